//! The range every duration and number in the configuration must be in, and how a range is
//! checked and shown. A value outside it is a config error (exit 78) rather than a panic, a
//! hot loop or a silent no-op in the daemon: an overflowing `close_wait_min_age * 10`, a
//! zero-period poll timer, a NaN rate. Each key's range is declared with the key (see
//! `decl.rs`); the example file and the docs are generated from those declarations.
use std::time::Duration;

use super::{keys::KeyPath, size::ByteSize};

/// A range `min..=max` of a configuration value (`(min, max]` when `open`).
pub(super) struct Range<T> {
    pub(super) min: T,
    pub(super) max: T,
    /// `min` itself is outside.
    pub(super) open: bool,
}

impl<T> Range<T> {
    pub(super) const fn closed(min: T, max: T) -> Self {
        Range {
            min,
            max,
            open: false,
        }
    }
    pub(super) const fn above(min: T, max: T) -> Self {
        Range {
            min,
            max,
            open: true,
        }
    }
}

pub(super) const fn secs(s: u64) -> Duration {
    Duration::from_secs(s)
}
pub(super) const fn ms(m: u64) -> Duration {
    Duration::from_millis(m)
}
pub(super) const MINUTE: u64 = 60;
pub(super) const HOUR: u64 = 60 * MINUTE;
pub(super) const DAY: u64 = 24 * HOUR;
pub(super) const KIB: u64 = 1024;
pub(super) const MIB: u64 = 1024 * KIB;

/// The largest count (quota `used`/`limit`) connreap accepts: 2^53, the largest integer every
/// JSON parser (and an f64 fill ratio) holds exactly.
pub const MAX_COUNT: u64 = 1 << 53;

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

impl<T: Value> Range<T> {
    /// How the range reads in messages and in the example file: `100ms to 1h`, `(0, 1]`.
    pub(super) fn describe(&self) -> String {
        if self.open {
            format!("({}, {}]", self.min.show(), self.max.show())
        } else {
            format!("{} to {}", self.min.show(), self.max.show())
        }
    }

    pub(super) fn check(&self, key: KeyPath, value: T) -> Result<(), (KeyPath, String)> {
        let above_min = if self.open {
            value > self.min
        } else {
            value >= self.min
        };
        if value.comparable() && above_min && value <= self.max {
            return Ok(());
        }
        let message = if self.open {
            format!("must be in {} (got {})", self.describe(), value.show())
        } else {
            format!("must be from {} (got {})", self.describe(), value.show())
        };
        Err((key, message))
    }
}
