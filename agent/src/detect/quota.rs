//! quota_exhausted_by_leak and quota_source_unavailable.
use std::time::Duration;

use rustc_hash::FxHashMap;

use super::{
    describe_owners, oldest_briefs, processes,
    upstream::{self, Upstream},
    Detail, Finding, Freed, Input, OrphanCounts, QuotaDetail, QuotaRef, Relations, Verdict,
    MAX_SOCKETS,
};
use crate::{
    config::QuotaConfig,
    present::{human, round_secs},
    quota::{static_sockets, QuotaEntry, QuotaStatus, Scope},
    table::{Direction, Socket, TcpState},
};

/// The connections carrying a quota entry's streams, in the quota's namespace (`scope`): for
/// HTTP sources the sockets accepted on the (mapped) port, else the ones dialled to it; for
/// static sources the process's sockets to the peer.
fn connections<'a>(
    cfg: &'a QuotaConfig,
    scope: &Scope<'_>,
    entry: &QuotaEntry,
    table: &'a [Socket],
) -> Vec<&'a Socket> {
    if !cfg.is_http() {
        return static_sockets(cfg, table).collect();
    }
    let port = cfg.socket_port(entry.port);
    let live = |s: &&Socket| {
        !matches!(s.state, TcpState::Listen | TcpState::TimeWait) && scope.contains(s)
    };
    let inbound: Vec<&Socket> = table
        .iter()
        .filter(live)
        .filter(|s| s.direction == Direction::Inbound && s.local.port() == port)
        .collect();
    if !inbound.is_empty() {
        return inbound;
    }
    table
        .iter()
        .filter(live)
        .filter(|s| s.direction == Direction::Outbound && s.peer.port() == port)
        .collect()
}

