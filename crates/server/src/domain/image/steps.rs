//! The steps of a build and the hash chain that names them. Each step's
//! key is the SHA-256 of the key before it, the instruction, its script and
//! the build state it runs in (env, workdir, user); the first chains from
//! the base's key. Changing a step, or anything before it, changes its key
//! and every key after it; nothing else does. A key is also the name of the
//! layer the build keeps after the step (`images/layers/<key>/`).

use base64::Engine;
use serde::{Deserialize, Serialize};
use serde_json::json;

use super::{ImageUser, Step, StepState};
use crate::domain::access::sha256_hex;

/// Most steps one build may have.
pub(crate) const MAX_STEPS: usize = 200;

/// How many of a key's characters name its disk to the host (and its
/// pre-booted templates).
const SHORT_KEY: usize = 32;

/// The build state a step runs in, and what the image keeps of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct BuildState {
    pub(crate) env: Vec<(String, String)>,
    pub(crate) workdir: Option<String>,
    pub(crate) user: ImageUser,
}

impl BuildState {
    /// Sets one variable (a later value replaces an earlier one, and moves
    /// it to the end).
    pub(crate) fn set_env(&mut self, k: &str, v: &str) {
        self.env.retain(|(n, _)| n != k);
        self.env.push((k.to_string(), v.to_string()));
    }
}

/// The steps of a build as its recipe or Dockerfile is read.
#[derive(Debug, Clone)]
pub(crate) struct Steps {
    pub(crate) steps: Vec<Step>,
    pub(crate) state: BuildState,
    prev: String,
    /// Set by [`Steps::restart`]: the layer the next step runs on.
    on: Option<String>,
    /// The build disk when it is not the default ([`super::BuildLimits::other_disk`]):
    /// every key covers it, since a layer's file system is its disk's size.
    pub(crate) disk: Option<u32>,
}

impl Steps {
    /// Steps chaining from `base_key`, starting in `state`.
    pub(crate) fn new(base_key: impl Into<String>, state: BuildState) -> Self {
        Steps {
            steps: Vec::new(),
            state,
            prev: base_key.into(),
            on: None,
            disk: None,
        }
    }

    /// The key the next step chains from (the last step's, or the base's).
    pub(crate) fn prev(&self) -> &str {
        &self.prev
    }

    /// Starts another chain (a stage of a multi-stage build): later steps
    /// chain from `key`, in `state`, and the next one runs on that layer.
    pub(crate) fn restart(&mut self, key: &str, state: BuildState) {
        self.prev = key.to_string();
        self.state = state;
        self.on = Some(key.to_string());
    }

    /// A step running `script` as the build's user, in its state.
    pub(crate) fn push(&mut self, instruction: String, script: String) {
        let mut key = step_key(&self.prev, &instruction, &script, &self.state);
        if let Some(mib) = self.disk {
            key = on_disk(&key, mib);
        }
        self.prev = key.clone();
        self.steps.push(Step {
            index: self.steps.len(),
            instruction,
            key,
            state: StepState::Pending,
            script: Some(script),
            root: self.state.user == ImageUser::Root,
            env: self.state.env.clone(),
            workdir: self.state.workdir.clone(),
            seconds: None,
            copy: None,
            on: self.on.take(),
            from_layer: None,
        });
    }

    /// A `COPY --from` step: `script` copies out of layer `layer`, mounted
    /// at [`from_mount`]`(layer)`, which the script names (so the key
    /// covers the layer, and through its key all that made it).
    pub(crate) fn push_from(&mut self, instruction: String, script: String, layer: &str) {
        self.push(instruction, script);
        if let Some(s) = self.steps.last_mut() {
            s.from_layer = Some(layer.to_string());
        }
    }

    /// A step that runs `script` after the build has placed `plan`'s
    /// context files in the machine (as a tar cut into pieces in
    /// `plan.dir`). The script names the plan's digest, so the key covers
    /// the content of every file it places.
    pub(crate) fn push_copy(&mut self, instruction: String, script: String, plan: CopyPlan) {
        self.push(instruction, script);
        if let Some(s) = self.steps.last_mut() {
            s.copy = Some(plan);
        }
    }

