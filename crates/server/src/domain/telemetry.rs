//! The operator's metrics: counters and latency histograms the server
//! bumps as it works, and their rendering in the Prometheus text format
//! (version 0.0.4) that `GET /metrics` answers. Lock-free (atomics), fixed
//! label sets, so a scrape costs the same however busy the server is and no
//! guest or key can grow them.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Upper bounds (seconds) of the latency buckets: from a restore under KVM
/// (milliseconds) to a cold boot under emulation (a minute).
pub(crate) const LATENCY_BUCKETS: [f64; 14] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
];

/// A cumulative count.
#[derive(Debug, Default)]
pub(crate) struct Counter(AtomicU64);

impl Counter {
    pub(crate) fn inc(&self) {
        self.add(1);
    }

    pub(crate) fn add(&self, n: u64) {
        self.0.fetch_add(n, Ordering::Relaxed);
    }

    pub(crate) fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// Durations in [`LATENCY_BUCKETS`], with their count and sum.
#[derive(Debug, Default)]
pub(crate) struct Histogram {
    buckets: [AtomicU64; LATENCY_BUCKETS.len()],
    count: AtomicU64,
    /// Microseconds, so the sum stays an integer add.
    sum_micros: AtomicU64,
}

impl Histogram {
    pub(crate) fn observe(&self, d: Duration) {
        let secs = d.as_secs_f64();
        // Each bucket counts what is at most its bound (the rendering's
        // buckets are cumulative, as Prometheus wants).
        for (b, bound) in self.buckets.iter().zip(LATENCY_BUCKETS) {
            if secs <= bound {
                b.fetch_add(1, Ordering::Relaxed);
            }
        }
        self.count.fetch_add(1, Ordering::Relaxed);
        let micros = u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
        self.sum_micros.fetch_add(micros, Ordering::Relaxed);
    }

    fn render(&self, out: &mut String, name: &str, labels: &str) {
        let sep = if labels.is_empty() { "" } else { "," };
        for (b, bound) in self.buckets.iter().zip(LATENCY_BUCKETS) {
            let _ = writeln!(
                out,
                "{name}_bucket{{{labels}{sep}le=\"{bound}\"}} {}",
                b.load(Ordering::Relaxed)
            );
        }
        let count = self.count.load(Ordering::Relaxed);
        let _ = writeln!(out, "{name}_bucket{{{labels}{sep}le=\"+Inf\"}} {count}");
        let sum = self.sum_micros.load(Ordering::Relaxed) as f64 / 1e6;
        let _ = writeln!(out, "{name}_sum{} {sum}", braces(labels));
        let _ = writeln!(out, "{name}_count{} {count}", braces(labels));
    }
}

fn braces(labels: &str) -> String {
    if labels.is_empty() {
        String::new()
    } else {
        format!("{{{labels}}}")
    }
}

/// How a machine operation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Outcome {
    Ok,
    Failed,
}

/// A count and a latency per outcome of one machine operation.
#[derive(Debug, Default)]
pub(crate) struct Timed {
    ok: Counter,
    failed: Counter,
    seconds: Histogram,
}

impl Timed {
    pub(crate) fn record(&self, outcome: Outcome, took: Duration) {
        match outcome {
            Outcome::Ok => self.ok.inc(),
            Outcome::Failed => self.failed.inc(),
        }
        self.seconds.observe(took);
    }
}

/// The HTTP answers' status classes, 1xx to 5xx.
const CLASSES: [&str; 5] = ["1xx", "2xx", "3xx", "4xx", "5xx"];

/// Error codes counted by name; anything else (there is nothing else today:
/// every code is a constant of `runtime-api`) counts as `other`, so the set
/// of series is fixed.
const MAX_CODES: usize = 96;

