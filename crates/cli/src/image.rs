//! `runtime image ls|logs|tag|rm|registry` call the API of any server (see
//! [`RemoteCmd`]). `runtime image build --file recipe.toml`: builds a custom image on a
//! running server through its API (`POST /v1/images`, then `GET
//! /v1/images/{id}` until the build ends), printing each step as it starts
//! and ends, and the image's id and name at the end.
//!
//! The recipe file holds the API's recipe fields (`base`, `apt`, `pip`,
//! `npm`, `commands`, `env`, `files`, `workdir`) and, beside them, the
//! image's `name`, `tags` and `start`:
//!
//! ```toml
//! name = "app"
//! workdir = "/workspace/app"
//! apt = ["jq"]
//! pip = ["pandas"]
//! commands = ["python3 -c 'import pandas'"]
//! start = "python3 -m http.server 8000"
//!
//! [env]
//! APP_ENV = "production"
//!
//! [files]
//! "/workspace/app/config.toml" = "debug = false\n"
//! ```
//!
//! `files` is a table of path = text, or an array of tables `{path,
//! content, encoding?, mode?}` as in the API.
//!
//! `runtime image build DIR -t name:tag` builds the folder's Dockerfile with
//! the folder as its context (packed and uploaded as the official client
//! does, [`pack_context`]); `runtime image build --from REF -t name:tag`
//! builds a registry image as it is.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use serde_json::{json, Map, Value};
use sha2::{Digest, Sha256};

use crate::client::{self, ConnArgs};
use crate::login;

/// The recipe fields, passed to the server's `recipe`.
const RECIPE: &[&str] = &[
    "base", "apt", "pip", "npm", "commands", "env", "files", "workdir",
];
/// The fields of the image itself, beside the recipe.
const IMAGE: &[&str] = &["name", "tags", "start"];

/// A TOML value as JSON (dates become their text).
fn to_json(v: &toml::Value) -> Value {
    match v {
        toml::Value::String(s) => Value::String(s.clone()),
        toml::Value::Integer(i) => json!(i),
        toml::Value::Float(f) => json!(f),
        toml::Value::Boolean(b) => Value::Bool(*b),
        toml::Value::Datetime(d) => Value::String(d.to_string()),
        toml::Value::Array(a) => Value::Array(a.iter().map(to_json).collect()),
        toml::Value::Table(t) => Value::Object(
            t.iter()
                .map(|(k, v)| (k.clone(), to_json(v)))
                .collect::<Map<_, _>>(),
        ),
    }
}

fn strings(v: &toml::Value, field: &str) -> anyhow::Result<Value> {
    match v.as_array() {
        Some(a) if a.iter().all(toml::Value::is_str) => Ok(to_json(v)),
        _ => bail!("`{field}` must be an array of strings"),
    }
}

fn string(v: &toml::Value, field: &str) -> anyhow::Result<Value> {
    match v.as_str() {
        Some(s) => Ok(Value::String(s.to_string())),
        None => bail!("`{field}` must be a string"),
    }
}

/// The body of `POST /v1/images` for a recipe file's text; `name` and
/// `tags` given on the command line win over the file's.
pub(crate) fn body_from_toml(
    text: &str,
    name: Option<&str>,
    tags: &[String],
) -> anyhow::Result<Value> {
    let table: toml::Table = toml::from_str(text).context("not a valid TOML recipe")?;
    let mut recipe = Map::new();
    let mut body = Map::new();
    for (k, v) in &table {
        let value = match k.as_str() {
            "apt" | "pip" | "npm" | "commands" | "tags" => strings(v, k)?,
            "base" | "workdir" | "name" => string(v, k)?,
            "env" => match v.as_table() {
                Some(t) if t.values().all(toml::Value::is_str) => to_json(v),
                _ => bail!("`env` must be a table of strings (NAME = \"value\")"),
            },
            "files" => files(v)?,
            "start" => match v {
                toml::Value::String(_) | toml::Value::Array(_) => json!({"command": to_json(v)}),
                toml::Value::Table(_) => to_json(v),
                _ => bail!(
                    "`start` must be a command: a string, an array of strings or {{command = ...}}"
                ),
            },
            other => bail!(
                "`{other}` is not a recipe field (the fields are {}, {})",
                RECIPE.join(", "),
                IMAGE.join(", ")
            ),
        };
        if RECIPE.contains(&k.as_str()) {
            recipe.insert(k.clone(), value);
        } else {
            body.insert(k.clone(), value);
        }
    }
    if let Some(n) = name {
        body.insert("name".into(), json!(n));
    }
    if !tags.is_empty() {
        body.insert("tags".into(), json!(tags));
    }
    body.insert("recipe".into(), Value::Object(recipe));
    Ok(Value::Object(body))
}

