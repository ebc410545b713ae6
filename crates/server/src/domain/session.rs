//! Sandbox sessions: short-lived tokens (`rtsess_…`) a backend makes for a
//! frontend, reaching one sandbox's commands, processes, files and previews
//! and nothing else. The rules of their shape, lifetime and origins.

use serde_json::{json, Value};

use crate::domain::access::random_token;
use crate::domain::time::iso;

/// A session lasts an hour unless asked, a day at most, a minute at least.
pub(crate) const DEFAULT_TTL_SECONDS: i64 = 3600;
pub(crate) const MAX_TTL_SECONDS: i64 = 86_400;
pub(crate) const MIN_TTL_SECONDS: i64 = 60;
/// Live sessions per sandbox; a create past it is refused.
pub(crate) const MAX_LIVE_PER_SANDBOX: usize = 50;
/// Origins per session, and the longest one.
pub(crate) const MAX_ORIGINS: usize = 16;
const MAX_ORIGIN_LEN: usize = 255;
pub(crate) const MAX_NAME_CHARS: usize = 64;
/// Ended sessions stay listed this long, then are forgotten.
pub(crate) const ENDED_KEPT_MS: i64 = 86_400_000;

/// A new session's id and its token `rtsess_<id>_<43 base64url chars>`.
/// The id's first 16 hex digits grow with each session this process makes
/// (the time in ms, then a count within it), so sessions made in one
/// millisecond still list in the order they were made on every store
/// engine; the last 16 are random.
pub(crate) fn new_token() -> (String, String) {
    let id = format!("sess_{}", ordered_hex());
    let token = random_token(&format!("rtsess_{id}_"));
    (id, token)
}

/// 32 hex digits that sort in the order this process made them: 16 of a
/// strictly growing sequence (below), then 16 random. For ids listed in the
/// order they were made where rows share a millisecond (sessions, shared
/// attachments), on every store engine.
pub(crate) fn ordered_hex() -> String {
    format!("{:016x}{:016x}", next_order(), rand::random::<u64>())
}

/// The next of a strictly growing sequence: the wall clock's ms shifted
/// left 16 bits, or one more than the last when the clock has not moved on.
fn next_order() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static LAST: AtomicU64 = AtomicU64::new(0);
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| {
            u64::try_from(d.as_millis()).unwrap_or(u64::MAX >> 16)
        })
        << 16;
    let mut last = LAST.load(Ordering::Relaxed);
    loop {
        let next = now.max(last + 1);
        match LAST.compare_exchange_weak(last, next, Ordering::Relaxed, Ordering::Relaxed) {
            Ok(_) => return next,
            Err(seen) => last = seen,
        }
    }
}

/// Whether a bearer token is a session's (rather than an API key).
pub(crate) fn is_session_token(token: &str) -> bool {
    token.starts_with("rtsess_")
}

/// Why an origin is refused, or `None` when it is one exact page origin:
/// `http(s)://host[:port]`, lowercase, no path, query, user or trailing slash.
pub(crate) fn origin_problem(origin: &str) -> Option<&'static str> {
    if origin.len() > MAX_ORIGIN_LEN {
        return Some("is too long (255 characters at most)");
    }
    let Some(rest) = origin
        .strip_prefix("https://")
        .or_else(|| origin.strip_prefix("http://"))
    else {
        return Some("must start with https:// or http://");
    };
    if rest.is_empty() {
        return Some("names no host");
    }
    if origin.bytes().any(|b| b.is_ascii_uppercase()) {
        return Some("must be lowercase, as browsers send it");
    }
    let (host, port) = match rest.rsplit_once(':') {
        Some((h, p)) if !h.ends_with(']') || rest.starts_with('[') => (h, Some(p)),
        _ => (rest, None),
    };
    if let Some(p) = port {
        if p.is_empty() || !p.bytes().all(|b| b.is_ascii_digit()) || p.parse::<u16>().is_err() {
            return Some("has a port that is not a number from 1 to 65535");
        }
    }
    let host_ok = !host.is_empty()
        && host
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b'[' | b']' | b':'));
    if !host_ok {
        return Some("must be scheme://host[:port] only: no path, query, user or trailing slash");
    }
    None
}

/// A stored session.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Session {
    pub id: String,
    pub sandbox_id: String,
    pub key_id: String,
    pub name: Option<String>,
    pub origins: Vec<String>,
    pub created_ms: i64,
    pub expires_ms: i64,
    pub revoked_ms: Option<i64>,
}

