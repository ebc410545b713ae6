//! Traced files, end to end through the agent binary (as root, as the
//! agent runs in the guest): fanotify on the command's own mount namespace.
#![allow(clippy::unwrap_used, clippy::expect_used)] // helpers outside #[test] fns panic on purpose

mod common;

use common::{exec_req, Agent};
use runtime_proto::{ExecRequest, Reply, TracedFiles};

fn traced(argv: &[&str]) -> ExecRequest {
    ExecRequest {
        trace_files: true,
        ..exec_req(argv)
    }
}

fn files(end: &Reply) -> TracedFiles {
    match end {
        Reply::Exited {
            exit_code: Some(0),
            files: Some(f),
            ..
        } => f.clone(),
        other => panic!("not a traced success: {other:?}"),
    }
}

#[test]
fn a_traced_command_lists_what_it_and_its_children_opened_and_wrote() {
    let mut a = Agent::start();
    let dir = std::fs::canonicalize(&a.dir).unwrap();
    let d = dir.display().to_string();
    std::fs::create_dir_all(dir.join("real")).unwrap();
    std::os::unix::fs::symlink(dir.join("real"), dir.join("link")).unwrap();
    std::fs::write(dir.join("known.txt"), "known\n").unwrap();
    std::fs::write(dir.join("child.txt"), "child\n").unwrap();
    std::fs::write(dir.join("other.txt"), "other\n").unwrap();
    // An untraced command reads `other.txt` all the while.
    let (busy, _) = a.spawn(exec_req(&[
        "sh",
        "-c",
        &format!("while true; do cat {d}/other.txt > /dev/null; sleep 0.01; done"),
    ]));
    let script = format!(
        "cat {d}/known.txt; echo new > {d}/link/new.txt; ls {d}/real > /dev/null; \
         sh -c 'cat {d}/child.txt'; sleep 0.3"
    );
    let out = a.exec(traced(&["sh", "-c", &script]));
    assert_eq!(out.stdout(), "known\nchild\n", "{}", out.stderr());
    let f = files(&out.end);
    assert!(!f.truncated);
    let mut sorted = f.read.clone();
    sorted.sort();
    assert_eq!(f.read, sorted);
    assert!(f.read.contains(&format!("{d}/known.txt")), "{f:?}");
    assert!(f.read.contains(&format!("{d}/child.txt")), "{f:?}");
    assert!(f.read.contains(&format!("{d}/real/")), "{f:?}");
    assert_eq!(f.written, [format!("{d}/real/new.txt")]);
    // The real path of what it ran (sh, cat are read: executed).
    let cat = std::fs::canonicalize("/bin/cat").unwrap();
    assert!(f.read.contains(&cat.display().to_string()), "{f:?}");
    // Not what another command opened meanwhile.
    assert!(!f.read.contains(&format!("{d}/other.txt")), "{f:?}");
    assert!(!f.read.iter().any(|p| p.contains("/link/")), "{f:?}");
    assert!(!f.read.iter().any(|p| p.starts_with("/proc/")), "{f:?}");
    a.send(busy, &runtime_proto::Request::Signal { signal: 9 });
    a.collect(busy, None);
}

#[test]
fn an_untraced_command_reports_no_files_and_a_reader_writes_nothing() {
    let mut a = Agent::start();
    let out = a.run(&["true"]);
    match out.end {
        Reply::Exited { files: None, .. } => {}
        other => panic!("{other:?}"),
    }
    let dir = std::fs::canonicalize(&a.dir).unwrap();
    std::fs::write(dir.join("r.txt"), "r").unwrap();
    let out = a.exec(traced(&["cat", &format!("{}/r.txt", dir.display())]));
    let f = files(&out.end);
    assert!(
        f.read.contains(&format!("{}/r.txt", dir.display())),
        "{f:?}"
    );
    assert!(f.written.is_empty(), "{f:?}");
}
