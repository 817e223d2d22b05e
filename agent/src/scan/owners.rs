//! When a daemon scan may reuse the last owner dump instead of walking every process's files
//! again (plain data, no kernel access: the counts are read by the caller).
//!
//! The owner dump (`iter/task_file`) visits every file of every process on the host, which at
//! 100k held sockets is about a quarter of an idle scan's cost. Which process holds which
//! socket changes only when
//! - a socket is created, accepted, or closed: created and closed sockets make a TCP state
//!   transition (counted by the tracker); an accepted one was counted when it was
//!   established, and until its accept it is a row with no owner and no inode, which forces
//!   the next dump (`pending_accept`);
//! - a process is created (it inherits its parent's files) or reaped: the set of processes
//!   listed in /proc changes (a new thread shares its process's files and changes nothing;
//!   forks cannot be counted instead: the daemon's own threads are forks). Such a change
//!   still leaves the owners as they were when every reaped process held none of the last
//!   dump's sockets and every new one has no socket at all among its descriptors
//!   (/proc/PID/fd, read for at most [`MAX_NEW_PROCESSES`] new processes): a cron job, a
//!   shell, an exec'd health check that has not opened its connection yet (when it does, the
//!   transition forces a dump);
//! - a descriptor is duplicated, closed while a duplicate stays open, or passed over a Unix
//!   socket: nothing counts these; the last dump is reused at most `max_reuse` scans in a row
//!   (one walk period), so such a change shows within one `netns_walk_interval`.
//!
//! A re-check before a kill never reuses a dump (`Scanner::scan_walking`), nor does a snapshot.

use crate::table::{Socket, TcpState};

/// What the kernel counted when a dump was taken (or now), to tell whether owners can have
/// changed since.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Counts {
    /// TCP state transitions the tracker has seen (all CPUs).
    pub transitions: u64,
    /// The processes listed in /proc, sorted (`procfs::processes`).
    pub processes: Vec<u32>,
}

/// The last owner dump's counts (or those of the last scan that reused it), and how many
/// scans in a row have reused it.
#[derive(Debug, Clone)]
pub struct Dumped {
    pub at: Counts,
    pub reused: u64,
}

/// Most new processes a scan looks into before it reuses a dump; more than this and it dumps
/// (reading their descriptors would cost about what the dump does).
pub const MAX_NEW_PROCESSES: usize = 64;

/// Whether this scan may reuse the dump `last` (None: there is none, or it cannot be trusted)
/// given the counts `now` (None: a count could not be read), at most `max_reuse` scans in a
/// row, when the last table had a socket waiting to be accepted (`pending_accept`) or not.
/// Across a change of processes: `held(pid)`, whether a process held a socket in the last
/// dump, and `has_sockets(pid)`, whether a new process has any socket (asked only of new
/// processes, at most [`MAX_NEW_PROCESSES`]).
pub fn reusable(
    last: Option<&Dumped>,
    now: Option<&Counts>,
    max_reuse: u64,
    pending_accept: bool,
    held: impl Fn(u32) -> bool,
    mut has_sockets: impl FnMut(u32) -> bool,
) -> bool {
    let (Some(last), Some(now)) = (last, now) else {
        return false;
    };
    if last.at.transitions != now.transitions || last.reused >= max_reuse || pending_accept {
        return false;
    }
    let (gone, new) = changed(&last.at.processes, &now.processes);
    !gone.into_iter().any(held)
        && new.len() <= MAX_NEW_PROCESSES
        && !new.into_iter().any(&mut has_sockets)
}

/// The pids only in `before` (reaped) and those only in `now` (new), both lists sorted.
fn changed(before: &[u32], now: &[u32]) -> (Vec<u32>, Vec<u32>) {
    let (mut gone, mut new) = (Vec::new(), Vec::new());
    let (mut i, mut j) = (0, 0);
    while i < before.len() || j < now.len() {
        match (before.get(i), now.get(j)) {
            (Some(a), Some(b)) if a == b => {
                i += 1;
                j += 1;
            }
            (Some(a), Some(b)) if a < b => {
                gone.push(*a);
                i += 1;
            }
            (Some(a), None) => {
                gone.push(*a);
                i += 1;
            }
            (_, Some(b)) => {
                new.push(*b);
                j += 1;
            }
            (None, None) => break,
        }
    }
    (gone, new)
}

