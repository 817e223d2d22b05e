//! The other end of each connection on this host, wherever it lives: in the socket's own network
//! namespace, in another pod's namespace (bridge/veth addresses), or behind a Service's DNAT.
//!
//! Rules, in order, for a socket without a partner yet:
//! 1. **Same namespace**: the socket with the reversed 4-tuple in its own namespace (the only
//!    rule for loopback addresses: two namespaces each hold their own `127.0.0.1`).
//! 2. **Across namespaces**: the reversed 4-tuple in another namespace, for addresses that are
//!    not loopback, when exactly one socket has it.
//! 3. **Through a DNAT**: a client dialled a Service address (ClusterIP:port) and the server
//!    sees the client's own address: the client's local endpoint equals the server's peer. Paired
//!    when exactly one unpaired client has that source endpoint and exactly one unpaired server
//!    sees it (a source address and port names one connection on a host).
//!
//! 4. **By conntrack**: where rule 3 finds no unique match (several clients share a source, or
//!    the server sees another source: a masquerading Service), the kernel's connection tracking
//!    of the namespace that translated it says which: the reply tuple of the client's original
//!    tuple is the server's own (local, peer). Read only when such sockets exist.
//!
//! Where more than one socket could be the other end, none is taken: the socket is marked
//! ambiguous and treated as unpaired with a note, never paired on a guess.
use std::net::IpAddr;

use rustc_hash::FxHashMap;

use crate::table::{ConnKey, Direction, Endpoint, Socket, TcpState};

const NONE: u32 = u32::MAX;

/// How a socket's other end was found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PairedBy {
    SameNetns,
    AcrossNetns,
    /// Client source endpoint = server's peer (a DNAT between them).
    Dnat,
    /// The client's tuple translated by conntrack is the server's (a DNAT, maybe with SNAT).
    Conntrack,
}

/// One tracked TCP connection's original and reply tuples (as conntrack prints them: the
/// reply's source is the server's own address, its destination what the server sees).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Nat {
    pub orig_src: Endpoint,
    pub orig_dst: Endpoint,
    pub reply_src: Endpoint,
    pub reply_dst: Endpoint,
}

/// The TCP entries of `/proc/net/nf_conntrack` text that were translated (reply differs from
/// the reversed original). Lines that do not parse are skipped.
pub fn parse_conntrack(text: &str) -> Vec<Nat> {
    text.lines().filter_map(parse_conntrack_line).collect()
}

fn parse_conntrack_line(line: &str) -> Option<Nat> {
    let mut f = line.split_whitespace();
    if f.nth(2)? != "tcp" {
        return None;
    }
    let mut vals: [Vec<&str>; 4] = Default::default();
    for field in f {
        let Some((k, v)) = field.split_once('=') else {
            continue;
        };
        let i = match k {
            "src" => 0,
            "dst" => 1,
            "sport" => 2,
            "dport" => 3,
            _ => continue,
        };
        vals[i].push(v);
    }
    let ep = |ip: &str, port: &str| -> Option<Endpoint> {
        Some(Endpoint::new(ip.parse().ok()?, port.parse().ok()?))
    };
    let [src, dst, sport, dport] = &vals;
    if src.len() < 2 || dst.len() < 2 || sport.len() < 2 || dport.len() < 2 {
        return None;
    }
    let n = Nat {
        orig_src: ep(src[0], sport[0])?,
        orig_dst: ep(dst[0], dport[0])?,
        reply_src: ep(src[1], sport[1])?,
        reply_dst: ep(dst[1], dport[1])?,
    };
    (n.reply_src != n.orig_dst || n.reply_dst != n.orig_src).then_some(n)
}

/// For each row of a table, the row holding the other end of its connection, if on this host.
#[derive(Debug, Default)]
pub struct Ends {
    other: Vec<u32>,
    how: Vec<Option<PairedBy>>,
    /// Rows whose other end could be more than one socket.
    ambiguous: Vec<bool>,
    /// Rows that repeat an earlier row's connection end (same namespace and 4-tuple): they share
    /// its other end, and are left out of [`Ends::pairs`].
    dup: Vec<bool>,
}

