//! Leak detectors: pure functions over the socket table, quota readings and connection-rate
//! windows. Each returns findings; `run` runs them all.
mod close_wait;
mod downstream;
mod ends;
mod failing;
mod idle;
mod pairs;
mod quota;
mod resolved;
mod scope;
mod storm;
mod upstream;

use std::collections::BTreeMap;

use rustc_hash::FxHashSet;

use serde::Serialize;

pub use downstream::{Downstreams, Orphan};
pub use ends::{parse_conntrack, Ends, Nat};
pub use failing::{FailTracker, FailingUpstream, Target};
pub use idle::PeerCount;
pub use quota::feeders;
pub use resolved::resolution;
pub use scope::identity;
pub use storm::{ConnKey, StormTracker};
pub use upstream::UpstreamOwner;

use crate::{
    config::{DetectConfig, QuotaConfig},
    containers::Container,
    present::round_secs,
    quota::QuotaStatus,
    table::{Netns, Socket, TcpState},
};

pub use crate::kind::Kind;

#[derive(Debug, Clone, PartialEq, Default, Serialize)]
pub struct ProcessCount {
    pub pid: Option<u32>,
    pub comm: String,
    pub unit: Option<String>,
    pub count: usize,
    /// The full id of the container it runs in, if it runs in one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub container: Option<String>,
    /// That container's runtime, and its Kubernetes pod when known.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub container_runtime: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pod_name: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pod_namespace: Option<String>,
    /// The network namespace of its sockets counted here (inode; 0 unknown).
    #[serde(skip_serializing_if = "is_zero")]
    pub netns: u32,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

impl ProcessCount {
    /// The owner of `s`, counting `count` sockets.
    pub fn of(s: &Socket, count: usize) -> Self {
        let c = s.container();
        ProcessCount {
            pid: s.pid(),
            comm: s.comm().to_string(),
            unit: s.unit(),
            count,
            container: c.map(|c| c.id.clone()),
            container_runtime: c.map(|c| c.runtime.as_str()),
            pod_name: c.and_then(|c| c.pod_name.clone()),
            pod_namespace: c.and_then(|c| c.pod_namespace.clone()),
            netns: s.netns.inode,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct QuotaRef {
    pub name: String,
    pub used: u64,
    pub limit: u64,
    /// The entry's port (the quota source's own port number), when it is one entry's.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub port: Option<u16>,
}

/// A connection a reclaim round closed for a quota, as the quota detector needs it: until the
/// source's next reading, the reading still counts it.
#[derive(Debug, Clone, PartialEq)]
pub struct Freed {
    pub quota: String,
    /// The quota entry's port (see [`QuotaRef::port`]).
    pub port: Option<u16>,
    pub policy: String,
    pub at: chrono::DateTime<chrono::Utc>,
}

impl Freed {
    /// Whether this kill belongs to entry `port` of quota `name` and came after `since`.
    pub fn of(&self, name: &str, port: u16, since: Option<chrono::DateTime<chrono::Utc>>) -> bool {
        self.quota == name
            && self.port.is_none_or(|p| p == port)
            && since.is_none_or(|t| self.at >= t)
    }
}

/// "8 connections freed by reclaim (policy relay-leaks)": what `freed` did, or None.
pub fn freed_text(freed: &[&Freed]) -> Option<String> {
    freed.first()?;
    let mut policies: Vec<&str> = freed.iter().map(|f| f.policy.as_str()).collect();
    policies.sort_unstable();
    policies.dedup();
    Some(format!(
        "{} connection{} freed by reclaim (polic{} {})",
        freed.len(),
        if freed.len() == 1 { "" } else { "s" },
        if policies.len() == 1 { "y" } else { "ies" },
        policies.join(", ")
    ))
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
    /// Not known yet: too many connections are younger than the idle threshold for their
    /// idleness to tell (`verdict_known_in_secs` says when it will be known).
    Pending,
    /// A reclaim closed some of its connections after the source's last reading: that reading
    /// still counts them; the next one tells.
    Reclaimed,
}

impl Verdict {
    pub fn as_str(self) -> &'static str {
        match self {
            Verdict::Leak => "leak",
            Verdict::Load => "load",
            Verdict::Pending => "pending",
            Verdict::Reclaimed => "reclaimed",
        }
    }
}

/// Connections feeding a quota's holder from relaying processes, by whether they still serve
/// a connected downstream (see `downstream`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct OrphanCounts {
    /// Feeding connections whose feeder is a relay (it listens).
    pub feeding: usize,
    pub orphaned: usize,
    pub serving: usize,
    pub ambiguous: usize,
}

impl OrphanCounts {
    /// The counts over `socks` (None when no feeder is a relay).
    pub fn of(socks: &[&Socket], serving: impl Fn(&Socket) -> Option<Orphan>) -> Option<Self> {
        let mut c = OrphanCounts {
            feeding: 0,
            orphaned: 0,
            serving: 0,
            ambiguous: 0,
        };
        for s in socks {
            match serving(s) {
                Some(Orphan::Orphaned) => c.orphaned += 1,
                Some(Orphan::Serving) => c.serving += 1,
                Some(Orphan::Ambiguous) => c.ambiguous += 1,
                None => continue,
            }
            c.feeding += 1;
        }
        (c.feeding > 0).then_some(c)
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
    /// quota_exhausted_by_leak with a pending verdict: seconds until it is known at the latest.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub verdict_known_in_secs: Option<f64>,
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
    /// idle_established_buildup with keepalive on: seconds until the kernel resets the last of
    /// them if the peer is gone (from the namespace's tcp_keepalive_* sysctls); 0 when they are
    /// all past that, so the peer answers probes.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub keepalive_reap_secs: Option<f64>,
    /// idle_established_buildup: the remote addresses, most sockets first (a few).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub peers: Vec<PeerCount>,
    /// quota_exhausted_by_leak: local processes feeding the quota's holder (a relay), one hop
    /// upstream, when no port_map names the port carrying its streams.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub upstream: Vec<UpstreamOwner>,
    /// quota_exhausted_by_leak: the connections feeding the quota's holder, and how many of
    /// them are orphaned (their downstream is gone) or still serve a connected one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub orphans: Option<OrphanCounts>,
    /// failing_upstream: the failing endpoint, its failures by kind, the retry interval and
    /// the other endpoints of its port.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub failing: Option<FailingUpstream>,
    /// The network namespace of its sockets: the inode (0: not known, or no sockets).
    pub netns: u32,
    /// The namespace's name under `/run/netns` or `/run/docker/netns`, if it has one.
    pub netns_name: Option<String>,
    /// Whether that is connreap's own namespace (labelled "host").
    #[serde(skip)]
    pub netns_own: bool,
    /// The container its (main) owner runs in: the holder of the sockets, for a pair the
    /// server's (each process's own is in `processes`). Serialized flat: `container`,
    /// `container_runtime`, `pod_uid`, `pod_name`, `pod_namespace`.
    #[serde(flatten, serialize_with = "scope::ser_container")]
    pub container: Option<Container>,
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
            verdict_known_in_secs: None,
            growth: None,
            rate_per_sec: None,
            reason: None,
            keepalive: None,
            keepalive_reap_secs: None,
            peers: Vec::new(),
            upstream: Vec::new(),
            orphans: None,
            failing: None,
            netns: 0,
            netns_name: None,
            netns_own: true,
            container: None,
        }
    }