/// `files`: a table of path = text, or the API's list of `{path, content,
/// encoding?, mode?}`.
fn files(v: &toml::Value) -> anyhow::Result<Value> {
    match v {
        toml::Value::Table(t) => t
            .iter()
            .map(|(path, content)| match content.as_str() {
                Some(c) => Ok(json!({"path": path, "content": c})),
                None => bail!("`files`: the content of {path} must be a string"),
            })
            .collect::<anyhow::Result<Vec<_>>>()
            .map(Value::Array),
        toml::Value::Array(a) if a.iter().all(toml::Value::is_table) => Ok(to_json(v)),
        _ => bail!(
            "`files` must be a table of path = \"content\" or an array of {{path, content}} tables"
        ),
    }
}

/// Where the API is and the key to call it with: `--url`/`RUNTIME_API_URL`
/// (default this machine's `runtime serve`), `--key`/`RUNTIME_API_KEY`,
/// else the key `runtime login` saved for that server.
pub(crate) struct Target {
    pub url: String,
    pub key: String,
}

impl Target {
    pub(crate) fn new(url: &str, key: Option<String>) -> anyhow::Result<Target> {
        let url = login::origin(url.trim());
        let key = match key.filter(|k| !k.trim().is_empty()) {
            Some(k) => k.trim().to_string(),
            None => login::saved_key(&url).with_context(|| {
                format!("no API key for {url}: give --key, set RUNTIME_API_KEY, or run `runtime login --url {url}`")
            })?,
        };
        Ok(Target { url, key })
    }

    fn call(&self, method: &str, path: &str, body: Option<&Value>) -> anyhow::Result<(u16, Value)> {
        login::call(&self.url, method, path, body, Some(&self.key))
            .with_context(|| format!("{method} {}{path}", self.url))
    }
}

/// The message of an API error answer.
fn api_error(status: u16, v: &Value) -> String {
    let e = &v["error"];
    let mut out = format!(
        "{} ({status}): {}",
        e["code"].as_str().unwrap_or("error"),
        e["message"].as_str().unwrap_or("no message")
    );
    if let Some(issues) = e["details"]["issues"].as_array() {
        for i in issues {
            out.push_str(&format!(
                "\n  {}: {}",
                i["field"].as_str().unwrap_or("?"),
                i["message"].as_str().unwrap_or("")
            ));
        }
    }
    out
}

fn label(image: &Value) -> String {
    match image["name"].as_str() {
        Some(n) => format!("{n}@{}", image["version"]),
        None => "(no name)".into(),
    }
}

/// Progress lines for the steps whose state changed since `seen`.
fn report_steps(image: &Value, seen: &mut Vec<String>) {
    let steps = image["steps"].as_array().cloned().unwrap_or_default();
    let total = steps.len();
    seen.resize(total, "pending".into());
    for (i, s) in steps.iter().enumerate() {
        let state = s["state"].as_str().unwrap_or("pending").to_string();
        if seen[i] == state {
            continue;
        }
        let what = s["instruction"].as_str().unwrap_or("");
        let n = i + 1;
        // A step that started and ended between two looks still shows
        // its start.
        if seen[i] == "pending" && matches!(state.as_str(), "done" | "failed") {
            eprintln!("step {n}/{total} {what} ...");
        }
        match state.as_str() {
            "running" => eprintln!("step {n}/{total} {what} ..."),
            "cached" => eprintln!("step {n}/{total} {what} (cached)"),
            "done" => {
                let secs = s["seconds"].as_f64().unwrap_or(0.0);
                eprintln!("step {n}/{total} done in {secs:.1} s");
            }
            "failed" => eprintln!("step {n}/{total} {what} FAILED"),
            _ => {}
        }
        seen[i] = state;
    }
}

