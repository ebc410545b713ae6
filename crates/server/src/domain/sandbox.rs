//! A new sandbox's record from the settings its create asked for. Pure:
//! the id and `now` come from the caller.

use std::collections::BTreeMap;

use runtime_api::{Sandbox, SandboxState};

use crate::domain::lease::lease_end;
use crate::domain::time::iso;

/// What a create asked for, checked (defaults filled in).
#[derive(Debug, Clone)]
pub(crate) struct Settings {
    pub name: Option<String>,
    pub labels: BTreeMap<String, String>,
    pub funding: String,
    pub vcpu: u32,
    pub memory_mib: u32,
    pub disk_mib: u32,
    pub cpu: String,
    pub cpu_floor_millis: u32,
    pub pausable: bool,
    pub timeout_seconds: Option<u32>,
    pub idle_pause_seconds: u32,
    pub auto_wake: bool,
    pub persistent: bool,
    pub on_lease_end: String,
    pub user: String,
    pub max_total_cost_micros: Option<i64>,
    pub max_cost_micros: Option<i64>,
}

/// The names of `env`, sorted, each once.
pub(crate) fn env_names(env: &[(String, String)]) -> Vec<String> {
    let mut names: Vec<String> = env.iter().map(|(k, _)| k.clone()).collect();
    names.sort();
    names.dedup();
    names
}

/// The record of a sandbox created at `now`: `starting`, its first lease
/// running from now.
pub(crate) fn new_record(s: Settings, id: String, env: &[(String, String)], now: i64) -> Sandbox {
    let ends_at = lease_end(s.timeout_seconds, now);
    Sandbox {
        id,
        kind: "sandbox".into(),
        name: s.name,
        labels: s.labels,
        status: SandboxState::Starting.status().into(),
        state: SandboxState::Starting,
        region: "local".into(),
        funding: s.funding,
        vcpu: s.vcpu,
        memory_mib: s.memory_mib,
        disk_mib: s.disk_mib,
        cpu: s.cpu,
        cpu_floor_millis: s.cpu_floor_millis,
        pausable: s.pausable,
        timeout_seconds: s.timeout_seconds,
        idle_pause_seconds: s.idle_pause_seconds,
        auto_wake: s.auto_wake,
        persistent: s.persistent,
        on_lease_end: s.on_lease_end,
        user: s.user,
        created_at: iso(now),
        ready_at: None,
        expires_at: ends_at.clone(),
        ends_at,
        ended_at: None,
        stop_reason: None,
        paused_at: None,
        paused_expires_at: None,
        retention_days: None,
        last_active_at: Some(iso(now)),
        charged_micros: 0,
        held_micros: 0,
        max_total_cost_micros: s.max_total_cost_micros,
        max_cost_micros: s.max_cost_micros,
        env_names: env_names(env),
        snapshot: None,
        secrets: None,
        image: None,
    }
}

/// What follows from a record's state, applied on every write: `status`
/// (or `deleted`), and no money held unless it runs (its lease is what holds).
pub(crate) fn follow_state(r: &mut Sandbox, deleted: bool) {
    r.status = if deleted {
        "deleted".into()
    } else {
        r.state.status().into()
    };
    if r.state != SandboxState::Running {
        r.held_micros = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_new_sandbox_starts_with_its_lease_from_now() {
        let s = Settings {
            name: Some("a".into()),
            labels: BTreeMap::new(),
            funding: "paid".into(),
            vcpu: 2,
            memory_mib: 4096,
            disk_mib: 4096,
            cpu: "shared".into(),
            cpu_floor_millis: 50,
            pausable: true,
            timeout_seconds: Some(60),
            idle_pause_seconds: 0,
            auto_wake: true,
            persistent: false,
            on_lease_end: "pause".into(),
            user: "sandbox".into(),
            max_total_cost_micros: None,
            max_cost_micros: None,
        };
        let env = vec![
            ("B".to_string(), "1".to_string()),
            ("A".into(), "2".into()),
            ("B".into(), "3".into()),
        ];
        let r = new_record(s, "id1".into(), &env, 0);
        assert_eq!(r.state, SandboxState::Starting);
        assert_eq!(r.status, "pending");
        assert_eq!(r.created_at, "1970-01-01T00:00:00.000Z");
        assert_eq!(r.ends_at.as_deref(), Some("1970-01-01T00:01:00.000Z"));
        assert_eq!(r.expires_at, r.ends_at);
        assert_eq!(r.env_names, ["A", "B"]);
        assert_eq!(
            r.last_active_at.as_deref(),
            Some("1970-01-01T00:00:00.000Z")
        );
    }

    #[test]
    fn status_and_holds_follow_the_state() {
        let mut r = new_record(
            Settings {
                name: None,
                labels: BTreeMap::new(),
                funding: "paid".into(),
                vcpu: 1,
                memory_mib: 512,
                disk_mib: 3072,
                cpu: "shared".into(),
                cpu_floor_millis: 50,
                pausable: true,
                timeout_seconds: None,
                idle_pause_seconds: 0,
                auto_wake: true,
                persistent: false,
                on_lease_end: "pause".into(),
                user: "sandbox".into(),
                max_total_cost_micros: None,
                max_cost_micros: None,
            },
            "s".into(),
            &[],
            0,
        );
        r.state = SandboxState::Running;
        r.held_micros = 7;
        follow_state(&mut r, false);
        assert_eq!((r.status.as_str(), r.held_micros), ("active", 7));
        r.state = SandboxState::Paused;
        follow_state(&mut r, false);
        assert_eq!((r.status.as_str(), r.held_micros), ("paused", 0));
        r.state = SandboxState::Stopped;
        follow_state(&mut r, true);
        assert_eq!(r.status, "deleted");
    }
}
