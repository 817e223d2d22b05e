//! Unit tests of policy selection, namespace scoping, arming and decisions.
use std::time::Duration;

use super::*;
use crate::{
    config::{parse, QuotaConfig},
    detect::testutil::sock,
    quota::QuotaEntry,
    table::Direction,
};

/// [`plan`] with the table's relations and, for a quota-saturated policy, the reach of quota
/// `q` (no feeders).
fn plan_of<'a>(
    p: &PolicyConfig,
    rc: &ReclaimConfig,
    pid: u32,
    t: &'a [Socket],
    q: Option<&QuotaConfig>,
) -> Plan<'a> {
    let rel = Relations::new(t);
    let reach = (p.trigger == Trigger::QuotaSaturated).then(|| QuotaReach {
        quota: Scope::at(q.and_then(QuotaConfig::place), t),
        feeders: Vec::new(),
    });
    plan(p, rc, pid, &rel, reach.as_ref())
}

/// The relay incident's proxy (pid 10, listening on 8080): users that stay (accepted at the
/// ages given, still connected) and upstreams to the relay on 25001 dialled 5 ms after each
/// user's accept, for the users who stay and for `left` users who left (ages given).
fn proxy(stay: &[u64], left: &[u64]) -> Vec<Socket> {
    let mut t = vec![sock(
        10,
        "node",
        "0.0.0.0:8080",
        "0.0.0.0:0",
        TcpState::Listen,
    )];
    t[0].direction = Direction::Listen;
    let mut port = 40000u16;
    for (&age, stays) in stay
        .iter()
        .map(|a| (a, true))
        .chain(left.iter().map(|a| (a, false)))
    {
        port += 1;
        if stays {
            let mut d = sock(
                10,
                "node",
                "10.0.0.2:8080",
                &format!("10.0.0.1:{port}"),
                TcpState::Established,
            );
            d.direction = Direction::Inbound;
            d.set_age(Duration::from_secs(age));
            d.set_last_io(Some(Duration::from_secs(age)), Some(Duration::ZERO));
            t.push(d);
        }
        let mut u = sock(
            10,
            "node",
            &format!("10.0.0.2:{port}"),
            "10.0.0.3:25001",
            TcpState::Established,
        );
        u.direction = Direction::Outbound;
        u.set_age(Duration::from_secs(age) - Duration::from_millis(5));
        u.set_last_io(Some(u.age()), Some(u.age()));
        t.push(u);
    }
    t
}

/// The README's relay policy takes the upstreams of users who left, orphaned first, and never
/// the oldest ones that still serve users on a quiet page (incident 1's own regression);
/// `include_serving = true` takes those too, after the orphaned ones.
#[test]
fn orphaned_upstreams_go_first_and_live_users_keep_theirs() {
    let (p, rc) = policy("trigger = \"always\"\nselect = { comm = \"node\", peer_port = 25001, states = [\"ESTABLISHED\"] }\nmin_idle = \"10s\"\nmax_per_round = 8\n");
    let t = proxy(&[600, 590], &[300, 299, 298]);
    let pl = plan_of(&p, &rc, 999, &t, None);
    let ports: Vec<u16> = pl.targets.iter().map(|s| s.local.port()).collect();
    assert_eq!(
        ports,
        [40003, 40004, 40005],
        "only the orphaned, oldest first"
    );
    assert_eq!(pl.skipped.len(), 2);
    assert!(
        pl.skipped
            .iter()
            .all(|(s, why)| s.age() >= Duration::from_secs(589)
                && why.contains("serves a connected downstream")),
        "{:?}",
        pl.skipped.iter().map(|(_, w)| w).collect::<Vec<_>>()
    );
    let (p, rc) = policy("trigger = \"always\"\nselect = { comm = \"node\", peer_port = 25001 }\ninclude_serving = true\n");
    let pl = plan_of(&p, &rc, 999, &t, None);
    let ports: Vec<u16> = pl.targets.iter().map(|s| s.local.port()).collect();
    assert_eq!(ports, [40003, 40004, 40005, 40001, 40002]);
    // Only users still connected: nothing selected, and the plan says why.
    let t = proxy(&[600, 590], &[]);
    let (p, rc) = policy("trigger = \"always\"\nselect = { comm = \"node\", peer_port = 25001 }\nmin_idle = \"10s\"\n");
    let pl = plan_of(&p, &rc, 999, &t, None);
    assert!(pl.targets.is_empty());
    assert_eq!(
        pl.nothing.as_deref(),
        Some("2 sockets match its select; 2 spared: they may serve a connected downstream")
    );
}

