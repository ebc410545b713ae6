//! Nodes and leases (v19): several control planes on one store.
//!
//! Each server is a node: its machines run the sandboxes whose `node` is
//! its id, and only it acts on them (leases, idle pauses, the meter, a
//! restart's recovery). A request for another node's sandbox is carried to
//! that node's URL (`http/forward.rs`). Store-wide jobs run on the one node
//! holding their lease.

use super::db::{params, Engine, OptionalExtension};
use super::{store_err, Store};
use crate::error::ServerError;

pub use crate::domain::placement::NodeRow;

const NODE_COLUMNS: &str = "id, url, started_ms, seen_ms, free_mib, draining, lost_ms";

fn node_row(r: &super::db::Row) -> super::db::DbResult<NodeRow> {
    Ok(NodeRow {
        id: r.get(0)?,
        url: r.get(1)?,
        started_ms: r.get(2)?,
        seen_ms: r.get(3)?,
        free_mib: r.get(4)?,
        draining: r.get::<_, i64>(5)? != 0,
        lost_ms: r.get(6)?,
    })
}

impl Store {
    /// This store as node `node`'s: the sandboxes it inserts are `node`'s,
    /// the leases it takes are held by `node`.
    pub fn on_node(mut self, node: &str) -> Self {
        self.node = node.to_string();
        self
    }

    /// The node this store acts for.
    pub fn node(&self) -> &str {
        &self.node
    }

    /// Whether other control planes may share this store (PostgreSQL);
    /// SQLite's file has one server.
    pub fn shared(&self) -> bool {
        matches!(self.engine, Engine::Pg(_))
    }

    /// Says this node is alive at `now`, reachable at `url`, with room for
    /// `free_mib` more MiB of machines (a first beat since the start also
    /// sets `started_ms`). Answers its row as its peers see it (drained,
    /// held lost).
    pub fn beat(
        &self,
        url: &str,
        now: i64,
        starting: bool,
        free_mib: i64,
    ) -> Result<NodeRow, ServerError> {
        let sql = if starting {
            "INSERT INTO nodes (id, url, started_ms, seen_ms, free_mib) VALUES (?1, ?2, ?3, ?3, ?4) \
             ON CONFLICT (id) DO UPDATE SET url = excluded.url, started_ms = excluded.started_ms, \
             seen_ms = excluded.seen_ms, free_mib = excluded.free_mib"
        } else {
            "INSERT INTO nodes (id, url, started_ms, seen_ms, free_mib) VALUES (?1, ?2, ?3, ?3, ?4) \
             ON CONFLICT (id) DO UPDATE SET url = excluded.url, seen_ms = excluded.seen_ms, \
             free_mib = excluded.free_mib"
        };
        self.conn()
            .execute(sql, params![self.node, url, now, free_mib])
            .map_err(store_err("node beat"))?;
        self.get_node(&self.node)?
            .ok_or_else(|| super::corrupt(format!("node {} vanished on its beat", self.node)))
    }

    /// This node stops: it takes no creates of its peers until its next
    /// start says its room again.
    pub fn node_leaving(&self) -> Result<(), ServerError> {
        self.conn()
            .execute(
                "UPDATE nodes SET free_mib = 0 WHERE id = ?1",
                params![self.node],
            )
            .map_err(store_err("node leaving"))?;
        Ok(())
    }

    /// Drains node `id` (no new sandboxes go there) or takes it back;
    /// `false` when no such node is known.
    pub fn set_draining(&self, id: &str, draining: bool) -> Result<bool, ServerError> {
        let n = self
            .conn()
            .execute(
                "UPDATE nodes SET draining = ?2 WHERE id = ?1",
                params![id, i64::from(draining)],
            )
            .map_err(store_err("drain node"))?;
        Ok(n == 1)
    }

    /// Holds node `id` lost from `now` when it was last seen before
    /// `cutoff_ms` and is not held lost yet: true for the one caller that
    /// did it (it then stops the node's sandboxes in the records).
    pub fn mark_lost(&self, id: &str, cutoff_ms: i64, now: i64) -> Result<bool, ServerError> {
        let n = self
            .conn()
            .execute(
                "UPDATE nodes SET lost_ms = ?3 WHERE id = ?1 AND lost_ms = 0 AND seen_ms < ?2",
                params![id, cutoff_ms, now],
            )
            .map_err(store_err("mark node lost"))?;
        Ok(n == 1)
    }

    /// This node, held lost since `since_ms`, has settled what its peers
    /// recorded meanwhile: no longer lost.
    pub fn node_back(&self, since_ms: i64) -> Result<(), ServerError> {
        self.conn()
            .execute(
                "UPDATE nodes SET lost_ms = 0 WHERE id = ?1 AND lost_ms = ?2",
                params![self.node, since_ms],
            )
            .map_err(store_err("node back"))?;
        Ok(())
    }

