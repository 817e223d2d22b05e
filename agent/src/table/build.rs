//! Building the table from the kernel's dumps: socket records streamed in as they are read,
//! then owners. Pure functions only; no kernel access.
use std::{
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    sync::Arc,
    time::Duration,
};

use connreap_ebpf::{sock_flags, OwnerRecord, SockRecord, AF_INET};
use rustc_hash::FxHashMap;

use super::{
    classify, opt_ms, Direction, Endpoint, HostInfo, Owner, PortSet, Socket, TcpState, NO_MS,
};

/// Remembers when the agent first saw each socket whose age the tracker does not know, for a
/// lower bound on it. Sockets the tracker knows are not kept: their age never needs it (the
/// tracker keeps a socket until it closes).
///
/// A scan looks them all up at once at its end, in one pass over both sorted lists: looking
/// each up as it arrives (in the kernel's hash order, random to this list) missed the cache on
/// most steps of a binary search, and was a third of the daemon's CPU on a host with 70k
/// TIME_WAIT sockets.
#[derive(Debug, Default)]
pub struct FirstSeen {
    /// Sockets and when they were first seen (ns), sorted.
    seen: Vec<Unaged>,
}

/// A socket whose age is a first-seen bound: during a scan `val` indexes
/// [`TableBuilder::unaged_rows`]; once resolved (and in [`FirstSeen`]) it is the first-seen
/// time. One allocation serves as both, so a scan of 100k such sockets holds no third list.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct Unaged {
    skaddr: u64,
    inode: u64,
    val: u64,
}

impl FirstSeen {
    /// Resolve the first-seen bounds of this scan's unaged rows (`keys[i].val` indexes `rows`,
    /// the table rows), raising each row's age to its bound; remember them for the next scan
    /// and forget sockets not seen in this one. `clock` is when the dump began and ended
    /// (CLOCK_MONOTONIC ns): a socket first seen in this scan is stamped with its end and aged
    /// from a later scan's beginning, so the bound never exceeds the socket's real age.
    fn resolve(&mut self, mut keys: Vec<Unaged>, rows: &[u32], clock: Clock, table: &mut [Socket]) {
        keys.sort_unstable();
        let mut first = vec![0u64; rows.len()];
        let mut j = 0;
        for k in &mut keys {
            let key = (k.skaddr, k.inode);
            while j < self.seen.len() && (self.seen[j].skaddr, self.seen[j].inode) < key {
                j += 1;
            }
            let n = k.val as usize;
            k.val = match self.seen.get(j) {
                Some(s) if (s.skaddr, s.inode) == key => s.val,
                _ => clock.end_ns,
            };
            first[n] = k.val;
        }
        self.seen = keys;
        for (&row, t) in rows.iter().zip(first) {
            if let Some(s) = table.get_mut(row as usize) {
                s.age = s
                    .age
                    .max(Duration::from_nanos(clock.start_ns.saturating_sub(t)));
            }
        }
    }
}

/// When a dump began and ended, CLOCK_MONOTONIC ns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Clock {
    pub start_ns: u64,
    pub end_ns: u64,
}

fn addr(family: u16, raw: &[u8; 16], port: u16) -> Endpoint {
    let ip = if family == AF_INET {
        IpAddr::V4(Ipv4Addr::new(raw[0], raw[1], raw[2], raw[3]))
    } else {
        IpAddr::V6(Ipv6Addr::from(*raw))
    };
    Endpoint::new(ip, port)
}

fn comm_str(raw: &[u8; 16]) -> String {
    let end = raw.iter().position(|b| *b == 0).unwrap_or(raw.len());
    String::from_utf8_lossy(&raw[..end]).into_owned()
}

/// Socket holders from the owner dump, 16 bytes each; command names are kept once per process.
#[derive(Debug, Default)]
pub struct Holders {
    /// (skaddr, tgid, fd)
    holders: Vec<(u64, u32, u32)>,
    comms: FxHashMap<u32, [u8; 16]>,
}

impl Holders {
    pub fn push(&mut self, o: &OwnerRecord) {
        self.holders.push((o.skaddr, o.tgid, o.fd));
        self.comms.entry(o.tgid).or_insert(o.comm);
    }
    pub fn pids(&self) -> impl Iterator<Item = u32> + '_ {
        self.comms.keys().copied()
    }
}