fn loopback(ip: IpAddr) -> bool {
    ip.to_canonical().is_loopback()
}

fn eligible(s: &Socket) -> bool {
    !matches!(s.state, TcpState::Listen | TcpState::TimeWait)
}

/// An endpoint as a hash key: address bits and port.
type EpKey = (u128, u16);

/// An endpoint as a hash key (IPv4 as mapped IPv6, like [`ConnKey`]).
fn ep_key(e: Endpoint) -> EpKey {
    let bits = match e.ip() {
        IpAddr::V4(v4) => v4.to_ipv6_mapped().to_bits(),
        IpAddr::V6(v6) => v6.to_bits(),
    };
    (bits, e.port())
}

/// First row and how many rows share a key.
#[derive(Clone, Copy)]
struct Seen {
    first: u32,
    count: u32,
}

fn note<K: std::hash::Hash + Eq>(map: &mut FxHashMap<K, Seen>, k: K, i: usize) {
    map.entry(k).and_modify(|s| s.count += 1).or_insert(Seen {
        first: i as u32,
        count: 1,
    });
}

impl Ends {
    pub fn new(table: &[Socket]) -> Ends {
        Self::with_nat(table, &|| Vec::new())
    }

    /// [`Ends::new`] with the host's translated connections (rule 4), asked for only when some
    /// client and server are left without a unique match.
    pub fn with_nat(table: &[Socket], nat: &dyn Fn() -> Vec<Nat>) -> Ends {
        let n = table.len();
        let mut e = Ends {
            other: vec![NONE; n],
            how: vec![None; n],
            ambiguous: vec![false; n],
            dup: vec![false; n],
        };
        let mut exact: FxHashMap<ConnKey, u32> =
            FxHashMap::with_capacity_and_hasher(n, Default::default());
        let mut dups: Vec<(usize, usize)> = Vec::new();
        for (i, s) in table.iter().enumerate().filter(|(_, s)| eligible(s)) {
            match exact.entry(ConnKey::of(s)) {
                std::collections::hash_map::Entry::Occupied(first) => {
                    dups.push((i, *first.get() as usize));
                    e.dup[i] = true;
                }
                std::collections::hash_map::Entry::Vacant(v) => {
                    v.insert(i as u32);
                }
            }
        }
        for (i, s) in table.iter().enumerate() {
            if !eligible(s) || s.direction == Direction::Inbound || e.other[i] != NONE || e.dup[i] {
                continue;
            }
            if let Some(&j) = exact.get(&ConnKey::other_end(s)) {
                let j = j as usize;
                if j != i && e.other[j] == NONE {
                    e.link(i, j, PairedBy::SameNetns);
                }
            }
        }
        // One namespace (the common host): nothing can cross.
        let first_ns = table.first().map(|s| s.netns.inode);
        if !table.iter().all(|s| Some(s.netns.inode) == first_ns) {
            e.across(table);
            e.dnat(table);
            e.conntrack(table, nat);
        }
        for (i, first) in dups {
            e.other[i] = e.other[first];
            e.how[i] = e.how[first];
            e.ambiguous[i] = e.ambiguous[first];
        }
        e
    }

    fn link(&mut self, a: usize, b: usize, how: PairedBy) {
        self.other[a] = b as u32;
        self.other[b] = a as u32;
        self.how[a] = Some(how);
        self.how[b] = Some(how);
    }

    fn unpaired_routable(&self, table: &[Socket], i: usize) -> bool {
        let s = &table[i];
        eligible(s)
            && self.other[i] == NONE
            && !self.dup[i]
            && !self.ambiguous[i]
            && !loopback(s.local.ip())
            && !loopback(s.peer.ip())
    }

