//! `runtime sandbox ...`: the sandbox commands, as an HTTP client of any
//! server that speaks the API (docs/cli.md). Each command is one function
//! that calls the API and prints what a person (or with `--json`, a
//! script) needs; a failure is one line on stderr and a non-zero exit.

use std::io::{IsTerminal, Read};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use base64::Engine;
use bytes::Bytes;
use clap::{Args, Subcommand};
use serde_json::{json, Map, Value};

use crate::client::{enc, query, ConnArgs, Target};
use crate::output::{self, cell, Ended, Follow, Lines};
use crate::{copy, forward, shell};

#[derive(Args)]
pub(crate) struct SandboxArgs {
    #[command(flatten)]
    conn: ConnArgs,
    #[command(subcommand)]
    cmd: SandboxCmd,
}

#[derive(Subcommand)]
enum SandboxCmd {
    /// Create a sandbox and print its id once it runs.
    Create(CreateArgs),
    /// List sandboxes (oldest first).
    #[command(alias = "list")]
    Ls {
        /// Only in this state (repeatable).
        #[arg(long)]
        state: Vec<String>,
        /// Only with this label, k=v (repeatable).
        #[arg(long, value_name = "K=V")]
        label: Vec<String>,
        /// Stopped ones too.
        #[arg(long)]
        all: bool,
        #[arg(long)]
        json: bool,
    },
    /// Show one sandbox.
    Get {
        sandbox: String,
        #[arg(long)]
        json: bool,
    },
    /// Run a command, streaming its output; exits with its exit code.
    Exec(ExecArgs),
    /// An interactive terminal in the sandbox.
    Shell {
        sandbox: String,
        /// Another program than the default login shell.
        #[arg(long)]
        command: Option<String>,
        #[arg(long)]
        cwd: Option<String>,
        /// `sandbox` or `root`.
        #[arg(long)]
        user: Option<String>,
    },
    /// Copy files and folders: `cp ./dir SBX:/workspace/dir`, `cp SBX:/path ./local`.
    Cp { source: String, destination: String },
    /// What a process wrote (all of it so far; `-f` follows until it ends).
    /// Without a process, lists the processes.
    Logs {
        sandbox: String,
        process: Option<String>,
        #[arg(short = 'f', long)]
        follow: bool,
        #[arg(long)]
        json: bool,
    },
    /// Pause: save the memory and stop the machine (billing stops).
    Pause {
        sandbox: String,
        #[arg(long)]
        json: bool,
    },
    /// Wake a paused sandbox.
    Wake {
        sandbox: String,
        #[arg(long)]
        json: bool,
    },
    /// Running copies of a sandbox; prints their ids.
    Fork {
        sandbox: String,
        #[arg(long)]
        count: Option<u32>,
        #[arg(long)]
        json: bool,
    },
    /// Snapshot a sandbox; prints the snapshot's id once it is ready.
    Snapshot {
        sandbox: String,
        #[arg(long)]
        name: Option<String>,
        /// `memory` (the default) or `disk`.
        #[arg(long)]
        mode: Option<String>,
        /// Days to keep it (1 to 365; 7 by default).
        #[arg(long)]
        retention: Option<u32>,
        #[arg(long)]
        json: bool,
    },
    /// Preview addresses: with a port, make (or with --rm remove) one;
    /// without, list them.
    Preview {
        sandbox: String,
        port: Option<u16>,
        /// Reachable without its token.
        #[arg(long)]
        public: bool,
        /// Seconds it lasts.
        #[arg(long)]
        ttl: Option<u64>,
        /// Remove the port's preview.
        #[arg(long, requires = "port")]
        rm: bool,
        #[arg(long)]
        json: bool,
    },
    /// Forward local ports to ports on the sandbox's loopback
    /// (`5432`, or `15432:5432` for local:remote), until Ctrl-C.
    PortForward {
        sandbox: String,
        #[arg(required = true, value_name = "[LOCAL:]REMOTE")]
        ports: Vec<String>,
        /// The local address to listen on.
        #[arg(long, default_value = "127.0.0.1")]
        address: String,
    },
    /// Delete sandboxes for good (any state).
    #[command(alias = "delete")]
    Rm {
        #[arg(required = true)]
        sandboxes: Vec<String>,
        #[arg(long)]
        json: bool,
    },
}

