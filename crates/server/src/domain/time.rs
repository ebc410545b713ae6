//! Times on the wire: ISO 8601 UTC with milliseconds and `Z`, from and to
//! milliseconds since the epoch. Pure: reading the clock is the service's.

use time::OffsetDateTime;

/// ISO 8601 UTC with milliseconds and `Z`.
pub(crate) fn iso(ms: i64) -> String {
    let t = OffsetDateTime::from_unix_timestamp_nanos(ms as i128 * 1_000_000)
        .unwrap_or(OffsetDateTime::UNIX_EPOCH);
    format!(
        "{:04}-{:02}-{:02}T{:02}:{:02}:{:02}.{:03}Z",
        t.year(),
        u8::from(t.month()),
        t.day(),
        t.hour(),
        t.minute(),
        t.second(),
        t.millisecond()
    )
}

pub(crate) fn parse_iso_ms(s: &str) -> Option<i64> {
    let t = OffsetDateTime::parse(s, &time::format_description::well_known::Rfc3339).ok()?;
    Some((t.unix_timestamp_nanos() / 1_000_000) as i64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn iso_has_z_and_millis() {
        assert_eq!(iso(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(
            parse_iso_ms(&iso(1_700_000_000_123)),
            Some(1_700_000_000_123)
        );
        assert_eq!(parse_iso_ms("yesterday"), None);
    }
}
