//! `runtime sandbox port-forward ID [LOCAL:]REMOTE...`: listens on local
//! ports and carries each connection to the sandbox's loopback over one
//! tunnel WebSocket (`GET …/tunnel`, docs/api.md). Frames both ways are a
//! kind byte, a big-endian `u32` stream number and a payload: `o` open
//! (`tcp <port>`), `d` data, `e` end of data, `c` close (with the reason an
//! open failed), `a` credit from the server (bytes delivered so far); this
//! side never sends more than [`WINDOW`] bytes past the last credit.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use anyhow::{bail, Context};
use futures::{SinkExt, StreamExt};
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch};
use tokio_tungstenite::tungstenite::Message;

use crate::client::{enc, Target};

/// What the server accepts past its last credit.
const WINDOW: u64 = 1 << 20;
const CHUNK: usize = 64 << 10;

/// One forwarded port: where to listen here and the sandbox's port.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Spec {
    pub local: u16,
    pub remote: u16,
}

/// `5432` (the same port here) or `15432:5432` (local:remote).
pub(crate) fn parse_spec(s: &str) -> anyhow::Result<Spec> {
    let port = |p: &str| -> anyhow::Result<u16> {
        p.trim()
            .parse::<u16>()
            .ok()
            .filter(|n| *n != 0)
            .with_context(|| format!("{s:?}: {p:?} is not a port (1 to 65535)"))
    };
    match s.split_once(':') {
        Some((l, r)) => Ok(Spec {
            local: port(l)?,
            remote: port(r)?,
        }),
        None => {
            let p = port(s)?;
            Ok(Spec {
                local: p,
                remote: p,
            })
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

/// What the server says to one connection.
enum ToLocal {
    Data(Vec<u8>),
    End,
    Close(String),
}

struct Shared {
    out: mpsc::Sender<Message>,
    conns: Mutex<HashMap<u32, mpsc::UnboundedSender<ToLocal>>>,
    next: AtomicU32,
    sent: AtomicU64,
    credit: watch::Receiver<u64>,
    /// Sends take turns, so the window check and the count stay together.
    turn: tokio::sync::Mutex<()>,
}

pub(crate) async fn run(t: &Target, id: &str, address: &str, specs: &[Spec]) -> anyhow::Result<()> {
    let mut listeners = Vec::new();
    for s in specs {
        let l = TcpListener::bind((address, s.local))
            .await
            .with_context(|| format!("listening on {address}:{}", s.local))?;
        listeners.push((l, *s));
    }
    let ws = t
        .websocket(&format!("/v1/sandboxes/{}/tunnel", enc(id)))
        .await?;
    let (mut ws_tx, mut ws_rx) = ws.split();
    let (out_tx, mut out_rx) = mpsc::channel::<Message>(64);
    let (credit_tx, credit_rx) = watch::channel(0u64);
    let shared = Arc::new(Shared {
        out: out_tx,
        conns: Mutex::new(HashMap::new()),
        next: AtomicU32::new(1),
        sent: AtomicU64::new(0),
        credit: credit_rx,
        turn: tokio::sync::Mutex::new(()),
    });
    let writer = tokio::spawn(async move {
        while let Some(m) = out_rx.recv().await {
            if ws_tx.send(m).await.is_err() {
                break;
            }
        }
    });
    for (l, s) in listeners {
        let shown = l.local_addr().map(|a| a.to_string()).unwrap_or_default();
        eprintln!("runtime: forwarding {shown} -> {id} port {}", s.remote);
        let sh = shared.clone();
        tokio::spawn(async move {
            while let Ok((sock, _)) = l.accept().await {
                let _ = sock.set_nodelay(true);
                tokio::spawn(carry(sh.clone(), sock, s.remote));
            }
        });
    }
    // One listener for the whole run: a new `ctrl_c()` each turn of the
    // loop would miss a SIGINT that came while a frame was handled.
    let ctrl_c = tokio::signal::ctrl_c();
    tokio::pin!(ctrl_c);
    let result = async {
        loop {
            tokio::select! {
                msg = ws_rx.next() => match msg {
                    Some(Ok(Message::Binary(b))) => {
                        if b.len() < 5 {
                            continue;
                        }
                        let stream = u32::from_be_bytes([b[1], b[2], b[3], b[4]]);
                        let payload = &b[5..];
                        let to = |m: ToLocal| {
                            if let Ok(c) = shared.conns.lock() {
                                if let Some(tx) = c.get(&stream) {
                                    let _ = tx.send(m);
                                }
                            }
                        };
                        match b[0] {
                            b'a' if payload.len() == 8 => {
                                let mut n = [0u8; 8];
                                n.copy_from_slice(payload);
                                let _ = credit_tx.send(u64::from_be_bytes(n));
                            }
                            b'd' => to(ToLocal::Data(payload.to_vec())),
                            b'e' => to(ToLocal::End),
                            b'c' => {
                                to(ToLocal::Close(String::from_utf8_lossy(payload).into_owned()));
                                if let Ok(mut c) = shared.conns.lock() {
                                    c.remove(&stream);
                                }
                            }
                            _ => {}
                        }
                    }
                    Some(Ok(Message::Text(text))) => {
                        let v: Value = serde_json::from_str(text.as_str()).unwrap_or(Value::Null);
                        if v["type"] == "error" {
                            bail!(
                                "the tunnel ended: {}",
                                v["error"]["message"].as_str().unwrap_or("no message")
                            );
                        }
                    }
                    Some(Ok(Message::Close(_))) | None => bail!("the server closed the tunnel"),
                    Some(Ok(_)) => {}
                    Some(Err(e)) => return Err(anyhow::Error::new(e).context("the tunnel broke")),
                },
                _ = &mut ctrl_c => return Ok(()),
            }
        }
    }
    .await;
    writer.abort();
    result
}

/// One local connection, carried as one stream of the tunnel.
async fn carry(sh: Arc<Shared>, sock: tokio::net::TcpStream, port: u16) {
    let stream = sh.next.fetch_add(1, Ordering::Relaxed);
    let (tx, mut rx) = mpsc::unbounded_channel();
    if let Ok(mut c) = sh.conns.lock() {
        c.insert(stream, tx);
    }
    if sh
        .out
        .send(frame(b'o', stream, format!("tcp {port}").as_bytes()))
        .await
        .is_err()
    {
        return;
    }
    let (mut rd, mut wr) = sock.into_split();
    let up = {
        let sh = sh.clone();
        async move {
            let mut buf = vec![0u8; CHUNK];
            loop {
                let n = match rd.read(&mut buf).await {
                    Ok(0) | Err(_) => {
                        let _ = sh.out.send(frame(b'e', stream, b"")).await;
                        return;
                    }
                    Ok(n) => n,
                };
                let _turn = sh.turn.lock().await;
                let mut credit = sh.credit.clone();
                loop {
                    let delivered = *credit.borrow_and_update();
                    if sh.sent.load(Ordering::Relaxed) + n as u64 <= delivered + WINDOW {
                        break;
                    }
                    if credit.changed().await.is_err() {
                        return;
                    }
                }
                sh.sent.fetch_add(n as u64, Ordering::Relaxed);
                if sh.out.send(frame(b'd', stream, &buf[..n])).await.is_err() {
                    return;
                }
            }
        }
    };
    let down = async move {
        while let Some(m) = rx.recv().await {
            match m {
                ToLocal::Data(d) => {
                    if wr.write_all(&d).await.is_err() {
                        return;
                    }
                }
                ToLocal::End => {
                    let _ = wr.shutdown().await;
                }
                ToLocal::Close(why) => {
                    if !why.is_empty() {
                        eprintln!("runtime: port {port}: {why}");
                    }
                    return;
                }
            }
        }
    };
    // The connection is over when the server closes it; reading here
    // stops with it.
    tokio::select! {
        _ = down => {}
        _ = async { up.await; std::future::pending::<()>().await } => {}
    }
    if let Ok(mut c) = sh.conns.lock() {
        if c.remove(&stream).is_some() {
            let _ = sh.out.try_send(frame(b'c', stream, b""));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs() {
        assert_eq!(
            parse_spec("5432").unwrap(),
            Spec {
                local: 5432,
                remote: 5432
            }
        );
        assert_eq!(
            parse_spec("15432:5432").unwrap(),
            Spec {
                local: 15432,
                remote: 5432
            }
        );
        assert!(parse_spec("0").is_err());
        assert!(parse_spec("x:1").is_err());
        assert!(parse_spec("70000").is_err());
    }
}
