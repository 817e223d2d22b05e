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
//! the walk would read something the sweep does not (`worth_walking`, judged from the
//! kernel's socket counts): otherwise ("quiet") the sweep reads it, and what its last walk
//! read that the sweep cannot is carried: the full sockets the table had no room for, and the
//! TIME_WAIT sockets still alive (a TIME_WAIT socket lives a fixed 60 s from the kernel's
//! stamp of its entry, 6.13+: `timewait::alive`). So the own namespace stays fresh on every
//! scan: walked whenever the kernel counts a timewait socket not carried, a request socket, or
//! a socket the sweep cannot account for, and what it carries re-read by a walk at least once
//! per `every` scans.
use std::{collections::HashMap, ops::RangeInclusive};

use connreap_ebpf::{sock_flags, tcp_state, SockRecord};

use super::timewait;
use crate::kernel::procfs::SockStat;

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
}

/// What a namespace's last walk leaves for a scan at some time that the sweep cannot read:
/// its untracked full sockets, and its timewait sockets alive then (None: one whose fate is
/// not known, see [`timewait::alive`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Carried {
    pub untracked: u64,
    pub timewait: Option<u64>,
}

impl Carried {
    /// Nothing carried (never read by this rule: a namespace never walked is walked).
    pub const NOTHING: Carried = Carried {
        untracked: 0,
        timewait: Some(0),
    };
}

impl Walked {
    /// What this walk leaves for a scan at `now_ns`.
    pub fn carried_at(&self, now_ns: u64) -> Carried {
        let mut c = Carried::NOTHING;
        for r in &self.unheld {
            if untracked(r) {
                c.untracked += 1;
            } else if timewait::is_timewait(r) {
                c.timewait = match (c.timewait, timewait::alive(r, now_ns)) {
                    (Some(n), Some(true)) => Some(n + 1),
                    (n, Some(false)) => n,
                    (None, _) | (_, None) => None,
                };
            }
        }
        c
    }

    /// What a quiet scan at `now_ns` (a due walk skipped: see [`worth_walking`]) keeps of
    /// `last`, the namespace's last real walk, with this scan's sysctls (`self`): what it
    /// carries (see [`kept_when_quiet`]) and when that was read. Its request sockets are not
    /// kept: the sweep counted none.
    pub fn after_quiet(self, last: &Walked, now_ns: u64) -> Walked {
        Walked {
            at_ns: last.at_ns,
            unheld: last
                .unheld
                .iter()
                .filter(|r| kept_when_quiet(r, now_ns))
                .copied()
                .collect(),
            ..self
        }
    }
}

