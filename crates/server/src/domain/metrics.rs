//! A sandbox's measured CPU and memory over time (`GET …/metrics`): the
//! meter's per-second vCPU readings gathered into 10-second readings, kept
//! a day, and hourly sums kept 30 days; answered in the buckets of a range.

use std::collections::VecDeque;

use serde_json::{json, Value};

use crate::domain::time::iso;

/// One reading covers this long.
pub(crate) const READING_MS: i64 = 10_000;
/// Readings are kept a day, hourly sums 30 days.
const READINGS_KEPT_MS: i64 = 86_400_000;
const HOUR_MS: i64 = 3_600_000;
const HOURS_KEPT: usize = 30 * 24;
const READINGS_MAX: usize = (READINGS_KEPT_MS / READING_MS) as usize;

/// The ranges a client may ask for: (name, span, bucket), as the product's
/// documentation lists them.
pub(crate) const RANGES: &[(&str, i64, i64)] = &[
    ("15m", 900_000, 10_000),
    ("1h", 3_600_000, 20_000),
    ("6h", 21_600_000, 120_000),
    ("24h", 86_400_000, 480_000),
    ("7d", 604_800_000, HOUR_MS),
    ("30d", 2_592_000_000, HOUR_MS),
];

pub(crate) fn range_of(name: &str) -> Option<(i64, i64)> {
    RANGES
        .iter()
        .find(|(n, ..)| *n == name)
        .map(|(_, span, step)| (*span, *step))
}

/// What was measured over some time: vCPU nanoseconds used over `ms` of
/// wall time, the busiest second, and memory (summed for an average, and
/// its peak).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct Sum {
    cpu_ns: u64,
    ms: i64,
    peak_ns_per_s: u64,
    mem_sum: u64,
    mem_n: u64,
    mem_peak: u64,
}

impl Sum {
    fn memory(&mut self, m: u64) {
        self.mem_sum += m;
        self.mem_n += 1;
        self.mem_peak = self.mem_peak.max(m);
    }

    fn add(&mut self, o: &Sum) {
        self.cpu_ns += o.cpu_ns;
        self.ms += o.ms;
        self.peak_ns_per_s = self.peak_ns_per_s.max(o.peak_ns_per_s);
        self.mem_sum += o.mem_sum;
        self.mem_n += o.mem_n;
        self.mem_peak = self.mem_peak.max(o.mem_peak);
    }

    /// The point's fields for a machine of `vcpu` vCPUs.
    fn fields(&self, vcpu: u32) -> (Value, Value, Value, Value, Value) {
        if self.ms <= 0 {
            return (
                Value::Null,
                Value::Null,
                Value::Null,
                Value::Null,
                Value::Null,
            );
        }
        let cores = self.cpu_ns as f64 / (self.ms as f64 * 1e6);
        let pct = |c: f64| (c / f64::from(vcpu.max(1)) * 100.0).clamp(0.0, 100.0);
        let round = |x: f64| (x * 100.0).round() / 100.0;
        let peak_cores = self.peak_ns_per_s as f64 / 1e9;
        let mem = (self.mem_n > 0).then(|| self.mem_sum / self.mem_n);
        (
            json!(round(pct(cores))),
            json!(round(cores)),
            json!(round(pct(peak_cores.max(cores)))),
            mem.map_or(Value::Null, Value::from),
            if self.mem_n > 0 {
                Value::from(self.mem_peak)
            } else {
                Value::Null
            },
        )
    }
}

/// One sandbox's readings.
#[derive(Debug, Default)]
pub(crate) struct Series {
    /// The reading being filled: its start and what it holds so far.
    open: Option<(i64, Sum)>,
    /// Closed readings, oldest first: (start, what they hold).
    readings: VecDeque<(i64, Sum)>,
    /// Hourly sums, oldest first: (hour start, sum).
    hours: VecDeque<(i64, Sum)>,
    /// The newest closed reading while the machine runs.
    latest: Option<(i64, Sum)>,
}

impl Series {
    /// Whether the open reading ends at `now` (the caller then measures the
    /// memory and passes it to [`Series::second`]).
    pub(crate) fn due(&self, now: i64) -> bool {
        self.open.is_none_or(|(start, _)| now >= start + READING_MS)
    }

    /// One second of a running machine, ending at `now`: `cpu_ns` used
    /// since the last one, and its memory when measured (it then belongs to
    /// the reading that closes).
    pub(crate) fn second(&mut self, now: i64, cpu_ns: u64, memory: Option<u64>) {
        let mut memory = memory;
        if let Some((start, mut sum)) = self.open.take() {
            if now >= start + READING_MS {
                if let Some(m) = memory.take() {
                    sum.memory(m);
                }
                self.close(start, sum);
            } else {
                self.open = Some((start, sum));
            }
        }
        let (start, mut sum) = self.open.take().unwrap_or((now, Sum::default()));
        sum.cpu_ns += cpu_ns;
        sum.ms += 1000;
        sum.peak_ns_per_s = sum.peak_ns_per_s.max(cpu_ns);
        if let Some(m) = memory {
            sum.memory(m);
        }
        self.open = Some((start, sum));
    }

    /// The machine stopped running (paused, stopped): what was measured so
    /// far is kept, and there is no latest reading until it runs again.
    pub(crate) fn idle(&mut self) {
        if let Some((start, sum)) = self.open.take() {
            if sum.ms > 0 {
                self.close(start, sum);
            }
        }
        self.latest = None;
    }

