//! The rules of files and chunked uploads: what a path may be, how a list's
//! glob matches and how deep it looks, and which bytes of an upload have
//! arrived.

use std::collections::BTreeMap;

/// Largest `PUT …/files/content` body, and the chunk size of uploads.
pub(crate) const CHUNK_BYTES: usize = 1 << 20;

/// A path in the guest: absolute, without NUL.
pub(crate) fn valid_path(p: &str) -> bool {
    p.starts_with('/') && !p.contains('\0')
}

/// Shell-style match: `*` and `?` within a segment, `**` across segments.
pub(crate) fn glob_match(pat: &[u8], s: &[u8]) -> bool {
    match pat.first() {
        None => s.is_empty(),
        Some(b'*') if pat.get(1) == Some(&b'*') => {
            let rest = pat[2..].strip_prefix(b"/").unwrap_or(&pat[2..]);
            (0..=s.len()).any(|i| glob_match(rest, &s[i..]))
        }
        Some(b'*') => (0..=s.len())
            .take_while(|&i| i == 0 || s[i - 1] != b'/')
            .any(|i| glob_match(&pat[1..], &s[i..])),
        Some(b'?') => !s.is_empty() && s[0] != b'/' && glob_match(&pat[1..], &s[1..]),
        Some(c) => s.first() == Some(c) && glob_match(&pat[1..], &s[1..]),
    }
}

/// How deep a list looks: as asked, else deep enough for its glob (a glob
/// with `**` looks 64 levels, one with `/` one level per segment), else one.
pub(crate) fn list_depth(asked: Option<i64>, glob: Option<&str>) -> u32 {
    asked.unwrap_or(match glob {
        Some(g) if g.contains("**") => 64,
        Some(g) => g.matches('/').count() as i64 + 1,
        None => 1,
    }) as u32
}

/// Whether a listed entry (its `path` and `name`) matches the list's glob
/// under `root`: a glob with `/` matches the path below the root, one
/// without it the name alone.
pub(crate) fn listed(glob: Option<&str>, root: &str, path: &str, name: &str) -> bool {
    let Some(g) = glob else {
        return true;
    };
    let root = root.trim_end_matches('/');
    let rel = path
        .strip_prefix(root)
        .unwrap_or(path)
        .trim_start_matches('/');
    let target = if g.contains('/') { rel } else { name };
    glob_match(g.as_bytes(), target.as_bytes())
}

/// Whether a chunk of `len` bytes at `offset` lies within an upload of
/// `size` bytes.
pub(crate) fn chunk_fits(offset: u64, len: u64, size: u64) -> bool {
    offset.checked_add(len).is_some_and(|end| end <= size)
}

/// The bytes received without a gap from the start, from the chunks
/// received (offset → length).
pub(crate) fn covered(received: &BTreeMap<u64, u64>) -> u64 {
    let mut end = 0u64;
    for (&o, &l) in received {
        if o > end {
            break;
        }
        end = end.max(o + l);
    }
    end
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn globs() {
        assert!(glob_match(b"*.py", b"a.py"));
        assert!(!glob_match(b"*.py", b"d/a.py"));
        assert!(glob_match(b"**/*.py", b"d/e/a.py"));
        assert!(glob_match(b"**/*.py", b"a.py"));
        assert!(glob_match(b"a?c", b"abc"));
        assert!(!glob_match(b"a?c", b"a/c"));
        assert!(!glob_match(b"a?c", b"ac"));
        assert!(glob_match(b"", b""));
        assert!(!glob_match(b"", b"a"));
        assert!(glob_match(b"src/*.rs", b"src/lib.rs"));
        assert!(!glob_match(b"src/*.rs", b"src/a/lib.rs"));
    }

    #[test]
    fn paths_are_absolute_without_nul() {
        assert!(valid_path("/workspace/a.txt"));
        assert!(valid_path("/"));
        assert!(!valid_path("relative"));
        assert!(!valid_path(""));
        assert!(!valid_path("/a\0b"));
    }

    #[test]
    fn a_list_looks_as_deep_as_its_glob_needs() {
        assert_eq!(list_depth(None, None), 1);
        assert_eq!(list_depth(Some(3), None), 3);
        assert_eq!(list_depth(None, Some("*.py")), 1);
        assert_eq!(list_depth(None, Some("a/b/*.py")), 3);
        assert_eq!(list_depth(None, Some("**/*.py")), 64);
        assert_eq!(list_depth(Some(2), Some("**/*.py")), 2);
    }

    #[test]
    fn a_glob_with_a_slash_matches_the_path_below_the_root() {
        assert!(listed(None, "/w", "/w/a/b.py", "b.py"));
        assert!(listed(Some("*.py"), "/w", "/w/a/b.py", "b.py"));
        assert!(!listed(Some("*.py"), "/w", "/w/a/b.rs", "b.rs"));
        assert!(listed(Some("a/*.py"), "/w/", "/w/a/b.py", "b.py"));
        assert!(!listed(Some("c/*.py"), "/w", "/w/a/b.py", "b.py"));
        assert!(listed(Some("**/*.py"), "/w", "/w/a/b/c.py", "c.py"));
    }

    #[test]
    fn chunks_must_end_within_the_size() {
        assert!(chunk_fits(0, 4, 4));
        assert!(chunk_fits(4, 0, 4));
        assert!(!chunk_fits(1, 4, 4));
        assert!(!chunk_fits(5, 0, 4));
        assert!(!chunk_fits(u64::MAX, 2, u64::MAX));
    }

    #[test]
    fn coverage_counts_from_the_start_without_gaps() {
        let mut r = BTreeMap::new();
        assert_eq!(covered(&r), 0);
        r.insert(4, 4);
        assert_eq!(covered(&r), 0);
        r.insert(0, 4);
        assert_eq!(covered(&r), 8);
        r.insert(10, 2);
        assert_eq!(covered(&r), 8);
        r.insert(2, 9);
        assert_eq!(covered(&r), 12);
    }
}
