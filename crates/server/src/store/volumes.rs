//! The `volumes` table (`UNIQUE(key_id, name)`: a name is one key's) and
//! `volume_attachments`, the volumes each sandbox's create named, in order.

use super::db::{params, Connection, OptionalExtension};

use super::{corrupt, store_err, Store};
use crate::domain::volume::{
    AttachMode, Attachment, BackupPolicy, BackupState, ShareState, SharedAttachment, Volume,
    VolumeBackup,
};
use crate::error::ServerError;

const COLUMNS: &str = "id, key_id, name, labels, size_mib, created_at, created_ms, restored_from, \
                       backup_policy, shared";

fn insert_row(conn: &Connection, v: &Volume) -> Result<(), ServerError> {
    let labels = serde_json::to_string(&v.labels).map_err(|e| corrupt(e.to_string()))?;
    conn.execute(
        &format!(
            "INSERT INTO volumes ({COLUMNS}) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10)"
        ),
        params![
            v.id,
            v.key_id,
            v.name,
            labels,
            v.size_mib,
            v.created_at,
            v.created_ms,
            v.restored_from,
            policy_text(v.backup_policy)?,
            v.shared
        ],
    )
    .map(|_| ())
    .map_err(store_err("insert volume"))
}

/// A volume as the v6 table held it (the migration runs before v14 adds
/// `restored_from`).
fn insert_v6_row(conn: &Connection, v: &Volume) -> Result<(), ServerError> {
    let labels = serde_json::to_string(&v.labels).map_err(|e| corrupt(e.to_string()))?;
    conn.execute(
        "INSERT INTO volumes (id, key_id, name, labels, size_mib, created_at, created_ms) \
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
        params![
            v.id,
            v.key_id,
            v.name,
            labels,
            v.size_mib,
            v.created_at,
            v.created_ms
        ],
    )
    .map(|_| ())
    .map_err(store_err("insert volume"))
}

type RawVolume = (
    String,
    String,
    Option<String>,
    String,
    u32,
    String,
    i64,
    Option<String>,
    Option<String>,
    bool,
);

fn policy_text(p: Option<BackupPolicy>) -> Result<Option<String>, ServerError> {
    p.map(|p| serde_json::to_string(&p).map_err(|e| corrupt(e.to_string())))
        .transpose()
}

fn raw(r: &super::db::Row) -> super::db::DbResult<RawVolume> {
    Ok((
        r.get(0)?,
        r.get(1)?,
        r.get(2)?,
        r.get(3)?,
        r.get(4)?,
        r.get(5)?,
        r.get(6)?,
        r.get(7)?,
        r.get(8)?,
        r.get(9)?,
    ))
}

fn parse(
    (id, key_id, name, labels, size_mib, created_at, created_ms, restored_from, policy, shared): RawVolume,
) -> Result<Volume, ServerError> {
    let labels =
        serde_json::from_str(&labels).map_err(|e| corrupt(format!("volume labels: {e}")))?;
    let backup_policy = policy
        .map(|p| serde_json::from_str(&p))
        .transpose()
        .map_err(|e| corrupt(format!("volume backup policy: {e}")))?;
    Ok(Volume {
        id,
        key_id,
        name,
        labels,
        size_mib,
        created_at,
        created_ms,
        restored_from,
        backup_policy,
        shared,
    })
}

const BACKUP_COLUMNS: &str = "id, key_id, volume_id, name, state, size_mib, stored_bytes, \
                              sha256, retention_days, created_ms, expires_ms";

type RawBackup = (
    String,
    String,
    String,
    Option<String>,
    String,
    u32,
    i64,
    String,
    u32,
    i64,
    i64,
);

fn raw_backup(r: &super::db::Row) -> super::db::DbResult<RawBackup> {
    Ok((
        r.get(0)?,
        r.get(1)?,
        r.get(2)?,
        r.get(3)?,
        r.get(4)?,
        r.get(5)?,
        r.get(6)?,
        r.get(7)?,
        r.get(8)?,
        r.get(9)?,
        r.get(10)?,
    ))
}

fn parse_backup(
    (
        id,
        key_id,
        volume_id,
        name,
        state,
        size_mib,
        stored_bytes,
        sha256,
        retention_days,
        created_ms,
        expires_ms,
    ): RawBackup,
) -> Result<VolumeBackup, ServerError> {
    let state = BackupState::parse(&state)
        .ok_or_else(|| corrupt(format!("volume backup state {state}")))?;
    Ok(VolumeBackup {
        id,
        key_id,
        volume_id,
        name,
        state,
        size_mib,
        stored_bytes: stored_bytes.max(0) as u64,
        sha256,
        retention_days,
        created_ms,
        expires_ms,
    })
}

