//! Just enough tar for `runtime sandbox cp` of folders: writing a local
//! folder as ustar archives (long names as GNU `L` entries), in batches that
//! each fit the API's 1 MiB body, and unpacking the archive a sandbox's GNU
//! tar writes (regular files, folders, symbolic links; GNU long names and
//! pax `path`/`linkpath`). Nothing is ever written outside the destination:
//! absolute names lose their `/`, and a name with `..` is refused.

use std::path::{Component, Path, PathBuf};

use anyhow::{bail, Context};

const BLOCK: usize = 512;

/// What one archive member is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Kind {
    File(Vec<u8>),
    Dir,
    Symlink(String),
}

/// One member to write: its name inside the archive, mode and kind.
#[derive(Debug, Clone)]
pub(crate) struct Entry {
    pub name: String,
    pub mode: u32,
    pub kind: Kind,
}

fn octal(field: &mut [u8], value: u64) {
    // Digits, then a NUL, right-aligned with leading zeros.
    let width = field.len() - 1;
    let s = format!("{value:0width$o}");
    let s = &s.as_bytes()[s.len().saturating_sub(width)..];
    field[..width].copy_from_slice(s);
    field[width] = 0;
}

fn header(name: &[u8], mode: u32, size: u64, typeflag: u8, link: &[u8]) -> [u8; BLOCK] {
    let mut h = [0u8; BLOCK];
    let n = name.len().min(100);
    h[..n].copy_from_slice(&name[..n]);
    octal(&mut h[100..108], u64::from(mode & 0o7777));
    octal(&mut h[108..116], 0);
    octal(&mut h[116..124], 0);
    octal(&mut h[124..136], size);
    octal(&mut h[136..148], 0);
    h[156] = typeflag;
    let l = link.len().min(100);
    h[157..157 + l].copy_from_slice(&link[..l]);
    h[257..263].copy_from_slice(b"ustar\0");
    h[263..265].copy_from_slice(b"00");
    // The checksum is computed with its own field as spaces.
    h[148..156].copy_from_slice(b"        ");
    let sum: u64 = h.iter().map(|b| u64::from(*b)).sum();
    let s = format!("{sum:06o}\0 ");
    h[148..156].copy_from_slice(s.as_bytes());
    h
}

fn pad(out: &mut Vec<u8>) {
    let rem = out.len() % BLOCK;
    if rem != 0 {
        out.resize(out.len() + BLOCK - rem, 0);
    }
}

/// A GNU long-name (`L`) or long-link (`K`) entry when `value` does not
/// fit the 100 bytes of a header.
fn long(out: &mut Vec<u8>, flag: u8, value: &[u8]) {
    if value.len() < 100 {
        return;
    }
    let mut data = value.to_vec();
    data.push(0);
    out.extend_from_slice(&header(
        b"././@LongLink",
        0o644,
        data.len() as u64,
        flag,
        b"",
    ));
    out.extend_from_slice(&data);
    pad(out);
}

/// Appends one member.
pub(crate) fn append(out: &mut Vec<u8>, e: &Entry) {
    let mut name = e.name.clone();
    if matches!(e.kind, Kind::Dir) && !name.ends_with('/') {
        name.push('/');
    }
    long(out, b'L', name.as_bytes());
    match &e.kind {
        Kind::File(data) => {
            out.extend_from_slice(&header(
                name.as_bytes(),
                e.mode,
                data.len() as u64,
                b'0',
                b"",
            ));
            out.extend_from_slice(data);
            pad(out);
        }
        Kind::Dir => out.extend_from_slice(&header(name.as_bytes(), e.mode, 0, b'5', b"")),
        Kind::Symlink(target) => {
            long(out, b'K', target.as_bytes());
            out.extend_from_slice(&header(name.as_bytes(), e.mode, 0, b'2', target.as_bytes()));
        }
    }
}

/// Ends an archive (two zero blocks).
pub(crate) fn finish(out: &mut Vec<u8>) {
    out.resize(out.len() + 2 * BLOCK, 0);
}

/// The bytes a member takes in an archive, headers included.
pub(crate) fn size_of(e: &Entry) -> usize {
    let blocks = |n: usize| n.div_ceil(BLOCK) * BLOCK;
    let mut n = BLOCK;
    let slash = matches!(e.kind, Kind::Dir) && !e.name.ends_with('/');
    let name_len = e.name.len() + usize::from(slash);
    if name_len >= 100 {
        n += BLOCK + blocks(name_len + 1);
    }
    match &e.kind {
        Kind::File(d) => n + blocks(d.len()),
        Kind::Dir => n,
        Kind::Symlink(t) if t.len() >= 100 => n + BLOCK + blocks(t.len() + 1),
        Kind::Symlink(_) => n,
    }
}

