//! What a quota source's body may say: entries found by a JSON pointer, each a port, a used
//! count and a limit, refused with the entry, field and value named when they cannot be true.
use super::QuotaEntry;
use crate::config::{QuotaConfig, MAX_COUNT};

/// Where in a source's body an entry is: `/endpoints/3 (port 21000)`.
#[derive(Debug, Clone, PartialEq)]
pub struct Place {
    pub pointer: String,
    pub index: usize,
    /// The entry's port, once it was read.
    pub port: Option<u16>,
}

impl std::fmt::Display for Place {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.pointer, self.index)?;
        if let Some(port) = self.port {
            write!(f, " (port {port})")?;
        }
        Ok(())
    }
}

/// What in a source's body did not fit its configuration, or could not be true. Either makes
/// the source unavailable: reclaim never acts on such a reading.
#[derive(Debug, thiserror::Error)]
pub enum BodyError {
    #[error("body is not JSON; starts with {preview:?}")]
    NotJson {
        preview: String,
        #[source]
        source: serde_json::Error,
    },
    #[error("JSON pointer `{0}` not found in the body")]
    NoPointer(String),
    #[error("JSON pointer `{0}` is not an array")]
    NotArray(String),
    #[error("{at}: `{field}` is missing")]
    Missing { at: Place, field: String },
    /// A value that cannot be what the field says: `1e30`, `-1`, `1.5`, `"abc"` for a count.
    #[error("{at}: `{field}` is {value}, not {expected}")]
    Impossible {
        at: Place,
        field: String,
        /// The value as JSON text.
        value: String,
        expected: &'static str,
    },
    #[error("{at}: `{field}` is 0: a limit of 0 is not a quota")]
    ZeroLimit { at: Place, field: String },
    #[error(
        "{at}: `{used_field}` {used} is above `{limit_field}` {limit} by more than {tolerance} \
         (the most a source may overshoot is max(1, 10 % of its limit))"
    )]
    OverLimit {
        at: Place,
        used_field: String,
        used: u64,
        limit_field: String,
        limit: u64,
        tolerance: u64,
    },
    #[error("no limit_field and no limit configured")]
    NoLimit,
}

/// How far `used` may be above `limit` in a reading that is still believed: max(1, 10 % of
/// the limit). A source may count a stream it admitted just before its limit was lowered, or
/// read its counters at slightly different moments; anything further off is a broken source.
pub fn overshoot_tolerance(limit: u64) -> u64 {
    (limit / 10).max(1)
}

const COUNT: &str = "a count (an integer from 0 to 2^53)";

/// A count: a JSON integer, an integral float or a string of digits, from 0 to [`MAX_COUNT`].
/// Err(None) when missing, Err(Some(text)) with the value's JSON text when not a count.
fn count_field(entry: &serde_json::Value, field: &str) -> Result<u64, Option<String>> {
    let v = entry.get(field).ok_or(None)?;
    let n = match v {
        serde_json::Value::Number(n) => n.as_u64().or_else(|| {
            n.as_f64()
                .filter(|f| f.is_finite() && *f >= 0.0 && f.fract() == 0.0)
                .filter(|f| *f <= MAX_COUNT as f64)
                .map(|f| f as u64)
        }),
        serde_json::Value::String(s) => s.trim().parse::<u64>().ok(),
        _ => None,
    };
    n.filter(|n| *n <= MAX_COUNT)
        .ok_or_else(|| Some(v.to_string()))
}

/// Parse a source's body into entries; the error names the entry, the field and the value.
pub fn parse_body(body: &[u8], cfg: &QuotaConfig) -> Result<Vec<QuotaEntry>, BodyError> {
    let doc: serde_json::Value =
        serde_json::from_slice(body).map_err(|source| BodyError::NotJson {
            preview: String::from_utf8_lossy(&body[..body.len().min(40)]).into_owned(),
            source,
        })?;
    let pointer = cfg.items.as_deref().unwrap_or("");
    let items = doc
        .pointer(pointer)
        .ok_or_else(|| BodyError::NoPointer(pointer.into()))?
        .as_array()
        .ok_or_else(|| BodyError::NotArray(pointer.into()))?;
    items
        .iter()
        .enumerate()
        .map(|(index, e)| {
            let at = Place {
                pointer: pointer.into(),
                index,
                port: None,
            };
            parse_entry(e, cfg, at)
        })
        .collect()
}