fn insert_attachments(
    conn: &Connection,
    sandbox_id: &str,
    list: &[Attachment],
) -> Result<(), ServerError> {
    for (i, a) in list.iter().enumerate() {
        conn.execute(
            "INSERT INTO volume_attachments (sandbox_id, position, volume_id, path, mode) \
             VALUES (?1, ?2, ?3, ?4, ?5)",
            params![sandbox_id, i as i64, a.volume_id, a.path, a.mode.as_str()],
        )
        .map_err(store_err("insert volume attachment"))?;
    }
    Ok(())
}

fn attachment(volume_id: String, path: String, mode: &str) -> Result<Attachment, ServerError> {
    let mode =
        AttachMode::parse(mode).ok_or_else(|| corrupt(format!("volume attachment mode {mode}")))?;
    Ok(Attachment {
        volume_id,
        path,
        mode,
    })
}

impl Store {
    /// Inserts a volume; `UNIQUE(key_id, name)` refuses a second of one
    /// key's names.
    pub(crate) fn insert_volume(&self, v: &Volume) -> Result<(), ServerError> {
        insert_row(&self.conn(), v)
    }

    pub(crate) fn get_volume(&self, id: &str) -> Result<Option<Volume>, ServerError> {
        let raw = self
            .conn()
            .query_row(
                &format!("SELECT {COLUMNS} FROM volumes WHERE id = ?1"),
                params![id],
                raw,
            )
            .optional()
            .map_err(store_err("get volume"))?;
        raw.map(parse).transpose()
    }

    /// Every volume, newest first.
    pub(crate) fn volumes(&self) -> Result<Vec<Volume>, ServerError> {
        let conn = self.conn();
        let mut stmt = conn
            .prepare(&format!(
                "SELECT {COLUMNS} FROM volumes ORDER BY created_ms DESC, id DESC"
            ))
            .map_err(store_err("list volumes"))?;
        let rows = stmt.query_map([], raw).map_err(store_err("list volumes"))?;
        let mut out = Vec::new();
        for r in rows {
            out.push(parse(r.map_err(store_err("list volumes"))?)?);
        }
        Ok(out)
    }

    /// Sets a volume's size (a resize).
    pub(crate) fn set_volume_size(&self, id: &str, size_mib: u32) -> Result<bool, ServerError> {
        self.conn()
            .execute(
                "UPDATE volumes SET size_mib = ?2 WHERE id = ?1",
                params![id, size_mib],
            )
            .map(|n| n > 0)
            .map_err(store_err("resize volume"))
    }

    /// Sets a volume's backup policy.
    pub(crate) fn set_backup_policy(
        &self,
        id: &str,
        policy: BackupPolicy,
    ) -> Result<bool, ServerError> {
        self.conn()
            .execute(
                "UPDATE volumes SET backup_policy = ?2 WHERE id = ?1",
                params![id, policy_text(Some(policy))?],
            )
            .map(|n| n > 0)
            .map_err(store_err("set volume backup policy"))
    }

    /// Inserts a backup (pending while its copy is made).
    pub(crate) fn insert_backup(&self, b: &VolumeBackup) -> Result<(), ServerError> {
        self.conn()
            .execute(
                &format!(
                    "INSERT INTO volume_backups ({BACKUP_COLUMNS}) \
                     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11)"
                ),
                params![
                    b.id,
                    b.key_id,
                    b.volume_id,
                    b.name,
                    b.state.as_str(),
                    b.size_mib,
                    b.stored_bytes as i64,
                    b.sha256,
                    b.retention_days,
                    b.created_ms,
                    b.expires_ms
                ],
            )
            .map(|_| ())
            .map_err(store_err("insert volume backup"))
    }

    /// Marks a pending backup ready, with its copy's checksum and size.
    pub(crate) fn backup_ready(
        &self,
        id: &str,
        sha256: &str,
        stored_bytes: u64,
    ) -> Result<bool, ServerError> {
        self.conn()
            .execute(
                "UPDATE volume_backups SET state = 'ready', sha256 = ?2, stored_bytes = ?3 \
                 WHERE id = ?1 AND state = 'pending'",
                params![id, sha256, stored_bytes as i64],
            )
            .map(|n| n > 0)
            .map_err(store_err("finish volume backup"))
    }

