//! One hop upstream of a quota's connections. A relay dials its target (the quota's port) for
//! each stream it accepts on a dial slot of its own: when the process holding a saturated
//! quota's dialled connections also holds inbound connections from other local processes,
//! those processes feed it, and the leak may be theirs (incident 1: a proxy that never aborts
//! its upstream keeps the relay's streams, and so its quota, busy). Without a `port_map`
//! saying which local port carries the quota's streams, this names them: each dialled
//! connection is matched one-to-one to the accepted connection the holder made it for, by
//! timing (the dial follows the accept), or, where ages are not exact, the holder's port
//! carrying the most such connections is taken as a whole.
use std::{
    collections::{BTreeMap, BTreeSet},
    time::Duration,
};

use rustc_hash::FxHashMap;
use serde::Serialize;

use super::downstream::{Orphan, TOLERANCE};
use crate::table::{Direction, Socket, TcpState};

/// Longest time between a holder accepting a connection and the connection it dials for it
/// becoming ESTABLISHED (accept, the holder's own work, a connect): beyond this they are not
/// taken as one stream.
pub const MATCH_WINDOW: Duration = Duration::from_secs(2);

/// Connections accepted by a holder and the other process's end of each.
type Fed<'a> = Vec<(&'a Socket, &'a Socket)>;

/// One stream through the holder: its dialled connection (counted by the quota), the
/// connection it accepted for it, and the upstream process's end of that one.
#[derive(Debug, Clone, Copy)]
pub struct Hop<'a> {
    pub dial: &'a Socket,
    pub accepted: &'a Socket,
    pub origin: &'a Socket,
}

/// How the upstream connections were tied to the quota's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum MatchedBy {
    /// One-to-one, each dial to the accept just before it.
    Timing,
    /// Every connection on the holder's busiest inbound port (ages only lower bounds, or
    /// dials further than [`MATCH_WINDOW`] from their accepts).
    Port,
    /// The quota's `port_map` names the port: its connections' other ends.
    #[serde(rename = "port_map")]
    PortMap,
}

#[derive(Debug, Default)]
pub struct Upstream<'a> {
    pub hops: Vec<Hop<'a>>,
    pub matched_by: Option<MatchedBy>,
    /// Timing matches: the hop of each dial (socket address -> index in `hops`).
    by_dial: FxHashMap<u64, usize>,
}

impl<'a> Upstream<'a> {
    fn timed(hops: Vec<Hop<'a>>) -> Self {
        let by_dial = hops
            .iter()
            .enumerate()
            .map(|(i, h)| (h.dial.skaddr, i))
            .collect();
        Upstream {
            hops,
            matched_by: Some(MatchedBy::Timing),
            by_dial,
        }
    }

    /// The hop carrying the quota connection dialled as `dial` (socket address), if any.
    /// Only timing matches say which stream is which.
    pub fn for_dial(&self, dial: u64) -> Option<&Hop<'a>> {
        self.by_dial.get(&dial).and_then(|&i| self.hops.get(i))
    }
}

/// A process feeding the quota's holder, as a finding reports it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct UpstreamOwner {
    pub pid: Option<u32>,
    pub comm: String,
    pub unit: Option<String>,
    /// The holder it connects to, and the holder's port it connects to.
    pub via_pid: Option<u32>,
    pub via_comm: String,
    pub via_port: u16,
    /// Its connections to the holder that carry the quota's streams.
    pub count: usize,
    /// Of those, how many are idle at both ends (≥ quota_idle_min) or in CLOSE_WAIT.
    pub idle: usize,
    pub matched_by: MatchedBy,
    /// Of `count`, how many are orphaned (the downstream they were dialled for is gone), how
    /// many still serve a connected downstream, and how many could be either (see
    /// `downstream`); all 0 when the process is not a relay (it does not listen).
    pub orphaned: usize,
    pub serving: usize,
    pub ambiguous: usize,
    /// Its network namespace (inode, and name when it has one).
    pub netns: u32,
    pub netns_name: Option<String>,
    /// The full id of the container it runs in, if it runs in one, and its pod.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub container: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pod_name: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pod_namespace: Option<String>,
    /// Where it runs, for people: "netns proxy-pod, pod shop/proxy (docker 0123456789ab)";
    /// empty in connreap's own namespace outside containers.
    #[serde(skip)]
    pub place: String,
}

