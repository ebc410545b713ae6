//! Exec event pumps: a process's stream becomes an [`ExecHandle`], guest
//! frames its events and its controls frames to the guest.

use runtime_proto::{channel, Reply, Request};
use tokio::sync::mpsc;

use crate::convert::{exit_status, pty_size};
use crate::link::Incoming;
use crate::types::{ExecControl, ExecEvent, ExecHandle, ExitStatus, WatchHandle, WatchUpdate};

/// Turns an exec stream into an [`ExecHandle`]: guest frames become events,
/// controls become frames.
pub(crate) fn pump(stream: crate::link::Stream, pid: u32) -> ExecHandle {
    pump_after(stream, pid, Vec::new())
}

/// [`pump`], with output that arrived before the reply that started it (an
/// attach receives what the agent held across a pause first).
pub(crate) fn pump_after(
    mut stream: crate::link::Stream,
    pid: u32,
    early: Vec<ExecEvent>,
) -> ExecHandle {
    let token = u64::from(stream.id);
    let (ev_tx, ev_rx) = mpsc::channel(64);
    let (ctl_tx, mut ctl_rx) = mpsc::channel::<ExecControl>(64);
    let sender = stream.sender();
    tokio::spawn(async move {
        for ev in early {
            if ev_tx.send(ev).await.is_err() {
                break;
            }
        }
        let mut ctl_open = true;
        loop {
            tokio::select! {
                inc = stream.recv() => {
                    let ev = match inc {
                        Some(Incoming::Data { channel: channel::STDOUT, bytes }) => ExecEvent::Stdout(bytes),
                        Some(Incoming::Data { channel: channel::STDERR, bytes }) => ExecEvent::Stderr(bytes),
                        Some(Incoming::Data { .. }) => continue,
                        Some(Incoming::Reply(r @ Reply::Exited { .. })) => {
                            if let Some(status) = exit_status(r) {
                                let _ = ev_tx.send(ExecEvent::Exited(status)).await;
                            }
                            break;
                        }
                        Some(Incoming::Reply(_)) => continue,
                        None => break,
                    };
                    if ev_tx.send(ev).await.is_err() {
                        // Nobody listens any more; keep draining so the
                        // stream's route does not pile up.
                        continue;
                    }
                }
                ctl = ctl_rx.recv(), if ctl_open => {
                    let r = match ctl {
                        Some(ExecControl::Stdin(b)) => sender.send_data(&b).await,
                        Some(ExecControl::CloseStdin) => sender.send(&Request::CloseStdin),
                        Some(ExecControl::Signal(s)) => sender.send(&Request::Signal { signal: s }),
                        Some(ExecControl::Resize(t)) => sender.send(&Request::Resize { size: pty_size(t) }),
                        None => { ctl_open = false; Ok(()) }
                    };
                    if r.is_err() { break; }
                }
            }
        }
    });
    ExecHandle {
        pid,
        token,
        events: ev_rx,
        control: ctl_tx,
    }
}

/// The reply on `stream`, and the output that came before it (an attach:
/// what the agent held across a pause may come before the answer); `None`
/// when the link closed.
/// Most output kept from before a process's reply ([`reply_after_output`]).
const EARLY_BYTES: usize = 1 << 20;

pub(crate) async fn reply_after_output(
    stream: &mut crate::link::Stream,
) -> Option<(Reply, Vec<ExecEvent>)> {
    let mut early = Vec::new();
    let mut held = 0usize;
    loop {
        let ev = match stream.recv().await? {
            Incoming::Reply(r) => return Some((r, early)),
            Incoming::Data {
                channel: channel::STDOUT,
                bytes,
            } => ExecEvent::Stdout(bytes),
            Incoming::Data {
                channel: channel::STDERR,
                bytes,
            } => ExecEvent::Stderr(bytes),
            Incoming::Data { .. } => continue,
        };
        // The agent sends the reply first; a guest that does not is not
        // believed beyond a bound.
        if let ExecEvent::Stdout(b) | ExecEvent::Stderr(b) = &ev {
            held += b.len();
        }
        if held <= EARLY_BYTES {
            early.push(ev);
        }
    }
}

/// The handle of a process that ended already: its exit only.
pub(crate) fn exited(token: u64, status: ExitStatus) -> ExecHandle {
    let (ev_tx, ev_rx) = mpsc::channel(1);
    let (ctl_tx, _) = mpsc::channel(1);
    let _ = ev_tx.try_send(ExecEvent::Exited(status));
    ExecHandle {
        pid: 0,
        token,
        events: ev_rx,
        control: ctl_tx,
    }
}

/// Most updates waiting for the control plane; the guest's frames wait in
/// the link behind them (its watch is bounded by its rate).
const WATCH_QUEUE: usize = 64;

