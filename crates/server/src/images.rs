//! Custom images (contract §11): `POST /v1/images` with a `recipe` or a
//! `dockerfile`, `GET /v1/images[/{id}]`, `/v1/images/resolve`,
//! `/v1/images/{id}/logs`, `POST /v1/images/{id}:delete`.
//!
//! A build is a list of steps, each named by a key that hashes the key
//! before it with the step itself and the build state it runs in (env,
//! workdir, user): a hash chain starting at the base image's key. The disk
//! after each step is kept as a layer, `data_dir/images/layers/<key>/
//! disk.qcow2` (a qcow2 overlay on the layer it started from, or on the
//! base image). A build finds the longest prefix of its steps already kept,
//! boots one build machine on that layer, and runs the rest one by one as
//! commands in it (network through the egress proxy like any sandbox's, no
//! egress secrets), capturing the disk after each. A sandbox created with
//! the image boots (or restores its own template) on the last layer.

use std::path::PathBuf;
use std::time::Duration;

use axum::body::Bytes;
use axum::http::StatusCode;
use base64::Engine;
use runtime_host::RunAs;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::domain::access::sha256_hex;
use crate::domain::access::KeyInfo;
use crate::domain::time::iso;
use crate::error::{ApiError, ApiResult};
use crate::http::extract::{json_object, no_fields, query_object, Fields};
use crate::http::{Ctx, Reply};
use crate::service::clock::now_ms;
use crate::AppState;

