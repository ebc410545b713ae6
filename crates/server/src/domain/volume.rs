//! Volumes (contract §5 `volumes`, §11, docs/volumes.md): the record as
//! stored, how a sandbox attaches one, where it may be mounted, and when a
//! sandbox holds its volumes.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::domain::lifecycle::SandboxState;

/// Most volumes one sandbox attaches.
pub(crate) const MAX_ATTACH: usize = 4;
pub(crate) const MIN_SIZE_MIB: i64 = 16;
pub(crate) const MAX_SIZE_MIB: i64 = 1 << 20;

/// A volume as stored; the answer adds its attachments and usage.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct Volume {
    pub(crate) id: String,
    pub(crate) key_id: String,
    /// Unique among its key's volumes.
    pub(crate) name: Option<String>,
    pub(crate) labels: BTreeMap<String, String>,
    #[serde(rename = "sizeMiB")]
    pub(crate) size_mib: u32,
    pub(crate) created_at: String,
    pub(crate) created_ms: i64,
    /// The backup this volume was restored from.
    #[serde(default)]
    pub(crate) restored_from: Option<String>,
    /// Its automatic backups; `None`: none (this server's default).
    #[serde(default)]
    pub(crate) backup_policy: Option<BackupPolicy>,
    /// A shared volume: a directory served to running sandboxes that
    /// attach it (`:attach`), many at once, instead of an ext4 drive.
    #[serde(default)]
    pub(crate) shared: bool,
}

/// Most shared-volume attachments one sandbox has at once.
pub(crate) const MAX_SHARES_PER_SANDBOX: usize = 8;
/// Most live attachments of one shared volume.
pub(crate) const MAX_SHARES_PER_VOLUME: usize = 64;

/// Where an attachment of a shared volume stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ShareState {
    /// Recorded; the guest's mount is being made.
    Attaching,
    Attached,
    /// Recorded; the guest's mount is being taken down.
    Detaching,
    /// Ended (a detach, or its sandbox stopped or was deleted).
    Detached,
}

impl ShareState {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            ShareState::Attaching => "attaching",
            ShareState::Attached => "attached",
            ShareState::Detaching => "detaching",
            ShareState::Detached => "detached",
        }
    }

    pub(crate) fn parse(s: &str) -> Option<ShareState> {
        match s {
            "attaching" => Some(ShareState::Attaching),
            "attached" => Some(ShareState::Attached),
            "detaching" => Some(ShareState::Detaching),
            "detached" => Some(ShareState::Detached),
            _ => None,
        }
    }

    /// Not detached: it counts against the bounds and holds the volume.
    pub(crate) fn live(self) -> bool {
        self != ShareState::Detached
    }
}

/// A shared volume attached to a running sandbox (`va-…`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SharedAttachment {
    pub(crate) id: String,
    /// The key that attached it.
    pub(crate) key_id: String,
    pub(crate) volume_id: String,
    pub(crate) sandbox_id: String,
    pub(crate) path: String,
    pub(crate) state: ShareState,
    pub(crate) created_ms: i64,
    pub(crate) detached_ms: Option<i64>,
}

/// A volume's automatic backups: one a day while `daily`, each kept
/// `retention_days`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct BackupPolicy {
    pub(crate) daily: bool,
    pub(crate) retention_days: u32,
}

impl Default for BackupPolicy {
    fn default() -> Self {
        BackupPolicy {
            daily: false,
            retention_days: DEFAULT_RETENTION_DAYS,
        }
    }
}

/// A day between automatic backups; the first an hour after the volume
/// is made.
pub(crate) const DAILY_MS: i64 = 86_400_000;
pub(crate) const FIRST_DAILY_AFTER_MS: i64 = 3_600_000;

/// Whether a volume made at `created_ms`, whose newest backup was made at
/// `newest_ms`, is due its daily backup at `now`.
pub(crate) fn daily_due(created_ms: i64, newest_ms: Option<i64>, now: i64) -> bool {
    match newest_ms {
        Some(t) => now >= t + DAILY_MS,
        None => now >= created_ms + FIRST_DAILY_AFTER_MS,
    }
}

