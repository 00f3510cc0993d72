//! Human-friendly config values: durations with a mandatory unit ("500ms",
//! "30s", "24h") and byte sizes ("1MiB", "64KiB", or a plain byte count).
//!
//! A bare number is an error for durations (is "30" seconds or millis?), the
//! same rule linkerd uses; only "0" may omit the unit.

use serde::de::{self, Deserializer, Visitor};
use std::fmt;
use std::time::Duration;

/// A duration parsed from a string such as `"30s"`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct HumanDuration(pub Duration);

/// A byte size parsed from `"1MiB"`, `"512KiB"`, `"10MB"` or an integer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct ByteSize(pub u64);

/// Longer than any sensible ttl, and far from overflowing a deadline.
const MAX_DURATION_MS: u64 = 365 * 86_400_000;

/// Parses `<digits><unit>` where unit is one of ms, s, m, h, d.
pub fn parse_duration(input: &str) -> Result<Duration, String> {
    let s = input.trim();
    if s == "0" {
        return Ok(Duration::ZERO);
    }
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (digits, unit) = s.split_at(split);
    if digits.is_empty() {
        return Err(format!(
            "invalid duration {input:?}: expected a whole number followed by a unit (ms, s, m, h, d), e.g. \"30s\""
        ));
    }
    let n: u64 = digits
        .parse()
        .map_err(|_| format!("invalid duration {input:?}: number too large"))?;
    let millis_per_unit: u64 = match unit {
        "ms" => 1,
        "s" => 1_000,
        "m" => 60_000,
        "h" => 3_600_000,
        "d" => 86_400_000,
        "" => {
            return Err(format!(
                "invalid duration {input:?}: a unit is required (ms, s, m, h, d), e.g. \"{n}s\""
            ))
        }
        other => {
            return Err(format!(
                "invalid duration {input:?}: unknown unit {other:?} (use ms, s, m, h or d)"
            ))
        }
    };
    let millis = n
        .checked_mul(millis_per_unit)
        .filter(|&ms| ms <= MAX_DURATION_MS)
        .ok_or_else(|| format!("invalid duration {input:?}: at most 365d"))?;
    Ok(Duration::from_millis(millis))
}

/// Parses a size: an integer byte count, or a number with B, KB, MB, GB
/// (powers of 1000) or KiB, MiB, GiB (powers of 1024).
pub fn parse_size(input: &str) -> Result<u64, String> {
    let s = input.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (digits, unit) = s.split_at(split);
    if digits.is_empty() {
        return Err(format!(
            "invalid size {input:?}: expected a whole number of bytes, optionally with a unit (KiB, MiB, GiB, KB, MB, GB), e.g. \"1MiB\""
        ));
    }
    let n: u64 = digits
        .parse()
        .map_err(|_| format!("invalid size {input:?}: number too large"))?;
    let factor: u64 = match unit.trim() {
        "" | "B" => 1,
        "KB" => 1_000,
        "MB" => 1_000_000,
        "GB" => 1_000_000_000,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        other => {
            return Err(format!(
            "invalid size {input:?}: unknown unit {other:?} (use B, KiB, MiB, GiB, KB, MB or GB)"
        ))
        }
    };
    n.checked_mul(factor)
        .ok_or_else(|| format!("invalid size {input:?}: too large"))
}

/// Formats a duration the way the config accepts it, for `check-config`.
pub fn format_duration(d: Duration) -> String {
    let ms = d.as_millis();
    for (unit, per) in [
        ("d", 86_400_000u128),
        ("h", 3_600_000),
        ("m", 60_000),
        ("s", 1_000),
    ] {
        if ms >= per && ms.is_multiple_of(per) {
            return format!("{}{unit}", ms / per);
        }
    }
    if ms == 0 {
        "0".to_string()
    } else {
        format!("{ms}ms")
    }
}

/// Formats a size the way the config accepts it, for `check-config`.
pub fn format_size(n: u64) -> String {
    for (unit, per) in [("GiB", 1u64 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)] {
        if n >= per && n.is_multiple_of(per) {
            return format!("{}{unit}", n / per);
        }
    }
    n.to_string()
}

// === impl HumanDuration ===

impl<'de> de::Deserialize<'de> for HumanDuration {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = HumanDuration;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a duration string with a unit, e.g. \"30s\"")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<HumanDuration, E> {
                parse_duration(v).map(HumanDuration).map_err(E::custom)
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<HumanDuration, E> {
                if v == 0 {
                    Ok(HumanDuration(Duration::ZERO))
                } else {
                    Err(E::custom(format!(
                        "invalid duration {v}: a unit is required, e.g. \"{v}s\""
                    )))
                }
            }
        }
        d.deserialize_any(V)
    }
}

// === impl ByteSize ===

impl<'de> de::Deserialize<'de> for ByteSize {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = ByteSize;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a size such as \"1MiB\" or a number of bytes")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<ByteSize, E> {
                parse_size(v).map(ByteSize).map_err(E::custom)
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<ByteSize, E> {
                u64::try_from(v)
                    .map(ByteSize)
                    .map_err(|_| E::custom(format!("invalid size {v}: must not be negative")))
            }
        }
        d.deserialize_any(V)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_follow_the_grammar() {
        let ok = [
            ("500ms", 500),
            ("30s", 30_000),
            ("2m", 120_000),
            ("24h", 86_400_000),
            ("1d", 86_400_000),
            ("0", 0),
            (" 5s ", 5_000),
        ];
        for (input, ms) in ok {
            assert_eq!(
                parse_duration(input),
                Ok(Duration::from_millis(ms)),
                "{input}"
            );
        }
        for bad in [
            "",
            "30",
            "s",
            "1.5s",
            "-1s",
            "10 parsecs",
            "5sec",
            "99999999999999999999s",
        ] {
            assert!(parse_duration(bad).is_err(), "{bad:?} should be rejected");
        }
    }

    #[test]
    fn duration_without_unit_names_the_fix() {
        let err = parse_duration("30").unwrap_err();
        assert!(err.contains("\"30s\""), "{err}");
    }

    #[test]
    fn sizes_follow_the_grammar() {
        let ok = [
            ("1MiB", 1 << 20),
            ("64KiB", 64 << 10),
            ("2GiB", 2 << 30),
            ("10MB", 10_000_000),
            ("1KB", 1_000),
            ("123", 123),
            ("123B", 123),
        ];
        for (input, n) in ok {
            assert_eq!(parse_size(input), Ok(n), "{input}");
        }
        for bad in ["", "MiB", "1.5MiB", "1 parsec", "-1"] {
            assert!(parse_size(bad).is_err(), "{bad:?} should be rejected");
        }
    }

    #[test]
    fn formatting_round_trips() {
        for d in ["500ms", "30s", "2m", "25h", "2d", "1500ms"] {
            assert_eq!(format_duration(parse_duration(d).unwrap()), d);
        }
        for s in ["1MiB", "64KiB", "1000"] {
            assert_eq!(format_size(parse_size(s).unwrap()), s);
        }
    }
}
