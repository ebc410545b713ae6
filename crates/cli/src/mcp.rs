//! `runtime mcp`: a stdio bridge to a server's `/mcp`, so that an agent
//! that starts MCP servers as commands (`claude mcp add runtime -- runtime
//! mcp`) reaches a server with no key in its configuration. Each line of
//! stdin is a JSON-RPC message, POSTed as it is with the key; the answer
//! (JSON, or the `message` events of an SSE stream) goes to stdout, one
//! message a line. The bridge keeps the `Mcp-Session-Id` that `initialize`
//! gave, starts a new session when the server forgot it (a restart), and
//! ends it at EOF. Requests run at once, each in a thread of its own (at
//! most [`MAX_INFLIGHT`]), as a client may send one while another runs.
//! Logs go to stderr only: stdout carries nothing but messages.

use std::io::{BufRead, Read, Write};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use anyhow::Context;
use serde_json::{json, Value};

use crate::login;

const MAX_INFLIGHT: usize = 16;
/// Silence after which an answer is given up on. Tool calls answer as SSE
/// with a keep-alive comment every 15 s, so only a dead server is silent.
const READ_TIMEOUT: Duration = Duration::from_secs(300);

/// What the bridge talks to.
pub(crate) struct Target {
    pub url: String,
    pub key: String,
}

/// The server and key: `--url`, else `RUNTIME_API_URL`, else the one server
/// `runtime login` saved a key for; `RUNTIME_API_KEY`, else that saved key.
pub(crate) fn target(url: Option<String>, key: Option<String>) -> anyhow::Result<Target> {
    let url = match url.filter(|u| !u.trim().is_empty()) {
        Some(u) => login::origin(u.trim()),
        None => {
            let saved = login::saved_origins();
            match saved.as_slice() {
                [one] => one.clone(),
                [] => anyhow::bail!(
                    "no server: give --url, set RUNTIME_API_URL, or run `runtime login --url <server>`"
                ),
                many => anyhow::bail!(
                    "keys are saved for several servers ({}): give --url or set RUNTIME_API_URL",
                    many.join(", ")
                ),
            }
        }
    };
    let key = match key.filter(|k| !k.trim().is_empty()) {
        Some(k) => k.trim().to_string(),
        None => login::saved_key(&url).with_context(|| {
            format!("no API key for {url}: set RUNTIME_API_KEY, or run `runtime login --url {url}`")
        })?,
    };
    Ok(Target { url, key })
}

/// An HTTP answer.
struct Reply {
    status: u16,
    session: Option<String>,
    /// The JSON-RPC messages it carried.
    messages: Vec<Value>,
    /// The body when it carried none.
    raw: String,
}

#[derive(Default)]
struct State {
    session: Option<String>,
    version: Option<String>,
    /// The `initialize` params, to start again when the session is gone.
    init: Option<Value>,
}

struct Bridge {
    target: Target,
    state: Mutex<State>,
    out: Mutex<std::io::Stdout>,
    inflight: (Mutex<usize>, Condvar),
}

impl Bridge {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn emit(&self, v: &Value) {
        let mut o = self.out.lock().unwrap_or_else(|p| p.into_inner());
        let _ = writeln!(o, "{v}");
        let _ = o.flush();
    }

    /// One POST of `body` to `/mcp`.
    fn post(&self, body: &str) -> anyhow::Result<Reply> {
        let (session, version) = {
            let s = self.lock();
            (s.session.clone(), s.version.clone())
        };
        let (mut s, hostport) = login::connect(&self.target.url)?;
        s.set_read_timeout(Some(READ_TIMEOUT))?;
        let mut head = format!(
            "POST /mcp HTTP/1.1\r\nHost: {hostport}\r\nAuthorization: Bearer {}\r\nContent-Type: application/json\r\nAccept: application/json, text/event-stream\r\nContent-Length: {}\r\nConnection: close\r\n",
            self.target.key,
            body.len()
        );
        if let Some(id) = session {
            head.push_str(&format!("Mcp-Session-Id: {id}\r\n"));
        }
        if let Some(v) = version {
            head.push_str(&format!("MCP-Protocol-Version: {v}\r\n"));
        }
        head.push_str("\r\n");
        s.write_all(head.as_bytes())?;
        s.write_all(body.as_bytes())?;
        let mut raw = Vec::new();
        s.read_to_end(&mut raw)
            .context("reading the server's answer")?;
        parse_reply(&String::from_utf8_lossy(&raw))
    }

