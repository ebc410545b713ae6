//! The Dockerfiles this server builds (docs/images.md "Dockerfiles"):
//! `FROM` (with `AS name`, one of several stages, `ARG`s before it),
//! `RUN` (shell, JSON and heredoc forms; `--mount=type=cache` runs without
//! the cache), `COPY`/`ADD` from the build context, from inline files or
//! from a heredoc (`--chown`, `--chmod`; `ADD` of a local tar archive
//! unpacks it, `ADD` of a URL downloads it in the build machine), `ENV`,
//! `WORKDIR`, `USER`, `ARG` (with `buildArgs`, and the platform's
//! `TARGETARCH` and friends), `SHELL`, and `CMD`/`ENTRYPOINT` read as the
//! image's `start`; a few others are accepted and ignored, and the forms
//! this server cannot honour are refused with what to do instead.
//!
//! Multi-stage: the build makes the target stage (`target`, or the last)
//! and every stage it needs (the one it is built `FROM`, those its `COPY
//! --from` names, and theirs), in the Dockerfile's order, as one list of
//! steps in which a stage's first step names the layer it runs on
//! (`Step::on`) and a `COPY --from` the layer it copies out of
//! (`Step::from_layer`); stages nothing needs are not read.

use serde_json::{json, Value};

use super::context::{glob_match, is_glob, Manifest};
use super::steps::{from_mount, sh_quote, shell_form, BuildState, CopyEntry, CopyPlan, Steps};
use super::{valid_abs, ImageError, ImageUser, InlineFile};
use crate::domain::access::sha256_hex;

/// What is wrong with one instruction.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum Problem {
    #[error("the first instruction must be FROM")]
    FirstNotFrom,
    #[error("expected KEY=VALUE")]
    ExpectedKeyEqualsValue,
    #[error("expected KEY VALUE")]
    ExpectedKeyValue,
    #[error("a quote is not closed")]
    UnclosedQuote,
    #[error("must be a path without ..")]
    WorkdirNotNormal,
    #[error("user {0}: only root and runtime (uid 1000) exist")]
    UnknownUser(String),
    #[error("bad JSON form")]
    BadJsonForm,
    #[error("expected COPY <src>... <dest>")]
    CopyArguments,
    #[error("{0} is not among the build's files")]
    NotAmongFiles(String),
    #[error("{0}: no such file or directory in the build context")]
    NotInContext(String),
    #[error("{0} points outside the build context")]
    OutsideContext(String),
    #[error("the destination must be a path without ..")]
    DestinationNotNormal,
    #[error("several sources need a destination directory ending in /")]
    DestinationNotADirectory,
    #[error("not a supported instruction")]
    Unsupported,
    #[error("ONBUILD is not supported: put those instructions in the Dockerfile that builds FROM this image")]
    Onbuild,
    #[error("RUN --mount=type={0} is not supported: {hint}", hint = mount_hint(.0))]
    Mount(String),
    #[error("ADD of a git repository is not supported: RUN git clone … instead (git is in the base image)")]
    GitAdd,
    #[error("COPY --exclude is not supported: leave the files out with .dockerignore, or remove them with a RUN")]
    Exclude,
    #[error("COPY --from={0}: names this stage or a later one")]
    CopyFromLater(String),
    #[error("COPY --from={name}: no stage is named {name} (the stages: {stages}); to copy from an image, name it with its tag or registry ({name}:latest)")]
    UnknownStage { name: String, stages: String },
    #[error("{0} points outside the stage's file system")]
    OutsideStage(String),
    #[error("{0}: COPY --from copies paths of the stage or image, not a URL or heredoc")]
    CopyFromSource(String),
    #[error("unknown option {0}")]
    UnknownOption(String),
    #[error("--chmod={0}: expected octal digits such as 0755")]
    BadChmod(String),
    #[error("--chown={0}: only root (0) and runtime (1000) exist")]
    BadChown(String),
    #[error("--checksum={0}: expected sha256:<64 hex digits>")]
    BadChecksum(String),
    #[error("--checksum is only for ADD of a URL")]
    ChecksumNotUrl,
    #[error("heredoc <<{0} has no closing {0} line")]
    UnclosedHeredoc(String),
    #[error("FROM {0}: names this stage or a later one")]
    FromLaterStage(String),
    #[error("a stage named {0} is already there")]
    StageTwice(String),
    #[error("expected FROM <image> [AS <name>]")]
    FromArguments,
}

fn mount_hint(kind: &str) -> &'static str {
    match kind {
        "secret" => "pass the value as a build argument (kept in the image's steps) or give it to sandboxes at create",
        "ssh" => "fetch over https (with a token in a build argument) instead",
        _ => "COPY the files in first",
    }
}

/// What a Dockerfile says besides its steps.
#[derive(Debug, Clone, PartialEq, Default)]
pub(crate) struct Parsed {
    /// The image the built chain starts `FROM`; `None` for the server's own.
    pub(crate) base: Option<String>,
    /// The last `CMD` or `ENTRYPOINT` of the chain, as `{"command": …}`.
    pub(crate) start: Option<Value>,
    /// The other images the build needs: the bases of the stages it builds
    /// besides the target's chain, and the images `COPY --from` names.
    pub(crate) externals: Vec<ExternalRef>,
}

/// An image a Dockerfile names outside the target's chain.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ExternalRef {
    /// As written (args substituted).
    pub(crate) reference: String,
    /// The line of the first instruction that names it.
    pub(crate) line: usize,
    /// `FROM` or `COPY`.
    pub(crate) op: String,
    /// Named by `COPY --from=` (not a stage's `FROM`).
    pub(crate) copy: bool,
}

impl ExternalRef {
    /// The error of a `COPY --from` that names neither a stage nor an image
    /// (`stages`: the Dockerfile's stage names).
    pub(crate) fn unknown_stage(&self, stages: &[String]) -> ImageError {
        ImageError::Instruction {
            line: self.line,
            op: self.op.clone(),
            problem: Problem::UnknownStage {
                name: self.reference.clone(),
                stages: if stages.is_empty() {
                    "none has a name".into()
                } else {
                    stages.join(", ")
                },
            },
        }
    }
}

/// Where an image a Dockerfile names outside the target's chain starts:
/// its layer's key and the build state a stage on it starts in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct External {
    pub(crate) key: String,
    pub(crate) state: BuildState,
}

/// The key an external image has before it is pulled (the dry read).
pub(crate) fn pending_key(reference: &str) -> String {
    format!("pending-{}", sha256_hex(reference.as_bytes()))
}

/// What COPY and ADD may read, and what the build is asked for.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Inputs<'a> {
    /// Files given inline (`files`).
    pub(crate) files: &'a [InlineFile],
    /// The uploaded build context, if any.
    pub(crate) context: Option<&'a Manifest>,
    /// `buildArgs`.
    pub(crate) args: &'a [(String, String)],
    /// The stage to build (`target`); the last when `None`.
    pub(crate) target: Option<&'a str>,
    /// The images the Dockerfile names outside the target's chain, as
    /// resolved (by the reference as written); one not there is read as
    /// not yet pulled ([`pending_key`], the state of a bare image).
    pub(crate) externals: Option<&'a std::collections::BTreeMap<String, External>>,
}

/// The arguments every build has, as on a linux/amd64 builder.
const PLATFORM_ARGS: &[(&str, &str)] = &[
    ("TARGETPLATFORM", "linux/amd64"),
    ("TARGETOS", "linux"),
    ("TARGETARCH", "amd64"),
    ("TARGETVARIANT", ""),
    ("BUILDPLATFORM", "linux/amd64"),
    ("BUILDOS", "linux"),
    ("BUILDARCH", "amd64"),
    ("BUILDVARIANT", ""),
];

/// The most entries all of a build's COPY steps may place.
pub(crate) const MAX_COPY_ENTRIES: usize = 100_000;

/// One heredoc of an instruction.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Heredoc {
    /// The word after `<<` (unquoted).
    name: String,
    /// `<<-`: leading tabs are stripped.
    strip_tabs: bool,
    /// The body's lines as written, each with its newline.
    raw: String,
}

impl Heredoc {
    /// The body as its reader sees it.
    fn body(&self) -> String {
        if self.strip_tabs {
            self.raw
                .split_inclusive('\n')
                .map(|l| l.trim_start_matches('\t'))
                .collect()
        } else {
            self.raw.clone()
        }
    }
}

/// One instruction: where it starts, its word and the rest.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Instr {
    line: usize,
    op: String,
    rest: String,
    heredocs: Vec<Heredoc>,
}

struct Stage {
    name: Option<String>,
    /// The FROM line's instruction (for its errors).
    from: Instr,
    /// What it is built FROM, args substituted.
    base: String,
    instrs: Vec<Instr>,
}

/// The `--from=` of a COPY (args before the first FROM substituted).
fn copy_from(ins: &Instr, global: &[(String, String)]) -> Option<String> {
    if ins.op != "COPY" && ins.op != "ADD" {
        return None;
    }
    let (opts, _) = options(&substitute(&ins.rest, global, &[]));
    opts.into_iter().find(|(k, _)| k == "from").map(|(_, v)| v)
}

/// Reads `text` into `b`'s steps.
pub(crate) fn parse(b: &mut Steps, text: &str, inputs: Inputs<'_>) -> Result<Parsed, ImageError> {
    let instrs = instructions(text)?;
    // ARGs before the first FROM: usable in FROM, and re-declared in a stage.
    let mut global: Vec<(String, String)> = PLATFORM_ARGS
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    let mut stages: Vec<Stage> = Vec::new();
    for ins in instrs {
        let at = |problem: Problem| err_at(&ins, problem);
        if ins.op == "FROM" {
            let words: Vec<String> = substitute(&ins.rest, &global, &[])
                .split_whitespace()
                .filter(|w| !w.starts_with("--platform"))
                .map(str::to_string)
                .collect();
            let (base, name) = match words.as_slice() {
                [b] => (b.clone(), None),
                [b, as_, n] if as_.eq_ignore_ascii_case("as") => {
                    (b.clone(), Some(n.to_ascii_lowercase()))
                }
                _ => return Err(at(Problem::FromArguments)),
            };
            if let Some(n) = &name {
                if stages.iter().any(|s| s.name.as_ref() == Some(n)) {
                    return Err(at(Problem::StageTwice(n.clone())));
                }
            }
            stages.push(Stage {
                name,
                from: ins.clone(),
                base,
                instrs: Vec::new(),
            });
            continue;
        }
        match stages.last_mut() {
            Some(s) => s.instrs.push(ins),
            None if ins.op == "ARG" => {
                for (k, v) in arg_decls(&ins.rest, &global, inputs.args) {
                    set(&mut global, &k, &v);
                }
            }
            None => return Err(at(Problem::FirstNotFrom)),
        }
    }
    if stages.is_empty() {
        return Err(ImageError::NoFrom);
    }
    // The target, and every stage it needs: the one it is built FROM and
    // those its COPY --from name, and theirs (each an earlier stage).
    let target = match inputs.target {
        Some(t) => stages
            .iter()
            .position(|s| s.name.as_deref() == Some(t.to_ascii_lowercase().as_str()))
            .ok_or_else(|| ImageError::NoSuchTarget(t.to_string()))?,
        None => stages.len() - 1,
    };
    let mut needed = vec![false; stages.len()];
    let mut todo = vec![target];
    while let Some(i) = todo.pop() {
        if std::mem::replace(&mut needed[i], true) {
            continue;
        }
        let s = &stages[i];
        match stage_index(&stages, &s.base) {
            Some(j) if j >= i => {
                return Err(err_at(&s.from, Problem::FromLaterStage(s.base.clone())));
            }
            Some(j) => todo.push(j),
            None => {}
        }
        for ins in &s.instrs {
            if let Some(from) = copy_from(ins, &global) {
                match stage_index(&stages, &from) {
                    Some(j) if j >= i => return Err(err_at(ins, Problem::CopyFromLater(from))),
                    Some(j) => todo.push(j),
                    None => {}
                }
            }
        }
    }
    // The target's chain: it and the stages it is built FROM, back to an image.
    let mut in_chain = vec![false; stages.len()];
    let mut root = target;
    loop {
        in_chain[root] = true;
        match stage_index(&stages, &stages[root].base) {
            Some(j) => root = j,
            None => break,
        }
    }
    let mut out = Parsed {
        base: (!is_ours(&stages[root].base)).then(|| stages[root].base.clone()),
        start: None,
        externals: Vec::new(),
    };
    fn external(reference: &str, ins: &Instr, copy: bool, out: &mut Parsed) {
        if !out.externals.iter().any(|e| e.reference == reference) {
            out.externals.push(ExternalRef {
                reference: reference.to_string(),
                line: ins.line,
                op: ins.op.clone(),
                copy,
            });
        }
    }
    let resolve = |reference: &str| -> External {
        inputs
            .externals
            .and_then(|m| m.get(reference))
            .cloned()
            .unwrap_or_else(|| External {
                key: pending_key(reference),
                state: BuildState {
                    env: Vec::new(),
                    workdir: None,
                    user: ImageUser::Root,
                },
            })
    };
    let initial = StageEnd {
        key: b.prev().to_string(),
        state: b.state.clone(),
        shell: None,
    };
    // Where each built stage ended (each a stage needs is built before it).
    let mut ends: Vec<Option<StageEnd>> = vec![None; stages.len()];
    let mut copies = 0usize;
    // Stages in order: each after those it needs, the target last.
    for i in (0..stages.len()).filter(|i| needed[*i]) {
        let s = &stages[i];
        let StageEnd { key, state, shell } = match stage_index(&stages, &s.base) {
            Some(j) => ends[j].clone().unwrap_or_else(|| initial.clone()),
            None if i == root => initial.clone(),
            None => {
                external(&s.base, &s.from, false, &mut out);
                let e = resolve(&s.base);
                StageEnd {
                    key: e.key,
                    state: e.state,
                    shell: None,
                }
            }
        };
        if i == root && b.steps.is_empty() {
            b.state = state;
        } else {
            b.restart(&key, state);
        }
        let mut shell = shell;
        // Global ARGs stay visible in each stage (as this server always
        // had them); the platform's only where a stage declares them.
        let mut argv: Vec<(String, String)> = global
            .iter()
            .filter(|(k, _)| !PLATFORM_ARGS.iter().any(|(p, _)| p == k))
            .cloned()
            .collect();
        // Only the target's chain gives the image its start command.
        let mut start = None;
        for ins in &s.instrs {
            let from = copy_from(ins, &global).map(|f| match stage_index(&stages, &f) {
                Some(j) => {
                    let key = ends[j].as_ref().unwrap_or(&initial).key.clone();
                    (f, key)
                }
                None => {
                    external(&f, ins, true, &mut out);
                    let key = resolve(&f).key;
                    (f, key)
                }
            });
            let mut ctx = Ctx {
                inputs,
                global: &global,
                argv: &mut argv,
                shell: &mut shell,
                start: &mut start,
                copies: &mut copies,
                from,
            };
            instruction(b, ins, &mut ctx)?;
        }
        if in_chain[i] && start.is_some() {
            out.start = start;
        }
        ends[i] = Some(StageEnd {
            key: b.prev().to_string(),
            state: b.state.clone(),
            shell,
        });
    }
    Ok(out)
}

