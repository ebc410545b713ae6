//! Per-key quotas: what one key may hold at once, so that one tenant cannot
//! take a shared server's memory, disk or processes from the others. The
//! operator sets them for every key (`--quota name=value`); what a key uses
//! is counted from its records, and `/v1/limits` answers both as the
//! client's `account` rows.

use std::collections::BTreeMap;

/// One row of a key's quotas: `limit` is `<kind>.<dimension>`, as the
/// client names them (`sandbox.count`, `sandbox.memory_mib`, ...).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Quota {
    pub(crate) limit: &'static str,
    pub(crate) label: &'static str,
    /// `count` or `mib`.
    pub(crate) unit: &'static str,
    pub(crate) default: u64,
}

/// Every quota, with its default. Sandboxes count while their machine
/// runs (a paused or stopped one holds no CPU or memory), their disks while
/// kept; snapshots, volumes and volume backups while they exist; uploads
/// while under way; image builds while they run (more wait, queued).
pub(crate) const QUOTAS: &[Quota] = &[
    Quota {
        limit: "sandbox.count",
        label: "Sandboxes running at once",
        unit: "count",
        default: 100,
    },
    Quota {
        limit: "sandbox.vcpu",
        label: "vCPUs of running sandboxes",
        unit: "count",
        default: 256,
    },
    Quota {
        limit: "sandbox.memory_mib",
        label: "Memory of running sandboxes",
        unit: "mib",
        default: 256 << 10,
    },
    Quota {
        limit: "sandbox.disk_mib",
        label: "Disks of kept sandboxes",
        unit: "mib",
        default: 4 << 20,
    },
    Quota {
        limit: "snapshot.count",
        label: "Snapshots",
        unit: "count",
        default: 500,
    },
    Quota {
        limit: "snapshot.mib",
        label: "Space taken by snapshots",
        unit: "mib",
        default: 1 << 20,
    },
    Quota {
        limit: "volume.count",
        label: "Volumes",
        unit: "count",
        default: 100,
    },
    Quota {
        limit: "volume.mib",
        label: "Size of volumes",
        unit: "mib",
        default: 4 << 20,
    },
    Quota {
        limit: "volume_backup.count",
        label: "Volume backups",
        unit: "count",
        default: 200,
    },
    Quota {
        limit: "volume_backup.mib",
        label: "Space taken by volume backups",
        unit: "mib",
        default: 4 << 20,
    },
    Quota {
        limit: "upload.count",
        label: "Chunked uploads under way",
        unit: "count",
        default: 128,
    },
    Quota {
        limit: "upload.mib",
        label: "Size of chunked uploads under way",
        unit: "mib",
        default: 8 << 10,
    },
    Quota {
        limit: "image.builds",
        label: "Image builds running at once (more wait, queued)",
        unit: "count",
        default: 4,
    },
    Quota {
        limit: "process.count",
        label: "Processes kept per sandbox",
        unit: "count",
        default: 1024,
    },
];

/// The maximum of every quota: the defaults, with the operator's settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limits(BTreeMap<&'static str, u64>);

impl Default for Limits {
    fn default() -> Self {
        Limits(QUOTAS.iter().map(|q| (q.limit, q.default)).collect())
    }
}

/// One of the operator's settings, `name=value`: the quota it names and
/// its new maximum (`None` for `name=default`: back to the server's). The
/// error names the known quotas.
pub(crate) fn parse_setting(setting: &str) -> Result<(&'static str, Option<u64>), String> {
    let known = || {
        QUOTAS
            .iter()
            .map(|q| q.limit)
            .collect::<Vec<_>>()
            .join(", ")
    };
    let (name, value) = setting
        .split_once('=')
        .ok_or_else(|| format!("a quota is name=value, not {setting:?}"))?;
    let q = QUOTAS
        .iter()
        .find(|q| q.limit == name.trim())
        .ok_or_else(|| format!("no quota is named {name:?}; the quotas: {}", known()))?;
    let value = value.trim();
    if value == "default" {
        return Ok((q.limit, None));
    }
    let v: u64 = value
        .parse()
        .map_err(|_| format!("quota {name} takes a whole number or `default`, not {value:?}"))?;
    Ok((q.limit, Some(v)))
}

