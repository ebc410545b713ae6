//! The interpreter's rules and its driver protocol (contract §8). Pure:
//! bytes and events in, the run's answer out; the kernels themselves (guest
//! processes) are `service::interpreter`'s.
//!
//! A driver answers on its stdout with protocol lines, each `NONCE {json}`
//! where the nonce is random per process. [`Lines`] splits its stdout into
//! those lines ([`DriverEvent`]) and plain output; [`Cell`] gathers one
//! run's output, results and error into the answer, keeping at most
//! [`KEEP_BYTES`] per stream.

use serde::Deserialize;
use serde_json::{json, Value};

/// The languages of the contract, all installed in the default image.
pub(crate) const LANGUAGES: &[&str] = &[
    "python",
    "javascript",
    "typescript",
    "r",
    "java",
    "bash",
    "go",
];
/// A run that names no `timeoutMs` is interrupted after a minute.
pub(crate) const DEFAULT_TIMEOUT_MS: i64 = 60_000;
/// Kept per stream in the JSON answer; the rest is counted in `lostBytes`.
pub(crate) const KEEP_BYTES: usize = 1 << 20;
/// The largest `code` a run takes.
pub(crate) const MAX_CODE_BYTES: usize = 4 << 20;

/// A context id: 1-63 of `[a-z0-9-]`, starting with a letter or digit.
pub(crate) fn valid_context_id(id: &str) -> bool {
    (1..=63).contains(&id.len())
        && id.as_bytes()[0].is_ascii_alphanumeric()
        && id
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
}

pub(crate) fn is_language(l: &str) -> bool {
    LANGUAGES.contains(&l)
}

/// Why a new context's language is refused.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum LanguageIssue {
    /// Not one of [`LANGUAGES`].
    Unknown,
    /// The id names a language's default context, which runs only that
    /// language.
    NotItsOwn { id: String, language: String },
}

/// The language of a new context: the one asked for; else the language
/// its id names (a language's default context), else python.
pub(crate) fn context_language(
    id: Option<&str>,
    asked: Option<&str>,
) -> Result<String, LanguageIssue> {
    let language = match asked {
        Some(l) => l,
        None => id.filter(|c| is_language(c)).unwrap_or("python"),
    };
    if !is_language(language) {
        return Err(LanguageIssue::Unknown);
    }
    match id {
        Some(c) if is_language(c) && c != language => Err(LanguageIssue::NotItsOwn {
            id: c.to_string(),
            language: language.to_string(),
        }),
        _ => Ok(language.to_string()),
    }
}

/// One protocol line of a driver (`k` names the kind). Lines of other
/// kinds, or not of this shape, are ignored.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(tag = "k", rename_all = "lowercase")]
pub(crate) enum DriverEvent {
    /// The driver started and waits for runs.
    Ready,
    Stdout {
        #[serde(default)]
        text: String,
    },
    Stderr {
        #[serde(default)]
        text: String,
    },
    /// A value the run showed (`main`: the value of its last expression),
    /// as a MIME bundle.
    Result {
        #[serde(default)]
        main: bool,
        #[serde(default)]
        data: Value,
    },
    /// The run raised.
    Error {
        #[serde(default)]
        name: Value,
        #[serde(default)]
        value: Value,
        #[serde(default)]
        traceback: Value,
    },
    /// The run with this id ended.
    End {
        #[serde(default)]
        id: Option<String>,
    },
    #[serde(other)]
    Other,
}

impl DriverEvent {
    /// A protocol line's JSON as an event ([`DriverEvent::Other`] when it
    /// has no known shape).
    pub(crate) fn from_json(v: Value) -> DriverEvent {
        DriverEvent::deserialize(v).unwrap_or(DriverEvent::Other)
    }
}

/// What a driver's stdout holds.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Line {
    Event(DriverEvent),
    /// Output that is not a protocol line (a child process writing to the
    /// inherited stdout, what R prints).
    Plain(String),
}

/// Splits a driver's stdout into protocol lines and plain output.
#[derive(Debug)]
pub(crate) struct Lines {
    prefix: Vec<u8>,
    /// Bytes not yet ending in a newline.
    line: Vec<u8>,
}

impl Lines {
    pub(crate) fn new(nonce: &str) -> Self {
        Lines {
            prefix: format!("{nonce} ").into_bytes(),
            line: Vec::new(),
        }
    }

