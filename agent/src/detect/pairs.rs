//! Local connection pairs (both ends on this host) and stuck_established_pairs.
use std::collections::BTreeMap;

use rustc_hash::FxHashMap;

use super::{describe_owners, oldest_briefs, owner_identity, Finding, Kind, ProcessCount};
use crate::{
    config::DetectConfig,
    present::{human, round_secs},
    table::{ConnKey, Direction, Socket, TcpState},
};

/// Both ends of one connection, each a socket on this host.
#[derive(Debug, Clone, Copy)]
pub struct Pair<'a> {
    pub client: &'a Socket,
    pub server: &'a Socket,
}

impl Pair<'_> {
    pub fn service_port(&self) -> u16 {
        self.server.local.port()
    }
}

/// Pairs of sockets among `socks` that are the two ends of one connection: both in one network
/// namespace (two namespaces can each hold `127.0.0.1:X <-> 127.0.0.1:Y`, which are different
/// connections).
pub fn local_pairs<'a, I>(socks: I) -> Vec<Pair<'a>>
where
    I: IntoIterator<Item = &'a Socket>,
    I::IntoIter: Clone,
{
    let socks = socks.into_iter();
    let by_tuple: FxHashMap<ConnKey, &Socket> = socks
        .clone()
        .filter(|s| s.state != TcpState::Listen)
        .map(|s| (ConnKey::of(s), s))
        .collect();
    let mut out = Vec::new();
    for s in socks {
        if s.state == TcpState::Listen || s.direction == Direction::Inbound {
            continue;
        }
        if let Some(other) = by_tuple.get(&ConnKey::other_end(s)) {
            if other.direction == Direction::Inbound || s.local.port() > other.local.port() {
                out.push(Pair {
                    client: s,
                    server: other,
                });
            }
        }
    }
    out
}

fn stuck(s: &Socket, cfg: &DetectConfig) -> bool {
    s.state == TcpState::Established
        && s.queues_empty()
        && s.idle.is_some_and(|i| i >= cfg.stuck_pair_min_idle)
}

