//! UDP flows through the proxy (`connect-udp`, RFC 9298, over HTTP/1.1):
//! the same rules as connections, datagrams both ways as capsules, counted
//! as outbound traffic, closed by a rule change. The destination is a local
//! UDP echo server standing in for a public host through `test_hosts`.
#![allow(clippy::unwrap_used, clippy::expect_used)] // helpers outside #[test] fns panic on purpose

mod common;

use std::net::SocketAddr;

use common::*;
use runtime_egress::{EgressConfig, Policy};
use tokio::io::{AsyncReadExt, AsyncWriteExt, DuplexStream};
use tokio::net::UdpSocket;

/// Answers each datagram with it upper-cased.
async fn udp_echo() -> SocketAddr {
    let s = UdpSocket::bind("127.0.0.1:0").await.unwrap();
    let addr = s.local_addr().unwrap();
    tokio::spawn(async move {
        let mut b = vec![0u8; 65_536];
        while let Ok((n, from)) = s.recv_from(&mut b).await {
            let _ = s.send_to(&b[..n].to_ascii_uppercase(), from).await;
        }
    });
    addr
}

fn cfg(addr: SocketAddr) -> EgressConfig {
    EgressConfig {
        test_hosts: vec![("udp.example.com".into(), addr)],
        ..EgressConfig::default()
    }
}

async fn connect_udp(sbx: &Sandbox, host: &str, port: u16) -> (Answer, DuplexStream) {
    let mut g = sbx.guest();
    let req = format!(
        "GET /.well-known/masque/udp/{host}/{port}/ HTTP/1.1\r\nHost: proxy\r\n\
         Connection: Upgrade\r\nUpgrade: connect-udp\r\nCapsule-Protocol: ?1\r\n\r\n"
    );
    g.write_all(req.as_bytes()).await.unwrap();
    let a = tokio::time::timeout(WAIT, read_answer(&mut g))
        .await
        .unwrap()
        .unwrap();
    (a, g)
}

/// A DATAGRAM capsule (type 0, context 0) of a short payload.
fn capsule(payload: &[u8]) -> Vec<u8> {
    assert!(payload.len() < 63);
    let mut c = vec![0, payload.len() as u8 + 1, 0];
    c.extend_from_slice(payload);
    c
}

async fn read_capsule(g: &mut DuplexStream) -> Vec<u8> {
    let mut head = [0u8; 3];
    tokio::time::timeout(WAIT, g.read_exact(&mut head))
        .await
        .unwrap()
        .unwrap();
    assert_eq!((head[0], head[2]), (0, 0), "a datagram of context 0");
    let mut body = vec![0u8; usize::from(head[1]) - 1];
    g.read_exact(&mut body).await.unwrap();
    body
}

#[tokio::test]
async fn datagrams_go_both_ways_under_the_rules_and_are_counted() {
    let echo = udp_echo().await;
    let sbx = Sandbox::new(cfg(echo), Policy::open());

    // Port 5353 is not open by default: UDP has the same ports as TCP.
    let (a, _) = connect_udp(&sbx, "udp.example.com", 5353).await;
    assert_eq!(a.status, 403, "{a:?}");
    assert_eq!(
        a.header("x-runtime-egress").as_deref(),
        Some("port-not-allowed")
    );

    sbx.set_policy(policy(
        r#"{"internet":true,"connect":["udp.example.com:5353"]}"#,
    ));
    let (a, mut g) = connect_udp(&sbx, "udp.example.com", 5353).await;
    assert_eq!(a.status, 101, "{a:?}");
    assert_eq!(a.header("upgrade").as_deref(), Some("connect-udp"));
    let before = sbx.egress.traffic();
    for word in [&b"ping"[..], b"two words", b""] {
        g.write_all(&capsule(word)).await.unwrap();
        assert_eq!(read_capsule(&mut g).await, word.to_ascii_uppercase());
    }
    let after = sbx.egress.traffic();
    assert_eq!(after.sent_bytes - before.sent_bytes, 13);
    assert_eq!(after.received_bytes - before.received_bytes, 13);
    let outbound: u64 = sbx
        .egress
        .take_outbound()
        .iter()
        .filter(|(id, _)| id == "sbx-test")
        .map(|(_, n)| n)
        .sum();
    assert_eq!(outbound, 13);

    // A rule change that refuses the target ends the flow.
    sbx.set_policy(policy(r#"{"internet":true}"#));
    assert!(closed(&mut g).await, "the flow was not closed");

    // Private addresses stay refused, and the API's name is no UDP target.
    sbx.set_policy(Policy::open());
    let (a, _) = connect_udp(&sbx, "10.0.0.1", 443).await;
    assert_eq!(a.status, 403, "{a:?}");
    let (a, _) = connect_udp(&sbx, "runtime.internal", 80).await;
    assert_eq!(a.status, 400, "{a:?}");
    let (a, _) = connect_udp(&sbx, "udp.example.com", 0).await;
    assert_eq!(a.status, 400, "{a:?}");
}

#[tokio::test]
async fn a_flow_takes_a_slot_of_the_sandboxs_connection_cap() {
    let echo = udp_echo().await;
    let sbx = Sandbox::new(
        EgressConfig {
            max_connections_per_sandbox: 1,
            ..cfg(echo)
        },
        policy(r#"{"internet":true,"connect":["udp.example.com:5353"]}"#),
    );
    let (a, _held) = connect_udp(&sbx, "udp.example.com", 5353).await;
    assert_eq!(a.status, 101, "{a:?}");
    let (a, _) = connect_udp(&sbx, "udp.example.com", 5353).await;
    assert_eq!(a.status, 503, "{a:?}");
    assert_eq!(
        a.header("x-runtime-egress").as_deref(),
        Some("too-many-connections")
    );
}
