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
    classify, Direction, Endpoint, HostInfo, Netns, Owner, PortSet, ProcessFacts, Socket, TcpState,
    NO_MS,
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
                let bound = Duration::from_nanos(clock.start_ns.saturating_sub(t));
                s.set_age(s.age().max(bound));
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
    /// Whether process `pid` holds a socket here.
    pub fn holds(&self, pid: u32) -> bool {
        self.comms.contains_key(&pid)
    }
}

/// One namespace's part of a scan: its listeners and ephemeral range decide the service side
/// of its sockets (every pod may listen on 8080; another pod's listener says nothing here).
struct NsPart {
    netns: Arc<Netns>,
    listening: PortSet,
    ephemeral: std::ops::RangeInclusive<u16>,
}

/// Builds the table in two steps, so a scan never holds the kernel's socket records: `push`
/// each socket record as it is read (after [`TableBuilder::begin_namespace`] for the
/// namespace they come from), then `finish` with the owner dump.
pub struct TableBuilder<'a> {
    host: &'a HostInfo,
    first_seen: &'a mut FirstSeen,
    /// The namespaces of this scan, the one being read last.
    parts: Vec<NsPart>,
    /// Each row's index in `parts`.
    row_part: Vec<u32>,
    table: Vec<Socket>,
    /// Rows whose age is a first-seen bound (see [`FirstSeen`]): keys, and their rows.
    unaged: Vec<Unaged>,
    unaged_rows: Vec<u32>,
    /// When the socket dump began (CLOCK_MONOTONIC ns).
    start_ns: u64,
}

impl<'a> TableBuilder<'a> {
    /// Build into `rows` (its capacity sizes the scan's lists; the caller may have advised
    /// the kernel on its memory). `start_ns`: when the socket dump begins (CLOCK_MONOTONIC ns,
    /// read before it).
    pub fn into_rows(
        host: &'a HostInfo,
        first_seen: &'a mut FirstSeen,
        mut rows: Vec<Socket>,
        start_ns: u64,
    ) -> Self {
        rows.clear();
        TableBuilder {
            host,
            first_seen,
            parts: Vec::new(),
            row_part: Vec::with_capacity(rows.capacity()),
            table: rows,
            unaged: Vec::new(),
            unaged_rows: Vec::new(),
            start_ns,
        }
    }

    /// The records pushed from now on come from `netns`, whose ephemeral port range is
    /// `ephemeral` (None: the host's). Returns the namespace's part, for [`Self::push_in`].
    pub fn begin_namespace(
        &mut self,
        netns: Arc<Netns>,
        ephemeral: Option<std::ops::RangeInclusive<u16>>,
    ) -> usize {
        self.parts.push(NsPart {
            netns,
            listening: PortSet::default(),
            ephemeral: ephemeral.unwrap_or_else(|| self.host.ephemeral.clone()),
        });
        self.parts.len() - 1
    }

    /// The namespace being read: the last begun (the host's, unknown, if none was).
    fn part(&mut self) -> usize {
        if self.parts.is_empty() {
            self.begin_namespace(Netns::unknown(), None);
        }
        self.parts.len() - 1
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

    /// A record of the namespace begun last.
    pub fn push(&mut self, s: &SockRecord) {
        let part = self.part();
        self.push_in(part, s);
    }

    /// A record of the namespace `part` (from [`Self::begin_namespace`]; records of several
    /// namespaces may come interleaved).
    pub fn push_in(&mut self, part: usize, s: &SockRecord) {
        if part >= self.parts.len() {
            return;
        }
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
            self.parts[part].listening.insert(s.sport);
        }
        let mut sock = Socket::in_netns(
            addr(s.family, &s.saddr, s.sport),
            addr(s.family, &s.daddr, s.dport),
            state,
            self.parts[part].netns.clone(),
        );
        sock.skaddr = s.skaddr;
        sock.inode = s.inode;
        sock.cookie = s.cookie;
        sock.set_age(age);
        sock.age_exact = age_exact;
        sock.last_recv_ms = last_recv_ms;
        sock.last_send_ms = last_send_ms;
        sock.rx_queue = s.rx_queue;
        sock.tx_queue = s.tx_queue;
        sock.uid = s.uid;
        sock.keepalive = s.flags & sock_flags::KEEPALIVE != 0;
        self.row_part.push(part as u32);
        self.table.push(sock);
    }

    /// Direction and service port (now that every listener is known) and owners.
    /// `facts_of` gives a pid's systemd unit and container.
    /// `end_ns`: when the socket dump ended (CLOCK_MONOTONIC ns, read after it).
    pub fn finish(
        self,
        holders: &mut Holders,
        end_ns: u64,
        facts_of: &mut dyn FnMut(u32) -> ProcessFacts,
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
        for ((s, (first, n)), part) in table.iter_mut().zip(held_by).zip(&self.row_part) {
            (s.direction, s.service_port) = if s.state == TcpState::Listen {
                (Direction::Listen, s.local.port())
            } else {
                let ns = &self.parts[*part as usize];
                classify(s.local.port(), s.peer.port(), &ns.listening, &ns.ephemeral)
            };
            let mine = &h[first as usize..(first + n) as usize];
            if let Some(&(_, tgid, fd)) = mine.first() {
                let owner = procs.entry(tgid).or_insert_with(|| {
                    let comm = holders.comms.get(&tgid).map(comm_str).unwrap_or_default();
                    let facts = facts_of(tgid);
                    Arc::new(Owner {
                        pid: tgid,
                        comm: comm.into(),
                        unit: facts.unit,
                        container: facts.container,
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

/// Build the table from whole dumps. `facts_of` gives a pid's systemd unit and container.
#[cfg(test)]
fn build(
    socks: &[SockRecord],
    owners: &[OwnerRecord],
    host: &HostInfo,
    first_seen: &mut FirstSeen,
    clock: Clock,
    facts_of: &mut dyn FnMut(u32) -> ProcessFacts,
) -> Vec<Socket> {
    let mut holders = Holders::default();
    for o in owners {
        holders.push(o);
    }
    build_kept(socks, &mut holders, host, first_seen, clock, facts_of)
}

/// [`build`] with the holders of an owner dump that an earlier build may have finished with
/// (as a daemon scan that reuses the last dump does).
#[cfg(test)]
fn build_kept(
    socks: &[SockRecord],
    holders: &mut Holders,
    host: &HostInfo,
    first_seen: &mut FirstSeen,
    clock: Clock,
    facts_of: &mut dyn FnMut(u32) -> ProcessFacts,
) -> Vec<Socket> {
    let mut b = TableBuilder::into_rows(
        host,
        first_seen,
        Vec::with_capacity(socks.len()),
        clock.start_ns,
    );
    for s in socks {
        b.push(s);
    }
    b.finish(holders, clock.end_ns, facts_of)
}

#[cfg(test)]
mod tests;
