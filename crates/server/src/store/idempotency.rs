//! Stored answers of idempotent requests.

use super::db::{params, Connection, OptionalExtension};

use super::{store_err, Store};

use crate::error::ServerError;

/// The kind of a record stored with the sandbox a create made, in the
/// same transaction, before its answer exists (`{"sandboxId": …}`): a
/// resend after a crash answers that sandbox instead of making another.
/// The answer, once there, replaces it.
pub(crate) const PENDING_SANDBOX: &str = "sandbox";
/// Likewise for a fork, stored with its copies (`{"sandboxIds": […],
/// "snapshotId": …|null}`).
pub(crate) const PENDING_FORK: &str = "fork";
/// Likewise for a snapshot, stored with its record (`{"snapshotId": …}`).
pub(crate) const PENDING_SNAPSHOT: &str = "snapshot";
/// The kind of a claim on a shared store: a node runs the request now (its
/// id is the body). A node's answer, or a pending record, replaces it; a
/// request that ends without one removes it.
pub(crate) const IN_FLIGHT: &str = "inflight";

/// What [`Store::idem_claim`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IdemClaim {
    /// The claim is this node's: run the request.
    Run,
    /// An answer (or a pending record) within its time to live.
    Stored(StoredAnswer),
    /// Node `owner` runs it now (the fingerprints agree).
    InFlight { owner: String },
    /// The key was used for another request (within its time to live).
    Reused,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredAnswer {
    pub fingerprint: String,
    /// `json` (replay body), `stream` (body names the process to follow),
    /// [`PENDING_SANDBOX`], [`PENDING_FORK`] or [`PENDING_SNAPSHOT`].
    pub kind: String,
    pub status: u16,
    pub body: String,
    pub created_ms: i64,
}

impl Store {
    pub fn idem_get(
        &self,
        key_id: &str,
        idem_key: &str,
    ) -> Result<Option<StoredAnswer>, ServerError> {
        get(&self.conn(), key_id, idem_key)
    }

    pub fn idem_put(
        &self,
        key_id: &str,
        idem_key: &str,
        a: &StoredAnswer,
    ) -> Result<(), ServerError> {
        put(&self.conn(), key_id, idem_key, a)
    }

    /// Claims `idem_key` of `key_id` for this node, on a store several
    /// nodes share, so that a resend another node receives while this one
    /// runs the request waits for it instead of running it too. One atomic
    /// insert when nobody claimed it; an answer older than `ttl_ms`, or a
    /// claim of `taken_over` (a node held lost, or this node's own from
    /// before a restart), is taken over only if unchanged since it was read.
    pub fn idem_claim(
        &self,
        key_id: &str,
        idem_key: &str,
        fingerprint: &str,
        now_ms: i64,
        ttl_ms: i64,
        taken_over: &dyn Fn(&str) -> bool,
    ) -> Result<IdemClaim, ServerError> {
        let conn = self.conn();
        for _ in 0..8 {
            let inserted = conn
                .execute(
                    "INSERT INTO idempotency (key_id, idem_key, fingerprint, kind, status, body, created_ms)
                     VALUES (?1, ?2, ?3, ?4, 0, ?5, ?6) ON CONFLICT (key_id, idem_key) DO NOTHING",
                    params![key_id, idem_key, fingerprint, IN_FLIGHT, self.node(), now_ms],
                )
                .map_err(store_err("claim idempotency"))?;
            if inserted == 1 {
                return Ok(IdemClaim::Run);
            }
            let Some(found) = get(&conn, key_id, idem_key)? else {
                continue; // released meanwhile: claim again
            };
            let live = found.created_ms + ttl_ms > now_ms;
            let owner = (found.kind == IN_FLIGHT).then(|| found.body.clone());
            let stale = match &owner {
                Some(o) => taken_over(o),
                None => !live,
            };
            if !stale {
                if found.fingerprint != fingerprint {
                    return Ok(IdemClaim::Reused);
                }
                return Ok(match owner {
                    Some(owner) => IdemClaim::InFlight { owner },
                    None => IdemClaim::Stored(found),
                });
            }
            let took = conn
                .execute(
                    "UPDATE idempotency SET fingerprint = ?3, kind = ?4, status = 0, body = ?5, created_ms = ?6
                     WHERE key_id = ?1 AND idem_key = ?2 AND kind = ?7 AND body = ?8 AND created_ms = ?9",
                    params![
                        key_id,
                        idem_key,
                        fingerprint,
                        IN_FLIGHT,
                        self.node(),
                        now_ms,
                        found.kind,
                        found.body,
                        found.created_ms
                    ],
                )
                .map_err(store_err("take over idempotency"))?;
            if took == 1 {
                return Ok(IdemClaim::Run);
            }
        }
        Err(super::corrupt(
            "an idempotency key's claim kept changing while it was claimed",
        ))
    }

    /// Gives up this node's claim (the request ended without an answer to
    /// keep); an answer or pending record stored meanwhile stays.
    pub fn idem_release(&self, key_id: &str, idem_key: &str) -> Result<(), ServerError> {
        self.conn()
            .execute(
                "DELETE FROM idempotency WHERE key_id = ?1 AND idem_key = ?2 AND kind = ?3 AND body = ?4",
                params![key_id, idem_key, IN_FLIGHT, self.node()],
            )
            .map(|_| ())
            .map_err(store_err("release idempotency"))
    }