/// The hops feeding `dials` (the holder processes' connections to the quota's port):
/// `other_end` maps a socket to the other end of its local connection (in its namespace, see
/// `local_pairs`).
pub fn follow<'a>(
    dials: &[&'a Socket],
    table: &'a [Socket],
    other_end: &FxHashMap<u64, &'a Socket>,
) -> Upstream<'a> {
    // Holders by namespace and pid: a process may hold sockets in several namespaces, and
    // only the hop in the dials' namespace feeds them.
    let holders: BTreeSet<(u32, u32)> = dials
        .iter()
        .filter_map(|s| Some((s.netns.inode, s.pid()?)))
        .collect();
    let dialled: BTreeSet<u64> = dials.iter().map(|s| s.skaddr).collect();
    // The holders' accepted connections whose other end another local process owns.
    let fed = table
        .iter()
        .filter(|s| {
            s.direction == Direction::Inbound
                && matches!(s.state, TcpState::Established | TcpState::CloseWait)
                && s.pid()
                    .is_some_and(|p| holders.contains(&(s.netns.inode, p)))
                && !dialled.contains(&s.skaddr)
        })
        .filter_map(|s| {
            let o = other_end.get(&s.skaddr).copied()?;
            (o.pid().is_some() && o.pid() != s.pid()).then_some((s, o))
        });
    // Per holder port: a dial slot carries the quota's streams, other ports (the holder's own
    // API, a status poller) carry a few unrelated connections. The port whose accepts pair
    // with the most dials, by timing, is the slot, if it carries at least half of them.
    let mut per_port: BTreeMap<(Option<u32>, u16), Fed<'a>> = BTreeMap::new();
    for (a, o) in fed {
        per_port
            .entry((a.pid(), a.local.port()))
            .or_default()
            .push((a, o));
    }
    let enough = |n: usize| n > 0 && n * 2 >= dials.len();
    let timed = per_port
        .values()
        .map(|fed| by_timing(dials, fed))
        .max_by_key(Vec::len)
        .unwrap_or_default();
    if enough(timed.len()) {
        return Upstream::timed(timed);
    }
    // Without usable ages (or a dial slower than the window): the busiest port as a whole.
    match per_port.into_values().max_by_key(Vec::len) {
        Some(busiest) if enough(busiest.len()) => Upstream {
            // Hops without a known dial: the accepted socket stands in for it.
            hops: busiest
                .into_iter()
                .map(|(accepted, origin)| Hop {
                    dial: accepted,
                    accepted,
                    origin,
                })
                .collect(),
            matched_by: Some(MatchedBy::Port),
            by_dial: FxHashMap::default(),
        },
        _ => Upstream::default(),
    }
}

/// The quota's own connections (accepted on the port a `port_map` names) as hops from the
/// processes at their other ends.
pub fn mapped<'a>(conns: &[&'a Socket], other_end: &FxHashMap<u64, &'a Socket>) -> Upstream<'a> {
    let hops: Vec<Hop<'a>> = conns
        .iter()
        .filter(|s| s.direction == Direction::Inbound)
        .filter_map(|&s| {
            let o = other_end.get(&s.skaddr).copied()?;
            (o.pid().is_some() && o.pid() != s.pid()).then_some(Hop {
                dial: s,
                accepted: s,
                origin: o,
            })
        })
        .collect();
    Upstream {
        matched_by: (!hops.is_empty()).then_some(MatchedBy::PortMap),
        hops,
        by_dial: FxHashMap::default(),
    }
}

/// Each dial (youngest first) takes the youngest unmatched accept of the same holder that is
/// older, by at most [`MATCH_WINDOW`] (or reads younger by at most [`TOLERANCE`]): one-to-one,
/// each dial to the accept it was made for when the holder dials right after accepting; within
/// a burst, where those are too close to tell apart, to one of them. Dials in age order, each
/// taking the youngest accept it may, match as many as any pairing can (every dial's range of
/// accept ages is as long). Sockets whose age is only a lower bound take no part.
fn by_timing<'a>(dials: &[&'a Socket], fed: &[(&'a Socket, &'a Socket)]) -> Vec<Hop<'a>> {
    // Per holder pid: unmatched accepts by (age, index).
    let mut open: BTreeMap<(Option<u32>, Duration, usize), (&Socket, &Socket)> = fed
        .iter()
        .enumerate()
        .filter(|(_, (a, _))| a.age_exact && a.state == TcpState::Established)
        .map(|(i, &(a, o))| ((a.pid(), a.age(), i), (a, o)))
        .collect();
    // Ages are times in the current state: only ESTABLISHED ones date the connection.
    let mut order: Vec<&Socket> = dials
        .iter()
        .copied()
        .filter(|d| d.age_exact && d.state == TcpState::Established)
        .collect();
    order.sort_by_key(|d| d.age());
    let mut hops = Vec::new();
    for dial in order {
        let from = (dial.pid(), dial.age().saturating_sub(TOLERANCE), 0);
        let to = (dial.pid(), dial.age() + MATCH_WINDOW, usize::MAX);
        let Some((&key, &(accepted, origin))) = open.range(from..=to).next() else {
            continue;
        };
        open.remove(&key);
        hops.push(Hop {
            dial,
            accepted,
            origin,
        });
    }
    hops
}

