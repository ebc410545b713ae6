//! A small OCI distribution client: pulls an image's manifest, config and
//! layer blobs from a registry through this host's egress proxy, as the
//! build machine's network (its rules, the test mapping, byte counting),
//! so a pull reaches exactly what a build step could.
//!
//! Blobs are verified against their sha256 digests and kept by digest in
//! the cache (`<cache>/sha256/<hex>`, written to a partial file first); a
//! blob that does not match is refused by digest and not kept. Layers are
//! then decompressed (gzip, zstd or none, told by their first bytes) into
//! plain tar files by a stream transform; nothing here reads a tar: the
//! layers are unpacked inside a machine (the control plane's job).

mod auth;
mod client;
mod manifest;
mod reference;

use std::path::{Path, PathBuf};

use sha2::{Digest as _, Sha256};
use tokio::io::AsyncWriteExt;

pub use auth::{parse_challenge, Challenge};
pub use manifest::{pick_platform, Descriptor, ImageConfig, Platform, RunConfig};
pub use reference::{Reference, ReferenceError, DOCKER_HUB, DOCKER_HUB_API};

use client::{error_text, read_limited, Client};
use manifest::{AnyManifest, ACCEPT, DOCKER_LIST, OCI_INDEX};

use crate::types::Host;

/// Most bytes of a manifest, an index or a config.
const MAX_DOCUMENT: usize = 4 << 20;
/// Most layers an image may have.
pub const MAX_LAYERS: usize = 128;

/// Why a pull failed; the text is the build's error.
#[derive(Debug, thiserror::Error)]
pub enum PullError {
    #[error("{reference}: not found in the registry ({answer})")]
    NotFound { reference: String, answer: String },
    #[error("registry {registry} refused access ({answer}); give credentials for it with images.registries")]
    Denied { registry: String, answer: String },
    #[error("{reference}: the registry answered {answer}")]
    Registry { reference: String, answer: String },
    #[error("could not reach {host}: {answer}")]
    Connect { host: String, answer: String },
    #[error("fetching {url} failed: {cause}")]
    Transfer { url: String, cause: String },
    #[error("{url}: {problem}")]
    Protocol { url: String, problem: String },
    #[error("blob {digest} is corrupt ({problem}); it was not kept")]
    Corrupt { digest: String, problem: String },
    #[error("{what} is larger than the limit of {} MiB", limit >> 20)]
    TooBig { what: String, limit: u64 },
    #[error("{reference} has no linux/amd64 image (it has: {platforms})")]
    Platform {
        reference: String,
        platforms: String,
    },
    #[error("{reference}: unsupported manifest or layer type {media_type}")]
    Unsupported {
        reference: String,
        media_type: String,
    },
    #[error("layer {digest} could not be decompressed: {problem}")]
    Layer { digest: String, problem: String },
    #[error("{op}: {source}")]
    Io {
        op: &'static str,
        #[source]
        source: std::io::Error,
    },
}

fn io(op: &'static str) -> impl FnOnce(std::io::Error) -> PullError {
    move |source| PullError::Io { op, source }
}

/// How a pull runs (the operator's settings and the limits).
#[derive(Debug, Clone)]
pub struct PullOptions {
    /// The blob cache: `<dir>/sha256/<hex>`.
    pub cache_dir: PathBuf,
    /// Registries (as references name them, `docker.io`) and the mirror
    /// (`host[:port]`) tried before each.
    pub mirrors: Vec<(String, String)>,
    /// Registries (or mirrors) spoken to in plain HTTP.
    pub insecure: Vec<String>,
    /// Most bytes of one compressed layer, and of one decompressed.
    pub max_layer_bytes: u64,
    /// Most bytes of all of an image's layers, compressed.
    pub max_image_bytes: u64,
}

/// One layer as kept in the cache.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PulledLayer {
    pub digest: String,
    pub size: u64,
    pub path: PathBuf,
}

/// An image as pulled.
#[derive(Debug, Clone)]
pub struct Pulled {
    /// The digest of the linux/amd64 manifest (not of an index).
    pub manifest_digest: String,
    /// Where it came from (the registry, or its mirror).
    pub source: String,
    pub config: RunConfig,
    pub layers: Vec<PulledLayer>,
}

