//! `runtime.internal`: judged by the sandbox's rules by name, handed to the
//! server's API (here a stand-in that answers which sandbox asked and what),
//! bounded per sandbox, and never counted as outbound traffic.
#![allow(clippy::unwrap_used, clippy::expect_used)] // helpers outside #[test] fns panic on purpose

mod common;

use std::sync::{Arc, Mutex};

use common::*;
use runtime_egress::{EgressConfig, InternalApi, Policy};
use tokio::io::{AsyncReadExt, AsyncWriteExt, DuplexStream};
use tokio::sync::watch;

/// Answers each request with `<sandbox id> <request line> <host header>`,
/// once `gate` is open; records every sandbox id it was given.
struct Stand {
    gate: watch::Receiver<bool>,
    seen: Mutex<Vec<String>>,
}

impl InternalApi for Stand {
    fn serve(&self, sandbox_id: &str, mut stream: DuplexStream) {
        self.seen.lock().unwrap().push(sandbox_id.to_owned());
        let id = sandbox_id.to_owned();
        let mut gate = self.gate.clone();
        tokio::spawn(async move {
            loop {
                let mut head = Vec::new();
                while !head.ends_with(b"\r\n\r\n") {
                    let mut b = [0u8; 1];
                    if stream.read(&mut b).await.unwrap_or(0) == 0 {
                        return;
                    }
                    head.push(b[0]);
                }
                let _ = gate.wait_for(|open| *open).await;
                let head = String::from_utf8_lossy(&head).to_string();
                let line = head.lines().next().unwrap_or("").to_string();
                let host = head
                    .lines()
                    .find_map(|l| l.strip_prefix("host: ").or(l.strip_prefix("Host: ")))
                    .unwrap_or("-")
                    .to_string();
                let body = format!("{id} {line} {host}");
                let answer = format!(
                    "HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n{body}",
                    body.len()
                );
                if stream.write_all(answer.as_bytes()).await.is_err() {
                    return;
                }
            }
        });
    }
}

fn world(policy: Policy, open: bool) -> (Sandbox, Arc<Stand>, watch::Sender<bool>) {
    let sbx = Sandbox::new(
        EgressConfig {
            max_api_per_sandbox: 3,
            ..EgressConfig::default()
        },
        policy,
    );
    let (tx, rx) = watch::channel(open);
    let stand = Arc::new(Stand {
        gate: rx,
        seen: Mutex::new(Vec::new()),
    });
    sbx.egress.api().set(Some(stand.clone()));
    (sbx, stand, tx)
}

/// `GET http://runtime.internal<path>` through the proxy, as `sandbox`.
async fn get(sbx: &Sandbox, sandbox: &str, path: &str) -> (Answer, DuplexStream) {
    let mut g = sbx.guest_as(sandbox);
    g.write_all(
        format!("GET http://runtime.internal{path} HTTP/1.1\r\nHost: elsewhere.example\r\n\r\n")
            .as_bytes(),
    )
    .await
    .unwrap();
    let a = tokio::time::timeout(WAIT, read_answer(&mut g))
        .await
        .unwrap()
        .unwrap();
    (a, g)
}

#[tokio::test]
async fn absolute_form_connect_and_socks_reach_the_api_as_their_sandbox() {
    let (sbx, stand, _gate) = world(Policy::open(), true);
    let (a, _) = get(&sbx, "sbx-a", "/v1/me?x=1").await;
    assert_eq!(a.status, 200, "{a:?}");
    // The request goes on in origin form with the URL's host, not the
    // Host header the guest sent.
    assert_eq!(a.body, "sbx-a GET /v1/me?x=1 HTTP/1.1 runtime.internal");

    let (a, mut g) = connect_as(&sbx, "sbx-b", "runtime.internal:80")
        .await
        .unwrap();
    assert_eq!(a.status, 200, "{a:?}");
    g.write_all(b"GET /v1/sandboxes HTTP/1.1\r\nHost: runtime.internal\r\n\r\n")
        .await
        .unwrap();
    let a = read_answer(&mut g).await.unwrap();
    assert_eq!(a.body, "sbx-b GET /v1/sandboxes HTTP/1.1 runtime.internal");

    let (code, _s) = socks(&sbx, "runtime.internal", 80).await.unwrap();
    assert_eq!(code, 0);
    assert_eq!(
        *stand.seen.lock().unwrap(),
        ["sbx-a", "sbx-b", "sbx-test"],
        "each connection names the sandbox it came from"
    );
    // Not outbound: no upstream connection was opened or counted.
    let t = sbx.egress.traffic();
    assert_eq!((t.connections, t.sent_bytes, t.received_bytes), (0, 0, 0));
}

