//! Quota sources: HTTP JSON endpoints (e.g. a relay's `GET /status`) polled in the background
//! (`feeds`: one task per source; `poll`: one request; `body`: what a body may say), and
//! static limits (a pool's max-per-route) counted from the socket table. Each counts the
//! sockets of one network namespace ([`Scope`]).
mod body;
pub mod feeds;
pub mod poll;
mod scope;

use std::time::Duration;

use serde::Serialize;

pub use body::{parse_body, BodyError};
#[cfg(test)]
pub(crate) use scope::placed;
pub use scope::Scope;

use crate::{
    config::QuotaConfig,
    table::{canon, Socket, TcpState},
};

/// Where a quota's readings come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Source {
    /// Polled from an HTTP JSON endpoint.
    Http,
    /// Counted from the socket table against a configured limit.
    Static,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct QuotaEntry {
    pub port: u16,
    pub used: u64,
    pub limit: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct QuotaStatus {
    pub name: String,
    pub source: Source,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
    /// RFC 3339 time (UTC, ms) the last poll was sent (or the count made, for static sources).
    #[serde(serialize_with = "crate::present::ser_rfc3339_ms_opt")]
    pub last_poll: Option<chrono::DateTime<chrono::Utc>>,
    pub entries: Vec<QuotaEntry>,
    /// Why the last poll failed; entries are from the last good poll, if any.
    pub error: Option<String>,
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
        source: Source::Static,
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

/// An HTTP source's status after a poll sent at `now` failed for `error`.
pub fn failed(
    cfg: &QuotaConfig,
    previous: Option<&QuotaStatus>,
    now: chrono::DateTime<chrono::Utc>,
    error: String,
) -> QuotaStatus {
    QuotaStatus {
        name: cfg.name.clone(),
        source: Source::Http,
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

    /// The relay's status URL in the unit tests' configs.
    pub(crate) const RELAY_URL: &str = "http://127.0.0.1:20080/status";

    /// The `[[quota]]` entry of a relay's `/status` (entries under `/endpoints`, each with
    /// `port` and `streams`) read from `url`, then `extra` (its limit, a port_map, a place).
    pub(crate) fn relay_toml(url: &str, extra: &str) -> String {
        format!(
            "[[quota]]\nname = \"relay\"\nurl = \"{url}\"\nitems = \"/endpoints\"\n\
             port_field = \"port\"\nused_field = \"streams\"\n{extra}\n"
        )
    }

    pub(crate) fn relay_cfg() -> QuotaConfig {
        crate::config::parse(&relay_toml(RELAY_URL, "limit_field = \"maxStreams\""), "t")
            .unwrap()
            .quota
            .remove(0)
    }
}
