//! Unit tests of the table build (split out to keep build.rs readable).
use std::{
    collections::HashMap,
    net::{Ipv4Addr, Ipv6Addr},
};

use connreap_ebpf::{tcp_state, AF_INET6};

use super::*;

/// A dump at `s` seconds that took no time.
fn at(s: u64) -> Clock {
    Clock {
        start_ns: s * 1_000_000_000,
        end_ns: s * 1_000_000_000,
    }
}
const NOW: Clock = Clock {
    start_ns: 100_000_000_000,
    end_ns: 100_000_000_000,
};

fn rec(skaddr: u64, state: u8, sport: u16, dport: u16) -> SockRecord {
    let mut r = SockRecord {
        skaddr,
        inode: skaddr + 1000,
        family: AF_INET,
        state,
        sport,
        dport,
        flags: sock_flags::FULL,
        ..Default::default()
    };
    r.saddr[..4].copy_from_slice(&[127, 0, 0, 1]);
    r.daddr[..4].copy_from_slice(&[127, 0, 0, 1]);
    r
}

fn owner(skaddr: u64, tgid: u32, comm: &str) -> OwnerRecord {
    let mut c = [0u8; 16];
    c[..comm.len()].copy_from_slice(comm.as_bytes());
    OwnerRecord {
        skaddr,
        tgid,
        fd: 3,
        comm: c,
        ..OwnerRecord::default()
    }
}

#[test]
fn merges_owner_age_idle_and_service_port() {
    let mut listen = rec(1, tcp_state::LISTEN, 8080, 0);
    listen.flags = sock_flags::FULL;
    let mut accepted = rec(2, tcp_state::CLOSE_WAIT, 8080, 40000);
    accepted.flags |= sock_flags::SINCE_KNOWN | sock_flags::KEEPALIVE;
    accepted.state_age_jiffies = 15_000; // 60 s at HZ=250
    accepted.last_rcv_jiffies = 2500; // 10 s at HZ=250
    accepted.last_snd_jiffies = 500; // 2 s
    let client = rec(3, tcp_state::FIN_WAIT2, 40000, 8080);
    let owners = [
        owner(2, 77, "java"),
        owner(2, 99, "java"),
        owner(1, 77, "java"),
    ];
    let mut fs = FirstSeen::default();
    let t = build(
        &[listen, accepted, client],
        &owners,
        &HostInfo::default(),
        &mut fs,
        NOW,
        &mut |_| ProcessFacts {
            unit: Some("gw.service".into()),
            container: None,
        },
    );
    let cw = t.iter().find(|s| s.state == TcpState::CloseWait).unwrap();
    assert_eq!(cw.age(), Duration::from_secs(60));
    assert!(cw.age_exact);
    assert_eq!(cw.idle(), Some(Duration::from_secs(2)));
    assert_eq!(cw.direction, Direction::Inbound);
    assert_eq!(cw.service_port, 8080);
    let o = cw.owner.as_ref().unwrap();
    assert_eq!(
        (o.pid, &*o.comm, o.unit.as_deref()),
        (77, "java", Some("gw.service"))
    );
    assert_eq!(cw.fd, 3);
    assert_eq!(&*cw.shared_with, [99]);
    assert!(cw.keepalive, "SO_KEEPALIVE from the record's flags");
    let fw = t.iter().find(|s| s.state == TcpState::FinWait2).unwrap();
    assert!(!fw.keepalive);
    assert_eq!((fw.direction, fw.service_port), (Direction::Outbound, 8080));
    assert!(fw.owner.is_none());
    assert!(!fw.age_exact);
}

