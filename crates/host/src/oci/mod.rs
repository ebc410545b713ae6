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
mod ecr;
mod manifest;
mod reference;

use std::path::{Path, PathBuf};

use sha2::{Digest as _, Sha256};
use tokio::io::AsyncWriteExt;

pub use auth::{parse_challenge, Challenge};
pub use manifest::{pick_platform, Descriptor, ImageConfig, Platform, RunConfig};
pub use reference::{Reference, ReferenceError, DOCKER_HUB, DOCKER_HUB_API};

pub use client::Connector;
use client::{error_text, read_limited, Client};
pub use ecr::{ecr_login, ecr_region};
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

/// What a pull authenticates with: a user name and password (or token),
/// or an Amazon ECR access key, exchanged for a password ([`ecr_login`],
/// kept while it lasts). Its `Debug` shows no secret.
#[derive(Clone, PartialEq, Eq)]
pub enum Credentials {
    Basic {
        username: String,
        password: String,
    },
    Ecr {
        access_key_id: String,
        secret_access_key: String,
    },
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Credentials::Basic { username, .. } => write!(f, "Basic({username}, <secret>)"),
            Credentials::Ecr { access_key_id, .. } => write!(f, "Ecr({access_key_id}, <secret>)"),
        }
    }
}

impl Credentials {
    /// The user name and password for the registry's Basic or token
    /// challenge: an ECR key asks ECR for them first.
    async fn resolve(
        self,
        connect: &Connector<'_>,
        registry: &str,
        progress: &(dyn Fn(String) + Send + Sync),
    ) -> Result<(String, String), PullError> {
        match self {
            Credentials::Basic { username, password } => Ok((username, password)),
            Credentials::Ecr {
                access_key_id,
                secret_access_key,
            } => {
                let now = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_secs());
                let key = ecr::kept_key(registry, &access_key_id, &secret_access_key);
                if let Some(pair) = ecr::kept(&key, now) {
                    progress(format!(
                        "{registry}: signed in with access key {access_key_id} (ECR token kept from an earlier pull)"
                    ));
                    return Ok(pair);
                }
                let pair =
                    ecr_login(connect, registry, &access_key_id, &secret_access_key, now).await?;
                progress(format!(
                    "{registry}: signed in with access key {access_key_id} (ECR token)"
                ));
                Ok(pair)
            }
        }
    }
}

/// Pulls `r`'s manifest (linux/amd64 of an index), config and layers into
/// the cache, through network `net`'s egress. `progress` gets one line per
/// event (the build log).
pub async fn pull(
    host: &dyn Host,
    net: &str,
    r: &Reference,
    credentials: Option<Credentials>,
    opts: &PullOptions,
    progress: &(dyn Fn(String) + Send + Sync),
) -> Result<Pulled, PullError> {
    let connect = move || host.egress_connection(net);
    pull_through(&connect, r, credentials, opts, progress).await
}

/// [`pull`] through any way into the egress proxy.
pub async fn pull_through(
    connect: &Connector<'_>,
    r: &Reference,
    credentials: Option<Credentials>,
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
        let c = Client::new(connect, scheme_for(opts, mirror), mirror.clone(), None);
        match pull_from(c, r, opts, progress).await {
            Ok(p) => return Ok(p),
            Err(e @ PullError::Corrupt { .. }) | Err(e @ PullError::TooBig { .. }) => {
                return Err(e)
            }
            Err(e) => progress(format!("mirror {mirror}: {e}; pulling from {}", r.registry)),
        }
    }
    // A kept ECR token the registry refuses is not used again.
    let kept = match &credentials {
        Some(Credentials::Ecr {
            access_key_id,
            secret_access_key,
        }) => Some(ecr::kept_key(&r.registry, access_key_id, secret_access_key)),
        _ => None,
    };
    let credentials = match credentials {
        Some(c) => Some(c.resolve(connect, &r.registry, progress).await?),
        None => None,
    };
    let c = Client::new(connect, scheme_for(opts, &r.registry), api, credentials);
    let pulled = pull_from(c, r, opts, progress).await;
    if let (Err(PullError::Denied { .. }), Some(key)) = (&pulled, kept) {
        ecr::forget(&key);
    }
    pulled
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
        return Err(refusal(
            status.as_u16(),
            &r.registry,
            canonical.to_string(),
            canonical.to_string(),
            answer,
        ));
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
        return Err(refusal(
            status.as_u16(),
            &r.registry,
            format!("{} blob {}", r.canonical(), d.digest),
            r.canonical(),
            answer,
        ));
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

