//! The `images` table: one row per image, its record as JSON beside the
//! columns it is found and constrained by (`UNIQUE(key_id, name, version)` since v7), and
//! `image_logs`, a build's log one line a row.

use super::db::{params, Connection, OptionalExtension};

use super::{corrupt, store_err, Store};
use crate::domain::image::{Image, LogLine, LogStream};
use crate::error::ServerError;

const COLUMNS: &str = "id, key_id, name, version, state, created_ms, record";

fn insert_row(conn: &Connection, img: &Image) -> Result<(), ServerError> {
    let record = serde_json::to_string(img).map_err(|e| corrupt(e.to_string()))?;
    conn.execute(
        &format!("INSERT INTO images ({COLUMNS}) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)"),
        params![
            img.id,
            img.key_id,
            img.name,
            img.version,
            img.state.as_str(),
            img.created_ms,
            record
        ],
    )
    .map(|_| ())
    .map_err(store_err("insert image"))
}

fn parse(record: &str) -> Result<Image, ServerError> {
    serde_json::from_str(record).map_err(|e| corrupt(format!("image record: {e}")))
}

fn get_row(conn: &Connection, id: &str) -> Result<Option<Image>, ServerError> {
    let record: Option<String> = conn
        .query_row(
            "SELECT record FROM images WHERE id = ?1",
            params![id],
            |r| r.get(0),
        )
        .optional()
        .map_err(store_err("get image"))?;
    record.as_deref().map(parse).transpose()
}

fn stream_of(s: &str) -> Result<LogStream, ServerError> {
    match s {
        "system" => Ok(LogStream::System),
        "output" => Ok(LogStream::Output),
        other => Err(corrupt(format!("image log stream {other}"))),
    }
}

fn stream_name(s: LogStream) -> &'static str {
    match s {
        LogStream::System => "system",
        LogStream::Output => "output",
    }
}

fn insert_log_line(conn: &Connection, image_id: &str, l: &LogLine) -> Result<(), ServerError> {
    conn.execute(
        "INSERT INTO image_logs (image_id, seq, step, stream, text) VALUES (?1, ?2, ?3, ?4, ?5)",
        params![
            image_id,
            l.seq as i64,
            l.step.map(|s| s as i64),
            stream_name(l.stream),
            l.text
        ],
    )
    .map(|_| ())
    .map_err(store_err("insert image log"))
}

impl Store {
    /// Inserts a new image. Its version is the next of its name (1 for an
    /// unnamed image), assigned inside the insert's transaction, and
    /// `UNIQUE(key_id, name, version)` refuses a duplicate.
    pub(crate) fn insert_image(&self, img: &mut Image) -> Result<(), ServerError> {
        let mut conn = self.conn();
        let tx = conn.transaction().map_err(store_err("begin"))?;
        img.version = match &img.name {
            Some(n) => tx
                .query_row(
                    "SELECT COALESCE(MAX(version), 0) + 1 FROM images WHERE key_id = ?1 AND name = ?2",
                    params![img.key_id, n],
                    |r| r.get(0),
                )
                .map_err(store_err("next image version"))?,
            None => 1,
        };
        insert_row(&tx, img)?;
        // Its layers are made and kept on this node (v19).
        tx.execute(
            "UPDATE images SET node = ?1 WHERE id = ?2",
            params![self.node, img.id],
        )
        .map_err(store_err("insert image"))?;
        tx.commit().map_err(store_err("commit"))
    }

    /// The node whose data directory holds image `id`'s layers.
    pub(crate) fn image_node(&self, id: &str) -> Result<Option<String>, ServerError> {
        self.conn()
            .query_row("SELECT node FROM images WHERE id = ?1", params![id], |r| {
                r.get(0)
            })
            .optional()
            .map_err(store_err("image node"))
    }

    pub(crate) fn get_image(&self, id: &str) -> Result<Option<Image>, ServerError> {
        get_row(&self.conn(), id)
    }

    /// Every image, newest first.
    pub(crate) fn images(&self) -> Result<Vec<Image>, ServerError> {
        let conn = self.conn();
        let mut stmt = conn
            .prepare("SELECT record FROM images ORDER BY created_ms DESC, id DESC")
            .map_err(store_err("list images"))?;
        let rows = stmt
            .query_map([], |r| r.get::<_, String>(0))
            .map_err(store_err("list images"))?;
        let mut out = Vec::new();
        for r in rows {
            out.push(parse(&r.map_err(store_err("list images"))?)?);
        }
        Ok(out)
    }

