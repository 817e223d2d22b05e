//! Byte sizes in the configuration: an integer (bytes) or a string with a binary unit
//! (`"512KiB"`, `"1MiB"`, `"2 MiB"`, `"1000B"`).
use std::fmt;

use serde::{de, Deserialize, Deserializer, Serialize, Serializer};

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct ByteSize(pub u64);

const UNITS: [(&str, u64); 4] = [
    ("GiB", 1 << 30),
    ("MiB", 1 << 20),
    ("KiB", 1 << 10),
    ("B", 1),
];

/// Why a size does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SizeError {
    #[error("`{0}` is not a size like \"1MiB\" or a number of bytes")]
    NotASize(String),
    #[error("unknown unit `{unit}` in `{text}`: use B, KiB, MiB or GiB")]
    Unit { unit: String, text: String },
    #[error("`{0}` is too large")]
    TooLarge(String),
}

impl std::str::FromStr for ByteSize {
    type Err = SizeError;

    fn from_str(s: &str) -> Result<Self, SizeError> {
        let s = s.trim();
        let digits = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
        let (number, unit) = s.split_at(digits);
        let number: u64 = number
            .parse()
            .map_err(|_| SizeError::NotASize(s.to_string()))?;
        let unit = unit.trim();
        let scale = if unit.is_empty() {
            1
        } else {
            UNITS
                .iter()
                .find(|(u, _)| *u == unit)
                .map(|(_, scale)| *scale)
                .ok_or_else(|| SizeError::Unit {
                    unit: unit.to_string(),
                    text: s.to_string(),
                })?
        };
        number
            .checked_mul(scale)
            .map(ByteSize)
            .ok_or_else(|| SizeError::TooLarge(s.to_string()))
    }
}

impl fmt::Display for ByteSize {
    /// The largest unit that divides the size exactly: `1MiB`, `1536KiB`, `1000B`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (unit, scale) = UNITS
            .iter()
            .find(|(_, scale)| self.0 != 0 && self.0.is_multiple_of(*scale))
            .copied()
            .unwrap_or(("B", 1));
        write!(f, "{}{unit}", self.0 / scale)
    }
}

impl Serialize for ByteSize {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for ByteSize {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl de::Visitor<'_> for V {
            type Value = ByteSize;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a size like \"1MiB\" or a number of bytes")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<ByteSize, E> {
                Ok(ByteSize(v))
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<ByteSize, E> {
                u64::try_from(v)
                    .map(ByteSize)
                    .map_err(|_| E::custom(format!("a size cannot be negative (got {v})")))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<ByteSize, E> {
                v.parse().map_err(E::custom)
            }
        }
        d.deserialize_any(V)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_prints_binary_units() {
        let p = |s: &str| s.parse::<ByteSize>().map(|b| b.0);
        assert_eq!(p("1MiB"), Ok(1 << 20));
        assert_eq!(p("2 KiB"), Ok(2048));
        assert_eq!(p("1000"), Ok(1000));
        assert_eq!(p("1000B"), Ok(1000));
        assert!(p("1MB")
            .unwrap_err()
            .to_string()
            .contains("unknown unit `MB`"));
        assert!(p("lots").unwrap_err().to_string().contains("not a size"));
        assert!(p("99999999999999GiB")
            .unwrap_err()
            .to_string()
            .contains("too large"));
        assert_eq!(ByteSize(1 << 20).to_string(), "1MiB");
        assert_eq!(ByteSize(1536 * 1024).to_string(), "1536KiB");
        assert_eq!(ByteSize(1000).to_string(), "1000B");
        assert_eq!(ByteSize(0).to_string(), "0B");
    }
}