    pub(crate) fn get_backup(&self, id: &str) -> Result<Option<VolumeBackup>, ServerError> {
        let raw = self
            .conn()
            .query_row(
                &format!("SELECT {BACKUP_COLUMNS} FROM volume_backups WHERE id = ?1"),
                params![id],
                raw_backup,
            )
            .optional()
            .map_err(store_err("get volume backup"))?;
        raw.map(parse_backup).transpose()
    }

    /// Every backup, newest first.
    pub(crate) fn backups(&self) -> Result<Vec<VolumeBackup>, ServerError> {
        let conn = self.conn();
        let mut stmt = conn
            .prepare(&format!(
                "SELECT {BACKUP_COLUMNS} FROM volume_backups ORDER BY created_ms DESC, id DESC"
            ))
            .map_err(store_err("list volume backups"))?;
        let rows = stmt
            .query_map([], raw_backup)
            .map_err(store_err("list volume backups"))?;
        let mut out = Vec::new();
        for r in rows {
            out.push(parse_backup(r.map_err(store_err("list volume backups"))?)?);
        }
        Ok(out)
    }

    /// Deletes a backup's record; answers whether it was there.
    pub(crate) fn delete_backup(&self, id: &str) -> Result<bool, ServerError> {
        self.conn()
            .execute("DELETE FROM volume_backups WHERE id = ?1", params![id])
            .map(|n| n > 0)
            .map_err(store_err("delete volume backup"))
    }

    /// Deletes a volume's record; answers whether it was there.
    pub(crate) fn delete_volume(&self, id: &str) -> Result<bool, ServerError> {
        self.conn()
            .execute("DELETE FROM volumes WHERE id = ?1", params![id])
            .map(|n| n > 0)
            .map_err(store_err("delete volume"))
    }

    /// Keeps the volumes a sandbox attaches, in the order of its create
    /// (replacing any it had).
    pub(crate) fn set_attachments(
        &self,
        sandbox_id: &str,
        list: &[Attachment],
    ) -> Result<(), ServerError> {
        let mut conn = self.conn();
        let tx = conn.transaction().map_err(store_err("begin"))?;
        tx.execute(
            "DELETE FROM volume_attachments WHERE sandbox_id = ?1",
            params![sandbox_id],
        )
        .map_err(store_err("set volume attachments"))?;
        insert_attachments(&tx, sandbox_id, list)?;
        tx.commit().map_err(store_err("commit"))
    }

    /// The volumes a sandbox attaches, in the order of its create.
    pub(crate) fn attachments_of(&self, sandbox_id: &str) -> Result<Vec<Attachment>, ServerError> {
        Ok(self
            .all_attachments(Some(sandbox_id))?
            .into_iter()
            .flat_map(|(_, list)| list)
            .collect())
    }

    /// Every sandbox's attachments (one sandbox's with `Some`), by sandbox id.
    pub(crate) fn all_attachments(
        &self,
        sandbox_id: Option<&str>,
    ) -> Result<Vec<(String, Vec<Attachment>)>, ServerError> {
        let conn = self.conn();
        let mut stmt = conn
            .prepare(
                "SELECT sandbox_id, volume_id, path, mode FROM volume_attachments \
                 WHERE CAST(?1 AS TEXT) IS NULL OR sandbox_id = ?1 ORDER BY sandbox_id, position",
            )
            .map_err(store_err("list volume attachments"))?;
        let rows = stmt
            .query_map(params![sandbox_id], |r| {
                Ok((
                    r.get::<_, String>(0)?,
                    r.get::<_, String>(1)?,
                    r.get::<_, String>(2)?,
                    r.get::<_, String>(3)?,
                ))
            })
            .map_err(store_err("list volume attachments"))?;
        let mut out: Vec<(String, Vec<Attachment>)> = Vec::new();
        for r in rows {
            let (sandbox, volume_id, path, mode) =
                r.map_err(store_err("list volume attachments"))?;
            let a = attachment(volume_id, path, &mode)?;
            match out.last_mut() {
                Some((s, list)) if *s == sandbox => list.push(a),
                _ => out.push((sandbox, vec![a])),
            }
        }
        Ok(out)
    }

