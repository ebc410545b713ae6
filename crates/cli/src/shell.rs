//! `runtime sandbox shell ID`: an interactive terminal over the sandbox's
//! terminal WebSocket (`GET …/terminal?cols&rows&command&cwd&user`): the
//! local terminal in raw mode, keys out as binary frames, the remote pty's
//! output in, a resize frame on every SIGWINCH, and the remote shell's exit
//! status as this command's. Piped input is typed in, then an end of file
//! (Ctrl-D) once the shell is quiet, so it exits.

use std::io::{IsTerminal, Read, Write};
use std::time::Duration;

use anyhow::Context;
use futures::{SinkExt, StreamExt};
use serde_json::{json, Value};
use tokio::time::Instant;
use tokio_tungstenite::tungstenite::Message;

use crate::client::{enc, Target};

/// How long the remote side stays silent before piped input's end is sent.
const QUIET: Duration = Duration::from_millis(300);

/// The local terminal in raw mode until dropped.
struct RawMode {
    saved: libc::termios,
}

impl RawMode {
    fn enter() -> Option<RawMode> {
        // SAFETY: tcgetattr/tcsetattr on fd 0 with structs we own.
        unsafe {
            let mut t: libc::termios = std::mem::zeroed();
            if libc::tcgetattr(0, &mut t) != 0 {
                return None;
            }
            let saved = t;
            libc::cfmakeraw(&mut t);
            if libc::tcsetattr(0, libc::TCSANOW, &t) != 0 {
                return None;
            }
            Some(RawMode { saved })
        }
    }
}

impl Drop for RawMode {
    fn drop(&mut self) {
        // SAFETY: restores the settings read in `enter`.
        unsafe {
            libc::tcsetattr(0, libc::TCSANOW, &self.saved);
        }
    }
}

/// The local terminal's size (cols, rows), if there is a terminal.
fn size() -> Option<(u16, u16)> {
    for fd in [1, 0, 2] {
        // SAFETY: TIOCGWINSZ fills a winsize we own.
        unsafe {
            let mut w: libc::winsize = std::mem::zeroed();
            if libc::ioctl(fd, libc::TIOCGWINSZ, &mut w) == 0 && w.ws_col > 0 && w.ws_row > 0 {
                return Some((w.ws_col, w.ws_row));
            }
        }
    }
    None
}

/// Stdin's bytes as they come, read on a thread of its own (a read of a
/// terminal cannot be cancelled; the process exits around it).
fn stdin_reader() -> tokio::sync::mpsc::Receiver<Vec<u8>> {
    let (tx, rx) = tokio::sync::mpsc::channel(16);
    std::thread::spawn(move || {
        let mut buf = vec![0u8; 8192];
        let mut stdin = std::io::stdin().lock();
        loop {
            match stdin.read(&mut buf) {
                Ok(0) | Err(_) => return,
                Ok(n) => {
                    if tx.blocking_send(buf[..n].to_vec()).is_err() {
                        return;
                    }
                }
            }
        }
    });
    rx
}

/// The terminal route's path and query.
pub(crate) fn terminal_path(
    id: &str,
    cols: u16,
    rows: u16,
    command: Option<&str>,
    cwd: Option<&str>,
    user: Option<&str>,
) -> String {
    let mut q = vec![("cols", cols.to_string()), ("rows", rows.to_string())];
    if let Some(c) = command {
        q.push(("command", c.to_string()));
    }
    if let Some(c) = cwd {
        q.push(("cwd", c.to_string()));
    }
    if let Some(u) = user {
        q.push(("user", u.to_string()));
    }
    format!(
        "/v1/sandboxes/{}/terminal{}",
        enc(id),
        crate::client::query(&q)
    )
}

pub(crate) async fn run(
    t: &Target,
    id: &str,
    command: Option<String>,
    cwd: Option<String>,
    user: Option<String>,
) -> anyhow::Result<i32> {
    let (cols, rows) = size().unwrap_or((80, 24));
    let path = terminal_path(
        id,
        cols,
        rows,
        command.as_deref(),
        cwd.as_deref(),
        user.as_deref(),
    );
    let ws = t.websocket(&path).await?;
    let (mut tx, mut rx) = ws.split();
    let interactive = std::io::stdin().is_terminal();
    let raw = if interactive { RawMode::enter() } else { None };
    let mut winch = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::window_change())
        .context("watching the terminal's size")?;
    let mut stdin = stdin_reader();
    let mut stdin_open = true;
    let mut code = None;
    // After piped input ends: Ctrl-D once the remote side has been quiet a
    // moment (a shell at its prompt), again after each quiet second. Sent
    // while a command still runs, a terminal's line discipline would eat it.
    let mut eof_sends = 0u32;
    let quiet = tokio::time::sleep(Duration::from_secs(3600));
    tokio::pin!(quiet);
    loop {
        tokio::select! {
            msg = rx.next() => match msg {
                Some(Ok(Message::Binary(b))) => {
                    let mut out = std::io::stdout().lock();
                    out.write_all(&b)?;
                    out.flush()?;
                    if !stdin_open {
                        quiet.as_mut().reset(Instant::now() + QUIET);
                    }
                }
                Some(Ok(Message::Text(text))) => {
                    let v: Value = serde_json::from_str(text.as_str()).unwrap_or(Value::Null);
                    match v["type"].as_str() {
                        Some("exit") => {
                            code = Some(v["exitCode"].as_i64().map_or(1, |c| c.clamp(0, 255) as i32));
                        }
                        Some("error") => {
                            drop(raw);
                            anyhow::bail!(
                                "the terminal failed: {}",
                                v["error"]["message"].as_str().unwrap_or("no message")
                            );
                        }
                        _ => {}
                    }
                }
                Some(Ok(Message::Close(_))) | None => break,
                Some(Ok(_)) => {}
                Some(Err(e)) => {
                    drop(raw);
                    return Err(anyhow::Error::new(e).context("the terminal's connection broke"));
                }
            },
            input = stdin.recv(), if stdin_open => match input {
                None => {
                    stdin_open = false;
                    quiet.as_mut().reset(Instant::now() + QUIET);
                }
                Some(bytes) => tx.send(Message::Binary(bytes.into())).await?,
            },
            _ = &mut quiet, if !stdin_open && eof_sends < 10 => {
                eof_sends += 1;
                tx.send(Message::Binary(vec![4u8].into())).await?;
                quiet.as_mut().reset(Instant::now() + Duration::from_secs(1));
            }
            _ = winch.recv() => {
                if let Some((cols, rows)) = size() {
                    let m = json!({"type": "resize", "cols": cols, "rows": rows});
                    tx.send(Message::Text(m.to_string().into())).await?;
                }
            }
        }
    }
    drop(raw);
    match code {
        Some(c) => Ok(c),
        None => {
            eprintln!("\r\nruntime: the terminal closed without an exit status");
            Ok(1)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_terminal_query() {
        assert_eq!(
            terminal_path("abc", 120, 40, Some("bash -l"), None, Some("root")),
            "/v1/sandboxes/abc/terminal?cols=120&rows=40&command=bash%20-l&user=root"
        );
        assert_eq!(
            terminal_path("abc", 80, 24, None, None, None),
            "/v1/sandboxes/abc/terminal?cols=80&rows=24"
        );
    }
}
