//! The connections served per preview, and forgetting a deleted sandbox's
//! previews: what the sandbox and lifecycle services call.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use tokio_util::sync::CancellationToken;

use crate::AppState;

/// The kind of the preview records in the store.
pub(super) const KIND: &str = "preview";

/// Connections served per preview, closed when it is rotated, made private
/// or deleted.
#[derive(Default)]
pub(crate) struct Live {
    cancels: Mutex<HashMap<(String, u16), CancellationToken>>,
    /// The requests each preview serves now; an entry lives while one of
    /// its permits does.
    slots: Mutex<HashMap<(String, u16), Weak<Semaphore>>>,
}

impl Live {
    /// What ends the connections of a preview opened from now on.
    pub(super) fn token(&self, sandbox: &str, port: u16) -> CancellationToken {
        let mut m = self.cancels.lock().unwrap_or_else(|p| p.into_inner());
        m.entry((sandbox.to_string(), port)).or_default().clone()
    }

    /// A place for one more request to the preview, of at most `max` at
    /// once; `None` when all are taken. Never waits.
    pub(crate) fn slot(
        &self,
        sandbox: &str,
        port: u16,
        max: usize,
    ) -> Option<OwnedSemaphorePermit> {
        let mut m = self.slots.lock().unwrap_or_else(|p| p.into_inner());
        let key = (sandbox.to_string(), port);
        let sem = match m.get(&key).and_then(Weak::upgrade) {
            Some(s) => s,
            None => {
                m.retain(|_, w| w.strong_count() > 0);
                let s = Arc::new(Semaphore::new(max.clamp(1, Semaphore::MAX_PERMITS)));
                m.insert(key, Arc::downgrade(&s));
                s
            }
        };
        sem.try_acquire_owned().ok()
    }

    /// Closes what was opened so far.
    pub(super) fn cut(&self, sandbox: &str, port: u16) {
        let mut m = self.cancels.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(t) = m.remove(&(sandbox.to_string(), port)) {
            t.cancel();
        }
    }

    /// Closes every connection to the sandbox's previews.
    pub(crate) fn sandbox_gone(&self, sandbox: &str) {
        let mut m = self.cancels.lock().unwrap_or_else(|p| p.into_inner());
        m.retain(|(s, _), t| {
            if s == sandbox {
                t.cancel();
            }
            s != sandbox
        });
    }
}

/// Forgets a deleted sandbox's previews.
pub(crate) fn sandbox_gone(st: &AppState, id: &str) {
    if let Err(e) = st.store().doc_delete(KIND, id, None) {
        tracing::warn!(sandbox_id = id, error = %e, "forgetting previews failed");
    }
    st.inner.previews.sandbox_gone(id);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cut_closes_what_was_opened_and_not_what_opens_after() {
        let live = Live::default();
        let first = live.token("s", 80);
        let same = live.token("s", 80);
        let other = live.token("s", 81);
        live.cut("s", 80);
        assert!(first.is_cancelled() && same.is_cancelled());
        assert!(!other.is_cancelled());
        assert!(!live.token("s", 80).is_cancelled());
    }

    #[test]
    fn a_gone_sandbox_closes_all_its_previews_only() {
        let live = Live::default();
        let a = live.token("a", 80);
        let a2 = live.token("a", 81);
        let b = live.token("b", 80);
        live.sandbox_gone("a");
        assert!(a.is_cancelled() && a2.is_cancelled());
        assert!(!b.is_cancelled());
    }

    #[test]
    fn a_preview_serves_at_most_its_share_at_once() {
        let live = Live::default();
        let a = live.slot("s", 80, 2).unwrap();
        let _b = live.slot("s", 80, 2).unwrap();
        assert!(live.slot("s", 80, 2).is_none());
        // Another port of the same sandbox has its own.
        assert!(live.slot("s", 81, 2).is_some());
        drop(a);
        assert!(live.slot("s", 80, 2).is_some());
    }
}