/// A registry's refusal (`status`, its `answer`) as an error: a 404 names
/// what was asked for (`missing`), a 401 or 403 the registry, anything
/// else the image's `reference`.
fn refusal(
    status: u16,
    registry: &str,
    missing: String,
    reference: String,
    answer: String,
) -> PullError {
    match status {
        404 => PullError::NotFound {
            reference: missing,
            answer,
        },
        401 | 403 => PullError::Denied {
            registry: registry.to_string(),
            answer,
        },
        _ => PullError::Registry { reference, answer },
    }
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

    use std::sync::{Arc, Mutex};

    use tokio::io::AsyncReadExt as _;

    use crate::types::EgressConnection;

    /// (status, headers, body) for a request's target and Authorization.
    type Answer = (u16, Vec<(String, String)>, Vec<u8>);
    type Route = dyn Fn(&str, Option<&str>) -> Answer + Send + Sync;

    /// A connector whose every connection is answered by `route`, as the
    /// egress proxy forwarding plain-HTTP requests would (absolute URIs).
    fn fake(route: Arc<Route>) -> impl Fn() -> Result<EgressConnection, crate::HostError> {
        move || {
            let (ours, mut theirs) = tokio::io::duplex(1 << 20);
            let route = Arc::clone(&route);
            tokio::spawn(async move {
                let mut head = Vec::new();
                let mut b = [0u8; 1];
                while !head.ends_with(b"\r\n\r\n") {
                    if theirs.read(&mut b).await.unwrap_or(0) == 0 {
                        return;
                    }
                    head.push(b[0]);
                }
                let text = String::from_utf8_lossy(&head).to_string();
                let target = text.split_whitespace().nth(1).unwrap_or("").to_string();
                let auth = text.lines().find_map(|l| {
                    let (k, v) = l.split_once(": ")?;
                    k.eq_ignore_ascii_case("authorization")
                        .then(|| v.to_string())
                });
                let (status, headers, body) = route(&target, auth.as_deref());
                let mut out = format!(
                    "HTTP/1.1 {status} X\r\ncontent-length: {}\r\nconnection: close\r\n",
                    body.len()
                );
                for (k, v) in headers {
                    out.push_str(&format!("{k}: {v}\r\n"));
                }
                out.push_str("\r\n");
                let _ = theirs.write_all(out.as_bytes()).await;
                let _ = theirs.write_all(&body).await;
                let _ = theirs.shutdown().await;
            });
            Ok(EgressConnection {
                stream: ours,
                tls: None,
            })
        }
    }

    fn opts(dir: &Path) -> PullOptions {
        PullOptions {
            cache_dir: dir.to_path_buf(),
            mirrors: Vec::new(),
            insecure: vec!["reg.example.com".into()],
            max_layer_bytes: 1 << 20,
            max_image_bytes: 1 << 20,
        }
    }

    #[tokio::test]
    async fn a_pull_answers_the_token_challenge_and_follows_redirects_without_credentials() {
        let dir = std::env::temp_dir().join(format!("oci-pull-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let config =
            br#"{"architecture":"amd64","os":"linux","config":{"Env":["A=1"],"Cmd":["sh"]}}"#
                .to_vec();
        let layer = b"layer bytes".to_vec();
        let (cd, ld) = (sha256_digest(&config), sha256_digest(&layer));
        let basic_seen = format!(
            "Basic {}",
            base64::Engine::encode(&base64::engine::general_purpose::STANDARD, "u:p")
        );
        let manifest = serde_json::to_vec(&serde_json::json!({
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": cd, "size": config.len()},
            "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", "digest": ld, "size": layer.len()}],
        }))
        .unwrap();
        let md = sha256_digest(&manifest);
        let basic = format!(
            "Basic {}",
            base64::Engine::encode(&base64::engine::general_purpose::STANDARD, "u:p")
        );
        let seen: Arc<Mutex<Vec<String>>> = Arc::default();
        let log = Arc::clone(&seen);
        let route: Arc<Route> = Arc::new(move |target: &str, auth: Option<&str>| {
            log.lock()
                .unwrap()
                .push(format!("{target} {}", auth.unwrap_or("-")));
            let bearer = auth == Some("Bearer tok");
            let challenge = vec![(
                "www-authenticate".to_string(),
                r#"Bearer realm="http://auth.example.com/token",service="reg",scope="repository:x:pull""#
                    .to_string(),
            )];
            match target {
                "http://auth.example.com/token?service=reg&scope=repository%3Ax%3Apull"
                    if auth == Some(basic.as_str()) =>
                {
                    (200, vec![], br#"{"token":"tok"}"#.to_vec())
                }
                "http://reg.example.com/v2/x/manifests/1" if bearer => {
                    (200, vec![], manifest.clone())
                }
                t if t.starts_with("http://reg.example.com/v2/x/blobs/") && bearer => {
                    let to = if t.ends_with(&cd) { "/c" } else { "/l" };
                    (
                        307,
                        vec![("location".into(), format!("http://cdn.example.net{to}"))],
                        vec![],
                    )
                }
                // The blob host gets no registry credentials.
                "http://cdn.example.net/c" if auth.is_none() => (200, vec![], config.clone()),
                "http://cdn.example.net/l" if auth.is_none() => (200, vec![], layer.clone()),
                t if t.starts_with("http://reg.example.com/") => (401, challenge, vec![]),
                _ => (403, vec![], b"no".to_vec()),
            }
        });
        let connect = fake(route);
        let r = Reference::parse("reg.example.com/x:1").unwrap();
        let lines = Mutex::new(Vec::new());
        let progress = |l: String| lines.lock().unwrap().push(l);
        let creds = Some(Credentials::Basic {
            username: "u".into(),
            password: "p".into(),
        });
        let p = pull_through(&connect, &r, creds, &opts(&dir), &progress)
            .await
            .unwrap();
        assert_eq!(p.manifest_digest, md);
        assert_eq!(p.config.env, Some(vec!["A=1".to_string()]));
        assert_eq!(p.config.cmd, Some(vec!["sh".to_string()]));
        assert_eq!(std::fs::read(&p.layers[0].path).unwrap(), b"layer bytes");
        let seen = seen.lock().unwrap().clone();
        assert_eq!(seen[0], "http://reg.example.com/v2/x/manifests/1 -");
        assert!(
            seen[1].starts_with("http://auth.example.com/token?") && seen[1].ends_with(&basic_seen)
        );
        assert!(lines
            .lock()
            .unwrap()
            .iter()
            .any(|l| l.contains("layer 1/1") && l.ends_with("pulled")));
        // The second pull finds the blobs kept (the token is asked anew).
        let again = pull_through(
            &connect,
            &r,
            Some(Credentials::Basic {
                username: "u".into(),
                password: "p".into(),
            }),
            &opts(&dir),
            &progress,
        )
        .await
        .unwrap();
        assert_eq!(again.manifest_digest, md);
        assert!(lines
            .lock()
            .unwrap()
            .iter()
            .any(|l| l.contains("layer 1/1") && l.ends_with("(cached)")));
        // Without credentials the token service refuses: the error says so.
        let _ = std::fs::remove_dir_all(&dir);
        let e = pull_through(&connect, &r, None, &opts(&dir), &progress)
            .await
            .unwrap_err();
        assert!(matches!(e, PullError::Denied { .. }), "{e}");
        std::fs::remove_dir_all(&dir).ok();
    }

    #[tokio::test]
    async fn a_blob_that_does_not_match_its_digest_is_not_kept() {
        let dir = std::env::temp_dir().join(format!("oci-corrupt-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let config = br#"{"config":{}}"#.to_vec();
        let cd = sha256_digest(&config);
        let kept_config = cd.trim_start_matches("sha256:").to_string();
        let ld = sha256_digest(b"the real layer");
        let manifest = serde_json::to_vec(&serde_json::json!({
            "schemaVersion": 2,
            "config": {"digest": cd, "size": config.len()},
            "layers": [{"digest": ld, "size": 14}],
        }))
        .unwrap();
        let route: Arc<Route> = Arc::new(move |target: &str, _| match target {
            "http://reg.example.com/v2/x/manifests/1" => (200, vec![], manifest.clone()),
            t if t.ends_with(&cd) => (200, vec![], config.clone()),
            _ => (200, vec![], b"not the layer!".to_vec()),
        });
        let connect = fake(route);
        let r = Reference::parse("reg.example.com/x:1").unwrap();
        let e = pull_through(&connect, &r, None, &opts(&dir), &|_| {})
            .await
            .unwrap_err();
        assert!(
            matches!(&e, PullError::Corrupt { digest, .. } if *digest == ld),
            "{e}"
        );
        assert!(e.to_string().contains(&ld), "{e}");
        let kept: Vec<_> = std::fs::read_dir(dir.join("sha256"))
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        // Only the config: no layer, no partial file.
        assert_eq!(kept, [kept_config]);
        // A manifest asked for by digest must hash to it.
        let pinned = Reference::parse(&format!("reg.example.com/x@{ld}")).unwrap();
        let route: Arc<Route> = Arc::new(|_: &str, _| (200, vec![], b"{}".to_vec()));
        let e = pull_through(&fake(route), &pinned, None, &opts(&dir), &|_| {})
            .await
            .unwrap_err();
        assert!(
            matches!(&e, PullError::Corrupt { digest, .. } if *digest == ld),
            "{e}"
        );
        std::fs::remove_dir_all(&dir).ok();
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
