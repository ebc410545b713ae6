//! The stateful code interpreter (contract §8): `POST …/interpreter:run` and
//! the contexts under `…/interpreter/contexts`.
//!
//! Each (sandbox, context) is one long-lived guest process started through
//! [`Host::exec`](runtime_host::Host::exec) with a stdin pipe: a small driver
//! (`interp/driver.py` for Python, Bash and Go, `interp/driver.js` for
//! JavaScript and TypeScript, `interp/driver.R` for R,
//! `interp/RuntimeJShell.java` for Java) that reads one JSON line per run
//! (`{"id","code"}`) and answers
//! with protocol lines on its stdout, each `NONCE {json}` where the nonce is
//! random per process and sent as its first stdin line. The driver events
//! (`k`: `ready`, `stdout`, `stderr`, `result`, `error`, `end`) map one to one
//! onto the streamed events of the API. Output that is not a protocol line
//! (a child process writing to the inherited stdout in JavaScript, whatever R
//! prints) counts as stdout; the driver's own stderr counts as stderr. How
//! each language keeps its state is in docs/interpreter.md.
//!
//! Runs of one context are serialized by the lock that holds its kernel. A
//! timeout sends SIGINT to the driver's process group: the driver stops the
//! code and keeps its state (status `timeout`); one that does not answer
//! within [`INTERRUPT_GRACE`] is killed (its state is then gone). A kernel
//! whose process ended answers `lost` for the run in progress and starts
//! again on the next.
//!
//! The contexts live in memory only, in a table keyed by sandbox id: a
//! restart of the server, a stop or a pause of the sandbox loses them (their
//! next run starts a fresh process, `contextStarted: true`).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, Mutex, MutexGuard};
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::{header, HeaderValue, Method, StatusCode};
use axum::response::Response;
use runtime_host::{ExecControl, ExecEvent, ExecSpec, RunAs};
use serde_json::{json, Value};
use tokio::sync::mpsc;

use crate::domain::time::iso;
use crate::error::{ApiError, ApiResult};
use crate::http::extract::{json_object, no_fields, Fields};
use crate::http::{Ctx, Reply};
use crate::service::clock::now_ms;
use crate::service::sandboxes::{find, find_running};
use crate::store::SandboxRow;
use crate::AppState;

const PY_DRIVER: &str = include_str!("interp/driver.py");
const JS_DRIVER: &str = include_str!("interp/driver.js");
const R_DRIVER: &str = include_str!("interp/driver.R");
const JAVA_DRIVER: &str = include_str!("interp/RuntimeJShell.java");

/// The languages of the contract, all installed in the default image.
const LANGUAGES: &[&str] = &[
    "python",
    "javascript",
    "typescript",
    "r",
    "java",
    "bash",
    "go",
];
const DEFAULT_TIMEOUT_MS: i64 = 60_000;
const MAX_TIMEOUT_MS: i64 = 86_400_000;
/// How long a kernel may take to print `ready`.
const START_TIMEOUT: Duration = Duration::from_secs(120);
/// How long an interrupted run may take to end before its kernel is killed.
const INTERRUPT_GRACE: Duration = Duration::from_secs(10);
/// Kept per stream in the JSON answer; the rest is counted in `lostBytes`.
const KEEP_BYTES: usize = 1 << 20;
const MAX_CODE_BYTES: usize = 4 << 20;

/// Contexts by sandbox id, then by context id.
type Table = Mutex<HashMap<String, HashMap<String, Arc<Context>>>>;
static CONTEXTS: LazyLock<Table> = LazyLock::new(Default::default);

fn table() -> MutexGuard<'static, HashMap<String, HashMap<String, Arc<Context>>>> {
    CONTEXTS.lock().unwrap_or_else(|p| p.into_inner())
}

struct Context {
    id: String,
    sandbox_id: String,
    language: String,
    cwd: String,
    env: Vec<(String, String)>,
    created_ms: i64,
    count: AtomicU64,
    busy: AtomicBool,
    /// Set by `:interrupt`, so the run reports `interrupted`.
    interrupted: AtomicBool,
    /// The running kernel's control, reachable while a run holds `kernel`.
    control: Mutex<Option<mpsc::Sender<ExecControl>>>,
    kernel: tokio::sync::Mutex<Option<Kernel>>,
}

