//! The operator's metrics (`GET /metrics`): the counters the server keeps
//! ([`crate::domain::telemetry`]) with what is read at scrape time: the
//! sandboxes by state from the store, the host's memory and space, and the
//! egress proxy's totals.

use crate::domain::telemetry::{EgressGauges, Gauges, HostGauges};
use crate::error::ApiResult;
use crate::AppState;

/// The text of `GET /metrics`, in the Prometheus text format.
pub(crate) async fn scrape(st: &AppState) -> ApiResult<String> {
    let sandboxes = st.store().count_by_state()?;
    let host = st.host().room().await.map(|r| HostGauges {
        memory_total: r.memory_total,
        memory_available: r.memory_available,
        ram_dir_total: r.ram_dir_total,
        ram_dir_free: r.ram_dir_free,
        disk_free: r.disk_free,
    });
    let egress = st.host().egress_traffic().map(|t| EgressGauges {
        sent_bytes: t.sent_bytes,
        received_bytes: t.received_bytes,
        connections: t.connections,
        connections_open: t.connections_open,
        refused: t.refused,
    });
    let (warm_machines, warm_bytes) = st.inner.pools.gauges();
    let gauges = Gauges {
        warm_machines,
        warm_bytes,
        sandboxes,
        host,
        egress,
        uptime_seconds: st.inner.started.elapsed().as_secs_f64(),
    };
    Ok(st
        .inner
        .telemetry
        .render(&gauges, env!("CARGO_PKG_VERSION")))
}