/// Whether a quiet scan at `now_ns` carries a record of the namespace's last walk: an
/// untracked full socket, or a timewait socket alive then (a quiet scan found the kernel's
/// count of timewait sockets equal to those alive: see [`worth_walking`]).
pub fn kept_when_quiet(r: &SockRecord, now_ns: u64) -> bool {
    untracked(r) || (timewait::is_timewait(r) && timewait::alive(r, now_ns) == Some(true))
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

/// Whether a namespace's walk would read anything the sweep does not, judged from what the
/// kernel counts in it (`stat`, no socket visited) against what the last sweep read of it and
/// what its last walk `carried` now: a timewait socket not carried (or a carried one gone
/// early, or one whose fate is not known), a request socket, or more hashed full sockets than
/// the sweep read and the untracked ones carried (some have no record in the table: they
/// predate the tracker, or their set was full, or they are newer than the sweep). With
/// anything carried, also when fewer are hashed (an untracked one may have closed) and when
/// its re-read is `due`. Unknown counts: walk.
pub fn worth_walking(
    stat: Option<SockStat>,
    swept: Option<&Swept>,
    carried: Carried,
    due: bool,
) -> bool {
    match (stat, swept) {
        (Some(stat), Some(swept)) => {
            let accounted = swept.sockets + carried.untracked;
            let carries = carried.untracked > 0 || stat.tw > 0;
            carried.timewait != Some(stat.tw)
                || swept.requests > 0
                || stat.inuse > accounted
                || (carries && (due || stat.inuse < accounted))
        }
        _ => true,
    }
}

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

    fn carrying(untracked: u64, timewait: Option<u64>) -> Carried {
        Carried {
            untracked,
            timewait,
        }
    }

    #[test]
    fn a_due_walk_is_skipped_only_when_the_sweep_read_everything() {
        let stat = |inuse, tw| Some(SockStat { inuse, tw });
        let swept = |sockets, requests| Swept { sockets, requests };
        let none = Carried::NOTHING;
        let walk = |st, sw, carried, due| worth_walking(st, Some(&sw), carried, due);
        assert!(!walk(stat(1001, 0), swept(1001, 0), none, true));
        // The sweep read more than were hashed then (a socket since closed): nothing missed.
        assert!(!walk(stat(990, 0), swept(1001, 0), none, true));
        assert!(walk(stat(1001, 3), swept(1001, 0), none, true), "timewait");
        assert!(walk(stat(1001, 0), swept(1001, 2), none, true), "requests");
        assert!(walk(stat(1002, 0), swept(1001, 0), none, true), "untracked");
        assert!(
            worth_walking(None, Some(&swept(1, 0)), none, true),
            "no sockstat"
        );
        assert!(worth_walking(stat(0, 0), None, none, true), "never swept");
    }

    #[test]
    fn carried_sockets_are_re_read_when_due_or_when_one_may_have_closed() {
        let stat = |inuse| Some(SockStat { inuse, tw: 0 });
        let swept = Swept {
            sockets: 1000,
            requests: 0,
        };
        let ten = carrying(10, Some(0));
        // 10 untracked carried: 1010 hashed is all accounted for until the re-read is due.
        assert!(!worth_walking(stat(1010), Some(&swept), ten, false));
        assert!(worth_walking(stat(1010), Some(&swept), ten, true), "due");
        assert!(
            worth_walking(stat(1011), Some(&swept), ten, false),
            "a new one"
        );
        assert!(
            worth_walking(stat(1009), Some(&swept), ten, false),
            "one closed: maybe a carried one"
        );
        // Without anything carried, a due turn alone is no reason.
        assert!(!worth_walking(
            stat(1000),
            Some(&swept),
            Carried::NOTHING,
            true
        ));
    }

    #[test]
    fn carried_timewait_sockets_stand_in_while_the_kernel_counts_as_many() {
        let stat = |tw| Some(SockStat { inuse: 1000, tw });
        let swept = Swept {
            sockets: 1000,
            requests: 0,
        };
        let walk = |tw, carried, due| worth_walking(stat(tw), Some(&swept), carried, due);
        assert!(!walk(3, carrying(0, Some(3)), false), "the same 3");
        assert!(walk(4, carrying(0, Some(3)), false), "a new one");
        assert!(walk(2, carrying(0, Some(3)), false), "one gone early");
        assert!(walk(3, carrying(0, None), false), "one near its end");
        assert!(walk(3, carrying(0, Some(3)), true), "re-read due");
        // All gone, as predicted: nothing carried, nothing counted.
        assert!(!walk(0, carrying(0, Some(0)), true));
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
    fn a_quiet_scan_keeps_what_it_carries_and_when_that_was_read() {
        let tw = |skaddr, stamp_ms| SockRecord {
            state: tcp_state::TIME_WAIT,
            tw_entry_ms: stamp_ms,
            ..rec(skaddr, 0, sock_flags::TW_ENTRY)
        };
        let request = SockRecord {
            state: TCP_SYN_RECV,
            ..rec(4, 0, 0)
        };
        let last = Walked {
            at_ns: 5,
            unheld: vec![
                rec(1, 0, sock_flags::FULL | sock_flags::UNTRACKED),
                tw(2, 50_000),
                tw(3, 1_000),
                request,
            ],
            ..Walked::default()
        };
        // At 70 s: 2 is alive (20 s old), 3 is gone (69 s old).
        let now = 70_000 * 1_000_000;
        assert_eq!(last.carried_at(now), carrying(1, Some(1)));
        let fresh = Walked {
            at_ns: now,
            ephemeral: Some(1000..=2000),
            ..Walked::default()
        };
        let kept = fresh.after_quiet(&last, now);
        assert_eq!(kept.at_ns, 5);
        let addrs: Vec<u64> = kept.unheld.iter().map(|r| r.skaddr).collect();
        assert_eq!(addrs, vec![1, 2]);
        assert_eq!(kept.ephemeral, Some(1000..=2000));
        // 3 at 61 s: its end not known yet.
        assert_eq!(last.carried_at(62_000 * 1_000_000).timewait, None);
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
