//! File operations, end to end through the agent binary.
#![allow(clippy::unwrap_used, clippy::expect_used)] // helpers outside #[test] fns panic on purpose

mod common;

use std::os::unix::fs::{MetadataExt, PermissionsExt};

use common::Agent;
use runtime_proto::{Entry, EntryType, FailCode, Reply, Request, User};

fn p(a: &Agent, rel: &str) -> String {
    a.dir.join(rel).to_str().unwrap().to_string()
}

fn failed(r: &Reply) -> FailCode {
    match r {
        Reply::Failed { code, .. } => *code,
        other => panic!("expected a failure, got {other:?}"),
    }
}

#[test]
fn write_then_read_back() {
    let mut a = Agent::start();
    let bytes: Vec<u8> = (0..1_572_864u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    let path = p(&a, "new/sub/dir/data.bin");
    assert_eq!(a.write_file(&path, &bytes, None, User::Root), Reply::Done);
    let on_disk = std::fs::read(&path).unwrap();
    assert!(on_disk == bytes, "bytes on disk differ");
    let md = std::fs::metadata(&path).unwrap();
    assert_eq!(md.permissions().mode() & 0o7777, 0o644, "default mode");
    let back = a.read_file(&path, User::Root).unwrap();
    assert_eq!(back.len(), bytes.len());
    assert!(back == bytes, "bytes read back differ");
    // Overwrite atomically, mode not reduced by the umask; no temp file left.
    assert_eq!(
        a.write_file(&path, b"short", Some(0o666), User::Root),
        Reply::Done
    );
    assert_eq!(std::fs::read(&path).unwrap(), b"short");
    assert_eq!(
        std::fs::metadata(&path).unwrap().permissions().mode() & 0o7777,
        0o666
    );
    let names: Vec<_> = std::fs::read_dir(a.dir.join("new/sub/dir"))
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names, vec![std::ffi::OsString::from("data.bin")]);
    assert_eq!(
        a.write_file(&p(&a, "x.sh"), b"#!/bin/sh\n", Some(0o750), User::Root),
        Reply::Done
    );
    assert_eq!(
        std::fs::metadata(p(&a, "x.sh"))
            .unwrap()
            .permissions()
            .mode()
            & 0o7777,
        0o750
    );
    // An empty file.
    assert_eq!(
        a.write_file(&p(&a, "empty"), b"", None, User::Root),
        Reply::Done
    );
    assert_eq!(a.read_file(&p(&a, "empty"), User::Root).unwrap(), b"");
}

#[test]
fn read_and_write_errors() {
    let mut a = Agent::start();
    let err = a.read_file(&p(&a, "missing.txt"), User::Root).unwrap_err();
    assert_eq!(err.0, FailCode::FileNotFound, "{err:?}");
    assert!(err.1.contains("No such file"), "{err:?}");
    let dir = a.dir.to_str().unwrap().to_string();
    let err = a.read_file(&dir, User::Root).unwrap_err();
    assert_eq!(err.0, FailCode::IsADirectory);
    std::fs::create_dir(a.dir.join("adir")).unwrap();
    let r = a.write_file(&p(&a, "adir"), b"data", None, User::Root);
    assert_eq!(failed(&r), FailCode::IsADirectory);
    std::fs::write(a.dir.join("afile"), b"x").unwrap();
    let r = a.write_file(&p(&a, "afile/below"), b"data", None, User::Root);
    assert_eq!(failed(&r), FailCode::NotADirectory);
    let r = a.write_file("relative/path", b"data", None, User::Root);
    assert_eq!(failed(&r), FailCode::InvalidPath);
    let r = a.request(&Request::Stat {
        path: "relative".into(),
        user: User::Root,
    });
    assert_eq!(failed(&r), FailCode::InvalidPath);
    // The agent still answers afterwards.
    assert_eq!(a.request(&Request::Ping), Reply::Pong);
}

