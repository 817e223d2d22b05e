//! The range every duration and number in the configuration must be in. A value outside it is
//! a config error (exit 78) rather than a panic, a hot loop or a silent no-op in the daemon:
//! an overflowing `close_wait_min_age * 10`, a zero-period poll timer, a NaN rate.
//! `connreap.example.toml` documents each range next to its key; a unit test keeps them equal.
use std::time::Duration;

use super::{keys::KeyPath, size::ByteSize};

/// A closed range `min..=max` of a configuration value, and the key it is documented under
/// (`table.key`; `quota.key` and `policy.key` for keys of every entry).
pub(super) struct Range<T> {
    pub(super) key: &'static str,
    pub(super) min: T,
    pub(super) max: T,
}

const fn secs(s: u64) -> Duration {
    Duration::from_secs(s)
}
const fn ms(m: u64) -> Duration {
    Duration::from_millis(m)
}
const MINUTE: u64 = 60;
const HOUR: u64 = 60 * MINUTE;
const DAY: u64 = 24 * HOUR;
const KIB: u64 = 1024;
const MIB: u64 = 1024 * KIB;

/// The largest count (quota `used`/`limit`) connreap accepts: 2^53, the largest integer every
/// JSON parser (and an f64 fill ratio) holds exactly.
pub const MAX_COUNT: u64 = 1 << 53;

pub(super) const SCAN_INTERVAL: Range<Duration> = Range {
    key: "agent.scan_interval",
    min: ms(100),
    max: secs(HOUR),
};
pub(super) const NETNS_WALK_INTERVAL: Range<Duration> = Range {
    key: "agent.netns_walk_interval",
    min: secs(0),
    max: secs(HOUR),
};
pub(super) const CLOSE_WAIT_MIN_AGE: Range<Duration> = Range {
    key: "detect.close_wait_min_age",
    min: secs(0),
    max: secs(7 * DAY),
};
pub(super) const CLOSE_WAIT_THRESHOLD: Range<u64> = Range {
    key: "detect.close_wait_threshold",
    min: 1,
    max: 1_000_000,
};
pub(super) const STUCK_PAIR_MIN_IDLE: Range<Duration> = Range {
    key: "detect.stuck_pair_min_idle",
    min: secs(0),
    max: secs(30 * DAY),
};
pub(super) const IDLE_ESTABLISHED_MIN_IDLE: Range<Duration> = Range {
    key: "detect.idle_established_min_idle",
    min: secs(0),
    max: secs(30 * DAY),
};
pub(super) const IDLE_ESTABLISHED_THRESHOLD: Range<u64> = Range {
    key: "detect.idle_established_threshold",
    min: 1,
    max: 1_000_000,
};
pub(super) const STUCK_PAIR_THRESHOLD: Range<u64> = Range {
    key: "detect.stuck_pair_threshold",
    min: 1,
    max: 1_000_000,
};
pub(super) const QUOTA_IDLE_MIN: Range<Duration> = Range {
    key: "detect.quota_idle_min",
    min: secs(0),
    max: secs(30 * DAY),
};
pub(super) const STORM_RATE: Range<f64> = Range {
    key: "detect.storm_rate",
    min: 0.001,
    max: 1_000_000.0,
};
pub(super) const STORM_GROWTH_WINDOWS: Range<u64> = Range {
    key: "detect.storm_growth_windows",
    min: 0,
    max: 100,
};
pub(super) const FAILING_WINDOW: Range<Duration> = Range {
    key: "detect.failing_window",
    min: secs(5),
    max: secs(HOUR),
};
pub(super) const FAILING_MIN_FAILURES: Range<u64> = Range {
    key: "detect.failing_min_failures",
    min: 1,
    max: 1_000_000,
};
pub(super) const FAILING_SHARE: Range<f64> = Range {
    key: "detect.failing_share",
    min: 0.01,
    max: 1.0,
};
pub(super) const FAILING_SHORT_LIFETIME: Range<Duration> = Range {
    key: "detect.failing_short_lifetime",
    min: ms(1),
    max: secs(10),
};
pub(super) const REPEAT_INTERVAL: Range<Duration> = Range {
    key: "alerts.repeat_interval",
    min: secs(1),
    max: secs(30 * DAY),
};
pub(super) const RENOTIFY_INTERVAL: Range<Duration> = Range {
    key: "alerts.renotify_interval",
    min: secs(1),
    max: secs(30 * DAY),
};
/// Alertmanager forgets an alert at its endsAt (four of these ahead): a day at most.
pub(super) const ALERTMANAGER_RESEND: Range<Duration> = Range {
    key: "alerts.alertmanager_resend",
    min: secs(1),
    max: secs(DAY),
};
pub(super) const QUEUE_CAPACITY: Range<u64> = Range {
    key: "alerts.queue_capacity",
    min: 1,
    max: 1_000_000,
};
/// At least a second: a receiver that is down must not be retried in a hot loop.
pub(super) const MAX_BACKOFF: Range<Duration> = Range {
    key: "alerts.max_backoff",
    min: secs(1),
    max: secs(DAY),
};
pub(super) const ALERTS_TIMEOUT: Range<Duration> = Range {
    key: "alerts.timeout",
    min: ms(100),
    max: secs(5 * MINUTE),
};
pub(super) const POLL_INTERVAL: Range<Duration> = Range {
    key: "quota.poll_interval",
    min: ms(100),
    max: secs(HOUR),
};
pub(super) const QUOTA_TIMEOUT: Range<Duration> = Range {
    key: "quota.timeout",
    min: ms(100),
    max: secs(5 * MINUTE),
};
pub(super) const QUOTA_LIMIT: Range<u64> = Range {
    key: "quota.limit",
    min: 1,
    max: MAX_COUNT,
};
pub(super) const MAX_BODY: Range<ByteSize> = Range {
    key: "quota.max_body",
    min: ByteSize(KIB),
    max: ByteSize(64 * MIB),
};
pub(super) const MIN_IDLE: Range<Duration> = Range {
    key: "policy.min_idle",
    min: secs(0),
    max: secs(30 * DAY),
};
pub(super) const MIN_AGE: Range<Duration> = Range {
    key: "policy.min_age",
    min: secs(0),
    max: secs(30 * DAY),
};
pub(super) const MAX_PER_ROUND: Range<u64> = Range {
    key: "policy.max_per_round",
    min: 1,
    max: 10_000,
};

