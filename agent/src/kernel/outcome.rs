//! Outcomes of outbound connections, from the tracker's transitions (no probe of their own):
//! an active open (CLOSE -> SYN_SENT, seen in the connecting task, so it names the process) is
//! remembered by socket address until the connection's fate shows in a later transition of
//! the same socket, which mostly runs in softirq context and names nobody.
//!
//! - SYN_SENT -> CLOSE: the connect failed; `refused` when it took less than a second (a RST
//!   or an ICMP error answered the SYN), `timeout` otherwise (no answer: SYN retransmits ran
//!   out, or the application gave up).
//! - ESTABLISHED -> CLOSE within the short lifetime: `reset` (the peer's RST).
//! - ESTABLISHED -> CLOSE_WAIT within the short lifetime, then CLOSE_WAIT -> CLOSE: `closed`
//!   (the peer closed first at once and reset what was sent to it: a server that accepts and
//!   closes without reading). A peer FIN followed by this side's own close (CLOSE_WAIT ->
//!   LAST_ACK) is how a fast server ends an HTTP `Connection: close` exchange: a success.
//! - Anything else that got ESTABLISHED: `success` (it lived past the short lifetime, or this
//!   side closed first).
use std::{net::SocketAddr, time::Instant};

use connreap_ebpf::{tcp_state, TransitionEvent, AF_INET};
use rustc_hash::FxHashMap;

/// What became of one outbound connection attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Outcome {
    Success,
    Refused,
    Timeout,
    Reset,
    Closed,
}

impl Outcome {
    pub const ALL: [Outcome; 5] = [
        Outcome::Success,
        Outcome::Refused,
        Outcome::Timeout,
        Outcome::Reset,
        Outcome::Closed,
    ];
    /// The failure kinds, in the order summaries list them.
    pub const FAILURES: [Outcome; 4] = [
        Outcome::Refused,
        Outcome::Timeout,
        Outcome::Reset,
        Outcome::Closed,
    ];
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Success => "success",
            Outcome::Refused => "refused",
            Outcome::Timeout => "timeout",
            Outcome::Reset => "reset",
            Outcome::Closed => "closed",
        }
    }
    fn index(self) -> usize {
        self as usize
    }
}

/// An attempt's target as the events give it: (pid, connecting thread's comm bytes, netns
/// inode, remote address).
pub type RawTarget = (u32, [u8; 16], u32, SocketAddr);

/// At most this many start times of failed attempts are kept per target and drain (enough to
/// tell a retry interval).
pub const MAX_TIMES: usize = 64;

/// Attempts to one target, by outcome.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Attempts {
    counts: [u64; 5],
    /// When failed attempts started (their connect), ms on the kernel's jiffies clock, at
    /// most [`MAX_TIMES`].
    pub failed_at_ms: Vec<u64>,
    /// The longest life of a connection counted `reset` or `closed`, ms.
    pub max_short_life_ms: u64,
}

impl Attempts {
    pub fn get(&self, o: Outcome) -> u64 {
        self.counts[o.index()]
    }
    pub fn failures(&self) -> u64 {
        Outcome::FAILURES.iter().map(|o| self.get(*o)).sum()
    }
    pub fn total(&self) -> u64 {
        self.counts.iter().sum()
    }
    pub fn add(&mut self, o: Outcome, n: u64) {
        self.counts[o.index()] += n;
    }
    /// `other`'s attempts added to these.
    pub fn merge(&mut self, other: &Attempts) {
        for (a, b) in self.counts.iter_mut().zip(other.counts) {
            *a += b;
        }
        let room = MAX_TIMES.saturating_sub(self.failed_at_ms.len());
        self.failed_at_ms
            .extend(other.failed_at_ms.iter().take(room).copied());
        self.max_short_life_ms = self.max_short_life_ms.max(other.max_short_life_ms);
    }
}

/// Connections followed at most at once: beyond, new attempts are not followed (a host
/// opening this many connections at once is told by reconnect_storm).
const MAX_PENDING: usize = 1 << 16;
/// An attempt whose end was never seen (its events lost) is forgotten after this long.
const PENDING_TTL: std::time::Duration = std::time::Duration::from_secs(300);