/// The server's own image, as FROM or `--from` names it.
pub(crate) fn is_ours(r: &str) -> bool {
    matches!(
        r,
        "runtime" | "default" | "runtime:latest" | "default:latest"
    )
}

/// Where a built stage ended: its last key, its state, its `SHELL`.
#[derive(Debug, Clone)]
struct StageEnd {
    key: String,
    state: BuildState,
    shell: Option<Vec<String>>,
}

/// What one instruction reads and changes besides the steps.
struct Ctx<'a, 'b> {
    inputs: Inputs<'a>,
    global: &'b [(String, String)],
    argv: &'b mut Vec<(String, String)>,
    shell: &'b mut Option<Vec<String>>,
    start: &'b mut Option<Value>,
    copies: &'b mut usize,
    /// A COPY's `--from`: as written, and the key of the layer it names.
    from: Option<(String, String)>,
}

/// The names of a Dockerfile's stages (`FROM … AS name`), for an error
/// that lists them; none for a text that does not read.
pub(crate) fn stage_names(text: &str) -> Vec<String> {
    instructions(text)
        .unwrap_or_default()
        .iter()
        .filter(|i| i.op == "FROM")
        .filter_map(|i| {
            let words: Vec<&str> = i.rest.split_whitespace().collect();
            match words.as_slice() {
                [.., as_, n] if as_.eq_ignore_ascii_case("as") => Some(n.to_ascii_lowercase()),
                _ => None,
            }
        })
        .collect()
}

/// The stage a FROM or `--from` names: its name, or its index.
fn stage_index(stages: &[Stage], r: &str) -> Option<usize> {
    let r = r.to_ascii_lowercase();
    stages
        .iter()
        .position(|s| s.name.as_deref() == Some(r.as_str()))
        .or_else(|| r.parse::<usize>().ok().filter(|i| *i < stages.len()))
}

fn err_at(ins: &Instr, problem: Problem) -> ImageError {
    ImageError::Instruction {
        line: ins.line,
        op: ins.op.clone(),
        problem,
    }
}

fn set(vars: &mut Vec<(String, String)>, k: &str, v: &str) {
    vars.retain(|(a, _)| a != k);
    vars.push((k.to_string(), v.to_string()));
}

/// The names and values an `ARG` line declares: a build arg wins, then the
/// default, then (inside a stage) the global value of the same name.
fn arg_decls(
    rest: &str,
    global: &[(String, String)],
    args: &[(String, String)],
) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for word in quoted_words(rest) {
        let (k, default) = match word.split_once('=') {
            Some((k, v)) => (k, Some(substitute(v.trim_matches('"'), global, &[]))),
            None => (word.as_str(), None),
        };
        let v = args
            .iter()
            .find(|(a, _)| a == k)
            .map(|(_, v)| v.clone())
            .or(default)
            .or_else(|| global.iter().find(|(a, _)| a == k).map(|(_, v)| v.clone()))
            .unwrap_or_default();
        out.push((k.to_string(), v));
    }
    out
}

/// `ENV`'s `K=V …` words as Docker reads them: split at spaces outside
/// quotes, the quotes taken off (`K="two words"`, `K='a b'`), `\"`, `\\`
/// and `\$` inside double quotes and a backslash before any character
/// outside quotes kept as that character. None for an unclosed quote.
fn env_words(s: &str) -> Option<Vec<String>> {
    let mut out = Vec::new();
    let mut cur: Option<String> = None;
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        match c {
            c if c.is_whitespace() => out.extend(cur.take()),
            '\\' => cur
                .get_or_insert_with(String::new)
                .push(chars.next().unwrap_or('\\')),
            '\'' => loop {
                match chars.next()? {
                    '\'' => break,
                    c => cur.get_or_insert_with(String::new).push(c),
                }
            },
            '"' => loop {
                let word = cur.get_or_insert_with(String::new);
                match chars.next()? {
                    '"' => break,
                    '\\' => match chars.next()? {
                        c @ ('"' | '\\' | '$') => word.push(c),
                        c => {
                            word.push('\\');
                            word.push(c);
                        }
                    },
                    c => word.push(c),
                }
            },
            c => cur.get_or_insert_with(String::new).push(c),
        }
    }
    out.extend(cur);
    Some(out)
}

/// Words split at spaces outside double quotes (the quotes kept).
fn quoted_words(s: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut quoted = false;
    for c in s.chars() {
        if c == '"' {
            quoted = !quoted;
        }
        if c.is_whitespace() && !quoted {
            if !cur.is_empty() {
                out.push(std::mem::take(&mut cur));
            }
        } else {
            cur.push(c);
        }
    }
    if !cur.is_empty() {
        out.push(cur);
    }
    out
}

/// Leading `--name[=value]` options of an instruction, and what follows.
fn options(rest: &str) -> (Vec<(String, String)>, String) {
    let mut opts = Vec::new();
    let mut rest = rest.trim_start();
    while let Some(o) = rest.strip_prefix("--") {
        let end = o.find(char::is_whitespace).unwrap_or(o.len());
        let word = &o[..end];
        let (k, v) = word.split_once('=').unwrap_or((word, ""));
        opts.push((k.to_ascii_lowercase(), v.to_string()));
        rest = o[end..].trim_start();
    }
    (opts, rest.to_string())
}

fn instruction(b: &mut Steps, ins: &Instr, ctx: &mut Ctx<'_, '_>) -> Result<(), ImageError> {
    let inputs = ctx.inputs;
    let global = ctx.global;
    let at = |problem: Problem| err_at(ins, problem);
    let rest = ins.rest.as_str();
    match ins.op.as_str() {
        "ARG" => {
            for (k, v) in arg_decls(rest, global, inputs.args) {
                set(ctx.argv, &k, &v);
            }
        }
        "ENV" => {
            let rest = substitute(rest, ctx.argv, &b.state.env);
            if rest.contains('=') {
                for pair in env_words(&rest).ok_or_else(|| at(Problem::UnclosedQuote))? {
                    let (k, v) = pair
                        .split_once('=')
                        .ok_or_else(|| at(Problem::ExpectedKeyEqualsValue))?;
                    b.state.set_env(k, v);
                }
            } else {
                let (k, v) = rest
                    .split_once(char::is_whitespace)
                    .ok_or_else(|| at(Problem::ExpectedKeyValue))?;
                b.state.set_env(k, v.trim().trim_matches('"'));
            }
        }
        "WORKDIR" => {
            let w = substitute(rest, ctx.argv, &b.state.env);
            let w = absolute(&w, b.state.workdir.as_deref());
            if !valid_abs(&w) {
                return Err(at(Problem::WorkdirNotNormal));
            }
            b.workdir(&w);
        }
        "USER" => {
            let u = substitute(rest, ctx.argv, &b.state.env);
            b.state.user = match u.as_str() {
                "root" | "0" | "0:0" => ImageUser::Root,
                // The sandbox user is `runtime` in the image (it was
                // `user` on the older base; both names mean uid 1000).
                "runtime" | "runtime:runtime" | "user" | "1000" | "1000:1000" | "sandbox" => {
                    ImageUser::User
                }
                other => return Err(at(Problem::UnknownUser(other.to_string()))),
            };
        }
        "RUN" => {
            let (opts, cmd) = options(rest);
            for (k, v) in &opts {
                match k.as_str() {
                    "mount" => {
                        let kind = v
                            .split(',')
                            .find_map(|p| p.strip_prefix("type="))
                            .unwrap_or("bind");
                        if kind != "cache" && kind != "tmpfs" {
                            return Err(at(Problem::Mount(kind.to_string())));
                        }
                    }
                    "network" | "security" => {}
                    _ => return Err(at(Problem::UnknownOption(format!("--{k}")))),
                }
            }
            let cmd = run_command(&cmd, &ins.heredocs, ctx.shell.as_deref())
                .ok_or_else(|| at(Problem::BadJsonForm))?;
            // ARG values are in the step's environment, as in Docker.
            let prefix: String = ctx
                .argv
                .iter()
                .map(|(k, v)| format!("{k}={} ", sh_quote(v)))
                .collect();
            let script = if prefix.is_empty() {
                cmd.clone()
            } else {
                format!("export {prefix}; {cmd}")
            };
            let shown = match ins.heredocs.first() {
                Some(_) => format!("RUN {}", rest.trim()),
                None => format!("RUN {cmd}"),
            };
            b.push(shown, script);
        }
        "COPY" | "ADD" => match ctx.from.clone() {
            Some((name, layer)) => copy_from_layer(b, ins, ctx.argv, &name, &layer)?,
            None => copy(b, ins, inputs, ctx.argv, ctx.copies)?,
        },
        "SHELL" => {
            let words: Vec<String> =
                serde_json::from_str(rest).map_err(|_| at(Problem::BadJsonForm))?;
            if words.is_empty() {
                return Err(at(Problem::BadJsonForm));
            }
            *ctx.shell = Some(words);
        }
        "CMD" | "ENTRYPOINT" => {
            let cmd = shell_form(rest).ok_or_else(|| at(Problem::BadJsonForm))?;
            *ctx.start = Some(json!({ "command": cmd }));
        }
        "ONBUILD" => return Err(at(Problem::Onbuild)),
        "LABEL" | "EXPOSE" | "MAINTAINER" | "STOPSIGNAL" | "HEALTHCHECK" | "VOLUME" => {}
        _ => return Err(at(Problem::Unsupported)),
    }
    Ok(())
}

/// `p` made absolute against the working directory.
fn absolute(p: &str, workdir: Option<&str>) -> String {
    if p.starts_with('/') {
        p.to_string()
    } else {
        format!("{}/{p}", workdir.unwrap_or("").trim_end_matches('/'))
    }
}

/// The shell command a RUN runs: its exec form quoted, its shell form as
/// it is (through `SHELL` when one is set), with its heredocs; a bare
/// `RUN <<EOF` runs the heredoc as a script (by its own `#!` when it has
/// one).
fn run_command(cmd: &str, heredocs: &[Heredoc], shell: Option<&[String]>) -> Option<String> {
    if cmd.starts_with('[') {
        return shell_form(cmd);
    }
    let through_shell = |c: &str| match shell {
        Some(words) => format!(
            "{} {}",
            words
                .iter()
                .map(|w| sh_quote(w))
                .collect::<Vec<_>>()
                .join(" "),
            sh_quote(c)
        ),
        None => c.to_string(),
    };
    let bare = heredocs.len() == 1 && {
        let t = cmd.trim();
        t.starts_with("<<") && !t.contains(char::is_whitespace)
    };
    if bare {
        let body = heredocs[0].body();
        if body.starts_with("#!") {
            let b64 = base64::Engine::encode(&base64::engine::general_purpose::STANDARD, &body);
            return Some(format!(
                "f=$(mktemp) && printf '%s' {} | base64 -d > \"$f\" && chmod 700 \"$f\" && \"$f\"; s=$?; rm -f \"$f\"; exit $s",
                sh_quote(&b64)
            ));
        }
        return Some(match shell {
            Some(_) => through_shell(&body),
            None => format!("bash -c {}", sh_quote(&body)),
        });
    }
    let mut full = cmd.to_string();
    for h in heredocs {
        full.push('\n');
        full.push_str(&h.raw);
        full.push_str(&h.name);
    }
    Some(through_shell(&full))
}

