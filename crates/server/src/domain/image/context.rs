//! Build contexts (docs/images.md "Build contexts"): a folder the client
//! packs as one gzipped tar, cuts into chunks of [`CHUNK_BYTES`] and
//! uploads by SHA-256, then names in `POST /v1/images` as
//! `context: {archive: {sha256, size, chunks}, files: [{path, sha256, size,
//! mode}]}`. This module is pure: the limits, the request's shape, reading
//! the archive from any reader (gzip, then tar, checked entry by entry,
//! never written anywhere) into its [`Manifest`], matching COPY sources
//! against it, and `.dockerignore` rules.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Read;

use serde::{Deserialize, Serialize};
use serde_json::Value;
use sha2::{Digest, Sha256};

/// The size of a chunk (the client's `CHUNK_BYTES`); the last may be smaller.
pub(crate) const CHUNK_BYTES: usize = 1 << 20;
/// The most an archive may have, compressed (the client's `CONTEXT_BYTES`).
pub(crate) const MAX_ARCHIVE_BYTES: u64 = 100 << 20;
/// The most files a context may have (the client's `CONTEXT_FILES`).
pub(crate) const MAX_FILES: usize = 20_000;
/// The most an archive may unpack to.
pub(crate) const MAX_UNPACKED_BYTES: u64 = 2 << 30;
/// The most chunk bytes one key may hold at once.
pub(crate) const MAX_HELD_BYTES: u64 = 200 << 20;
/// The most digests one `missing` call may ask about.
pub(crate) const MAX_DIGESTS: usize = 1024;
/// A chunk unused for this long is removed.
pub(crate) const KEEP_MS: i64 = 24 * 3600 * 1000;
/// The longest `.dockerignore` taken.
pub(crate) const MAX_DOCKERIGNORE_BYTES: usize = 64 << 10;
/// The longest path in a context.
const MAX_PATH: usize = 4096;

/// Whether `s` is a SHA-256 as the client writes it: 64 lowercase hex digits.
pub(crate) fn valid_digest(s: &str) -> bool {
    s.len() == 64
        && s.bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// The archive a build names: its hash, size and chunks in order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct ArchiveRef {
    pub(crate) sha256: String,
    pub(crate) size: u64,
    pub(crate) chunks: Vec<String>,
}

/// One file the client says it packed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ListedFile {
    pub(crate) path: String,
    pub(crate) sha256: String,
    pub(crate) size: u64,
    pub(crate) mode: u32,
}

/// `context` as a build asks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ContextRequest {
    pub(crate) archive: ArchiveRef,
    pub(crate) files: Vec<ListedFile>,
}

/// What is wrong with a context.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum ContextError {
    #[error(
        "must be {{archive: {{sha256, size, chunks}}, files: [{{path, sha256, size, mode}}]}}"
    )]
    Shape,
    #[error("archive.sha256 must be 64 lowercase hex digits")]
    ArchiveDigest,
    #[error("archive.size must be 1 to {MAX_ARCHIVE_BYTES} bytes")]
    ArchiveSize,
    #[error("archive.chunks must be the archive's chunks' SHA-256 digests, {CHUNK_BYTES} bytes each but the last")]
    Chunks,
    #[error("files[{0}] must be {{path, sha256, size, mode}}")]
    FileShape(usize),
    #[error("at most {MAX_FILES} files")]
    TooManyFiles,
    #[error("chunks missing on this server (upload them first): {}", .0.join(", "))]
    Missing(Vec<String>),
    #[error(
        "the chunks make {got} bytes with SHA-256 {sha256}, not archive.size and archive.sha256"
    )]
    ArchiveMismatch { got: u64, sha256: String },
    #[error("the archive is not a gzipped tar: {0}")]
    NotAnArchive(String),
    #[error("archive entry {0}: paths must be relative, without .. or control characters")]
    BadPath(String),
    #[error(
        "archive entry {0}: only regular files and directories are taken (no links or devices)"
    )]
    BadKind(String),
    #[error("archive entry {0} is there twice")]
    Twice(String),
    #[error("the archive unpacks to more than {MAX_UNPACKED_BYTES} bytes")]
    TooLarge,
    #[error("files lists {0}, which the archive does not have (or has with other contents)")]
    NotInArchive(String),
    #[error("the archive has {0}, which files does not list")]
    NotListed(String),
}

