//! Printing for the remote commands: tables for people, JSON for scripts,
//! one line per error, and following a process's output (NDJSON events)
//! onto this terminal's stdout and stderr.

use std::io::Write;

use anyhow::Context;
use base64::Engine;
use http_body_util::BodyExt;
use hyper::body::Incoming;
use serde_json::Value;

use crate::client::ApiFailure;

/// Prints rows under a header, each column as wide as its widest cell.
pub(crate) fn table(header: &[&str], rows: &[Vec<String>]) {
    let mut widths: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for r in rows {
        for (i, c) in r.iter().enumerate() {
            if let Some(w) = widths.get_mut(i) {
                *w = (*w).max(c.chars().count());
            }
        }
    }
    let line = |cells: Vec<&str>| {
        let mut s = String::new();
        for (i, c) in cells.iter().enumerate() {
            if i + 1 == cells.len() {
                s.push_str(c);
            } else {
                s.push_str(&format!("{c:<w$}  ", w = widths[i]));
            }
        }
        s.trim_end().to_string()
    };
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{}", line(header.to_vec()));
    for r in rows {
        let _ = writeln!(out, "{}", line(r.iter().map(String::as_str).collect()));
    }
}

/// A JSON value as a table cell: strings bare, null as `-`.
pub(crate) fn cell(v: &Value) -> String {
    match v {
        Value::Null => "-".into(),
        Value::String(s) if s.is_empty() => "-".into(),
        Value::String(s) => s.clone(),
        Value::Object(m) if m.is_empty() => "-".into(),
        Value::Object(m) => m
            .iter()
            .map(|(k, v)| {
                format!(
                    "{k}={}",
                    v.as_str().map_or_else(|| v.to_string(), str::to_string)
                )
            })
            .collect::<Vec<_>>()
            .join(","),
        other => other.to_string(),
    }
}

/// A line about work under way, for a person watching: only when stderr is
/// a terminal, so a script's stderr holds nothing but the one line of a
/// failure (and the summaries of what succeeded).
pub(crate) fn progress(msg: &str) {
    use std::io::IsTerminal;
    if std::io::stderr().is_terminal() {
        eprintln!("runtime: {msg}");
    }
}

pub(crate) fn json(v: &Value) {
    let text = serde_json::to_string_pretty(v).unwrap_or_else(|_| v.to_string());
    println!("{text}");
}

/// NDJSON objects from a streamed answer, blank heartbeat lines skipped.
pub(crate) struct Lines {
    body: Incoming,
    buf: Vec<u8>,
    done: bool,
}

impl Lines {
    pub(crate) fn new(body: Incoming) -> Lines {
        Lines {
            body,
            buf: Vec::new(),
            done: false,
        }
    }

    pub(crate) async fn next(&mut self) -> anyhow::Result<Option<Value>> {
        loop {
            if let Some(i) = self.buf.iter().position(|b| *b == b'\n') {
                let line: Vec<u8> = self.buf.drain(..=i).collect();
                if line.iter().all(u8::is_ascii_whitespace) {
                    continue;
                }
                return serde_json::from_slice(&line)
                    .map(Some)
                    .context("a streamed line is not JSON");
            }
            if self.done {
                if self.buf.iter().all(u8::is_ascii_whitespace) {
                    return Ok(None);
                }
                let line = std::mem::take(&mut self.buf);
                return serde_json::from_slice(&line)
                    .map(Some)
                    .context("a streamed line is not JSON");
            }
            match self.body.frame().await {
                None => self.done = true,
                Some(Err(e)) => return Err(anyhow::Error::new(e).context("reading the stream")),
                Some(Ok(f)) => {
                    if let Ok(d) = f.into_data() {
                        self.buf.extend_from_slice(&d);
                    }
                }
            }
        }
    }
}

/// How a followed stream ended.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Ended {
    /// The process ended with this exit status for the shell.
    Exit(i32),
    /// The server ended the stream early; follow again from the cursor.
    Continue,
    /// The stream closed without saying why.
    Cut,
}

/// Where a follower is: the process and the output offset written so far.
#[derive(Debug, Default)]
pub(crate) struct Follow {
    pub process_id: Option<String>,
    pub cursor: u64,
    pub lost: u64,
    /// The process id too, for whoever must signal it while this follows.
    pub shared_pid: std::sync::Arc<std::sync::Mutex<Option<String>>>,
}

impl Follow {
    /// Applies one event: output goes to stdout or stderr (what was already
    /// written, after a resume, is skipped). Answers how the stream ended,
    /// when this event ends it.
    pub(crate) fn apply(&mut self, ev: &Value) -> anyhow::Result<Option<Ended>> {
        let r = self.apply_inner(ev);
        if let Ok(mut p) = self.shared_pid.lock() {
            p.clone_from(&self.process_id);
        }
        r
    }

