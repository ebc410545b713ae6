//! Between the guest protocol's types (`runtime-proto`) and the host's
//! ([`crate::types`]): requests built from the host's specs, and replies
//! turned into the host's results and errors.

use runtime_proto::{Entry, EntryType, ExecRequest, FailCode, PtySize, Reply, Request, User};

/// Most paths kept of each list a guest reports for a traced command.
pub(crate) const MAX_TRACED_PATHS: usize = 10_000;
/// The longest path kept of a traced command (Linux's `PATH_MAX`).
const MAX_TRACED_PATH: usize = 4096;

use crate::types::*;

fn failure(code: FailCode) -> GuestFailure {
    match code {
        FailCode::FileNotFound => GuestFailure::FileNotFound,
        FailCode::IsADirectory => GuestFailure::IsADirectory,
        FailCode::NotADirectory => GuestFailure::NotADirectory,
        FailCode::PermissionDenied => GuestFailure::PermissionDenied,
        FailCode::AlreadyExists => GuestFailure::AlreadyExists,
        FailCode::DirectoryNotEmpty => GuestFailure::DirectoryNotEmpty,
        FailCode::InvalidPath => GuestFailure::InvalidPath,
        FailCode::CommandNotFound => GuestFailure::CommandNotFound,
        FailCode::BadRequest => GuestFailure::BadRequest,
        FailCode::Io => GuestFailure::Io,
        FailCode::ConnectionRefused => GuestFailure::ConnectionRefused,
        FailCode::TooLarge => GuestFailure::TooLarge,
    }
}

pub(crate) fn user(u: RunAs) -> User {
    match u {
        RunAs::Sandbox => User::Sandbox,
        RunAs::Root => User::Root,
    }
}

pub(crate) fn pty_size(t: TermSize) -> PtySize {
    PtySize {
        cols: t.cols,
        rows: t.rows,
    }
}

fn entry(e: Entry) -> FileEntry {
    FileEntry {
        name: e.name,
        path: e.path,
        kind: match e.kind {
            EntryType::File => EntryKind::File,
            EntryType::Directory => EntryKind::Directory,
            EntryType::Symlink => EntryKind::Symlink,
            EntryType::Other => EntryKind::Other,
        },
        size: e.size,
        mode: e.mode,
        modified: e.modified,
    }
}

/// A reply that is not the one expected, as the error of machine `id`.
pub(crate) fn guest_err(id: &str, r: Reply) -> HostError {
    match r {
        Reply::Failed { code, message } => HostError::Guest {
            id: id.to_owned(),
            failure: failure(code),
            message,
        },
        other => HostError::Guest {
            id: id.to_owned(),
            failure: GuestFailure::Io,
            message: format!("unexpected reply {other:?}"),
        },
    }
}

pub(crate) fn exec_request(spec: ExecSpec) -> ExecRequest {
    ExecRequest {
        argv: spec.argv,
        cwd: spec.cwd,
        env: spec.env,
        user: user(spec.user),
        timeout_ms: spec.timeout.map(|t| t.as_millis() as u64),
        stdin: spec.stdin,
        pty: spec.pty.map(pty_size),
        kill_group_on_exit: spec.kill_group_on_exit,
        trace_files: spec.trace_files,
    }
}

/// The exit status an `Exited` reply reports; `None` for another reply.
pub(crate) fn exit_status(reply: Reply) -> Option<ExitStatus> {
    match reply {
        Reply::Exited {
            exit_code,
            signal,
            timed_out,
            duration_ms,
            out_of_memory,
            oom_kills,
            files,
        } => Some(ExitStatus {
            code: exit_code,
            signal,
            timed_out,
            duration_ms,
            oom_kills: oom_kills.max(u32::from(out_of_memory)),
            files: files.map(traced_files),
        }),
        _ => None,
    }
}

/// A guest's list of traced files, not trusted: only absolute paths of at
/// most `PATH_MAX` bytes without NUL are kept, sorted, without repeats, at
/// most [`MAX_TRACED_PATHS`] of each list; what is dropped makes it
/// `truncated`.
pub(crate) fn traced_files(f: runtime_proto::TracedFiles) -> TracedFiles {
    let mut truncated = f.truncated;
    let mut clean = |list: Vec<String>| {
        let n = list.len();
        let mut v: Vec<String> = list
            .into_iter()
            .filter(|p| p.starts_with('/') && p.len() <= MAX_TRACED_PATH && !p.contains('\0'))
            .collect();
        if v.len() < n {
            truncated = true;
        }
        v.sort();
        v.dedup();
        if v.len() > MAX_TRACED_PATHS {
            v.truncate(MAX_TRACED_PATHS);
            truncated = true;
        }
        v
    };
    let read = clean(f.read);
    let written = clean(f.written);
    TracedFiles {
        read,
        written,
        truncated,
    }
}

