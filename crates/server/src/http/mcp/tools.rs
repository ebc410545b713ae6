//! The tools, after the product's table (`runtime_<product>_<verb>`, or
//! `runtime_<product>` with an `action`), and how each becomes one request
//! of the API. Every tool is a request through the API's own path
//! ([`super::api`]), so keys, read-only keys, spending limits, quotas and
//! validation are the API's, and nothing is checked twice differently.

use axum::http::Method;
use base64::Engine;
use runtime_api::Issue;
use serde_json::{json, Map, Value};

use super::schema::{opt, req, Arg, Ty};

/// A tool as listed.
pub(super) struct Tool {
    pub name: &'static str,
    pub title: &'static str,
    pub desc: &'static str,
    pub args: &'static [Arg],
    pub read_only: bool,
    pub destructive: bool,
    pub idempotent: bool,
}

const ID: Arg = req("id", Ty::Str, "The sandbox's id.");
const IDEM: Arg = opt(
    "idempotencyKey",
    Ty::Str,
    "Chosen before the first call (1-128 of [A-Za-z0-9_.:-]); resend the same input with the same key after a lost reply and the change is made once.",
);
const USER: Arg = opt(
    "user",
    Ty::Enum(&["sandbox", "root"]),
    "Whom it runs as (the sandbox's user by default).",
);

const CREATE: &[Arg] = &[
    opt(
        "image",
        Ty::Str,
        "An image id, name, name:tag, name@version, or default.",
    ),
    opt("name", Ty::Str, "A unique name (1-128 characters)."),
    opt("vcpu", Ty::Int, "vCPUs, 1-16 (2)."),
    opt("memoryMiB", Ty::Int, "Memory in MiB, 128-65536 (4096)."),
    opt("diskMiB", Ty::Int, "Disk in MiB, at least 3072 (4096)."),
    opt(
        "timeoutSeconds",
        Ty::Int,
        "Lease, 60-86400 seconds; absent: no limit.",
    ),
    opt(
        "onLeaseEnd",
        Ty::Enum(&["pause", "stop", "delete"]),
        "What the lease's end does (pause).",
    ),
    opt(
        "env",
        Ty::StrMap,
        "Environment variables for every command in it.",
    ),
    opt("labels", Ty::StrMap, "Labels to find it by."),
    opt(
        "user",
        Ty::Enum(&["sandbox", "root"]),
        "Whom commands run as by default.",
    ),
    opt(
        "network",
        Ty::Obj,
        "Network rules: {internet, allow, deny}.",
    ),
    opt(
        "secrets",
        Ty::Obj,
        "Egress secrets the proxy adds for named hosts.",
    ),
    opt(
        "getOrCreate",
        Ty::Bool,
        "With name: answer the sandbox holding the name instead of name_taken.",
    ),
    opt("pausable", Ty::Bool, "Whether it may pause (true)."),
    opt(
        "autoWake",
        Ty::Bool,
        "Whether a call to a paused sandbox wakes it (true).",
    ),
    opt(
        "idlePauseSeconds",
        Ty::Int,
        "Pause after this long idle (300; 0 never).",
    ),
    opt(
        "persistent",
        Ty::Bool,
        "Keep the record and disk when it stops.",
    ),
    opt(
        "volumes",
        Ty::ObjList,
        "Volumes to attach: [{volumeId, path, mode: rw|snapshot}].",
    ),
    opt("snapshot", Ty::Str, "Start from this snapshot's id."),
    opt(
        "maxCostMicros",
        Ty::Int,
        "Refuse the create if it could cost more than this per hour (µ$).",
    ),
    opt(
        "maxTotalCostMicros",
        Ty::Int,
        "Stop it when it has cost this much (µ$).",
    ),
    opt(
        "funding",
        Ty::Enum(&["trial", "paid"]),
        "Accepted for the product's clients; stored only.",
    ),
    IDEM,
];

const LIST: &[Arg] = &[
    opt("id", Ty::Str, "Read this one sandbox instead of listing."),
    opt(
        "state",
        Ty::StrList,
        "Only these states (running, paused, stopped, ...).",
    ),
    opt("name", Ty::Str, "Only the sandbox of this name."),
    opt(
        "labels",
        Ty::StrMap,
        "Only sandboxes with all these labels.",
    ),
    opt("includeStopped", Ty::Bool, "Include stopped sandboxes."),
    opt("limit", Ty::Int, "At most this many, 1-100."),
    opt("cursor", Ty::Str, "The nextCursor of the page before."),
];