    /// Read-modify-write of one image in a transaction. `f` returns whether
    /// to write; the image as it is afterwards is returned (`None`: there is
    /// no such image). Its id, name and version stay as they were.
    pub(crate) fn update_image(
        &self,
        id: &str,
        f: impl FnOnce(&mut Image) -> bool,
    ) -> Result<Option<Image>, ServerError> {
        let mut conn = self.conn();
        let tx = conn.transaction().map_err(store_err("begin"))?;
        let Some(mut img) = get_row(&tx, id)? else {
            return Ok(None);
        };
        let (name, version) = (img.name.clone(), img.version);
        if f(&mut img) {
            img.id = id.to_string();
            img.name = name;
            img.version = version;
            let record = serde_json::to_string(&img).map_err(|e| corrupt(e.to_string()))?;
            tx.execute(
                "UPDATE images SET state = ?2, record = ?3 WHERE id = ?1",
                params![id, img.state.as_str(), record],
            )
            .map_err(store_err("update image"))?;
        }
        tx.commit().map_err(store_err("commit"))?;
        Ok(Some(img))
    }

    /// Deletes an image and its log; answers whether it was there.
    pub(crate) fn delete_image(&self, id: &str) -> Result<bool, ServerError> {
        let mut conn = self.conn();
        let tx = conn.transaction().map_err(store_err("begin"))?;
        tx.execute("DELETE FROM image_logs WHERE image_id = ?1", params![id])
            .map_err(store_err("delete image log"))?;
        let n = tx
            .execute("DELETE FROM images WHERE id = ?1", params![id])
            .map_err(store_err("delete image"))?;
        tx.commit().map_err(store_err("commit"))?;
        Ok(n > 0)
    }

    /// An image's log, oldest line first.
    pub(crate) fn image_log(&self, id: &str) -> Result<Vec<LogLine>, ServerError> {
        self.image_log_after(id, 0, usize::MAX)
    }

    /// At most `limit` lines of an image's log after sequence number `after`,
    /// oldest first.
    pub(crate) fn image_log_after(
        &self,
        id: &str,
        after: u64,
        limit: usize,
    ) -> Result<Vec<LogLine>, ServerError> {
        let conn = self.conn();
        let mut stmt = conn
            .prepare(
                "SELECT seq, step, stream, text FROM image_logs WHERE image_id = ?1 AND seq > ?2 \
                 ORDER BY seq LIMIT ?3",
            )
            .map_err(store_err("read image log"))?;
        let after = i64::try_from(after).unwrap_or(i64::MAX);
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let rows = stmt
            .query_map(params![id, after, limit], |r| {
                Ok((
                    r.get::<_, i64>(0)?,
                    r.get::<_, Option<i64>>(1)?,
                    r.get::<_, String>(2)?,
                    r.get::<_, String>(3)?,
                ))
            })
            .map_err(store_err("read image log"))?;
        let mut out = Vec::new();
        for r in rows {
            let (seq, step, stream, text) = r.map_err(store_err("read image log"))?;
            out.push(LogLine {
                seq: seq.max(0) as u64,
                step: step.map(|s| s.max(0) as usize),
                stream: stream_of(&stream)?,
                text,
            });
        }
        Ok(out)
    }