/// The upstream processes of `up`, most connections first; `idle` tells an idle socket,
/// `serving` whether a feeder's connection still serves a downstream of its own.
pub fn owners(
    up: &Upstream<'_>,
    idle: impl Fn(&Socket) -> bool,
    serving: impl Fn(&Socket) -> Option<Orphan>,
) -> Vec<UpstreamOwner> {
    let Some(matched_by) = up.matched_by else {
        return Vec::new();
    };
    let mut by: BTreeMap<(Option<u32>, Option<u32>, u16), UpstreamOwner> = BTreeMap::new();
    for h in &up.hops {
        let key = (h.origin.pid(), h.accepted.pid(), h.accepted.local.port());
        let ct = h.origin.container();
        let o = by.entry(key).or_insert_with(|| UpstreamOwner {
            pid: h.origin.pid(),
            comm: h.origin.comm().to_string(),
            unit: h.origin.unit(),
            via_pid: h.accepted.pid(),
            via_comm: h.accepted.comm().to_string(),
            via_port: h.accepted.local.port(),
            count: 0,
            idle: 0,
            matched_by,
            orphaned: 0,
            serving: 0,
            ambiguous: 0,
            netns: h.origin.netns.inode,
            netns_name: h.origin.netns.name.as_deref().map(String::from),
            container: ct.map(|c| c.id.clone()),
            pod_name: ct.and_then(|c| c.pod_name.clone()),
            pod_namespace: ct.and_then(|c| c.pod_namespace.clone()),
            place: super::scope::place_text(&h.origin.netns, ct),
        });
        o.count += 1;
        if idle(h.accepted) && idle(h.origin) {
            o.idle += 1;
        }
        match serving(h.origin) {
            Some(Orphan::Orphaned) => o.orphaned += 1,
            Some(Orphan::Serving) => o.serving += 1,
            Some(Orphan::Ambiguous) => o.ambiguous += 1,
            None => {}
        }
    }
    let mut v: Vec<UpstreamOwner> = by.into_values().collect();
    v.sort_by(|a, b| b.count.cmp(&a.count).then(a.pid.cmp(&b.pid)));
    v
}

/// "fed through relay-sim (port 25001) by leaky-proxy pid 12 (netns proxy-pod, pod shop/proxy
/// (docker 0123456789ab)): 64 connections, 64 idle, 61 orphaned, matched by timing"
pub fn describe(owners: &[UpstreamOwner]) -> String {
    owners
        .iter()
        .map(|o| {
            format!(
                "fed through {} (port {}) by {} pid {}{}: {} connection{}, {} idle{}, matched by {}",
                o.via_comm,
                o.via_port,
                o.comm,
                o.pid.map(|p| p.to_string()).unwrap_or_else(|| "?".into()),
                if o.place.is_empty() {
                    String::new()
                } else {
                    format!(" ({})", o.place)
                },
                o.count,
                if o.count == 1 { "" } else { "s" },
                o.idle,
                super::downstream::counts_text(o.orphaned, o.serving, o.ambiguous),
                match o.matched_by {
                    MatchedBy::Timing => "timing",
                    MatchedBy::Port => "port",
                    MatchedBy::PortMap => "port_map",
                }
            )
        })
        .collect::<Vec<_>>()
        .join("; ")
}

#[cfg(test)]
mod tests {
    use std::{sync::Arc, time::Duration};

    use super::*;
    use crate::{
        config::{parse, DetectConfig, QuotaConfig},
        detect::{quota, Finding, Input, StormTracker, Verdict},
        quota::{QuotaEntry, QuotaStatus},
        table::Owner,
    };

    fn socket(pid: u32, comm: &str, local: &str, peer: &str, dir: Direction) -> Socket {
        let mut s = Socket::new(
            local.parse().unwrap(),
            peer.parse().unwrap(),
            TcpState::Established,
        );
        s.direction = dir;
        s.owner = Some(Arc::new(Owner {
            pid,
            comm: comm.into(),
            unit: None,
            container: None,
        }));
        s
    }

