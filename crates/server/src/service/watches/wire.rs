//! File watches: their limits, the event names of the API, and the log a
//! watch's events are read from by cursor. The cursor counts the bytes of
//! the log (each entry as its JSON line), as a process's output does, so a
//! reader that falls more than [`LOG_BYTES`] behind is told how much it
//! lost (`lostBytes`) and carries on with what is kept.

use std::collections::VecDeque;

use runtime_host::{Change, ChangeKind, WatchMiss};
use serde_json::{json, Value};

/// Watches running in one sandbox at once (the product's limit).
pub(crate) const MAX_WATCHES_PER_SANDBOX: usize = 4;
/// Ended watches kept readable per sandbox (their last events, their end).
pub(crate) const ENDED_KEPT: usize = 8;
/// The most a watch keeps for its readers; older entries are dropped.
pub(crate) const LOG_BYTES: u64 = 1 << 20;
/// The most one read answers; the rest is read from its `nextCursor`.
pub(crate) const READ_BYTES: u64 = 256 << 10;
/// `batchMs` when none is given, and its bounds.
pub(crate) const DEFAULT_BATCH_MS: i64 = 100;
pub(crate) const MAX_BATCH_MS: i64 = 10_000;
/// `timeoutMs` when none is given (one hour), and its most (a day); 0 runs
/// until stopped.
pub(crate) const DEFAULT_TIMEOUT_MS: i64 = 3_600_000;
pub(crate) const MAX_TIMEOUT_MS: i64 = 86_400_000;
/// inotify watches (directories) a watch may hold.
pub(crate) const DEFAULT_MAX_WATCHES: i64 = 8192;
pub(crate) const MAX_MAX_WATCHES: i64 = 65_536;
/// The longest `waitMs` of a read.
pub(crate) const MAX_WAIT_MS: i64 = 8000;
/// A followed stream ends with `continue` after this long (the client
/// reconnects from its cursor).
pub(crate) const FOLLOW_SECONDS: u64 = 110;
/// Globs per list, and the longest glob.
pub(crate) const MAX_GLOBS: usize = 32;
pub(crate) const MAX_GLOB_LEN: usize = 256;

/// The event names a watch may be asked for. `modify` is `write` (as
/// Blaxel and Modal call it); `access` is accepted (Modal asks for it) but
/// never reported: reads are not watched.
pub(crate) const EVENT_NAMES: &[&str] = &[
    "create", "write", "modify", "remove", "delete", "rename", "chmod", "access",
];

/// The kind an event name asks for; `None` for `access`.
pub(crate) fn kind_of(name: &str) -> Option<ChangeKind> {
    match name {
        "create" => Some(ChangeKind::Create),
        "write" | "modify" => Some(ChangeKind::Write),
        "remove" | "delete" => Some(ChangeKind::Remove),
        "rename" => Some(ChangeKind::Rename),
        "chmod" => Some(ChangeKind::Chmod),
        _ => None,
    }
}

pub(crate) fn kind_name(k: ChangeKind) -> &'static str {
    match k {
        ChangeKind::Create => "create",
        ChangeKind::Write => "write",
        ChangeKind::Remove => "remove",
        ChangeKind::Rename => "rename",
        ChangeKind::Chmod => "chmod",
    }
}

/// A client-chosen watch id: 1 to 64 letters, digits, `-`, `_` or `.`.
pub(crate) fn valid_id(id: &str) -> bool {
    (1..=64).contains(&id.len())
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
}

/// An event as the API shows it.
pub(crate) fn event_json(c: &Change, time: &str) -> Value {
    let mut v = json!({
        "type": kind_name(c.kind),
        "path": c.path,
        "isDir": c.is_dir,
        "time": time,
    });
    if let Some(old) = &c.old_path {
        v["oldPath"] = json!(old);
        v["paths"] = json!([old, c.path]);
    }
    if c.kind == ChangeKind::Write {
        v["count"] = json!(c.count);
    }
    v
}

