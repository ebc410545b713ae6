//! Where a create runs when several nodes share one store
//! (docs/deploy.md, "Placement"): pure, over the nodes' rows.

/// A node as its peers see it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeRow {
    pub id: String,
    pub url: String,
    pub started_ms: i64,
    pub seen_ms: i64,
    /// The memory (MiB) it can still promise new machines; -1: it cannot tell.
    pub free_mib: i64,
    /// No new sandboxes go there (`runtime host drain`).
    pub draining: bool,
    /// Since when its peers hold it lost (it was not seen for too long); 0: not lost.
    pub lost_ms: i64,
}

/// The nodes that may take a machine of `asked_mib`, most room first,
/// other than `me`: seen within `fresh_ms` of `now`, not drained, not held
/// lost, and that said they can take `asked_mib` more. A node that cannot
/// tell its room (`free_mib` -1) comes after every node that can; equal
/// room is ordered by id, so every node ranks alike.
pub(crate) fn rank<'a>(
    nodes: &'a [NodeRow],
    me: &str,
    now: i64,
    fresh_ms: i64,
    asked_mib: u64,
) -> Vec<&'a NodeRow> {
    let asked = i64::try_from(asked_mib).unwrap_or(i64::MAX);
    let mut fit: Vec<&NodeRow> = nodes
        .iter()
        .filter(|n| n.id != me && !n.draining && n.lost_ms == 0 && n.seen_ms >= now - fresh_ms)
        .filter(|n| n.free_mib < 0 || n.free_mib >= asked)
        .collect();
    fit.sort_by(|a, b| {
        (b.free_mib >= 0, b.free_mib)
            .cmp(&(a.free_mib >= 0, a.free_mib))
            .then_with(|| a.id.cmp(&b.id))
    });
    fit
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(id: &str, free_mib: i64, seen_ms: i64) -> NodeRow {
        NodeRow {
            id: id.into(),
            url: format!("http://{id}:8080"),
            started_ms: 0,
            seen_ms,
            free_mib,
            draining: false,
            lost_ms: 0,
        }
    }

    #[test]
    fn the_live_node_with_most_room_is_chosen() {
        let now = 100_000;
        let mut nodes = vec![
            node("me", 99_999, now),
            node("a", 2048, now),
            node("b", 8192, now - 1_000),
            node("c", 512, now),
            node("stale", 50_000, now - 16_000),
            node("unknown", -1, now),
        ];
        let pick = |nodes: &[NodeRow], asked| {
            rank(nodes, "me", now, 15_000, asked)
                .first()
                .map(|n| n.id.clone())
        };
        assert_eq!(pick(&nodes, 1024).as_deref(), Some("b"));
        assert_eq!(pick(&nodes, 4096).as_deref(), Some("b"));
        // The rest follow by room, the one that cannot tell last.
        let order: Vec<&str> = rank(&nodes, "me", now, 15_000, 512)
            .iter()
            .map(|n| n.id.as_str())
            .collect();
        assert_eq!(order, ["b", "a", "c", "unknown"]);
        // Known room too small everywhere: the node that cannot tell.
        assert_eq!(pick(&nodes, 9000).as_deref(), Some("unknown"));
        nodes.retain(|n| n.id != "unknown");
        assert_eq!(pick(&nodes, 9000), None);
        // Drained or held lost: passed over.
        nodes[2].draining = true;
        assert_eq!(pick(&nodes, 1024).as_deref(), Some("a"));
        nodes[1].lost_ms = 1;
        assert_eq!(pick(&nodes, 1024), None);
        assert_eq!(pick(&nodes, 512).as_deref(), Some("c"));
        // Equal room: the same node every time (by id).
        let tie = vec![node("y", 1024, now), node("x", 1024, now)];
        assert_eq!(pick(&tie, 256).as_deref(), Some("x"));
    }
}