/// Builds the table in two steps, so a scan never holds the kernel's socket records: `push`
/// each socket record as it is read, then `finish` with the owner dump.
pub struct TableBuilder<'a> {
    host: &'a HostInfo,
    first_seen: &'a mut FirstSeen,
    listening: PortSet,
    table: Vec<Socket>,
    /// Rows whose age is a first-seen bound (see [`FirstSeen`]): keys, and their rows.
    unaged: Vec<Unaged>,
    unaged_rows: Vec<u32>,
    /// When the socket dump began (CLOCK_MONOTONIC ns).
    start_ns: u64,
}

impl<'a> TableBuilder<'a> {
    /// `start_ns`: when the socket dump begins (CLOCK_MONOTONIC ns, read before it).
    pub fn new(
        host: &'a HostInfo,
        first_seen: &'a mut FirstSeen,
        capacity: usize,
        start_ns: u64,
    ) -> Self {
        TableBuilder {
            host,
            first_seen,
            listening: PortSet::default(),
            table: Vec::with_capacity(capacity),
            unaged: Vec::new(),
            unaged_rows: Vec::new(),
            start_ns,
        }
    }

    /// A timewait socket's time in its state from the kernel's stamp (`tw_entry_ms`), if the
    /// record has one: exact for TIME_WAIT, a lower bound for an orphaned FIN_WAIT2 (it was in
    /// FIN_WAIT2 before it became a timewait socket).
    fn timewait_age(&self, s: &SockRecord, state: TcpState) -> Option<(Duration, bool)> {
        if s.flags & sock_flags::TW_ENTRY == 0 {
            return None;
        }
        // Both are CLOCK_MONOTONIC; the stamp is its low 32 bits in ms. The dump began before
        // the record was read, so this never exceeds the real age; a stamp "after" it (the
        // kernel clock ahead by under a dump) is taken as zero.
        let now_ms = (self.start_ns / 1_000_000) as u32;
        let ms = now_ms.wrapping_sub(s.tw_entry_ms);
        let ms = if ms > u32::MAX / 2 { 0 } else { ms };
        Some((
            Duration::from_millis(ms.into()),
            state == TcpState::TimeWait,
        ))
    }

    pub fn push(&mut self, s: &SockRecord) {
        let Some(state) = TcpState::from_kernel(s.state) else {
            return;
        };
        let hz = self.host.hz.max(1) as u64;
        let jiffies = |j: u32| j as u64 * 1000 / hz;
        let full = s.flags & sock_flags::FULL != 0;
        let (last_recv_ms, last_send_ms) = if full && state != TcpState::Listen {
            (jiffies(s.last_rcv_jiffies), jiffies(s.last_snd_jiffies))
        } else {
            (NO_MS, NO_MS)
        };
        let (age, age_exact) = if s.flags & sock_flags::SINCE_KNOWN != 0 {
            (
                Duration::from_nanos(s.state_age_jiffies.saturating_mul(1_000_000_000) / hz),
                true,
            )
        } else if let Some(tw) = self.timewait_age(s, state) {
            tw
        } else {
            // At least as long as the agent has seen it: resolved in `finish`.
            self.unaged.push(Unaged {
                skaddr: s.skaddr,
                inode: s.inode,
                val: self.unaged_rows.len() as u64,
            });
            self.unaged_rows.push(self.table.len() as u32);
            // In CLOSE_WAIT the peer's FIN (an ACK) arrived when the state was entered, and
            // the peer can only ACK since: time since the last ACK bounds the age from below.
            let bound = if state == TcpState::CloseWait && full {
                Duration::from_millis(jiffies(s.last_ack_jiffies))
            } else {
                Duration::ZERO
            };
            (bound, false)
        };
        if state == TcpState::Listen {
            self.listening.insert(s.sport);
        }
        let mut sock = Socket::new(
            addr(s.family, &s.saddr, s.sport),
            addr(s.family, &s.daddr, s.dport),
            state,
        );
        sock.skaddr = s.skaddr;
        sock.inode = s.inode;
        sock.cookie = s.cookie;
        sock.age = age;
        sock.age_exact = age_exact;
        sock.last_recv_ms = last_recv_ms;
        sock.last_send_ms = last_send_ms;
        sock.idle = opt_ms(last_recv_ms.min(last_send_ms));
        sock.rx_queue = s.rx_queue;
        sock.tx_queue = s.tx_queue;
        sock.uid = s.uid;
        self.table.push(sock);
    }

