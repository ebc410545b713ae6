//! What stays a JSON document under (kind, scope, name): previews, network
//! rules, secrets, sandbox CAs (and, until their tables, images and volumes).

use super::db::{params, OptionalExtension};

use super::{corrupt, store_err, Store};
use crate::error::ServerError;

impl Store {
    pub fn doc_put(
        &self,
        kind: &str,
        scope: &str,
        name: &str,
        doc: &serde_json::Value,
    ) -> Result<(), ServerError> {
        self.conn()
            .execute(
                "INSERT INTO net_docs (kind, scope, name, doc) VALUES (?1, ?2, ?3, ?4)
                 ON CONFLICT (kind, scope, name) DO UPDATE SET doc = excluded.doc",
                params![kind, scope, name, doc.to_string()],
            )
            .map_err(store_err("put doc"))?;
        Ok(())
    }

    pub fn doc_get(
        &self,
        kind: &str,
        scope: &str,
        name: &str,
    ) -> Result<Option<serde_json::Value>, ServerError> {
        let text: Option<String> = self
            .conn()
            .query_row(
                "SELECT doc FROM net_docs WHERE kind = ?1 AND scope = ?2 AND name = ?3",
                params![kind, scope, name],
                |r| r.get(0),
            )
            .optional()
            .map_err(store_err("get doc"))?;
        text.map(|t| serde_json::from_str(&t).map_err(|e| corrupt(format!("{kind} doc: {e}"))))
            .transpose()
    }

    /// Every document of a kind in a scope (every scope when `None`), by name.
    pub fn doc_list(
        &self,
        kind: &str,
        scope: Option<&str>,
    ) -> Result<Vec<(String, String, serde_json::Value)>, ServerError> {
        let conn = self.conn();
        let mut stmt = conn
            .prepare(
                "SELECT scope, name, doc FROM net_docs WHERE kind = ?1 AND (CAST(?2 AS TEXT) IS NULL OR scope = ?2)
                 ORDER BY scope, name",
            )
            .map_err(store_err("list docs"))?;
        let rows = stmt
            .query_map(params![kind, scope], |r| {
                Ok((
                    r.get::<_, String>(0)?,
                    r.get::<_, String>(1)?,
                    r.get::<_, String>(2)?,
                ))
            })
            .map_err(store_err("list docs"))?;
        let mut out = Vec::new();
        for r in rows {
            let (scope, name, text) = r.map_err(store_err("list docs"))?;
            let doc =
                serde_json::from_str(&text).map_err(|e| corrupt(format!("{kind} doc: {e}")))?;
            out.push((scope, name, doc));
        }
        Ok(out)
    }

    /// Deletes one document (`Some(name)`) or a scope's of that kind; answers how many went.
    pub fn doc_delete(
        &self,
        kind: &str,
        scope: &str,
        name: Option<&str>,
    ) -> Result<usize, ServerError> {
        self.conn()
            .execute(
                "DELETE FROM net_docs WHERE kind = ?1 AND scope = ?2 AND (CAST(?3 AS TEXT) IS NULL OR name = ?3)",
                params![kind, scope, name],
            )
            .map_err(store_err("delete doc"))
    }
}

#[cfg(test)]
mod tests {
    use rusqlite::{params, Connection};
    use serde_json::json;

    use crate::store::images::tests::v5_database;
    use crate::store::Store;

    #[test]
    fn secrets_kept_before_keys_owned_them_go_to_the_admin_key() {
        let dir = v5_database(&[
            ("secret", "", "OLD", json!({"name": "OLD"})),
            ("preview", "sbx", "3000", json!({"port": 3000})),
        ]);
        {
            let conn = Connection::open(dir.join("runtime.db")).unwrap();
            for (id, ro, wide, at) in [
                ("k-viewer", 1, 1, "2026-01-01"),
                ("k-admin", 0, 1, "2026-01-02"),
                ("k-user", 0, 0, "2026-01-03"),
            ] {
                conn.execute(
                    "INSERT INTO keys (id, name, hash, read_only, account_wide, created_at) VALUES (?1, ?1, ?1, ?2, ?3, ?4)",
                    params![id, ro, wide, at],
                )
                .unwrap();
            }
        }
        let store = Store::open(&dir).unwrap();
        assert!(store.doc_get("secret", "", "OLD").unwrap().is_none());
        assert_eq!(
            store.doc_get("secret", "k-admin", "OLD").unwrap(),
            Some(json!({"name": "OLD"}))
        );
        assert!(store.doc_get("preview", "sbx", "3000").unwrap().is_some());
        drop(store);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
