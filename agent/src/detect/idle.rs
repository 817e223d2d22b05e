//! idle_established_buildup: one-sided leaks. `stuck_established_pairs` needs both ends on this
//! host; when the other end runs elsewhere, or vanished without a FIN or RST (a client behind a
//! flaky network, a peer host powered off), this host sees only its own end: ESTABLISHED,
//! queues empty, idle for a long time. Without TCP keepalive or an application heartbeat the
//! kernel never finds out, and the socket stays forever.
use std::{collections::BTreeMap, net::IpAddr, time::Duration};

use serde::Serialize;

use super::{
    describe_owners, oldest_briefs, owner_identity, processes, Detail, Finding, IdleDetail,
    Relations,
};
use crate::{
    config::DetectConfig,
    present::{human, round_secs},
    table::{Direction, Socket, TcpState},
};

/// At most this many peers are listed in a finding.
pub const MAX_PEERS: usize = 5;

/// A remote address and how many of the finding's sockets go to it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PeerCount {
    pub addr: IpAddr,
    pub count: usize,
}

fn idle_one_end(s: &Socket, cfg: &DetectConfig) -> bool {
    s.state == TcpState::Established
        && s.queues_empty()
        && s.idle().is_some_and(|i| i >= cfg.idle_established_min_idle)
}

pub fn detect(rel: &Relations<'_>, cfg: &DetectConfig) -> Vec<Finding> {
    let table = rel.table();
    let candidates = table.iter().filter(|s| idle_one_end(s, cfg)).count();
    if candidates < cfg.idle_established_threshold {
        return Vec::new();
    }
    // Connections with both ends on this host are stuck_established_pairs' (which names both
    // owners): left out here, whether or not the other end is idle too, and wherever the other
    // end lives (another pod's namespace, behind a Service's DNAT: see `ends`). So are sockets
    // whose other end could be one of several on this host (not a ghost either way).
    let ends = rel.ends();
    let mut groups: BTreeMap<(u32, Option<u32>, u16), Vec<&Socket>> = BTreeMap::new();
    for (i, s) in table.iter().enumerate() {
        if idle_one_end(s, cfg) && ends.other(i).is_none() && !ends.ambiguous(i) {
            groups
                .entry((s.netns.inode, s.pid(), s.service_port))
                .or_default()
                .push(s);
        }
    }
    groups
        .into_iter()
        .filter(|(_, socks)| socks.len() >= cfg.idle_established_threshold)
        .map(|((_, _, port), socks)| finding(port, &socks))
        .collect()
}

/// The remote addresses of `socks`, most sockets first, at most [`MAX_PEERS`], and how many
/// distinct addresses there are.
fn peers(socks: &[&Socket]) -> (Vec<PeerCount>, usize) {
    let mut by: BTreeMap<IpAddr, usize> = BTreeMap::new();
    for s in socks {
        *by.entry(s.peer.ip().to_canonical()).or_default() += 1;
    }
    let distinct = by.len();
    let mut v: Vec<PeerCount> = by
        .into_iter()
        .map(|(addr, count)| PeerCount { addr, count })
        .collect();
    v.sort_by(|a, b| b.count.cmp(&a.count).then(a.addr.cmp(&b.addr)));
    v.truncate(MAX_PEERS);
    (v, distinct)
}