/// Turns a watch's stream into a [`WatchHandle`]: batches become updates
/// until its `WatchEnded`; a stop (or the handle's end) sends `Unwatch`.
pub(crate) fn watch_pump(mut stream: crate::link::Stream, watches: u32) -> WatchHandle {
    let (tx, rx) = mpsc::channel(WATCH_QUEUE);
    let (stop_tx, mut stop_rx) = mpsc::channel::<()>(1);
    let sender = stream.sender();
    tokio::spawn(async move {
        let mut stop_open = true;
        loop {
            tokio::select! {
                inc = stream.recv() => match inc {
                    Some(Incoming::Reply(Reply::WatchEvents { events, notices })) => {
                        let update = WatchUpdate::Batch {
                            changes: events.into_iter().map(crate::convert::change).collect(),
                            misses: notices.into_iter().map(crate::convert::miss).collect(),
                        };
                        if tx.send(update).await.is_err() && stop_open {
                            // Nobody reads it any more: end it in the guest.
                            stop_open = false;
                            let _ = sender.send(&Request::Unwatch);
                        }
                    }
                    Some(Incoming::Reply(Reply::WatchEnded { reason })) => {
                        let _ = tx.send(WatchUpdate::Ended { reason }).await;
                        break;
                    }
                    Some(_) => continue,
                    None => {
                        let _ = tx.send(WatchUpdate::Ended { reason: "lost".into() }).await;
                        break;
                    }
                },
                _ = stop_rx.recv(), if stop_open => {
                    // A stop, or the handle's sender dropped: either way it ends.
                    stop_open = false;
                    if sender.send(&Request::Unwatch).is_err() {
                        let _ = tx.send(WatchUpdate::Ended { reason: "lost".into() }).await;
                        break;
                    }
                }
            }
        }
        sender.ended();
    });
    WatchHandle {
        watches,
        updates: rx,
        stop: stop_tx,
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use std::time::Duration;

    use runtime_proto::{Kind, PtySize};

    use super::*;
    use crate::fake_guest::Guest;
    use crate::types::TermSize;

    fn status(code: i32) -> ExitStatus {
        ExitStatus {
            code: Some(code),
            signal: None,
            timed_out: false,
            duration_ms: 12,
            oom_kills: 0,
            files: None,
        }
    }

    fn exited_reply(code: i32) -> Reply {
        Reply::Exited {
            exit_code: Some(code),
            signal: None,
            timed_out: false,
            duration_ms: 12,
            out_of_memory: false,
            oom_kills: 0,
            files: None,
        }
    }

    async fn next(h: &mut ExecHandle) -> Option<ExecEvent> {
        tokio::time::timeout(Duration::from_secs(5), h.events.recv())
            .await
            .expect("an event in time")
    }

    #[tokio::test]
    async fn a_pump_turns_frames_into_events_and_controls_into_frames() {
        let (link, mut guest) = Guest::linked().await;
        let stream = link.open().unwrap();
        stream.send(&Request::Attach).unwrap();
        let (sid, _) = guest.request().await.unwrap();
        let mut h = pump_after(stream, 9, vec![ExecEvent::Stdout(b"held".to_vec())]);
        assert_eq!((h.pid, h.token), (9, u64::from(sid)));

        h.control
            .send(ExecControl::Stdin(b"input".to_vec()))
            .await
            .unwrap();
        let f = guest.stream_frame().await.unwrap();
        assert_eq!(
            (f.stream, f.kind, f.channel),
            (sid, Kind::Data, channel::INPUT)
        );
        assert_eq!(f.payload, b"input");
        for (ctl, want) in [
            (ExecControl::Signal(15), Request::Signal { signal: 15 }),
            (
                ExecControl::Resize(TermSize {
                    cols: 100,
                    rows: 30,
                }),
                Request::Resize {
                    size: PtySize {
                        cols: 100,
                        rows: 30,
                    },
                },
            ),
            (ExecControl::CloseStdin, Request::CloseStdin),
        ] {
            h.control.send(ctl).await.unwrap();
            assert_eq!(guest.request().await.unwrap(), (sid, want));
        }

        guest.output(sid, channel::STDOUT, b"out").await;
        guest.output(sid, 7, b"not a channel of a process").await;
        guest.output(sid, channel::STDERR, b"err").await;
        guest.reply(sid, &Reply::Pong).await;
        guest.reply(sid, &exited_reply(3)).await;
        assert_eq!(
            next(&mut h).await,
            Some(ExecEvent::Stdout(b"held".to_vec()))
        );
        assert_eq!(next(&mut h).await, Some(ExecEvent::Stdout(b"out".to_vec())));
        assert_eq!(next(&mut h).await, Some(ExecEvent::Stderr(b"err".to_vec())));
        assert_eq!(next(&mut h).await, Some(ExecEvent::Exited(status(3))));
        // Nothing after the exit.
        assert_eq!(next(&mut h).await, None);
    }

    #[tokio::test]
    async fn a_pump_ends_with_the_link() {
        let (link, mut guest) = Guest::linked().await;
        let stream = link.open().unwrap();
        stream.send(&Request::Attach).unwrap();
        let (sid, _) = guest.request().await.unwrap();
        let mut h = pump(stream, 1);
        guest.output(sid, channel::STDOUT, b"last words").await;
        assert_eq!(
            next(&mut h).await,
            Some(ExecEvent::Stdout(b"last words".to_vec()))
        );
        link.close();
        assert_eq!(next(&mut h).await, None);
    }

    #[tokio::test]
    async fn output_before_the_reply_is_kept() {
        let (link, mut guest) = Guest::linked().await;
        let mut stream = link.open().unwrap();
        stream.send(&Request::Attach).unwrap();
        let (sid, _) = guest.request().await.unwrap();
        guest.output(sid, channel::STDERR, b"e").await;
        guest.output(sid, channel::INPUT, b"ignored").await;
        guest.output(sid, channel::STDOUT, b"o").await;
        guest.reply(sid, &Reply::Started { pid: 4 }).await;
        let (reply, early) = reply_after_output(&mut stream).await.unwrap();
        assert_eq!(reply, Reply::Started { pid: 4 });
        assert_eq!(
            early,
            [
                ExecEvent::Stderr(b"e".to_vec()),
                ExecEvent::Stdout(b"o".to_vec())
            ]
        );
        link.close();
        assert_eq!(reply_after_output(&mut stream).await, None);
    }

    #[tokio::test]
    async fn an_ended_process_has_only_its_exit() {
        let mut h = exited(77, status(0));
        assert_eq!((h.pid, h.token), (0, 77));
        assert_eq!(next(&mut h).await, Some(ExecEvent::Exited(status(0))));
        assert_eq!(next(&mut h).await, None);
        assert!(h.control.send(ExecControl::CloseStdin).await.is_err());
    }

    #[tokio::test]
    async fn a_watch_pump_turns_batches_into_updates_and_a_stop_into_unwatch() {
        let (link, mut guest) = Guest::linked().await;
        let stream = link.open().unwrap();
        stream.send(&Request::Ping).unwrap();
        let (sid, _) = guest.request().await.unwrap();
        let mut h = watch_pump(stream, 3);
        assert_eq!(h.watches, 3);
        // The fake answers Hello with version 1: `Host::watch` would refuse it.
        assert_eq!(link.peer_version(), 1);
        let event = runtime_proto::WatchEvent {
            kind: runtime_proto::WatchKind::Rename,
            path: "/w/b".into(),
            old_path: Some("/w/a".into()),
            is_dir: false,
            count: 0,
        };
        guest
            .reply(
                sid,
                &Reply::WatchEvents {
                    events: vec![event],
                    notices: vec![runtime_proto::WatchNotice::Overflow { dropped: 7 }],
                },
            )
            .await;
        let got = tokio::time::timeout(Duration::from_secs(5), h.updates.recv())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(
            got,
            WatchUpdate::Batch {
                changes: vec![crate::types::Change {
                    kind: crate::types::ChangeKind::Rename,
                    path: "/w/b".into(),
                    old_path: Some("/w/a".into()),
                    is_dir: false,
                    count: 1,
                }],
                misses: vec![crate::types::WatchMiss::Overflow { dropped: 7 }],
            }
        );
        h.stop.send(()).await.unwrap();
        let (s, req) = guest.request().await.unwrap();
        assert_eq!((s, req), (sid, Request::Unwatch));
        guest
            .reply(
                sid,
                &Reply::WatchEnded {
                    reason: "stopped".into(),
                },
            )
            .await;
        let end = tokio::time::timeout(Duration::from_secs(5), h.updates.recv())
            .await
            .unwrap();
        assert_eq!(
            end,
            Some(WatchUpdate::Ended {
                reason: "stopped".into()
            })
        );
        assert_eq!(h.updates.recv().await, None);
        // The link going away ends a watch as `lost`.
        let stream = link.open().unwrap();
        let mut h = watch_pump(stream, 1);
        drop(guest);
        let end = tokio::time::timeout(Duration::from_secs(5), h.updates.recv())
            .await
            .unwrap();
        assert_eq!(
            end,
            Some(WatchUpdate::Ended {
                reason: "lost".into()
            })
        );
    }
}
