//! Control messages. Host -> guest: [`Request`]; guest -> host: [`Reply`].
//! Both travel as JSON in [`crate::Kind::Control`] frames.

use serde::{Deserialize, Serialize};

/// Data channels of a stream ([`crate::Kind::Data`] frames).
pub mod channel {
    /// Host -> guest: a process's stdin, or the bytes of a file being written.
    /// Guest -> host: the bytes of a file being read.
    /// Both ways: the bytes of a TCP tunnel ([`crate::Request::Connect`],
    /// [`crate::Reply::Outbound`]).
    pub const INPUT: u8 = 0;
    pub const STDOUT: u8 = 1;
    pub const STDERR: u8 = 2;
    /// Guest -> host on a share stream ([`crate::Request::Share`]): a 9P
    /// request sent again after the host connection changed.
    pub const RESENT: u8 = 2;
}

/// Who a command or file operation runs as.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum User {
    /// uid 1000 `user`, `HOME=/workspace`.
    #[default]
    Sandbox,
    Root,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PtySize {
    pub cols: u16,
    pub rows: u16,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExecRequest {
    /// The program and its arguments; `argv[0]` is looked up in `PATH`.
    pub argv: Vec<String>,
    #[serde(default)]
    pub cwd: Option<String>,
    /// Environment on top of the agent's base environment, in order.
    #[serde(default)]
    pub env: Vec<(String, String)>,
    #[serde(default)]
    pub user: User,
    /// Kill the whole process group after this long; `None` = no limit.
    #[serde(default)]
    pub timeout_ms: Option<u64>,
    /// Keep stdin open for [`crate::channel::INPUT`] data until
    /// [`Request::CloseStdin`]; otherwise stdin is `/dev/null`.
    #[serde(default)]
    pub stdin: bool,
    /// Run on a pseudo-terminal of this size (stdout carries its output).
    #[serde(default)]
    pub pty: Option<PtySize>,
    /// When the command's main process exits, kill what it left in its
    /// process group (the documented behaviour of a foreground exec).
    #[serde(default)]
    pub kill_group_on_exit: bool,
    /// Record the files the command and what it starts open
    /// ([`Reply::Exited`] `files`). Only sent to agents of
    /// [`crate::TRACE_VERSION`] or later (an older one would ignore it).
    #[serde(default, skip_serializing_if = "is_false")]
    pub trace_files: bool,
}

fn is_false(b: &bool) -> bool {
    !*b
}

/// The files a traced command opened, as [`Reply::Exited`] reports them.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TracedFiles {
    /// Every file and directory it opened: absolute paths, symlinks
    /// resolved, directories ending in `/`, sorted.
    #[serde(default)]
    pub read: Vec<String>,
    /// Every file it opened for writing and closed, sorted.
    #[serde(default)]
    pub written: Vec<String>,
    /// Some paths are missing (a bound was reached, or the kernel's queue
    /// overflowed).
    #[serde(default)]
    pub truncated: bool,
}

/// A kind of change a watch reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WatchKind {
    Create,
    /// The file's contents changed (repeated writes are folded, with a count).
    Write,
    Remove,
    Rename,
    Chmod,
}

/// What [`Request::Watch`] watches, as whom.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WatchRequest {
    /// A directory (or a file), absolute.
    pub path: String,
    /// Its subdirectories too, including ones created later.
    #[serde(default)]
    pub recursive: bool,
    /// The kinds reported; empty = all.
    #[serde(default)]
    pub events: Vec<WatchKind>,
    /// Globs: only paths that match one are reported (empty = all).
    #[serde(default)]
    pub include: Vec<String>,
    /// Globs: paths that match one (and what is under them) are left out.
    #[serde(default)]
    pub exclude: Vec<String>,
    /// Events are gathered this long after the first of a batch.
    #[serde(default)]
    pub batch_ms: u32,
    /// At most this many inotify watches (directories); 0 = the agent's default.
    #[serde(default)]
    pub max_watches: u32,
    #[serde(default)]
    pub user: User,
}

/// One change seen by a watch.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WatchEvent {
    pub kind: WatchKind,
    pub path: String,
    /// A rename's earlier path.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub old_path: Option<String>,
    #[serde(default)]
    pub is_dir: bool,
    /// How many writes this one stands for (1 for the other kinds).
    #[serde(default = "one")]
    pub count: u32,
}