/// A local folder's members, named relative to it (the folder itself not
/// included), parents before children, sorted.
pub(crate) fn walk(root: &Path) -> anyhow::Result<Vec<(String, PathBuf, std::fs::Metadata)>> {
    let mut out = Vec::new();
    let mut stack = vec![(String::new(), root.to_path_buf())];
    while let Some((prefix, dir)) = stack.pop() {
        let mut items: Vec<_> = std::fs::read_dir(&dir)
            .with_context(|| format!("reading {}", dir.display()))?
            .collect::<Result<_, _>>()
            .with_context(|| format!("reading {}", dir.display()))?;
        items.sort_by_key(|e| e.file_name());
        let mut subdirs = Vec::new();
        for item in items {
            let path = item.path();
            let meta = std::fs::symlink_metadata(&path)
                .with_context(|| format!("reading {}", path.display()))?;
            let Some(name) = item.file_name().to_str().map(str::to_string) else {
                bail!("{} is not a UTF-8 name", path.display());
            };
            let rel = format!("{prefix}{name}");
            if meta.is_dir() {
                subdirs.push((format!("{rel}/"), path.clone()));
            }
            out.push((rel, path, meta));
        }
        // Depth first, in name order.
        stack.extend(subdirs.into_iter().rev());
    }
    Ok(out)
}

/// A member read from an archive.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Member {
    pub path: PathBuf,
    pub mode: u32,
    pub kind: Kind,
}

fn parse_octal(field: &[u8]) -> anyhow::Result<u64> {
    let s: String = field
        .iter()
        .take_while(|b| **b != 0)
        .map(|b| *b as char)
        .collect();
    let s = s.trim();
    if s.is_empty() {
        return Ok(0);
    }
    u64::from_str_radix(s, 8).with_context(|| format!("a bad number {s:?} in a tar header"))
}

fn cstr(field: &[u8]) -> String {
    let end = field.iter().position(|b| *b == 0).unwrap_or(field.len());
    String::from_utf8_lossy(&field[..end]).into_owned()
}

/// A member's name as a relative path, or an error for one that climbs.
pub(crate) fn safe_path(name: &str) -> anyhow::Result<Option<PathBuf>> {
    let mut out = PathBuf::new();
    for c in Path::new(name).components() {
        match c {
            Component::Normal(p) => out.push(p),
            Component::CurDir | Component::RootDir => {}
            Component::ParentDir | Component::Prefix(_) => {
                bail!("the archive names {name:?}, outside its folder")
            }
        }
    }
    Ok((!out.as_os_str().is_empty()).then_some(out))
}

/// The pax records `path` and `linkpath` of an extended header.
fn pax(data: &[u8]) -> (Option<String>, Option<String>) {
    let (mut path, mut link) = (None, None);
    let mut rest = data;
    while !rest.is_empty() {
        let Some(sp) = rest.iter().position(|b| *b == b' ') else {
            break;
        };
        let Some(len) = std::str::from_utf8(&rest[..sp])
            .ok()
            .and_then(|s| s.parse::<usize>().ok())
        else {
            break;
        };
        if len <= sp || len > rest.len() {
            break;
        }
        let rec = &rest[sp + 1..len];
        let rec = rec.strip_suffix(b"\n").unwrap_or(rec);
        if let Some(eq) = rec.iter().position(|b| *b == b'=') {
            let v = String::from_utf8_lossy(&rec[eq + 1..]).into_owned();
            match &rec[..eq] {
                b"path" => path = Some(v),
                b"linkpath" => link = Some(v),
                _ => {}
            }
        }
        rest = &rest[len..];
    }
    (path, link)
}

