//! Lifecycle events (docs/api.md#events): their type names, which sandbox
//! transition makes which, the opaque cursor of `GET /v1/events`, and the
//! bounds of the log.

use crate::domain::lifecycle::{Event, SandboxState};

/// The types a webhook may subscribe to, as the product names them, plus
/// `sandbox.deleted` (this server's: a delete is the end of the record, not
/// only of the machine).
pub(crate) const TYPES: &[&str] = &[
    "sandbox.created",
    "sandbox.running",
    "sandbox.paused",
    "sandbox.woken",
    "sandbox.stopped",
    "sandbox.start_failed",
    "sandbox.wake_failed",
    "sandbox.deleted",
    "sandbox.files.changed",
    "snapshot.ready",
    "snapshot.failed",
    "snapshot.deleted",
    "volume.ready",
    "volume.failed",
    "volume.deleted",
];

/// The type of the signed test a webhook's `:test` sends (never logged).
pub(crate) const TEST_TYPE: &str = "webhook.test";

/// How long an event (and a finished delivery) is kept.
pub(crate) const KEEP_MS: i64 = 14 * 24 * 3600 * 1000;
/// Most events kept on the server, whatever their age: the oldest go first.
pub(crate) const MAX_EVENTS: i64 = 200_000;
/// Most deliveries kept on the server, whatever their age.
pub(crate) const MAX_DELIVERIES: i64 = 200_000;
pub(crate) const DEFAULT_LIMIT: i64 = 50;
pub(crate) const MAX_LIMIT: i64 = 200;

/// The events a sandbox's move from `from` along `event` makes, in order.
/// A delete of a live sandbox is a stop, then `sandbox.deleted`; the
/// delete's own event is added by the caller.
pub(crate) fn sandbox_types(from: SandboxState, event: Event) -> &'static [&'static str] {
    use Event::*;
    use SandboxState::*;
    match (from, event) {
        (Starting, Booted) | (Starting, Recovered) => &["sandbox.running"],
        (Starting, BootFailed) => &["sandbox.start_failed", "sandbox.stopped"],
        (Pausing, Suspended) | (Pausing, RecoveredSaved) => &["sandbox.paused"],
        (Resuming, Woken) | (Resuming, Recovered) => &["sandbox.woken"],
        (Resuming, WakeFailed) => &["sandbox.wake_failed"],
        (Resuming, MachineGone) => &["sandbox.wake_failed", "sandbox.stopped"],
        (Stopping, Halted) => &["sandbox.stopped"],
        (Starting | Running | Pausing | Paused, MachineGone) => &["sandbox.stopped"],
        (Starting | Running | Pausing | Resuming | Stopping, HostLost) => &["sandbox.stopped"],
        (Stopped, HostBack) => &["sandbox.running"],
        (Starting | Running | Pausing | Paused | Resuming | Stopping, Delete) => {
            &["sandbox.stopped"]
        }
        _ => &[],
    }
}

/// Whether a webhook subscribed to `filter` (empty: every type) gets `ty`.
pub(crate) fn wanted(filter: &[String], ty: &str) -> bool {
    filter.is_empty() || filter.iter().any(|f| f == ty)
}

/// The prefix of this list's cursors (`domain::cursor`).
pub(crate) const CURSOR_PREFIX: &str = "e";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transitions_make_the_products_events() {
        use Event::*;
        use SandboxState::*;
        assert_eq!(sandbox_types(Starting, Booted), ["sandbox.running"]);
        assert_eq!(
            sandbox_types(Starting, BootFailed),
            ["sandbox.start_failed", "sandbox.stopped"]
        );
        assert_eq!(sandbox_types(Pausing, Suspended), ["sandbox.paused"]);
        assert_eq!(sandbox_types(Running, HostLost), ["sandbox.stopped"]);
        assert_eq!(sandbox_types(Stopped, HostBack), ["sandbox.running"]);
        assert_eq!(sandbox_types(Resuming, Woken), ["sandbox.woken"]);
        assert_eq!(sandbox_types(Resuming, WakeFailed), ["sandbox.wake_failed"]);
        assert_eq!(sandbox_types(Stopping, Halted), ["sandbox.stopped"]);
        assert_eq!(sandbox_types(Paused, Delete), ["sandbox.stopped"]);
        // Requests alone, and a delete of a stopped sandbox, make none.
        assert!(sandbox_types(Running, Pause).is_empty());
        assert!(sandbox_types(Running, Stop).is_empty());
        assert!(sandbox_types(Stopped, Delete).is_empty());
        assert!(sandbox_types(Pausing, PauseFailed).is_empty());
        for t in [
            Booted, BootFailed, Suspended, Woken, WakeFailed, Halted, Delete,
        ] {
            for s in [
                Starting, Running, Pausing, Paused, Resuming, Stopping, Stopped,
            ] {
                for ty in sandbox_types(s, t) {
                    assert!(TYPES.contains(ty), "{ty}");
                }
            }
        }
    }

    #[test]
    fn an_empty_filter_wants_every_type() {
        assert!(wanted(&[], "sandbox.paused"));
        let f = vec!["sandbox.stopped".to_string()];
        assert!(wanted(&f, "sandbox.stopped"));
        assert!(!wanted(&f, "sandbox.paused"));
    }
}
