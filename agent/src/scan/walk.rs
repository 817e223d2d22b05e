//! Which namespaces a scan walks whole, and what it carries between walks (plain data, no
//! kernel access).
//!
//! A walk of a namespace is an `iter/tcp` dump inside it. The kernel keeps one TCP hash for
//! every namespace (unless `net.ipv4.tcp_child_ehash_entries` gave one its own), so each walk
//! visits every socket of the host to skip the other namespaces': walking every namespace on
//! every scan costs namespaces × all sockets. So the daemon walks each namespace other than its
//! own once per `every` scans (spread over the scans by inode). In between, the sweep over the
//! state table (`Kernel::sweep`: one pass over the sockets the tracker knows, every
//! namespace's at once) reads that namespace's full sockets fresh, held or not; what only a
//! walk sees is carried from its last walk, aged (`carried_between`): its TIME_WAIT and
//! request (NEW_SYN_RECV) sockets, which are not full sockets and never in the table, and full
//! sockets the table had no room for. A walk also gives the table a record of each full
//! socket it lacks (one that predates the tracker), so the sweep sees it from then on.
//!
//! A namespace whose walk is due, its own included on every scan, is still only walked when
//! the walk would read something the sweep does not (`quiet::judge`, from the kernel's socket
//! counts): otherwise the sweep reads it, and what its last walk read that the sweep cannot is
//! carried. So the own namespace stays fresh on every scan.
use std::{collections::HashMap, ops::RangeInclusive};

use connreap_ebpf::{sock_flags, tcp_state, SockRecord};

/// What was kept of a namespace's last walk.
#[derive(Debug, Clone, Default)]
pub struct Walked {
    /// Its ephemeral port range, read inside it (None: unreadable, the host's is used).
    pub ephemeral: Option<RangeInclusive<u16>>,
    /// Its keepalive sysctls, read inside it.
    pub keepalive: Option<crate::table::Keepalive>,
    /// When that walk's scan began (CLOCK_MONOTONIC ns).
    pub at_ns: u64,
    /// Its records the sweep cannot read (see [`carried_between`]).
    pub unheld: Vec<SockRecord>,
    /// The tracker's count of TCP state transitions (the host's) when that walk's scan began,
    /// if read: while it stays, no timewait socket has been made since (see `quiet::judge`).
    pub transitions: Option<u64>,
}

/// Which scans walk which namespaces, and the last walk of each.
#[derive(Debug, Default)]
pub struct Walks {
    /// Walk a namespace other than the own once per this many scans (≤ 1: every scan).
    pub every: u64,
    /// Scans begun.
    pub scans: u64,
    walked: HashMap<u32, Walked>,
}

impl Walks {
    pub fn new(every: u64) -> Self {
        Walks {
            every: every.max(1),
            ..Walks::default()
        }
    }

    /// Whether this scan's turn to walk namespace `inode` has come (for the own namespace,
    /// whose turn is every scan: whether its carried untracked sockets are due a re-read). A
    /// namespace never walked is due now; `forced` ones too.
    pub fn due(&self, inode: u32, forced: &[u32]) -> bool {
        self.every <= 1
            || forced.contains(&inode)
            || !self.walked.contains_key(&inode)
            || (self.scans + u64::from(inode)).is_multiple_of(self.every)
    }

    /// Whether this scan's pass over processes' files looks for namespaces discovery cannot
    /// find (see `hidden`) even when it has no other reason to read other namespaces'
    /// sockets: on the first scan, then once per walk period.
    pub fn look_due(&self) -> bool {
        self.scans
            .saturating_sub(1)
            .is_multiple_of(self.every.max(1))
    }

    /// The last walk of `inode`, if it is known.
    pub fn last(&self, inode: u32) -> Option<&Walked> {
        self.walked.get(&inode)
    }

    /// Record this scan's walk of `inode`.
    pub fn record(&mut self, inode: u32, walk: Walked) {
        self.walked.insert(inode, walk);
    }

    /// Forget namespaces that are gone (not in `alive`).
    pub fn retain(&mut self, alive: impl Fn(u32) -> bool) {
        self.walked.retain(|inode, _| alive(*inode));
    }

    /// Namespaces remembered.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.walked.len()
    }
}

/// Whether a walk's record is one the scans until the next walk carry: one the sweep cannot
/// read, a timewait or request socket (not a full socket) or a full socket the state table had
/// no room for.
pub fn carried_between(r: &SockRecord) -> bool {
    r.flags & sock_flags::FULL == 0 || r.flags & sock_flags::UNTRACKED != 0
}