/// Reads the members of a whole (uncompressed) archive.
pub(crate) fn read(data: &[u8]) -> anyhow::Result<Vec<Member>> {
    let mut out = Vec::new();
    let mut at = 0;
    let (mut next_name, mut next_link): (Option<String>, Option<String>) = (None, None);
    let mut ended = false;
    while at + BLOCK <= data.len() {
        let h = &data[at..at + BLOCK];
        at += BLOCK;
        if h.iter().all(|b| *b == 0) {
            ended = true;
            break;
        }
        let size = usize::try_from(parse_octal(&h[124..136])?).context("a member too large")?;
        let body_end = at
            .checked_add(size)
            .filter(|e| *e <= data.len())
            .context("the archive is cut short")?;
        let body = &data[at..body_end];
        at += size.div_ceil(BLOCK) * BLOCK;
        let flag = h[156];
        match flag {
            b'L' => {
                next_name = Some(cstr(body));
                continue;
            }
            b'K' => {
                next_link = Some(cstr(body));
                continue;
            }
            b'x' => {
                let (p, l) = pax(body);
                next_name = p.or(next_name);
                next_link = l.or(next_link);
                continue;
            }
            b'g' => continue,
            _ => {}
        }
        let mut name = next_name.take().unwrap_or_else(|| {
            let prefix = if &h[257..262] == b"ustar" {
                cstr(&h[345..500])
            } else {
                String::new()
            };
            let n = cstr(&h[..100]);
            if prefix.is_empty() {
                n
            } else {
                format!("{prefix}/{n}")
            }
        });
        let link = next_link.take().unwrap_or_else(|| cstr(&h[157..257]));
        let mode = parse_octal(&h[100..108])? as u32 & 0o7777;
        let kind = match flag {
            b'0' | 0 | b'7' => {
                if name.ends_with('/') {
                    Kind::Dir
                } else {
                    Kind::File(body.to_vec())
                }
            }
            b'5' => Kind::Dir,
            b'2' => Kind::Symlink(link),
            // Hard links, devices and fifos are left out.
            _ => continue,
        };
        if name.ends_with('/') {
            name.pop();
        }
        if let Some(path) = safe_path(&name)? {
            out.push(Member { path, mode, kind });
        }
    }
    if !ended {
        bail!("the archive is cut short (no end marker)");
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn roundtrip(entries: &[Entry]) -> Vec<Member> {
        let mut out = Vec::new();
        for e in entries {
            let before = out.len();
            append(&mut out, e);
            assert_eq!(out.len() - before, size_of(e), "{}", e.name);
        }
        finish(&mut out);
        read(&out).unwrap()
    }

    #[test]
    fn members_survive_a_roundtrip() {
        let long_name = format!("{}/file.txt", "d".repeat(150));
        let long_target = "t".repeat(120);
        let entries = vec![
            Entry {
                name: "a".into(),
                mode: 0o755,
                kind: Kind::Dir,
            },
            Entry {
                name: "a/run.sh".into(),
                mode: 0o755,
                kind: Kind::File(b"#!/bin/sh\necho hi\n".to_vec()),
            },
            Entry {
                name: "empty".into(),
                mode: 0o600,
                kind: Kind::File(Vec::new()),
            },
            Entry {
                name: long_name.clone(),
                mode: 0o644,
                kind: Kind::File(vec![7u8; 1500]),
            },
            Entry {
                name: "link".into(),
                mode: 0o777,
                kind: Kind::Symlink("a/run.sh".into()),
            },
            Entry {
                name: "longlink".into(),
                mode: 0o777,
                kind: Kind::Symlink(long_target.clone()),
            },
        ];
        let m = roundtrip(&entries);
        assert_eq!(m.len(), 6);
        assert_eq!(m[0].path, PathBuf::from("a"));
        assert_eq!(m[0].kind, Kind::Dir);
        assert_eq!(m[1].mode, 0o755);
        assert_eq!(m[1].kind, Kind::File(b"#!/bin/sh\necho hi\n".to_vec()));
        assert_eq!(m[2].kind, Kind::File(Vec::new()));
        assert_eq!(m[3].path, PathBuf::from(&long_name));
        assert_eq!(m[3].kind, Kind::File(vec![7u8; 1500]));
        assert_eq!(m[4].kind, Kind::Symlink("a/run.sh".into()));
        assert_eq!(m[5].kind, Kind::Symlink(long_target));
    }

    #[test]
    fn names_never_leave_the_folder() {
        assert_eq!(
            safe_path("/workspace/x").unwrap(),
            Some(PathBuf::from("workspace/x"))
        );
        assert_eq!(safe_path("./").unwrap(), None);
        assert!(safe_path("a/../../etc/passwd").is_err());
        let mut out = Vec::new();
        append(
            &mut out,
            &Entry {
                name: "../evil".into(),
                mode: 0o644,
                kind: Kind::File(b"x".to_vec()),
            },
        );
        finish(&mut out);
        assert!(read(&out).is_err());
    }

    #[test]
    fn a_cut_archive_is_an_error() {
        let mut out = Vec::new();
        append(
            &mut out,
            &Entry {
                name: "f".into(),
                mode: 0o644,
                kind: Kind::File(vec![1u8; 2000]),
            },
        );
        assert!(read(&out[..1024]).is_err());
        assert!(read(&out).is_err(), "no end marker");
    }

    #[test]
    fn pax_paths_win() {
        let body = "path=some/long/pax/name.txt\n";
        let rec = format!("{} {body}", body.len() + 3);
        let (p, l) = pax(rec.as_bytes());
        assert_eq!(p.as_deref(), Some("some/long/pax/name.txt"));
        assert_eq!(l, None);
    }
}