impl Context {
    fn control(&self) -> Option<mpsc::Sender<ExecControl>> {
        self.control
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    fn set_control(&self, c: Option<mpsc::Sender<ExecControl>>) {
        *self.control.lock().unwrap_or_else(|p| p.into_inner()) = c;
    }

    fn info(&self) -> Value {
        json!({
            "id": self.id,
            "sandboxId": self.sandbox_id,
            "language": self.language,
            "cwd": self.cwd,
            "envNames": self.env.iter().map(|(k, _)| k).collect::<Vec<_>>(),
            "state": if self.busy.load(Ordering::SeqCst) { "busy" }
                     else if self.control().is_some() { "idle" } else { "stopped" },
            "executionCount": self.count.load(Ordering::SeqCst),
            "createdAt": iso(self.created_ms),
        })
    }

    /// Kills the kernel's process group (restart, delete).
    async fn kill(&self) {
        if let Some(c) = self.control() {
            let _ = c.send(ExecControl::Signal(9)).await;
        }
    }
}

/// One driver process.
struct Kernel {
    nonce: String,
    events: mpsc::Receiver<ExecEvent>,
    control: mpsc::Sender<ExecControl>,
    /// Stdout bytes not yet ending in a newline.
    line: Vec<u8>,
    queue: std::collections::VecDeque<Msg>,
}

enum Msg {
    Proto(Value),
    Stdout(String),
    Stderr(String),
    /// The process ended (its status, when the host reported one).
    Died(Option<runtime_host::ExitStatus>),
}

impl Kernel {
    fn split_stdout(&mut self, bytes: &[u8]) {
        self.line.extend_from_slice(bytes);
        let prefix = format!("{} ", self.nonce);
        while let Some(i) = self.line.iter().position(|b| *b == b'\n') {
            let rest = self.line.split_off(i + 1);
            let line = std::mem::replace(&mut self.line, rest);
            let body = &line[..line.len() - 1];
            match body.strip_prefix(prefix.as_bytes()) {
                Some(j) => match serde_json::from_slice::<Value>(j) {
                    Ok(v) => self.queue.push_back(Msg::Proto(v)),
                    Err(_) => self
                        .queue
                        .push_back(Msg::Stdout(String::from_utf8_lossy(&line).into_owned())),
                },
                None => self
                    .queue
                    .push_back(Msg::Stdout(String::from_utf8_lossy(&line).into_owned())),
            }
        }
        // A partial line that cannot start a protocol line goes out now.
        let p = prefix.as_bytes();
        let n = self.line.len().min(p.len());
        if !self.line.is_empty() && self.line[..n] != p[..n] {
            let line = std::mem::take(&mut self.line);
            self.queue
                .push_back(Msg::Stdout(String::from_utf8_lossy(&line).into_owned()));
        }
    }