/// Whether a walk's record is a full socket the state table had no room for.
pub fn untracked(r: &SockRecord) -> bool {
    r.flags & sock_flags::FULL != 0 && r.flags & sock_flags::UNTRACKED != 0
}

/// What one sweep read of a namespace: its tracked sockets and its listeners' request sockets.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Swept {
    pub sockets: u64,
    pub requests: u64,
}

impl Swept {
    pub fn add(&mut self, r: &connreap_ebpf::SweepRecord) {
        self.sockets += 1;
        self.requests += u64::from(r.requests);
    }

    /// Count a walk's record as the sweep would have read it: a tracked full socket, or a
    /// request socket (the sweep counts them on their listener).
    pub fn add_walked(&mut self, r: &SockRecord) {
        if r.flags & sock_flags::FULL != 0 {
            self.sockets += u64::from(r.flags & sock_flags::UNTRACKED == 0);
        } else if r.state == TCP_SYN_RECV {
            self.requests += 1;
        }
    }
}

/// `TCP_SYN_RECV`: how a walk shows a request socket.
pub(super) const TCP_SYN_RECV: u8 = tcp_state::SYN_RECV;

/// A record read `elapsed_jiffies` ago as it would read now, as far as it can be known: its
/// time in state and idle times grow by that much (a timewait socket's entry stamp is a clock
/// value and stays).
pub fn aged(r: &SockRecord, elapsed_jiffies: u64) -> SockRecord {
    let mut out = *r;
    if r.flags & sock_flags::SINCE_KNOWN != 0 {
        out.state_age_jiffies = r.state_age_jiffies.saturating_add(elapsed_jiffies);
    }
    if r.flags & sock_flags::FULL != 0 {
        let e = u32::try_from(elapsed_jiffies).unwrap_or(u32::MAX);
        out.last_rcv_jiffies = r.last_rcv_jiffies.saturating_add(e);
        out.last_snd_jiffies = r.last_snd_jiffies.saturating_add(e);
        out.last_ack_jiffies = r.last_ack_jiffies.saturating_add(e);
    }
    out
}

/// Jiffies in `ns` nanoseconds at `hz` ticks per second.
pub fn jiffies(ns: u64, hz: u32) -> u64 {
    (u128::from(ns) * u128::from(hz) / 1_000_000_000) as u64
}

/// The rows a namespace's last walk carries to a scan between walks: its records the sweep
/// cannot read, aged by the time since, except those `swept_now` (a socket the table has a
/// record of since, whose fresh record the scan has).
pub fn carried<'a>(
    last: &'a Walked,
    swept_now: impl Fn(u64) -> bool + 'a,
    now_ns: u64,
    hz: u32,
) -> impl Iterator<Item = SockRecord> + 'a {
    let elapsed = jiffies(now_ns.saturating_sub(last.at_ns), hz);
    last.unheld
        .iter()
        .filter(move |r| !swept_now(r.skaddr))
        .map(move |r| aged(r, elapsed))
}