    /// Forgets a sandbox's attachments; answers how many went.
    pub(crate) fn drop_attachments(&self, sandbox_id: &str) -> Result<usize, ServerError> {
        self.conn()
            .execute(
                "DELETE FROM volume_attachments WHERE sandbox_id = ?1",
                params![sandbox_id],
            )
            .map_err(store_err("drop volume attachments"))
    }
}

/// Part of the v6 migration: moves the volume documents of `net_docs` (kind
/// `volume`) into `volumes`, and each sandbox's `sandbox_volumes` into
/// `volume_attachments`. A document that does not read as one stays where
/// it is (it was never listed).
pub(super) fn move_docs(tx: &Connection) -> Result<(), ServerError> {
    for (scope, name, text) in docs(tx, "volume")? {
        if scope != "volumes" {
            continue;
        }
        let v = match serde_json::from_str::<Volume>(&text) {
            Ok(v) => v,
            Err(e) => {
                tracing::warn!(volume_id = %name, error = %e, "a volume document is not a volume record; left in net_docs");
                continue;
            }
        };
        match insert_v6_row(tx, &v) {
            Ok(()) => {}
            // Not made by a server (creates checked names under a lock).
            Err(ServerError::Store { source, .. }) if source.is_constraint() => {
                tracing::warn!(volume_id = %name, "a volume's name is another's of its key; left in net_docs");
                continue;
            }
            Err(e) => return Err(e),
        }
        forget(tx, "volume", &scope, &name)?;
    }
    for (sandbox_id, name, text) in docs(tx, "sandbox_volumes")? {
        match serde_json::from_str::<Vec<Attachment>>(&text) {
            Ok(list) => insert_attachments(tx, &sandbox_id, &list)?,
            Err(e) => {
                tracing::warn!(sandbox_id = %sandbox_id, error = %e, "a sandbox's volume list does not read; left in net_docs");
                continue;
            }
        }
        forget(tx, "sandbox_volumes", &sandbox_id, &name)?;
    }
    Ok(())
}