pub fn detect<'a>(input: &Input<'a>, rel: &Relations<'a>) -> Vec<Finding> {
    let cfg = input.cfg;
    let saturated = |e: &QuotaEntry| (e.used as f64) >= cfg.quota_saturation * e.limit as f64;
    let any_saturated = input
        .quotas
        .iter()
        .filter(|s| s.error.is_none())
        .any(|s| s.entries.iter().any(saturated));
    // The other end of each connection on this host (across namespaces too), to name both
    // owners (only needed, and only computed, when some quota is saturated).
    let other_end: FxHashMap<u64, &Socket> = if any_saturated {
        rel.ends().by_skaddr(input.table)
    } else {
        FxHashMap::default()
    };
    let mut out = Vec::new();
    for status in input.quotas.iter().filter(|s| s.error.is_none()) {
        let Some(qcfg) = input.quota_cfgs.iter().find(|q| q.name == status.name) else {
            continue;
        };
        let scope = Scope::of(qcfg, input.table);
        for entry in &status.entries {
            if !saturated(entry) {
                continue;
            }
            let conns = connections(qcfg, &scope, entry, input.table);
            let quiet = |s: &Socket| {
                s.state == TcpState::CloseWait || s.idle().is_some_and(|i| i >= cfg.quota_idle_min)
            };
            let up = upstream_of(qcfg, entry, &conns, input.table, &other_end);
            // A connection fed through a relay hop is idle only if the hop is idle too.
            let idle: Vec<&Socket> = conns
                .iter()
                .copied()
                .filter(|s| {
                    quiet(s)
                        && dial_of(s, &other_end)
                            .and_then(|d| up.for_dial(d.skaddr))
                            .is_none_or(|h| quiet(h.accepted) && quiet(h.origin))
                })
                .collect();
            // Connections a reclaim closed after this reading: it still counts them.
            let freed: Vec<&Freed> = input
                .freed
                .iter()
                .filter(|f| f.of(&status.name, entry.port, status.last_poll))
                .collect();
            let (verdict, known_in) = match freed.is_empty() {
                true => verdict(&conns, idle.len(), cfg.quota_idle_min),
                false => (Verdict::Reclaimed, None),
            };
            let ends: Vec<&Socket> = conns
                .iter()
                .flat_map(|s| [Some(*s), other_end.get(&s.skaddr).copied()])
                .flatten()
                .collect();
            let mut feeders = upstream::owners(&up, quiet, |s| rel.serving(s));
            // With a port_map, the feeders are the other ends of the quota's own connections:
            // listed the same way (the summary's "held by" already names them).
            let mapped =
                up.hops.is_empty() && qcfg.is_http() && qcfg.socket_port(entry.port) != entry.port;
            if mapped {
                let by_map = upstream::mapped(&conns, &other_end);
                feeders = upstream::owners(&by_map, quiet, |s| rel.serving(s));
            }
            let feeding = feeding(&up, &conns, &other_end);
            let orphans = OrphanCounts::of(&feeding, |s| rel.serving(s));
            let procs = processes(ends.iter().copied().chain(up.hops.iter().map(|h| h.origin)));
            let oldest = conns.iter().map(|s| s.age()).max().unwrap_or_default();
            let mut summary = summary(qcfg, &scope, entry, &conns, &idle, &other_end, cfg);
            if let Some(text) = super::freed_text(&freed) {
                summary.push_str(&format!(
                    "; {text} since this reading, which still counts them"
                ));
            }
            if !feeders.is_empty() && !mapped {
                summary.push_str(&format!("; {}", upstream::describe(&feeders)));
            } else if let Some(o) = &orphans {
                summary.push_str(&format!(
                    "; of {} feeding connections{}",
                    o.feeding,
                    super::downstream::counts_text(o.orphaned, o.serving, o.ambiguous)
                ));
            }
            summary.push_str(&verdict_text(
                verdict,
                known_in,
                cfg.quota_idle_min,
                conns.is_empty(),
            ));
            let mut f = Finding::new(
                Detail::QuotaExhaustedByLeak(QuotaDetail {
                    verdict,
                    verdict_known_in_secs: known_in.map(round_secs),
                    upstream: feeders,
                    orphans,
                }),
                &format!("{}:{}{}", status.name, entry.port, scope.fingerprint_part()),
                summary,
            );
            f.service_port = Some(entry.port);
            f.count = conns.len();
            f.oldest_age_secs = round_secs(oldest);
            f.processes = procs;
            f.quota = Some(QuotaRef {
                name: status.name.clone(),
                used: entry.used,
                limit: entry.limit,
                port: Some(entry.port),
            });
            // Both the quota's own connections and the hop that feeds them, half the list each
            // when there is a hop (one list sorted by age could hold only one side). The hop's
            // half lists whole connections, both ends of each, oldest first: sorted by socket
            // age alone it could list only the holder's accepted ends, never the feeder's.
            f.sockets = oldest_briefs(ends.iter().copied());
            if !up.hops.is_empty() {
                f.sockets.truncate(MAX_SOCKETS / 2);
                let mut hops: Vec<_> = up.hops.iter().collect();
                hops.sort_by_key(|h| std::cmp::Reverse(h.origin.age().max(h.accepted.age())));
                f.sockets.extend(
                    hops.iter()
                        .take(MAX_SOCKETS / 4)
                        .flat_map(|h| [h.accepted, h.origin])
                        .map(super::brief),
                );
            }
            // Where the quota's connections are: its namespace, and the container of the
            // process holding its side of them (the relay's).
            if let Some(s) = conns.first() {
                f.place(&s.netns, s.container());
            }
            out.push(f);
        }
    }
    out
}

/// The feeding connections' feeder ends: the hop's when one was followed, else the other ends
/// of the quota's own connections (a port_map names the port the feeder dials).
fn feeding<'a>(
    up: &Upstream<'a>,
    conns: &[&'a Socket],
    other_end: &FxHashMap<u64, &'a Socket>,
) -> Vec<&'a Socket> {
    if up.hops.is_empty() {
        conns
            .iter()
            .filter_map(|s| other_end.get(&s.skaddr).copied())
            .collect()
    } else {
        up.hops.iter().map(|h| h.origin).collect()
    }
}