/// Prints the build log's lines past `after` on stderr (indented under the
/// step lines); a failure to read them is left for the next look.
fn follow_log(target: &Target, id: &str, after: &mut Option<u64>) {
    let q = after.map_or_else(String::new, |a| format!("?after={a}"));
    if let Ok((200, v)) = target.call("GET", &format!("/v1/images/{id}/logs{q}"), None) {
        for l in v["lines"].as_array().into_iter().flatten() {
            eprintln!("    {}", l["text"].as_str().unwrap_or(""));
        }
        if let Some(n) = v["nextAfter"].as_u64() {
            *after = Some(n);
        }
    }
}

/// Builds the image `body` describes and waits for it; the final image on
/// success, an error naming the failed step and its output otherwise.
pub(crate) fn build(target: &Target, body: &Value) -> anyhow::Result<Value> {
    let started = Instant::now();
    let (status, created) = target.call("POST", "/v1/images", Some(body))?;
    if status != 201 && status != 200 {
        bail!(
            "the server refused the build: {}",
            api_error(status, &created)
        );
    }
    let id = created["id"]
        .as_str()
        .context("the server's answer has no image id")?
        .to_string();
    eprintln!(
        "image {id} ({}): {} steps queued",
        label(&created),
        created["steps"].as_array().map_or(0, Vec::len)
    );
    let mut seen = Vec::new();
    let mut image = created;
    let mut failures = 0;
    let mut log_after: Option<u64> = None;
    loop {
        report_steps(&image, &mut seen);
        match image["state"].as_str() {
            Some("ready") => break,
            Some("failed") => bail!(
                "image {id} ({}) failed: {}\n(the whole log: GET /v1/images/{id}/logs)",
                label(&image),
                image["error"].as_str().unwrap_or("no error given")
            ),
            _ => {}
        }
        std::thread::sleep(Duration::from_secs(1));
        follow_log(target, &id, &mut log_after);
        match target.call("GET", &format!("/v1/images/{id}"), None) {
            Ok((200, v)) => {
                image = v;
                failures = 0;
            }
            Ok((status, v)) => bail!("reading image {id}: {}", api_error(status, &v)),
            // A server restarting or busy: a few tries before giving up.
            Err(e) if failures < 10 => {
                failures += 1;
                eprintln!("runtime: {e:#}; trying again");
            }
            Err(e) => return Err(e),
        }
    }
    follow_log(target, &id, &mut log_after);
    println!(
        "image {id} {} ready in {:.1} s (tags: {})",
        label(&image),
        started.elapsed().as_secs_f64(),
        image["tags"]
            .as_array()
            .map(|t| t
                .iter()
                .filter_map(Value::as_str)
                .collect::<Vec<_>>()
                .join(", "))
            .unwrap_or_default()
    );
    Ok(image)
}

/// Most files, compressed bytes and chunk size of a build context (the
/// server's and the official client's limits).
const CONTEXT_FILES: usize = 20_000;
const CONTEXT_BYTES: usize = 100 << 20;
const CHUNK_BYTES: usize = 1 << 20;

/// A folder packed as a build context, the way the official client sends
/// one: every regular file its `.dockerignore` leaves in (`.git` when it has
/// none; links are not followed), in one gzipped tar with no times or
/// owners, and the list of files with their SHA-256.
pub(crate) struct Packed {
    pub archive: Vec<u8>,
    pub files: Vec<Value>,
    pub dockerignore: Option<String>,
}

fn sha256_hex(b: &[u8]) -> String {
    hex::encode(Sha256::digest(b))
}