    /// Appends `lines` to an image's log, each with the next sequence
    /// number, while it has fewer than `max_lines` (the rest are dropped).
    /// Nothing is written for an image that is not there.
    pub(crate) fn append_image_log(
        &self,
        id: &str,
        step: Option<usize>,
        stream: LogStream,
        lines: &[&str],
        max_lines: usize,
    ) -> Result<(), ServerError> {
        let mut conn = self.conn();
        let tx = conn.transaction().map_err(store_err("begin"))?;
        let exists: Option<i64> = tx
            .query_row("SELECT 1 FROM images WHERE id = ?1", params![id], |r| {
                r.get(0)
            })
            .optional()
            .map_err(store_err("append image log"))?;
        if exists.is_none() {
            return Ok(());
        }
        let (count, last): (i64, Option<i64>) = tx
            .query_row(
                "SELECT COUNT(*), MAX(seq) FROM image_logs WHERE image_id = ?1",
                params![id],
                |r| Ok((r.get(0)?, r.get(1)?)),
            )
            .map_err(store_err("append image log"))?;
        let room = max_lines.saturating_sub(count.max(0) as usize);
        let first = last.unwrap_or(0).max(0) as u64 + 1;
        for (seq, text) in (first..).zip(lines.iter().take(room)) {
            let line = LogLine {
                seq,
                step,
                stream,
                text: (*text).to_string(),
            };
            insert_log_line(&tx, id, &line)?;
        }
        tx.commit().map_err(store_err("commit"))
    }
}

/// Part of the v6 migration: moves the image documents of `net_docs` (kind
/// `image`) into `images` and `image_logs`. A document that is not an image
/// record stays where it is (it was never listed). Two documents of one
/// name and version (created at once before the table's constraint) keep
/// the newest at that version, which is the one `name@version` found, and
/// give the others the next versions of the name.
pub(super) fn move_docs(tx: &Connection) -> Result<(), ServerError> {
    let mut docs: Vec<(String, Image, Vec<LogLine>)> = Vec::new();
    {
        let mut stmt = tx
            .prepare("SELECT name, doc FROM net_docs WHERE kind = 'image' AND scope = 'images'")
            .map_err(store_err("migrate images"))?;
        let rows = stmt
            .query_map([], |r| Ok((r.get::<_, String>(0)?, r.get::<_, String>(1)?)))
            .map_err(store_err("migrate images"))?;
        for r in rows {
            let (name, text) = r.map_err(store_err("migrate images"))?;
            let mut doc: serde_json::Value = match serde_json::from_str(&text) {
                Ok(d) => d,
                Err(e) => {
                    tracing::warn!(image_id = %name, error = %e, "an image document is not JSON; left in net_docs");
                    continue;
                }
            };
            let log = doc
                .as_object_mut()
                .and_then(|m| m.remove("log"))
                .unwrap_or_else(|| serde_json::Value::Array(Vec::new()));
            let log: Vec<LogLine> = match serde_json::from_value(log) {
                Ok(l) => l,
                Err(e) => {
                    tracing::warn!(image_id = %name, error = %e, "an image's log does not read; the image moves without it");
                    Vec::new()
                }
            };
            match serde_json::from_value::<Image>(doc) {
                Ok(img) => docs.push((name, img, log)),
                Err(e) => {
                    tracing::warn!(image_id = %name, error = %e, "an image document is not an image record; left in net_docs");
                }
            }
        }
    }
    // Newest first, as names were resolved.
    docs.sort_by(|(_, a, _), (_, b, _)| (b.created_ms, &b.id).cmp(&(a.created_ms, &a.id)));
    let mut highest: std::collections::HashMap<String, u32> = std::collections::HashMap::new();
    for (_, img, _) in &docs {
        if let Some(n) = &img.name {
            let h = highest.entry(n.clone()).or_default();
            *h = (*h).max(img.version);
        }
    }
    let mut taken: std::collections::HashSet<(String, u32)> = std::collections::HashSet::new();
    for (doc_name, mut img, log) in docs {
        if let Some(n) = &img.name {
            if !taken.insert((n.clone(), img.version)) {
                let h = highest.entry(n.clone()).or_default();
                *h += 1;
                tracing::warn!(image_id = %img.id, name = %n, from = img.version, to = *h, "two images had one version; the older one gets the next");
                img.version = *h;
                taken.insert((n.clone(), img.version));
            }
        }
        insert_row(tx, &img)?;
        for l in &log {
            insert_log_line(tx, &img.id, l)?;
        }
        tx.execute(
            "DELETE FROM net_docs WHERE kind = 'image' AND scope = 'images' AND name = ?1",
            params![doc_name],
        )
        .map_err(store_err("migrate images"))?;
    }
    Ok(())
}

#[cfg(test)]
pub(super) mod tests {
    use serde_json::{json, Value};

    use super::*;
    use crate::domain::image::ImageState;
    use crate::store::SCHEMA_VERSION;

