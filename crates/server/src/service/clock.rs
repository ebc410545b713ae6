//! The clock the service reads. Leases, idle pauses, retention and the
//! meter all take their `now` from [`Clock::now_ms`] through the server's
//! state, so tests can run them on tokio's paused time
//! (`tokio::time::pause`/`advance`) instead of sleeping.

use time::OffsetDateTime;

use crate::domain::time::iso;

/// Where "now" comes from.
#[derive(Debug, Clone, Copy)]
pub enum Clock {
    /// The system's wall clock.
    System,
    /// A wall clock that moves with tokio's clock from `epoch_ms` at
    /// `start`: under `tokio::time::pause` it moves only when time is advanced.
    Tokio {
        epoch_ms: i64,
        start: tokio::time::Instant,
    },
}

impl Clock {
    /// A clock that reads `epoch_ms` now and then follows tokio's time.
    pub fn following_tokio(epoch_ms: i64) -> Clock {
        Clock::Tokio {
            epoch_ms,
            start: tokio::time::Instant::now(),
        }
    }

    /// Milliseconds since the Unix epoch.
    pub fn now_ms(&self) -> i64 {
        match self {
            Clock::System => now_ms(),
            Clock::Tokio { epoch_ms, start } => {
                let since = tokio::time::Instant::now().saturating_duration_since(*start);
                epoch_ms.saturating_add(i64::try_from(since.as_millis()).unwrap_or(i64::MAX))
            }
        }
    }
}

/// The system's wall clock, for code that has no server state at hand (the
/// operator's key commands).
pub(crate) fn now_ms() -> i64 {
    (OffsetDateTime::now_utc().unix_timestamp_nanos() / 1_000_000) as i64
}

pub(crate) fn now_iso() -> String {
    iso(now_ms())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_tokio_clock_moves_only_with_tokio_time() {
        let c = Clock::following_tokio(1_000);
        assert_eq!(c.now_ms(), 1_000);
        tokio::time::advance(std::time::Duration::from_millis(2_500)).await;
        assert_eq!(c.now_ms(), 3_500);
    }

    #[test]
    fn the_system_clock_is_now() {
        let before = now_ms();
        let c = Clock::System.now_ms();
        assert!(c >= before && c - before < 60_000);
    }
}