    fn close(&mut self, start: i64, sum: Sum) {
        self.readings.push_back((start, sum));
        while self.readings.len() > READINGS_MAX
            || self
                .readings
                .front()
                .is_some_and(|(s, _)| *s < start - READINGS_KEPT_MS)
        {
            self.readings.pop_front();
        }
        let hour = start - start.rem_euclid(HOUR_MS);
        match self.hours.back_mut() {
            Some((h, s)) if *h == hour => s.add(&sum),
            _ => self.hours.push_back((hour, sum)),
        }
        while self.hours.len() > HOURS_KEPT {
            self.hours.pop_front();
        }
        self.latest = Some((start, sum));
    }

    /// The answer for `range` at `now`: a point per bucket (fields null
    /// where nothing was measured) and the latest reading.
    pub(crate) fn answer(&self, now: i64, range: &str, vcpu: u32) -> Value {
        let (span, step) = range_of(range).unwrap_or((900_000, 10_000));
        let end = now - now.rem_euclid(step) + step;
        let begin = end - span;
        let buckets = (span / step) as usize;
        let mut sums = vec![Sum::default(); buckets];
        let source: Box<dyn Iterator<Item = &(i64, Sum)>> = if step >= HOUR_MS {
            Box::new(self.hours.iter())
        } else {
            Box::new(self.readings.iter())
        };
        for (start, sum) in source {
            if *start >= begin && *start < end {
                sums[((start - begin) / step) as usize].add(sum);
            }
        }
        let points: Vec<Value> = sums
            .iter()
            .enumerate()
            .map(|(i, s)| point(begin + i as i64 * step, s, vcpu))
            .collect();
        let latest = self
            .latest
            .as_ref()
            .map_or(Value::Null, |(start, s)| point(*start, s, vcpu));
        json!({
            "range": range,
            "stepSeconds": step / 1000,
            "latest": latest,
            "points": points,
        })
    }
}

fn point(at: i64, s: &Sum, vcpu: u32) -> Value {
    let (cpu_percent, cpu_cores, cpu_peak, mem, mem_peak) = s.fields(vcpu);
    json!({
        "at": iso(at),
        "cpuPercent": cpu_percent,
        "cpuCores": cpu_cores,
        "cpuPeakPercent": cpu_peak,
        "memoryBytes": mem,
        "memoryPeakBytes": mem_peak,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const T0: i64 = 1_700_000_000_000;

    /// `seconds` seconds from `from` of a machine using `ns` each second.
    fn run(s: &mut Series, from: i64, seconds: i64, ns: u64, mem: u64) {
        for i in 0..seconds {
            let now = from + i * 1000;
            let m = s.due(now).then_some(mem);
            s.second(now, ns, m);
        }
    }

    #[test]
    fn ten_seconds_make_a_reading_of_their_average_and_peak() {
        let mut s = Series::default();
        // One vCPU of two busy at half: 25 %.
        run(&mut s, T0, 11, 500_000_000, 100 << 20);
        let a = s.answer(T0 + 11_000, "15m", 2);
        assert_eq!(a["stepSeconds"], 10);
        assert_eq!(a["latest"]["cpuPercent"], 25.0);
        assert_eq!(a["latest"]["cpuCores"], 0.5);
        assert_eq!(a["latest"]["memoryBytes"], 100u64 << 20);
        assert_eq!(a["points"].as_array().unwrap().len(), 90);
        let measured: Vec<&Value> = a["points"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|p| !p["cpuPercent"].is_null())
            .collect();
        assert!(!measured.is_empty());
        assert!(measured.iter().all(|p| p["cpuPercent"] == 25.0));
    }

    #[test]
    fn the_peak_is_the_busiest_second() {
        let mut s = Series::default();
        run(&mut s, T0, 5, 0, 1);
        run(&mut s, T0 + 5_000, 1, 1_000_000_000, 1);
        run(&mut s, T0 + 6_000, 5, 0, 1);
        let l = &s.answer(T0 + 11_000, "15m", 1)["latest"];
        assert_eq!(l["cpuPercent"], 10.0);
        assert_eq!(l["cpuPeakPercent"], 100.0);
    }

    #[test]
    fn a_paused_machine_has_no_latest_but_keeps_its_points() {
        let mut s = Series::default();
        run(&mut s, T0, 25, 1_000_000_000, 7);
        s.idle();
        let a = s.answer(T0 + 60_000, "15m", 1);
        assert!(a["latest"].is_null());
        let busy = a["points"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|p| p["cpuPercent"] == 100.0)
            .count();
        assert!(busy >= 2, "{a}");
    }

    #[test]
    fn readings_older_than_a_day_go_and_hours_stay() {
        let mut s = Series::default();
        run(&mut s, T0, 20, 1_000_000_000, 7);
        run(&mut s, T0 + 2 * 86_400_000, 20, 0, 7);
        assert!(s.readings.iter().all(|(t, _)| *t >= T0 + 86_400_000));
        assert_eq!(s.hours.len(), 2);
        let week = s.answer(T0 + 2 * 86_400_000 + 30_000, "7d", 1);
        assert_eq!(week["stepSeconds"], 3600);
        let busy = week["points"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|p| p["cpuPercent"].as_f64().unwrap_or(0.0) > 50.0)
            .count();
        assert_eq!(busy, 1);
    }

    #[test]
    fn every_range_answers_its_buckets() {
        let s = Series::default();
        for (name, span, step) in RANGES {
            let a = s.answer(T0, name, 1);
            assert_eq!(a["points"].as_array().unwrap().len() as i64, span / step);
            assert!(a["points"][0]["cpuPercent"].is_null());
        }
        assert!(range_of("2h").is_none());
    }
}