#[test]
fn sandbox_user_has_uid_1000_permissions() {
    let mut a = Agent::start();
    let home = a.dir.join("home");
    std::fs::create_dir(&home).unwrap();
    std::os::unix::fs::chown(&home, Some(1000), Some(1000)).unwrap();
    let path = p(&a, "home/sub/mine.txt");
    assert_eq!(
        a.write_file(&path, b"mine", None, User::Sandbox),
        Reply::Done
    );
    let md = std::fs::metadata(&path).unwrap();
    assert_eq!((md.uid(), md.gid()), (1000, 1000));
    let sub = std::fs::metadata(a.dir.join("home/sub")).unwrap();
    assert_eq!(
        (sub.uid(), sub.gid()),
        (1000, 1000),
        "created parents belong to the user"
    );
    assert_eq!(a.read_file(&path, User::Sandbox).unwrap(), b"mine");

    // The test dir itself is root's 0755: no writing there.
    std::fs::set_permissions(&a.dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    let r = a.write_file(&p(&a, "root-owned.txt"), b"x", None, User::Sandbox);
    assert_eq!(failed(&r), FailCode::PermissionDenied);
    assert!(!a.dir.join("root-owned.txt").exists());
    std::fs::write(a.dir.join("secret"), b"s").unwrap();
    std::fs::set_permissions(a.dir.join("secret"), std::fs::Permissions::from_mode(0o600)).unwrap();
    let err = a.read_file(&p(&a, "secret"), User::Sandbox).unwrap_err();
    assert_eq!(err.0, FailCode::PermissionDenied);
    assert_eq!(a.read_file(&p(&a, "secret"), User::Root).unwrap(), b"s");
    let r = a.request(&Request::Chmod {
        path: p(&a, "secret"),
        mode: 0o644,
        user: User::Sandbox,
    });
    assert_eq!(failed(&r), FailCode::PermissionDenied);
    let r = a.request(&Request::Remove {
        path: p(&a, "secret"),
        recursive: false,
        user: User::Sandbox,
    });
    assert_eq!(failed(&r), FailCode::PermissionDenied);
}

fn listing(r: Reply) -> (Vec<Entry>, bool) {
    match r {
        Reply::Listing { entries, truncated } => (entries, truncated),
        other => panic!("{other:?}"),
    }
}

#[test]
fn list_depth_hidden_limit() {
    let mut a = Agent::start();
    let root = a.dir.join("tree");
    for d in ["a/b/c", "z", ".hidden/inner"] {
        std::fs::create_dir_all(root.join(d)).unwrap();
    }
    for f in ["f1.txt", ".dot", "a/f2.txt", "a/b/f3.txt", "a/b/c/f4.txt"] {
        std::fs::write(root.join(f), f).unwrap();
    }
    std::os::unix::fs::symlink("a", root.join("link")).unwrap();
    let base = root.to_str().unwrap().to_string();
    let list = |a: &mut Agent, depth, hidden, limit| {
        listing(a.request(&Request::List {
            path: base.clone(),
            depth,
            hidden,
            limit,
            user: User::Root,
        }))
    };
    let rel = |entries: &[Entry]| -> Vec<String> {
        entries
            .iter()
            .map(|e| e.path.strip_prefix(&base).unwrap().to_string())
            .collect()
    };

    let (entries, truncated) = list(&mut a, 1, false, 100);
    assert_eq!(rel(&entries), ["/a", "/f1.txt", "/link", "/z"]);
    assert!(!truncated);
    let f1 = &entries[1];
    assert_eq!(
        (f1.name.as_str(), f1.kind, f1.size, f1.mode),
        ("f1.txt", EntryType::File, 6, 0o644)
    );
    assert!(f1.modified > 1_600_000_000);
    assert_eq!(entries[0].kind, EntryType::Directory);
    assert_eq!(entries[2].kind, EntryType::Symlink);

    let (entries, _) = list(&mut a, 2, false, 100);
    assert_eq!(
        rel(&entries),
        ["/a", "/a/b", "/a/f2.txt", "/f1.txt", "/link", "/z"]
    );
    let (entries, _) = list(&mut a, 10, false, 100);
    assert_eq!(
        rel(&entries),
        [
            "/a",
            "/a/b",
            "/a/b/c",
            "/a/b/c/f4.txt",
            "/a/b/f3.txt",
            "/a/f2.txt",
            "/f1.txt",
            "/link",
            "/z"
        ]
    );
    let (entries, _) = list(&mut a, 2, true, 100);
    assert_eq!(
        rel(&entries),
        [
            "/.dot",
            "/.hidden",
            "/.hidden/inner",
            "/a",
            "/a/b",
            "/a/f2.txt",
            "/f1.txt",
            "/link",
            "/z"
        ]
    );
    let (entries, truncated) = list(&mut a, 10, false, 3);
    assert_eq!(rel(&entries), ["/a", "/a/b", "/a/b/c"]);
    assert!(truncated);

    let missing = Request::List {
        path: p(&a, "nope"),
        depth: 1,
        hidden: false,
        limit: 10,
        user: User::Root,
    };
    assert_eq!(failed(&a.request(&missing)), FailCode::FileNotFound);
    let file = Request::List {
        path: format!("{base}/f1.txt"),
        depth: 1,
        hidden: false,
        limit: 10,
        user: User::Root,
    };
    assert_eq!(failed(&a.request(&file)), FailCode::NotADirectory);
}

#[test]
fn a_huge_listing_is_cut_to_fit_one_frame() {
    let mut a = Agent::start();
    let dir = a.dir.join("many");
    std::fs::create_dir(&dir).unwrap();
    for i in 0..4000 {
        std::fs::write(
            dir.join(format!("file-with-a-rather-long-name-{i:05}.txt")),
            b"",
        )
        .unwrap();
    }
    let req = Request::List {
        path: p(&a, "many"),
        depth: 1,
        hidden: false,
        limit: 0,
        user: User::Root,
    };
    let (entries, truncated) = listing(a.request(&req));
    assert!(truncated);
    assert!(
        entries.len() > 100 && entries.len() < 4000,
        "{}",
        entries.len()
    );
    assert!(entries.windows(2).all(|w| w[0].path < w[1].path), "sorted");
    let req = Request::List {
        path: p(&a, "many"),
        depth: 1,
        hidden: false,
        limit: 50,
        user: User::Root,
    };
    let (entries, truncated) = listing(a.request(&req));
    assert_eq!((entries.len(), truncated), (50, true));
    assert!(entries[0].name.ends_with("00000.txt"));
}

#[test]
fn stat_mkdir_chmod() {
    let mut a = Agent::start();
    std::fs::write(a.dir.join("f"), b"12345").unwrap();
    let stat = |a: &mut Agent, rel: &str| match a.request(&Request::Stat {
        path: p(a, rel),
        user: User::Root,
    }) {
        Reply::Stat { entry } => entry,
        other => panic!("{other:?}"),
    };
    let e = stat(&mut a, "f").unwrap();
    assert_eq!((e.name.as_str(), e.kind, e.size), ("f", EntryType::File, 5));
    assert_eq!(e.path, p(&a, "f"));
    assert_eq!(stat(&mut a, "missing"), None);

    let mkdir = |a: &mut Agent, rel: &str, parents| {
        a.request(&Request::Mkdir {
            path: p(a, rel),
            parents,
            user: User::Root,
        })
    };
    assert_eq!(
        failed(&mkdir(&mut a, "x/y/z", false)),
        FailCode::FileNotFound
    );
    assert_eq!(mkdir(&mut a, "x/y/z", true), Reply::Done);
    assert!(a.dir.join("x/y/z").is_dir());
    assert_eq!(
        mkdir(&mut a, "x/y/z", true),
        Reply::Done,
        "mkdir -p of an existing dir"
    );
    assert_eq!(
        failed(&mkdir(&mut a, "x/y/z", false)),
        FailCode::AlreadyExists
    );
    assert_eq!(mkdir(&mut a, "x/w", false), Reply::Done);
    assert_eq!(stat(&mut a, "x/w").unwrap().kind, EntryType::Directory);

    let r = a.request(&Request::Chmod {
        path: p(&a, "f"),
        mode: 0o600,
        user: User::Root,
    });
    assert_eq!(r, Reply::Done);
    assert_eq!(stat(&mut a, "f").unwrap().mode, 0o600);
    let r = a.request(&Request::Chmod {
        path: p(&a, "missing"),
        mode: 0o600,
        user: User::Root,
    });
    assert_eq!(failed(&r), FailCode::FileNotFound);
}

#[test]
fn rename_with_and_without_overwrite() {
    let mut a = Agent::start();
    std::fs::write(a.dir.join("one"), b"1").unwrap();
    std::fs::write(a.dir.join("two"), b"2").unwrap();
    let rename = |a: &mut Agent, from: &str, to: &str, overwrite| {
        a.request(&Request::Rename {
            from: p(a, from),
            to: p(a, to),
            overwrite,
            user: User::Root,
        })
    };
    assert_eq!(
        failed(&rename(&mut a, "one", "two", false)),
        FailCode::AlreadyExists
    );
    assert_eq!(std::fs::read(a.dir.join("two")).unwrap(), b"2");
    assert_eq!(rename(&mut a, "one", "two", true), Reply::Done);
    assert_eq!(std::fs::read(a.dir.join("two")).unwrap(), b"1");
    assert!(!a.dir.join("one").exists());
    assert_eq!(rename(&mut a, "two", "three", false), Reply::Done);
    assert_eq!(std::fs::read(a.dir.join("three")).unwrap(), b"1");
    assert_eq!(
        failed(&rename(&mut a, "missing", "four", false)),
        FailCode::FileNotFound
    );
}

#[test]
fn remove_files_and_trees() {
    let mut a = Agent::start();
    std::fs::create_dir_all(a.dir.join("tree/a/b")).unwrap();
    std::fs::write(a.dir.join("tree/a/b/f"), b"x").unwrap();
    std::fs::write(a.dir.join("file"), b"x").unwrap();
    std::fs::create_dir(a.dir.join("empty")).unwrap();
    let remove = |a: &mut Agent, rel: &str, recursive| {
        a.request(&Request::Remove {
            path: p(a, rel),
            recursive,
            user: User::Root,
        })
    };
    assert_eq!(
        failed(&remove(&mut a, "tree", false)),
        FailCode::DirectoryNotEmpty
    );
    assert!(a.dir.join("tree/a/b/f").exists());
    assert_eq!(
        remove(&mut a, "tree", true),
        Reply::Removed { removed: true }
    );
    assert!(!a.dir.join("tree").exists());
    assert_eq!(
        remove(&mut a, "file", false),
        Reply::Removed { removed: true }
    );
    assert!(!a.dir.join("file").exists());
    assert_eq!(
        remove(&mut a, "empty", false),
        Reply::Removed { removed: true }
    );
    assert_eq!(
        remove(&mut a, "file", false),
        Reply::Removed { removed: false }
    );
}

/// Waits a moment, then runs a command to the end: frames the agent queued
/// before its output (a read's bytes sent without credit) have arrived.
fn settle(a: &mut Agent) {
    std::thread::sleep(std::time::Duration::from_millis(300));
    assert_eq!(a.run(&["true"]).exit_code(), Some(0));
}

/// Reads `n` bytes of data frames on `s` (and nothing else).
fn take_bytes(a: &mut Agent, s: u32, n: usize) -> Vec<u8> {
    let mut got = Vec::new();
    while got.len() < n {
        let f = a.recv(s);
        assert_eq!(f.kind, runtime_proto::Kind::Data, "{f:?}");
        got.extend_from_slice(&f.payload);
    }
    assert_eq!(got.len(), n, "more than the credit");
    got
}

#[test]
fn a_flow_controlled_read_sends_only_what_the_host_credits() {
    let mut a = Agent::start();
    let bytes: Vec<u8> = (0..1_500_000u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 11) as u8)
        .collect();
    let path = p(&a, "big.bin");
    std::fs::write(&path, &bytes).unwrap();
    let s = a.new_stream();
    a.send(
        s,
        &Request::ReadFile {
            path: path.clone(),
            user: User::Root,
            flow: true,
        },
    );
    assert_eq!(
        a.reply(s),
        Reply::FileStart {
            size: bytes.len() as u64
        }
    );
    // No credit yet: no bytes.
    settle(&mut a);
    assert_eq!(a.pending_on(s), 0, "bytes sent before any credit");
    // 100,000 bytes of credit: exactly that many, then nothing.
    a.send(s, &Request::Credit { bytes: 100_000 });
    let mut got = take_bytes(&mut a, s, 100_000);
    settle(&mut a);
    assert_eq!(a.pending_on(s), 0, "bytes sent beyond the credit");
    // The rest, in two grants; then Done.
    a.send(s, &Request::Credit { bytes: 700_000 });
    got.extend(take_bytes(&mut a, s, 700_000));
    let rest = bytes.len() - got.len();
    a.send(
        s,
        &Request::Credit {
            bytes: rest as u32 + 10,
        },
    );
    got.extend(take_bytes(&mut a, s, rest));
    assert_eq!(a.reply(s), Reply::Done);
    assert!(got == bytes, "the bytes differ");
}