    /// The seed chain without a port_map: `n` streams node (pid 10) -> relay (pid 20) on
    /// 25001 -> instance (pid 30) on 21000, stream i opened `gap_ms` after stream i-1, the
    /// relay's dial 10 ms after its accept; all idle `idle` s, except the proxy's hop idle
    /// `hop_idle` s. Plus the agent polling the relay's status port.
    fn chain(n: u32, gap_ms: u64, idle: u64, hop_idle: u64) -> Vec<Socket> {
        let mut t = Vec::new();
        let mut add = |mut s: Socket, age: Duration, idle: u64| {
            s.skaddr = 1 + t.len() as u64;
            s.set_age(age);
            s.set_idle(Some(Duration::from_secs(idle)));
            t.push(s);
        };
        for i in 0..n {
            let age = Duration::from_secs(600) - Duration::from_millis(gap_ms * i as u64);
            let dial_age = age - Duration::from_millis(10);
            let p = format!("127.0.0.1:{}", 40000 + i);
            let r = format!("127.0.0.1:{}", 50000 + i);
            use Direction::{Inbound, Outbound};
            add(
                socket(10, "node", &p, "127.0.0.1:25001", Outbound),
                age,
                hop_idle,
            );
            add(
                socket(20, "relay", "127.0.0.1:25001", &p, Inbound),
                age,
                hop_idle,
            );
            add(
                socket(20, "relay", &r, "127.0.0.1:21000", Outbound),
                dial_age,
                idle,
            );
            add(
                socket(30, "instance", "127.0.0.1:21000", &r, Inbound),
                dial_age,
                idle,
            );
        }
        let status = Duration::from_millis(600_000 - gap_ms * n as u64 / 2);
        add(
            socket(
                40,
                "connreap",
                "127.0.0.1:45000",
                "127.0.0.1:20080",
                Direction::Outbound,
            ),
            status,
            0,
        );
        add(
            socket(
                20,
                "relay",
                "127.0.0.1:20080",
                "127.0.0.1:45000",
                Direction::Inbound,
            ),
            status,
            0,
        );
        t
    }

    fn run(table: &[Socket], port_map: bool) -> Finding {
        use crate::quota::tests::{relay_toml, RELAY_URL};
        let text = relay_toml(
            RELAY_URL,
            if port_map {
                "limit_field = \"maxStreams\"\nport_map = { \"21000\" = 25001 }"
            } else {
                "limit_field = \"maxStreams\""
            },
        );
        let cfgs: Vec<QuotaConfig> = parse(&text, "t").unwrap().quota;
        let cfg = DetectConfig::default();
        let storm = StormTracker::default();
        let quotas = [QuotaStatus {
            name: "relay".into(),
            source: crate::quota::Source::Http,
            url: None,
            last_poll: None,
            entries: vec![QuotaEntry {
                port: 21000,
                used: 64,
                limit: 64,
            }],
            error: None,
        }];
        let mut f = quota::detect(
            &Input {
                table,
                cfg: &cfg,
                quota_cfgs: &cfgs,
                quotas: &quotas,
                storm: &storm,
                failing: None,
                nat: None,
                freed: &[],
            },
            &crate::detect::Relations::new(table),
        );
        assert_eq!(f.len(), 1);
        f.remove(0)
    }

    fn pids(f: &Finding) -> Vec<(Option<u32>, &str, usize)> {
        f.processes
            .iter()
            .map(|p| (p.pid, p.comm.as_str(), p.count))
            .collect()
    }

    #[test]
    fn names_the_proxy_behind_the_relay_without_port_map() {
        // Streams opened in a burst (1 ms apart, closer than the relay's accept-to-dial).
        for gap_ms in [1, 3000] {
            let f = run(&chain(64, gap_ms, 360, 360), false);
            assert_eq!(f.verdict(), Some(Verdict::Leak), "{}", f.summary);
            assert_eq!(
                f.upstream(),
                vec![UpstreamOwner {
                    pid: Some(10),
                    comm: "node".into(),
                    unit: None,
                    via_pid: Some(20),
                    via_comm: "relay".into(),
                    via_port: 25001,
                    count: 64,
                    idle: 64,
                    matched_by: MatchedBy::Timing,
                    orphaned: 0,
                    serving: 0,
                    ambiguous: 0,
                    netns: 0,
                    netns_name: None,
                    container: None,
                    pod_name: None,
                    pod_namespace: None,
                    place: String::new(),
                }],
                "gap {gap_ms} ms"
            );
            assert_eq!(
                pids(&f),
                [
                    (Some(10), "node", 64),
                    (Some(20), "relay", 64),
                    (Some(30), "instance", 64)
                ]
            );
            assert!(
                f.summary.ends_with(
                    "held by relay pid 20 ↔ instance pid 30; fed through relay (port 25001) by node pid 10: 64 connections, 64 idle, matched by timing; verdict: leak"
                ),
                "{}",
                f.summary
            );
            assert!(
                f.sockets.iter().any(|s| s.comm == "node"),
                "the proxy's sockets are listed"
            );
        }
    }

