//! Leak detectors: pure functions over the socket table, quota readings and connection-rate
//! windows. Each returns findings; `run` runs them all.
mod close_wait;
mod downstream;
mod ends;
mod failing;
mod finding;
mod idle;
mod pairs;
mod quota;
mod resolved;
mod scope;
mod storm;
mod upstream;

use std::collections::BTreeMap;

use rustc_hash::FxHashSet;

pub use downstream::{Downstreams, Orphan};
pub use ends::{parse_conntrack, Ends, Nat};
pub use failing::{FailTracker, Target};
pub use finding::{
    brief, describe_owners, freed_text, oldest_briefs, owner_identity, processes, Detail, Finding,
    Freed, IdleDetail, OrphanCounts, ProcessCount, QuotaDetail, QuotaRef, Verdict, MAX_SOCKETS,
};
pub use quota::feeders;
pub use resolved::resolution;
pub use scope::identity;
pub use storm::{ConnKey, StormTracker};

use crate::{
    config::{DetectConfig, QuotaConfig},
    quota::QuotaStatus,
    table::Socket,
};

pub use crate::kind::Kind;

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
        first.detail.absorb(&f.detail);
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

#[cfg(test)]
mod merge_tests {
    use super::*;
    use crate::table::{Netns, TcpState};

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
    Finding::for_test(kind, key)
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
        s.set_age(Duration::from_secs(600));
        s.set_idle(Some(Duration::from_secs(600)));
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
