//! A placement simulation (`runtime host simulate`, run by
//! `bench/cluster.py`): the real ranking of `domain::placement` over many
//! hosts and creates, in memory, and the real read of the `nodes` table
//! against that many rows when a store is given.

use std::time::Instant;

use rand::{Rng, SeedableRng};

use crate::domain::placement::{rank, NodeRow};
use crate::error::ServerError;
use crate::store::{Store, StoreAt};

/// What a simulation measured.
#[derive(Debug, Clone, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct SimReport {
    pub hosts: usize,
    pub creates: usize,
    pub placed: usize,
    pub refused: usize,
    /// Ranking decisions per second (one per create, every host ranked).
    pub decisions_per_second: f64,
    pub decision_p50_us: f64,
    pub decision_p95_us: f64,
    /// Store round trips a create adds for placement: one read of `nodes`.
    pub store_reads_per_create: u32,
    /// Rows that read returns (every node).
    pub rows_per_read: usize,
    /// Its time on the given store (median and p95 of 50), when one was given.
    pub read_p50_ms: Option<f64>,
    pub read_p95_ms: Option<f64>,
    /// Statements every host writes to the store each second, summed
    /// (its beat every 5 s: an upsert and a read; the `nodes` lease try).
    pub store_writes_per_second_all_hosts: f64,
}

const SIM_PREFIX: &str = "sim-";

/// Places `creates` sandboxes of 1, 2 or 4 GiB on `hosts` hosts of 64, 128
/// or 256 GiB (4x overcommit), each create taking the host with the most
/// room (the worst case: every create ranks every host, as one whose own
/// node is full does).
pub fn simulate_placement(
    hosts: usize,
    creates: usize,
    at: Option<&StoreAt>,
) -> Result<SimReport, ServerError> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(17);
    let now = 1_000_000;
    let mut nodes: Vec<NodeRow> = (0..hosts)
        .map(|i| {
            let gib: i64 = [64, 128, 256][rng.gen_range(0..3)];
            NodeRow {
                id: format!("{SIM_PREFIX}{i:05}"),
                url: format!(
                    "http://10.{}.{}.{}:8080",
                    i / 65536,
                    (i / 256) % 256,
                    i % 256
                ),
                started_ms: 0,
                seen_ms: now - rng.gen_range(0..5_000),
                free_mib: gib * 1024 * 4,
                draining: false,
                lost_ms: 0,
            }
        })
        .collect();
    let (read_p50_ms, read_p95_ms) = match at {
        Some(at) => {
            let store = Store::open_at(at)?;
            store.seed_nodes(&nodes)?;
            let mut reads = Vec::with_capacity(50);
            for _ in 0..50 {
                let t = Instant::now();
                let rows = store.nodes()?;
                reads.push(t.elapsed().as_secs_f64() * 1e3);
                debug_assert!(rows.len() >= hosts);
            }
            store.forget_nodes(SIM_PREFIX)?;
            (
                Some(quantile(&mut reads, 0.5)),
                Some(quantile(&mut reads, 0.95)),
            )
        }
        None => (None, None),
    };
    let mut times = Vec::with_capacity(creates);
    let (mut placed, mut refused) = (0, 0);
    let started = Instant::now();
    for _ in 0..creates {
        let asked: u64 = [1024, 2048, 4096][rng.gen_range(0..3)];
        let t = Instant::now();
        let chosen = rank(&nodes, "", now, 15_000, asked)
            .first()
            .map(|n| n.id.clone());
        times.push(t.elapsed().as_secs_f64() * 1e6);
        match chosen {
            Some(id) => {
                // The chosen host's next beat says it has that much less.
                if let Some(n) = nodes.iter_mut().find(|n| n.id == id) {
                    n.free_mib -= i64::try_from(asked).unwrap_or(0);
                }
                placed += 1;
            }
            None => refused += 1,
        }
    }
    let total = started.elapsed().as_secs_f64();
    Ok(SimReport {
        hosts,
        creates,
        placed,
        refused,
        decisions_per_second: creates as f64 / total.max(1e-9),
        decision_p50_us: quantile(&mut times, 0.5),
        decision_p95_us: quantile(&mut times, 0.95),
        store_reads_per_create: 1,
        rows_per_read: hosts,
        read_p50_ms,
        read_p95_ms,
        // Each host every 5 s: the beat's upsert and read, the lease try.
        store_writes_per_second_all_hosts: hosts as f64 * 3.0 / 5.0,
    })
}

fn quantile(v: &mut [f64], q: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let i = ((v.len() - 1) as f64 * q).round() as usize;
    v[i.min(v.len() - 1)]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_simulation_places_until_the_hosts_are_full() {
        // 10 hosts promise at least 10 x 256 GiB: 500 creates of at most
        // 4 GiB all fit; 20,000 (over 40 TiB) do not.
        let r = simulate_placement(10, 500, None).unwrap();
        assert_eq!((r.placed, r.refused), (500, 0));
        let r = simulate_placement(10, 20_000, None).unwrap();
        assert!(r.refused > 0 && r.placed + r.refused == 20_000, "{r:?}");
        assert!(r.decisions_per_second > 0.0 && r.rows_per_read == 10);
    }
}
