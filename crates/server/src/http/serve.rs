//! The accept loop: each connection served by hyper's HTTP/1 with a timer,
//! so a client that sends its request head too slowly, or holds a
//! keep-alive connection idle, is cut off (`header_read_timeout`); at most
//! `max_connections` are open at once (the next waits in the kernel's
//! backlog), so no client can use up the server's descriptors. WebSocket
//! and other upgrades pass through. On `stop`, the listener closes and the
//! open connections finish what they are doing, up to `drain`.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// How connections are held to account.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Limits {
    /// A request head must arrive whole within this, counted from the
    /// connection's start or the end of its last answer (so an idle
    /// keep-alive connection closes after it too).
    pub(crate) header_read: Duration,
    /// Most connections open at once.
    pub(crate) max_connections: usize,
    /// How long open connections may finish after the listener closed.
    pub(crate) drain: Duration,
}

/// The address a request's connection came from, put in its extensions
/// by the accept loop (absent in in-process tests, which call the router
/// directly).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Peer(pub std::net::SocketAddr);

impl Peer {
    /// Whether the connection came from this machine's loopback.
    pub(crate) fn is_loopback(&self) -> bool {
        self.0.ip().to_canonical().is_loopback()
    }
}

/// Serves `app` on `listener` until `stop` resolves.
pub(crate) async fn serve<L>(
    mut listener: L,
    app: Router,
    limits: Limits,
    stop: impl Future<Output = ()>,
) where
    L: axum::serve::Listener<Addr = std::net::SocketAddr>,
{
    let closing = CancellationToken::new();
    let open = TaskTracker::new();
    let slots = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    tokio::pin!(stop);
    loop {
        let slot = tokio::select! {
            s = Arc::clone(&slots).acquire_owned() => match s {
                Ok(s) => s,
                Err(_) => break,
            },
            () = &mut stop => break,
        };
        let (io, addr) = tokio::select! {
            c = listener.accept() => c,
            () = &mut stop => break,
        };
        let mut builder = hyper::server::conn::http1::Builder::new();
        builder
            .timer(TokioTimer::new())
            .header_read_timeout(limits.header_read);
        let service = tower::ServiceExt::map_request(
            app.clone(),
            move |mut req: axum::http::Request<hyper::body::Incoming>| {
                req.extensions_mut().insert(Peer(addr));
                req
            },
        );
        let conn = builder
            .serve_connection(TokioIo::new(io), TowerToHyperService::new(service))
            .with_upgrades();
        let closing = closing.clone();
        open.spawn(async move {
            tokio::pin!(conn);
            let ended = tokio::select! {
                r = conn.as_mut() => r,
                () = closing.cancelled() => {
                    // The answer in progress finishes; no next request.
                    conn.as_mut().graceful_shutdown();
                    conn.await
                }
            };
            if let Err(e) = ended {
                tracing::debug!(error = %e, "connection ended with an error");
            }
            drop(slot);
        });
    }
    drop(listener);
    closing.cancel();
    open.close();
    if tokio::time::timeout(limits.drain, open.wait())
        .await
        .is_err()
    {
        tracing::warn!(
            "connections still open {} s after the listener closed: dropped",
            limits.drain.as_secs()
        );
    }
}