    /// Direction and service port (now that every listener is known) and owners.
    /// `unit_of` maps a pid to its systemd unit.
    /// `end_ns`: when the socket dump ended (CLOCK_MONOTONIC ns, read after it).
    pub fn finish(
        self,
        mut holders: Holders,
        end_ns: u64,
        unit_of: &mut dyn FnMut(u32) -> Option<String>,
    ) -> Vec<Socket> {
        let mut table = self.table;
        let clock = Clock {
            start_ns: self.start_ns,
            end_ns,
        };
        self.first_seen
            .resolve(self.unaged, &self.unaged_rows, clock, &mut table);
        let h = &mut holders.holders;
        h.sort_unstable();
        h.dedup_by_key(|o| (o.0, o.1));
        // Each row's holders (a range of `h`), from one pass over the rows and the holders
        // both sorted by socket address. TIME_WAIT rows are left out: a timewait socket has
        // no file, so no holder.
        let mut by_addr: Vec<(u64, u32)> = table
            .iter()
            .enumerate()
            .filter(|(_, s)| s.state != TcpState::TimeWait)
            .map(|(i, s)| (s.skaddr, i as u32))
            .collect();
        by_addr.sort_unstable();
        let mut held_by = vec![(0u32, 0u32); table.len()];
        let mut j = 0;
        for &(skaddr, row) in &by_addr {
            while j < h.len() && h[j].0 < skaddr {
                j += 1;
            }
            let n = h[j..].iter().take_while(|o| o.0 == skaddr).count();
            held_by[row as usize] = (j as u32, n as u32);
        }
        // Per process: comm and unit, allocated once.
        let mut procs: FxHashMap<u32, Arc<Owner>> = FxHashMap::default();
        for (s, (first, n)) in table.iter_mut().zip(held_by) {
            (s.direction, s.service_port) = if s.state == TcpState::Listen {
                (Direction::Listen, s.local.port())
            } else {
                classify(
                    s.local.port(),
                    s.peer.port(),
                    &self.listening,
                    &self.host.ephemeral,
                )
            };
            let mine = &h[first as usize..(first + n) as usize];
            if let Some(&(_, tgid, fd)) = mine.first() {
                let owner = procs.entry(tgid).or_insert_with(|| {
                    let comm = holders.comms.get(&tgid).map(comm_str).unwrap_or_default();
                    Arc::new(Owner {
                        pid: tgid,
                        comm: comm.into(),
                        unit: unit_of(tgid).map(Arc::from),
                    })
                });
                s.owner = Some(owner.clone());
                s.fd = fd;
                if n > 1 {
                    s.shared_with = mine[1..].iter().map(|o| o.1).collect();
                }
            }
        }
        table
    }
}

/// Build the table from whole dumps. `unit_of` maps a pid to its systemd unit.
#[cfg(test)]
fn build(
    socks: &[SockRecord],
    owners: &[OwnerRecord],
    host: &HostInfo,
    first_seen: &mut FirstSeen,
    clock: Clock,
    unit_of: &mut dyn FnMut(u32) -> Option<String>,
) -> Vec<Socket> {
    let mut b = TableBuilder::new(host, first_seen, socks.len(), clock.start_ns);
    for s in socks {
        b.push(s);
    }
    let mut holders = Holders::default();
    for o in owners {
        holders.push(o);
    }
    b.finish(holders, clock.end_ns, unit_of)
}

