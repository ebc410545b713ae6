//! The stateful code interpreter (contract §8): runs, and the contexts that
//! keep state between them.
//!
//! Each (sandbox, context) is one long-lived guest process started through
//! [`Host::exec`](runtime_host::Host::exec) with a stdin pipe: a small driver
//! (`guest/interp/driver.py` for Python, Bash and Go, `interp/driver.js` for
//! JavaScript and TypeScript, `interp/driver.R` for R,
//! `interp/RuntimeJShell.java` for Java) that reads one JSON line per run
//! (`{"id","code"}`) and answers with protocol lines on its stdout, each
//! `NONCE {json}` where the nonce is random per process and sent as its
//! first stdin line. The driver events
//! ([`DriverEvent`](crate::domain::interpreter::DriverEvent): `ready`,
//! `stdout`, `stderr`, `result`, `error`, `end`) map one to one onto the
//! streamed events of the API. Output that is not a protocol line (a child
//! process writing to the inherited stdout in JavaScript, whatever R prints)
//! counts as stdout; the driver's own stderr counts as stderr. How each
//! language keeps its state is in docs/interpreter.md.
//!
//! Runs of one context are serialized by the lock that holds its kernel. A
//! timeout sends SIGINT to the driver's process group: the driver stops the
//! code and keeps its state (status `timeout`); one that does not answer
//! within [`INTERRUPT_GRACE`] is killed (its state is then gone). A kernel
//! whose process ended answers `lost` for the run in progress and starts
//! again on the next.
//!
//! The contexts live in memory only, in the server's [`Contexts`] keyed by
//! sandbox id: a restart of the server, a stop or a pause of the sandbox
//! loses them (their next run starts a fresh process, `contextStarted:
//! true`).

use runtime_api::codes;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use futures::stream::BoxStream;
use runtime_host::{ExecControl, ExecEvent, ExecSpec};
use serde_json::{json, Value};
use tokio::sync::mpsc;

use crate::domain::access::KeyInfo;
use crate::domain::interpreter::{
    is_language, status, Cell, DriverEvent, Ended, Line, Lines, RunFacts, Step,
};
use crate::domain::process::{SIGINT, SIGKILL};
use crate::domain::time::iso;
use crate::error::{ApiError, ApiResult};
use crate::service::processes::run_as;
use crate::service::sandboxes::{find, find_running};
use crate::store::SandboxRow;
use crate::AppState;

const PY_DRIVER: &str = include_str!("../../../../guest/interp/driver.py");
const JS_DRIVER: &str = include_str!("../../../../guest/interp/driver.js");
const R_DRIVER: &str = include_str!("../../../../guest/interp/driver.R");
const JAVA_DRIVER: &str = include_str!("../../../../guest/interp/RuntimeJShell.java");

/// How long a kernel may take to print `ready`.
const START_TIMEOUT: Duration = Duration::from_secs(120);
/// How long an interrupted run may take to end before its kernel is killed.
const INTERRUPT_GRACE: Duration = Duration::from_secs(10);

/// The contexts of every sandbox, by sandbox id, then by context id.
#[derive(Default)]
pub(crate) struct Contexts {
    map: Mutex<HashMap<String, HashMap<String, Arc<Context>>>>,
}

impl Contexts {
    fn lock(&self) -> MutexGuard<'_, HashMap<String, HashMap<String, Arc<Context>>>> {
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn get(&self, sandbox_id: &str, id: &str) -> Option<Arc<Context>> {
        self.lock().get(sandbox_id).and_then(|m| m.get(id)).cloned()
    }

    /// The default context of `language`, made on first use.
    fn default_of(&self, st: &AppState, sandbox_id: &str, language: &str) -> Arc<Context> {
        self.lock()
            .entry(sandbox_id.to_string())
            .or_default()
            .entry(language.to_string())
            .or_insert_with(|| Context::new(st, sandbox_id, language, language, None, Vec::new()))
            .clone()
    }
}

