//! Local connection pairs (both ends on this host) and stuck_established_pairs.
use std::collections::BTreeMap;

use super::{
    describe_owners, ends::PairedBy, oldest_briefs, owner_identity, Detail, Finding, ProcessCount,
    Relations,
};
use crate::{
    config::DetectConfig,
    present::{human, round_secs},
    table::{Socket, TcpState},
};

/// Both ends of one connection, each a socket on this host.
#[derive(Debug, Clone, Copy)]
pub struct Pair<'a> {
    pub client: &'a Socket,
    pub server: &'a Socket,
    /// Paired through a DNAT (the client dialled a Service address).
    pub dnat: bool,
}

impl Pair<'_> {
    pub fn service_port(&self) -> u16 {
        self.server.local.port()
    }
}

/// Every connection with both ends on this host (see [`super::ends`]: across namespaces too).
pub fn local_pairs<'a>(rel: &Relations<'a>) -> Vec<Pair<'a>> {
    let table = rel.table();
    rel.ends()
        .pairs(table)
        .map(|(c, s)| Pair {
            client: &table[c],
            server: &table[s],
            dnat: rel.ends().how(c) == Some(PairedBy::Dnat),
        })
        .collect()
}

fn stuck(s: &Socket, cfg: &DetectConfig) -> bool {
    s.state == TcpState::Established
        && s.queues_empty()
        && s.idle().is_some_and(|i| i >= cfg.stuck_pair_min_idle)
}

pub fn detect<'a>(rel: &Relations<'a>, cfg: &DetectConfig) -> Vec<Finding> {
    // Both ends of a stuck pair are stuck: without enough stuck sockets for one finding, no
    // pairing is needed.
    let stuck_count = rel.table().iter().filter(|s| stuck(s, cfg)).count();
    if stuck_count < cfg.stuck_pair_threshold.saturating_mul(2) {
        return Vec::new();
    }
    type Key = (u32, u32, Option<u32>, Option<u32>, u16);
    let mut groups: BTreeMap<Key, Vec<Pair<'_>>> = BTreeMap::new();
    for p in local_pairs(rel) {
        if stuck(p.client, cfg) && stuck(p.server, cfg) {
            let key = (
                p.client.netns.inode,
                p.server.netns.inode,
                p.client.pid(),
                p.server.pid(),
                p.service_port(),
            );
            groups.entry(key).or_default().push(p);
        }
    }
    let mut out = Vec::new();
    for ((_, _, _, _, port), pairs) in groups {
        if pairs.len() < cfg.stuck_pair_threshold {
            continue;
        }
        let (c, s) = (pairs[0].client, pairs[0].server);
        let procs = vec![
            ProcessCount::of(c, pairs.len()),
            ProcessCount::of(s, pairs.len()),
        ];
        let oldest = pairs
            .iter()
            .map(|p| p.client.age().min(p.server.age()))
            .max()
            .unwrap_or_default();
        let min_idle = pairs
            .iter()
            .filter_map(|p| p.client.idle().zip(p.server.idle()).map(|(a, b)| a.min(b)))
            .min()
            .unwrap_or_default();
        let key = format!("{}->{}:{port}", owner_identity(c), owner_identity(s));
        let dnat = pairs.iter().filter(|p| p.dnat).count();
        let mut text = format!(
            "{} idle ESTABLISHED pair{} on port {port} between {} (client{}) and {} (server{}): idle ≥ {}, queues empty, oldest {}",
            pairs.len(),
            if pairs.len() == 1 { "" } else { "s" },
            describe_owners(&procs[..1]),
            across_text(c, s),
            describe_owners(&procs[1..]),
            across_text(s, c),
            human(min_idle),
            human(oldest),
        );
        if dnat > 0 {
            text.push_str(&format!(
                "; {dnat} through a DNAT (the client dialled {}, a Service address)",
                c.peer
            ));
        }
        let mut f = if c.netns.inode == s.netns.inode {
            Finding::new(Detail::StuckEstablishedPairs, &key, text).scoped(&c.netns, s.container())
        } else {
            // Two pods: both namespaces are part of its identity; the summary names each
            // side's place, the fields the server's.
            let key = format!(
                "{key}{}{}",
                super::scope::ns_part(&c.netns),
                super::scope::ns_part(&s.netns)
            );
            let mut f = Finding::new(Detail::StuckEstablishedPairs, &key, text);
            f.place(&s.netns, s.container());
            f
        };
        f.service_port = Some(port);
        f.count = pairs.len();
        f.oldest_age_secs = round_secs(oldest);
        f.processes = procs;
        f.sockets = oldest_briefs(pairs.iter().flat_map(|p| [p.client, p.server]));
        out.push(f);
    }
    out
}