/// How many scans apart a namespace is walked, for a walk interval and a scan interval (0: on
/// every scan).
pub fn every(walk: std::time::Duration, scan: std::time::Duration) -> u64 {
    if walk.is_zero() || scan.is_zero() {
        return 1;
    }
    walk.as_nanos().div_ceil(scan.as_nanos()).max(1) as u64
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scan::timewait;
    use std::time::Duration;

    fn rec(skaddr: u64, inode: u64, flags: u8) -> SockRecord {
        SockRecord {
            skaddr,
            inode,
            flags,
            state_age_jiffies: 100,
            last_rcv_jiffies: 10,
            last_snd_jiffies: 20,
            last_ack_jiffies: 30,
            ..SockRecord::default()
        }
    }

    #[test]
    fn each_namespace_is_walked_once_per_period_and_new_ones_at_once() {
        let mut w = Walks::new(4);
        // Never walked: due on any scan.
        assert!(w.due(7, &[]));
        w.record(7, Walked::default());
        let mut walked_on = Vec::new();
        for scan in 1..=12 {
            w.scans = scan;
            if w.due(7, &[]) {
                walked_on.push(scan);
            }
        }
        assert_eq!(walked_on, vec![1, 5, 9], "once every 4 scans");
        // Spread: another inode falls on other scans.
        w.record(8, Walked::default());
        w.scans = 1;
        assert!(!w.due(8, &[]));
        assert!(w.due(8, &[8]), "forced");
        assert!(Walks::new(0).due(8, &[]) && Walks::new(1).due(8, &[]));
    }

    #[test]
    fn hidden_namespaces_are_looked_for_on_the_first_scan_and_once_per_period() {
        let mut w = Walks::new(4);
        let looked: Vec<u64> = (1..=9)
            .filter(|&scan| {
                w.scans = scan;
                w.look_due()
            })
            .collect();
        assert_eq!(looked, vec![1, 5, 9]);
        let mut every = Walks::new(1);
        every.scans = 7;
        assert!(every.look_due());
    }

    #[test]
    fn gone_namespaces_are_forgotten() {
        let mut w = Walks::new(3);
        w.record(1, Walked::default());
        w.record(2, Walked::default());
        w.retain(|i| i == 2);
        assert_eq!(w.len(), 1);
        assert!(w.last(1).is_none() && w.last(2).is_some());
    }

    #[test]
    fn ageing_adds_the_elapsed_time_to_what_is_known() {
        let full = aged(&rec(1, 0, sock_flags::FULL | sock_flags::SINCE_KNOWN), 50);
        assert_eq!(full.state_age_jiffies, 150);
        assert_eq!(
            (
                full.last_rcv_jiffies,
                full.last_snd_jiffies,
                full.last_ack_jiffies
            ),
            (60, 70, 80)
        );
        // A mini socket: neither age nor idle times are known; nothing changes.
        let mini = rec(2, 0, sock_flags::TW_ENTRY);
        assert_eq!(aged(&mini, 50), mini);
        assert_eq!(jiffies(2_000_000_000, 250), 500);
    }

    #[test]
    fn a_walk_counts_what_the_sweep_would_read() {
        let mut s = Swept::default();
        s.add_walked(&rec(1, 9, sock_flags::FULL | sock_flags::SINCE_KNOWN));
        s.add_walked(&rec(2, 0, sock_flags::FULL | sock_flags::UNTRACKED));
        s.add_walked(&rec(3, 0, sock_flags::TW_ENTRY));
        let request = SockRecord {
            state: TCP_SYN_RECV,
            ..rec(4, 0, 0)
        };
        s.add_walked(&request);
        assert_eq!(
            s,
            Swept {
                sockets: 1,
                requests: 1
            }
        );
        assert!(
            !timewait::is_timewait(&request)
                && timewait::is_timewait(&rec(3, 0, sock_flags::TW_ENTRY))
        );
    }

    #[test]
    fn only_what_the_sweep_cannot_read_is_carried() {
        // Timewait and request sockets: not full sockets.
        assert!(carried_between(&rec(1, 0, sock_flags::TW_ENTRY)));
        assert!(carried_between(&rec(1, 0, 0)));
        // Full sockets the table tracks, held or not (orphans, not yet accepted): swept.
        assert!(!carried_between(&rec(1, 0, sock_flags::FULL)));
        assert!(!carried_between(&rec(
            1,
            9,
            sock_flags::FULL | sock_flags::SINCE_KNOWN
        )));
        // A full socket its set had no room for, held or not.
        assert!(carried_between(&rec(
            1,
            9,
            sock_flags::FULL | sock_flags::UNTRACKED
        )));
        assert!(carried_between(&rec(
            1,
            0,
            sock_flags::FULL | sock_flags::UNTRACKED
        )));
    }

    #[test]
    fn carried_rows_are_the_unheld_not_held_now_aged() {
        let last = Walked {
            at_ns: 1_000_000_000,
            // 3 was untracked at the walk and is swept now; 4 is a TIME_WAIT.
            unheld: vec![
                rec(3, 0, sock_flags::FULL | sock_flags::UNTRACKED),
                rec(4, 0, sock_flags::SINCE_KNOWN),
            ],
            ..Walked::default()
        };
        let rows: Vec<SockRecord> = carried(&last, |a| a == 3, 3_000_000_000, 100).collect();
        assert_eq!(rows.len(), 1);
        assert_eq!(rows[0].skaddr, 4);
        // 2 s at HZ=100: 200 jiffies older.
        assert_eq!(rows[0].state_age_jiffies, 300);
    }

    #[test]
    fn walk_period_in_scans() {
        let s = Duration::from_secs;
        assert_eq!(every(s(60), s(5)), 12);
        assert_eq!(every(s(7), s(5)), 2);
        assert_eq!(every(s(1), s(5)), 1);
        assert_eq!(every(Duration::ZERO, s(5)), 1);
    }
}