impl ContextRequest {
    /// Reads `context` of a build body.
    pub(crate) fn parse(v: &Value) -> Result<ContextRequest, ContextError> {
        let obj = v.as_object().ok_or(ContextError::Shape)?;
        if obj.keys().any(|k| k != "archive" && k != "files") {
            return Err(ContextError::Shape);
        }
        let a = obj
            .get("archive")
            .and_then(Value::as_object)
            .ok_or(ContextError::Shape)?;
        let sha256 = a
            .get("sha256")
            .and_then(Value::as_str)
            .filter(|s| valid_digest(s))
            .ok_or(ContextError::ArchiveDigest)?
            .to_string();
        let size = a
            .get("size")
            .and_then(Value::as_u64)
            .filter(|s| (1..=MAX_ARCHIVE_BYTES).contains(s))
            .ok_or(ContextError::ArchiveSize)?;
        let chunks: Vec<String> = a
            .get("chunks")
            .and_then(Value::as_array)
            .ok_or(ContextError::Chunks)?
            .iter()
            .map(|c| c.as_str().filter(|s| valid_digest(s)).map(str::to_string))
            .collect::<Option<_>>()
            .ok_or(ContextError::Chunks)?;
        if chunks.len() as u64 != size.div_ceil(CHUNK_BYTES as u64) {
            return Err(ContextError::Chunks);
        }
        let list = obj
            .get("files")
            .and_then(Value::as_array)
            .ok_or(ContextError::Shape)?;
        if list.len() > MAX_FILES {
            return Err(ContextError::TooManyFiles);
        }
        let mut files = Vec::with_capacity(list.len());
        for (i, f) in list.iter().enumerate() {
            let bad = || ContextError::FileShape(i);
            let path = f.get("path").and_then(Value::as_str).ok_or_else(bad)?;
            let sha256 = f
                .get("sha256")
                .and_then(Value::as_str)
                .filter(|s| valid_digest(s))
                .ok_or_else(bad)?;
            let size = f.get("size").and_then(Value::as_u64).ok_or_else(bad)?;
            let mode = match f.get("mode") {
                None | Some(Value::Null) => 0o644,
                Some(m) => m.as_u64().filter(|m| *m <= 0o7777).ok_or_else(bad)? as u32,
            };
            files.push(ListedFile {
                path: clean_path(path).ok_or_else(|| ContextError::BadPath(path.to_string()))?,
                sha256: sha256.to_string(),
                size,
                mode,
            });
        }
        Ok(ContextRequest {
            archive: ArchiveRef {
                sha256,
                size,
                chunks,
            },
            files,
        })
    }
}

/// A context path made plain: relative, `/`-separated, without `.` parts;
/// `None` for an absolute one, one with `..`, control characters or none
/// left.
pub(crate) fn clean_path(p: &str) -> Option<String> {
    if p.starts_with('/') || p.len() > MAX_PATH || p.chars().any(char::is_control) {
        return None;
    }
    let parts: Vec<&str> = p
        .split('/')
        .filter(|c| !c.is_empty() && *c != ".")
        .collect();
    if parts.is_empty() || parts.contains(&"..") {
        return None;
    }
    Some(parts.join("/"))
}

/// A regular file of a context.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct ContextFile {
    pub(crate) sha256: String,
    pub(crate) size: u64,
    pub(crate) mode: u32,
}

/// What a context holds: its files by path, and its directories (those the
/// archive names, and every parent of a file).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(crate) struct Manifest {
    pub(crate) files: BTreeMap<String, ContextFile>,
    pub(crate) dirs: BTreeSet<String>,
}

impl Manifest {
    fn add_parents(&mut self, path: &str) {
        let mut at = path;
        while let Some(i) = at.rfind('/') {
            at = &at[..i];
            if !self.dirs.insert(at.to_string()) {
                break;
            }
        }
    }

