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

/// Longest glob a list takes (its matcher's work is its length times the
/// name's).
pub(crate) const MAX_GLOB: usize = 1024;

/// One piece of a glob.
#[derive(Clone, Copy)]
enum Tok {
    Byte(u8),
    /// `?`: one byte but `/`.
    One,
    /// `*`: any run without `/`.
    Star,
    /// `**` (with the `/` after it, if any): any run.
    Stars,
}

fn tokens(pat: &[u8]) -> Vec<Tok> {
    let mut out = Vec::with_capacity(pat.len());
    let mut i = 0;
    while i < pat.len() {
        match pat[i] {
            b'*' if pat.get(i + 1) == Some(&b'*') => {
                i += if pat.get(i + 2) == Some(&b'/') { 3 } else { 2 };
                out.push(Tok::Stars);
                continue;
            }
            b'*' => out.push(Tok::Star),
            b'?' => out.push(Tok::One),
            c => out.push(Tok::Byte(c)),
        }
        i += 1;
    }
    out
}

/// Shell-style match: `*` and `?` within a segment, `**` across segments.
/// Linear in the pattern times the name (one row of a table per piece of
/// the pattern), whatever the stars: no pattern makes it backtrack.
pub(crate) fn glob_match(pat: &[u8], s: &[u8]) -> bool {
    let n = s.len();
    // `next[j]`: the pieces after this one match `s[j..]`.
    let mut next = vec![false; n + 1];
    next[n] = true;
    let mut row = vec![false; n + 1];
    for tok in tokens(pat).into_iter().rev() {
        for j in (0..=n).rev() {
            let c = s.get(j).copied();
            row[j] = match tok {
                Tok::Byte(b) => c == Some(b) && next[j + 1],
                Tok::One => c.is_some_and(|c| c != b'/') && next[j + 1],
                Tok::Star => next[j] || (c.is_some_and(|c| c != b'/') && row[j + 1]),
                Tok::Stars => next[j] || (c.is_some() && row[j + 1]),
            };
        }
        std::mem::swap(&mut next, &mut row);
    }
    next[0]
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

/// The largest archive a chunked archive upload takes (its bytes as sent,
/// gzipped or not).
pub(crate) const MAX_ARCHIVE_BYTES: u64 = 1 << 30;

/// How many chunked archive uploads one sandbox may have open at once.
pub(crate) const MAX_ARCHIVE_UPLOADS: usize = 8;

/// What a chunk of an archive upload is, given the bytes received so far:
/// archive uploads go in order, so the guest's tar can read them as one
/// stream at the commit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ArchiveChunk {
    /// It starts where the bytes so far end: appended.
    Append,
    /// It lies wholly within the bytes so far (a resend): compared with
    /// them, never written again.
    Resend,
}

