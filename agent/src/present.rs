//! How durations and times are shown to people and in JSON, in one place: compact human
//! durations (tables, finding summaries), seconds rounded to the millisecond (every `*_secs`
//! field), and RFC 3339 UTC timestamps. Pure.
use std::time::Duration;

use chrono::{DateTime, SecondsFormat, Utc};

/// Compact human duration: 850ms, 42s, 3m12s, 2h05m, 3d04h.
pub fn human(d: Duration) -> String {
    let mut out = Vec::with_capacity(8);
    push_human(&mut out, d);
    String::from_utf8_lossy(&out).into_owned()
}

/// [`human`] appended to `out`, without core::fmt (a table at 100k sockets has two per row).
pub fn push_human(out: &mut Vec<u8>, d: Duration) {
    fn num(out: &mut Vec<u8>, n: u64, unit: u8) {
        out.extend_from_slice(itoa::Buffer::new().format(n).as_bytes());
        out.push(unit);
    }
    /// The second figure: two digits.
    fn two(out: &mut Vec<u8>, n: u64, unit: u8) {
        out.extend_from_slice(&[b'0' + (n / 10 % 10) as u8, b'0' + (n % 10) as u8, unit]);
    }
    let s = d.as_secs();
    match s {
        0 => {
            num(out, u64::from(d.subsec_millis()), b'm');
            out.push(b's');
        }
        1..=59 => num(out, s, b's'),
        60..=3599 => {
            num(out, s / 60, b'm');
            two(out, s % 60, b's');
        }
        3600..=86399 => {
            num(out, s / 3600, b'h');
            two(out, (s % 3600) / 60, b'm');
        }
        _ => {
            num(out, s / 86400, b'd');
            two(out, (s % 86400) / 3600, b'h');
        }
    }
}

/// Seconds rounded to the millisecond: the value of every `*_secs` JSON field.
pub fn round_secs(d: Duration) -> f64 {
    (d.as_secs_f64() * 1000.0).round() / 1000.0
}

/// `#[serde(serialize_with = "present::secs")]` for a `Duration` shown as [`round_secs`].
pub fn secs<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_f64(round_secs(*d))
}

/// RFC 3339 UTC to the second (`2026-12-02T10:00:00Z`): alert and audit times.
pub fn rfc3339(t: DateTime<Utc>) -> String {
    t.to_rfc3339_opts(SecondsFormat::Secs, true)
}

/// RFC 3339 UTC to the millisecond (`2026-12-02T10:00:00.250Z`): poll and round times, which
/// are compared with each other.
pub fn rfc3339_ms(t: DateTime<Utc>) -> String {
    t.to_rfc3339_opts(SecondsFormat::Millis, true)
}

/// `#[serde(serialize_with = "present::ser_rfc3339")]` for a time shown as [`rfc3339`].
pub fn ser_rfc3339<S: serde::Serializer>(t: &DateTime<Utc>, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&rfc3339(*t))
}

/// [`ser_rfc3339`] for an optional time (None is null).
pub fn ser_rfc3339_opt<S: serde::Serializer>(
    t: &Option<DateTime<Utc>>,
    s: S,
) -> Result<S::Ok, S::Error> {
    match t {
        Some(t) => ser_rfc3339(t, s),
        None => s.serialize_none(),
    }
}

/// `#[serde(serialize_with = "present::ser_rfc3339_ms_opt")]`: an optional time as
/// [`rfc3339_ms`] (None is null).
pub fn ser_rfc3339_ms_opt<S: serde::Serializer>(
    t: &Option<DateTime<Utc>>,
    s: S,
) -> Result<S::Ok, S::Error> {
    match t {
        Some(t) => s.serialize_str(&rfc3339_ms(*t)),
        None => s.serialize_none(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn human_durations() {
        assert_eq!(human(Duration::from_millis(850)), "850ms");
        assert_eq!(human(Duration::from_secs(42)), "42s");
        assert_eq!(human(Duration::from_secs(192)), "3m12s");
        assert_eq!(human(Duration::from_secs(7500)), "2h05m");
        assert_eq!(human(Duration::from_secs(3 * 86400 + 4 * 3600)), "3d04h");
        assert_eq!(human(Duration::from_millis(7)), "7ms");
        assert_eq!(human(Duration::from_secs(60)), "1m00s");
        assert_eq!(human(Duration::from_secs(86399)), "23h59m");
        assert_eq!(human(Duration::from_secs(400 * 86400 + 3600)), "400d01h");
    }

    #[test]
    fn seconds_round_to_the_millisecond() {
        assert_eq!(round_secs(Duration::from_micros(1_234_567)), 1.235);
        assert_eq!(round_secs(Duration::from_micros(1_234_499)), 1.234);
        assert_eq!(round_secs(Duration::ZERO), 0.0);
    }

    #[test]
    fn rfc3339_in_utc() {
        let t = DateTime::from_timestamp_millis(1_796_205_600_250).unwrap();
        assert_eq!(rfc3339(t), "2026-12-02T10:00:00Z");
        assert_eq!(rfc3339_ms(t), "2026-12-02T10:00:00.250Z");
    }
}