/// A quota-saturated policy reaches the processes feeding its quota in their own namespace
/// (the proxy's pod), not other processes there; and says so when it selects nothing.
#[test]
fn a_quota_policy_reaches_its_feeders_namespace() {
    let (p, rc) =
        policy("trigger = \"quota-saturated\"\nselect = { comm = \"node\", peer_port = 25001 }\n");
    let mut t = in_ns(2, None, 3);
    t.extend(in_ns(1, None, 2));
    let rel = Relations::new(&t);
    let quota = |feeders| QuotaReach {
        quota: Scope::at(None, &t),
        feeders,
    };
    let none = plan(&p, &rc, 999, &rel, Some(&quota(vec![])));
    assert_eq!(namespaces(&none.targets), vec![1]);
    let pid = t[0].pid().unwrap();
    let fed = plan(&p, &rc, 999, &rel, Some(&quota(vec![(pid, 2)])));
    assert_eq!(namespaces(&fed.targets), vec![1, 2]);
    let (p2, _) =
        policy("trigger = \"quota-saturated\"\nselect = { comm = \"node\", netns = \"blue\" }\n");
    let why = plan(&p2, &rc, 999, &rel, Some(&quota(vec![])))
        .nothing
        .unwrap();
    assert!(
        why.starts_with("3 sockets match its select; 3 outside where a quota-saturated policy acts: the quota's sockets (in connreap's own namespace; no process feeds it through a relay)"),
        "{why}"
    );
}

fn policy(extra: &str) -> (PolicyConfig, ReclaimConfig) {
    use crate::quota::tests::{relay_toml, RELAY_URL};
    let relay = relay_toml(RELAY_URL, "limit_field = \"maxStreams\"");
    let text = format!(
        r#"[reclaim]
protect_ports = [22]
{relay}[[policy]]
name = "relay-leaks"
mode = "enforce"
quota = "relay"
{extra}"#
    );
    let mut c = parse(&text, "t").unwrap();
    (c.policy.remove(0), c.reclaim)
}

fn node_socks(n: u16) -> Vec<Socket> {
    (0..n)
        .map(|i| {
            let mut s = sock(
                10,
                "node",
                &format!("127.0.0.1:{}", 40000 + i),
                "127.0.0.1:25001",
                TcpState::Established,
            );
            s.set_age(Duration::from_secs(100 + i as u64));
            s
        })
        .collect()
}

#[test]
fn oldest_first_capped_and_thresholded() {
    let (p, rc) = policy("trigger = \"quota-saturated\"\nselect = { comm = \"node\", peer_port = 25001, states = [\"ESTABLISHED\"] }\nmin_idle = \"10s\"\nmax_per_round = 8\n");
    let mut t = node_socks(20);
    t[19].set_idle(Some(Duration::from_secs(2))); // the oldest is busy: never selected
    t.push(sock(
        11,
        "other",
        "127.0.0.1:41000",
        "127.0.0.1:25001",
        TcpState::Established,
    ));
    let plan = plan_of(&p, &rc, 999, &t, None);
    assert_eq!(plan.targets.len(), 8);
    let ports: Vec<u16> = plan.targets.iter().map(|s| s.local.port()).collect();
    assert_eq!(ports, (40011..=40018).rev().collect::<Vec<_>>());
    assert!(plan.skipped.is_empty());
}

#[test]
fn protected_listen_and_own_sockets_are_skipped() {
    let (p, rc) = policy("trigger = \"always\"\nselect = { peer_port = 22 }\n");
    let t = vec![sock(
        10,
        "ssh",
        "127.0.0.1:40000",
        "127.0.0.1:22",
        TcpState::Established,
    )];
    let pl = plan_of(&p, &rc, 999, &t, None);
    assert!(pl.targets.is_empty());
    assert!(pl.skipped[0].1.contains("protect_ports"));
    let (p, rc) = policy("trigger = \"always\"\nselect = { peer_port = 25001 }\n");
    let t = node_socks(1);
    let pl = plan_of(&p, &rc, 10, &t, None);
    assert_eq!(pl.skipped[0].1, "connreap's own socket");
}

