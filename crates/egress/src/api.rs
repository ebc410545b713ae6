//! `http://runtime.internal`: the server's own API as code in a sandbox
//! reaches it. The proxy judges the name by the sandbox's rules like any
//! other (`internet: false`, an `allow` list that leaves it out and `deny`
//! refuse it with the usual codes), never resolves it, and instead of
//! connecting out hands the connection to the [`InternalApi`] the server put
//! in the [`ApiSlot`], naming the sandbox it comes from.

use std::sync::{Arc, RwLock};

use tokio::io::DuplexStream;

/// The name the API has inside every sandbox.
pub const API_HOST: &str = "runtime.internal";
/// The only port it is served on (plain HTTP: the hop never leaves the host).
pub const API_PORT: u16 = 80;

/// The server's side of `runtime.internal`.
pub trait InternalApi: Send + Sync + 'static {
    /// Serves HTTP/1.1 on `stream`, a connection of `sandbox_id`'s guest,
    /// until it ends. Must return at once (spawn the work).
    fn serve(&self, sandbox_id: &str, stream: DuplexStream);
}

/// Where the server puts its [`InternalApi`]: shared by every clone of the
/// config, set once the server exists (after the proxy was made), emptied
/// when it stops.
#[derive(Clone, Default)]
pub struct ApiSlot(Arc<RwLock<Option<Arc<dyn InternalApi>>>>);

impl ApiSlot {
    /// Puts the handler in (or takes it out with `None`).
    pub fn set(&self, api: Option<Arc<dyn InternalApi>>) {
        *self.0.write().unwrap_or_else(|e| e.into_inner()) = api;
    }

    pub(crate) fn get(&self) -> Option<Arc<dyn InternalApi>> {
        self.0.read().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

impl std::fmt::Debug for ApiSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ApiSlot")
            .field("set", &self.get().is_some())
            .finish()
    }
}
