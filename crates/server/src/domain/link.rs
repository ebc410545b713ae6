//! File links (`files:link`): a signed URL anyone may use without a key to
//! download a file (or a folder as `.tar.gz`) or upload one, until it
//! expires or the sandbox's links are revoked.

use serde_json::{json, Value};

use crate::domain::access::random_token;
use crate::domain::time::iso;

pub(crate) const DEFAULT_TTL_SECONDS: i64 = 3600;
pub(crate) const MAX_TTL_SECONDS: i64 = 7 * 86_400;
/// Live links per sandbox.
pub(crate) const MAX_LIVE_PER_SANDBOX: usize = 1000;
/// The longest `filename`.
pub(crate) const MAX_FILENAME: usize = 255;

/// A new link's id and token (`rtlnk_<43 base64url chars>`).
pub(crate) fn new_token() -> (String, String) {
    (
        format!("lnk_{}", uuid::Uuid::new_v4().simple()),
        random_token("rtlnk_"),
    )
}

/// A stored link.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Link {
    pub id: String,
    pub sandbox_id: String,
    pub key_id: String,
    pub path: String,
    /// `GET` or `PUT`.
    pub method: String,
    pub filename: Option<String>,
    pub max_bytes: Option<u64>,
    pub wake: bool,
    pub archive: bool,
    pub created_ms: i64,
    pub expires_ms: i64,
    pub revoked_ms: Option<i64>,
}

impl Link {
    /// `None` while it may be used, else why not.
    pub(crate) fn ended(&self, now: i64) -> Option<&'static str> {
        if self.revoked_ms.is_some() {
            Some("revoked")
        } else if now >= self.expires_ms {
            Some("expired")
        } else {
            None
        }
    }

    /// The name a download is saved as: the one asked for, else the path's
    /// last part (`.tar.gz` added for a folder).
    pub(crate) fn download_name(&self) -> String {
        if let Some(f) = &self.filename {
            return f.clone();
        }
        let base = self
            .path
            .trim_end_matches('/')
            .rsplit('/')
            .next()
            .filter(|b| !b.is_empty())
            .unwrap_or("download");
        if self.archive {
            format!("{base}.tar.gz")
        } else {
            base.to_string()
        }
    }

    pub(crate) fn wire(&self, url: &str) -> Value {
        json!({
            "id": self.id,
            "url": url,
            "method": self.method,
            "path": self.path,
            "sandboxId": self.sandbox_id,
            "filename": self.filename,
            "archive": self.archive,
            "maxBytes": self.max_bytes,
            "wake": self.wake,
            "createdAt": iso(self.created_ms),
            "expiresAt": iso(self.expires_ms),
        })
    }
}

/// A filename fit for `Content-Disposition`: no path, quote or control.
pub(crate) fn filename_problem(name: &str) -> Option<&'static str> {
    if name.is_empty() || name.len() > MAX_FILENAME {
        return Some("must be 1 to 255 bytes");
    }
    if name
        .chars()
        .any(|c| c.is_control() || matches!(c, '/' | '\\' | '"'))
        || name == "."
        || name == ".."
    {
        return Some("must be a file name: no slash, backslash, quote or control character");
    }
    None
}

/// The one byte range a `Range: bytes=…` header asks of `len` bytes, as
/// `start..end`; `Err` when it cannot be served (416), `Ok(None)` for the
/// whole (no header, or a form this server does not take).
pub(crate) fn byte_range(header: Option<&str>, len: u64) -> Result<Option<(u64, u64)>, ()> {
    let Some(spec) = header.and_then(|h| h.trim().strip_prefix("bytes=")) else {
        return Ok(None);
    };
    if spec.contains(',') {
        return Ok(None);
    }
    let (a, b) = spec.split_once('-').ok_or(())?;
    let (a, b) = (a.trim(), b.trim());
    let (start, end) = if a.is_empty() {
        let n: u64 = b.parse().map_err(|_| ())?;
        if n == 0 {
            return Err(());
        }
        (len.saturating_sub(n), len)
    } else {
        let s: u64 = a.parse().map_err(|_| ())?;
        let e = if b.is_empty() {
            len
        } else {
            b.parse::<u64>().map_err(|_| ())?.saturating_add(1).min(len)
        };
        (s, e)
    };
    if start >= len || start >= end {
        return Err(());
    }
    Ok(Some((start, end)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn link() -> Link {
        Link {
            id: "lnk_1".into(),
            sandbox_id: "s".into(),
            key_id: "k".into(),
            path: "/workspace/out/report.csv".into(),
            method: "GET".into(),
            filename: None,
            max_bytes: None,
            wake: true,
            archive: false,
            created_ms: 0,
            expires_ms: 1000,
            revoked_ms: None,
        }
    }

    #[test]
    fn a_link_ends_when_it_expires_or_is_revoked() {
        let mut l = link();
        assert_eq!(l.ended(999), None);
        assert_eq!(l.ended(1000), Some("expired"));
        l.revoked_ms = Some(10);
        assert_eq!(l.ended(20), Some("revoked"));
    }

    #[test]
    fn downloads_are_named_after_the_path_or_as_asked() {
        let mut l = link();
        assert_eq!(l.download_name(), "report.csv");
        l.path = "/workspace/out/".into();
        l.archive = true;
        assert_eq!(l.download_name(), "out.tar.gz");
        l.filename = Some("x.bin".into());
        assert_eq!(l.download_name(), "x.bin");
        assert!(filename_problem("a\"b").is_some());
        assert!(filename_problem("../a").is_some());
        assert!(filename_problem("").is_some());
        assert_eq!(filename_problem("report (1).csv"), None);
    }

    #[test]
    fn ranges_are_one_span_inside_the_file() {
        assert_eq!(byte_range(None, 10), Ok(None));
        assert_eq!(byte_range(Some("bytes=0-3"), 10), Ok(Some((0, 4))));
        assert_eq!(byte_range(Some("bytes=5-"), 10), Ok(Some((5, 10))));
        assert_eq!(byte_range(Some("bytes=-3"), 10), Ok(Some((7, 10))));
        assert_eq!(byte_range(Some("bytes=8-100"), 10), Ok(Some((8, 10))));
        assert_eq!(byte_range(Some("bytes=10-"), 10), Err(()));
        assert_eq!(byte_range(Some("bytes=x-"), 10), Err(()));
        assert_eq!(byte_range(Some("bytes=0-1,4-5"), 10), Ok(None));
        assert_eq!(byte_range(Some("items=0-1"), 10), Ok(None));
        assert!(new_token().1.starts_with("rtlnk_"));
    }
}