/// How long a backup is kept, in days: 1 to 365, 7 unless asked.
pub(crate) const MIN_RETENTION_DAYS: i64 = 1;
pub(crate) const MAX_RETENTION_DAYS: i64 = 365;
pub(crate) const DEFAULT_RETENTION_DAYS: u32 = 7;

/// Where a backup stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum BackupState {
    /// Its copy is being made; never restored from.
    Pending,
    /// Copied, synced, renamed into place and checked.
    Ready,
}

impl BackupState {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            BackupState::Pending => "pending",
            BackupState::Ready => "ready",
        }
    }

    pub(crate) fn parse(s: &str) -> Option<BackupState> {
        match s {
            "pending" => Some(BackupState::Pending),
            "ready" => Some(BackupState::Ready),
            _ => None,
        }
    }
}

/// A point-in-time copy of a volume, kept on the server's disk until it
/// expires or is deleted; it outlives its volume.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct VolumeBackup {
    pub(crate) id: String,
    /// The key that made it: its owner.
    pub(crate) key_id: String,
    pub(crate) volume_id: String,
    pub(crate) name: Option<String>,
    pub(crate) state: BackupState,
    /// The volume's size when it was taken: a restore's least size.
    pub(crate) size_mib: u32,
    /// Bytes its copy takes on disk (holes are not stored).
    pub(crate) stored_bytes: u64,
    /// Hex SHA-256 of its content, checked at every restore.
    pub(crate) sha256: String,
    pub(crate) retention_days: u32,
    pub(crate) created_ms: i64,
    pub(crate) expires_ms: i64,
}

/// When a backup made at `created_ms` and kept `days` days expires.
pub(crate) fn expires_ms(created_ms: i64, days: u32) -> i64 {
    created_ms + i64::from(days) * 86_400_000
}

/// How a sandbox has a volume.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum AttachMode {
    /// The volume itself: one live sandbox at a time.
    Rw,
    /// The machine's own copy taken at boot, discarded with it.
    Snapshot,
}

impl AttachMode {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            AttachMode::Rw => "rw",
            AttachMode::Snapshot => "snapshot",
        }
    }

    pub(crate) fn parse(s: &str) -> Option<AttachMode> {
        match s {
            "rw" => Some(AttachMode::Rw),
            "snapshot" => Some(AttachMode::Snapshot),
            _ => None,
        }
    }
}

/// One volume of a sandbox, as its create named it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct Attachment {
    pub(crate) volume_id: String,
    pub(crate) path: String,
    pub(crate) mode: AttachMode,
}

/// Whether a sandbox keeps a volume it attached.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Hold {
    /// The sandbox may run again: it keeps the volume.
    Active,
    /// It has ended and its machine is going away.
    Releasing,
    Free,
}

/// What a sandbox's record says of its hold: it holds its volumes while it
/// may run again (not deleted, and not stopped unless persistent), and is
/// releasing them while it stops. `None`: it has ended, and holds them
/// until its machine is gone (which only the host knows).
pub(crate) fn hold_of(deleted: bool, state: SandboxState, persistent: bool) -> Option<Hold> {
    if deleted || (state == SandboxState::Stopped && !persistent) {
        return None;
    }
    Some(if state == SandboxState::Stopping {
        Hold::Releasing
    } else {
        Hold::Active
    })
}

/// Directories a volume may not be mounted on or under: the system's own.
const SYSTEM_DIRS: &[&str] = &[
    "proc", "sys", "dev", "etc", "bin", "sbin", "lib", "lib32", "lib64", "libx32", "usr", "boot",
    "run", "var", "root",
];

/// Why a guest mount point is refused, if it is.
pub(crate) fn path_problem(path: &str) -> Option<&'static str> {
    let Some(rest) = path.strip_prefix('/') else {
        return Some("must be an absolute path");
    };
    if path.len() > 255 || path.chars().any(|c| c.is_control() || c == '\\') {
        return Some("must be at most 255 characters without control characters");
    }
    let parts: Vec<&str> = rest.split('/').collect();
    if parts
        .iter()
        .any(|p| p.is_empty() || *p == "." || *p == "..")
    {
        return Some("must be a normalized path (no empty, . or .. parts, no trailing /)");
    }
    if SYSTEM_DIRS.contains(&parts[0]) {
        return Some(
            "may not be a system directory or under one (/proc, /sys, /dev, /etc, /usr, /var, ...)",
        );
    }
    if parts.len() == 1 && matches!(parts[0], "workspace" | "tmp" | "home") {
        return Some("may not replace /workspace, /tmp or /home; use a directory below them");
    }
    None
}

