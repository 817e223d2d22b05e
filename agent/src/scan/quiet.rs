//! Whether a namespace whose walk is due (the own one on every scan) is walked, or "quiet":
//! read by the sweep, with what its last walk read that the sweep cannot carried (plain data,
//! no kernel access). The judgement compares what the kernel counts in the namespace
//! (`sockstat`, no socket visited) with what the last sweep read of it and what its last walk
//! carries now.
//!
//! TIME_WAIT sockets are the reason this needs care: the sweep never sees them, and each
//! request over a new connection leaves one. A walked one's fate is known from the kernel's
//! stamp of its entry (`timewait::alive`: alive, gone, or unsure in the seconds around its
//! timer's expiry). A scan whose kernel count equals the sure-alive ones, or those plus every
//! unsure one, carries accordingly instead of walking.
use connreap_ebpf::SockRecord;

use super::{
    timewait,
    walk::{untracked, Swept, Walked},
};
use crate::kernel::procfs::SockStat;

/// What a namespace's last walk leaves for a scan at some time that the sweep cannot read.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Carried {
    /// Full sockets the state table had no room for.
    pub untracked: u64,
    /// Timewait sockets alive then.
    pub alive: u64,
    /// Timewait sockets within the seconds around their timer's expiry.
    pub unsure: u64,
    /// Whether one timewait socket's fate cannot be known from its record (no stamp before
    /// 6.13, or FIN_WAIT2): only a walk tells.
    pub unknown: bool,
}

impl Carried {
    /// Nothing carried (never read by this rule: a namespace never walked is walked).
    pub const NOTHING: Carried = Carried {
        untracked: 0,
        alive: 0,
        unsure: 0,
        unknown: false,
    };
}

/// How a quiet scan carries its last walk's timewait sockets: those alive, and the unsure ones
/// too when the kernel counts them all alive (`unsure`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Quiet {
    pub unsure: bool,
}

/// Whether a walk's timewait socket, unsure or not, may be at its timer's expiry at `now_ns`.
fn unsure(r: &SockRecord, now_ns: u64) -> bool {
    timewait::alive(r, now_ns).is_none() && timewait::stamped(r)
}

impl Walked {
    /// What this walk leaves for a scan at `now_ns`.
    pub fn carried_at(&self, now_ns: u64) -> Carried {
        let mut c = Carried::NOTHING;
        for r in &self.unheld {
            if untracked(r) {
                c.untracked += 1;
            } else if timewait::is_timewait(r) {
                match timewait::alive(r, now_ns) {
                    Some(true) => c.alive += 1,
                    Some(false) => {}
                    None if unsure(r, now_ns) => c.unsure += 1,
                    None => c.unknown = true,
                }
            }
        }
        c
    }

    /// What a quiet scan at `now_ns` keeps of `last`, the namespace's last real walk, with this
    /// scan's sysctls (`self`): what it carries (see [`kept`]) and when that was read. Its
    /// request sockets are not kept: the sweep counted none.
    pub fn after_quiet(self, last: &Walked, now_ns: u64, quiet: Quiet) -> Walked {
        Walked {
            at_ns: last.at_ns,
            unheld: last
                .unheld
                .iter()
                .filter(|r| kept(r, now_ns, quiet))
                .copied()
                .collect(),
            ..self
        }
    }
}

/// Whether a quiet scan at `now_ns` carries a record of the namespace's last walk: an
/// untracked full socket, or a timewait socket alive then, or unsure when the kernel's count
/// says the unsure ones are all alive (see [`judge`]).
pub fn kept(r: &SockRecord, now_ns: u64, quiet: Quiet) -> bool {
    untracked(r)
        || (timewait::is_timewait(r)
            && match timewait::alive(r, now_ns) {
                Some(alive) => alive,
                None => quiet.unsure && unsure(r, now_ns),
            })
}

