//! Warm machines (docs/memory.md, "Warm machines"): per image and shape
//! that a create has used, a few machines restored from the shape's
//! template and running, that a create takes instead of restoring one.
//!
//! A warm machine's id is the id its sandbox gets: a create that takes one
//! records its sandbox under that id, and the machine's directory, RAM file
//! and cgroup are already its own. It has no record until then, so it is
//! never listed, counts against no key's quota, and is ended with the other
//! machines no record owns when the server starts after a crash
//! (`background::recover`'s sweep). Taking is a pop under a short lock;
//! refills run in owned tasks, one per pool at a time, never on a request's
//! path; a shutdown ends every warm machine.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;
use std::time::Duration;

use runtime_api::Sandbox;
use runtime_host::MachineSpec;

use crate::domain::pool;
use crate::AppState;

/// Every pool of this server.
#[derive(Default)]
pub(crate) struct Pools {
    pools: Mutex<HashMap<String, Pool>>,
}

/// One image and shape.
struct Pool {
    /// The machine of this pool, less what each machine gets for itself
    /// (its id; its hostname and CA come when a sandbox takes it).
    spec: MachineSpec,
    ready: VecDeque<Warm>,
    /// A refill task runs.
    filling: bool,
    /// What the last machine of this pool held once warm: the next one's
    /// estimate against the budget.
    last_bytes: Option<u64>,
    last_taken_ms: i64,
}

/// A running warm machine.
struct Warm {
    id: String,
    /// Its host memory when it was ready.
    bytes: u64,
}

/// How many times in a row a refill may fail before it stops (until the
/// next take).
const MAX_FAILURES: u32 = 3;
/// How long a refill waits for its shape's template to be built.
const TEMPLATE_WAIT: Duration = Duration::from_secs(600);
/// How long a refill waits after the take that started it: a restore is
/// CPU-heavy (under emulation most of a core for a few hundred ms), and the
/// take's own setup in its guest should not share the CPU with it.
const REFILL_DELAY: Duration = Duration::from_millis(300);

impl Pools {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Pool>> {
        self.pools.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Warm machines and the host memory they hold, for the metrics.
    pub(crate) fn gauges(&self) -> (u64, u64) {
        let pools = self.lock();
        let machines = pools.values().map(|p| p.ready.len() as u64).sum();
        (machines, used_bytes(&pools))
    }
}

fn used_bytes(pools: &HashMap<String, Pool>) -> u64 {
    pools
        .values()
        .flat_map(|p| p.ready.iter())
        .map(|w| w.bytes)
        .sum()
}

/// A warm machine a create took: ended again unless [`Taken::keep`] is
/// called (the create failed after taking it).
pub(crate) struct Taken {
    st: AppState,
    id: Option<String>,
}

impl Taken {
    pub(crate) fn id(&self) -> &str {
        self.id.as_deref().unwrap_or_default()
    }