    /// Rule 2: the reversed 4-tuple in another namespace.
    fn across(&mut self, table: &[Socket]) {
        let mut global: FxHashMap<(EpKey, EpKey), Seen> = FxHashMap::default();
        for i in 0..table.len() {
            if self.unpaired_routable(table, i) {
                let s = &table[i];
                note(&mut global, (ep_key(s.local), ep_key(s.peer)), i);
            }
        }
        for i in 0..table.len() {
            if !self.unpaired_routable(table, i) {
                continue;
            }
            let s = &table[i];
            let Some(seen) = global.get(&(ep_key(s.peer), ep_key(s.local))).copied() else {
                continue;
            };
            let j = seen.first as usize;
            if seen.count > 1 {
                self.ambiguous[i] = true;
            } else if j != i
                && self.other[j] == NONE
                && table[j].netns.inode != s.netns.inode
                && !self.ambiguous[j]
            {
                // The other side sees one candidate too only if our tuple is unique.
                if global
                    .get(&(ep_key(s.local), ep_key(s.peer)))
                    .is_some_and(|x| x.count > 1)
                {
                    self.ambiguous[i] = true;
                    self.ambiguous[j] = true;
                } else {
                    self.link(i, j, PairedBy::AcrossNetns);
                }
            }
        }
    }

    /// Rule 3: the client's source endpoint seen as a server's peer.
    fn dnat(&mut self, table: &[Socket]) {
        let mut clients: FxHashMap<EpKey, Seen> = FxHashMap::default();
        let mut servers: FxHashMap<EpKey, Seen> = FxHashMap::default();
        for i in 0..table.len() {
            if !self.unpaired_routable(table, i) {
                continue;
            }
            let s = &table[i];
            match s.direction {
                Direction::Inbound => note(&mut servers, ep_key(s.peer), i),
                Direction::Outbound => note(&mut clients, ep_key(s.local), i),
                Direction::Listen => {}
            }
        }
        let mut unsure: rustc_hash::FxHashSet<EpKey> = Default::default();
        for (src, c) in clients {
            let Some(sv) = servers.get(&src).copied() else {
                continue;
            };
            if c.count == 1 && sv.count == 1 {
                self.link(c.first as usize, sv.first as usize, PairedBy::Dnat);
            } else {
                unsure.insert(src);
            }
        }
        if unsure.is_empty() {
            return;
        }
        // Several clients with one source (or servers seeing it): no guess.
        for (i, s) in table.iter().enumerate() {
            let src = match s.direction {
                Direction::Inbound => ep_key(s.peer),
                _ => ep_key(s.local),
            };
            if self.other[i] == NONE && eligible(s) && unsure.contains(&src) {
                self.ambiguous[i] = true;
            }
        }
    }

    /// Rule 4: conntrack's translation of unpaired clients' tuples names their server.
    fn conntrack(&mut self, table: &[Socket], nat: &dyn Fn() -> Vec<Nat>) {
        // Unpaired (ambiguous ones included) routable sockets by (local, peer).
        let open = |e: &Ends, i: usize| {
            let s = &table[i];
            eligible(s)
                && e.other[i] == NONE
                && !e.dup[i]
                && !loopback(s.local.ip())
                && !loopback(s.peer.ip())
        };
        let mut servers: FxHashMap<(EpKey, EpKey), Seen> = FxHashMap::default();
        let mut any_client = false;
        for (i, s) in table.iter().enumerate() {
            if !open(self, i) {
                continue;
            }
            match s.direction {
                Direction::Inbound => note(&mut servers, (ep_key(s.local), ep_key(s.peer)), i),
                Direction::Outbound => any_client = true,
                Direction::Listen => {}
            }
        }
        if servers.is_empty() || !any_client {
            return;
        }
        let translated: FxHashMap<(EpKey, EpKey), (EpKey, EpKey)> = nat()
            .into_iter()
            .map(|n| {
                (
                    (ep_key(n.orig_src), ep_key(n.orig_dst)),
                    (ep_key(n.reply_src), ep_key(n.reply_dst)),
                )
            })
            .collect();
        if translated.is_empty() {
            return;
        }
        for (i, s) in table.iter().enumerate() {
            if !open(self, i) || s.direction != Direction::Outbound {
                continue;
            }
            let Some(reply) = translated.get(&(ep_key(s.local), ep_key(s.peer))) else {
                continue;
            };
            let Some(sv) = servers.get(reply).copied() else {
                continue;
            };
            let j = sv.first as usize;
            if sv.count == 1 && open(self, j) {
                self.link(i, j, PairedBy::Conntrack);
                self.ambiguous[i] = false;
                self.ambiguous[j] = false;
            }
        }
    }