impl Session {
    /// `active`, `expired` or `revoked` at `now`.
    pub(crate) fn state(&self, now: i64) -> &'static str {
        if self.revoked_ms.is_some() {
            "revoked"
        } else if now >= self.expires_ms {
            "expired"
        } else {
            "active"
        }
    }

    pub(crate) fn live(&self, now: i64) -> bool {
        self.state(now) == "active"
    }

    /// When it ended, if it has.
    pub(crate) fn ended_ms(&self, now: i64) -> Option<i64> {
        match self.revoked_ms {
            Some(r) => Some(r.min(self.expires_ms)),
            None if now >= self.expires_ms => Some(self.expires_ms),
            None => None,
        }
    }

    /// Whether a request from `origin` (the browser's `Origin` header) may
    /// use it: any request without one (a backend), or one of its origins.
    pub(crate) fn allows_origin(&self, origin: Option<&str>) -> bool {
        origin.is_none_or(|o| self.origins.iter().any(|x| x == o))
    }

    /// The record as answered (the token only ever beside it, on create).
    pub(crate) fn wire(&self, now: i64) -> Value {
        json!({
            "id": self.id,
            "object": "sandbox_session",
            "sandboxId": self.sandbox_id,
            "name": self.name,
            "origins": self.origins,
            "state": self.state(now),
            "createdAt": iso(self.created_ms),
            "expiresAt": iso(self.expires_ms),
            "revokedAt": self.revoked_ms.map(iso),
            "endedAt": self.ended_ms(now).map(iso),
        })
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn ids_made_one_after_another_sort_in_that_order() {
        let ids: Vec<String> = (0..1000).map(|_| super::new_token().0).collect();
        let mut sorted = ids.clone();
        sorted.sort();
        assert_eq!(ids, sorted);
        assert!(ids.iter().all(|i| i.len() == "sess_".len() + 32));
    }

    use super::*;

    fn session() -> Session {
        Session {
            id: "sess_1".into(),
            sandbox_id: "sbx".into(),
            key_id: "k".into(),
            name: None,
            origins: vec!["https://app.example.com".into()],
            created_ms: 1_000,
            expires_ms: 5_000,
            revoked_ms: None,
        }
    }

    #[test]
    fn tokens_are_rtsess_with_their_id() {
        let (id, token) = new_token();
        assert!(is_session_token(&token));
        assert!(token.starts_with(&format!("rtsess_{id}_")));
        assert_eq!(token.len(), "rtsess_".len() + id.len() + 1 + 43);
        assert_ne!(new_token().1, token);
        assert!(!is_session_token("rtcloud_abc"));
    }

    #[test]
    fn a_session_is_active_until_it_expires_or_is_revoked() {
        let mut s = session();
        assert_eq!(s.state(4_999), "active");
        assert_eq!(s.ended_ms(4_999), None);
        assert_eq!(s.state(5_000), "expired");
        assert_eq!(s.ended_ms(9_000), Some(5_000));
        s.revoked_ms = Some(2_000);
        assert_eq!(s.state(2_500), "revoked");
        assert!(!s.live(2_500));
        assert_eq!(s.ended_ms(2_500), Some(2_000));
        assert_eq!(s.wire(2_500)["revokedAt"], iso(2_000));
    }

    #[test]
    fn only_its_exact_origins_or_no_origin_may_use_it() {
        let s = session();
        assert!(s.allows_origin(None));
        assert!(s.allows_origin(Some("https://app.example.com")));
        assert!(!s.allows_origin(Some("https://app.example.com.evil.example")));
        assert!(!s.allows_origin(Some("http://app.example.com")));
        assert!(!s.allows_origin(Some("null")));
    }

    #[test]
    fn origins_are_scheme_host_and_port_only() {
        for ok in [
            "https://app.example.com",
            "http://localhost:5173",
            "http://127.0.0.1:8080",
            "http://[::1]:3000",
        ] {
            assert_eq!(origin_problem(ok), None, "{ok}");
        }
        for bad in [
            "app.example.com",
            "https://",
            "https://app.example.com/",
            "https://app.example.com/path",
            "https://App.example.com",
            "https://user@app.example.com",
            "https://app.example.com:99999",
            "https://app.example.com:",
            "ftp://app.example.com",
            "*",
        ] {
            assert!(origin_problem(bad).is_some(), "{bad}");
        }
        assert!(origin_problem(&format!("https://{}.com", "a".repeat(260))).is_some());
    }
}
