//! A process's output as the server keeps it (contract §6), and how it ends.
//! Pure: bytes in, offsets and events out; the pump that feeds it and the
//! readers that follow it are `service::processes`.
//!
//! [`Output`] takes the host's stdout and stderr bytes. It holds back an
//! incomplete UTF-8 tail per stream until the rest arrives, so every chunk
//! it keeps is whole characters unless the bytes are not UTF-8 at all, and
//! only then assigns offsets (stdout and stderr counted together). Chunks go
//! into an [`OutBuf`] that keeps the last `cap` bytes: readers follow it
//! from a cursor, and one behind its start learns how much it missed
//! (`truncated`). The first [`JSON_KEEP`] bytes of each stream are also kept
//! whole for the JSON answer of an unstreamed exec ([`exec_result`]).

use std::collections::VecDeque;
use std::sync::Arc;

use base64::Engine;
use runtime_api::ExecResult;
use serde_json::{json, Map, Value};

/// The signals the server itself sends (the numbers are Linux's; the
/// host's `ExecControl::Signal` carries the number).
pub(crate) const SIGHUP: i32 = 1;
pub(crate) const SIGINT: i32 = 2;
pub(crate) const SIGKILL: i32 = 9;
pub(crate) const SIGTERM: i32 = 15;

/// Kept per stream for the JSON answer of an unstreamed exec.
pub(crate) const JSON_KEEP: usize = 64 * 1024;

/// The longest `timeoutMs` a command may ask for (a day).
pub(crate) const MAX_TIMEOUT_MS: i64 = 86_400_000;
/// An unstreamed exec that names no timeout ends after a minute.
pub(crate) const DEFAULT_EXEC_TIMEOUT_MS: i64 = 60_000;
/// How long past its timeout an unstreamed exec waits for the host's own
/// end before it kills the process itself.
pub(crate) const EXEC_GUARD_MS: u64 = 30_000;

/// The timeout a command runs with: the one it asked for; else a minute for
/// an unstreamed exec, a day for a streamed one, none for a spawn.
pub(crate) fn timeout_ms(asked: Option<i64>, spawn: bool, stream: bool) -> Option<i64> {
    match (asked, spawn, stream) {
        (Some(t), _, _) => Some(t),
        (None, false, false) => Some(DEFAULT_EXEC_TIMEOUT_MS),
        (None, false, true) => Some(MAX_TIMEOUT_MS),
        (None, true, _) => None,
    }
}

/// How long an unstreamed exec waits for the exit of a command with
/// `timeout_ms` before it ends the process group itself.
pub(crate) fn exec_guard_ms(timeout_ms: Option<u64>) -> u64 {
    timeout_ms.unwrap_or(MAX_TIMEOUT_MS as u64) + EXEC_GUARD_MS
}

/// A signal as a request names it: its number (1-64), or its name with or
/// without `SIG` (the common ones).
pub(crate) fn signal_number(v: &Value) -> Option<i32> {
    if let Some(n) = v.as_i64() {
        return (1..=64).contains(&n).then_some(n as i32);
    }
    let s = v.as_str()?;
    let name = s.strip_prefix("SIG").unwrap_or(s);
    Some(match name {
        "HUP" => SIGHUP,
        "INT" => SIGINT,
        "QUIT" => 3,
        "KILL" => SIGKILL,
        "USR1" => 10,
        "USR2" => 12,
        "TERM" => SIGTERM,
        "CONT" => 18,
        "STOP" => 19,
        "TSTP" => 20,
        "WINCH" => 28,
        _ => return None,
    })
}

/// Bytes at the end of `d` that start a UTF-8 character not yet complete.
pub(crate) fn incomplete_tail(d: &[u8]) -> usize {
    for k in 1..=3.min(d.len()) {
        let b = d[d.len() - k];
        if b & 0xC0 == 0x80 {
            continue; // continuation byte: look further back
        }
        let need = match b {
            0xC0..=0xDF => 2,
            0xE0..=0xEF => 3,
            0xF0..=0xF7 => 4,
            _ => return 0,
        };
        return if need > k { k } else { 0 };
    }
    0
}

