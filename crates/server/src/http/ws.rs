//! The two WebSockets of a sandbox: `…/terminal` (a pty process: binary
//! frames both ways, JSON text frames for control) and `…/tunnel` (port
//! forwarding: many TCP connections to the guest's loopback multiplexed on
//! one socket, with the client's credit window). Both are authenticated by
//! the key like any call; neither opens a port of the guest to anyone else.
//!
//! Tunnel frames, both ways: a kind byte, a big-endian `u32` stream number,
//! a payload. `o` opens (client: `tcp <port>`; server: empty = opened),
//! `d` data, `e` end of the sender's data (half-close), `c` close (server:
//! the payload says why when an open failed), `a` credit (server only: a
//! big-endian `u64`, every byte of client data delivered to the guest so
//! far; the client sends at most its window past it).

use std::collections::HashMap;
use std::sync::Arc;

use axum::extract::ws::{Message, WebSocket, WebSocketUpgrade};
use axum::response::Response;
use bytes::Bytes;
use runtime_host::TermSize;
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::mpsc;

use crate::domain::access::KeyInfo;
use crate::domain::process::SIGHUP;
use crate::error::{ApiError, ApiResult};
use crate::http::extract::{query_object, Fields};
use crate::service::processes::{self, run_as, Proc, Terminal, TerminalCommand};
use crate::service::tunnels;
use crate::AppState;

/// What the client may send past the last credit (its own constant).
const CLIENT_WINDOW: u64 = 1 << 20;
/// Queued client data beyond this closes the tunnel: the client ignores credits.
const MAX_QUEUED: u64 = 2 * CLIENT_WINDOW;
/// Connections one tunnel carries at once.
const MAX_STREAMS: usize = 256;
const CHUNK: usize = 64 << 10;

/// `GET …/terminal?cols&rows&command&cwd&user&processId`.
pub(crate) async fn terminal(
    st: AppState,
    key: KeyInfo,
    id: String,
    query: Vec<(String, String)>,
    upgrade: WebSocketUpgrade,
) -> ApiResult<Response> {
    let q = query_object(&query, &[]);
    let mut f = Fields::new(&q);
    let cols = f.q_int("cols", 1, 1000).unwrap_or(80) as u16;
    let rows = f.q_int("rows", 1, 1000).unwrap_or(24) as u16;
    let command = f.string("command");
    let cwd = f.string("cwd");
    let user = f.one_of("user", &["sandbox", "root"]).map(|u| run_as(&u));
    let process_id = f.string("processId");
    f.finish()?;
    let cmd = TerminalCommand {
        size: TermSize { cols, rows },
        command,
        cwd,
        user,
        process_id,
    };
    let Terminal { proc, owned } = processes::open_terminal(&st, &key, &id, cmd).await?;
    Ok(upgrade.on_upgrade(move |socket| run_terminal(st, proc, owned, socket)))
}

async fn run_terminal(st: AppState, proc: Arc<Proc>, owned: bool, mut socket: WebSocket) {
    let ready = json!({"type": "ready", "processId": proc.id()});
    if socket
        .send(Message::Text(ready.to_string().into()))
        .await
        .is_err()
    {
        hang_up(&proc, owned).await;
        return;
    }
    let mut rx = proc.subscribe();
    let mut cursor = proc.output_start();
    let cancel = st.inner.cancel.clone();
    loop {
        let (out, next, exit) = proc.read_raw(cursor);
        cursor = next;
        if !out.is_empty() && socket.send(Message::Binary(out.into())).await.is_err() {
            hang_up(&proc, owned).await;
            return;
        }
        if let Some(code) = exit {
            let end = json!({"type": "exit", "exitCode": code});
            let _ = socket.send(Message::Text(end.to_string().into())).await;
            let _ = socket.send(Message::Close(None)).await;
            return;
        }
        tokio::select! {
            changed = rx.changed() => {
                if changed.is_err() {
                    return;
                }
            }
            msg = socket.recv() => match msg {
                Some(Ok(Message::Binary(b))) => {
                    processes::type_in(&st, &proc, b.to_vec()).await;
                }
                Some(Ok(Message::Text(t))) => match serde_json::from_str::<Value>(t.as_str()) {
                    Ok(v) if v["type"] == "resize" => {
                        let dim = |k: &str, d: u16| {
                            v[k].as_u64().filter(|n| (1..=1000).contains(n)).map_or(d, |n| n as u16)
                        };
                        proc.resize(TermSize { cols: dim("cols", 80), rows: dim("rows", 24) }).await;
                    }
                    Ok(v) if v.is_object() => {}
                    _ => {
                        processes::type_in(&st, &proc, t.as_bytes().to_vec()).await;
                    }
                },
                Some(Ok(_)) => {}
                Some(Err(_)) | None => {
                    hang_up(&proc, owned).await;
                    return;
                }
            },
            _ = cancel.cancelled() => {
                let _ = socket.send(Message::Close(None)).await;
                return;
            }
        }
    }
}

