//! The pump: one owned task per process handle that moves the host's
//! events into the process's output and records its end.

use std::sync::Arc;
use std::time::Duration;

use runtime_host::{ExecEvent, ExitStatus};
use tokio::sync::mpsc;

use crate::domain::process::{Exit, TracedFiles};
use crate::service::processes::table::{Link, Proc};
use crate::AppState;

/// The host's exit status as the process's end.
pub(super) fn exit_of(status: ExitStatus) -> Exit {
    Exit {
        code: status.code,
        signal: status.signal,
        timed_out: status.timed_out,
        duration_ms: status.duration_ms,
        oom_kills: status.oom_kills,
        lost: false,
        files: status.files.map(|f| {
            std::sync::Arc::new(TracedFiles {
                read: f.read,
                written: f.written,
                truncated: f.truncated,
            })
        }),
    }
}

/// Moves the host's events into the process until it ends, or until its
/// handle closes during a pause (it is then `Detached`); writes the output
/// count to the store at most every second, when it detaches and when the
/// server shuts down, so a restart continues the offsets. `generation` is
/// the process's attach count when this handle was taken.
pub(super) fn pump(
    st: &AppState,
    p: Arc<Proc>,
    generation: u64,
    mut events: mpsc::Receiver<ExecEvent>,
) {
    let st2 = st.clone();
    let cancel = st.inner.cancel.clone();
    st.spawn(async move {
        let store = st2.store();
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let ev = tokio::select! {
                ev = events.recv() => ev,
                _ = tick.tick() => {
                    p.flush_output(store);
                    continue;
                }
                _ = cancel.cancelled() => {
                    p.flush_output(store);
                    return;
                }
            };
            let current = match ev {
                Some(ExecEvent::Stdout(b)) => p.ingest(generation, false, b),
                Some(ExecEvent::Stderr(b)) => p.ingest(generation, true, b),
                Some(ExecEvent::Exited(status)) => {
                    if p.state().generation == generation {
                        p.finish(store, st2.now_ms(), exit_of(status));
                        p.bump();
                    }
                    return;
                }
                None => {
                    let detached = {
                        let mut s = p.state();
                        if s.generation != generation {
                            return;
                        }
                        if s.link == Link::Detaching {
                            s.link = Link::Detached;
                        }
                        s.link == Link::Detached
                    };
                    if detached {
                        tracing::debug!(process_id = %p.id, "process detached for a pause");
                        p.flush_output(store);
                    } else {
                        tracing::warn!(process_id = %p.id, "lost the process's event stream");
                        p.lose(store, st2.now_ms());
                    }
                    p.bump();
                    return;
                }
            };
            if !current {
                return;
            }
            p.bump();
        }
    });
}
