//! The wall clock the service reads.

use time::OffsetDateTime;

use crate::domain::time::iso;

pub fn now_ms() -> i64 {
    (OffsetDateTime::now_utc().unix_timestamp_nanos() / 1_000_000) as i64
}

pub fn now_iso() -> String {
    iso(now_ms())
}
