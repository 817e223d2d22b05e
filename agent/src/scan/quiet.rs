//! Whether a namespace whose walk is due (the own one on every scan) is walked, or "quiet":
//! read by the sweep, with what its last walk read that the sweep cannot carried (plain data,
//! no kernel access). The judgement compares what the kernel counts in the namespace
//! (`sockstat`, no socket visited) with what the last sweep read of it and what its last walk
//! carries now.
//!
//! TIME_WAIT sockets are the reason this needs care: the sweep never sees them, and each
//! request over a new connection leaves one. A walked one's fate is known from the kernel's
//! stamp of its entry (`timewait::alive`: alive, gone, or unsure in the seconds around its
//! timer's expiry), and the kernel counts how many are alive. A scan whose count equals the
//! sure-alive ones, or those plus every unsure one, carries accordingly instead of walking.
//! Between those, when no timewait socket can have been made since the walk (no TCP state
//! transition on the host: each new one follows one), the count says how many of the unsure
//! ones are alive, and those are the youngest: timers of one length fire in the order they
//! were armed (the timer wheel rounds their expiry up to its level's granularity, which keeps
//! the order and ends them in batches seconds apart).
use connreap_ebpf::SockRecord;

use super::{
    timewait,
    walk::{untracked, Swept, Walked},
};
use crate::kernel::procfs::SockStat;

/// What a namespace's last walk leaves for a scan at some time that the sweep cannot read.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Carried {
    /// Full sockets the state table had no room for.
    pub untracked: u64,
    /// Timewait sockets alive then.
    pub alive: u64,
    /// The ages (ms since their stamps) of the timewait sockets within the seconds around
    /// their timer's expiry, youngest first.
    pub unsure: Vec<u32>,
    /// Whether one timewait socket's fate cannot be known from its record (no stamp before
    /// 6.13, or FIN_WAIT2): only a walk tells.
    pub unknown: bool,
}

/// How a quiet scan carries its last walk's timewait sockets: those alive, and of the unsure
/// ones those younger than `unsure_below_ms` (the kernel counts them alive).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Quiet {
    pub unsure_below_ms: u32,
}

impl Quiet {
    /// None of the unsure ones: the kernel counts only the sure-alive ones.
    pub const SURE: Quiet = Quiet { unsure_below_ms: 0 };
    /// Every unsure one: the kernel counts them all.
    pub const ALL: Quiet = Quiet {
        unsure_below_ms: u32::MAX,
    };
}

/// How far apart in age the youngest unsure timewait socket taken for ended and the oldest
/// taken for alive must be. A stamp is the socket's clock as of its last send (the FIN or
/// ACK that ended it, usually), stale by up to a round trip when the peer's FIN came later,
/// so two sockets made within that much may have been armed in the other order. Sub-ms on
/// loopback and within a cluster; on a quiet host with remote peers a misjudged pair shows
/// the wrong one of two timewait rows until both are past their expiry (seconds), never a
/// wrong count. Busy hosts make TCP transitions all the time and never use this rule.
const ORDER_MARGIN_MS: u32 = 20;

/// Whether a walk's timewait socket is within the seconds around its timer's expiry at
/// `now_ns` (neither sure alive nor sure gone, but stamped).
fn unsure(r: &SockRecord, now_ns: u64) -> bool {
    timewait::alive(r, now_ns).is_none() && timewait::stamped(r)
}

impl Walked {
    /// What this walk leaves for a scan at `now_ns`.
    pub fn carried_at(&self, now_ns: u64) -> Carried {
        let mut c = Carried::default();
        for r in &self.unheld {
            if untracked(r) {
                c.untracked += 1;
            } else if timewait::is_timewait(r) {
                match timewait::alive(r, now_ns) {
                    Some(true) => c.alive += 1,
                    Some(false) => {}
                    None if unsure(r, now_ns) => c.unsure.push(timewait::age_ms(r, now_ns)),
                    None => c.unknown = true,
                }
            }
        }
        c.unsure.sort_unstable();
        c
    }