/// The request for a file operation, done as `user`.
pub(crate) fn file_request(op: FileOp, user: User) -> Request {
    match op {
        FileOp::Stat { path } => Request::Stat { path, user },
        FileOp::List {
            path,
            depth,
            hidden,
            limit,
        } => Request::List {
            path,
            depth,
            hidden,
            limit,
            user,
        },
        FileOp::Mkdir { path, parents } => Request::Mkdir {
            path,
            parents,
            user,
        },
        FileOp::Remove { path, recursive } => Request::Remove {
            path,
            recursive,
            user,
        },
        FileOp::Rename {
            from,
            to,
            overwrite,
        } => Request::Rename {
            from,
            to,
            overwrite,
            user,
        },
        FileOp::Chmod { path, mode } => Request::Chmod { path, mode, user },
    }
}

/// The reply to a [`file_request`] of machine `id`.
pub(crate) fn file_op_result(id: &str, reply: Reply) -> Result<FileOpResult, HostError> {
    match reply {
        Reply::Stat { entry: e } => Ok(FileOpResult::Stat(e.map(entry))),
        Reply::Listing { entries, truncated } => Ok(FileOpResult::Listing {
            entries: entries.into_iter().map(entry).collect(),
            truncated,
        }),
        Reply::Removed { removed } => Ok(FileOpResult::Removed(removed)),
        Reply::Done => Ok(FileOpResult::Done),
        other => Err(guest_err(id, other)),
    }
}

pub(crate) fn watch_request(spec: WatchSpec) -> runtime_proto::WatchRequest {
    use runtime_proto::WatchKind as K;
    runtime_proto::WatchRequest {
        path: spec.path,
        recursive: spec.recursive,
        events: spec
            .kinds
            .iter()
            .map(|k| match k {
                ChangeKind::Create => K::Create,
                ChangeKind::Write => K::Write,
                ChangeKind::Remove => K::Remove,
                ChangeKind::Rename => K::Rename,
                ChangeKind::Chmod => K::Chmod,
            })
            .collect(),
        include: spec.include,
        exclude: spec.exclude,
        batch_ms: spec.batch_ms,
        max_watches: spec.max_watches,
        user: user(spec.user),
    }
}

pub(crate) fn change(e: runtime_proto::WatchEvent) -> Change {
    use runtime_proto::WatchKind as K;
    Change {
        kind: match e.kind {
            K::Create => ChangeKind::Create,
            K::Write => ChangeKind::Write,
            K::Remove => ChangeKind::Remove,
            K::Rename => ChangeKind::Rename,
            K::Chmod => ChangeKind::Chmod,
        },
        path: e.path,
        old_path: e.old_path,
        is_dir: e.is_dir,
        count: e.count.max(1),
    }
}

