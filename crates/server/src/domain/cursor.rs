//! Opaque list cursors: base64url of a list's prefix and the sequence
//! number of the row the next page starts after.

use base64::Engine;

pub(crate) fn encode(prefix: &str, seq: i64) -> String {
    base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(format!("{prefix}{seq}"))
}

/// The position a cursor of [`encode`] with `prefix` names; `None` for
/// anything else.
pub(crate) fn decode(prefix: &str, c: &str) -> Option<i64> {
    let raw = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(c)
        .ok()?;
    let s = std::str::from_utf8(&raw).ok()?;
    s.strip_prefix(prefix)?
        .parse::<i64>()
        .ok()
        .filter(|n| *n > 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cursors_round_trip_and_refuse_anything_else() {
        for seq in [1, 42, i64::MAX] {
            assert_eq!(decode("e", &encode("e", seq)), Some(seq));
            assert_eq!(decode("seq:", &encode("seq:", seq)), Some(seq));
        }
        assert_eq!(decode("e", &encode("seq:", 7)), None);
        assert_eq!(decode("e", "42"), None);
        assert_eq!(decode("e", ""), None);
        assert_eq!(decode("e", &encode("e", 0)), None);
        assert_eq!(
            decode(
                "e",
                &base64::engine::general_purpose::URL_SAFE_NO_PAD.encode("d7")
            ),
            None
        );
    }
}
