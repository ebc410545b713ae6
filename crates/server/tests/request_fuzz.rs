//! A deterministic fuzz of the API's request parsing, beside the guest
//! protocol's (`crates/proto/src/codec.rs`): every route of
//! `ROUTE_SAMPLES` is sent thousands of generated requests (JSON of every
//! type in the fields the API knows, deep nesting, huge and negative
//! numbers, NUL and `..` in strings, broken JSON, raw bytes, odd query
//! strings), against a fake host. Whatever comes in, the server answers
//! within a bound, never with a 500, and every refusal is the one error
//! shape with its status and a code. The seed is fixed (`FUZZ_SEED`
//! and `FUZZ_ROUNDS` change it), so a failure names the request that
//! made it.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::type_complexity)]

#[allow(dead_code)]
mod fake;

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use fake::FakeHost;
use http_body_util::BodyExt;
use runtime_server::{ensure_admin_key, open_store, router, AppState, Config, ROUTE_SAMPLES};
use serde_json::{json, Map, Value};
use tower::ServiceExt;

/// xorshift64*: reproducible, no dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len())]
    }
}

/// Field names the API reads somewhere, so generated objects reach the
/// parsers' checks and not only their "unknown field" answer.
const FIELDS: &[&str] = &[
    "command",
    "argv",
    "args",
    "cwd",
    "env",
    "user",
    "timeoutSeconds",
    "timeoutMs",
    "stdin",
    "pty",
    "cols",
    "rows",
    "path",
    "paths",
    "from",
    "to",
    "recursive",
    "mode",
    "content",
    "encoding",
    "size",
    "sha256",
    "offset",
    "name",
    "labels",
    "image",
    "imageId",
    "snapshotId",
    "memoryMiB",
    "vcpu",
    "diskMiB",
    "cpu",
    "persistent",
    "idlePauseSeconds",
    "lifetimeSeconds",
    "onLeaseEnd",
    "network",
    "rules",
    "allow",
    "deny",
    "secrets",
    "volumes",
    "retentionDays",
    "count",
    "port",
    "public",
    "code",
    "language",
    "contextId",
    "dockerfile",
    "recipe",
    "steps",
    "base",
    "tag",
    "registry",
    "username",
    "token",
    "sizeMiB",
    "waitMs",
    "signal",
    "data",
    "outputEncoding",
    "ifLabels",
    "gzip",
    "header",
    "hosts",
    "url",
    "events",
    "metadata",
    "seconds",
    "keepalive",
    "glob",
    "depth",
    "ref",
    "digests",
    "cpuFloorMillis",
];

fn string(rng: &mut Rng) -> String {
    match rng.below(12) {
        0 => String::new(),
        1 => "x".repeat(1 + rng.below(70_000)),
        2 => "../../../../etc/passwd".into(),
        3 => "/workspace/\u{0}nul".into(),
        4 => "\u{202e}ünï©ødé 🦀".into(),
        5 => "*a*a*a*a*a*a*a*a*a*a*a*a*b".into(),
        6 => "-1".into(),
        7 => "99999999999999999999999".into(),
        8 => "/".into(),
        9 => "memory".into(),
        10 => "%00%2e%2e/%ff".into(),
        _ => (0..rng.below(20))
            .map(|_| char::from(32 + rng.below(95) as u8))
            .collect(),
    }
}

fn value(rng: &mut Rng, depth: u32) -> Value {
    let leaf = depth >= 4;
    match rng.below(if leaf { 7 } else { 10 }) {
        0 => Value::Null,
        1 => Value::Bool(rng.below(2) == 0),
        2 => json!(*rng.pick(&[0i64, -1, 1, i64::MIN, i64::MAX, 65_536, 4_294_967_296])),
        3 => json!(*rng.pick(&[0.5f64, -0.0, 1e300, -1e-300, 3.0])),
        4 => json!(u64::MAX),
        5 | 6 => Value::String(string(rng)),
        7 => Value::Array((0..rng.below(5)).map(|_| value(rng, depth + 1)).collect()),
        _ => object(rng, depth + 1),
    }
}