const MANAGE_ACTIONS: &[&str] = &[
    "get", "stop", "pause", "wake", "extend", "restart", "update", "delete",
];
const MANAGE: &[Arg] = &[
    ID,
    req("action", Ty::Enum(MANAGE_ACTIONS), "get reads it; stop ends its machine; pause keeps memory and disk (billing stops); wake resumes it; extend moves the lease's end; restart reboots it; update changes its settings; delete removes it and its disk for good."),
    req("seconds", Ty::Int, "Seconds to add to the lease.").only(&["extend"]),
    opt("name", Ty::Str, "A new name.").only(&["update"]),
    opt("labels", Ty::StrMap, "New labels (replacing).").only(&["update"]),
    opt("env", Ty::StrMap, "New environment (replacing).").only(&["update"]),
    opt("autoWake", Ty::Bool, "Whether calls wake it when paused.").only(&["update"]),
    opt("idlePauseSeconds", Ty::Int, "Pause after this long idle (0 never).").only(&["update"]),
    opt("timeoutSeconds", Ty::Int, "A new lease from now, 60-86400 (0 takes the limit away).").only(&["update"]),
    opt("onTimeout", Ty::Enum(&["pause", "stop", "delete"]), "What the lease's end does.").only(&["update"]),
    opt("persistent", Ty::Bool, "Keep it when it stops.").only(&["update"]),
    opt("user", Ty::Enum(&["sandbox", "root"]), "Whom commands run as.").only(&["update"]),
    opt("maxTotalCostMicros", Ty::Int, "Stop it when it has cost this much (µ$).").only(&["update"]),
    opt("idempotencyKey", IDEM.ty, IDEM.desc).only(&[
        "stop", "pause", "wake", "extend", "restart", "update", "delete",
    ]),
];

const EXEC: &[Arg] = &[
    ID,
    req(
        "command",
        Ty::Command,
        "A shell command line (run by bash -c), or an argv array run without a shell.",
    ),
    opt("cwd", Ty::Str, "Working directory (/workspace)."),
    opt("env", Ty::StrMap, "Extra environment variables."),
    opt(
        "timeoutMs",
        Ty::Int,
        "Kill it after this long (60000 unless in the background).",
    ),
    opt("stdin", Ty::Str, "Text given on its standard input."),
    USER,
    opt(
        "background",
        Ty::Bool,
        "Start it and answer its process at once; follow it with runtime_sandbox_process.",
    ),
    IDEM,
];

const PROCESS_ACTIONS: &[&str] = &["start", "list", "get", "output", "write", "signal", "kill"];
const PROCESS: &[Arg] = &[
    ID,
    req("action", Ty::Enum(PROCESS_ACTIONS), "start a background command; list processes; get one; output reads its output from a cursor; write feeds its stdin; signal or kill it."),
    req("processId", Ty::Str, "The process (proc_...).").only(&["get", "output", "write", "signal", "kill"]),
    req("command", Ty::Command, "A shell command line, or an argv array.").only(&["start"]),
    opt("cwd", Ty::Str, "Working directory (/workspace).").only(&["start"]),
    opt("env", Ty::StrMap, "Extra environment variables.").only(&["start"]),
    opt("timeoutMs", Ty::Int, "Kill it after this long.").only(&["start"]),
    opt("user", USER.ty, USER.desc).only(&["start"]),
    opt("cursor", Ty::Int, "Where to read from: 0, or the nextCursor of the read before.").only(&["output"]),
    opt("waitMs", Ty::Int, "Wait up to this long (0-60000) for new output or the end.").only(&["output"]),
    req("data", Ty::Str, "Text to write to its stdin.").only(&["write"]),
    opt("eof", Ty::Bool, "Close its stdin after the data.").only(&["write"]),
    opt("signal", Ty::StrOrInt, "A signal name (SIGTERM) or number.").only(&["signal"]),
    opt("idempotencyKey", IDEM.ty, IDEM.desc).only(&["start"]),
];

const FILES_READ: &[Arg] = &[
    ID,
    req(
        "path",
        Ty::Str,
        "An absolute path, or one relative to /workspace.",
    ),
    opt("startLine", Ty::Int, "First line to answer (1-based)."),
    opt("endLine", Ty::Int, "Last line to answer (inclusive)."),
    USER,
];

const FILES_WRITE: &[Arg] = &[
    ID,
    req(
        "path",
        Ty::Str,
        "Where to write (parents are made; the file is replaced whole).",
    ),
    opt("content", Ty::Str, "The file's text (UTF-8)."),
    opt(
        "contentBase64",
        Ty::Str,
        "The file's bytes in base64, instead of content.",
    ),
    opt("mode", Ty::Str, "Octal permissions such as \"644\"."),
    USER,
    IDEM,
];

const FILES_LIST: &[Arg] = &[
    ID,
    opt("path", Ty::Str, "The folder (/workspace)."),
    opt("depth", Ty::Int, "How deep, 1-64 (1)."),
    opt(
        "glob",
        Ty::Str,
        "Only paths matching this glob (** across folders).",
    ),
    opt("hidden", Ty::Bool, "Include names starting with a dot."),
    opt("limit", Ty::Int, "At most this many entries (1000)."),
    USER,
];

const FILES_MANAGE: &[Arg] = &[
    ID,
    req("action", Ty::Enum(&["stat", "mkdir", "move", "remove", "chmod"]), "stat reads a path's kind, size and mode; mkdir makes a folder; move renames; remove deletes; chmod sets permissions."),
    req("path", Ty::Str, "The path.").only(&["stat", "mkdir", "remove", "chmod"]),
    req("from", Ty::Str, "The path to move.").only(&["move"]),
    req("to", Ty::Str, "Where it goes.").only(&["move"]),
    opt("parents", Ty::Bool, "Make missing parents (true).").only(&["mkdir"]),
    opt("recursive", Ty::Bool, "Remove a folder with what it holds.").only(&["remove"]),
    opt("overwrite", Ty::Bool, "Replace what is at the destination.").only(&["move"]),
    req("mode", Ty::Str, "Octal permissions such as \"755\".").only(&["chmod"]),
    USER,
];