    /// A data dir holding a v5 database (images and volumes still in
    /// `net_docs`) with `docs` as (kind, scope, name, doc).
    pub(in crate::store) fn v5_database(docs: &[(&str, &str, &str, Value)]) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("rt-store-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        let conn = rusqlite::Connection::open(dir.join("runtime.db")).unwrap();
        for batch in [
            super::super::SCHEMA_V1,
            super::super::SCHEMA_V2,
            super::super::SCHEMA_V3,
            super::super::SCHEMA_V4,
            super::super::SCHEMA_V5,
        ] {
            conn.execute_batch(batch).unwrap();
        }
        conn.pragma_update(None, "user_version", 5).unwrap();
        for (kind, scope, name, doc) in docs {
            conn.execute(
                "INSERT INTO net_docs (kind, scope, name, doc) VALUES (?1, ?2, ?3, ?4)",
                rusqlite::params![kind, scope, name, doc.to_string()],
            )
            .unwrap();
        }
        dir
    }

    /// An image document as a v5 server wrote it.
    fn old_doc(
        id: &str,
        name: Option<&str>,
        version: u32,
        tags: &[&str],
        created_ms: i64,
    ) -> Value {
        json!({
            "id": id, "keyId": "k1", "name": name, "version": version, "tags": tags,
            "labels": {"team": "a"}, "state": "ready", "error": null, "source": "recipe",
            "base": null, "baseKey": "base-x",
            "steps": [{"index": 0, "instruction": "RUN true", "key": format!("key-{id}"),
                       "state": "done", "script": "true", "root": false,
                       "env": [["A", "1"]], "workdir": "/w", "seconds": 1.5}],
            "env": [["A", "1"]], "workdir": "/w", "user": "user",
            "start": {"command": "sleep 1"}, "createdAt": "2024-01-01T00:00:00.000Z",
            "createdMs": created_ms, "readyAt": "2024-01-01T00:00:09.000Z",
            "buildSeconds": 9.0,
            "log": [
                {"seq": 1, "step": null, "stream": "system", "text": "build machine starting"},
                {"seq": 2, "step": 0, "stream": "output", "text": "hi"}
            ],
            "buildVm": null
        })
    }

