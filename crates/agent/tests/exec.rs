//! Commands, end to end through the agent binary.
#![allow(clippy::unwrap_used, clippy::expect_used)] // helpers outside #[test] fns panic on purpose

mod common;

use common::{eventually, exec_req, group_alive, kill_group, Agent};
use runtime_proto::{FailCode, PtySize, Reply, Request, User, VERSION};

#[test]
fn hello_ping_and_bad_requests() {
    let mut a = Agent::start();
    match a.hello() {
        Reply::Hello { version, agent } => {
            assert_eq!(version, VERSION);
            assert_eq!(agent, env!("CARGO_PKG_VERSION"));
        }
        other => panic!("{other:?}"),
    }
    // Every hello is answered (the host resends until it hears back).
    assert!(matches!(a.hello(), Reply::Hello { .. }));
    a.send(0, &Request::Ping);
    assert_eq!(a.reply(0), Reply::Pong);
    a.send_raw_control(41, br#"{"op":"no_such_op"}"#);
    assert!(matches!(
        a.reply(41),
        Reply::Failed {
            code: FailCode::BadRequest,
            ..
        }
    ));
    a.send_raw_control(43, b"not json");
    assert!(matches!(
        a.reply(43),
        Reply::Failed {
            code: FailCode::BadRequest,
            ..
        }
    ));
    // Still serving.
    assert_eq!(a.request(&Request::Ping), Reply::Pong);
    assert_eq!(a.request(&Request::Sync), Reply::Done);
}

#[test]
fn garbage_resets_the_decoder() {
    let mut a = Agent::start();
    // A whole frame of an unknown kind: the agent drops what it buffered.
    a.send_raw_bytes(&[0, 0, 0, 6, 9, 0, 0, 0, 0, 0]);
    std::thread::sleep(std::time::Duration::from_millis(200));
    assert!(matches!(a.hello(), Reply::Hello { .. }));
}

#[test]
fn survives_host_reconnect() {
    let mut a = Agent::start();
    assert!(matches!(a.hello(), Reply::Hello { .. }));
    a.reconnect();
    assert!(matches!(a.hello(), Reply::Hello { .. }));
    let out = a.run(&["echo", "again"]);
    assert_eq!(out.stdout(), "again\n");
}

#[test]
fn echo_stdout_and_exit_zero() {
    let mut a = Agent::start();
    let out = a.run(&["echo", "hello", "world"]);
    assert!(out.pid.is_some());
    assert_eq!(out.stdout(), "hello world\n");
    assert_eq!(out.stderr(), "");
    match out.end {
        Reply::Exited {
            exit_code,
            signal,
            timed_out,
            out_of_memory,
            oom_kills,
            ..
        } => {
            assert_eq!(
                (exit_code, signal, timed_out, out_of_memory, oom_kills),
                (Some(0), None, false, false, 0)
            );
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn stderr_is_separate_and_exit_code_kept() {
    let mut a = Agent::start();
    let out = a.run(&["bash", "-c", "echo out; echo err >&2; exit 3"]);
    assert_eq!(out.stdout(), "out\n");
    assert_eq!(out.stderr(), "err\n");
    assert_eq!(out.exit_code(), Some(3));
}

#[test]
fn command_not_found() {
    let mut a = Agent::start();
    let out = a.run(&["definitely-not-a-command-xyz", "arg"]);
    assert_eq!(out.pid, None, "no Started for a missing command");
    assert!(
        matches!(
            out.end,
            Reply::Failed {
                code: FailCode::CommandNotFound,
                ..
            }
        ),
        "{:?}",
        out.end
    );
    let out = a.run(&["/no/such/binary"]);
    assert!(
        matches!(
            out.end,
            Reply::Failed {
                code: FailCode::CommandNotFound,
                ..
            }
        ),
        "{:?}",
        out.end
    );
    // A missing cwd is reported, not started.
    let mut req = exec_req(&["true"]);
    req.cwd = Some("/no/such/dir".into());
    let out = a.exec(req);
    assert!(
        matches!(
            out.end,
            Reply::Failed {
                code: FailCode::FileNotFound,
                ..
            }
        ),
        "{:?}",
        out.end
    );
}

#[test]
fn stdin_pipe_and_close() {
    let mut a = Agent::start();
    let mut req = exec_req(&["cat"]);
    req.stdin = true;
    let (s, pid) = a.spawn(req);
    a.send_data(s, b"first line\n");
    let big: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
    a.send_data(s, &big);
    a.send(s, &Request::CloseStdin);
    let out = a.collect(s, Some(pid));
    assert_eq!(out.exit_code(), Some(0));
    let mut expected = b"first line\n".to_vec();
    expected.extend_from_slice(&big);
    assert_eq!(out.stdout.len(), expected.len());
    assert!(out.stdout == expected);
}

#[test]
fn stdin_data_right_behind_the_request_is_kept() {
    let mut a = Agent::start();
    let mut req = exec_req(&["cat"]);
    req.stdin = true;
    let s = a.new_stream();
    a.send(s, &Request::Exec(req));
    a.send_data(s, b"early");
    a.send(s, &Request::CloseStdin);
    let out = a.collect(s, None);
    assert_eq!(out.stdout(), "early");
}

#[test]
fn timeout_kills_the_whole_group() {
    let mut a = Agent::start();
    let mut req = exec_req(&["bash", "-c", "sleep 100 & sleep 100"]);
    req.timeout_ms = Some(300);
    req.kill_group_on_exit = false;
    let out = a.exec(req);
    let pid = out.pid.unwrap();
    match out.end {
        Reply::Exited {
            exit_code,
            timed_out,
            signal,
            duration_ms,
            ..
        } => {
            assert!(timed_out);
            assert_eq!(exit_code, None);
            assert_eq!(signal, Some(libc::SIGKILL));
            assert!(duration_ms >= 300, "{duration_ms}");
        }
        other => panic!("{other:?}"),
    }
    assert!(
        eventually(|| !group_alive(pid)),
        "a process of the group survived the timeout"
    );
}

#[test]
fn kill_group_on_exit_kills_leftovers() {
    let mut a = Agent::start();
    let out = a.run(&["bash", "-c", "sleep 100 & echo started"]);
    assert_eq!(out.stdout(), "started\n");
    assert_eq!(out.exit_code(), Some(0));
    let pid = out.pid.unwrap();
    assert!(
        eventually(|| !group_alive(pid)),
        "the backgrounded sleep survived"
    );
}

#[test]
fn without_kill_group_a_daemon_survives_and_exit_is_still_reported() {
    let mut a = Agent::start();
    let mut req = exec_req(&["bash", "-c", "sleep 100 & echo started"]);
    req.kill_group_on_exit = false;
    // The sleep keeps stdout open: Exited must come anyway, after a short drain.
    let out = a.exec(req);
    let pid = out.pid.unwrap();
    assert_eq!(out.stdout(), "started\n");
    assert_eq!(out.exit_code(), Some(0));
    assert!(group_alive(pid), "the sleep should have been left running");
    kill_group(pid);
    assert!(eventually(|| !group_alive(pid)));
}

#[test]
fn signal_reaches_the_process() {
    let mut a = Agent::start();
    let (s, pid) = a.spawn(exec_req(&["sleep", "100"]));
    a.send(
        s,
        &Request::Signal {
            signal: libc::SIGTERM,
        },
    );
    let out = a.collect(s, Some(pid));
    match out.end {
        Reply::Exited {
            exit_code,
            signal,
            timed_out,
            ..
        } => {
            assert_eq!(
                (exit_code, signal, timed_out),
                (None, Some(libc::SIGTERM), false)
            );
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn pty_gives_a_terminal_and_resizes() {
    let mut a = Agent::start();
    let mut req = exec_req(&["tty"]);
    req.pty = Some(PtySize { cols: 80, rows: 24 });
    let out = a.exec(req);
    assert_eq!(out.exit_code(), Some(0));
    let tty = out.stdout();
    assert!(
        tty.starts_with("/dev/pts/") && tty.trim_end()[9..].parse::<u32>().is_ok(),
        "{tty:?}"
    );

    let mut req = exec_req(&["bash", "-c", "stty size; echo $TERM; read x; stty size"]);
    req.pty = Some(PtySize { cols: 80, rows: 24 });
    req.stdin = true;
    let (s, pid) = a.spawn(req);
    // Wait for the first size before resizing.
    let mut seen = Vec::new();
    while !String::from_utf8_lossy(&seen).contains("xterm-256color") {
        let f = a.recv(s);
        assert_eq!(f.kind, runtime_proto::Kind::Data, "{f:?}");
        seen.extend_from_slice(&f.payload);
    }
    a.send(
        s,
        &Request::Resize {
            size: PtySize {
                cols: 100,
                rows: 30,
            },
        },
    );
    a.send_data(s, b"go\n");
    let out = a.collect(s, Some(pid));
    seen.extend_from_slice(&out.stdout);
    let text = String::from_utf8_lossy(&seen);
    assert!(text.starts_with("24 80\r\n"), "{text:?}");
    assert!(text.contains("30 100\r\n"), "{text:?}");
    assert_eq!(out.exit_code(), Some(0));
}

#[test]
fn large_output_arrives_whole() {
    let mut a = Agent::start();
    let out = a.run(&["bash", "-c", "seq 1 2000000 | head -c 10485760"]);
    assert_eq!(out.exit_code(), Some(0));
    let mut expected = String::new();
    for i in 1..=2_000_000u32 {
        expected.push_str(&i.to_string());
        expected.push('\n');
        if expected.len() >= 10_485_760 {
            break;
        }
    }
    expected.truncate(10_485_760);
    assert_eq!(out.stdout.len(), 10_485_760);
    assert!(out.stdout == expected.as_bytes(), "output differs");
}

#[test]
fn output_streams_while_running() {
    let mut a = Agent::start();
    let mut req = exec_req(&["bash", "-c", "echo first; sleep 100"]);
    req.kill_group_on_exit = true;
    let (s, pid) = a.spawn(req);
    let f = a.recv(s);
    assert_eq!(f.kind, runtime_proto::Kind::Data);
    assert_eq!(
        f.payload, b"first\n",
        "output must arrive before the command ends"
    );
    a.send(
        s,
        &Request::Signal {
            signal: libc::SIGKILL,
        },
    );
    let out = a.collect(s, Some(pid));
    assert!(matches!(
        out.end,
        Reply::Exited {
            signal: Some(9),
            ..
        }
    ));
}

#[test]
fn cwd_and_env_are_applied() {
    let mut a = Agent::start();
    let dir = a.dir.join("work");
    std::fs::create_dir(&dir).unwrap();
    let mut req = exec_req(&["bash", "-c", "pwd; echo $FOO $BAR"]);
    req.cwd = Some(dir.to_str().unwrap().into());
    req.env = vec![
        ("FOO".into(), "one".into()),
        ("BAR".into(), "two".into()),
        ("FOO".into(), "three".into()),
    ];
    let out = a.exec(req);
    let lines: Vec<String> = out.stdout().lines().map(String::from).collect();
    assert_eq!(lines[0], dir.to_str().unwrap());
    assert_eq!(lines[1], "three two");
    // The whole environment: the base, then the request's in order.
    let mut req = exec_req(&["env"]);
    req.env = vec![
        ("FOO".into(), "one".into()),
        ("HOME".into(), "/elsewhere".into()),
        ("no_proxy".into(), "*".into()),
    ];
    let env = a.exec(req).stdout();
    let proxy = "http://127.0.0.1:10800";
    let socks = "socks5h://127.0.0.1:10800";
    let bundle = "/etc/ssl/certs/ca-certificates.crt";
    assert_eq!(
        env,
        format!(
            "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin\nHOME=/elsewhere\nUSER=root\n\
             LOGNAME=root\nSHELL=/bin/bash\nLANG=C.UTF-8\n\
             HTTP_PROXY={proxy}\nHTTPS_PROXY={proxy}\nhttp_proxy={proxy}\nhttps_proxy={proxy}\n\
             ALL_PROXY={socks}\nall_proxy={socks}\n\
             NO_PROXY=localhost,127.0.0.1,::1\nno_proxy=*\n\
             npm_config_proxy={proxy}\nnpm_config_https_proxy={proxy}\nNODE_USE_ENV_PROXY=1\n\
             SSL_CERT_FILE={bundle}\nREQUESTS_CA_BUNDLE={bundle}\nCURL_CA_BUNDLE={bundle}\n\
             PIP_CERT={bundle}\nGIT_SSL_CAINFO={bundle}\nFOO=one\n"
        )
    );
    let mut req = exec_req(&["env"]);
    req.pty = Some(PtySize { cols: 80, rows: 24 });
    assert!(a.exec(req).stdout().contains("TERM=xterm-256color\r\n"));
}

#[test]
fn sandbox_user_is_uid_1000_without_groups() {
    let mut a = Agent::start();
    let mut req = exec_req(&[
        "bash",
        "-c",
        "id -u; id -g; id -G; echo $HOME $USER $LOGNAME; echo $PATH; echo $NPM_CONFIG_PREFIX",
    ]);
    req.user = User::Sandbox;
    let out = a.exec(req);
    assert_eq!(out.exit_code(), Some(0), "{}", out.stderr());
    // The name is what /etc/passwd calls uid 1000 (`runtime` in the image).
    let name = std::fs::read_to_string("/etc/passwd")
        .unwrap_or_default()
        .lines()
        .find_map(|l| {
            let f: Vec<&str> = l.split(':').collect();
            (f.len() > 2 && f[2] == "1000").then(|| f[0].to_string())
        })
        .unwrap_or_else(|| "runtime".into());
    assert_eq!(
        out.stdout(),
        format!(
            "1000\n1000\n1000\n/workspace {name} {name}\n\
             /workspace/.local/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin\n\
             /workspace/.local\n"
        )
    );
}

/// The child shares the agent's memory until it execs (a vfork-style
/// clone): its switch to the sandbox user is its own; the agent, each of
/// its threads, and the next command stay root.
#[test]
fn a_sandbox_command_leaves_the_agent_and_the_next_command_root() {
    let mut a = Agent::start();
    let mut req = exec_req(&["id", "-u"]);
    req.user = User::Sandbox;
    assert_eq!(a.exec(req).stdout(), "1000\n");
    let status = std::fs::read_to_string(format!("/proc/{}/status", a.agent_pid())).unwrap();
    let uids = status.lines().find(|l| l.starts_with("Uid:")).unwrap();
    assert_eq!(
        uids.split_whitespace().collect::<Vec<_>>(),
        ["Uid:", "0", "0", "0", "0"]
    );
    // Every thread of it.
    for task in std::fs::read_dir(format!("/proc/{}/task", a.agent_pid())).unwrap() {
        let status = std::fs::read_to_string(task.unwrap().path().join("status")).unwrap();
        assert!(status.contains("\nUid:\t0\t0\t0\t0\n"), "{status}");
    }
    assert_eq!(a.run(&["id", "-u"]).stdout(), "0\n");
}

/// A command starts with no signal blocked and none ignored (the agent
/// ignores SIGPIPE and blocks every signal across the spawn).
#[test]
fn a_command_starts_with_default_signals() {
    let mut a = Agent::start();
    let out = a.run(&["grep", "-E", "^Sig(Blk|Ign):", "/proc/self/status"]);
    assert_eq!(
        out.stdout(),
        "SigBlk:\t0000000000000000\nSigIgn:\t0000000000000000\n"
    );
}

#[test]
fn ping_is_answered_while_a_long_exec_runs() {
    let mut a = Agent::start();
    // One command floods output, another just sleeps.
    let (flood, flood_pid) = a.spawn(exec_req(&[
        "bash",
        "-c",
        "yes | head -c 50000000; sleep 100",
    ]));
    let (sleeper, sleeper_pid) = a.spawn(exec_req(&["sleep", "100"]));
    let p = a.new_stream();
    a.send(p, &Request::Ping);
    assert_eq!(a.reply(p), Reply::Pong);
    let st = a.new_stream();
    a.send(
        st,
        &Request::Stat {
            path: "/".into(),
            user: User::Root,
        },
    );
    assert!(matches!(a.reply(st), Reply::Stat { entry: Some(_) }));
    for (s, pid) in [(flood, flood_pid), (sleeper, sleeper_pid)] {
        a.send(
            s,
            &Request::Signal {
                signal: libc::SIGKILL,
            },
        );
        let out = a.collect(s, Some(pid));
        assert!(
            matches!(
                out.end,
                Reply::Exited {
                    signal: Some(9),
                    ..
                }
            ),
            "{:?}",
            out.end
        );
    }
}

#[test]
fn concurrent_execs_do_not_mix() {
    let mut a = Agent::start();
    let streams: Vec<(u32, u32)> = (0..4)
        .map(|i| {
            a.spawn(exec_req(&[
                "bash",
                "-c",
                &format!("for j in 1 2 3; do echo {i}-$j; done"),
            ]))
        })
        .collect();
    for (i, (s, pid)) in streams.into_iter().enumerate() {
        let out = a.collect(s, Some(pid));
        assert_eq!(out.stdout(), format!("{i}-1\n{i}-2\n{i}-3\n"));
    }
}

#[test]
fn a_reconnected_host_attaches_to_running_and_ended_execs() {
    let mut a = Agent::start();
    a.hello();
    let (running, pid) = a.spawn(exec_req(&["bash", "-c", "sleep 1.5; echo late"]));
    let (ended, _) = a.spawn(exec_req(&["bash", "-c", "exit 7"]));
    // Give the short one time to end while the host is away.
    std::thread::sleep(std::time::Duration::from_millis(300));
    a.reconnect();
    a.hello();
    a.send(ended, &Request::Attach);
    match a.reply(ended) {
        Reply::Exited { exit_code, .. } => assert_eq!(exit_code, Some(7)),
        other => panic!("{other:?}"),
    }
    a.send(running, &Request::Attach);
    let out = a.collect(running, None);
    assert_eq!(out.pid, Some(pid), "Started names the same process");
    assert_eq!(out.stdout(), "late\n");
    assert_eq!(out.exit_code(), Some(0));
    let unknown = a.new_stream();
    a.send(unknown, &Request::Attach);
    assert!(matches!(
        a.reply(unknown),
        Reply::Failed {
            code: FailCode::BadRequest,
            ..
        }
    ));
}