const FILES_WATCH: &[Arg] = &[
    ID,
    req(
        "action",
        Ty::Enum(&["start", "events", "list", "stop"]),
        "start a watch; events reads what changed after a cursor; list running watches; stop one.",
    ),
    req("path", Ty::Str, "The folder or file to watch.").only(&["start"]),
    opt("recursive", Ty::Bool, "Watch subfolders too.").only(&["start"]),
    opt(
        "events",
        Ty::StrList,
        "Only these: create, write, remove, rename, chmod.",
    )
    .only(&["start"]),
    opt("include", Ty::StrList, "Only paths matching these globs.").only(&["start"]),
    opt(
        "exclude",
        Ty::StrList,
        "Leave out paths matching these globs.",
    )
    .only(&["start"]),
    req("watchId", Ty::Str, "The watch.").only(&["events", "stop"]),
    opt(
        "cursor",
        Ty::Int,
        "0, or the nextCursor of the read before.",
    )
    .only(&["events"]),
    opt(
        "waitMs",
        Ty::Int,
        "Wait up to this long (0-8000) for events.",
    )
    .only(&["events"]),
];

const INTERP_RUN: &[Arg] = &[
    ID,
    req("code", Ty::Str, "The code to run."),
    opt(
        "language",
        Ty::Enum(&[
            "python",
            "javascript",
            "typescript",
            "r",
            "java",
            "bash",
            "go",
        ]),
        "The language (python).",
    ),
    opt(
        "context",
        Ty::Str,
        "A context from runtime_sandbox_interpreter_contexts (the language's default).",
    ),
    opt(
        "timeoutMs",
        Ty::Int,
        "Interrupt it after this long (60000; 0 none).",
    ),
    IDEM,
];

const INTERP_CONTEXTS: &[Arg] = &[
    ID,
    req(
        "action",
        Ty::Enum(&["list", "create", "restart", "interrupt", "delete"]),
        "list contexts; create one; restart empties its state; interrupt its run; delete it.",
    ),
    opt(
        "context",
        Ty::Str,
        "The context's id (create: the id to give it).",
    )
    .only(&["create", "restart", "interrupt", "delete"]),
    opt("language", Ty::Str, "Its language (python).").only(&["create"]),
    opt("cwd", Ty::Str, "Its working directory.").only(&["create"]),
    opt("env", Ty::StrMap, "Its environment variables.").only(&["create"]),
];

const FORK: &[Arg] = &[
    ID,
    opt("count", Ty::Int, "How many copies (1)."),
    opt("name", Ty::Str, "The copy's name (one copy only)."),
    opt("labels", Ty::StrMap, "The copies' labels."),
    opt("network", Ty::Obj, "The copies' network rules."),
    IDEM,
];

const SNAPSHOT: &[Arg] = &[
    req(
        "action",
        Ty::Enum(&["create", "list", "get", "delete"]),
        "create keeps a sandbox's state to start copies from; list, get or delete snapshots.",
    ),
    opt(
        "sandboxId",
        Ty::Str,
        "The sandbox to snapshot (create), or to list the snapshots of.",
    )
    .only(&["create", "list"]),
    req("snapshotId", Ty::Str, "The snapshot.").only(&["get", "delete"]),
    opt("name", Ty::Str, "Its name.").only(&["create", "list"]),
    opt("labels", Ty::StrMap, "Its labels.").only(&["create"]),
    opt("retentionDays", Ty::Int, "Kept this many days, 1-365 (7).").only(&["create"]),
    opt(
        "mode",
        Ty::Enum(&["memory", "disk"]),
        "memory keeps running processes; disk the files only.",
    )
    .only(&["create"]),
    opt("limit", Ty::Int, "At most this many.").only(&["list"]),
    opt("cursor", Ty::Str, "The nextCursor of the page before.").only(&["list"]),
    opt("idempotencyKey", IDEM.ty, IDEM.desc).only(&["create", "delete"]),
];

const PREVIEWS: &[Arg] = &[
    ID,
    req("action", Ty::Enum(&["create", "list", "get", "rotate", "delete"]), "create shares a port at an address; list, get; rotate refuses every old token; delete stops sharing."),
    req("port", Ty::Int, "The port in the sandbox.").only(&["create", "get", "rotate", "delete"]),
    opt("visibility", Ty::Enum(&["private", "public"]), "private needs the token (default).").only(&["create"]),
    opt("ttlSeconds", Ty::Int, "How long the token lasts.").only(&["create"]),
];

const NETWORK: &[Arg] = &[
    ID,
    req(
        "action",
        Ty::Enum(&["get", "set"]),
        "get or set the sandbox's network rules.",
    ),
    req(
        "network",
        Ty::Obj,
        "The rules: {internet: bool, allow: [hosts], deny: [hosts]}.",
    )
    .only(&["set"]),
    opt("secrets", Ty::Obj, "Egress secrets for named hosts.").only(&["set"]),
];