/// One context: its settings, its count of runs and its kernel.
pub(crate) struct Context {
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
    fn new(
        st: &AppState,
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
            created_ms: st.now_ms(),
            count: AtomicU64::new(0),
            busy: AtomicBool::new(false),
            interrupted: AtomicBool::new(false),
            control: Mutex::new(None),
            kernel: tokio::sync::Mutex::new(None),
        })
    }

    fn control(&self) -> Option<mpsc::Sender<ExecControl>> {
        self.control
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    fn set_control(&self, c: Option<mpsc::Sender<ExecControl>>) {
        *self.control.lock().unwrap_or_else(|p| p.into_inner()) = c;
    }

    pub(crate) fn id(&self) -> &str {
        &self.id
    }

    /// The context as listed.
    pub(crate) fn info(&self) -> Value {
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
            let _ = c.send(ExecControl::Signal(SIGKILL)).await;
        }
    }
}

/// One driver process.
struct Kernel {
    events: mpsc::Receiver<ExecEvent>,
    control: mpsc::Sender<ExecControl>,
    lines: Lines,
    queue: VecDeque<Msg>,
}

enum Msg {
    Line(Line),
    Stderr(String),
    /// The process ended (how, when the host reported it).
    Died(Option<Ended>),
}

impl Kernel {
    /// Its handle closed while it waited between runs (a pause or a stop of
    /// the sandbox, or its process ended): nothing reaches it any more.
    fn gone(&self) -> bool {
        self.control.is_closed() || self.events.is_closed()
    }