/// Whether a namespace's walk would read anything the sweep does not (None: walk it), judged
/// from what the kernel counts in it (`stat`) against what the last sweep read of it and what
/// its last walk `carried` now; otherwise how the quiet scan carries.
///
/// Walk on: a timewait count that is neither the carried alive ones nor those plus every
/// unsure one (a new one, one ended early by a reset), one whose fate is unknown; a request
/// socket (the kernel does not count them; the sweep counts them on their listener); more
/// hashed full sockets than the sweep read and the untracked ones carried (some have no record
/// in the table: they predate the tracker, or their set was full, or they are newer than the
/// sweep). With untracked ones carried, also when fewer are hashed (one may have closed) and
/// when their re-read is `due` (their queues and state may have moved). A timewait socket does
/// not change until it ends, so it needs no re-read: a count that hides a change (one ended
/// early while a new one entered) shows at the latest when the early one's expiry is passed,
/// ≤ 66 s after its stamp. Unknown counts: walk.
pub fn judge(
    stat: Option<SockStat>,
    swept: Option<&Swept>,
    carried: Carried,
    due: bool,
) -> Option<Quiet> {
    let (stat, swept) = (stat?, swept?);
    let accounted = swept.sockets + carried.untracked;
    let untracked = carried.untracked > 0;
    if carried.unknown
        || swept.requests > 0
        || stat.inuse > accounted
        || (untracked && (due || stat.inuse < accounted))
    {
        return None;
    }
    if stat.tw == carried.alive {
        Some(Quiet { unsure: false })
    } else if stat.tw == carried.alive + carried.unsure {
        Some(Quiet { unsure: true })
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use connreap_ebpf::{sock_flags, tcp_state};

    fn rec(skaddr: u64, flags: u8) -> SockRecord {
        SockRecord {
            skaddr,
            flags,
            ..SockRecord::default()
        }
    }

    fn tw(skaddr: u64, stamp_ms: u32) -> SockRecord {
        SockRecord {
            state: tcp_state::TIME_WAIT,
            tw_entry_ms: stamp_ms,
            ..rec(skaddr, sock_flags::TW_ENTRY)
        }
    }

    fn carrying(untracked: u64, alive: u64, unsure: u64) -> Carried {
        Carried {
            untracked,
            alive,
            unsure,
            unknown: false,
        }
    }

    const SURE: Option<Quiet> = Some(Quiet { unsure: false });
    const ALL: Option<Quiet> = Some(Quiet { unsure: true });

    #[test]
    fn a_due_walk_is_skipped_only_when_the_sweep_read_everything() {
        let stat = |inuse, tw| Some(SockStat { inuse, tw });
        let swept = |sockets, requests| Swept { sockets, requests };
        let none = Carried::NOTHING;
        let judged = |st, sw, carried, due| judge(st, Some(&sw), carried, due);
        assert_eq!(judged(stat(1001, 0), swept(1001, 0), none, true), SURE);
        // The sweep read more than were hashed then (a socket since closed): nothing missed.
        assert_eq!(judged(stat(990, 0), swept(1001, 0), none, true), SURE);
        assert_eq!(judged(stat(1001, 3), swept(1001, 0), none, true), None);
        assert_eq!(judged(stat(1001, 0), swept(1001, 2), none, true), None);
        assert_eq!(judged(stat(1002, 0), swept(1001, 0), none, true), None);
        assert_eq!(judge(None, Some(&swept(1, 0)), none, true), None);
        assert_eq!(judge(stat(0, 0), None, none, true), None, "never swept");
    }

    #[test]
    fn carried_sockets_are_re_read_when_due_or_when_one_may_have_closed() {
        let stat = |inuse| Some(SockStat { inuse, tw: 0 });
        let swept = Swept {
            sockets: 1000,
            requests: 0,
        };
        let ten = carrying(10, 0, 0);
        // 10 untracked carried: 1010 hashed is all accounted for until the re-read is due.
        assert_eq!(judge(stat(1010), Some(&swept), ten, false), SURE);
        assert_eq!(judge(stat(1010), Some(&swept), ten, true), None, "due");
        assert_eq!(judge(stat(1011), Some(&swept), ten, false), None);
        // One closed: maybe a carried one.
        assert_eq!(judge(stat(1009), Some(&swept), ten, false), None);
        // Without anything carried, a due turn alone is no reason.
        let none = Carried::NOTHING;
        assert_eq!(judge(stat(1000), Some(&swept), none, true), SURE);
    }

    #[test]
    fn carried_timewait_sockets_stand_in_while_the_kernel_counts_as_many() {
        let stat = |tw| Some(SockStat { inuse: 1000, tw });
        let swept = Swept {
            sockets: 1000,
            requests: 0,
        };
        let judged = |tw, carried, due| judge(stat(tw), Some(&swept), carried, due);
        assert_eq!(judged(3, carrying(0, 3, 0), false), SURE, "the same 3");
        assert_eq!(judged(4, carrying(0, 3, 0), false), None, "a new one");
        assert_eq!(judged(2, carrying(0, 3, 0), false), None, "one gone early");
        // They do not change until they end: no re-read.
        assert_eq!(judged(3, carrying(0, 3, 0), true), SURE);
        let unknown = Carried {
            unknown: true,
            ..carrying(0, 3, 0)
        };
        assert_eq!(judged(3, unknown, false), None, "no stamp");
        // All gone, as predicted: nothing carried, nothing counted.
        assert_eq!(judged(0, carrying(0, 0, 0), true), SURE);
    }

    #[test]
    fn unsure_timewait_sockets_are_settled_by_the_count_when_it_can() {
        let stat = |tw| Some(SockStat { inuse: 1000, tw });
        let swept = Swept {
            sockets: 1000,
            requests: 0,
        };
        let judged = |tw| judge(stat(tw), Some(&swept), carrying(0, 2, 3), false);
        assert_eq!(judged(2), SURE, "the 3 unsure ended");
        assert_eq!(judged(5), ALL, "the 3 unsure still alive");
        assert_eq!(judged(3), None, "some of them: which not known");
        assert_eq!(judged(6), None, "a new one");
        assert_eq!(judged(1), None, "a sure one gone early");
    }

    #[test]
    fn a_quiet_scan_keeps_what_it_carries_and_when_that_was_read() {
        let request = SockRecord {
            state: tcp_state::SYN_RECV,
            ..rec(4, 0)
        };
        let last = Walked {
            at_ns: 5,
            unheld: vec![
                rec(1, sock_flags::FULL | sock_flags::UNTRACKED),
                tw(2, 50_000),
                tw(3, 1_000),
                request,
                tw(5, 9_000),
            ],
            ..Walked::default()
        };
        // At 70 s: 2 is alive (20 s old), 3 is gone (69 s old), 5 is unsure (61 s old).
        let now = 70_000 * 1_000_000;
        assert_eq!(last.carried_at(now), carrying(1, 1, 1));
        let fresh = Walked {
            at_ns: now,
            ephemeral: Some(1000..=2000),
            ..Walked::default()
        };
        let addrs = |w: &Walked| w.unheld.iter().map(|r| r.skaddr).collect::<Vec<u64>>();
        let kept = fresh
            .clone()
            .after_quiet(&last, now, Quiet { unsure: false });
        assert_eq!(kept.at_ns, 5);
        assert_eq!(addrs(&kept), vec![1, 2]);
        assert_eq!(kept.ephemeral, Some(1000..=2000));
        let kept = fresh.after_quiet(&last, now, Quiet { unsure: true });
        assert_eq!(addrs(&kept), vec![1, 2, 5]);
        // Without the kernel's stamp: unknown, never kept by a quiet scan.
        let no_stamp = SockRecord {
            state: tcp_state::TIME_WAIT,
            ..rec(6, 0)
        };
        let last = Walked {
            unheld: vec![no_stamp],
            ..Walked::default()
        };
        assert!(last.carried_at(now).unknown);
        assert!(!kept_any(&no_stamp, now));
    }

    fn kept_any(r: &SockRecord, now: u64) -> bool {
        kept(r, now, Quiet { unsure: false }) || kept(r, now, Quiet { unsure: true })
    }
}