fn object(rng: &mut Rng, depth: u32) -> Value {
    let mut m = Map::new();
    for _ in 0..rng.below(6) {
        let k = if rng.below(8) == 0 {
            string(rng)
        } else {
            (*rng.pick(FIELDS)).to_string()
        };
        m.insert(k, value(rng, depth));
    }
    Value::Object(m)
}

/// A body: mostly objects, also other JSON, broken JSON, deep nesting,
/// raw bytes.
fn body(rng: &mut Rng) -> Vec<u8> {
    match rng.below(14) {
        0 => Vec::new(),
        1 => b"{\"command\": ".to_vec(),
        2 => (0..rng.below(300)).map(|_| rng.next() as u8).collect(),
        3 => format!("{}{}", "[".repeat(5_000), "]".repeat(5_000)).into_bytes(),
        4 => value(rng, 0).to_string().into_bytes(),
        5 => b"{\"a\":1,\"a\":2}".to_vec(),
        _ => object(rng, 0).to_string().into_bytes(),
    }
}

fn query(rng: &mut Rng) -> String {
    let mut q = Vec::new();
    for _ in 0..rng.below(4) {
        let k = *rng.pick(&[
            "path",
            "timeoutSeconds",
            "offset",
            "limit",
            "cursor",
            "glob",
            "depth",
            "waitMs",
            "follow",
            "since",
            "user",
            "gzip",
            "sandboxId",
            "state",
            "ref",
            "waitFor",
        ]);
        let v = *rng.pick(&[
            "",
            "-1",
            "18446744073709551616",
            "/etc",
            "..%2f..",
            "%zz",
            "true",
            "1e9",
            "a&b",
            "%00",
            "999999",
        ]);
        q.push(format!("{k}={v}"));
    }
    q.join("&")
}

