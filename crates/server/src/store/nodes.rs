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

/// A node as its peers see it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeRow {
    pub id: String,
    pub url: String,
    pub started_ms: i64,
    pub seen_ms: i64,
}

fn node_row(r: &super::db::Row) -> super::db::DbResult<NodeRow> {
    Ok(NodeRow {
        id: r.get(0)?,
        url: r.get(1)?,
        started_ms: r.get(2)?,
        seen_ms: r.get(3)?,
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

    /// Says this node is alive at `now`, reachable at `url` (a first beat
    /// since the start also sets `started_ms`).
    pub fn beat(&self, url: &str, now: i64, starting: bool) -> Result<(), ServerError> {
        let sql = if starting {
            "INSERT INTO nodes (id, url, started_ms, seen_ms) VALUES (?1, ?2, ?3, ?3) \
             ON CONFLICT (id) DO UPDATE SET url = excluded.url, started_ms = excluded.started_ms, seen_ms = excluded.seen_ms"
        } else {
            "INSERT INTO nodes (id, url, started_ms, seen_ms) VALUES (?1, ?2, ?3, ?3) \
             ON CONFLICT (id) DO UPDATE SET url = excluded.url, seen_ms = excluded.seen_ms"
        };
        self.conn()
            .execute(sql, params![self.node, url, now])
            .map_err(store_err("node beat"))?;
        Ok(())
    }

    pub fn get_node(&self, id: &str) -> Result<Option<NodeRow>, ServerError> {
        self.conn()
            .query_row(
                "SELECT id, url, started_ms, seen_ms FROM nodes WHERE id = ?1",
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
            .prepare("SELECT id, url, started_ms, seen_ms FROM nodes ORDER BY id")
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
            a.beat("http://10.0.0.1:8080", 100, true).unwrap();
            a.beat("http://10.0.0.1:8080", 200, false).unwrap();
            b.beat("http://10.0.0.2:8080", 150, true).unwrap();
            let na = a.get_node("node-a").unwrap().unwrap();
            assert_eq!(
                (na.url.as_str(), na.started_ms, na.seen_ms),
                ("http://10.0.0.1:8080", 100, 200)
            );
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
        });
    }
}