/// Output bytes of one stream at an offset.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Chunk {
    pub(crate) offset: u64,
    pub(crate) stderr: bool,
    pub(crate) data: Vec<u8>,
}

/// Output with offsets, keeping the last `cap` bytes: `start` is the offset
/// of the oldest byte kept, `end` the offset the next byte gets.
#[derive(Debug)]
pub(crate) struct OutBuf {
    chunks: VecDeque<Chunk>,
    start: u64,
    end: u64,
    size: usize,
    cap: usize,
}

impl OutBuf {
    /// An empty buffer whose offsets go on from `at` (a process taken up
    /// after a restart continues its count).
    pub(crate) fn new(cap: usize, at: u64) -> Self {
        OutBuf {
            chunks: VecDeque::new(),
            start: at,
            end: at,
            size: 0,
            cap,
        }
    }

    pub(crate) fn start(&self) -> u64 {
        self.start
    }

    /// Appends `data` at `end`, dropping the oldest bytes past `cap`.
    pub(crate) fn push(&mut self, stderr: bool, data: Vec<u8>) {
        let len = data.len();
        self.chunks.push_back(Chunk {
            offset: self.end,
            stderr,
            data,
        });
        self.end += len as u64;
        self.size += len;
        while self.size > self.cap {
            let excess = self.size - self.cap;
            let Some(front) = self.chunks.front_mut() else {
                break;
            };
            // Never keep the rest of a character whose start was dropped.
            let rest = front.data.get(excess..).unwrap_or_default();
            let cut = excess
                + rest
                    .iter()
                    .take(3)
                    .take_while(|b| **b & 0xC0 == 0x80)
                    .count();
            if front.data.len() <= cut {
                self.size -= front.data.len();
                self.chunks.pop_front();
            } else {
                front.data.drain(..cut);
                front.offset += cut as u64;
                self.size -= cut;
            }
        }
        self.start = self.chunks.front().map_or(self.end, |c| c.offset);
    }

    /// What a reader at `cursor` gets: the bytes it missed (when it is
    /// behind `start`), the pieces from there on, and the cursor after them.
    pub(crate) fn read(&self, cursor: u64) -> Read<'_> {
        let mut read = Read {
            missed: None,
            pieces: Vec::new(),
            cursor,
        };
        if cursor < self.start {
            read.missed = Some(Missed {
                dropped: self.start - cursor,
                resume_at: self.start,
            });
            read.cursor = self.start;
        }
        for c in &self.chunks {
            let end = c.offset + c.data.len() as u64;
            if end <= read.cursor {
                continue;
            }
            let skip = read.cursor.saturating_sub(c.offset) as usize;
            read.pieces.push(Piece {
                stderr: c.stderr,
                offset: c.offset + skip as u64,
                bytes: &c.data[skip..],
            });
            read.cursor = end;
        }
        read
    }

    /// The bytes from `cursor` on, stdout and stderr in order (what a
    /// terminal shows), and the cursor after them. A cursor behind `start`
    /// starts there.
    pub(crate) fn read_raw(&self, cursor: u64) -> (Vec<u8>, u64) {
        let read = self.read(cursor.max(self.start));
        let mut out = Vec::new();
        for p in &read.pieces {
            out.extend_from_slice(p.bytes);
        }
        (out, read.cursor)
    }
}

/// Bytes a reader asked for that the buffer no longer keeps.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Missed {
    pub(crate) dropped: u64,
    pub(crate) resume_at: u64,
}

/// Kept output of one stream from an offset on.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Piece<'a> {
    pub(crate) stderr: bool,
    pub(crate) offset: u64,
    pub(crate) bytes: &'a [u8],
}

/// What [`OutBuf::read`] gives a reader.
#[derive(Debug)]
pub(crate) struct Read<'a> {
    pub(crate) missed: Option<Missed>,
    pub(crate) pieces: Vec<Piece<'a>>,
    /// Where the next read starts.
    pub(crate) cursor: u64,
}