    /// The chain inside one namespace is followed as on the host; a proxy whose end of the hop
    /// is in another namespace (same addresses, another connection) feeds nothing. (The quota
    /// names no namespace: its sockets are those of connreap's own, `a` here.)
    #[test]
    fn the_hop_is_followed_inside_one_namespace_only() {
        use crate::detect::scope_testutil::{netns, place};
        let a = Arc::new(crate::table::Netns {
            own: true,
            ..(*netns(51, Some("a"))).clone()
        });
        let b = netns(52, Some("b"));
        let inside: Vec<Socket> = chain(64, 1, 360, 360)
            .into_iter()
            .map(|s| place(s, &a, None))
            .collect();
        let f = run(&inside, false);
        assert_eq!(f.upstream().len(), 1, "{}", f.summary);
        assert_eq!((f.upstream()[0].pid, f.upstream()[0].count), (Some(10), 64));
        let split: Vec<Socket> = chain(64, 1, 360, 360)
            .into_iter()
            .map(|s| {
                let ns = if s.comm() == "node" { &b } else { &a };
                place(s, ns, None)
            })
            .collect();
        let f = run(&split, false);
        assert!(f.upstream().is_empty(), "{:?}", f.upstream());
    }

    /// Ages read at different moments of one dump: each relay dial, made 10 ms after its
    /// accept, reads 4 ms (a jiffy) older than it. Every dial is still matched by timing, in
    /// a burst and one stream at a time.
    #[test]
    fn dials_that_read_older_than_their_accepts_still_match() {
        for gap_ms in [1, 3000] {
            let mut t = chain(64, gap_ms, 360, 360);
            for s in t
                .iter_mut()
                .filter(|s| s.peer.port() == 21000 || s.local.port() == 21000)
            {
                s.set_age(s.age() + Duration::from_millis(14));
            }
            let f = run(&t, false);
            let u = f.upstream();
            assert_eq!(
                u.iter()
                    .map(|u| (u.pid, u.count, u.matched_by))
                    .collect::<Vec<_>>(),
                [(Some(10), 64, MatchedBy::Timing)],
                "gap {gap_ms} ms: {}",
                f.summary
            );
        }
    }

    #[test]
    fn busy_upstream_makes_the_verdict_load() {
        let f = run(&chain(64, 1, 360, 1), false);
        assert_eq!(f.verdict(), Some(Verdict::Load), "{}", f.summary);
        assert_eq!(f.upstream()[0].idle, 0);
        assert!(
            f.summary.contains("0 of 64 connections idle"),
            "{}",
            f.summary
        );
    }

    #[test]
    fn inexact_ages_fall_back_to_the_busiest_port() {
        let mut t = chain(64, 1, 360, 360);
        for s in &mut t {
            s.age_exact = false;
        }
        let f = run(&t, false);
        assert_eq!(f.upstream().len(), 1);
        let u = &f.upstream()[0];
        assert_eq!(
            (u.pid, u.via_port, u.count, u.matched_by),
            (Some(10), 25001, 64, MatchedBy::Port)
        );
        assert!(f.summary.contains("matched by port"), "{}", f.summary);
    }

    #[test]
    fn port_map_stays_the_explicit_way() {
        let f = run(&chain(64, 1, 360, 360), true);
        assert_eq!(f.upstream().len(), 1, "{:?}", f.upstream());
        assert_eq!(
            (
                f.upstream()[0].pid,
                f.upstream()[0].count,
                f.upstream()[0].matched_by
            ),
            (Some(10), 64, MatchedBy::PortMap)
        );
        assert_eq!(pids(&f), [(Some(10), "node", 64), (Some(20), "relay", 64)]);
        assert!(!f.summary.contains("fed through"), "{}", f.summary);
    }

    #[test]
    fn a_lone_client_is_not_a_feeder() {
        // Only the status poller feeds the relay: one connection (even one made within the
        // window of a dial) does not make a dial slot.
        let t: Vec<Socket> = chain(64, 1, 360, 360)
            .into_iter()
            .filter(|s| s.comm() != "node" && s.local.port() != 25001)
            .collect();
        let f = run(&t, false);
        assert!(f.upstream().is_empty(), "{:?}", f.upstream());
        assert_eq!(f.verdict(), Some(Verdict::Leak));
    }
}
