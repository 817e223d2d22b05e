//! Orphaned connections. A process that relays (it listens, accepts a downstream, then dials an
//! upstream for it: a proxy, a relay) leaks when a downstream goes away and its upstream is never
//! aborted (incident 1). Its upstreams then fall in three kinds:
//! - **orphaned**: no connected downstream of the process could be the one it was dialled for;
//! - **serving**: exactly one could, and that downstream could be no other upstream's;
//! - **ambiguous**: more than one could (or one that others could claim too): which upstream is
//!   orphaned is not known, so none of them is called orphaned.
//!
//! An upstream `u` may serve a downstream `d` (both of one process) when `d` is connected
//! (ESTABLISHED, not itself the far end of an orphaned upstream), was accepted before `u` was
//! dialled (by [`TOLERANCE`]), and `u` was dialled no later than the first dial after `d`'s last
//! received data (by [`TOLERANCE`], and within [`MATCH_WINDOW`] of it): a request arrives, the
//! relay dials at once; a dial a second later while `d` sent nothing more was someone else's.
//! Ages that are only lower bounds never rule a downstream out. Statuses follow a chain: the far end of an orphaned upstream is a dead downstream for
//! the next relay, so that relay's upstream for it is orphaned too, and each upstream's status
//! is also its other end's (the next hop's accepted socket).
use std::time::Duration;

use rustc_hash::{FxHashMap, FxHashSet};
use serde::Serialize;

use super::{ends::Ends, upstream::MATCH_WINDOW};
use crate::table::{Direction, Socket, TcpState};

/// How much earlier than its downstream an upstream may seem to start (jiffy ticks, an accept
/// completed on another CPU), here and in the hop's timing match (`upstream::by_timing`). Each
/// age is also read at its own moment of a dump (the sweep reads the clock once per run of
/// sets, `iter/tcp` once per socket): a dial made in the jiffy of its accept, read a jiffy
/// later, reads older than the accept.
pub const TOLERANCE: Duration = Duration::from_millis(100);

/// Whether an upstream connection still serves a connected downstream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Orphan {
    Orphaned,
    Serving,
    Ambiguous,
}

/// ", 61 orphaned, 3 serving a connected downstream, 2 ambiguous" (the parts that are not 0).
pub fn counts_text(orphaned: usize, serving: usize, ambiguous: usize) -> String {
    let mut s = String::new();
    if orphaned > 0 {
        s.push_str(&format!(", {orphaned} orphaned (downstream gone)"));
    }
    if serving > 0 {
        s.push_str(&format!(", {serving} serving a connected downstream"));
    }
    if ambiguous > 0 {
        s.push_str(&format!(
            ", {ambiguous} ambiguous (a connected downstream could be theirs)"
        ));
    }
    s
}

/// For each row of a table: its status when it is a relaying process's upstream or the far end
/// of one.
#[derive(Debug, Default)]
pub struct Downstreams {
    status: Vec<Option<Orphan>>,
}

/// A relaying process's connections: accepted ones and dialled ones (rows).
#[derive(Default)]
struct Relay {
    downs: Vec<usize>,
    ups: Vec<usize>,
}

impl Downstreams {
    /// `known`: processes seen relaying in earlier scans (pids), confirmed relays even when no
    /// downstream of theirs is connected now.
    pub fn new(table: &[Socket], ends: &Ends, known: &FxHashSet<u32>) -> Downstreams {
        let mut status = vec![None; table.len()];
        let listeners: rustc_hash::FxHashSet<u32> = table
            .iter()
            .filter(|s| s.state == TcpState::Listen)
            .filter_map(Socket::pid)
            .collect();
        let mut relays: FxHashMap<u32, Relay> = FxHashMap::default();
        for (i, s) in table.iter().enumerate() {
            let Some(pid) = s.pid().filter(|p| listeners.contains(p)) else {
                continue;
            };
            if s.state != TcpState::Established {
                continue;
            }
            match s.direction {
                Direction::Inbound => relays.entry(pid).or_default().downs.push(i),
                Direction::Outbound => relays.entry(pid).or_default().ups.push(i),
                Direction::Listen => {}
            }
        }
        relays.retain(|_, r| !r.ups.is_empty());
        if relays.is_empty() {
            return Downstreams { status };
        }
        // Only a process seen relaying is judged: one of its upstreams may serve a connected
        // downstream now, or did in an earlier scan. Any other process that listens and dials
        // (a service answering health checks that calls an API) dials for itself: "no
        // downstream could be its origin" says nothing about it.
        let no_dead = vec![false; table.len()];
        for r in relays.values() {
            classify(table, r, &no_dead, &mut status);
        }
        relays.retain(|pid, r| {
            let relaying = known.contains(pid)
                || r.ups
                    .iter()
                    .any(|&u| matches!(status[u], Some(Orphan::Serving | Orphan::Ambiguous)));
            if !relaying {
                for &u in &r.ups {
                    status[u] = None;
                }
            }
            relaying
        });
        let mut dead = no_dead;
        // A chain is a few hops long; each pass settles one more.
        for _ in 0..4 {
            for r in relays.values() {
                classify(table, r, &dead, &mut status);
            }
            let mut changed = false;
            for r in relays.values() {
                for &u in &r.ups {
                    if status[u] == Some(Orphan::Orphaned) {
                        if let Some(j) = ends.other(u) {
                            changed |= !dead[j];
                            dead[j] = true;
                        }
                    }
                }
            }
            if !changed {
                break;
            }
        }
        for r in relays.values() {
            for &u in &r.ups {
                if let Some(j) = ends.other(u) {
                    if status[j].is_none() {
                        status[j] = status[u];
                    }
                }
            }
        }
        Downstreams { status }
    }