    /// Takes stdout bytes; `out` gets each whole line, and a partial line
    /// at once when it cannot start a protocol line.
    pub(crate) fn push(&mut self, bytes: &[u8], out: &mut Vec<Line>) {
        self.line.extend_from_slice(bytes);
        while let Some(i) = self.line.iter().position(|b| *b == b'\n') {
            let rest = self.line.split_off(i + 1);
            let line = std::mem::replace(&mut self.line, rest);
            let body = &line[..line.len() - 1];
            let event = body
                .strip_prefix(&self.prefix[..])
                .and_then(|j| serde_json::from_slice::<Value>(j).ok());
            out.push(match event {
                Some(v) => Line::Event(DriverEvent::from_json(v)),
                None => Line::Plain(String::from_utf8_lossy(&line).into_owned()),
            });
        }
        let n = self.line.len().min(self.prefix.len());
        if !self.line.is_empty() && self.line[..n] != self.prefix[..n] {
            let line = std::mem::take(&mut self.line);
            out.push(Line::Plain(String::from_utf8_lossy(&line).into_owned()));
        }
    }
}

/// Text of one stream kept for the answer: the first [`KEEP_BYTES`], cut
/// at a character boundary; `lost` counts the rest.
#[derive(Debug, Default)]
pub(crate) struct Captured {
    text: String,
    lost: u64,
}

impl Captured {
    pub(crate) fn add(&mut self, t: &str) {
        let room = KEEP_BYTES.saturating_sub(self.text.len());
        if t.len() <= room {
            self.text.push_str(t);
        } else {
            let mut cut = room;
            while !t.is_char_boundary(cut) {
                cut -= 1;
            }
            self.text.push_str(&t[..cut]);
            self.lost += (t.len() - cut) as u64;
        }
    }
}

/// What a run's driver said, gathered into its answer.
#[derive(Debug, Default)]
pub(crate) struct Cell {
    stdout: Captured,
    stderr: Captured,
    results: Vec<Value>,
    error: Value,
}

/// What [`Cell::take`] makes of a driver's line.
#[derive(Debug, PartialEq)]
pub(crate) enum Step {
    /// Send this event to a streaming reader.
    Send(Value),
    /// The run ended.
    End,
    Nothing,
}

impl Cell {
    /// Output of the run; answers the event that streams it.
    pub(crate) fn output(&mut self, stderr: bool, text: String) -> Value {
        let kind = if stderr {
            self.stderr.add(&text);
            "stderr"
        } else {
            self.stdout.add(&text);
            "stdout"
        };
        json!({"k": kind, "text": text})
    }

    /// A line of the driver during the run `exec_id`.
    pub(crate) fn take(&mut self, line: Line, exec_id: &str) -> Step {
        let ev = match line {
            Line::Plain(t) => return Step::Send(self.output(false, t)),
            Line::Event(ev) => ev,
        };
        match ev {
            DriverEvent::Stdout { text } => Step::Send(self.output(false, text)),
            DriverEvent::Stderr { text } => Step::Send(self.output(true, text)),
            DriverEvent::Result { main, data } => {
                self.results
                    .push(json!({"main": main, "data": data, "refs": []}));
                Step::Send(json!({"k": "result", "main": main, "data": data, "refs": []}))
            }
            DriverEvent::Error {
                name,
                value,
                traceback,
            } => {
                self.error = json!({"name": name, "value": value, "traceback": traceback});
                Step::Send(json!({"k": "error", "name": name, "value": value,
                                  "traceback": traceback}))
            }
            DriverEvent::End { id } if id.as_deref() == Some(exec_id) => Step::End,
            _ => Step::Nothing,
        }
    }

    /// The run raised (or its kernel was lost with this error).
    pub(crate) fn errored(&self) -> bool {
        !self.error.is_null()
    }

    /// The kernel was lost: unless the run already raised, its error says
    /// how the process ended (`None`: the host could not say).
    pub(crate) fn lose(&mut self, ended: Option<&Ended>) {
        if self.error.is_null() {
            self.error = json!({"name": "ContextLost", "value": format!("The interpreter process {}; the next run starts it again with empty state.", ended_how(ended)), "traceback": ""});
        }
    }

    /// The answer, from the run's facts.
    pub(crate) fn execution(self, run: &RunFacts) -> Value {
        let lost = self.stdout.lost + self.stderr.lost;
        json!({
            "id": run.id,
            "contextId": run.context_id,
            "language": run.language,
            "executionCount": run.count,
            "status": run.status,
            "stdout": self.stdout.text,
            "stderr": self.stderr.text,
            "results": self.results,
            "error": self.error,
            "overflow": lost > 0,
            "durationMs": run.duration_ms,
            "contextStarted": run.context_started,
            "lostBytes": lost,
        })
    }
}