    /// Place the finding in namespace `netns` (its sockets') and container `container` (its
    /// owner's): the fields, the fingerprint (namespaces other than connreap's own are part of
    /// it) and the summary (which names both). Once per finding, right after [`Finding::new`].
    pub fn scoped(mut self, netns: &Netns, container: Option<&Container>) -> Self {
        self.fingerprint.push_str(&scope::ns_part(netns));
        self.summary
            .push_str(&scope::summary_part(netns, container));
        self.place(netns, container);
        self
    }

    /// Only the fields of [`Finding::scoped`], for findings whose identity and summary already
    /// say where they are (a quota is named, and its summary names its namespace).
    pub fn place(&mut self, netns: &Netns, container: Option<&Container>) {
        self.netns = netns.inode;
        self.netns_name = netns.name.as_deref().map(String::from);
        self.netns_own = netns.own;
        self.container = container.cloned();
    }

    /// The namespace as labels name it: its name, "host" for connreap's own, else its inode.
    pub fn netns_label(&self) -> String {
        Netns {
            inode: self.netns,
            name: self.netns_name.as_deref().map(Box::from),
            own: self.netns_own,
            keepalive: None,
        }
        .label()
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
            .or_insert_with(|| ProcessCount::of(s, 0))
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

/// A socket owner as a finding's identity names it (see [`identity`]): its command, and its
/// container or systemd unit. Never its pid: a restarted service keeps its findings.
pub fn owner_identity(s: &Socket) -> String {
    identity(s.comm(), s.unit().as_deref(), s.container())
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
    /// Processes seen relaying (pids): judged as relays while none of their downstreams is
    /// connected too (see `downstream`).
    relays: FxHashSet<u32>,
}

pub struct Input<'a> {
    pub table: &'a [Socket],
    pub cfg: &'a DetectConfig,
    pub quota_cfgs: &'a [QuotaConfig],
    pub quotas: &'a [QuotaStatus],
    pub storm: &'a StormTracker,
    /// Outbound connection outcomes per target (failing_upstream), when the ring feeds them.
    pub failing: Option<&'a FailTracker>,
    /// The host's translated connections (conntrack), read only if a pairing needs them.
    pub nat: Option<&'a dyn Fn() -> Vec<Nat>>,
    /// Connections recent reclaim rounds closed for quotas.
    pub freed: &'a [Freed],
}

/// How the sockets of one table relate: the other end of each connection (across namespaces
/// too) and, for relaying processes, whether an upstream still serves a connected downstream.
/// Each is computed on first use (a quiet host needs neither).
pub struct Relations<'a> {
    table: &'a [Socket],
    /// Where conntrack's translations come from (none: rule 4 of `ends` is skipped).
    nat: Option<&'a dyn Fn() -> Vec<Nat>>,
    /// Processes seen relaying in earlier scans (see `downstream`).
    known_relays: FxHashSet<u32>,
    ends: std::cell::OnceCell<Ends>,
    downstreams: std::cell::OnceCell<Downstreams>,
}

impl<'a> Relations<'a> {
    pub fn new(table: &'a [Socket]) -> Self {
        Self::knowing(table, FxHashSet::default())
    }
    /// With the processes seen relaying in earlier scans.
    pub fn knowing(table: &'a [Socket], known_relays: FxHashSet<u32>) -> Self {
        Relations {
            table,
            nat: None,
            known_relays,
            ends: Default::default(),
            downstreams: Default::default(),
        }
    }
    pub fn table(&self) -> &'a [Socket] {
        self.table
    }
    /// With conntrack's translations from `nat` (see `ends`).
    pub fn with_nat(mut self, nat: Option<&'a dyn Fn() -> Vec<Nat>>) -> Self {
        self.nat = nat;
        self
    }
    pub fn ends(&self) -> &Ends {
        self.ends.get_or_init(|| match self.nat {
            Some(nat) => Ends::with_nat(self.table, nat),
            None => Ends::new(self.table),
        })
    }
    pub fn downstreams(&self) -> &Downstreams {
        self.downstreams
            .get_or_init(|| Downstreams::new(self.table, self.ends(), &self.known_relays))
    }
    /// The row of `s`, a socket of this table.
    pub fn row(&self, s: &Socket) -> Option<usize> {
        let size = std::mem::size_of::<Socket>();
        let off = (s as *const Socket as usize).checked_sub(self.table.as_ptr() as usize)?;
        (off % size == 0 && off / size < self.table.len()).then_some(off / size)
    }
    /// Whether `s` (an upstream of a relaying process, or its far end) still serves a
    /// connected downstream.
    pub fn serving(&self, s: &Socket) -> Option<Orphan> {
        self.downstreams().status(self.row(s)?)
    }
}