/// Places a chunk of `len` bytes at `offset` of an archive upload that has
/// `received` bytes, in an archive of at most `max` bytes; the error says
/// what is wrong with `offset` (or the size).
pub(crate) fn archive_chunk(
    received: u64,
    offset: u64,
    len: u64,
    max: u64,
) -> Result<ArchiveChunk, String> {
    let Some(end) = offset.checked_add(len) else {
        return Err(format!("must be {received}, the bytes received so far"));
    };
    if offset == received {
        if end > max {
            return Err(format!(
                "this chunk would take the archive past {max} bytes, the largest archive upload"
            ));
        }
        return Ok(ArchiveChunk::Append);
    }
    if offset < received && end <= received {
        return Ok(ArchiveChunk::Resend);
    }
    Err(format!(
        "must be {received}, the bytes received so far (archive chunks go in order, without gaps or overlaps)"
    ))
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
    fn archive_chunks_go_in_order_without_gaps() {
        let max = 10;
        assert_eq!(archive_chunk(0, 0, 4, max), Ok(ArchiveChunk::Append));
        assert_eq!(archive_chunk(4, 4, 6, max), Ok(ArchiveChunk::Append));
        // A resend of bytes already there, whole or in part.
        assert_eq!(archive_chunk(8, 0, 4, max), Ok(ArchiveChunk::Resend));
        assert_eq!(archive_chunk(8, 4, 4, max), Ok(ArchiveChunk::Resend));
        assert_eq!(archive_chunk(8, 8, 0, max), Ok(ArchiveChunk::Append));
        // A gap, an overlap past the end, or a chunk past the largest.
        let gap = archive_chunk(4, 5, 1, max).unwrap_err();
        assert!(gap.starts_with("must be 4"), "{gap}");
        let overlap = archive_chunk(4, 2, 4, max).unwrap_err();
        assert!(overlap.starts_with("must be 4"), "{overlap}");
        let big = archive_chunk(8, 8, 3, max).unwrap_err();
        assert!(big.contains("past 10 bytes"), "{big}");
        assert!(archive_chunk(0, u64::MAX, 2, max).is_err());
        assert_eq!(archive_chunk(8, 8, 2, max), Ok(ArchiveChunk::Append));
    }

    /// The matcher this one replaced: the definition, exponential in stars.
    fn reference(pat: &[u8], s: &[u8]) -> bool {
        match pat.first() {
            None => s.is_empty(),
            Some(b'*') if pat.get(1) == Some(&b'*') => {
                let rest = pat[2..].strip_prefix(b"/").unwrap_or(&pat[2..]);
                (0..=s.len()).any(|i| reference(rest, &s[i..]))
            }
            Some(b'*') => (0..=s.len())
                .take_while(|&i| i == 0 || s[i - 1] != b'/')
                .any(|i| reference(&pat[1..], &s[i..])),
            Some(b'?') => !s.is_empty() && s[0] != b'/' && reference(&pat[1..], &s[1..]),
            Some(c) => s.first() == Some(c) && reference(&pat[1..], &s[1..]),
        }
    }

    /// Every word of up to `len` letters of `alphabet`.
    fn words(alphabet: &[u8], len: usize) -> Vec<Vec<u8>> {
        let mut all = vec![Vec::new()];
        let mut last = vec![Vec::new()];
        for _ in 0..len {
            last = last
                .iter()
                .flat_map(|w| {
                    alphabet.iter().map(move |c| {
                        let mut w = w.clone();
                        w.push(*c);
                        w
                    })
                })
                .collect();
            all.extend(last.iter().cloned());
        }
        all
    }

    #[test]
    fn the_linear_matcher_agrees_with_the_definition() {
        let names = words(b"ab/", 5);
        let mut checked = 0;
        for pat in words(b"a/?*", 5) {
            for name in &names {
                assert_eq!(
                    glob_match(&pat, name),
                    reference(&pat, name),
                    "{:?} on {:?}",
                    String::from_utf8_lossy(&pat),
                    String::from_utf8_lossy(name)
                );
                checked += 1;
            }
        }
        assert!(checked > 100_000, "{checked}");
    }

    #[test]
    fn many_stars_over_a_long_name_end() {
        // Exponential for the old matcher (days); a table of 1024 x 256 here.
        let pat = "*a".repeat(300) + "b";
        let name = "a".repeat(255);
        assert!(!glob_match(pat.as_bytes(), name.as_bytes()));
        assert!(glob_match(
            b"*a*a*a*a*a*a*a*a*a*a*b",
            format!("{name}b").as_bytes()
        ));
    }

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
        assert!(glob_match(b"**", b"a/b/c"));
        assert!(glob_match(b"a/**/z", b"a/z"));
        assert!(glob_match(b"a/**/z", b"a/b/c/z"));
        assert!(glob_match(b"*", b""));
        assert!(!glob_match(b"?", b""));
        assert!(glob_match(b"*a*b", b"xaxxb"));
        assert!(!glob_match(b"*a*b", b"xaxxb/"));
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