/// Owner words `--chown` takes: only the guest's two users.
fn owner_id(w: &str) -> Option<u32> {
    match w {
        "root" | "0" => Some(0),
        "runtime" | "user" | "sandbox" | "1000" => Some(1000),
        _ => None,
    }
}

fn parse_chown(v: &str) -> Option<(u32, u32)> {
    let (u, g) = v.split_once(':').unwrap_or((v, v));
    Some((owner_id(u)?, owner_id(g)?))
}

/// A git repository as `ADD` would clone it.
fn is_git(src: &str) -> bool {
    src.starts_with("git@")
        || src.starts_with("git://")
        || ((src.starts_with("https://") || src.starts_with("http://"))
            && (src.split('#').next().unwrap_or("").ends_with(".git")))
}

/// `.tar`, `.tar.gz`, `.tgz`, `.tar.bz2`, `.tar.xz`: what `ADD` unpacks.
fn is_tar(name: &str) -> bool {
    [
        ".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tbz2", ".tar.xz", ".txz",
    ]
    .iter()
    .any(|e| name.ends_with(e))
}

/// The `tar` option that decompresses an archive [`is_tar`] takes, from its
/// name: GNU tar guesses from the file, busybox's (Alpine, Debian's, the one
/// supplied to an image without a shell) must be told.
fn tar_decompress(name: &str) -> &'static str {
    let ends = |exts: &[&str]| exts.iter().any(|e| name.ends_with(e));
    if ends(&[".tar.gz", ".tgz"]) {
        " -z"
    } else if ends(&[".tar.bz2", ".tbz2"]) {
        " -j"
    } else if ends(&[".tar.xz", ".txz"]) {
        " -J"
    } else {
        ""
    }
}

/// What a COPY or ADD says: its options, checked, and its words (the
/// sources, then the destination).
struct CopyArgs {
    chown: Option<(u32, u32)>,
    chmod: Option<u32>,
    /// ADD's `--checksum=sha256:<hex>`, lower-case.
    checksum: Option<String>,
    srcs: Vec<String>,
    dest: String,
}

/// Parses a COPY or ADD's options and words (at least one source, then
/// the destination); `from`: it copies out of
/// another stage or image (`--from`), where a checksum has no URL to check.
fn copy_args(
    b: &Steps,
    ins: &Instr,
    argv: &[(String, String)],
    from: bool,
) -> Result<CopyArgs, ImageError> {
    let at = |problem: Problem| err_at(ins, problem);
    let add = ins.op == "ADD";
    let (opts, rest) = options(&substitute(&ins.rest, argv, &b.state.env));
    let mut chown = None;
    let mut chmod = None;
    let mut checksum = None;
    for (k, v) in &opts {
        match k.as_str() {
            "chown" => {
                chown = Some(parse_chown(v).ok_or_else(|| at(Problem::BadChown(v.clone())))?)
            }
            "chmod" => {
                chmod = Some(
                    u32::from_str_radix(v, 8)
                        .ok()
                        .filter(|m| *m <= 0o7777 && !v.is_empty())
                        .ok_or_else(|| at(Problem::BadChmod(v.clone())))?,
                )
            }
            "exclude" => return Err(at(Problem::Exclude)),
            "checksum" if from => return Err(at(Problem::ChecksumNotUrl)),
            "checksum" if add => {
                let hex = v
                    .strip_prefix("sha256:")
                    .filter(|h| h.len() == 64 && h.bytes().all(|c| c.is_ascii_hexdigit()))
                    .ok_or_else(|| at(Problem::BadChecksum(v.clone())))?;
                checksum = Some(hex.to_ascii_lowercase());
            }
            "from" if from => {}
            "keep-git-dir" if !from => {}
            "link" => {}
            _ => return Err(at(Problem::UnknownOption(format!("--{k}")))),
        }
    }
    let mut srcs: Vec<String> = if rest.starts_with('[') {
        serde_json::from_str(&rest).map_err(|_| at(Problem::BadJsonForm))?
    } else {
        rest.split_whitespace().map(str::to_string).collect()
    };
    let dest = srcs.pop().filter(|_| !srcs.is_empty());
    let dest = dest.ok_or_else(|| at(Problem::CopyArguments))?;
    Ok(CopyArgs {
        chown,
        chmod,
        checksum,
        srcs,
        dest,
    })
}

