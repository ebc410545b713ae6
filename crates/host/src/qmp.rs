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
    pub async fn connect(sock: &Path, timeout: Duration) -> Result<Qmp, QmpError> {
        let deadline = tokio::time::Instant::now() + timeout;
        let stream = loop {
            match UnixStream::connect(sock).await {
                Ok(s) => break s,
                Err(e) if tokio::time::Instant::now() >= deadline => return Err(e.into()),
                Err(_) => tokio::time::sleep(Duration::from_millis(5)).await,
            }
        };
        let (rd, wr) = stream.into_split();
        let mut q = Qmp { rd: BufReader::new(rd), wr };
        let _greeting = q.read_line(timeout).await?;
        q.execute("qmp_capabilities", json!({})).await?;
        Ok(q)
    }

    async fn read_line(&mut self, timeout: Duration) -> Result<Value, QmpError> {
        let mut line = String::new();
        let n = tokio::time::timeout(timeout, self.rd.read_line(&mut line))
            .await
            .map_err(|_| QmpError::Timeout { command: "greeting".into() })??;
        if n == 0 {
            return Err(QmpError::Closed);
        }
        Ok(serde_json::from_str(&line)?)
    }

    /// Runs a command and returns its `return` value; events are skipped.
    pub async fn execute(&mut self, command: &str, arguments: Value) -> Result<Value, QmpError> {
        let msg = json!({"execute": command, "arguments": arguments});
        let mut buf = serde_json::to_vec(&msg)?;
        buf.push(b'\n');
        self.wr.write_all(&buf).await?;
        loop {
            let v = self
                .read_line(Duration::from_secs(60))
                .await
                .map_err(|e| match e {
                    QmpError::Timeout { .. } => QmpError::Timeout { command: command.into() },
                    e => e,
                })?;
            if let Some(r) = v.get("return") {
                return Ok(r.clone());
            }
            if let Some(e) = v.get("error") {
                return Err(QmpError::Command {
                    command: command.into(),
                    desc: e.get("desc").and_then(Value::as_str).unwrap_or("unknown").to_owned(),
                });
            }
            // An asynchronous event: not ours.
        }
    }

    /// Polls `query-migrate` until the migration completes or fails.
    pub async fn wait_migration(&mut self, timeout: Duration) -> Result<Value, QmpError> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let r = self.execute("query-migrate", json!({})).await?;
            match r.get("status").and_then(Value::as_str) {
                Some("completed") => return Ok(r),
                Some("failed") | Some("cancelled") => {
                    return Err(QmpError::Command {
                        command: "migrate".into(),
                        desc: r.get("error-desc").and_then(Value::as_str).unwrap_or("failed").to_owned(),
                    })
                }
                _ => {}
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(QmpError::Timeout { command: "migrate".into() });
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}
