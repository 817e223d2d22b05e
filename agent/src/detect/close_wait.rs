//! close_wait_buildup: a process that never closes sockets its peers closed.
use std::collections::{BTreeMap, BTreeSet};

use super::{describe_owners, oldest_briefs, owner_identity, processes, scope, Detail, Finding};
use crate::{
    config::DetectConfig,
    present::{human, round_secs},
    table::{Socket, TcpState},
};

pub fn detect(
    table: &[Socket],
    cfg: &DetectConfig,
    prev_counts: &mut BTreeMap<String, usize>,
) -> Vec<Finding> {
    // The threshold is per process (a pool's limit is) and namespace (a process may hold
    // sockets of several; every pod has its own port 8080); the finding's identity is what
    // survives a restart of the leaking service (see `owner_identity`).
    let mut groups: BTreeMap<(u32, Option<u32>, u16), Vec<&Socket>> = BTreeMap::new();
    for s in table {
        if s.state == TcpState::CloseWait && s.age() >= cfg.close_wait_min_age {
            groups
                .entry((s.netns.inode, s.pid(), s.service_port))
                .or_default()
                .push(s);
        }
    }
    let stuck_long = cfg.close_wait_min_age.saturating_mul(10);
    let mut counts = BTreeMap::new();
    let mut out = Vec::new();
    for ((_, _, port), socks) in groups {
        let oldest = socks.iter().map(|s| s.age()).max().unwrap_or_default();
        let oldest_exact = socks
            .iter()
            .filter(|s| s.age() == oldest)
            .all(|s| s.age_exact);
        let key = format!("{}:{port}", owner_identity(socks[0]));
        let scoped_key = format!("{key}{}", scope::ns_part(&socks[0].netns));
        counts.insert(scoped_key.clone(), socks.len());
        if socks.len() < cfg.close_wait_threshold && oldest < stuck_long {
            continue;
        }
        let peers: BTreeSet<String> = socks.iter().map(|s| s.peer.to_string()).collect();
        let peer_text = if peers.len() == 1 {
            peers.iter().next().cloned().unwrap_or_default()
        } else {
            format!("{} peers on port {port}", peers.len())
        };
        let owners = processes(socks.iter().copied());
        let growth = socks.len() as i64 - prev_counts.get(&scoped_key).copied().unwrap_or(0) as i64;
        let mut f = Finding::new(
            Detail::CloseWaitBuildup {
                growth: Some(growth),
            },
            &key,
            format!(
                "{} holds {} CLOSE_WAIT socket{} to {} (service port {port}), oldest {}{}: the peer closed and this process never did",
                describe_owners(&owners),
                socks.len(),
                if socks.len() == 1 { "" } else { "s" },
                peer_text,
                if oldest_exact { "" } else { "≥" },
                human(oldest),
            ),
        )
        .scoped(&socks[0].netns, socks[0].container());
        f.service_port = Some(port);
        f.count = socks.len();
        f.oldest_age_secs = round_secs(oldest);
        f.processes = owners;
        f.sockets = oldest_briefs(socks.iter().copied());
        out.push(f);
    }
    *prev_counts = counts;
    out
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::detect::testutil::sock;

    fn cw(pid: u32, n: u16, age: u64) -> Vec<Socket> {
        (0..n)
            .map(|i| {
                let mut s = sock(
                    pid,
                    "java",
                    &format!("[::ffff:10.0.0.5]:{}", 40000 + i),
                    "[::ffff:10.0.16.36]:80",
                    TcpState::CloseWait,
                );
                s.set_age(Duration::from_secs(age + i as u64));
                s
            })
            .collect()
    }

    #[test]
    fn fires_at_threshold_with_growth() {
        let cfg = DetectConfig::default();
        let mut prev = BTreeMap::new();
        assert!(detect(&cw(7, 15, 100), &cfg, &mut prev).is_empty());
        let f = detect(&cw(7, 20, 100), &cfg, &mut prev);
        assert_eq!(f.len(), 1);
        let f = &f[0];
        assert_eq!((f.count, f.service_port), (20, Some(80)));
        assert_eq!(f.detail, Detail::CloseWaitBuildup { growth: Some(5) });
        assert_eq!(f.processes[0].pid, Some(7));
        assert_eq!(f.sockets.len(), 20);
        assert_eq!(f.oldest_age_secs, 119.0);
        assert!(
            f.summary
                .contains("java pid 7 holds 20 CLOSE_WAIT sockets to [::ffff:10.0.16.36]:80"),
            "{}",
            f.summary
        );
    }

    #[test]
    fn young_close_wait_is_normal_but_one_very_old_fires() {
        let cfg = DetectConfig::default();
        let mut prev = BTreeMap::new();
        assert!(detect(&cw(7, 40, 5), &cfg, &mut prev).is_empty());
        let f = detect(&cw(7, 1, 301), &cfg, &mut prev);
        assert_eq!(f.len(), 1);
        assert_eq!(f[0].count, 1);
    }

    /// Two pods, each with its process holding 20 CLOSE_WAIT on port 8080: two findings, each
    /// naming its namespace and pod; the same in connreap's own namespace keeps its old
    /// fingerprint.
    #[test]
    fn two_namespaces_on_one_port_are_two_findings() {
        use crate::{
            containers::Runtime,
            detect::scope_testutil::{container, netns, place},
        };
        let cfg = DetectConfig::default();
        let pods = [
            (netns(4026532001, Some("cni-a")), "aaaa", "web-a"),
            (netns(4026532002, None), "bbbb", "web-b"),
        ];
        let mut t = Vec::new();
        for (i, (ns, id, pod)) in pods.iter().enumerate() {
            let c = container(id, Runtime::Containerd, Some(("shop", pod)));
            for s in cw(100 + i as u32, 20, 100) {
                let mut s = place(s, ns, Some(&c));
                s.service_port = 8080;
                t.push(s);
            }
        }
        let mut f = detect(&t, &cfg, &mut BTreeMap::new());
        f.sort_by_key(|f| f.netns);
        assert_eq!(f.len(), 2, "{f:?}");
        assert_eq!(
            f[0].fingerprint,
            "close_wait_buildup:java@pod:shop/web-a:8080@netns:cni-a"
        );
        assert_eq!(
            f[1].fingerprint,
            "close_wait_buildup:java@pod:shop/web-b:8080@netns:4026532002"
        );
        assert_eq!(
            (f[0].netns, f[0].netns_name.as_deref()),
            (4026532001, Some("cni-a"))
        );
        assert_eq!((f[1].netns, f[1].netns_name.as_deref()), (4026532002, None));
        assert_eq!(f[1].netns_label(), "4026532002");
        let c = f[0].container.as_ref().expect("container");
        assert_eq!(
            (c.short_id(), c.pod_name.as_deref()),
            ("aaaa00000000", Some("web-a"))
        );
        assert_eq!(f[0].processes[0].container.as_deref(), Some(c.id.as_str()));
        assert!(
            f[0].summary
                .ends_with("; in netns cni-a, pod shop/web-a (containerd aaaa00000000)"),
            "{}",
            f[0].summary
        );
        // Growth is per namespace too.
        for f in &f[..2] {
            assert_eq!(f.detail, Detail::CloseWaitBuildup { growth: Some(20) });
        }
        let json = serde_json::to_value(&f[0]).expect("serializes");
        assert_eq!(json["netns"], 4026532001u32);
        assert_eq!(json["netns_name"], "cni-a");
        assert_eq!(json["container"], c.id.as_str());
        assert_eq!(json["container_runtime"], "containerd");
        assert_eq!(json["pod_name"], "web-a");
        assert_eq!(json["pod_namespace"], "shop");
        assert!(json.get("netns_own").is_none(), "{json}");
        // The same leak in connreap's own namespace, outside containers: the fingerprint as it
        // always was, no container fields.
        let f = detect(&cw(7, 20, 100), &cfg, &mut BTreeMap::new());
        assert_eq!(f[0].fingerprint, "close_wait_buildup:java:80");
        assert_eq!(f[0].netns_label(), "host");
        let json = serde_json::to_value(&f[0]).expect("serializes");
        assert!(json.get("container").is_none(), "{json}");
        assert_eq!(json["netns_name"], serde_json::Value::Null);
    }

    #[test]
    fn one_process_in_two_namespaces_is_two_groups() {
        use crate::detect::scope_testutil::netns;
        let cfg = DetectConfig::default();
        let other = netns(9, Some("blue"));
        let mut t = cw(7, 10, 100);
        t.extend(
            cw(7, 10, 100)
                .into_iter()
                .map(|s| crate::detect::scope_testutil::place(s, &other, None)),
        );
        assert!(
            detect(&t, &cfg, &mut BTreeMap::new()).is_empty(),
            "10 + 10 in two namespaces"
        );
    }

    #[test]
    fn groups_per_process() {
        let cfg = DetectConfig::default();
        let mut t = cw(7, 10, 100);
        t.extend(cw(8, 10, 100));
        assert!(detect(&t, &cfg, &mut BTreeMap::new()).is_empty());
    }
}
