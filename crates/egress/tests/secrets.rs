//! Secret substitution through the proxy: the guest trusts only the
//! sandbox's CA, destinations are local HTTPS servers with a CA of their own.
#![allow(clippy::unwrap_used, clippy::expect_used)] // helpers outside #[test] fns panic on purpose

mod common;

use std::sync::Arc;

use bytes::Bytes;
use common::*;
use http_body_util::Full;
use runtime_egress::{
    make_placeholder, CertificateDer, EgressConfig, Policy, SandboxCa, Secret, SecretRule,
    SecretValue,
};

const VALUE: &str = "real-value-7f3a";

struct World {
    sbx: Sandbox,
    api_log: Log,
    other_log: Log,
    plain_log: Log,
    untrusted_log: Log,
    dest_roots: Vec<CertificateDer<'static>>,
    guest_roots: Vec<CertificateDer<'static>>,
}

/// api.example.com and other.example.org are trusted HTTPS destinations;
/// untrusted.example.com shows a certificate from a CA nobody trusts;
/// plain.example.com speaks plain HTTP.
async fn world(policy: Policy) -> World {
    let ca = TestCa::new("test destinations");
    let rogue = TestCa::new("rogue");
    let (api, api_log) = https_server(&ca, &["api.example.com"]).await;
    let (other, other_log) = https_server(&ca, &["other.example.org"]).await;
    let (untrusted, untrusted_log) = https_server(&rogue, &["untrusted.example.com"]).await;
    let (plain, plain_log) = http_server().await;
    let sbx = Sandbox::new(
        EgressConfig {
            test_hosts: vec![
                ("api.example.com".into(), api),
                ("other.example.org".into(), other),
                ("untrusted.example.com".into(), untrusted),
                ("plain.example.com".into(), plain),
            ],
            extra_roots: vec![ca.der()],
            ..EgressConfig::default()
        },
        policy,
    );
    let guest_roots = vec![sbx.ca.cert_der().clone()];
    World {
        sbx,
        api_log,
        other_log,
        plain_log,
        untrusted_log,
        dest_roots: vec![ca.der()],
        guest_roots,
    }
}

fn secret(name: &str, hosts: &[&str]) -> Secret {
    Secret {
        name: name.into(),
        value: SecretValue::new(VALUE),
        hosts: hosts.iter().map(|h| h.to_string()).collect(),
        header: None,
        format: None,
        rules: Vec::new(),
        placeholder: make_placeholder(),
    }
}

impl World {
    fn set(&self, secrets: Vec<Secret>) {
        self.sbx.secrets.send_replace(Arc::new(secrets));
    }

