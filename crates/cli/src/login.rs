//! `runtime login --url http://host:port`: asks the server for a key, which
//! a person approves on the server's page in a browser, then saves it where
//! the `withruntime` client reads a saved login (its `_connection.py`):
//! `$XDG_CONFIG_HOME/runtime-cloud/<sha256(auth origin + "\n" + API
//! origin)>.json` (`~/.config` without `XDG_CONFIG_HOME`), holding
//! `{"apiOrigin", "key"}`, the directory 0700 and the file 0600. The auth
//! origin is `RUNTIME_AUTH_URL`'s, `https://withruntime.com` by default,
//! as in the client.
//!
//! Plain `http://` only: this binary carries no TLS client. `image build
//! --file` calls the API with the same request helper and reads the key
//! saved here when it is given none.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

const DEFAULT_AUTH: &str = "https://withruntime.com";

/// `scheme://netloc` of a URL, as Python's `urlsplit` gives it.
pub(crate) fn origin(url: &str) -> String {
    let (scheme, rest) = url.split_once("://").unwrap_or(("", url));
    let netloc = rest.split(['/', '?', '#']).next().unwrap_or("");
    format!("{scheme}://{netloc}")
}

/// One HTTP/1.1 request over a fresh connection; (status, JSON body).
fn request(api: &str, method: &str, path: &str, body: &Value) -> anyhow::Result<(u16, Value)> {
    call(api, method, path, Some(body), None)
}

/// A connection to `api`'s origin, and its `host:port` for the `Host` header.
pub(crate) fn connect(api: &str) -> anyhow::Result<(TcpStream, String)> {
    let api = origin(api.trim());
    let hostport = api
        .strip_prefix("http://")
        .context("this binary speaks plain http:// only; give http://host:port")?;
    let addr = if hostport.contains(':') && !hostport.ends_with(']') {
        hostport.to_string()
    } else {
        format!("{hostport}:80")
    };
    let s = TcpStream::connect(&addr).with_context(|| format!("connecting to {addr}"))?;
    Ok((s, hostport.to_string()))
}

/// One HTTP/1.1 request over a fresh connection, with a bearer key if
/// given; (status, JSON body, `null` when the body is not JSON).
pub(crate) fn call(
    api: &str,
    method: &str,
    path: &str,
    body: Option<&Value>,
    key: Option<&str>,
) -> anyhow::Result<(u16, Value)> {
    let payload = body.map(Value::to_string).unwrap_or_default();
    call_bytes(
        api,
        method,
        path,
        "application/json",
        payload.as_bytes(),
        key,
    )
}

/// [`call`] with a body of any type (a build context's chunk).
pub(crate) fn call_bytes(
    api: &str,
    method: &str,
    path: &str,
    content_type: &str,
    payload: &[u8],
    key: Option<&str>,
) -> anyhow::Result<(u16, Value)> {
    let (mut s, hostport) = connect(api)?;
    s.set_read_timeout(Some(Duration::from_secs(30)))?;
    let auth = key.map_or_else(String::new, |k| format!("Authorization: Bearer {k}\r\n"));
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: {hostport}\r\n{auth}Content-Type: {content_type}\r\nAccept: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        payload.len()
    )?;
    s.write_all(payload)?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw)?;
    let text = String::from_utf8_lossy(&raw);
    let (head, body) = text
        .split_once("\r\n\r\n")
        .context("the server's answer has no body")?;
    let status: u16 = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .context("the server's answer has no status")?;
    let chunked = head
        .lines()
        .any(|l| l.to_ascii_lowercase().starts_with("transfer-encoding:") && l.contains("chunked"));
    let body = if chunked {
        dechunk(body)
    } else {
        body.to_string()
    };
    let v = serde_json::from_str(&body).unwrap_or(Value::Null);
    Ok((status, v))
}

pub(crate) fn dechunk(mut s: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = s.split_once("\r\n") {
        let Ok(n) = usize::from_str_radix(size.trim(), 16) else {
            break;
        };
        if n == 0 || rest.len() < n {
            break;
        }
        out.push_str(&rest[..n]);
        s = rest[n..].trim_start_matches("\r\n");
    }
    out
}

/// The API origins `runtime login` saved a key for (private files only).
pub(crate) fn saved_origins() -> Vec<String> {
    let Some(dir) = saved_path("http://x").parent().map(PathBuf::from) else {
        return Vec::new();
    };
    let Ok(entries) = std::fs::read_dir(&dir) else {
        return Vec::new();
    };
    let mut out: Vec<String> = entries
        .filter_map(Result::ok)
        .filter(|e| e.path().extension().is_some_and(|x| x == "json"))
        .filter_map(|e| {
            let f = std::fs::symlink_metadata(e.path()).ok()?;
            if !f.is_file() || f.len() > 4096 {
                return None;
            }
            let v: Value = serde_json::from_str(&std::fs::read_to_string(e.path()).ok()?).ok()?;
            let api = v["apiOrigin"].as_str()?.to_string();
            // Only what `saved_key` would read for that origin.
            saved_key(&api).map(|_| api)
        })
        .collect();
    out.sort();
    out.dedup();
    out
}