#[cfg(test)]
mod tests {
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
        }
    }

    #[test]
    fn merges_owner_age_idle_and_service_port() {
        let mut listen = rec(1, tcp_state::LISTEN, 8080, 0);
        listen.flags = sock_flags::FULL;
        let mut accepted = rec(2, tcp_state::CLOSE_WAIT, 8080, 40000);
        accepted.flags |= sock_flags::SINCE_KNOWN;
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
            &mut |_| Some("gw.service".into()),
        );
        let cw = t.iter().find(|s| s.state == TcpState::CloseWait).unwrap();
        assert_eq!(cw.age, Duration::from_secs(60));
        assert!(cw.age_exact);
        assert_eq!(cw.idle, Some(Duration::from_secs(2)));
        assert_eq!(cw.direction, Direction::Inbound);
        assert_eq!(cw.service_port, 8080);
        let o = cw.owner.as_ref().unwrap();
        assert_eq!(
            (o.pid, &*o.comm, o.unit.as_deref()),
            (77, "java", Some("gw.service"))
        );
        assert_eq!(cw.fd, 3);
        assert_eq!(&*cw.shared_with, [99]);
        let fw = t.iter().find(|s| s.state == TcpState::FinWait2).unwrap();
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
            &mut |_| Some("gw.service".into()),
        );
        assert_eq!(
            serde_json::to_string(&t[1]).unwrap(),
            r#"{"inode":1002,"cookie":null,"local":"127.0.0.1:8080","peer":"127.0.0.1:40000","state":"CLOSE_WAIT","age_secs":60.0,"age_exact":true,"idle_secs":2.0,"last_recv_secs":10.0,"last_send_secs":2.0,"rx_queue":0,"tx_queue":0,"uid":0,"direction":"inbound","service_port":8080,"pid":77,"comm":"java","fd":3,"unit":"gw.service","shared_with":[99]}"#
        );
        assert_eq!(
            serde_json::to_string(&t[2]).unwrap(),
            r#"{"inode":1003,"cookie":42,"local":"127.0.0.1:40001","peer":"127.0.0.1:8080","state":"TIME_WAIT","age_secs":0.004,"age_exact":true,"idle_secs":null,"last_recv_secs":null,"last_send_secs":null,"rx_queue":0,"tx_queue":0,"uid":0,"direction":"outbound","service_port":8080}"#
        );
    }

    #[test]
    fn unknown_close_wait_age_is_bounded_by_last_ack() {
        let mut cw = rec(5, tcp_state::CLOSE_WAIT, 45000, 80);
        cw.last_ack_jiffies = 3000; // 12 s at 250 Hz
        let mut fs = FirstSeen::default();
        let t = build(&[cw], &[], &HostInfo::default(), &mut fs, NOW, &mut |_| {
            None
        });
        assert_eq!(t[0].age, Duration::from_secs(12));
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
            build(socks, &[], &HostInfo::default(), fs, clock, &mut |_| None)
        };
        assert_eq!(scan(&mut fs, &[s], 100, 102)[0].age, Duration::ZERO);
        // Seen by the end of the first dump (102 s), aged from the second one's start (107 s):
        // the socket may have been created while the first dump ran.
        assert_eq!(scan(&mut fs, &[s], 107, 108)[0].age, Duration::from_secs(5));
        assert_eq!(scan(&mut fs, &[s], 110, 111)[0].age, Duration::from_secs(8));
        // A socket missing from a scan is forgotten.
        scan(&mut fs, &[], 115, 116);
        assert_eq!(scan(&mut fs, &[s], 120, 121)[0].age, Duration::ZERO);
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
        for (range, now) in scans {
            let mut d = dump(range.clone());
            d.push(d[7]);
            shuffle(&mut d);
            let t = build(
                &d,
                &owners,
                &HostInfo::default(),
                &mut fs,
                at(now),
                &mut |_| None,
            );
            assert_eq!(t.len(), d.len());
            let mut model = HashMap::new();
            for r in &d {
                model.insert(r.skaddr, *first_seen.get(&r.skaddr).unwrap_or(&now));
            }
            for s in &t {
                let a = s.skaddr / 64;
                assert_eq!(
                    s.age,
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
            &mut |_| None,
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
            &mut |_| None,
        );
        let ages: Vec<_> = t.iter().map(|s| (s.age, s.age_exact)).collect();
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
            &mut |_| None,
        );
        assert_eq!(t[0].idle, None);
    }
}