/// Where a blob is kept.
pub fn blob_path(cache_dir: &Path, digest: &str) -> Option<PathBuf> {
    let hex = digest.strip_prefix("sha256:")?;
    (hex.len() == 64 && hex.bytes().all(|c| c.is_ascii_hexdigit()))
        .then(|| cache_dir.join("sha256").join(hex))
}

fn scheme_for(opts: &PullOptions, authority: &str) -> &'static str {
    if opts.insecure.iter().any(|i| i == authority) {
        "http"
    } else {
        "https"
    }
}

/// Pulls `r`'s manifest (linux/amd64 of an index), config and layers into
/// the cache, through network `net`'s egress. `progress` gets one line per
/// event (the build log).
pub async fn pull(
    host: &dyn Host,
    net: &str,
    r: &Reference,
    credentials: Option<(String, String)>,
    opts: &PullOptions,
    progress: &(dyn Fn(String) + Send + Sync),
) -> Result<Pulled, PullError> {
    let api = if r.registry == DOCKER_HUB {
        DOCKER_HUB_API.to_string()
    } else {
        r.registry.clone()
    };
    // A mirror first (as Docker does for Docker Hub), then the registry.
    if let Some((_, mirror)) = opts.mirrors.iter().find(|(reg, _)| *reg == r.registry) {
        let c = Client::new(host, net, scheme_for(opts, mirror), mirror.clone(), None);
        match pull_from(c, r, opts, progress).await {
            Ok(p) => return Ok(p),
            Err(e @ PullError::Corrupt { .. }) | Err(e @ PullError::TooBig { .. }) => {
                return Err(e)
            }
            Err(e) => progress(format!("mirror {mirror}: {e}; pulling from {}", r.registry)),
        }
    }
    let c = Client::new(host, net, scheme_for(opts, &r.registry), api, credentials);
    pull_from(c, r, opts, progress).await
}

async fn pull_from(
    mut c: Client<'_>,
    r: &Reference,
    opts: &PullOptions,
    progress: &(dyn Fn(String) + Send + Sync),
) -> Result<Pulled, PullError> {
    let canonical = r.canonical();
    let source = c.authority.clone();
    let (body, digest) = document(&mut c, r, r.manifest_ref(), &canonical).await?;
    let mut m: AnyManifest = serde_json::from_slice(&body).map_err(|e| PullError::Protocol {
        url: canonical.clone(),
        problem: format!("the manifest is not JSON: {e}"),
    })?;
    let mut digest = digest;
    let is_index = |m: &AnyManifest| {
        matches!(m.media_type.as_deref(), Some(OCI_INDEX) | Some(DOCKER_LIST))
            || (m.media_type.is_none() && m.manifests.is_some())
    };
    if is_index(&m) {
        let list = m.manifests.clone().unwrap_or_default();
        let chosen = pick_platform(&list).map_err(|p| PullError::Platform {
            reference: canonical.clone(),
            platforms: if p.is_empty() {
                "no platforms".into()
            } else {
                p.join(", ")
            },
        })?;
        progress(format!("{canonical}: linux/amd64 is {}", chosen.digest));
        let (body, d) = document(&mut c, r, &chosen.digest, &canonical).await?;
        m = serde_json::from_slice(&body).map_err(|e| PullError::Protocol {
            url: canonical.clone(),
            problem: format!("the manifest is not JSON: {e}"),
        })?;
        digest = d;
        if is_index(&m) {
            return Err(PullError::Unsupported {
                reference: canonical,
                media_type: "an index inside an index".into(),
            });
        }
    }
    if m.schema_version == Some(1) {
        return Err(PullError::Unsupported {
            reference: canonical,
            media_type: "Docker schema 1 manifest".into(),
        });
    }
    let (config, layers) = match (m.config, m.layers) {
        (Some(c), Some(l)) => (c, l),
        _ => {
            return Err(PullError::Unsupported {
                reference: canonical,
                media_type: m.media_type.unwrap_or_else(|| "an unknown manifest".into()),
            })
        }
    };
    if layers.len() > MAX_LAYERS {
        return Err(PullError::TooBig {
            what: format!(
                "{canonical} ({} layers, at most {MAX_LAYERS})",
                layers.len()
            ),
            limit: opts.max_image_bytes,
        });
    }
    let total: u64 = layers.iter().map(|l| l.size).sum();
    if total > opts.max_image_bytes {
        return Err(PullError::TooBig {
            what: format!("{canonical} ({} MiB of layers)", total >> 20),
            limit: opts.max_image_bytes,
        });
    }
    for l in &layers {
        if l.media_type.contains("nondistributable") || l.media_type.contains("foreign") {
            return Err(PullError::Unsupported {
                reference: canonical,
                media_type: l.media_type.clone(),
            });
        }
    }
    progress(format!(
        "{canonical}: manifest {digest}, {} layers, {:.1} MiB",
        layers.len(),
        total as f64 / 1048576.0
    ));
    let cfg_path = blob(&mut c, r, &config, opts, MAX_DOCUMENT as u64).await?;
    let cfg_bytes = tokio::fs::read(&cfg_path.0)
        .await
        .map_err(io("reading an image config"))?;
    let cfg: ImageConfig = serde_json::from_slice(&cfg_bytes).map_err(|e| PullError::Protocol {
        url: config.digest.clone(),
        problem: format!("the image config is not JSON: {e}"),
    })?;
    if let (Some(os), Some(arch)) = (&cfg.os, &cfg.architecture) {
        if os != "linux" || arch != manifest::ARCH {
            return Err(PullError::Platform {
                reference: canonical,
                platforms: format!("{os}/{arch}"),
            });
        }
    }
    let mut pulled = Vec::new();
    for (i, l) in layers.iter().enumerate() {
        let (path, cached) = blob(&mut c, r, l, opts, opts.max_layer_bytes).await?;
        progress(format!(
            "layer {}/{} {} {:.1} MiB{}",
            i + 1,
            layers.len(),
            short(&l.digest),
            l.size as f64 / 1048576.0,
            if cached { " (cached)" } else { " pulled" }
        ));
        pulled.push(PulledLayer {
            digest: l.digest.clone(),
            size: l.size,
            path,
        });
    }
    Ok(Pulled {
        manifest_digest: digest,
        source,
        config: cfg.config.unwrap_or_default(),
        layers: pulled,
    })
}