/// For a pair across namespaces, where `x` is: ", in netns A, pod NS/NAME (...)"; nothing when
/// both ends share a namespace (the finding's own place says it).
fn across_text(x: &Socket, other: &Socket) -> String {
    if x.netns.inode == other.netns.inode {
        return String::new();
    }
    let mut parts = vec![format!("netns {}", x.netns.label())];
    if let Some(ct) = x.container() {
        parts.push(super::scope::describe_container(ct));
    }
    format!(", in {}", parts.join(", "))
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::detect::testutil::sock;

    fn lp(t: &[Socket]) -> Vec<(String, String, u16)> {
        local_pairs(&Relations::new(t))
            .iter()
            .map(|p| {
                (
                    p.client.comm().to_string(),
                    p.server.comm().to_string(),
                    p.service_port(),
                )
            })
            .collect()
    }

    fn det(t: &[Socket], cfg: &DetectConfig) -> Vec<Finding> {
        detect(&Relations::new(t), cfg)
    }

    /// Two pods on a bridge: the proxy in one, the relay in the other; their idle pairs are
    /// one finding naming both places, not two one-sided ghosts.
    #[test]
    fn pairs_pods_across_namespaces() {
        use crate::{
            containers::Runtime,
            detect::scope_testutil::{container, netns, place},
            table::Direction,
        };
        let cfg = DetectConfig::default();
        let (a, b) = (netns(21, Some("proxy-pod")), netns(22, Some("relay-pod")));
        let relay = container("5e5e", Runtime::Containerd, Some(("shop", "relay-0")));
        let mut t = Vec::new();
        for i in 0..16u16 {
            let cl = format!("10.244.0.3:{}", 40000 + i);
            let mut c = sock(10, "node", &cl, "10.244.0.4:25001", TcpState::Established);
            let mut s = sock(20, "relay", "10.244.0.4:25001", &cl, TcpState::Established);
            c.set_idle(Some(Duration::from_secs(400)));
            s.set_idle(Some(Duration::from_secs(400)));
            c.direction = Direction::Outbound;
            s.direction = Direction::Inbound;
            t.push(place(c, &a, None));
            t.push(place(s, &b, Some(&relay)));
        }
        let f = det(&t, &cfg);
        assert_eq!(f.len(), 1, "{f:?}");
        assert_eq!(f[0].count, 16);
        assert_eq!(f[0].netns, 22);
        assert!(
            f[0].summary.contains("node pid 10 (client, in netns proxy-pod) and relay pid 20 (server, in netns relay-pod, pod shop/relay-0"),
            "{}",
            f[0].summary
        );
        assert!(
            f[0].fingerprint
                .ends_with("@netns:proxy-pod@netns:relay-pod"),
            "{}",
            f[0].fingerprint
        );
        assert!(crate::detect::idle::detect(
            &Relations::new(&t),
            &DetectConfig {
                idle_established_threshold: 1,
                ..Default::default()
            }
        )
        .is_empty());
    }

    fn pair(i: u16, idle: u64) -> [Socket; 2] {
        let cl = format!("127.0.0.1:{}", 40000 + i);
        let mut c = sock(10, "node", &cl, "127.0.0.1:25001", TcpState::Established);
        let mut s = sock(20, "relay", "127.0.0.1:25001", &cl, TcpState::Established);
        c.set_idle(Some(Duration::from_secs(idle)));
        s.set_idle(Some(Duration::from_secs(idle)));
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
        let p = lp(&t);
        assert_eq!(p, [("java".to_string(), "srv".to_string(), 8080)]);
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
        let rel = Relations::new(&t);
        let p = local_pairs(&rel);
        assert_eq!(p.len(), 32);
        assert!(p
            .iter()
            .all(|p| p.client.netns.inode == p.server.netns.inode));
        let mut f = det(&t, &cfg);
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
        assert!(lp(&split).is_empty());
        assert!(det(&split, &cfg).is_empty());
    }

    #[test]
    fn fires_for_idle_pairs_only() {
        let cfg = DetectConfig::default();
        let t: Vec<Socket> = (0..16).flat_map(|i| pair(i, 400)).collect();
        let f = det(&t, &cfg);
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
        assert!(det(&busy, &cfg).is_empty());
        let mut queued: Vec<Socket> = (0..16).flat_map(|i| pair(i, 400)).collect();
        queued[0].tx_queue = 10;
        assert!(
            det(&queued, &cfg).is_empty(),
            "one pair with data queued is not stuck: 15 < 16"
        );
    }
}