    pub fn get_node(&self, id: &str) -> Result<Option<NodeRow>, ServerError> {
        self.conn()
            .query_row(
                &format!("SELECT {NODE_COLUMNS} FROM nodes WHERE id = ?1"),
                params![id],
                node_row,
            )
            .optional()
            .map_err(store_err("get node"))
    }

    /// Every node, by id.
    pub fn nodes(&self) -> Result<Vec<NodeRow>, ServerError> {
        let conn = self.conn();
        let mut stmt = conn
            .prepare(&format!("SELECT {NODE_COLUMNS} FROM nodes ORDER BY id"))
            .map_err(store_err("list nodes"))?;
        let rows = stmt
            .query_map([], node_row)
            .map_err(store_err("list nodes"))?;
        let mut out = Vec::new();
        for r in rows {
            out.push(r.map_err(store_err("list nodes"))?);
        }
        Ok(out)
    }

    /// Writes `rows` as nodes, in one transaction: the placement
    /// simulation's hosts (`runtime host simulate --store`), so its reads
    /// of the `nodes` table are timed against that many rows.
    pub fn seed_nodes(&self, rows: &[NodeRow]) -> Result<(), ServerError> {
        let mut conn = self.conn();
        let tx = conn.transaction().map_err(store_err("begin"))?;
        for n in rows {
            tx.execute(
                "INSERT INTO nodes (id, url, started_ms, seen_ms, free_mib, draining, lost_ms) \
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7) ON CONFLICT (id) DO UPDATE SET \
                 seen_ms = excluded.seen_ms, free_mib = excluded.free_mib",
                params![
                    n.id,
                    n.url,
                    n.started_ms,
                    n.seen_ms,
                    n.free_mib,
                    i64::from(n.draining),
                    n.lost_ms
                ],
            )
            .map_err(store_err("seed nodes"))?;
        }
        tx.commit().map_err(store_err("commit"))
    }

    /// Forgets the nodes whose id starts with `prefix` (the simulation's).
    pub fn forget_nodes(&self, prefix: &str) -> Result<usize, ServerError> {
        self.conn()
            .execute(
                "DELETE FROM nodes WHERE substr(id, 1, length(?1)) = ?1",
                params![prefix],
            )
            .map_err(store_err("forget nodes"))
    }

    /// The store-wide fact `name`: `value` if none was set yet, otherwise
    /// the one set first (by whichever node).
    pub fn claim_meta(&self, name: &str, value: &str) -> Result<String, ServerError> {
        let conn = self.conn();
        conn.execute(
            "INSERT INTO store_meta (name, value) VALUES (?1, ?2) ON CONFLICT (name) DO NOTHING",
            params![name, value],
        )
        .map_err(store_err("store fact"))?;
        conn.query_row(
            "SELECT value FROM store_meta WHERE name = ?1",
            params![name],
            |r| r.get(0),
        )
        .map_err(store_err("store fact"))
    }

    /// Sets the store-wide fact `name` to `value`, whatever it was.
    pub fn set_meta(&self, name: &str, value: &str) -> Result<(), ServerError> {
        self.conn()
            .execute(
                "INSERT INTO store_meta (name, value) VALUES (?1, ?2) \
                 ON CONFLICT (name) DO UPDATE SET value = excluded.value",
                params![name, value],
            )
            .map(|_| ())
            .map_err(store_err("store fact"))
    }

    /// The store-wide fact `name`, if set.
    pub fn meta(&self, name: &str) -> Result<Option<String>, ServerError> {
        self.conn()
            .query_row(
                "SELECT value FROM store_meta WHERE name = ?1",
                params![name],
                |r| r.get(0),
            )
            .optional()
            .map_err(store_err("store fact"))
    }

    /// How many sandboxes each node holds that are not stopped (deleted
    /// ones aside), by node id.
    pub fn sandboxes_per_node(&self) -> Result<Vec<(String, i64)>, ServerError> {
        let conn = self.conn();
        let mut stmt = conn
            .prepare(
                "SELECT node, COUNT(*) FROM sandboxes WHERE deleted IS NULL AND state <> 'stopped' \
                 GROUP BY node ORDER BY node",
            )
            .map_err(store_err("count sandboxes per node"))?;
        let rows = stmt
            .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
            .map_err(store_err("count sandboxes per node"))?;
        let mut out = Vec::new();
        for r in rows {
            out.push(r.map_err(store_err("count sandboxes per node"))?);
        }
        Ok(out)
    }

