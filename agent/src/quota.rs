//! Quota sources: HTTP JSON endpoints (e.g. a relay's `GET /status`) polled in the background,
//! and static limits (a pool's max-per-route) counted from the socket table.
use std::time::Duration;

use serde::Serialize;

use crate::{
    config::QuotaConfig,
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
    pub last_poll: Option<String>,
    pub entries: Vec<QuotaEntry>,
    /// Why the last poll failed; entries are from the last good poll, if any.
    pub error: Option<String>,
}

fn field_u64(entry: &serde_json::Value, field: &str) -> Option<u64> {
    let v = entry.get(field)?;
    v.as_u64()
        .or_else(|| {
            v.as_f64()
                .filter(|f| *f >= 0.0 && f.fract() == 0.0)
                .map(|f| f as u64)
        })
        .or_else(|| v.as_str().and_then(|s| s.trim().parse().ok()))
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
    #[error(transparent)]
    Parse(#[from] BodyError),
}

/// What in a source's body did not fit its configuration.
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
    /// Entry `index` of the array at `pointer` lacks `field` or it has the wrong type.
    #[error("{pointer}/{index}: `{field}` missing or not {expected}")]
    Field {
        pointer: String,
        index: usize,
        field: String,
        expected: &'static str,
    },
    #[error("no limit_field and no limit configured")]
    NoLimit,
    #[error("{pointer}/{index}: limit is 0")]
    ZeroLimit { pointer: String, index: usize },
}

/// Parse a source's body into entries; the error names what did not fit.
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
    let port_field = cfg.port_field.as_deref().unwrap_or("port");
    let used_field = cfg.used_field.as_deref().unwrap_or("used");
    items
        .iter()
        .enumerate()
        .map(|(index, e)| {
            let missing = |field: &str, expected| BodyError::Field {
                pointer: pointer.into(),
                index,
                field: field.into(),
                expected,
            };
            let count = "a non-negative integer";
            let port = field_u64(e, port_field)
                .and_then(|p| u16::try_from(p).ok())
                .ok_or_else(|| missing(port_field, "a port number"))?;
            let used = field_u64(e, used_field).ok_or_else(|| missing(used_field, count))?;
            let limit = match (&cfg.limit_field, cfg.limit) {
                (Some(f), fallback) => field_u64(e, f)
                    .or(fallback)
                    .ok_or_else(|| missing(f, count))?,
                (None, Some(l)) => l,
                (None, None) => return Err(BodyError::NoLimit),
            };
            if limit == 0 {
                return Err(BodyError::ZeroLimit {
                    pointer: pointer.into(),
                    index,
                });
            }
            Ok(QuotaEntry { port, used, limit })
        })
        .collect()
}

/// Sockets a static source counts as used: that process's connections to that peer.
pub fn static_sockets<'a>(
    cfg: &'a QuotaConfig,
    table: &'a [Socket],
) -> impl Iterator<Item = &'a Socket> {
    table.iter().filter(move |s| {
        cfg.process.as_deref() == Some(s.comm())
            && cfg.peer.map(canon) == Some(canon(s.peer))
            && !matches!(s.state, TcpState::Listen | TcpState::TimeWait)
    })
}

pub fn static_status(cfg: &QuotaConfig, table: &[Socket], now: &str) -> QuotaStatus {
    QuotaStatus {
        name: cfg.name.clone(),
        source: "static",
        url: None,
        last_poll: Some(now.to_string()),
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
    let now = crate::present::rfc3339_ms(chrono::Utc::now());
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
        let body = resp.bytes().await.map_err(|source| PollError::Body {
            url: url.clone(),
            source,
        })?;
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
        Err(e) => QuotaStatus {
            name: cfg.name.clone(),
            source: "http",
            url: Some(url),
            last_poll: Some(now),
            // Keep the last good entries for display; detectors ignore sources with errors.
            entries: previous.map(|p| p.entries.clone()).unwrap_or_default(),
            // The whole chain: the request error's causes say why it failed.
            error: Some(format!("{:#}", anyhow::Error::new(e))),
        },
    }
}

#[cfg(test)]
mod tests {
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
        assert_eq!(
            e.to_string(),
            "/endpoints/0: `streams` missing or not a non-negative integer"
        );
        let e = parse_body(
            br#"{"endpoints":[{"port":70000,"streams":1,"maxStreams":4}]}"#,
            &cfg,
        )
        .unwrap_err();
        assert_eq!(
            e.to_string(),
            "/endpoints/0: `port` missing or not a port number"
        );
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
