//! Quota sources: HTTP JSON endpoints (e.g. a relay's `GET /status`) polled in the background,
//! and static limits (a pool's max-per-route) counted from the socket table. Each counts the
//! sockets of one network namespace ([`Scope`]).
mod scope;

use std::time::Duration;

use serde::Serialize;

#[cfg(test)]
pub(crate) use scope::placed;
pub use scope::Scope;

use crate::{
    config::{ByteSize, QuotaConfig, MAX_COUNT},
    table::{canon, Socket, TcpState},
};

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct QuotaEntry {
    pub port: u16,
    pub used: u64,
    pub limit: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct QuotaStatus {
    pub name: String,
    /// "http" or "static".
    pub source: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
    /// RFC 3339 time (UTC, ms) the last poll was sent (or the count made, for static sources).
    #[serde(serialize_with = "crate::present::ser_rfc3339_ms_opt")]
    pub last_poll: Option<chrono::DateTime<chrono::Utc>>,
    pub entries: Vec<QuotaEntry>,
    /// Why the last poll failed; entries are from the last good poll, if any.
    pub error: Option<String>,
}

/// Why a poll of an HTTP source gave no reading.
#[derive(Debug, thiserror::Error)]
pub enum PollError {
    /// The request's own timeout: the message says it all.
    #[error("no answer within {}", humantime::format_duration(*.0))]
    Timeout(Duration),
    #[error("cannot connect to {url}")]
    Connect {
        url: String,
        #[source]
        source: reqwest::Error,
    },
    #[error("request to {url} failed")]
    Request {
        url: String,
        #[source]
        source: reqwest::Error,
    },
    #[error("{url} answered HTTP {status}")]
    Status {
        url: String,
        status: reqwest::StatusCode,
    },
    #[error("reading the body of {url} failed")]
    Body {
        url: String,
        #[source]
        source: reqwest::Error,
    },
    /// More than `quota.max_body`: read no further (`length` is the announced
    /// Content-Length, when there was one).
    #[error("the body of {url} is larger than max_body ({}){}", ByteSize(*.max_body),
        .length.map(|l| format!(": Content-Length {l}")).unwrap_or_default())]
    TooLarge {
        url: String,
        max_body: u64,
        length: Option<u64>,
    },
    #[error(transparent)]
    Parse(#[from] BodyError),
}

/// The body of `resp`, read chunk by chunk and refused as soon as it would exceed `max_body`
/// bytes: at most `max_body` plus one chunk is ever held.
async fn read_body(
    mut resp: reqwest::Response,
    url: &str,
    max_body: u64,
) -> Result<Vec<u8>, PollError> {
    let too_large = |length| PollError::TooLarge {
        url: url.into(),
        max_body,
        length,
    };
    if let Some(length) = resp.content_length().filter(|l| *l > max_body) {
        return Err(too_large(Some(length)));
    }
    let mut body = Vec::new();
    while let Some(chunk) = resp.chunk().await.map_err(|source| PollError::Body {
        url: url.into(),
        source,
    })? {
        if (body.len() + chunk.len()) as u64 > max_body {
            return Err(too_large(None));
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body)
}

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

/// Sockets a static source counts as used: that process's connections to that peer, in the
/// source's namespace.
pub fn static_sockets<'a>(
    cfg: &'a QuotaConfig,
    table: &'a [Socket],
) -> impl Iterator<Item = &'a Socket> {
    let scope = Scope::of(cfg, table);
    table.iter().filter(move |s| {
        scope.contains(s)
            && cfg.process.as_deref() == Some(s.comm())
            && cfg.peer.map(canon) == Some(canon(s.peer))
            && !matches!(s.state, TcpState::Listen | TcpState::TimeWait)
    })
}

pub fn static_status(
    cfg: &QuotaConfig,
    table: &[Socket],
    now: chrono::DateTime<chrono::Utc>,
) -> QuotaStatus {
    QuotaStatus {
        name: cfg.name.clone(),
        source: "static",
        url: None,
        last_poll: Some(now),
        entries: vec![QuotaEntry {
            port: cfg.peer.map(|p| p.port()).unwrap_or(0),
            used: static_sockets(cfg, table).count() as u64,
            limit: cfg.limit.unwrap_or(u64::MAX),
        }],
        error: None,
    }
}

pub fn poll_interval(cfg: &QuotaConfig, scan_interval: Duration) -> Duration {
    cfg.poll_interval.unwrap_or(scan_interval)
}

pub fn timeout(cfg: &QuotaConfig, scan_interval: Duration) -> Duration {
    cfg.timeout
        .unwrap_or_else(|| poll_interval(cfg, scan_interval).min(Duration::from_secs(5)))
}