fn parse_entry(
    e: &serde_json::Value,
    cfg: &QuotaConfig,
    mut at: Place,
) -> Result<QuotaEntry, BodyError> {
    let port_field = cfg.port_field.as_deref().unwrap_or("port");
    let used_field = cfg.used_field.as_deref().unwrap_or("used");
    let bad = |at: &Place, field: &str, value: Option<String>, expected| match value {
        None => BodyError::Missing {
            at: at.clone(),
            field: field.into(),
        },
        Some(value) => BodyError::Impossible {
            at: at.clone(),
            field: field.into(),
            value,
            expected,
        },
    };
    let port = count_field(e, port_field)
        .and_then(|p| u16::try_from(p).map_err(|_| Some(p.to_string())))
        .map_err(|v| bad(&at, port_field, v, "a port number"))?;
    at.port = Some(port);
    let used = count_field(e, used_field).map_err(|v| bad(&at, used_field, v, COUNT))?;
    let (limit_field, limit) = match (&cfg.limit_field, cfg.limit) {
        (Some(f), fallback) => match (count_field(e, f), fallback) {
            (Ok(l), _) => (f.as_str(), l),
            // Missing: the configured fixed limit, if any. Present but wrong: never replaced.
            (Err(None), Some(l)) => ("limit", l),
            (Err(v), _) => return Err(bad(&at, f, v, COUNT)),
        },
        (None, Some(l)) => ("limit", l),
        (None, None) => return Err(BodyError::NoLimit),
    };
    if limit == 0 {
        return Err(BodyError::ZeroLimit {
            at,
            field: limit_field.into(),
        });
    }
    let tolerance = overshoot_tolerance(limit);
    if used > limit.saturating_add(tolerance) {
        return Err(BodyError::OverLimit {
            at,
            used_field: used_field.into(),
            used,
            limit_field: limit_field.into(),
            limit,
            tolerance,
        });
    }
    Ok(QuotaEntry { port, used, limit })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quota::tests::relay_cfg;

    #[test]
    fn parses_relay_status() {
        let body = br#"{"endpoints":[{"port":21000,"streams":64,"maxStreams":64},{"port":21001,"streams":"3","maxStreams":64}],"dialDenied":5}"#;
        let e = parse_body(body, &relay_cfg()).unwrap();
        assert_eq!(
            e,
            vec![
                QuotaEntry {
                    port: 21000,
                    used: 64,
                    limit: 64
                },
                QuotaEntry {
                    port: 21001,
                    used: 3,
                    limit: 64
                },
            ]
        );
    }

    #[test]
    fn bad_bodies_name_the_cause() {
        let cfg = relay_cfg();
        let e = parse_body(b"<html>oops", &cfg).unwrap_err();
        assert_eq!(
            e.to_string(),
            "body is not JSON; starts with \"<html>oops\""
        );
        assert!(format!("{:#}", anyhow::Error::new(e)).contains("expected value at line 1"));
        assert!(parse_body(br#"{"other":[]}"#, &cfg)
            .unwrap_err()
            .to_string()
            .contains("`/endpoints` not found"));
        assert!(parse_body(br#"{"endpoints":{}}"#, &cfg)
            .unwrap_err()
            .to_string()
            .contains("not an array"));
        let e = parse_body(br#"{"endpoints":[{"port":1,"maxStreams":4}]}"#, &cfg).unwrap_err();
        assert_eq!(e.to_string(), "/endpoints/0 (port 1): `streams` is missing");
        let e = parse_body(
            br#"{"endpoints":[{"port":70000,"streams":1,"maxStreams":4}]}"#,
            &cfg,
        )
        .unwrap_err();
        assert_eq!(
            e.to_string(),
            "/endpoints/0: `port` is 70000, not a port number"
        );
    }

    fn one(streams: &str, max: &str) -> Result<Vec<QuotaEntry>, String> {
        let body =
            format!(r#"{{"endpoints":[{{"port":21000,"streams":{streams},"maxStreams":{max}}}]}}"#);
        parse_body(body.as_bytes(), &relay_cfg()).map_err(|e| e.to_string())
    }

    #[test]
    fn impossible_counts_are_refused_naming_field_port_and_value() {
        for (value, shown) in [
            ("1e30", "1e+30"),
            ("-1", "-1"),
            ("1.5", "1.5"),
            (r#""abc""#, r#""abc""#),
            ("null", "null"),
            ("true", "true"),
            ("18446744073709551615", "18446744073709551615"),
            ("9007199254740993", "9007199254740993"),
        ] {
            let e = one(value, "64").unwrap_err();
            assert_eq!(
                e,
                format!(
                    "/endpoints/0 (port 21000): `streams` is {shown}, not a count (an integer from 0 to 2^53)"
                ),
                "{value}"
            );
            let e = one("1", value).unwrap_err();
            assert!(
                e.starts_with(&format!(
                    "/endpoints/0 (port 21000): `maxStreams` is {shown},"
                )),
                "{value}: {e}"
            );
        }
        // Integral floats and digit strings are counts.
        assert_eq!(one("3.0", r#""64""#).unwrap()[0].used, 3);
        let e = one("0", "0").unwrap_err();
        assert_eq!(
            e,
            "/endpoints/0 (port 21000): `maxStreams` is 0: a limit of 0 is not a quota"
        );
    }

    #[test]
    fn used_far_above_the_limit_is_refused() {
        let e = one("1000000", "10").unwrap_err();
        assert!(
            e.starts_with(
                "/endpoints/0 (port 21000): `streams` 1000000 is above `maxStreams` 10 by more than 1 "
            ),
            "{e}"
        );
        // Within max(1, 10 % of the limit): a believable overshoot.
        assert_eq!(one("11", "10").unwrap()[0].used, 11);
        assert!(one("12", "10").is_err());
        assert_eq!(one("110", "100").unwrap()[0].used, 110);
        assert!(one("111", "100").unwrap_err().contains("by more than 10 "));
        assert_eq!(overshoot_tolerance(1), 1);
        assert_eq!(overshoot_tolerance(64), 6);
    }

    #[test]
    fn a_wrong_limit_field_is_not_replaced_by_the_fixed_limit() {
        let mut cfg = relay_cfg();
        cfg.limit = Some(64);
        let body = br#"{"endpoints":[{"port":1,"streams":1,"maxStreams":-5}]}"#;
        assert!(parse_body(body, &cfg).is_err());
        let body = br#"{"endpoints":[{"port":1,"streams":1}]}"#;
        assert_eq!(parse_body(body, &cfg).unwrap()[0].limit, 64);
    }

    #[test]
    fn fixed_limit_when_no_limit_field() {
        let mut cfg = relay_cfg();
        cfg.limit_field = None;
        cfg.limit = Some(64);
        let e = parse_body(br#"{"endpoints":[{"port":21000,"streams":10}]}"#, &cfg).unwrap();
        assert_eq!(e[0].limit, 64);
    }
}
