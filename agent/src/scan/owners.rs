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
//!   forks cannot be counted instead: the daemon's own threads are forks);
//! - a descriptor is duplicated, closed while a duplicate stays open, or passed over a Unix
//!   socket: nothing counts these; the last dump is reused at most `max_reuse` scans in a row
//!   (one walk period), so such a change shows within one `netns_walk_interval`.
//!
//! A re-check before a kill never reuses a dump (`Scanner::scan_walking`), nor does a snapshot.

use crate::table::{Socket, TcpState};

/// What the kernel counted when a dump was taken (or now), to tell whether owners can have
/// changed since.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counts {
    /// TCP state transitions the tracker has seen (all CPUs).
    pub transitions: u64,
    /// The processes listed in /proc, as `procfs::processes` fingerprints them.
    pub processes: u64,
}

/// The last owner dump's counts, and how many scans in a row have reused it.
#[derive(Debug, Clone, Copy)]
pub struct Dumped {
    pub at: Counts,
    pub reused: u64,
}

/// Whether this scan may reuse the dump `last` (None: there is none, or it cannot be trusted)
/// given the counts `now` (None: a count could not be read), at most `max_reuse` scans in a
/// row, when the last table had a socket waiting to be accepted (`pending_accept`) or not.
pub fn reusable(
    last: Option<&Dumped>,
    now: Option<Counts>,
    max_reuse: u64,
    pending_accept: bool,
) -> bool {
    match (last, now) {
        (Some(last), Some(now)) => last.at == now && last.reused < max_reuse && !pending_accept,
        _ => false,
    }
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

    const AT: Counts = Counts {
        transitions: 10,
        processes: 500,
    };

    fn dumped(reused: u64) -> Dumped {
        Dumped { at: AT, reused }
    }

    #[test]
    fn a_dump_is_reused_only_while_nothing_counted_changed() {
        assert!(reusable(Some(&dumped(0)), Some(AT), 11, false));
        for changed in [
            Counts {
                transitions: 11,
                ..AT
            },
            Counts {
                processes: 501,
                ..AT
            },
        ] {
            assert!(
                !reusable(Some(&dumped(0)), Some(changed), 11, false),
                "{changed:?}"
            );
        }
    }

    #[test]
    fn a_dump_is_not_reused_past_its_bound_without_counts_or_with_a_socket_to_accept() {
        assert!(reusable(Some(&dumped(10)), Some(AT), 11, false));
        assert!(!reusable(Some(&dumped(11)), Some(AT), 11, false));
        // max_reuse 0: every scan dumps (netns_walk_interval = 0 or one scan per period).
        assert!(!reusable(Some(&dumped(0)), Some(AT), 0, false));
        assert!(!reusable(None, Some(AT), 11, false));
        assert!(!reusable(Some(&dumped(0)), None, 11, false));
        assert!(!reusable(Some(&dumped(0)), Some(AT), 11, true));
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