/// The HTTP client quota sources are polled with: no proxy (a status port is local to the
/// host or the pod), no redirect followed (a source answers where it was asked), and
/// connreap's user agent. Building it fails only when the TLS backend cannot start: an error
/// at start, never a silently different client.
pub fn http_client() -> Result<reqwest::Client, reqwest::Error> {
    reqwest::Client::builder()
        .no_proxy()
        .redirect(reqwest::redirect::Policy::none())
        .user_agent(concat!("connreap/", env!("CARGO_PKG_VERSION")))
        .build()
}

/// Poll one HTTP source once. Never fails: problems become `error`.
pub async fn poll(
    client: &reqwest::Client,
    cfg: &QuotaConfig,
    timeout: Duration,
    previous: Option<&QuotaStatus>,
) -> QuotaStatus {
    let url = cfg.url.clone().unwrap_or_default();
    // A reading is stamped with the time its request was sent: the source's counts can only
    // reflect what happened before then.
    let now = chrono::Utc::now();
    let result = async {
        let resp = client
            .get(&url)
            .timeout(timeout)
            .send()
            .await
            .map_err(|source| {
                let url = url.clone();
                if source.is_timeout() {
                    PollError::Timeout(timeout)
                } else if source.is_connect() {
                    PollError::Connect { url, source }
                } else {
                    PollError::Request { url, source }
                }
            })?;
        let status = resp.status();
        if !status.is_success() {
            return Err(PollError::Status {
                url: url.clone(),
                status,
            });
        }
        let body = read_body(resp, &url, cfg.max_body()).await?;
        Ok(parse_body(&body, cfg)?)
    }
    .await;
    match result {
        Ok(entries) => QuotaStatus {
            name: cfg.name.clone(),
            source: "http",
            url: Some(url),
            last_poll: Some(now),
            entries,
            error: None,
        },
        // The whole chain: the request error's causes say why it failed.
        Err(e) => failed(cfg, previous, now, format!("{:#}", anyhow::Error::new(e))),
    }
}

/// An HTTP source's status after a poll sent at `now` failed for `error`.
pub fn failed(
    cfg: &QuotaConfig,
    previous: Option<&QuotaStatus>,
    now: chrono::DateTime<chrono::Utc>,
    error: String,
) -> QuotaStatus {
    QuotaStatus {
        name: cfg.name.clone(),
        source: "http",
        url: cfg.url.clone(),
        last_poll: Some(now),
        // Keep the last good entries for display; detectors ignore sources with errors.
        entries: previous.map(|p| p.entries.clone()).unwrap_or_default(),
        error: Some(error),
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    fn relay_cfg() -> QuotaConfig {
        crate::config::parse(
            r#"[[quota]]
name = "relay"
url = "http://127.0.0.1:20080/status"
items = "/endpoints"
port_field = "port"
used_field = "streams"
limit_field = "maxStreams"
"#,
            "t",
        )
        .unwrap()
        .quota
        .remove(0)
    }

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

    /// Serves one response with `body`, announced by Content-Length or chunked.
    pub(crate) async fn serve_once(body: Vec<u8>, chunked: bool) -> String {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/status", listener.local_addr().unwrap());
        tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            let mut req = [0u8; 1024];
            let _ = s.read(&mut req).await;
            let head = if chunked {
                "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n".to_string()
            } else {
                format!("HTTP/1.1 200 OK\r\ncontent-length: {}\r\n\r\n", body.len())
            };
            let _ = s.write_all(head.as_bytes()).await;
            for part in body.chunks(64 * 1024) {
                let part = if chunked {
                    [format!("{:x}\r\n", part.len()).as_bytes(), part, b"\r\n"].concat()
                } else {
                    part.to_vec()
                };
                if s.write_all(&part).await.is_err() {
                    return; // the agent stopped reading
                }
            }
            let _ = s.write_all(b"0\r\n\r\n").await;
        });
        url
    }

    #[tokio::test]
    async fn bodies_above_max_body_are_refused_without_reading_them_whole() {
        let client = reqwest::Client::builder().no_proxy().build().unwrap();
        let mut cfg = relay_cfg();
        cfg.max_body = Some(ByteSize(64 * 1024));
        let t = Duration::from_secs(5);
        let big = vec![b' '; 4 << 20];
        for chunked in [false, true] {
            cfg.url = Some(serve_once(big.clone(), chunked).await);
            let q = poll(&client, &cfg, t, None).await;
            let e = q.error.unwrap();
            assert!(e.contains("is larger than max_body (64KiB)"), "{e}");
            assert_eq!(e.contains("Content-Length 4194304"), !chunked, "{e}");
        }
        // Under the cap: read and parsed.
        let ok = br#"{"endpoints":[{"port":1,"streams":1,"maxStreams":4}]}"#.to_vec();
        cfg.url = Some(serve_once(ok, true).await);
        let q = poll(&client, &cfg, t, None).await;
        assert_eq!((q.error, q.entries.len()), (None, 1));
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
