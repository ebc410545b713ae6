//! The `registry_credentials` table: one row per (key, registry), the
//! secret sealed (see `domain::registry`).

use super::db::{params, OptionalExtension};

use super::{corrupt, store_err, Store};
use crate::domain::registry::{Kind, Registry};
use crate::error::ServerError;

const COLUMNS: &str =
    "key_id, registry, kind, username, sealed, secret_bytes, created_ms, updated_ms";

type Raw = (String, String, String, String, String, i64, i64, i64);

fn raw(r: &super::db::Row) -> super::db::DbResult<Raw> {
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

fn parse(
    (key_id, registry, kind, username, sealed, secret_bytes, created_ms, updated_ms): Raw,
) -> Result<Registry, ServerError> {
    Ok(Registry {
        kind: Kind::parse(&kind).ok_or_else(|| corrupt(format!("registry kind {kind}")))?,
        key_id,
        registry,
        username,
        sealed,
        secret_bytes: usize::try_from(secret_bytes).unwrap_or_default(),
        created_ms,
        updated_ms,
    })
}

/// What [`Store::put_registry`] did.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum PutRegistry {
    /// Kept (created, or replaced keeping its creation time): the row as
    /// stored.
    Kept(Registry),
    /// The key already has `max` registries and this is not one of them.
    Full,
}

impl Store {
    /// Creates or replaces `r` (keeping a replaced row's `created_ms`),
    /// unless its key has `max` other registries already; the count and the
    /// write are one transaction.
    pub(crate) fn put_registry(
        &self,
        r: &Registry,
        max: usize,
    ) -> Result<PutRegistry, ServerError> {
        let mut conn = self.conn();
        let tx = conn
            .transaction()
            .map_err(store_err("begin put registry"))?;
        let created: Option<i64> = tx
            .query_row(
                "SELECT created_ms FROM registry_credentials WHERE key_id = ?1 AND registry = ?2",
                params![r.key_id, r.registry],
                |row| row.get(0),
            )
            .optional()
            .map_err(store_err("get registry"))?;
        if created.is_none() {
            let n: i64 = tx
                .query_row(
                    "SELECT COUNT(*) FROM registry_credentials WHERE key_id = ?1",
                    params![r.key_id],
                    |row| row.get(0),
                )
                .map_err(store_err("count registries"))?;
            if usize::try_from(n).unwrap_or(usize::MAX) >= max {
                return Ok(PutRegistry::Full);
            }
        }
        let mut kept = r.clone();
        kept.created_ms = created.unwrap_or(r.created_ms);
        tx.execute(
            &format!(
                "INSERT INTO registry_credentials ({COLUMNS}) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)
                 ON CONFLICT (key_id, registry) DO UPDATE SET kind = excluded.kind,
                 username = excluded.username, sealed = excluded.sealed,
                 secret_bytes = excluded.secret_bytes, updated_ms = excluded.updated_ms"
            ),
            params![
                kept.key_id,
                kept.registry,
                kept.kind.as_str(),
                kept.username,
                kept.sealed,
                i64::try_from(kept.secret_bytes).unwrap_or(i64::MAX),
                kept.created_ms,
                kept.updated_ms
            ],
        )
        .map_err(store_err("put registry"))?;
        tx.commit().map_err(store_err("commit put registry"))?;
        Ok(PutRegistry::Kept(kept))
    }

    pub(crate) fn get_registry(
        &self,
        key_id: &str,
        registry: &str,
    ) -> Result<Option<Registry>, ServerError> {
        let raw = self
            .conn()
            .query_row(
                &format!(
                    "SELECT {COLUMNS} FROM registry_credentials WHERE key_id = ?1 AND registry = ?2"
                ),
                params![key_id, registry],
                raw,
            )
            .optional()
            .map_err(store_err("get registry"))?;
        raw.map(parse).transpose()
    }

    /// Key `key_id`'s registries, by name.
    pub(crate) fn registries(&self, key_id: &str) -> Result<Vec<Registry>, ServerError> {
        let conn = self.conn();
        let mut stmt = conn
            .prepare(&format!(
                "SELECT {COLUMNS} FROM registry_credentials WHERE key_id = ?1 ORDER BY registry"
            ))
            .map_err(store_err("list registries"))?;
        let rows = stmt
            .query_map(params![key_id], raw)
            .map_err(store_err("list registries"))?;
        let mut out = Vec::new();
        for r in rows {
            out.push(parse(r.map_err(store_err("list registries"))?)?);
        }
        Ok(out)
    }

    /// Deletes key `key_id`'s credential for `registry`; whether there was one.
    pub(crate) fn delete_registry(
        &self,
        key_id: &str,
        registry: &str,
    ) -> Result<bool, ServerError> {
        let n = self
            .conn()
            .execute(
                "DELETE FROM registry_credentials WHERE key_id = ?1 AND registry = ?2",
                params![key_id, registry],
            )
            .map_err(store_err("delete registry"))?;
        Ok(n > 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(key: &str, registry: &str, ms: i64) -> Registry {
        Registry {
            key_id: key.into(),
            registry: registry.into(),
            kind: Kind::Password,
            username: "me".into(),
            sealed: "S".into(),
            secret_bytes: 1,
            created_ms: ms,
            updated_ms: ms,
        }
    }

    #[test]
    fn rows_belong_to_a_key_are_counted_and_replaced_in_place() {
        crate::store::testing::each_engine(|store| {
            let ok = |p: Result<PutRegistry, ServerError>| match p {
                Ok(PutRegistry::Kept(r)) => r,
                other => panic!("{other:?}"),
            };
            ok(store.put_registry(&row("a", "ghcr.io", 1), 2));
            ok(store.put_registry(&row("a", "docker.io", 2), 2));
            // Full for a third, but a replacement still goes in, keeping its
            // creation time.
            assert!(matches!(
                store.put_registry(&row("a", "quay.io", 3), 2),
                Ok(PutRegistry::Full)
            ));
            let mut again = row("a", "ghcr.io", 4);
            again.kind = Kind::Ecr;
            let kept = ok(store.put_registry(&again, 2));
            assert_eq!((kept.created_ms, kept.updated_ms), (1, 4));
            assert_eq!(
                store.get_registry("a", "ghcr.io").ok().flatten(),
                Some(kept)
            );
            // Another key's are its own.
            ok(store.put_registry(&row("b", "ghcr.io", 5), 2));
            let names = |k: &str| -> Vec<String> {
                store
                    .registries(k)
                    .unwrap_or_default()
                    .into_iter()
                    .map(|r| r.registry)
                    .collect()
            };
            assert_eq!(names("a"), ["docker.io", "ghcr.io"]);
            assert_eq!(names("b"), ["ghcr.io"]);
            assert!(matches!(store.delete_registry("b", "docker.io"), Ok(false)));
            assert!(matches!(store.delete_registry("b", "ghcr.io"), Ok(true)));
            assert_eq!(names("a").len(), 2);
        });
    }
}
