//! What a detector reports: a [`Finding`] (where, who, how many, the oldest sockets) and its
//! [`Detail`], the part only one kind of finding carries.
use std::collections::BTreeMap;

use serde::Serialize;

use super::{
    downstream::Orphan, failing::FailingUpstream, idle::PeerCount, scope, scope::identity,
    upstream::UpstreamOwner,
};
use crate::{
    containers::Container,
    kind::Kind,
    present::round_secs,
    table::{Netns, Socket, TcpState},
};

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

/// What only one kind of finding carries. The variant is the finding's kind: serialized as
/// `kind` (the names of [`Kind::as_str`]) next to the variant's own fields.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Detail {
    CloseWaitBuildup {
        /// Change in count since the previous scan (None on the first).
        #[serde(skip_serializing_if = "Option::is_none")]
        growth: Option<i64>,
    },
    StuckEstablishedPairs,
    QuotaExhaustedByLeak(QuotaDetail),
    ReconnectStorm {
        /// New connections per second in the last window.
        rate_per_sec: f64,
    },
    QuotaSourceUnavailable {
        /// Why the source gave no reading.
        reason: String,
    },
    IdleEstablishedBuildup(IdleDetail),
    FailingUpstream {
        /// Failed connections per second to the endpoint over the window.
        rate_per_sec: f64,
        /// The failing endpoint, its failures by kind, the retry interval and the other
        /// endpoints of its port.
        failing: FailingUpstream,
    },
}

impl Detail {
    pub fn kind(&self) -> Kind {
        match self {
            Detail::CloseWaitBuildup { .. } => Kind::CloseWaitBuildup,
            Detail::StuckEstablishedPairs => Kind::StuckEstablishedPairs,
            Detail::QuotaExhaustedByLeak(_) => Kind::QuotaExhaustedByLeak,
            Detail::ReconnectStorm { .. } => Kind::ReconnectStorm,
            Detail::QuotaSourceUnavailable { .. } => Kind::QuotaSourceUnavailable,
            Detail::IdleEstablishedBuildup(_) => Kind::IdleEstablishedBuildup,
            Detail::FailingUpstream { .. } => Kind::FailingUpstream,
        }
    }

    /// Add what `other` (a finding of the same identity: another process of one service)
    /// counts to this one's figures.
    pub(super) fn absorb(&mut self, other: &Detail) {
        match (self, other) {
            (Detail::CloseWaitBuildup { growth }, Detail::CloseWaitBuildup { growth: more }) => {
                *growth = match (*growth, *more) {
                    (Some(a), Some(b)) => Some(a + b),
                    (a, b) => a.or(b),
                }
            }
            (
                Detail::ReconnectStorm { rate_per_sec },
                Detail::ReconnectStorm { rate_per_sec: more },
            )
            | (
                Detail::FailingUpstream { rate_per_sec, .. },
                Detail::FailingUpstream {
                    rate_per_sec: more, ..
                },
            ) => *rate_per_sec += more,
            _ => {}
        }
    }
}

/// quota_exhausted_by_leak: whose the quota's connections are, and what is known of why.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct QuotaDetail {
    /// Leak, load, pending (not known yet) or reclaimed.
    pub verdict: Verdict,
    /// With a pending verdict: seconds until it is known at the latest.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub verdict_known_in_secs: Option<f64>,
    /// Local processes feeding the quota's holder (a relay), one hop upstream, when no
    /// port_map names the port carrying its streams.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub upstream: Vec<UpstreamOwner>,
    /// The connections feeding the quota's holder, and how many of them are orphaned (their
    /// downstream is gone) or still serve a connected one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub orphans: Option<OrphanCounts>,
}

/// idle_established_buildup: keepalive and the remote ends.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct IdleDetail {
    /// Whether TCP keepalive is on for every one of the sockets.
    pub keepalive: bool,
    /// With keepalive on: seconds until the kernel resets the last of them if the peer is gone
    /// (from the namespace's tcp_keepalive_* sysctls); 0 when they are all past that, so the
    /// peer answers probes.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub keepalive_reap_secs: Option<f64>,
    /// The remote addresses, most sockets first (a few).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub peers: Vec<PeerCount>,
}