    /// The row of the other end of row `i`'s connection.
    pub fn other(&self, i: usize) -> Option<usize> {
        self.other
            .get(i)
            .copied()
            .filter(|&j| j != NONE)
            .map(|j| j as usize)
    }

    /// How row `i` was paired.
    pub fn how(&self, i: usize) -> Option<PairedBy> {
        self.how.get(i).copied().flatten()
    }

    /// Whether row `i` has no other end because several sockets could be it.
    pub fn ambiguous(&self, i: usize) -> bool {
        self.ambiguous.get(i).copied().unwrap_or(false)
    }

    /// Every pair once: (client row, server row), the server being the inbound side (or the
    /// lower local port when neither is).
    pub fn pairs<'a>(&'a self, table: &'a [Socket]) -> impl Iterator<Item = (usize, usize)> + 'a {
        (0..self.other.len()).filter_map(move |i| {
            let j = self.other(i).filter(|_| !self.dup[i])?;
            let (a, b) = (&table[i], &table[j]);
            let i_client = b.direction == Direction::Inbound
                || (a.direction != Direction::Inbound && a.local.port() > b.local.port());
            i_client.then_some((i, j))
        })
    }

    /// The other end of each socket by socket address (what the quota detector keys by).
    pub fn by_skaddr<'a>(&self, table: &'a [Socket]) -> FxHashMap<u64, &'a Socket> {
        let mut m = FxHashMap::default();
        for (i, s) in table.iter().enumerate() {
            if let Some(j) = self.other(i) {
                m.insert(s.skaddr, &table[j]);
            }
        }
        m
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::detect::{
        scope_testutil::{netns, place},
        testutil::sock,
    };

    fn est(pid: u32, l: &str, p: &str, dir: Direction) -> Socket {
        let mut s = sock(pid, "x", l, p, TcpState::Established);
        s.direction = dir;
        s
    }

    #[test]
    fn pairs_across_pod_namespaces_but_not_loopback() {
        let (a, b) = (netns(41, Some("a")), netns(42, Some("b")));
        let t = vec![
            place(
                est(
                    1,
                    "10.244.0.3:40000",
                    "10.244.0.4:8080",
                    Direction::Outbound,
                ),
                &a,
                None,
            ),
            place(
                est(2, "10.244.0.4:8080", "10.244.0.3:40000", Direction::Inbound),
                &b,
                None,
            ),
            place(
                est(3, "127.0.0.1:40001", "127.0.0.1:9000", Direction::Outbound),
                &a,
                None,
            ),
            place(
                est(4, "127.0.0.1:9000", "127.0.0.1:40001", Direction::Inbound),
                &b,
                None,
            ),
        ];
        let e = Ends::new(&t);
        assert_eq!(e.other(0), Some(1));
        assert_eq!(e.how(1), Some(PairedBy::AcrossNetns));
        assert_eq!(e.other(2), None, "loopback never crosses namespaces");
        assert_eq!(e.pairs(&t).collect::<Vec<_>>(), [(0, 1)]);
    }

    #[test]
    fn pairs_through_a_dnat_by_the_client_source() {
        let (a, b) = (netns(41, Some("a")), netns(42, Some("b")));
        // The client dialled the ClusterIP 10.96.0.10:80; the server sees the pod address.
        let t = vec![
            place(
                est(1, "10.244.0.3:40000", "10.96.0.10:80", Direction::Outbound),
                &a,
                None,
            ),
            place(
                est(2, "10.244.0.4:8080", "10.244.0.3:40000", Direction::Inbound),
                &b,
                None,
            ),
        ];
        let e = Ends::new(&t);
        assert_eq!(e.other(0), Some(1));
        assert_eq!(e.how(0), Some(PairedBy::Dnat));
    }

    /// A Service that masquerades: the server sees the node's address, not the client's; the
    /// translation conntrack keeps pairs them, and only it.
    #[test]
    fn pairs_a_masqueraded_service_by_conntrack() {
        let (a, b) = (netns(41, Some("a")), netns(42, Some("b")));
        let t = vec![
            place(
                est(1, "10.244.0.3:40000", "10.96.0.10:80", Direction::Outbound),
                &a,
                None,
            ),
            place(
                est(2, "10.244.0.4:8080", "10.244.0.1:61000", Direction::Inbound),
                &b,
                None,
            ),
        ];
        assert_eq!(Ends::new(&t).other(0), None);
        let text = "ipv4     2 tcp      6 431999 ESTABLISHED src=10.244.0.3 dst=10.96.0.10 sport=40000 dport=80 src=10.244.0.4 dst=10.244.0.1 sport=8080 dport=61000 [ASSURED] mark=0 zone=0 use=2\n\
                    ipv4     2 udp      17 20 src=10.0.0.1 dst=10.0.0.2 sport=53 dport=53 src=10.0.0.2 dst=10.0.0.1 sport=53 dport=53 mark=0 use=2\n\
                    ipv4     2 tcp      6 20 ESTABLISHED src=1.1.1.1 dst=2.2.2.2 sport=1 dport=2 src=2.2.2.2 dst=1.1.1.1 sport=2 dport=1 mark=0 use=2\n\
                    garbage line\n";
        let nat = parse_conntrack(text);
        assert_eq!(nat.len(), 1, "only translated TCP entries: {nat:?}");
        let asked = std::cell::Cell::new(0);
        let e = Ends::with_nat(&t, &|| {
            asked.set(asked.get() + 1);
            nat.clone()
        });
        assert_eq!(e.other(0), Some(1));
        assert_eq!(e.how(1), Some(PairedBy::Conntrack));
        assert_eq!(asked.get(), 1);
        // Nothing left to match: conntrack is not read.
        let _ = Ends::with_nat(&t[..1], &|| panic!("read for one socket"));
    }

    #[test]
    fn never_pairs_on_a_guess() {
        let (a, b, c) = (
            netns(41, Some("a")),
            netns(42, Some("b")),
            netns(43, Some("c")),
        );
        // Two servers in two namespaces see the same client source: ambiguous.
        let t = vec![
            place(
                est(1, "10.244.0.3:40000", "10.96.0.10:80", Direction::Outbound),
                &a,
                None,
            ),
            place(
                est(2, "10.244.0.4:8080", "10.244.0.3:40000", Direction::Inbound),
                &b,
                None,
            ),
            place(
                est(3, "10.244.0.5:8080", "10.244.0.3:40000", Direction::Inbound),
                &c,
                None,
            ),
        ];
        let e = Ends::new(&t);
        assert!((0..3).all(|i| e.other(i).is_none()));
        assert!((0..3).all(|i| e.ambiguous(i)));
        // The reversed tuple in two other namespaces: ambiguous too.
        let t = vec![
            place(
                est(1, "10.0.0.2:40000", "10.0.0.1:80", Direction::Outbound),
                &a,
                None,
            ),
            place(
                est(2, "10.0.0.1:80", "10.0.0.2:40000", Direction::Inbound),
                &b,
                None,
            ),
            place(
                est(3, "10.0.0.1:80", "10.0.0.2:40000", Direction::Inbound),
                &c,
                None,
            ),
        ];
        let e = Ends::new(&t);
        assert_eq!(e.other(0), None);
        assert!(e.ambiguous(0));
    }

    #[test]
    fn same_namespace_wins_over_another() {
        let (a, b) = (netns(41, Some("a")), netns(42, Some("b")));
        let t = vec![
            place(
                est(1, "10.0.0.2:40000", "10.0.0.1:80", Direction::Outbound),
                &a,
                None,
            ),
            place(
                est(2, "10.0.0.1:80", "10.0.0.2:40000", Direction::Inbound),
                &a,
                None,
            ),
            place(
                est(3, "10.0.0.1:80", "10.0.0.2:40000", Direction::Inbound),
                &b,
                None,
            ),
        ];
        let e = Ends::new(&t);
        assert_eq!(e.other(0), Some(1));
        assert_eq!(e.how(0), Some(PairedBy::SameNetns));
        assert_eq!(e.other(2), None);
    }
}