    fn apply_inner(&mut self, ev: &Value) -> anyhow::Result<Option<Ended>> {
        match ev["type"].as_str().unwrap_or("") {
            "start" => {
                if let Some(p) = ev["processId"].as_str() {
                    self.process_id = Some(p.to_string());
                }
            }
            kind @ ("stdout" | "stderr") => {
                let bytes = match ev["base64"].as_str() {
                    Some(b) => base64::engine::general_purpose::STANDARD
                        .decode(b)
                        .context("output that is not base64")?,
                    None => ev["data"].as_str().unwrap_or("").as_bytes().to_vec(),
                };
                let offset = ev["offset"].as_u64().unwrap_or(self.cursor);
                let end = offset + bytes.len() as u64;
                if end > self.cursor {
                    let skip = self.cursor.saturating_sub(offset) as usize;
                    let new = &bytes[skip.min(bytes.len())..];
                    if kind == "stdout" {
                        let mut o = std::io::stdout().lock();
                        o.write_all(new)?;
                        o.flush()?;
                    } else {
                        let mut o = std::io::stderr().lock();
                        o.write_all(new)?;
                        o.flush()?;
                    }
                    self.cursor = end;
                }
            }
            "truncated" => {
                let dropped = ev["droppedBytes"].as_u64().unwrap_or(0);
                self.lost += dropped;
                eprintln!("runtime: {dropped} bytes of output were lost (the reader fell behind)");
                if let Some(at) = ev["resumeAt"].as_u64() {
                    self.cursor = self.cursor.max(at);
                }
            }
            "continue" => {
                if let Some(p) = ev["processId"].as_str() {
                    self.process_id = Some(p.to_string());
                }
                if let Some(c) = ev["cursor"].as_u64() {
                    self.cursor = c;
                }
                return Ok(Some(Ended::Continue));
            }
            "exit" => return Ok(Some(Ended::Exit(exit_status(ev)))),
            "error" => {
                let body = serde_json::json!({ "error": ev["error"] });
                let status = ev["error"]["status"].as_u64().unwrap_or(500) as u16;
                return Err(
                    ApiFailure::from_body(status, None, body.to_string().as_bytes()).into(),
                );
            }
            _ => {}
        }
        Ok(None)
    }
}

/// The shell's exit status for a process's end: its code, 124 when it
/// timed out (as `timeout(1)`), 137 when it was killed.
pub(crate) fn exit_status(ev: &Value) -> i32 {
    if let Some(c) = ev["exitCode"].as_i64() {
        return c.clamp(0, 255) as i32;
    }
    if ev["timedOut"].as_bool() == Some(true) {
        return 124;
    }
    137
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn exit_statuses() {
        assert_eq!(exit_status(&json!({"exitCode": 3})), 3);
        assert_eq!(
            exit_status(&json!({"exitCode": null, "timedOut": true})),
            124
        );
        assert_eq!(exit_status(&json!({"exitCode": null})), 137);
    }

    #[test]
    fn a_resume_skips_what_was_written() {
        let mut f = Follow::default();
        assert_eq!(
            f.apply(&json!({"type": "start", "processId": "p"}))
                .unwrap(),
            None
        );
        f.apply(&json!({"type": "stdout", "data": "abc", "offset": 0}))
            .unwrap();
        assert_eq!(f.cursor, 3);
        // The same bytes again after a resume are skipped; the rest advances.
        f.apply(&json!({"type": "stdout", "data": "bcd", "offset": 1}))
            .unwrap();
        assert_eq!(f.cursor, 4);
        assert_eq!(
            f.apply(&json!({"type": "continue", "cursor": 4})).unwrap(),
            Some(Ended::Continue)
        );
        assert_eq!(
            f.apply(&json!({"type": "exit", "exitCode": 5})).unwrap(),
            Some(Ended::Exit(5))
        );
        assert_eq!(f.process_id.as_deref(), Some("p"));
        let e = f
            .apply(&json!({"type": "error", "error": {"code": "x", "message": "Boom.", "status": 503}}))
            .unwrap_err();
        assert_eq!(e.to_string(), "Boom. (503 x)");
    }

    #[test]
    fn cells() {
        assert_eq!(cell(&json!(null)), "-");
        assert_eq!(cell(&json!("a")), "a");
        assert_eq!(cell(&json!(2)), "2");
        assert_eq!(cell(&json!({"team": "x"})), "team=x");
    }
}