    /// Leaves out what a `.dockerignore` excludes (the client has already
    /// left it out; this keeps another client's archive to the same rule).
    pub(crate) fn ignore(&mut self, rules: &Ignore) {
        if rules.is_empty() {
            return;
        }
        self.files.retain(|p, _| !rules.excluded(p));
        let mut dirs = BTreeSet::new();
        for p in self.files.keys() {
            let mut at = p.as_str();
            while let Some(i) = at.rfind('/') {
                at = &at[..i];
                if !dirs.insert(at.to_string()) {
                    break;
                }
            }
        }
        self.dirs = dirs;
    }
}

/// Reads a gzipped tar from `r` as a context: every entry's path must be
/// relative without `..`, every entry a regular file or a directory, no
/// path twice, at most [`MAX_FILES`] files and [`MAX_UNPACKED_BYTES`] in
/// all. Each file is hashed as it streams by; nothing is kept but the
/// manifest.
pub(crate) fn read_archive(r: impl Read) -> Result<Manifest, ContextError> {
    let not_archive = |e: std::io::Error| ContextError::NotAnArchive(e.to_string());
    let mut ar = tar::Archive::new(flate2::read::GzDecoder::new(r));
    let mut m = Manifest::default();
    let mut total: u64 = 0;
    let mut buf = vec![0u8; 64 << 10];
    for (n, entry) in ar.entries().map_err(not_archive)?.enumerate() {
        // Directories count too: headers cost the sender nothing compressed.
        if n >= 2 * MAX_FILES {
            return Err(ContextError::TooManyFiles);
        }
        let mut e = entry.map_err(not_archive)?;
        let raw = String::from_utf8_lossy(&e.path_bytes()).into_owned();
        let path = clean_path(&raw).ok_or_else(|| ContextError::BadPath(raw.clone()))?;
        let kind = e.header().entry_type();
        if kind.is_dir() {
            m.add_parents(&path);
            m.dirs.insert(path);
            continue;
        }
        if !(kind.is_file() || kind == tar::EntryType::Continuous) {
            return Err(ContextError::BadKind(raw));
        }
        if m.files.len() >= MAX_FILES {
            return Err(ContextError::TooManyFiles);
        }
        let size = e.header().size().map_err(not_archive)?;
        total = total.saturating_add(size);
        if total > MAX_UNPACKED_BYTES {
            return Err(ContextError::TooLarge);
        }
        let mode = e.header().mode().map_err(not_archive)? & 0o7777;
        let mut h = Sha256::new();
        loop {
            let n = e.read(&mut buf).map_err(not_archive)?;
            if n == 0 {
                break;
            }
            h.update(&buf[..n]);
        }
        if m.files.contains_key(&path) || m.dirs.contains(&path) {
            return Err(ContextError::Twice(path));
        }
        m.add_parents(&path);
        m.files.insert(
            path,
            ContextFile {
                sha256: hex::encode(h.finalize()),
                size,
                mode,
            },
        );
    }
    if let Some(f) = m.files.keys().find(|f| m.dirs.contains(*f)) {
        return Err(ContextError::Twice(f.clone()));
    }
    Ok(m)
}

/// Whether the archive's files are those `listed`, with the same contents.
pub(crate) fn check_listed(m: &Manifest, listed: &[ListedFile]) -> Result<(), ContextError> {
    for f in listed {
        match m.files.get(&f.path) {
            Some(c) if c.sha256 == f.sha256 && c.size == f.size => {}
            _ => return Err(ContextError::NotInArchive(f.path.clone())),
        }
    }
    if m.files.len() != listed.len() {
        let names: BTreeSet<&str> = listed.iter().map(|f| f.path.as_str()).collect();
        if let Some(extra) = m.files.keys().find(|p| !names.contains(p.as_str())) {
            return Err(ContextError::NotListed(extra.clone()));
        }
        // The same path listed twice.
        return Err(ContextError::Shape);
    }
    Ok(())
}