#[test]
fn quota_trigger_arms_only_when_saturated_and_fresh() {
    let (p, _) = policy("trigger = \"quota-saturated\"\nselect = { comm = \"node\" }\n");
    let mut q = QuotaStatus {
        name: "relay".into(),
        source: crate::quota::Source::Http,
        url: None,
        last_poll: Some(chrono::Utc::now()),
        entries: vec![QuotaEntry {
            port: 21000,
            used: 64,
            limit: 64,
        }],
        error: None,
    };
    assert_eq!(
        armed(&p, std::slice::from_ref(&q), 0.9)
            .unwrap()
            .unwrap()
            .used,
        64
    );
    q.entries[0].used = 56;
    assert_eq!(
        armed(&p, std::slice::from_ref(&q), 0.9),
        Err(NotArmed::BelowSaturation("relay".into()))
    );
    q.entries[0].used = 64;
    q.error = Some("HTTP 500".into());
    let e = armed(&p, std::slice::from_ref(&q), 0.9).unwrap_err();
    assert!(matches!(e, NotArmed::Unavailable { .. }), "{e}");
    assert!(e.to_string().contains("never act on stale data"), "{e}");
}

#[test]
fn selectors_cover_every_key() {
    let s = sock(
        10,
        "java",
        "[::ffff:10.0.0.5]:40000",
        "[::ffff:10.0.16.36]:80",
        TcpState::CloseWait,
    );
    let sel = |f: &dyn Fn(&mut Selector)| {
        let mut x = Selector::default();
        f(&mut x);
        selected(&x, &s)
    };
    assert!(sel(&|x| x.peer = Some("10.0.16.36:80".parse().unwrap())));
    assert!(!sel(&|x| x.peer = Some("10.0.16.37:80".parse().unwrap())));
    assert!(sel(&|x| x.pid = Some(10)));
    assert!(!sel(&|x| x.local_port = Some(1)));
    assert!(!sel(&|x| x.states = vec![TcpState::Established]));
    assert!(!sel(&|x| x.unit = Some("a.service".into())));
}

/// `node` connections to 25001 in namespace `ns` (1 host, 2 "blue"), in container `c`.
fn in_ns(ns: u32, c: Option<&str>, n: u16) -> Vec<Socket> {
    node_socks(n)
        .into_iter()
        .map(|s| crate::quota::placed(s, ns, c))
        .collect()
}

fn namespaces(targets: &[&Socket]) -> Vec<u32> {
    let mut v: Vec<u32> = targets.iter().map(|s| s.netns.inode).collect();
    v.sort_unstable();
    v.dedup();
    v
}

#[test]
fn netns_and_container_selectors_filter_targets() {
    let (a, b) = ("3f2a".repeat(16), "abab".repeat(16));
    let mut t = in_ns(1, None, 2);
    t.extend(in_ns(2, Some(&a), 2));
    t.extend(in_ns(3, Some(&b), 2));
    let pick = |select: &str| {
        let (p, rc) = policy(&format!("trigger = \"always\"\nselect = {{ {select} }}\n"));
        namespaces(&plan_of(&p, &rc, 999, &t, None).targets)
    };
    // No namespace selector: every namespace.
    assert_eq!(pick("comm = \"node\""), vec![1, 2, 3]);
    assert_eq!(pick("comm = \"node\", netns = \"host\""), vec![1]);
    assert_eq!(pick("comm = \"node\", netns = \"blue\""), vec![2]);
    assert_eq!(pick("peer_port = 25001, netns = \"3\""), vec![3]);
    assert_eq!(pick("container = \"3F2A\""), vec![2], "prefix, any case");
    assert_eq!(pick("container = \"abab\", peer_port = 25001"), vec![3]);
    assert!(pick("container = \"ffff\"").is_empty());
    // A container selector never matches a socket nobody holds.
    let mut unowned = t[2].clone();
    unowned.owner = None;
    let mut sel = Selector {
        container: Some("3f2a".into()),
        peer_port: Some(25001),
        unowned: true,
        ..Selector::default()
    };
    assert!(selected(&sel, &t[2]) && !selected(&sel, &unowned));
    // ... but a netns selector does.
    sel.container = None;
    sel.netns = Some("blue".into());
    assert!(selected(&sel, &unowned));
}