    fn doc_names(dir: &std::path::Path) -> Vec<(String, String)> {
        let conn = rusqlite::Connection::open(dir.join("runtime.db")).unwrap();
        let mut stmt = conn
            .prepare("SELECT kind, name FROM net_docs ORDER BY kind, name")
            .unwrap();
        let rows = stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?))).unwrap();
        rows.map(Result::unwrap).collect()
    }

    #[test]
    fn a_v5_database_opens_as_the_newest_schema_with_every_image_and_its_log() {
        let dir = v5_database(&[
            ("image", "images", "a", old_doc("a", Some("app"), 1, &[], 1)),
            (
                "image",
                "images",
                "b",
                old_doc("b", Some("app"), 2, &["stable"], 2),
            ),
            // Made at once with b before the constraint: the newest keeps v2.
            (
                "image",
                "images",
                "c",
                old_doc("c", Some("app"), 2, &["latest"], 3),
            ),
            ("image", "images", "d", old_doc("d", None, 1, &[], 4)),
            ("image", "images", "junk", json!({"not": "an image"})),
            ("preview", "sbx", "8080", json!({"port": 8080})),
        ]);
        let store = Store::open(&dir).unwrap();
        let version: i64 = store
            .conn()
            .as_sqlite()
            .unwrap()
            .query_row("PRAGMA user_version", [], |r| r.get(0))
            .unwrap();
        assert_eq!(version, SCHEMA_VERSION);
        let all = store.images().unwrap();
        let got: Vec<(&str, u32)> = all.iter().map(|i| (i.id.as_str(), i.version)).collect();
        assert_eq!(got, [("d", 1), ("c", 2), ("b", 3), ("a", 1)]);
        // The record is the document as it was (without its log).
        let mut want: Image =
            serde_json::from_value(old_doc("b", Some("app"), 3, &["stable"], 2)).unwrap();
        want.version = 3;
        assert_eq!(store.get_image("b").unwrap(), Some(want));
        let log = store.image_log("b").unwrap();
        assert_eq!(
            log,
            [
                LogLine {
                    seq: 1,
                    step: None,
                    stream: LogStream::System,
                    text: "build machine starting".into()
                },
                LogLine {
                    seq: 2,
                    step: Some(0),
                    stream: LogStream::Output,
                    text: "hi".into()
                },
            ]
        );
        // What was not an image stays, and so do the other kinds.
        assert_eq!(
            doc_names(&dir),
            [
                ("image".to_string(), "junk".to_string()),
                ("preview".into(), "8080".into())
            ]
        );
        drop(store);
        // Opening again changes nothing.
        let store = Store::open(&dir).unwrap();
        assert_eq!(store.images().unwrap(), all);
        drop(store);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn versions_are_assigned_in_the_insert_and_unique_per_name() {
        crate::store::testing::each_engine(|store| {
            let mut first: Image =
                serde_json::from_value(old_doc("a", Some("app"), 0, &[], 1)).unwrap();
            store.insert_image(&mut first).unwrap();
            assert_eq!(first.version, 1);
            let mut img: Image =
                serde_json::from_value(old_doc("n", Some("app"), 0, &[], 5)).unwrap();
            store.insert_image(&mut img).unwrap();
            assert_eq!(img.version, 2);
            img.id = "n2".into();
            store.insert_image(&mut img).unwrap();
            assert_eq!(img.version, 3);
            let mut other: Image =
                serde_json::from_value(old_doc("o", Some("web"), 0, &[], 5)).unwrap();
            store.insert_image(&mut other).unwrap();
            assert_eq!(other.version, 1);
            let mut unnamed: Image =
                serde_json::from_value(old_doc("u1", None, 9, &[], 5)).unwrap();
            store.insert_image(&mut unnamed).unwrap();
            unnamed.id = "u2".into();
            store.insert_image(&mut unnamed).unwrap();
            assert_eq!(unnamed.version, 1);
            // The constraint refuses a second app@3 of the same key.
            img.id = "dup".into();
            assert!(insert_row(&store.conn(), &img).is_err());
            // Another key's "app" is another name: its versions start at 1, and
            // its app@3 may be.
            let mut theirs: Image =
                serde_json::from_value(old_doc("t1", Some("app"), 0, &[], 5)).unwrap();
            theirs.key_id = format!("{}-other", img.key_id);
            store.insert_image(&mut theirs).unwrap();
            assert_eq!(theirs.version, 1);
            theirs.id = "t3".into();
            theirs.version = 3;
            insert_row(&store.conn(), &theirs).unwrap();
            // An update keeps the id, name and version; a delete takes the log too.
            let after = store
                .update_image("n", |i| {
                    i.version = 7;
                    i.name = None;
                    i.state = ImageState::Failed;
                    true
                })
                .unwrap()
                .unwrap();
            assert_eq!(
                (after.name.as_deref(), after.version, after.state),
                (Some("app"), 2, ImageState::Failed)
            );
            assert_eq!(store.get_image("n").unwrap(), Some(after));
            assert_eq!(store.update_image("nope", |_| true).unwrap(), None);
            assert!(store.delete_image("a").unwrap());
            assert!(store.image_log("a").unwrap().is_empty());
            assert!(!store.delete_image("a").unwrap());
        });
    }

    #[test]
    fn a_log_grows_to_its_limit_for_an_image_that_is_there() {
        crate::store::testing::each_engine(|store| {
            store
                .append_image_log("nope", None, LogStream::System, &["x"], 10)
                .unwrap();
            assert!(store.image_log("nope").unwrap().is_empty());
            let mut img: Image = serde_json::from_value(old_doc("i", None, 1, &[], 1)).unwrap();
            store.insert_image(&mut img).unwrap();
            store
                .append_image_log("i", None, LogStream::System, &["a", "b"], 3)
                .unwrap();
            store
                .append_image_log("i", Some(1), LogStream::Output, &["c", "d"], 3)
                .unwrap();
            let log = store.image_log("i").unwrap();
            let got: Vec<(u64, Option<usize>, &str)> = log
                .iter()
                .map(|l| (l.seq, l.step, l.text.as_str()))
                .collect();
            assert_eq!(got, [(1, None, "a"), (2, None, "b"), (3, Some(1), "c")]);
        });
    }
}
