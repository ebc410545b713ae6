//! Network rules through the proxy, with real sockets: the guest is a
//! `tokio::io::duplex`, destinations are local servers standing in for
//! public hosts through `test_hosts`.
#![allow(clippy::unwrap_used, clippy::expect_used)] // helpers outside #[test] fns panic on purpose

mod common;

use std::time::Duration;

use common::*;
use runtime_egress::{EgressConfig, Policy};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn cfg(hosts: &[(&str, std::net::SocketAddr)]) -> EgressConfig {
    EgressConfig {
        test_hosts: hosts.iter().map(|(h, a)| (h.to_string(), *a)).collect(),
        ..EgressConfig::default()
    }
}

#[tokio::test]
async fn internet_on_forwards_and_off_refuses() {
    let (addr, log) = http_server().await;
    let sbx = Sandbox::new(cfg(&[("example.com", addr)]), Policy::open());
    let mut c = client(sbx.guest()).await.unwrap();
    let got = send(&mut c, get("http://example.com/on", "example.com"))
        .await
        .unwrap();
    assert_eq!(got.status, 200);
    assert_eq!(got.body, "seen /on");

    sbx.set_policy(policy(r#"{"internet":false}"#));
    let mut c = client(sbx.guest()).await.unwrap();
    let got = send(&mut c, get("http://example.com/off", "example.com"))
        .await
        .unwrap();
    assert_eq!(got.status, 403);
    assert_eq!(got.headers["x-runtime-egress"], "internet-off");
    assert!(got.body.contains("internet access is off"), "{}", got.body);
    let (a, _) = connect(&sbx, "example.com:443").await.unwrap();
    assert_eq!(a.status, 403);
    let seen: Vec<String> = log.lock().unwrap().iter().map(|s| s.uri.clone()).collect();
    assert_eq!(seen, vec!["/on"]);
}

#[tokio::test]
async fn allow_by_name_and_the_reason_the_guest_sees() {
    let (addr, _) = echo_server().await;
    let sbx = Sandbox::new(
        cfg(&[("example.com", addr), ("example.net", addr)]),
        policy(r#"{"internet":true,"allow":["example.com"]}"#),
    );
    let (a, _) = connect(&sbx, "example.com:443").await.unwrap();
    assert_eq!(a.status, 200, "{a:?}");
    let (a, mut g) = connect(&sbx, "example.net:443").await.unwrap();
    assert_eq!(a.status, 403);
    assert_eq!(
        a.body.trim(),
        "example.net is not in this sandbox's allow list"
    );
    assert_eq!(
        a.header("x-runtime-egress").as_deref(),
        Some("rule-not-allowed")
    );
    // The connection stays usable for another request after a refusal.
    g.write_all(b"CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\n")
        .await
        .unwrap();
    assert_eq!(read_answer(&mut g).await.unwrap().status, 200);
}

#[tokio::test]
async fn wildcard_matches_subdomains_at_any_depth_not_the_apex() {
    let (addr, _) = echo_server().await;
    let sbx = Sandbox::new(
        cfg(&[("*.example.org", addr), ("example.org", addr)]),
        policy(r#"{"internet":true,"allow":["*.example.org"]}"#),
    );
    for (target, status) in [
        ("a.example.org:443", 200),
        ("b.a.example.org:443", 200),
        ("example.org:443", 403),
    ] {
        let (a, _) = connect(&sbx, target).await.unwrap();
        assert_eq!(a.status, status, "{target}: {a:?}");
    }
}

#[tokio::test]
async fn deny_wins_over_allow() {
    let (addr, _) = echo_server().await;
    let sbx = Sandbox::new(
        cfg(&[("*.example.org", addr)]),
        policy(r#"{"internet":true,"allow":["*.example.org"],"deny":["bad.example.org"]}"#),
    );
    let (a, _) = connect(&sbx, "good.example.org:443").await.unwrap();
    assert_eq!(a.status, 200);
    let (a, _) = connect(&sbx, "bad.example.org:443").await.unwrap();
    assert_eq!(a.status, 403);
    assert_eq!(a.header("x-runtime-egress").as_deref(), Some("rule-denied"));
    let (code, _) = socks(&sbx, "bad.example.org", 443).await.unwrap();
    assert_eq!(code, 0x02);
}

#[tokio::test]
async fn address_and_cidr_entries() {
    let (addr, _) = echo_server().await;
    let sbx = Sandbox::new(
        cfg(&[
            ("203.0.113.7", addr),
            ("198.51.100.7", addr),
            ("2001:db8::7", addr),
        ]),
        policy(r#"{"internet":true,"allow":["203.0.113.0/24","2001:db8::7"]}"#),
    );
    let (a, _) = connect(&sbx, "203.0.113.7:443").await.unwrap();
    assert_eq!(a.status, 200, "{a:?}");
    let (a, _) = connect(&sbx, "[2001:db8::7]:443").await.unwrap();
    assert_eq!(a.status, 200, "{a:?}");
    let (a, _) = connect(&sbx, "198.51.100.7:443").await.unwrap();
    assert_eq!(a.status, 403);
    assert_eq!(socks(&sbx, "203.0.113.7", 443).await.unwrap().0, 0);
    assert_eq!(socks(&sbx, "2001:db8::7", 443).await.unwrap().0, 0);
    assert_eq!(socks(&sbx, "198.51.100.7", 443).await.unwrap().0, 0x02);
}

#[tokio::test]
async fn ports_beyond_web_ports_need_connect() {
    let (addr, _) = echo_server().await;
    let sbx = Sandbox::new(cfg(&[("example.com", addr)]), Policy::open());
    let (a, _) = connect(&sbx, "example.com:8080").await.unwrap();
    assert_eq!(a.status, 403);
    assert_eq!(
        a.header("x-runtime-egress").as_deref(),
        Some("port-not-allowed")
    );
    let (a, _) = connect(&sbx, "example.com:80").await.unwrap();
    assert_eq!(a.status, 200);

    sbx.set_policy(policy(
        r#"{"internet":true,"allow":["example.net"],"connect":["example.com:8080"]}"#,
    ));
    let (a, mut g) = connect(&sbx, "example.com:8080").await.unwrap();
    assert_eq!(a.status, 200, "{a:?}");
    g.write_all(b"ping").await.unwrap();
    let mut b = [0u8; 4];
    g.read_exact(&mut b).await.unwrap();
    assert_eq!(&b, b"ping");
    // Mail, telnet, SMB and the like stay closed even when a pair names them.
    sbx.set_policy(policy(
        r#"{"internet":true,"allow":["example.net"],"connect":["example.com:8080","example.com:25"]}"#,
    ));
    let (a, _) = connect(&sbx, "example.com:25").await.unwrap();
    assert_eq!(a.status, 403);
    assert!(a.body.contains("never open"), "{}", a.body);
    // The pair opens that port only, and allow still narrows the web ports.
    assert_eq!(
        connect(&sbx, "example.com:8081").await.unwrap().0.status,
        403
    );
    assert_eq!(
        connect(&sbx, "example.com:443").await.unwrap().0.status,
        403
    );
}

#[tokio::test]
async fn internal_addresses_refused_even_when_allowed() {
    // A real listener on loopback, explicitly allowed: still refused.
    let (addr, count) = echo_server().await;
    let port = addr.port();
    let sbx = Sandbox::new(
        EgressConfig::default(),
        policy(&format!(
            r#"{{"internet":true,
                "allow":["127.0.0.1","::1","10.0.0.0/8","169.254.169.254","fd00::/8","localhost"],
                "connect":["127.0.0.1:{port}","localhost:{port}"]}}"#
        )),
    );
    for target in [
        format!("127.0.0.1:{port}"),
        "127.0.0.1:443".into(),
        "[::1]:443".into(),
        "[::ffff:127.0.0.1]:443".into(),
        "10.1.2.3:443".into(),
        "169.254.169.254:80".into(),
        "[fd00::1]:443".into(),
        "0.0.0.0:443".into(),
    ] {
        let (a, _) = connect(&sbx, &target).await.unwrap();
        assert_eq!(a.status, 403, "{target}: {a:?}");
        assert_eq!(
            a.header("x-runtime-egress").as_deref(),
            Some("address-not-allowed"),
            "{target}"
        );
    }
    let mut c = client(sbx.guest()).await.unwrap();
    let got = send(
        &mut c,
        get(
            "http://169.254.169.254/latest/meta-data/",
            "169.254.169.254",
        ),
    )
    .await
    .unwrap();
    assert_eq!(got.status, 403);
    assert_eq!(socks(&sbx, "127.0.0.1", port).await.unwrap().0, 0x02);
    // A name that resolves to loopback (through the real resolver).
    let (a, _) = connect(&sbx, &format!("localhost:{port}")).await.unwrap();
    assert_eq!(a.status, 403, "{a:?}");
    assert!(a.body.contains("localhost is at"), "{}", a.body);
    assert_eq!(
        *count.lock().unwrap(),
        0,
        "the loopback listener was reached"
    );
}

#[tokio::test]
async fn live_change_closes_an_open_tunnel() {
    let (addr, _) = echo_server().await;
    let sbx = Sandbox::new(
        cfg(&[("example.com", addr)]),
        policy(r#"{"internet":true,"connect":["example.com:5432"]}"#),
    );
    let (a, mut g) = connect(&sbx, "example.com:5432").await.unwrap();
    assert_eq!(a.status, 200);
    let (code, mut s) = socks(&sbx, "example.com", 5432).await.unwrap();
    assert_eq!(code, 0);
    let mut b = [0u8; 4];
    for io in [&mut g, &mut s] {
        io.write_all(b"one!").await.unwrap();
        io.read_exact(&mut b).await.unwrap();
        assert_eq!(&b, b"one!");
    }
    // A change that still allows it leaves it open.
    sbx.set_policy(policy(
        r#"{"internet":true,"connect":["example.com:5432","example.net:22"]}"#,
    ));
    tokio::time::sleep(Duration::from_millis(100)).await;
    for io in [&mut g, &mut s] {
        io.write_all(b"two!").await.unwrap();
        io.read_exact(&mut b).await.unwrap();
        assert_eq!(&b, b"two!");
    }
    // One that no longer allows it closes it mid-stream.
    sbx.set_policy(policy(r#"{"internet":true,"deny":["example.com"]}"#));
    assert!(closed(&mut g).await, "CONNECT tunnel still open");
    assert!(closed(&mut s).await, "SOCKS tunnel still open");
}

#[tokio::test]
async fn live_change_closes_a_keep_alive_http_connection() {
    let (addr, _) = http_server().await;
    let sbx = Sandbox::new(cfg(&[("example.com", addr)]), Policy::open());
    let mut g = sbx.guest();
    g.write_all(b"GET http://example.com/a HTTP/1.1\r\nHost: example.com\r\n\r\n")
        .await
        .unwrap();
    assert_eq!(read_answer(&mut g).await.unwrap().status, 200);
    sbx.set_policy(policy(r#"{"internet":false}"#));
    assert!(closed(&mut g).await);
}

#[tokio::test]
async fn a_plain_http_request_reaches_the_host_of_its_url_whatever_its_host_header() {
    let (addr, log) = http_server().await;
    let sbx = Sandbox::new(
        cfg(&[("example.com", addr)]),
        policy(r#"{"internet":true,"deny":["evil.example.net"]}"#),
    );
    let mut g = sbx.guest();
    // Allowed URL, a denied site in Host (vhost fronting on a shared address).
    g.write_all(b"GET http://example.com/a HTTP/1.1\r\nHost: evil.example.net\r\n\r\n")
        .await
        .unwrap();
    assert_eq!(read_answer(&mut g).await.unwrap().status, 200);
    let seen = log.lock().unwrap();
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0].headers["host"], "example.com");
}

#[tokio::test]
async fn sni_must_pass_the_rules_too() {
    let ca = TestCa::new("test destinations");
    let (addr, log) =
        https_server(&ca, &["api.example.com", "evil.example.net", "example.com"]).await;
    let roots = [ca.der()];
    let sbx = Sandbox::new(
        EgressConfig {
            test_hosts: vec![
                ("api.example.com".into(), addr),
                ("evil.example.net".into(), addr),
                ("203.0.113.9".into(), addr),
            ],
            ..EgressConfig::default()
        },
        policy(
            r#"{"internet":true,"allow":["api.example.com","203.0.113.9"],"deny":["evil.example.net"]}"#,
        ),
    );
    // The name the CONNECT gave, in the SNI too: works.
    let (a, g) = connect(&sbx, "api.example.com:443").await.unwrap();
    assert_eq!(a.status, 200);
    let mut c = client(tls(g, "api.example.com", &roots, true).await.unwrap())
        .await
        .unwrap();
    assert_eq!(
        send(&mut c, get("/ok", "api.example.com"))
            .await
            .unwrap()
            .status,
        200
    );
    // No SNI at all: still works.
    let (_, g) = connect(&sbx, "api.example.com:443").await.unwrap();
    let mut c = client(tls(g, "api.example.com", &roots, false).await.unwrap())
        .await
        .unwrap();
    assert_eq!(
        send(&mut c, get("/nosni", "api.example.com"))
            .await
            .unwrap()
            .status,
        200
    );
    // An allowed name or address, with a refused name in the SNI: closed.
    for target in ["api.example.com:443", "203.0.113.9:443"] {
        let (a, g) = connect(&sbx, target).await.unwrap();
        assert_eq!(a.status, 200);
        assert!(
            tls(g, "evil.example.net", &roots, true).await.is_err(),
            "{target}"
        );
    }
    let (code, g) = socks(&sbx, "api.example.com", 443).await.unwrap();
    assert_eq!(code, 0);
    assert!(tls(g, "evil.example.net", &roots, true).await.is_err());
    // A name merely outside the allow list in the SNI is refused as well.
    let (_, g) = connect(&sbx, "api.example.com:443").await.unwrap();
    assert!(tls(g, "example.com", &roots, true).await.is_err());
    let seen: Vec<String> = log.lock().unwrap().iter().map(|s| s.uri.clone()).collect();
    assert_eq!(seen, vec!["/ok", "/nosni"]);
}

#[tokio::test]
async fn socks5_replies() {
    let (addr, _) = echo_server().await;
    let sbx = Sandbox::new(
        EgressConfig {
            // An unresolvable name answers 0x04 whether the resolver says so
            // or does not answer at all.
            connect_timeout: Duration::from_secs(2),
            ..cfg(&[("example.com", addr)])
        },
        Policy::open(),
    );
    let (code, mut g) = socks(&sbx, "example.com", 443).await.unwrap();
    assert_eq!(code, 0);
    g.write_all(b"hey!").await.unwrap();
    let mut b = [0u8; 4];
    g.read_exact(&mut b).await.unwrap();
    assert_eq!(&b, b"hey!");
    assert_eq!(socks(&sbx, "example.com", 8080).await.unwrap().0, 0x02);
    assert_eq!(
        socks(&sbx, "nonexistent.invalid", 443).await.unwrap().0,
        0x04
    );
    // No acceptable method.
    let mut g = sbx.guest();
    g.write_all(&[5, 1, 2]).await.unwrap();
    let mut r = [0u8; 2];
    g.read_exact(&mut r).await.unwrap();
    assert_eq!(r, [5, 0xff]);
    // BIND is not supported.
    let mut g = sbx.guest();
    g.write_all(&[5, 1, 0, 5, 2, 0, 1, 1, 2, 3, 4, 0, 80])
        .await
        .unwrap();
    let mut r = [0u8; 12];
    g.read_exact(&mut r).await.unwrap();
    assert_eq!(r[..2], [5, 0]);
    assert_eq!(r[2..4], [5, 7]);
}

#[tokio::test]
async fn absolute_form_requests_share_a_connection_each_checked() {
    let (addr, log) = http_server().await;
    let sbx = Sandbox::new(
        cfg(&[
            ("example.com", addr),
            ("*.example.org", addr),
            ("example.net", addr),
        ]),
        policy(r#"{"internet":true,"allow":["example.com","*.example.org"]}"#),
    );
    let mut c = client(sbx.guest()).await.unwrap();
    let req = http::Request::get("http://example.com/one?x=1")
        .header("host", "example.com")
        .header("proxy-authorization", "Basic Zm9vOmJhcg==")
        .header("proxy-connection", "keep-alive")
        .header("connection", "keep-alive, x-hop")
        .header("x-hop", "drop me")
        .header("x-end", "keep me")
        .body(http_body_util::Full::new(bytes::Bytes::new()))
        .unwrap();
    assert_eq!(send(&mut c, req).await.unwrap().status, 200);
    assert_eq!(
        send(&mut c, get("http://a.example.org/two", "a.example.org"))
            .await
            .unwrap()
            .status,
        200
    );
    let refused = send(&mut c, get("http://example.net/three", "example.net"))
        .await
        .unwrap();
    assert_eq!(refused.status, 403);
    assert_eq!(
        refused.body.trim(),
        "example.net is not in this sandbox's allow list"
    );
    let post = http::Request::post("http://example.com/four")
        .header("host", "example.com")
        .body(http_body_util::Full::new(bytes::Bytes::from_static(
            b"a body",
        )))
        .unwrap();
    assert_eq!(send(&mut c, post).await.unwrap().status, 200);
    let seen = log.lock().unwrap().clone();
    let uris: Vec<&str> = seen.iter().map(|s| s.uri.as_str()).collect();
    assert_eq!(uris, vec!["/one?x=1", "/two", "/four"]);
    let h = &seen[0].headers;
    assert!(h.get("proxy-authorization").is_none());
    assert!(h.get("proxy-connection").is_none());
    assert!(h.get("x-hop").is_none());
    assert_eq!(h["x-end"], "keep me");
    assert_eq!(seen[2].body.as_ref(), b"a body");
}

#[tokio::test]
async fn hostile_input_is_bounded() {
    let sbx = Sandbox::new(
        EgressConfig {
            handshake_timeout: Duration::from_millis(300),
            ..EgressConfig::default()
        },
        Policy::open(),
    );
    // Silence: dropped after the handshake timeout.
    let mut g = sbx.guest();
    assert!(closed(&mut g).await);
    // A head that never ends: refused without reading it all.
    let mut g = sbx.guest();
    let mut head = b"CONNECT example.com:443 HTTP/1.1\r\n".to_vec();
    head.extend(std::iter::repeat_n(b'a', 200 * 1024));
    let _ = tokio::time::timeout(WAIT, g.write_all(&head)).await;
    let answer = read_to_close(&mut g).await.expect("still open");
    assert!(
        answer.is_empty() || answer.starts_with(b"HTTP/1.1 431"),
        "{answer:?}"
    );
    // Half a SOCKS request: dropped.
    let mut g = sbx.guest();
    g.write_all(&[5, 1, 0, 5, 1, 0, 3, 200, b'a'])
        .await
        .unwrap();
    let mut r = [0u8; 2];
    g.read_exact(&mut r).await.unwrap();
    assert!(closed(&mut g).await);
    // Garbage.
    let mut g = sbx.guest();
    g.write_all(b"\x16\x03\x01\xff\xff garbage\r\n\r\n")
        .await
        .unwrap();
    let answer = read_to_close(&mut g).await.expect("still open");
    assert!(
        answer.is_empty() || answer.starts_with(b"HTTP/1.1 400"),
        "{answer:?}"
    );
}

#[test]
fn depends_on_no_workspace_crate() {
    let manifest =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/Cargo.toml")).unwrap();
    let deps: Vec<&str> = manifest
        .lines()
        .filter(|l| l.trim_start().starts_with("runtime-") || l.contains("aws-lc"))
        .collect();
    assert!(deps.is_empty(), "{deps:?}");
}

#[tokio::test]
async fn server_first_protocols_wait_for_a_late_client() {
    // The destination speaks first (as SSH or SMTP do); the client answers
    // after longer than the handshake timeout.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let (mut s, _) = listener.accept().await.unwrap();
        s.write_all(b"BANNER\n").await.unwrap();
        let (mut r, mut w) = s.split();
        let _ = tokio::io::copy(&mut r, &mut w).await;
    });
    let sbx = Sandbox::new(
        EgressConfig {
            handshake_timeout: Duration::from_millis(200),
            ..cfg(&[("example.com", addr)])
        },
        policy(r#"{"internet":true,"connect":["example.com:22"]}"#),
    );
    let (a, mut g) = connect(&sbx, "example.com:22").await.unwrap();
    assert_eq!(a.status, 200);
    let mut b = [0u8; 7];
    g.read_exact(&mut b).await.unwrap();
    assert_eq!(&b, b"BANNER\n");
    tokio::time::sleep(Duration::from_millis(600)).await;
    g.write_all(b"late").await.unwrap();
    let mut b = [0u8; 4];
    tokio::time::timeout(WAIT, g.read_exact(&mut b))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(&b, b"late");
}

#[tokio::test]
async fn random_bytes_never_panic_or_hang() {
    use rand::{Rng, SeedableRng};
    let sbx = Sandbox::new(
        EgressConfig {
            handshake_timeout: Duration::from_millis(200),
            ..EgressConfig::default()
        },
        policy(r#"{"internet":false}"#),
    );
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let starts: [&[u8]; 5] = [
        &[5],
        &[5, 1, 0, 5, 1, 0],
        b"CONNECT ",
        b"GET http://",
        &[0x16, 3, 1],
    ];
    for case in 0..300 {
        let mut bytes = starts[case % starts.len()].to_vec();
        let n = rng.gen_range(0..600);
        bytes.extend((0..n).map(|_| rng.gen::<u8>()));
        let (mut guest, host) = tokio::io::duplex(64 * 1024);
        let net = runtime_egress::SandboxNet {
            sandbox_id: "sbx-fuzz".into(),
            policy: sbx.policy.subscribe(),
            secrets: sbx.secrets.subscribe(),
            ca: sbx.ca.clone(),
        };
        let egress = sbx.egress.clone();
        let task = tokio::spawn(async move { egress.serve(host, net).await });
        let _ = guest.write_all(&bytes).await;
        let _ = guest.shutdown().await;
        let mut sink = Vec::new();
        let _ = tokio::time::timeout(WAIT, guest.read_to_end(&mut sink)).await;
        let joined = tokio::time::timeout(WAIT, task).await;
        assert!(matches!(joined, Ok(Ok(()))), "case {case}: {bytes:?}");
    }
}

#[tokio::test]
async fn an_address_the_operator_names_as_this_host_is_refused_like_its_own() {
    // A public address (no interface here carries it), named by
    // `--egress-deny-self`: refused before any connection is tried, with
    // the reason of the host's own addresses; another public address is
    // not refused by the rules (it then fails to connect, as nothing is
    // reachable here, which answers 502 and not 403).
    let sbx = Sandbox::new(
        EgressConfig {
            deny_self: vec!["198.51.100.7".parse().unwrap()],
            connect_timeout: Duration::from_secs(2),
            ..EgressConfig::default()
        },
        Policy::open(),
    );
    let (a, _) = connect(&sbx, "198.51.100.7:443").await.unwrap();
    assert_eq!(a.status, 403, "{a:?}");
    assert_eq!(
        a.header("x-runtime-egress").as_deref(),
        Some("address-not-allowed")
    );
    let (b, _) = connect(&sbx, "198.51.100.8:443").await.unwrap();
    assert_ne!(b.status, 403, "{b:?}");
}