/// Run every detector.
pub fn run(input: &Input<'_>, memory: &mut Memory) -> Vec<Finding> {
    // Relays remembered while their pid still holds sockets.
    let pids: FxHashSet<u32> = input.table.iter().filter_map(Socket::pid).collect();
    memory.relays.retain(|p| pids.contains(p));
    let rel = Relations::knowing(input.table, memory.relays.clone()).with_nat(input.nat);
    let mut out = close_wait::detect(input.table, input.cfg, &mut memory.close_wait_counts);
    out.extend(pairs::detect(&rel, input.cfg));
    out.extend(idle::detect(&rel, input.cfg));
    out.extend(quota::detect(input, &rel));
    if let Some(d) = rel.downstreams.get() {
        memory.relays.extend(d.relays(input.table));
    }
    out.extend(input.storm.findings(input.cfg));
    if let Some(f) = input.failing {
        out.extend(f.findings(input.cfg));
    }
    out.extend(quota::unavailable(input.quotas));
    merge_same_identity(out)
}

/// Findings of several processes with one identity (replicas of a service, or a service and
/// its restarted self while the old one drains) become one finding listing them all.
fn merge_same_identity(findings: Vec<Finding>) -> Vec<Finding> {
    let mut out: Vec<(Finding, usize)> = Vec::with_capacity(findings.len());
    for f in findings {
        let Some((first, merged)) = out.iter_mut().find(|(o, _)| o.fingerprint == f.fingerprint)
        else {
            out.push((f, 0));
            continue;
        };
        *merged += 1;
        first.count += f.count;
        first.oldest_age_secs = first.oldest_age_secs.max(f.oldest_age_secs);
        first.growth = sum(first.growth, f.growth);
        first.rate_per_sec = sum(first.rate_per_sec, f.rate_per_sec);
        first.processes.extend(f.processes);
        first
            .processes
            .sort_by(|a, b| b.count.cmp(&a.count).then(a.pid.cmp(&b.pid)));
        first.sockets.extend(f.sockets);
        first
            .sockets
            .sort_by(|a, b| b.age_secs.total_cmp(&a.age_secs));
        first.sockets.truncate(MAX_SOCKETS);
    }
    out.into_iter()
        .map(|(mut f, merged)| {
            if merged > 0 {
                f.summary = format!(
                    "{} (+{merged} more process{} of the same service, count {} in all)",
                    f.summary,
                    if merged == 1 { "" } else { "es" },
                    f.count
                );
            }
            f
        })
        .collect()
}