/// COPY and ADD.
fn copy(
    b: &mut Steps,
    ins: &Instr,
    inputs: Inputs<'_>,
    argv: &[(String, String)],
    copies: &mut usize,
) -> Result<(), ImageError> {
    let at = |problem: Problem| err_at(ins, problem);
    let add = ins.op == "ADD";
    let CopyArgs {
        chown,
        chmod,
        checksum,
        srcs,
        dest,
    } = copy_args(b, ins, argv, false)?;
    let (dest, srcs) = (&dest, &srcs[..]);
    let base_dir = b.state.workdir.clone().unwrap_or_else(|| "/".into());
    // `dir/`, `.` and `dir/.` name a directory to copy into.
    let dest_is_dir = dest.ends_with('/') || dest == "." || dest.ends_with("/.");
    let dest_abs = absolute(dest, Some(&base_dir));
    if !valid_abs(&dest_abs) {
        return Err(at(Problem::DestinationNotNormal));
    }
    if checksum.is_some()
        && !srcs
            .iter()
            .all(|s| s.starts_with("http://") || s.starts_with("https://"))
    {
        return Err(at(Problem::ChecksumNotUrl));
    }
    // Heredocs: each `<<name` source is a file of that name.
    let heredoc_of = |s: &str| {
        let name = s
            .strip_prefix("<<")?
            .trim_start_matches('-')
            .trim_matches(['"', '\'']);
        ins.heredocs.iter().find(|h| h.name == name)
    };
    let into_dir = dest_is_dir || srcs.len() > 1;
    let target_for = |name: &str| {
        if into_dir {
            format!("{}/{name}", dest_abs.trim_end_matches('/'))
        } else {
            dest_abs.clone()
        }
    };
    let mut plan: Vec<CopyEntry> = Vec::new();
    // Where each archive unpacks, and its tar option.
    let mut archives: Vec<(String, &'static str)> = Vec::new();
    let owner_of = |user: ImageUser| {
        chown.unwrap_or(match user {
            ImageUser::Root => (0, 0),
            ImageUser::User => (1000, 1000),
        })
    };
    for src in srcs {
        if let Some(h) = heredoc_of(src) {
            let target = target_for(&h.name);
            if !valid_abs(&target) {
                return Err(at(Problem::DestinationNotNormal));
            }
            let owner = owner_of(b.state.user);
            b.file_owned(&target, h.body().as_bytes(), chmod, owner);
            continue;
        }
        if src.starts_with("http://")
            || src.starts_with("https://")
            || src.starts_with("git@")
            || src.starts_with("git://")
        {
            if !add || is_git(src) {
                return Err(at(if is_git(src) {
                    Problem::GitAdd
                } else {
                    Problem::NotInContext(src.clone())
                }));
            }
            let name = src
                .split(['?', '#'])
                .next()
                .unwrap_or("")
                .rsplit('/')
                .next()
                .filter(|n| !n.is_empty())
                .unwrap_or("download");
            let target = if dest_is_dir {
                format!("{}/{name}", dest_abs.trim_end_matches('/'))
            } else {
                dest_abs.clone()
            };
            if !valid_abs(&target) {
                return Err(at(Problem::DestinationNotNormal));
            }
            let (u, g) = chown.unwrap_or((0, 0));
            let mut script = format!(
                "mkdir -p {d} && curl -fsSL --retry 2 -o {t} {url}",
                d = sh_quote(parent(&target)),
                t = sh_quote(&target),
                url = sh_quote(src)
            );
            if let Some(sum) = &checksum {
                script.push_str(&format!(
                    " && echo {} | sha256sum -c - >/dev/null",
                    sh_quote(&format!("{sum}  {target}"))
                ));
            }
            script.push_str(&format!(
                " && chmod {m:o} {t} && chown {u}:{g} {t}",
                m = chmod.unwrap_or(0o600),
                t = sh_quote(&target)
            ));
            let shown = match &checksum {
                Some(s) => format!("ADD {src} {target} (sha256 {})", &s[..12]),
                None => format!("ADD {src} {target}"),
            };
            b.as_root(|s| s.push(shown, script));
            continue;
        }
        match inputs.context {
            None => {
                // The inline files.
                let name = src.trim_start_matches("./");
                let Some(f) = inputs
                    .files
                    .iter()
                    .find(|f| f.path.trim_start_matches("./").trim_start_matches('/') == name)
                else {
                    // A directory of them (`dir/a`, `dir/sub/b` for `COPY dir
                    // /d`): its contents go into the destination, as Docker
                    // copies a directory's.
                    let dir = &normal(src)[1..];
                    let mut inside: Vec<(String, &InlineFile)> = inputs
                        .files
                        .iter()
                        .filter_map(|f| {
                            let path = normal(&f.path);
                            let rel = if dir.is_empty() {
                                path[1..].to_string()
                            } else {
                                path[1..].strip_prefix(dir)?.strip_prefix('/')?.to_string()
                            };
                            Some((rel, f))
                        })
                        .collect();
                    if inside.is_empty() {
                        return Err(at(Problem::NotAmongFiles(name.to_string())));
                    }
                    inside.sort_by(|a, b| a.0.cmp(&b.0));
                    for (rel, f) in inside {
                        let target = normal(&format!("{}/{rel}", dest_abs.trim_end_matches('/')));
                        if !valid_abs(&target) {
                            return Err(at(Problem::DestinationNotNormal));
                        }
                        match (chown, chmod) {
                            (None, None) => b.file(&target, &f.data, f.mode),
                            _ => b.file_owned(
                                &target,
                                &f.data,
                                chmod.or(f.mode),
                                owner_of(b.state.user),
                            ),
                        }
                    }
                    continue;
                };
                let target = if into_dir {
                    format!(
                        "{}/{}",
                        dest.trim_end_matches('/'),
                        name.rsplit('/').next().unwrap_or(name)
                    )
                } else {
                    dest.clone()
                };
                let target = absolute(&target, Some(&base_dir));
                if !valid_abs(&target) {
                    return Err(at(Problem::DestinationNotNormal));
                }
                match (chown, chmod) {
                    (None, None) => b.file(&target, &f.data, f.mode),
                    _ => b.file_owned(&target, &f.data, chmod.or(f.mode), owner_of(b.state.user)),
                }
            }
            Some(m) => {
                let dest_abs = normal(&dest_abs);
                let found = context_sources(m, src).map_err(at)?;
                if is_glob(src) && !into_dir && found.len() > 1 {
                    return Err(at(Problem::DestinationNotADirectory));
                }
                let owner = chown.unwrap_or((0, 0));
                for (path, rel, kind) in found {
                    let target = if kind != Found::Named || into_dir {
                        // What a directory or a glob names goes into the destination.
                        if rel.is_empty() {
                            continue;
                        }
                        format!("{}/{rel}", dest_abs.trim_end_matches('/'))
                    } else {
                        dest_abs.clone()
                    };
                    if !valid_abs(&target) || target == "/" {
                        return Err(at(Problem::DestinationNotNormal));
                    }
                    match m.files.get(&path) {
                        Some(f) if add && kind == Found::Named && is_tar(&path) => {
                            // Unpacked into the destination, as a directory.
                            archives.push((dest_abs.clone(), tar_decompress(&path)));
                            plan.push(CopyEntry {
                                src: path.clone(),
                                sha256: f.sha256.clone(),
                                dst: format!("\0archive-{}", archives.len()),
                                mode: 0o600,
                                uid: 0,
                                gid: 0,
                                dir: false,
                            });
                        }
                        Some(f) => plan.push(CopyEntry {
                            src: path.clone(),
                            sha256: f.sha256.clone(),
                            dst: target.trim_start_matches('/').to_string(),
                            mode: chmod.unwrap_or(f.mode),
                            uid: owner.0,
                            gid: owner.1,
                            dir: false,
                        }),
                        None => plan.push(CopyEntry {
                            src: path.clone(),
                            sha256: String::new(),
                            dst: target.trim_start_matches('/').to_string(),
                            mode: chmod.unwrap_or(0o755),
                            uid: owner.0,
                            gid: owner.1,
                            dir: true,
                        }),
                    }
                }
            }
        }
    }
    if inputs.context.is_some() && !plan.is_empty() {
        let files = plan.iter().filter(|e| !e.dir).count();
        *copies += plan.len();
        if *copies > MAX_COPY_ENTRIES {
            return Err(ImageError::TooManyCopies);
        }
        let canonical = serde_json::to_string(&plan).unwrap_or_default();
        let digest = sha256_hex(canonical.as_bytes());
        let dir = format!(".runtime-copy/{digest}");
        // Archives wait beside the pieces, to be unpacked where they point.
        for e in plan.iter_mut().filter(|e| e.dst.starts_with('\0')) {
            e.dst = format!("{dir}/{}", &e.dst[1..]);
        }
        let d = sh_quote(&format!("/{dir}"));
        // GNU tar keeps a directory symlink the image has where the copy
        // names a directory; busybox's tar (Alpine, or the one supplied
        // to an image without a shell) has no such option.
        let mut script = format!(
            "k=; tar --keep-directory-symlink --version >/dev/null 2>&1 && k='-p --keep-directory-symlink'; \
             cat {d}/part-* | tar -x --numeric-owner $k -C /"
        );
        for (i, (target, z)) in archives.iter().enumerate() {
            script.push_str(&format!(
                " && mkdir -p {t} && tar -x{z} --no-same-owner -f {d}/archive-{n} -C {t}",
                t = sh_quote(target),
                n = i + 1
            ));
        }
        script.push_str(&format!(" && rm -rf {d}"));
        let bytes: u64 = plan
            .iter()
            .filter_map(|e| {
                inputs
                    .context
                    .and_then(|m| m.files.get(&e.src))
                    .map(|f| f.size)
            })
            .sum();
        let shown = format!(
            "{} {} ({files} files, {bytes} bytes, sha256 {})",
            ins.op,
            ins.rest.trim(),
            &digest[..12]
        );
        b.as_root(|s| {
            s.push_copy(
                shown,
                script,
                CopyPlan {
                    dir: format!("/{dir}"),
                    entries: plan,
                },
            )
        });
    }
    Ok(())
}

/// `COPY --from=<stage or image>`: one step, as root, that copies the
/// sources out of `layer` (mounted at [`from_mount`] in the build machine)
/// by Docker's rules: a directory's contents go into the destination, one
/// file to a path without a trailing `/` is that path, several go into
/// the destination as a directory; owners and modes as they are there
/// unless `--chown`/`--chmod`. Sources are paths in that file system
/// (relative ones from its root), with `*`, `?` and `[...]` globs.
fn copy_from_layer(
    b: &mut Steps,
    ins: &Instr,
    argv: &[(String, String)],
    name: &str,
    layer: &str,
) -> Result<(), ImageError> {
    let at = |problem: Problem| err_at(ins, problem);
    let CopyArgs {
        chown,
        chmod,
        srcs,
        dest,
        ..
    } = copy_args(b, ins, argv, true)?;
    let (dest, srcs) = (&dest, &srcs[..]);
    let base_dir = b.state.workdir.clone().unwrap_or_else(|| "/".into());
    let dest_is_dir = dest.ends_with('/') || dest == "." || dest.ends_with("/.");
    let dest_abs = normal(&absolute(dest, Some(&base_dir)));
    if !valid_abs(&absolute(dest, Some(&base_dir))) {
        return Err(at(Problem::DestinationNotNormal));
    }
    let into_dir = dest_is_dir || srcs.len() > 1 || srcs.iter().any(|s| is_glob(s));
    let mount = from_mount(layer);
    let d = sh_quote(&dest_abs);
    let mut script = String::new();
    for src in srcs {
        if src.starts_with("<<") || src.contains("://") || src.starts_with("git@") {
            return Err(at(Problem::CopyFromSource(src.clone())));
        }
        // A path in the stage's file system, from its root.
        let mut parts: Vec<&str> = Vec::new();
        for p in src.split('/').filter(|p| !p.is_empty() && *p != ".") {
            if p == ".." {
                if parts.pop().is_none() {
                    return Err(at(Problem::OutsideStage(src.clone())));
                }
            } else {
                parts.push(p);
            }
        }
        let clean = parts.join("/");
        let path = if clean.is_empty() {
            sh_quote(&mount)
        } else {
            format!("{}/{}", sh_quote(&mount), glob_word(&clean))
        };
        let missing = sh_quote(&format!(
            "COPY --from={name}: {src}: no such file or directory in {name}"
        ));
        // Each top-level thing placed, for --chown and --chmod.
        let mut fix = String::new();
        if let Some((u, g)) = chown {
            fix.push_str(&format!(" && chown -hR {u}:{g} \"$t\""));
        }
        if let Some(m) = chmod {
            fix.push_str(&format!(" && chmod -R {m:o} \"$t\""));
        }
        let fix_dir = if fix.is_empty() {
            String::new()
        } else {
            format!(
                "\n    for e in \"$s\"/* \"$s\"/.[!.]* \"$s\"/..?*; do {{ [ -e \"$e\" ] || [ -L \"$e\" ]; }} || continue; t={d}/\"${{e##*/}}\"{fix}; done"
            )
        };
        let (file_target, file_copy) = if into_dir {
            (
                format!("{d}/\"${{s##*/}}\""),
                format!("mkdir -p {d} && cp -a \"$s\" {d}/"),
            )
        } else {
            (
                d.clone(),
                format!(
                    "mkdir -p {} && cp -a \"$s\" {d}",
                    sh_quote(parent(&dest_abs))
                ),
            )
        };
        script.push_str(&format!(
            "set -- {path}\n\
             {{ [ -e \"$1\" ] || [ -L \"$1\" ]; }} || {{ echo {missing} >&2; exit 1; }}\n\
             for s do\n  \
             if [ -d \"$s\" ] && [ ! -L \"$s\" ]; then\n    \
             mkdir -p {d} && cp -a \"$s\"/. {d}/{fix_dir}\n  \
             else\n    \
             {file_copy}{file_fix}\n  \
             fi\n\
             done\n",
            file_fix = if fix.is_empty() {
                String::new()
            } else {
                format!(" && t={file_target}{fix}")
            },
        ));
    }
    let shown = format!(
        "{} {} (from layer {})",
        ins.op,
        ins.rest.trim(),
        super::steps::short_key(layer)
            .chars()
            .take(12)
            .collect::<String>()
    );
    b.as_root(|s| s.push_from(shown, script, layer));
    Ok(())
}

/// A path as one shell word: quoted, but for the glob characters `*` and
/// `?` and plain `[...]` classes, which the shell then expands.
fn glob_word(p: &str) -> String {
    let mut out = String::new();
    let mut lit = String::new();
    let mut rest = p;
    while let Some(c) = rest.chars().next() {
        let class = (c == '[').then(|| rest.find(']')).flatten().filter(|end| {
            *end > 1
                && rest[1..*end]
                    .chars()
                    .all(|k| k.is_ascii_alphanumeric() || "!^-_.".contains(k))
        });
        let raw = match (c, class) {
            ('*' | '?', _) => Some(c.len_utf8()),
            ('[', Some(end)) => Some(end + 1),
            _ => None,
        };
        match raw {
            Some(n) => {
                if !lit.is_empty() {
                    out.push_str(&sh_quote(&std::mem::take(&mut lit)));
                }
                out.push_str(&rest[..n]);
                rest = &rest[n..];
            }
            None => {
                lit.push(c);
                rest = &rest[c.len_utf8()..];
            }
        }
    }
    if !lit.is_empty() {
        out.push_str(&sh_quote(&lit));
    }
    out
}

/// An absolute path without `.` parts or doubled slashes.
fn normal(p: &str) -> String {
    let parts: Vec<&str> = p
        .split('/')
        .filter(|c| !c.is_empty() && *c != ".")
        .collect();
    format!("/{}", parts.join("/"))
}

/// The directory a path is in.
fn parent(p: &str) -> &str {
    match p.rfind('/') {
        Some(0) | None => "/",
        Some(i) => &p[..i],
    }
}

/// How a COPY source found a context path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Found {
    /// The source names this file.
    Named,
    /// A file in a directory the source names, or one its glob matches.
    Inside,
    /// A directory in one the source names.
    Dir,
}

/// What a COPY source names in the context: `(path, path relative to what
/// the source names, is a directory)`. A file is named whole (relative:
/// its base name); a directory stands for everything in it; a glob for
/// every file and directory it matches.
fn context_sources(m: &Manifest, src: &str) -> Result<Vec<(String, String, Found)>, Problem> {
    let trimmed = src.trim_start_matches('/');
    let mut parts: Vec<&str> = Vec::new();
    for p in trimmed.split('/').filter(|p| !p.is_empty() && *p != ".") {
        if p == ".." {
            if parts.pop().is_none() {
                return Err(Problem::OutsideContext(src.to_string()));
            }
        } else {
            parts.push(p);
        }
    }
    let clean = parts.join("/");
    let base = |p: &str| p.rsplit('/').next().unwrap_or(p).to_string();
    let mut out = Vec::new();
    let add_dir = |out: &mut Vec<(String, String, Found)>, dir: &str| {
        let prefix = if dir.is_empty() {
            String::new()
        } else {
            format!("{dir}/")
        };
        for d in m.dirs.iter().filter(|d| d.starts_with(&prefix)) {
            out.push((d.clone(), d[prefix.len()..].to_string(), Found::Dir));
        }
        for f in m.files.keys().filter(|f| f.starts_with(&prefix)) {
            out.push((f.clone(), f[prefix.len()..].to_string(), Found::Inside));
        }
    };
    if is_glob(&clean) {
        // Docker copies a matched directory's contents (not the directory).
        for d in m.dirs.iter().filter(|d| glob_match(&clean, d)) {
            add_dir(&mut out, d);
        }
        for f in m.files.keys().filter(|f| glob_match(&clean, f)) {
            if !out.iter().any(|(p, _, _)| p == f) {
                out.push((f.clone(), base(f), Found::Inside));
            }
        }
    } else if clean.is_empty() || m.dirs.contains(&clean) {
        add_dir(&mut out, &clean);
        if clean.is_empty() && m.files.is_empty() {
            return Ok(out);
        }
    } else if m.files.contains_key(&clean) {
        out.push((clean.clone(), base(&clean), Found::Named));
    }
    if out.is_empty() && !clean.is_empty() {
        return Err(Problem::NotInContext(src.to_string()));
    }
    Ok(out)
}

/// The instructions of `text`, each with its first line's number: blank
/// lines and comment lines dropped (also inside a continued instruction),
/// lines ending in `\` joined with the next, heredocs (`<<EOF`, `<<-EOF`,
/// `<<"EOF"`) read up to their closing word.
fn instructions(text: &str) -> Result<Vec<Instr>, ImageError> {
    let lines: Vec<&str> = text.lines().collect();
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut start = 0;
    let mut i = 0;
    while i < lines.len() {
        let t = lines[i].trim();
        i += 1;
        if t.is_empty() || t.starts_with('#') {
            continue;
        }
        if cur.is_empty() {
            start = i;
        }
        if let Some(head) = t.strip_suffix('\\') {
            cur.push_str(head);
            cur.push(' ');
            continue;
        }
        cur.push_str(t);
        let logical = std::mem::take(&mut cur);
        let (op, rest) = logical
            .split_once(char::is_whitespace)
            .unwrap_or((logical.as_str(), ""));
        let op = op.to_ascii_uppercase();
        let mut heredocs = Vec::new();
        if matches!(op.as_str(), "RUN" | "COPY" | "ADD") {
            for (name, strip_tabs) in heredoc_markers(rest) {
                let mut raw = String::new();
                loop {
                    let Some(l) = lines.get(i) else {
                        return Err(ImageError::Instruction {
                            line: start,
                            op: op.clone(),
                            problem: Problem::UnclosedHeredoc(name),
                        });
                    };
                    i += 1;
                    let closing = if strip_tabs {
                        l.trim_start_matches('\t')
                    } else {
                        l
                    };
                    if closing == name {
                        break;
                    }
                    raw.push_str(l);
                    raw.push('\n');
                }
                heredocs.push(Heredoc {
                    name,
                    strip_tabs,
                    raw,
                });
            }
        }
        out.push(Instr {
            line: start,
            op,
            rest: rest.trim().to_string(),
            heredocs,
        });
    }
    if !cur.is_empty() {
        let (op, rest) = cur
            .split_once(char::is_whitespace)
            .unwrap_or((cur.as_str(), ""));
        out.push(Instr {
            line: start,
            op: op.to_ascii_uppercase(),
            rest: rest.trim().to_string(),
            heredocs: Vec::new(),
        });
    }
    Ok(out)
}

