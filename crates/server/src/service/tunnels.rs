//! Port forwarding into a sandbox (the tunnel WebSocket): connections to
//! the guest's loopback, for a key that may reach the sandbox.

use tokio::io::DuplexStream;

use crate::domain::access::KeyInfo;
use crate::error::ApiResult;
use crate::service::sandboxes::find_running;
use crate::AppState;

/// Checks that the key may open a tunnel to the sandbox (waking it).
pub(crate) async fn open(st: &AppState, key: &KeyInfo, id: &str) -> ApiResult<()> {
    find_running(st, key, id).await?;
    Ok(())
}

/// A connection to the guest's `127.0.0.1:port`. A paused sandbox is woken
/// by a connection, as by any call.
pub(crate) async fn connect(
    st: &AppState,
    key: &KeyInfo,
    id: &str,
    port: u16,
) -> ApiResult<DuplexStream> {
    find_running(st, key, id).await?;
    Ok(st.host().connect(id, port).await?)
}
