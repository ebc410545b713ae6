//! The route table: one place that says which method and path is which
//! [`Route`], how large a body it reads, whether it shows what is inside a
//! sandbox, and a sample request of each for the tests. Routes are matched
//! by hand because ids arrive percent-encoded and actions follow the first
//! literal `:` of the last raw segment (`/v1/sandboxes/{id}:exec`), which
//! axum's router treats specially.

use axum::http::Method;

use crate::error::{ApiError, ApiResult};
use crate::http::extract::percent_decode;

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Route {
    CreateSandbox,
    ListSandboxes,
    GetSandbox(String),
    DeleteSandbox(String),
    SandboxAction(String, String),
    FileContentGet(String),
    FileContentPut(String),
    FilesList(String),
    FilesStat(String),
    FilesAction(String, String),
    /// `…/files/archive`: a folder as a tar, out (`GET`) or in (`PUT`).
    ArchiveGet(String),
    ArchivePut(String),
    UploadBegin(String),
    UploadChunk(String, String),
    UploadAction(String, String, String),
    /// `…/files/archive/uploads[/{u}[:commit|:abort]]`: a large archive in
    /// ordered chunks.
    ArchiveUploadBegin(String),
    ArchiveUploadChunk(String, String),
    ArchiveUploadAction(String, String, String),
    ProcSpawn(String),
    ProcList(String),
    ProcGet(String, String),
    ProcOutput(String, String),
    /// `…/processes/{pid}/files`: what a traced process opened.
    ProcFiles(String, String),
    ProcAction(String, String, String),
    /// `…/files/watches[/{w}[/events]]`.
    WatchCreate(String),
    WatchList(String),
    WatchEvents(String, String),
    WatchDelete(String, String),
    ListSnapshots,
    GetSnapshot(String),
    DeleteSnapshot(String),
    SnapshotAction(String, String),
    CreateImage,
    ListImages,
    ResolveImage,
    /// `/v1/images/registries[:delete]`: the key's registry credentials.
    ListRegistries,
    SetRegistry,
    DeleteRegistry,
    GetImage(String),
    ImageLogs(String),
    DeleteImage(String),
    ImageAction(String, String),
    PruneImages,
    /// `POST /v1/images/context/missing`.
    ContextMissing,
    /// `PUT /v1/images/context/{sha256}`: one chunk, raw bytes.
    ContextPut(String),
    CreateVolume,
    ListVolumes,
    GetVolume(String),
    DeleteVolume(String),
    VolumeAction(String, String),
    ListVolumeBackups,
    GetVolumeBackup(String),
    /// `POST /v1/volume-backups/{id}:{verb}`.
    VolumeBackupAction(String, String),
    /// `GET /v1/volumes/{id}/attachments/{aid}`.
    GetVolumeAttachment(String, String),
    /// `POST /v1/volumes/{id}/attachments/{aid}:{verb}` (`detach`).
    VolumeAttachmentAction(String, String, String),
    /// `/v1/sandboxes/{id}/interpreter[/…]`: the method, the segments after
    /// `interpreter`, and the verb.
    Interpreter(Method, String, Vec<String>, Option<String>),
    Previews(String),
    PreviewCreate(String),
    PreviewGet(String, String),
    PreviewDelete(String, String),
    PreviewAction(String, String, String),
    GetNetwork(String),
    PutNetwork(String),
    ListSecrets,
    PutSecret(String),
    DeleteSecret(String),
    /// `/v1/secrets`: the jobs copies of secrets (not offered).
    JobSecrets,
    /// WebSockets.
    Terminal(String),
    Tunnel(String),
    Usage,
    Limits,
    Me,
    /// `…/sessions`: tokens for one sandbox.
    SessionCreate(String),
    SessionList(String),
    SessionRevoke(String, String),
    /// `…/metrics?range`: the sandbox's measured CPU and memory.
    Metrics(String),
    ListEvents,
    CreateWebhook,
    ListWebhooks,
    GetWebhook(String),
    DeleteWebhook(String),
    WebhookAction(String, String),
    WebhookDeliveries(String),
    DeliveryAction(String, String),
    /// `/v1/keys[/{k}:verb]`: this server's own key management (the
    /// console's keys page).
    ListKeys,
    CreateKey,
    KeyAction(String, String),
    /// `/v1/usage/daily?days`: spending per UTC day (the console's usage).
    UsageDaily,
    /// `/v1/usage/requests?range`: the account's API answers per hour.
    UsageRequests,
    /// `/v1/usage/export?since&until&cursor&limit`: settled usage as CSV.
    UsageExport,
    /// `…/console?bytes`: the tail of the sandbox's serial console.
    ConsoleLog(String),
    /// A product the client knows that this server does not offer: its name.
    Unavailable(&'static str),
}

/// The products of the client's surface this server does not serve, by the
/// path segments after `/v1` (and, for a sandbox's, after its id). Each
/// answers 501 `unavailable`, so the client's own "switched off here" hints
/// appear, rather than a bare 404.
const ACCOUNT_PRODUCTS: &[(&str, &str)] = &[
    ("otel-exports", "OpenTelemetry exports"),
    ("jobs", "Jobs"),
    ("job-imports", "Jobs"),
    ("job-runs", "Jobs"),
    ("apps", "Apps"),
    ("functions", "Functions"),
    ("builds", "Builds"),
    ("repositories", "Repositories"),
    ("ci", "CI"),
    ("containers", "Containers"),
    ("agents", "Agents"),
    ("reservations", "Reservations"),
    ("sso", "Single sign-on"),
    ("audit", "The audit log"),
    ("domains", "Domains"),
    ("ports", "Ports"),
    ("ips", "Dedicated IPs"),
    ("networks", "Networks"),
    ("feedback", "Feedback"),
    ("support", "Support"),
    ("account", "Account management"),
    ("billing", "Billing top-ups"),
    ("plans", "Plans"),
    ("referrals", "Referrals"),
    ("switching", "Switching"),
    ("mcp", "The MCP catalog"),
];

const SANDBOX_PRODUCTS: &[(&str, &str)] = &[
    ("mounts", "Bucket mounts"),
    ("tailscale", "Tailscale"),
    ("desktop", "Desktops"),
    ("browser", "Browsers"),
    ("mcp", "Sandbox MCP servers"),
];

fn unavailable(s: &[&str]) -> Option<&'static str> {
    let find =
        |t: &[(&str, &'static str)], seg: &str| t.iter().find(|(p, _)| *p == seg).map(|(_, n)| *n);
    match s {
        ["v1", "usage", "compare"] => Some("Usage comparisons"),
        ["v1", "sandboxes", _, product, ..] => find(SANDBOX_PRODUCTS, product),
        ["v1", product, ..] => find(ACCOUNT_PRODUCTS, product),
        _ => None,
    }
}

/// Splits the raw path into decoded segments and the action verb.
fn segments(raw: &str) -> Option<(Vec<String>, Option<String>)> {
    let mut raw_segs: Vec<&str> = raw.strip_prefix('/')?.split('/').collect();
    if raw_segs.last() == Some(&"") {
        raw_segs.pop();
    }
    let mut verb = None;
    if let Some(last) = raw_segs.last_mut() {
        if let Some((head, v)) = last.split_once(':') {
            verb = Some(percent_decode(v, false)?);
            *last = head;
        }
    }
    let segs = raw_segs
        .iter()
        .map(|s| percent_decode(s, false))
        .collect::<Option<Vec<_>>>()?;
    Some((segs, verb))
}

pub(crate) fn route(method: &Method, raw_path: &str) -> ApiResult<Route> {
    let not_found = || ApiError::RouteNotFound {
        method: method.to_string(),
        path: raw_path.to_string(),
    };
    let not_allowed = || ApiError::MethodNotAllowed {
        method: method.to_string(),
        path: raw_path.to_string(),
    };
    let (segs, verb) = segments(raw_path).ok_or_else(not_found)?;
    let s: Vec<&str> = segs.iter().map(String::as_str).collect();
    let m = method.clone();
    let verb_or_none = |want_verb: bool| verb.is_some() == want_verb;
    if let Some(product) = unavailable(&s) {
        return Ok(Route::Unavailable(product));
    }
    let r = match s.as_slice() {
        ["v1", "sandboxes"] if verb_or_none(false) => match m {
            Method::POST => Route::CreateSandbox,
            Method::GET => Route::ListSandboxes,
            _ => return Err(not_allowed()),
        },
        ["v1", "sandboxes", id] => match (&m, &verb) {
            (&Method::GET, None) => Route::GetSandbox(id.to_string()),
            (&Method::DELETE, None) => Route::DeleteSandbox(id.to_string()),
            (&Method::POST, Some(v)) => Route::SandboxAction(id.to_string(), v.clone()),
            _ => return Err(not_allowed()),
        },
        ["v1", "sandboxes", id, "files", "content"] if verb_or_none(false) => match m {
            Method::GET => Route::FileContentGet(id.to_string()),
            Method::PUT => Route::FileContentPut(id.to_string()),
            _ => return Err(not_allowed()),
        },
        ["v1", "sandboxes", id, "files", "list"] if verb_or_none(false) => match m {
            Method::GET => Route::FilesList(id.to_string()),
            _ => return Err(not_allowed()),
        },
        ["v1", "sandboxes", id, "files", "archive"] if verb_or_none(false) => match m {
            Method::GET => Route::ArchiveGet(id.to_string()),
            Method::PUT => Route::ArchivePut(id.to_string()),
            _ => return Err(not_allowed()),
        },
        ["v1", "sandboxes", id, "files", "archive", "uploads"] if verb_or_none(false) => match m {
            Method::POST => Route::ArchiveUploadBegin(id.to_string()),
            _ => return Err(not_allowed()),
        },
        ["v1", "sandboxes", id, "files", "archive", "uploads", u] => match (&m, &verb) {
            (&Method::PUT, None) => Route::ArchiveUploadChunk(id.to_string(), u.to_string()),
            (&Method::POST, Some(v)) => {
                Route::ArchiveUploadAction(id.to_string(), u.to_string(), v.clone())
            }
            _ => return Err(not_allowed()),
        },
        ["v1", "sandboxes", id, "files", "stat"] if verb_or_none(false) => match m {
            Method::GET => Route::FilesStat(id.to_string()),
            _ => return Err(not_allowed()),
        },
        ["v1", "sandboxes", id, "files", "watches"] if verb_or_none(false) => match m {
            Method::POST => Route::WatchCreate(id.to_string()),
            Method::GET => Route::WatchList(id.to_string()),
            _ => return Err(not_allowed()),
        },
        ["v1", "sandboxes", id, "files", "watches", w] if verb_or_none(false) => match m {
            Method::DELETE => Route::WatchDelete(id.to_string(), w.to_string()),
            _ => return Err(not_allowed()),
        },
        ["v1", "sandboxes", id, "files", "watches", w, "events"] if verb_or_none(false) => {
            match m {
                Method::GET => Route::WatchEvents(id.to_string(), w.to_string()),
                _ => return Err(not_allowed()),
            }
        }
        ["v1", "sandboxes", id, "files"] => match (&m, &verb) {
            (&Method::POST, Some(v)) => Route::FilesAction(id.to_string(), v.clone()),
            _ => return Err(not_found()),
        },
        ["v1", "sandboxes", id, "uploads"] if verb_or_none(false) => match m {
            Method::POST => Route::UploadBegin(id.to_string()),
            _ => return Err(not_allowed()),
        },
        ["v1", "sandboxes", id, "uploads", u] => match (&m, &verb) {
            (&Method::PUT, None) => Route::UploadChunk(id.to_string(), u.to_string()),
            (&Method::POST, Some(v)) => {
                Route::UploadAction(id.to_string(), u.to_string(), v.clone())
            }
            _ => return Err(not_allowed()),
        },
        ["v1", "sandboxes", id, "processes"] if verb_or_none(false) => match m {
            Method::POST => Route::ProcSpawn(id.to_string()),
            Method::GET => Route::ProcList(id.to_string()),
            _ => return Err(not_allowed()),
        },
        ["v1", "sandboxes", id, "processes", pid] => match (&m, &verb) {
            (&Method::GET, None) => Route::ProcGet(id.to_string(), pid.to_string()),
            (&Method::POST, Some(v)) => {
                Route::ProcAction(id.to_string(), pid.to_string(), v.clone())
            }
            _ => return Err(not_allowed()),
        },
        ["v1", "sandboxes", id, "processes", pid, "output"] if verb_or_none(false) => match m {
            Method::GET => Route::ProcOutput(id.to_string(), pid.to_string()),
            _ => return Err(not_allowed()),
        },
        ["v1", "sandboxes", id, "processes", pid, "files"] if verb_or_none(false) => match m {
            Method::GET => Route::ProcFiles(id.to_string(), pid.to_string()),
            _ => return Err(not_allowed()),
        },
        ["v1", "sandboxes", id, "interpreter", rest @ ..] => Route::Interpreter(
            m.clone(),
            id.to_string(),
            rest.iter().map(|s| s.to_string()).collect(),
            verb.clone(),
        ),
        ["v1", "sandboxes", id, "previews"] if verb_or_none(false) => match m {
            Method::GET => Route::Previews(id.to_string()),
            Method::POST => Route::PreviewCreate(id.to_string()),
            _ => return Err(not_allowed()),
        },
        ["v1", "sandboxes", id, "previews", port] => match (&m, &verb) {
            (&Method::GET, None) => Route::PreviewGet(id.to_string(), port.to_string()),
            (&Method::DELETE, None) => Route::PreviewDelete(id.to_string(), port.to_string()),
            (&Method::POST, Some(v)) => {
                Route::PreviewAction(id.to_string(), port.to_string(), v.clone())
            }
            _ => return Err(not_allowed()),
        },
        ["v1", "sandboxes", id, "network"] if verb_or_none(false) => match m {
            Method::GET => Route::GetNetwork(id.to_string()),
            Method::PUT => Route::PutNetwork(id.to_string()),
            _ => return Err(not_allowed()),
        },
        ["v1", "sandboxes", id, "sessions"] if verb_or_none(false) => match m {
            Method::POST => Route::SessionCreate(id.to_string()),
            Method::GET => Route::SessionList(id.to_string()),
            _ => return Err(not_allowed()),
        },
        ["v1", "sandboxes", id, "sessions", sid] => match (&m, verb.as_deref()) {
            (&Method::POST, Some("revoke")) => {
                Route::SessionRevoke(id.to_string(), sid.to_string())
            }
            (&Method::POST, _) => return Err(not_found()),
            _ => return Err(not_allowed()),
        },
        ["v1", "sandboxes", id, "metrics"] if verb_or_none(false) => match m {
            Method::GET => Route::Metrics(id.to_string()),
            _ => return Err(not_allowed()),
        },
        ["v1", "sandboxes", id, "terminal"] if verb_or_none(false) => match m {
            Method::GET => Route::Terminal(id.to_string()),
            _ => return Err(not_allowed()),
        },
        ["v1", "sandboxes", id, "console"] if verb_or_none(false) => match m {
            Method::GET => Route::ConsoleLog(id.to_string()),
            _ => return Err(not_allowed()),
        },
        ["v1", "sandboxes", id, "tunnel"] if verb_or_none(false) => match m {
            Method::GET => Route::Tunnel(id.to_string()),
            _ => return Err(not_allowed()),
        },
        ["v1", "egress-secrets"] if verb_or_none(false) => match m {
            Method::GET => Route::ListSecrets,
            _ => return Err(not_allowed()),
        },
        ["v1", "egress-secrets", name] if verb_or_none(false) => match m {
            Method::PUT => Route::PutSecret(name.to_string()),
            Method::DELETE => Route::DeleteSecret(name.to_string()),
            _ => return Err(not_allowed()),
        },
        ["v1", "secrets", ..] => Route::JobSecrets,
        ["v1", "snapshots"] if verb_or_none(false) => match m {
            Method::GET => Route::ListSnapshots,
            _ => return Err(not_allowed()),
        },
        ["v1", "snapshots", id] => match (&m, &verb) {
            (&Method::GET, None) => Route::GetSnapshot(id.to_string()),
            (&Method::DELETE, None) => Route::DeleteSnapshot(id.to_string()),
            (&Method::POST, Some(v)) => Route::SnapshotAction(id.to_string(), v.clone()),
            _ => return Err(not_allowed()),
        },
        ["v1", "images"] if verb_or_none(false) => match m {
            Method::POST => Route::CreateImage,
            Method::GET => Route::ListImages,
            _ => return Err(not_allowed()),
        },
        ["v1", "images"] if verb.as_deref() == Some("prune") => match m {
            Method::POST => Route::PruneImages,
            _ => return Err(not_allowed()),
        },
        ["v1", "images", "context", "missing"] if verb_or_none(false) => match m {
            Method::POST => Route::ContextMissing,
            _ => return Err(not_allowed()),
        },
        ["v1", "images", "context", sha] if verb_or_none(false) => match m {
            Method::PUT => Route::ContextPut(sha.to_string()),
            _ => return Err(not_allowed()),
        },
        ["v1", "images", "resolve"] if verb_or_none(false) => match m {
            Method::GET => Route::ResolveImage,
            _ => return Err(not_allowed()),
        },
        ["v1", "images", "registries"] => match (&m, verb.as_deref()) {
            (&Method::GET, None) => Route::ListRegistries,
            (&Method::POST, None) => Route::SetRegistry,
            (&Method::POST, Some("delete")) => Route::DeleteRegistry,
            (&Method::POST, Some(_)) => return Err(not_found()),
            _ => return Err(not_allowed()),
        },
        ["v1", "images", id] => match (&m, &verb) {
            (&Method::GET, None) => Route::GetImage(id.to_string()),
            (&Method::DELETE, None) => Route::DeleteImage(id.to_string()),
            (&Method::POST, Some(v)) => Route::ImageAction(id.to_string(), v.clone()),
            _ => return Err(not_allowed()),
        },
        ["v1", "images", id, "logs"] if verb_or_none(false) => match m {
            Method::GET => Route::ImageLogs(id.to_string()),
            _ => return Err(not_allowed()),
        },
        ["v1", "volumes"] if verb_or_none(false) => match m {
            Method::POST => Route::CreateVolume,
            Method::GET => Route::ListVolumes,
            _ => return Err(not_allowed()),
        },
        ["v1", "volumes", id] => match (&m, &verb) {
            (&Method::GET, None) => Route::GetVolume(id.to_string()),
            (&Method::DELETE, None) => Route::DeleteVolume(id.to_string()),
            (&Method::POST, Some(v)) => Route::VolumeAction(id.to_string(), v.clone()),
            _ => return Err(not_allowed()),
        },
        ["v1", "volumes", id, "attachments", aid] => match (&m, &verb) {
            (&Method::GET, None) => Route::GetVolumeAttachment(id.to_string(), aid.to_string()),
            (&Method::POST, Some(v)) => {
                Route::VolumeAttachmentAction(id.to_string(), aid.to_string(), v.clone())
            }
            _ => return Err(not_allowed()),
        },
        ["v1", "usage"] if verb_or_none(false) => match m {
            Method::GET => Route::Usage,
            _ => return Err(not_allowed()),
        },
        ["v1", "usage", "daily"] if verb_or_none(false) => match m {
            Method::GET => Route::UsageDaily,
            _ => return Err(not_allowed()),
        },
        ["v1", "usage", "requests"] if verb_or_none(false) => match m {
            Method::GET => Route::UsageRequests,
            _ => return Err(not_allowed()),
        },
        ["v1", "usage", "export"] if verb_or_none(false) => match m {
            Method::GET => Route::UsageExport,
            _ => return Err(not_allowed()),
        },
        ["v1", "limits"] if verb_or_none(false) => match m {
            Method::GET => Route::Limits,
            _ => return Err(not_allowed()),
        },
        ["v1", "me"] if verb_or_none(false) => match m {
            Method::GET => Route::Me,
            _ => return Err(not_allowed()),
        },
        ["v1", "events"] if verb_or_none(false) => match m {
            Method::GET => Route::ListEvents,
            _ => return Err(not_allowed()),
        },
        ["v1", "webhooks"] if verb_or_none(false) => match m {
            Method::POST => Route::CreateWebhook,
            Method::GET => Route::ListWebhooks,
            _ => return Err(not_allowed()),
        },
        ["v1", "webhooks", id] => match (&m, &verb) {
            (&Method::GET, None) => Route::GetWebhook(id.to_string()),
            (&Method::DELETE, None) => Route::DeleteWebhook(id.to_string()),
            (&Method::POST, Some(v)) => Route::WebhookAction(id.to_string(), v.clone()),
            _ => return Err(not_allowed()),
        },
        ["v1", "webhooks", id, "deliveries"] if verb_or_none(false) => match m {
            Method::GET => Route::WebhookDeliveries(id.to_string()),
            _ => return Err(not_allowed()),
        },
        ["v1", "keys"] if verb_or_none(false) => match m {
            Method::GET => Route::ListKeys,
            Method::POST => Route::CreateKey,
            _ => return Err(not_allowed()),
        },
        ["v1", "keys", k] => match (&m, &verb) {
            (&Method::POST, Some(v)) => Route::KeyAction(k.to_string(), v.clone()),
            _ => return Err(not_allowed()),
        },
        ["v1", "volume-backups"] if verb_or_none(false) => match m {
            Method::GET => Route::ListVolumeBackups,
            _ => return Err(not_allowed()),
        },
        ["v1", "volume-backups", b] => match (&m, &verb) {
            (&Method::GET, None) => Route::GetVolumeBackup(b.to_string()),
            (&Method::POST, Some(v)) => Route::VolumeBackupAction(b.to_string(), v.clone()),
            _ => return Err(not_allowed()),
        },
        ["v1", "webhook-deliveries", d] => match (&m, &verb) {
            (&Method::POST, Some(v)) => Route::DeliveryAction(d.to_string(), v.clone()),
            _ => return Err(not_allowed()),
        },
        _ => return Err(not_found()),
    };
    Ok(r)
}

/// The largest body a route reads.
pub(super) fn body_limit(r: &Route) -> usize {
    match r {
        Route::FileContentPut(_)
        | Route::UploadChunk(..)
        | Route::ArchivePut(_)
        | Route::ArchiveUploadChunk(..) => crate::domain::files::CHUNK_BYTES,
        Route::ContextPut(_) => crate::domain::image::context::CHUNK_BYTES,
        _ => 8 << 20,
    }
}

/// One request per route (and per sandbox verb), `{id}` standing for a
/// sandbox id: what tests run against the router, e.g. to see a read-only
/// key refused every change. A unit test checks it covers every [`Route`].
pub const ROUTE_SAMPLES: &[(&str, &str)] = &[
    ("POST", "/v1/sandboxes"),
    ("GET", "/v1/sandboxes"),
    ("GET", "/v1/sandboxes/{id}"),
    ("DELETE", "/v1/sandboxes/{id}"),
    ("POST", "/v1/sandboxes/{id}:exec"),
    ("POST", "/v1/sandboxes/{id}:stop"),
    ("POST", "/v1/sandboxes/{id}:pause"),
    ("POST", "/v1/sandboxes/{id}:wake"),
    ("POST", "/v1/sandboxes/{id}:extend"),
    ("POST", "/v1/sandboxes/{id}:update"),
    ("POST", "/v1/sandboxes/{id}:restart"),
    ("POST", "/v1/sandboxes/{id}:fork"),
    ("POST", "/v1/sandboxes/{id}:snapshot"),
    ("POST", "/v1/sandboxes/{id}:resize"),
    ("POST", "/v1/sandboxes/{id}:switch-image"),
    ("GET", "/v1/sandboxes/{id}/files/content?path=/etc/hostname"),
    ("PUT", "/v1/sandboxes/{id}/files/content?path=/tmp/x"),
    ("GET", "/v1/sandboxes/{id}/files/list?path=/"),
    ("GET", "/v1/sandboxes/{id}/files/stat?path=/"),
    ("POST", "/v1/sandboxes/{id}/files:mkdir"),
    ("POST", "/v1/sandboxes/{id}/files:remove"),
    ("POST", "/v1/sandboxes/{id}/files:move"),
    ("POST", "/v1/sandboxes/{id}/uploads"),
    ("PUT", "/v1/sandboxes/{id}/uploads/u1?offset=0"),
    ("POST", "/v1/sandboxes/{id}/uploads/u1:commit"),
    ("POST", "/v1/sandboxes/{id}/files/archive/uploads"),
    (
        "PUT",
        "/v1/sandboxes/{id}/files/archive/uploads/u1?offset=0",
    ),
    ("POST", "/v1/sandboxes/{id}/files/archive/uploads/u1:commit"),
    ("POST", "/v1/sandboxes/{id}/processes"),
    ("GET", "/v1/sandboxes/{id}/processes"),
    ("GET", "/v1/sandboxes/{id}/processes/p1"),
    ("POST", "/v1/sandboxes/{id}/processes/p1:kill"),
    ("POST", "/v1/sandboxes/{id}/processes/p1:stdin"),
    ("GET", "/v1/sandboxes/{id}/processes/p1/output"),
    ("GET", "/v1/sandboxes/{id}/processes/p1/files"),
    ("POST", "/v1/sandboxes/{id}/interpreter:run"),
    ("GET", "/v1/sandboxes/{id}/interpreter/contexts"),
    ("POST", "/v1/sandboxes/{id}/interpreter/contexts"),
    ("DELETE", "/v1/sandboxes/{id}/interpreter/contexts/c1"),
    ("GET", "/v1/snapshots"),
    ("GET", "/v1/snapshots/s1"),
    ("DELETE", "/v1/snapshots/s1"),
    ("POST", "/v1/snapshots/s1:update"),
    ("POST", "/v1/images"),
    ("GET", "/v1/images"),
    ("GET", "/v1/images/resolve?ref=app"),
    ("GET", "/v1/images/registries"),
    ("POST", "/v1/images/registries"),
    ("POST", "/v1/images/registries:delete"),
    ("GET", "/v1/images/i1"),
    ("GET", "/v1/images/i1/logs"),
    ("DELETE", "/v1/images/i1"),
    ("POST", "/v1/images/i1:delete"),
    ("POST", "/v1/images:prune"),
    ("POST", "/v1/images/context/missing"),
    (
        "PUT",
        "/v1/images/context/0000000000000000000000000000000000000000000000000000000000000000",
    ),
    ("POST", "/v1/volumes"),
    ("GET", "/v1/volumes"),
    ("GET", "/v1/volumes/v1"),
    ("DELETE", "/v1/volumes/v1"),
    ("POST", "/v1/volumes/v1:delete"),
    ("GET", "/v1/volume-backups"),
    ("GET", "/v1/volume-backups/b1"),
    ("POST", "/v1/volume-backups/b1:delete"),
    ("GET", "/v1/volumes/v1/attachments/va-1"),
    ("POST", "/v1/volumes/v1/attachments/va-1:detach"),
    ("GET", "/v1/usage"),
    ("GET", "/v1/limits"),
    ("GET", "/v1/me"),
    ("GET", "/v1/sandboxes/{id}/previews"),
    ("POST", "/v1/sandboxes/{id}/previews"),
    ("GET", "/v1/sandboxes/{id}/previews/3000"),
    ("DELETE", "/v1/sandboxes/{id}/previews/3000"),
    ("POST", "/v1/sandboxes/{id}/previews/3000:rotate"),
    ("GET", "/v1/sandboxes/{id}/network"),
    ("PUT", "/v1/sandboxes/{id}/network"),
    ("GET", "/v1/egress-secrets"),
    ("PUT", "/v1/egress-secrets/TOKEN"),
    ("DELETE", "/v1/egress-secrets/TOKEN"),
    ("GET", "/v1/secrets"),
    ("GET", "/v1/sandboxes/{id}/terminal"),
    ("GET", "/v1/sandboxes/{id}/tunnel"),
    ("GET", "/v1/events"),
    ("POST", "/v1/webhooks"),
    ("GET", "/v1/webhooks"),
    ("GET", "/v1/webhooks/w1"),
    ("DELETE", "/v1/webhooks/w1"),
    ("POST", "/v1/webhooks/w1:update"),
    ("POST", "/v1/webhooks/w1:rotate-secret"),
    ("POST", "/v1/webhooks/w1:delete"),
    ("POST", "/v1/webhooks/w1:test"),
    ("GET", "/v1/webhooks/w1/deliveries"),
    ("POST", "/v1/webhook-deliveries/d1:retry"),
    ("GET", "/v1/otel-exports"),
    ("GET", "/v1/sandboxes/{id}/files/archive?path=/workspace"),
    ("PUT", "/v1/sandboxes/{id}/files/archive?path=/tmp/x"),
    ("POST", "/v1/sandboxes/{id}/sessions"),
    ("GET", "/v1/sandboxes/{id}/sessions"),
    ("POST", "/v1/sandboxes/{id}/sessions/s1:revoke"),
    ("GET", "/v1/sandboxes/{id}/metrics?range=15m"),
    ("POST", "/v1/sandboxes/{id}/files/watches"),
    ("GET", "/v1/sandboxes/{id}/files/watches"),
    ("GET", "/v1/sandboxes/{id}/files/watches/w1/events?cursor=0"),
    ("DELETE", "/v1/sandboxes/{id}/files/watches/w1"),
    ("GET", "/v1/keys"),
    ("POST", "/v1/keys"),
    ("POST", "/v1/keys/k1:revoke"),
    ("POST", "/v1/keys/k1:limit"),
    ("GET", "/v1/sandboxes/{id}/console?bytes=4096"),
    ("GET", "/v1/usage/daily?days=7"),
    ("GET", "/v1/usage/requests?range=24h"),
    (
        "GET",
        "/v1/usage/export?since=2026-01-01T00:00:00Z&until=2026-01-02T00:00:00Z",
    ),
];

/// `product.verb` when `verb` is one of `known`, `product.other` otherwise:
/// a key chooses the verb, and the counters keep a bounded set of names.
fn act(product: &str, verb: &str, known: &[&str]) -> String {
    if known.contains(&verb) {
        format!("{product}.{verb}")
    } else {
        format!("{product}.other")
    }
}

/// The operation a route is counted under in `GET /v1/usage/requests`:
/// `product.verb`, from a fixed set of names.
pub(crate) fn operation(r: &Route) -> String {
    let fixed = |s: &str| s.to_string();
    match r {
        Route::CreateSandbox => fixed("sandboxes.create"),
        Route::ListSandboxes => fixed("sandboxes.list"),
        Route::GetSandbox(_) => fixed("sandboxes.get"),
        Route::DeleteSandbox(_) => fixed("sandboxes.delete"),
        Route::SandboxAction(_, v) => act(
            "sandboxes",
            v,
            &[
                "exec",
                "stop",
                "extend",
                "update",
                "pause",
                "wake",
                "fork",
                "snapshot",
                "restart",
                "retention",
                "resize",
                "switch-image",
            ],
        ),
        Route::FileContentGet(_) => fixed("files.read"),
        Route::FileContentPut(_) => fixed("files.write"),
        Route::FilesList(_) => fixed("files.list"),
        Route::FilesStat(_) => fixed("files.stat"),
        Route::FilesAction(_, v) => act(
            "files",
            v,
            &["mkdir", "remove", "rename", "chmod", "link", "revoke-links"],
        ),
        Route::ArchiveGet(_) => fixed("files.archiveDownload"),
        Route::ArchivePut(_) => fixed("files.archiveUpload"),
        Route::UploadBegin(_) => fixed("uploads.create"),
        Route::UploadChunk(..) => fixed("uploads.chunk"),
        Route::UploadAction(_, _, v) => act("uploads", v, &["commit", "abort"]),
        Route::ArchiveUploadBegin(_) => fixed("archiveUploads.create"),
        Route::ArchiveUploadChunk(..) => fixed("archiveUploads.chunk"),
        Route::ArchiveUploadAction(_, _, v) => act("archiveUploads", v, &["commit", "abort"]),
        Route::ProcSpawn(_) => fixed("processes.spawn"),
        Route::ProcList(_) => fixed("processes.list"),
        Route::ProcGet(..) => fixed("processes.get"),
        Route::ProcOutput(..) => fixed("processes.output"),
        Route::ProcFiles(..) => fixed("processes.files"),
        Route::ProcAction(_, _, v) => act(
            "processes",
            v,
            &["write", "signal", "resize", "kill", "close-stdin"],
        ),
        Route::WatchCreate(_) => fixed("watches.create"),
        Route::WatchList(_) => fixed("watches.list"),
        Route::WatchEvents(..) => fixed("watches.events"),
        Route::WatchDelete(..) => fixed("watches.delete"),
        Route::ListSnapshots => fixed("snapshots.list"),
        Route::GetSnapshot(_) => fixed("snapshots.get"),
        Route::DeleteSnapshot(_) => fixed("snapshots.delete"),
        Route::SnapshotAction(_, v) => act("snapshots", v, &["delete", "update", "extend"]),
        Route::CreateImage => fixed("images.create"),
        Route::ListImages => fixed("images.list"),
        Route::ResolveImage => fixed("images.resolve"),
        Route::ListRegistries => fixed("registries.list"),
        Route::SetRegistry => fixed("registries.set"),
        Route::DeleteRegistry => fixed("registries.delete"),
        Route::GetImage(_) => fixed("images.get"),
        Route::ImageLogs(_) => fixed("images.logs"),
        Route::DeleteImage(_) => fixed("images.delete"),
        Route::ImageAction(_, v) => act("images", v, &["delete", "tag", "untag"]),
        Route::PruneImages => fixed("images.prune"),
        Route::ContextMissing => fixed("images.contextMissing"),
        Route::ContextPut(_) => fixed("images.contextPut"),
        Route::CreateVolume => fixed("volumes.create"),
        Route::ListVolumes => fixed("volumes.list"),
        Route::GetVolume(_) => fixed("volumes.get"),
        Route::DeleteVolume(_) => fixed("volumes.delete"),
        Route::VolumeAction(_, v) => act(
            "volumes",
            v,
            &["delete", "resize", "backup", "attach", "backup-policy"],
        ),
        Route::ListVolumeBackups => fixed("volumeBackups.list"),
        Route::GetVolumeBackup(_) => fixed("volumeBackups.get"),
        Route::VolumeBackupAction(_, v) => act("volumeBackups", v, &["delete"]),
        Route::GetVolumeAttachment(..) => fixed("volumeAttachments.get"),
        Route::VolumeAttachmentAction(_, _, v) => act("volumeAttachments", v, &["detach"]),
        Route::Interpreter(..) => fixed("interpreter"),
        Route::Previews(_) => fixed("previews.list"),
        Route::PreviewCreate(_) => fixed("previews.create"),
        Route::PreviewGet(..) => fixed("previews.get"),
        Route::PreviewDelete(..) => fixed("previews.delete"),
        Route::PreviewAction(_, _, v) => act("previews", v, &["rotate"]),
        Route::GetNetwork(_) => fixed("network.get"),
        Route::PutNetwork(_) => fixed("network.set"),
        Route::ListSecrets => fixed("secrets.list"),
        Route::PutSecret(_) => fixed("secrets.set"),
        Route::DeleteSecret(_) => fixed("secrets.delete"),
        Route::JobSecrets => fixed("secrets.jobs"),
        Route::Terminal(_) => fixed("sandboxes.terminal"),
        Route::Tunnel(_) => fixed("sandboxes.tunnel"),
        Route::Usage => fixed("usage.get"),
        Route::Limits => fixed("limits.get"),
        Route::Me => fixed("me.get"),
        Route::SessionCreate(_) => fixed("sessions.create"),
        Route::SessionList(_) => fixed("sessions.list"),
        Route::SessionRevoke(..) => fixed("sessions.revoke"),
        Route::Metrics(_) => fixed("sandboxes.metrics"),
        Route::ListEvents => fixed("events.list"),
        Route::CreateWebhook => fixed("webhooks.create"),
        Route::ListWebhooks => fixed("webhooks.list"),
        Route::GetWebhook(_) => fixed("webhooks.get"),
        Route::DeleteWebhook(_) => fixed("webhooks.delete"),
        Route::WebhookAction(_, v) => act(
            "webhooks",
            v,
            &["update", "rotate-secret", "delete", "test"],
        ),
        Route::WebhookDeliveries(_) => fixed("webhooks.deliveries"),
        Route::DeliveryAction(_, v) => act("webhookDeliveries", v, &["retry"]),
        Route::ListKeys => fixed("keys.list"),
        Route::CreateKey => fixed("keys.create"),
        Route::KeyAction(_, v) => act("keys", v, &["revoke", "limit"]),
        Route::UsageDaily => fixed("usage.daily"),
        Route::UsageRequests => fixed("usage.requests"),
        Route::UsageExport => fixed("usage.export"),
        Route::ConsoleLog(_) => fixed("sandboxes.console"),
        Route::Unavailable(_) => fixed("unavailable"),
    }
}

/// The sandbox a session token may use this route on, when a session may
/// use it at all: the sandbox's record, its commands, processes, files,
/// interpreter and terminal, and reading its previews. Never lifecycle
/// changes (stop, pause, fork, snapshot, update...), network rules,
/// sessions, tunnels, or anything outside the sandbox.
pub(crate) fn session_sandbox(r: &Route) -> Option<&str> {
    match r {
        Route::SandboxAction(id, verb) if verb == "exec" => Some(id),
        Route::GetSandbox(id)
        | Route::FileContentGet(id)
        | Route::FileContentPut(id)
        | Route::FilesList(id)
        | Route::FilesStat(id)
        | Route::FilesAction(id, _)
        | Route::ArchiveGet(id)
        | Route::ArchivePut(id)
        | Route::UploadBegin(id)
        | Route::UploadChunk(id, _)
        | Route::UploadAction(id, ..)
        | Route::ArchiveUploadBegin(id)
        | Route::ArchiveUploadChunk(id, _)
        | Route::ArchiveUploadAction(id, ..)
        | Route::ProcSpawn(id)
        | Route::ProcList(id)
        | Route::ProcGet(id, _)
        | Route::ProcOutput(id, _)
        | Route::ProcFiles(id, _)
        | Route::ProcAction(id, ..)
        | Route::Interpreter(_, id, ..)
        | Route::Previews(id)
        | Route::PreviewGet(id, _)
        | Route::Metrics(id)
        | Route::WatchCreate(id)
        | Route::WatchList(id)
        | Route::WatchEvents(id, _)
        | Route::WatchDelete(id, _)
        | Route::Terminal(id) => Some(id),
        _ => None,
    }
}

/// Routes whose body carries a secret (an egress secret's value, a
/// registry's password): their idempotency fingerprint is keyed.
pub(crate) fn carries_secret(r: &Route) -> bool {
    matches!(r, Route::PutSecret(_) | Route::SetRegistry)
}

/// Routes that show what is inside a sandbox (files, commands and their
/// output, the interpreter), which read-only keys may not read.
pub(crate) fn reveals_contents(r: &Route) -> bool {
    matches!(
        r,
        Route::FileContentGet(_)
            | Route::ArchiveGet(_)
            | Route::FilesList(_)
            | Route::FilesStat(_)
            | Route::ProcList(_)
            | Route::ProcGet(..)
            | Route::ProcOutput(..)
            | Route::ProcFiles(..)
            | Route::WatchList(_)
            | Route::WatchEvents(..)
            | Route::Interpreter(..)
            | Route::ListSecrets
            | Route::Terminal(_)
            | Route::Tunnel(_)
            | Route::ConsoleLog(_)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn verbs_split_at_the_first_raw_colon() {
        assert_eq!(
            route(&Method::POST, "/v1/sandboxes/ab%3Acd:exec").ok(),
            Some(Route::SandboxAction("ab:cd".into(), "exec".into()))
        );
        assert_eq!(
            route(&Method::POST, "/v1/sandboxes/x/files:mkdir").ok(),
            Some(Route::FilesAction("x".into(), "mkdir".into()))
        );
        assert_eq!(
            route(&Method::POST, "/v1/sandboxes/x/uploads/u%2F1:commit").ok(),
            Some(Route::UploadAction(
                "x".into(),
                "u/1".into(),
                "commit".into()
            ))
        );
        assert!(matches!(
            route(&Method::GET, "/v2/x"),
            Err(ApiError::RouteNotFound { .. })
        ));
        assert!(matches!(
            route(&Method::PATCH, "/v1/sandboxes/x"),
            Err(ApiError::MethodNotAllowed { .. })
        ));
    }

    /// A number per variant; a new variant fails to compile here until it
    /// is counted, and then the samples must cover it.
    fn variant(r: &Route) -> usize {
        match r {
            Route::CreateSandbox => 0,
            Route::ListSandboxes => 1,
            Route::GetSandbox(_) => 2,
            Route::DeleteSandbox(_) => 3,
            Route::SandboxAction(..) => 4,
            Route::FileContentGet(_) => 5,
            Route::FileContentPut(_) => 6,
            Route::FilesList(_) => 7,
            Route::FilesStat(_) => 8,
            Route::FilesAction(..) => 9,
            Route::UploadBegin(_) => 10,
            Route::UploadChunk(..) => 11,
            Route::UploadAction(..) => 12,
            Route::ProcSpawn(_) => 13,
            Route::ProcList(_) => 14,
            Route::ProcGet(..) => 15,
            Route::ProcOutput(..) => 16,
            Route::ProcAction(..) => 17,
            Route::ListSnapshots => 18,
            Route::GetSnapshot(_) => 19,
            Route::DeleteSnapshot(_) => 20,
            Route::SnapshotAction(..) => 21,
            Route::Interpreter(..) => 22,
            Route::Usage => 23,
            Route::Limits => 24,
            Route::Me => 25,
            Route::Previews(_) => 26,
            Route::PreviewCreate(_) => 27,
            Route::PreviewGet(..) => 28,
            Route::PreviewDelete(..) => 29,
            Route::PreviewAction(..) => 30,
            Route::GetNetwork(_) => 31,
            Route::PutNetwork(_) => 32,
            Route::ListSecrets => 33,
            Route::PutSecret(_) => 34,
            Route::DeleteSecret(_) => 35,
            Route::JobSecrets => 36,
            Route::Terminal(_) => 37,
            Route::Tunnel(_) => 38,
            Route::CreateVolume => 39,
            Route::ListVolumes => 40,
            Route::GetVolume(_) => 41,
            Route::DeleteVolume(_) => 42,
            Route::VolumeAction(..) => 43,
            Route::CreateImage => 44,
            Route::ListImages => 45,
            Route::ResolveImage => 46,
            Route::GetImage(_) => 47,
            Route::ImageLogs(_) => 48,
            Route::DeleteImage(_) => 49,
            Route::ImageAction(..) => 50,
            Route::Unavailable(_) => 51,
            Route::ArchiveGet(_) => 52,
            Route::ArchivePut(_) => 53,
            Route::SessionCreate(_) => 54,
            Route::SessionList(_) => 55,
            Route::SessionRevoke(..) => 56,
            Route::Metrics(_) => 57,
            Route::ListEvents => 58,
            Route::CreateWebhook => 59,
            Route::ListWebhooks => 60,
            Route::GetWebhook(_) => 61,
            Route::DeleteWebhook(_) => 62,
            Route::WebhookAction(..) => 63,
            Route::WebhookDeliveries(_) => 64,
            Route::DeliveryAction(..) => 65,
            Route::WatchCreate(_) => 66,
            Route::WatchList(_) => 67,
            Route::WatchEvents(..) => 68,
            Route::WatchDelete(..) => 69,
            Route::ListKeys => 70,
            Route::CreateKey => 71,
            Route::KeyAction(..) => 72,
            Route::ConsoleLog(_) => 73,
            Route::UsageDaily => 74,
            Route::ListRegistries => 75,
            Route::SetRegistry => 76,
            Route::DeleteRegistry => 77,
            Route::PruneImages => 78,
            Route::ContextMissing => 79,
            Route::ContextPut(_) => 80,
            Route::ArchiveUploadBegin(_) => 81,
            Route::ArchiveUploadChunk(..) => 82,
            Route::ArchiveUploadAction(..) => 83,
            Route::ListVolumeBackups => 84,
            Route::GetVolumeBackup(_) => 85,
            Route::VolumeBackupAction(..) => 86,
            Route::ProcFiles(..) => 87,
            Route::UsageRequests => 88,
            Route::UsageExport => 89,
            Route::GetVolumeAttachment(..) => 90,
            Route::VolumeAttachmentAction(..) => 91,
        }
    }
    const VARIANTS: usize = 92;

    #[test]
    fn products_not_served_here_are_unavailable_not_missing() {
        for (m, p, product) in [
            ("GET", "/v1/otel-exports", "OpenTelemetry exports"),
            ("GET", "/v1/jobs", "Jobs"),
            ("POST", "/v1/sandboxes/x/mounts", "Bucket mounts"),
            ("GET", "/v1/usage/compare", "Usage comparisons"),
        ] {
            assert_eq!(
                route(&Method::from_bytes(m.as_bytes()).unwrap(), p).ok(),
                Some(Route::Unavailable(product)),
                "{m} {p}"
            );
        }
        // What is served, or unknown, is not swallowed.
        assert_eq!(
            route(&Method::GET, "/v1/sandboxes/x/processes/p1/files").ok(),
            Some(Route::ProcFiles("x".into(), "p1".into()))
        );
        assert_eq!(
            route(&Method::POST, "/v1/sandboxes/x/files:mkdir").ok(),
            Some(Route::FilesAction("x".into(), "mkdir".into()))
        );
        assert_eq!(route(&Method::GET, "/v1/usage").ok(), Some(Route::Usage));
        assert_eq!(
            route(&Method::GET, "/v1/usage/requests").ok(),
            Some(Route::UsageRequests)
        );
        assert_eq!(
            route(&Method::GET, "/v1/usage/export").ok(),
            Some(Route::UsageExport)
        );
        // Registry credentials come before image ids.
        assert_eq!(
            route(&Method::GET, "/v1/images/registries").ok(),
            Some(Route::ListRegistries)
        );
        assert_eq!(
            route(&Method::POST, "/v1/images/registries").ok(),
            Some(Route::SetRegistry)
        );
        assert_eq!(
            route(&Method::POST, "/v1/images/registries:delete").ok(),
            Some(Route::DeleteRegistry)
        );
        assert!(matches!(
            route(&Method::DELETE, "/v1/images/registries"),
            Err(ApiError::MethodNotAllowed { .. })
        ));
        assert!(matches!(
            route(&Method::POST, "/v1/images/registries:tag"),
            Err(ApiError::RouteNotFound { .. })
        ));
        assert_eq!(
            route(&Method::GET, "/v1/events").ok(),
            Some(Route::ListEvents)
        );
        assert_eq!(
            route(&Method::POST, "/v1/webhooks/w1:rotate-secret").ok(),
            Some(Route::WebhookAction("w1".into(), "rotate-secret".into()))
        );
        assert_eq!(
            route(&Method::POST, "/v1/webhook-deliveries/d%2F1:retry").ok(),
            Some(Route::DeliveryAction("d/1".into(), "retry".into()))
        );
        assert_eq!(
            route(&Method::GET, "/v1/sandboxes/x/files/watches/w%2F1/events").ok(),
            Some(Route::WatchEvents("x".into(), "w/1".into()))
        );
        assert_eq!(
            route(&Method::POST, "/v1/sandboxes/x/files/watches").ok(),
            Some(Route::WatchCreate("x".into()))
        );
        assert!(matches!(
            route(&Method::GET, "/v1/nothing-of-the-kind"),
            Err(ApiError::RouteNotFound { .. })
        ));
    }

    #[test]
    fn a_session_reaches_only_its_sandboxs_insides() {
        let of = |m: &str, p: &str| {
            let r = route(&Method::from_bytes(m.as_bytes()).unwrap(), p).unwrap();
            session_sandbox(&r).map(str::to_string)
        };
        for (m, p) in [
            ("POST", "/v1/sandboxes/s1:exec"),
            ("GET", "/v1/sandboxes/s1"),
            ("GET", "/v1/sandboxes/s1/files/content"),
            ("PUT", "/v1/sandboxes/s1/files/content"),
            ("POST", "/v1/sandboxes/s1/files:mkdir"),
            ("POST", "/v1/sandboxes/s1/processes"),
            ("GET", "/v1/sandboxes/s1/processes/p1/output"),
            ("POST", "/v1/sandboxes/s1/interpreter:run"),
            ("GET", "/v1/sandboxes/s1/previews"),
            ("GET", "/v1/sandboxes/s1/terminal"),
        ] {
            assert_eq!(of(m, p).as_deref(), Some("s1"), "{m} {p}");
        }
        for (m, p) in [
            ("POST", "/v1/sandboxes/s1:pause"),
            ("POST", "/v1/sandboxes/s1:stop"),
            ("POST", "/v1/sandboxes/s1:fork"),
            ("POST", "/v1/sandboxes/s1:snapshot"),
            ("POST", "/v1/sandboxes/s1:extend"),
            ("POST", "/v1/sandboxes/s1:update"),
            ("DELETE", "/v1/sandboxes/s1"),
            ("POST", "/v1/sandboxes"),
            ("GET", "/v1/sandboxes"),
            ("POST", "/v1/sandboxes/s1/sessions"),
            ("GET", "/v1/sandboxes/s1/sessions"),
            ("POST", "/v1/sandboxes/s1/previews"),
            ("DELETE", "/v1/sandboxes/s1/previews/3000"),
            ("PUT", "/v1/sandboxes/s1/network"),
            ("GET", "/v1/sandboxes/s1/tunnel"),
            ("GET", "/v1/usage"),
            ("GET", "/v1/snapshots"),
            ("PUT", "/v1/egress-secrets/T"),
        ] {
            assert_eq!(of(m, p), None, "{m} {p}");
        }
    }

    #[test]
    fn the_route_samples_cover_every_route() {
        let mut seen = [false; VARIANTS];
        for (m, p) in ROUTE_SAMPLES {
            let path = p.split('?').next().unwrap_or(p);
            let r = route(&Method::from_bytes(m.as_bytes()).unwrap(), path)
                .unwrap_or_else(|e| panic!("{m} {p}: {e}"));
            seen[variant(&r)] = true;
        }
        let missing: Vec<usize> = (0..VARIANTS).filter(|i| !seen[*i]).collect();
        assert!(missing.is_empty(), "routes without a sample: {missing:?}");
    }
}