/// The heredocs an instruction opens, in order: `(word, strips tabs)`.
fn heredoc_markers(rest: &str) -> Vec<(String, bool)> {
    let mut out = Vec::new();
    let mut s = rest;
    while let Some(i) = s.find("<<") {
        let after = &s[i + 2..];
        if after.starts_with('<') {
            s = after.trim_start_matches('<');
            continue;
        }
        let (strip, after) = match after.strip_prefix('-') {
            Some(a) => (true, a),
            None => (false, after),
        };
        let (word, len) = match after.chars().next() {
            Some(q @ ('"' | '\'')) => match after[1..].find(q) {
                Some(end) => (after[1..end + 1].to_string(), end + 2),
                None => (String::new(), 0),
            },
            _ => {
                let end = after
                    .find(|c: char| !(c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-')))
                    .unwrap_or(after.len());
                (after[..end].to_string(), end)
            }
        };
        if !word.is_empty() {
            out.push((word, strip));
        }
        s = &after[len.max(1).min(after.len())..];
    }
    out
}

/// `$NAME` and `${NAME}` replaced by the build's variables (ENV before
/// ARG), each name read whole and each value put in as it is; an unknown
/// name stays as written.
fn substitute(s: &str, argv: &[(String, String)], env: &[(String, String)]) -> String {
    let value = |name: &str| {
        env.iter()
            .chain(argv.iter())
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    };
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(i) = rest.find('$') {
        out.push_str(&rest[..i]);
        let after = &rest[i + 1..];
        let (name, len) = if let Some(braced) = after.strip_prefix('{') {
            match braced.find('}') {
                Some(end) => (&braced[..end], end + 2),
                None => ("", 0),
            }
        } else {
            let end = after
                .char_indices()
                .find(|(k, c)| {
                    !(c.is_ascii_alphanumeric() || *c == '_') || (*k == 0 && c.is_ascii_digit())
                })
                .map_or(after.len(), |(k, _)| k);
            (&after[..end], end)
        };
        match value(name).filter(|_| !name.is_empty()) {
            Some(v) => {
                out.push_str(v);
                rest = &after[len..];
            }
            None => {
                out.push('$');
                rest = after;
            }
        }
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::super::steps::BuildState;
    use super::*;

    fn file(path: &str, data: &str) -> InlineFile {
        InlineFile {
            path: path.into(),
            data: data.as_bytes().to_vec(),
            mode: None,
        }
    }

    fn build(
        text: &str,
        files: &[InlineFile],
        args: &[(&str, &str)],
    ) -> Result<(Steps, Parsed), String> {
        let mut b = Steps::new(
            "base-abc",
            BuildState {
                env: Vec::new(),
                workdir: None,
                user: ImageUser::Root,
            },
        );
        let args: Vec<(String, String)> = args
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let p = parse(
            &mut b,
            text,
            Inputs {
                files,
                args: &args,
                ..Inputs::default()
            },
        )
        .map_err(|e| e.to_string())?;
        Ok((b, p))
    }

    fn ok(text: &str) -> Steps {
        build(text, &[], &[]).unwrap().0
    }

    fn err(text: &str, files: &[InlineFile]) -> String {
        build(text, files, &[]).err().unwrap_or_default()
    }

    fn instructions(b: &Steps) -> Vec<&str> {
        b.steps.iter().map(|s| s.instruction.as_str()).collect()
    }

    fn env(b: &Steps) -> Vec<(&str, &str)> {
        b.state
            .env
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect()
    }

    #[test]
    fn a_whole_dockerfile_with_pinned_keys() {
        let files = [InlineFile {
            path: "app.py".into(),
            data: b"print(1)".to_vec(),
            mode: Some(0o755),
        }];
        let (b, p) = build(
            "ARG V=1\nFROM runtime\nENV X=$V Y=b\nWORKDIR app\nCOPY app.py ./\nUSER 1000\n\
             RUN [\"python3\", \"app.py\"]\nCMD python3 app.py",
            &files,
            &[("V", "2")],
        )
        .unwrap();
        assert_eq!(p.base, None);
        assert_eq!(p.start, Some(json!({"command": "python3 app.py"})));
        assert_eq!(
            instructions(&b),
            [
                "WORKDIR /app",
                // `./` is kept as written: the path is the same file.
                "COPY /app/./app.py (8 bytes, sha256 d287bb7f9d15)",
                "RUN 'python3' 'app.py'"
            ]
        );
        // The key the server has always given this step.
        assert_eq!(
            b.steps[0].key,
            "d7705ff46f50ecfd787eaa50730aa3114f363bb883fc46e1787b9dbd886ab0df"
        );
        assert_eq!(
            b.steps[1].script.as_deref(),
            Some(
                "mkdir -p '/app/.' && printf '%s' 'cHJpbnQoMSk=' | base64 -d > '/app/./app.py' && \
                 chmod 755 '/app/./app.py' && chown 0:0 '/app/./app.py'"
            )
        );
        assert_eq!(
            b.steps[2].script.as_deref(),
            Some("export V='2' ; 'python3' 'app.py'")
        );
        assert_eq!(
            b.steps.iter().map(|s| s.root).collect::<Vec<_>>(),
            [true, true, false]
        );
        assert_eq!(b.steps[2].workdir.as_deref(), Some("/app"));
        assert_eq!(env(&b), [("X", "2"), ("Y", "b")]);
        assert_eq!(b.state.user, ImageUser::User);
    }

    #[test]
    fn from_names_the_servers_image_or_one_of_ours() {
        for f in ["runtime", "default", "runtime:latest", "default:latest"] {
            assert_eq!(
                build(&format!("FROM {f}"), &[], &[]).unwrap().1.base,
                None,
                "{f}"
            );
        }
        let base = |t: &str, args: &[(&str, &str)]| build(t, &[], args).unwrap().1.base;
        assert_eq!(base("FROM app:1 AS build", &[]).as_deref(), Some("app:1"));
        assert_eq!(base("from app@2", &[]).as_deref(), Some("app@2"));
        assert_eq!(base("ARG B=app\nFROM $B", &[]).as_deref(), Some("app"));
        assert_eq!(
            base("ARG B=app\nFROM ${B}:v2", &[("B", "web")]).as_deref(),
            Some("web:v2")
        );
    }

    #[test]
    fn run_has_a_shell_and_an_exec_form_and_sees_the_args() {
        let b = ok("FROM runtime\nRUN echo hi && true\nrun [\"echo\", \"it's\"]");
        assert_eq!(
            instructions(&b),
            ["RUN echo hi && true", r"RUN 'echo' 'it'\''s'"]
        );
        assert_eq!(b.steps[0].script.as_deref(), Some("echo hi && true"));
        // RUN is not substituted: the shell expands the exported args.
        let (b, _) = build(
            "ARG A=1\nFROM runtime\nARG B\nARG C=\"x y\"\nRUN echo $A$B$C",
            &[],
            &[("B", "2")],
        )
        .unwrap();
        assert_eq!(b.steps[0].instruction, "RUN echo $A$B$C");
        assert_eq!(
            b.steps[0].script.as_deref(),
            Some("export A='1' B='2' C='x y' ; echo $A$B$C")
        );
        // A build arg no ARG declares is not used; a later ARG replaces one.
        let (b, _) = build(
            "FROM runtime\nARG A=1\nARG A=3\nRUN true",
            &[],
            &[("Z", "9")],
        )
        .unwrap();
        assert_eq!(b.steps[0].script.as_deref(), Some("export A='3' ; true"));
    }

    #[test]
    fn env_has_both_forms_and_substitutes_earlier_values() {
        let b =
            ok("FROM runtime\nENV A=1 B=\"two\"\nENV C hello world\nENV D \"q\"\nENV E=$A/${B}");
        assert_eq!(
            env(&b),
            [
                ("A", "1"),
                ("B", "two"),
                ("C", "hello world"),
                ("D", "q"),
                ("E", "1/two")
            ]
        );
        assert!(b.steps.is_empty());
        // Quoted values keep their spaces, as the official client's Daytona
        // `Image.env` writes them (`ENV K="v"`, JSON's escapes).
        let b = ok(r#"FROM runtime
ENV S="two words" T='it''s' U=a\ b V="say \"hi\" \\ \$HOME \n" W="" X=1"#);
        assert_eq!(
            env(&b),
            [
                ("S", "two words"),
                ("T", "its"),
                ("U", "a b"),
                ("V", r#"say "hi" \ $HOME \n"#),
                ("W", ""),
                ("X", "1")
            ]
        );
        // A later value replaces an earlier one; later steps run with it.
        let b = ok("FROM runtime\nENV A=1\nRUN one\nENV A=2\nRUN two");
        assert_eq!(b.steps[0].env, [("A".to_string(), "1".to_string())]);
        assert_eq!(b.steps[1].env, [("A".to_string(), "2".to_string())]);
    }

    #[test]
    fn workdir_is_absolute_or_relative_to_the_previous_one() {
        let b = ok("FROM runtime\nWORKDIR b\nWORKDIR /a\nWORKDIR c/\nWORKDIR d\nWORKDIR /e");
        assert_eq!(
            instructions(&b),
            [
                "WORKDIR /b",
                "WORKDIR /a",
                "WORKDIR /a/c/",
                "WORKDIR /a/c/d",
                "WORKDIR /e"
            ]
        );
        assert_eq!(b.state.workdir.as_deref(), Some("/e"));
        let b = ok("FROM runtime\nENV D=/srv\nWORKDIR $D/app");
        assert_eq!(b.state.workdir.as_deref(), Some("/srv/app"));
        // Made by root, owned by the user the build is at.
        let b = ok("FROM runtime\nUSER user\nWORKDIR /w");
        assert!(b.steps[0].root);
        assert_eq!(
            b.steps[0].script.as_deref(),
            Some("mkdir -p '/w' && chown 1000:1000 '/w'")
        );
    }

    #[test]
    fn user_is_root_or_the_sandbox_user() {
        for u in ["root", "0", "0:0"] {
            let b = ok(&format!("FROM runtime\nUSER user\nUSER {u}\nRUN id"));
            assert_eq!(b.state.user, ImageUser::Root, "{u}");
            assert!(b.steps[0].root);
        }
        for u in [
            "runtime",
            "runtime:runtime",
            "user",
            "1000",
            "1000:1000",
            "sandbox",
        ] {
            let b = ok(&format!("FROM runtime\nUSER {u}\nRUN id"));
            assert_eq!(b.state.user, ImageUser::User, "{u}");
            assert!(!b.steps[0].root);
        }
        let b = ok("FROM runtime\nARG U=user\nUSER $U");
        assert_eq!(b.state.user, ImageUser::User);
    }

    #[test]
    fn copy_and_add_write_the_inline_files() {
        let files = [
            file("a.txt", "A"),
            file("./dir/b.txt", "B"),
            file("/c.txt", "C"),
        ];
        let (b, _) = build(
            "FROM runtime\nCOPY a.txt /etc/a.conf\nCOPY --chown=user:user ./a.txt dir/b.txt /opt/\n\
             WORKDIR /w\nADD c.txt c\nCOPY a.txt /",
            &files,
            &[],
        )
        .unwrap();
        assert_eq!(
            instructions(&b),
            [
                "COPY /etc/a.conf (1 bytes, sha256 559aead08264)",
                "COPY /opt/a.txt (1 bytes, sha256 559aead08264)",
                "COPY /opt/b.txt (1 bytes, sha256 df7e70e50215)",
                "WORKDIR /w",
                "COPY /w/c (1 bytes, sha256 6b23c0d5f35d)",
                "COPY /a.txt (1 bytes, sha256 559aead08264)",
            ]
        );
        // Several sources go into the destination as a directory.
        let (b, _) = build("FROM runtime\nCOPY a.txt dir/b.txt /x", &files, &[]).unwrap();
        assert_eq!(
            b.steps[1].instruction,
            "COPY /x/b.txt (1 bytes, sha256 df7e70e50215)"
        );
        // The file belongs to the build's user.
        let (b, _) = build(
            "FROM runtime\nUSER user\nCOPY a.txt /home/user/a",
            &files,
            &[],
        )
        .unwrap();
        assert!(b.steps[0].root);
        assert!(b.steps[0]
            .script
            .as_deref()
            .unwrap_or("")
            .ends_with("chown 1000:1000 '/home/user/a'"));
        assert_eq!(b.state.user, ImageUser::User);
        // Sources and destinations are substituted.
        let (b, _) = build(
            "FROM runtime\nARG F=a.txt\nENV D=/d\nCOPY $F ${D}/",
            &files,
            &[],
        )
        .unwrap();
        assert_eq!(
            b.steps[0].instruction,
            "COPY /d/a.txt (1 bytes, sha256 559aead08264)"
        );
    }

    #[test]
    fn copy_of_a_directory_of_inline_files_copies_its_contents() {
        // As the official client's Daytona layer sends add_local_dir and a
        // Dockerfile's `COPY ./conf/ ...`: each file under the directory.
        let files = [
            file("ctx/1/b.txt", "B"),
            file("ctx/1/sub/a.txt", "A"),
            file("conf//c.txt", "C"),
            file("ctx/10", "X"),
        ];
        let (b, _) = build(
            "FROM runtime\nCOPY ctx/1 /opt/tree\nWORKDIR /w\nCOPY ./conf/ etc/\nCOPY ctx/10 /x",
            &files,
            &[],
        )
        .unwrap();
        assert_eq!(
            instructions(&b),
            [
                "COPY /opt/tree/b.txt (1 bytes, sha256 df7e70e50215)",
                "COPY /opt/tree/sub/a.txt (1 bytes, sha256 559aead08264)",
                "WORKDIR /w",
                "COPY /w/etc/c.txt (1 bytes, sha256 6b23c0d5f35d)",
                "COPY /x (1 bytes, sha256 4b68ab3847fe)",
            ]
        );
        // `--chown` applies to each of them.
        let (b, _) = build("FROM runtime\nCOPY --chown=user ctx/1 /t/", &files, &[]).unwrap();
        let scripts: Vec<&str> = b.steps.iter().filter_map(|s| s.script.as_deref()).collect();
        assert_eq!(scripts.len(), 2);
        assert!(
            scripts[0].ends_with("chown 1000:1000 '/t/b.txt'"),
            "{}",
            scripts[0]
        );
        assert!(
            scripts[1].ends_with("chown 1000:1000 '/t/sub/a.txt'"),
            "{}",
            scripts[1]
        );
        // A prefix of a name is no directory; nothing under it is an error.
        assert_eq!(
            err("FROM runtime\nCOPY ctx/1/su /d", &files),
            "Dockerfile line 2 (COPY): ctx/1/su is not among the build's files"
        );
        assert_eq!(
            err("FROM runtime\nCOPY ctx /d", &files[..0]),
            "Dockerfile line 2 (COPY): ctx is not among the build's files"
        );
    }

    #[test]
    fn cmd_and_entrypoint_become_the_start_command() {
        let (_, p) = build(
            "FROM runtime\nCMD [\"python3\", \"-m\", \"http.server\"]",
            &[],
            &[],
        )
        .unwrap();
        assert_eq!(
            p.start,
            Some(json!({"command": "'python3' '-m' 'http.server'"}))
        );
        let (b, p) = build("FROM runtime\nCMD a\nENTRYPOINT b c", &[], &[]).unwrap();
        assert_eq!(p.start, Some(json!({"command": "b c"})));
        assert!(b.steps.is_empty());
        assert_eq!(build("FROM runtime", &[], &[]).unwrap().1.start, None);
    }

    #[test]
    fn some_instructions_are_accepted_and_ignored() {
        let b = ok(
            "FROM runtime\nLABEL a=b\nEXPOSE 80\nMAINTAINER me\nSHELL [\"/bin/sh\"]\n\
                    STOPSIGNAL SIGTERM\nHEALTHCHECK NONE\nVOLUME /data",
        );
        assert!(b.steps.is_empty());
        assert!(b.state.env.is_empty());
    }

    #[test]
    fn comments_blank_lines_and_continuations() {
        let b = ok("# syntax=docker/dockerfile:1\n\n  # a comment\nFROM runtime\n\nRUN apt-get update && \\\n    apt-get install -y jq\n");
        // The joined line keeps the space before the `\` and adds one.
        assert_eq!(
            instructions(&b),
            ["RUN apt-get update &&  apt-get install -y jq"]
        );
        // A continuation at the end of the text ends the instruction.
        let b = ok("FROM runtime\nRUN a \\");
        assert_eq!(instructions(&b), ["RUN a"]);
        // Numbers are the line an instruction starts on.
        assert_eq!(
            err("# c\n\nFROM runtime\nRUN a \\\n b\nONBUILD x", &[]),
            "Dockerfile line 6 (ONBUILD): ONBUILD is not supported: put those instructions in the Dockerfile that builds FROM this image"
        );
    }

    #[test]
    fn every_error_names_the_instruction() {
        let e = |t: &str| err(t, &[file("a", "A")]);
        assert_eq!(
            e("RUN true"),
            "Dockerfile line 1 (RUN): the first instruction must be FROM"
        );
        assert_eq!(
            e("ARG A\nenv A=1"),
            "Dockerfile line 2 (ENV): the first instruction must be FROM"
        );
        assert_eq!(
            e("FROM runtime\nFROM app AS a AS b"),
            "Dockerfile line 2 (FROM): expected FROM <image> [AS <name>]"
        );
        assert_eq!(
            e("FROM runtime\nENV A=1 B"),
            "Dockerfile line 2 (ENV): expected KEY=VALUE"
        );
        assert_eq!(
            e("FROM runtime\nENV A"),
            "Dockerfile line 2 (ENV): expected KEY VALUE"
        );
        assert_eq!(
            e("FROM runtime\nENV A=\"open B=1"),
            "Dockerfile line 2 (ENV): a quote is not closed"
        );
        assert_eq!(
            e("FROM runtime\nWORKDIR /a/../b"),
            "Dockerfile line 2 (WORKDIR): must be a path without .."
        );
        assert_eq!(
            e("FROM runtime\nWORKDIR ../b"),
            "Dockerfile line 2 (WORKDIR): must be a path without .."
        );
        assert_eq!(
            e("FROM runtime\nUSER nobody"),
            "Dockerfile line 2 (USER): user nobody: only root and runtime (uid 1000) exist"
        );
        assert_eq!(
            e("FROM runtime\nRUN [\"a\", 1]"),
            "Dockerfile line 2 (RUN): bad JSON form"
        );
        assert_eq!(
            e("FROM runtime\nCMD [nope"),
            "Dockerfile line 2 (CMD): bad JSON form"
        );
        assert_eq!(
            e("FROM runtime\nENTRYPOINT [1]"),
            "Dockerfile line 2 (ENTRYPOINT): bad JSON form"
        );
        assert_eq!(
            e("FROM runtime\nCOPY a"),
            "Dockerfile line 2 (COPY): expected COPY <src>... <dest>"
        );
        assert_eq!(
            e("FROM runtime\nCOPY --chown=root a"),
            "Dockerfile line 2 (COPY): expected COPY <src>... <dest>"
        );
        assert_eq!(
            e("FROM runtime\nADD missing.txt /x"),
            "Dockerfile line 2 (ADD): missing.txt is not among the build's files"
        );
        assert_eq!(
            e("FROM runtime\nCOPY a ../x"),
            "Dockerfile line 2 (COPY): the destination must be a path without .."
        );
        assert_eq!(
            e("FROM runtime\nONBUILD RUN true"),
            "Dockerfile line 2 (ONBUILD): ONBUILD is not supported: put those instructions in the Dockerfile that builds FROM this image"
        );
        assert_eq!(e(""), "a Dockerfile needs FROM");
        assert_eq!(e("# only a comment\n"), "a Dockerfile needs FROM");
        assert_eq!(e("ARG A=1"), "a Dockerfile needs FROM");
    }

    #[test]
    fn copy_to_dot_copies_into_the_workdir() {
        // `COPY app.py .` is Docker's usual form: the file goes into the
        // directory, not onto the directory's own path.
        let files = [file("app.py", "A")];
        let (b, _) = build(
            "FROM runtime\nWORKDIR /srv\nCOPY app.py .\nCOPY app.py /opt/.",
            &files,
            &[],
        )
        .unwrap();
        assert_eq!(
            b.steps[1].instruction,
            "COPY /srv/./app.py (1 bytes, sha256 559aead08264)"
        );
        assert_eq!(
            b.steps[2].instruction,
            "COPY /opt/./app.py (1 bytes, sha256 559aead08264)"
        );
    }

    #[test]
    fn a_variable_is_replaced_whole_and_once() {
        // `$V` is not the start of `$VERSION`, and a value is not read again
        // for more variables.
        let b = ok("FROM runtime\nARG V=1\nARG VERSION=2.0\nENV A=$VERSION B=${V}x C=$Vx");
        assert_eq!(env(&b), [("A", "2.0"), ("B", "1x"), ("C", "$Vx")]);
        let b = ok("FROM runtime\nENV A=$B\nENV B=x\nENV C=${A}");
        assert_eq!(env(&b), [("A", "$B"), ("B", "x"), ("C", "$B")]);
        // ENV wins over ARG; unknown names and a lone `$` stay as written.
        let b = ok("FROM runtime\nARG N=arg\nENV N=env\nENV M=$N/$NOPE/${NOPE}/$/${");
        assert_eq!(env(&b), [("N", "env"), ("M", "env/$NOPE/${NOPE}/$/${")]);
    }

    #[test]
    fn comments_and_blank_lines_inside_a_continuation_are_dropped() {
        // As in Docker: a comment line inside a continued instruction is
        // not part of it, and a blank line does not end it.
        let b = ok("FROM runtime\nRUN apt-get update \\\n    # the tools\n    && apt-get install -y jq \\\n\n    && true");
        assert_eq!(
            instructions(&b),
            ["RUN apt-get update  && apt-get install -y jq  && true"]
        );
    }

    fn manifest(files: &[(&str, &str)]) -> Manifest {
        let mut m = Manifest::default();
        for (p, data) in files {
            let mut at = *p;
            while let Some(i) = at.rfind('/') {
                at = &at[..i];
                m.dirs.insert(at.to_string());
            }
            m.files.insert(
                p.to_string(),
                crate::domain::image::context::ContextFile {
                    sha256: sha256_hex(data.as_bytes()),
                    size: data.len() as u64,
                    mode: 0o644,
                },
            );
        }
        m
    }

    fn with_context(text: &str, m: &Manifest) -> Result<(Steps, Parsed), String> {
        with(text, m, None)
    }

    fn with(text: &str, m: &Manifest, target: Option<&str>) -> Result<(Steps, Parsed), String> {
        let mut b = Steps::new(
            "base-abc",
            BuildState {
                env: Vec::new(),
                workdir: None,
                user: ImageUser::Root,
            },
        );
        let p = parse(
            &mut b,
            text,
            Inputs {
                context: Some(m),
                target,
                ..Inputs::default()
            },
        )
        .map_err(|e| e.to_string())?;
        Ok((b, p))
    }

    /// What a COPY step places: (dst, src or "dir", mode, uid).
    fn placed(b: &Steps, i: usize) -> Vec<(String, String, u32, u32)> {
        b.steps[i]
            .copy
            .as_ref()
            .map(|p| {
                p.entries
                    .iter()
                    .map(|e| {
                        let src = if e.dir {
                            "dir".to_string()
                        } else {
                            e.src.clone()
                        };
                        (e.dst.clone(), src, e.mode, e.uid)
                    })
                    .collect()
            })
            .unwrap_or_default()
    }

    fn own(v: &[(&str, &str, u32, u32)]) -> Vec<(String, String, u32, u32)> {
        v.iter()
            .map(|(a, b, m, u)| (a.to_string(), b.to_string(), *m, *u))
            .collect()
    }

    #[test]
    fn copy_from_the_context_follows_dockers_rules() {
        let m = manifest(&[
            ("app.py", "print(1)"),
            ("src/a.rs", "a"),
            ("src/sub/b.rs", "b"),
            ("docs/x.md", "x"),
            ("docs/y.md", "y"),
        ]);
        let (b, _) = with_context(
            "FROM runtime\nWORKDIR /w\nCOPY . .\nCOPY src/ /opt/src\nCOPY app.py /bin/run\n\
             COPY docs/*.md /d/\nCOPY --chown=runtime:runtime --chmod=0755 app.py src/sub ./x/",
            &m,
        )
        .unwrap();
        // `.` is the whole context, into the workdir.
        assert_eq!(
            placed(&b, 1),
            own(&[
                ("w/docs", "dir", 0o755, 0),
                ("w/src", "dir", 0o755, 0),
                ("w/src/sub", "dir", 0o755, 0),
                ("w/app.py", "app.py", 0o644, 0),
                ("w/docs/x.md", "docs/x.md", 0o644, 0),
                ("w/docs/y.md", "docs/y.md", 0o644, 0),
                ("w/src/a.rs", "src/a.rs", 0o644, 0),
                ("w/src/sub/b.rs", "src/sub/b.rs", 0o644, 0),
            ])
        );
        // A directory's contents go into the destination.
        assert_eq!(
            placed(&b, 2),
            own(&[
                ("opt/src/sub", "dir", 0o755, 0),
                ("opt/src/a.rs", "src/a.rs", 0o644, 0),
                ("opt/src/sub/b.rs", "src/sub/b.rs", 0o644, 0),
            ])
        );
        // One file to a path without a slash is that path.
        assert_eq!(placed(&b, 3), own(&[("bin/run", "app.py", 0o644, 0)]));
        assert_eq!(
            placed(&b, 4),
            own(&[
                ("d/x.md", "docs/x.md", 0o644, 0),
                ("d/y.md", "docs/y.md", 0o644, 0)
            ])
        );
        assert_eq!(
            placed(&b, 5),
            own(&[
                ("w/x/app.py", "app.py", 0o755, 1000),
                ("w/x/b.rs", "src/sub/b.rs", 0o755, 1000)
            ])
        );
        assert!(b.steps[5].instruction.starts_with(
            "COPY --chown=runtime:runtime --chmod=0755 app.py src/sub ./x/ (2 files, 9 bytes, sha256 "
        ));
        // Each copy runs as root and unpacks its pieces at /.
        assert!(b.steps[1].root);
        let script = b.steps[1].script.clone().unwrap_or_default();
        let dir = b.steps[1]
            .copy
            .as_ref()
            .map(|p| p.dir.clone())
            .unwrap_or_default();
        assert!(
            dir.starts_with("/.runtime-copy/") && dir.len() == 15 + 64,
            "{dir}"
        );
        assert_eq!(
            script,
            format!("k=; tar --keep-directory-symlink --version >/dev/null 2>&1 && k='-p --keep-directory-symlink'; \
                     cat '{dir}'/part-* | tar -x --numeric-owner $k -C / && rm -rf '{dir}'")
        );
    }

    #[test]
    fn a_changed_context_file_changes_its_copys_key_and_later_ones_only() {
        let text = "FROM runtime\nRUN echo first\nCOPY a.txt /a\nCOPY b.txt /b\nRUN echo last";
        let keys = |m: &Manifest| {
            with_context(text, m)
                .unwrap()
                .0
                .steps
                .iter()
                .map(|s| s.key.clone())
                .collect::<Vec<_>>()
        };
        let one = keys(&manifest(&[("a.txt", "A"), ("b.txt", "B")]));
        let two = keys(&manifest(&[("a.txt", "A"), ("b.txt", "B2")]));
        assert_eq!(one[..2], two[..2]);
        assert_ne!(one[2], two[2]);
        assert_ne!(one[3], two[3]);
        // A file no COPY reads changes nothing.
        let three = keys(&manifest(&[("a.txt", "A"), ("b.txt", "B"), ("c.txt", "C")]));
        assert_eq!(one, three);
    }

    #[test]
    fn copy_sources_missing_or_outside_the_context_are_refused() {
        let m = manifest(&[("a.txt", "A"), ("b.txt", "B")]);
        let e = |t: &str| with_context(t, &m).err().unwrap_or_default();
        assert_eq!(
            e("FROM runtime\nCOPY nope.txt /x"),
            "Dockerfile line 2 (COPY): nope.txt: no such file or directory in the build context"
        );
        assert_eq!(
            e("FROM runtime\nCOPY *.md /x/"),
            "Dockerfile line 2 (COPY): *.md: no such file or directory in the build context"
        );
        assert_eq!(
            e("FROM runtime\nCOPY ../etc/passwd /x"),
            "Dockerfile line 2 (COPY): ../etc/passwd points outside the build context"
        );
        assert_eq!(
            e("FROM runtime\nCOPY *.txt /x"),
            "Dockerfile line 2 (COPY): several sources need a destination directory ending in /"
        );
        assert_eq!(
            e("FROM runtime\nCOPY --chown=nobody a.txt /x"),
            "Dockerfile line 2 (COPY): --chown=nobody: only root (0) and runtime (1000) exist"
        );
        assert_eq!(
            e("FROM runtime\nCOPY --chmod=9 a.txt /x"),
            "Dockerfile line 2 (COPY): --chmod=9: expected octal digits such as 0755"
        );
        // `--link` is accepted (layers are ours to keep).
        assert!(with_context("FROM runtime\nCOPY --link a.txt /x", &m).is_ok());
    }

    #[test]
    fn add_tells_tar_how_each_archive_is_compressed() {
        assert_eq!(tar_decompress("a.tar.gz"), " -z");
        assert_eq!(tar_decompress("d/a.tgz"), " -z");
        assert_eq!(tar_decompress("a.tar.bz2"), " -j");
        assert_eq!(tar_decompress("a.tbz2"), " -j");
        assert_eq!(tar_decompress("a.tar.xz"), " -J");
        assert_eq!(tar_decompress("a.txz"), " -J");
        assert_eq!(tar_decompress("a.tar"), "");
    }

    #[test]
    fn add_unpacks_local_tars_and_downloads_urls() {
        let m = manifest(&[("pkg.tar.gz", "gz"), ("plain.txt", "p")]);
        // Into a directory ending in / or not, an archive unpacks there.
        let (b, _) = with_context("FROM runtime\nADD pkg.tar.gz /opt/a/", &m).unwrap();
        assert!(b.steps[0]
            .script
            .as_deref()
            .unwrap_or("")
            .contains("-C '/opt/a'"));
        let sum = "a".repeat(64);
        let (b, _) = with_context(
            &format!(
                "FROM runtime\nADD pkg.tar.gz /opt/pkg\nADD plain.txt /p\n\
                 ADD --checksum=sha256:{sum} https://example.com/f.bin /dl/\nADD https://example.com/x /x"
            ),
            &m,
        )
        .unwrap();
        let p = b.steps[0].copy.as_ref().unwrap();
        assert_eq!(p.entries[0].dst, format!("{}/archive-1", &p.dir[1..]));
        let script = b.steps[0].script.clone().unwrap_or_default();
        assert!(
            script.contains(&format!(
                "mkdir -p '/opt/pkg' && tar -x -z --no-same-owner -f '{}'/archive-1 -C '/opt/pkg'",
                p.dir
            )),
            "{script}"
        );
        // A file that is not an archive is copied as it is.
        assert_eq!(placed(&b, 1), own(&[("p", "plain.txt", 0o644, 0)]));
        assert_eq!(
            b.steps[2].script.as_deref(),
            Some(&*format!(
                "mkdir -p '/dl' && curl -fsSL --retry 2 -o '/dl/f.bin' 'https://example.com/f.bin' && \
                 echo '{sum}  /dl/f.bin' | sha256sum -c - >/dev/null && chmod 600 '/dl/f.bin' && chown 0:0 '/dl/f.bin'"
            ))
        );
        assert!(b.steps[2].instruction.contains("(sha256 aaaaaaaaaaaa)"));
        assert!(b.steps[3]
            .script
            .as_deref()
            .unwrap_or("")
            .contains("-o '/x' 'https://example.com/x'"));
        let e = |t: &str| with_context(t, &m).err().unwrap_or_default();
        assert_eq!(
            e("FROM runtime\nADD https://example.com/r.git /src"),
            "Dockerfile line 2 (ADD): ADD of a git repository is not supported: RUN git clone … instead (git is in the base image)"
        );
        assert!(e("FROM runtime\nADD git@example.com:r.git /src").contains("git repository"));
        assert_eq!(
            e("FROM runtime\nADD --checksum=sha256:abc https://example.com/f /f"),
            "Dockerfile line 2 (ADD): --checksum=sha256:abc: expected sha256:<64 hex digits>"
        );
        assert_eq!(
            e(&format!(
                "FROM runtime\nADD --checksum=sha256:{sum} plain.txt /f"
            )),
            "Dockerfile line 2 (ADD): --checksum is only for ADD of a URL"
        );
        assert!(e("FROM runtime\nCOPY https://example.com/f /f").contains("no such file"));
    }

    #[test]
    fn heredocs_run_as_scripts_feed_commands_and_make_files() {
        let (b, _) = build(
            "FROM runtime\nRUN <<EOF\necho one\necho two\nEOF\nRUN python3 <<PY > /out\nprint(1)\nPY\n\
             RUN <<-EOT\n\techo tabbed\n\tEOT\nRUN <<EOF\n#!/usr/bin/env python3\nprint(2)\nEOF\n\
             COPY <<EOF /etc/conf\nk = v\n# not a comment\nEOF\nCOPY --chmod=755 <<a.sh <<b.sh /bin/\necho a\na.sh\necho b\nb.sh\nRUN true",
            &[],
            &[],
        )
        .unwrap();
        assert_eq!(
            b.steps[0].script.as_deref(),
            Some("bash -c 'echo one\necho two\n'")
        );
        assert_eq!(b.steps[0].instruction, "RUN <<EOF");
        assert_eq!(
            b.steps[1].script.as_deref(),
            Some("python3 <<PY > /out\nprint(1)\nPY")
        );
        assert_eq!(
            b.steps[2].script.as_deref(),
            Some("bash -c 'echo tabbed\n'")
        );
        let shebang = b.steps[3].script.clone().unwrap_or_default();
        assert!(
            shebang.starts_with(
                "f=$(mktemp) && printf '%s' 'IyEvdXNyL2Jpbi9lbnYgcHl0aG9uMwpwcmludCgyKQo='"
            ),
            "{shebang}"
        );
        assert!(b.steps[4]
            .instruction
            .starts_with("COPY /etc/conf (22 bytes, sha256 "));
        assert!(b.steps[4]
            .script
            .as_deref()
            .unwrap_or("")
            .contains("chown 0:0 '/etc/conf'"));
        assert!(b.steps[5]
            .instruction
            .starts_with("COPY /bin/a.sh (7 bytes"));
        assert!(b.steps[5]
            .script
            .as_deref()
            .unwrap_or("")
            .contains("chmod 755 '/bin/a.sh'"));
        assert!(b.steps[6]
            .instruction
            .starts_with("COPY /bin/b.sh (7 bytes"));
        assert_eq!(b.steps[7].instruction, "RUN true");
        assert_eq!(
            err("FROM runtime\nRUN <<EOF\necho never closed\n", &[]),
            "Dockerfile line 2 (RUN): heredoc <<EOF has no closing EOF line"
        );
        // `<<<` is a here-string, not a heredoc.
        let b = ok("FROM runtime\nRUN cat <<< hi");
        assert_eq!(b.steps[0].script.as_deref(), Some("cat <<< hi"));
    }

    #[test]
    fn args_before_from_shell_and_mounts() {
        let (b, p) = build(
            "ARG BASE=app\nARG V=1\nFROM ${BASE}:v$V\nARG TARGETARCH\nARG TARGETPLATFORM\n\
             RUN echo $TARGETARCH\nSHELL [\"/bin/sh\", \"-c\"]\nRUN echo hi\nRUN --mount=type=cache,target=/root/.cache pip list",
            &[],
            &[],
        )
        .unwrap();
        assert_eq!(p.base.as_deref(), Some("app:v1"));
        assert_eq!(
            b.steps[0].script.as_deref(),
            Some("export BASE='app' V='1' TARGETARCH='amd64' TARGETPLATFORM='linux/amd64' ; echo $TARGETARCH")
        );
        assert_eq!(
            b.steps[1].script.as_deref(),
            Some("export BASE='app' V='1' TARGETARCH='amd64' TARGETPLATFORM='linux/amd64' ; '/bin/sh' '-c' 'echo hi'")
        );
        assert!(b.steps[2]
            .script
            .as_deref()
            .unwrap_or("")
            .ends_with("'/bin/sh' '-c' 'pip list'"));
        assert_eq!(
            build("ARG T=runtime\nFROM $TARGETOS-$T", &[], &[])
                .unwrap()
                .1
                .base
                .as_deref(),
            Some("linux-runtime")
        );
        let e = |t: &str| err(t, &[]);
        assert_eq!(
            e("FROM runtime\nRUN --mount=type=secret,id=tok cat /run/secrets/tok"),
            "Dockerfile line 2 (RUN): RUN --mount=type=secret is not supported: pass the value as a build argument (kept in the image's steps) or give it to sandboxes at create"
        );
        assert!(e("FROM runtime\nRUN --mount=type=ssh git clone x")
            .contains("--mount=type=ssh is not supported"));
        assert!(e("FROM runtime\nRUN --mount=target=/src make")
            .contains("--mount=type=bind is not supported: COPY the files in first"));
        assert_eq!(
            e("FROM runtime\nRUN --frobnicate true"),
            "Dockerfile line 2 (RUN): unknown option --frobnicate"
        );
        assert_eq!(
            e("FROM runtime\nSHELL bash"),
            "Dockerfile line 2 (SHELL): bad JSON form"
        );
        assert_eq!(
            e("FROM runtime\nCOPY --exclude=*.md . /x"),
            "Dockerfile line 2 (COPY): COPY --exclude is not supported: leave the files out with .dockerignore, or remove them with a RUN"
        );
    }

    #[test]
    fn stages_build_the_target_and_what_it_is_built_from() {
        let m = manifest(&[("a", "A")]);
        let text = "FROM runtime AS base\nENV B=1\nRUN echo base\n\
                    FROM runtime AS unused\nRUN echo unused\nONBUILD RUN x\n\
                    FROM base AS app\nRUN echo app\n\
                    FROM app\nRUN echo last\nCMD run";
        let (b, p) = with(text, &m, None).unwrap();
        assert_eq!(
            instructions(&b),
            ["RUN echo base", "RUN echo app", "RUN echo last"]
        );
        assert_eq!(p.base, None);
        assert_eq!(p.start, Some(json!({"command": "run"})));
        assert_eq!(env(&b), [("B", "1")]);
        let (b, p) = with(text, &m, Some("APP")).unwrap();
        assert_eq!(instructions(&b), ["RUN echo base", "RUN echo app"]);
        assert_eq!(p.start, None);
        let (b, _) = with(text, &m, Some("base")).unwrap();
        assert_eq!(instructions(&b), ["RUN echo base"]);
        // The same steps make the same keys: a target shares its stages' cache.
        let (full, _) = with(text, &m, None).unwrap();
        assert_eq!(full.steps[0].key, b.steps[0].key);
        // An unused stage is not read, so its refusal does not count...
        assert_eq!(
            with(text, &m, Some("unused")).err().unwrap_or_default(),
            "Dockerfile line 6 (ONBUILD): ONBUILD is not supported: put those instructions in the Dockerfile that builds FROM this image"
        );
        assert_eq!(
            with(text, &m, Some("nope")).err().unwrap_or_default(),
            "no stage is named nope"
        );
        // ...a stage by index, and the chain's root names the image.
        let (_, p) = with("FROM app:1\nRUN a\nFROM 0\nRUN b", &m, None).unwrap();
        assert_eq!(p.base.as_deref(), Some("app:1"));
        let e = |t: &str| with(t, &m, None).err().unwrap_or_default();
        assert_eq!(
            e("FROM runtime AS a\nFROM runtime AS A"),
            "Dockerfile line 2 (FROM): a stage named a is already there"
        );
        assert_eq!(
            e("FROM runtime AS a\nCOPY --from=a /x /y"),
            "Dockerfile line 2 (COPY): COPY --from=a: names this stage or a later one"
        );
        assert_eq!(
            with(
                "FROM runtime AS a\nCOPY --from=b /x /y\nFROM runtime AS b",
                &m,
                Some("a")
            )
            .err()
            .unwrap_or_default(),
            "Dockerfile line 2 (COPY): COPY --from=b: names this stage or a later one"
        );
        // Nothing needs stage a when b is the target: it is not read.
        assert!(with(
            "FROM runtime AS a\nCOPY --from=b /x /y\nFROM runtime AS b",
            &m,
            None
        )
        .is_ok());
    }

    const MULTI: &str = "FROM golang:1.22 AS build\nWORKDIR /src\nRUN go build -o /out/app .\n\
                         FROM runtime AS unused\nRUN echo unused\n\
                         FROM alpine:3.20 AS tools\nRUN echo tools > /t\n\
                         FROM runtime\nCOPY --from=build /out/app /usr/local/bin/app\n\
                         COPY --from=2 /t /t\nCOPY --chmod=0755 --from=busybox:1.36 /bin/busybox /bin/\nCMD app";

    fn multi(externals: Option<&std::collections::BTreeMap<String, External>>) -> (Steps, Parsed) {
        let mut b = Steps::new(
            "base-abc",
            BuildState {
                env: Vec::new(),
                workdir: None,
                user: ImageUser::Root,
            },
        );
        let p = parse(
            &mut b,
            MULTI,
            Inputs {
                externals,
                ..Inputs::default()
            },
        );
        (b, p.unwrap_or_default())
    }

    #[test]
    fn a_multi_stage_build_makes_the_stages_the_target_copies_from_and_no_other() {
        let (b, p) = multi(None);
        let shown: Vec<&str> = instructions(&b);
        assert_eq!(shown.len(), 6, "{shown:?}");
        assert_eq!(
            shown[..3],
            [
                "WORKDIR /src",
                "RUN go build -o /out/app .",
                "RUN echo tools > /t"
            ]
        );
        assert!(
            shown[3].starts_with("COPY --from=build /out/app /usr/local/bin/app (from layer "),
            "{}",
            shown[3]
        );
        assert!(shown[4].starts_with("COPY --from=2 /t /t (from layer "));
        assert!(!shown.iter().any(|s| s.contains("unused")));
        // The images besides the target's chain, where they are named first.
        let ext: Vec<(&str, usize, &str, bool)> = p
            .externals
            .iter()
            .map(|e| (e.reference.as_str(), e.line, e.op.as_str(), e.copy))
            .collect();
        assert_eq!(
            ext,
            [
                ("golang:1.22", 1, "FROM", false),
                ("alpine:3.20", 6, "FROM", false),
                ("busybox:1.36", 11, "COPY", true)
            ]
        );
        assert_eq!(p.base, None);
        assert_eq!(p.start, Some(json!({"command": "app"})));
        // Each stage starts on its base's layer (before a pull: a pending
        // key); the target's on the build's base, after the others.
        let on: Vec<Option<&str>> = b.steps.iter().map(|s| s.on.as_deref()).collect();
        let golang = pending_key("golang:1.22");
        let alpine = pending_key("alpine:3.20");
        assert_eq!(
            on,
            [
                Some(golang.as_str()),
                None,
                Some(alpine.as_str()),
                Some("base-abc"),
                None,
                None
            ]
        );
        // Each COPY --from copies out of that stage's last layer (or the
        // image's), mounted where its script reads it, as root.
        let from: Vec<Option<&str>> = b.steps.iter().map(|s| s.from_layer.as_deref()).collect();
        let busybox = pending_key("busybox:1.36");
        assert_eq!(
            from,
            [
                None,
                None,
                None,
                Some(b.steps[1].key.as_str()),
                Some(b.steps[2].key.as_str()),
                Some(busybox.as_str())
            ]
        );
        for i in 3..6 {
            let layer = b.steps[i].from_layer.clone().unwrap_or_default();
            assert!(b.steps[i]
                .script
                .as_deref()
                .unwrap_or("")
                .contains(&from_mount(&layer)));
            assert!(b.steps[i].root);
        }
        // The build stage's WORKDIR is its own; the image's is the target's.
        assert_eq!(b.steps[1].workdir.as_deref(), Some("/src"));
        assert_eq!(b.state.workdir, None);
    }

    #[test]
    fn a_copy_from_key_covers_the_stage_it_copies_from() {
        let (before, _) = multi(None);
        // Once pulled, golang's layer and config (its env, workdir) count.
        let mut m = std::collections::BTreeMap::new();
        m.insert(
            "golang:1.22".to_string(),
            External {
                key: "oci-v1-golang".into(),
                state: BuildState {
                    env: vec![("GOPATH".into(), "/go".into())],
                    workdir: Some("/go".into()),
                    user: ImageUser::Root,
                },
            },
        );
        let (after, _) = multi(Some(&m));
        assert_eq!(after.steps[0].on.as_deref(), Some("oci-v1-golang"));
        assert_eq!(
            after.steps[1].env,
            [("GOPATH".to_string(), "/go".to_string())]
        );
        let changed: Vec<bool> = before
            .steps
            .iter()
            .zip(&after.steps)
            .map(|(a, b)| a.key != b.key)
            .collect();
        // The build stage, the copy out of it and every step after it
        // change; the tools stage does not.
        assert_eq!(changed, [true, true, false, true, true, true]);
        assert_eq!(
            after.steps[3].from_layer.as_deref(),
            Some(after.steps[1].key.as_str())
        );
    }

    #[test]
    fn from_an_earlier_stage_and_copy_from_it_chain_on_its_last_layer() {
        let m = manifest(&[("a", "A")]);
        let (b, p) = with(
            "FROM runtime AS a\nRUN echo a > /a\nFROM a\nCOPY --from=a /a /b\nCOPY --from=0 / /copy/",
            &m,
            None,
        )
        .unwrap();
        assert!(p.externals.is_empty());
        assert_eq!(b.steps[0].on, None);
        assert_eq!(b.steps[1].on.as_deref(), Some(b.steps[0].key.as_str()));
        assert_eq!(
            b.steps[1].from_layer.as_deref(),
            Some(b.steps[0].key.as_str())
        );
        assert_eq!(
            b.steps[2].from_layer.as_deref(),
            Some(b.steps[0].key.as_str())
        );
        // A single-stage build's keys are what they were.
        let (single, _) = with("FROM runtime AS a\nRUN echo a > /a", &m, None).unwrap();
        assert_eq!(single.steps[0].key, b.steps[0].key);
        assert_eq!(single.steps[0].on, None);
    }

    #[test]
    fn copy_from_names_a_stage_an_image_or_is_refused_naming_the_line() {
        let m = manifest(&[("a", "A")]);
        let text = "FROM runtime AS build\nRUN true\nFROM runtime\nCOPY --from=biuld /x /y";
        let (_, p) = with(text, &m, None).unwrap();
        // An unknown name is read as an image; the service refuses a bare
        // word that names none of the caller's images.
        assert_eq!(p.externals.len(), 1);
        assert_eq!(
            p.externals[0].unknown_stage(&stage_names(text)).to_string(),
            "Dockerfile line 4 (COPY): COPY --from=biuld: no stage is named biuld (the stages: build); to copy from an image, name it with its tag or registry (biuld:latest)"
        );
        assert_eq!(
            stage_names("FROM a AS One\nFROM b\nFROM c as two"),
            ["one", "two"]
        );
        let e = |t: &str| with(t, &m, None).err().unwrap_or_default();
        assert_eq!(
            e("FROM runtime AS b\nFROM runtime\nCOPY --from=b ../../etc/x /y"),
            "Dockerfile line 3 (COPY): ../../etc/x points outside the stage's file system"
        );
        assert_eq!(
            e("FROM runtime AS b\nFROM runtime\nCOPY --from=b <<EOF /y\nx\nEOF"),
            "Dockerfile line 3 (COPY): <<EOF: COPY --from copies paths of the stage or image, not a URL or heredoc"
        );
        assert_eq!(
            e("FROM runtime AS b\nFROM runtime\nCOPY --from=b --chown=nobody /x /y"),
            "Dockerfile line 3 (COPY): --chown=nobody: only root (0) and runtime (1000) exist"
        );
    }

    /// Runs a COPY --from step's script with `sh`, its mount and
    /// destinations moved under `dir`.
    fn run_copy(b: &Steps, i: usize, dir: &std::path::Path) -> std::process::Output {
        let s = &b.steps[i];
        let layer = s.from_layer.clone().unwrap_or_default();
        let script = s
            .script
            .clone()
            .unwrap_or_default()
            .replace(&from_mount(&layer), &format!("{}/src", dir.display()))
            .replace("'/dst", &format!("'{}/dst", dir.display()));
        std::process::Command::new("sh")
            .arg("-c")
            .arg(format!("set -e\n{script}"))
            .output()
            .unwrap_or_else(|e| panic!("sh: {e}"))
    }

    #[test]
    fn a_copy_from_script_follows_dockers_rules() {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("rt-copy-from-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let src = dir.join("src");
        for d in ["out/sub", "etc"] {
            std::fs::create_dir_all(src.join(d)).unwrap_or_default();
        }
        for (f, text) in [
            ("out/app", "app"),
            ("out/.hidden", "h"),
            ("out/sub/x.txt", "x"),
            ("etc/a.conf", "a"),
            ("etc/b.conf", "b"),
        ] {
            std::fs::write(src.join(f), text).unwrap_or_default();
        }
        let m = manifest(&[("a", "A")]);
        let (b, _) = with(
            "FROM runtime AS s\nRUN true\nFROM runtime\nWORKDIR /dst\n\
             COPY --from=s /out /dst/tree\nCOPY --from=s out/app /dst/bin/app\n\
             COPY --from=s /etc/*.conf conf/\nCOPY --from=s --chmod=0700 /out/app /out/sub/x.txt /dst/two\n\
             COPY --from=s /nope /dst/x",
            &m,
            None,
        )
        .unwrap();
        let read = |p: &str| std::fs::read_to_string(dir.join(p)).unwrap_or_default();
        let mode = |p: &str| {
            std::fs::metadata(dir.join(p))
                .map(|m| m.permissions().mode() & 0o7777)
                .unwrap_or(0)
        };
        for i in 2..6 {
            let out = run_copy(&b, i, &dir);
            assert!(
                out.status.success(),
                "step {i}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        // A directory's contents (dot files too), recursively.
        assert_eq!(
            (
                read("dst/tree/app"),
                read("dst/tree/.hidden"),
                read("dst/tree/sub/x.txt")
            ),
            ("app".to_string(), "h".to_string(), "x".to_string())
        );
        // One file to a path is that path; a relative source is from the root.
        assert_eq!(read("dst/bin/app"), "app");
        // A glob, into a directory under the workdir.
        assert_eq!(
            (read("dst/conf/a.conf"), read("dst/conf/b.conf")),
            ("a".into(), "b".into())
        );
        // Several sources into a directory, with --chmod.
        assert_eq!(
            (read("dst/two/app"), read("dst/two/x.txt")),
            ("app".into(), "x".into())
        );
        assert_eq!((mode("dst/two/app"), mode("dst/two/x.txt")), (0o700, 0o700));
        // A source that is not there fails the step, saying so.
        let out = run_copy(&b, 6, &dir);
        assert!(!out.status.success());
        assert_eq!(
            String::from_utf8_lossy(&out.stderr).trim(),
            "COPY --from=s: /nope: no such file or directory in s"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
