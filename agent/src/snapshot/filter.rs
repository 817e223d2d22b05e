//! Socket filters, as given on the command line (`snapshot --state ...`) or in a query string
//! (`GET /v1/sockets?state=...`).
use std::time::Duration;

use serde::Deserialize;

use crate::table::{ParseStateError, Socket, TcpState};

/// Filters as given on the command line or in a query string (comma-separated lists).
#[derive(Debug, Default, Clone, clap::Args, Deserialize)]
pub struct FilterArgs {
    /// Only these states, comma-separated (e.g. CLOSE_WAIT,ESTABLISHED), or state groups as
    /// `ss` names them: all, connected (all but LISTEN and CLOSE), synchronized (connected
    /// but SYN_SENT), bucket (TIME_WAIT, SYN_RECV), big (all but bucket).
    #[arg(long, value_name = "STATES")]
    pub state: Option<String>,
    /// Only sockets with this local, peer or service port: ports or ranges (8000-8999),
    /// comma-separated.
    #[arg(long, value_name = "PORTS")]
    pub port: Option<String>,
    /// Only sockets whose local (source) port is one of these: ports or ranges, comma-separated.
    #[arg(long, value_name = "PORTS")]
    pub sport: Option<String>,
    /// Only sockets whose peer (destination) port is one of these: ports or ranges,
    /// comma-separated.
    #[arg(long, value_name = "PORTS")]
    pub dport: Option<String>,
    /// Only sockets held by these pids (comma-separated), whichever of its holders they are.
    #[arg(long, value_name = "PIDS")]
    pub pid: Option<String>,
    /// Only sockets owned by processes with this command name (comma-separated).
    #[arg(long, value_name = "COMMS")]
    pub comm: Option<String>,
    /// Only sockets idle at least this long (e.g. 30s, 5m).
    #[arg(long = "idle-min", value_name = "DURATION")]
    #[serde(alias = "idle-min")]
    pub idle_min: Option<String>,
    /// Only sockets of these network namespaces (comma-separated): a name under /run/netns
    /// or /run/docker/netns, an inode, `host` (connreap's own), or `all` (the default).
    #[arg(long, value_name = "NAMESPACES")]
    pub netns: Option<String>,
    /// Only sockets owned by processes of containers whose id starts with one of these
    /// (comma-separated; at least 4 characters each).
    #[arg(long, value_name = "IDS")]
    pub container: Option<String>,
}

#[derive(Debug, Default, Clone, PartialEq)]
pub struct Filter {
    pub states: Vec<TcpState>,
    pub ports: Vec<PortRange>,
    pub sports: Vec<PortRange>,
    pub dports: Vec<PortRange>,
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
    #[error(
        "invalid {option} `{value}`: give ports (1-65535) or ranges (8000-8999), comma-separated"
    )]
    Port { option: &'static str, value: String },
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

/// A port or an inclusive range of ports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PortRange {
    pub first: u16,
    pub last: u16,
}

impl PortRange {
    fn contains(self, port: u16) -> bool {
        (self.first..=self.last).contains(&port)
    }

    /// `8080` or `8000-8999`; None when it is neither (or the range is empty or has port 0).
    fn parse(v: &str) -> Option<PortRange> {
        let (a, b) = v.split_once('-').unwrap_or((v, v));
        let (first, last): (u16, u16) = (a.trim().parse().ok()?, b.trim().parse().ok()?);
        (first > 0 && first <= last).then_some(PortRange { first, last })
    }
}

/// `ss`'s state groups (ss(8), STATE-FILTER).
fn state_group(name: &str) -> Option<Vec<TcpState>> {
    use TcpState::*;
    let bucket = |s: &TcpState| matches!(s, TimeWait | SynRecv | NewSynRecv);
    let all = TcpState::all();
    Some(match name.to_ascii_lowercase().as_str() {
        "all" => all.collect(),
        "connected" => all.filter(|s| !matches!(s, Listen | Close)).collect(),
        "synchronized" => all
            .filter(|s| !matches!(s, Listen | Close | SynSent))
            .collect(),
        "bucket" => all.filter(bucket).collect(),
        "big" => all.filter(|s| !bucket(s)).collect(),
        _ => return None,
    })
}

fn ports(option: &'static str, v: &Option<String>) -> Result<Vec<PortRange>, FilterError> {
    items(v)
        .map(|p| {
            PortRange::parse(p).ok_or_else(|| FilterError::Port {
                option,
                value: crate::config::shown(p, crate::config::INPUT_MAX),
            })
        })
        .collect()
}

