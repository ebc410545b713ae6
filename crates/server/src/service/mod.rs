//! Orchestration over the store, the `Host` and owned tasks. Never names
//! HTTP types (axum, `StatusCode`, `Bytes`).

pub(crate) mod clock;
pub(crate) mod interpreter;
pub(crate) mod lifecycle;
pub(crate) mod processes;
pub(crate) mod sandboxes;
pub(crate) mod tunnels;