/// Every counter and histogram the server keeps. One per server, shared.
#[derive(Debug)]
pub(crate) struct Telemetry {
    pub sandboxes_created: Counter,
    /// Machines started from the image (a boot, or its pre-booted template).
    pub starts_image: Timed,
    /// Machines started from a capture (forks, snapshots, restarts of a
    /// kept state).
    pub starts_capture: Timed,
    /// Sandboxes started on a warm machine of the pool (its identity
    /// given, no restore).
    pub starts_warm: Timed,
    pub wakes: Timed,
    pub pauses: Timed,
    /// Commands started in guests, by kind (`exec`, `spawn`, `terminal`,
    /// the interpreter's `run`, ...).
    processes: Labelled,
    /// Answers by status class, and the time to their head.
    http_answers: [Counter; 5],
    pub http_seconds: Histogram,
    /// Refused or failed requests by error code.
    refusals: Labelled,
}

impl Default for Telemetry {
    fn default() -> Self {
        Telemetry {
            sandboxes_created: Counter::default(),
            starts_image: Timed::default(),
            starts_capture: Timed::default(),
            starts_warm: Timed::default(),
            wakes: Timed::default(),
            pauses: Timed::default(),
            processes: Labelled::new(16),
            http_answers: Default::default(),
            http_seconds: Histogram::default(),
            refusals: Labelled::new(MAX_CODES),
        }
    }
}

/// Counters by a label value from a small known set: a fixed number of
/// slots, each taken by the first value that needs it; values past the
/// last slot count under `other`.
#[derive(Debug)]
struct Labelled {
    slots: std::sync::Mutex<Vec<(&'static str, u64)>>,
    max: usize,
}

impl Labelled {
    fn new(max: usize) -> Self {
        Labelled {
            slots: std::sync::Mutex::new(Vec::new()),
            max,
        }
    }

    fn inc(&self, value: &'static str) {
        let mut slots = self.slots.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(s) = slots.iter_mut().find(|(v, _)| *v == value) {
            s.1 += 1;
            return;
        }
        let value = if slots.len() + 1 >= self.max {
            "other"
        } else {
            value
        };
        match slots.iter_mut().find(|(v, _)| *v == value) {
            Some(s) => s.1 += 1,
            None => slots.push((value, 1)),
        }
    }

    fn snapshot(&self) -> Vec<(&'static str, u64)> {
        let mut v = self.slots.lock().unwrap_or_else(|e| e.into_inner()).clone();
        v.sort_unstable();
        v
    }
}

/// What the server reads at scrape time rather than counts.
#[derive(Debug, Default, Clone)]
pub(crate) struct Gauges {
    /// Sandboxes not deleted, by state name.
    pub sandboxes: Vec<(String, u64)>,
    pub host: Option<HostGauges>,
    pub egress: Option<EgressGauges>,
    /// Seconds since the server started.
    pub uptime_seconds: f64,
    /// Warm machines ready in the pools, and the host memory they hold.
    pub warm_machines: u64,
    pub warm_bytes: u64,
}

/// The host's memory and space, in bytes.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct HostGauges {
    pub memory_total: u64,
    pub memory_available: u64,
    pub ram_dir_total: u64,
    pub ram_dir_free: u64,
    pub disk_free: u64,
}

/// The egress proxy's totals since the server started.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct EgressGauges {
    pub sent_bytes: u64,
    pub received_bytes: u64,
    pub connections: u64,
    pub connections_open: u64,
    pub refused: u64,
}

impl Telemetry {
    pub(crate) fn process_started(&self, kind: &'static str) {
        self.processes.inc(kind);
    }

    /// One HTTP answer: its status, the time to its head, and its error
    /// code when it is an error.
    pub(crate) fn answered(&self, status: u16, took: Duration, code: Option<&'static str>) {
        let class = usize::from(status / 100).clamp(1, 5) - 1;
        self.http_answers[class].inc();
        self.http_seconds.observe(took);
        if let Some(code) = code {
            self.refusals.inc(code);
        }
    }

