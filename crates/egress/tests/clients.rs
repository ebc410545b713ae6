//! Real clients through the proxy: curl (HTTP CONNECT, SOCKS5h, absolute-form),
//! Python's urllib and requests, git, npm and pip, reaching it over a local
//! TCP port as the guest's processes reach theirs.
#![allow(clippy::unwrap_used, clippy::expect_used)] // helpers outside #[test] fns panic on purpose

mod common;

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;

use base64::engine::general_purpose::STANDARD as BASE64;
use base64::Engine as _;
use common::*;
use runtime_egress::{make_placeholder, EgressConfig, SandboxCa, SandboxNet, Secret, SecretValue};
use tokio::net::TcpListener;
use tokio::process::Command;

const VALUE: &str = "real-value-for-clients";
const ALLOW: &str = r#"{"internet":true,"allow":["*.example.com","*.example.org"]}"#;

/// Serves every connection to a local port with the sandbox's proxy.
async fn listen(sbx: &Sandbox) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let egress = sbx.egress.clone();
    let (policy, secrets, ca) = (
        sbx.policy.subscribe(),
        sbx.secrets.subscribe(),
        sbx.ca.clone(),
    );
    tokio::spawn(async move {
        loop {
            let Ok((s, _)) = listener.accept().await else {
                return;
            };
            let net = SandboxNet {
                sandbox_id: "sbx-clients".into(),
                policy: policy.clone(),
                secrets: secrets.clone(),
                ca: ca.clone(),
            };
            let egress = egress.clone();
            tokio::spawn(async move { egress.serve(s, net).await });
        }
    });
    addr
}

/// A client process whose every CA setting names `bundle` and whose proxy
/// settings come only from the test, whatever the machine's environment says.
fn client_cmd(program: &str, bundle: &str) -> Command {
    let mut cmd = Command::new(program);
    for var in [
        "SSL_CERT_FILE",
        "REQUESTS_CA_BUNDLE",
        "CURL_CA_BUNDLE",
        "PIP_CERT",
        "GIT_SSL_CAINFO",
        "NODE_EXTRA_CA_CERTS",
        "npm_config_cafile",
    ] {
        cmd.env(var, bundle);
    }
    for var in [
        "SSL_CERT_DIR",
        "HTTP_PROXY",
        "HTTPS_PROXY",
        "ALL_PROXY",
        "NO_PROXY",
        "http_proxy",
        "https_proxy",
        "all_proxy",
        "no_proxy",
        "PIP_FIND_LINKS",
        "PIP_INDEX_URL",
        "PIP_CONFIG_FILE",
    ] {
        cmd.env_remove(var);
    }
    cmd.env("PIP_CONFIG_FILE", "/dev/null");
    cmd
}

