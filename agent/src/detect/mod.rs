//! Leak detectors: pure functions over the socket table, quota readings and connection-rate
//! windows. Each returns findings; `run` runs them all.
mod close_wait;
mod idle;
mod pairs;
mod quota;
mod storm;
mod upstream;

use std::collections::BTreeMap;

use serde::Serialize;

pub use idle::PeerCount;
pub use pairs::local_pairs;
pub use storm::{ConnKey, StormTracker};
pub use upstream::UpstreamOwner;

use crate::{
    config::{DetectConfig, QuotaConfig},
    present::round_secs,
    quota::QuotaStatus,
    table::{Socket, TcpState},
};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Kind {
    CloseWaitBuildup,
    StuckEstablishedPairs,
    QuotaExhaustedByLeak,
    ReconnectStorm,
    QuotaSourceUnavailable,
    IdleEstablishedBuildup,
}

impl Kind {
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::CloseWaitBuildup => "close_wait_buildup",
            Kind::StuckEstablishedPairs => "stuck_established_pairs",
            Kind::QuotaExhaustedByLeak => "quota_exhausted_by_leak",
            Kind::ReconnectStorm => "reconnect_storm",
            Kind::QuotaSourceUnavailable => "quota_source_unavailable",
            Kind::IdleEstablishedBuildup => "idle_established_buildup",
        }
    }
    pub const ALL: [Kind; 6] = [
        Kind::CloseWaitBuildup,
        Kind::StuckEstablishedPairs,
        Kind::QuotaExhaustedByLeak,
        Kind::ReconnectStorm,
        Kind::QuotaSourceUnavailable,
        Kind::IdleEstablishedBuildup,
    ];
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ProcessCount {
    pub pid: Option<u32>,
    pub comm: String,
    pub unit: Option<String>,
    pub count: usize,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct QuotaRef {
    pub name: String,
    pub used: u64,
    pub limit: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SocketBrief {
    pub local: String,
    pub peer: String,
    pub state: TcpState,
    pub age_secs: f64,
    pub age_exact: bool,
    pub idle_secs: Option<f64>,
    pub pid: Option<u32>,
    pub comm: String,
    pub inode: u64,
}

/// What a saturated quota's connections say about it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Verdict {
    /// Most of them are idle or in CLOSE_WAIT: leaked.
    Leak,
    /// Most of them are busy: real load.
    Load,
}

impl Verdict {
    pub fn as_str(self) -> &'static str {
        match self {
            Verdict::Leak => "leak",
            Verdict::Load => "load",
        }
    }
}

/// At most this many sockets are listed in a finding.
pub const MAX_SOCKETS: usize = 20;

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Finding {
    pub kind: Kind,
    /// Stable identity of the problem across scans (process name, not pid, so a restart of
    /// the leaking process does not look like a new problem).
    pub fingerprint: String,
    pub summary: String,
    pub service_port: Option<u16>,
    pub count: usize,
    pub oldest_age_secs: f64,
    pub processes: Vec<ProcessCount>,
    pub quota: Option<QuotaRef>,
    pub sockets: Vec<SocketBrief>,
    /// quota_exhausted_by_leak: "leak" or "load".
    #[serde(skip_serializing_if = "Option::is_none")]
    pub verdict: Option<Verdict>,
    /// close_wait_buildup: change in count since the previous scan.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub growth: Option<i64>,
    /// reconnect_storm: new connections per second in the last window.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rate_per_sec: Option<f64>,
    /// quota_source_unavailable: why.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// idle_established_buildup: whether TCP keepalive is on for every one of the sockets.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub keepalive: Option<bool>,
    /// idle_established_buildup: the remote addresses, most sockets first (a few).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub peers: Vec<PeerCount>,
    /// quota_exhausted_by_leak: local processes feeding the quota's holder (a relay), one hop
    /// upstream, when no port_map names the port carrying its streams.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub upstream: Vec<UpstreamOwner>,
}

impl Finding {
    fn new(kind: Kind, key: &str, summary: String) -> Self {
        Finding {
            kind,
            fingerprint: format!("{}:{key}", kind.as_str()),
            summary,
            service_port: None,
            count: 0,
            oldest_age_secs: 0.0,
            processes: Vec::new(),
            quota: None,
            sockets: Vec::new(),
            verdict: None,
            growth: None,
            rate_per_sec: None,
            reason: None,
            keepalive: None,
            peers: Vec::new(),
            upstream: Vec::new(),
        }
    }
}