#[derive(Debug, Clone)]
struct Pending {
    target: RawTarget,
    connect_j: u64,
    established_j: Option<u64>,
    /// The peer's FIN came within the short lifetime (ESTABLISHED -> CLOSE_WAIT), after this
    /// long (jiffies): the end of the connection tells success from failure.
    peer_fin_life_j: Option<u64>,
    /// When the drain that saw its last transition ran.
    seen: Instant,
}

/// An attempt in flight: its socket's address and its remote end. The remote end is in the
/// key because a socket's memory is reused at once: a refused connect freed on one CPU and
/// the next connect, to another node, in the same memory on another may reach the reader in
/// the other order (each CPU's batch is sent on its own), and the first one's end must not
/// end the second attempt. The local port is not in it: `connect` picks it after the
/// transition to SYN_SENT.
type AttemptKey = (u64, SocketAddr);

/// The attempts in flight, by [`AttemptKey`].
#[derive(Debug)]
pub struct Outcomes {
    pending: FxHashMap<AttemptKey, Pending>,
    hz: u64,
    /// The short lifetime, in jiffies (at least one).
    short_j: u64,
    short: std::time::Duration,
}

/// Attempts that ended, by target.
pub type Tally = FxHashMap<RawTarget, Attempts>;

impl Outcomes {
    /// `hz`: the jiffies clock's rate; a connection that lives less than `short` and ends by
    /// the peer's RST or FIN is a failure.
    pub fn new(hz: u32, short: std::time::Duration) -> Self {
        let hz = u64::from(hz.max(1));
        let short_j = ((short.as_micros() as u64).saturating_mul(hz) / 1_000_000).max(1);
        Outcomes {
            pending: FxHashMap::default(),
            hz,
            short_j,
            short,
        }
    }

    fn ms(&self, j: u64) -> u64 {
        j.saturating_mul(1000) / self.hz
    }

    /// One transition, in the order the socket went through them.
    pub fn observe(&mut self, ev: &TransitionEvent, now: Instant, out: &mut Tally) {
        if ev.oldstate == tcp_state::CLOSE && ev.newstate == tcp_state::SYN_SENT {
            if ev.pid == 0 || self.pending.len() >= MAX_PENDING {
                return;
            }
            let peer = remote(ev);
            let target = (ev.pid, ev.comm, ev.netns, peer);
            let p = Pending {
                target,
                connect_j: ev.ts_jiffies,
                established_j: None,
                peer_fin_life_j: None,
                seen: now,
            };
            self.pending.insert((ev.skaddr, peer), p);
            return;
        }
        let key = (ev.skaddr, remote(ev));
        let Some(p) = self.pending.get_mut(&key) else {
            return;
        };
        let mut life_j = None;
        let outcome = match (ev.oldstate, ev.newstate, p.established_j) {
            (tcp_state::SYN_SENT, tcp_state::ESTABLISHED, None) => {
                p.established_j = Some(ev.ts_jiffies);
                p.seen = now;
                return;
            }
            (tcp_state::SYN_SENT, _, None) => {
                if ev.ts_jiffies.saturating_sub(p.connect_j) >= self.hz {
                    Outcome::Timeout
                } else {
                    Outcome::Refused
                }
            }
            (tcp_state::ESTABLISHED, new, Some(at)) => {
                let life = ev.ts_jiffies.saturating_sub(at);
                life_j = Some(life);
                match new {
                    _ if life >= self.short_j => Outcome::Success,
                    tcp_state::CLOSE => Outcome::Reset,
                    tcp_state::CLOSE_WAIT => {
                        p.peer_fin_life_j = Some(life);
                        p.seen = now;
                        return;
                    }
                    _ => Outcome::Success,
                }
            }
            (tcp_state::CLOSE_WAIT, new, Some(_)) => {
                life_j = p.peer_fin_life_j;
                if new == tcp_state::CLOSE {
                    Outcome::Closed
                } else {
                    Outcome::Success
                }
            }
            _ => return,
        };
        let Some(p) = self.pending.remove(&key) else {
            return;
        };
        self.record(p, outcome, life_j.map(|j| self.ms(j)), out);
    }

    fn record(&self, p: Pending, o: Outcome, life_ms: Option<u64>, out: &mut Tally) {
        let a = out.entry(p.target).or_default();
        a.add(o, 1);
        if o != Outcome::Success {
            if a.failed_at_ms.len() < MAX_TIMES {
                a.failed_at_ms.push(self.ms(p.connect_j));
            }
            if matches!(o, Outcome::Reset | Outcome::Closed) {
                a.max_short_life_ms = a.max_short_life_ms.max(life_ms.unwrap_or(0));
            }
        }
    }