    /// What a quiet scan at `now_ns` keeps of `last`, the namespace's last real walk, with this
    /// scan's sysctls (`self`): what it carries (see [`kept`]), when that was read and the
    /// transitions counted then. Its request sockets are not kept: the sweep counted none.
    pub fn after_quiet(self, last: &Walked, now_ns: u64, quiet: Quiet) -> Walked {
        Walked {
            at_ns: last.at_ns,
            transitions: last.transitions,
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
/// untracked full socket, or a timewait socket alive then, or an unsure one that `quiet`
/// takes for alive (see [`judge`]).
pub fn kept(r: &SockRecord, now_ns: u64, quiet: Quiet) -> bool {
    untracked(r)
        || (timewait::is_timewait(r)
            && match timewait::alive(r, now_ns) {
                Some(alive) => alive,
                None => unsure(r, now_ns) && timewait::age_ms(r, now_ns) < quiet.unsure_below_ms,
            })
}

/// Whether a namespace's walk would read anything the sweep does not (None: walk it), judged
/// from what the kernel counts in it (`stat`) against what the last sweep read of it and what
/// its last walk `carried` now; otherwise how the quiet scan carries. `settled`: no TCP state
/// transition on the host since that walk's scan began.
///
/// Walk on: a request socket (the kernel does not count them; the sweep counts them on their
/// listener); more hashed full sockets than the sweep read and the untracked ones carried
/// (some have no record in the table: they predate the tracker, or their set was full, or
/// they are newer than the sweep); with untracked ones carried, also when fewer are hashed
/// (one may have closed) and when their re-read is `due` (their queues and state may have
/// moved). And on a timewait count the carried ones cannot explain (see the module's text):
/// a new one, one ended early by a reset, one whose fate is unknown. A timewait socket does
/// not change until it ends, so it needs no re-read: a count that hides a change (one ended
/// early while a new one entered) shows at the latest when the early one's expiry is passed,
/// ≤ 66 s after its stamp. Unknown counts: walk.
pub fn judge(
    stat: Option<SockStat>,
    swept: Option<&Swept>,
    carried: &Carried,
    due: bool,
    settled: bool,
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
    // How many of the unsure ones the kernel counts alive, if the sure-alive ones all are.
    let alive = usize::try_from(stat.tw.checked_sub(carried.alive)?).ok()?;
    let unsure = &carried.unsure;
    if alive == 0 {
        Some(Quiet::SURE)
    } else if alive == unsure.len() {
        Some(Quiet::ALL)
    } else if alive > unsure.len() || !settled {
        None
    } else {
        // The `alive` youngest; the next one must be clearly older.
        let (youngest_gone, oldest_alive) = (unsure[alive], unsure[alive - 1]);
        (youngest_gone.saturating_sub(oldest_alive) >= ORDER_MARGIN_MS).then_some(Quiet {
            unsure_below_ms: youngest_gone,
        })
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

    fn carrying(untracked: u64, alive: u64, unsure: &[u32]) -> Carried {
        Carried {
            untracked,
            alive,
            unsure: unsure.to_vec(),
            unknown: false,
        }
    }

    const SURE: Option<Quiet> = Some(Quiet::SURE);
    const ALL: Option<Quiet> = Some(Quiet::ALL);

    /// `judge` for 1000 hashed sockets, all swept, and `tw` timewait sockets counted.
    fn judged_tw(tw: u64, carried: &Carried, due: bool, settled: bool) -> Option<Quiet> {
        let swept = Swept {
            sockets: 1000,
            requests: 0,
        };
        judge(
            Some(SockStat { inuse: 1000, tw }),
            Some(&swept),
            carried,
            due,
            settled,
        )
    }

    #[test]
    fn a_due_walk_is_skipped_only_when_the_sweep_read_everything() {
        let stat = |inuse, tw| Some(SockStat { inuse, tw });
        let swept = |sockets, requests| Swept { sockets, requests };
        let none = Carried::default();
        let judged = |st, sw, due| judge(st, Some(&sw), &none, due, false);
        assert_eq!(judged(stat(1001, 0), swept(1001, 0), true), SURE);
        // The sweep read more than were hashed then (a socket since closed): nothing missed.
        assert_eq!(judged(stat(990, 0), swept(1001, 0), true), SURE);
        assert_eq!(
            judged(stat(1001, 3), swept(1001, 0), true),
            None,
            "timewait"
        );
        assert_eq!(
            judged(stat(1001, 0), swept(1001, 2), true),
            None,
            "requests"
        );
        assert_eq!(
            judged(stat(1002, 0), swept(1001, 0), true),
            None,
            "untracked"
        );
        assert_eq!(judge(None, Some(&swept(1, 0)), &none, true, true), None);
        assert_eq!(
            judge(stat(0, 0), None, &none, true, true),
            None,
            "never swept"
        );
    }

    #[test]
    fn carried_sockets_are_re_read_when_due_or_when_one_may_have_closed() {
        let stat = |inuse| Some(SockStat { inuse, tw: 0 });
        let swept = Swept {
            sockets: 1000,
            requests: 0,
        };
        let ten = carrying(10, 0, &[]);
        let judged =
            |inuse, carried: &Carried, due| judge(stat(inuse), Some(&swept), carried, due, true);
        // 10 untracked carried: 1010 hashed is all accounted for until the re-read is due.
        assert_eq!(judged(1010, &ten, false), SURE);
        assert_eq!(judged(1010, &ten, true), None, "due");
        assert_eq!(judged(1011, &ten, false), None, "a new one");
        assert_eq!(
            judged(1009, &ten, false),
            None,
            "one closed: maybe a carried one"
        );
        // Without anything carried, a due turn alone is no reason.
        assert_eq!(judged(1000, &Carried::default(), true), SURE);
    }

    #[test]
    fn carried_timewait_sockets_stand_in_while_the_kernel_counts_as_many() {
        let judged = |tw, carried: &Carried, due| judged_tw(tw, carried, due, false);
        let three = carrying(0, 3, &[]);
        assert_eq!(judged(3, &three, false), SURE, "the same 3");
        assert_eq!(judged(4, &three, false), None, "a new one");
        assert_eq!(judged(2, &three, false), None, "one gone early");
        // They do not change until they end: no re-read.
        assert_eq!(judged(3, &three, true), SURE);
        let unknown = Carried {
            unknown: true,
            ..three
        };
        assert_eq!(judged(3, &unknown, false), None, "no stamp");
        // All gone, as predicted: nothing carried, nothing counted.
        assert_eq!(judged(0, &Carried::default(), true), SURE);
    }

    #[test]
    fn unsure_timewait_sockets_are_settled_by_the_count_when_it_can() {
        // 2 sure alive; 3 unsure, 59.5 s, 61 s and 63 s after their stamps.
        let c = carrying(0, 2, &[59_500, 61_000, 63_000]);
        let judged = |tw, settled| judged_tw(tw, &c, false, settled);
        assert_eq!(judged(2, false), SURE, "the 3 unsure ended");
        assert_eq!(judged(5, false), ALL, "the 3 unsure still alive");
        assert_eq!(judged(6, true), None, "a new one");
        assert_eq!(judged(1, true), None, "a sure one gone early");
        // Some of them: the youngest, if no timewait socket can have been made since the walk.
        assert_eq!(
            judged(3, false),
            None,
            "a new one may stand in for an ended one"
        );
        let below = |ms| {
            Some(Quiet {
                unsure_below_ms: ms,
            })
        };
        assert_eq!(judged(3, true), below(61_000));
        assert_eq!(judged(4, true), below(63_000));
        // Two made too close together to tell which was armed first.
        let close = carrying(0, 0, &[60_000, 60_010]);
        assert_eq!(judged_tw(1, &close, false, true), None);
    }

    #[test]
    fn a_quiet_scan_keeps_what_it_carries_and_when_that_was_read() {
        let request = SockRecord {
            state: tcp_state::SYN_RECV,
            ..rec(4, 0)
        };
        let last = Walked {
            at_ns: 5,
            transitions: Some(77),
            unheld: vec![
                rec(1, sock_flags::FULL | sock_flags::UNTRACKED),
                tw(2, 50_000),
                tw(3, 1_000),
                request,
                tw(5, 9_000),
                tw(6, 8_000),
            ],
            ..Walked::default()
        };
        // At 70 s: 2 is alive (20 s old), 3 is gone (69 s old), 5 and 6 unsure (61, 62 s).
        let now = 70_000 * 1_000_000;
        assert_eq!(last.carried_at(now), carrying(1, 1, &[61_000, 62_000]));
        let fresh = Walked {
            at_ns: now,
            ephemeral: Some(1000..=2000),
            transitions: Some(99),
            ..Walked::default()
        };
        let addrs = |w: &Walked| w.unheld.iter().map(|r| r.skaddr).collect::<Vec<u64>>();
        let sure = fresh.clone().after_quiet(&last, now, Quiet::SURE);
        assert_eq!((sure.at_ns, sure.transitions), (5, Some(77)));
        assert_eq!(addrs(&sure), vec![1, 2]);
        assert_eq!(sure.ephemeral, Some(1000..=2000));
        let all = fresh.clone().after_quiet(&last, now, Quiet::ALL);
        assert_eq!(addrs(&all), vec![1, 2, 5, 6]);
        let younger = Quiet {
            unsure_below_ms: 62_000,
        };
        assert_eq!(
            addrs(&fresh.after_quiet(&last, now, younger)),
            vec![1, 2, 5]
        );
        // Without the kernel's stamp: unknown, never kept by a quiet scan.
        let no_stamp = SockRecord {
            state: tcp_state::TIME_WAIT,
            ..rec(7, 0)
        };
        let last = Walked {
            unheld: vec![no_stamp],
            ..Walked::default()
        };
        assert!(last.carried_at(now).unknown);
        assert!(!kept(&no_stamp, now, Quiet::ALL));
    }
}