const IMAGE: &[Arg] = &[
    req(
        "action",
        Ty::Enum(&["list", "get", "logs", "resolve", "delete"]),
        "list images; get one; logs of its build; resolve a reference to a version; delete it.",
    ),
    req("imageId", Ty::Str, "The image (img_...).").only(&["get", "logs", "delete"]),
    req("ref", Ty::Str, "name, name:tag or name@version.").only(&["resolve"]),
    opt("name", Ty::Str, "Only images of this name.").only(&["list"]),
    opt("limit", Ty::Int, "At most this many.").only(&["list"]),
    opt("cursor", Ty::Str, "The nextCursor of the page before.").only(&["list"]),
];

const IMAGE_BUILD: &[Arg] = &[
    req("name", Ty::Str, "The image's name."),
    opt("tags", Ty::StrList, "Tags for this version."),
    opt(
        "recipe",
        Ty::Obj,
        "The recipe: {base, apt, pip, npm, run, ...} (docs/images.md).",
    ),
    opt("dockerfile", Ty::Str, "A Dockerfile, instead of a recipe."),
    opt("files", Ty::Obj, "Files the build copies in."),
    opt("buildArgs", Ty::StrMap, "Dockerfile ARG values."),
    opt("env", Ty::StrMap, "Environment of sandboxes made from it."),
    opt("start", Ty::Obj, "A command started in each new sandbox."),
    IDEM,
];

const VOLUME: &[Arg] = &[
    req(
        "action",
        Ty::Enum(&["create", "list", "get", "delete"]),
        "create a persistent disk to attach at create; list, get or delete volumes.",
    ),
    req("volumeId", Ty::Str, "The volume.").only(&["get", "delete"]),
    req("sizeMiB", Ty::Int, "Its size in MiB.").only(&["create"]),
    opt("name", Ty::Str, "Its name.").only(&["create", "list"]),
    opt("labels", Ty::StrMap, "Its labels.").only(&["create"]),
    opt("limit", Ty::Int, "At most this many.").only(&["list"]),
    opt("cursor", Ty::Str, "The nextCursor of the page before.").only(&["list"]),
    opt("idempotencyKey", IDEM.ty, IDEM.desc).only(&["create", "delete"]),
];

const METRICS: &[Arg] = &[
    ID,
    opt(
        "range",
        Ty::Enum(&["15m", "1h", "6h", "24h", "7d", "30d"]),
        "How far back (15m).",
    ),
];

const EVENTS: &[Arg] = &[
    opt(
        "resourceId",
        Ty::Str,
        "Only events of this sandbox, snapshot or volume.",
    ),
    opt("type", Ty::Str, "Only this type, such as sandbox.paused."),
    opt("limit", Ty::Int, "At most this many, 1-200 (50)."),
    opt("cursor", Ty::Str, "The nextCursor of the page before."),
];

const ACCOUNT: &[Arg] = &[req(
    "action",
    Ty::Enum(&["get", "limits", "usage"]),
    "get this key and account; limits: the key's access, daily spending limit and quotas; usage: what was spent.",
)];

const fn tool(
    name: &'static str,
    title: &'static str,
    desc: &'static str,
    args: &'static [Arg],
) -> Tool {
    Tool {
        name,
        title,
        desc,
        args,
        read_only: false,
        destructive: false,
        idempotent: false,
    }
}

const fn reads(t: Tool) -> Tool {
    Tool {
        read_only: true,
        idempotent: true,
        ..t
    }
}

const fn destroys(t: Tool) -> Tool {
    Tool {
        destructive: true,
        ..t
    }
}

