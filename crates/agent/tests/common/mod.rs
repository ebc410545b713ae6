//! Drives the built agent binary over a Unix socket, as the host would.
#![allow(dead_code)]

use std::collections::VecDeque;
use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use runtime_proto::{
    channel, encode, Decoder, ExecRequest, FailCode, Frame, Kind, Reply, Request, User, MAX_PAYLOAD,
};

pub(crate) const TIMEOUT: Duration = Duration::from_secs(20);

pub(crate) struct Agent {
    child: Child,
    listener: UnixListener,
    conn: UnixStream,
    dec: Decoder,
    pending: VecDeque<Frame>,
    /// A scratch directory of this test, removed on drop.
    pub dir: PathBuf,
    sock: PathBuf,
    next_stream: u32,
    /// Every command started, killed (with its group) on drop.
    started: Vec<u32>,
}

/// What an exec produced.
#[derive(Debug)]
pub(crate) struct Output {
    pub pid: Option<u32>,
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
    /// `Exited` or `Failed`.
    pub end: Reply,
}

impl Output {
    pub(crate) fn stdout(&self) -> String {
        String::from_utf8_lossy(&self.stdout).into_owned()
    }
    pub(crate) fn stderr(&self) -> String {
        String::from_utf8_lossy(&self.stderr).into_owned()
    }
    pub(crate) fn exit_code(&self) -> Option<i32> {
        match &self.end {
            Reply::Exited { exit_code, .. } => *exit_code,
            other => panic!("not exited: {other:?}"),
        }
    }
}

pub(crate) fn exec_req(argv: &[&str]) -> ExecRequest {
    ExecRequest {
        argv: argv.iter().map(|s| s.to_string()).collect(),
        cwd: None,
        env: vec![],
        user: User::Root,
        timeout_ms: None,
        stdin: false,
        pty: None,
        kill_group_on_exit: true,
        trace_files: false,
    }
}

