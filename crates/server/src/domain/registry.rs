//! Private-registry credentials (`/v1/images/registries`): what a registry
//! name may be and how it is normalised, the limits of each field, and the
//! public view of a kept credential (never its secret). The secret itself is
//! sealed with the egress secrets' [`Sealer`](crate::domain::secret::Sealer).

use serde_json::{json, Map, Value};

use crate::domain::time::iso;

/// At most this many registries per key.
pub(crate) const MAX_REGISTRIES: usize = 32;
/// A user name is 1 to this many bytes.
pub(crate) const MAX_USERNAME: usize = 256;
/// A password or token is 1 to this many bytes (a Google service account's
/// JSON key is about 2.3 KiB).
pub(crate) const MAX_PASSWORD: usize = 16 << 10;
/// An ECR secret access key is 1 to this many bytes (AWS's are 40).
pub(crate) const MAX_SECRET_ACCESS_KEY: usize = 128;

/// Docker Hub's one name; the others it is known by map to it.
pub(crate) const DOCKER_HUB: &str = "docker.io";
const DOCKER_HUB_ALIASES: &[&str] = &["docker.io", "index.docker.io", "registry-1.docker.io"];

/// What kind of credential a registry has.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// A user name and a password or token (HTTP basic, or a bearer token
    /// fetched with them).
    Password,
    /// An Amazon ECR access key (id and secret).
    Ecr,
}

impl Kind {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Kind::Password => "password",
            Kind::Ecr => "ecr",
        }
    }

    pub(crate) fn parse(s: &str) -> Option<Kind> {
        match s {
            "password" => Some(Kind::Password),
            "ecr" => Some(Kind::Ecr),
            _ => None,
        }
    }
}

/// A kept credential, its secret still sealed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Registry {
    pub(crate) key_id: String,
    /// Normalised ([`normalize`]).
    pub(crate) registry: String,
    pub(crate) kind: Kind,
    /// The user name, or the ECR access key id.
    pub(crate) username: String,
    /// The secret sealed under [`seal_name`].
    pub(crate) sealed: String,
    pub(crate) secret_bytes: usize,
    pub(crate) created_ms: i64,
    pub(crate) updated_ms: i64,
}

/// The name a secret is sealed under: it opens only in its own key's row
/// for its own registry, so a row copied elsewhere in the store opens to
/// nothing.
pub(crate) fn seal_name(key_id: &str, registry: &str) -> String {
    format!("registry\n{key_id}\n{registry}")
}

/// `registry` as kept: lower case, without a scheme or the `/v1/`, `/v2/`
/// of a Docker config's keys, Docker Hub's names as `docker.io`. `None`
/// for anything but a host name or IPv4 address with an optional port.
pub(crate) fn normalize(registry: &str) -> Option<String> {
    let r = registry.trim().to_ascii_lowercase();
    let r = r
        .strip_prefix("https://")
        .or_else(|| r.strip_prefix("http://"))
        .unwrap_or(&r);
    let (r, path) = r.split_once('/').unwrap_or((r, ""));
    if !matches!(path, "" | "v1" | "v1/" | "v2" | "v2/") {
        return None;
    }
    let (host, port) = match r.rsplit_once(':') {
        Some((h, p)) => (h, Some(p)),
        None => (r, None),
    };
    if let Some(p) = port {
        if p.is_empty()
            || p.len() > 5
            || !p.bytes().all(|b| b.is_ascii_digit())
            || !(1..=65535).contains(&p.parse::<u32>().ok()?)
            || p.starts_with('0')
        {
            return None;
        }
    }
    if !valid_host(host) {
        return None;
    }
    if port.is_none() && DOCKER_HUB_ALIASES.contains(&host) {
        return Some(DOCKER_HUB.to_string());
    }
    Some(r.to_string())
}

/// A lower-case DNS name (labels of `[a-z0-9-]`, not starting or ending
/// with `-`) or a dotted IPv4 address.
fn valid_host(h: &str) -> bool {
    (1..=253).contains(&h.len())
        && h.split('.').all(|l| {
            (1..=63).contains(&l.len())
                && l.bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
                && !l.starts_with('-')
                && !l.ends_with('-')
        })
}

/// An Amazon ECR registry: `<account>.dkr.ecr.<region>.amazonaws.com`
/// (or `.amazonaws.com.cn`).
pub(crate) fn is_ecr(registry: &str) -> bool {
    let host = registry.split(':').next().unwrap_or(registry);
    let labels: Vec<&str> = host.split('.').collect();
    labels.len() >= 6
        && labels[0].len() == 12
        && labels[0].bytes().all(|b| b.is_ascii_digit())
        && labels[1] == "dkr"
        && labels[2] == "ecr"
        && (host.ends_with(".amazonaws.com") || host.ends_with(".amazonaws.com.cn"))
}

/// A user name: 1 to 256 bytes, visible characters, no `:` (HTTP basic
/// authentication ends the name at the first).
pub(crate) fn username_problem(u: &str) -> Option<&'static str> {
    if u.is_empty() || u.len() > MAX_USERNAME {
        Some("must be 1 to 256 bytes")
    } else if u.contains(':') || u.chars().any(char::is_control) || u.trim() != u {
        Some("must not contain ':', control characters or surrounding spaces")
    } else {
        None
    }
}

/// A password or token: 1 to 16 KiB without NUL (a JSON key's line
/// breaks are kept).
pub(crate) fn password_problem(p: &str) -> Option<&'static str> {
    if p.is_empty() || p.len() > MAX_PASSWORD {
        Some("must be 1 to 16384 bytes")
    } else if p.contains('\0') {
        Some("must not contain NUL")
    } else {
        None
    }
}