/// `sha256:0123456789ab`.
pub fn short(digest: &str) -> &str {
    digest.get(..19).unwrap_or(digest)
}

fn sha256_digest(b: &[u8]) -> String {
    format!("sha256:{}", hex::encode(Sha256::digest(b)))
}

/// A manifest or index by tag or digest: its body and its digest (checked
/// when asked for by digest).
async fn document(
    c: &mut Client<'_>,
    r: &Reference,
    reference: &str,
    canonical: &str,
) -> Result<(Vec<u8>, String), PullError> {
    let url = c.url(&format!("/v2/{}/manifests/{reference}", r.repository))?;
    let resp = c.get(url.clone(), Some(ACCEPT)).await?;
    let status = resp.status();
    if !status.is_success() {
        let body = client::read_small(resp, &url).await.unwrap_or_default();
        let answer = format!("{} {}", status.as_u16(), error_text(&body));
        return Err(match status.as_u16() {
            404 => PullError::NotFound {
                reference: canonical.to_string(),
                answer,
            },
            401 | 403 => PullError::Denied {
                registry: r.registry.clone(),
                answer,
            },
            _ => PullError::Registry {
                reference: canonical.to_string(),
                answer,
            },
        });
    }
    let body = read_limited(resp, &url, MAX_DOCUMENT).await?;
    let digest = sha256_digest(&body);
    if reference.starts_with("sha256:") && digest != reference {
        return Err(PullError::Corrupt {
            digest: reference.to_string(),
            problem: format!("its content hashes to {digest}"),
        });
    }
    Ok((body, digest))
}