fn sum<T: std::ops::Add<Output = T>>(a: Option<T>, b: Option<T>) -> Option<T> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a + b),
        (a, b) => a.or(b),
    }
}

#[cfg(test)]
mod merge_tests {
    use super::*;

    #[test]
    fn two_processes_of_one_service_are_one_finding() {
        let cfg = DetectConfig::default();
        let mut t: Vec<Socket> = Vec::new();
        for (pid, base) in [(7u32, 40000u16), (8, 41000)] {
            for i in 0..20u16 {
                let mut s = testutil::sock(
                    pid,
                    "java",
                    &format!("10.0.0.5:{}", base + i),
                    "10.0.16.36:80",
                    TcpState::CloseWait,
                );
                s.service_port = 80;
                t.push(s);
            }
        }
        let storm = StormTracker::default();
        let input = Input {
            table: &t,
            cfg: &cfg,
            quota_cfgs: &[],
            quotas: &[],
            storm: &storm,
            failing: None,
            nat: None,
            freed: &[],
        };
        let f = run(&input, &mut Memory::default());
        assert_eq!(f.len(), 1, "{f:?}");
        assert_eq!(f[0].fingerprint, "close_wait_buildup:java:80");
        assert_eq!(f[0].count, 40);
        let pids: Vec<Option<u32>> = f[0].processes.iter().map(|p| p.pid).collect();
        assert_eq!(pids, vec![Some(7), Some(8)]);
        assert!(f[0].summary.contains("+1 more process"), "{}", f[0].summary);
    }

    /// Replicas of one service in two pods (two namespaces) stay two findings, and so do two
    /// containers of the same command in connreap's own namespace (host network).
    #[test]
    fn same_command_in_two_pods_or_containers_never_merges() {
        use crate::{
            containers::Runtime,
            detect::scope_testutil::{container, netns, place},
        };
        let cfg = DetectConfig::default();
        let cases = [
            (netns(11, Some("a")), netns(12, Some("b"))),
            (Netns::unknown(), Netns::unknown()),
        ];
        for (na, nb) in cases {
            let mut t: Vec<Socket> = Vec::new();
            for (pid, ns, id) in [(7u32, &na, "aaaa"), (8, &nb, "bbbb")] {
                let c = container(id, Runtime::Docker, None);
                for i in 0..20u16 {
                    let s = testutil::sock(
                        pid,
                        "java",
                        &format!("10.0.0.5:{}", 40000 + i),
                        "10.0.16.36:80",
                        TcpState::CloseWait,
                    );
                    t.push(place(s, ns, Some(&c)));
                }
            }
            let storm = StormTracker::default();
            let input = Input {
                table: &t,
                cfg: &cfg,
                quota_cfgs: &[],
                quotas: &[],
                storm: &storm,
                failing: None,
                nat: None,
                freed: &[],
            };
            let f = run(&input, &mut Memory::default());
            assert_eq!(f.len(), 2, "{f:?}");
            assert_ne!(f[0].fingerprint, f[1].fingerprint);
            assert!(f.iter().all(|f| f.count == 20 && f.processes.len() == 1));
        }
    }
}

#[cfg(test)]
pub(crate) use scope::testutil as scope_testutil;

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
            container: None,
        }));
        s.fd = 3;
        s
    }
}