/// A glob as COPY and `.dockerignore` read one: `*` and `?` within one
/// path part, `[...]` (`[!...]` or `[^...]` for "not"), `**` for any
/// number of parts, `\` escaping the next character.
pub(crate) fn glob_match(pattern: &str, path: &str) -> bool {
    let p: Vec<char> = pattern.chars().collect();
    let s: Vec<char> = path.chars().collect();
    // Iterative matching with one backtrack point per star kind, bounded
    // by the product of the lengths (both are short).
    fn go(p: &[char], s: &[char], budget: &mut u32) -> bool {
        if *budget == 0 {
            return false;
        }
        *budget -= 1;
        match p.first() {
            None => s.is_empty(),
            Some('*') if p.get(1) == Some(&'*') => {
                // `**/` matches zero or more whole parts; `**` anything.
                let rest = if p.get(2) == Some(&'/') {
                    &p[3..]
                } else {
                    &p[2..]
                };
                if go(rest, s, budget) {
                    return true;
                }
                (0..s.len()).any(|i| {
                    (p.get(2) != Some(&'/') || s[i] == '/') && go(rest, &s[i + 1..], budget)
                })
            }
            Some('*') => {
                let rest = &p[1..];
                for i in 0..=s.len() {
                    if go(rest, &s[i..], budget) {
                        return true;
                    }
                    if i < s.len() && s[i] == '/' {
                        break;
                    }
                }
                false
            }
            Some('?') => !s.is_empty() && s[0] != '/' && go(&p[1..], &s[1..], budget),
            Some('[') => {
                let Some(end) = p.iter().skip(1).position(|c| *c == ']').map(|i| i + 1) else {
                    return s.first() == Some(&'[') && go(&p[1..], &s[1..], budget);
                };
                let Some(&c) = s.first() else { return false };
                if c == '/' {
                    return false;
                }
                let mut set = &p[1..end];
                let negate = matches!(set.first(), Some('!') | Some('^'));
                if negate {
                    set = &set[1..];
                }
                let mut hit = false;
                let mut i = 0;
                while i < set.len() {
                    if i + 2 < set.len() && set[i + 1] == '-' {
                        hit |= set[i] <= c && c <= set[i + 2];
                        i += 3;
                    } else {
                        hit |= set[i] == c;
                        i += 1;
                    }
                }
                hit != negate && go(&p[end + 1..], &s[1..], budget)
            }
            Some('\\') if p.len() > 1 => s.first() == Some(&p[1]) && go(&p[2..], &s[1..], budget),
            Some(c) => s.first() == Some(c) && go(&p[1..], &s[1..], budget),
        }
    }
    let mut budget = 100_000;
    go(&p, &s, &mut budget)
}

/// Whether a COPY source has glob characters.
pub(crate) fn is_glob(p: &str) -> bool {
    p.contains(['*', '?', '['])
}

/// A `.dockerignore`, read as Docker reads it (and as the client does):
/// `#` comments, `!` re-includes, `**`, a pattern naming a directory
/// excludes what is in it, the last match decides.
#[derive(Debug, Clone, Default)]
pub(crate) struct Ignore {
    rules: Vec<(bool, String)>,
}

impl Ignore {
    pub(crate) fn parse(text: &str) -> Ignore {
        let mut rules = Vec::new();
        for raw in text.lines() {
            let line = raw.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let (negate, line) = match line.strip_prefix('!') {
                Some(l) => (true, l.trim()),
                None => (false, line),
            };
            let mut parts: Vec<&str> = Vec::new();
            for part in line.split('/').filter(|p| !p.is_empty() && *p != ".") {
                if part == ".." {
                    parts.pop();
                } else {
                    parts.push(part);
                }
            }
            if !parts.is_empty() {
                rules.push((negate, parts.join("/")));
            }
        }
        Ignore { rules }
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.rules.is_empty()
    }