/// A blob in the cache (fetched and verified when missing); `true` when it
/// was there already.
async fn blob(
    c: &mut Client<'_>,
    r: &Reference,
    d: &Descriptor,
    opts: &PullOptions,
    limit: u64,
) -> Result<(PathBuf, bool), PullError> {
    let path = blob_path(&opts.cache_dir, &d.digest).ok_or_else(|| PullError::Unsupported {
        reference: r.canonical(),
        media_type: format!("digest {}", d.digest.chars().take(80).collect::<String>()),
    })?;
    if path.is_file() {
        return Ok((path, true));
    }
    if d.size > limit {
        return Err(PullError::TooBig {
            what: format!("blob {}", d.digest),
            limit,
        });
    }
    let dir = opts.cache_dir.join("sha256");
    tokio::fs::create_dir_all(&dir)
        .await
        .map_err(io("making the blob cache"))?;
    let url = c.url(&format!("/v2/{}/blobs/{}", r.repository, d.digest))?;
    let resp = c.get(url.clone(), None).await?;
    let status = resp.status();
    if !status.is_success() {
        let body = client::read_small(resp, &url).await.unwrap_or_default();
        let answer = format!("{} {}", status.as_u16(), error_text(&body));
        return Err(match status.as_u16() {
            404 => PullError::NotFound {
                reference: format!("{} blob {}", r.canonical(), d.digest),
                answer,
            },
            401 | 403 => PullError::Denied {
                registry: r.registry.clone(),
                answer,
            },
            _ => PullError::Registry {
                reference: r.canonical(),
                answer,
            },
        });
    }
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or_default();
    let partial = path.with_extension(format!("partial-{}-{nanos}", std::process::id()));
    let result = fetch_to(resp, &url, &partial, d).await;
    match result {
        Ok(()) => {
            tokio::fs::rename(&partial, &path)
                .await
                .map_err(io("keeping a blob"))?;
            Ok((path, false))
        }
        Err(e) => {
            let _ = tokio::fs::remove_file(&partial).await;
            Err(e)
        }
    }
}

/// Writes the body to `partial`, at most `d.size` bytes, and checks its
/// digest.
async fn fetch_to(
    resp: hyper::Response<hyper::body::Incoming>,
    url: &http::Uri,
    partial: &Path,
    d: &Descriptor,
) -> Result<(), PullError> {
    use http_body_util::BodyExt as _;
    let mut f = tokio::fs::File::create(partial)
        .await
        .map_err(io("writing a blob"))?;
    let mut hash = Sha256::new();
    let mut n: u64 = 0;
    let mut body = resp.into_body();
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| PullError::Transfer {
            url: url.to_string(),
            cause: e.to_string(),
        })?;
        if let Some(data) = frame.data_ref() {
            n += data.len() as u64;
            if n > d.size {
                return Err(PullError::Corrupt {
                    digest: d.digest.clone(),
                    problem: format!("more than the {} bytes its manifest gives", d.size),
                });
            }
            hash.update(data);
            f.write_all(data).await.map_err(io("writing a blob"))?;
        }
    }
    f.flush().await.map_err(io("writing a blob"))?;
    f.sync_all().await.map_err(io("writing a blob"))?;
    let got = format!("sha256:{}", hex::encode(hash.finalize()));
    if got != d.digest {
        return Err(PullError::Corrupt {
            digest: d.digest.clone(),
            problem: format!("its {n} bytes hash to {got}"),
        });
    }
    if n != d.size {
        return Err(PullError::Corrupt {
            digest: d.digest.clone(),
            problem: format!("{n} bytes, its manifest gives {}", d.size),
        });
    }
    Ok(())
}

/// How a layer blob is compressed, from its first bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compression {
    Gzip,
    Zstd,
    None,
}

impl Compression {
    pub fn sniff(head: &[u8]) -> Compression {
        if head.starts_with(&[0x1f, 0x8b]) {
            Compression::Gzip
        } else if head.starts_with(&[0x28, 0xb5, 0x2f, 0xfd]) {
            Compression::Zstd
        } else {
            Compression::None
        }
    }
}