    /// Makes the sandboxes and images no node owns (made before v19) this
    /// node's: on an upgrade, the one machine that has them. Returns how
    /// many sandboxes.
    pub fn adopt_unowned(&self) -> Result<usize, ServerError> {
        let conn = self.conn();
        conn.execute(
            "UPDATE images SET node = ?1 WHERE node = ''",
            params![self.node],
        )
        .map_err(store_err("adopt images"))?;
        conn.execute(
            "UPDATE sandboxes SET node = ?1 WHERE node = ''",
            params![self.node],
        )
        .map_err(store_err("adopt sandboxes"))
    }

    /// The node whose machines run sandbox `id` (deleted ones included).
    pub fn sandbox_node(&self, id: &str) -> Result<Option<String>, ServerError> {
        self.conn()
            .query_row(
                "SELECT node FROM sandboxes WHERE id = ?1",
                params![id],
                |r| r.get(0),
            )
            .optional()
            .map_err(store_err("sandbox node"))
    }

    /// Takes or keeps the lease `name` until `now + ttl_ms`: true when this
    /// node holds it now. Another node's lease is taken only once it has
    /// lapsed, so one job has one runner at a time.
    pub fn hold_lease(&self, name: &str, now: i64, ttl_ms: i64) -> Result<bool, ServerError> {
        let n = self
            .conn()
            .execute(
                "INSERT INTO leases (name, holder, until_ms) VALUES (?1, ?2, ?3) \
                 ON CONFLICT (name) DO UPDATE SET holder = excluded.holder, until_ms = excluded.until_ms \
                 WHERE leases.holder = excluded.holder OR leases.until_ms < ?4",
                params![name, self.node, now + ttl_ms, now],
            )
            .map_err(store_err("lease"))?;
        Ok(n == 1)
    }