fn one() -> u32 {
    1
}

/// Events a watch could not report.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "k", rename_all = "snake_case")]
pub enum WatchNotice {
    /// Events were dropped: more than the watch reports a second, or the
    /// kernel's queue overflowed (`dropped` is 0 when unknown).
    Overflow { dropped: u64 },
    /// A directory was not watched: the watch has its most inotify watches
    /// (or the kernel refused one more).
    Limit { watches: u32, path: String },
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Request {
    /// First message on stream 0; the guest answers [`Reply::Hello`].
    ///
    /// `session` names the host's connection (random, non-zero). A `Hello`
    /// with a session other than the last one (or 0) means a new host
    /// connection (a restart of the server, a restore, a fork, a wake): the
    /// agent resets every TCP tunnel of the earlier one and drops their
    /// frames still queued. A `Hello` with the same session only releases
    /// output held since [`Request::Quiesce`] (its tunnels go on).
    Hello {
        version: u32,
        #[serde(default)]
        session: u64,
    },
    /// Liveness, stream 0 or any stream; answered by [`Reply::Pong`].
    Ping,
    /// Sets the clock, hostname and entropy: after boot and after every restore.
    Setup {
        hostname: String,
        unix_time_ms: u64,
        #[serde(default)]
        entropy: Vec<u8>,
        /// The sandbox's CA certificate (PEM): the agent installs it as
        /// `/usr/local/share/ca-certificates/runtime-egress.crt` and rebuilds
        /// `/etc/ssl/certs/ca-certificates.crt` as the pristine system bundle
        /// plus this CA (a later Setup replaces it, never appends).
        #[serde(default)]
        ca_pem: Option<String>,
        /// The JSON the agent writes to `/run/runtime/environment.json`
        /// (directory 0755, file 0644, replaced atomically); `None` keeps
        /// the file as it is.
        #[serde(default)]
        environment: Option<String>,
    },
    /// Starts a process on this stream: [`Reply::Started`], output data,
    /// then [`Reply::Exited`].
    Exec(ExecRequest),
    /// Ends the stdin of the process on this stream.
    CloseStdin,
    /// Sends a signal (a number) to the process group on this stream.
    Signal {
        signal: i32,
    },
    Resize {
        size: PtySize,
    },
    /// The file's bytes come back as INPUT data after [`Reply::FileStart`],
    /// then [`Reply::Done`].
    ///
    /// With `flow` (agents of [`crate::READ_FLOW_VERSION`] or later; an
    /// older one would ignore it) the bytes flow within credits as a
    /// tunnel's do ([`crate::flow`]): the agent's window starts at zero, the
    /// host opens it with a first [`Request::Credit`] of
    /// [`crate::flow::READ_WINDOW`] and grants more as its reader takes the
    /// bytes. A host that no longer wants the rest sends [`Request::Close`]:
    /// the agent stops reading and sends nothing more on the stream. An
    /// agent that sends beyond its window gets the same `Close` and what it
    /// sent is dropped.
    ReadFile {
        path: String,
        user: User,
        #[serde(default, skip_serializing_if = "is_false")]
        flow: bool,
    },
    /// INPUT data frames follow, then [`Request::EndWrite`]; the file is
    /// placed atomically (temp file + rename), parents created.
    WriteFile {
        path: String,
        mode: Option<u32>,
        user: User,
    },
    EndWrite,
    Stat {
        path: String,
        user: User,
    },
    List {
        path: String,
        depth: u32,
        hidden: bool,
        limit: u32,
        user: User,
    },
    Mkdir {
        path: String,
        parents: bool,
        user: User,
    },
    Remove {
        path: String,
        recursive: bool,
        user: User,
    },
    Rename {
        from: String,
        to: String,
        overwrite: bool,
        user: User,
    },
    Chmod {
        path: String,
        mode: u32,
        user: User,
    },
    /// Flushes file systems (before a snapshot or a stop).
    Sync,
    /// Before the host stops the machine (pause, capture): answered `Done`
    /// once every frame queued before it is written; the agent then holds
    /// further output (it queues, nothing is lost) until the next `Hello`,
    /// so no frame is in flight when the machine stops.
    Quiesce,
    /// Takes up an exec stream again after the host reconnected (a restart
    /// of the server): answered by [`Reply::Started`] if the process still
    /// runs (its output and `Exited` then follow on this stream as before),
    /// by its [`Reply::Exited`] if it ended meanwhile (kept for an hour), or
    /// `Failed` if the agent knows no process on this stream. Output the
    /// process wrote while no host listened is lost.
    Attach,
    /// Opens a TCP tunnel on this (host-chosen) stream to `127.0.0.1:port`
    /// in the guest (`[::1]:port` if that is refused). Answered by `Done`
    /// (connected) or `Failed` (`connection_refused` when nothing listens).
    /// After `Done` the stream is a tunnel: see [`crate::flow`] for the bytes,
    /// credits, half-close and reset.
    Connect {
        port: u16,
    },
    /// Tunnel (and flow-controlled read) flow control: the host delivered
    /// `bytes` more of the guest's bytes to its end; the guest may send that
    /// many more. The first `Credit` of a stream opens the guest's window
    /// ([`crate::flow::WINDOW`], [`crate::flow::READ_WINDOW`] for a read).
    Credit {
        bytes: u32,
    },
    /// Tunnel half-close: the host will send no more bytes on this stream
    /// (after the ones before it); the guest shuts down the socket's write
    /// side once it has written them.
    Eof,
    /// Tunnel reset: the host forgets the stream; the guest resets the socket
    /// at once (bytes not yet delivered are dropped). On a flow-controlled
    /// read: the agent stops the read and sends nothing more. On a
    /// [`Request::WriteFile`] before its `EndWrite` (agents of
    /// [`crate::READ_FLOW_VERSION`] or later): the write is abandoned, no
    /// file placed, answered `Failed`.
    Close,
    /// Watches a path on this stream: answered by [`Reply::Watching`] (or
    /// `Failed`), then [`Reply::WatchEvents`] batches, then one
    /// [`Reply::WatchEnded`]. A `Hello` of a new session ends every watch.
    Watch(WatchRequest),
    /// Ends the watch on this stream ([`Reply::WatchEnded`] `stopped`).
    Unwatch,
    /// Mounts a shared volume at `path` (made if missing): 9P2000.L served
    /// by the host, carried on this stream ([`crate::SHARE_VERSION`]). The
    /// agent pumps the mount's socket to the stream as INPUT data, whole 9P
    /// messages; requests it re-sends after a new host connection (those
    /// without a reply yet) travel on [`crate::channel::RESENT`]. Answered
    /// `Done` once mounted, or `Failed`. A `Share` of an `id` already
    /// mounted (after a pause and wake, or a restart of the server) joins
    /// the same mount to this stream again.
    Share {
        id: String,
        path: String,
    },
    /// Unmounts the share `id` (lazily if busy) and ends its pump; `Done`.
    Unshare {
        id: String,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EntryType {
    File,
    Directory,
    Symlink,
    Other,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Entry {
    pub name: String,
    pub path: String,
    #[serde(rename = "type")]
    pub kind: EntryType,
    pub size: u64,
    /// Permission bits (e.g. 0o644).
    pub mode: u32,
    /// Seconds since the epoch.
    pub modified: i64,
}

/// Why a request failed, as the API names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FailCode {
    FileNotFound,
    IsADirectory,
    NotADirectory,
    PermissionDenied,
    AlreadyExists,
    DirectoryNotEmpty,
    InvalidPath,
    CommandNotFound,
    BadRequest,
    Io,
    /// Nothing accepted the connection ([`Request::Connect`]).
    ConnectionRefused,
    /// A file larger than a read takes ([`crate::MAX_READ_BYTES`]).
    TooLarge,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "ev", rename_all = "snake_case")]
pub enum Reply {
    Hello {
        version: u32,
        agent: String,
    },
    Pong,
    Started {
        pid: u32,
    },
    Exited {
        /// `None` when killed by a signal or timed out.
        exit_code: Option<i32>,
        signal: Option<i32>,
        timed_out: bool,
        duration_ms: u64,
        #[serde(default)]
        out_of_memory: bool,
        /// How many of its processes (it, or what it started) the kernel
        /// killed for memory.
        #[serde(default)]
        oom_kills: u32,
        /// What it opened, when it ran with [`ExecRequest::trace_files`].
        #[serde(default, skip_serializing_if = "Option::is_none")]
        files: Option<TracedFiles>,
    },
    /// Before the bytes of a read file.
    FileStart {
        size: u64,
    },
    Stat {
        entry: Option<Entry>,
    },
    Listing {
        entries: Vec<Entry>,
        truncated: bool,
    },
    Removed {
        removed: bool,
    },
    /// A request finished with nothing more to say.
    Done,
    Failed {
        code: FailCode,
        message: String,
    },
    /// The first frame of a guest-opened stream (its id has
    /// [`crate::GUEST_STREAM`] set): a process in the guest connected to the
    /// agent's proxy port (`127.0.0.1:10800`). The stream is a tunnel from
    /// here on: the host grants the guest's first window with
    /// [`Request::Credit`] (or refuses with [`Request::Close`]), then raw bytes
    /// flow both ways; the agent does not interpret them.
    Outbound,
    /// Tunnel flow control, the guest's side of [`Request::Credit`].
    Credit {
        bytes: u32,
    },
    /// Tunnel half-close: the guest's socket reached end-of-file.
    Eof,
    /// Tunnel reset: the socket failed or was reset, or the stream is not
    /// known (any more) to the agent.
    Close,
    /// A watch runs, with this many inotify watches.
    Watching {
        watches: u32,
    },
    /// A batch of a watch's changes, and what it missed.
    WatchEvents {
        events: Vec<WatchEvent>,
        #[serde(default)]
        notices: Vec<WatchNotice>,
    },
    /// The watch ended: `stopped` ([`Request::Unwatch`] or a new host
    /// session), `root-removed`, or `failed`. Its last frame.
    WatchEnded {
        reason: String,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Freezes the wire names: changing one breaks older agents or hosts.
    #[test]
    fn message_names_are_frozen() {
        let req = Request::Exec(ExecRequest {
            argv: vec!["true".into()],
            cwd: None,
            env: vec![],
            user: User::Sandbox,
            timeout_ms: Some(5),
            stdin: false,
            pty: None,
            kill_group_on_exit: true,
            trace_files: false,
        });
        let json = serde_json::to_string(&req).unwrap();
        assert_eq!(
            json,
            r#"{"op":"exec","argv":["true"],"cwd":null,"env":[],"user":"sandbox","timeout_ms":5,"stdin":false,"pty":null,"kill_group_on_exit":true}"#
        );
        let names: Vec<String> = [
            Request::Hello {
                version: 1,
                session: 7,
            },
            Request::Ping,
            Request::CloseStdin,
            Request::EndWrite,
            Request::Sync,
            Request::Attach,
            Request::Quiesce,
            Request::Connect { port: 80 },
            Request::Credit { bytes: 1 },
            Request::Eof,
            Request::Close,
        ]
        .iter()
        .map(|r| {
            serde_json::to_value(r).unwrap()["op"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect();
        assert_eq!(
            names,
            [
                "hello",
                "ping",
                "close_stdin",
                "end_write",
                "sync",
                "attach",
                "quiesce",
                "connect",
                "credit",
                "eof",
                "close"
            ]
        );
        let evs: Vec<String> = [
            Reply::Outbound,
            Reply::Credit { bytes: 1 },
            Reply::Eof,
            Reply::Close,
        ]
        .iter()
        .map(|r| {
            serde_json::to_value(r).unwrap()["ev"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect();
        assert_eq!(evs, ["outbound", "credit", "eof", "close"]);
        assert_eq!(
            serde_json::to_string(&Request::Connect { port: 8000 }).unwrap(),
            r#"{"op":"connect","port":8000}"#
        );
        assert_eq!(
            serde_json::to_string(&Reply::Credit { bytes: 65536 }).unwrap(),
            r#"{"ev":"credit","bytes":65536}"#
        );
        assert_eq!(
            serde_json::to_string(&Reply::Failed {
                code: FailCode::ConnectionRefused,
                message: String::new()
            })
            .unwrap(),
            r#"{"ev":"failed","code":"connection_refused","message":""}"#
        );
        let reply = Reply::Failed {
            code: FailCode::IsADirectory,
            message: "x".into(),
        };
        assert_eq!(
            serde_json::to_string(&reply).unwrap(),
            r#"{"ev":"failed","code":"is_a_directory","message":"x"}"#
        );
    }

    #[test]
    fn watch_messages_are_frozen_and_their_options_optional() {
        let r: Request = serde_json::from_str(r#"{"op":"watch","path":"/w"}"#).unwrap();
        match r {
            Request::Watch(w) => {
                assert_eq!(w.path, "/w");
                assert!(!w.recursive && w.events.is_empty() && w.batch_ms == 0);
                assert_eq!(w.user, User::Sandbox);
            }
            other => panic!("unexpected {other:?}"),
        }
        assert_eq!(
            serde_json::to_string(&Request::Unwatch).unwrap(),
            r#"{"op":"unwatch"}"#
        );
        let batch = Reply::WatchEvents {
            events: vec![WatchEvent {
                kind: WatchKind::Rename,
                path: "/w/b".into(),
                old_path: Some("/w/a".into()),
                is_dir: false,
                count: 1,
            }],
            notices: vec![WatchNotice::Overflow { dropped: 3 }],
        };
        assert_eq!(
            serde_json::to_string(&batch).unwrap(),
            r#"{"ev":"watch_events","events":[{"kind":"rename","path":"/w/b","old_path":"/w/a","is_dir":false,"count":1}],"notices":[{"k":"overflow","dropped":3}]}"#
        );
        let e: WatchEvent = serde_json::from_str(r#"{"kind":"write","path":"/x"}"#).unwrap();
        assert_eq!(e.count, 1);
        assert_eq!(
            serde_json::to_string(&Reply::WatchEnded {
                reason: "root-removed".into()
            })
            .unwrap(),
            r#"{"ev":"watch_ended","reason":"root-removed"}"#
        );
    }

    #[test]
    fn new_optional_fields_may_be_missing() {
        let r: Request = serde_json::from_str(r#"{"op":"hello","version":1}"#).unwrap();
        assert_eq!(
            r,
            Request::Hello {
                version: 1,
                session: 0
            }
        );
        let r: Request =
            serde_json::from_str(r#"{"op":"setup","hostname":"h","unix_time_ms":1}"#).unwrap();
        assert!(matches!(r, Request::Setup { ca_pem: None, .. }));
        let r: Request = serde_json::from_str(r#"{"op":"exec","argv":["ls"]}"#).unwrap();
        match r {
            Request::Exec(e) => {
                assert_eq!(e.user, User::Sandbox);
                assert!(!e.stdin && e.timeout_ms.is_none() && !e.trace_files);
            }
            other => panic!("unexpected {other:?}"),
        }
        // An exit of an agent before traced files has none.
        let r: Reply = serde_json::from_str(
            r#"{"ev":"exited","exit_code":0,"signal":null,"timed_out":false,"duration_ms":1}"#,
        )
        .unwrap();
        assert!(matches!(r, Reply::Exited { files: None, .. }));
    }

    #[test]
    fn traced_files_travel_on_the_exec_and_its_exit() {
        let req = Request::Exec(ExecRequest {
            argv: vec!["true".into()],
            cwd: None,
            env: vec![],
            user: User::Root,
            timeout_ms: None,
            stdin: false,
            pty: None,
            kill_group_on_exit: false,
            trace_files: true,
        });
        assert!(serde_json::to_string(&req)
            .unwrap()
            .ends_with(r#","kill_group_on_exit":false,"trace_files":true}"#));
        let exited = Reply::Exited {
            exit_code: Some(0),
            signal: None,
            timed_out: false,
            duration_ms: 1,
            out_of_memory: false,
            oom_kills: 0,
            files: Some(TracedFiles {
                read: vec!["/etc/".into()],
                written: vec!["/tmp/x".into()],
                truncated: false,
            }),
        };
        assert_eq!(
            serde_json::to_string(&exited).unwrap(),
            r#"{"ev":"exited","exit_code":0,"signal":null,"timed_out":false,"duration_ms":1,"out_of_memory":false,"oom_kills":0,"files":{"read":["/etc/"],"written":["/tmp/x"],"truncated":false}}"#
        );
    }
}
