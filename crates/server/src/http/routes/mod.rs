//! The handlers of each resource, reached from [`dispatch`]: each parses
//! its request, calls the service and renders the answer.

mod interpreter;
pub(crate) mod processes;

use axum::body::Bytes;

use crate::error::{ApiError, ApiResult};
use crate::http::route::Route;
use crate::http::{Ctx, Reply};
use crate::AppState;

mod account;
mod console;
mod events;
mod files;
mod images;
mod keys;
pub(crate) mod network;
mod previews;
mod registries;
pub(crate) mod sandboxes;
mod secrets;
mod sessions;
pub(crate) mod snapshots;
pub(crate) mod volumes;
mod watches;

pub(super) async fn dispatch(st: AppState, ctx: Ctx, r: Route, body: Bytes) -> ApiResult<Reply> {
    match r {
        Route::CreateSandbox => sandboxes::create(st, ctx, body).await,
        Route::ListSandboxes => sandboxes::list(st, ctx).await,
        Route::GetSandbox(id) => sandboxes::get(st, ctx, id).await,
        Route::DeleteSandbox(id) => sandboxes::delete(st, ctx, id).await,
        Route::SandboxAction(id, verb) => match verb.as_str() {
            "exec" => processes::exec(st, ctx, id, body).await,
            _ => sandboxes::action(st, ctx, id, verb, body).await,
        },
        Route::FileContentGet(id) => files::read(st, ctx, id).await,
        Route::ArchiveGet(id) => files::archive_get(st, ctx, id).await,
        Route::ArchivePut(id) => files::archive_put(st, ctx, id, body).await,
        Route::FileContentPut(id) => files::write(st, ctx, id, body).await,
        Route::FilesList(id) => files::list(st, ctx, id).await,
        Route::FilesStat(id) => files::stat(st, ctx, id).await,
        Route::FilesAction(id, verb) => files::action(st, ctx, id, verb, body).await,
        Route::UploadBegin(id) => files::upload_begin(st, ctx, id, body).await,
        Route::UploadChunk(id, u) => files::upload_chunk(st, ctx, id, u, body).await,
        Route::UploadAction(id, u, verb) => files::upload_action(st, ctx, id, u, verb, body).await,
        Route::ArchiveUploadBegin(id) => files::archive_upload_begin(st, ctx, id, body).await,
        Route::ArchiveUploadChunk(id, u) => files::archive_upload_chunk(st, ctx, id, u, body).await,
        Route::ArchiveUploadAction(id, u, verb) => {
            files::archive_upload_action(st, ctx, id, u, verb, body).await
        }
        Route::ProcSpawn(id) => processes::spawn(st, ctx, id, body).await,
        Route::ProcList(id) => processes::list(st, ctx, id).await,
        Route::ProcGet(id, pid) => processes::get(st, ctx, id, pid).await,
        Route::ProcFiles(id, pid) => processes::files(st, ctx, id, pid).await,
        Route::ProcOutput(id, pid) => processes::output(st, ctx, id, pid).await,
        Route::ProcAction(id, pid, verb) => processes::action(st, ctx, id, pid, verb, body).await,
        Route::WatchCreate(id) => watches::create(st, ctx, id, body).await,
        Route::WatchList(id) => watches::list(st, ctx, id).await,
        Route::WatchEvents(id, w) => watches::events(st, ctx, id, w).await,
        Route::WatchDelete(id, w) => watches::delete(st, ctx, id, w).await,
        Route::ListSnapshots => snapshots::list(st, ctx).await,
        Route::GetSnapshot(id) => snapshots::get(st, ctx, id).await,
        Route::DeleteSnapshot(id) => snapshots::delete(st, ctx, id).await,
        Route::SnapshotAction(id, verb) => snapshots::action(st, ctx, id, verb, body).await,
        Route::CreateImage => images::create(st, ctx, body).await,
        Route::ListImages => images::list(st, ctx).await,
        Route::ResolveImage => images::resolve(st, ctx).await,
        Route::ListRegistries => registries::list(st, ctx).await,
        Route::SetRegistry => registries::set(st, ctx, body).await,
        Route::DeleteRegistry => registries::delete(st, ctx, body).await,
        Route::GetImage(id) => images::get(st, ctx, id).await,
        Route::ImageLogs(id) => images::logs(st, ctx, id).await,
        Route::DeleteImage(id) => images::delete(st, ctx, id).await,
        Route::ImageAction(id, verb) => images::action(st, ctx, id, verb, body).await,
        Route::PruneImages => images::prune(st, ctx, body).await,
        Route::ContextMissing => images::context_missing(st, ctx, body).await,
        Route::ContextPut(sha) => images::context_put(st, ctx, sha, body).await,
        Route::CreateVolume => volumes::create(st, ctx, body).await,
        Route::ListVolumes => volumes::list(st, ctx).await,
        Route::GetVolume(id) => volumes::get(st, ctx, id).await,
        Route::DeleteVolume(id) => volumes::delete(st, ctx, id).await,
        Route::VolumeAction(id, verb) => volumes::action(st, ctx, id, verb, body).await,
        Route::GetVolumeAttachment(id, aid) => volumes::get_attachment(st, ctx, id, aid).await,
        Route::VolumeAttachmentAction(id, aid, verb) => {
            volumes::attachment_action(st, ctx, id, aid, verb, body).await
        }
        Route::ListVolumeBackups => volumes::list_backups(st, ctx).await,
        Route::GetVolumeBackup(id) => volumes::get_backup(st, ctx, id).await,
        Route::VolumeBackupAction(id, verb) => {
            volumes::backup_action(st, ctx, id, verb, body).await
        }
        Route::Interpreter(m, id, rest, verb) => {
            interpreter::handle(st, ctx, m, id, rest, verb, body).await
        }
        Route::Previews(id) => previews::list(st, ctx, id).await,
        Route::PreviewCreate(id) => previews::create(st, ctx, id, body).await,
        Route::PreviewGet(id, port) => previews::get(st, ctx, id, port).await,
        Route::PreviewDelete(id, port) => previews::delete(st, ctx, id, port).await,
        Route::PreviewAction(id, port, verb) => {
            previews::action(st, ctx, id, port, verb, body).await
        }
        Route::GetNetwork(id) => network::get(st, ctx, id).await,
        Route::PutNetwork(id) => network::put(st, ctx, id, body).await,
        Route::ListSecrets => secrets::list(st, ctx).await,
        Route::PutSecret(name) => secrets::put(st, ctx, name, body).await,
        Route::DeleteSecret(name) => secrets::delete(st, ctx, name).await,
        Route::ListEvents => events::list(st, ctx).await,
        Route::CreateWebhook => events::create_webhook(st, ctx, body).await,
        Route::ListWebhooks => events::list_webhooks(st, ctx).await,
        Route::GetWebhook(id) => events::get_webhook(st, ctx, id).await,
        Route::DeleteWebhook(id) => events::delete_webhook(st, ctx, id).await,
        Route::WebhookAction(id, verb) => events::webhook_action(st, ctx, id, verb, body).await,
        Route::WebhookDeliveries(id) => events::deliveries(st, ctx, id).await,
        Route::DeliveryAction(id, verb) => events::delivery_action(st, ctx, id, verb, body).await,
        Route::JobSecrets => Err(ApiError::Unsupported {
            feature: "Secrets for scheduled jobs",
        }),
        Route::Terminal(_) | Route::Tunnel(_) => Err(ApiError::Internal {
            what: "a WebSocket route reached the JSON dispatcher".into(),
        }),
        Route::Usage => account::usage(st, ctx).await,
        Route::UsageRequests => account::usage_requests(st, ctx).await,
        Route::UsageExport => account::usage_export(st, ctx).await,
        Route::Limits => account::limits(st, ctx).await,
        Route::Me => account::me(st, ctx).await,
        Route::SessionCreate(id) => sessions::create(st, ctx, id, body).await,
        Route::SessionList(id) => sessions::list(st, ctx, id).await,
        Route::SessionRevoke(id, s) => sessions::revoke(st, ctx, id, s, body).await,
        Route::Metrics(id) => sandboxes::metrics(st, ctx, id).await,
        Route::ListKeys => keys::list(st, ctx).await,
        Route::CreateKey => keys::create(st, ctx, body).await,
        Route::KeyAction(k, verb) => keys::action(st, ctx, k, verb, body).await,
        Route::ConsoleLog(id) => console::log(st, ctx, id).await,
        Route::UsageDaily => console::usage_daily(st, ctx).await,
        Route::Unavailable(product) => Err(ApiError::Unavailable { product }),
    }
}