/// Default `quota.max_body`: a status document is a few KB; 1 MiB leaves room for thousands
/// of entries and keeps a misbehaving source from filling the agent's memory.
pub const DEFAULT_MAX_BODY: ByteSize = ByteSize(MIB);

/// A value type with a range: how it is compared and shown.
pub(super) trait Value: Copy + PartialOrd {
    fn show(self) -> String;
    /// False for values outside every range (NaN, infinities).
    fn comparable(self) -> bool {
        true
    }
}

impl Value for Duration {
    fn show(self) -> String {
        humantime::format_duration(self).to_string()
    }
}
impl Value for u64 {
    fn show(self) -> String {
        self.to_string()
    }
}
impl Value for f64 {
    fn show(self) -> String {
        self.to_string()
    }
    fn comparable(self) -> bool {
        self.is_finite()
    }
}
impl Value for ByteSize {
    fn show(self) -> String {
        self.to_string()
    }
}

type Checked = Result<(), (KeyPath, String)>;

impl<T: Value> Range<T> {
    /// How the range reads in messages and in the example file: `100ms to 1h`.
    pub(super) fn describe(&self) -> String {
        format!("{} to {}", self.min.show(), self.max.show())
    }

    fn check(&self, key: KeyPath, value: T) -> Checked {
        if value.comparable() && value >= self.min && value <= self.max {
            return Ok(());
        }
        Err((
            key,
            format!("must be from {} (got {})", self.describe(), value.show()),
        ))
    }

    /// Checks the value of a top-level key (`agent.scan_interval`).
    pub(super) fn top(&self, value: T) -> Checked {
        let key = self
            .key
            .split('.')
            .fold(KeyPath::default(), |path, k| path.key(k));
        self.check(key, value)
    }

    /// Checks the value of this key in the `[[quota]]` or `[[policy]]` entry `entry`.
    pub(super) fn within(&self, entry: &KeyPath, value: T) -> Checked {
        let key = self.key.split_once('.').map_or(self.key, |(_, k)| k);
        self.check(entry.clone().key(key), value)
    }
}

/// Every range with its description, for the example-file test.
#[cfg(test)]
pub(super) fn all() -> Vec<(&'static str, String)> {
    fn d<T: Value>(r: &Range<T>) -> (&'static str, String) {
        (r.key, r.describe())
    }
    vec![
        d(&SCAN_INTERVAL),
        d(&NETNS_WALK_INTERVAL),
        d(&CLOSE_WAIT_MIN_AGE),
        d(&CLOSE_WAIT_THRESHOLD),
        d(&STUCK_PAIR_MIN_IDLE),
        d(&IDLE_ESTABLISHED_MIN_IDLE),
        d(&IDLE_ESTABLISHED_THRESHOLD),
        d(&STUCK_PAIR_THRESHOLD),
        d(&QUOTA_IDLE_MIN),
        d(&STORM_RATE),
        d(&STORM_GROWTH_WINDOWS),
        d(&FAILING_WINDOW),
        d(&FAILING_MIN_FAILURES),
        d(&FAILING_SHARE),
        d(&FAILING_SHORT_LIFETIME),
        d(&REPEAT_INTERVAL),
        d(&RENOTIFY_INTERVAL),
        d(&ALERTMANAGER_RESEND),
        d(&QUEUE_CAPACITY),
        d(&MAX_BACKOFF),
        d(&ALERTS_TIMEOUT),
        d(&POLL_INTERVAL),
        d(&QUOTA_TIMEOUT),
        d(&QUOTA_LIMIT),
        d(&MAX_BODY),
        d(&MIN_IDLE),
        d(&MIN_AGE),
        d(&MAX_PER_ROUND),
    ]
}
