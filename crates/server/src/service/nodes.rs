//! Several nodes on one store (docs/deploy.md, "Placement" and "A node
//! that stays away"): each node's beat with the room it has, where a
//! create runs, noticing a node that stays away, and a node settling what
//! its peers recorded while it was away.

use crate::domain::lifecycle::{Event, SandboxState};
use crate::domain::time::{iso, parse_iso_ms};
use crate::error::{ApiError, ApiResult, ServerError};
use crate::service::lifecycle;
use crate::store::NodeRow;
use crate::AppState;

/// Whether this node is one of several on a shared store.
pub(crate) fn several(st: &AppState) -> bool {
    st.store().shared()
}

/// A node seen within this long takes creates of its peers.
pub(crate) const FRESH_MS: i64 = 15_000;

/// Says this node is alive, with the room it has for new machines.
/// Answers its row as its peers see it.
pub(crate) async fn beat(st: &AppState, starting: bool) -> Result<NodeRow, ServerError> {
    let free_mib = match crate::service::quotas::headroom_here(st).await {
        Some(mib) => i64::try_from(mib).unwrap_or(i64::MAX),
        None => -1,
    };
    st.store()
        .beat(st.node_url(), st.now_ms(), starting, free_mib)
}

/// Where a create that nothing ties to a node runs.
pub(crate) enum Placement {
    /// On this node.
    Here,
    /// On one of these peers, the first that answers; none answering,
    /// the refusal this node gave.
    Peers(Vec<NodeRow>, ApiError),
}

/// Where a create of `asked_mib` that nothing ties to a node runs: here
/// unless this node is drained or has no room for it; then the live peers
/// with room, most room first. No peer with room: this node's own refusal
/// (`no_capacity`, which the client waits out).
pub(crate) async fn place(st: &AppState, asked_mib: u64) -> ApiResult<Placement> {
    if !st.store().shared() {
        return Ok(Placement::Here);
    }
    // Read at each create: a drain counts from the moment it is said.
    let nodes = st.store().nodes()?;
    let me = st.store().node();
    let draining = nodes.iter().any(|n| n.id == me && n.draining);
    let here = if draining {
        Err(ApiError::NoCapacity {
            message: format!(
                "This node ({me}) is drained and no other node has room for this sandbox now."
            ),
            details: serde_json::json!({ "memoryMiB": asked_mib }),
        })
    } else {
        crate::service::quotas::host_room(st, asked_mib).await
    };
    let Err(refusal) = here else {
        return Ok(Placement::Here);
    };
    let peers: Vec<NodeRow> =
        crate::domain::placement::rank(&nodes, me, st.now_ms(), FRESH_MS, asked_mib)
            .into_iter()
            .cloned()
            .collect();
    if peers.is_empty() {
        return Err(refusal);
    }
    Ok(Placement::Peers(peers, refusal))
}