impl Read<'_> {
    /// The read as stream events: `truncated`, then `stdout` / `stderr`
    /// with their offsets. Text is `data`; bytes that are not UTF-8 also go
    /// as `base64` (always, with `base64_always`).
    pub(crate) fn events(&self, base64_always: bool) -> Vec<Value> {
        let mut events = Vec::new();
        if let Some(m) = &self.missed {
            events.push(
                json!({"type": "truncated", "droppedBytes": m.dropped, "resumeAt": m.resume_at}),
            );
        }
        for p in &self.pieces {
            let mut ev = Map::new();
            ev.insert(
                "type".into(),
                json!(if p.stderr { "stderr" } else { "stdout" }),
            );
            ev.insert("offset".into(), json!(p.offset));
            match std::str::from_utf8(p.bytes) {
                Ok(text) => {
                    ev.insert("data".into(), json!(text));
                    if base64_always {
                        ev.insert("base64".into(), json!(b64(p.bytes)));
                    }
                }
                Err(_) => {
                    ev.insert("data".into(), json!(String::from_utf8_lossy(p.bytes)));
                    ev.insert("base64".into(), json!(b64(p.bytes)));
                }
            }
            events.push(Value::Object(ev));
        }
        events
    }
}

impl Read<'_> {
    /// The read as text chunks, `{stream, text, offset}` (bytes that are
    /// not UTF-8 replaced), as the JSON polling form of the output gives it.
    pub(crate) fn chunks(&self) -> Vec<Value> {
        self.pieces
            .iter()
            .map(|p| {
                json!({
                    "stream": if p.stderr { "stderr" } else { "stdout" },
                    "text": String::from_utf8_lossy(p.bytes),
                    "offset": p.offset,
                })
            })
            .collect()
    }
}

fn b64(b: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(b)
}

/// The first [`JSON_KEEP`] bytes of one stream, and how many it had.
#[derive(Debug, Default)]
pub(crate) struct Kept {
    data: Vec<u8>,
    total: u64,
}

impl Kept {
    pub(crate) fn add(&mut self, b: &[u8]) {
        let room = JSON_KEEP.saturating_sub(self.data.len());
        self.data.extend_from_slice(&b[..room.min(b.len())]);
        self.total += b.len() as u64;
    }

    pub(crate) fn truncated(&self) -> bool {
        self.total > self.data.len() as u64
    }

    /// The kept bytes as text, cut at a character boundary when truncated.
    pub(crate) fn text(&self) -> String {
        let mut d = &self.data[..];
        if self.truncated() {
            d = &d[..d.len() - incomplete_tail(d)];
        }
        String::from_utf8_lossy(d).into_owned()
    }
}

/// A process's output: the buffer readers follow, the incomplete UTF-8
/// tail held back per stream, and the start of each stream for the JSON
/// answer. Index 0 is stdout, 1 stderr.
#[derive(Debug)]
pub(crate) struct Output {
    buf: OutBuf,
    carry: [Vec<u8>; 2],
    kept: [Kept; 2],
}

impl Output {
    /// Empty, keeping `cap` bytes, offsets going on from `at`.
    pub(crate) fn new(cap: usize, at: u64) -> Self {
        Output {
            buf: OutBuf::new(cap, at),
            carry: [Vec::new(), Vec::new()],
            kept: [Kept::default(), Kept::default()],
        }
    }

    pub(crate) fn buf(&self) -> &OutBuf {
        &self.buf
    }

    /// The offset the next byte gets (every byte counted so far).
    pub(crate) fn end(&self) -> u64 {
        self.buf.end
    }

    /// Bytes from the host; an incomplete character at their end waits
    /// for the rest.
    pub(crate) fn ingest(&mut self, stderr: bool, bytes: &[u8]) {
        let i = usize::from(stderr);
        self.kept[i].add(bytes);
        let mut data = std::mem::take(&mut self.carry[i]);
        data.extend_from_slice(bytes);
        let keep = incomplete_tail(&data);
        self.carry[i] = data.split_off(data.len() - keep);
        if !data.is_empty() {
            self.buf.push(stderr, data);
        }
    }