    /// A step that writes `data` to `path` with `mode` (or 0644), owned by
    /// `owner` (uid, gid): COPY of an inline file or a heredoc with
    /// `--chown` or `--chmod`.
    pub(crate) fn file_owned(
        &mut self,
        path: &str,
        data: &[u8],
        mode: Option<u32>,
        owner: (u32, u32),
    ) {
        let b64 = base64::engine::general_purpose::STANDARD.encode(data);
        let dir = match path.rfind('/') {
            Some(0) | None => "/",
            Some(i) => &path[..i],
        };
        let script = format!(
            "mkdir -p {d} && printf '%s' {b} | base64 -d > {p} && chmod {m:o} {p} && chown {u}:{g} {p}",
            d = sh_quote(dir),
            b = sh_quote(&b64),
            p = sh_quote(path),
            m = mode.unwrap_or(0o644),
            u = owner.0,
            g = owner.1,
        );
        let instruction = format!(
            "COPY {path} ({} bytes, sha256 {})",
            data.len(),
            &sha256_hex(data)[..12]
        );
        self.as_root(|s| s.push(instruction, script));
    }

    /// A step that writes `data` to `path` (its directory made, `mode` or
    /// 0644): root writes it, then gives it to the build's user.
    pub(crate) fn file(&mut self, path: &str, data: &[u8], mode: Option<u32>) {
        let b64 = base64::engine::general_purpose::STANDARD.encode(data);
        let owner = self.state.user.owner();
        let dir = match path.rfind('/') {
            Some(0) | None => "/",
            Some(i) => &path[..i],
        };
        let script = format!(
            "mkdir -p {d} && printf '%s' {b} | base64 -d > {p} && chmod {m:o} {p} && chown {owner} {p}",
            d = sh_quote(dir),
            b = sh_quote(&b64),
            p = sh_quote(path),
            m = mode.unwrap_or(0o644),
        );
        let instruction = format!(
            "COPY {path} ({} bytes, sha256 {})",
            data.len(),
            &sha256_hex(data)[..12]
        );
        self.as_root(|s| s.push(instruction, script));
    }

    /// A step that makes `dir` (owned by the build's user), which later
    /// steps then run in.
    pub(crate) fn workdir(&mut self, dir: &str) {
        let owner = self.state.user.owner();
        self.as_root(|s| {
            s.push(
                format!("WORKDIR {dir}"),
                format!("mkdir -p {d} && chown {owner} {d}", d = sh_quote(dir)),
            )
        });
        self.state.workdir = Some(dir.to_string());
    }

    /// Runs `f` with the build's user set to root, then sets it back.
    pub(crate) fn as_root<R>(&mut self, f: impl FnOnce(&mut Self) -> R) -> R {
        let user = std::mem::replace(&mut self.state.user, ImageUser::Root);
        let r = f(self);
        self.state.user = user;
        r
    }
}

/// One thing a COPY places from the build context: the context file
/// `src` (its `sha256`) at `dst` (relative to `/`), or a directory.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct CopyEntry {
    pub(crate) src: String,
    pub(crate) sha256: String,
    pub(crate) dst: String,
    pub(crate) mode: u32,
    pub(crate) uid: u32,
    pub(crate) gid: u32,
    pub(crate) dir: bool,
}

/// What the build places before a COPY step's script runs: a tar of
/// `entries` written into the machine in pieces, `dir/part-000000`, ….
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct CopyPlan {
    pub(crate) dir: String,
    pub(crate) entries: Vec<CopyEntry>,
}

/// Where a `COPY --from` step finds its source layer's files in the
/// build machine (on `/run`, a tmpfs: no layer keeps the mount point).
pub(crate) fn from_mount(layer: &str) -> String {
    format!("/run/runtime-from/{layer}")
}

/// The key of a step after `prev`.
pub(crate) fn step_key(prev: &str, instruction: &str, script: &str, state: &BuildState) -> String {
    let canonical = json!([
        prev,
        instruction,
        script,
        state.env,
        state.workdir,
        state.user
    ]);
    sha256_hex(canonical.to_string().as_bytes())
}

/// The key of a step whose key on the default build disk is `key`, on a
/// build disk of `mib` MiB (the default disk's keys stay as they were).
pub(crate) fn on_disk(key: &str, mib: u32) -> String {
    sha256_hex(json!(["disk", mib, key]).to_string().as_bytes())
}

/// The name a layer's disk has for the host: the key's first 32 characters.
pub(crate) fn short_key(key: &str) -> String {
    key.chars().take(SHORT_KEY).collect()
}

/// The directory a step's layer is captured into before it is complete.
pub(crate) fn partial_layer(key: &str) -> String {
    format!("{key}.partial")
}

/// `s` as one single-quoted shell word.
pub(crate) fn sh_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', "'\\''"))
}