/// Every tool, in the order listed.
pub(super) const TOOLS: &[Tool] = &[
    tool("runtime_sandbox_create", "Create a sandbox", "Create a sandbox (a Linux VM) and wait until it runs; answers its record, whose id every runtime_sandbox_* tool takes as `id`. Check `state` is running.", CREATE),
    reads(tool("runtime_sandbox_list", "List sandboxes", "List sandboxes by state, name or label (oldest first), or read one by id.", LIST)),
    destroys(tool("runtime_sandbox_manage", "Manage a sandbox", "get, stop, pause, wake, extend, restart, update or delete a sandbox.", MANAGE)),
    tool("runtime_sandbox_exec", "Run a command", "Run a command and answer its exitCode, stdout and stderr (each kept to 64 KiB; over MCP, output over 16,000 characters keeps each stream's first line and its end, and outputCut counts what was cut). With background: true, answer its process at once.", EXEC),
    tool("runtime_sandbox_process", "Background processes", "Start, list, read, feed, signal or kill background processes.", PROCESS),
    reads(tool("runtime_sandbox_files_read", "Read a file", "Read a text file, whole or by line range (binary files come as base64).", FILES_READ)),
    Tool { idempotent: true, ..tool("runtime_sandbox_files_write", "Write a file", "Write a whole file (up to 1 MiB), making its folders.", FILES_WRITE) },
    reads(tool("runtime_sandbox_files_list", "List files", "List a folder's entries, to a depth or by glob.", FILES_LIST)),
    destroys(tool("runtime_sandbox_files_manage", "Manage files", "stat, mkdir, move, remove or chmod a path.", FILES_MANAGE)),
    tool("runtime_sandbox_files_watch", "Watch files", "Watch a folder for changes: start, read events after a cursor, list, stop.", FILES_WATCH),
    tool("runtime_sandbox_interpreter_run", "Run code", "Run code in a notebook-style context that keeps its state between runs (Python, JavaScript, TypeScript, R, Java, Bash, Go); answers stdout, stderr, results (charts as images) and error.", INTERP_RUN),
    destroys(tool("runtime_sandbox_interpreter_contexts", "Interpreter contexts", "list, create, restart, interrupt or delete interpreter contexts.", INTERP_CONTEXTS)),
    tool("runtime_sandbox_fork", "Fork a sandbox", "Copies of a running sandbox as it is now, memory and processes included.", FORK),
    destroys(tool("runtime_snapshot", "Snapshots", "create a snapshot of a sandbox to start new sandboxes from (runtime_sandbox_create with snapshot); list, get, delete.", SNAPSHOT)),
    destroys(tool("runtime_sandbox_previews", "Previews", "Share a port of the sandbox at an HTTP address: create, list, get, rotate, delete.", PREVIEWS)),
    Tool { idempotent: true, ..tool("runtime_sandbox_network", "Network rules", "get or set a sandbox's network rules (internet on or off, allow and deny lists).", NETWORK) },
    destroys(tool("runtime_image", "Images", "list, get, logs, resolve or delete images.", IMAGE)),
    tool("runtime_image_build", "Build an image", "Build a custom image from a recipe or a Dockerfile; follow it with runtime_image logs.", IMAGE_BUILD),
    destroys(tool("runtime_volume", "Volumes", "Persistent disks to attach at create: create, list, get, delete.", VOLUME)),
    reads(tool("runtime_sandbox_metrics", "Sandbox metrics", "A sandbox's CPU and memory over time.", METRICS)),
    reads(tool("runtime_events_list", "Events", "Lifecycle events (created, paused, stopped, ...), newest first.", EVENTS)),
    reads(tool("runtime_account", "Account", "get the key and account, its limits and quotas, or its usage.", ACCOUNT)),
];

pub(super) fn find(name: &str) -> Option<&'static Tool> {
    TOOLS.iter().find(|t| t.name == name)
}

/// The `tools/list` answer.
pub(super) fn list() -> Value {
    let tools: Vec<Value> = TOOLS
        .iter()
        .map(|t| {
            json!({
                "name": t.name,
                "title": t.title,
                "description": t.desc,
                "inputSchema": super::schema::input_schema(t.args),
                "annotations": {
                    "title": t.title,
                    "readOnlyHint": t.read_only,
                    "destructiveHint": t.destructive,
                    "idempotentHint": t.idempotent,
                    "openWorldHint": false,
                },
            })
        })
        .collect();
    json!({ "tools": tools })
}

/// What a call's answer is turned into.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Shape {
    Json,
    /// stdout and stderr cut to the tool result's share.
    Exec,
    /// A process's output chunks, cut at the share with the cursor after.
    Output,
    /// A file's bytes as text lines.
    File {
        start: Option<usize>,
        end: Option<usize>,
    },
    /// The interpreter's answer: streams cut, images as image content.
    Interpreter,
}

/// A request body.
#[derive(Debug)]
pub(super) enum Payload {
    None,
    Json(Value),
    Bytes(Vec<u8>),
}

/// One request of the API a tool call makes.
#[derive(Debug)]
pub(super) struct Call {
    pub method: Method,
    pub path: String,
    pub query: Vec<(&'static str, String)>,
    pub body: Payload,
    /// `Prefer: wait=60`: answer once the state settles.
    pub settle: bool,
    /// `Accept: application/json` (the JSON polling form of output).
    pub accept_json: bool,
    pub idem: Option<String>,
    pub shape: Shape,
}

impl Call {
    fn new(method: Method, path: String) -> Call {
        Call {
            method,
            path,
            query: Vec::new(),
            body: Payload::None,
            settle: false,
            accept_json: false,
            idem: None,
            shape: Shape::Json,
        }
    }

    fn get(path: String) -> Call {
        Call::new(Method::GET, path)
    }

    fn post(path: String, body: Value) -> Call {
        Call {
            body: Payload::Json(body),
            ..Call::new(Method::POST, path)
        }
    }

    fn delete(path: String) -> Call {
        Call::new(Method::DELETE, path)
    }

    fn settled(self) -> Call {
        Call {
            settle: true,
            ..self
        }
    }

    fn shaped(self, shape: Shape) -> Call {
        Call { shape, ..self }
    }