    /// The process ended: what was held back goes in as it is.
    pub(crate) fn close(&mut self) {
        for i in 0..2 {
            let rest = std::mem::take(&mut self.carry[i]);
            if !rest.is_empty() {
                self.buf.push(i == 1, rest);
            }
        }
    }

    pub(crate) fn kept(&self, stderr: bool) -> &Kept {
        &self.kept[usize::from(stderr)]
    }
}

/// Where a command runs when it names no `cwd` (the sandbox user's home).
pub(crate) const DEFAULT_CWD: &str = "/workspace";

/// How a process ended. `lost`: the server lost it (its sandbox went, or
/// no host knew it any more), so there is no exit code.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Exit {
    pub(crate) code: Option<i32>,
    pub(crate) signal: Option<i32>,
    pub(crate) timed_out: bool,
    pub(crate) duration_ms: u64,
    /// How many of its processes the kernel killed for memory.
    pub(crate) oom_kills: u32,
    pub(crate) lost: bool,
    /// What it opened, when it was traced (`traceFiles`); shared, as an
    /// exit is cloned for every reader.
    pub(crate) files: Option<Arc<TracedFiles>>,
}

impl Exit {
    /// A process lost after running `duration_ms`.
    pub(crate) fn lost(duration_ms: u64) -> Exit {
        Exit {
            code: None,
            signal: None,
            timed_out: false,
            duration_ms,
            oom_kills: 0,
            lost: true,
            files: None,
        }
    }

    /// Its `state`, as listed and stored.
    pub(crate) fn state(&self) -> &'static str {
        if self.lost {
            "lost"
        } else {
            "exited"
        }
    }

    /// The `exit` event that ends a stream (`memory_mib`: its sandbox's).
    pub(crate) fn event(&self, memory_mib: u32) -> Value {
        let mut v = json!({
            "type": "exit",
            "exitCode": self.code,
            "state": self.state(),
            "timedOut": self.timed_out,
            "durationMs": self.duration_ms,
        });
        if let Some(oom) = out_of_memory(self.oom_kills, memory_mib) {
            v["outOfMemory"] = oom;
        }
        if let Some(files) = &self.files {
            v["files"] = files_json(files);
        }
        v
    }
}

/// The files a traced command opened (`traceFiles`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct TracedFiles {
    /// Every file and directory opened (directories end in `/`), sorted.
    pub(crate) read: Vec<String>,
    /// Every file opened for writing, sorted.
    pub(crate) written: Vec<String>,
    /// Some paths are missing.
    pub(crate) truncated: bool,
}

/// Traced files as the API answers them.
pub(crate) fn files_json(f: &TracedFiles) -> Value {
    json!({"read": f.read, "written": f.written, "truncated": f.truncated})
}

/// The `outOfMemory` report of a command whose processes the kernel
/// killed for memory (`None` when it killed none), as the client reads it.
pub(crate) fn out_of_memory(kills: u32, memory_mib: u32) -> Option<Value> {
    (kills > 0).then(|| {
        let what = if kills == 1 { "process" } else { "processes" };
        json!({
            "code": "out_of_memory",
            "processesKilled": kills,
            "memoryMiB": memory_mib,
            "message": format!(
                "The sandbox ran out of memory ({memory_mib} MiB): the kernel ended {kills} {what} of this command."
            ),
            "hint": "Use less memory, or create the sandbox with more (memoryMiB).",
        })
    })
}

