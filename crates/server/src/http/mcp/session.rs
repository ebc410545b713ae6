//! MCP sessions: an id `initialize` hands out, bound to the key that asked,
//! kept in memory. Bounded: an idle session ends after an hour, a key holds
//! at most [`PER_KEY`] (its least recently used goes first), the server at
//! most [`TOTAL`]. A server restart ends them all; clients initialize again
//! on the 404 that follows.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

const IDLE: Duration = Duration::from_secs(3600);
pub(super) const PER_KEY: usize = 32;
const TOTAL: usize = 10_000;

struct Entry {
    key_id: String,
    last: Instant,
}

#[derive(Default)]
pub(crate) struct Sessions {
    map: Mutex<HashMap<String, Entry>>,
}

impl Sessions {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Entry>> {
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A new session for `key_id`.
    pub(super) fn open(&self, key_id: &str) -> String {
        let id = format!("mcp_{}", uuid::Uuid::new_v4().simple());
        let now = Instant::now();
        let mut m = self.lock();
        m.retain(|_, e| now.duration_since(e.last) < IDLE);
        let mut mine: Vec<(Instant, String)> = m
            .iter()
            .filter(|(_, e)| e.key_id == key_id)
            .map(|(k, e)| (e.last, k.clone()))
            .collect();
        if mine.len() >= PER_KEY {
            mine.sort();
            for (_, k) in mine.iter().take(mine.len() + 1 - PER_KEY) {
                m.remove(k);
            }
        }
        if m.len() >= TOTAL {
            if let Some(oldest) = m.iter().min_by_key(|(_, e)| e.last).map(|(k, _)| k.clone()) {
                m.remove(&oldest);
            }
        }
        m.insert(
            id.clone(),
            Entry {
                key_id: key_id.to_string(),
                last: now,
            },
        );
        id
    }

    /// Whether `id` is a live session of `key_id` (and marks it used).
    pub(super) fn touch(&self, id: &str, key_id: &str) -> bool {
        let now = Instant::now();
        let mut m = self.lock();
        match m.get_mut(id) {
            Some(e) if e.key_id == key_id && now.duration_since(e.last) < IDLE => {
                e.last = now;
                true
            }
            _ => false,
        }
    }

    /// Ends `id` if it is `key_id`'s.
    pub(super) fn close(&self, id: &str, key_id: &str) -> bool {
        let mut m = self.lock();
        if m.get(id).is_some_and(|e| e.key_id == key_id) {
            m.remove(id);
            return true;
        }
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mcp_sessions_are_bounded_per_key() {
        let s = Sessions::default();
        let first = s.open("k1");
        assert!(s.touch(&first, "k1"));
        assert!(!s.touch(&first, "k2"), "another key's session is unknown");
        let mut ids = vec![first.clone()];
        for _ in 0..PER_KEY {
            ids.push(s.open("k1"));
        }
        assert!(!s.touch(&first, "k1"), "the least recently used went");
        assert!(s.touch(&ids[PER_KEY], "k1"));
        let other = s.open("k2");
        assert!(s.touch(&other, "k2"));
        assert!(!s.close(&other, "k1"));
        assert!(s.close(&other, "k2"));
        assert!(!s.touch(&other, "k2"));
    }
}