const KIND: &str = "image";
const SCOPE: &str = "images";
/// Most log lines an image keeps (the newest are dropped past it).
const MAX_LOG_LINES: usize = 5000;
const STEP_TIMEOUT: Duration = Duration::from_secs(1800);

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Step {
    pub index: usize,
    /// As the user wrote it (`RUN …`, `pip install …`).
    pub instruction: String,
    pub key: String,
    /// `pending|running|cached|done|failed`.
    pub state: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub script: Option<String>,
    pub root: bool,
    pub env: Vec<(String, String)>,
    pub workdir: Option<String>,
    pub seconds: Option<f64>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LogLine {
    pub seq: u64,
    pub step: Option<usize>,
    pub stream: String,
    pub text: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ImageDoc {
    pub id: String,
    pub key_id: String,
    pub name: Option<String>,
    pub version: u32,
    pub tags: Vec<String>,
    pub labels: std::collections::BTreeMap<String, String>,
    pub state: String,
    pub error: Option<String>,
    pub source: String,
    pub base: Option<String>,
    /// The key of the layer the steps start from.
    pub base_key: String,
    pub steps: Vec<Step>,
    pub env: Vec<(String, String)>,
    pub workdir: Option<String>,
    pub user: String,
    pub start: Option<Value>,
    pub created_at: String,
    pub created_ms: i64,
    pub ready_at: Option<String>,
    pub build_seconds: Option<f64>,
    pub log: Vec<LogLine>,
    /// The build machine while one runs (ended by a restart's recovery).
    #[serde(default)]
    pub build_vm: Option<String>,
}

impl ImageDoc {
    /// The key of the final disk (the base's when there are no steps).
    pub fn disk_key(&self) -> String {
        self.steps
            .last()
            .map_or_else(|| self.base_key.clone(), |s| s.key.clone())
    }
}

fn not_found(id: &str) -> ApiError {
    ApiError::NotFound {
        code: "image_not_found",
        what: "image",
        id: id.to_string(),
    }
}

fn layers(st: &AppState) -> PathBuf {
    st.config().data_dir.join("images").join("layers")
}

/// The disk of a layer (`None` for the base image's own key).
pub fn layer_disk(st: &AppState, key: &str) -> PathBuf {
    layers(st).join(key).join("disk.qcow2")
}

fn root_key() -> String {
    format!("base-{}", runtime_host::artifacts::rootfs_key())
}

type Pick = Box<dyn Fn(&ImageDoc) -> bool>;

fn visible(key: &KeyInfo, d: &ImageDoc) -> bool {
    key.account_wide || key.read_only || d.key_id == key.id
}

fn save(st: &AppState, d: &ImageDoc) -> ApiResult<()> {
    st.store().doc_put(
        KIND,
        SCOPE,
        &d.id,
        &serde_json::to_value(d).unwrap_or(Value::Null),
    )?;
    Ok(())
}

fn load(st: &AppState, id: &str) -> ApiResult<Option<ImageDoc>> {
    Ok(st
        .store()
        .doc_get(KIND, SCOPE, id)?
        .and_then(|d| serde_json::from_value(d).ok()))
}

fn all(st: &AppState) -> ApiResult<Vec<ImageDoc>> {
    let mut out: Vec<ImageDoc> = st
        .store()
        .doc_list(KIND, Some(SCOPE))?
        .into_iter()
        .filter_map(|(_, _, d)| serde_json::from_value(d).ok())
        .collect();
    out.sort_by(|a, b| (b.created_ms, &b.id).cmp(&(a.created_ms, &a.id)));
    Ok(out)
}

/// An image by id, `name`, `name:tag` or `name@version`, as `key` sees it.
pub fn resolve(st: &AppState, key: &KeyInfo, r: &str) -> ApiResult<ImageDoc> {
    if let Some(d) = load(st, r)? {
        if visible(key, &d) {
            return Ok(d);
        }
    }
    let (name, pick): (&str, Pick) = if let Some((n, v)) = r.split_once('@') {
        let v: u32 = v.parse().map_err(|_| not_found(r))?;
        (n, Box::new(move |d: &ImageDoc| d.version == v))
    } else if let Some((n, t)) = r.split_once(':') {
        let t = t.to_string();
        (n, Box::new(move |d: &ImageDoc| d.tags.contains(&t)))
    } else {
        (
            r,
            Box::new(|d: &ImageDoc| d.tags.iter().any(|t| t == "latest")),
        )
    };
    all(st)?
        .into_iter()
        .find(|d| visible(key, d) && d.name.as_deref() == Some(name) && pick(d))
        .ok_or_else(|| not_found(r))
}

/// What a sandbox started from the image needs: its disk and environment.
pub struct ForSandbox {
    pub id: String,
    pub env: Vec<(String, String)>,
}

/// The image a create names, which must be ready.
pub fn for_create(st: &AppState, key: &KeyInfo, r: &str) -> ApiResult<ForSandbox> {
    let d = resolve(st, key, r)?;
    if d.state != "ready" {
        return Err(ApiError::Conflict {
            code: "image_not_ready",
            message: format!("Image {} is {}, not ready.", d.id, d.state),
            details: Some(json!({"imageId": d.id, "state": d.state})),
        });
    }
    Ok(ForSandbox {
        id: d.id,
        env: d.env,
    })
}

/// What a new sandbox of image `id` starts in the background: its `start`
/// command (a string run by bash, or an argv), in the image's workdir, as
/// the image's user.
pub fn start_of(st: &AppState, id: &str) -> Option<(Vec<String>, Option<String>, RunAs)> {
    let d = load(st, id).ok().flatten()?;
    let argv = match d.start.as_ref()?.get("command")? {
        Value::String(c) if !c.trim().is_empty() => vec!["bash".into(), "-lc".into(), c.clone()],
        Value::Array(a) if !a.is_empty() && a.iter().all(Value::is_string) => a
            .iter()
            .filter_map(|v| v.as_str().map(String::from))
            .collect(),
        _ => return None,
    };
    let user = if d.user == "root" {
        RunAs::Root
    } else {
        RunAs::Sandbox
    };
    Some((argv, d.workdir.clone(), user))
}

/// The disk a sandbox on image `id` boots on.
pub fn disk_of(st: &AppState, id: &str) -> Option<runtime_host::ImageDisk> {
    let d = load(st, id).ok().flatten()?;
    let key = d.disk_key();
    if key == d.base_key && d.base.is_none() {
        return None;
    }
    Some(runtime_host::ImageDisk {
        disk: layer_disk(st, &key),
        key: key.chars().take(32).collect(),
    })
}

fn answer(d: &ImageDoc) -> Value {
    let steps: Vec<Value> = d
        .steps
        .iter()
        .map(|s| {
            json!({"index": s.index, "instruction": s.instruction, "state": s.state,
                   "cached": s.state == "cached", "seconds": s.seconds})
        })
        .collect();
    let log: Vec<String> = d
        .log
        .iter()
        .map(|l| match l.step {
            Some(i) => format!("[{}] {}", i + 1, l.text),
            None => l.text.clone(),
        })
        .collect();
    json!({
        "id": d.id, "kind": "image", "name": d.name, "version": d.version, "tags": d.tags,
        "labels": d.labels, "state": d.state, "error": d.error, "source": d.source, "base": d.base,
        "steps": steps, "env": d.env.iter().map(|(k, _)| k).collect::<Vec<_>>(),
        "workdir": d.workdir, "user": d.user, "start": d.start, "createdAt": d.created_at,
        "readyAt": d.ready_at, "buildSeconds": d.build_seconds, "log": log.join("\n"),
        "region": "local",
    })
}

// ---- parsing ----------------------------------------------------------

/// The build state a step runs in, and what the image keeps of it.
#[derive(Clone)]
struct State {
    env: Vec<(String, String)>,
    workdir: Option<String>,
    user: String,
}

/// A RUN, CMD or ENTRYPOINT argument as one shell command: the exec form
/// (a JSON array) quoted word by word, the shell form as it is; `None` for
/// an exec form that is not a JSON array of strings.
fn shell_form(rest: &str) -> Option<String> {
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

fn sh_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', "'\\''"))
}

fn set_env(env: &mut Vec<(String, String)>, k: &str, v: &str) {
    env.retain(|(n, _)| n != k);
    env.push((k.to_string(), v.to_string()));
}

struct Builder {
    steps: Vec<Step>,
    state: State,
    prev: String,
}

impl Builder {
    fn push(&mut self, instruction: String, script: String) {
        let root = self.state.user == "root";
        let canonical = json!([
            self.prev,
            instruction,
            script,
            self.state.env,
            self.state.workdir,
            self.state.user
        ]);
        let key = sha256_hex(canonical.to_string().as_bytes());
        self.prev = key.clone();
        self.steps.push(Step {
            index: self.steps.len(),
            instruction,
            key,
            state: "pending".into(),
            script: Some(script),
            root,
            env: self.state.env.clone(),
            workdir: self.state.workdir.clone(),
            seconds: None,
        });
    }

    fn file(&mut self, path: &str, data: &[u8], mode: Option<u32>) {
        let b64 = base64::engine::general_purpose::STANDARD.encode(data);
        let owner = if self.state.user == "root" {
            "0:0"
        } else {
            "1000:1000"
        };
        let dir = match path.rfind('/') {
            Some(0) | None => "/".to_string(),
            Some(i) => path[..i].to_string(),
        };
        let script = format!(
            "mkdir -p {d} && printf '%s' {b} | base64 -d > {p} && chmod {m:o} {p} && chown {owner} {p}",
            d = sh_quote(&dir),
            b = sh_quote(&b64),
            p = sh_quote(path),
            m = mode.unwrap_or(0o644),
        );
        // Root writes the file, then gives it to the build's user.
        let user = std::mem::replace(&mut self.state.user, "root".into());
        let instruction = format!(
            "COPY {path} ({} bytes, sha256 {})",
            data.len(),
            &sha256_hex(data)[..12]
        );
        self.push(instruction, script);
        self.state.user = user;
    }

    fn workdir(&mut self, dir: &str) {
        let user = std::mem::replace(&mut self.state.user, "root".into());
        let owner = if user == "root" { "0:0" } else { "1000:1000" };
        self.push(
            format!("WORKDIR {dir}"),
            format!("mkdir -p {d} && chown {owner} {d}", d = sh_quote(dir)),
        );
        self.state.user = user;
        self.state.workdir = Some(dir.to_string());
    }
}

fn valid_abs(p: &str) -> bool {
    p.starts_with('/') && !p.split('/').any(|c| c == "..") && !p.chars().any(char::is_control)
}

/// One file of `files`/`recipe.files`: `{path, content, encoding?, mode?}`.
fn inline_file(v: &Value) -> Result<(String, Vec<u8>, Option<u32>), String> {
    let path = v["path"].as_str().ok_or("a file needs a path")?.to_string();
    let content = v["content"].as_str().ok_or("a file needs content")?;
    let data = match v["encoding"].as_str() {
        Some("base64") => base64::engine::general_purpose::STANDARD
            .decode(content)
            .map_err(|_| format!("{path}: content is not base64"))?,
        None | Some("utf-8") | Some("utf8") => content.as_bytes().to_vec(),
        Some(e) => return Err(format!("{path}: unknown encoding {e}")),
    };
    let mode = match &v["mode"] {
        Value::Null => None,
        m => Some(crate::http::extract::parse_mode(m).ok_or(format!("{path}: bad mode"))?),
    };
    Ok((path, data, mode))
}

fn strings(v: &Value, what: &str) -> Result<Vec<String>, String> {
    match v {
        Value::Null => Ok(Vec::new()),
        Value::Array(a) => a
            .iter()
            .map(|x| {
                x.as_str()
                    .map(str::to_string)
                    .ok_or(format!("{what} must be strings"))
            })
            .collect(),
        _ => Err(format!("{what} must be a list of strings")),
    }
}

fn pkg_ok(p: &str) -> bool {
    !p.is_empty() && !p.starts_with('-') && !p.chars().any(|c| c.is_whitespace() || c.is_control())
}

fn parse_recipe(b: &mut Builder, r: &Value) -> Result<(), String> {
    let obj = r.as_object().ok_or("recipe must be an object")?;
    for k in obj.keys() {
        if !matches!(
            k.as_str(),
            "base" | "apt" | "pip" | "npm" | "commands" | "env" | "files" | "workdir"
        ) {
            return Err(format!("recipe.{k} is not a recipe field"));
        }
    }
    if let Some(env) = obj.get("env").and_then(Value::as_object) {
        for (k, v) in env {
            let v = v
                .as_str()
                .ok_or(format!("recipe.env.{k} must be a string"))?;
            set_env(&mut b.state.env, k, v);
        }
    }
    if let Some(w) = obj.get("workdir").and_then(Value::as_str) {
        if !valid_abs(w) {
            return Err("recipe.workdir must be an absolute path".into());
        }
        b.workdir(w);
    }
    let user = std::mem::replace(&mut b.state.user, "root".into());
    let apt = strings(obj.get("apt").unwrap_or(&Value::Null), "recipe.apt")?;
    if !apt.is_empty() {
        if !apt.iter().all(|p| pkg_ok(p)) {
            return Err("recipe.apt: package names only".into());
        }
        let list: Vec<String> = apt.iter().map(|p| sh_quote(p)).collect();
        b.push(
            format!("apt install {}", apt.join(" ")),
            format!("apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends {} && rm -rf /var/lib/apt/lists/*", list.join(" ")),
        );
    }
    let pip = strings(obj.get("pip").unwrap_or(&Value::Null), "recipe.pip")?;
    if !pip.is_empty() {
        if !pip.iter().all(|p| pkg_ok(p)) {
            return Err("recipe.pip: requirement specifiers only".into());
        }
        let list: Vec<String> = pip.iter().map(|p| sh_quote(p)).collect();
        b.push(
            format!("pip install {}", pip.join(" ")),
            format!(
                "pip install --no-cache-dir --break-system-packages {}",
                list.join(" ")
            ),
        );
    }
    let npm = strings(obj.get("npm").unwrap_or(&Value::Null), "recipe.npm")?;
    if !npm.is_empty() {
        if !npm.iter().all(|p| pkg_ok(p)) {
            return Err("recipe.npm: package names only".into());
        }
        let list: Vec<String> = npm.iter().map(|p| sh_quote(p)).collect();
        b.push(
            format!("npm install -g {}", npm.join(" ")),
            format!("npm install -g --no-audit --no-fund {}", list.join(" ")),
        );
    }
    b.state.user = user;
    match obj.get("files") {
        None | Some(Value::Null) => {}
        Some(Value::Array(files)) => {
            for f in files {
                let (path, data, mode) = inline_file(f)?;
                if !valid_abs(&path) {
                    return Err(format!("recipe.files: {path} must be an absolute path"));
                }
                b.file(&path, &data, mode);
            }
        }
        Some(Value::Object(files)) => {
            for (path, content) in files {
                let content = content
                    .as_str()
                    .ok_or(format!("recipe.files: {path} must be text"))?;
                if !valid_abs(path) {
                    return Err(format!("recipe.files: {path} must be an absolute path"));
                }
                b.file(path, content.as_bytes(), None);
            }
        }
        Some(_) => {
            return Err("recipe.files must be {path: text} or a list of {path, content}".into())
        }
    }
    for c in strings(
        obj.get("commands").unwrap_or(&Value::Null),
        "recipe.commands",
    )? {
        b.push(format!("RUN {c}"), c);
    }
    Ok(())
}

/// Dockerfile instructions: FROM, RUN, COPY (inline `files`), ENV, WORKDIR,
/// USER, ARG (with `buildArgs`); CMD and ENTRYPOINT are read as `start`.
fn parse_dockerfile(
    b: &mut Builder,
    text: &str,
    files: &[(String, Vec<u8>, Option<u32>)],
    args: &[(String, String)],
    base: &mut Option<String>,
    start: &mut Option<Value>,
) -> Result<(), String> {
    let mut logical = Vec::new();
    let mut cur = String::new();
    for line in text.lines() {
        let t = line.trim();
        if cur.is_empty() && (t.is_empty() || t.starts_with('#')) {
            continue;
        }
        if let Some(head) = t.strip_suffix('\\') {
            cur.push_str(head);
            cur.push(' ');
            continue;
        }
        cur.push_str(t);
        logical.push(std::mem::take(&mut cur));
    }
    if !cur.is_empty() {
        logical.push(cur);
    }
    let mut argv: Vec<(String, String)> = Vec::new();
    let subst = |s: &str, argv: &[(String, String)], env: &[(String, String)]| {
        let mut out = s.to_string();
        for (k, v) in env.iter().chain(argv.iter()) {
            out = out
                .replace(&format!("${{{k}}}"), v)
                .replace(&format!("${k}"), v);
        }
        out
    };
    let mut seen_from = false;
    for (n, l) in logical.iter().enumerate() {
        let (op, rest) = l
            .split_once(char::is_whitespace)
            .unwrap_or((l.as_str(), ""));
        let rest = rest.trim();
        let op = op.to_ascii_uppercase();
        let at = |m: &str| format!("Dockerfile instruction {} ({op}): {m}", n + 1);
        if !seen_from && op != "FROM" && op != "ARG" {
            return Err(at("the first instruction must be FROM"));
        }
        match op.as_str() {
            "FROM" => {
                if seen_from {
                    return Err(at("multi-stage builds are not supported"));
                }
                seen_from = true;
                let r = subst(rest, &argv, &[]);
                let r = r.split_whitespace().next().unwrap_or("");
                if !matches!(
                    r,
                    "runtime" | "default" | "runtime:latest" | "default:latest"
                ) {
                    *base = Some(r.to_string());
                }
            }
            "ARG" => {
                let (k, default) = match rest.split_once('=') {
                    Some((k, v)) => (k.trim(), Some(v.trim().trim_matches('"'))),
                    None => (rest, None),
                };
                let v = args
                    .iter()
                    .find(|(a, _)| a == k)
                    .map(|(_, v)| v.clone())
                    .or(default.map(str::to_string))
                    .unwrap_or_default();
                argv.retain(|(a, _)| a != k);
                argv.push((k.to_string(), v));
            }
            "ENV" => {
                let rest = subst(rest, &argv, &b.state.env);
                if rest.contains('=') {
                    for pair in rest.split_whitespace() {
                        let (k, v) = pair
                            .split_once('=')
                            .ok_or_else(|| at("expected KEY=VALUE"))?;
                        set_env(&mut b.state.env, k, v.trim_matches('"'));
                    }
                } else {
                    let (k, v) = rest
                        .split_once(char::is_whitespace)
                        .ok_or_else(|| at("expected KEY VALUE"))?;
                    set_env(&mut b.state.env, k, v.trim().trim_matches('"'));
                }
            }
            "WORKDIR" => {
                let w = subst(rest, &argv, &b.state.env);
                let w = if w.starts_with('/') {
                    w
                } else {
                    format!(
                        "{}/{w}",
                        b.state
                            .workdir
                            .as_deref()
                            .unwrap_or("")
                            .trim_end_matches('/')
                    )
                };
                if !valid_abs(&w) {
                    return Err(at("must be a path without .."));
                }
                b.workdir(&w);
            }
            "USER" => {
                let u = subst(rest, &argv, &b.state.env);
                b.state.user = match u.as_str() {
                    "root" | "0" | "0:0" => "root".into(),
                    "user" | "1000" | "1000:1000" | "sandbox" => "user".into(),
                    other => {
                        return Err(at(&format!(
                            "user {other}: only root and user (1000) exist"
                        )))
                    }
                };
            }
            "RUN" => {
                let cmd = shell_form(rest).ok_or_else(|| at("bad JSON form"))?;
                // ARG values are in the step's environment, as in Docker.
                let prefix: String = argv
                    .iter()
                    .map(|(k, v)| format!("{k}={} ", sh_quote(v)))
                    .collect();
                let script = if prefix.is_empty() {
                    cmd.clone()
                } else {
                    format!("export {prefix}; {cmd}")
                };
                b.push(format!("RUN {cmd}"), script);
            }
            "COPY" | "ADD" => {
                let parts: Vec<String> = subst(rest, &argv, &b.state.env)
                    .split_whitespace()
                    .filter(|p| !p.starts_with("--"))
                    .map(str::to_string)
                    .collect();
                if parts.len() < 2 {
                    return Err(at("expected COPY <src>... <dest>"));
                }
                let (dest, srcs) = parts.split_last().unwrap_or((&parts[0], &[]));
                let base_dir = b.state.workdir.clone().unwrap_or_else(|| "/".into());
                for src in srcs {
                    let src = src.trim_start_matches("./");
                    let (_, data, mode) = files
                        .iter()
                        .find(|(p, _, _)| p.trim_start_matches("./").trim_start_matches('/') == src)
                        .ok_or_else(|| at(&format!("{src} is not among the build's files")))?;
                    let target = if dest.ends_with('/') || srcs.len() > 1 {
                        format!(
                            "{}/{}",
                            dest.trim_end_matches('/'),
                            src.rsplit('/').next().unwrap_or(src)
                        )
                    } else {
                        dest.clone()
                    };
                    let target = if target.starts_with('/') {
                        target
                    } else {
                        format!("{}/{target}", base_dir.trim_end_matches('/'))
                    };
                    if !valid_abs(&target) {
                        return Err(at("the destination must be a path without .."));
                    }
                    b.file(&target, data, *mode);
                }
            }
            "CMD" | "ENTRYPOINT" => {
                let cmd = shell_form(rest).ok_or_else(|| at("bad JSON form"))?;
                *start = Some(json!({"command": cmd}));
            }
            "LABEL" | "EXPOSE" | "MAINTAINER" | "SHELL" | "STOPSIGNAL" | "HEALTHCHECK"
            | "VOLUME" => {}
            _ => return Err(at("not a supported instruction")),
        }
    }
    if !seen_from {
        return Err("a Dockerfile needs FROM".into());
    }
    Ok(())
}

// ---- routes -----------------------------------------------------------

pub async fn create(st: AppState, ctx: Ctx, body: Bytes) -> ApiResult<Reply> {
    let obj = json_object(&body)?;
    let mut f = Fields::new(&obj);
    let name = crate::http::extract::checked_name(&mut f);
    if let Some(n) = &name {
        if n.contains([':', '@', '/']) {
            f.issue("name", "may not contain ':', '@' or '/'");
        }
    }
    let labels = crate::http::extract::checked_labels(&mut f).unwrap_or_default();
    let tags = f.raw("tags").cloned();
    let recipe = f.raw("recipe").cloned();
    let dockerfile = f.string("dockerfile");
    let files = f.raw("files").cloned();
    let build_args = f.string_map("buildArgs", 64).unwrap_or_default();
    let env = f.string_map("env", 64).unwrap_or_default();
    let start = f.raw("start").cloned();
    let _ = f.raw("build");
    let _ = f.bool("cache");
    if let Some(r) = f.string("region") {
        if r != "local" {
            f.issue("region", "this server has one region, local");
        }
    }
    f.refuse("image", "building from a registry image is not supported by this server; use a recipe or a Dockerfile FROM one of its images");
    f.refuse(
        "context",
        "build contexts are not supported by this server; give small files inline in files",
    );
    f.refuse(
        "target",
        "multi-stage builds are not supported by this server",
    );
    f.refuse(
        "dockerignore",
        "build contexts are not supported by this server",
    );
    if recipe.is_some() == dockerfile.is_some() {
        f.issue("recipe", "give exactly one of recipe and dockerfile");
    }
    let tags: Vec<String> = match tags {
        None | Some(Value::Null) => vec!["latest".to_string()],
        Some(Value::Array(a)) => a
            .iter()
            .filter_map(|t| t.as_str().map(str::to_string))
            .collect(),
        Some(_) => {
            f.issue("tags", "must be a list of strings");
            Vec::new()
        }
    };
    if tags
        .iter()
        .any(|t| t.is_empty() || t.len() > 128 || t.contains([':', '@', '/', ' ']))
    {
        f.issue(
            "tags",
            "each tag is 1-128 characters without ':', '@', '/' or spaces",
        );
    }
    f.finish()?;
    let mut base_ref: Option<String> = None;
    let mut start = start.filter(|s| !s.is_null());
    let mut b = Builder {
        steps: Vec::new(),
        state: State {
            env: Vec::new(),
            workdir: None,
            user: "root".into(),
        },
        prev: String::new(),
    };
    // The base first: its key starts the chain and its state carries over.
    if let Some(r) = &recipe {
        if let Some(base) = r.get("base").and_then(Value::as_str) {
            if !matches!(base, "default" | "runtime") {
                base_ref = Some(base.to_string());
            }
        }
    }
    let file_list: Vec<(String, Vec<u8>, Option<u32>)> = match &files {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(a)) => a
            .iter()
            .map(inline_file)
            .collect::<Result<_, _>>()
            .map_err(|m| ApiError::invalid("files", m))?,
        Some(_) => {
            return Err(ApiError::invalid(
                "files",
                "must be a list of {path, content}",
            ))
        }
    };
    let mut df_start = None;
    if let Some(text) = &dockerfile {
        // Read FROM before the rest: a dry parse finds the base.
        let mut probe = Builder {
            steps: Vec::new(),
            state: b.state.clone(),
            prev: String::new(),
        };
        parse_dockerfile(
            &mut probe,
            text,
            &file_list,
            &build_args,
            &mut base_ref,
            &mut df_start,
        )
        .map_err(|m| ApiError::invalid("dockerfile", m))?;
    }
    let (base_key, base_id) = match &base_ref {
        None => (root_key(), None),
        Some(r) => {
            let d = for_create(&st, &ctx.key, r)?;
            let doc = load(&st, &d.id)?.ok_or_else(|| not_found(r))?;
            b.state.env = doc.env.clone();
            b.state.workdir = doc.workdir.clone();
            b.state.user = doc.user.clone();
            (doc.disk_key(), Some(doc.id))
        }
    };
    b.prev = base_key.clone();
    // On the server's own image, a Dockerfile starts as root (as Docker
    // does) and a recipe as the sandbox user; on one of ours, both go on as
    // the user it ended with, like its env and workdir.
    if base_id.is_none() {
        b.state.user = if dockerfile.is_some() {
            "root".into()
        } else {
            "user".into()
        };
    }
    for (k, v) in &env {
        set_env(&mut b.state.env, k, v);
    }
    let source = if let Some(text) = &dockerfile {
        let mut ignored = None;
        parse_dockerfile(
            &mut b,
            text,
            &file_list,
            &build_args,
            &mut ignored,
            &mut df_start,
        )
        .map_err(|m| ApiError::invalid("dockerfile", m))?;
        if start.is_none() {
            start = df_start;
        }
        "dockerfile"
    } else {
        parse_recipe(&mut b, recipe.as_ref().unwrap_or(&Value::Null))
            .map_err(|m| ApiError::invalid("recipe", m))?;
        "recipe"
    };
    if b.steps.len() > 200 {
        return Err(ApiError::invalid("recipe", "at most 200 steps"));
    }
    let now = now_ms();
    let version = {
        let _g = st.inner.create_lock.lock().await;
        match &name {
            Some(n) => {
                all(&st)?
                    .iter()
                    .filter(|d| d.name.as_deref() == Some(n.as_str()))
                    .map(|d| d.version)
                    .max()
                    .unwrap_or(0)
                    + 1
            }
            None => 1,
        }
    };
    let d = ImageDoc {
        id: uuid::Uuid::new_v4().to_string(),
        key_id: ctx.key.id.clone(),
        tags: if name.is_some() { tags } else { Vec::new() },
        name,
        version,
        labels,
        state: "queued".into(),
        error: None,
        source: source.into(),
        base: base_id,
        base_key,
        steps: b.steps,
        env: b.state.env,
        workdir: b.state.workdir,
        user: if b.state.user == "root" {
            "root".into()
        } else {
            "user".into()
        },
        start,
        created_at: iso(now),
        created_ms: now,
        ready_at: None,
        build_seconds: None,
        log: Vec::new(),
        build_vm: None,
    };
    save(&st, &d)?;
    tracing::info!(image_id = %d.id, steps = d.steps.len(), "image queued");
    let st2 = st.clone();
    let id = d.id.clone();
    st.spawn(async move { build(st2, id).await });
    Ok(Reply::Json(StatusCode::CREATED, answer(&d)))
}

pub async fn get(st: AppState, ctx: Ctx, id: String) -> ApiResult<Reply> {
    let d = load(&st, &id)?
        .filter(|d| visible(&ctx.key, d))
        .ok_or_else(|| not_found(&id))?;
    Reply::ok(answer(&d))
}

pub async fn resolve_route(st: AppState, ctx: Ctx) -> ApiResult<Reply> {
    let r = ctx
        .query
        .iter()
        .find(|(k, _)| k == "ref")
        .map(|(_, v)| v.clone())
        .ok_or_else(|| ApiError::invalid("ref", "is required"))?;
    Reply::ok(answer(&resolve(&st, &ctx.key, &r)?))
}

pub async fn logs(st: AppState, ctx: Ctx, id: String) -> ApiResult<Reply> {
    let d = load(&st, &id)?
        .filter(|d| visible(&ctx.key, d))
        .ok_or_else(|| not_found(&id))?;
    let after: u64 = ctx
        .query
        .iter()
        .find(|(k, _)| k == "after")
        .and_then(|(_, v)| v.parse().ok())
        .unwrap_or(0);
    if ctx.query.iter().any(|(k, v)| k == "follow" && v == "true") {
        return Err(ApiError::Unsupported {
            feature: "following build logs",
        });
    }
    let lines: Vec<Value> = d
        .log
        .iter()
        .filter(|l| l.seq > after)
        .map(|l| json!({"seq": l.seq, "step": l.step, "stream": l.stream, "text": l.text}))
        .collect();
    let next = d.log.last().map_or(after, |l| l.seq.max(after));
    Reply::ok(json!({"lines": lines, "nextAfter": next,
                     "done": !matches!(d.state.as_str(), "queued" | "building")}))
}

pub async fn list(st: AppState, ctx: Ctx) -> ApiResult<Reply> {
    let q = query_object(&ctx.query, &[]);
    let mut f = Fields::new(&q);
    let name = f.string("name");
    let state = f.one_of("state", &["queued", "building", "ready", "failed"]);
    let limit = f.q_int("limit", 1, 100).unwrap_or(50) as usize;
    let cursor = f.string("cursor").filter(|c| !c.is_empty());
    f.finish()?;
    let mut rows: Vec<ImageDoc> = all(&st)?
        .into_iter()
        .filter(|d| visible(&ctx.key, d))
        .filter(|d| name.as_ref().is_none_or(|n| d.name.as_ref() == Some(n)))
        .filter(|d| state.as_ref().is_none_or(|s| &d.state == s))
        .collect();
    let next =
        crate::http::extract::page_after(&mut rows, cursor.as_deref(), limit, |d| d.id.as_str())?;
    let data: Vec<Value> = rows.iter().map(answer).collect();
    Reply::ok(json!({"data": data, "nextCursor": next}))
}

/// Deletes one version; refused (409 `image_in_use`) while a sandbox that
/// is not deleted started from it. The step cache (layers) stays.
pub async fn delete(st: AppState, ctx: Ctx, id: String) -> ApiResult<Reply> {
    let _g = st.inner.create_lock.lock().await;
    let d = load(&st, &id)?
        .filter(|d| d.key_id == ctx.key.id || ctx.key.account_wide)
        .ok_or_else(|| not_found(&id))?;
    if matches!(d.state.as_str(), "queued" | "building") {
        return Err(ApiError::Conflict {
            code: "image_building",
            message: format!("Image {id} is still building."),
            details: None,
        });
    }
    if let Some(user) = st
        .store()
        .live_sandboxes()?
        .into_iter()
        .find(|r| r.record.image.as_deref() == Some(id.as_str()))
    {
        return Err(ApiError::Conflict {
            code: "image_in_use",
            message: format!(
                "Image {id} is used by sandbox {}; delete that sandbox first.",
                user.record.id
            ),
            details: Some(json!({"sandboxId": user.record.id})),
        });
    }
    st.store().doc_delete(KIND, SCOPE, Some(&id))?;
    Reply::ok(json!({"id": id, "kind": "image", "status": "deleted"}))
}

pub async fn action(
    st: AppState,
    ctx: Ctx,
    id: String,
    verb: String,
    body: Bytes,
) -> ApiResult<Reply> {
    match verb.as_str() {
        "delete" => {
            no_fields(&body)?;
            delete(st, ctx, id).await
        }
        "tag" | "untag" => Err(ApiError::Unsupported {
            feature: "moving image tags",
        }),
        _ => Err(ApiError::RouteNotFound {
            method: "POST".into(),
            path: format!("/v1/images/{id}:{verb}"),
        }),
    }
}

// ---- the build --------------------------------------------------------

/// After a restart: builds that were under way failed (their finished steps
/// stay cached, so building again resumes there); their machines end.
pub async fn recover(st: &AppState) -> Result<(), crate::ServerError> {
    let docs = match all(st) {
        Ok(d) => d,
        Err(e) => {
            tracing::warn!(error = %e, "reading images failed");
            return Ok(());
        }
    };
    for mut d in docs {
        if !matches!(d.state.as_str(), "queued" | "building") {
            continue;
        }
        if let Some(vm) = d.build_vm.take() {
            let _ = st.host().destroy(&vm).await;
            crate::service::network::sandbox_gone(st, &vm);
        }
        d.state = "failed".into();
        d.error = Some(
            "the server restarted during the build; build again (finished steps are cached)".into(),
        );
        for s in &mut d.steps {
            if s.state == "running" {
                s.state = "failed".into();
            }
        }
        let _ = save(st, &d);
    }
    Ok(())
}

fn log(st: &AppState, id: &str, step: Option<usize>, stream: &str, text: &str) {
    let Ok(Some(mut d)) = load(st, id) else {
        return;
    };
    for line in text.lines() {
        if d.log.len() >= MAX_LOG_LINES {
            break;
        }
        let seq = d.log.last().map_or(1, |l| l.seq + 1);
        d.log.push(LogLine {
            seq,
            step,
            stream: stream.into(),
            text: line.to_string(),
        });
    }
    let _ = save(st, &d);
}

fn update(st: &AppState, id: &str, f: impl FnOnce(&mut ImageDoc)) {
    if let Ok(Some(mut d)) = load(st, id) {
        f(&mut d);
        let _ = save(st, &d);
    }
}

async fn build(st: AppState, id: String) {
    let started = std::time::Instant::now();
    let result = run_build(&st, &id).await;
    let secs = started.elapsed().as_secs_f64();
    match result {
        Ok(()) => {
            log(
                &st,
                &id,
                None,
                "system",
                &format!("image ready in {secs:.1} s"),
            );
            let _g = st.inner.create_lock.lock().await;
            let Ok(Some(mut d)) = load(&st, &id) else {
                return;
            };
            // Tags move to the newest ready version of the name.
            if let Ok(others) = all(&st) {
                for mut o in others {
                    if o.id != d.id && o.name.is_some() && o.name == d.name {
                        let before = o.tags.len();
                        o.tags.retain(|t| !d.tags.contains(t));
                        if o.tags.len() != before {
                            let _ = save(&st, &o);
                        }
                    }
                }
            }
            d.state = "ready".into();
            d.ready_at = Some(iso(now_ms()));
            d.build_seconds = Some(secs);
            let _ = save(&st, &d);
            tracing::info!(image_id = %id, secs, "image ready");
        }
        Err(message) => {
            log(
                &st,
                &id,
                None,
                "system",
                &format!("build failed: {message}"),
            );
            update(&st, &id, |d| {
                d.state = "failed".into();
                d.error = Some(message.clone());
                d.build_seconds = Some(secs);
                for s in &mut d.steps {
                    if s.state == "running" {
                        s.state = "failed".into();
                    }
                }
            });
            tracing::warn!(image_id = %id, %message, "image build failed");
        }
    }
}

async fn run_build(st: &AppState, id: &str) -> Result<(), String> {
    let d = load(st, id).ok().flatten().ok_or("the image went away")?;
    update(st, id, |d| d.state = "building".into());
    // The longest prefix already kept.
    let mut from = d
        .steps
        .iter()
        .take_while(|s| layer_disk(st, &s.key).exists())
        .count();
    let base_layer = if from > 0 {
        Some(d.steps[from - 1].key.clone())
    } else if d.base.is_some() {
        Some(d.base_key.clone())
    } else {
        None
    };
    for s in &d.steps[..from] {
        log(
            st,
            id,
            Some(s.index),
            "system",
            &format!("{} (cached)", s.instruction),
        );
    }
    update(st, id, |d| {
        for s in d.steps.iter_mut().take(from) {
            s.state = "cached".into();
        }
    });
    if from == d.steps.len() {
        return Ok(());
    }
    let vm = format!("{}", uuid::Uuid::new_v4());
    // The build machine has the network of a sandbox with default rules
    // and no egress secrets.
    let net = crate::domain::network::CreateNet {
        rules: None,
        secrets: Some(Vec::new()),
    };
    crate::service::network::store_create(st, &vm, &net).map_err(|e| e.to_string())?;
    update(st, id, |d| d.build_vm = Some(vm.clone()));
    let spec = runtime_host::MachineSpec {
        id: vm.clone(),
        vcpu: 2,
        memory_mib: 2048,
        // The smallest disk a sandbox may have: the guest grows its file
        // system to its disk, and a sandbox's disk may not be smaller.
        disk_mib: 3072,
        hostname: "build".into(),
        guest_ca_pem: crate::service::network::guest_ca_pem(st, &vm),
        volumes: Vec::new(),
        image: base_layer.map(|k| runtime_host::ImageDisk {
            disk: layer_disk(st, &k),
            key: k.chars().take(32).collect(),
        }),
        // The first step's machine may come from the default template.
        no_template: from > 0 || d.base.is_some(),
    };
    log(
        st,
        id,
        None,
        "system",
        &format!(
            "build machine starting ({} of {} steps cached)",
            from,
            d.steps.len()
        ),
    );
    let result = async {
        st.host()
            .start(&spec)
            .await
            .map_err(|e| format!("the build machine did not start: {e}"))?;
        while from < d.steps.len() {
            let s = &d.steps[from];
            run_step(st, id, &vm, s).await?;
            from += 1;
        }
        Ok::<(), String>(())
    }
    .await;
    let _ = st.host().destroy(&vm).await;
    crate::service::network::sandbox_gone(st, &vm);
    update(st, id, |d| d.build_vm = None);
    result
}

async fn run_step(st: &AppState, id: &str, vm: &str, s: &Step) -> Result<(), String> {
    use runtime_host::{ExecEvent, ExecSpec, RunAs};
    let started = std::time::Instant::now();
    update(st, id, |d| d.steps[s.index].state = "running".into());
    log(st, id, Some(s.index), "system", &s.instruction);
    let script = format!("set -e\n{}\nsync", s.script.as_deref().unwrap_or("true"));
    let mut env = s.env.clone();
    env.push(("DEBIAN_FRONTEND".into(), "noninteractive".into()));
    let spec = ExecSpec {
        argv: vec!["bash".into(), "-c".into(), script],
        cwd: s.workdir.clone(),
        env,
        user: if s.root { RunAs::Root } else { RunAs::Sandbox },
        timeout: Some(STEP_TIMEOUT),
        stdin: false,
        pty: None,
        kill_group_on_exit: true,
    };
    let mut h = st.host().exec(vm, spec).await.map_err(|e| {
        format!(
            "step {} ({}) could not start: {e}",
            s.index + 1,
            s.instruction
        )
    })?;
    let mut tail: Vec<String> = Vec::new();
    let mut pending = String::new();
    let status = loop {
        match h.events.recv().await {
            Some(ExecEvent::Stdout(b)) | Some(ExecEvent::Stderr(b)) => {
                pending.push_str(&String::from_utf8_lossy(&b));
                if let Some(i) = pending.rfind('\n') {
                    let done: String = pending.drain(..=i).collect();
                    log(st, id, Some(s.index), "output", &done);
                    tail.extend(done.lines().map(str::to_string));
                    let n = tail.len().saturating_sub(20);
                    tail.drain(..n);
                }
            }
            Some(ExecEvent::Exited(x)) => break x,
            None => {
                return Err(format!(
                    "step {} ({}): lost the build machine",
                    s.index + 1,
                    s.instruction
                ))
            }
        }
    };
    if !pending.is_empty() {
        log(st, id, Some(s.index), "output", &pending);
        tail.extend(pending.lines().map(str::to_string));
        let n = tail.len().saturating_sub(20);
        tail.drain(..n);
    }
    if status.code != Some(0) {
        let why = match (status.code, status.timed_out) {
            (_, true) => "timed out".to_string(),
            (Some(c), _) => format!("exited with code {c}"),
            (None, _) => format!("was killed by signal {}", status.signal.unwrap_or(0)),
        };
        return Err(format!(
            "step {} ({}) {why}; its last output:\n{}",
            s.index + 1,
            s.instruction,
            tail.join("\n")
        ));
    }
    // Keep the disk as this step's layer.
    let dir = layers(st).join(&s.key);
    let partial = layers(st).join(format!("{}.partial", s.key));
    let _ = std::fs::remove_dir_all(&partial);
    std::fs::create_dir_all(layers(st)).map_err(|e| e.to_string())?;
    st.host()
        .capture(vm, &partial, false)
        .await
        .map_err(|e| format!("step {}: keeping its disk failed: {e}", s.index + 1))?;
    {
        use std::os::unix::fs::PermissionsExt;
        for p in [
            st.config().data_dir.join("images"),
            layers(st),
            partial.clone(),
        ] {
            let _ = std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o711));
        }
        let _ = std::fs::set_permissions(
            partial.join("disk.qcow2"),
            std::fs::Permissions::from_mode(0o644),
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::rename(&partial, &dir).map_err(|e| e.to_string())?;
    let secs = started.elapsed().as_secs_f64();
    update(st, id, |d| {
        d.steps[s.index].state = "done".into();
        d.steps[s.index].seconds = Some(secs);
    });
    Ok(())
}