/// A RUN, CMD or ENTRYPOINT argument as one shell command: the exec form
/// (a JSON array) quoted word by word, the shell form as it is; `None` for
/// an exec form that is not a JSON array of strings.
pub(crate) fn shell_form(rest: &str) -> Option<String> {
    if !rest.starts_with('[') {
        return Some(rest.to_string());
    }
    let parts: Vec<String> = serde_json::from_str(rest).ok()?;
    Some(
        parts
            .iter()
            .map(|p| sh_quote(p))
            .collect::<Vec<_>>()
            .join(" "),
    )
}

/// How a step's command ended, when that fails the build.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum StepEnd {
    /// The step timeout passed.
    TimedOut,
    Exited(i32),
    Killed(i32),
}

impl StepEnd {
    /// `None` for a success: exit code 0.
    pub(crate) fn of(code: Option<i32>, timed_out: bool, signal: Option<i32>) -> Option<StepEnd> {
        match (code, timed_out) {
            (Some(0), _) => None,
            (_, true) => Some(StepEnd::TimedOut),
            (Some(c), _) => Some(StepEnd::Exited(c)),
            (None, _) => Some(StepEnd::Killed(signal.unwrap_or(0))),
        }
    }
}

impl std::fmt::Display for StepEnd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StepEnd::TimedOut => write!(f, "timed out"),
            StepEnd::Exited(c) => write!(f, "exited with code {c}"),
            StepEnd::Killed(s) => write!(f, "was killed by signal {s}"),
        }
    }
}

/// The tail of a step's output, cut into whole lines: what to log as it
/// comes, and the last [`StepOutput::TAIL`] lines for a failure's message.
#[derive(Debug, Default)]
pub(crate) struct StepOutput {
    pending: String,
    tail: Vec<String>,
}

impl StepOutput {
    /// Lines of output a failed step's message carries.
    pub(crate) const TAIL: usize = 20;

    /// Longest line kept: output that runs on without a newline is cut
    /// into lines of this many bytes (at most), so nothing a step prints
    /// grows without a bound.
    pub(crate) const MAX_LINE: usize = 16 * 1024;

    /// Takes output bytes; answers the lines they complete (with their
    /// newlines), if any.
    pub(crate) fn push(&mut self, bytes: &[u8]) -> Option<String> {
        self.pending.push_str(&String::from_utf8_lossy(bytes));
        let mut done = match self.pending.rfind('\n') {
            Some(i) => self.pending.drain(..=i).collect(),
            None => String::new(),
        };
        while self.pending.len() > Self::MAX_LINE {
            let mut cut = Self::MAX_LINE;
            while !self.pending.is_char_boundary(cut) {
                cut -= 1;
            }
            done.extend(self.pending.drain(..cut));
            done.push('\n');
        }
        // A completed line may be long too.
        if done.lines().any(|l| l.len() > Self::MAX_LINE) {
            done = done
                .lines()
                .flat_map(|l| cut_line(l, Self::MAX_LINE))
                .map(|l| format!("{l}\n"))
                .collect();
        }
        if done.is_empty() {
            return None;
        }
        self.keep(&done);
        Some(done)
    }

    /// The output's end: what is left after the last newline, if any.
    pub(crate) fn finish(&mut self) -> Option<String> {
        if self.pending.is_empty() {
            return None;
        }
        let rest = std::mem::take(&mut self.pending);
        self.keep(&rest);
        Some(rest)
    }

    /// The last lines, oldest first.
    pub(crate) fn tail(&self) -> &[String] {
        &self.tail
    }

    fn keep(&mut self, text: &str) {
        self.tail.extend(text.lines().map(str::to_string));
        let n = self.tail.len().saturating_sub(Self::TAIL);
        self.tail.drain(..n);
    }
}