    /// The text of `GET /metrics`.
    pub(crate) fn render(&self, g: &Gauges, version: &str) -> String {
        let mut o = String::with_capacity(8 * 1024);
        header(
            &mut o,
            "runtime_build_info",
            "gauge",
            "The server's version.",
        );
        let _ = writeln!(o, "runtime_build_info{{version=\"{}\"}} 1", escape(version));
        header(
            &mut o,
            "runtime_uptime_seconds",
            "gauge",
            "Seconds since the server started.",
        );
        let _ = writeln!(o, "runtime_uptime_seconds {}", g.uptime_seconds);

        header(
            &mut o,
            "runtime_sandboxes",
            "gauge",
            "Sandboxes not deleted, by state.",
        );
        for (state, n) in &g.sandboxes {
            let _ = writeln!(o, "runtime_sandboxes{{state=\"{}\"}} {n}", escape(state));
        }
        header(
            &mut o,
            "runtime_warm_machines",
            "gauge",
            "Warm machines ready in the pools (no sandbox's yet).",
        );
        let _ = writeln!(o, "runtime_warm_machines {}", g.warm_machines);
        header(
            &mut o,
            "runtime_warm_memory_bytes",
            "gauge",
            "Host memory the warm machines held when they were ready.",
        );
        let _ = writeln!(o, "runtime_warm_memory_bytes {}", g.warm_bytes);
        header(
            &mut o,
            "runtime_sandboxes_created_total",
            "counter",
            "Sandboxes created (creates and forks).",
        );
        let _ = writeln!(
            o,
            "runtime_sandboxes_created_total {}",
            self.sandboxes_created.get()
        );

        header(
            &mut o,
            "runtime_machine_starts_total",
            "counter",
            "Machines started, by what from (image, capture, or a warm machine of the pool) and result.",
        );
        for (from, t) in [
            ("image", &self.starts_image),
            ("capture", &self.starts_capture),
            ("pool", &self.starts_warm),
        ] {
            for (result, c) in [("ok", &t.ok), ("failed", &t.failed)] {
                let _ = writeln!(
                    o,
                    "runtime_machine_starts_total{{from=\"{from}\",result=\"{result}\"}} {}",
                    c.get()
                );
            }
        }
        header(
            &mut o,
            "runtime_machine_start_seconds",
            "histogram",
            "Time from asking the host for a machine until its agent answers.",
        );
        for (from, t) in [
            ("image", &self.starts_image),
            ("capture", &self.starts_capture),
            ("pool", &self.starts_warm),
        ] {
            t.seconds.render(
                &mut o,
                "runtime_machine_start_seconds",
                &format!("from=\"{from}\""),
            );
        }
        for (name, what, t) in [
            ("wake", "Wakes of paused sandboxes", &self.wakes),
            ("pause", "Pauses of running sandboxes", &self.pauses),
        ] {
            let total = format!("runtime_sandbox_{name}s_total");
            header(&mut o, &total, "counter", &format!("{what}, by result."));
            for (result, c) in [("ok", &t.ok), ("failed", &t.failed)] {
                let _ = writeln!(o, "{total}{{result=\"{result}\"}} {}", c.get());
            }
            let secs = format!("runtime_sandbox_{name}_seconds");
            header(
                &mut o,
                &secs,
                "histogram",
                &format!("{what}: how long each took."),
            );
            t.seconds.render(&mut o, &secs, "");
        }

        header(
            &mut o,
            "runtime_processes_started_total",
            "counter",
            "Commands started in guests, by kind.",
        );
        for (kind, n) in self.processes.snapshot() {
            let _ = writeln!(o, "runtime_processes_started_total{{kind=\"{kind}\"}} {n}");
        }

        header(
            &mut o,
            "runtime_http_responses_total",
            "counter",
            "API answers, by status class.",
        );
        for (class, c) in CLASSES.iter().zip(&self.http_answers) {
            let _ = writeln!(
                o,
                "runtime_http_responses_total{{class=\"{class}\"}} {}",
                c.get()
            );
        }
        header(
            &mut o,
            "runtime_http_response_seconds",
            "histogram",
            "Time from a request's arrival until its answer's head (a stream's body may go on).",
        );
        self.http_seconds
            .render(&mut o, "runtime_http_response_seconds", "");
        header(
            &mut o,
            "runtime_refusals_total",
            "counter",
            "Requests answered with an error, by the error's code.",
        );
        for (code, n) in self.refusals.snapshot() {
            let _ = writeln!(o, "runtime_refusals_total{{code=\"{code}\"}} {n}");
        }

        if let Some(e) = g.egress {
            header(
                &mut o,
                "runtime_egress_bytes_total",
                "counter",
                "What the egress proxy carried for guests, in bytes, by direction.",
            );
            let _ = writeln!(
                o,
                "runtime_egress_bytes_total{{direction=\"sent\"}} {}",
                e.sent_bytes
            );
            let _ = writeln!(
                o,
                "runtime_egress_bytes_total{{direction=\"received\"}} {}",
                e.received_bytes
            );
            header(
                &mut o,
                "runtime_egress_connections_total",
                "counter",
                "Outbound connections the egress proxy opened for guests.",
            );
            let _ = writeln!(o, "runtime_egress_connections_total {}", e.connections);
            header(
                &mut o,
                "runtime_egress_connections_open",
                "gauge",
                "Outbound connections open now.",
            );
            let _ = writeln!(o, "runtime_egress_connections_open {}", e.connections_open);
            header(
                &mut o,
                "runtime_egress_refused_total",
                "counter",
                "Outbound connections refused by a connection cap.",
            );
            let _ = writeln!(o, "runtime_egress_refused_total {}", e.refused);
        }

        if let Some(h) = g.host {
            for (name, help, v) in [
                (
                    "runtime_host_memory_total_bytes",
                    "The host's memory.",
                    h.memory_total,
                ),
                (
                    "runtime_host_memory_available_bytes",
                    "The host's available memory (MemAvailable).",
                    h.memory_available,
                ),
                (
                    "runtime_host_ram_dir_total_bytes",
                    "Size of the file system holding the guests' RAM files.",
                    h.ram_dir_total,
                ),
                (
                    "runtime_host_ram_dir_free_bytes",
                    "Free space for the guests' RAM files.",
                    h.ram_dir_free,
                ),
                (
                    "runtime_host_disk_free_bytes",
                    "Free space in the data directory's file system.",
                    h.disk_free,
                ),
            ] {
                header(&mut o, name, "gauge", help);
                let _ = writeln!(o, "{name} {v}");
            }
        }
        o
    }
}