fn docs(tx: &Connection, kind: &str) -> Result<Vec<(String, String, String)>, ServerError> {
    let mut stmt = tx
        .prepare("SELECT scope, name, doc FROM net_docs WHERE kind = ?1 ORDER BY scope, name")
        .map_err(store_err("migrate volumes"))?;
    let rows = stmt
        .query_map(params![kind], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
        .map_err(store_err("migrate volumes"))?;
    rows.collect::<Result<_, _>>()
        .map_err(store_err("migrate volumes"))
}

fn forget(tx: &Connection, kind: &str, scope: &str, name: &str) -> Result<(), ServerError> {
    tx.execute(
        "DELETE FROM net_docs WHERE kind = ?1 AND scope = ?2 AND name = ?3",
        params![kind, scope, name],
    )
    .map(|_| ())
    .map_err(store_err("migrate volumes"))
}

const SHARE_COLUMNS: &str =
    "id, key_id, volume_id, sandbox_id, path, state, created_ms, detached_ms";

type RawShare = (
    String,
    String,
    String,
    String,
    String,
    String,
    i64,
    Option<i64>,
);

fn raw_share(r: &super::db::Row) -> super::db::DbResult<RawShare> {
    Ok((
        r.get(0)?,
        r.get(1)?,
        r.get(2)?,
        r.get(3)?,
        r.get(4)?,
        r.get(5)?,
        r.get(6)?,
        r.get(7)?,
    ))
}

fn parse_share(
    (id, key_id, volume_id, sandbox_id, path, state, created_ms, detached_ms): RawShare,
) -> Result<SharedAttachment, ServerError> {
    let state = ShareState::parse(&state)
        .ok_or_else(|| corrupt(format!("shared attachment state {state}")))?;
    Ok(SharedAttachment {
        id,
        key_id,
        volume_id,
        sandbox_id,
        path,
        state,
        created_ms,
        detached_ms,
    })
}

impl Store {
    pub(crate) fn insert_share(&self, a: &SharedAttachment) -> Result<(), ServerError> {
        self.conn()
            .execute(
                &format!(
                    "INSERT INTO shared_attachments ({SHARE_COLUMNS}) \
                     VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)"
                ),
                params![
                    a.id,
                    a.key_id,
                    a.volume_id,
                    a.sandbox_id,
                    a.path,
                    a.state.as_str(),
                    a.created_ms,
                    a.detached_ms
                ],
            )
            .map(|_| ())
            .map_err(store_err("insert shared attachment"))
    }

    /// Moves an attachment from `from` to `to` (`detached_ms` set with
    /// `Detached`); false when it was not in `from`.
    pub(crate) fn set_share_state(
        &self,
        id: &str,
        from: &[ShareState],
        to: ShareState,
        now_ms: i64,
    ) -> Result<bool, ServerError> {
        let conn = self.conn();
        let current: Option<String> = conn
            .query_row(
                "SELECT state FROM shared_attachments WHERE id = ?1",
                params![id],
                |r| r.get(0),
            )
            .optional()
            .map_err(store_err("get shared attachment"))?;
        let Some(current) = current.and_then(|c| ShareState::parse(&c)) else {
            return Ok(false);
        };
        if !from.contains(&current) {
            return Ok(false);
        }
        let detached = (to == ShareState::Detached).then_some(now_ms);
        conn.execute(
            "UPDATE shared_attachments SET state = ?2, detached_ms = COALESCE(?3, detached_ms) \
             WHERE id = ?1",
            params![id, to.as_str(), detached],
        )
        .map(|n| n > 0)
        .map_err(store_err("set shared attachment state"))
    }

    pub(crate) fn get_share(&self, id: &str) -> Result<Option<SharedAttachment>, ServerError> {
        let raw = self
            .conn()
            .query_row(
                &format!("SELECT {SHARE_COLUMNS} FROM shared_attachments WHERE id = ?1"),
                params![id],
                raw_share,
            )
            .optional()
            .map_err(store_err("get shared attachment"))?;
        raw.map(parse_share).transpose()
    }

    fn shares_where(&self, clause: &str, arg: &str) -> Result<Vec<SharedAttachment>, ServerError> {
        let conn = self.conn();
        let mut stmt = conn
            .prepare(&format!(
                "SELECT {SHARE_COLUMNS} FROM shared_attachments WHERE {clause} \
                 ORDER BY created_ms, id"
            ))
            .map_err(store_err("list shared attachments"))?;
        let rows = stmt
            .query_map(params![arg], raw_share)
            .map_err(store_err("list shared attachments"))?;
        let mut out = Vec::new();
        for r in rows {
            out.push(parse_share(
                r.map_err(store_err("list shared attachments"))?,
            )?);
        }
        Ok(out)
    }

    /// A volume's attachments, oldest first (ended ones too).
    pub(crate) fn shares_of_volume(
        &self,
        volume_id: &str,
    ) -> Result<Vec<SharedAttachment>, ServerError> {
        self.shares_where("volume_id = ?1", volume_id)
    }

    /// A sandbox's attachments of shared volumes, oldest first.
    pub(crate) fn shares_of_sandbox(
        &self,
        sandbox_id: &str,
    ) -> Result<Vec<SharedAttachment>, ServerError> {
        self.shares_where("sandbox_id = ?1", sandbox_id)
    }

    /// Every attachment not detached.
    pub(crate) fn live_shares(&self) -> Result<Vec<SharedAttachment>, ServerError> {
        self.shares_where("state != ?1", "detached")
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::store::images::tests::v5_database;

    fn volume(id: &str, key: &str, name: Option<&str>, created_ms: i64) -> Volume {
        Volume {
            id: id.into(),
            key_id: key.into(),
            name: name.map(str::to_string),
            labels: [("team".to_string(), "a".to_string())]
                .into_iter()
                .collect(),
            size_mib: 64,
            created_at: "2024-01-01T00:00:00.000Z".into(),
            created_ms,
            restored_from: None,
            backup_policy: None,
            shared: false,
        }
    }

    #[test]
    fn a_v5_database_opens_as_v6_with_every_volume_and_attachment() {
        let old = |v: &Volume| serde_json::to_value(v).unwrap();
        let (a, b) = (
            volume("va", "k1", Some("data"), 1),
            volume("vb", "k2", None, 2),
        );
        let dir = v5_database(&[
            ("volume", "volumes", "va", old(&a)),
            ("volume", "volumes", "vb", old(&b)),
            ("volume", "volumes", "junk", json!([])),
            (
                "sandbox_volumes",
                "s1",
                "",
                json!([{"volumeId": "va", "path": "/data", "mode": "rw"},
                       {"volumeId": "vb", "path": "/view", "mode": "snapshot"}]),
            ),
            (
                "sandbox_volumes",
                "s2",
                "",
                json!([{"volumeId": "vb", "path": "/x", "mode": "rw"}]),
            ),
            ("sandbox-net", "s1", "", json!({"rules": null})),
        ]);
        // The v5 document says sizeMiB, as the answer does.
        assert_eq!(old(&a)["sizeMiB"], 64);
        let store = Store::open(&dir).unwrap();
        assert_eq!(store.volumes().unwrap(), [b.clone(), a.clone()]);
        assert_eq!(store.get_volume("va").unwrap(), Some(a));
        let s1 = vec![
            Attachment {
                volume_id: "va".into(),
                path: "/data".into(),
                mode: AttachMode::Rw,
            },
            Attachment {
                volume_id: "vb".into(),
                path: "/view".into(),
                mode: AttachMode::Snapshot,
            },
        ];
        assert_eq!(store.attachments_of("s1").unwrap(), s1);
        let all = store.all_attachments(None).unwrap();
        assert_eq!(
            all.iter()
                .map(|(s, l)| (s.as_str(), l.len()))
                .collect::<Vec<_>>(),
            [("s1", 2), ("s2", 1)]
        );
        let kinds: Vec<(String, String)> = {
            let conn = store.conn();
            let mut stmt = conn
                .prepare("SELECT kind, name FROM net_docs ORDER BY kind")
                .unwrap();
            let rows = stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?))).unwrap();
            rows.map(Result::unwrap).collect()
        };
        assert_eq!(
            kinds,
            [
                ("sandbox-net".to_string(), String::new()),
                ("volume".into(), "junk".into())
            ]
        );
        drop(store);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn names_are_unique_per_key_and_attachments_keep_their_order() {
        crate::store::testing::each_engine(|store| {
            store
                .insert_volume(&volume("v1", "k1", Some("data"), 1))
                .unwrap();
            assert!(store
                .insert_volume(&volume("v2", "k1", Some("data"), 2))
                .is_err());
            store
                .insert_volume(&volume("v3", "k2", Some("data"), 3))
                .unwrap();
            store.insert_volume(&volume("v4", "k1", None, 4)).unwrap();
            store.insert_volume(&volume("v5", "k1", None, 5)).unwrap();
            assert_eq!(store.volumes().unwrap().len(), 4);
            let list: Vec<Attachment> = ["/b", "/a", "/c"]
                .iter()
                .map(|p| Attachment {
                    volume_id: "v1".into(),
                    path: p.to_string(),
                    mode: AttachMode::Rw,
                })
                .collect();
            store.set_attachments("s", &list).unwrap();
            assert_eq!(store.attachments_of("s").unwrap(), list);
            store.set_attachments("s", &list[..1]).unwrap();
            assert_eq!(store.attachments_of("s").unwrap(), list[..1]);
            assert_eq!(store.drop_attachments("s").unwrap(), 1);
            assert!(store.attachments_of("s").unwrap().is_empty());
            assert!(store.delete_volume("v1").unwrap());
            assert!(!store.delete_volume("v1").unwrap());
            assert_eq!(store.get_volume("v1").unwrap(), None);
        });
    }

    #[test]
    fn a_shared_attachment_moves_only_from_the_states_named() {
        crate::store::testing::each_engine(|store| {
            let a = SharedAttachment {
                id: "va-1".into(),
                key_id: "k".into(),
                volume_id: "v".into(),
                sandbox_id: "s".into(),
                path: "/mnt/v".into(),
                state: ShareState::Attaching,
                created_ms: 5,
                detached_ms: None,
            };
            store.insert_share(&a).unwrap();
            let to = |from: &[ShareState], to| store.set_share_state("va-1", from, to, 9).unwrap();
            assert!(!to(&[ShareState::Attached], ShareState::Detaching));
            assert!(to(&[ShareState::Attaching], ShareState::Attached));
            assert_eq!(store.live_shares().unwrap().len(), 1);
            assert!(to(&[ShareState::Attached], ShareState::Detached));
            let got = store.get_share("va-1").unwrap().unwrap();
            assert_eq!(
                (got.state, got.detached_ms),
                (ShareState::Detached, Some(9))
            );
            assert!(store.live_shares().unwrap().is_empty());
            assert_eq!(store.shares_of_volume("v").unwrap().len(), 1);
            assert_eq!(store.shares_of_sandbox("s").unwrap()[0].path, "/mnt/v");
            assert!(!store
                .set_share_state("va-2", &[ShareState::Attached], ShareState::Detached, 1)
                .unwrap());
        });
    }
}