    /// Drops this node's claims: at its start, nothing of it runs.
    pub fn idem_release_all_mine(&self) -> Result<usize, ServerError> {
        self.conn()
            .execute(
                "DELETE FROM idempotency WHERE kind = ?1 AND body = ?2",
                params![IN_FLIGHT, self.node()],
            )
            .map_err(store_err("release idempotency"))
    }

    pub fn idem_purge(&self, older_than_ms: i64) -> Result<usize, ServerError> {
        self.conn()
            .execute(
                "DELETE FROM idempotency WHERE created_ms < ?1",
                params![older_than_ms],
            )
            .map_err(store_err("purge idempotency"))
    }
}

/// Stores (or replaces) one answer on `conn`, which may be a transaction.
pub(super) fn put(
    conn: &Connection,
    key_id: &str,
    idem_key: &str,
    a: &StoredAnswer,
) -> Result<(), ServerError> {
    conn.execute(
        "INSERT INTO idempotency (key_id, idem_key, fingerprint, kind, status, body, created_ms)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)
         ON CONFLICT (key_id, idem_key) DO UPDATE SET fingerprint = excluded.fingerprint,
           kind = excluded.kind, status = excluded.status, body = excluded.body,
           created_ms = excluded.created_ms",
        params![
            key_id,
            idem_key,
            a.fingerprint,
            a.kind,
            a.status,
            a.body,
            a.created_ms
        ],
    )
    .map(|_| ())
    .map_err(store_err("put idempotency"))
}

/// One stored answer (or claim) on `conn`.
fn get(
    conn: &Connection,
    key_id: &str,
    idem_key: &str,
) -> Result<Option<StoredAnswer>, ServerError> {
    conn.query_row(
        "SELECT fingerprint, kind, status, body, created_ms FROM idempotency WHERE key_id = ?1 AND idem_key = ?2",
        params![key_id, idem_key],
        |r| {
            Ok(StoredAnswer {
                fingerprint: r.get(0)?,
                kind: r.get(1)?,
                status: r.get(2)?,
                body: r.get(3)?,
                created_ms: r.get(4)?,
            })
        },
    )
    .optional()
    .map_err(store_err("get idempotency"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::testing::each_location;

    fn answer(fingerprint: &str, created_ms: i64) -> StoredAnswer {
        StoredAnswer {
            fingerprint: fingerprint.into(),
            kind: "json".into(),
            status: 200,
            body: "{\"ok\":true}".into(),
            created_ms,
        }
    }

    #[test]
    fn a_request_claimed_by_one_node_waits_on_another_until_its_answer() {
        each_location(|at| {
            let a = Store::open_at(at).unwrap().on_node("node_a");
            let b = Store::open_at(at).unwrap().on_node("node_b");
            let nobody_gone = |_: &str| false;
            let claim = |s: &Store, fp: &str, now: i64, gone: &dyn Fn(&str) -> bool| {
                s.idem_claim("k1", "req-1", fp, now, 1_000, gone).unwrap()
            };
            assert_eq!(claim(&a, "fp", 100, &nobody_gone), IdemClaim::Run);
            // The same request through the other node: it runs on a.
            assert_eq!(
                claim(&b, "fp", 110, &nobody_gone),
                IdemClaim::InFlight {
                    owner: "node_a".into()
                }
            );
            assert_eq!(claim(&b, "other", 110, &nobody_gone), IdemClaim::Reused);
            // Another key's request of the same name is its own.
            assert_eq!(
                b.idem_claim("k2", "req-1", "fp", 110, 1_000, &nobody_gone)
                    .unwrap(),
                IdemClaim::Run
            );
            // a's answer replaces its claim: b replays it.
            a.idem_put("k1", "req-1", &answer("fp", 150)).unwrap();
            assert_eq!(
                claim(&b, "fp", 160, &nobody_gone),
                IdemClaim::Stored(answer("fp", 150))
            );
            // A release leaves an answer alone.
            a.idem_release("k1", "req-1").unwrap();
            assert!(a.idem_get("k1", "req-1").unwrap().is_some());
            // Past its time to live the answer is anyone's to run again.
            assert_eq!(claim(&b, "new", 2_000, &nobody_gone), IdemClaim::Run);
            assert_eq!(
                claim(&a, "new", 2_001, &nobody_gone),
                IdemClaim::InFlight {
                    owner: "node_b".into()
                }
            );
            // b ends without an answer: its claim goes, a resend runs anew.
            a.idem_release("k1", "req-1").unwrap();
            assert!(
                a.idem_get("k1", "req-1").unwrap().is_some(),
                "not a's to release"
            );
            b.idem_release("k1", "req-1").unwrap();
            assert!(a.idem_get("k1", "req-1").unwrap().is_none());
            assert_eq!(claim(&a, "new", 2_100, &nobody_gone), IdemClaim::Run);
            // a's claim is taken over once a is gone, not before.
            assert_eq!(
                claim(&b, "new", 2_200, &|o: &str| o == "node_b"),
                IdemClaim::InFlight {
                    owner: "node_a".into()
                }
            );
            assert_eq!(
                claim(&b, "new", 2_200, &|o: &str| o == "node_a"),
                IdemClaim::Run
            );
            // At a node's start its own claims go, and only those.
            assert_eq!(
                a.idem_claim("k3", "req-9", "fp", 2_300, 1_000, &nobody_gone)
                    .unwrap(),
                IdemClaim::Run
            );
            assert_eq!(a.idem_release_all_mine().unwrap(), 1);
            assert!(a.idem_get("k3", "req-9").unwrap().is_none());
            assert_eq!(
                a.idem_get("k1", "req-1").unwrap().map(|r| r.body),
                Some("node_b".to_string())
            );
        });
    }
}