    /// Whether the context path `path` is left out.
    pub(crate) fn excluded(&self, path: &str) -> bool {
        let parts: Vec<&str> = path.split('/').collect();
        let mut out = false;
        for (negate, pattern) in &self.rules {
            if (1..=parts.len()).any(|n| glob_match(pattern, &parts[..n].join("/"))) {
                out = !negate;
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::access::sha256_hex as digest;
    use serde_json::json;

    /// A gzipped tar of `entries`: (path, kind, data); kind `f`ile, `d`ir,
    /// `l`ink (to `data`), `s`ymlink.
    pub(crate) fn tgz(entries: &[(&str, char, &[u8])]) -> Vec<u8> {
        let mut b = tar::Builder::new(Vec::new());
        for (path, kind, data) in entries {
            let mut h = tar::Header::new_ustar();
            h.set_mode(0o644);
            match kind {
                'd' => {
                    h.set_entry_type(tar::EntryType::Directory);
                    h.set_size(0);
                }
                's' | 'l' => {
                    h.set_entry_type(if *kind == 's' {
                        tar::EntryType::Symlink
                    } else {
                        tar::EntryType::Link
                    });
                    h.set_size(0);
                    h.set_link_name(String::from_utf8_lossy(data).as_ref())
                        .unwrap();
                }
                _ => h.set_size(data.len() as u64),
            }
            // Written raw: `append_data` would refuse `..` itself.
            let name = path.as_bytes();
            h.as_old_mut().name[..name.len()].copy_from_slice(name);
            h.set_cksum();
            let body: &[u8] = if *kind == 'f' { data } else { &[] };
            b.append(&h, body).unwrap();
        }
        let tar = b.into_inner().unwrap();
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        std::io::Write::write_all(&mut gz, &tar).unwrap();
        gz.finish().unwrap()
    }

    #[test]
    fn an_archive_reads_into_files_and_directories() {
        let a = tgz(&[
            ("d/", 'd', b""),
            ("d/a.txt", 'f', b"A"),
            ("./b/c/x", 'f', b"xyz"),
        ]);
        let m = read_archive(&a[..]).unwrap();
        assert_eq!(m.files.keys().collect::<Vec<_>>(), ["b/c/x", "d/a.txt"]);
        assert_eq!(m.files["d/a.txt"].sha256, digest(b"A"));
        assert_eq!(m.files["b/c/x"].size, 3);
        assert_eq!(m.files["b/c/x"].mode, 0o644);
        assert_eq!(m.dirs.iter().collect::<Vec<_>>(), ["b", "b/c", "d"]);
        let listed = |p: &str, d: &[u8]| ListedFile {
            path: p.into(),
            sha256: digest(d),
            size: d.len() as u64,
            mode: 0o644,
        };
        assert_eq!(
            check_listed(&m, &[listed("d/a.txt", b"A"), listed("b/c/x", b"xyz")]),
            Ok(())
        );
        assert_eq!(
            check_listed(&m, &[listed("d/a.txt", b"B"), listed("b/c/x", b"xyz")]),
            Err(ContextError::NotInArchive("d/a.txt".into()))
        );
        assert_eq!(
            check_listed(&m, &[listed("d/a.txt", b"A")]),
            Err(ContextError::NotListed("b/c/x".into()))
        );
    }

    #[test]
    fn an_archive_with_escapes_links_or_odd_entries_is_refused() {
        let e = |entries: &[(&str, char, &[u8])]| {
            read_archive(&tgz(entries)[..]).err().map(|e| e.to_string())
        };
        assert_eq!(
            e(&[("../etc/passwd", 'f', b"x")]),
            Some("archive entry ../etc/passwd: paths must be relative, without .. or control characters".into())
        );
        assert!(e(&[("a/../../x", 'f', b"x")])
            .unwrap()
            .contains("a/../../x"));
        assert!(e(&[("/abs", 'f', b"x")]).unwrap().contains("/abs"));
        assert_eq!(
            e(&[("l", 's', b"/etc")]),
            Some("archive entry l: only regular files and directories are taken (no links or devices)".into())
        );
        assert!(e(&[("a", 'f', b"x"), ("h", 'l', b"a")])
            .unwrap()
            .contains("archive entry h"));
        assert_eq!(
            e(&[("a", 'f', b"x"), ("./a", 'f', b"y")]),
            Some("archive entry a is there twice".into())
        );
        assert_eq!(
            e(&[("a", 'f', b"x"), ("a/b", 'f', b"y")]),
            Some("archive entry a is there twice".into())
        );
        assert!(read_archive(&b"not gzip"[..])
            .unwrap_err()
            .to_string()
            .starts_with("the archive is not a gzipped tar"));
        let dirs: Vec<String> = (0..2 * MAX_FILES + 1).map(|i| format!("d{i}/")).collect();
        let many: Vec<(&str, char, &[u8])> =
            dirs.iter().map(|d| (d.as_str(), 'd', &b""[..])).collect();
        assert_eq!(
            read_archive(&tgz(&many)[..]).err(),
            Some(ContextError::TooManyFiles)
        );
    }

    #[test]
    fn a_context_request_is_checked_field_by_field() {
        let d = digest(b"x");
        let ok = json!({"archive": {"sha256": d, "size": 10, "chunks": [d]},
                        "files": [{"path": "./a/b", "sha256": d, "size": 1, "mode": 0o755}]});
        let r = ContextRequest::parse(&ok).unwrap();
        assert_eq!(r.files[0].path, "a/b");
        assert_eq!(r.files[0].mode, 0o755);
        let e = |v: Value| ContextRequest::parse(&v).err().map(|e| e.to_string());
        assert_eq!(e(json!("x")).unwrap(), ContextError::Shape.to_string());
        assert_eq!(
            e(json!({"archive": {"sha256": "ABC", "size": 10, "chunks": [d]}, "files": []})),
            Some("archive.sha256 must be 64 lowercase hex digits".into())
        );
        assert_eq!(
            e(json!({"archive": {"sha256": d, "size": 0, "chunks": []}, "files": []})),
            Some(ContextError::ArchiveSize.to_string())
        );
        // Two chunks for 10 bytes is wrong, as is one for 1 MiB + 1.
        assert_eq!(
            e(json!({"archive": {"sha256": d, "size": 10, "chunks": [d, d]}, "files": []})),
            Some(ContextError::Chunks.to_string())
        );
        assert_eq!(
            e(
                json!({"archive": {"sha256": d, "size": CHUNK_BYTES + 1, "chunks": [d]}, "files": []})
            ),
            Some(ContextError::Chunks.to_string())
        );
        assert_eq!(
            e(
                json!({"archive": {"sha256": d, "size": 10, "chunks": [d]}, "files": [{"path": "a"}]})
            ),
            Some("files[0] must be {path, sha256, size, mode}".into())
        );
        assert!(
            e(json!({"archive": {"sha256": d, "size": 10, "chunks": [d]},
                         "files": [{"path": "../a", "sha256": d, "size": 1}]}))
            .unwrap()
            .contains("../a")
        );
    }

    #[test]
    fn globs_match_within_parts_and_across_with_double_stars() {
        for (p, s) in [
            ("*.txt", "a.txt"),
            ("a?c", "abc"),
            ("[a-c]x", "bx"),
            ("[!a]x", "bx"),
            ("src/*", "src/main.rs"),
            ("**/*.py", "a/b/c.py"),
            ("**/*.py", "c.py"),
            ("a/**", "a/b/c"),
            ("\\*", "*"),
        ] {
            assert!(glob_match(p, s), "{p} {s}");
        }
        for (p, s) in [
            ("*.txt", "a/b.txt"),
            ("a?c", "a/c"),
            ("[!a]x", "ax"),
            ("src/*", "src"),
            ("[ab", "a"),
        ] {
            assert!(!glob_match(p, s), "{p} {s}");
        }
    }

    #[test]
    fn dockerignore_reads_as_docker_does() {
        let i = Ignore::parse("# comment\n*.log\nbuild\n!build/keep.txt\n**/secret*\n./tmp/\n");
        assert!(i.excluded("a.log"));
        assert!(!i.excluded("d/a.log"));
        assert!(i.excluded("build/x"));
        assert!(!i.excluded("build/keep.txt"));
        assert!(i.excluded("x/y/secret.key"));
        assert!(i.excluded("tmp/z"));
        assert!(!i.excluded("src/main.rs"));
        let mut m = read_archive(
            &tgz(&[
                ("a.log", 'f', b"1"),
                ("b/c", 'f', b"2"),
                ("build/x", 'f', b"3"),
            ])[..],
        )
        .unwrap();
        m.ignore(&i);
        assert_eq!(m.files.keys().collect::<Vec<_>>(), ["b/c"]);
        assert_eq!(m.dirs.iter().collect::<Vec<_>>(), ["b"]);
        assert!(Ignore::parse("\n# only\n").is_empty());
    }
}
