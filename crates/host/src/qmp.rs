//! A minimal QMP client: one command at a time over QEMU's monitor socket.

use std::path::Path;
use std::time::Duration;

use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::UnixStream;

#[derive(Debug, thiserror::Error)]
pub(crate) enum QmpError {
    #[error("QMP socket I/O failed")]
    Io(#[from] std::io::Error),
    #[error("QMP closed the connection")]
    Closed,
    #[error("QMP answered something unreadable")]
    Decode(#[from] serde_json::Error),
    #[error("QMP command {command} failed: {desc}")]
    Command { command: String, desc: String },
    #[error("QMP did not answer {command} in time")]
    Timeout { command: String },
}

pub(crate) struct Qmp {
    rd: BufReader<tokio::net::unix::OwnedReadHalf>,
    wr: tokio::net::unix::OwnedWriteHalf,
}

impl Qmp {
    /// Connects (retrying while QEMU starts) and leaves capabilities negotiation.
    pub(crate) async fn connect(sock: &Path, timeout: Duration) -> Result<Qmp, QmpError> {
        let deadline = tokio::time::Instant::now() + timeout;
        let stream = loop {
            match UnixStream::connect(sock).await {
                Ok(s) => break s,
                Err(e) if tokio::time::Instant::now() >= deadline => return Err(e.into()),
                Err(_) => tokio::time::sleep(Duration::from_millis(5)).await,
            }
        };
        let (rd, wr) = stream.into_split();
        let mut q = Qmp {
            rd: BufReader::new(rd),
            wr,
        };
        let _greeting = q.read_line(timeout).await?;
        q.execute("qmp_capabilities", json!({})).await?;
        Ok(q)
    }

    async fn read_line(&mut self, timeout: Duration) -> Result<Value, QmpError> {
        let mut line = String::new();
        let n = tokio::time::timeout(timeout, self.rd.read_line(&mut line))
            .await
            .map_err(|_| QmpError::Timeout {
                command: "greeting".into(),
            })??;
        if n == 0 {
            return Err(QmpError::Closed);
        }
        Ok(serde_json::from_str(&line)?)
    }

    /// Runs a command and returns its `return` value; events are skipped.
    pub(crate) async fn execute(
        &mut self,
        command: &str,
        arguments: Value,
    ) -> Result<Value, QmpError> {
        let msg = json!({"execute": command, "arguments": arguments});
        let mut buf = serde_json::to_vec(&msg)?;
        buf.push(b'\n');
        self.wr.write_all(&buf).await?;
        loop {
            let v = self
                .read_line(Duration::from_secs(60))
                .await
                .map_err(|e| match e {
                    QmpError::Timeout { .. } => QmpError::Timeout {
                        command: command.into(),
                    },
                    e => e,
                })?;
            if let Some(r) = v.get("return") {
                return Ok(r.clone());
            }
            if let Some(e) = v.get("error") {
                return Err(QmpError::Command {
                    command: command.into(),
                    desc: e
                        .get("desc")
                        .and_then(Value::as_str)
                        .unwrap_or("unknown")
                        .to_owned(),
                });
            }
            // An asynchronous event: not ours.
        }
    }

    /// Hands QEMU an open file under `name` (QMP `getfd`, the descriptor
    /// passed with SCM_RIGHTS), so an unprivileged QEMU can write a file the
    /// server opened.
    pub(crate) async fn send_fd(
        &mut self,
        name: &str,
        fd: std::os::fd::RawFd,
    ) -> Result<(), QmpError> {
        use std::os::fd::AsRawFd;
        let msg = json!({"execute": "getfd", "arguments": {"fdname": name}});
        let mut buf = serde_json::to_vec(&msg)?;
        buf.push(b'\n');
        let sock = self.wr.as_ref().as_raw_fd();
        // SAFETY: the iovec and control buffer live across the call; the
        // cmsg macros only address inside `cmsg_buf`.
        let rc = unsafe {
            let mut iov = libc::iovec {
                iov_base: buf.as_mut_ptr().cast(),
                iov_len: buf.len(),
            };
            let space = libc::CMSG_SPACE(std::mem::size_of::<libc::c_int>() as u32) as usize;
            let mut cmsg_buf = vec![0u8; space];
            let mut hdr: libc::msghdr = std::mem::zeroed();
            hdr.msg_iov = &mut iov;
            hdr.msg_iovlen = 1;
            hdr.msg_control = cmsg_buf.as_mut_ptr().cast();
            hdr.msg_controllen = space as _;
            let cmsg = libc::CMSG_FIRSTHDR(&hdr);
            (*cmsg).cmsg_level = libc::SOL_SOCKET;
            (*cmsg).cmsg_type = libc::SCM_RIGHTS;
            (*cmsg).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<libc::c_int>() as u32) as _;
            std::ptr::write_unaligned(libc::CMSG_DATA(cmsg).cast::<libc::c_int>(), fd);
            libc::sendmsg(sock, &hdr, 0)
        };
        if rc < 0 || rc as usize != buf.len() {
            return Err(QmpError::Io(std::io::Error::last_os_error()));
        }
        loop {
            let v = self.read_line(Duration::from_secs(10)).await?;
            if v.get("return").is_some() {
                return Ok(());
            }
            if let Some(e) = v.get("error") {
                return Err(QmpError::Command {
                    command: "getfd".into(),
                    desc: e
                        .get("desc")
                        .and_then(Value::as_str)
                        .unwrap_or("unknown")
                        .to_owned(),
                });
            }
        }
    }

    /// Polls `query-migrate` until the migration completes or fails.
    pub(crate) async fn wait_migration(&mut self, timeout: Duration) -> Result<Value, QmpError> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let r = self.execute("query-migrate", json!({})).await?;
            match r.get("status").and_then(Value::as_str) {
                Some("completed") => return Ok(r),
                Some("failed") | Some("cancelled") => {
                    return Err(QmpError::Command {
                        command: "migrate".into(),
                        desc: r
                            .get("error-desc")
                            .and_then(Value::as_str)
                            .unwrap_or("failed")
                            .to_owned(),
                    })
                }
                _ => {}
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(QmpError::Timeout {
                    command: "migrate".into(),
                });
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}