pub fn brief(s: &Socket) -> SocketBrief {
    SocketBrief {
        local: s.local.to_string(),
        peer: s.peer.to_string(),
        state: s.state,
        age_secs: round_secs(s.age),
        age_exact: s.age_exact,
        idle_secs: s.idle.map(round_secs),
        pid: s.pid(),
        comm: s.comm().to_string(),
        inode: s.inode,
    }
}

/// Owners of `socks`, largest first.
pub fn processes<'a>(socks: impl IntoIterator<Item = &'a Socket>) -> Vec<ProcessCount> {
    let mut by: BTreeMap<Option<u32>, ProcessCount> = BTreeMap::new();
    for s in socks {
        by.entry(s.pid())
            .or_insert_with(|| ProcessCount {
                pid: s.pid(),
                comm: s.comm().to_string(),
                unit: s.unit(),
                count: 0,
            })
            .count += 1;
    }
    let mut v: Vec<ProcessCount> = by.into_values().collect();
    v.sort_by(|a, b| b.count.cmp(&a.count).then(a.pid.cmp(&b.pid)));
    v
}

/// Oldest first, at most MAX_SOCKETS.
pub fn oldest_briefs<'a>(socks: impl IntoIterator<Item = &'a Socket>) -> Vec<SocketBrief> {
    let mut v: Vec<&Socket> = socks.into_iter().collect();
    v.sort_by_key(|s| std::cmp::Reverse(s.age));
    v.into_iter().take(MAX_SOCKETS).map(brief).collect()
}

/// "node pid 12" / "node pids 12, 13"
pub fn describe_owners(p: &[ProcessCount]) -> String {
    let mut by_comm: BTreeMap<&str, Vec<String>> = BTreeMap::new();
    for pc in p {
        by_comm
            .entry(pc.comm.as_str())
            .or_default()
            .push(pc.pid.map(|x| x.to_string()).unwrap_or_else(|| "?".into()));
    }
    by_comm
        .into_iter()
        .map(|(c, pids)| {
            if pids.len() == 1 {
                format!("{c} pid {}", pids[0])
            } else {
                format!("{c} pids {}", pids.join(", "))
            }
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// State carried from one scan to the next (for growth figures).
#[derive(Debug, Default)]
pub struct Memory {
    close_wait_counts: BTreeMap<String, usize>,
}

pub struct Input<'a> {
    pub table: &'a [Socket],
    pub cfg: &'a DetectConfig,
    pub quota_cfgs: &'a [QuotaConfig],
    pub quotas: &'a [QuotaStatus],
    pub storm: &'a StormTracker,
}

/// Run every detector.
pub fn run(input: &Input<'_>, memory: &mut Memory) -> Vec<Finding> {
    let mut out = close_wait::detect(input.table, input.cfg, &mut memory.close_wait_counts);
    out.extend(pairs::detect(input.table, input.cfg));
    out.extend(idle::detect(input.table, input.cfg));
    out.extend(quota::detect(input));
    out.extend(input.storm.findings(input.cfg));
    out.extend(quota::unavailable(input.quotas));
    out
}

#[cfg(test)]
pub(crate) fn testutil_finding(kind: Kind, key: &str) -> Finding {
    Finding::new(kind, key, format!("test finding {key}"))
}

#[cfg(test)]
pub(crate) mod testutil {
    use std::{sync::Arc, time::Duration};

    use crate::table::{Direction, Endpoint, Owner, Socket, TcpState};

    pub fn sock(pid: u32, comm: &str, local: &str, peer: &str, state: TcpState) -> Socket {
        let local: Endpoint = local.parse().unwrap();
        let peer: Endpoint = peer.parse().unwrap();
        let mut s = Socket::new(local, peer, state);
        s.skaddr = (pid as u64) << 20 | local.port() as u64;
        s.inode = local.port() as u64;
        s.age = Duration::from_secs(600);
        s.idle = Some(Duration::from_secs(600));
        s.direction = if local.port() < peer.port() {
            Direction::Inbound
        } else {
            Direction::Outbound
        };
        s.service_port = local.port().min(peer.port());
        s.owner = Some(Arc::new(Owner {
            pid,
            comm: comm.into(),
            unit: None,
        }));
        s.fd = 3;
        s
    }
}
