//! The sandbox lifecycle as one transition function, in the manner of Cloud
//! Hypervisor's `VmState::valid_transition`: every edge the server may take
//! is a line of [`next`]; anything else is an [`InvalidTransition`] naming
//! both ends. `service::lifecycle` is the only code that moves a sandbox
//! along these edges.
//!
//! ```text
//!            Boot                     Pause           Suspended
//!  (create) ──────▶ starting ─Booted─▶ running ─────▶ pausing ─────▶ paused
//!                      │  ▲              │  ▲  ◀─PauseFailed─┘          │
//!            BootFailed│  │Restart       │  └──Woken── resuming ◀─Wake──┘
//!                      ▼  │        Stop  ▼            (WakeFailed: back to paused)
//!                    stopped ◀─Halted── stopping
//! ```
//! `Resize` moves a running, paused or stopped sandbox to `starting`: its
//! machine (if any) is ended keeping its disk, and it boots at its new shape.
//! `MachineGone` (the host lost the machine or its saved state) ends any
//! state with a machine in `stopped`; `Delete` ends every state in `stopped`.
//! After a restart of the server, `Recovered` (the machine still runs) and
//! `RecoveredSaved` (only a pause's saved state is left) settle the states
//! an earlier server left half-way.

pub(crate) use runtime_api::SandboxState;

/// What happens to a sandbox: a request (`Pause`), or the outcome of the
/// host call it started (`Paused`, `PauseFailed`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Event {
    /// A stopped persistent sandbox starts again (from its kept disk).
    Restart,
    /// It restarts at a new shape (`:resize`): from its disk, its programs
    /// ended.
    Resize,
    /// The machine booted or was restored.
    Booted,
    /// The machine did not come up.
    BootFailed,
    Pause,
    /// The host saved the machine's state and ended it.
    Suspended,
    /// The host could not pause: the machine runs on.
    PauseFailed,
    Wake,
    Woken,
    /// The host could not wake it: its saved state is kept.
    WakeFailed,
    Stop,
    /// The host shut the machine down.
    Halted,
    /// The host no longer has the machine or its saved state.
    MachineGone,
    /// The sandbox is deleted, whatever it was doing.
    Delete,
    /// A restart of the server found the machine still running.
    Recovered,
    /// A restart of the server found no machine but the saved state of a
    /// pause (that had happened) or wake (that had not).
    RecoveredSaved,
    /// Its node was not seen for too long: its peers record it stopped
    /// (docs/deploy.md, "A node that stays away").
    HostLost,
    /// Its node came back and its machine still runs (a persistent one).
    HostBack,
}

/// An edge the lifecycle does not have.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("a {from} sandbox cannot take {event:?}")]
pub(crate) struct InvalidTransition {
    pub from: SandboxState,
    pub event: Event,
}

/// The state after `event` in state `from`, or the refused edge.
pub(crate) fn next(from: SandboxState, event: Event) -> Result<SandboxState, InvalidTransition> {
    use Event::*;
    use SandboxState::*;
    let to = match (from, event) {
        (Stopped, Restart) => Starting,
        (Running | Paused | Stopped, Resize) => Starting,
        (Starting, Booted) => Running,
        (Starting, BootFailed) => Stopped,
        (Running, Pause) => Pausing,
        (Pausing, Suspended) => Paused,
        (Pausing, PauseFailed) => Running,
        (Paused, Wake) => Resuming,
        (Resuming, Woken) => Running,
        (Resuming, WakeFailed) => Paused,
        (Starting | Running | Pausing | Paused | Resuming, Stop) => Stopping,
        (Stopping, Halted) => Stopped,
        (Starting | Running | Pausing | Paused | Resuming, MachineGone) => Stopped,
        (_, Delete) => Stopped,
        (Starting | Running | Pausing | Resuming | Stopping, Recovered) => Running,
        (Pausing | Resuming, RecoveredSaved) => Paused,
        (Starting | Running | Pausing | Resuming | Stopping, HostLost) => Stopped,
        (Stopped, HostBack) => Running,
        (from, event) => return Err(InvalidTransition { from, event }),
    };
    Ok(to)
}

