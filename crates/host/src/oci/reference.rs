//! Image references as Docker reads them: `python:3.12-slim` is
//! `docker.io/library/python:3.12-slim`, `registry.host[:port]/repo/x:tag`,
//! and `…@sha256:<hex>` pins a manifest.

/// Docker Hub's name in references (and in stored credentials).
pub const DOCKER_HUB: &str = "docker.io";
/// The host Docker Hub's registry API answers on.
pub const DOCKER_HUB_API: &str = "registry-1.docker.io";

/// A registry image reference, normalised.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reference {
    /// `docker.io` for Docker Hub, else `host[:port]` as written (lowercase).
    pub registry: String,
    /// `library/python`, `team/app`.
    pub repository: String,
    pub tag: Option<String>,
    /// `sha256:<64 hex>`.
    pub digest: Option<String>,
}

/// Why a string is not an image reference.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReferenceError {
    #[error("an image reference may not be empty")]
    Empty,
    #[error("an image reference is at most 512 characters")]
    TooLong,
    #[error("{0:?} is not a repository name (lowercase letters and digits, parts separated by '.', '_', '-' and joined by '/')")]
    Repository(String),
    #[error("{0:?} is not a tag (letters, digits, '_', '.', '-', at most 128, not starting with '.' or '-')")]
    Tag(String),
    #[error("{0:?} is not a digest (sha256: and 64 lowercase hex digits)")]
    Digest(String),
    #[error("{0:?} is not a registry host (a name or address, and an optional :port)")]
    Registry(String),
}

fn valid_component(c: &str) -> bool {
    // [a-z0-9]+((\.|_|__|-+)[a-z0-9]+)*
    let b = c.as_bytes();
    if b.is_empty() || !is_alnum(b[0]) || !is_alnum(b[b.len() - 1]) {
        return false;
    }
    let mut i = 0;
    while i < b.len() {
        if is_alnum(b[i]) {
            i += 1;
            continue;
        }
        let start = i;
        while i < b.len() && !is_alnum(b[i]) {
            i += 1;
        }
        let sep = &c[start..i];
        if !(sep == "." || sep == "_" || sep == "__" || sep.bytes().all(|x| x == b'-')) {
            return false;
        }
    }
    true
}

fn is_alnum(b: u8) -> bool {
    b.is_ascii_lowercase() || b.is_ascii_digit()
}

fn valid_tag(t: &str) -> bool {
    let b = t.as_bytes();
    !b.is_empty()
        && b.len() <= 128
        && (b[0].is_ascii_alphanumeric() || b[0] == b'_')
        && b.iter()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'_' | b'.' | b'-'))
}

fn valid_digest(d: &str) -> bool {
    d.strip_prefix("sha256:").is_some_and(|h| {
        h.len() == 64
            && h.bytes()
                .all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(&c))
    })
}

fn valid_registry(r: &str) -> bool {
    let (host, port) = match r.rsplit_once(':') {
        Some((h, p)) => (h, Some(p)),
        None => (r, None),
    };
    let host_ok = !host.is_empty()
        && host.len() <= 253
        && host.split('.').all(|l| {
            !l.is_empty()
                && l.len() <= 63
                && !l.starts_with('-')
                && !l.ends_with('-')
                && l.bytes().all(|c| c.is_ascii_alphanumeric() || c == b'-')
        });
    let port_ok = port.is_none_or(|p| p.parse::<u16>().is_ok_and(|n| n > 0));
    host_ok && port_ok
}

impl Reference {
    /// Reads `s` as Docker does. A first part with a `.` or a `:`, or
    /// `localhost`, is a registry; anything else is on Docker Hub, where a
    /// one-part name is in `library/`.
    pub fn parse(s: &str) -> Result<Reference, ReferenceError> {
        if s.is_empty() {
            return Err(ReferenceError::Empty);
        }
        if s.len() > 512 {
            return Err(ReferenceError::TooLong);
        }
        let (rest, digest) = match s.split_once('@') {
            Some((r, d)) => {
                if !valid_digest(d) {
                    return Err(ReferenceError::Digest(d.to_string()));
                }
                (r, Some(d.to_string()))
            }
            None => (s, None),
        };
        let (name, tag) = match rest.rfind(':') {
            Some(i) if !rest[i..].contains('/') => (&rest[..i], Some(&rest[i + 1..])),
            _ => (rest, None),
        };
        if let Some(t) = tag {
            if !valid_tag(t) {
                return Err(ReferenceError::Tag(t.to_string()));
            }
        }
        let (registry, repository) = match name.split_once('/') {
            Some((first, r)) if first.contains(['.', ':']) || first == "localhost" => {
                if !valid_registry(first) {
                    return Err(ReferenceError::Registry(first.to_string()));
                }
                (first.to_ascii_lowercase(), r.to_string())
            }
            _ => (DOCKER_HUB.to_string(), name.to_string()),
        };
        let registry = match registry.as_str() {
            "index.docker.io" | "registry-1.docker.io" | "registry.hub.docker.com" => {
                DOCKER_HUB.to_string()
            }
            _ => registry,
        };
        if repository.is_empty() || !repository.split('/').all(valid_component) {
            return Err(ReferenceError::Repository(repository));
        }
        let repository = if registry == DOCKER_HUB && !repository.contains('/') {
            format!("library/{repository}")
        } else {
            repository
        };
        Ok(Reference {
            registry,
            repository,
            tag: tag.map(str::to_string),
            digest,
        })
    }