#[tokio::test]
async fn the_sandboxs_rules_apply_by_name() {
    let cases = [
        (r#"{"internet": false}"#, 80, Some("internet-off")),
        (
            r#"{"internet": true, "allow": ["example.com"]}"#,
            80,
            Some("rule-not-allowed"),
        ),
        // An address range admits no name that has no address.
        (
            r#"{"internet": true, "allow": ["0.0.0.0/0"]}"#,
            80,
            Some("rule-not-allowed"),
        ),
        (
            r#"{"internet": true, "deny": ["runtime.internal"]}"#,
            80,
            Some("rule-denied"),
        ),
        (
            r#"{"internet": true, "allow": ["runtime.internal"]}"#,
            80,
            None,
        ),
        (r#"{"internet": true, "allow": ["*.internal"]}"#, 80, None),
        (r#"{"internet": true}"#, 443, Some("port-not-allowed")),
        (
            r#"{"internet": true, "connect": ["runtime.internal:8080"]}"#,
            8080,
            Some("port-not-allowed"),
        ),
    ];
    for (rules, port, refusal) in cases {
        let (sbx, stand, _gate) = world(policy(rules), true);
        let (a, _) = connect(&sbx, &format!("runtime.internal:{port}"))
            .await
            .unwrap();
        match refusal {
            Some(code) => {
                assert_eq!(a.status, 403, "{rules} :{port}: {a:?}");
                assert_eq!(
                    a.header("x-runtime-egress").as_deref(),
                    Some(code),
                    "{rules}"
                );
                assert!(stand.seen.lock().unwrap().is_empty(), "{rules}");
            }
            None => assert_eq!(a.status, 200, "{rules}: {a:?}"),
        }
    }
}

#[tokio::test]
async fn a_rule_change_closes_an_open_api_connection() {
    let (sbx, _stand, _gate) = world(Policy::open(), true);
    let (a, mut g) = connect(&sbx, "runtime.internal:80").await.unwrap();
    assert_eq!(a.status, 200, "{a:?}");
    sbx.set_policy(policy(r#"{"internet": false}"#));
    assert!(closed(&mut g).await);
}

#[tokio::test]
async fn requests_beyond_the_sandboxs_bound_get_429_api_busy() {
    let (sbx, _stand, gate) = world(Policy::open(), false);
    // Three requests held open by the API.
    let mut held = Vec::new();
    for i in 0..3 {
        let mut g = sbx.guest_as("sbx-a");
        g.write_all(format!("GET http://runtime.internal/v1/slow/{i} HTTP/1.1\r\n\r\n").as_bytes())
            .await
            .unwrap();
        held.push(g);
    }
    // Let the three take their slots.
    let deadline = tokio::time::Instant::now() + WAIT;
    let busy = loop {
        let (a, _) = get(&sbx, "sbx-a", "/v1/me").await;
        if a.status == 429 || tokio::time::Instant::now() > deadline {
            break a;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    };
    assert_eq!(busy.status, 429, "{busy:?}");
    assert_eq!(busy.header("x-runtime-egress").as_deref(), Some("api-busy"));
    assert!(busy.body.contains("3 requests"), "{}", busy.body);
    let (code, _) = socks(&sbx, "runtime.internal", 80).await.unwrap();
    // "sbx-test" is another sandbox: not held back by sbx-a's bound.
    assert_eq!(code, 0);
    let (code, _) = {
        let mut g = sbx.guest_as("sbx-a");
        g.write_all(&[5, 1, 0]).await.unwrap();
        let mut r = [0u8; 2];
        g.read_exact(&mut r).await.unwrap();
        g.write_all(&[5, 1, 0, 3, 16]).await.unwrap();
        g.write_all(b"runtime.internal").await.unwrap();
        g.write_all(&80u16.to_be_bytes()).await.unwrap();
        let mut reply = [0u8; 10];
        g.read_exact(&mut reply).await.unwrap();
        (reply[1], g)
    };
    assert_eq!(code, 0x01, "SOCKS: general failure for the busy sandbox");
    // The held ones are answered; their slots come back.
    gate.send_replace(true);
    for g in &mut held {
        let a = tokio::time::timeout(WAIT, read_answer(g))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(a.status, 200, "{a:?}");
        assert!(a.body.starts_with("sbx-a GET /v1/slow/"), "{}", a.body);
    }
    drop(held);
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let (a, _) = get(&sbx, "sbx-a", "/v1/me").await;
        if a.status == 200 {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "{a:?}");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn without_a_server_the_name_goes_nowhere() {
    let sbx = Sandbox::new(EgressConfig::default(), Policy::open());
    let (a, _) = connect(&sbx, "runtime.internal:80").await.unwrap();
    assert_eq!(a.status, 502, "{a:?}");
    assert_eq!(
        a.header("x-runtime-egress").as_deref(),
        Some("connect-failed")
    );
}