/// An AWS access key id: 16 to 128 upper-case letters and digits.
pub(crate) fn access_key_id_problem(id: &str) -> Option<&'static str> {
    let ok = (16..=128).contains(&id.len())
        && id
            .bytes()
            .all(|b| b.is_ascii_uppercase() || b.is_ascii_digit());
    (!ok).then_some("must be an AWS access key id (16 to 128 of A-Z and 0-9)")
}

/// An AWS secret access key: 1 to 128 visible ASCII characters.
pub(crate) fn secret_access_key_problem(s: &str) -> Option<&'static str> {
    let ok = (1..=MAX_SECRET_ACCESS_KEY).contains(&s.len())
        && s.bytes().all(|b| (0x21..0x7f).contains(&b));
    (!ok).then_some("must be 1 to 128 visible ASCII characters")
}

/// The public view of a kept credential: never the secret.
pub(crate) fn view(r: &Registry) -> Value {
    let mut v = Map::new();
    v.insert("registry".into(), json!(r.registry));
    v.insert("kind".into(), json!(r.kind.as_str()));
    match r.kind {
        Kind::Password => v.insert("username".into(), json!(r.username)),
        Kind::Ecr => v.insert("accessKeyId".into(), json!(r.username)),
    };
    v.insert("createdAt".into(), json!(iso(r.created_ms)));
    v.insert("updatedAt".into(), json!(iso(r.updated_ms)));
    Value::Object(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn docker_hubs_names_are_one() {
        for n in [
            "docker.io",
            "Docker.IO",
            "index.docker.io",
            "registry-1.docker.io",
            "https://index.docker.io/v1/",
            "https://index.docker.io/v1",
            "https://registry-1.docker.io/v2/",
            " docker.io/ ",
        ] {
            assert_eq!(normalize(n).as_deref(), Some("docker.io"), "{n}");
        }
        // With a port it is another server.
        assert_eq!(
            normalize("docker.io:5000").as_deref(),
            Some("docker.io:5000")
        );
    }

    #[test]
    fn hosts_and_ports() {
        assert_eq!(normalize("GHCR.io").as_deref(), Some("ghcr.io"));
        assert_eq!(
            normalize("https://registry.example.com:5000/").as_deref(),
            Some("registry.example.com:5000")
        );
        assert_eq!(
            normalize("127.0.0.1:5000").as_deref(),
            Some("127.0.0.1:5000")
        );
        assert_eq!(normalize("localhost").as_deref(), Some("localhost"));
        for bad in [
            "",
            "ghcr.io/owner",
            "ghcr.io/owner/repo",
            "a b.com",
            "-a.com",
            "a..com",
            "ghcr.io:",
            "ghcr.io:0",
            "ghcr.io:65536",
            "ghcr.io:080",
            "ghcr.io:x",
            "[::1]:5000",
            "ftp://ghcr.io",
            "user@ghcr.io",
        ] {
            assert_eq!(normalize(bad), None, "{bad}");
        }
        assert_eq!(normalize(&format!("{}.com", "a".repeat(64))), None);
    }

    #[test]
    fn ecr_hosts() {
        assert!(is_ecr("123456789012.dkr.ecr.us-east-1.amazonaws.com"));
        assert!(is_ecr("123456789012.dkr.ecr.cn-north-1.amazonaws.com.cn"));
        assert!(!is_ecr("ghcr.io"));
        assert!(!is_ecr("12345.dkr.ecr.us-east-1.amazonaws.com"));
        assert!(!is_ecr("123456789012.dkr.ecr.us-east-1.example.com"));
    }

    #[test]
    fn fields() {
        assert_eq!(username_problem("me"), None);
        assert!(username_problem("").is_some());
        assert!(username_problem("a:b").is_some());
        assert!(username_problem(" me").is_some());
        assert!(username_problem(&"u".repeat(257)).is_some());
        assert_eq!(
            password_problem("{\n \"type\": \"service_account\"\n}"),
            None
        );
        assert!(password_problem("").is_some());
        assert!(password_problem("a\0b").is_some());
        assert!(password_problem(&"p".repeat(MAX_PASSWORD + 1)).is_some());
        assert_eq!(access_key_id_problem("AKIAIOSFODNN7EXAMPLE"), None);
        assert!(access_key_id_problem("akiaiosfodnn7example").is_some());
        assert!(access_key_id_problem("AKIA").is_some());
        assert_eq!(
            secret_access_key_problem("wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"),
            None
        );
        assert!(secret_access_key_problem("with space").is_some());
        assert!(secret_access_key_problem("").is_some());
    }

    #[test]
    fn the_view_never_shows_the_secret() {
        let mut r = Registry {
            key_id: "k1".into(),
            registry: "ghcr.io".into(),
            kind: Kind::Password,
            username: "me".into(),
            sealed: "SEALED".into(),
            secret_bytes: 6,
            created_ms: 0,
            updated_ms: 1000,
        };
        let v = view(&r);
        assert_eq!(
            v,
            json!({"registry": "ghcr.io", "kind": "password", "username": "me",
                   "createdAt": "1970-01-01T00:00:00.000Z", "updatedAt": "1970-01-01T00:00:01.000Z"})
        );
        r.kind = Kind::Ecr;
        r.username = "AKIAIOSFODNN7EXAMPLE".into();
        let v = view(&r);
        assert_eq!(v["accessKeyId"], "AKIAIOSFODNN7EXAMPLE");
        assert!(v.get("username").is_none());
        assert!(!v.to_string().contains("SEALED"));
        assert_eq!(Kind::parse(Kind::Ecr.as_str()), Some(Kind::Ecr));
        assert_eq!(Kind::parse("x"), None);
    }
}