/// At most this many sockets are listed in a finding.
pub const MAX_SOCKETS: usize = 20;

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Finding {
    /// What only this kind of finding carries; serialized flat, with `kind`.
    #[serde(flatten)]
    pub detail: Detail,
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
    pub(super) fn new(detail: Detail, key: &str, summary: String) -> Self {
        Finding {
            fingerprint: format!("{}:{key}", detail.kind().as_str()),
            detail,
            summary,
            service_port: None,
            count: 0,
            oldest_age_secs: 0.0,
            processes: Vec::new(),
            quota: None,
            sockets: Vec::new(),
            netns: 0,
            netns_name: None,
            netns_own: true,
            container: None,
        }
    }

    pub fn kind(&self) -> Kind {
        self.detail.kind()
    }

    /// quota_exhausted_by_leak's verdict (None for every other kind).
    pub fn verdict(&self) -> Option<Verdict> {
        match &self.detail {
            Detail::QuotaExhaustedByLeak(q) => Some(q.verdict),
            _ => None,
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
        age_secs: round_secs(s.age()),
        age_exact: s.age_exact,
        idle_secs: s.idle().map(round_secs),
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
    v.sort_by_key(|s| std::cmp::Reverse(s.age()));
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

/// Views of the detail for tests, and a finding of any kind with placeholder figures.
#[cfg(test)]
impl Finding {
    pub(crate) fn failing(&self) -> Option<&FailingUpstream> {
        match &self.detail {
            Detail::FailingUpstream { failing, .. } => Some(failing),
            _ => None,
        }
    }

    pub(crate) fn idle(&self) -> Option<&IdleDetail> {
        match &self.detail {
            Detail::IdleEstablishedBuildup(d) => Some(d),
            _ => None,
        }
    }

    pub(crate) fn quota_detail(&self) -> Option<&QuotaDetail> {
        match &self.detail {
            Detail::QuotaExhaustedByLeak(d) => Some(d),
            _ => None,
        }
    }

    /// quota_exhausted_by_leak's feeders (empty for other kinds).
    pub(crate) fn upstream(&self) -> &[UpstreamOwner] {
        self.quota_detail().map_or(&[], |q| &q.upstream)
    }

    /// Set the verdict of a quota_exhausted_by_leak finding.
    pub(crate) fn set_verdict(&mut self, verdict: Verdict) {
        if let Detail::QuotaExhaustedByLeak(q) = &mut self.detail {
            q.verdict = verdict;
        }
    }

    pub(crate) fn for_test(kind: Kind, key: &str) -> Finding {
        let detail = match kind {
            Kind::CloseWaitBuildup => Detail::CloseWaitBuildup { growth: None },
            Kind::StuckEstablishedPairs => Detail::StuckEstablishedPairs,
            Kind::QuotaExhaustedByLeak => Detail::QuotaExhaustedByLeak(QuotaDetail {
                verdict: Verdict::Leak,
                verdict_known_in_secs: None,
                upstream: Vec::new(),
                orphans: None,
            }),
            Kind::ReconnectStorm => Detail::ReconnectStorm { rate_per_sec: 0.0 },
            Kind::QuotaSourceUnavailable => Detail::QuotaSourceUnavailable {
                reason: String::new(),
            },
            Kind::IdleEstablishedBuildup => Detail::IdleEstablishedBuildup(IdleDetail {
                keepalive: false,
                keepalive_reap_secs: None,
                peers: Vec::new(),
            }),
            Kind::FailingUpstream => Detail::FailingUpstream {
                rate_per_sec: 0.0,
                failing: FailingUpstream::default(),
            },
        };
        Finding::new(detail, key, format!("test finding {key}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every kind's detail serializes its `kind` as the name the config and metrics use.
    #[test]
    fn each_detail_is_tagged_with_its_kinds_name() {
        for kind in Kind::ALL {
            let f = Finding::for_test(kind, "k");
            assert_eq!(f.kind(), kind);
            let json = serde_json::to_value(&f).expect("serializes");
            assert_eq!(json["kind"], kind.as_str(), "{json}");
            assert_eq!(f.fingerprint, format!("{}:k", kind.as_str()));
        }
    }

    #[test]
    fn merging_adds_growth_and_rates_of_the_same_kind_only() {
        let mut a = Detail::CloseWaitBuildup { growth: Some(2) };
        a.absorb(&Detail::CloseWaitBuildup { growth: Some(3) });
        assert_eq!(a, Detail::CloseWaitBuildup { growth: Some(5) });
        a.absorb(&Detail::ReconnectStorm { rate_per_sec: 9.0 });
        assert_eq!(a, Detail::CloseWaitBuildup { growth: Some(5) });
        let mut s = Detail::ReconnectStorm { rate_per_sec: 1.5 };
        s.absorb(&Detail::ReconnectStorm { rate_per_sec: 2.0 });
        assert_eq!(s, Detail::ReconnectStorm { rate_per_sec: 3.5 });
    }
}