fn finding(port: u16, socks: &[&Socket]) -> Finding {
    let n = socks.len();
    let oldest = socks.iter().map(|s| s.age()).max().unwrap_or_default();
    let oldest_exact = socks
        .iter()
        .filter(|s| s.age() == oldest)
        .all(|s| s.age_exact);
    let min_idle = socks
        .iter()
        .filter_map(|s| s.idle())
        .min()
        .unwrap_or_default();
    let keepalive_on = socks.iter().filter(|s| s.keepalive).count();
    let inbound = socks
        .iter()
        .filter(|s| s.direction == Direction::Inbound)
        .count();
    let side = if inbound == n {
        "accepted on"
    } else if inbound == 0 {
        "dialled to"
    } else {
        "on"
    };
    let (top, distinct) = peers(socks);
    let mut peer_text: Vec<String> = top
        .iter()
        .map(|p| format!("{} ({})", p.addr, p.count))
        .collect();
    if distinct > top.len() {
        peer_text.push(format!("{} more", distinct - top.len()));
    }
    // With keepalive, the kernel resets a socket whose peer is gone once it has been idle
    // for the namespace's time + probes × interval (sockets may override these; the
    // namespace's are what most use).
    let ka = socks[0].netns.keepalive.unwrap_or_default();
    let reap_after = ka.reap_after();
    let reap_in = socks
        .iter()
        .filter(|s| s.keepalive)
        .map(|s| reap_after.saturating_sub(s.idle().unwrap_or_default()))
        .max();
    let ka_rule = format!(
        "tcp_keepalive_time {}s + {} × {}s",
        ka.time_secs, ka.probes, ka.intvl_secs
    );
    let keepalive_text = match keepalive_on {
        0 => "TCP keepalive off: the kernel never finds out if the peer is gone".to_string(),
        k if k == n && reap_in == Some(Duration::ZERO) => format!(
            "TCP keepalive on and every one idle past {} ({ka_rule}), when the kernel resets a socket whose peer is gone: the peers answer keepalive probes, so they are alive (idle connections, not ghosts)",
            human(reap_after)
        ),
        k => format!(
            "TCP keepalive on{}: reaped by keepalive in ≤ {} if the peer is gone ({ka_rule})",
            if k == n { String::new() } else { format!(" for {k} of {n}") },
            human(reap_in.unwrap_or_default())
        ),
    };
    let owners = processes(socks.iter().copied());
    // Identity without the pid (see `owner_identity`): a restarted service keeps its alert.
    let key = format!("{}:{port}", owner_identity(socks[0]));
    let mut f = Finding::new(
        Detail::IdleEstablishedBuildup(IdleDetail {
            keepalive: keepalive_on == n,
            keepalive_reap_secs: reap_in.map(round_secs),
            peers: top,
        }),
        &key,
        format!(
            "{} holds {n} idle ESTABLISHED socket{} {side} port {port} with no local other end: idle ≥ {}, queues empty, oldest {}{}; {keepalive_text}; peers {}",
            describe_owners(&owners),
            if n == 1 { "" } else { "s" },
            human(min_idle),
            if oldest_exact { "" } else { "≥" },
            human(oldest),
            peer_text.join(", "),
        ),
    )
    .scoped(&socks[0].netns, socks[0].container());
    f.service_port = Some(port);
    f.count = n;
    f.oldest_age_secs = round_secs(oldest);
    f.processes = owners;
    f.sockets = oldest_briefs(socks.iter().copied());
    f
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::detect::testutil::sock;
    use crate::kind::Kind;

    fn det(t: &[Socket], cfg: &DetectConfig) -> Vec<Finding> {
        detect(&Relations::new(t), cfg)
    }

    /// `n` sockets of server pid 7 accepted on port 8080 from `peers` addresses in turn,
    /// idle `idle_secs`.
    fn ghosts(n: u16, peers: u8, idle_secs: u64) -> Vec<Socket> {
        (0..n)
            .map(|i| {
                let peer = format!("10.0.0.{}:{}", 10 + (i % peers as u16), 40000 + i);
                let mut s = sock(7, "server", "10.0.0.1:8080", &peer, TcpState::Established);
                s.skaddr = 1000 + i as u64;
                s.direction = Direction::Inbound;
                s.service_port = 8080;
                s.set_idle(Some(Duration::from_secs(idle_secs)));
                s.set_age(Duration::from_secs(idle_secs + i as u64));
                s
            })
            .collect()
    }

    #[test]
    fn fires_at_threshold_with_peers_and_keepalive() {
        let cfg = DetectConfig::default();
        assert!(det(&ghosts(63, 3, 700), &cfg).is_empty(), "63 < 64");
        assert!(
            det(&ghosts(100, 3, 500), &cfg).is_empty(),
            "idle 500s < 10m: a keep-alive pool between requests"
        );
        let t = ghosts(64, 3, 700);
        let f = det(&t, &cfg);
        assert_eq!(f.len(), 1);
        let f = &f[0];
        assert_eq!(f.kind(), Kind::IdleEstablishedBuildup);
        assert_eq!((f.count, f.service_port), (64, Some(8080)));
        assert_eq!(f.idle().map(|d| d.keepalive), Some(false));
        assert_eq!(f.processes[0].pid, Some(7));
        assert_eq!(f.oldest_age_secs, 763.0);
        let addrs: Vec<String> = f
            .idle()
            .map_or(&[][..], |d| &d.peers)
            .iter()
            .map(|p| p.addr.to_string())
            .collect();
        assert_eq!(addrs, ["10.0.0.10", "10.0.0.11", "10.0.0.12"]);
        assert_eq!(
            f.idle()
                .map_or(&[][..], |d| &d.peers)
                .iter()
                .map(|p| p.count)
                .sum::<usize>(),
            64
        );
        assert!(
            f.summary.starts_with(
                "server pid 7 holds 64 idle ESTABLISHED sockets accepted on port 8080 with no local other end: idle ≥ 11m40s, queues empty, oldest 12m43s; TCP keepalive off"
            ),
            "{}",
            f.summary
        );
        assert!(
            f.summary
                .ends_with("peers 10.0.0.10 (22), 10.0.0.11 (21), 10.0.0.12 (21)"),
            "{}",
            f.summary
        );
    }

    #[test]
    fn reports_keepalive_all_or_some() {
        let cfg = DetectConfig::default();
        let mut t = ghosts(64, 1, 700);
        for s in &mut t {
            s.keepalive = true;
        }
        let f = &det(&t, &cfg)[0];
        assert_eq!(f.idle().map(|d| d.keepalive), Some(true));
        // Idle 700 s of Linux's default 7875 s (2h + 9 × 75s).
        assert_eq!(f.idle().and_then(|d| d.keepalive_reap_secs), Some(7175.0));
        assert!(
            f.summary.contains("; TCP keepalive on: reaped by keepalive in ≤ 1h59m if the peer is gone (tcp_keepalive_time 7200s + 9 × 75s);"),
            "{}",
            f.summary
        );
        // A namespace that probes after 60 s, 3 × 10 s: past 90 s idle the peers answered.
        let short = std::sync::Arc::new(crate::table::Netns {
            keepalive: Some(crate::table::Keepalive {
                time_secs: 60,
                intvl_secs: 10,
                probes: 3,
            }),
            ..(*t[0].netns).clone()
        });
        let mut alive = t.clone();
        for s in &mut alive {
            s.netns = short.clone();
        }
        let f = &det(&alive, &cfg)[0];
        assert_eq!(f.idle().and_then(|d| d.keepalive_reap_secs), Some(0.0));
        assert!(
            f.summary.contains("the peers answer keepalive probes, so they are alive (idle connections, not ghosts)"),
            "{}",
            f.summary
        );
        t[0].keepalive = false;
        let f = &det(&t, &cfg)[0];
        assert_eq!(f.idle().map(|d| d.keepalive), Some(false));
        assert!(
            f.summary
                .contains("TCP keepalive on for 63 of 64: reaped by keepalive in"),
            "{}",
            f.summary
        );
    }

    #[test]
    fn queued_data_busy_sockets_and_local_pairs_do_not_count() {
        let cfg = DetectConfig::default();
        let mut t = ghosts(64, 8, 700);
        t[0].rx_queue = 1;
        assert!(det(&t, &cfg).is_empty(), "data waiting: not idle");
        let mut t = ghosts(64, 8, 700);
        t[0].set_idle(Some(Duration::from_secs(1)));
        assert!(det(&t, &cfg).is_empty());
        // The other end of one of them is on this host: stuck_established_pairs' case.
        let mut t = ghosts(64, 8, 700);
        let mut client = sock(
            9,
            "client",
            &t[0].peer.to_string(),
            &t[0].local.to_string(),
            TcpState::Established,
        );
        client.skaddr = 1;
        client.direction = Direction::Outbound;
        t.push(client.clone());
        assert!(det(&t, &cfg).is_empty());
        // Two rows of that end (the same connection end twice): both left out.
        let mut t = ghosts(65, 8, 700);
        let mut twin = t[0].clone();
        twin.skaddr = 999;
        t[64] = twin;
        assert_eq!(det(&t, &cfg)[0].count, 65);
        t.push(client);
        assert!(det(&t, &cfg).is_empty(), "63 left: under the threshold");
    }

    /// The other end of a connection is looked for across namespaces for pod addresses (a
    /// client pod's socket with the reversed tuple is the other end: not a ghost), in the
    /// socket's own namespace only for loopback ones (another namespace's 127.0.0.1 is another
    /// connection).
    #[test]
    fn other_ends_and_groups_are_per_namespace() {
        use crate::detect::scope_testutil::{netns, place};
        let cfg = DetectConfig::default();
        let (a, b) = (netns(31, Some("a")), netns(32, Some("b")));
        for (server, peers, ghosts_left) in [
            ("10.0.0.1:8080", "10.0.0", 63),
            ("127.0.0.1:8080", "127.0.0", 64),
        ] {
            let mut t: Vec<Socket> = ghosts(64, 8, 700)
                .into_iter()
                .map(|mut s| {
                    s.local = server.parse().unwrap();
                    s.peer = format!(
                        "{peers}.{}:{}",
                        s.peer.ip().to_string().rsplit('.').next().unwrap(),
                        s.peer.port()
                    )
                    .parse()
                    .unwrap();
                    place(s, &a, None)
                })
                .collect();
            let mut client = sock(
                9,
                "client",
                &t[0].peer.to_string(),
                &t[0].local.to_string(),
                TcpState::Established,
            );
            client.skaddr = 1;
            client.direction = Direction::Outbound;
            t.push(place(client, &b, None));
            let f = det(&t, &cfg);
            if ghosts_left < 64 {
                assert!(f.is_empty(), "{server}: {f:?}");
                continue;
            }
            assert_eq!(f.len(), 1, "{f:?}");
            assert_eq!(f[0].count, 64);
            assert_eq!(f[0].netns, 31);
            assert_eq!(
                f[0].fingerprint,
                "idle_established_buildup:server:8080@netns:a"
            );
        }
        // 32 + 32 of one process in two namespaces: under the threshold in each.
        let t: Vec<Socket> = ghosts(64, 8, 700)
            .into_iter()
            .enumerate()
            .map(|(i, s)| place(s, if i % 2 == 0 { &a } else { &b }, None))
            .collect();
        assert!(det(&t, &cfg).is_empty());
    }

    #[test]
    fn groups_per_process_and_port_and_caps_peers() {
        let cfg = DetectConfig {
            idle_established_threshold: 4,
            ..Default::default()
        };
        let mut t = ghosts(10, 10, 700);
        let mut other = ghosts(3, 1, 700);
        for s in &mut other {
            s.skaddr += 100;
            s.owner = sock(
                8,
                "other",
                "10.0.0.1:1",
                "10.0.0.2:2",
                TcpState::Established,
            )
            .owner;
        }
        t.extend(other);
        let f = det(&t, &cfg);
        assert_eq!(f.len(), 1, "pid 8 holds 3 < 4");
        assert_eq!(f[0].idle().map_or(&[][..], |d| &d.peers).len(), MAX_PEERS);
        assert!(f[0].summary.ends_with(", 5 more"), "{}", f[0].summary);
        // Outbound: the service port is the peer's.
        let out: Vec<Socket> = (0..4)
            .map(|i| {
                let mut s = sock(
                    5,
                    "proxy",
                    &format!("10.0.0.1:{}", 50000 + i),
                    "10.0.9.9:25001",
                    TcpState::Established,
                );
                s.direction = Direction::Outbound;
                s.service_port = 25001;
                s
            })
            .collect();
        let f = det(&out, &cfg);
        assert_eq!(f[0].service_port, Some(25001));
        assert!(
            f[0].summary
                .contains("4 idle ESTABLISHED sockets dialled to port 25001"),
            "{}",
            f[0].summary
        );
    }
}