    /// Query parameters from the named arguments given.
    fn with_query(mut self, a: &Map<String, Value>, names: &[&'static str]) -> Call {
        for n in names {
            match a.get(*n) {
                Some(Value::String(s)) => self.query.push((n, s.clone())),
                Some(Value::Array(xs)) => {
                    for x in xs.iter().filter_map(Value::as_str) {
                        self.query.push((n, x.to_string()));
                    }
                }
                Some(v @ (Value::Number(_) | Value::Bool(_))) => {
                    self.query.push((n, v.to_string()))
                }
                _ => {}
            }
        }
        self
    }

    /// The path with its query, encoded.
    pub(super) fn uri(&self) -> String {
        if self.query.is_empty() {
            return self.path.clone();
        }
        let q: Vec<String> = self
            .query
            .iter()
            .map(|(k, v)| format!("{k}={}", enc(v)))
            .collect();
        format!("{}?{}", self.path, q.join("&"))
    }
}

/// Percent-encodes everything but the unreserved characters, so an id or a
/// path given to a tool stays one segment or value.
pub(super) fn enc(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

fn s<'a>(a: &'a Map<String, Value>, name: &str) -> &'a str {
    a.get(name).and_then(Value::as_str).unwrap_or_default()
}

/// The named arguments given, as a body.
fn pick(a: &Map<String, Value>, names: &[&str]) -> Value {
    let m: Map<String, Value> = names
        .iter()
        .filter_map(|n| a.get(*n).map(|v| ((*n).to_string(), v.clone())))
        .collect();
    Value::Object(m)
}

/// Every argument given but these, as a body.
fn all_but(a: &Map<String, Value>, skip: &[&str]) -> Value {
    Value::Object(
        a.iter()
            .filter(|(k, _)| !skip.contains(&k.as_str()))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect(),
    )
}

/// `command` as the API takes it: a line for bash, or an argv.
fn command_body(a: &Map<String, Value>, rest: &[&str]) -> Value {
    let mut body = pick(a, rest);
    match a.get("command") {
        Some(Value::Array(argv)) => body["argv"] = Value::Array(argv.clone()),
        Some(c) => body["command"] = c.clone(),
        None => {}
    }
    body
}

fn issue(field: &str, message: &str) -> Issue {
    Issue {
        field: field.to_string(),
        message: message.to_string(),
    }
}

/// Paths of the files tools that do not start with `/` are taken from
/// `/workspace`, where commands run (the API takes absolute paths only).
fn absolute_paths(tool: &Tool, a: &Map<String, Value>) -> Map<String, Value> {
    let mut a = a.clone();
    if tool.name.starts_with("runtime_sandbox_files_") {
        for k in ["path", "from", "to"] {
            if let Some(Value::String(p)) = a.get_mut(k) {
                if !p.is_empty() && !p.starts_with('/') {
                    let rel = p.trim_start_matches("./");
                    *p = format!("/workspace/{rel}");
                }
            }
        }
    }
    a
}

/// The request a call of `tool` with checked arguments `a` makes.
pub(super) fn plan(tool: &Tool, a: &Map<String, Value>) -> Result<Call, Vec<Issue>> {
    let a = &absolute_paths(tool, a);
    let id = enc(s(a, "id"));
    let sbx = format!("/v1/sandboxes/{id}");
    let action = s(a, "action");
    let mut call = match tool.name {
        "runtime_sandbox_create" => {
            Call::post("/v1/sandboxes".into(), all_but(a, &["idempotencyKey"])).settled()
        }
        "runtime_sandbox_list" => {
            if a.contains_key("id") {
                if let Some(k) = a.keys().find(|k| *k != "id") {
                    return Err(vec![issue(k, "is not used when reading one sandbox by id")]);
                }
                Call::get(sbx)
            } else {
                let mut c = Call::get("/v1/sandboxes".into())
                    .with_query(a, &["state", "name", "includeStopped", "limit", "cursor"]);
                if let Some(Value::Object(m)) = a.get("labels") {
                    for (k, v) in m {
                        c.query
                            .push(("label", format!("{k}:{}", v.as_str().unwrap_or(""))));
                    }
                }
                c
            }
        }
        "runtime_sandbox_manage" => match action {
            "get" => Call::get(sbx),
            "delete" => Call::delete(sbx),
            "update" => Call::post(
                format!("{sbx}:update"),
                all_but(a, &["id", "action", "idempotencyKey"]),
            ),
            "extend" => Call::post(format!("{sbx}:extend"), pick(a, &["seconds"])),
            verb => Call::post(format!("{sbx}:{verb}"), json!({})).settled(),
        },
        "runtime_sandbox_exec" => {
            let rest = ["cwd", "env", "timeoutMs", "stdin", "user"];
            if a.get("background") == Some(&Value::Bool(true)) {
                Call::post(format!("{sbx}/processes"), command_body(a, &rest))
            } else {
                Call::post(format!("{sbx}:exec"), command_body(a, &rest)).shaped(Shape::Exec)
            }
        }
        "runtime_sandbox_process" => {
            let pid = enc(s(a, "processId"));
            let procs = format!("{sbx}/processes");
            match action {
                "start" => Call::post(procs, command_body(a, &["cwd", "env", "timeoutMs", "user"])),
                "list" => Call::get(procs),
                "get" => Call::get(format!("{procs}/{pid}")),
                "output" => {
                    let mut c = Call::get(format!("{procs}/{pid}/output"))
                        .with_query(a, &["cursor", "waitMs"])
                        .shaped(Shape::Output);
                    c.accept_json = true;
                    if !a.contains_key("waitMs") {
                        c.query.push(("waitMs", "0".into()));
                    }
                    c
                }
                "write" => {
                    let data = base64::engine::general_purpose::STANDARD.encode(s(a, "data"));
                    let mut body = json!({ "base64": data });
                    if let Some(e) = a.get("eof") {
                        body["eof"] = e.clone();
                    }
                    Call::post(format!("{procs}/{pid}:write"), body)
                }
                "kill" => Call::post(
                    format!("{procs}/{pid}:signal"),
                    json!({"signal": "SIGKILL"}),
                ),
                _ => Call::post(format!("{procs}/{pid}:signal"), pick(a, &["signal"])),
            }
        }
        "runtime_sandbox_files_read" => {
            let line = |n: &str| a.get(n).and_then(Value::as_u64).map(|v| v as usize);
            let (start, end) = (line("startLine"), line("endLine"));
            let mut bad = Vec::new();
            if start == Some(0) {
                bad.push(issue("startLine", "lines count from 1"));
            }
            if end == Some(0) || matches!((start, end), (Some(x), Some(y)) if y < x) {
                bad.push(issue(
                    "endLine",
                    "must be at least 1 and at least startLine",
                ));
            }
            if !bad.is_empty() {
                return Err(bad);
            }
            Call::get(format!("{sbx}/files/content"))
                .with_query(a, &["path", "user"])
                .shaped(Shape::File { start, end })
        }
        "runtime_sandbox_files_write" => {
            let bytes = match (a.get("content"), a.get("contentBase64")) {
                (Some(Value::String(t)), None) => t.clone().into_bytes(),
                (None, Some(Value::String(b))) => {
                    match base64::engine::general_purpose::STANDARD.decode(b.trim()) {
                        Ok(d) => d,
                        Err(_) => return Err(vec![issue("contentBase64", "is not valid base64")]),
                    }
                }
                (None, None) => {
                    return Err(vec![issue("content", "is required (or contentBase64)")])
                }
                _ => {
                    return Err(vec![issue(
                        "contentBase64",
                        "give content or contentBase64, not both",
                    )])
                }
            };
            let mut c = Call::new(Method::PUT, format!("{sbx}/files/content"))
                .with_query(a, &["path", "mode", "user"]);
            c.body = Payload::Bytes(bytes);
            c
        }
        "runtime_sandbox_files_list" => {
            let mut c = Call::get(format!("{sbx}/files/list"))
                .with_query(a, &["path", "depth", "glob", "hidden", "limit", "user"]);
            if !a.contains_key("limit") {
                c.query.push(("limit", "1000".into()));
            }
            c
        }
        "runtime_sandbox_files_manage" => match action {
            "stat" => Call::get(format!("{sbx}/files/stat")).with_query(a, &["path", "user"]),
            "move" => Call::post(
                format!("{sbx}/files:rename"),
                pick(a, &["from", "to", "overwrite", "user"]),
            ),
            verb => Call::post(
                format!("{sbx}/files:{verb}"),
                pick(a, &["path", "parents", "recursive", "mode", "user"]),
            ),
        },
        "runtime_sandbox_files_watch" => {
            let w = enc(s(a, "watchId"));
            let watches = format!("{sbx}/files/watches");
            match action {
                "start" => Call::post(
                    watches,
                    pick(a, &["path", "recursive", "events", "include", "exclude"]),
                ),
                "list" => Call::get(watches),
                "stop" => Call::delete(format!("{watches}/{w}")),
                _ => {
                    Call::get(format!("{watches}/{w}/events")).with_query(a, &["cursor", "waitMs"])
                }
            }
        }
        "runtime_sandbox_interpreter_run" => Call::post(
            format!("{sbx}/interpreter:run"),
            pick(a, &["code", "language", "context", "timeoutMs"]),
        )
        .shaped(Shape::Interpreter),
        "runtime_sandbox_interpreter_contexts" => {
            let ctxs = format!("{sbx}/interpreter/contexts");
            let c = enc(s(a, "context"));
            let needs_context = matches!(action, "restart" | "interrupt" | "delete");
            if needs_context && !a.contains_key("context") {
                return Err(vec![issue(
                    "context",
                    &format!("is required by action {action}"),
                )]);
            }
            match action {
                "list" => Call::get(ctxs),
                "create" => {
                    let mut body = pick(a, &["language", "cwd", "env"]);
                    if let Some(id) = a.get("context") {
                        body["id"] = id.clone();
                    }
                    Call::post(ctxs, body)
                }
                "delete" => Call::delete(format!("{ctxs}/{c}")),
                verb => Call::post(format!("{ctxs}/{c}:{verb}"), json!({})),
            }
        }
        "runtime_sandbox_fork" => Call::post(
            format!("{sbx}:fork"),
            pick(a, &["count", "name", "labels", "network"]),
        )
        .settled(),
        "runtime_snapshot" => {
            let snap = format!("/v1/snapshots/{}", enc(s(a, "snapshotId")));
            match action {
                "create" => {
                    if !a.contains_key("sandboxId") {
                        return Err(vec![issue("sandboxId", "is required by action create")]);
                    }
                    Call::post(
                        format!("/v1/sandboxes/{}:snapshot", enc(s(a, "sandboxId"))),
                        pick(a, &["name", "labels", "retentionDays", "mode"]),
                    )
                    .settled()
                }
                "list" => Call::get("/v1/snapshots".into())
                    .with_query(a, &["sandboxId", "name", "limit", "cursor"]),
                "get" => Call::get(snap),
                _ => Call::delete(snap),
            }
        }
        "runtime_sandbox_previews" => {
            let port = a.get("port").map(Value::to_string).unwrap_or_default();
            let previews = format!("{sbx}/previews");
            match action {
                "create" => Call::post(previews, pick(a, &["port", "visibility", "ttlSeconds"])),
                "list" => Call::get(previews),
                "get" => Call::get(format!("{previews}/{port}")),
                "rotate" => Call::post(format!("{previews}/{port}:rotate"), json!({})),
                _ => Call::delete(format!("{previews}/{port}")),
            }
        }
        "runtime_sandbox_network" => match action {
            "get" => Call::get(format!("{sbx}/network")),
            _ => Call {
                body: Payload::Json(pick(a, &["network", "secrets"])),
                ..Call::new(Method::PUT, format!("{sbx}/network"))
            },
        },
        "runtime_image" => {
            let img = format!("/v1/images/{}", enc(s(a, "imageId")));
            match action {
                "list" => {
                    Call::get("/v1/images".into()).with_query(a, &["name", "limit", "cursor"])
                }
                "get" => Call::get(img),
                "logs" => Call::get(format!("{img}/logs")),
                "resolve" => Call::get("/v1/images/resolve".into()).with_query(a, &["ref"]),
                _ => Call::delete(img),
            }
        }
        "runtime_image_build" => Call::post("/v1/images".into(), all_but(a, &["idempotencyKey"])),
        "runtime_volume" => {
            let vol = format!("/v1/volumes/{}", enc(s(a, "volumeId")));
            match action {
                "create" => Call::post(
                    "/v1/volumes".into(),
                    pick(a, &["sizeMiB", "name", "labels"]),
                ),
                "list" => {
                    Call::get("/v1/volumes".into()).with_query(a, &["name", "limit", "cursor"])
                }
                "get" => Call::get(vol),
                _ => Call::delete(vol),
            }
        }
        "runtime_sandbox_metrics" => Call::get(format!("{sbx}/metrics")).with_query(a, &["range"]),
        "runtime_events_list" => {
            Call::get("/v1/events".into()).with_query(a, &["resourceId", "type", "limit", "cursor"])
        }
        _ => match action {
            "limits" => Call::get("/v1/limits".into()),
            "usage" => Call::get("/v1/usage".into()),
            _ => Call::get("/v1/me".into()),
        },
    };
    if call.method != Method::GET {
        call.idem = a
            .get("idempotencyKey")
            .and_then(Value::as_str)
            .map(str::to_string);
    }
    Ok(call)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan_of(tool: &str, args: Value) -> Call {
        let t = find(tool).unwrap();
        let a = super::super::schema::check(t.args, Some(&args)).unwrap();
        plan(t, &a).unwrap()
    }

    #[test]
    fn mcp_tools_become_api_requests() {
        let c = plan_of(
            "runtime_sandbox_exec",
            json!({"id": "a/b:c", "command": ["ls", "-l"], "idempotencyKey": "k1"}),
        );
        assert_eq!(c.method, Method::POST);
        assert_eq!(c.uri(), "/v1/sandboxes/a%2Fb%3Ac:exec");
        assert!(matches!(&c.body, Payload::Json(v) if v == &json!({"argv": ["ls", "-l"]})));
        assert_eq!(c.idem.as_deref(), Some("k1"));
        let c = plan_of(
            "runtime_sandbox_list",
            json!({"state": ["running", "paused"], "labels": {"team": "a b"}}),
        );
        assert_eq!(
            c.uri(),
            "/v1/sandboxes?state=running&state=paused&label=team%3Aa%20b"
        );
        let c = plan_of(
            "runtime_sandbox_files_read",
            json!({"id": "s", "path": "/etc/hosts", "startLine": 2}),
        );
        assert_eq!(c.uri(), "/v1/sandboxes/s/files/content?path=%2Fetc%2Fhosts");
        assert_eq!(
            c.shape,
            Shape::File {
                start: Some(2),
                end: None
            }
        );
        let c = plan_of(
            "runtime_sandbox_files_manage",
            json!({"id": "s", "action": "move", "from": "./a", "to": "/b"}),
        );
        assert_eq!(c.uri(), "/v1/sandboxes/s/files:rename");
        assert!(
            matches!(&c.body, Payload::Json(v) if v == &json!({"from": "/workspace/a", "to": "/b"}))
        );
        let c = plan_of("runtime_account", json!({"action": "limits"}));
        assert_eq!(c.uri(), "/v1/limits");
    }

    #[test]
    fn mcp_every_tool_has_a_valid_schema_and_a_plan() {
        for t in TOOLS {
            let s = super::super::schema::input_schema(t.args);
            assert_eq!(s["type"], "object", "{}", t.name);
            assert!(t.name.starts_with("runtime_"), "{}", t.name);
            assert!(t.name.len() <= 64);
        }
        let names: std::collections::BTreeSet<&str> = TOOLS.iter().map(|t| t.name).collect();
        assert_eq!(names.len(), TOOLS.len(), "tool names are unique");
    }
}