/// Everything wrong with an answer of `status` and `body`, if anything.
fn wrong(status: StatusCode, body: &[u8]) -> Option<String> {
    if status == StatusCode::INTERNAL_SERVER_ERROR {
        return Some("a 500".into());
    }
    if status.is_success() || status.is_redirection() || status.is_informational() {
        return None;
    }
    let v: Value = match serde_json::from_slice(body) {
        Ok(v) => v,
        Err(_) => return Some("an error that is not JSON".into()),
    };
    let e = &v["error"];
    let shaped = e["code"].as_str().is_some_and(|c| !c.is_empty())
        && e["message"].as_str().is_some_and(|m| !m.is_empty())
        && e["status"].as_u64() == Some(u64::from(status.as_u16()));
    (!shaped).then(|| format!("an error not in the one shape: {v}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_request_makes_a_500_a_hang_or_an_error_of_another_shape() {
    let dir = std::env::temp_dir().join(format!("rt-fuzz-test-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&dir).unwrap();
    let admin = ensure_admin_key(&dir).unwrap().unwrap();
    let host = Arc::new(FakeHost::default());
    let mut config = Config::new(&dir);
    // Fuzzed creates and forks make many large sandboxes: the quotas are
    // not what is under test here.
    for q in [
        "sandbox.count",
        "sandbox.vcpu",
        "sandbox.memory_mib",
        "sandbox.disk_mib",
    ] {
        config.quotas.set(&format!("{q}=1000000000000")).unwrap();
    }
    let state = AppState::new(config, open_store(&dir).unwrap(), host);
    let app = router(state);
    let send = |method: &str, uri: &str, body: Vec<u8>, ctype: &str| {
        let req = Request::builder()
            .method(method)
            .uri(uri)
            .header("authorization", format!("Bearer {admin}"))
            .header("content-type", ctype)
            .body(Body::from(body))
            .unwrap();
        let app = app.clone();
        async move {
            let answer = tokio::time::timeout(Duration::from_secs(20), async move {
                let resp = app.oneshot(req).await.unwrap();
                let status = resp.status();
                // A stream that does not end is read no further than this.
                let mut bytes = Vec::new();
                let mut body = resp.into_body();
                while let Ok(Some(Ok(frame))) =
                    tokio::time::timeout(Duration::from_secs(2), body.frame()).await
                {
                    if let Ok(d) = frame.into_data() {
                        bytes.extend_from_slice(&d);
                    }
                    if bytes.len() > 1 << 20 {
                        break;
                    }
                }
                (status, bytes)
            })
            .await;
            answer.unwrap_or_else(|_| panic!("no answer within 20 s"))
        }
    };
    let fresh = || async {
        let (s, made) = send("POST", "/v1/sandboxes", b"{}".to_vec(), "application/json").await;
        let made: Value = serde_json::from_slice(&made).unwrap();
        assert_eq!(s, StatusCode::CREATED, "{made}");
        made["id"].as_str().unwrap().to_string()
    };
    let mut id = fresh().await;

    let seed = std::env::var("FUZZ_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x5EED_CAFE_F00D_u64);
    let rounds: usize = std::env::var("FUZZ_ROUNDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(40);
    let mut rng = Rng(seed);
    let mut failures = Vec::new();
    let mut sent = 0;
    let mut statuses = std::collections::BTreeMap::<u16, usize>::new();
    for round in 0..rounds {
        for (method, sample) in ROUTE_SAMPLES {
            // Upgrades are refused without a WebSocket handshake; the
            // guest's own streams are fuzzed in the protocol's test.
            if sample.ends_with("/terminal") || sample.ends_with("/tunnel") {
                continue;
            }
            let path = sample.replace("{id}", &id);
            let (base, q) = path.split_once('?').unwrap_or((&path, ""));
            let extra = query(&mut rng);
            let uri = match (q.is_empty(), extra.is_empty(), round % 3) {
                // A third keep the sample's own query, so the body's
                // checks are reached as well as the query's.
                (_, _, 0) => path.clone(),
                (true, true, _) => base.to_string(),
                (true, false, _) => format!("{base}?{extra}"),
                (false, true, _) => path.clone(),
                (false, false, _) => format!("{path}&{extra}"),
            };
            let b = body(&mut rng);
            let ctype = *rng.pick(&[
                "application/json",
                "application/json",
                "application/octet-stream",
                "text/plain",
            ]);
            let shown = String::from_utf8_lossy(&b[..b.len().min(300)]).into_owned();
            let (status, answer) = send(method, &uri, b, ctype).await;
            sent += 1;
            *statuses.entry(status.as_u16()).or_default() += 1;
            if let Some(why) = wrong(status, &answer) {
                failures.push(format!(
                    "{method} {uri} ({ctype}) {shown:?} -> {status}: {why}"
                ));
            }
            // What may have ended the sandbox: a running one for the
            // routes after it, so they reach their parsers.
            let ends = ["DELETE", "POST"].contains(method)
                && [
                    ":stop",
                    ":pause",
                    ":delete",
                    ":restart",
                    ":resize",
                    ":switch-image",
                ]
                .iter()
                .any(|v| sample.ends_with(v))
                || (*method == "DELETE" && sample == &"/v1/sandboxes/{id}");
            if ends {
                id = fresh().await;
            }
        }
    }
    println!("{sent} requests; answers by status: {statuses:?}");
    // The requests reach past the parsers too: some are taken.
    let taken: usize = statuses.range(200..300).map(|(_, n)| n).sum();
    assert!(
        taken * 20 >= sent,
        "only {taken} of {sent} taken: {statuses:?}"
    );
    assert!(
        failures.is_empty(),
        "{} of {sent} requests answered wrongly (seed {seed:#x}):\n{}",
        failures.len(),
        failures.join("\n")
    );
}