/// Whether two mount points are one, or one is under the other.
pub(crate) fn overlap(a: &str, b: &str) -> bool {
    let nested = |x: &str, y: &str| x.starts_with(&format!("{y}/"));
    a == b || nested(a, b) || nested(b, a)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mount_points_are_normalized_absolute_and_outside_the_system() {
        for ok in [
            "/data",
            "/workspace/data",
            "/tmp/x",
            "/home/user/v",
            "/mnt/a/b",
            "/srv",
        ] {
            assert_eq!(path_problem(ok), None, "{ok}");
        }
        assert_eq!(path_problem("data"), Some("must be an absolute path"));
        assert_eq!(path_problem(""), Some("must be an absolute path"));
        let long = format!("/{}", "a".repeat(255));
        for bad in [long.as_str(), "/a\nb", "/a\\b"] {
            assert_eq!(
                path_problem(bad),
                Some("must be at most 255 characters without control characters"),
                "{bad}"
            );
        }
        for bad in ["/", "/a/", "/a//b", "/a/./b", "/mnt/../proc"] {
            assert_eq!(
                path_problem(bad),
                Some("must be a normalized path (no empty, . or .. parts, no trailing /)"),
                "{bad}"
            );
        }
        for bad in [
            "/proc",
            "/etc/x",
            "/usr/local/data",
            "/var/lib/x",
            "/root",
            "/lib64",
        ] {
            assert!(
                path_problem(bad).is_some_and(|p| p.starts_with("may not be a system directory")),
                "{bad}"
            );
        }
        for bad in ["/workspace", "/tmp", "/home"] {
            assert_eq!(
                path_problem(bad),
                Some("may not replace /workspace, /tmp or /home; use a directory below them"),
                "{bad}"
            );
        }
    }

    #[test]
    fn a_daily_backup_is_due_an_hour_after_creation_then_a_day_after_the_last() {
        assert!(!daily_due(0, None, FIRST_DAILY_AFTER_MS - 1));
        assert!(daily_due(0, None, FIRST_DAILY_AFTER_MS));
        assert!(!daily_due(0, Some(5), 5 + DAILY_MS - 1));
        assert!(daily_due(0, Some(5), 5 + DAILY_MS));
    }

    #[test]
    fn mount_points_overlap_when_one_is_under_the_other() {
        assert!(overlap("/data", "/data"));
        assert!(overlap("/data", "/data/x"));
        assert!(overlap("/data/x", "/data"));
        assert!(!overlap("/data", "/database"));
        assert!(!overlap("/a/b", "/a/c"));
    }

    #[test]
    fn a_sandbox_holds_its_volumes_while_it_may_run_again() {
        use SandboxState::*;
        for s in [Starting, Running, Pausing, Paused, Resuming] {
            assert_eq!(hold_of(false, s, false), Some(Hold::Active), "{s:?}");
            assert_eq!(hold_of(false, s, true), Some(Hold::Active), "{s:?}");
            assert_eq!(hold_of(true, s, true), None, "{s:?}");
        }
        assert_eq!(hold_of(false, Stopping, false), Some(Hold::Releasing));
        assert_eq!(hold_of(false, Stopped, false), None);
        // A persistent sandbox may start again from its kept disk.
        assert_eq!(hold_of(false, Stopped, true), Some(Hold::Active));
        assert_eq!(hold_of(true, Stopped, true), None);
    }

    #[test]
    fn modes_keep_their_strings() {
        for m in [AttachMode::Rw, AttachMode::Snapshot] {
            assert_eq!(AttachMode::parse(m.as_str()), Some(m));
            assert_eq!(
                serde_json::to_value(m).unwrap(),
                serde_json::json!(m.as_str())
            );
        }
        assert_eq!(AttachMode::parse("ro"), None);
    }
}
