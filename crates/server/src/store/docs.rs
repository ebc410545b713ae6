//! What stays a JSON document under (kind, scope, name): previews, network
//! rules, secrets, sandbox CAs (and, until their tables, images and volumes).

use rusqlite::{params, OptionalExtension};

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
                "SELECT scope, name, doc FROM net_docs WHERE kind = ?1 AND (?2 IS NULL OR scope = ?2)
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
                "DELETE FROM net_docs WHERE kind = ?1 AND scope = ?2 AND (?3 IS NULL OR name = ?3)",
                params![kind, scope, name],
            )
            .map_err(store_err("delete doc"))
    }
}