/// `line` in pieces of at most `max` bytes, cut at character boundaries.
fn cut_line(mut line: &str, max: usize) -> Vec<&str> {
    let mut out = Vec::new();
    while line.len() > max {
        let mut cut = max;
        while !line.is_char_boundary(cut) {
            cut -= 1;
        }
        out.push(&line[..cut]);
        line = &line[cut..];
    }
    out.push(line);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn output_without_newlines_is_cut_into_bounded_lines() {
        let mut o = StepOutput::default();
        let max = StepOutput::MAX_LINE;
        let mut logged = String::new();
        // `yes | tr -d '\n'`: a megabyte with no newline, in chunks.
        for _ in 0..64 {
            if let Some(d) = o.push(&[b'y'; 16 * 1024 + 7]) {
                logged.push_str(&d);
            }
        }
        assert!(o.pending.len() <= max, "{}", o.pending.len());
        logged.push_str(&o.finish().unwrap_or_default());
        assert_eq!(
            logged.bytes().filter(|b| *b == b'y').count(),
            64 * (16 * 1024 + 7)
        );
        assert!(logged.lines().all(|l| l.len() <= max));
        assert!(o.tail().iter().all(|l| l.len() <= max));
        // One long line that comes whole with its newline is cut as well.
        let mut o = StepOutput::default();
        let long = format!("{}\n", "é".repeat(max));
        let d = o.push(long.as_bytes()).unwrap();
        assert!(
            d.lines().all(|l| l.len() <= max) && d.lines().count() == 2,
            "{}",
            d.len()
        );
        assert_eq!(d.replace('\n', ""), long.trim_end());
        // Short lines are as they were.
        let mut o = StepOutput::default();
        assert_eq!(o.push(b"a\nb"), Some("a\n".into()));
        assert_eq!(o.finish(), Some("b".into()));
    }

    fn state(user: ImageUser) -> BuildState {
        BuildState {
            env: Vec::new(),
            workdir: None,
            user,
        }
    }

    #[test]
    fn keys_hash_a_canonical_json_pinned_to_its_format() {
        // Changing this format orphans every layer a server has kept.
        assert_eq!(
            step_key("base-abc", "RUN true", "true", &state(ImageUser::Root)),
            sha256_hex(br#"["base-abc","RUN true","true",[],null,"root"]"#)
        );
        let mut st = state(ImageUser::User);
        st.set_env("A", "1");
        st.workdir = Some("/w".into());
        assert_eq!(
            step_key("p", "RUN true", "true", &st),
            sha256_hex(br#"["p","RUN true","true",[["A","1"]],"/w","user"]"#)
        );
        // A step's key chains from the one before it.
        let mut s = Steps::new("base-abc", st.clone());
        let mut big = Steps::new("base-abc", st.clone());
        big.disk = Some(5120);
        big.push("RUN a".into(), "a".into());
        big.push("RUN b".into(), "b".into());
        assert_eq!(
            big.steps[0].key,
            on_disk(&step_key("base-abc", "RUN a", "a", &st), 5120)
        );
        assert_eq!(
            big.steps[1].key,
            on_disk(&step_key(&big.steps[0].key, "RUN b", "b", &st), 5120)
        );
        assert_eq!(on_disk("k", 5120), sha256_hex(br#"["disk",5120,"k"]"#));
        s.push("RUN a".into(), "a".into());
        s.push("RUN b".into(), "b".into());
        assert_eq!(s.steps[0].key, step_key("base-abc", "RUN a", "a", &st));
        assert_eq!(s.steps[1].key, step_key(&s.steps[0].key, "RUN b", "b", &st));
    }

    #[test]
    fn a_change_to_a_step_changes_its_key_and_every_later_one_only() {
        let build = |second: &str| {
            let mut s = Steps::new("base", state(ImageUser::User));
            s.push("RUN a".into(), "a".into());
            s.push(format!("RUN {second}"), second.into());
            s.push("RUN c".into(), "c".into());
            s.steps.iter().map(|s| s.key.clone()).collect::<Vec<_>>()
        };
        let one = build("b");
        let two = build("B");
        assert_eq!(one[0], two[0]);
        assert_ne!(one[1], two[1]);
        assert_ne!(one[2], two[2]);
        assert_eq!(one, build("b"));
        // The base's key starts the chain; the state a step runs in is part of it.
        let mut other_base = Steps::new("base2", state(ImageUser::User));
        other_base.push("RUN a".into(), "a".into());
        assert_ne!(other_base.steps[0].key, one[0]);
        let mut as_root = Steps::new("base", state(ImageUser::Root));
        as_root.push("RUN a".into(), "a".into());
        assert_ne!(as_root.steps[0].key, one[0]);
        let mut with_env = Steps::new("base", state(ImageUser::User));
        with_env.state.set_env("X", "1");
        with_env.push("RUN a".into(), "a".into());
        assert_ne!(with_env.steps[0].key, one[0]);
    }

    #[test]
    fn steps_record_their_index_state_and_user() {
        let mut s = Steps::new("base", state(ImageUser::User));
        s.state.set_env("A", "1");
        s.push("RUN a".into(), "a".into());
        s.workdir("/w");
        s.file("/w/f", b"hi", None);
        let st = &s.steps;
        assert_eq!(st.iter().map(|s| s.index).collect::<Vec<_>>(), [0, 1, 2]);
        assert!(st
            .iter()
            .all(|s| s.state == StepState::Pending && s.seconds.is_none()));
        // The command runs as the user; the directory and the file are
        // made by root and given to the user.
        assert_eq!(
            st.iter().map(|s| s.root).collect::<Vec<_>>(),
            [false, true, true]
        );
        assert_eq!(s.state.user, ImageUser::User);
        assert_eq!(st[1].instruction, "WORKDIR /w");
        assert_eq!(
            st[1].script.as_deref(),
            Some("mkdir -p '/w' && chown 1000:1000 '/w'")
        );
        assert_eq!(st[1].workdir, None);
        assert_eq!(st[2].workdir.as_deref(), Some("/w"));
        assert_eq!(
            st[2].instruction,
            "COPY /w/f (2 bytes, sha256 8f434346648f)"
        );
        assert_eq!(
            st[2].script.as_deref(),
            Some("mkdir -p '/w' && printf '%s' 'aGk=' | base64 -d > '/w/f' && chmod 644 '/w/f' && chown 1000:1000 '/w/f'")
        );
        assert!(st
            .iter()
            .all(|s| s.env == [("A".to_string(), "1".to_string())]));
        // As root, what is written stays root's; a file at the top goes in /.
        let mut s = Steps::new("base", state(ImageUser::Root));
        s.file("/f", b"", Some(0o755));
        s.workdir("/r");
        assert_eq!(
            s.steps[0].script.as_deref(),
            Some("mkdir -p '/' && printf '%s' '' | base64 -d > '/f' && chmod 755 '/f' && chown 0:0 '/f'")
        );
        assert_eq!(
            s.steps[1].script.as_deref(),
            Some("mkdir -p '/r' && chown 0:0 '/r'")
        );
    }

    #[test]
    fn later_variables_replace_earlier_ones_at_the_end() {
        let mut st = state(ImageUser::User);
        st.set_env("A", "1");
        st.set_env("B", "2");
        st.set_env("A", "3");
        assert_eq!(
            st.env,
            [
                ("B".to_string(), "2".to_string()),
                ("A".to_string(), "3".to_string())
            ]
        );
    }

    #[test]
    fn shell_words_and_exec_forms() {
        assert_eq!(sh_quote("it's"), r"'it'\''s'");
        assert_eq!(
            shell_form("echo hi && true").as_deref(),
            Some("echo hi && true")
        );
        assert_eq!(
            shell_form(r#"["python3", "a b.py"]"#).as_deref(),
            Some("'python3' 'a b.py'")
        );
        assert_eq!(shell_form(r#"["a", 1]"#), None);
        assert_eq!(shell_form("[ -f x ]"), None);
        assert_eq!(short_key(&"a".repeat(64)), "a".repeat(32));
        assert_eq!(short_key("abc"), "abc");
        assert_eq!(partial_layer("k"), "k.partial");
    }

    #[test]
    fn a_step_fails_unless_it_exits_with_zero() {
        assert_eq!(StepEnd::of(Some(0), false, None), None);
        // Exit code 0 wins, even past the timeout.
        assert_eq!(StepEnd::of(Some(0), true, None), None);
        let end = |c, t, s| StepEnd::of(c, t, s).map(|e| e.to_string());
        assert_eq!(
            end(Some(3), false, None).as_deref(),
            Some("exited with code 3")
        );
        assert_eq!(end(None, true, Some(9)).as_deref(), Some("timed out"));
        assert_eq!(end(Some(1), true, None).as_deref(), Some("timed out"));
        assert_eq!(
            end(None, false, Some(9)).as_deref(),
            Some("was killed by signal 9")
        );
        assert_eq!(
            end(None, false, None).as_deref(),
            Some("was killed by signal 0")
        );
    }

    #[test]
    fn step_output_logs_whole_lines_and_keeps_the_last_twenty() {
        let mut o = StepOutput::default();
        assert_eq!(o.push(b"par"), None);
        assert_eq!(o.push(b"tial\nnext").as_deref(), Some("partial\n"));
        assert_eq!(
            o.push(b" line\nmore\nand").as_deref(),
            Some("next line\nmore\n")
        );
        assert_eq!(o.finish().as_deref(), Some("and"));
        assert_eq!(o.finish(), None);
        assert_eq!(o.tail(), ["partial", "next line", "more", "and"]);
        let mut o = StepOutput::default();
        for i in 0..30 {
            o.push(format!("{i}\n").as_bytes());
        }
        assert_eq!(o.tail().len(), StepOutput::TAIL);
        assert_eq!(o.tail()[0], "10");
        assert_eq!(o.tail()[19], "29");
        // Invalid UTF-8 is replaced, not refused.
        let mut o = StepOutput::default();
        assert_eq!(o.push(b"\xff\n").as_deref(), Some("\u{fffd}\n"));
    }
}
