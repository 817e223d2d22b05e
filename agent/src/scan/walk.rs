//! Which namespaces a scan walks whole, and what it carries between walks (plain data, no
//! kernel access).
//!
//! A walk of a namespace is an `iter/tcp` dump inside it. The kernel keeps one TCP hash for
//! every namespace (unless `net.ipv4.tcp_child_ehash_entries` gave one its own), so each walk
//! visits every socket of the host to skip the other namespaces': walking every namespace on
//! every scan costs namespaces × all sockets. So the daemon walks its own namespace on every
//! scan and each other namespace once per `every` scans (spread over the scans by inode); in
//! between, that namespace's sockets held by a process are read by the owner dump, which then
//! also reads the sockets of other namespaces than connreap's in its pass over all processes'
//! files (`Kernel::for_each_owner_and_elsewhere`), and the ones no process holds (TIME_WAIT,
//! SYN_RECV, orphaned, not yet accepted: inode 0) are carried from its last walk, aged.
//! Reading them costs the owner dump about half again its time, more than a few walks: where
//! walking the namespaces between their walks would cost less (measured times), the scan walks
//! them all.
use std::{collections::HashMap, ops::RangeInclusive};

use connreap_ebpf::{sock_flags, SockRecord};

/// What was kept of a namespace's last walk.
#[derive(Debug, Clone, Default)]
pub struct Walked {
    /// Its ephemeral port range, read inside it (None: unreadable, the host's is used).
    pub ephemeral: Option<RangeInclusive<u16>>,
    /// Its keepalive sysctls, read inside it.
    pub keepalive: Option<crate::table::Keepalive>,
    /// When that walk's scan began (CLOCK_MONOTONIC ns).
    pub at_ns: u64,
    /// Its sockets no process held then.
    pub unheld: Vec<SockRecord>,
}

/// Which scans walk which namespaces, and the last walk of each.
#[derive(Debug, Default)]
pub struct Walks {
    /// Walk a namespace other than the own once per this many scans (≤ 1: every scan).
    pub every: u64,
    /// Scans begun.
    pub scans: u64,
    walked: HashMap<u32, Walked>,
    /// Smoothed kernel times, in ns: one walk of a namespace other than the own; the plain
    /// owner dump; and what reading the other namespaces' sockets adds to the owner dump.
    walk_ns: Option<f64>,
    owner_ns: Option<f64>,
    elsewhere_ns: Option<f64>,
}

/// Weight of a new measurement in the smoothed times.
const ALPHA: f64 = 0.3;

fn smooth(old: Option<f64>, new: f64) -> Option<f64> {
    Some(old.map_or(new, |o| o + ALPHA * (new - o)))
}

impl Walks {
    pub fn new(every: u64) -> Self {
        Walks {
            every: every.max(1),
            ..Walks::default()
        }
    }

    /// `n` walks of namespaces other than the own took `total` in the kernel.
    pub fn observe_walks(&mut self, n: usize, total: std::time::Duration) {
        if n > 0 {
            self.walk_ns = smooth(self.walk_ns, total.as_nanos() as f64 / n as f64);
        }
    }

    /// The plain owner dump took `d` in the kernel.
    pub fn observe_owner(&mut self, d: std::time::Duration) {
        self.owner_ns = smooth(self.owner_ns, d.as_nanos() as f64);
    }

    /// The owner dump that also read the other namespaces' sockets took `d` in the kernel.
    /// What reading them added is `d` less the plain dump's time (known from the first scan,
    /// which walks every namespace it finds).
    pub fn observe_owner_and_elsewhere(&mut self, d: std::time::Duration) {
        let added = d.as_nanos() as f64 - self.owner_ns.unwrap_or(0.0);
        self.elsewhere_ns = smooth(self.elsewhere_ns, added.max(0.0));
    }

    /// Whether walking all `between` namespaces costs no more than reading their sockets in
    /// the owner dump would add to it: each walk passes over every socket of the host, but
    /// skipping another namespace's socket is several times cheaper than reading a process's
    /// socket file (measure 7 of `cargo xtask bench`), so with a few namespaces walking them is
    /// cheaper. From the times measured so far; before the owner dump read them once, half the
    /// plain dump's time stands in for what reading them adds.
    pub fn walk_all_cheaper(&self, between: usize) -> bool {
        let Some(walk) = self.walk_ns else {
            return false;
        };
        let Some(added) = self.elsewhere_ns.or(self.owner_ns.map(|o| o * 0.5)) else {
            return false;
        };
        between as f64 * walk <= added
    }

    /// Whether this scan walks namespace `inode` (not the own: that one is always walked).
    /// A namespace never walked is walked now; `forced` ones too.
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

/// Whether a walk's record is one only a walk sees: no process holds the socket (no file, so
/// no inode: timewait and request sockets, orphans, connections not yet accepted).
pub fn unheld(r: &SockRecord) -> bool {
    r.inode == 0
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

/// The rows a namespace's last walk carries to a scan between walks: the sockets no process
/// held then, aged by the time since, except those `held_now` (a connection accepted since,
/// whose fresh record the scan has).
pub fn carried<'a>(
    last: &'a Walked,
    held_now: impl Fn(u64) -> bool + 'a,
    now_ns: u64,
    hz: u32,
) -> impl Iterator<Item = SockRecord> + 'a {
    let elapsed = jiffies(now_ns.saturating_sub(last.at_ns), hz);
    last.unheld
        .iter()
        .filter(move |r| !held_now(r.skaddr))
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

    #[test]
    fn carried_rows_are_the_unheld_not_held_now_aged() {
        let last = Walked {
            at_ns: 1_000_000_000,
            // 3 was not yet accepted at the walk and is held now; 4 is a TIME_WAIT.
            unheld: vec![
                rec(3, 0, sock_flags::FULL),
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
    fn all_between_namespaces_are_walked_when_that_is_cheaper_than_the_pass() {
        let ms = Duration::from_millis;
        let mut w = Walks::new(12);
        // Nothing measured yet: no walk-time estimate, use the pass.
        assert!(!w.walk_all_cheaper(1));
        w.observe_walks(2, ms(20));
        // Reading the namespaces in the owner dump is not measured yet either: half the plain
        // dump's time stands in.
        w.observe_owner(ms(180));
        assert!(
            w.walk_all_cheaper(1),
            "one walk of 10 ms vs ~90 ms more for the owner dump"
        );
        assert!(w.walk_all_cheaper(9));
        assert!(!w.walk_all_cheaper(10));
        // It added 40 ms (220 against 180).
        w.observe_owner_and_elsewhere(ms(220));
        assert!(w.walk_all_cheaper(4) && !w.walk_all_cheaper(5));
        // A dump quicker than the plain one's smoothed time added nothing, not less: 40 ms
        // smoothed towards 0 is 28 ms.
        w.observe_owner_and_elsewhere(ms(100));
        assert!(w.walk_all_cheaper(2) && !w.walk_all_cheaper(3));
        // Smoothed, not replaced: one slow walk does not flip the choice at once.
        w.observe_walks(1, ms(60));
        assert!(w.walk_all_cheaper(1));
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