pub fn detect(table: &[Socket], cfg: &DetectConfig) -> Vec<Finding> {
    // Both ends of a stuck pair are stuck: pair only those sockets (not the whole table).
    let candidates = table.iter().filter(|s| stuck(s, cfg));
    type Key = (u32, Option<u32>, Option<u32>, u16);
    let mut groups: BTreeMap<Key, Vec<Pair<'_>>> = BTreeMap::new();
    for p in local_pairs(candidates) {
        if stuck(p.client, cfg) && stuck(p.server, cfg) {
            let key = (
                p.client.netns.inode,
                p.client.pid(),
                p.server.pid(),
                p.service_port(),
            );
            groups.entry(key).or_default().push(p);
        }
    }
    let mut out = Vec::new();
    for ((_, _, _, port), pairs) in groups {
        if pairs.len() < cfg.stuck_pair_threshold {
            continue;
        }
        let (c, s) = (pairs[0].client, pairs[0].server);
        let (cpid, spid) = (c.pid(), s.pid());
        let owner = |x: &Socket, pid: Option<u32>| ProcessCount {
            pid,
            comm: x.comm().to_string(),
            unit: x.unit(),
            count: pairs.len(),
            container: x.container_id().map(String::from),
        };
        let procs = vec![owner(c, cpid), owner(s, spid)];
        let oldest = pairs
            .iter()
            .map(|p| p.client.age.min(p.server.age))
            .max()
            .unwrap_or_default();
        let min_idle = pairs
            .iter()
            .filter_map(|p| p.client.idle.zip(p.server.idle).map(|(a, b)| a.min(b)))
            .min()
            .unwrap_or_default();
        let key = format!("{}->{}:{port}", owner_identity(c), owner_identity(s));
        let mut f = Finding::new(
            Kind::StuckEstablishedPairs,
            &key,
            format!(
                "{} idle ESTABLISHED pair{} on port {port} between {} (client) and {} (server): idle ≥ {}, queues empty, oldest {}",
                pairs.len(),
                if pairs.len() == 1 { "" } else { "s" },
                describe_owners(&procs[..1]),
                describe_owners(&procs[1..]),
                human(min_idle),
                human(oldest),
            ),
        )
        .scoped(&c.netns, s.container());
        f.service_port = Some(port);
        f.count = pairs.len();
        f.oldest_age_secs = round_secs(oldest);
        f.processes = procs;
        f.sockets = oldest_briefs(pairs.iter().flat_map(|p| [p.client, p.server]));
        out.push(f);
    }
    out
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::detect::testutil::sock;

    fn pair(i: u16, idle: u64) -> [Socket; 2] {
        let cl = format!("127.0.0.1:{}", 40000 + i);
        let mut c = sock(10, "node", &cl, "127.0.0.1:25001", TcpState::Established);
        let mut s = sock(20, "relay", "127.0.0.1:25001", &cl, TcpState::Established);
        c.idle = Some(Duration::from_secs(idle));
        s.idle = Some(Duration::from_secs(idle));
        [c, s]
    }

    #[test]
    fn finds_pairs_across_mapped_addresses() {
        let c = sock(
            1,
            "java",
            "[::ffff:127.0.0.1]:40000",
            "[::ffff:127.0.0.1]:8080",
            TcpState::Established,
        );
        let s = sock(
            2,
            "srv",
            "127.0.0.1:8080",
            "127.0.0.1:40000",
            TcpState::Established,
        );
        let t = [c, s];
        let p = local_pairs(&t);
        assert_eq!(p.len(), 1);
        assert_eq!(
            (p[0].client.comm(), p[0].server.comm(), p[0].service_port()),
            ("java", "srv", 8080)
        );
    }

    /// Two namespaces each hold `127.0.0.1:X <-> 127.0.0.1:25001`: each pairs with its own
    /// other end, never across; a client whose server is in another namespace pairs with
    /// nothing.
    #[test]
    fn pairs_never_cross_namespaces() {
        use crate::{
            containers::Runtime,
            detect::scope_testutil::{container, netns, place},
        };
        let cfg = DetectConfig::default();
        let (a, b) = (netns(21, Some("a")), netns(22, Some("b")));
        let srv = container("5e5e", Runtime::Podman, None);
        let mut t = Vec::new();
        for ns in [&a, &b] {
            for i in 0..16 {
                let [c, s] = pair(i, 400);
                t.push(place(c, ns, None));
                t.push(place(s, ns, Some(&srv)));
            }
        }
        let p = local_pairs(&t);
        assert_eq!(p.len(), 32);
        assert!(p
            .iter()
            .all(|p| p.client.netns.inode == p.server.netns.inode));
        let mut f = detect(&t, &cfg);
        f.sort_by_key(|f| f.netns);
        assert_eq!(f.len(), 2, "{f:?}");
        assert_eq!(
            f[0].fingerprint,
            "stuck_established_pairs:node->relay@podman:5e5e00000000:25001@netns:a"
        );
        assert!(
            f[1].fingerprint.ends_with("@netns:b"),
            "{}",
            f[1].fingerprint
        );
        assert_eq!((f[0].count, f[1].count), (16, 16));
        assert_eq!(
            f[0].container.as_ref().map(|c| c.short_id()),
            Some("5e5e00000000")
        );
        assert_eq!(f[0].processes[0].container, None);
        assert!(f[0].processes[1].container.is_some());
        // Clients in namespace a, servers in b: no connection between them is local.
        let split: Vec<Socket> = (0..16)
            .flat_map(|i| {
                let [c, s] = pair(i, 400);
                [place(c, &a, None), place(s, &b, None)]
            })
            .collect();
        assert!(local_pairs(&split).is_empty());
        assert!(detect(&split, &cfg).is_empty());
    }

    #[test]
    fn fires_for_idle_pairs_only() {
        let cfg = DetectConfig::default();
        let t: Vec<Socket> = (0..16).flat_map(|i| pair(i, 400)).collect();
        let f = detect(&t, &cfg);
        assert_eq!(f.len(), 1);
        assert_eq!((f[0].count, f[0].service_port), (16, Some(25001)));
        assert_eq!(f[0].processes[0].comm, "node");
        assert_eq!(f[0].processes[1].comm, "relay");
        assert!(
            f[0].summary
                .contains("node pid 10 (client) and relay pid 20 (server)"),
            "{}",
            f[0].summary
        );

        let busy: Vec<Socket> = (0..16).flat_map(|i| pair(i, 1)).collect();
        assert!(detect(&busy, &cfg).is_empty());
        let mut queued: Vec<Socket> = (0..16).flat_map(|i| pair(i, 400)).collect();
        queued[0].tx_queue = 10;
        assert!(
            detect(&queued, &cfg).is_empty(),
            "one pair with data queued is not stuck: 15 < 16"
        );
    }
}