/// Decompresses layer `l` into the plain tar file `out`, at most `max`
/// bytes (gzip and zstd by the host's `gzip` and `zstd`, a pure stream
/// transform); returns its size.
pub async fn decompress(l: &PulledLayer, out: &Path, max: u64) -> Result<u64, PullError> {
    use tokio::io::AsyncReadExt as _;
    let layer_err = |problem: String| PullError::Layer {
        digest: l.digest.clone(),
        problem,
    };
    let mut head = [0u8; 4];
    let n = {
        let mut f = tokio::fs::File::open(&l.path)
            .await
            .map_err(io("reading a layer"))?;
        f.read(&mut head).await.map_err(io("reading a layer"))?
    };
    let tool = match Compression::sniff(&head[..n]) {
        Compression::Gzip => Some(("gzip", vec!["-dc"])),
        Compression::Zstd => Some(("zstd", vec!["-dcq", "--no-progress"])),
        Compression::None => None,
    };
    let mut dst = tokio::fs::File::create(out)
        .await
        .map_err(io("writing a layer"))?;
    let mut written: u64 = 0;
    let too_big = || PullError::TooBig {
        what: format!("layer {} decompressed", l.digest),
        limit: max,
    };
    let mut buf = vec![0u8; 256 * 1024];
    match tool {
        None => {
            let mut src = tokio::fs::File::open(&l.path)
                .await
                .map_err(io("reading a layer"))?;
            loop {
                let k = src.read(&mut buf).await.map_err(io("reading a layer"))?;
                if k == 0 {
                    break;
                }
                written += k as u64;
                if written > max {
                    return Err(too_big());
                }
                dst.write_all(&buf[..k])
                    .await
                    .map_err(io("writing a layer"))?;
            }
        }
        Some((prog, args)) => {
            let src = std::fs::File::open(&l.path).map_err(io("reading a layer"))?;
            let mut child = tokio::process::Command::new(prog)
                .args(&args)
                .stdin(std::process::Stdio::from(src))
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .env("PATH", "/usr/sbin:/sbin:/usr/bin:/bin")
                .kill_on_drop(true)
                .spawn()
                .map_err(|e| layer_err(format!("{prog}: {e}")))?;
            let mut stdout = child
                .stdout
                .take()
                .ok_or_else(|| layer_err(format!("{prog} has no output")))?;
            loop {
                let k = stdout
                    .read(&mut buf)
                    .await
                    .map_err(|e| layer_err(format!("{prog}: {e}")))?;
                if k == 0 {
                    break;
                }
                written += k as u64;
                if written > max {
                    let _ = child.kill().await;
                    return Err(too_big());
                }
                dst.write_all(&buf[..k])
                    .await
                    .map_err(io("writing a layer"))?;
            }
            let out = child
                .wait_with_output()
                .await
                .map_err(|e| layer_err(format!("{prog}: {e}")))?;
            if !out.status.success() {
                return Err(layer_err(format!(
                    "{prog}: {} {}",
                    out.status,
                    String::from_utf8_lossy(&out.stderr)
                        .chars()
                        .take(300)
                        .collect::<String>()
                        .trim()
                )));
            }
        }
    }
    dst.flush().await.map_err(io("writing a layer"))?;
    Ok(written)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    #[test]
    fn compression_is_told_by_the_first_bytes() {
        assert_eq!(Compression::sniff(&[0x1f, 0x8b, 8, 0]), Compression::Gzip);
        assert_eq!(
            Compression::sniff(&[0x28, 0xb5, 0x2f, 0xfd]),
            Compression::Zstd
        );
        assert_eq!(Compression::sniff(b"usr/"), Compression::None);
        assert_eq!(Compression::sniff(&[]), Compression::None);
    }

    #[test]
    fn blobs_are_kept_by_their_digest_only() {
        let d = Path::new("/c");
        let hex = "a".repeat(64);
        assert_eq!(
            blob_path(d, &format!("sha256:{hex}")),
            Some(PathBuf::from(format!("/c/sha256/{hex}")))
        );
        assert_eq!(blob_path(d, "sha256:../../etc/passwd"), None);
        assert_eq!(blob_path(d, &format!("sha512:{hex}")), None);
    }

    #[tokio::test]
    async fn layers_decompress_within_their_limit() {
        let dir = std::env::temp_dir().join(format!("oci-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let plain = dir.join("plain");
        std::fs::write(&plain, vec![b'x'; 10000]).unwrap();
        let gz = dir.join("plain.gz");
        let st = std::process::Command::new("gzip")
            .args(["-kf"])
            .arg(&plain)
            .status()
            .unwrap();
        assert!(st.success());
        let layer = |p: &Path| PulledLayer {
            digest: "sha256:x".into(),
            size: 0,
            path: p.to_path_buf(),
        };
        let out = dir.join("out.tar");
        assert_eq!(decompress(&layer(&gz), &out, 1 << 20).await.unwrap(), 10000);
        assert_eq!(std::fs::read(&out).unwrap(), vec![b'x'; 10000]);
        assert_eq!(
            decompress(&layer(&plain), &out, 1 << 20).await.unwrap(),
            10000
        );
        let e = decompress(&layer(&gz), &out, 100).await.unwrap_err();
        assert!(matches!(e, PullError::TooBig { .. }), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
