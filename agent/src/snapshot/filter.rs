//! Socket filters, as given on the command line (`snapshot --state ...`) or in a query string
//! (`GET /v1/sockets?state=...`).
use std::time::Duration;

use serde::Deserialize;

use crate::table::{ParseStateError, Socket, TcpState};

/// Filters as given on the command line or in a query string (comma-separated lists).
#[derive(Debug, Default, Clone, clap::Args, Deserialize)]
pub struct FilterArgs {
    /// Only these states, comma-separated (e.g. CLOSE_WAIT,ESTABLISHED).
    #[arg(long)]
    pub state: Option<String>,
    /// Only sockets with this local, peer or service port (comma-separated).
    #[arg(long)]
    pub port: Option<String>,
    /// Only sockets owned by these pids (comma-separated).
    #[arg(long)]
    pub pid: Option<String>,
    /// Only sockets owned by processes with this command name (comma-separated).
    #[arg(long)]
    pub comm: Option<String>,
    /// Only sockets idle at least this long (e.g. 30s, 5m).
    #[arg(long = "idle-min")]
    #[serde(alias = "idle-min")]
    pub idle_min: Option<String>,
    /// Only sockets of these network namespaces (comma-separated): a name under /run/netns
    /// or /run/docker/netns, an inode, `host` (connreap's own), or `all` (the default).
    #[arg(long)]
    pub netns: Option<String>,
    /// Only sockets owned by processes of containers whose id starts with one of these
    /// (comma-separated; at least 4 characters each).
    #[arg(long)]
    pub container: Option<String>,
}

#[derive(Debug, Default, Clone, PartialEq)]
pub struct Filter {
    pub states: Vec<TcpState>,
    pub ports: Vec<u16>,
    pub pids: Vec<u32>,
    pub comms: Vec<String>,
    pub idle_min: Option<Duration>,
    /// Namespace selectors (see [`crate::table::Netns::matches`]); empty: every namespace.
    pub netns: Vec<String>,
    /// Container id prefixes; empty: any owner, in a container or not.
    pub containers: Vec<String>,
}

/// A filter value that does not parse, and why.
#[derive(Debug, thiserror::Error)]
pub enum FilterError {
    #[error("invalid state `{value}`")]
    State {
        value: String,
        #[source]
        source: ParseStateError,
    },
    #[error("invalid port `{value}`")]
    Port {
        value: String,
        #[source]
        source: std::num::ParseIntError,
    },
    #[error("invalid pid `{value}`")]
    Pid {
        value: String,
        #[source]
        source: std::num::ParseIntError,
    },
    #[error("invalid container `{value}`: give at least 4 hex digits of a container id")]
    Container { value: String },
    #[error("invalid idle-min `{value}`")]
    IdleMin {
        value: String,
        #[source]
        source: humantime::DurationError,
    },
}

/// The items of a comma-separated list.
fn items(v: &Option<String>) -> impl Iterator<Item = &str> {
    v.iter()
        .flat_map(|s| s.split(','))
        .map(str::trim)
        .filter(|s| !s.is_empty())
}

impl FilterArgs {
    pub fn parse(&self) -> Result<Filter, FilterError> {
        let value = String::from;
        Ok(Filter {
            states: items(&self.state)
                .map(|v| {
                    v.parse().map_err(|source| FilterError::State {
                        value: value(v),
                        source,
                    })
                })
                .collect::<Result<_, _>>()?,
            ports: items(&self.port)
                .map(|v| {
                    v.parse().map_err(|source| FilterError::Port {
                        value: value(v),
                        source,
                    })
                })
                .collect::<Result<_, _>>()?,
            pids: items(&self.pid)
                .map(|v| {
                    v.parse().map_err(|source| FilterError::Pid {
                        value: value(v),
                        source,
                    })
                })
                .collect::<Result<_, _>>()?,
            comms: items(&self.comm).map(value).collect(),
            netns: items(&self.netns)
                .filter(|v| *v != "all")
                .map(value)
                .collect(),
            containers: items(&self.container)
                .map(|v| {
                    if v.len() >= 4 && v.bytes().all(|b| b.is_ascii_hexdigit()) {
                        Ok(v.to_ascii_lowercase())
                    } else {
                        Err(FilterError::Container { value: value(v) })
                    }
                })
                .collect::<Result<_, _>>()?,
            idle_min: self
                .idle_min
                .as_deref()
                .map(|v| {
                    humantime::parse_duration(v).map_err(|source| FilterError::IdleMin {
                        value: value(v),
                        source,
                    })
                })
                .transpose()?,
        })
    }
}

impl Filter {
    pub fn matches(&self, s: &Socket) -> bool {
        (self.states.is_empty() || self.states.contains(&s.state))
            && (self.ports.is_empty()
                || self
                    .ports
                    .iter()
                    .any(|p| *p == s.local.port() || *p == s.peer.port() || *p == s.service_port))
            && (self.pids.is_empty() || s.pid().is_some_and(|p| self.pids.contains(&p)))
            && (self.comms.is_empty() || self.comms.iter().any(|c| c == s.comm()))
            && self
                .idle_min
                .is_none_or(|min| s.idle.is_some_and(|idle| idle >= min))
            && (self.netns.is_empty() || self.netns.iter().any(|n| s.netns.matches(n)))
            && (self.containers.is_empty()
                || s.container_id()
                    .is_some_and(|id| self.containers.iter().any(|c| id.starts_with(c.as_str()))))
    }
}

#[cfg(test)]
mod tests {
    use std::error::Error as _;

    use super::*;
    use crate::snapshot::tests::sock;

    #[test]
    fn filters_combine() {
        let args = FilterArgs {
            state: Some("close_wait".into()),
            port: Some("80".into()),
            comm: Some("java".into()),
            idle_min: Some("30s".into()),
            ..Default::default()
        };
        let f = args.parse().unwrap();
        assert!(f.matches(&sock(1, "java", TcpState::CloseWait, 80, 100, 60)));
        assert!(!f.matches(&sock(1, "java", TcpState::CloseWait, 80, 100, 10)));
        assert!(!f.matches(&sock(1, "node", TcpState::CloseWait, 80, 100, 60)));
        assert!(!f.matches(&sock(1, "java", TcpState::Established, 80, 100, 60)));
        assert!(!f.matches(&sock(1, "java", TcpState::CloseWait, 81, 100, 60)));
        let pid = FilterArgs {
            pid: Some("7,8".into()),
            ..Default::default()
        }
        .parse()
        .unwrap();
        assert!(pid.matches(&sock(8, "x", TcpState::Listen, 1, 0, 0)));
        assert!(!pid.matches(&sock(9, "x", TcpState::Listen, 1, 0, 0)));
    }

    #[test]
    fn bad_filters_name_the_cause() {
        let e = FilterArgs {
            port: Some("http".into()),
            ..Default::default()
        }
        .parse()
        .unwrap_err();
        assert_eq!(e.to_string(), "invalid port `http`");
        assert!(e.source().is_some_and(|c| c.to_string().contains("digit")));
        let e = FilterArgs {
            idle_min: Some("soon".into()),
            ..Default::default()
        }
        .parse()
        .unwrap_err();
        assert!(e.to_string().contains("idle-min `soon`"), "{e}");
        let e = FilterArgs {
            state: Some("bogus".into()),
            ..Default::default()
        }
        .parse()
        .unwrap_err();
        assert_eq!(e.to_string(), "invalid state `bogus`");
        assert!(e
            .source()
            .is_some_and(|c| c.to_string().contains("CLOSE_WAIT")));
    }
}