/// The JSON answer of an unstreamed exec. Without an exit (the host never
/// reported one within `guard_ms`) it counts as timed out after `guard_ms`.
pub(crate) fn exec_result(
    out: &Output,
    exit: Option<&Exit>,
    guard_ms: u64,
    process_id: String,
    memory_mib: u32,
    traced: bool,
) -> ExecResult {
    let (code, timed_out, duration, oom) = match exit {
        Some(e) => (e.code, e.timed_out, e.duration_ms, e.oom_kills),
        None => (None, true, guard_ms, 0),
    };
    let files = match exit {
        Some(e) => e.files.as_deref().map(files_json),
        // Traced, but never reported: nothing is known.
        None if traced => Some(files_json(&TracedFiles {
            truncated: true,
            ..TracedFiles::default()
        })),
        None => None,
    };
    ExecResult {
        exit_code: code,
        stdout: out.kept(false).text(),
        stderr: out.kept(true).text(),
        timed_out,
        stdout_truncated: out.kept(false).truncated(),
        stderr_truncated: out.kept(true).truncated(),
        duration_ms: duration,
        process_id,
        out_of_memory: out_of_memory(oom, memory_mib),
        files,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(events: &[Value]) -> String {
        events
            .iter()
            .filter_map(|e| e["data"].as_str())
            .collect::<String>()
    }

    #[test]
    fn incomplete_utf8_tails() {
        assert_eq!(incomplete_tail(b"abc"), 0);
        assert_eq!(incomplete_tail(b""), 0);
        assert_eq!(incomplete_tail("é".as_bytes()), 0);
        assert_eq!(incomplete_tail(&"é".as_bytes()[..1]), 1);
        assert_eq!(incomplete_tail(&"€".as_bytes()[..2]), 2);
        assert_eq!(incomplete_tail(&"😀".as_bytes()[..3]), 3);
        assert_eq!(incomplete_tail("a😀".as_bytes()), 0);
        assert_eq!(incomplete_tail(b"\xff"), 0);
    }

    #[test]
    fn pushing_past_the_cap_drops_the_oldest_bytes_and_moves_start() {
        let mut b = OutBuf::new(10, 0);
        b.push(false, vec![1; 6]);
        assert_eq!((b.start(), b.end), (0, 6));
        b.push(true, vec![2; 6]);
        assert_eq!((b.start(), b.end, b.size), (2, 12, 10));
        let front: Vec<(u64, usize)> = b.chunks.iter().map(|c| (c.offset, c.data.len())).collect();
        assert_eq!(front, vec![(2, 4), (6, 6)]);
        // A chunk larger than the cap keeps only its last bytes.
        b.push(false, (0..25).collect());
        assert_eq!((b.start(), b.end), (27, 37));
        assert_eq!(b.chunks.len(), 1);
        assert_eq!(
            b.read(0).pieces[0].bytes,
            &(15..25).collect::<Vec<u8>>()[..]
        );
    }

    #[test]
    fn dropping_the_oldest_bytes_never_cuts_a_character() {
        let mut b = OutBuf::new(5, 0);
        b.push(false, "éééé".as_bytes().to_vec());
        // Three bytes over the cap end inside the second `é`: it goes whole.
        assert_eq!((b.start, b.end), (4, 8));
        let r = b.read(0);
        assert_eq!(r.missed.map(|m| m.dropped), Some(4));
        assert_eq!(std::str::from_utf8(r.pieces[0].bytes), Ok("éé"));
        // A chunk whose rest is only such bytes goes entirely.
        let mut b = OutBuf::new(3, 0);
        b.push(false, "é".as_bytes().to_vec());
        b.push(true, b"abc".to_vec());
        assert_eq!(b.start, 2);
        assert_eq!(b.chunks.len(), 1);
        // Bytes that are not UTF-8 lose at most three more.
        let mut b = OutBuf::new(2, 0);
        b.push(false, vec![0x80; 8]);
        assert_eq!((b.start, b.end), (8, 8));
        assert!(b.chunks.is_empty());
    }

    #[test]
    fn offsets_go_on_from_where_they_were() {
        let mut b = OutBuf::new(100, 500);
        assert_eq!((b.start(), b.end), (500, 500));
        b.push(false, b"abc".to_vec());
        let r = b.read(500);
        assert!(r.missed.is_none());
        assert_eq!(r.pieces[0].offset, 500);
        assert_eq!(r.cursor, 503);
    }

    #[test]
    fn a_read_from_before_start_reports_what_was_lost() {
        let mut b = OutBuf::new(4, 0);
        b.push(false, b"abcdef".to_vec());
        let r = b.read(1);
        assert_eq!(
            r.missed,
            Some(Missed {
                dropped: 1,
                resume_at: 2
            })
        );
        assert_eq!(r.pieces[0].bytes, b"cdef");
        assert_eq!(r.cursor, 6);
        let ev = r.events(false);
        assert_eq!(
            ev[0],
            json!({"type": "truncated", "droppedBytes": 1, "resumeAt": 2})
        );
        assert_eq!(
            ev[1],
            json!({"type": "stdout", "offset": 2, "data": "cdef"})
        );
        // Nothing missed from start or later.
        assert!(b.read(2).missed.is_none());
        assert!(b.read(6).pieces.is_empty());
    }

    #[test]
    fn a_read_from_inside_a_chunk_starts_at_the_cursor() {
        let mut b = OutBuf::new(100, 0);
        b.push(false, b"hello ".to_vec());
        b.push(true, b"world".to_vec());
        let r = b.read(3);
        let got: Vec<(bool, u64, &[u8])> = r
            .pieces
            .iter()
            .map(|p| (p.stderr, p.offset, p.bytes))
            .collect();
        assert_eq!(got, vec![(false, 3, &b"lo "[..]), (true, 6, &b"world"[..])]);
        assert_eq!(r.cursor, 11);
        assert_eq!(b.read_raw(0), (b"hello world".to_vec(), 11));
        assert_eq!(b.read_raw(8), (b"rld".to_vec(), 11));
    }

    #[test]
    fn bytes_that_are_not_utf8_also_go_as_base64() {
        let mut b = OutBuf::new(100, 0);
        b.push(false, vec![0xff, b'a']);
        b.push(true, b"ok".to_vec());
        let ev = b.read(0).events(false);
        assert_eq!(ev[0]["base64"], "/2E=");
        assert_eq!(ev[0]["data"], "\u{fffd}a");
        assert!(ev[1].get("base64").is_none());
        assert_eq!(ev[1]["type"], "stderr");
        let ev = b.read(0).events(true);
        assert_eq!(ev[1]["base64"], "b2s=");
    }

    #[test]
    fn a_utf8_sequence_split_across_chunks_is_not_cut() {
        let mut o = Output::new(1 << 20, 0);
        let euro = "€".as_bytes();
        o.ingest(false, &[b'a', euro[0]]);
        // Only the whole character got an offset.
        assert_eq!(o.end(), 1);
        o.ingest(false, &euro[1..2]);
        assert_eq!(o.end(), 1);
        o.ingest(false, &euro[2..]);
        assert_eq!(o.end(), 4);
        let ev = o.buf().read(0).events(false);
        assert_eq!(text(&ev), "a€");
        assert!(ev.iter().all(|e| e.get("base64").is_none()));
        // Each stream holds back its own tail.
        o.ingest(true, &euro[..1]);
        o.ingest(false, b"b");
        o.ingest(true, &euro[1..]);
        let ev = o.buf().read(4).events(false);
        assert_eq!(ev[0], json!({"type": "stdout", "offset": 4, "data": "b"}));
        assert_eq!(ev[1], json!({"type": "stderr", "offset": 5, "data": "€"}));
    }

    #[test]
    fn at_the_end_a_held_back_tail_goes_in_as_it_is() {
        let mut o = Output::new(100, 0);
        o.ingest(false, &"é".as_bytes()[..1]);
        assert_eq!(o.end(), 0);
        o.close();
        assert_eq!(o.end(), 1);
        let ev = o.buf().read(0).events(false);
        assert_eq!(ev[0]["base64"], "ww==");
    }

    #[test]
    fn the_json_answer_keeps_the_first_64_kib_per_stream_whole_characters() {
        let mut o = Output::new(1 << 20, 0);
        o.ingest(false, &vec![b'x'; JSON_KEEP - 1]);
        o.ingest(false, "é and more".as_bytes());
        o.ingest(true, b"small");
        assert!(o.kept(false).truncated());
        // The cut fell inside `é`: the answer stops before it.
        assert_eq!(o.kept(false).text().len(), JSON_KEEP - 1);
        assert!(!o.kept(true).truncated());
        assert_eq!(o.kept(true).text(), "small");
    }

    #[test]
    fn an_exit_becomes_the_answer_and_the_event() {
        let mut o = Output::new(100, 0);
        o.ingest(false, b"out");
        o.ingest(true, b"err");
        let exit = Exit {
            code: Some(3),
            signal: None,
            timed_out: false,
            duration_ms: 12,
            oom_kills: 2,
            lost: false,
            files: None,
        };
        let r = exec_result(&o, Some(&exit), 99, "proc_1".into(), 512, false);
        assert_eq!(r.files, None);
        assert_eq!(r.exit_code, Some(3));
        assert_eq!((r.stdout.as_str(), r.stderr.as_str()), ("out", "err"));
        assert_eq!((r.timed_out, r.duration_ms), (false, 12));
        let oom = r.out_of_memory.clone().unwrap();
        assert_eq!(
            (&oom["code"], &oom["processesKilled"], &oom["memoryMiB"]),
            (&json!("out_of_memory"), &json!(2), &json!(512))
        );
        assert!(
            oom["message"].as_str().unwrap().contains("512 MiB"),
            "{oom}"
        );
        assert!(oom["hint"].is_string());
        assert_eq!(r.process_id, "proc_1");
        assert_eq!(
            exit.event(512),
            json!({"type": "exit", "exitCode": 3, "state": "exited", "timedOut": false,
                   "durationMs": 12, "outOfMemory": oom})
        );
        // No exit within the guard: timed out after it.
        let r = exec_result(&o, None, 99, "proc_1".into(), 512, false);
        assert_eq!((r.exit_code, r.timed_out, r.duration_ms), (None, true, 99));
        assert_eq!(r.out_of_memory, None);
        assert_eq!(r.files, None);
        // Traced: what it opened, in the answer and the event.
        let traced = Exit {
            files: Some(Arc::new(TracedFiles {
                read: vec!["/etc/".into(), "/etc/hostname".into()],
                written: vec!["/tmp/x".into()],
                truncated: false,
            })),
            ..exit.clone()
        };
        let want =
            json!({"read": ["/etc/", "/etc/hostname"], "written": ["/tmp/x"], "truncated": false});
        let r = exec_result(&o, Some(&traced), 99, "proc_1".into(), 512, true);
        assert_eq!(r.files.as_ref(), Some(&want));
        assert_eq!(traced.event(512)["files"], want);
        // Traced, with no exit within the guard: nothing known, so truncated.
        let r = exec_result(&o, None, 99, "proc_1".into(), 512, true);
        assert_eq!(
            r.files,
            Some(json!({"read": [], "written": [], "truncated": true}))
        );
        let lost = Exit::lost(7);
        assert_eq!(lost.state(), "lost");
        assert_eq!(lost.event(512)["exitCode"], Value::Null);
        assert!(lost.event(512).get("outOfMemory").is_none());
    }

    #[test]
    fn timeouts_by_kind_of_command() {
        assert_eq!(timeout_ms(Some(5), false, false), Some(5));
        assert_eq!(timeout_ms(Some(5), true, false), Some(5));
        assert_eq!(timeout_ms(None, false, false), Some(60_000));
        assert_eq!(timeout_ms(None, false, true), Some(MAX_TIMEOUT_MS));
        assert_eq!(timeout_ms(None, true, false), None);
        assert_eq!(exec_guard_ms(Some(1_000)), 31_000);
        assert_eq!(exec_guard_ms(None), 86_430_000);
    }

    #[test]
    fn signals_by_number_or_name() {
        assert_eq!(signal_number(&json!(9)), Some(SIGKILL));
        assert_eq!(signal_number(&json!(64)), Some(64));
        assert_eq!(signal_number(&json!(0)), None);
        assert_eq!(signal_number(&json!(65)), None);
        assert_eq!(signal_number(&json!("SIGTERM")), Some(SIGTERM));
        assert_eq!(signal_number(&json!("INT")), Some(SIGINT));
        assert_eq!(signal_number(&json!("HUP")), Some(SIGHUP));
        assert_eq!(signal_number(&json!("SIGBOGUS")), None);
        assert_eq!(signal_number(&json!(true)), None);
    }
}