    async fn next(&mut self) -> Msg {
        loop {
            if let Some(m) = self.queue.pop_front() {
                return m;
            }
            match self.events.recv().await {
                Some(ExecEvent::Stdout(b)) => self.split_stdout(&b),
                Some(ExecEvent::Stderr(b)) => {
                    return Msg::Stderr(String::from_utf8_lossy(&b).into_owned())
                }
                Some(ExecEvent::Exited(x)) => return Msg::Died(Some(x)),
                None => return Msg::Died(None),
            }
        }
    }
}

/// The driver process of a language (`go` and `bash` run under the Python
/// driver, which starts their tools).
fn argv_for(language: &str) -> Vec<String> {
    match language {
        "javascript" => vec!["node".into(), "-e".into(), JS_DRIVER.into()],
        "typescript" => vec![
            "node".into(),
            "-e".into(),
            JS_DRIVER.into(),
            "typescript".into(),
        ],
        // Line-buffered stdout (stdbuf), so what R prints streams as it runs.
        "r" => vec![
            "stdbuf".into(),
            "-oL".into(),
            "Rscript".into(),
            "--vanilla".into(),
            "-e".into(),
            "eval(parse(text = commandArgs(TRUE)[1]))".into(),
            R_DRIVER.into(),
        ],
        // The source launcher compiles the driver in memory; it needs a file.
        // C1 only and the serial collector: the JVM starts faster.
        "java" => vec![
            "bash".into(),
            "-c".into(),
            "d=$(mktemp -d /tmp/.runtime-java.XXXXXX) && printf %s \"$1\" > \"$d/RuntimeJShell.java\" \
             && exec java -XX:+UseSerialGC -XX:TieredStopAtLevel=1 -Djava.awt.headless=true \"$d/RuntimeJShell.java\""
                .into(),
            "bash".into(),
            JAVA_DRIVER.into(),
        ],
        other => vec![
            "python3".into(),
            "-u".into(),
            "-c".into(),
            PY_DRIVER.into(),
            other.into(),
        ],
    }
}

async fn start_kernel(st: &AppState, row: &SandboxRow, ctx: &Context) -> ApiResult<Kernel> {
    // OpenBLAS's detected kernel dies with SIGILL under the TCG CPU model.
    let mut env = vec![("OPENBLAS_CORETYPE".to_string(), "Prescott".to_string())];
    env.extend(crate::service::network::secret_env(st, &row.record.id));
    env.extend(row.env.iter().cloned());
    env.extend(ctx.env.iter().cloned());
    env.push(("PYTHONUNBUFFERED".into(), "1".into()));
    let spec = ExecSpec {
        argv: argv_for(&ctx.language),
        cwd: Some(ctx.cwd.clone()),
        env,
        user: if row.record.user == "root" {
            RunAs::Root
        } else {
            RunAs::Sandbox
        },
        timeout: None,
        stdin: true,
        pty: None,
        kill_group_on_exit: false,
    };
    let h = st.host().exec(&row.record.id, spec).await?;
    let nonce = uuid::Uuid::new_v4().simple().to_string();
    let mut k = Kernel {
        nonce,
        events: h.events,
        control: h.control,
        line: Vec::new(),
        queue: Default::default(),
    };
    let _ = k
        .control
        .send(ExecControl::Stdin(format!("{}\n", k.nonce).into_bytes()))
        .await;
    let mut said = String::new();
    let ready = tokio::time::timeout(START_TIMEOUT, async {
        loop {
            match k.next().await {
                Msg::Proto(v) if v["k"] == "ready" => return true,
                Msg::Proto(_) => {}
                Msg::Stdout(t) | Msg::Stderr(t) => said.push_str(&t),
                Msg::Died(_) => return false,
            }
        }
    })
    .await;
    if ready != Ok(true) {
        let _ = k.control.send(ExecControl::Signal(9)).await;
        tracing::warn!(sandbox_id = %row.record.id, context = %ctx.id, output = %said, "interpreter failed to start");
        return Err(ApiError::Failed {
            code: "interpreter_start_failed",
            message: format!(
                "The {} interpreter of context {} did not start.",
                ctx.language, ctx.id
            ),
        });
    }
    Ok(k)
}

fn bad_language() -> ApiError {
    ApiError::invalid(
        "language",
        format!("must be one of {}", LANGUAGES.join(", ")),
    )
}

fn valid_context_id(id: &str) -> bool {
    (1..=63).contains(&id.len())
        && id.as_bytes()[0].is_ascii_alphanumeric()
        && id
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
}

fn context_not_found(id: &str) -> ApiError {
    ApiError::NotFound {
        code: "context_not_found",
        what: "interpreter context",
        id: id.to_string(),
    }
}

fn new_context(
    sandbox_id: &str,
    id: &str,
    language: &str,
    cwd: Option<String>,
    env: Vec<(String, String)>,
) -> Arc<Context> {
    Arc::new(Context {
        id: id.to_string(),
        sandbox_id: sandbox_id.to_string(),
        language: language.to_string(),
        cwd: cwd.unwrap_or_else(|| "/workspace".into()),
        env,
        created_ms: now_ms(),
        count: AtomicU64::new(0),
        busy: AtomicBool::new(false),
        interrupted: AtomicBool::new(false),
        control: Mutex::new(None),
        kernel: tokio::sync::Mutex::new(None),
    })
}

fn get_context(sandbox_id: &str, id: &str) -> Option<Arc<Context>> {
    table().get(sandbox_id).and_then(|m| m.get(id)).cloned()
}

/// Everything under `/v1/sandboxes/{id}/interpreter`: `rest` are the
/// segments after `interpreter`, `verb` the action of the last one.
pub async fn handle(
    st: AppState,
    ctx: Ctx,
    method: Method,
    id: String,
    rest: Vec<String>,
    verb: Option<String>,
    body: Bytes,
) -> ApiResult<Reply> {
    let r: Vec<&str> = rest.iter().map(String::as_str).collect();
    let not_found = || ApiError::RouteNotFound {
        method: method.to_string(),
        path: format!("/v1/sandboxes/{id}/interpreter/{}", rest.join("/")),
    };
    match (&method, r.as_slice(), verb.as_deref()) {
        (&Method::POST, [], Some("run")) => run(st, ctx, id, body).await,
        (&Method::GET, ["contexts"], None) => {
            find(&st, &ctx.key, &id)?;
            let mut list: Vec<Arc<Context>> = table()
                .get(&id)
                .map(|m| m.values().cloned().collect())
                .unwrap_or_default();
            list.sort_by_key(|c| c.created_ms);
            let data: Vec<Value> = list.iter().map(|c| c.info()).collect();
            Reply::ok(json!({ "data": data }))
        }
        (&Method::POST, ["contexts"], None) => create(st, ctx, id, body).await,
        (&Method::POST, ["contexts", c], Some(v)) => {
            no_fields(&body)?;
            find(&st, &ctx.key, &id)?;
            let cx = get_context(&id, c).ok_or_else(|| context_not_found(c))?;
            match v {
                "restart" => {
                    cx.kill().await;
                    let mut k = cx.kernel.lock().await;
                    *k = None;
                    cx.set_control(None);
                    cx.count.store(0, Ordering::SeqCst);
                    drop(k);
                    Reply::ok(cx.info())
                }
                "interrupt" => {
                    let busy = cx.busy.load(Ordering::SeqCst);
                    let mut sent = false;
                    if busy {
                        if let Some(c) = cx.control() {
                            cx.interrupted.store(true, Ordering::SeqCst);
                            sent = c.send(ExecControl::Signal(2)).await.is_ok();
                        }
                    }
                    Reply::ok(json!({ "id": cx.id, "interrupted": sent }))
                }
                _ => Err(not_found()),
            }
        }
        (&Method::DELETE, ["contexts", c], None) => {
            find(&st, &ctx.key, &id)?;
            let cx = table().get_mut(&id).and_then(|m| m.remove(*c));
            if let Some(cx) = &cx {
                cx.kill().await;
            }
            Reply::ok(json!({ "id": c, "deleted": cx.is_some() }))
        }
        (&Method::GET, ["contexts", c, "results", _name], None) => {
            if ctx.key.read_only {
                return Err(ApiError::Forbidden {
                    action: "read interpreter output",
                });
            }
            find(&st, &ctx.key, &id)?;
            get_context(&id, c).ok_or_else(|| context_not_found(c))?;
            // Results always travel inline here; no run writes a ref.
            Err(ApiError::NotFound {
                code: "result_not_found",
                what: "result",
                id: rest.last().cloned().unwrap_or_default(),
            })
        }
        (_, [] | ["contexts"] | ["contexts", _] | ["contexts", _, "results", _], _) => {
            Err(ApiError::MethodNotAllowed {
                method: method.to_string(),
                path: format!("/v1/sandboxes/{id}/interpreter/{}", rest.join("/")),
            })
        }
        _ => Err(not_found()),
    }
}

async fn create(st: AppState, ctx: Ctx, id: String, body: Bytes) -> ApiResult<Reply> {
    let obj = json_object(&body)?;
    let mut f = Fields::new(&obj);
    let cid = f.string("id");
    let language = f.string("language");
    let cwd = f.string("cwd");
    let env = f.string_map("env", 256).unwrap_or_default();
    if let Some(c) = &cid {
        if !valid_context_id(c) {
            f.issue(
                "id",
                "must be 1-63 of [a-z0-9-], starting with a letter or digit",
            );
        }
    }
    if let Some(c) = &cwd {
        if !c.starts_with('/') {
            f.issue("cwd", "must be an absolute path");
        }
    }
    f.finish()?;
    let language = language.unwrap_or_else(|| {
        cid.as_deref()
            .filter(|c| LANGUAGES.contains(c))
            .unwrap_or("python")
            .to_string()
    });
    if !LANGUAGES.contains(&language.as_str()) {
        return Err(bad_language());
    }
    if let Some(c) = cid.as_deref() {
        if LANGUAGES.contains(&c) && c != language {
            return Err(ApiError::invalid(
                "id",
                format!("{c} is the default context of {c}; its language cannot be {language}"),
            ));
        }
    }
    let row = find_running(&st, &ctx.key, &id).await?;
    let cid =
        cid.unwrap_or_else(|| format!("ctx-{}", &uuid::Uuid::new_v4().simple().to_string()[..12]));
    let cx = new_context(&row.record.id, &cid, &language, cwd, env);
    {
        let mut t = table();
        let m = t.entry(row.record.id.clone()).or_default();
        if m.contains_key(&cid) {
            return Err(ApiError::Conflict {
                code: "context_exists",
                message: format!("Interpreter context {cid} already exists."),
                details: Some(json!({ "contextId": cid })),
            });
        }
        m.insert(cid.clone(), cx.clone());
    }
    Ok(Reply::Json(StatusCode::CREATED, cx.info()))
}

struct RunReq {
    code: String,
    language: Option<String>,
    context: Option<String>,
    timeout_ms: i64,
    stream: bool,
    interrupt_on_disconnect: bool,
}

fn parse_run(body: &[u8]) -> ApiResult<RunReq> {
    let obj = json_object(body)?;
    let mut f = Fields::new(&obj);
    let code = f.string("code");
    if !f.present("code") {
        f.issue("code", "is required");
    }
    if code.as_ref().is_some_and(|c| c.len() > MAX_CODE_BYTES) {
        f.issue("code", format!("must be at most {MAX_CODE_BYTES} bytes"));
    }
    let language = f.string("language");
    let context = f.string("context");
    let timeout_ms = f.int("timeoutMs", 0, MAX_TIMEOUT_MS);
    let stream = f.bool("stream").unwrap_or(false);
    let interrupt_on_disconnect = f.bool("interruptOnDisconnect").unwrap_or(false);
    if let Some(c) = &context {
        if !valid_context_id(c) {
            f.issue(
                "context",
                "must be 1-63 of [a-z0-9-], starting with a letter or digit",
            );
        }
    }
    if !language.as_deref().is_none_or(|l| LANGUAGES.contains(&l)) {
        f.issue(
            "language",
            format!("must be one of {}", LANGUAGES.join(", ")),
        );
    }
    f.finish()?;
    Ok(RunReq {
        code: code.unwrap_or_default(),
        language,
        context,
        timeout_ms: timeout_ms.unwrap_or(DEFAULT_TIMEOUT_MS),
        stream,
        interrupt_on_disconnect,
    })
}

async fn run(st: AppState, ctx: Ctx, id: String, body: Bytes) -> ApiResult<Reply> {
    let req = parse_run(&body)?;
    let row = find_running(&st, &ctx.key, &id).await?;
    // The context: named, or the language's default one (created on first use).
    let cx = match (&req.context, &req.language) {
        (Some(c), lang) => match get_context(&row.record.id, c) {
            Some(cx) => {
                if let Some(l) = lang {
                    if *l != cx.language {
                        return Err(ApiError::invalid(
                            "language",
                            format!("context {c} runs {}, not {l}", cx.language),
                        ));
                    }
                }
                cx
            }
            None if LANGUAGES.contains(&c.as_str()) && lang.as_ref().is_none_or(|l| l == c) => {
                default_context(&row.record.id, c)
            }
            None => return Err(context_not_found(c)),
        },
        (None, lang) => default_context(&row.record.id, lang.as_deref().unwrap_or("python")),
    };
    if !req.stream {
        let exec = run_cell(&st, &row, &cx, &req, None).await?;
        return Reply::ok(exec);
    }
    let (tx, rx) = mpsc::channel::<Value>(256);
    let st2 = st.clone();
    st.spawn(async move {
        let tx2 = tx.clone();
        match run_cell(&st2, &row, &cx, &req, Some(tx)).await {
            Ok(exec) => {
                let _ = tx2.send(json!({"k": "execution", "execution": exec})).await;
            }
            Err(e) => {
                let b = e.body("");
                let _ = tx2
                    .send(
                        json!({"k": "failure", "code": b.error.code, "message": b.error.message,
                                 "hint": b.error.hint, "status": b.error.status}),
                    )
                    .await;
            }
        }
    });
    Ok(Reply::Raw(stream_response(&st, rx)))
}

fn default_context(sandbox_id: &str, language: &str) -> Arc<Context> {
    let mut t = table();
    t.entry(sandbox_id.to_string())
        .or_default()
        .entry(language.to_string())
        .or_insert_with(|| new_context(sandbox_id, language, language, None, Vec::new()))
        .clone()
}

fn stream_response(st: &AppState, rx: mpsc::Receiver<Value>) -> Response {
    let heartbeat = st.config().heartbeat;
    let stream = futures::stream::unfold((rx, false), move |(mut rx, done)| async move {
        if done {
            return None;
        }
        match tokio::time::timeout(heartbeat, rx.recv()).await {
            Err(_) => Some((
                Ok::<_, std::convert::Infallible>(Bytes::from_static(b"\n")),
                (rx, false),
            )),
            Ok(None) => None,
            Ok(Some(v)) => {
                let last = v["k"] == "execution" || v["k"] == "failure";
                let mut line = serde_json::to_vec(&v).unwrap_or_default();
                line.push(b'\n');
                Some((Ok(Bytes::from(line)), (rx, last)))
            }
        }
    });
    let mut resp = Response::new(Body::from_stream(stream));
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/x-ndjson"),
    );
    resp.headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    resp
}

