//! Manifests, indexes and image configs (OCI image spec and Docker's v2
//! schema 2), read with serde, and the platform an index gives us.

use serde::Deserialize;

pub(super) const OCI_INDEX: &str = "application/vnd.oci.image.index.v1+json";
pub(super) const DOCKER_LIST: &str = "application/vnd.docker.distribution.manifest.list.v2+json";

/// The `Accept` of a manifest request: every kind we read.
pub(super) const ACCEPT: &str = "application/vnd.oci.image.index.v1+json, application/vnd.docker.distribution.manifest.list.v2+json, application/vnd.oci.image.manifest.v1+json, application/vnd.docker.distribution.manifest.v2+json";

/// A blob a manifest names.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Descriptor {
    #[serde(default)]
    pub media_type: String,
    pub digest: String,
    pub size: u64,
    #[serde(default)]
    pub platform: Option<Platform>,
}

#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct Platform {
    #[serde(default)]
    pub architecture: String,
    #[serde(default)]
    pub os: String,
    #[serde(default)]
    pub variant: Option<String>,
}

/// A manifest or an index, told apart by its media type (or, when the
/// body has none, by having `manifests` or `layers`).
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(super) struct AnyManifest {
    #[serde(default)]
    pub(super) schema_version: Option<u32>,
    #[serde(default)]
    pub(super) media_type: Option<String>,
    #[serde(default)]
    pub(super) manifests: Option<Vec<Descriptor>>,
    #[serde(default)]
    pub(super) config: Option<Descriptor>,
    #[serde(default)]
    pub(super) layers: Option<Vec<Descriptor>>,
}

/// The architecture we run (amd64 guests).
pub(super) const ARCH: &str = "amd64";

/// The `linux/amd64` manifest of an index (without a variant, or `v1`
/// before others); `Err` lists the platforms it has.
pub fn pick_platform(manifests: &[Descriptor]) -> Result<&Descriptor, Vec<String>> {
    let linux_amd64 = |d: &&Descriptor| {
        d.platform
            .as_ref()
            .is_some_and(|p| p.os == "linux" && p.architecture == ARCH)
    };
    let plain = manifests.iter().filter(linux_amd64).find(|d| {
        d.platform
            .as_ref()
            .is_some_and(|p| p.variant.as_deref().is_none_or(|v| v == "v1"))
    });
    if let Some(d) = plain.or_else(|| manifests.iter().find(linux_amd64)) {
        return Ok(d);
    }
    Err(manifests
        .iter()
        .filter_map(|d| d.platform.as_ref())
        .map(|p| match &p.variant {
            Some(v) => format!("{}/{}/{v}", p.os, p.architecture),
            None => format!("{}/{}", p.os, p.architecture),
        })
        .collect())
}

/// The parts of an image config that become the image's.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "PascalCase")]
pub struct RunConfig {
    #[serde(default)]
    pub env: Option<Vec<String>>,
    #[serde(default)]
    pub working_dir: Option<String>,
    #[serde(default)]
    pub user: Option<String>,
    #[serde(default)]
    pub cmd: Option<Vec<String>>,
    #[serde(default)]
    pub entrypoint: Option<Vec<String>>,
}

#[derive(Debug, Clone, Default, Deserialize)]
pub struct ImageConfig {
    #[serde(default)]
    pub architecture: Option<String>,
    #[serde(default)]
    pub os: Option<String>,
    #[serde(default)]
    pub config: Option<RunConfig>,
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    fn index(platforms: &[(&str, &str, Option<&str>)]) -> Vec<Descriptor> {
        platforms
            .iter()
            .enumerate()
            .map(|(i, (os, arch, v))| Descriptor {
                media_type: "application/vnd.oci.image.manifest.v1+json".into(),
                digest: format!("sha256:{i}"),
                size: 1,
                platform: Some(Platform {
                    architecture: arch.to_string(),
                    os: os.to_string(),
                    variant: v.map(str::to_string),
                }),
            })
            .collect()
    }

    #[test]
    fn an_index_gives_its_linux_amd64_manifest() {
        let m = index(&[
            ("linux", "arm64", Some("v8")),
            ("unknown", "unknown", None),
            ("linux", "amd64", None),
            ("windows", "amd64", None),
        ]);
        assert_eq!(pick_platform(&m).unwrap().digest, "sha256:2");
        // A plain amd64 (or v1) before a newer micro-architecture level.
        let m = index(&[
            ("linux", "amd64", Some("v3")),
            ("linux", "amd64", Some("v1")),
        ]);
        assert_eq!(pick_platform(&m).unwrap().digest, "sha256:1");
        let m = index(&[("linux", "amd64", Some("v3"))]);
        assert_eq!(pick_platform(&m).unwrap().digest, "sha256:0");
        let m = index(&[("linux", "arm64", Some("v8")), ("windows", "amd64", None)]);
        assert_eq!(
            pick_platform(&m).unwrap_err(),
            vec!["linux/arm64/v8".to_string(), "windows/amd64".to_string()]
        );
    }

    #[test]
    fn configs_read_what_the_image_runs_with() {
        let c: ImageConfig = serde_json::from_str(
            r#"{"architecture":"amd64","os":"linux","config":{"Env":["PATH=/usr/bin","A=b=c"],
            "WorkingDir":"/app","User":"1000:1000","Cmd":["python3"],"Entrypoint":null,"Labels":{"x":"y"}},
            "rootfs":{"type":"layers","diff_ids":[]}}"#,
        )
        .unwrap();
        let r = c.config.unwrap();
        assert_eq!(r.env.unwrap(), ["PATH=/usr/bin", "A=b=c"]);
        assert_eq!(r.working_dir.as_deref(), Some("/app"));
        assert_eq!(r.user.as_deref(), Some("1000:1000"));
        assert_eq!(r.cmd.unwrap(), ["python3"]);
        assert_eq!(r.entrypoint, None);
    }
}