/// Packs `dir`; `dockerfile` is the Dockerfile's path, whose
/// `<name>.dockerignore` beside it wins over the folder's `.dockerignore`.
pub(crate) fn pack_context(dir: &Path, dockerfile: &Path) -> anyhow::Result<Packed> {
    let own = PathBuf::from(format!("{}.dockerignore", dockerfile.display()));
    let dockerignore = [own, dir.join(".dockerignore")]
        .iter()
        .find_map(|p| std::fs::read_to_string(p).ok());
    let text = dockerignore.clone().unwrap_or_else(|| ".git\n".into());
    let excluded = runtime_server::dockerignore(&text);
    // Without a re-include, nothing under a left-out folder comes back.
    let prune_dirs = !text.lines().any(|l| l.trim_start().starts_with('!'));
    let mut paths = Vec::new();
    let mut stack = vec![(dir.to_path_buf(), String::new())];
    while let Some((at, prefix)) = stack.pop() {
        let mut entries: Vec<_> = std::fs::read_dir(&at)
            .with_context(|| format!("reading {}", at.display()))?
            .collect::<Result<_, _>>()?;
        entries.sort_by_key(|e| e.file_name());
        for e in entries.into_iter().rev() {
            let name = e.file_name().to_string_lossy().into_owned();
            let rel = format!("{prefix}{name}");
            let kind = e.file_type()?;
            if kind.is_dir() {
                if !(prune_dirs && excluded(&rel)) {
                    stack.push((e.path(), format!("{rel}/")));
                }
            } else if kind.is_file() && !excluded(&rel) {
                paths.push((rel, e.path()));
            }
        }
    }
    paths.sort();
    if paths.len() > CONTEXT_FILES {
        bail!("the build context has more than {CONTEXT_FILES} files: leave some out with a .dockerignore");
    }
    let gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::new(6));
    let mut tar = tar::Builder::new(gz);
    let mut files = Vec::new();
    for (rel, full) in &paths {
        use std::os::unix::fs::PermissionsExt;
        let data = std::fs::read(full).with_context(|| format!("reading {}", full.display()))?;
        let mode = std::fs::metadata(full)?.permissions().mode() & 0o777;
        let mut h = tar::Header::new_gnu();
        h.set_size(data.len() as u64);
        h.set_mode(mode);
        h.set_mtime(0);
        h.set_uid(0);
        h.set_gid(0);
        h.set_entry_type(tar::EntryType::Regular);
        tar.append_data(&mut h, rel, &data[..])
            .with_context(|| format!("packing {rel}"))?;
        files.push(
            json!({"path": rel, "sha256": sha256_hex(&data), "size": data.len(), "mode": mode}),
        );
    }
    let archive = tar.into_inner()?.finish()?;
    if archive.len() > CONTEXT_BYTES {
        bail!(
            "the build context is {} MiB compressed; the most is {} MiB: leave build outputs and dependencies out with a .dockerignore",
            archive.len() / 1048576 + 1,
            CONTEXT_BYTES >> 20
        );
    }
    Ok(Packed {
        archive,
        files,
        dockerignore,
    })
}

/// Uploads the chunks of `p` the server lacks; the `context` a build names.
pub(crate) fn upload_context(target: &Target, p: &Packed) -> anyhow::Result<Value> {
    let chunks: Vec<&[u8]> = p.archive.chunks(CHUNK_BYTES).collect();
    let digests: Vec<String> = chunks.iter().map(|c| sha256_hex(c)).collect();
    let (status, v) = target.call(
        "POST",
        "/v1/images/context/missing",
        Some(&json!({ "digests": digests })),
    )?;
    if status != 200 {
        bail!("the server refused the context: {}", api_error(status, &v));
    }
    let mut missing: Vec<String> = v["missing"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|d| d.as_str().map(String::from))
        .collect();
    let mut sent = 0;
    for (digest, chunk) in digests.iter().zip(&chunks) {
        if let Some(i) = missing.iter().position(|m| m == digest) {
            missing.swap_remove(i);
            let path = format!("/v1/images/context/{digest}");
            let (status, v) = login::call_bytes(
                &target.url,
                "PUT",
                &path,
                "application/octet-stream",
                chunk,
                Some(&target.key),
            )
            .with_context(|| format!("PUT {}{path}", target.url))?;
            if !(200..300).contains(&status) {
                bail!(
                    "the server refused a context chunk: {}",
                    api_error(status, &v)
                );
            }
            sent += 1;
        }
    }
    eprintln!(
        "context: {} files, {:.1} MiB compressed, {sent} of {} chunks sent",
        p.files.len(),
        p.archive.len() as f64 / 1048576.0,
        chunks.len()
    );
    Ok(json!({
        "archive": {"sha256": sha256_hex(&p.archive), "size": p.archive.len(), "chunks": digests},
        "files": p.files,
    }))
}