/// The facts of a run besides what its driver said.
pub(crate) struct RunFacts<'a> {
    pub(crate) id: &'a str,
    pub(crate) context_id: &'a str,
    pub(crate) language: &'a str,
    pub(crate) count: u64,
    pub(crate) status: &'static str,
    pub(crate) duration_ms: i64,
    pub(crate) context_started: bool,
}

/// How a kernel's process ended, as the host reported it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Ended {
    pub(crate) code: Option<i32>,
    pub(crate) signal: Option<i32>,
    pub(crate) out_of_memory: bool,
}

fn ended_how(ended: Option<&Ended>) -> String {
    match ended {
        Some(x) if x.out_of_memory => "ran out of memory".to_string(),
        Some(x) => match (x.code, x.signal) {
            (_, Some(sig)) => format!("was killed by signal {sig}"),
            (Some(c), None) => format!("exited with code {c}"),
            (None, None) => "ended".to_string(),
        },
        None => "could no longer be reached".to_string(),
    }
}

/// A run's `status`: `lost` when its kernel ended (not killed by us),
/// `timeout` when it ran out of time, `interrupted` when an interrupt made
/// it raise, else `error` or `ok`.
pub(crate) fn status(
    lost: bool,
    killed: bool,
    timed_out: bool,
    interrupted: bool,
    errored: bool,
) -> &'static str {
    if lost && !killed {
        "lost"
    } else if timed_out {
        "timeout"
    } else if interrupted && errored {
        "interrupted"
    } else if errored {
        "error"
    } else {
        "ok"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split(chunks: &[&[u8]]) -> Vec<Line> {
        let mut l = Lines::new("abc");
        let mut out = Vec::new();
        for c in chunks {
            l.push(c, &mut out);
        }
        out
    }

    #[test]
    fn protocol_lines_are_split_from_plain_output() {
        let got = split(&[
            b"abc {\"k\":\"end\"}\nplain\nab",
            b"c {\"k\":\"ready\"}\nxyz",
        ]);
        assert_eq!(
            got,
            vec![
                Line::Event(DriverEvent::End { id: None }),
                Line::Plain("plain\n".into()),
                Line::Event(DriverEvent::Ready),
                Line::Plain("xyz".into()),
            ]
        );
    }

    #[test]
    fn a_line_with_the_nonce_but_not_json_is_plain_output() {
        let got = split(&[b"abc not json\n", b"abd {\"k\":\"ready\"}\n"]);
        assert_eq!(
            got,
            vec![
                Line::Plain("abc not json\n".into()),
                Line::Plain("abd {\"k\":\"ready\"}\n".into()),
            ]
        );
    }

    #[test]
    fn driver_events_by_kind_and_unknown_ones() {
        let ev = |v: Value| DriverEvent::from_json(v);
        assert_eq!(
            ev(json!({"k": "stdout", "text": "hi"})),
            DriverEvent::Stdout { text: "hi".into() }
        );
        assert_eq!(
            ev(json!({"k": "stderr"})),
            DriverEvent::Stderr {
                text: String::new()
            }
        );
        assert_eq!(
            ev(json!({"k": "result", "main": true, "data": {"text/plain": "2"}})),
            DriverEvent::Result {
                main: true,
                data: json!({"text/plain": "2"})
            }
        );
        assert_eq!(
            ev(json!({"k": "end", "id": "exec_1", "status": "ok"})),
            DriverEvent::End {
                id: Some("exec_1".into())
            }
        );
        assert_eq!(
            ev(json!({"k": "ready", "pid": 7, "language": "r"})),
            DriverEvent::Ready
        );
        assert_eq!(ev(json!({"k": "progress"})), DriverEvent::Other);
        assert_eq!(ev(json!({"no": "kind"})), DriverEvent::Other);
        assert_eq!(ev(json!(5)), DriverEvent::Other);
    }

    #[test]
    fn a_cell_gathers_output_results_and_errors() {
        let mut c = Cell::default();
        let step = c.take(Line::Plain("raw\n".into()), "e1");
        assert_eq!(step, Step::Send(json!({"k": "stdout", "text": "raw\n"})));
        c.take(
            Line::Event(DriverEvent::Stderr {
                text: "warn".into(),
            }),
            "e1",
        );
        let step = c.take(
            Line::Event(DriverEvent::Result {
                main: true,
                data: json!({"text/plain": "2"}),
            }),
            "e1",
        );
        assert_eq!(
            step,
            Step::Send(
                json!({"k": "result", "main": true, "data": {"text/plain": "2"}, "refs": []})
            )
        );
        assert!(!c.errored());
        c.take(
            Line::Event(DriverEvent::Error {
                name: json!("ValueError"),
                value: json!("bad"),
                traceback: json!("tb"),
            }),
            "e1",
        );
        assert!(c.errored());
        // The end of another run is not this one's.
        let other = DriverEvent::End {
            id: Some("e0".into()),
        };
        assert_eq!(c.take(Line::Event(other), "e1"), Step::Nothing);
        let end = DriverEvent::End {
            id: Some("e1".into()),
        };
        assert_eq!(c.take(Line::Event(end), "e1"), Step::End);
        let run = RunFacts {
            id: "e1",
            context_id: "python",
            language: "python",
            count: 3,
            status: "error",
            duration_ms: 5,
            context_started: false,
        };
        let v = c.execution(&run);
        assert_eq!(v["stdout"], "raw\n");
        assert_eq!(v["stderr"], "warn");
        assert_eq!(
            v["results"],
            json!([{"main": true, "data": {"text/plain": "2"}, "refs": []}])
        );
        assert_eq!(
            v["error"],
            json!({"name": "ValueError", "value": "bad", "traceback": "tb"})
        );
        assert_eq!(
            (v["overflow"].clone(), v["lostBytes"].clone()),
            (json!(false), json!(0))
        );
        assert_eq!(v["executionCount"], 3);
    }

    #[test]
    fn the_answer_keeps_the_first_mib_per_stream_at_a_character_boundary() {
        let mut c = Cell::default();
        c.output(false, "x".repeat(KEEP_BYTES - 1));
        c.output(false, "é!".into());
        c.output(true, "e".into());
        let v = c.execution(&RunFacts {
            id: "e",
            context_id: "c",
            language: "python",
            count: 1,
            status: "ok",
            duration_ms: 0,
            context_started: true,
        });
        assert_eq!(v["stdout"].as_str().map(str::len), Some(KEEP_BYTES - 1));
        assert_eq!(v["lostBytes"], 3);
        assert_eq!(v["overflow"], true);
        assert_eq!(v["stderr"], "e");
    }

    #[test]
    fn a_lost_kernel_says_how_it_ended_unless_the_run_raised() {
        let mut c = Cell::default();
        c.lose(Some(&Ended {
            code: None,
            signal: Some(9),
            out_of_memory: false,
        }));
        assert_eq!(c.error["name"], "ContextLost");
        assert_eq!(
            c.error["value"],
            "The interpreter process was killed by signal 9; the next run starts it again with empty state."
        );
        let how = |code, signal, oom| {
            ended_how(Some(&Ended {
                code,
                signal,
                out_of_memory: oom,
            }))
        };
        assert_eq!(how(Some(1), None, false), "exited with code 1");
        assert_eq!(how(None, None, false), "ended");
        assert_eq!(how(Some(1), Some(9), true), "ran out of memory");
        assert_eq!(ended_how(None), "could no longer be reached");
        let mut raised = Cell::default();
        raised.take(
            Line::Event(DriverEvent::Error {
                name: json!("E"),
                value: json!("v"),
                traceback: json!(""),
            }),
            "e",
        );
        raised.lose(None);
        assert_eq!(raised.error["name"], "E");
    }

    #[test]
    fn statuses() {
        assert_eq!(status(true, false, false, false, false), "lost");
        assert_eq!(status(true, true, true, false, false), "timeout");
        assert_eq!(status(false, false, true, true, true), "timeout");
        assert_eq!(status(false, false, false, true, true), "interrupted");
        assert_eq!(status(false, false, false, true, false), "ok");
        assert_eq!(status(false, false, false, false, true), "error");
        assert_eq!(status(false, false, false, false, false), "ok");
    }

    #[test]
    fn context_ids_and_languages() {
        assert!(valid_context_id("python"));
        assert!(valid_context_id("ctx-1"));
        assert!(!valid_context_id("-a"));
        assert!(!valid_context_id("A"));
        assert!(!valid_context_id(""));
        assert!(!valid_context_id(&"a".repeat(64)));
        assert_eq!(LANGUAGES.len(), 7);
        assert_eq!(context_language(None, None), Ok("python".into()));
        assert_eq!(context_language(Some("r"), None), Ok("r".into()));
        assert_eq!(context_language(Some("mine"), Some("go")), Ok("go".into()));
        assert_eq!(
            context_language(None, Some("cobol")),
            Err(LanguageIssue::Unknown)
        );
        assert_eq!(
            context_language(Some("r"), Some("python")),
            Err(LanguageIssue::NotItsOwn {
                id: "r".into(),
                language: "python".into()
            })
        );
    }
}