fn computer_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

/// Where `withruntime` looks for the saved key of `api`.
pub(crate) fn saved_path(api: &str) -> PathBuf {
    let auth =
        origin(&std::env::var("RUNTIME_AUTH_URL").unwrap_or_else(|_| DEFAULT_AUTH.to_string()));
    let root = std::env::var_os("XDG_CONFIG_HOME")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| crate::home().join(".config"));
    let name = hex::encode(Sha256::digest(format!("{auth}\n{api}").as_bytes()));
    root.join("runtime-cloud").join(format!("{name}.json"))
}

/// The key `runtime login` saved for `api`'s origin, if there is one (read
/// as the client reads it: only a private file naming that origin).
pub(crate) fn saved_key(api: &str) -> Option<String> {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let api = origin(api.trim());
    let path = saved_path(&api);
    // SAFETY: getuid has no preconditions.
    let me = unsafe { libc::getuid() };
    let private = |m: &std::fs::Metadata| m.permissions().mode() & 0o077 == 0 && m.uid() == me;
    let dir = std::fs::symlink_metadata(path.parent()?).ok()?;
    let file = std::fs::symlink_metadata(&path).ok()?;
    if !dir.is_dir() || !private(&dir) || !file.is_file() || !private(&file) || file.len() > 4096 {
        return None;
    }
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&path).ok()?).ok()?;
    if v["apiOrigin"].as_str() != Some(api.as_str()) {
        return None;
    }
    v["key"].as_str().map(str::to_string)
}

fn save(api: &str, key: &str) -> anyhow::Result<PathBuf> {
    use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
    let path = saved_path(api);
    let dir = path.parent().context("no directory")?;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .with_context(|| format!("creating {}", dir.display()))?;
    // The client ignores a directory others can read.
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))?;
    let tmp = dir.join(format!(".login-{}.tmp", std::process::id()));
    let _ = std::fs::remove_file(&tmp);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&tmp)
        .with_context(|| format!("writing {}", tmp.display()))?;
    f.write_all(json!({"apiOrigin": api, "key": key}).to_string().as_bytes())?;
    f.sync_all()?;
    std::fs::rename(&tmp, &path)?;
    Ok(path)
}

pub(crate) fn run(url: &str, computer: Option<String>, open_browser: bool) -> anyhow::Result<()> {
    let api = origin(url.trim());
    let computer = computer.unwrap_or_else(computer_name);
    let (status, v) = request(
        &api,
        "POST",
        "/v1/login/requests",
        &json!({ "computer": computer }),
    )?;
    if status != 201 {
        bail!("the server refused the login request ({status}): {v}");
    }
    let field = |k: &str| {
        v[k].as_str()
            .map(str::to_string)
            .context("a malformed answer")
    };
    let (id, code, token) = (field("id")?, field("code")?, field("pollToken")?);
    let page = format!("{api}{}", field("approvePath")?);
    eprintln!("runtime: approve this computer in a browser, where the page shows the code {code}:");
    println!("{page}");
    let _ = std::io::stdout().flush();
    if open_browser {
        let _ = std::process::Command::new("xdg-open")
            .arg(&page)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn();
    }
    let deadline = Instant::now() + Duration::from_secs(15 * 60);
    let key = loop {
        if Instant::now() > deadline {
            bail!("the request expired before anyone approved it");
        }
        std::thread::sleep(Duration::from_millis(500));
        let (status, v) = request(
            &api,
            "POST",
            &format!("/v1/login/requests/{id}:poll"),
            &json!({ "pollToken": token }),
        )?;
        match (status, v["status"].as_str()) {
            (200, Some("pending")) => continue,
            (200, Some("approved")) => {
                break v["key"]
                    .as_str()
                    .context("an approval without a key")?
                    .to_string()
            }
            (200, Some("denied")) => bail!("the request was denied"),
            _ => bail!("the login request ended ({status}): {v}"),
        }
    };
    let path = save(&api, &key)?;
    eprintln!(
        "runtime: logged in to {api}; the key is saved in {} (set RUNTIME_API_URL={api} for the client)",
        path.display()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn origins_as_python_splits_them() {
        assert_eq!(origin("http://127.0.0.1:8080/"), "http://127.0.0.1:8080");
        assert_eq!(origin("http://h:1/x?y"), "http://h:1");
        assert_eq!(origin("https://withruntime.com"), "https://withruntime.com");
    }

    #[test]
    fn chunks() {
        assert_eq!(dechunk("3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n"), "abcde");
    }
}