#[test]
fn serializes_the_documented_fields() {
    let mut listen = rec(1, tcp_state::LISTEN, 8080, 0);
    listen.flags = sock_flags::FULL;
    let mut cw = rec(2, tcp_state::CLOSE_WAIT, 8080, 40000);
    cw.flags |= sock_flags::SINCE_KNOWN;
    cw.state_age_jiffies = 15_000;
    cw.last_rcv_jiffies = 2500;
    cw.last_snd_jiffies = 500;
    let mut tw = rec(3, tcp_state::TIME_WAIT, 40001, 8080);
    tw.flags = sock_flags::SINCE_KNOWN;
    tw.state_age_jiffies = 1; // one tick: 4 ms
    tw.cookie = 42;
    let t = build(
        &[listen, cw, tw],
        &[owner(2, 77, "java"), owner(2, 99, "java")],
        &HostInfo::default(),
        &mut FirstSeen::default(),
        NOW,
        &mut |_| ProcessFacts {
            unit: Some("gw.service".into()),
            container: crate::containers::from_cgroup(&format!(
                "0::/system.slice/docker-{}.scope\n",
                "0f".repeat(32)
            ))
            .map(Arc::new),
        },
    );
    assert_eq!(
        serde_json::to_string(&t[1]).unwrap(),
        r#"{"inode":1002,"cookie":null,"local":"127.0.0.1:8080","peer":"127.0.0.1:40000","state":"CLOSE_WAIT","age_secs":60.0,"age_exact":true,"idle_secs":2.0,"last_recv_secs":10.0,"last_send_secs":2.0,"rx_queue":0,"tx_queue":0,"keepalive":false,"uid":0,"direction":"inbound","service_port":8080,"netns":0,"netns_name":null,"pid":77,"comm":"java","fd":3,"unit":"gw.service","container":"0f0f0f0f0f0f0f0f0f0f0f0f0f0f0f0f0f0f0f0f0f0f0f0f0f0f0f0f0f0f0f0f","container_runtime":"docker","container_name":null,"container_image":null,"pod_uid":null,"pod_name":null,"pod_namespace":null,"shared_with":[99]}"#
    );
    assert_eq!(
        serde_json::to_string(&t[2]).unwrap(),
        r#"{"inode":1003,"cookie":42,"local":"127.0.0.1:40001","peer":"127.0.0.1:8080","state":"TIME_WAIT","age_secs":0.004,"age_exact":true,"idle_secs":null,"last_recv_secs":null,"last_send_secs":null,"rx_queue":0,"tx_queue":0,"keepalive":false,"uid":0,"direction":"outbound","service_port":8080,"netns":0,"netns_name":null}"#
    );
}

#[test]
fn unknown_close_wait_age_is_bounded_by_last_ack() {
    let mut cw = rec(5, tcp_state::CLOSE_WAIT, 45000, 80);
    cw.last_ack_jiffies = 3000; // 12 s at 250 Hz
    let mut fs = FirstSeen::default();
    let t = build(&[cw], &[], &HostInfo::default(), &mut fs, NOW, &mut |_| {
        ProcessFacts::default()
    });
    assert_eq!(t[0].age(), Duration::from_secs(12));
    assert!(!t[0].age_exact);
    assert_eq!(
        (t[0].direction, t[0].service_port),
        (Direction::Outbound, 80)
    );
}

#[test]
fn first_seen_bound_grows_across_scans() {
    let s = rec(9, tcp_state::ESTABLISHED, 45000, 443);
    let mut fs = FirstSeen::default();
    let scan = |fs: &mut FirstSeen, socks: &[SockRecord], start_s: u64, end_s: u64| {
        let clock = Clock {
            start_ns: start_s * 1_000_000_000,
            end_ns: end_s * 1_000_000_000,
        };
        build(socks, &[], &HostInfo::default(), fs, clock, &mut |_| {
            ProcessFacts::default()
        })
    };
    assert_eq!(scan(&mut fs, &[s], 100, 102)[0].age(), Duration::ZERO);
    // Seen by the end of the first dump (102 s), aged from the second one's start (107 s):
    // the socket may have been created while the first dump ran.
    assert_eq!(
        scan(&mut fs, &[s], 107, 108)[0].age(),
        Duration::from_secs(5)
    );
    assert_eq!(
        scan(&mut fs, &[s], 110, 111)[0].age(),
        Duration::from_secs(8)
    );
    // A socket missing from a scan is forgotten.
    scan(&mut fs, &[], 115, 116);
    assert_eq!(scan(&mut fs, &[s], 120, 121)[0].age(), Duration::ZERO);
}