pub(crate) fn miss(n: runtime_proto::WatchNotice) -> WatchMiss {
    match n {
        runtime_proto::WatchNotice::Overflow { dropped } => WatchMiss::Overflow { dropped },
        runtime_proto::WatchNotice::Limit { watches, path } => WatchMiss::Limit { watches, path },
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use std::time::Duration;

    fn proto_entry(name: &str, kind: EntryType) -> Entry {
        Entry {
            name: name.into(),
            path: format!("/home/user/{name}"),
            kind,
            size: 42,
            mode: 0o640,
            modified: 1_700_000_000,
        }
    }

    #[test]
    fn a_refusal_keeps_its_reason_and_message() {
        let e = guest_err(
            "sbx",
            Reply::Failed {
                code: FailCode::DirectoryNotEmpty,
                message: "not empty".into(),
            },
        );
        match e {
            HostError::Guest {
                id,
                failure,
                message,
            } => {
                assert_eq!(id, "sbx");
                assert_eq!(failure, GuestFailure::DirectoryNotEmpty);
                assert_eq!(message, "not empty");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn every_fail_code_has_its_own_failure() {
        let pairs = [
            (FailCode::FileNotFound, GuestFailure::FileNotFound),
            (FailCode::IsADirectory, GuestFailure::IsADirectory),
            (FailCode::NotADirectory, GuestFailure::NotADirectory),
            (FailCode::PermissionDenied, GuestFailure::PermissionDenied),
            (FailCode::AlreadyExists, GuestFailure::AlreadyExists),
            (FailCode::DirectoryNotEmpty, GuestFailure::DirectoryNotEmpty),
            (FailCode::InvalidPath, GuestFailure::InvalidPath),
            (FailCode::CommandNotFound, GuestFailure::CommandNotFound),
            (FailCode::BadRequest, GuestFailure::BadRequest),
            (FailCode::Io, GuestFailure::Io),
            (FailCode::ConnectionRefused, GuestFailure::ConnectionRefused),
            (FailCode::TooLarge, GuestFailure::TooLarge),
        ];
        for (code, want) in pairs {
            assert_eq!(failure(code), want, "{code:?}");
        }
    }

    #[test]
    fn an_unexpected_reply_is_an_io_failure_that_names_it() {
        match guest_err("sbx", Reply::Pong) {
            HostError::Guest {
                failure, message, ..
            } => {
                assert_eq!(failure, GuestFailure::Io);
                assert_eq!(message, "unexpected reply Pong");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn an_exec_request_carries_the_spec() {
        let req = exec_request(ExecSpec {
            argv: vec!["ls".into(), "-l".into()],
            cwd: Some("/tmp".into()),
            env: vec![("A".into(), "1".into())],
            user: RunAs::Root,
            timeout: Some(Duration::from_millis(1500)),
            stdin: true,
            pty: Some(TermSize { cols: 80, rows: 24 }),
            kill_group_on_exit: false,
            trace_files: true,
        });
        assert_eq!(
            req,
            ExecRequest {
                argv: vec!["ls".into(), "-l".into()],
                cwd: Some("/tmp".into()),
                env: vec![("A".into(), "1".into())],
                user: User::Root,
                timeout_ms: Some(1500),
                stdin: true,
                pty: Some(PtySize { cols: 80, rows: 24 }),
                kill_group_on_exit: false,
                trace_files: true,
            }
        );
    }

    #[test]
    fn traced_files_from_a_guest_are_checked() {
        let f = traced_files(runtime_proto::TracedFiles {
            read: vec![
                "/b".into(),
                "/a/".into(),
                "/b".into(),
                "relative".into(),
                "/nul\0".into(),
                format!("/{}", "x".repeat(5000)),
            ],
            written: vec!["/w".into()],
            truncated: false,
        });
        assert_eq!(f.read, ["/a/", "/b"]);
        assert_eq!(f.written, ["/w"]);
        // The refused paths are a loss.
        assert!(f.truncated);
        let f = traced_files(runtime_proto::TracedFiles {
            read: vec!["/a".into(), "/a".into()],
            written: vec![],
            truncated: false,
        });
        // A repeat is not.
        assert_eq!((f.read.len(), f.truncated), (1, false));
        let f = traced_files(runtime_proto::TracedFiles {
            read: (0..MAX_TRACED_PATHS + 1).map(|i| format!("/{i}")).collect(),
            written: vec![],
            truncated: false,
        });
        assert_eq!(f.read.len(), MAX_TRACED_PATHS);
        assert!(f.truncated);
        let f = traced_files(runtime_proto::TracedFiles {
            read: vec!["/a".into()],
            written: vec![],
            truncated: false,
        });
        assert!(!f.truncated);
    }

    #[test]
    fn file_requests_carry_the_user() {
        assert_eq!(
            file_request(
                FileOp::List {
                    path: "/srv".into(),
                    depth: 2,
                    hidden: true,
                    limit: 10,
                },
                User::Sandbox
            ),
            Request::List {
                path: "/srv".into(),
                depth: 2,
                hidden: true,
                limit: 10,
                user: User::Sandbox,
            }
        );
        assert_eq!(
            file_request(
                FileOp::Rename {
                    from: "/a".into(),
                    to: "/b".into(),
                    overwrite: false,
                },
                User::Root
            ),
            Request::Rename {
                from: "/a".into(),
                to: "/b".into(),
                overwrite: false,
                user: User::Root,
            }
        );
        assert_eq!(
            file_request(
                FileOp::Chmod {
                    path: "/x".into(),
                    mode: 0o755,
                },
                User::Root
            ),
            Request::Chmod {
                path: "/x".into(),
                mode: 0o755,
                user: User::Root,
            }
        );
    }

    #[test]
    fn file_replies_become_results() {
        let listing = file_op_result(
            "sbx",
            Reply::Listing {
                entries: vec![
                    proto_entry("a", EntryType::File),
                    proto_entry("d", EntryType::Directory),
                    proto_entry("l", EntryType::Symlink),
                    proto_entry("p", EntryType::Other),
                ],
                truncated: true,
            },
        )
        .unwrap();
        let FileOpResult::Listing { entries, truncated } = listing else {
            panic!("{listing:?}");
        };
        assert!(truncated);
        let kinds: Vec<EntryKind> = entries.iter().map(|e| e.kind).collect();
        assert_eq!(
            kinds,
            [
                EntryKind::File,
                EntryKind::Directory,
                EntryKind::Symlink,
                EntryKind::Other
            ]
        );
        assert_eq!(
            entries[0],
            FileEntry {
                name: "a".into(),
                path: "/home/user/a".into(),
                kind: EntryKind::File,
                size: 42,
                mode: 0o640,
                modified: 1_700_000_000,
            }
        );
        assert_eq!(
            file_op_result("sbx", Reply::Stat { entry: None }).unwrap(),
            FileOpResult::Stat(None)
        );
        assert_eq!(
            file_op_result("sbx", Reply::Removed { removed: false }).unwrap(),
            FileOpResult::Removed(false)
        );
        assert_eq!(
            file_op_result("sbx", Reply::Done).unwrap(),
            FileOpResult::Done
        );
        assert!(matches!(
            file_op_result("sbx", Reply::Started { pid: 1 }),
            Err(HostError::Guest {
                failure: GuestFailure::Io,
                ..
            })
        ));
    }
}