/// A `-t` of `image build DIR|--from`: `name[:tag]`.
pub(crate) fn name_and_tags(
    name: Option<&str>,
    tagged: &[String],
) -> anyhow::Result<(Option<String>, Vec<String>)> {
    let mut name = name.map(String::from);
    let mut tags = Vec::new();
    for t in tagged {
        // The last `:` not followed by a `/` (a registry's port is not a tag).
        let (n, tag) = match t.rsplit_once(':') {
            Some((n, tag)) if !tag.contains('/') => (n, Some(tag)),
            _ => (t.as_str(), None),
        };
        match &name {
            Some(have) if have != n => {
                bail!("-t {t}: one build makes one name's version, and {have} is named already")
            }
            _ => name = Some(n.to_string()),
        }
        tags.extend(tag.map(String::from));
    }
    Ok((name, tags))
}

/// `runtime image ls|logs|tag|rm`: the server's images, through the API.
#[derive(clap::Subcommand)]
pub(crate) enum RemoteCmd {
    /// List the server's images (newest first).
    #[command(alias = "list")]
    Ls {
        #[command(flatten)]
        conn: ConnArgs,
        /// Only the versions of this name.
        #[arg(long)]
        name: Option<String>,
        #[arg(long)]
        json: bool,
    },
    /// An image's build log; `-f` follows it until the build ends.
    Logs {
        #[command(flatten)]
        conn: ConnArgs,
        /// An id, `name`, `name:tag` or `name@version`.
        image: String,
        #[arg(short = 'f', long)]
        follow: bool,
    },
    /// Give an image version a tag.
    Tag {
        #[command(flatten)]
        conn: ConnArgs,
        image: String,
        tag: String,
    },
    /// Take a tag off an image version.
    Untag {
        #[command(flatten)]
        conn: ConnArgs,
        image: String,
        tag: String,
    },
    /// Remove the layers and blobs no image uses (admin keys).
    Prune {
        #[command(flatten)]
        conn: ConnArgs,
        #[arg(long)]
        json: bool,
    },
    /// Delete images (refused while a sandbox uses one).
    #[command(alias = "delete")]
    Rm {
        #[command(flatten)]
        conn: ConnArgs,
        #[arg(required = true)]
        images: Vec<String>,
        #[arg(long)]
        json: bool,
    },
    /// Credentials for private registries, used by this key's pulls.
    #[command(subcommand)]
    Registry(RegistryCmd),
}

/// `runtime image registry set|ls|rm`.
#[derive(clap::Subcommand)]
pub(crate) enum RegistryCmd {
    /// Store (or replace) a registry's credential; the password, token or
    /// ECR secret access key is read from stdin:
    /// `echo "$TOKEN" | runtime image registry set ghcr.io --username me`.
    Set {
        #[command(flatten)]
        conn: ConnArgs,
        /// The registry's host[:port] (`docker.io` for Docker Hub).
        registry: String,
        /// The user name (with a password or token on stdin).
        #[arg(long, required_unless_present = "access_key_id")]
        username: Option<String>,
        /// An Amazon ECR access key id (with its secret access key on stdin).
        #[arg(long, conflicts_with = "username")]
        access_key_id: Option<String>,
    },
    /// The stored credentials (never their secrets).
    #[command(alias = "list")]
    Ls {
        #[command(flatten)]
        conn: ConnArgs,
        #[arg(long)]
        json: bool,
    },
    /// Delete stored credentials.
    #[command(alias = "delete")]
    Rm {
        #[command(flatten)]
        conn: ConnArgs,
        #[arg(required = true)]
        registries: Vec<String>,
    },
}

/// The secret piped on stdin, without the line break `echo` adds.
fn secret_from_stdin() -> anyhow::Result<String> {
    use std::io::{IsTerminal, Read};
    let stdin = std::io::stdin();
    if stdin.is_terminal() {
        bail!("pipe the secret on stdin: echo \"$TOKEN\" | runtime image registry set HOST --username USER");
    }
    let mut data = String::new();
    stdin
        .lock()
        .take(64 << 10)
        .read_to_string(&mut data)
        .context("reading the secret from stdin")?;
    let secret = data
        .strip_suffix("\r\n")
        .or_else(|| data.strip_suffix('\n'))
        .unwrap_or(&data);
    if secret.is_empty() {
        bail!("stdin held no secret");
    }
    Ok(secret.to_string())
}