    /// What the manifest is asked for by: the digest, else the tag, else
    /// `latest`.
    pub fn manifest_ref(&self) -> &str {
        self.digest
            .as_deref()
            .or(self.tag.as_deref())
            .unwrap_or("latest")
    }

    /// The full form: `docker.io/library/python:3.12-slim`,
    /// `host:5000/x@sha256:…` (`:latest` when neither is given).
    pub fn canonical(&self) -> String {
        let mut s = format!("{}/{}", self.registry, self.repository);
        match (&self.tag, &self.digest) {
            (Some(t), _) => {
                s.push(':');
                s.push_str(t);
            }
            (None, None) => s.push_str(":latest"),
            (None, Some(_)) => {}
        }
        if let Some(d) = &self.digest {
            s.push('@');
            s.push_str(d);
        }
        s
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    fn parts(s: &str) -> (String, String, Option<String>, Option<String>) {
        let r = Reference::parse(s).unwrap();
        (r.registry, r.repository, r.tag, r.digest)
    }

    #[test]
    fn docker_hub_short_names_are_normalised() {
        assert_eq!(
            parts("python:3.12-slim"),
            (
                "docker.io".into(),
                "library/python".into(),
                Some("3.12-slim".into()),
                None
            )
        );
        assert_eq!(
            Reference::parse("python").unwrap().canonical(),
            "docker.io/library/python:latest"
        );
        assert_eq!(
            Reference::parse("bitnami/redis:7").unwrap().canonical(),
            "docker.io/bitnami/redis:7"
        );
        assert_eq!(
            Reference::parse("docker.io/python:3").unwrap().canonical(),
            "docker.io/library/python:3"
        );
        assert_eq!(
            Reference::parse("index.docker.io/library/python")
                .unwrap()
                .canonical(),
            "docker.io/library/python:latest"
        );
        assert_eq!(Reference::parse("python").unwrap().manifest_ref(), "latest");
    }

    #[test]
    fn registries_with_ports_and_digests() {
        let d = format!("sha256:{}", "ab".repeat(32));
        assert_eq!(
            parts("registry.example.com:5000/team/app:v1"),
            (
                "registry.example.com:5000".into(),
                "team/app".into(),
                Some("v1".into()),
                None
            )
        );
        assert_eq!(
            parts("localhost/app"),
            ("localhost".into(), "app".into(), None, None)
        );
        assert_eq!(
            parts("localhost:5000/app"),
            ("localhost:5000".into(), "app".into(), None, None)
        );
        let r = Reference::parse(&format!("Reg.Example.com/x@{d}")).unwrap();
        assert_eq!(r.registry, "reg.example.com");
        assert_eq!(r.manifest_ref(), d);
        assert_eq!(r.canonical(), format!("reg.example.com/x@{d}"));
        let r = Reference::parse(&format!("python:3@{d}")).unwrap();
        assert_eq!(r.tag.as_deref(), Some("3"));
        assert_eq!(r.manifest_ref(), d);
        assert_eq!(r.canonical(), format!("docker.io/library/python:3@{d}"));
    }

    #[test]
    fn bad_references_name_what_is_wrong() {
        let err = |s: &str| Reference::parse(s).unwrap_err();
        assert_eq!(err(""), ReferenceError::Empty);
        assert_eq!(err("Python"), ReferenceError::Repository("Python".into()));
        assert_eq!(err("a//b"), ReferenceError::Repository("a//b".into()));
        assert_eq!(err("a-:1"), ReferenceError::Repository("a-".into()));
        assert_eq!(err("python:"), ReferenceError::Tag("".into()));
        assert_eq!(err("python:-x"), ReferenceError::Tag("-x".into()));
        assert_eq!(
            err("python@sha256:abc"),
            ReferenceError::Digest("sha256:abc".into())
        );
        assert_eq!(
            err(&format!("python@md5:{}", "a".repeat(32))),
            ReferenceError::Digest(format!("md5:{}", "a".repeat(32)))
        );
        assert_eq!(
            err("reg.example.com:99999/x"),
            ReferenceError::Registry("reg.example.com:99999".into())
        );
        assert_eq!(
            err("-bad.example.com/x"),
            ReferenceError::Registry("-bad.example.com".into())
        );
        assert_eq!(err(&"a".repeat(600)), ReferenceError::TooLong);
        // Separators: one '.', one or two '_', any number of '-'.
        assert!(Reference::parse("a__b/c--d/e.f").is_ok());
        assert!(Reference::parse("a___b").is_err());
        assert!(Reference::parse("a..b").is_err());
    }
}