#[test]
fn a_flow_controlled_read_closed_by_the_host_sends_nothing_more() {
    let mut a = Agent::start();
    let path = p(&a, "big.bin");
    std::fs::write(&path, vec![7u8; 1 << 20]).unwrap();
    let s = a.new_stream();
    a.send(
        s,
        &Request::ReadFile {
            path,
            user: User::Root,
            flow: true,
        },
    );
    assert!(matches!(a.reply(s), Reply::FileStart { .. }));
    a.send(s, &Request::Credit { bytes: 1000 });
    take_bytes(&mut a, s, 1000);
    a.send(s, &Request::Close);
    // Credits after the close reach no read.
    a.send(s, &Request::Credit { bytes: 500_000 });
    settle(&mut a);
    assert_eq!(a.pending_on(s), 0, "frames after the close");
    // The stream is free again (the read's state is gone).
    a.send(
        s,
        &Request::ReadFile {
            path: p(&a, "big.bin"),
            user: User::Root,
            flow: true,
        },
    );
    assert!(matches!(a.reply(s), Reply::FileStart { .. }));
}

#[test]
fn a_write_the_host_closes_places_no_file() {
    let mut a = Agent::start();
    let path = p(&a, "half.bin");
    let s = a.new_stream();
    a.send(
        s,
        &Request::WriteFile {
            path: path.clone(),
            mode: None,
            user: User::Root,
        },
    );
    a.send_data(s, &[1u8; 300_000]);
    a.send(s, &Request::Close);
    assert_eq!(failed(&a.reply(s)), FailCode::Io);
    assert!(!std::path::Path::new(&path).exists());
    // Nor a temporary file beside it.
    let left: Vec<_> = std::fs::read_dir(&a.dir)
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .filter(|n| n != "agent.sock")
        .collect();
    assert!(left.is_empty(), "{left:?}");
}