fn accept(listener: &UnixListener) -> UnixStream {
    let deadline = Instant::now() + TIMEOUT;
    loop {
        match listener.accept() {
            Ok((s, _)) => {
                s.set_nonblocking(false).unwrap();
                s.set_read_timeout(Some(TIMEOUT)).unwrap();
                return s;
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock && Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(e) => panic!("agent did not connect: {e}"),
        }
    }
}

impl Agent {
    pub(crate) fn start() -> Agent {
        Agent::start_with(&[])
    }

    /// With extra arguments (e.g. `--proxy-port`).
    pub(crate) fn start_with(args: &[&str]) -> Agent {
        static N: AtomicU32 = AtomicU32::new(0);
        let dir = std::env::temp_dir().join(format!(
            "agent-test-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::SeqCst)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let sock = dir.join("agent.sock");
        let listener = UnixListener::bind(&sock).unwrap();
        listener.set_nonblocking(true).unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_runtime-agent"))
            .arg("--socket")
            .arg(&sock)
            .args(args)
            .stdin(Stdio::null())
            .spawn()
            .unwrap();
        let conn = accept(&listener);
        Agent {
            child,
            listener,
            conn,
            dec: Decoder::new(),
            pending: VecDeque::new(),
            dir,
            sock,
            next_stream: 1,
            started: vec![],
        }
    }

    pub(crate) fn agent_pid(&self) -> u32 {
        self.child.id()
    }

    /// Drops the connection and takes the agent's next one (a host restart).
    pub(crate) fn reconnect(&mut self) {
        self.conn.shutdown(std::net::Shutdown::Both).unwrap();
        self.conn = accept(&self.listener);
        self.dec = Decoder::new();
        self.pending.clear();
    }

    pub(crate) fn new_stream(&mut self) -> u32 {
        self.next_stream += 2;
        self.next_stream
    }

    pub(crate) fn send(&mut self, stream: u32, req: &Request) {
        let mut buf = Vec::new();
        encode(&Frame::control(stream, req).unwrap(), &mut buf);
        self.conn.write_all(&buf).unwrap();
    }

    pub(crate) fn send_raw_control(&mut self, stream: u32, json: &[u8]) {
        let mut buf = Vec::new();
        encode(
            &Frame {
                kind: Kind::Control,
                channel: 0,
                stream,
                payload: json.to_vec(),
            },
            &mut buf,
        );
        self.conn.write_all(&buf).unwrap();
    }

    pub(crate) fn send_raw_bytes(&mut self, bytes: &[u8]) {
        self.conn.write_all(bytes).unwrap();
    }

    pub(crate) fn send_data(&mut self, stream: u32, bytes: &[u8]) {
        for chunk in bytes.chunks(MAX_PAYLOAD) {
            let mut buf = Vec::new();
            encode(
                &Frame::data(stream, channel::INPUT, chunk.to_vec()).unwrap(),
                &mut buf,
            );
            self.conn.write_all(&buf).unwrap();
        }
    }

    fn read_frame(&mut self) -> Frame {
        let mut buf = vec![0u8; 256 * 1024];
        loop {
            if let Some(f) = self.dec.next_frame().unwrap() {
                return f;
            }
            let n = self
                .conn
                .read(&mut buf)
                .expect("no frame from the agent in time");
            assert!(n > 0, "the agent closed the connection");
            self.dec.feed(&buf[..n]);
        }
    }

    /// The next frame on `stream`; frames of other streams are kept for later.
    pub(crate) fn recv(&mut self, stream: u32) -> Frame {
        if let Some(i) = self.pending.iter().position(|f| f.stream == stream) {
            return self.pending.remove(i).unwrap();
        }
        loop {
            let f = self.read_frame();
            if f.kind == Kind::Control {
                if let Ok(Reply::Started { pid }) = f.parse() {
                    self.started.push(pid);
                }
            }
            if f.stream == stream {
                return f;
            }
            self.pending.push_back(f);
        }
    }

    /// The next control message on `stream` (data frames there are an error).
    pub(crate) fn reply(&mut self, stream: u32) -> Reply {
        let f = self.recv(stream);
        assert_eq!(
            f.kind,
            Kind::Control,
            "expected a control frame on stream {stream}, got {f:?}"
        );
        f.parse().unwrap()
    }

    pub(crate) fn request(&mut self, req: &Request) -> Reply {
        let s = self.new_stream();
        self.send(s, req);
        self.reply(s)
    }

    pub(crate) fn hello(&mut self) -> Reply {
        self.send(
            0,
            &Request::Hello {
                version: runtime_proto::VERSION,
                session: 0,
            },
        );
        self.reply(0)
    }

    /// A hello naming a host session (tunnels survive only the same one).
    pub(crate) fn hello_session(&mut self, session: u64) -> Reply {
        self.send(
            0,
            &Request::Hello {
                version: runtime_proto::VERSION,
                session,
            },
        );
        self.reply(0)
    }

    /// Frames of `stream` received so far and kept for later (none are
    /// read from the socket here).
    pub(crate) fn pending_on(&self, stream: u32) -> usize {
        self.pending.iter().filter(|f| f.stream == stream).count()
    }

    /// The next frame on any stream (pending ones first).
    pub(crate) fn next_any(&mut self) -> Frame {
        if let Some(f) = self.pending.pop_front() {
            return f;
        }
        self.read_frame()
    }

    /// Sends an exec; returns its stream and pid (panics on Failed).
    pub(crate) fn spawn(&mut self, req: ExecRequest) -> (u32, u32) {
        let s = self.new_stream();
        self.send(s, &Request::Exec(req));
        match self.reply(s) {
            Reply::Started { pid } => (s, pid),
            other => panic!("exec did not start: {other:?}"),
        }
    }

    /// Collects output on `stream` until `Exited` (or `Failed`).
    pub(crate) fn collect(&mut self, stream: u32, pid: Option<u32>) -> Output {
        let mut out = Output {
            pid,
            stdout: vec![],
            stderr: vec![],
            end: Reply::Done,
        };
        loop {
            let f = self.recv(stream);
            match f.kind {
                Kind::Data if f.channel == channel::STDOUT => {
                    out.stdout.extend_from_slice(&f.payload)
                }
                Kind::Data if f.channel == channel::STDERR => {
                    out.stderr.extend_from_slice(&f.payload)
                }
                Kind::Data => panic!("data on channel {}", f.channel),
                Kind::Control => match f.parse::<Reply>().unwrap() {
                    Reply::Started { pid } => {
                        assert!(out.pid.is_none(), "two Started");
                        out.pid = Some(pid);
                    }
                    end @ (Reply::Exited { .. } | Reply::Failed { .. }) => {
                        out.end = end;
                        return out;
                    }
                    other => panic!("unexpected {other:?}"),
                },
            }
        }
    }

    pub(crate) fn exec(&mut self, req: ExecRequest) -> Output {
        let s = self.new_stream();
        self.send(s, &Request::Exec(req));
        self.collect(s, None)
    }

    pub(crate) fn run(&mut self, argv: &[&str]) -> Output {
        self.exec(exec_req(argv))
    }

    pub(crate) fn write_file(
        &mut self,
        path: &str,
        bytes: &[u8],
        mode: Option<u32>,
        user: User,
    ) -> Reply {
        let s = self.new_stream();
        self.send(
            s,
            &Request::WriteFile {
                path: path.into(),
                mode,
                user,
            },
        );
        self.send_data(s, bytes);
        self.send(s, &Request::EndWrite);
        self.reply(s)
    }

    /// Reads a file: its bytes, or the failure.
    pub(crate) fn read_file(
        &mut self,
        path: &str,
        user: User,
    ) -> Result<Vec<u8>, (FailCode, String)> {
        let s = self.new_stream();
        self.send(
            s,
            &Request::ReadFile {
                path: path.into(),
                user,
                flow: false,
            },
        );
        let size = match self.reply(s) {
            Reply::FileStart { size } => size,
            Reply::Failed { code, message } => return Err((code, message)),
            other => panic!("unexpected {other:?}"),
        };
        let mut bytes = Vec::new();
        loop {
            let f = self.recv(s);
            match f.kind {
                Kind::Data => {
                    assert_eq!(f.channel, channel::INPUT);
                    bytes.extend_from_slice(&f.payload);
                }
                Kind::Control => match f.parse::<Reply>().unwrap() {
                    Reply::Done => break,
                    Reply::Failed { code, message } => return Err((code, message)),
                    other => panic!("unexpected {other:?}"),
                },
            }
        }
        assert_eq!(bytes.len() as u64, size, "FileStart size and bytes differ");
        Ok(bytes)
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        // Without its socket the agent kills its commands and exits.
        let _ = std::fs::remove_file(&self.sock);
        let _ = self.conn.shutdown(std::net::Shutdown::Both);
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        // Whatever a failed test left behind.
        for pid in &self.started {
            kill_group(*pid);
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// True while any process of group `pgid` exists (zombies included).
pub(crate) fn group_alive(pgid: u32) -> bool {
    // SAFETY: signal 0 only checks for existence.
    unsafe { libc::kill(-(pgid as i32), 0) == 0 }
}

/// Waits up to a few seconds for `cond`.
pub(crate) fn eventually(mut cond: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + Duration::from_secs(5);
    while Instant::now() < deadline {
        if cond() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    cond()
}

pub(crate) fn kill_group(pgid: u32) {
    // SAFETY: plain syscall.
    unsafe { libc::kill(-(pgid as i32), libc::SIGKILL) };
}