async fn registry(cmd: RegistryCmd) -> anyhow::Result<i32> {
    use crate::output::{self, cell};
    match cmd {
        RegistryCmd::Set {
            conn,
            registry,
            username,
            access_key_id,
        } => {
            let t = conn.target()?;
            let secret = secret_from_stdin()?;
            let body = match (username, access_key_id) {
                (_, Some(id)) => {
                    json!({"registry": registry, "accessKeyId": id, "secretAccessKey": secret})
                }
                (u, None) => json!({"registry": registry, "username": u, "password": secret}),
            };
            let v = t.json("POST", "/v1/images/registries", Some(&body)).await?;
            println!("{} {}", cell(&v["registry"]), cell(&v["kind"]));
            Ok(0)
        }
        RegistryCmd::Ls { conn, json } => {
            let t = conn.target()?;
            let v = t.json("GET", "/v1/images/registries", None).await?;
            if json {
                output::json(&v["data"]);
                return Ok(0);
            }
            let rows: Vec<Vec<String>> = v["data"]
                .as_array()
                .map(Vec::as_slice)
                .unwrap_or_default()
                .iter()
                .map(|r| {
                    let user = if r["kind"] == "ecr" {
                        cell(&r["accessKeyId"])
                    } else {
                        cell(&r["username"])
                    };
                    vec![
                        cell(&r["registry"]),
                        cell(&r["kind"]),
                        user,
                        cell(&r["updatedAt"]),
                    ]
                })
                .collect();
            output::table(&["REGISTRY", "KIND", "USER", "UPDATED"], &rows);
            Ok(0)
        }
        RegistryCmd::Rm { conn, registries } => {
            let t = conn.target()?;
            for r in registries {
                let v = t
                    .json(
                        "POST",
                        "/v1/images/registries:delete",
                        Some(&json!({ "registry": r })),
                    )
                    .await?;
                println!("deleted {}", cell(&v["registry"]));
            }
            Ok(0)
        }
    }
}

/// An image's id from an id, `name`, `name:tag` or `name@version`.
async fn resolve_image(t: &client::Target, r: &str) -> anyhow::Result<String> {
    let v = t
        .json(
            "GET",
            &format!(
                "/v1/images/resolve{}",
                client::query(&[("ref", r.to_string())])
            ),
            None,
        )
        .await?;
    v["id"]
        .as_str()
        .map(str::to_string)
        .context("the server's answer has no image id")
}

/// `tag` or `untag` (`verb`) on the image `image` names.
async fn retag(conn: ConnArgs, image: &str, tag: &str, verb: &str) -> anyhow::Result<i32> {
    let t = conn.target()?;
    let id = resolve_image(&t, image).await?;
    let v = t
        .json(
            "POST",
            &format!("/v1/images/{}:{verb}", client::enc(&id)),
            Some(&json!({ "tag": tag })),
        )
        .await?;
    println!("{id} {}", label(&v));
    Ok(0)
}