/// A notice as the API shows it.
pub(crate) fn notice_json(m: &WatchMiss) -> Value {
    match m {
        WatchMiss::Overflow { dropped } => json!({"k": "overflow", "dropped": dropped}),
        WatchMiss::Limit { watches, path } => {
            json!({"k": "limit", "watches": watches, "path": path})
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Entry {
    Event(Value),
    Notice(Value),
}

/// A watch's events and notices, by byte cursor, the oldest dropped beyond
/// [`LOG_BYTES`].
#[derive(Debug)]
pub(crate) struct Log {
    /// Each entry with the cursor it starts at and its size.
    entries: VecDeque<(u64, u64, Entry)>,
    /// The cursor after the last entry.
    end: u64,
    kept: u64,
    cap: u64,
}

/// What a read from a cursor finds.
#[derive(Debug, Default, PartialEq)]
pub(crate) struct Read {
    pub(crate) events: Vec<Value>,
    pub(crate) notices: Vec<Value>,
    pub(crate) next: u64,
    /// Bytes dropped between the cursor and what is kept.
    pub(crate) lost: u64,
}

impl Read {
    pub(crate) fn is_empty(&self) -> bool {
        self.events.is_empty() && self.notices.is_empty() && self.lost == 0
    }
}

/// A cursor past the end of the log.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct FutureCursor {
    pub(crate) end: u64,
}

impl Log {
    pub(crate) fn new(cap: u64) -> Log {
        Log {
            entries: VecDeque::new(),
            end: 0,
            kept: 0,
            cap,
        }
    }

    pub(crate) fn end(&self) -> u64 {
        self.end
    }

    pub(crate) fn push(&mut self, e: Entry) {
        let v = match &e {
            Entry::Event(v) | Entry::Notice(v) => v,
        };
        let size = serde_json::to_vec(v)
            .map(|b| b.len() as u64 + 1)
            .unwrap_or(1);
        self.entries.push_back((self.end, size, e));
        self.end += size;
        self.kept += size;
        while self.kept > self.cap {
            match self.entries.pop_front() {
                Some((_, s, _)) => self.kept -= s,
                None => break,
            }
        }
    }

    /// The entries from `cursor`, at most [`READ_BYTES`] of them (always at
    /// least one when there is one).
    pub(crate) fn read(&self, cursor: u64) -> Result<Read, FutureCursor> {
        if cursor > self.end {
            return Err(FutureCursor { end: self.end });
        }
        let first = self.entries.front().map_or(self.end, |(s, _, _)| *s);
        let mut r = Read {
            lost: first.saturating_sub(cursor),
            next: cursor.max(first),
            ..Read::default()
        };
        let mut bytes = 0;
        for (start, size, e) in &self.entries {
            if *start < r.next {
                continue;
            }
            if bytes > 0 && bytes + size > READ_BYTES {
                break;
            }
            bytes += size;
            r.next = start + size;
            match e {
                Entry::Event(v) => r.events.push(v.clone()),
                Entry::Notice(v) => r.notices.push(v.clone()),
            }
        }
        Ok(r)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn ev(n: usize) -> Entry {
        Entry::Event(json!({"type": "create", "path": format!("/w/{n:04}")}))
    }

    #[test]
    fn a_read_goes_on_from_its_cursor() {
        let mut log = Log::new(LOG_BYTES);
        log.push(ev(1));
        log.push(Entry::Notice(json!({"k": "overflow", "dropped": 2})));
        log.push(ev(2));
        let all = log.read(0).unwrap();
        assert_eq!((all.events.len(), all.notices.len(), all.lost), (2, 1, 0));
        assert_eq!(all.next, log.end());
        assert!(log.read(all.next).unwrap().is_empty());
        // From the last entry's start: it only; from inside an entry: what follows.
        let last = log.entries.back().unwrap().0;
        let rest = log.read(last).unwrap();
        assert_eq!(rest, log.read(last - 1).unwrap());
        assert_eq!(
            rest.events,
            vec![json!({"type": "create", "path": "/w/0002"})]
        );
    }

    #[test]
    fn a_cursor_from_the_future_is_refused() {
        let mut log = Log::new(LOG_BYTES);
        log.push(ev(1));
        let end = log.end();
        assert_eq!(log.read(end + 1), Err(FutureCursor { end }));
    }

    #[test]
    fn the_oldest_is_dropped_and_a_late_reader_told_how_much() {
        let mut log = Log::new(1000);
        for n in 0..100 {
            log.push(ev(n));
        }
        let r = log.read(0).unwrap();
        assert!(r.lost > 0 && r.lost < log.end());
        let kept: u64 = log.entries.iter().map(|(_, s, _)| s).sum();
        assert!(kept <= 1000);
        assert_eq!(r.lost + kept, log.end());
        assert_eq!(
            r.events.last(),
            Some(&json!({"type": "create", "path": "/w/0099"}))
        );
        // Read after the drop: nothing lost any more.
        assert_eq!(log.read(r.next).unwrap().lost, 0);
    }

    #[test]
    fn a_read_is_bounded_but_never_empty() {
        let mut log = Log::new(LOG_BYTES * 4);
        for n in 0..20_000 {
            log.push(ev(n));
        }
        let r = log.read(0).unwrap();
        assert!(r.next <= READ_BYTES && r.events.len() > 1000);
        assert!(r.next < log.end());
    }

    #[test]
    fn names_and_ids() {
        assert_eq!(kind_of("modify"), Some(ChangeKind::Write));
        assert_eq!(kind_of("access"), None);
        assert!(EVENT_NAMES
            .iter()
            .all(|n| *n == "access" || kind_of(n).is_some()));
        assert!(valid_id("build-watch_1.x"));
        assert!(!valid_id("") && !valid_id("a/b") && !valid_id(&"a".repeat(65)));
        let c = Change {
            kind: ChangeKind::Rename,
            path: "/w/b".into(),
            old_path: Some("/w/a".into()),
            is_dir: false,
            count: 1,
        };
        let v = event_json(&c, "t");
        assert_eq!(v["type"], "rename");
        assert_eq!(v["oldPath"], "/w/a");
        assert_eq!(v["paths"], json!(["/w/a", "/w/b"]));
        assert!(v.get("count").is_none());
    }
}