/// The terminal window closed: a shell it started gets SIGHUP, as a
/// terminal emulator's would; a process it only took up keeps running.
async fn hang_up(proc: &Proc, owned: bool) {
    if owned {
        proc.signal(SIGHUP).await;
    }
}

/// `GET …/tunnel`: port forwarding to the guest's loopback.
pub(crate) async fn tunnel(
    st: AppState,
    key: KeyInfo,
    id: String,
    upgrade: WebSocketUpgrade,
) -> ApiResult<Response> {
    tunnels::open(&st, &key, &id).await?;
    Ok(upgrade.on_upgrade(move |socket| run_tunnel(st, key, id, socket)))
}

/// What the connection tasks tell the socket's loop.
enum Event {
    Opened(u32),
    OpenFailed(u32, String),
    Data(u32, Vec<u8>),
    End(u32),
    Closed(u32),
    Delivered(u64),
}

/// What the loop tells a connection's writer.
enum ToGuest {
    Data(Bytes),
    End,
}

struct Conn {
    tx: mpsc::UnboundedSender<ToGuest>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Drop for Conn {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

fn frame(kind: u8, stream: u32, payload: &[u8]) -> Message {
    let mut b = Vec::with_capacity(5 + payload.len());
    b.push(kind);
    b.extend_from_slice(&stream.to_be_bytes());
    b.extend_from_slice(payload);
    Message::Binary(b.into())
}

async fn run_tunnel(st: AppState, key: KeyInfo, id: String, mut socket: WebSocket) {
    if socket
        .send(Message::Text(json!({"type": "ready"}).to_string().into()))
        .await
        .is_err()
    {
        return;
    }
    let (ev_tx, mut ev_rx) = mpsc::channel::<Event>(64);
    let mut conns: HashMap<u32, Conn> = HashMap::new();
    let mut received: u64 = 0;
    let mut delivered: u64 = 0;
    let cancel = st.inner.cancel.clone();
    loop {
        tokio::select! {
            msg = socket.recv() => {
                let b = match msg {
                    Some(Ok(Message::Binary(b))) => b,
                    Some(Ok(Message::Close(_))) | Some(Err(_)) | None => return,
                    Some(Ok(_)) => continue,
                };
                if b.len() < 5 {
                    continue;
                }
                let kind = b[0];
                let stream = u32::from_be_bytes([b[1], b[2], b[3], b[4]]);
                let payload = b.slice(5..);
                match kind {
                    b'o' => {
                        let port = std::str::from_utf8(&payload)
                            .ok()
                            .and_then(|s| s.strip_prefix("tcp "))
                            .and_then(|p| p.trim().parse::<u16>().ok())
                            .filter(|p| *p != 0);
                        let refuse = match port {
                            None => Some("The open frame must say `tcp <port>`.".to_string()),
                            Some(_) if conns.len() >= MAX_STREAMS => Some(format!("At most {MAX_STREAMS} connections per tunnel.")),
                            Some(_) if conns.contains_key(&stream) => Some("That stream number is in use.".to_string()),
                            Some(_) => None,
                        };
                        if let Some(why) = refuse {
                            if socket.send(frame(b'c', stream, why.as_bytes())).await.is_err() {
                                return;
                            }
                            continue;
                        }
                        let (tx, rx) = mpsc::unbounded_channel();
                        let task = tokio::spawn(open_conn(st.clone(), key.clone(), id.clone(), stream, port.unwrap_or(0), rx, ev_tx.clone()));
                        conns.insert(stream, Conn { tx, tasks: vec![task] });
                    }
                    b'd' => {
                        received += payload.len() as u64;
                        if received - delivered > MAX_QUEUED {
                            let e = json!({"type": "error", "error": {"code": "tunnel_overrun", "message": "The client sent past its credit window."}});
                            let _ = socket.send(Message::Text(e.to_string().into())).await;
                            return;
                        }
                        match conns.get(&stream) {
                            Some(c) => { let _ = c.tx.send(ToGuest::Data(payload)); }
                            // Data for a closed connection counts as delivered.
                            None => {
                                delivered += payload.len() as u64;
                                if socket.send(frame(b'a', 0, &delivered.to_be_bytes())).await.is_err() {
                                    return;
                                }
                            }
                        }
                    }
                    b'e' => {
                        if let Some(c) = conns.get(&stream) {
                            let _ = c.tx.send(ToGuest::End);
                        }
                    }
                    b'c' => {
                        conns.remove(&stream);
                    }
                    _ => {}
                }
            }
            Some(ev) = ev_rx.recv() => {
                let out = match ev {
                    Event::Opened(s) => frame(b'o', s, b""),
                    Event::OpenFailed(s, why) => {
                        conns.remove(&s);
                        frame(b'c', s, why.as_bytes())
                    }
                    Event::Data(s, d) => frame(b'd', s, &d),
                    Event::End(s) => frame(b'e', s, b""),
                    Event::Closed(s) => {
                        if conns.remove(&s).is_none() {
                            continue;
                        }
                        frame(b'c', s, b"")
                    }
                    Event::Delivered(n) => {
                        delivered += n;
                        frame(b'a', 0, &delivered.to_be_bytes())
                    }
                };
                if socket.send(out).await.is_err() {
                    return;
                }
            }
            _ = cancel.cancelled() => {
                let _ = socket.send(Message::Close(None)).await;
                return;
            }
        }
    }
}

/// Opens one connection to the guest's `127.0.0.1:port` and carries it.
async fn open_conn(
    st: AppState,
    key: KeyInfo,
    id: String,
    stream: u32,
    port: u16,
    mut rx: mpsc::UnboundedReceiver<ToGuest>,
    ev: mpsc::Sender<Event>,
) {
    let io = match tunnels::connect(&st, &key, &id, port).await {
        Ok(io) => io,
        Err(e) => {
            let why = match e {
                ApiError::Host(runtime_host::HostError::Guest { .. }) => {
                    format!("Nothing listens on port {port} in the sandbox.")
                }
                other => other.to_string(),
            };
            let _ = ev.send(Event::OpenFailed(stream, why)).await;
            return;
        }
    };
    if ev.send(Event::Opened(stream)).await.is_err() {
        return;
    }
    let (mut rd, mut wr) = tokio::io::split(io);
    let ev_read = ev.clone();
    let ev_write = ev.clone();
    // Each side answers `true` when it failed (the connection is reset).
    let reader = async move {
        let mut buf = vec![0u8; CHUNK];
        loop {
            match rd.read(&mut buf).await {
                Ok(0) => {
                    return ev_read.send(Event::End(stream)).await.is_err();
                }
                Ok(n) => {
                    if ev_read
                        .send(Event::Data(stream, buf[..n].to_vec()))
                        .await
                        .is_err()
                    {
                        return true;
                    }
                }
                Err(_) => return true,
            }
        }
    };
    let writer = async move {
        while let Some(m) = rx.recv().await {
            match m {
                ToGuest::Data(d) => {
                    let n = d.len() as u64;
                    if wr.write_all(&d).await.is_err() {
                        return true;
                    }
                    if ev_write.send(Event::Delivered(n)).await.is_err() {
                        return true;
                    }
                }
                ToGuest::End => {
                    let _ = wr.shutdown().await;
                    return false;
                }
            }
        }
        true
    };
    // Both directions ended cleanly (half-closes), or one failed: either
    // way the connection is over and the client is told.
    tokio::pin!(reader);
    tokio::pin!(writer);
    let (mut read_done, mut write_done) = (false, false);
    while !(read_done && write_done) {
        tokio::select! {
            failed = &mut reader, if !read_done => {
                if failed { break; }
                read_done = true;
            }
            failed = &mut writer, if !write_done => {
                if failed { break; }
                write_done = true;
            }
        }
    }
    let _ = ev.send(Event::Closed(stream)).await;
}