/// Sockets arrive in the kernel's hash order: first-seen bounds and owners must not depend
/// on it (checked against a plain model over shuffled dumps, with duplicates).
#[test]
fn first_seen_and_owners_in_any_order() {
    let mut x: u64 = 0x2545_f491_4f6c_dd1d;
    let mut shuffle = |v: &mut Vec<SockRecord>| {
        for i in (1..v.len()).rev() {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            v.swap(i, (x % (i as u64 + 1)) as usize);
        }
    };
    let dump = |range: std::ops::Range<u64>| {
        range
            .map(|a| rec(a * 64, tcp_state::ESTABLISHED, 40000, 443))
            .collect::<Vec<_>>()
    };
    let owners: Vec<OwnerRecord> = (0..1000u64)
        .filter(|a| a % 3 == 0)
        .flat_map(|a| {
            [
                owner(a * 64, 10 + (a % 5) as u32, "w"),
                owner(a * 64, 99, "x"),
            ]
        })
        .collect();
    let mut fs = FirstSeen::default();
    let scans: [(std::ops::Range<u64>, u64); 3] = [(0..500, 0), (250..750, 5), (0..100, 9)];
    let mut first_seen: HashMap<u64, u64> = HashMap::new();
    // One owner dump for all three scans: the later ones reuse the holders the first one
    // finished with (sorted and deduplicated), as a daemon scan that reuses its last dump.
    let mut kept = Holders::default();
    for o in &owners {
        kept.push(o);
    }
    for (range, now) in scans {
        let mut d = dump(range.clone());
        d.push(d[7]);
        shuffle(&mut d);
        let t = build_kept(
            &d,
            &mut kept,
            &HostInfo::default(),
            &mut fs,
            at(now),
            &mut |_| ProcessFacts::default(),
        );
        assert_eq!(t.len(), d.len());
        let mut model = HashMap::new();
        for r in &d {
            model.insert(r.skaddr, *first_seen.get(&r.skaddr).unwrap_or(&now));
        }
        for s in &t {
            let a = s.skaddr / 64;
            assert_eq!(
                s.age(),
                Duration::from_secs(now - model[&s.skaddr]),
                "{a} at {now}"
            );
            assert!(!s.age_exact);
            let expect = (a % 3 == 0).then(|| 10 + (a % 5) as u32);
            assert_eq!(s.pid(), expect, "{a}");
            let shared: &[u32] = if a % 3 == 0 { &[99] } else { &[] };
            assert_eq!(&*s.shared_with, shared, "{a}");
        }
        first_seen = model;
    }
}

#[test]
fn decodes_ipv6_and_mapped_addresses() {
    let mut s = rec(4, tcp_state::ESTABLISHED, 45000, 8080);
    s.family = AF_INET6;
    s.saddr = Ipv6Addr::LOCALHOST.octets();
    s.daddr = Ipv4Addr::new(10, 0, 16, 36).to_ipv6_mapped().octets();
    let t = build(
        &[s],
        &[],
        &HostInfo::default(),
        &mut FirstSeen::default(),
        NOW,
        &mut |_| ProcessFacts::default(),
    );
    assert_eq!(t[0].local.to_string(), "[::1]:45000");
    assert_eq!(t[0].peer.to_string(), "[::ffff:10.0.16.36]:8080");
}

/// Timewait sockets are aged from the kernel's stamp (CLOCK_MONOTONIC ms, low 32 bits),
/// not from when connreap first saw them.
#[test]
fn timewait_age_from_the_kernel_stamp() {
    // A dump at 2^32 + 1000 ms: its low 32 bits have wrapped past the stamps.
    let start_ms = (1u64 << 32) + 1000;
    let clock = Clock {
        start_ns: start_ms * 1_000_000,
        end_ns: start_ms * 1_000_000 + 50_000_000,
    };
    let tw = |skaddr, state, stamp: u32| {
        let mut r = rec(skaddr, state, 40000, 8080);
        r.flags = sock_flags::TW_ENTRY;
        r.tw_entry_ms = stamp;
        r
    };
    let mut unstamped = rec(4, tcp_state::TIME_WAIT, 40001, 8080);
    unstamped.flags = 0;
    let socks = [
        tw(1, tcp_state::TIME_WAIT, u32::MAX - 29_000 + 1), // 30 s before
        tw(2, tcp_state::FIN_WAIT2, 500),                   // 0.5 s before
        tw(3, tcp_state::TIME_WAIT, 1500),                  // "after" the dump began
        unstamped,
    ];
    let mut fs = FirstSeen::default();
    let t = build(
        &socks,
        &[],
        &HostInfo::default(),
        &mut fs,
        clock,
        &mut |_| ProcessFacts::default(),
    );
    let ages: Vec<_> = t.iter().map(|s| (s.age(), s.age_exact)).collect();
    assert_eq!(
        ages,
        [
            (Duration::from_secs(30), true),
            (Duration::from_millis(500), false),
            (Duration::ZERO, true),
            (Duration::ZERO, false),
        ]
    );
    // Only the unstamped one is remembered for a first-seen bound.
    assert_eq!(fs.seen.len(), 1);
}

#[test]
fn time_wait_has_no_idle() {
    let mut s = rec(6, tcp_state::TIME_WAIT, 45000, 80);
    s.flags = 0;
    let t = build(
        &[s],
        &[],
        &HostInfo::default(),
        &mut FirstSeen::default(),
        NOW,
        &mut |_| ProcessFacts::default(),
    );
    assert_eq!(t[0].idle(), None);
}
