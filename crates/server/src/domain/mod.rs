//! Pure types and rules: no axum, no store, no `Host`, no spawned tasks, no
//! clock of its own (`now` is a parameter). Everything here is unit-tested
//! at the bottom of its file.

pub(crate) mod access;
pub(crate) mod cursor;
pub(crate) mod events;
pub(crate) mod files;
pub(crate) mod image;
pub(crate) mod interpreter;
pub(crate) mod lease;
pub(crate) mod lifecycle;
pub(crate) mod link;
pub(crate) mod metrics;
pub(crate) mod money;
pub(crate) mod names;
pub(crate) mod network;
pub(crate) mod placement;
pub(crate) mod pool;
pub(crate) mod preview;
pub(crate) mod process;
pub(crate) mod quota;
pub(crate) mod registry;
pub(crate) mod sandbox;
pub(crate) mod secret;
pub(crate) mod session;
pub(crate) mod snapshot;
pub(crate) mod telemetry;
pub(crate) mod time;
pub(crate) mod volume;
pub(crate) mod webhook;