impl Limits {
    /// Sets one quota of every key from the operator's `name=value`
    /// (`name=default`: the built-in default).
    pub fn set(&mut self, setting: &str) -> Result<(), String> {
        let (limit, v) = parse_setting(setting)?;
        let default = QUOTAS.iter().find(|q| q.limit == limit).map(|q| q.default);
        self.0.insert(limit, v.or(default).unwrap_or(u64::MAX));
        Ok(())
    }

    pub fn max(&self, limit: &str) -> u64 {
        self.0.get(limit).copied().unwrap_or(u64::MAX)
    }

    /// These limits with a key's own quotas in place of the server's
    /// (names no quota has are ignored: a setting of a newer server).
    pub(crate) fn for_key(&self, own: &KeyQuotas) -> Limits {
        let mut l = self.clone();
        for q in QUOTAS {
            if let Some(v) = own.get(q.limit) {
                l.0.insert(q.limit, v);
            }
        }
        l
    }
}

/// A key's own quotas, set by the operator (`runtime keys quota`): each
/// replaces the server's for that key alone, higher or lower.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(transparent)]
pub struct KeyQuotas(BTreeMap<String, u64>);

impl KeyQuotas {
    pub fn get(&self, limit: &str) -> Option<u64> {
        self.0.get(limit).copied()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn iter(&self) -> impl Iterator<Item = (&str, u64)> {
        self.0.iter().map(|(k, v)| (k.as_str(), *v))
    }

    /// Applies the operator's `name=value` settings in order
    /// (`name=default` removes the key's own); every bad one is named.
    pub fn apply(&mut self, settings: &[String]) -> Result<(), String> {
        let mut next = self.0.clone();
        let mut wrong = Vec::new();
        for s in settings {
            match parse_setting(s) {
                Ok((limit, Some(v))) => {
                    next.insert(limit.to_string(), v);
                }
                Ok((limit, None)) => {
                    next.remove(limit);
                }
                Err(e) => wrong.push(e),
            }
        }
        if !wrong.is_empty() {
            return Err(wrong.join("; "));
        }
        self.0 = next;
        Ok(())
    }
}

/// What a key holds now, or what a request would add, per quota name.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Usage(BTreeMap<&'static str, u64>);

impl Usage {
    pub(crate) fn add(&mut self, limit: &'static str, n: u64) {
        *self.0.entry(limit).or_default() += n;
    }

    pub(crate) fn get(&self, limit: &str) -> u64 {
        self.0.get(limit).copied().unwrap_or(0)
    }

    /// A machine that runs (or is about to): its count, vCPUs and memory.
    pub(crate) fn add_machine(&mut self, vcpu: u32, memory_mib: u32) {
        self.add("sandbox.count", 1);
        self.add("sandbox.vcpu", u64::from(vcpu));
        self.add("sandbox.memory_mib", u64::from(memory_mib));
    }
}

/// The quota a request would pass.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Exceeded {
    pub(crate) quota: Quota,
    pub(crate) max: u64,
    pub(crate) used: u64,
    pub(crate) asked: u64,
}

impl Exceeded {
    pub(crate) fn message(&self) -> String {
        let unit = if self.quota.unit == "mib" { " MiB" } else { "" };
        format!(
            "Quota {} ({}) is {}{unit}; this key uses {}{unit} and this request asks for {}{unit} more. \
             Stop, pause or delete what it no longer needs, or ask the operator to raise the quota.",
            self.quota.limit, self.quota.label, self.max, self.used, self.asked
        )
    }
}

/// The first quota that `used + asked` would pass. Only the quotas the
/// request asks something of are checked: a key already over a lowered
/// quota may still do what adds nothing to it.
pub(crate) fn check(limits: &Limits, used: &Usage, asked: &Usage) -> Result<(), Box<Exceeded>> {
    for q in QUOTAS {
        let a = asked.get(q.limit);
        if a == 0 {
            continue;
        }
        let (max, u) = (limits.max(q.limit), used.get(q.limit));
        if u.saturating_add(a) > max {
            return Err(Box::new(Exceeded {
                quota: *q,
                max,
                used: u,
                asked: a,
            }));
        }
    }
    Ok(())
}

/// Bytes as whole MiB, rounded up (a byte of a snapshot counts).
pub(crate) fn mib_of(bytes: u64) -> u64 {
    bytes.div_ceil(1 << 20)
}

/// What the operator keeps free on the host, and how far the memory of
/// running machines may be promised beyond the host's own.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Reserve {
    pub memory_mib: u64,
    pub disk_mib: u64,
    /// Running machines' memory may add up to this times the host's (a
    /// guest holds only what it touched: an idle 1 GiB one about 100 MiB).
    pub memory_overcommit: f64,
}