    /// Its sandbox is recorded: the machine is the sandbox's now.
    pub(crate) fn keep(mut self) {
        self.id = None;
    }
}

impl Drop for Taken {
    fn drop(&mut self) {
        if let Some(id) = self.id.take() {
            let st = self.st.clone();
            st.clone().spawn(async move { end(&st, &id).await });
        }
    }
}

async fn end(st: &AppState, id: &str) {
    if let Err(e) = st.host().destroy(id).await {
        tracing::warn!(machine = id, error = %e, "ending a warm machine failed");
    }
}

/// Whether a new sandbox of `record` with `volumes` volumes may start on a
/// warm machine: it must need nothing that has to be there at boot (volume
/// drives) nor start from a capture.
pub(crate) fn fits(volumes: usize, snapshot: bool) -> bool {
    volumes == 0 && !snapshot
}

/// The warm machine of `record`'s image and shape, if its pool has one
/// (and starts a refill); `None` with the pool off or empty. Whatever the
/// answer, the pool of that image and shape exists from now on.
pub(crate) fn take(st: &AppState, record: &Sandbox) -> Option<Taken> {
    let target = st.config().warm_pool;
    if target == 0 {
        return None;
    }
    let spec = shape(st, record);
    let key = pool::key(
        spec.vcpu,
        spec.memory_mib,
        spec.disk_mib,
        spec.image.as_ref().map(|i| i.key.as_str()),
    );
    let now = st.now_ms();
    let taken = {
        let mut pools = st.inner.pools.lock();
        let p = pools.entry(key.clone()).or_insert_with(|| Pool {
            spec,
            ready: VecDeque::new(),
            filling: false,
            last_bytes: None,
            last_taken_ms: now,
        });
        p.last_taken_ms = now;
        p.ready.pop_front()
    };
    refill(st, &key);
    taken.map(|w| Taken {
        st: st.clone(),
        id: Some(w.id),
    })
}

/// The machine of `record`'s image and shape, before it is anyone's.
fn shape(st: &AppState, s: &Sandbox) -> MachineSpec {
    MachineSpec {
        id: String::new(),
        vcpu: s.vcpu,
        memory_mib: s.memory_mib,
        disk_mib: s.disk_mib,
        hostname: "sandbox".into(),
        guest_ca_pem: None,
        volumes: Vec::new(),
        image: s
            .image
            .as_deref()
            .and_then(|i| crate::service::images::disk_of(st, i)),
        no_template: false,
    }
}

/// Starts the refill of pool `key` unless one runs.
fn refill(st: &AppState, key: &str) {
    {
        let mut pools = st.inner.pools.lock();
        match pools.get_mut(key) {
            Some(p) if !p.filling => p.filling = true,
            _ => return,
        }
    }
    let st2 = st.clone();
    let key = key.to_owned();
    let span = tracing::info_span!("warm_pool", pool = %key);
    st.spawn(tracing::Instrument::instrument(
        async move { fill(&st2, &key).await },
        span,
    ));
}

/// Starts warm machines for pool `key`, one at a time, until it has its
/// size, the budget is reached, the host is short of memory, or the server
/// shuts down.
async fn fill(st: &AppState, key: &str) {
    let budget = st.config().warm_pool_memory_mib << 20;
    let target = st.config().warm_pool;
    let mut failures = 0;
    pause(st, REFILL_DELAY).await;
    let waiting_since = tokio::time::Instant::now();
    loop {
        // The next machine to start, or `None`: the refill is done.
        let next = {
            let mut pools = st.inner.pools.lock();
            let used = used_bytes(&pools);
            match pools.get_mut(key) {
                Some(p) if !st.inner.cancel.is_cancelled() => {
                    let estimate = p.last_bytes.unwrap_or(pool::FIRST_ESTIMATE_BYTES);
                    if pool::may_fill(p.ready.len(), target, used, estimate, budget) {
                        Some(MachineSpec {
                            id: uuid::Uuid::new_v4().to_string(),
                            ..p.spec.clone()
                        })
                    } else {
                        p.filling = false;
                        None
                    }
                }
                Some(p) => {
                    p.filling = false;
                    None
                }
                None => None,
            }
        };
        let Some(spec) = next else { return };
        let stop = if short_of_memory(st).await {
            tracing::info!("the host is short of memory: the pool starts nothing");
            true
        } else {
            match st.host().start_warm(&spec).await {
                Ok(true) => {
                    failures = 0;
                    let bytes = st.host().memory_bytes(&spec.id).await;
                    keep_warm(st, key, spec.id, bytes).await;
                    false
                }
                Ok(false) if waiting_since.elapsed() < TEMPLATE_WAIT => {
                    // No template of the shape yet: its first create built one.
                    pause(st, Duration::from_millis(500)).await;
                    false
                }
                Ok(false) => true,
                Err(e) => {
                    tracing::warn!(error = %e, "starting a warm machine failed");
                    end(st, &spec.id).await;
                    failures += 1;
                    pause(st, Duration::from_secs(2)).await;
                    failures >= MAX_FAILURES
                }
            }
        };
        if stop {
            if let Some(p) = st.inner.pools.lock().get_mut(key) {
                p.filling = false;
            }
            return;
        }
    }
}

/// Adds the ready machine `id` to pool `key`, or ends it when the pool is
/// gone or the server shuts down.
async fn keep_warm(st: &AppState, key: &str, id: String, bytes: Option<u64>) {
    let unwanted = {
        let mut pools = st.inner.pools.lock();
        match pools.get_mut(key) {
            Some(p) if !st.inner.cancel.is_cancelled() => {
                let bytes = bytes.unwrap_or(pool::FIRST_ESTIMATE_BYTES);
                p.last_bytes = Some(bytes);
                tracing::info!(machine = %id, mib = bytes >> 20, "warm machine ready");
                p.ready.push_back(Warm { id, bytes });
                None
            }
            _ => Some(id),
        }
    };
    if let Some(id) = unwanted {
        end(st, &id).await;
    }
}

/// Waits `d`, or less when the server shuts down.
async fn pause(st: &AppState, d: Duration) {
    tokio::select! {
        _ = tokio::time::sleep(d) => {}
        _ = st.inner.cancel.cancelled() => {}
    }
}

async fn short_of_memory(st: &AppState) -> bool {
    crate::service::quotas::host_free(st)
        .await
        .is_some_and(|free| pool::under_pressure(&free, &st.config().reserve))
}

/// The reaper's look at the pools: under memory pressure every warm machine
/// ends; a pool nobody took from for a while ends with its machines.
pub(crate) async fn tend(st: &AppState) {
    let pressure = short_of_memory(st).await;
    let now = st.now_ms();
    let ended: Vec<String> = {
        let mut pools = st.inner.pools.lock();
        let mut ended = Vec::new();
        pools.retain(|_, p| {
            let idle = pool::idle(p.last_taken_ms, now);
            if pressure || idle {
                ended.extend(p.ready.drain(..).map(|w| w.id));
            }
            // A refill of a pool that is gone ends what it started.
            !idle
        });
        ended
    };
    if !ended.is_empty() {
        tracing::info!(
            machines = ended.len(),
            pressure,
            "ending warm machines (memory pressure or unused)"
        );
    }
    for id in ended {
        end(st, &id).await;
    }
}

/// At shutdown: every warm machine ends (refills have stopped).
pub(crate) async fn drain(st: &AppState) {
    let ended: Vec<String> = {
        let mut pools = st.inner.pools.lock();
        pools
            .drain()
            .flat_map(|(_, p)| p.ready.into_iter().map(|w| w.id))
            .collect()
    };
    for id in ended {
        end(st, &id).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_create_that_needs_nothing_at_boot_takes_a_warm_machine() {
        assert!(fits(0, false));
        assert!(!fits(1, false));
        assert!(!fits(0, true));
    }
}