#[cfg(test)]
mod tests {
    use super::Event::*;
    use super::SandboxState::*;
    use super::*;

    const EVENTS: [Event; 18] = [
        Restart,
        Resize,
        Booted,
        BootFailed,
        Pause,
        Suspended,
        PauseFailed,
        Wake,
        Woken,
        WakeFailed,
        Stop,
        Halted,
        MachineGone,
        Delete,
        Recovered,
        RecoveredSaved,
        HostLost,
        HostBack,
    ];

    /// Every allowed edge, written out once more by hand: the table below
    /// and `next` must agree on all 7 × 16 pairs.
    const ALLOWED: &[(SandboxState, Event, SandboxState)] = &[
        (Stopped, Restart, Starting),
        (Running, Resize, Starting),
        (Paused, Resize, Starting),
        (Stopped, Resize, Starting),
        (Starting, Booted, Running),
        (Starting, BootFailed, Stopped),
        (Running, Pause, Pausing),
        (Pausing, Suspended, Paused),
        (Pausing, PauseFailed, Running),
        (Paused, Wake, Resuming),
        (Resuming, Woken, Running),
        (Resuming, WakeFailed, Paused),
        (Starting, Stop, Stopping),
        (Running, Stop, Stopping),
        (Pausing, Stop, Stopping),
        (Paused, Stop, Stopping),
        (Resuming, Stop, Stopping),
        (Stopping, Halted, Stopped),
        (Starting, MachineGone, Stopped),
        (Running, MachineGone, Stopped),
        (Pausing, MachineGone, Stopped),
        (Paused, MachineGone, Stopped),
        (Resuming, MachineGone, Stopped),
        (Starting, Delete, Stopped),
        (Running, Delete, Stopped),
        (Pausing, Delete, Stopped),
        (Paused, Delete, Stopped),
        (Resuming, Delete, Stopped),
        (Stopping, Delete, Stopped),
        (Stopped, Delete, Stopped),
        (Starting, Recovered, Running),
        (Running, Recovered, Running),
        (Pausing, Recovered, Running),
        (Resuming, Recovered, Running),
        (Stopping, Recovered, Running),
        (Pausing, RecoveredSaved, Paused),
        (Resuming, RecoveredSaved, Paused),
        (Starting, HostLost, Stopped),
        (Running, HostLost, Stopped),
        (Pausing, HostLost, Stopped),
        (Resuming, HostLost, Stopped),
        (Stopping, HostLost, Stopped),
        (Stopped, HostBack, Running),
    ];

    #[test]
    fn every_allowed_edge_leads_where_the_table_says() {
        for &(from, ev, to) in ALLOWED {
            assert_eq!(next(from, ev), Ok(to), "{from} + {ev:?}");
        }
    }

    #[test]
    fn every_other_edge_is_refused_naming_both_ends() {
        let mut refused = 0;
        for from in SandboxState::ALL {
            for ev in EVENTS {
                if ALLOWED.iter().any(|&(f, e, _)| f == from && e == ev) {
                    continue;
                }
                let err = next(from, ev).expect_err("a refused edge");
                assert_eq!(err, InvalidTransition { from, event: ev });
                assert!(err.to_string().contains(from.as_str()), "{err}");
                refused += 1;
            }
        }
        assert_eq!(refused, 7 * EVENTS.len() - ALLOWED.len());
    }

    #[test]
    fn some_edges_people_might_expect_do_not_exist() {
        // A stop under way is not paused, woken or booted out of.
        for ev in [Pause, Wake, Booted, Restart, Stop] {
            assert!(next(Stopping, ev).is_err(), "{ev:?}");
        }
        // Only a paused sandbox wakes; only a running one pauses.
        assert!(next(Running, Wake).is_err());
        assert!(next(Paused, Pause).is_err());
        // Only a stopped one restarts.
        assert!(next(Running, Restart).is_err());
        // A stopped sandbox has no machine to lose and nothing to stop.
        assert!(next(Stopped, MachineGone).is_err());
        assert!(next(Stopped, Stop).is_err());
    }
}