impl Default for Reserve {
    fn default() -> Self {
        Reserve {
            memory_mib: 512,
            disk_mib: 2048,
            memory_overcommit: 4.0,
        }
    }
}

/// The host's free memory and space now, in MiB.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct Free {
    pub(crate) memory_total: u64,
    pub(crate) memory_available: u64,
    /// The guests' RAM files' file system; 0 total when unknown.
    pub(crate) ram_dir_total: u64,
    pub(crate) ram_dir_free: u64,
    pub(crate) disk: u64,
}

/// What a machine needs free the moment it starts: its memory, up to what
/// a start touches (the rest comes as the guest uses it).
pub(crate) const START_MIB: u64 = 256;

/// Whether the host can take machines of `asked_mib` memory in all now,
/// beside running ones promised `promised_mib`: the refusal says which
/// part of the host is short.
pub(crate) fn room_for(
    free: &Free,
    promised_mib: u64,
    asked_mib: u64,
    r: &Reserve,
) -> Result<(), String> {
    let start = asked_mib.min(START_MIB);
    if free.memory_available < r.memory_mib + start {
        return Err(format!(
            "the host has {} MiB of memory available and keeps {} MiB free",
            free.memory_available, r.memory_mib
        ));
    }
    if free.ram_dir_total > 0 && free.ram_dir_free < r.memory_mib + start {
        return Err(format!(
            "the guests' memory files have {} MiB left on the host",
            free.ram_dir_free
        ));
    }
    // As f64: the product of MiB and a small ratio is far below 2^52.
    let can_promise = (free.memory_total as f64 * r.memory_overcommit) as u64;
    if promised_mib.saturating_add(asked_mib) > can_promise {
        return Err(format!(
            "running machines were promised {promised_mib} MiB of memory, and {asked_mib} MiB \
             more would pass {can_promise} MiB ({}x the host's {} MiB)",
            r.memory_overcommit, free.memory_total
        ));
    }
    if free.disk < r.disk_mib {
        return Err(format!(
            "the host's disk has {} MiB free and keeps {} MiB free",
            free.disk, r.disk_mib
        ));
    }
    Ok(())
}