#[derive(Args)]
struct CreateArgs {
    #[arg(long)]
    name: Option<String>,
    /// k=v (repeatable).
    #[arg(long, value_name = "K=V")]
    label: Vec<String>,
    #[arg(long)]
    vcpu: Option<u32>,
    /// Memory in MiB.
    #[arg(long)]
    memory: Option<u64>,
    /// Disk in MiB.
    #[arg(long)]
    disk: Option<u64>,
    /// The lease in seconds (none by default).
    #[arg(long)]
    timeout: Option<u64>,
    /// What the lease's end does: pause, stop or delete.
    #[arg(long)]
    on_timeout: Option<String>,
    /// An image: id, name, name:tag or name@version.
    #[arg(long)]
    image: Option<String>,
    /// Start from a snapshot.
    #[arg(long)]
    snapshot: Option<String>,
    /// K=V for every command in it (repeatable; never shown again).
    #[arg(long, value_name = "K=V")]
    env: Vec<String>,
    /// Seconds with nothing happening before it pauses (0: never).
    #[arg(long)]
    idle_pause: Option<u64>,
    /// A paused sandbox stays paused until `wake`.
    #[arg(long)]
    no_auto_wake: bool,
    #[arg(long)]
    persistent: bool,
    /// With --name: the sandbox that already has the name, if any.
    #[arg(long, requires = "name")]
    get_or_create: bool,
    /// Answer at once, without waiting for it to run.
    #[arg(long)]
    no_wait: bool,
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
struct ExecArgs {
    sandbox: String,
    /// One argument runs in `bash -c`; several run as they are.
    #[arg(required = true, trailing_var_arg = true, allow_hyphen_values = true)]
    command: Vec<String>,
    #[arg(long)]
    cwd: Option<String>,
    /// K=V (repeatable).
    #[arg(long, value_name = "K=V")]
    env: Vec<String>,
    /// `sandbox` or `root`.
    #[arg(long)]
    user: Option<String>,
    /// Seconds before the command is killed (exit 124).
    #[arg(long)]
    timeout: Option<u64>,
    /// One JSON result instead of streaming (64 KiB per stream).
    #[arg(long)]
    json: bool,
}

/// Runs a sandbox command; the process's exit status.
pub(crate) async fn run(args: SandboxArgs) -> anyhow::Result<i32> {
    let t = args.conn.target()?;
    match args.cmd {
        SandboxCmd::Create(a) => create(&t, a).await,
        SandboxCmd::Ls {
            state,
            label,
            all,
            json,
        } => ls(&t, &state, &label, all, json).await,
        SandboxCmd::Get { sandbox, json } => {
            let id = resolve(&t, &sandbox).await?;
            let v = t
                .json("GET", &format!("/v1/sandboxes/{}", enc(&id)), None)
                .await?;
            if json {
                output::json(&v);
            } else {
                describe(&v);
            }
            Ok(0)
        }
        SandboxCmd::Exec(a) => exec(&t, a).await,
        SandboxCmd::Shell {
            sandbox,
            command,
            cwd,
            user,
        } => {
            let id = resolve(&t, &sandbox).await?;
            shell::run(&t, &id, command, cwd, user).await
        }
        SandboxCmd::Cp {
            source,
            destination,
        } => copy::run(&t, &source, &destination).await.map(|()| 0),
        SandboxCmd::Logs {
            sandbox,
            process,
            follow,
            json,
        } => {
            let id = resolve(&t, &sandbox).await?;
            logs(&t, &id, process, follow, json).await
        }
        SandboxCmd::Pause { sandbox, json } => lifecycle(&t, &sandbox, "pause", json).await,
        SandboxCmd::Wake { sandbox, json } => lifecycle(&t, &sandbox, "wake", json).await,
        SandboxCmd::Fork {
            sandbox,
            count,
            json,
        } => {
            let id = resolve(&t, &sandbox).await?;
            let mut body = Map::new();
            if let Some(c) = count {
                body.insert("count".into(), json!(c));
            }
            output::progress(&format!("forking {id} ..."));
            let v = t
                .json_with(
                    "POST",
                    &format!("/v1/sandboxes/{}:fork", enc(&id)),
                    Some(&Value::Object(body)),
                    &[("prefer", "wait=120")],
                )
                .await?;
            let mut copies = match v["sandboxes"].as_array() {
                Some(a) => a.clone(),
                None => vec![v.clone()],
            };
            for c in copies.iter_mut() {
                if c["state"].as_str() == Some("starting") {
                    let cid = c["id"].as_str().unwrap_or_default().to_string();
                    *c = wait_running(&t, &cid, c.clone()).await?;
                }
            }
            if json {
                output::json(&json!({ "sandboxes": copies }));
            } else {
                for c in &copies {
                    println!("{}", c["id"].as_str().unwrap_or("?"));
                }
            }
            Ok(0)
        }
        SandboxCmd::Snapshot {
            sandbox,
            name,
            mode,
            retention,
            json,
        } => snapshot(&t, &sandbox, name, mode, retention, json).await,
        SandboxCmd::Preview {
            sandbox,
            port,
            public,
            ttl,
            rm,
            json,
        } => {
            let id = resolve(&t, &sandbox).await?;
            preview(&t, &id, port, public, ttl, rm, json).await
        }
        SandboxCmd::PortForward {
            sandbox,
            ports,
            address,
        } => {
            let specs = ports
                .iter()
                .map(|p| forward::parse_spec(p))
                .collect::<anyhow::Result<Vec<_>>>()?;
            let id = resolve(&t, &sandbox).await?;
            forward::run(&t, &id, &address, &specs).await.map(|()| 0)
        }
        SandboxCmd::Rm { sandboxes, json } => {
            for s in sandboxes {
                let id = resolve(&t, &s).await?;
                let v = t
                    .json("DELETE", &format!("/v1/sandboxes/{}", enc(&id)), None)
                    .await?;
                if json {
                    println!("{v}");
                } else {
                    println!("deleted {id}");
                }
            }
            Ok(0)
        }
    }
}

/// A sandbox's id from what the user typed: an id as it is, or the name of
/// one live sandbox.
pub(crate) async fn resolve(t: &Target, given: &str) -> anyhow::Result<String> {
    if looks_like_id(given) {
        return Ok(given.to_string());
    }
    let v = t
        .json(
            "GET",
            &format!(
                "/v1/sandboxes{}",
                query(&[("name", given.to_string()), ("limit", "2".into())])
            ),
            None,
        )
        .await?;
    match v["data"].as_array().map(Vec::as_slice) {
        Some([one]) => Ok(one["id"].as_str().unwrap_or(given).to_string()),
        // Not a name: the id as typed, so the API says what is wrong.
        _ => Ok(given.to_string()),
    }
}

fn looks_like_id(s: &str) -> bool {
    s.len() == 36
        && s.chars().enumerate().all(|(i, c)| {
            if [8, 13, 18, 23].contains(&i) {
                c == '-'
            } else {
                c.is_ascii_hexdigit()
            }
        })
}

/// `K=V` pairs as a JSON object; `what` names the option in errors.
pub(crate) fn pairs(items: &[String], what: &str) -> anyhow::Result<Map<String, Value>> {
    let mut m = Map::new();
    for i in items {
        let (k, v) = i
            .split_once('=')
            .with_context(|| format!("{what} {i:?}: expected K=V"))?;
        if k.is_empty() {
            bail!("{what} {i:?}: the name is empty");
        }
        m.insert(k.to_string(), json!(v));
    }
    Ok(m)
}

async fn create(t: &Target, a: CreateArgs) -> anyhow::Result<i32> {
    let mut b = Map::new();
    let mut put = |k: &str, v: Value| {
        b.insert(k.to_string(), v);
    };
    if let Some(n) = &a.name {
        put("name", json!(n));
    }
    if !a.label.is_empty() {
        put("labels", Value::Object(pairs(&a.label, "--label")?));
    }
    if !a.env.is_empty() {
        put("env", Value::Object(pairs(&a.env, "--env")?));
    }
    if let Some(v) = a.vcpu {
        put("vcpu", json!(v));
    }
    if let Some(v) = a.memory {
        put("memoryMiB", json!(v));
    }
    if let Some(v) = a.disk {
        put("diskMiB", json!(v));
    }
    if let Some(v) = a.timeout {
        put("timeoutSeconds", json!(v));
    }
    if let Some(v) = &a.on_timeout {
        put("onLeaseEnd", json!(v));
    }
    if let Some(v) = &a.image {
        put("image", json!(v));
    }
    if let Some(v) = &a.snapshot {
        put("snapshot", json!(v));
    }
    if let Some(v) = a.idle_pause {
        put("idlePauseSeconds", json!(v));
    }
    if a.no_auto_wake {
        put("autoWake", json!(false));
    }
    if a.persistent {
        put("persistent", json!(true));
    }
    if a.get_or_create {
        put("getOrCreate", json!(true));
    }
    let started = Instant::now();
    let wait: &[(&str, &str)] = if a.no_wait {
        &[]
    } else {
        output::progress("creating a sandbox ...");
        &[("prefer", "wait=120")]
    };
    let mut v = t
        .json_with("POST", "/v1/sandboxes", Some(&Value::Object(b)), wait)
        .await
        .map_err(|e| rename_fields(e, CREATE_FLAGS))?;
    let id = v["id"]
        .as_str()
        .context("the server's answer has no sandbox id")?
        .to_string();
    if !a.no_wait {
        v = wait_running(t, &id, v).await?;
        eprintln!(
            "runtime: {id} is {} ({:.1} s)",
            v["state"].as_str().unwrap_or("?"),
            started.elapsed().as_secs_f64()
        );
    }
    if a.json {
        output::json(&v);
    } else {
        println!("{id}");
    }
    Ok(0)
}

/// The sandbox once it left `starting` (a start slower than the server's
/// own wait: ask again, a minute at a time, for up to ten).
async fn wait_running(t: &Target, id: &str, mut v: Value) -> anyhow::Result<Value> {
    let mut tries = 0;
    while v["state"].as_str() == Some("starting") && tries < 10 {
        tries += 1;
        output::progress(&format!("{id} is still starting ..."));
        v = t
            .json(
                "GET",
                &format!(
                    "/v1/sandboxes/{}?waitFor=running&timeoutSeconds=60",
                    enc(id)
                ),
                None,
            )
            .await?;
    }
    Ok(v)
}

/// An API refusal that names fields, with the options that set them named
/// instead (`--memory`, not `memoryMiB`).
fn rename_fields(e: anyhow::Error, flags: &[(&str, &str)]) -> anyhow::Error {
    match e.downcast::<crate::client::ApiFailure>() {
        Ok(mut f) => {
            for (field, _) in f.issues.iter_mut() {
                if let Some((_, flag)) = flags.iter().find(|(k, _)| k == field) {
                    *field = flag.to_string();
                }
            }
            f.into()
        }
        Err(e) => e,
    }
}

/// The API's field names as the options that set them, for errors.
const CREATE_FLAGS: &[(&str, &str)] = &[
    ("memoryMiB", "--memory"),
    ("diskMiB", "--disk"),
    ("timeoutSeconds", "--timeout"),
    ("onLeaseEnd", "--on-timeout"),
    ("idlePauseSeconds", "--idle-pause"),
    ("autoWake", "--no-auto-wake"),
    ("getOrCreate", "--get-or-create"),
    ("labels", "--label"),
    ("env", "--env"),
    ("vcpu", "--vcpu"),
    ("name", "--name"),
    ("image", "--image"),
    ("snapshot", "--snapshot"),
];

async fn ls(
    t: &Target,
    states: &[String],
    labels: &[String],
    all: bool,
    json: bool,
) -> anyhow::Result<i32> {
    let mut q: Vec<(&str, String)> = states.iter().map(|s| ("state", s.clone())).collect();
    for l in labels {
        let (k, v) = l
            .split_once('=')
            .with_context(|| format!("--label {l:?}: expected K=V"))?;
        q.push(("label", format!("{k}:{v}")));
    }
    if all {
        q.push(("includeStopped", "true".into()));
    }
    let rows = t.list_all("/v1/sandboxes", &q).await?;
    if json {
        output::json(&Value::Array(rows));
        return Ok(0);
    }
    let table: Vec<Vec<String>> = rows
        .iter()
        .map(|s| {
            vec![
                cell(&s["id"]),
                cell(&s["name"]),
                cell(&s["state"]),
                cell(&s["vcpu"]),
                cell(&s["memoryMiB"]),
                cell(&s["image"]),
                cell(&s["labels"]),
                cell(&s["createdAt"]),
            ]
        })
        .collect();
    output::table(
        &[
            "ID",
            "NAME",
            "STATE",
            "VCPU",
            "MEMORY MiB",
            "IMAGE",
            "LABELS",
            "CREATED",
        ],
        &table,
    );
    Ok(0)
}

/// A sandbox for people: the fields that say what it is and what will
/// happen to it.
fn describe(v: &Value) {
    let fields = [
        ("id", "id"),
        ("name", "name"),
        ("state", "state"),
        ("stop reason", "stopReason"),
        ("image", "image"),
        ("vcpu", "vcpu"),
        ("memory MiB", "memoryMiB"),
        ("disk MiB", "diskMiB"),
        ("labels", "labels"),
        ("env", "envNames"),
        ("created", "createdAt"),
        ("lease ends", "endsAt"),
        ("at lease end", "onLeaseEnd"),
        ("idle pause s", "idlePauseSeconds"),
        ("auto wake", "autoWake"),
        ("persistent", "persistent"),
        ("paused at", "pausedAt"),
        ("charged µ$", "chargedMicros"),
        ("held µ$", "heldMicros"),
    ];
    let rows: Vec<Vec<String>> = fields
        .iter()
        .filter(|(_, k)| !v[*k].is_null())
        .map(|(label, k)| {
            let c = match &v[*k] {
                Value::Array(a) => a.iter().map(cell).collect::<Vec<_>>().join(","),
                other => cell(other),
            };
            vec![format!("{label}:"), c]
        })
        .collect();
    let width = rows.iter().map(|r| r[0].len()).max().unwrap_or(0);
    for r in rows {
        println!("{:<width$} {}", r[0], r[1]);
    }
}

async fn lifecycle(t: &Target, sandbox: &str, verb: &str, json: bool) -> anyhow::Result<i32> {
    let id = resolve(t, sandbox).await?;
    let started = Instant::now();
    let v = t
        .json_with(
            "POST",
            &format!("/v1/sandboxes/{}:{verb}", enc(&id)),
            Some(&json!({})),
            &[("prefer", "wait=120")],
        )
        .await?;
    if json {
        output::json(&v);
    } else {
        println!(
            "{id} {} ({:.1} s)",
            v["state"].as_str().unwrap_or("?"),
            started.elapsed().as_secs_f64()
        );
    }
    Ok(0)
}

/// Stdin for the command when it is a pipe or a file (never a terminal,
/// and never /dev/null's nothing), up to the API's 1 MiB.
fn piped_stdin() -> anyhow::Result<Option<Vec<u8>>> {
    let stdin = std::io::stdin();
    if stdin.is_terminal() {
        return Ok(None);
    }
    // SAFETY: fstat on fd 0 into a zeroed struct.
    let mode = unsafe {
        let mut st: libc::stat = std::mem::zeroed();
        if libc::fstat(0, &mut st) != 0 {
            return Ok(None);
        }
        st.st_mode & libc::S_IFMT
    };
    if mode != libc::S_IFIFO && mode != libc::S_IFREG {
        return Ok(None);
    }
    let mut data = Vec::new();
    stdin
        .lock()
        .take((1 << 20) + 1)
        .read_to_end(&mut data)
        .context("reading stdin")?;
    if data.len() > 1 << 20 {
        bail!("stdin holds more than 1 MiB; copy a file in with `runtime sandbox cp` instead");
    }
    Ok((!data.is_empty()).then_some(data))
}

async fn exec(t: &Target, a: ExecArgs) -> anyhow::Result<i32> {
    let id = resolve(t, &a.sandbox).await?;
    let mut b = Map::new();
    if a.command.len() == 1 {
        b.insert("command".into(), json!(a.command[0]));
    } else {
        b.insert("argv".into(), json!(a.command));
    }
    if let Some(c) = &a.cwd {
        b.insert("cwd".into(), json!(c));
    }
    if !a.env.is_empty() {
        b.insert("env".into(), Value::Object(pairs(&a.env, "--env")?));
    }
    if let Some(u) = &a.user {
        b.insert("user".into(), json!(u));
    }
    if let Some(data) = piped_stdin()? {
        b.insert(
            "stdinBase64".into(),
            json!(base64::engine::general_purpose::STANDARD.encode(data)),
        );
    }
    let path = format!("/v1/sandboxes/{}:exec", enc(&id));
    let sandbox_id = id.clone();
    if a.json {
        if let Some(s) = a.timeout {
            b.insert("timeoutMs".into(), json!(s.saturating_mul(1000)));
        }
        let v = t.json("POST", &path, Some(&Value::Object(b))).await?;
        output::json(&v);
        return Ok(output::exit_status(&v));
    }
    let timeout_ms = a.timeout.map_or(86_400_000, |s| s.saturating_mul(1000));
    b.insert("timeoutMs".into(), json!(timeout_ms));
    b.insert("stream".into(), json!(true));
    let body = Bytes::from(Value::Object(b).to_string());
    let mut follow = Follow::default();
    let pid = follow.shared_pid.clone();
    let run = async move {
        let resp = t
            .send(
                "POST",
                &path,
                &[
                    ("content-type", "application/json"),
                    ("accept", "application/x-ndjson"),
                ],
                body,
            )
            .await?;
        let resp = crate::client::check(resp).await?;
        let code = follow_events(t, &id, Lines::new(resp.into_body()), &mut follow).await?;
        if follow.lost > 0 && code == 0 {
            eprintln!(
                "runtime: the command succeeded but {} bytes of its output were lost",
                follow.lost
            );
            return Ok(1);
        }
        Ok(code)
    };
    tokio::select! {
        r = run => r,
        _ = tokio::signal::ctrl_c() => {
            let pid = pid.lock().ok().and_then(|p| p.clone());
            if let Some(pid) = pid {
                let _ = t.json(
                    "POST",
                    &format!("/v1/sandboxes/{}/processes/{}:signal", enc(&sandbox_id), enc(&pid)),
                    Some(&json!({"signal": "SIGTERM"})),
                ).await;
            }
            eprintln!("runtime: interrupted; the command was sent SIGTERM");
            Ok(130)
        }
    }
}

/// Writes a process's output events until it exits, following again from
/// the cursor when the server ends the stream early (a pause, a restart).
async fn follow_events(
    t: &Target,
    id: &str,
    mut lines: Lines,
    follow: &mut Follow,
) -> anyhow::Result<i32> {
    let mut resumes = 0;
    loop {
        let ended = loop {
            match lines.next().await {
                Ok(Some(ev)) => {
                    if let Some(end) = follow.apply(&ev)? {
                        break end;
                    }
                }
                Ok(None) => break Ended::Cut,
                Err(e) if follow.process_id.is_some() => {
                    eprintln!("runtime: {e:#}; following again");
                    break Ended::Cut;
                }
                Err(e) => return Err(e),
            }
        };
        match ended {
            Ended::Exit(code) => return Ok(code),
            Ended::Continue => resumes = 0,
            Ended::Cut => {
                resumes += 1;
                if resumes > 5 {
                    bail!(
                        "the output stream kept closing; read the rest with `runtime sandbox logs {id} {}`",
                        follow.process_id.as_deref().unwrap_or("?")
                    );
                }
                tokio::time::sleep(Duration::from_millis(200 * resumes)).await;
            }
        }
        let pid = follow
            .process_id
            .clone()
            .context("the stream ended before naming its process")?;
        let resp = t
            .get_stream(
                &format!(
                    "/v1/sandboxes/{}/processes/{}/output?cursor={}&follow=true",
                    enc(id),
                    enc(&pid),
                    follow.cursor
                ),
                "application/x-ndjson",
            )
            .await?;
        lines = Lines::new(resp.into_body());
    }
}

async fn logs(
    t: &Target,
    id: &str,
    process: Option<String>,
    follow: bool,
    json: bool,
) -> anyhow::Result<i32> {
    let Some(pid) = process else {
        let v = t
            .json("GET", &format!("/v1/sandboxes/{}/processes", enc(id)), None)
            .await?;
        let procs = v["data"].as_array().cloned().unwrap_or_default();
        if json {
            output::json(&Value::Array(procs));
            return Ok(0);
        }
        let rows: Vec<Vec<String>> = procs
            .iter()
            .map(|p| {
                let cmd = match &p["argv"] {
                    Value::Array(a) => a.iter().map(cell).collect::<Vec<_>>().join(" "),
                    _ => cell(&p["command"]),
                };
                vec![
                    cell(&p["id"]),
                    cell(&p["state"]),
                    cell(&p["exitCode"]),
                    cell(&p["startedAt"]),
                    cmd,
                ]
            })
            .collect();
        output::table(&["PROCESS", "STATE", "EXIT", "STARTED", "COMMAND"], &rows);
        if !rows.is_empty() {
            eprintln!("runtime: `runtime sandbox logs {id} <process>` prints one's output");
        }
        return Ok(0);
    };
    if follow {
        let mut f = Follow {
            process_id: Some(pid.clone()),
            ..Follow::default()
        };
        let resp = t
            .get_stream(
                &format!(
                    "/v1/sandboxes/{}/processes/{}/output?cursor=0&follow=true",
                    enc(id),
                    enc(&pid)
                ),
                "application/x-ndjson",
            )
            .await?;
        return follow_events(t, id, Lines::new(resp.into_body()), &mut f).await;
    }
    // What is there now, page by page of the JSON polling form.
    let mut cursor = 0u64;
    let mut all = Vec::new();
    loop {
        let v = t
            .json(
                "GET",
                &format!(
                    "/v1/sandboxes/{}/processes/{}/output?cursor={cursor}&waitMs=0",
                    enc(id),
                    enc(&pid)
                ),
                None,
            )
            .await?;
        let chunks = v["chunks"].as_array().cloned().unwrap_or_default();
        let next = v["nextCursor"].as_u64().unwrap_or(cursor);
        for c in &chunks {
            if json {
                all.push(c.clone());
                continue;
            }
            let text = c["text"].as_str().unwrap_or("");
            if c["stream"] == "stderr" {
                eprint!("{text}");
            } else {
                print!("{text}");
            }
        }
        if chunks.is_empty() || next <= cursor {
            break;
        }
        cursor = next;
    }
    if json {
        output::json(&Value::Array(all));
    }
    use std::io::Write;
    let _ = std::io::stdout().flush();
    Ok(0)
}

async fn snapshot(
    t: &Target,
    sandbox: &str,
    name: Option<String>,
    mode: Option<String>,
    retention: Option<u32>,
    json: bool,
) -> anyhow::Result<i32> {
    let id = resolve(t, sandbox).await?;
    let mut b = Map::new();
    if let Some(n) = name {
        b.insert("name".into(), json!(n));
    }
    if let Some(m) = mode {
        b.insert("mode".into(), json!(m));
    }
    if let Some(r) = retention {
        b.insert("retentionDays".into(), json!(r));
    }
    let started = Instant::now();
    output::progress(&format!("snapshotting {id} ..."));
    let mut v = t
        .json(
            "POST",
            &format!("/v1/sandboxes/{}:snapshot", enc(&id)),
            Some(&Value::Object(b)),
        )
        .await?;
    let snap = v["id"]
        .as_str()
        .context("the server's answer has no snapshot id")?
        .to_string();
    while v["state"].as_str() == Some("capturing") {
        tokio::time::sleep(Duration::from_millis(500)).await;
        v = t
            .json("GET", &format!("/v1/snapshots/{}", enc(&snap)), None)
            .await?;
    }
    if v["state"].as_str() == Some("failed") {
        bail!(
            "snapshot {snap} failed: {}",
            v["error"]["message"]
                .as_str()
                .or(v["error"].as_str())
                .unwrap_or("no reason given")
        );
    }
    eprintln!(
        "runtime: snapshot {snap} is {} ({:.1} s)",
        v["state"].as_str().unwrap_or("?"),
        started.elapsed().as_secs_f64()
    );
    if json {
        output::json(&v);
    } else {
        println!("{snap}");
    }
    Ok(0)
}

async fn preview(
    t: &Target,
    id: &str,
    port: Option<u16>,
    public: bool,
    ttl: Option<u64>,
    rm: bool,
    json: bool,
) -> anyhow::Result<i32> {
    let base = format!("/v1/sandboxes/{}/previews", enc(id));
    let Some(port) = port else {
        let v = t.json("GET", &base, None).await?;
        let list = v["data"].as_array().cloned().unwrap_or_default();
        if json {
            output::json(&Value::Array(list));
            return Ok(0);
        }
        let rows: Vec<Vec<String>> = list
            .iter()
            .map(|p| {
                vec![
                    cell(&p["port"]),
                    cell(&p["visibility"]),
                    cell(&p["urlWithToken"]),
                    cell(&p["tokenExpiresAt"]),
                ]
            })
            .collect();
        output::table(&["PORT", "VISIBILITY", "URL", "EXPIRES"], &rows);
        return Ok(0);
    };
    if rm {
        let v = t.json("DELETE", &format!("{base}/{port}"), None).await?;
        if json {
            output::json(&v);
        } else {
            println!("removed the preview of port {port}");
        }
        return Ok(0);
    }
    let mut b = Map::new();
    b.insert("port".into(), json!(port));
    if public {
        b.insert("visibility".into(), json!("public"));
    }
    if let Some(s) = ttl {
        b.insert("ttlSeconds".into(), json!(s));
    }
    let v = t.json("POST", &base, Some(&Value::Object(b))).await?;
    if json {
        output::json(&v);
    } else {
        println!(
            "{}",
            v["urlWithToken"]
                .as_str()
                .or(v["url"].as_str())
                .unwrap_or("?")
        );
        if let Some(tok) = v["token"].as_str() {
            eprintln!("runtime: a private preview; its token also goes in the header x-runtime-preview-token: {tok}");
        }
    }
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_and_names() {
        assert!(looks_like_id("0b8f3c52-6d8e-4b1f-9c67-2f4e6c1d9a10"));
        assert!(!looks_like_id("demo"));
        assert!(!looks_like_id("0b8f3c52x6d8e-4b1f-9c67-2f4e6c1d9a10"));
    }

    #[test]
    fn pairs_name_the_option() {
        let m = pairs(&["A=1".into(), "B=x=y".into()], "--env").unwrap();
        assert_eq!(Value::Object(m), json!({"A": "1", "B": "x=y"}));
        let e = pairs(&["nope".into()], "--label").unwrap_err().to_string();
        assert!(e.contains("--label") && e.contains("K=V"), "{e}");
        assert!(pairs(&["=v".into()], "--env").is_err());
    }
}