    /// Forwards one line; answers it on stdout.
    fn forward(&self, line: &str) {
        let msg: Option<Value> = serde_json::from_str(line).ok();
        let id = msg.as_ref().and_then(|m| m.get("id")).cloned();
        let is_init = msg
            .as_ref()
            .and_then(|m| m.get("method"))
            .and_then(Value::as_str)
            == Some("initialize");
        if is_init {
            let mut s = self.lock();
            s.session = None;
            s.init = msg.as_ref().and_then(|m| m.get("params")).cloned();
        }
        let mut r = self.post(line);
        if matches!(&r, Ok(rep) if rep.status == 404) && !is_init && self.restart() {
            r = self.post(line);
        }
        match r {
            Ok(rep) => {
                if is_init {
                    let mut s = self.lock();
                    s.session = rep.session.clone();
                    s.version = rep
                        .messages
                        .first()
                        .and_then(|m| m.pointer("/result/protocolVersion"))
                        .and_then(Value::as_str)
                        .map(str::to_string);
                }
                if !rep.messages.is_empty() {
                    for m in &rep.messages {
                        // An error the server could not tie to a request
                        // (a session it forgot) answers this one.
                        match (&id, m.get("id")) {
                            (Some(id), Some(Value::Null)) if m.get("error").is_some() => {
                                let mut m = m.clone();
                                m["id"] = id.clone();
                                self.emit(&m);
                            }
                            _ => self.emit(m),
                        }
                    }
                } else if rep.status >= 300 {
                    if let Some(id) = id {
                        self.emit(&http_error(id, rep.status, &rep.raw));
                    } else {
                        eprintln!(
                            "runtime mcp: the server answered {}: {}",
                            rep.status,
                            rep.raw.trim()
                        );
                    }
                }
            }
            Err(e) => {
                eprintln!("runtime mcp: {e:#}");
                if let Some(id) = id {
                    self.emit(&json!({"jsonrpc": "2.0", "id": id, "error": {
                        "code": -32000,
                        "message": format!("runtime mcp could not reach {}: {e:#}", self.target.url),
                    }}));
                }
            }
        }
    }

    /// A new session after the server forgot ours: initialize again as the
    /// client did first.
    fn restart(&self) -> bool {
        let Some(params) = self.lock().init.clone() else {
            return false;
        };
        self.lock().session = None;
        let init = json!({"jsonrpc": "2.0", "id": "runtime-mcp-reinitialize", "method": "initialize", "params": params});
        let Ok(rep) = self.post(&init.to_string()) else {
            return false;
        };
        if rep.session.is_none() {
            return false;
        }
        self.lock().session = rep.session;
        eprintln!("runtime mcp: the server forgot the session; started a new one");
        let note = json!({"jsonrpc": "2.0", "method": "notifications/initialized"});
        self.post(&note.to_string()).is_ok()
    }

    fn end(&self) {
        let Some(id) = self.lock().session.take() else {
            return;
        };
        if let Ok((mut s, hostport)) = login::connect(&self.target.url) {
            let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
            let _ = write!(
                s,
                "DELETE /mcp HTTP/1.1\r\nHost: {hostport}\r\nAuthorization: Bearer {}\r\nMcp-Session-Id: {id}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
                self.target.key
            );
            let _ = s.read_to_end(&mut Vec::new());
        }
    }
}

/// A JSON-RPC error for an HTTP refusal that carried no JSON-RPC answer
/// (a 401, a 413): the API's message, code and request id.
fn http_error(id: Value, status: u16, raw: &str) -> Value {
    let body: Value = serde_json::from_str(raw).unwrap_or(Value::Null);
    let e = &body["error"];
    let message = match e["message"].as_str() {
        Some(m) => format!(
            "{m} ({}, HTTP {status}, request {})",
            e["code"].as_str().unwrap_or("error"),
            e["requestId"].as_str().unwrap_or("?")
        ),
        None => format!("the server answered HTTP {status}"),
    };
    json!({"jsonrpc": "2.0", "id": id, "error": {"code": -32000, "message": message, "data": body}})
}