#[derive(Default)]
struct Out {
    text: String,
    total: u64,
    lost: u64,
}

impl Out {
    fn add(&mut self, t: &str) {
        self.total += t.len() as u64;
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

/// Sends a streamed event; a reader that went away may interrupt the run.
struct Sink {
    tx: Option<mpsc::Sender<Value>>,
    gone: bool,
}

impl Sink {
    async fn send(&mut self, v: Value) {
        if let Some(tx) = &self.tx {
            if tx.send(v).await.is_err() {
                self.tx = None;
                self.gone = true;
            }
        }
    }
}

async fn run_cell(
    st: &AppState,
    row: &SandboxRow,
    cx: &Arc<Context>,
    req: &RunReq,
    tx: Option<mpsc::Sender<Value>>,
) -> ApiResult<Value> {
    let mut sink = Sink { tx, gone: false };
    let mut guard = cx.kernel.lock().await;
    let started = now_ms();
    let mut context_started = false;
    if guard.is_none() {
        let k = start_kernel(st, row, cx).await?;
        context_started = true;
        *guard = Some(k);
    }
    let Some(kernel) = guard.as_mut() else {
        return Err(ApiError::Internal {
            what: "kernel missing".into(),
        });
    };
    cx.set_control(Some(kernel.control.clone()));
    cx.busy.store(true, Ordering::SeqCst);
    cx.interrupted.store(false, Ordering::SeqCst);
    let n = cx.count.fetch_add(1, Ordering::SeqCst) + 1;
    let exec_id = format!("exec_{}", uuid::Uuid::new_v4().simple());
    sink.send(json!({"k": "start", "n": n, "id": exec_id}))
        .await;
    let line = json!({"id": exec_id, "code": req.code}).to_string() + "\n";
    let sent = kernel
        .control
        .send(ExecControl::Stdin(line.into_bytes()))
        .await
        .is_ok();

    let mut stdout = Out::default();
    let mut stderr = Out::default();
    let mut results: Vec<Value> = Vec::new();
    let mut error = Value::Null;
    let mut status = "ok";
    let mut timed_out = false;
    let mut killed = false;
    let mut lost = !sent;
    let mut deadline = (req.timeout_ms > 0)
        .then(|| tokio::time::Instant::now() + Duration::from_millis(req.timeout_ms as u64));
    let mut disconnect_sent = false;
    let mut died = None;
    while !lost {
        let msg = match deadline {
            Some(d) => match tokio::time::timeout_at(d, kernel.next()).await {
                Ok(m) => m,
                Err(_) if !timed_out => {
                    timed_out = true;
                    let _ = kernel.control.send(ExecControl::Signal(2)).await;
                    deadline = Some(tokio::time::Instant::now() + INTERRUPT_GRACE);
                    continue;
                }
                Err(_) => {
                    // The driver did not stop: its state is gone.
                    let _ = kernel.control.send(ExecControl::Signal(9)).await;
                    killed = true;
                    break;
                }
            },
            None => kernel.next().await,
        };
        if sink.gone && req.interrupt_on_disconnect && !disconnect_sent {
            disconnect_sent = true;
            cx.interrupted.store(true, Ordering::SeqCst);
            let _ = kernel.control.send(ExecControl::Signal(2)).await;
        }
        match msg {
            Msg::Died(x) => {
                lost = true;
                died = x;
            }
            Msg::Stdout(t) => {
                stdout.add(&t);
                sink.send(json!({"k": "stdout", "text": t})).await;
            }
            Msg::Stderr(t) => {
                stderr.add(&t);
                sink.send(json!({"k": "stderr", "text": t})).await;
            }
            Msg::Proto(v) => {
                match v["k"].as_str() {
                    Some("stdout") | Some("stderr") => {
                        let t = v["text"].as_str().unwrap_or_default();
                        if v["k"] == "stdout" {
                            stdout.add(t);
                        } else {
                            stderr.add(t);
                        }
                        sink.send(v).await;
                    }
                    Some("result") => {
                        let r = json!({
                            "main": v["main"].as_bool().unwrap_or(false),
                            "data": v["data"],
                            "refs": [],
                        });
                        sink.send(json!({"k": "result", "main": r["main"], "data": r["data"], "refs": []}))
                        .await;
                        results.push(r);
                    }
                    Some("error") => {
                        error = json!({
                            "name": v["name"],
                            "value": v["value"],
                            "traceback": v["traceback"],
                        });
                        status = "error";
                        sink.send(json!({"k": "error", "name": v["name"], "value": v["value"],
                                     "traceback": v["traceback"]}))
                            .await;
                    }
                    Some("end") if v["id"] == exec_id.as_str() => break,
                    _ => {}
                }
            }
        }
    }
    if lost || killed {
        *guard = None;
        cx.set_control(None);
    }
    let interrupted = cx.interrupted.swap(false, Ordering::SeqCst);
    if lost && !killed {
        status = "lost";
        if error.is_null() {
            let how = match &died {
                Some(x) if x.out_of_memory => "ran out of memory".to_string(),
                Some(x) => match (x.code, x.signal) {
                    (_, Some(sig)) => format!("was killed by signal {sig}"),
                    (Some(c), None) => format!("exited with code {c}"),
                    (None, None) => "ended".to_string(),
                },
                None => "could no longer be reached".to_string(),
            };
            error = json!({"name": "ContextLost", "value": format!("The interpreter process {how}; the next run starts it again with empty state."), "traceback": ""});
        }
    } else if timed_out {
        status = "timeout";
    } else if interrupted && status == "error" {
        status = "interrupted";
    }
    cx.busy.store(false, Ordering::SeqCst);
    drop(guard);
    sink.send(json!({"k": "end"})).await;
    Ok(json!({
        "id": exec_id,
        "contextId": cx.id,
        "language": cx.language,
        "executionCount": n,
        "status": status,
        "stdout": stdout.text,
        "stderr": stderr.text,
        "results": results,
        "error": error,
        "overflow": stdout.lost + stderr.lost > 0,
        "durationMs": (now_ms() - started).max(0),
        "contextStarted": context_started,
        "lostBytes": stdout.lost + stderr.lost,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn protocol_lines_are_split_from_plain_output() {
        let (_tx, events) = mpsc::channel(1);
        let (control, _rx) = mpsc::channel(1);
        let mut k = Kernel {
            nonce: "abc".into(),
            events,
            control,
            line: Vec::new(),
            queue: Default::default(),
        };
        k.split_stdout(b"abc {\"k\":\"end\"}\nplain\nab");
        k.split_stdout(b"c {\"k\":\"ready\"}\nxyz");
        let got: Vec<String> = k
            .queue
            .iter()
            .map(|m| match m {
                Msg::Proto(v) => format!("P{}", v["k"].as_str().unwrap_or("")),
                Msg::Stdout(t) => format!("O{t}"),
                Msg::Stderr(t) => format!("E{t}"),
                Msg::Died(_) => "D".into(),
            })
            .collect();
        assert_eq!(got, vec!["Pend", "Oplain\n", "Pready", "Oxyz"]);
    }

    #[test]
    fn context_ids_and_languages() {
        assert!(valid_context_id("python"));
        assert!(valid_context_id("ctx-1"));
        assert!(!valid_context_id("-a"));
        assert!(!valid_context_id("A"));
        assert!(matches!(bad_language(), ApiError::Invalid { .. }));
        assert!(parse_run(br#"{"code":"1","language":"cobol"}"#).is_err());
        for l in LANGUAGES {
            let body = json!({"code": "1", "language": l}).to_string();
            assert!(parse_run(body.as_bytes()).is_ok(), "{l}");
            assert!(!argv_for(l).is_empty());
        }
        assert_eq!(LANGUAGES.len(), 7);
    }
}