    /// Gives up this node's leases (a clean shutdown), so another node
    /// takes them at once.
    pub fn release_leases(&self) -> Result<(), ServerError> {
        self.conn()
            .execute("DELETE FROM leases WHERE holder = ?1", params![self.node])
            .map_err(store_err("release leases"))?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::super::{testing, Store, StoreAt};
    use crate::store::SandboxRow;

    fn open(at: &StoreAt, node: &str) -> Store {
        Store::open_at(at).unwrap().on_node(node)
    }

    fn row(id: &str) -> SandboxRow {
        let settings = crate::domain::sandbox::Settings {
            name: None,
            labels: Default::default(),
            funding: "key".into(),
            vcpu: 1,
            memory_mib: 1024,
            disk_mib: 4096,
            cpu: "shared".into(),
            cpu_floor_millis: 0,
            pausable: true,
            timeout_seconds: None,
            idle_pause_seconds: 0,
            auto_wake: false,
            persistent: false,
            on_lease_end: "stop".into(),
            user: "runtime".into(),
            max_total_cost_micros: None,
            max_cost_micros: None,
        };
        SandboxRow {
            seq: 0,
            key_id: "k".into(),
            record: crate::domain::sandbox::new_record(settings, id.into(), &[], 0),
            env: vec![],
            deleted: None,
        }
    }

    fn here(s: &Store) -> Vec<String> {
        let mut v: Vec<String> = s
            .live_sandboxes_here()
            .unwrap()
            .into_iter()
            .map(|r| r.record.id)
            .collect();
        v.sort();
        v
    }

    #[test]
    fn one_node_holds_a_lease_until_it_lapses_or_is_released() {
        testing::each_location(|at| {
            // Two control planes on one store: the same database, two nodes.
            let a = open(at, "node-a");
            let b = open(at, "node-b");
            assert!(a.hold_lease("housekeeping", 1_000, 10_000).unwrap());
            assert!(!b.hold_lease("housekeeping", 2_000, 10_000).unwrap());
            // The holder keeps it, and moves its end.
            assert!(a.hold_lease("housekeeping", 5_000, 10_000).unwrap());
            assert!(!b.hold_lease("housekeeping", 14_000, 10_000).unwrap());
            // Another lease is another job's.
            assert!(b.hold_lease("fold", 14_000, 10_000).unwrap());
            // Lapsed: the other node takes it, and the first no longer has it.
            assert!(b.hold_lease("housekeeping", 15_001, 10_000).unwrap());
            assert!(!a.hold_lease("housekeeping", 15_002, 10_000).unwrap());
            // Released on a clean stop: taken at once.
            b.release_leases().unwrap();
            assert!(a.hold_lease("housekeeping", 15_003, 10_000).unwrap());
        });
    }

    #[test]
    fn nodes_beat_and_sandboxes_belong_to_the_node_that_made_them() {
        testing::each_location(|at| {
            let before = Store::open_at(at).unwrap();
            let a = open(at, "node-a");
            let b = open(at, "node-b");
            a.beat("http://10.0.0.1:8080", 100, true, -1).unwrap();
            let seen = a.beat("http://10.0.0.1:8080", 200, false, 3072).unwrap();
            b.beat("http://10.0.0.2:8080", 150, true, 0).unwrap();
            let na = a.get_node("node-a").unwrap().unwrap();
            assert_eq!(seen, na);
            assert_eq!(
                (na.url.as_str(), na.started_ms, na.seen_ms, na.free_mib),
                ("http://10.0.0.1:8080", 100, 200, 3072)
            );
            assert!(!na.draining && na.lost_ms == 0);
            assert_eq!(a.nodes().unwrap().len(), 2);
            // One made before nodes existed (no node), one by each node.
            before.insert_sandbox(&row("old")).unwrap();
            a.insert_sandbox(&row("sa")).unwrap();
            b.insert_sandboxes_answered(&[row("sb")], None).unwrap();
            assert_eq!(a.sandbox_node("sa").unwrap().as_deref(), Some("node-a"));
            assert_eq!(a.sandbox_node("sb").unwrap().as_deref(), Some("node-b"));
            assert_eq!(a.sandbox_node("nope").unwrap(), None);
            assert_eq!(here(&a), ["sa"]);
            assert_eq!(here(&b), ["sb"]);
            // The first node to start after the upgrade takes the old one.
            assert_eq!(a.adopt_unowned().unwrap(), 1);
            assert_eq!(b.adopt_unowned().unwrap(), 0);
            assert_eq!(here(&a), ["old", "sa"]);
            // Every node still lists all of them.
            assert_eq!(b.live_sandboxes().unwrap().len(), 3);
            assert_eq!(
                b.sandboxes_per_node().unwrap(),
                [("node-a".to_string(), 2), ("node-b".to_string(), 1)]
            );
        });
    }

    #[test]
    fn a_node_is_drained_held_lost_once_and_back_when_it_says_so() {
        testing::each_location(|at| {
            let a = open(at, "node-a");
            let b = open(at, "node-b");
            a.beat("http://10.0.0.1:8080", 1_000, true, 2048).unwrap();
            b.beat("http://10.0.0.2:8080", 1_000, true, 2048).unwrap();
            // Leaving: no room until its next beat.
            b.node_leaving().unwrap();
            assert_eq!(a.get_node("node-b").unwrap().unwrap().free_mib, 0);
            // Drained by the operator: its next beat sees it; unknown nodes are said.
            assert!(a.set_draining("node-b", true).unwrap());
            assert!(!a.set_draining("node-z", true).unwrap());
            assert!(
                b.beat("http://10.0.0.2:8080", 2_000, false, 2048)
                    .unwrap()
                    .draining
            );
            assert!(a.set_draining("node-b", false).unwrap());
            assert!(!b.get_node("node-b").unwrap().unwrap().draining);
            // Seen since the cutoff: not lost.
            assert!(!a.mark_lost("node-b", 1_500, 40_000).unwrap());
            // Unseen since: held lost by one caller only, from `now`.
            assert!(a.mark_lost("node-b", 2_500, 40_000).unwrap());
            assert!(!a.mark_lost("node-b", 2_500, 41_000).unwrap());
            let lost = b.beat("http://10.0.0.2:8080", 50_000, true, 2048).unwrap();
            assert_eq!(
                lost.lost_ms, 40_000,
                "a beat does not end it: the node settles first"
            );
            // Back only for the loss it settled.
            b.node_back(39_999).unwrap();
            assert_eq!(b.get_node("node-b").unwrap().unwrap().lost_ms, 40_000);
            b.node_back(40_000).unwrap();
            assert_eq!(b.get_node("node-b").unwrap().unwrap().lost_ms, 0);
            // The simulation's hosts come and go by their prefix alone.
            let sim: Vec<super::NodeRow> = (0..3)
                .map(|i| super::NodeRow {
                    id: format!("sim-{i}"),
                    url: format!("http://10.0.0.{i}:8080"),
                    started_ms: 0,
                    seen_ms: 1,
                    free_mib: 1024,
                    draining: false,
                    lost_ms: 0,
                })
                .collect();
            a.seed_nodes(&sim).unwrap();
            assert_eq!(a.nodes().unwrap().len(), 5);
            assert_eq!(a.get_node("sim-2").unwrap().as_ref(), Some(&sim[2]));
            assert_eq!(a.forget_nodes("sim-").unwrap(), 3);
            assert_eq!(a.nodes().unwrap().len(), 2);
            // A store-wide fact: the first node's stands.
            assert_eq!(a.meta("check").unwrap(), None);
            assert_eq!(a.claim_meta("check", "one").unwrap(), "one");
            assert_eq!(b.claim_meta("check", "two").unwrap(), "one");
            assert_eq!(b.meta("check").unwrap().as_deref(), Some("one"));
        });
    }
}