fn parse_reply(text: &str) -> anyhow::Result<Reply> {
    let (head, body) = text
        .split_once("\r\n\r\n")
        .context("the server's answer has no head")?;
    let status: u16 = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .context("the server's answer has no status")?;
    let header = |name: &str| {
        head.lines().find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.trim()
                .eq_ignore_ascii_case(name)
                .then(|| v.trim().to_string())
        })
    };
    let body = if header("transfer-encoding").is_some_and(|v| v.contains("chunked")) {
        login::dechunk(body)
    } else {
        body.to_string()
    };
    let sse = header("content-type").is_some_and(|v| v.starts_with("text/event-stream"));
    let mut messages = Vec::new();
    if sse {
        for event in body.replace("\r\n", "\n").split("\n\n") {
            let data: Vec<&str> = event
                .lines()
                .filter_map(|l| l.strip_prefix("data:"))
                .map(|d| d.strip_prefix(' ').unwrap_or(d))
                .collect();
            if let Ok(v) = serde_json::from_str::<Value>(&data.join("\n")) {
                messages.push(v);
            }
        }
    } else if let Ok(v) = serde_json::from_str::<Value>(&body) {
        let rpc = |v: &Value| v.get("jsonrpc").is_some();
        if rpc(&v)
            || v.as_array()
                .is_some_and(|a| a.iter().all(rpc) && !a.is_empty())
        {
            messages.push(v);
        }
    }
    Ok(Reply {
        status,
        session: header("mcp-session-id"),
        messages,
        raw: body,
    })
}

pub(crate) fn run(target: Target) -> anyhow::Result<()> {
    eprintln!("runtime mcp: bridging stdio to {}/mcp", target.url);
    let bridge = Arc::new(Bridge {
        target,
        state: Mutex::new(State::default()),
        out: Mutex::new(std::io::stdout()),
        inflight: (Mutex::new(0), Condvar::new()),
    });
    let mut threads = Vec::new();
    for line in std::io::stdin().lock().lines() {
        let line = line.context("reading stdin")?;
        let line = line.trim().to_string();
        if line.is_empty() {
            continue;
        }
        // `initialize` first and alone, so what follows has its session.
        if line.contains("\"initialize\"") {
            let init = serde_json::from_str::<Value>(&line)
                .ok()
                .and_then(|m| m.get("method").cloned());
            if init.as_ref().and_then(Value::as_str) == Some("initialize") {
                bridge.forward(&line);
                continue;
            }
        }
        {
            let (m, cv) = &bridge.inflight;
            let mut n = m.lock().unwrap_or_else(|p| p.into_inner());
            while *n >= MAX_INFLIGHT {
                n = cv.wait(n).unwrap_or_else(|p| p.into_inner());
            }
            *n += 1;
        }
        let b = bridge.clone();
        threads.retain(|t: &std::thread::JoinHandle<()>| !t.is_finished());
        threads.push(std::thread::spawn(move || {
            b.forward(&line);
            let (m, cv) = &b.inflight;
            let mut n = m.lock().unwrap_or_else(|p| p.into_inner());
            *n -= 1;
            cv.notify_one();
        }));
    }
    for t in threads {
        let _ = t.join();
    }
    bridge.end();
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sse_and_json_answers() {
        let r = parse_reply(
            "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nmcp-session-id: mcp_1\r\n\r\n: keep-alive\n\nevent: message\ndata: {\"jsonrpc\":\"2.0\",\"id\":1,\"result\":{}}\n\n",
        )
        .unwrap();
        assert_eq!(r.status, 200);
        assert_eq!(r.session.as_deref(), Some("mcp_1"));
        assert_eq!(
            r.messages,
            vec![json!({"jsonrpc": "2.0", "id": 1, "result": {}})]
        );
        let r = parse_reply(
            "HTTP/1.1 401 Unauthorized\r\ncontent-type: application/json\r\n\r\n{\"error\":{\"code\":\"unauthorized\",\"message\":\"Missing or invalid API key.\",\"requestId\":\"req_1\"}}",
        )
        .unwrap();
        assert!(r.messages.is_empty());
        let e = http_error(json!(7), r.status, &r.raw);
        assert_eq!(e["id"], 7);
        assert!(e["error"]["message"]
            .as_str()
            .unwrap()
            .starts_with("Missing or invalid API key. (unauthorized, HTTP 401, request req_1)"));
        let r = parse_reply("HTTP/1.1 202 Accepted\r\ncontent-length: 0\r\n\r\n").unwrap();
        assert_eq!(r.status, 202);
        assert!(r.messages.is_empty());
    }
}