/// Run by the holder of the `nodes` lease: a node not seen for
/// `host_lost_after` is held lost, and its sandboxes that had a machine
/// (starting, running, pausing, resuming, stopping) are recorded
/// `stopped` with `stopReason: host_lost`. Paused ones stay paused: their
/// state is on that node's disk.
pub(crate) fn notice_lost(st: &AppState, now: i64) {
    let lost_after = i64::try_from(st.config().host_lost_after.as_millis()).unwrap_or(i64::MAX);
    let nodes = match st.store().nodes() {
        Ok(n) => n,
        Err(e) => {
            tracing::error!(error = %e, "reading the nodes failed");
            return;
        }
    };
    let cutoff = now - lost_after;
    for n in nodes {
        if n.id == st.store().node() || n.lost_ms != 0 || n.seen_ms >= cutoff {
            continue;
        }
        match st.store().mark_lost(&n.id, cutoff, now) {
            Ok(true) => {}
            Ok(false) => continue,
            Err(e) => {
                tracing::error!(node = %n.id, error = %e, "holding a node lost failed");
                continue;
            }
        }
        let rows = st.store().live_sandboxes_of(&n.id).unwrap_or_else(|e| {
            tracing::error!(node = %n.id, error = %e, "reading a lost node's sandboxes failed");
            Vec::new()
        });
        let mut stopped = 0;
        for r in rows.iter().filter(|r| had_machine(r.record.state)) {
            let moved = lifecycle::transition(st, &r.record.id, Event::HostLost, |r| {
                r.record.stop_reason = Some("host_lost".into());
                r.record.ended_at = Some(iso(now));
            });
            match moved {
                Ok(true) => stopped += 1,
                Ok(false) => {}
                Err(e) => {
                    tracing::error!(sandbox_id = %r.record.id, error = %e, "recording a lost sandbox failed")
                }
            }
        }
        tracing::warn!(
            node = %n.id,
            unseen_for_ms = now - n.seen_ms,
            sandboxes = stopped,
            "a node stayed away: held lost, its sandboxes recorded stopped"
        );
    }
}

fn had_machine(s: SandboxState) -> bool {
    use SandboxState::*;
    matches!(s, Starting | Running | Pausing | Resuming | Stopping)
}

/// This node was held lost by its peers since `since_ms` (it was away, or
/// cut from the store, for longer than `host_lost_after`): of its
/// sandboxes they recorded `stopped` meanwhile, the persistent ones come
/// back (running again when their machine still runs, otherwise started
/// from their kept disk) and the others' machines end, as recorded.
pub(crate) async fn come_back(st: &AppState, since_ms: i64) {
    let rows = match st.store().live_sandboxes_here() {
        Ok(rows) => rows,
        Err(e) => {
            tracing::error!(error = %e, "reading this node's sandboxes failed");
            return;
        }
    };
    let lost_meanwhile = rows.into_iter().filter(|r| {
        r.record.state == SandboxState::Stopped
            && r.record.stop_reason.as_deref() == Some("host_lost")
            && r.record
                .ended_at
                .as_deref()
                .and_then(parse_iso_ms)
                .is_some_and(|ended| ended >= since_ms)
    });
    let (mut back, mut restarted, mut ended) = (0, 0, 0);
    for row in lost_meanwhile {
        let id = row.record.id.clone();
        if !row.record.persistent {
            // Recorded stopped while away; what it left here ends.
            if let Err(e) = st.host().stop(&id, false).await {
                tracing::warn!(sandbox_id = %id, error = %e, "ending a lost sandbox's machine failed");
            }
            crate::service::network::sandbox_gone(st, &id);
            lifecycle::machine_gone(st, &id);
            ended += 1;
            continue;
        }
        let spec = lifecycle::machine_spec(st, &row.record);
        let runs = st.host().recover(&spec).await.unwrap_or(false);
        if runs {
            let now = iso(st.now_ms());
            match lifecycle::transition(st, &id, Event::HostBack, |r| {
                r.record.stop_reason = None;
                r.record.ended_at = None;
                r.record.last_active_at = Some(now.clone());
            }) {
                Ok(true) => {
                    crate::service::processes::recover::reattach(st, &id).await;
                    back += 1;
                }
                Ok(false) => {}
                Err(e) => {
                    tracing::error!(sandbox_id = %id, error = %e, "recording a sandbox back failed")
                }
            }
        } else {
            match crate::service::sandboxes::restart(st, &id) {
                Ok(()) => restarted += 1,
                Err(e) => {
                    tracing::error!(sandbox_id = %id, error = %e, "restarting a lost persistent sandbox failed")
                }
            }
        }
    }
    if let Err(e) = st.store().node_back(since_ms) {
        tracing::error!(error = %e, "saying this node is back failed");
    }
    tracing::info!(
        since_ms,
        back,
        restarted,
        ended,
        "this node was held lost by its peers: settled its sandboxes"
    );
}