fn header(o: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(o, "# HELP {name} {help}");
    let _ = writeln!(o, "# TYPE {name} {kind}");
}

/// A label value as the text format wants it.
fn escape(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn value(text: &str, series: &str) -> Option<f64> {
        text.lines()
            .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
    }

    #[test]
    fn histograms_are_cumulative_with_count_and_sum() {
        let t = Telemetry::default();
        t.wakes.record(Outcome::Ok, Duration::from_millis(40));
        t.wakes.record(Outcome::Ok, Duration::from_millis(300));
        t.wakes.record(Outcome::Failed, Duration::from_secs(200));
        let text = t.render(&Gauges::default(), "1.2.3");
        let b = |le: &str| {
            value(
                &text,
                &format!("runtime_sandbox_wake_seconds_bucket{{le=\"{le}\"}}"),
            )
        };
        assert_eq!(b("0.025"), Some(0.0));
        assert_eq!(b("0.05"), Some(1.0));
        assert_eq!(b("0.5"), Some(2.0));
        assert_eq!(b("120"), Some(2.0));
        assert_eq!(b("+Inf"), Some(3.0));
        assert_eq!(
            value(&text, "runtime_sandbox_wake_seconds_count"),
            Some(3.0)
        );
        assert_eq!(
            value(&text, "runtime_sandbox_wake_seconds_sum"),
            Some(200.34)
        );
        assert_eq!(
            value(&text, "runtime_sandbox_wakes_total{result=\"ok\"}"),
            Some(2.0)
        );
        assert_eq!(
            value(&text, "runtime_sandbox_wakes_total{result=\"failed\"}"),
            Some(1.0)
        );
    }

    #[test]
    fn answers_count_by_class_and_errors_by_code() {
        let t = Telemetry::default();
        t.answered(200, Duration::from_millis(1), None);
        t.answered(409, Duration::from_millis(1), Some("quota_exceeded"));
        t.answered(409, Duration::from_millis(1), Some("quota_exceeded"));
        t.answered(503, Duration::from_millis(1), Some("no_capacity"));
        let text = t.render(&Gauges::default(), "x");
        assert_eq!(
            value(&text, "runtime_http_responses_total{class=\"2xx\"}"),
            Some(1.0)
        );
        assert_eq!(
            value(&text, "runtime_http_responses_total{class=\"4xx\"}"),
            Some(2.0)
        );
        assert_eq!(
            value(&text, "runtime_http_responses_total{class=\"5xx\"}"),
            Some(1.0)
        );
        assert_eq!(
            value(&text, "runtime_refusals_total{code=\"quota_exceeded\"}"),
            Some(2.0)
        );
        assert_eq!(
            value(&text, "runtime_refusals_total{code=\"no_capacity\"}"),
            Some(1.0)
        );
    }

    #[test]
    fn label_sets_stay_bounded() {
        let l = Labelled::new(4);
        for v in ["a", "b", "c", "d", "e", "a"] {
            l.inc(v);
        }
        let s = l.snapshot();
        assert!(s.len() <= 4, "{s:?}");
        assert_eq!(s.iter().map(|(_, n)| n).sum::<u64>(), 6);
        assert!(s.contains(&("a", 2)));
        assert!(s.iter().any(|(v, _)| *v == "other"));
    }

    #[test]
    fn gauges_render_when_known_and_every_series_has_a_type() {
        let t = Telemetry::default();
        let g = Gauges {
            sandboxes: vec![("running".into(), 3), ("paused".into(), 1)],
            host: Some(HostGauges {
                memory_total: 100,
                memory_available: 40,
                ..HostGauges::default()
            }),
            egress: Some(EgressGauges {
                sent_bytes: 7,
                received_bytes: 9,
                ..EgressGauges::default()
            }),
            uptime_seconds: 1.5,
            warm_machines: 2,
            warm_bytes: 5 << 20,
        };
        let text = t.render(&g, "v\"1");
        assert_eq!(value(&text, "runtime_warm_machines"), Some(2.0));
        assert_eq!(
            value(&text, "runtime_warm_memory_bytes"),
            Some((5 << 20) as f64)
        );
        assert_eq!(
            value(&text, "runtime_sandboxes{state=\"running\"}"),
            Some(3.0)
        );
        assert_eq!(
            value(&text, "runtime_host_memory_available_bytes"),
            Some(40.0)
        );
        assert_eq!(
            value(&text, "runtime_egress_bytes_total{direction=\"received\"}"),
            Some(9.0)
        );
        assert!(text.contains("runtime_build_info{version=\"v\\\"1\"} 1"));
        // Every sample's family was declared with a TYPE line before it.
        let mut typed = std::collections::HashSet::new();
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                typed.insert(rest.split(' ').next().unwrap_or_default().to_string());
            } else if !line.starts_with('#') {
                let name = line.split(['{', ' ']).next().unwrap_or_default();
                let family = ["_bucket", "_sum", "_count"]
                    .iter()
                    .find_map(|s| name.strip_suffix(s).filter(|f| typed.contains(*f)))
                    .unwrap_or(name);
                assert!(typed.contains(family), "{name} has no TYPE");
            }
        }
        let without = t.render(&Gauges::default(), "v");
        assert!(!without.contains("runtime_host_memory_total_bytes"));
        assert!(!without.contains("runtime_egress_bytes_total"));
    }
}