    async fn next(&mut self) -> Msg {
        loop {
            if let Some(m) = self.queue.pop_front() {
                return m;
            }
            match self.events.recv().await {
                Some(ExecEvent::Stdout(b)) => {
                    let mut out = Vec::new();
                    self.lines.push(&b, &mut out);
                    self.queue.extend(out.into_iter().map(Msg::Line));
                }
                Some(ExecEvent::Stderr(b)) => {
                    return Msg::Stderr(String::from_utf8_lossy(&b).into_owned())
                }
                Some(ExecEvent::Exited(x)) => {
                    return Msg::Died(Some(Ended {
                        code: x.code,
                        signal: x.signal,
                        out_of_memory: x.oom_kills > 0,
                    }))
                }
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
        user: run_as(&row.record.user),
        timeout: None,
        stdin: true,
        pty: None,
        kill_group_on_exit: false,
        trace_files: false,
    };
    let h = st.host().exec(&row.record.id, spec).await?;
    st.inner.telemetry.process_started("interpreter");
    let nonce = uuid::Uuid::new_v4().simple().to_string();
    let mut k = Kernel {
        events: h.events,
        control: h.control,
        lines: Lines::new(&nonce),
        queue: VecDeque::new(),
    };
    let _ = k
        .control
        .send(ExecControl::Stdin(format!("{nonce}\n").into_bytes()))
        .await;
    let mut said = String::new();
    let ready = tokio::time::timeout(START_TIMEOUT, async {
        loop {
            match k.next().await {
                Msg::Line(Line::Event(DriverEvent::Ready)) => return true,
                Msg::Line(Line::Event(_)) => {}
                Msg::Line(Line::Plain(t)) | Msg::Stderr(t) => said.push_str(&t),
                Msg::Died(_) => return false,
            }
        }
    })
    .await;
    if ready != Ok(true) {
        let _ = k.control.send(ExecControl::Signal(SIGKILL)).await;
        tracing::warn!(sandbox_id = %row.record.id, context = %ctx.id, output = %said, "interpreter failed to start");
        return Err(ApiError::Failed {
            code: codes::INTERPRETER_START_FAILED,
            message: format!(
                "The {} interpreter of context {} did not start.",
                ctx.language, ctx.id
            ),
        });
    }
    Ok(k)
}

fn context_not_found(id: &str) -> ApiError {
    ApiError::NotFound {
        code: codes::CONTEXT_NOT_FOUND,
        what: "interpreter context",
        id: id.to_string(),
    }
}

/// `POST …/interpreter:run`, checked.
pub(crate) struct RunCommand {
    pub(crate) code: String,
    pub(crate) language: Option<String>,
    /// The context to run in (else the language's default one).
    pub(crate) context: Option<String>,
    /// 0: no timeout.
    pub(crate) timeout_ms: i64,
    pub(crate) stream: bool,
    pub(crate) interrupt_on_disconnect: bool,
}

/// `POST …/interpreter/contexts`, checked.
pub(crate) struct CreateContext {
    /// The context's id (else one is made).
    pub(crate) id: Option<String>,
    pub(crate) language: String,
    pub(crate) cwd: Option<String>,
    pub(crate) env: Vec<(String, String)>,
}

/// What a streamed run sends, in order; the stream ends after its
/// `Execution` or `Failure`.
pub(crate) enum RunEvent {
    /// A run event (`start`, `stdout`, `stderr`, `result`, `error`, `end`).
    Event(Value),
    /// The run's answer.
    Execution(Value),
    /// The run could not be made (its kernel did not start, …).
    Failure(ApiError),
}

/// What a run answers.
pub(crate) enum Ran {
    /// Its answer (an execution).
    Done(Value),
    Streaming(BoxStream<'static, RunEvent>),
}

/// Runs code in a context: the named one, or the language's default one
/// (created on first use).
pub(crate) async fn run(st: &AppState, key: &KeyInfo, id: &str, req: RunCommand) -> ApiResult<Ran> {
    let row = find_running(st, key, id).await?;
    let contexts = &st.inner.interpreter;
    let cx = match (&req.context, &req.language) {
        (Some(c), lang) => match contexts.get(&row.record.id, c) {
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
            None if is_language(c) && lang.as_ref().is_none_or(|l| l == c) => {
                contexts.default_of(st, &row.record.id, c)
            }
            None => return Err(context_not_found(c)),
        },
        (None, lang) => {
            contexts.default_of(st, &row.record.id, lang.as_deref().unwrap_or("python"))
        }
    };
    if !req.stream {
        let exec = run_cell(st, &row, &cx, &req, None).await?;
        return Ok(Ran::Done(exec));
    }
    let (tx, rx) = mpsc::channel::<RunEvent>(256);
    let st2 = st.clone();
    st.spawn(async move {
        let last = match run_cell(&st2, &row, &cx, &req, Some(tx.clone())).await {
            Ok(exec) => RunEvent::Execution(exec),
            Err(e) => RunEvent::Failure(e),
        };
        let _ = tx.send(last).await;
    });
    let events = futures::stream::unfold((rx, false), |(mut rx, done)| async move {
        if done {
            return None;
        }
        let ev = rx.recv().await?;
        let last = matches!(ev, RunEvent::Execution(_) | RunEvent::Failure(_));
        Some((ev, (rx, last)))
    });
    Ok(Ran::Streaming(Box::pin(events)))
}

/// The sandbox's contexts, oldest first.
pub(crate) fn contexts(st: &AppState, key: &KeyInfo, id: &str) -> ApiResult<Vec<Arc<Context>>> {
    find(st, key, id)?;
    let mut list: Vec<Arc<Context>> = st
        .inner
        .interpreter
        .lock()
        .get(id)
        .map(|m| m.values().cloned().collect())
        .unwrap_or_default();
    list.sort_by_key(|c| c.created_ms);
    Ok(list)
}

/// Creates a context (409 `context_exists` when the id is taken).
pub(crate) async fn create_context(
    st: &AppState,
    key: &KeyInfo,
    id: &str,
    req: CreateContext,
) -> ApiResult<Arc<Context>> {
    let row = find_running(st, key, id).await?;
    let cid = req
        .id
        .unwrap_or_else(|| format!("ctx-{}", &uuid::Uuid::new_v4().simple().to_string()[..12]));
    let cx = Context::new(st, &row.record.id, &cid, &req.language, req.cwd, req.env);
    let mut t = st.inner.interpreter.lock();
    let m = t.entry(row.record.id.clone()).or_default();
    if m.contains_key(&cid) {
        return Err(ApiError::Conflict {
            code: codes::CONTEXT_EXISTS,
            message: format!("Interpreter context {cid} already exists."),
            details: Some(json!({ "contextId": cid })),
        });
    }
    m.insert(cid, cx.clone());
    Ok(cx)
}

/// A context of a sandbox the key may see (404 `context_not_found`).
pub(crate) fn context(
    st: &AppState,
    key: &KeyInfo,
    id: &str,
    cid: &str,
) -> ApiResult<Arc<Context>> {
    find(st, key, id)?;
    st.inner
        .interpreter
        .get(id, cid)
        .ok_or_else(|| context_not_found(cid))
}

/// Kills the context's kernel: its next run starts a fresh one, counting
/// from 1.
pub(crate) async fn restart(cx: &Context) {
    cx.kill().await;
    let mut k = cx.kernel.lock().await;
    *k = None;
    cx.set_control(None);
    cx.count.store(0, Ordering::SeqCst);
}

/// Interrupts the run in progress (SIGINT); `false` when none runs.
pub(crate) async fn interrupt(cx: &Context) -> bool {
    if !cx.busy.load(Ordering::SeqCst) {
        return false;
    }
    let Some(c) = cx.control() else {
        return false;
    };
    cx.interrupted.store(true, Ordering::SeqCst);
    c.send(ExecControl::Signal(SIGINT)).await.is_ok()
}

/// Deletes a context, killing its kernel; `false` when there was none.
pub(crate) async fn delete_context(
    st: &AppState,
    key: &KeyInfo,
    id: &str,
    cid: &str,
) -> ApiResult<bool> {
    find(st, key, id)?;
    let cx = st
        .inner
        .interpreter
        .lock()
        .get_mut(id)
        .and_then(|m| m.remove(cid));
    if let Some(cx) = &cx {
        cx.kill().await;
    }
    Ok(cx.is_some())
}

/// A result a run stored by reference. Results always travel inline here
/// (no run writes a ref), so this is 404 `result_not_found` for a context
/// that exists.
pub(crate) fn result(
    st: &AppState,
    key: &KeyInfo,
    id: &str,
    cid: &str,
    name: &str,
) -> ApiResult<Value> {
    context(st, key, id, cid)?;
    Err(ApiError::NotFound {
        code: codes::RESULT_NOT_FOUND,
        what: "result",
        id: name.to_string(),
    })
}

/// Sends a streamed event; a reader that went away may interrupt the run.
struct Sink {
    tx: Option<mpsc::Sender<RunEvent>>,
    gone: bool,
}

impl Sink {
    async fn send(&mut self, v: Value) {
        if let Some(tx) = &self.tx {
            if tx.send(RunEvent::Event(v)).await.is_err() {
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
    req: &RunCommand,
    tx: Option<mpsc::Sender<RunEvent>>,
) -> ApiResult<Value> {
    let mut sink = Sink { tx, gone: false };
    let mut guard = cx.kernel.lock().await;
    let started = st.now_ms();
    let mut context_started = false;
    if guard.as_ref().is_some_and(Kernel::gone) {
        // Lost while idle: this run starts a fresh one.
        *guard = None;
        cx.set_control(None);
    }
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

    let mut cell = Cell::default();
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
                    let _ = kernel.control.send(ExecControl::Signal(SIGINT)).await;
                    deadline = Some(tokio::time::Instant::now() + INTERRUPT_GRACE);
                    continue;
                }
                Err(_) => {
                    // The driver did not stop: its state is gone.
                    let _ = kernel.control.send(ExecControl::Signal(SIGKILL)).await;
                    killed = true;
                    break;
                }
            },
            None => kernel.next().await,
        };
        if sink.gone && req.interrupt_on_disconnect && !disconnect_sent {
            disconnect_sent = true;
            cx.interrupted.store(true, Ordering::SeqCst);
            let _ = kernel.control.send(ExecControl::Signal(SIGINT)).await;
        }
        let step = match msg {
            Msg::Died(x) => {
                lost = true;
                died = x;
                Step::Nothing
            }
            Msg::Stderr(t) => Step::Send(cell.output(true, t)),
            Msg::Line(line) => cell.take(line, &exec_id),
        };
        match step {
            Step::Send(v) => sink.send(v).await,
            Step::End => break,
            Step::Nothing => {}
        }
    }
    if lost || killed {
        *guard = None;
        cx.set_control(None);
    }
    let interrupted = cx.interrupted.swap(false, Ordering::SeqCst);
    let status = status(lost, killed, timed_out, interrupted, cell.errored());
    if lost && !killed {
        cell.lose(died.as_ref());
    }
    cx.busy.store(false, Ordering::SeqCst);
    drop(guard);
    sink.send(json!({"k": "end"})).await;
    Ok(cell.execution(&RunFacts {
        id: &exec_id,
        context_id: &cx.id,
        language: &cx.language,
        count: n,
        status,
        duration_ms: (st.now_ms() - started).max(0),
        context_started,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::interpreter::LANGUAGES;

    #[test]
    fn every_language_has_a_driver() {
        for l in LANGUAGES {
            let argv = argv_for(l);
            assert!(argv.len() >= 3, "{l}");
        }
        assert_eq!(argv_for("go").last().map(String::as_str), Some("go"));
        assert_eq!(argv_for("javascript")[0], "node");
        assert!(argv_for("java").iter().any(|a| a.contains("class")));
    }
}