/// Whether a row is a connection waiting in its listener's accept queue: open, not held, and
/// without a file (inode 0). Its accept gives it an owner without any transition. A socket
/// with an inode but no holder (a kernel socket, or one in flight over a Unix socket) does
/// not count: it may stay so for good.
pub fn pending_accept(s: &Socket) -> bool {
    s.owner.is_none()
        && s.inode == 0
        && matches!(
            s.state,
            TcpState::Established | TcpState::CloseWait | TcpState::SynRecv
        )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at() -> Counts {
        Counts {
            transitions: 10,
            processes: vec![1, 5, 9],
        }
    }

    fn dumped(reused: u64) -> Dumped {
        Dumped { at: at(), reused }
    }

    /// `reusable` with no process holding sockets, before or now.
    fn quiet(last: Option<&Dumped>, now: Option<&Counts>, max: u64, pending: bool) -> bool {
        reusable(last, now, max, pending, |_| false, |_| false)
    }

    #[test]
    fn a_dump_is_reused_only_while_nothing_counted_changed() {
        assert!(quiet(Some(&dumped(0)), Some(&at()), 11, false));
        let more = Counts {
            transitions: 11,
            ..at()
        };
        assert!(!quiet(Some(&dumped(0)), Some(&more), 11, false));
    }

    #[test]
    fn processes_that_come_and_go_without_sockets_change_no_owner() {
        let d = dumped(0);
        // 5 reaped, 7 and 12 new.
        let now = Counts {
            processes: vec![1, 7, 9, 12],
            ..at()
        };
        assert_eq!(
            changed(&d.at.processes, &now.processes),
            (vec![5], vec![7, 12])
        );
        let mut asked = Vec::new();
        assert!(reusable(
            Some(&d),
            Some(&now),
            11,
            false,
            |_| false,
            |p| {
                asked.push(p);
                false
            }
        ));
        assert_eq!(asked, vec![7, 12], "only new processes are looked into");
        // The reaped one held a socket of the dump: its sockets have new owners, or none.
        assert!(!reusable(
            Some(&d),
            Some(&now),
            11,
            false,
            |p| p == 5,
            |_| false
        ));
        // A new one has a socket: it may have inherited one of the dump's.
        assert!(!reusable(
            Some(&d),
            Some(&now),
            11,
            false,
            |_| false,
            |p| p == 12
        ));
        // Held processes that are still there change nothing.
        assert!(reusable(
            Some(&d),
            Some(&now),
            11,
            false,
            |p| p == 1,
            |_| false
        ));
        // Too many new processes: dump rather than read them all.
        let crowd = Counts {
            processes: (100..100 + MAX_NEW_PROCESSES as u32 + 1).collect(),
            ..at()
        };
        assert!(!quiet(Some(&d), Some(&crowd), 11, false));
        assert_eq!(changed(&[], &[2, 3]), (vec![], vec![2, 3]));
        assert_eq!(changed(&[2, 3], &[]), (vec![2, 3], vec![]));
    }

    #[test]
    fn a_dump_is_not_reused_past_its_bound_without_counts_or_with_a_socket_to_accept() {
        assert!(quiet(Some(&dumped(10)), Some(&at()), 11, false));
        assert!(!quiet(Some(&dumped(11)), Some(&at()), 11, false));
        // max_reuse 0: every scan dumps (netns_walk_interval = 0 or one scan per period).
        assert!(!quiet(Some(&dumped(0)), Some(&at()), 0, false));
        assert!(!quiet(None, Some(&at()), 11, false));
        assert!(!quiet(Some(&dumped(0)), None, 11, false));
        assert!(!quiet(Some(&dumped(0)), Some(&at()), 11, true));
    }

    #[test]
    fn only_an_open_socket_with_no_file_and_no_holder_waits_for_its_accept() {
        use std::sync::Arc;
        let sock = |state, inode, owned: bool| {
            let mut s = Socket::new(
                "10.0.0.1:8080".parse().expect("endpoint"),
                "10.0.0.2:40000".parse().expect("endpoint"),
                state,
            );
            s.inode = inode;
            if owned {
                s.owner = Some(Arc::new(crate::table::Owner {
                    pid: 7,
                    comm: "relay".into(),
                    unit: None,
                    container: None,
                }));
            }
            s
        };
        for state in [
            TcpState::Established,
            TcpState::CloseWait,
            TcpState::SynRecv,
        ] {
            assert!(pending_accept(&sock(state, 0, false)), "{state:?}");
            assert!(!pending_accept(&sock(state, 0, true)), "{state:?}");
            // A kernel socket, or one in flight over a Unix socket: has a file, no holder.
            assert!(!pending_accept(&sock(state, 42, false)), "{state:?}");
        }
        // Orphans (closed by their process) and listeners never get a holder by accept.
        for state in [TcpState::FinWait1, TcpState::LastAck, TcpState::Listen] {
            assert!(!pending_accept(&sock(state, 0, false)), "{state:?}");
        }
    }
}