    /// After a drain: connections established more than the short lifetime plus a second
    /// ago are successes; attempts whose end was never seen are forgotten. The clock is the
    /// drain's, not the events': one CPU's batch may arrive with later transitions than
    /// another's that is not sent yet (up to a flush tick), so the latest transition seen
    /// does not say that a socket's end would have been seen by now.
    pub fn settle(&mut self, now: Instant, out: &mut Tally) {
        let by_clock = self.short + std::time::Duration::from_secs(1);
        let mut done = Vec::new();
        self.pending
            .retain(|sk, p| match (p.established_j, p.peer_fin_life_j) {
                // Closed by the peer at once, and this side has not closed yet: wait for its end.
                (Some(_), Some(_)) => now.duration_since(p.seen) < PENDING_TTL,
                (Some(_), None) if now.duration_since(p.seen) >= by_clock => {
                    done.push((*sk, p.clone()));
                    false
                }
                _ => now.duration_since(p.seen) < PENDING_TTL,
            });
        for (_, p) in done {
            self.record(p, Outcome::Success, None, out);
        }
    }

    /// Attempts followed now.
    #[cfg(test)]
    fn in_flight(&self) -> usize {
        self.pending.len()
    }
}

/// The remote end of the event's socket; an IPv4-mapped IPv6 address as the IPv4 one.
fn remote(ev: &TransitionEvent) -> SocketAddr {
    let d = ev.daddr;
    let ip = if ev.family == AF_INET {
        std::net::IpAddr::from([d[0], d[1], d[2], d[3]])
    } else {
        std::net::Ipv6Addr::from(d).to_canonical()
    };
    SocketAddr::new(ip, ev.dport)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    const HZ: u32 = 250;

    fn ev(sk: u64, old: u8, new: u8, ms: u64, host: u8) -> TransitionEvent {
        let mut daddr = [0u8; 16];
        daddr[..4].copy_from_slice(&[10, 0, 0, host]);
        let mut comm = [0u8; 16];
        comm[..4].copy_from_slice(b"node");
        TransitionEvent {
            ts_jiffies: 1_000_000 + ms * u64::from(HZ) / 1000,
            skaddr: sk,
            daddr,
            family: AF_INET,
            dport: 8080,
            oldstate: old,
            newstate: new,
            pid: if old == tcp_state::CLOSE { 42 } else { 0 },
            comm: if old == tcp_state::CLOSE {
                comm
            } else {
                [0; 16]
            },
            netns: 7,
            ..Default::default()
        }
    }

    fn run(events: &[TransitionEvent]) -> (Tally, Outcomes) {
        let mut o = Outcomes::new(HZ, Duration::from_millis(50));
        let mut t = Tally::default();
        let now = Instant::now();
        for e in events {
            o.observe(e, now, &mut t);
        }
        o.settle(now, &mut t);
        (t, o)
    }

    fn of(t: &Tally, host: u8) -> Attempts {
        let mut comm = [0u8; 16];
        comm[..4].copy_from_slice(b"node");
        let addr: SocketAddr = format!("10.0.0.{host}:8080").parse().unwrap();
        t.get(&(42, comm, 7, addr)).cloned().unwrap_or_default()
    }

    use tcp_state::{CLOSE, CLOSE_WAIT, ESTABLISHED, FIN_WAIT1, SYN_SENT};

    #[test]
    fn each_way_of_failing_is_told_apart() {
        let (t, o) = run(&[
            // Refused: RST to the SYN.
            ev(1, CLOSE, SYN_SENT, 0, 3),
            ev(1, SYN_SENT, CLOSE, 1, 3),
            // Accepted then reset at once.
            ev(2, CLOSE, SYN_SENT, 300, 3),
            ev(2, SYN_SENT, ESTABLISHED, 301, 3),
            ev(2, ESTABLISHED, CLOSE, 305, 3),
            // Accepted then closed by the peer at once, which reset the request sent to it.
            ev(3, CLOSE, SYN_SENT, 600, 3),
            ev(3, SYN_SENT, ESTABLISHED, 601, 3),
            ev(3, ESTABLISHED, CLOSE_WAIT, 610, 3),
            ev(3, CLOSE_WAIT, CLOSE, 611, 3),
            // No answer for 3 s.
            ev(4, CLOSE, SYN_SENT, 1000, 4),
            ev(4, SYN_SENT, CLOSE, 4000, 4),
        ]);
        let bad = of(&t, 3);
        assert_eq!(
            [
                Outcome::Refused,
                Outcome::Reset,
                Outcome::Closed,
                Outcome::Success
            ]
            .map(|o| bad.get(o)),
            [1, 1, 1, 0]
        );
        assert_eq!(bad.failed_at_ms, vec![4_000_000, 4_000_300, 4_000_600]);
        assert!(bad.max_short_life_ms <= 12, "{}", bad.max_short_life_ms);
        assert_eq!(of(&t, 4).get(Outcome::Timeout), 1);
        assert_eq!(o.in_flight(), 0);
    }

    #[test]
    fn connections_that_live_or_that_we_close_succeed() {
        let (t, mut o) = run(&[
            // Reset by the peer after a second: served, then ended.
            ev(1, CLOSE, SYN_SENT, 0, 1),
            ev(1, SYN_SENT, ESTABLISHED, 1, 1),
            ev(1, ESTABLISHED, CLOSE, 1000, 1),
            // A fast HTTP answer with Connection: close: the peer's FIN first, then ours.
            ev(6, CLOSE, SYN_SENT, 0, 1),
            ev(6, SYN_SENT, ESTABLISHED, 1, 1),
            ev(6, ESTABLISHED, CLOSE_WAIT, 3, 1),
            ev(6, CLOSE_WAIT, tcp_state::LAST_ACK, 4, 1),
            // Closed by us within a millisecond.
            ev(2, CLOSE, SYN_SENT, 0, 1),
            ev(2, SYN_SENT, ESTABLISHED, 1, 1),
            ev(2, ESTABLISHED, FIN_WAIT1, 2, 1),
            // Still open: a success once the drain's clock is past its short lifetime.
            ev(3, CLOSE, SYN_SENT, 10, 1),
            ev(3, SYN_SENT, ESTABLISHED, 11, 1),
            // An accepted connection (no connect seen) is not an attempt.
            ev(5, tcp_state::SYN_RECV, ESTABLISHED, 5, 9),
            ev(5, ESTABLISHED, CLOSE, 6, 9),
        ]);
        let good = of(&t, 1);
        assert_eq!((good.get(Outcome::Success), good.failures()), (3, 0));
        assert!(good.failed_at_ms.is_empty());
        assert_eq!(of(&t, 9).total(), 0);
        assert_eq!(o.in_flight(), 1, "the open one is not known yet");
        // A later drain, past the short lifetime and a flush tick: it succeeded.
        let mut t = Tally::default();
        o.settle(Instant::now() + Duration::from_secs(2), &mut t);
        assert_eq!((of(&t, 1).get(Outcome::Success), o.in_flight()), (1, 0));
    }

    #[test]
    fn a_reused_socket_whose_old_end_arrives_late_keeps_each_attempt_apart() {
        // A connect to the refusing node 3 is refused on one CPU; its socket's memory is
        // reused at once for a connect to healthy node 1 on another CPU, whose batch reaches
        // the reader first.
        let (t, o) = run(&[
            ev(1, CLOSE, SYN_SENT, 0, 3),
            ev(1, CLOSE, SYN_SENT, 2, 1),
            ev(1, SYN_SENT, CLOSE, 1, 3),
            ev(1, SYN_SENT, ESTABLISHED, 3, 1),
            ev(1, ESTABLISHED, FIN_WAIT1, 5, 1),
        ]);
        assert_eq!((of(&t, 3).get(Outcome::Refused), of(&t, 3).total()), (1, 1));
        assert_eq!((of(&t, 1).get(Outcome::Success), of(&t, 1).total()), (1, 1));
        assert_eq!(o.in_flight(), 0);
    }

    #[test]
    fn ipv4_mapped_peers_are_ipv4() {
        let mut e = ev(1, CLOSE, SYN_SENT, 0, 3);
        e.family = connreap_ebpf::AF_INET6;
        e.daddr = std::net::Ipv6Addr::from([0, 0, 0, 0, 0, 0xffff, 0x0a00, 0x0003]).octets();
        assert_eq!(remote(&e), "10.0.0.3:8080".parse::<SocketAddr>().unwrap());
    }
}
