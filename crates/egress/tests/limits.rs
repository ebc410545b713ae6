//! What a guest may hold open: tunnels that go quiet are closed, and
//! upstream connections are capped per sandbox and for the whole host. Real
//! sockets, tiny timeouts and caps.
#![allow(clippy::unwrap_used, clippy::expect_used)] // helpers outside #[test] fns panic on purpose

mod common;

use std::time::Duration;

use common::*;
use runtime_egress::{EgressConfig, Policy};
use tokio::io::{AsyncReadExt, AsyncWriteExt, DuplexStream};

fn cfg(addr: std::net::SocketAddr) -> EgressConfig {
    EgressConfig {
        test_hosts: vec![("example.com".into(), addr)],
        ..EgressConfig::default()
    }
}

/// Writes `bytes` and reads their echo.
async fn echoes(g: &mut DuplexStream, bytes: &[u8]) -> bool {
    if g.write_all(bytes).await.is_err() {
        return false;
    }
    let mut b = vec![0u8; bytes.len()];
    matches!(
        tokio::time::timeout(WAIT, g.read_exact(&mut b)).await,
        Ok(Ok(_))
    ) && b == bytes
}

#[tokio::test]
async fn a_quiet_tunnel_is_closed_and_a_busy_one_is_not() {
    let (addr, _) = echo_server().await;
    let sbx = Sandbox::new(
        EgressConfig {
            tunnel_idle_timeout: Duration::from_millis(400),
            ..cfg(addr)
        },
        Policy::open(),
    );
    let (a, mut busy) = connect(&sbx, "example.com:443").await.unwrap();
    assert_eq!(a.status, 200, "{a:?}");
    let (a, mut quiet) = connect(&sbx, "example.com:443").await.unwrap();
    assert_eq!(a.status, 200, "{a:?}");
    assert!(echoes(&mut quiet, b"hello").await);
    // Busy for three idle timeouts: a byte every 100 ms keeps it open.
    for i in 0..12u8 {
        assert!(echoes(&mut busy, &[b'a' + i]).await, "closed at {i}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // The quiet one was closed meanwhile.
    assert!(closed(&mut quiet).await);
    assert!(echoes(&mut busy, b"still").await);
}

#[tokio::test]
async fn a_tunnel_where_nobody_speaks_is_closed_after_the_handshake_timeout() {
    let (addr, _) = echo_server().await;
    let sbx = Sandbox::new(
        EgressConfig {
            handshake_timeout: Duration::from_millis(300),
            ..cfg(addr)
        },
        Policy::open(),
    );
    let (a, mut g) = connect(&sbx, "example.com:443").await.unwrap();
    assert_eq!(a.status, 200, "{a:?}");
    let (code, mut s) = socks(&sbx, "example.com", 443).await.unwrap();
    assert_eq!(code, 0);
    // The default idle timeout is ten minutes: only the first-byte bound
    // can close these within the wait.
    assert!(closed(&mut g).await);
    assert!(closed(&mut s).await);
}

/// Opens a CONNECT for `sandbox`, retrying while a closed one's slot is
/// still being given back; the last answer.
async fn open_until_200(sbx: &Sandbox, sandbox: &str) -> (Answer, DuplexStream) {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let (a, g) = connect_as(sbx, sandbox, "example.com:443").await.unwrap();
        if a.status == 200 || tokio::time::Instant::now() > deadline {
            return (a, g);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn connections_beyond_a_sandboxs_cap_or_the_hosts_are_refused() {
    let (addr, count) = echo_server().await;
    let sbx = Sandbox::new(
        EgressConfig {
            max_connections: 3,
            max_connections_per_sandbox: 2,
            ..cfg(addr)
        },
        Policy::open(),
    );
    let mut a_conns = Vec::new();
    for _ in 0..2 {
        let (a, mut g) = connect_as(&sbx, "sbx-a", "example.com:443").await.unwrap();
        assert_eq!(a.status, 200, "{a:?}");
        assert!(echoes(&mut g, b"x").await);
        a_conns.push(g);
    }
    // The third of sandbox a: refused, whichever way it asks.
    let (a, _) = connect_as(&sbx, "sbx-a", "example.com:443").await.unwrap();
    assert_eq!(a.status, 503, "{a:?}");
    assert_eq!(
        a.header("x-runtime-egress").as_deref(),
        Some("too-many-connections")
    );
    assert!(
        a.body
            .contains("this sandbox has 2 outbound connections open"),
        "{}",
        a.body
    );
    // Sandbox b is not held back by a's cap, only by the host's.
    let (a, mut b1) = connect_as(&sbx, "sbx-b", "example.com:443").await.unwrap();
    assert_eq!(a.status, 200, "{a:?}");
    assert!(echoes(&mut b1, b"y").await);
    let (a, _) = connect_as(&sbx, "sbx-b", "example.com:443").await.unwrap();
    assert_eq!(a.status, 503, "{a:?}");
    assert!(
        a.body.contains("the host has 3 outbound connections open"),
        "{}",
        a.body
    );
    let (code, _) = socks(&sbx, "example.com", 443).await.unwrap();
    assert_eq!(code, 0x01, "SOCKS: general failure");
    assert_eq!(
        *count.lock().unwrap(),
        3,
        "a refused connection reached the destination"
    );
    // One of a's closes: its slot is given back, b gets it.
    drop(a_conns.pop());
    let (a, mut b2) = open_until_200(&sbx, "sbx-b").await;
    assert_eq!(a.status, 200, "{a:?}");
    assert!(echoes(&mut b2, b"z").await);
    // Four refusals, one warning (they are rate-limited).
    let warnings = logs()
        .matches("outbound connections refused by a cap")
        .count();
    assert_eq!(warnings, 1, "{}", logs());
}
