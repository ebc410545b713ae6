//! Orchestration over the store, the `Host` and owned tasks. Never names
//! HTTP types (axum, `StatusCode`, `Bytes`).

pub(crate) mod archives;
pub(crate) mod attachments;
pub(crate) mod background;
pub(crate) mod billing;
pub(crate) mod clock;
pub(crate) mod console;
pub(crate) mod events;
pub(crate) mod files;
pub(crate) mod images;
pub(crate) mod interpreter;
pub mod keys;
pub(crate) mod lifecycle;
pub(crate) mod links;
pub(crate) mod meter;
pub(crate) mod metrics;
pub(crate) mod network;
pub(crate) mod nodes;
pub(crate) mod pool;
pub(crate) mod previews;
pub(crate) mod processes;
pub(crate) mod quotas;
pub(crate) mod resize;
pub(crate) mod sandboxes;
pub(crate) mod secrets;
pub(crate) mod sessions;
pub(crate) mod shares;
pub(crate) mod snapshots;
pub(crate) mod switch;
pub(crate) mod telemetry;
pub(crate) mod tunnels;
pub(crate) mod uploads;
pub(crate) mod usage;
pub(crate) mod volumes;
pub(crate) mod watches;
pub(crate) mod webhooks;