/// The memory (MiB) of new machines the host can still take now: what
/// [`room_for`] would admit of a machine of at least [`START_MIB`] (0 when
/// the host is short of memory, memory files or disk). What a node
/// publishes for placement (docs/deploy.md, "Placement").
pub(crate) fn headroom(free: &Free, promised_mib: u64, r: &Reserve) -> u64 {
    let short = free.memory_available < r.memory_mib + START_MIB
        || (free.ram_dir_total > 0 && free.ram_dir_free < r.memory_mib + START_MIB)
        || free.disk < r.disk_mib;
    if short {
        return 0;
    }
    let can_promise = (free.memory_total as f64 * r.memory_overcommit) as u64;
    can_promise.saturating_sub(promised_mib)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_are_checked_and_named() {
        let mut l = Limits::default();
        assert_eq!(l.max("sandbox.count"), 100);
        l.set("sandbox.count=3").unwrap();
        assert_eq!(l.max("sandbox.count"), 3);
        let e = l.set("sandbox.cores=3").unwrap_err();
        assert!(
            e.contains("sandbox.vcpu") && e.contains("sandbox.cores"),
            "{e}"
        );
        assert!(l.set("sandbox.count").unwrap_err().contains("name=value"));
        assert!(l
            .set("sandbox.count=-1")
            .unwrap_err()
            .contains("whole number"));
    }

    #[test]
    fn a_keys_own_quotas_replace_the_servers_for_it_alone() {
        let mut server = Limits::default();
        server.set("sandbox.count=10").unwrap();
        let mut own = KeyQuotas::default();
        own.apply(&["sandbox.count=2".into(), "snapshot.count=900".into()])
            .unwrap();
        let l = server.for_key(&own);
        assert_eq!(l.max("sandbox.count"), 2);
        assert_eq!(l.max("snapshot.count"), 900);
        assert_eq!(l.max("volume.count"), 100);
        assert_eq!(server.max("sandbox.count"), 10);
        // `default` gives the key the server's quota back.
        own.apply(&["sandbox.count=default".into()]).unwrap();
        assert_eq!(server.for_key(&own).max("sandbox.count"), 10);
        // Every bad setting is named, and none is applied.
        let before = own.clone();
        let e = own
            .apply(&["sandbox.cores=1".into(), "volume.mib=lots".into()])
            .unwrap_err();
        assert!(e.contains("sandbox.cores") && e.contains("lots"), "{e}");
        assert_eq!(own, before);
        // Stored as a JSON object; names of a newer server are ignored.
        let stored: KeyQuotas =
            serde_json::from_str(r#"{"sandbox.count":3,"gpu.count":1}"#).unwrap();
        assert_eq!(server.for_key(&stored).max("sandbox.count"), 3);
    }

    #[test]
    fn a_request_passes_until_it_would_go_over() {
        let mut l = Limits::default();
        l.set("sandbox.memory_mib=4096").unwrap();
        let mut used = Usage::default();
        used.add_machine(2, 3072);
        let mut asked = Usage::default();
        asked.add_machine(1, 1024);
        assert_eq!(check(&l, &used, &asked), Ok(()));
        asked.add_machine(1, 1);
        let e = check(&l, &used, &asked).unwrap_err();
        assert_eq!(
            (e.quota.limit, e.max, e.used, e.asked),
            ("sandbox.memory_mib", 4096, 3072, 1025)
        );
        assert!(e.message().contains("4096 MiB"), "{}", e.message());
        // Over a lowered quota, what asks nothing of it still passes.
        l.set("sandbox.memory_mib=1").unwrap();
        let mut disk = Usage::default();
        disk.add("snapshot.count", 1);
        assert_eq!(check(&l, &used, &disk), Ok(()));
    }

    #[test]
    fn the_host_takes_a_machine_only_with_room_to_spare() {
        let r = Reserve::default();
        let free = Free {
            memory_total: 8192,
            memory_available: 4096,
            ram_dir_total: 4096,
            ram_dir_free: 4096,
            disk: 10_000,
        };
        assert_eq!(room_for(&free, 0, 1024, &r), Ok(()));
        let short = |f: Free, promised: u64| room_for(&f, promised, 1024, &r).unwrap_err();
        assert!(short(
            Free {
                memory_available: 700,
                ..free
            },
            0
        )
        .contains("memory available"));
        assert!(short(
            Free {
                ram_dir_free: 700,
                ..free
            },
            0
        )
        .contains("memory files"));
        assert!(short(Free { disk: 100, ..free }, 0).contains("disk"));
        // 4 x 8192 promised at most.
        assert_eq!(room_for(&free, 31 << 10, 1024, &r), Ok(()));
        assert!(short(free, (31 << 10) + 1).contains("promised"));
        // An unknown RAM directory is not checked.
        let unknown = Free {
            ram_dir_total: 0,
            ram_dir_free: 0,
            ..free
        };
        assert_eq!(room_for(&unknown, 0, 1024, &r), Ok(()));
    }

    #[test]
    fn the_headroom_a_node_publishes_is_what_it_admits() {
        let r = Reserve::default();
        let base = Free {
            memory_total: 8192,
            memory_available: 4096,
            ram_dir_total: 4096,
            ram_dir_free: 4096,
            disk: 10_000,
        };
        let frees = [
            base,
            Free {
                memory_available: 700,
                ..base
            },
            Free {
                ram_dir_free: 700,
                ..base
            },
            Free { disk: 100, ..base },
            Free {
                ram_dir_total: 0,
                ram_dir_free: 0,
                ..base
            },
        ];
        for free in frees {
            for promised in [0, 1024, 30 << 10, 32 << 10, 40 << 10] {
                let room = headroom(&free, promised, &r);
                for asked in [
                    256,
                    512,
                    1024,
                    2048,
                    4096,
                    1536 + (30 << 10) - promised.min(30 << 10),
                ] {
                    assert_eq!(
                        room_for(&free, promised, asked, &r).is_ok(),
                        asked <= room,
                        "{free:?} promised {promised} asked {asked} headroom {room}"
                    );
                }
            }
        }
        assert_eq!(headroom(&base, 0, &r), 32 << 10);
        assert_eq!(headroom(&base, 40 << 10, &r), 0);
    }

    #[test]
    fn bytes_round_up_to_mib() {
        assert_eq!(mib_of(0), 0);
        assert_eq!(mib_of(1), 1);
        assert_eq!(mib_of(1 << 20), 1);
        assert_eq!(mib_of((1 << 20) + 1), 2);
    }
}