/// The processes (pid, namespace inode) feeding the saturated entries of quota `qcfg`: the
/// hop's origins when one is followed, else the other ends of the quota's connections. A
/// quota-triggered policy may act on their sockets in their namespaces: that is where a leak
/// through a relay is (the proxy's pod), not the quota's.
pub fn feeders(
    qcfg: &QuotaConfig,
    status: &QuotaStatus,
    saturation: f64,
    rel: &Relations<'_>,
) -> Vec<(u32, u32)> {
    let table = rel.table();
    let other_end = rel.ends().by_skaddr(table);
    let scope = Scope::of(qcfg, table);
    let mut out: Vec<(u32, u32)> = Vec::new();
    for entry in &status.entries {
        if (entry.used as f64) < saturation * entry.limit as f64 {
            continue;
        }
        let conns = connections(qcfg, &scope, entry, table);
        let up = upstream_of(qcfg, entry, &conns, table, &other_end);
        let feeding = feeding(&up, &conns, &other_end);
        out.extend(
            feeding
                .iter()
                .filter_map(|s| Some((s.pid()?, s.netns.inode))),
        );
    }
    out.sort_unstable();
    out.dedup();
    out
}

/// The quota holder's end of connection `s`: its other end when `s` was accepted (on the
/// quota's port), else `s` itself.
fn dial_of<'a>(s: &'a Socket, other_end: &FxHashMap<u64, &'a Socket>) -> Option<&'a Socket> {
    match s.direction {
        Direction::Inbound => other_end.get(&s.skaddr).copied(),
        _ => Some(s),
    }
}

/// One hop upstream of an HTTP quota's connections, unless a `port_map` already says which
/// local port carries them (static sources name their process themselves).
fn upstream_of<'a>(
    qcfg: &QuotaConfig,
    entry: &QuotaEntry,
    conns: &[&'a Socket],
    table: &'a [Socket],
    other_end: &FxHashMap<u64, &'a Socket>,
) -> Upstream<'a> {
    if !qcfg.is_http() || qcfg.socket_port(entry.port) != entry.port {
        return Upstream::default();
    }
    let dials: Vec<&Socket> = conns.iter().filter_map(|s| dial_of(s, other_end)).collect();
    upstream::follow(&dials, table, other_end)
}

/// The finding's summary: the quota reading, how many of its connections are idle, who holds
/// both ends, and the verdict.
fn summary(
    qcfg: &QuotaConfig,
    scope: &Scope<'_>,
    entry: &QuotaEntry,
    conns: &[&Socket],
    idle: &[&Socket],
    other_end: &FxHashMap<u64, &Socket>,
    cfg: &crate::config::DetectConfig,
) -> String {
    let socket_port = qcfg.socket_port(entry.port);
    // Where the ports are, unless in connreap's own namespace.
    let place = scope
        .describe()
        .map(|p| format!(" {p}"))
        .unwrap_or_default();
    let mut summary = format!(
        "{} quota on port {}{place} at {}/{}",
        qcfg.name, entry.port, entry.used, entry.limit
    );
    if socket_port != entry.port {
        summary.push_str(&format!(" (connections on local port {socket_port})"));
    }
    if conns.is_empty() {
        summary.push_str(if place.is_empty() {
            "; no matching connections on this host"
        } else {
            "; no matching connections there"
        });
        return summary;
    }
    summary.push_str(&format!(
        "; {} of {} connections idle{} for ≥ {}",
        idle.len(),
        conns.len(),
        if idle.iter().any(|s| s.state == TcpState::CloseWait) {
            " or CLOSE_WAIT"
        } else {
            ""
        },
        human(cfg.quota_idle_min)
    ));
    let mut sides: Vec<String> = Vec::new();
    let client_side: Vec<&Socket> = conns
        .iter()
        .filter_map(|s| other_end.get(&s.skaddr).copied())
        .collect();
    if !client_side.is_empty() {
        sides.push(describe_owners(&processes(client_side.iter().copied())));
    }
    sides.push(describe_owners(&processes(conns.iter().copied())));
    summary.push_str(&format!("; held by {}", sides.join(" ↔ ")));
    summary
}

/// Leak when most connections are idle (or CLOSE_WAIT); load when most are busy and old enough
/// that their idleness could have shown; pending otherwise, with the longest wait until it is
/// known (the youngest deciding connection reaching `idle_min`).
fn verdict(conns: &[&Socket], idle: usize, idle_min: Duration) -> (Verdict, Option<Duration>) {
    if !conns.is_empty() && idle * 2 > conns.len() {
        return (Verdict::Leak, None);
    }
    let young: Vec<Duration> = conns
        .iter()
        .filter(|s| s.state != TcpState::CloseWait && s.age() < idle_min)
        .map(|s| idle_min - s.age())
        .collect();
    if conns.is_empty() || (idle + young.len()) * 2 <= conns.len() {
        return (Verdict::Load, None);
    }
    (Verdict::Pending, young.iter().max().copied())
}

