//! Every sandbox's readings (`domain::metrics::Series`), fed by the meter's
//! per-second vCPU readings and the host's measure of each machine's
//! memory. Held in memory: a server restart starts them afresh. Bounded:
//! a series per live sandbox, each of a bounded length.

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;

use serde_json::Value;

use crate::domain::access::KeyInfo;
use crate::domain::metrics::{range_of, Series, RANGES};
use crate::error::{ApiError, ApiResult};
use crate::service::sandboxes;
use crate::AppState;

#[derive(Default)]
pub(crate) struct Metrics {
    series: Mutex<HashMap<String, Series>>,
}

impl Metrics {
    /// Whether a running machine's reading closes now (measure its memory).
    pub(crate) fn due(&self, id: &str, now: i64) -> bool {
        let m = self.series.lock().unwrap_or_else(|p| p.into_inner());
        m.get(id).is_none_or(|s| s.due(now))
    }

    pub(crate) fn second(&self, id: &str, now: i64, cpu_ns: u64, memory: Option<u64>) {
        let mut m = self.series.lock().unwrap_or_else(|p| p.into_inner());
        match m.get_mut(id) {
            Some(s) => s.second(now, cpu_ns, memory),
            None => m
                .entry(id.to_string())
                .or_default()
                .second(now, cpu_ns, memory),
        }
    }

    /// A machine that does not run (paused, stopped, starting).
    pub(crate) fn idle(&self, id: &str) {
        let mut m = self.series.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(s) = m.get_mut(id) {
            s.idle();
        }
    }

    /// Forgets the series of sandboxes no longer live.
    pub(crate) fn retain(&self, live: &HashSet<String>) {
        self.series
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|id, _| live.contains(id));
    }

    fn answer(&self, id: &str, now: i64, range: &str, vcpu: u32) -> Value {
        let m = self.series.lock().unwrap_or_else(|p| p.into_inner());
        match m.get(id) {
            Some(s) => s.answer(now, range, vcpu),
            None => Series::default().answer(now, range, vcpu),
        }
    }
}

/// `GET …/metrics?range`: the sandbox's readings over `range` (15m by
/// default), with its shape's limits beside them.
pub(crate) fn get(st: &AppState, key: &KeyInfo, id: &str, range: Option<&str>) -> ApiResult<Value> {
    let range = range.unwrap_or("15m");
    if range_of(range).is_none() {
        let names: Vec<&str> = RANGES.iter().map(|(n, ..)| *n).collect();
        return Err(ApiError::invalid(
            "range",
            format!("must be one of {}", names.join(", ")),
        ));
    }
    let row = sandboxes::find(st, key, id)?;
    let r = &row.record;
    let mut v = st.inner.metrics.answer(&r.id, st.now_ms(), range, r.vcpu);
    if let Value::Object(o) = &mut v {
        o.insert("sandboxId".into(), r.id.clone().into());
        o.insert(
            "state".into(),
            serde_json::to_value(r.state).unwrap_or(Value::Null),
        );
        o.insert("vcpu".into(), r.vcpu.into());
        o.insert(
            "memoryLimitBytes".into(),
            (u64::from(r.memory_mib) << 20).into(),
        );
        o.insert(
            "diskLimitBytes".into(),
            (u64::from(r.disk_mib) << 20).into(),
        );
    }
    Ok(v)
}