pub(crate) async fn remote(cmd: RemoteCmd) -> anyhow::Result<i32> {
    use crate::output::{self, cell};
    match cmd {
        RemoteCmd::Ls { conn, name, json } => {
            let t = conn.target()?;
            let q: Vec<(&str, String)> = name.iter().map(|n| ("name", n.clone())).collect();
            let all = t.list_all("/v1/images", &q).await?;
            if json {
                output::json(&Value::Array(all));
                return Ok(0);
            }
            let rows: Vec<Vec<String>> = all
                .iter()
                .map(|i| {
                    let tags = i["tags"]
                        .as_array()
                        .map(|a| a.iter().map(cell).collect::<Vec<_>>().join(","))
                        .unwrap_or_default();
                    vec![
                        cell(&i["id"]),
                        cell(&i["name"]),
                        cell(&i["version"]),
                        if tags.is_empty() { "-".into() } else { tags },
                        cell(&i["state"]),
                        cell(&i["createdAt"]),
                    ]
                })
                .collect();
            output::table(
                &["ID", "NAME", "VERSION", "TAGS", "STATE", "CREATED"],
                &rows,
            );
            Ok(0)
        }
        RemoteCmd::Logs {
            conn,
            image,
            follow,
        } => {
            let t = conn.target()?;
            let id = resolve_image(&t, &image).await?;
            let mut after: Option<u64> = None;
            loop {
                let q = after.map_or_else(String::new, |a| format!("?after={a}"));
                let v = t
                    .json(
                        "GET",
                        &format!("/v1/images/{}/logs{q}", client::enc(&id)),
                        None,
                    )
                    .await?;
                for l in v["lines"].as_array().cloned().unwrap_or_default() {
                    let text = l["text"].as_str().unwrap_or("");
                    match l["step"].as_u64() {
                        Some(s) => println!("[{}] {text}", s + 1),
                        None => println!("{text}"),
                    }
                }
                if let Some(n) = v["nextAfter"].as_u64() {
                    after = Some(n);
                }
                if !follow || v["done"].as_bool() != Some(false) {
                    break;
                }
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
            Ok(0)
        }
        RemoteCmd::Tag { conn, image, tag } => retag(conn, &image, &tag, "tag").await,
        RemoteCmd::Untag { conn, image, tag } => retag(conn, &image, &tag, "untag").await,
        RemoteCmd::Prune { conn, json } => {
            let t = conn.target()?;
            let v = t.json("POST", "/v1/images:prune", Some(&json!({}))).await?;
            if json {
                println!("{v}");
            } else {
                println!(
                    "removed {} layers and {} blobs, {:.1} MiB",
                    v["removedLayers"].as_u64().unwrap_or(0),
                    v["removedBlobs"].as_u64().unwrap_or(0),
                    v["freedBytes"].as_u64().unwrap_or(0) as f64 / 1048576.0
                );
            }
            Ok(0)
        }
        RemoteCmd::Registry(cmd) => registry(cmd).await,
        RemoteCmd::Rm { conn, images, json } => {
            let t = conn.target()?;
            for r in images {
                let id = resolve_image(&t, &r).await?;
                let v = t
                    .json("DELETE", &format!("/v1/images/{}", client::enc(&id)), None)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_recipe_file_becomes_the_api_body() {
        let text = r#"
name = "app"
tags = ["latest", "stable"]
base = "default"
workdir = "/workspace/app"
apt = ["hello"]
pip = ["rtdemo"]
npm = ["rtdemo"]
commands = ["echo hi > hi.txt"]
start = "python3 -m http.server"

[env]
APP_ENV = "production"

[files]
"/workspace/app/config.txt" = "answer=42\n"
"#;
        let body = body_from_toml(text, None, &[]).unwrap();
        assert_eq!(
            body,
            json!({
                "name": "app",
                "tags": ["latest", "stable"],
                "start": {"command": "python3 -m http.server"},
                "recipe": {
                    "base": "default",
                    "workdir": "/workspace/app",
                    "apt": ["hello"],
                    "pip": ["rtdemo"],
                    "npm": ["rtdemo"],
                    "commands": ["echo hi > hi.txt"],
                    "env": {"APP_ENV": "production"},
                    "files": [{"path": "/workspace/app/config.txt", "content": "answer=42\n"}],
                },
            })
        );
    }

    #[test]
    fn the_command_line_wins_and_files_may_be_a_list() {
        let text = r#"
name = "from-file"
tags = ["old"]
start = ["python3", "app.py"]

[[files]]
path = "/srv/run.sh"
content = "IyEvYmluL3NoCg=="
encoding = "base64"
mode = "755"
"#;
        let body = body_from_toml(text, Some("cli"), &["v1".into()]).unwrap();
        assert_eq!(body["name"], "cli");
        assert_eq!(body["tags"], json!(["v1"]));
        assert_eq!(body["start"], json!({"command": ["python3", "app.py"]}));
        assert_eq!(
            body["recipe"]["files"],
            json!([{"path": "/srv/run.sh", "content": "IyEvYmluL3NoCg==", "encoding": "base64", "mode": "755"}])
        );
        // An empty file is an empty recipe: the server's own image.
        assert_eq!(
            body_from_toml("", None, &[]).unwrap(),
            json!({"recipe": {}})
        );
    }

    #[test]
    fn a_folder_packs_as_the_client_does_less_what_it_ignores() {
        let dir = std::env::temp_dir().join(format!("pack-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("keep/deep")).unwrap();
        std::fs::create_dir_all(dir.join("skip")).unwrap();
        std::fs::write(dir.join("Dockerfile"), "FROM runtime\n").unwrap();
        std::fs::write(dir.join(".dockerignore"), "skip\n*.log\n").unwrap();
        std::fs::write(dir.join("keep/deep/a.txt"), "a").unwrap();
        std::fs::write(dir.join("keep/b.log"), "b").unwrap();
        std::fs::write(dir.join("skip/c.txt"), "c").unwrap();
        std::fs::write(dir.join("top.log"), "t").unwrap();
        let p = pack_context(&dir, &dir.join("Dockerfile")).unwrap();
        let paths: Vec<&str> = p.files.iter().filter_map(|f| f["path"].as_str()).collect();
        // As Docker reads it, `*.log` is the context's top level only.
        assert_eq!(
            paths,
            [
                ".dockerignore",
                "Dockerfile",
                "keep/b.log",
                "keep/deep/a.txt"
            ]
        );
        assert_eq!(p.files[3]["sha256"], sha256_hex(b"a"));
        assert_eq!(p.dockerignore.as_deref(), Some("skip\n*.log\n"));
        // The same folder gives the same bytes (no times, no owners).
        let again = pack_context(&dir, &dir.join("Dockerfile")).unwrap();
        assert_eq!(p.archive, again.archive);
        let mut ar = tar::Archive::new(flate2::read::GzDecoder::new(&p.archive[..]));
        let names: Vec<String> = ar
            .entries()
            .unwrap()
            .map(|e| e.unwrap().path().unwrap().display().to_string())
            .collect();
        assert_eq!(names, paths);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_build_tag_names_one_image() {
        let tags = |t: &[&str]| {
            let t: Vec<String> = t.iter().map(|s| s.to_string()).collect();
            name_and_tags(None, &t).map_err(|e| e.to_string())
        };
        assert_eq!(
            tags(&["web:v1", "web:latest"]),
            Ok((Some("web".into()), vec!["v1".into(), "latest".into()]))
        );
        assert_eq!(tags(&["web"]), Ok((Some("web".into()), vec![])));
        assert_eq!(
            tags(&["localhost:5000/web"]),
            Ok((Some("localhost:5000/web".into()), vec![]))
        );
        assert!(tags(&["a:1", "b:1"]).unwrap_err().contains("one name"));
    }

    #[test]
    fn errors_name_the_field() {
        let e = body_from_toml("pakages = [\"jq\"]\n", None, &[]).unwrap_err();
        let msg = format!("{e:#}");
        assert!(msg.contains("`pakages` is not a recipe field"), "{msg}");
        assert!(msg.contains("apt"), "{msg}");
        for (text, field) in [
            ("apt = \"jq\"", "`apt`"),
            ("commands = [1]", "`commands`"),
            ("workdir = 3", "`workdir`"),
            ("[env]\nN = 1", "`env`"),
            ("files = \"x\"", "`files`"),
            ("start = 1", "`start`"),
        ] {
            let msg = format!("{:#}", body_from_toml(text, None, &[]).unwrap_err());
            assert!(msg.contains(field), "{text} -> {msg}");
        }
        let msg = format!("{:#}", body_from_toml("apt = [", None, &[]).unwrap_err());
        assert!(msg.contains("TOML"), "{msg}");
    }

    #[test]
    fn progress_reports_each_change_once() {
        let mut seen = Vec::new();
        let image = json!({"steps": [
            {"instruction": "apt install hello", "state": "cached"},
            {"instruction": "RUN true", "state": "running"},
        ]});
        report_steps(&image, &mut seen);
        assert_eq!(seen, vec!["cached", "running"]);
        report_steps(&image, &mut seen);
        assert_eq!(seen, vec!["cached", "running"]);
    }
}