fn verdict_text(
    verdict: Verdict,
    known_in: Option<Duration>,
    idle_min: Duration,
    none_here: bool,
) -> String {
    match verdict {
        Verdict::Leak => "; verdict: leak".into(),
        Verdict::Load if none_here => {
            "; verdict: load (not leaked here: none of its connections are on this host)".into()
        }
        Verdict::Load => "; verdict: load (connections are busy)".into(),
        Verdict::Reclaimed => "; verdict: reclaimed (the source's next reading tells)".into(),
        Verdict::Pending => format!(
            "; verdict: pending (connections younger than quota_idle_min {}; known in ≤ {})",
            human(idle_min),
            human(known_in.unwrap_or_default())
        ),
    }
}

pub fn unavailable(quotas: &[QuotaStatus]) -> Vec<Finding> {
    quotas
        .iter()
        .filter_map(|q| {
            let reason = q.error.as_ref()?;
            Some(Finding::new(
                Detail::QuotaSourceUnavailable {
                    reason: reason.clone(),
                },
                &q.name,
                format!("quota source {} unavailable: {reason}", q.name),
            ))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::kind::Kind;
    use crate::{
        config::{parse, DetectConfig},
        detect::{testutil::sock, StormTracker},
    };

    fn cfgs() -> Vec<QuotaConfig> {
        use crate::quota::tests::{relay_toml, RELAY_URL};
        let relay = relay_toml(
            RELAY_URL,
            "limit_field = \"maxStreams\"\nport_map = { \"21000\" = 25001 }",
        );
        parse(
            &(relay
                + r#"[[quota]]
name = "pool"
process = "java"
peer = "10.0.16.36:80"
limit = 4
"#),
            "t",
        )
        .unwrap()
        .quota
    }

    fn relay_table(n: u16, idle: u64) -> Vec<Socket> {
        (0..n)
            .flat_map(|i| {
                let cl = format!("127.0.0.1:{}", 40000 + i);
                let mut c = sock(10, "node", &cl, "127.0.0.1:25001", TcpState::Established);
                let mut s = sock(20, "relay", "127.0.0.1:25001", &cl, TcpState::Established);
                c.set_idle(Some(Duration::from_secs(idle)));
                s.set_idle(Some(Duration::from_secs(idle)));
                [c, s]
            })
            .collect()
    }

    fn run(table: &[Socket], used: u64, limit: u64, quota_cfgs: &[QuotaConfig]) -> Vec<Finding> {
        run_freed(table, used, limit, quota_cfgs, &[])
    }

    fn run_freed(
        table: &[Socket],
        used: u64,
        limit: u64,
        quota_cfgs: &[QuotaConfig],
        freed: &[Freed],
    ) -> Vec<Finding> {
        let cfg = DetectConfig::default();
        let storm = StormTracker::default();
        let quotas = vec![QuotaStatus {
            name: "relay".into(),
            source: crate::quota::Source::Http,
            url: None,
            last_poll: None,
            entries: vec![QuotaEntry {
                port: 21000,
                used,
                limit,
            }],
            error: None,
        }];
        let input = Input {
            table,
            cfg: &cfg,
            quota_cfgs,
            quotas: &quotas,
            storm: &storm,
            failing: None,
            nat: None,
            freed,
        };
        detect(&input, &Relations::new(table))
    }

    #[test]
    fn after_a_reclaim_a_stale_reading_says_so_not_load() {
        // The reclaim closed every connection; the reading (taken before) still says 64/64.
        let kill = Freed {
            quota: "relay".into(),
            port: Some(21000),
            policy: "relay-leaks".into(),
            at: chrono::Utc::now(),
        };
        let f = run_freed(&[], 64, 64, &cfgs(), &vec![kill; 8]);
        assert_eq!(f.len(), 1);
        assert_eq!(f[0].verdict(), Some(Verdict::Reclaimed), "{}", f[0].summary);
        assert!(
            f[0].summary.contains("8 connections freed by reclaim (policy relay-leaks) since this reading, which still counts them; verdict: reclaimed"),
            "{}", f[0].summary
        );
        // Without a reclaim, no connection here is not "busy".
        let f = run(&[], 64, 64, &cfgs());
        assert!(
            f[0].summary.ends_with(
                "verdict: load (not leaked here: none of its connections are on this host)"
            ),
            "{}",
            f[0].summary
        );
    }

    #[test]
    fn relay_case_reads_as_leak_with_both_owners() {
        let t = relay_table(64, 360);
        let f = run(&t, 64, 64, &cfgs());
        assert_eq!(f.len(), 1);
        let f = &f[0];
        assert_eq!(f.verdict(), Some(Verdict::Leak));
        assert_eq!(
            f.quota,
            Some(QuotaRef {
                name: "relay".into(),
                used: 64,
                limit: 64,
                port: Some(21000),
            })
        );
        assert_eq!(f.count, 64);
        assert!(
            f.summary.starts_with("relay quota on port 21000 at 64/64 (connections on local port 25001); 64 of 64 connections idle for ≥ 1m00s; held by node pid 10 ↔ relay pid 20"),
            "{}", f.summary
        );
        let comms: Vec<&str> = f.processes.iter().map(|p| p.comm.as_str()).collect();
        assert!(comms.contains(&"node") && comms.contains(&"relay"));
    }

    #[test]
    fn young_busy_connections_make_a_pending_verdict_with_when_it_is_known() {
        // Default quota_idle_min is 1m: connections 20 s old cannot have been idle for it yet.
        let mut t = relay_table(64, 2);
        for s in &mut t {
            s.set_age(Duration::from_secs(20));
        }
        let f = &run(&t, 64, 64, &cfgs())[0];
        assert_eq!(f.verdict(), Some(Verdict::Pending));
        assert_eq!(
            f.quota_detail().and_then(|q| q.verdict_known_in_secs),
            Some(40.0)
        );
        assert!(
            f.summary.ends_with(
                "verdict: pending (connections younger than quota_idle_min 1m00s; known in ≤ 40s)"
            ),
            "{}",
            f.summary
        );
        assert!(
            f.summary.contains("0 of 64 connections idle for ≥ 1m00s"),
            "{}",
            f.summary
        );
        // Once they are older than the threshold, busy connections read as load.
        for s in &mut t {
            s.set_age(Duration::from_secs(61));
        }
        assert_eq!(run(&t, 64, 64, &cfgs())[0].verdict(), Some(Verdict::Load));
    }

    #[test]
    fn busy_connections_read_as_load_and_unsaturated_is_silent() {
        let t = relay_table(64, 2);
        assert_eq!(run(&t, 64, 64, &cfgs())[0].verdict(), Some(Verdict::Load));
        assert!(run(&t, 50, 64, &cfgs()).is_empty());
    }

    #[test]
    fn static_pool_counts_process_sockets_to_peer() {
        let cfgs = cfgs();
        let t: Vec<Socket> = (0..4)
            .map(|i| {
                sock(
                    7,
                    "java",
                    &format!("[::ffff:10.0.0.5]:{}", 40000 + i),
                    "[::ffff:10.0.16.36]:80",
                    TcpState::CloseWait,
                )
            })
            .collect();
        let st = crate::quota::static_status(&cfgs[1], &t, chrono::Utc::now());
        assert_eq!(
            st.entries[0],
            QuotaEntry {
                port: 80,
                used: 4,
                limit: 4
            }
        );
        let cfg = DetectConfig::default();
        let storm = StormTracker::default();
        let f = detect(
            &Input {
                table: &t,
                cfg: &cfg,
                quota_cfgs: &cfgs,
                quotas: &[st],
                storm: &storm,
                failing: None,
                nat: None,
                freed: &[],
            },
            &Relations::new(&t),
        );
        assert_eq!(f[0].verdict(), Some(Verdict::Leak));
        assert!(
            f[0].summary
                .contains("4 of 4 connections idle or CLOSE_WAIT"),
            "{}",
            f[0].summary
        );
    }

    /// `n` relay connections in namespace `ns` (client ports from `first`), by `pid` (node)
    /// and `pid + 1` (relay).
    fn relay_in(ns: u32, n: u16, first: u16, pid: u32) -> Vec<Socket> {
        (0..n)
            .flat_map(|i| {
                let cl = format!("127.0.0.1:{}", first + i);
                let c = sock(pid, "node", &cl, "127.0.0.1:25001", TcpState::Established);
                let s = sock(
                    pid + 1,
                    "relay",
                    "127.0.0.1:25001",
                    &cl,
                    TcpState::Established,
                );
                [c, s].map(|s| crate::quota::placed(s, ns, None))
            })
            .collect()
    }

    #[test]
    fn a_quota_counts_only_the_connections_of_its_namespace() {
        let mut t = relay_in(1, 64, 40000, 10);
        t.extend(relay_in(2, 10, 41000, 30));
        let blue = |netns: &str| {
            let mut c = cfgs();
            c[0].netns = Some(netns.into());
            c
        };
        let f = run(&t, 10, 10, &blue("blue"));
        assert_eq!(f[0].count, 10);
        assert!(
            f[0].summary.starts_with(
                "relay quota on port 21000 in netns blue at 10/10 (connections on local port 25001); \
                 10 of 10 connections idle for ≥ 1m00s; held by node pid 30 ↔ relay pid 31"
            ),
            "{}",
            f[0].summary
        );
        assert_eq!(run(&t, 10, 10, &blue("2"))[0].count, 10);
        // Without netns: connreap's own namespace only, said nothing about.
        let f = run(&t, 64, 64, &cfgs());
        assert_eq!(f[0].count, 64);
        assert!(f[0]
            .summary
            .starts_with("relay quota on port 21000 at 64/64"));
        assert!(f[0].summary.contains("node pid 10 ↔ relay pid 11"));
        // A namespace with none of its connections.
        let f = run(&t, 10, 10, &blue("red"));
        assert_eq!(f[0].count, 0);
        assert!(
            f[0].summary.contains("in netns red at 10/10 (connections on local port 25001); no matching connections there"),
            "{}",
            f[0].summary
        );
    }

    #[test]
    fn a_container_quota_counts_its_namespace() {
        let id = "3f2a".repeat(16);
        let mut t = relay_in(1, 8, 40000, 10);
        // The relay runs in the container; its clients in another container of the same pod.
        t.extend(relay_in(5, 6, 41000, 30).into_iter().map(|s| {
            let c = (s.comm() == "relay").then_some(id.as_str());
            crate::quota::placed(s, 5, c)
        }));
        let mut c = cfgs();
        c[0].container = Some("3f2a3f".into());
        let f = run(&t, 6, 6, &c);
        assert_eq!(f[0].count, 6);
        assert!(
            f[0].summary.starts_with(
                "relay quota on port 21000 in the netns of container 3f2a3f (5) at 6/6"
            ),
            "{}",
            f[0].summary
        );
        assert!(
            f[0].summary.contains("node pid 30 ↔ relay pid 31"),
            "{}",
            f[0].summary
        );
    }

    #[test]
    fn static_sources_count_in_their_namespace() {
        let mut c = cfgs();
        let java = |ns: u32, i: u16| {
            let s = sock(
                7,
                "java",
                &format!("10.0.0.5:{}", 40000 + i),
                "10.0.16.36:80",
                TcpState::CloseWait,
            );
            crate::quota::placed(s, ns, None)
        };
        let t: Vec<Socket> = (0..3)
            .map(|i| java(1, i))
            .chain((0..2).map(|i| java(2, i)))
            .collect();
        let now = chrono::Utc::now();
        assert_eq!(
            crate::quota::static_status(&c[1], &t, now).entries[0].used,
            3
        );
        c[1].netns = Some("blue".into());
        assert_eq!(
            crate::quota::static_status(&c[1], &t, now).entries[0].used,
            2
        );
    }

    #[test]
    fn unavailable_sources_become_findings() {
        let q = QuotaStatus {
            name: "relay".into(),
            source: crate::quota::Source::Http,
            url: None,
            last_poll: None,
            entries: vec![],
            error: Some("answered HTTP 500".into()),
        };
        let f = unavailable(&[q]);
        assert_eq!(f[0].kind(), Kind::QuotaSourceUnavailable);
        assert_eq!(
            f[0].detail,
            Detail::QuotaSourceUnavailable {
                reason: "answered HTTP 500".into()
            }
        );
    }
}