impl FilterArgs {
    pub fn parse(&self) -> Result<Filter, FilterError> {
        // Shown escaped and capped: the values come from a command line or a query string.
        let value = |v: &str| crate::config::shown(v, crate::config::INPUT_MAX);
        let mut states: Vec<TcpState> = Vec::new();
        for v in items(&self.state) {
            match state_group(v) {
                Some(group) => states.extend(group),
                None => states.push(v.parse().map_err(|source| FilterError::State {
                    value: value(v),
                    source,
                })?),
            }
        }
        states.sort_unstable_by_key(|s| s.as_str());
        states.dedup();
        Ok(Filter {
            states,
            ports: ports("port", &self.port)?,
            sports: ports("sport", &self.sport)?,
            dports: ports("dport", &self.dport)?,
            pids: items(&self.pid)
                .map(|v| {
                    v.parse().map_err(|source| FilterError::Pid {
                        value: value(v),
                        source,
                    })
                })
                .collect::<Result<_, _>>()?,
            comms: items(&self.comm).map(String::from).collect(),
            netns: items(&self.netns)
                .filter(|v| *v != "all")
                .map(String::from)
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
                || self.ports.iter().any(|p| {
                    p.contains(s.local.port())
                        || p.contains(s.peer.port())
                        || p.contains(s.service_port)
                }))
            && (self.sports.is_empty() || self.sports.iter().any(|p| p.contains(s.local.port())))
            && (self.dports.is_empty() || self.dports.iter().any(|p| p.contains(s.peer.port())))
            && (self.pids.is_empty()
                || s.pid()
                    .into_iter()
                    .chain(s.shared_with.iter().copied())
                    .any(|p| self.pids.contains(&p)))
            && (self.comms.is_empty() || self.comms.iter().any(|c| c == s.comm()))
            && self
                .idle_min
                .is_none_or(|min| s.idle().is_some_and(|idle| idle >= min))
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
        assert_eq!(
            e.to_string(),
            "invalid port `http`: give ports (1-65535) or ranges (8000-8999), comma-separated"
        );
        for bad in ["0", "9-1", "70000", "1-"] {
            let e = FilterArgs {
                dport: Some(bad.into()),
                ..Default::default()
            }
            .parse()
            .unwrap_err();
            assert!(
                e.to_string().starts_with(&format!("invalid dport `{bad}`")),
                "{e}"
            );
        }
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

    #[test]
    fn state_groups_port_ranges_and_every_holder() {
        // `sock` sockets are 127.0.0.1:45000 -> 127.0.0.1:PORT.
        let f = FilterArgs {
            state: Some("connected".into()),
            sport: Some("44000-45999,80".into()),
            dport: Some("7000-7999,100".into()),
            ..Default::default()
        }
        .parse()
        .unwrap();
        assert!(!f.states.contains(&TcpState::Listen));
        assert!(f.states.contains(&TcpState::TimeWait) && f.states.contains(&TcpState::CloseWait));
        assert!(f.matches(&sock(1, "x", TcpState::CloseWait, 7500, 100, 0)));
        assert!(f.matches(&sock(1, "x", TcpState::Established, 100, 100, 0)));
        assert!(!f.matches(&sock(1, "x", TcpState::Established, 8000, 100, 0)));
        assert!(!f.matches(&sock(1, "x", TcpState::Listen, 7500, 100, 0)));
        let other_sport = FilterArgs {
            sport: Some("46000-46999".into()),
            ..Default::default()
        }
        .parse()
        .unwrap();
        assert!(!other_sport.matches(&sock(1, "x", TcpState::Established, 100, 100, 0)));
        let bucket = FilterArgs {
            state: Some("bucket".into()),
            ..Default::default()
        }
        .parse()
        .unwrap();
        assert!(bucket.matches(&sock(1, "x", TcpState::TimeWait, 1, 2, 0)));
        assert!(!bucket.matches(&sock(1, "x", TcpState::Established, 1, 2, 0)));
        // A socket shared after fork: found by either holder's pid.
        let mut shared = sock(8, "x", TcpState::Established, 1, 2, 0);
        shared.shared_with = vec![9].into();
        let by_second = FilterArgs {
            pid: Some("9".into()),
            ..Default::default()
        }
        .parse()
        .unwrap();
        assert!(by_second.matches(&shared));
    }
}