    /// The processes judged as relays this time (to remember for later scans).
    pub fn relays(&self, table: &[Socket]) -> FxHashSet<u32> {
        table
            .iter()
            .enumerate()
            .filter(|(i, s)| s.direction == Direction::Outbound && self.status(*i).is_some())
            .filter_map(|(_, s)| s.pid())
            .collect()
    }

    /// Row `i`'s status, if it is an upstream of a relaying process or the far end of one.
    pub fn status(&self, i: usize) -> Option<Orphan> {
        self.status.get(i).copied().flatten()
    }
}

/// The statuses of one relay's upstreams given which downstreams are dead.
///
/// Each connected downstream `d` may be the origin of the upstreams dialled while it was there
/// and active: after it was accepted, and no later than the first dial that followed its last
/// received data (by [`TOLERANCE`]; never more than [`MATCH_WINDOW`] after it). A request is
/// answered by the dial right after it: an upstream dialled a second later, while `d` sent
/// nothing more, was made for someone else. In upstream-age space that is an interval per
/// downstream; an upstream's candidates are the intervals holding its age.
fn classify(table: &[Socket], r: &Relay, dead: &[bool], status: &mut [Option<Orphan>]) {
    let live: Vec<usize> = r.downs.iter().copied().filter(|&d| !dead[d]).collect();
    // Exact upstream ages, ascending (youngest first).
    let mut ups: Vec<(Duration, usize)> = r
        .ups
        .iter()
        .filter(|&&u| table[u].age_exact)
        .map(|&u| (table[u].age(), u))
        .collect();
    ups.sort_unstable();
    let mut ivs: Vec<(Duration, Duration, usize)> = live
        .iter()
        .map(|&d| {
            let s = &table[d];
            let lr = s.last_recv().unwrap_or(Duration::ZERO);
            // The first dial at or after its last received data (the oldest such age).
            let bound = lr.saturating_add(TOLERANCE);
            let first = ups[..ups.partition_point(|&(a, _)| a <= bound)]
                .last()
                .map(|&(a, _)| a);
            let low = first
                .map(|a| a.saturating_sub(TOLERANCE))
                .unwrap_or(Duration::ZERO)
                .max(lr.saturating_sub(MATCH_WINDOW));
            let high = if s.age_exact {
                s.age().saturating_add(TOLERANCE)
            } else {
                Duration::MAX
            };
            (low, high, d)
        })
        .collect();
    ivs.sort_unstable();
    let mut unique: Vec<(usize, usize)> = Vec::new();
    let mut active: std::collections::BTreeSet<(Duration, usize)> = Default::default();
    let mut next = 0;
    for &(age, u) in &ups {
        while next < ivs.len() && ivs[next].0 <= age {
            active.insert((ivs[next].1, ivs[next].2));
            next += 1;
        }
        while active.first().is_some_and(|&(high, _)| high < age) {
            active.pop_first();
        }
        let mut it = active.iter();
        status[u] = Some(match (it.next(), it.next()) {
            (None, _) => Orphan::Orphaned,
            (Some(_), Some(_)) => Orphan::Ambiguous,
            (Some(&(_, d)), None) => {
                unique.push((u, d));
                Orphan::Serving
            }
        });
    }
    // An upstream whose age is a lower bound could be any connected downstream's.
    for &u in r.ups.iter().filter(|&&u| !table[u].age_exact) {
        status[u] = Some(match live[..] {
            [] => Orphan::Orphaned,
            [d] => {
                unique.push((u, d));
                Orphan::Serving
            }
            _ => Orphan::Ambiguous,
        });
    }
    // A downstream that is the only candidate of two upstreams serves at most one of them.
    let mut claims: FxHashMap<usize, usize> = FxHashMap::default();
    for &(_, d) in &unique {
        *claims.entry(d).or_default() += 1;
    }
    for (u, d) in unique {
        if claims[&d] > 1 {
            status[u] = Some(Orphan::Ambiguous);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::{sync::Arc, time::Duration};

    use super::*;
    use crate::table::{Owner, Socket};

    fn s(pid: u32, local: &str, peer: &str, dir: Direction, state: TcpState) -> Socket {
        let mut s = Socket::new(local.parse().unwrap(), peer.parse().unwrap(), state);
        s.direction = dir;
        s.owner = Some(Arc::new(Owner {
            pid,
            comm: format!("p{pid}").into(),
            unit: None,
            container: None,
        }));
        s
    }

    /// A proxy (pid 10) listening on 8080, users (pid 1) connecting at `ages` seconds ago
    /// (`stays` says which still are), each upstream dialled 5 ms after its user's accept to a
    /// relay (pid 20) on 25001.
    fn proxy(users: &[(u64, bool)]) -> Vec<Socket> {
        let mut t = vec![
            s(
                10,
                "0.0.0.0:8080",
                "0.0.0.0:0",
                Direction::Listen,
                TcpState::Listen,
            ),
            s(
                20,
                "0.0.0.0:25001",
                "0.0.0.0:0",
                Direction::Listen,
                TcpState::Listen,
            ),
        ];
        for (i, &(age, stays)) in users.iter().enumerate() {
            let cport = 40000 + i;
            let uport = 50000 + i;
            let age = Duration::from_secs(age);
            if stays {
                let mut c = s(
                    1,
                    &format!("10.0.0.1:{cport}"),
                    "10.0.0.2:8080",
                    Direction::Outbound,
                    TcpState::Established,
                );
                c.set_age(age);
                let mut d = s(
                    10,
                    "10.0.0.2:8080",
                    &format!("10.0.0.1:{cport}"),
                    Direction::Inbound,
                    TcpState::Established,
                );
                d.set_age(age);
                d.set_last_io(Some(age), Some(Duration::ZERO));
                t.push(c);
                t.push(d);
            }
            let mut u = s(
                10,
                &format!("10.0.0.2:{uport}"),
                "10.0.0.3:25001",
                Direction::Outbound,
                TcpState::Established,
            );
            u.set_age(age - Duration::from_millis(5));
            let mut r = s(
                20,
                "10.0.0.3:25001",
                &format!("10.0.0.2:{uport}"),
                Direction::Inbound,
                TcpState::Established,
            );
            r.set_age(u.age());
            t.push(u);
            t.push(r);
        }
        t
    }

    fn statuses(t: &[Socket]) -> Vec<(u16, Option<Orphan>)> {
        let ends = Ends::new(t);
        let d = Downstreams::new(t, &ends, &FxHashSet::default());
        t.iter()
            .enumerate()
            .filter(|(_, s)| s.pid() == Some(10) && s.peer.port() == 25001)
            .map(|(i, s)| (s.local.port(), d.status(i)))
            .collect()
    }

    #[test]
    fn upstreams_of_users_who_left_are_orphaned() {
        use Orphan::{Orphaned, Serving as Live};
        // Two stay (early), then three leave in a burst 10 s later, one more stays after.
        let t = proxy(&[
            (100, true),
            (90, true),
            (80, false),
            (80, false),
            (80, false),
            (60, true),
        ]);
        assert_eq!(
            statuses(&t),
            [
                (50000, Some(Live)),
                (50001, Some(Live)),
                (50002, Some(Orphaned)),
                (50003, Some(Orphaned)),
                (50004, Some(Orphaned)),
                (50005, Some(Live)),
            ]
        );
        // The relay's accepted ends carry the same status.
        let ends = Ends::new(&t);
        let d = Downstreams::new(&t, &ends, &FxHashSet::default());
        let relay: Vec<Option<Orphan>> = t
            .iter()
            .enumerate()
            .filter(|(_, s)| s.pid() == Some(20) && s.direction == Direction::Inbound)
            .map(|(i, _)| d.status(i))
            .collect();
        assert_eq!(relay.iter().filter(|s| **s == Some(Orphaned)).count(), 3);
    }

    /// A user on a live page (its request answered by the dial right after it) and users who
    /// came a second later and left: their upstreams are not the live user's (it asked for one,
    /// it got it), whatever the window.
    #[test]
    fn a_dial_after_the_one_that_answered_a_request_is_someone_elses() {
        use Orphan::{Orphaned, Serving as Live};
        let mut t = proxy(&[(100, true)]);
        for (i, leaver) in proxy(&[(99, false), (99, false)])
            .into_iter()
            .filter(|x| x.state != TcpState::Listen)
            .enumerate()
        {
            let mut x = leaver;
            x.set_age(x.age() - Duration::from_millis(200));
            x.local = format!("{}:{}", x.local.ip(), 51000 + i).parse().unwrap();
            x.peer = if x.direction == Direction::Inbound {
                format!("{}:{}", x.peer.ip(), 51000 + i).parse().unwrap()
            } else {
                x.peer
            };
            t.push(x);
        }
        let st = statuses(&t);
        assert_eq!(
            st.iter().map(|x| x.1).collect::<Vec<_>>(),
            [Some(Live), Some(Orphaned), Some(Orphaned)],
            "{st:?}"
        );
    }

    #[test]
    fn users_arriving_together_are_ambiguous_not_orphaned() {
        use Orphan::Ambiguous;
        // One stays, one leaves, within the same second: which upstream serves the one
        // left is not known.
        let t = proxy(&[(100, true), (100, false)]);
        assert_eq!(
            statuses(&t),
            [(50000, Some(Ambiguous)), (50001, Some(Ambiguous))]
        );
    }

    #[test]
    fn a_downstream_busy_at_the_dial_may_have_asked_for_it() {
        // A keep-alive downstream accepted long before; its request arrived right before the
        // upstream's dial.
        let mut t = proxy(&[(300, true), (100, false)]);
        for x in &mut t {
            if x.pid() == Some(10) && x.direction == Direction::Inbound {
                x.set_last_io(Some(Duration::from_secs(100)), Some(Duration::ZERO));
            }
        }
        let st = statuses(&t);
        assert_eq!(st[1].1, Some(Orphan::Ambiguous), "{st:?}");
    }

    #[test]
    fn inexact_ages_never_make_an_orphan_while_a_user_is_connected() {
        let mut t = proxy(&[(100, true), (50, false)]);
        for x in &mut t {
            x.age_exact = false;
        }
        let st = statuses(&t);
        assert!(
            st.iter().all(|(_, s)| *s != Some(Orphan::Orphaned)),
            "{st:?}"
        );
        // With no user connected at all, the proxy is not known to relay: nothing is said;
        // once seen relaying (an earlier scan), every upstream is orphaned.
        let t = proxy(&[(100, false), (50, false)]);
        assert!(statuses(&t).iter().all(|(_, s)| s.is_none()));
        let ends = Ends::new(&t);
        let known: FxHashSet<u32> = [10].into_iter().collect();
        let d = Downstreams::new(&t, &ends, &known);
        let ups: Vec<Option<Orphan>> = t
            .iter()
            .enumerate()
            .filter(|(_, s)| s.pid() == Some(10) && s.peer.port() == 25001)
            .map(|(i, _)| d.status(i))
            .collect();
        assert_eq!(ups, [Some(Orphan::Orphaned); 2]);
        assert_eq!(d.relays(&t), known);
    }

    /// A client that also listens (a service answering health checks) dials for itself: its
    /// connections are not orphans, and the proxy it talks to keeps its downstreams.
    #[test]
    fn a_listening_client_is_not_taken_for_a_relay() {
        let mut t = proxy(&[(100, true), (50, false)]);
        // Users are pid 1; give them a listener and an old inbound connection.
        let mut l = s(
            1,
            "0.0.0.0:9999",
            "0.0.0.0:0",
            Direction::Listen,
            TcpState::Listen,
        );
        l.direction = Direction::Listen;
        t.push(l);
        let mut d = s(
            1,
            "10.0.0.1:9999",
            "10.0.0.9:50000",
            Direction::Inbound,
            TcpState::Established,
        );
        d.set_age(Duration::from_secs(1000));
        d.set_last_io(Some(Duration::from_secs(1000)), None);
        t.push(d);
        let st = statuses(&t);
        assert_eq!(st[0].1, Some(Orphan::Serving), "{st:?}");
        assert_eq!(st[1].1, Some(Orphan::Orphaned), "{st:?}");
    }

    #[test]
    fn a_process_that_does_not_listen_is_not_a_relay() {
        let t: Vec<Socket> = proxy(&[(100, false)])
            .into_iter()
            .filter(|x| x.state != TcpState::Listen || x.pid() != Some(10))
            .collect();
        assert!(statuses(&t).iter().all(|(_, s)| s.is_none()));
    }
}