#[test]
fn a_quota_policy_targets_only_its_quotas_namespace() {
    let a = "3f2a".repeat(16);
    let mut t = in_ns(1, None, 3);
    t.extend(in_ns(2, None, 3));
    t.extend(in_ns(4, Some(&a), 3));
    let select = "trigger = \"quota-saturated\"\nselect = { comm = \"node\" }\n";
    let (p, rc) = policy(select);
    let quota = |place: &str| {
        let mut q = crate::config::parse(
            &format!("[[quota]]\nname = \"relay\"\nprocess = \"x\"\npeer = \"1.2.3.4:5\"\nlimit = 1\n{place}\n"),
            "t",
        )
        .unwrap();
        q.quota.remove(0)
    };
    let pick = |q: Option<&QuotaConfig>| namespaces(&plan_of(&p, &rc, 999, &t, q).targets);
    assert_eq!(
        pick(Some(&quota(""))),
        vec![1],
        "a quota without netns: the host's"
    );
    assert_eq!(pick(None), vec![1]);
    assert_eq!(pick(Some(&quota("netns = \"blue\""))), vec![2]);
    assert_eq!(pick(Some(&quota("container = \"3f2a\""))), vec![4]);
    // Its selector narrows further; it never widens past the quota's namespace.
    let (p2, _) =
        policy("trigger = \"quota-saturated\"\nselect = { comm = \"node\", netns = \"host\" }\n");
    assert!(plan_of(&p2, &rc, 999, &t, Some(&quota("netns = \"blue\"")))
        .targets
        .is_empty());
    // An "always" policy naming a quota is not scoped by it.
    let (p3, _) = policy("trigger = \"always\"\nselect = { comm = \"node\" }\n");
    let all = plan_of(&p3, &rc, 999, &t, Some(&quota("netns = \"blue\"")));
    assert_eq!(namespaces(&all.targets), vec![1, 2, 4]);
}

#[test]
fn protect_ports_apply_in_every_namespace() {
    let (p, rc) = policy("trigger = \"always\"\nselect = { peer_port = 22 }\n");
    let ssh = |ns| {
        let s = sock(
            10,
            "ssh",
            "127.0.0.1:40000",
            "127.0.0.1:22",
            TcpState::Established,
        );
        crate::quota::placed(s, ns, Some(&"ab".repeat(32)))
    };
    let t = vec![ssh(1), ssh(2), ssh(3)];
    let pl = plan_of(&p, &rc, 999, &t, None);
    assert!(pl.targets.is_empty());
    assert_eq!(pl.skipped.len(), 3);
    assert!(pl
        .skipped
        .iter()
        .all(|(_, why)| why.contains("protect_ports")));
}

#[test]
fn decisions_name_namespace_and_container() {
    let (p, _) = policy("trigger = \"always\"\nselect = { comm = \"node\" }\n");
    let id = "3f2a".repeat(16);
    let s = &in_ns(2, Some(&id), 1)[0];
    let d = decision(&p, &Mode::DryRun, s, &None, Outcome::WouldKill, None, 1);
    let v = serde_json::to_value(&d).unwrap();
    assert_eq!(v["netns"], 2);
    assert_eq!(v["netns_name"], "blue");
    assert_eq!(v["container"], id.as_str());
    let s = &in_ns(7, None, 1)[0];
    let v = serde_json::to_value(decision(
        &p,
        &Mode::DryRun,
        s,
        &None,
        Outcome::WouldKill,
        None,
        1,
    ))
    .unwrap();
    assert_eq!(
        (v["netns"].as_u64(), v["netns_name"].is_null()),
        (Some(7), true)
    );
    assert!(v.get("container").is_none());
}

#[test]
fn unowned_sockets_need_unowned_and_a_port() {
    // A connection in a listener's accept queue: nobody holds it yet.
    let mut s = sock(
        10,
        "x",
        "127.0.0.1:7500",
        "127.0.0.1:40000",
        TcpState::Established,
    );
    s.owner = None;
    assert_eq!(s.comm(), "?");
    let sel = |f: &dyn Fn(&mut Selector)| {
        let mut x = Selector::default();
        f(&mut x);
        selected(&x, &s)
    };
    assert!(!sel(&|x| x.comm = Some("?".into())));
    assert!(!sel(&|x| x.local_port = Some(7500)));
    assert!(!sel(&|x| x.peer = Some("127.0.0.1:40000".parse().unwrap())));
    assert!(!sel(&|x| {
        x.comm = Some("?".into());
        x.unowned = true;
    }));
    assert!(sel(&|x| {
        x.local_port = Some(7500);
        x.unowned = true;
    }));
    assert!(sel(&|x| {
        x.comm = Some("?".into());
        x.peer_port = Some(40000);
        x.unowned = true;
    }));
    assert!(!sel(&|x| {
        x.local_port = Some(7501);
        x.unowned = true;
    }));
    // And a policy that reads `comm = "?"` plans nothing on it.
    let (p, rc) = policy("trigger = \"always\"\nselect = { comm = \"?\" }\n");
    let t = vec![s.clone()];
    let pl = plan_of(&p, &rc, 999, &t, None);
    assert!(pl.targets.is_empty() && pl.skipped.is_empty());
}