async fn run(cmd: &mut Command) -> (bool, String) {
    let out = tokio::time::timeout(WAIT, cmd.output())
        .await
        .expect("client timed out")
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

fn write(dir: &Path, name: &str, text: &str) -> String {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p.to_str().unwrap().to_owned()
}

#[tokio::test]
async fn curl_and_python_work_through_the_proxy() {
    let ca = TestCa::new("test destinations");
    let (api, api_log) = https_server(&ca, &["api.example.com"]).await;
    let (other, other_log) = https_server(&ca, &["other.example.org"]).await;
    let (plain, plain_log) = http_server().await;
    let mut sbx = Sandbox::new(
        EgressConfig {
            test_hosts: vec![
                ("api.example.com".into(), api),
                ("other.example.org".into(), other),
                ("plain.example.com".into(), plain),
            ],
            extra_roots: vec![ca.der()],
            ..EgressConfig::default()
        },
        // Only the stand-ins: nothing a client does on the side (npm's update
        // check) leaves this machine.
        policy(ALLOW),
    );
    // The CA as the server would load it back after a restart: OpenSSL-based
    // clients match the leaf's issuer by name and key identifier.
    sbx.ca = Arc::new(SandboxCa::from_pem(sbx.ca.cert_pem(), sbx.ca.key_pem()).unwrap());
    let placeholder = make_placeholder();
    sbx.secrets.send_replace(Arc::new(vec![Secret {
        name: "API_KEY".into(),
        value: SecretValue::new(VALUE),
        hosts: vec!["api.example.com".into()],
        header: None,
        format: None,
        rules: Vec::new(),
        placeholder: placeholder.clone(),
    }]));
    let proxy = listen(&sbx).await;
    let dir = std::env::temp_dir().join(format!("egress-clients-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    // What the guest trusts: its sandbox CA, and (for pass-through) the
    // destinations' own CA, as a system bundle would hold public roots.
    let bundle = write(
        &dir,
        "bundle.pem",
        &format!("{}{}", sbx.ca.cert_pem(), ca.pem()),
    );
    let http_proxy = format!("http://{proxy}");
    let socks_proxy = format!("socks5h://{proxy}");

    // curl over HTTP CONNECT to a secret's host: intercepted, swapped.
    let (ok, out) = run(client_cmd("curl", &bundle)
        .args(["-sS", "--fail", "--proxy", &http_proxy, "--cacert", &bundle])
        .args(["-H", &format!("Authorization: Bearer {placeholder}")])
        .arg(format!("https://api.example.com/curl?k={placeholder}")))
    .await;
    assert!(ok, "{out}");
    // The destination echoes the URL: the guest sees it scrubbed.
    assert_eq!(out, format!("seen /curl?k={}", "*".repeat(VALUE.len())));
    // A placeholder as a URL's password (as git and curl take a token): it
    // goes inside the Basic credential.
    let (ok, out) = run(client_cmd("curl", &bundle)
        .args(["-sS", "--fail", "--proxy", &http_proxy, "--cacert", &bundle])
        .arg(format!(
            "https://x-access-token:{placeholder}@api.example.com/basic"
        )))
    .await;
    assert!(ok, "{out}");
    assert_eq!(out, "seen /basic");
    // curl over SOCKS5 with remote names, to a passed-through host.
    let (ok, out) = run(client_cmd("curl", &bundle)
        .args([
            "-sS",
            "--fail",
            "--proxy",
            &socks_proxy,
            "--cacert",
            &bundle,
        ])
        .arg("https://other.example.org/socks"))
    .await;
    assert!(ok, "{out}");
    assert_eq!(out, "seen /socks");
    // curl plain HTTP through the proxy (absolute-form), keep-alive, twice.
    let (ok, out) = run(client_cmd("curl", &bundle)
        .args(["-sS", "--fail", "--proxy", &http_proxy])
        .args(["http://plain.example.com/a", "http://plain.example.com/b"]))
    .await;
    assert!(ok, "{out}");
    assert_eq!(out, "seen /aseen /b");
    // A refusal: curl reports the proxy's 403.
    sbx.policy.send_replace(Arc::new(policy(
        r#"{"internet":true,"allow":["*.example.org"]}"#,
    )));
    let (ok, out) = run(client_cmd("curl", &bundle)
        .args(["-sS", "--proxy", &http_proxy, "--cacert", &bundle])
        .arg("https://api.example.com/refused"))
    .await;
    assert!(!ok);
    assert!(out.contains("403"), "{out}");
    sbx.policy.send_replace(Arc::new(policy(ALLOW)));

    // Python's urllib with the usual environment variables.
    let script = format!(
        "import urllib.request\n\
         r = urllib.request.urlopen('https://api.example.com/py?k={placeholder}')\n\
         print(r.read().decode(), end='')\n\
         r = urllib.request.urlopen('http://plain.example.com/py')\n\
         print(' ' + r.read().decode(), end='')\n"
    );
    let (ok, out) = run(client_cmd("python3", &bundle)
        .args(["-c", &script])
        .env("HTTPS_PROXY", &http_proxy)
        .env("HTTP_PROXY", &http_proxy)
        .env("NO_PROXY", "")
        .env("SSL_CERT_FILE", &bundle))
    .await;
    assert!(ok, "{out}");
    assert_eq!(
        out,
        format!("seen /py?k={} seen /py", "*".repeat(VALUE.len()))
    );
    // And requests, with its own CA variable, where the machine's Python has
    // it (it is not in the standard library; urllib above always runs).
    let has_requests = run(client_cmd("python3", &bundle).args(["-c", "import requests"]))
        .await
        .0;
    let script = format!(
        "import requests\n\
         print(requests.get('https://api.example.com/rq', headers={{'X-Key': '{placeholder}'}}).text, end='')\n"
    );
    if has_requests {
        let (ok, out) = run(client_cmd("python3", &bundle)
            .args(["-c", &script])
            .env("HTTPS_PROXY", &http_proxy)
            .env("NO_PROXY", "")
            .env("REQUESTS_CA_BUNDLE", &bundle))
        .await;
        assert!(ok, "{out}");
        assert_eq!(out, "seen /rq");
    } else {
        eprintln!("python3 has no requests module: only urllib was run");
    }

    // git, npm and pip: the destination is no git server or registry, so they
    // fail after the request; what counts is that it arrived, intercepted.
    let home = dir.to_str().unwrap();
    let (_, git_out) = run(client_cmd("git", &bundle)
        .args(["-c", &format!("http.proxy={http_proxy}")])
        .env("GIT_SSL_CAINFO", &bundle)
        .args(["ls-remote", "https://api.example.com/git/repo.git"])
        .env("HOME", home)
        .env("GIT_TERMINAL_PROMPT", "0"))
    .await;
    let _ = run(client_cmd("npm", &bundle)
        .args([
            "view",
            "left-pad",
            "--registry",
            "https://api.example.com/npm/",
        ])
        .args([
            "--https-proxy",
            &http_proxy,
            "--cafile",
            &bundle,
            "--fetch-retries",
            "0",
        ])
        .env("HOME", home)
        .env("npm_config_cache", home)
        .env("npm_config_update_notifier", "false"))
    .await;
    let (_, pip_out) = run(client_cmd("python3", &bundle)
        .args([
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--disable-pip-version-check",
        ])
        .args([
            "--index-url",
            "https://api.example.com/simple/",
            "--cert",
            &bundle,
        ])
        .args([
            "--proxy",
            &http_proxy,
            "--retries",
            "0",
            "--timeout",
            "5",
            "-d",
            home,
        ])
        .arg("some-package")
        .env("HOME", home)
        .env("PIP_NO_CACHE_DIR", "1"))
    .await;
    let uris: Vec<String> = api_log
        .lock()
        .unwrap()
        .iter()
        .map(|s| s.uri.clone())
        .collect();
    assert!(
        uris.iter()
            .any(|u| u.starts_with("/git/repo.git/info/refs")),
        "{uris:?} {git_out}"
    );
    assert!(
        uris.iter().any(|u| u.starts_with("/npm/left-pad")),
        "{uris:?}"
    );
    assert!(
        uris.iter().any(|u| u.starts_with("/simple/some-package")),
        "{uris:?} {pip_out}"
    );

    let api_seen = api_log.lock().unwrap().clone();
    assert_eq!(
        api_seen[0].headers["authorization"],
        format!("Bearer {VALUE}")
    );
    assert!(api_seen.iter().all(|s| !s.uri.contains("/refused")));
    let basic = api_seen.iter().find(|s| s.uri == "/basic").unwrap();
    assert_eq!(
        basic.headers["authorization"],
        format!("Basic {}", BASE64.encode(format!("x-access-token:{VALUE}")))
    );
    if has_requests {
        let rq = api_seen.iter().find(|s| s.uri == "/rq").unwrap();
        assert_eq!(rq.headers["x-key"], VALUE);
    }
    assert_eq!(other_log.lock().unwrap().len(), 1);
    assert_eq!(plain_log.lock().unwrap().len(), 3);
    let _ = std::fs::remove_dir_all(&dir);
}
