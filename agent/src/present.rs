//! How durations and times are shown to people and in JSON, in one place: compact human
//! durations (tables, finding summaries), seconds rounded to the millisecond (every `*_secs`
//! field), and RFC 3339 UTC timestamps. Pure.
use std::time::Duration;

use chrono::{DateTime, SecondsFormat, Utc};

/// Compact human duration: 850ms, 42s, 3m12s, 2h05m, 3d04h.
pub fn human(d: Duration) -> String {
    let s = d.as_secs();
    match s {
        0 => format!("{}ms", d.subsec_millis()),
        1..=59 => format!("{s}s"),
        60..=3599 => format!("{}m{:02}s", s / 60, s % 60),
        3600..=86399 => format!("{}h{:02}m", s / 3600, (s % 3600) / 60),
        _ => format!("{}d{:02}h", s / 86400, (s % 86400) / 3600),
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