    /// An HTTPS client to `host` through CONNECT, trusting the sandbox CA.
    async fn https(
        &self,
        host: &str,
        roots: &[CertificateDer<'static>],
    ) -> hyper::client::conn::http1::SendRequest<Full<Bytes>> {
        let (a, g) = connect(&self.sbx, &format!("{host}:443")).await.unwrap();
        assert_eq!(a.status, 200, "{a:?}");
        client(tls(g, host, roots, true).await.unwrap())
            .await
            .unwrap()
    }
}

fn req(
    method: &str,
    uri: &str,
    host: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> http::Request<Full<Bytes>> {
    let mut b = http::Request::builder()
        .method(method)
        .uri(uri)
        .header("host", host);
    for (k, v) in headers {
        b = b.header(*k, *v);
    }
    b.body(Full::new(Bytes::from(body.to_owned()))).unwrap()
}

#[tokio::test]
async fn header_set_by_header_and_format() {
    let w = world(Policy::open()).await;
    let mut s = secret("API_KEY", &["api.example.com"]);
    s.header = Some("Authorization".into());
    s.format = Some("Bearer {value}".into());
    let mut plain_header = secret("OTHER", &["api.example.com"]);
    plain_header.header = Some("X-Api-Key".into());
    w.set(vec![s, plain_header]);
    let mut c = w.https("api.example.com", &w.guest_roots).await;
    let got = send(
        &mut c,
        req(
            "GET",
            "/v1/me",
            "api.example.com",
            &[("authorization", "Bearer junk")],
            "",
        ),
    )
    .await
    .unwrap();
    assert_eq!(got.status, 200, "{}", got.body);
    // A second request on the same connection gets it too.
    let got = send(&mut c, req("GET", "/v1/again", "api.example.com", &[], ""))
        .await
        .unwrap();
    assert_eq!(got.status, 200);
    let seen = w.api_log.lock().unwrap().clone();
    assert_eq!(seen.len(), 2);
    for s in &seen {
        assert_eq!(s.headers["authorization"], format!("Bearer {VALUE}"));
        assert_eq!(s.headers.get_all("authorization").iter().count(), 1);
        assert_eq!(s.headers["x-api-key"], VALUE);
    }
}

#[tokio::test]
async fn placeholder_swapped_in_credential_headers_and_query_values_only() {
    let w = world(Policy::open()).await;
    let s = secret("API_KEY", &["api.example.com"]);
    let ph = s.placeholder.clone();
    let unrelated = secret("ELSEWHERE", &["other.example.org"]);
    let ph2 = unrelated.placeholder.clone();
    w.set(vec![s, unrelated]);
    let mut c = w.https("api.example.com", &w.guest_roots).await;
    let got = send(
        &mut c,
        req(
            "POST",
            &format!("/v1/items/{ph}?key={ph}&other={ph2}"),
            "api.example.com",
            &[
                ("x-api-key", &ph),
                ("authorization", &format!("Bearer {ph}")),
                ("x-request-note", &ph),
            ],
            &format!("{{\"key\":\"{ph}\"}}"),
        ),
    )
    .await
    .unwrap();
    assert_eq!(got.status, 200, "{}", got.body);
    let seen = w.api_log.lock().unwrap().clone();
    assert_eq!(seen.len(), 1);
    let s = &seen[0];
    assert_eq!(s.uri, format!("/v1/items/{ph}?key={VALUE}&other={ph2}"));
    assert_eq!(s.headers["x-api-key"], VALUE);
    assert_eq!(s.headers["authorization"], format!("Bearer {VALUE}"));
    assert_eq!(s.headers["x-request-note"], ph.as_str());
    assert_eq!(s.headers["accept-encoding"], "identity");
    assert_eq!(s.body.as_ref(), format!("{{\"key\":\"{ph}\"}}").as_bytes());
}

#[tokio::test]
async fn a_host_that_echoes_the_request_never_shows_the_value_to_the_guest() {
    let w = world(Policy::open()).await;
    let s = secret("API_KEY", &["api.example.com"]);
    let ph = s.placeholder.clone();
    let mut bearer = secret("BEARER", &["api.example.com"]);
    bearer.header = Some("x-set".into());
    bearer.format = Some("Token {value}".into());
    bearer.value = SecretValue::new("second value/+&");
    w.set(vec![s, bearer]);
    let mut c = w.https("api.example.com", &w.guest_roots).await;
    let got = send(
        &mut c,
        req(
            "GET",
            &format!("/echo/{ph}?k={ph}"),
            "api.example.com",
            &[("authorization", &format!("Bearer {ph}"))],
            "",
        ),
    )
    .await
    .unwrap();
    assert_eq!(got.status, 200, "{}", got.body);
    // The destination got both values where they belong.
    let seen = w.api_log.lock().unwrap().clone();
    assert_eq!(seen[0].headers["authorization"], format!("Bearer {VALUE}"));
    assert_eq!(seen[0].headers["x-set"], "Token second value/+&");
    assert_eq!(seen[0].uri, format!("/echo/{ph}?k={VALUE}"));
    // It echoed them in its body and an answer header; the guest sees masks
    // of the same length, the placeholder where it stayed, and no value in
    // any form the request carried it.
    let stars = "*".repeat(VALUE.len());
    assert_eq!(
        got.headers["x-echo-authorization"],
        format!("Bearer {stars}")
    );
    assert!(
        got.body
            .contains(&format!("authorization: Bearer {stars}\n")),
        "{}",
        got.body
    );
    assert!(
        got.body.contains(&format!("uri /echo/{ph}?k={stars}\n")),
        "{}",
        got.body
    );
    assert!(
        got.body.contains(&format!("x-set: {}\n", "*".repeat(21))),
        "{}",
        got.body
    );
    for leaked in [VALUE, "second value", "second%20value"] {
        assert!(!got.body.contains(leaked), "{leaked} in {}", got.body);
    }
    let content_length: usize = got.headers["content-length"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(content_length, got.body.len());
}

#[tokio::test]
async fn trace_to_a_secret_host_is_refused() {
    let w = world(Policy::open()).await;
    let mut s = secret("API_KEY", &["api.example.com"]);
    s.header = Some("authorization".into());
    w.set(vec![s]);
    let mut c = w.https("api.example.com", &w.guest_roots).await;
    for method in ["TRACE", "TRACK"] {
        let got = send(&mut c, req(method, "/", "api.example.com", &[], ""))
            .await
            .unwrap();
        assert_eq!(got.status, 405, "{method}");
        assert_eq!(got.headers["x-runtime-egress"], "method-refused");
        assert!(got.body.contains("would echo the request"), "{}", got.body);
    }
    assert!(w.api_log.lock().unwrap().is_empty());
}

#[tokio::test]
async fn an_encoded_answer_to_a_request_with_a_value_is_refused() {
    let w = world(Policy::open()).await;
    let mut s = secret("API_KEY", &["api.example.com"]);
    s.header = Some("authorization".into());
    w.set(vec![s]);
    let mut c = w.https("api.example.com", &w.guest_roots).await;
    let got = send(
        &mut c,
        req(
            "GET",
            "/gzip",
            "api.example.com",
            &[("accept-encoding", "gzip")],
            "",
        ),
    )
    .await
    .unwrap();
    assert_eq!(got.status, 502);
    assert_eq!(got.headers["x-runtime-egress"], "encoded-response");
    assert!(
        got.body.contains("cannot read this encoding"),
        "{}",
        got.body
    );
    assert_eq!(
        w.api_log.lock().unwrap()[0].headers["accept-encoding"],
        "identity"
    );
}

#[tokio::test]
async fn plain_http_carries_the_placeholder() {
    let w = world(Policy::open()).await;
    let s = secret("API_KEY", &["plain.example.com"]);
    let ph = s.placeholder.clone();
    w.set(vec![s]);
    let mut c = client(w.sbx.guest()).await.unwrap();
    let got = send(
        &mut c,
        req(
            "GET",
            &format!("http://plain.example.com/?key={ph}"),
            "plain.example.com",
            &[("x-api-key", &ph)],
            "",
        ),
    )
    .await
    .unwrap();
    assert_eq!(got.status, 200);
    let seen = w.plain_log.lock().unwrap().clone();
    assert_eq!(seen[0].uri, format!("/?key={ph}"));
    assert_eq!(seen[0].headers["x-api-key"], ph.as_str());
}

#[tokio::test]
async fn hosts_not_listed_get_the_placeholder() {
    let w = world(Policy::open()).await;
    let mut s = secret("API_KEY", &["api.example.com"]);
    s.header = Some("x-set".into());
    let ph = s.placeholder.clone();
    w.set(vec![s]);
    // Another host: passed through untouched (the guest sees the real
    // destination's certificate).
    let mut c = w.https("other.example.org", &w.dest_roots).await;
    let got = send(
        &mut c,
        req(
            "GET",
            &format!("/?key={ph}"),
            "other.example.org",
            &[("x-api-key", &ph)],
            "",
        ),
    )
    .await
    .unwrap();
    assert_eq!(got.status, 200);
    let seen = w.other_log.lock().unwrap().clone();
    assert_eq!(seen[0].uri, format!("/?key={ph}"));
    assert_eq!(seen[0].headers["x-api-key"], ph.as_str());
    assert!(seen[0].headers.get("x-set").is_none());
    // The secret's host, but a request naming another virtual host.
    let mut c = w.https("api.example.com", &w.guest_roots).await;
    let got = send(
        &mut c,
        req("GET", &format!("/?key={ph}"), "other.example.org", &[], ""),
    )
    .await
    .unwrap();
    assert_eq!(got.status, 200);
    let seen = w.api_log.lock().unwrap().clone();
    assert_eq!(seen[0].uri, format!("/?key={ph}"));
    assert!(seen[0].headers.get("x-set").is_none());
}

#[tokio::test]
async fn rules_choose_the_requests_by_method_and_path() {
    let w = world(Policy::open()).await;
    let mut s = secret("GH", &["api.example.com"]);
    s.rules = vec![SecretRule {
        methods: vec!["GET".into(), "HEAD".into()],
        paths: vec!["/repos/acme/*".into()],
    }];
    let ph = s.placeholder.clone();
    w.set(vec![s]);
    let mut c = w.https("api.example.com", &w.guest_roots).await;
    let cases = [
        ("GET", "/repos/acme/x", true),
        ("POST", "/repos/acme/x", false),
        ("GET", "/repos/other/x", false),
        ("GET", "/repos/acme/%2e%2e/other", false),
        ("GET", "/repos/acme%2fx", false),
        ("get", "/repos/acme/deep/er", true),
    ];
    for (method, path, _) in cases {
        let got = send(
            &mut c,
            req(method, path, "api.example.com", &[("x-key", &ph)], ""),
        )
        .await
        .unwrap();
        assert_eq!(got.status, 200, "{method} {path}");
    }
    let seen = w.api_log.lock().unwrap().clone();
    assert_eq!(seen.len(), cases.len());
    for (s, (method, path, swapped)) in seen.iter().zip(cases) {
        let expected = if swapped { VALUE } else { ph.as_str() };
        assert_eq!(s.headers["x-key"], expected, "{method} {path}");
    }
}

#[tokio::test]
async fn the_destination_certificate_is_verified() {
    let w = world(Policy::open()).await;
    let s = secret("API_KEY", &["untrusted.example.com"]);
    let ph = s.placeholder.clone();
    w.set(vec![s]);
    let mut c = w.https("untrusted.example.com", &w.guest_roots).await;
    let got = send(
        &mut c,
        req(
            "GET",
            "/",
            "untrusted.example.com",
            &[("x-api-key", &ph)],
            "",
        ),
    )
    .await
    .unwrap();
    assert_eq!(got.status, 502);
    assert_eq!(got.headers["x-runtime-egress"], "upstream-tls-failed");
    assert!(w.untrusted_log.lock().unwrap().is_empty());
}

#[tokio::test]
async fn network_rules_come_first() {
    let w = world(policy(r#"{"internet":true,"allow":["other.example.org"]}"#)).await;
    w.set(vec![secret("API_KEY", &["api.example.com"])]);
    let (a, _) = connect(&w.sbx, "api.example.com:443").await.unwrap();
    assert_eq!(a.status, 403);
    let (code, _) = socks(&w.sbx, "api.example.com", 443).await.unwrap();
    assert_eq!(code, 0x02);
}

#[tokio::test]
async fn socks_and_a_persisted_ca_work_too() {
    let mut w = world(Policy::open()).await;
    // The server persists the CA and loads it again: the guest's copy still
    // verifies what the proxy shows.
    let loaded = SandboxCa::from_pem(w.sbx.ca.cert_pem(), w.sbx.ca.key_pem()).unwrap();
    w.sbx.ca = Arc::new(loaded);
    let mut s = secret("API_KEY", &["*.example.com"]);
    s.header = Some("authorization".into());
    w.set(vec![s]);
    let (code, g) = socks(&w.sbx, "api.example.com", 443).await.unwrap();
    assert_eq!(code, 0);
    let mut c = client(
        tls(g, "api.example.com", &w.guest_roots, true)
            .await
            .unwrap(),
    )
    .await
    .unwrap();
    assert_eq!(
        send(&mut c, get("/s", "api.example.com"))
            .await
            .unwrap()
            .status,
        200
    );
    assert_eq!(w.api_log.lock().unwrap()[0].headers["authorization"], VALUE);
}

#[tokio::test]
async fn a_secret_added_later_applies_to_new_requests() {
    let w = world(Policy::open()).await;
    let mut s = secret("API_KEY", &["api.example.com"]);
    s.header = Some("x-set".into());
    // Intercepted because another secret names the host; this one is added
    // once the connection is open.
    let first = secret("FIRST", &["api.example.com"]);
    w.set(vec![first.clone()]);
    let mut c = w.https("api.example.com", &w.guest_roots).await;
    assert_eq!(
        send(&mut c, get("/1", "api.example.com"))
            .await
            .unwrap()
            .status,
        200
    );
    w.set(vec![first, s]);
    assert_eq!(
        send(&mut c, get("/2", "api.example.com"))
            .await
            .unwrap()
            .status,
        200
    );
    let seen = w.api_log.lock().unwrap().clone();
    assert!(seen[0].headers.get("x-set").is_none());
    assert_eq!(seen[1].headers["x-set"], VALUE);
}

#[tokio::test]
async fn the_value_is_never_logged() {
    let w = world(Policy::open()).await;
    let mut s = secret("API_KEY", &["api.example.com"]);
    s.header = Some("authorization".into());
    let ph = s.placeholder.clone();
    w.set(vec![s]);
    let mut c = w.https("api.example.com", &w.guest_roots).await;
    let got = send(
        &mut c,
        req("GET", &format!("/?k={ph}"), "api.example.com", &[], ""),
    )
    .await
    .unwrap();
    assert_eq!(got.status, 200);
    assert_eq!(w.api_log.lock().unwrap()[0].headers["authorization"], VALUE);
    let logs = logs();
    assert!(
        logs.contains("secrets put into a request"),
        "debug logs were not captured"
    );
    assert!(!logs.contains(VALUE), "the value is in a log");
}

#[tokio::test]
async fn websockets_to_a_secret_host_carry_the_value_in_the_handshake() {
    let w = world(Policy::open()).await;
    let s = secret("API_KEY", &["api.example.com"]);
    let ph = s.placeholder.clone();
    w.set(vec![s]);
    let (a, g) = connect(&w.sbx, "api.example.com:443").await.unwrap();
    assert_eq!(a.status, 200);
    let tls = tls(g, "api.example.com", &w.guest_roots, true)
        .await
        .unwrap();
    let (mut sender, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tls))
            .await
            .unwrap();
    tokio::spawn(conn.with_upgrades());
    let resp = sender
        .send_request(req(
            "GET",
            &format!("/ws?token={ph}"),
            "api.example.com",
            &[
                ("connection", "Upgrade"),
                ("upgrade", "websocket"),
                ("sec-websocket-version", "13"),
            ],
            "",
        ))
        .await
        .unwrap();
    assert_eq!(resp.status(), 101);
    let up = tokio::time::timeout(WAIT, hyper::upgrade::on(resp))
        .await
        .unwrap()
        .unwrap();
    let mut up = hyper_util::rt::TokioIo::new(up);
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    up.write_all(b"frame bytes").await.unwrap();
    let mut b = [0u8; 11];
    tokio::time::timeout(WAIT, up.read_exact(&mut b))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(&b, b"frame bytes");
    let seen = w.api_log.lock().unwrap().clone();
    assert_eq!(seen[0].uri, format!("/ws?token={VALUE}"));
    assert_eq!(seen[0].headers["sec-websocket-version"], "13");
    // A rule change closes the upgraded stream too.
    w.sbx.set_policy(policy(r#"{"internet":false}"#));
    assert!(closed(&mut up).await);
}
