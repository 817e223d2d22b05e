//! A round's kills: each target re-checked against a fresh kernel view right before it is
//! destroyed, with the mechanism chosen at start (`kernel::destroy`), each namespace's targets
//! from inside that namespace.
use std::collections::HashMap;

use super::{old_enough, selected, Outcome};
use crate::{
    config::PolicyConfig,
    kernel::{
        destroy::{bpf::DestroyResult, netlink::Netlink, Destroyer},
        netns::{self, Namespace},
    },
    table::Socket,
};

/// sock_diag's cookie (two host-order u32, low word first) as the kernel's u64 socket cookie.
fn cookie_u64(c: [u8; 8]) -> u64 {
    let lo = u32::from_ne_bytes([c[0], c[1], c[2], c[3]]);
    let hi = u32::from_ne_bytes([c[4], c[5], c[6], c[7]]);
    (u64::from(hi) << 32) | u64::from(lo)
}

/// What became of one target: the outcome, why (for anything but a kill), and the cookie a
/// netlink destroy went by.
#[derive(Debug, Clone, PartialEq)]
pub struct Kill {
    pub outcome: Outcome,
    pub reason: Option<String>,
    pub cookie: Option<u64>,
}

impl Kill {
    pub fn new(outcome: Outcome, reason: impl Into<String>) -> Kill {
        Kill {
            outcome,
            reason: Some(reason.into()),
            cookie: None,
        }
    }

    fn killed(cookie: Option<u64>) -> Kill {
        Kill {
            outcome: Outcome::Killed,
            reason: None,
            cookie,
        }
    }

    fn with_cookie(mut self, cookie: Option<u64>) -> Kill {
        self.cookie = cookie;
        self
    }
}

const CLOSED: &str = "closed before the kill";

/// Re-check every target against its fresh kernel view and destroy those that still qualify,
/// each namespace's targets from inside that namespace (a netlink socket and a BPF iterator
/// see only the sockets of the namespace they were made in). One outcome per target, in
/// order; also the cookie a netlink destroy went by.
pub(super) fn kill_all(
    p: &PolicyConfig,
    destroyer: &mut Destroyer,
    targets: &[&Socket],
    now: &HashMap<(u64, u64), &Socket>,
    spaces: &[Namespace],
) -> Vec<Kill> {
    let mut out: Vec<Option<Kill>> = vec![None; targets.len()];
    let mut inodes: Vec<u32> = targets.iter().map(|s| s.netns.inode).collect();
    inodes.sort_unstable();
    inodes.dedup();
    for inode in inodes {
        let (idx, group): (Vec<usize>, Vec<&Socket>) = targets
            .iter()
            .enumerate()
            .filter(|(_, s)| s.netns.inode == inode)
            .map(|(i, s)| (i, *s))
            .unzip();
        // Inode 0 (a table built without namespaces) is connreap's own.
        let ns = spaces
            .iter()
            .find(|n| n.inode == inode || (inode == 0 && n.own));
        let results = match ns {
            Some(ns) => netns::run_in(ns, || kill_in_namespace(p, destroyer, &group, now))
                .unwrap_or_else(|e| {
                    let (outcome, why) = if e.is_gone() {
                        (
                            Outcome::Skipped,
                            "network namespace gone before the kill".to_string(),
                        )
                    } else {
                        (Outcome::Failed, format!("{:#}", anyhow::Error::new(e)))
                    };
                    vec![Kill::new(outcome, why); group.len()]
                }),
            None => vec![
                Kill::new(Outcome::Skipped, "network namespace gone before the kill");
                group.len()
            ],
        };
        for (i, r) in idx.into_iter().zip(results) {
            out[i] = Some(r);
        }
    }
    out.into_iter()
        .map(|o| o.unwrap_or_else(|| Kill::new(Outcome::Failed, "not attempted")))
        .collect()
}

/// [`kill_all`] for the targets of one namespace, on a thread inside it.
fn kill_in_namespace(
    p: &PolicyConfig,
    destroyer: &mut Destroyer,
    targets: &[&Socket],
    now: &HashMap<(u64, u64), &Socket>,
) -> Vec<Kill> {
    let mut out: Vec<Kill> = Vec::with_capacity(targets.len());
    // Targets for the BPF mechanism, destroyed together in one iterator pass.
    let mut batch: Vec<(usize, (u64, u64))> = Vec::new();
    // One netlink socket for the namespace's whole batch, made on first use (in it).
    let mut netlink: Option<Result<Netlink, String>> = None;
    for s in targets {
        let fresh = match recheck(p, s, now.get(&(s.skaddr, s.inode)).copied()) {
            Ok(fresh) => fresh,
            Err(why) => {
                out.push(Kill::new(Outcome::Skipped, why.to_string()));
                continue;
            }
        };
        match destroyer {
            Destroyer::Netlink => {
                let nl = netlink.get_or_insert_with(|| {
                    Netlink::open().map_err(|e| format!("sock_diag: {:#}", anyhow::Error::new(e)))
                });
                out.push(match nl {
                    Ok(nl) => kill_netlink(nl, fresh),
                    Err(e) => Kill::new(Outcome::Failed, e.clone()),
                });
            }
            Destroyer::Bpf(_) if fresh.inode == 0 => out.push(Kill::new(
                Outcome::Skipped,
                "no inode to identify the socket by (bpf-sock-destroy needs one)",
            )),
            Destroyer::Bpf(_) => {
                batch.push((out.len(), (fresh.inode, fresh.skaddr)));
                out.push(Kill::new(Outcome::Failed, "not attempted"));
            }
        }
    }
    if let (Destroyer::Bpf(d), false) = (destroyer, batch.is_empty()) {
        let wanted: Vec<(u64, u64)> = batch.iter().map(|(_, t)| *t).collect();
        match d.destroy(&wanted) {
            Ok(results) => {
                for ((i, _), r) in batch.iter().zip(results) {
                    out[*i] = match r {
                        DestroyResult::Destroyed => Kill::killed(None),
                        DestroyResult::NotFound => Kill::new(Outcome::Skipped, CLOSED),
                        DestroyResult::Mismatch => Kill::new(
                            Outcome::Skipped,
                            "inode now belongs to another socket: not the selected one",
                        ),
                        DestroyResult::Errno(e) => Kill::new(
                            Outcome::Failed,
                            format!("bpf_sock_destroy: {}", std::io::Error::from_raw_os_error(e)),
                        ),
                    };
                }
            }
            Err(e) => {
                let e = format!("{:#}", anyhow::Error::new(e));
                for (i, _) in &batch {
                    out[*i] = Kill::new(Outcome::Failed, format!("bpf_sock_destroy: {e}"));
                }
            }
        }
    }
    out
}

/// Why a target is no longer killed when re-read right before the kill (the decision's reason).
#[derive(Debug, thiserror::Error)]
enum Recheck {
    #[error("gone before the kill")]
    Gone,
    #[error("owner changed since selection")]
    OwnerChanged,
    #[error("no longer matches on re-check (state {state}, idle {idle})")]
    NoLongerMatches {
        state: crate::table::TcpState,
        idle: String,
    },
}

/// The fresh view of a target if it still qualifies: same socket, same owner, still selected
/// and still old/idle enough.
fn recheck<'a>(
    p: &PolicyConfig,
    was: &Socket,
    now: Option<&'a Socket>,
) -> Result<&'a Socket, Recheck> {
    let now = now.ok_or(Recheck::Gone)?;
    if now.netns.inode != was.netns.inode {
        return Err(Recheck::Gone);
    }
    if now.pid() != was.pid() {
        return Err(Recheck::OwnerChanged);
    }
    if !selected(&p.select, now) || !old_enough(p, now) {
        return Err(Recheck::NoLongerMatches {
            state: now.state,
            idle: now
                .idle()
                .map(crate::present::human)
                .unwrap_or_else(|| "-".into()),
        });
    }
    Ok(now)
}

/// Exact lookup by 4-tuple (same inode), then SOCK_DESTROY by that cookie.
fn kill_netlink(nl: &Netlink, now: &Socket) -> Kill {
    match nl.lookup(now.local.into(), now.peer.into()) {
        Ok(None) => Kill::new(Outcome::Skipped, CLOSED),
        Ok(Some(d)) if d.inode as u64 != now.inode && now.inode != 0 => Kill::new(
            Outcome::Skipped,
            format!(
                "4-tuple now belongs to inode {}: not the selected socket",
                d.inode
            ),
        ),
        Ok(Some(d)) => {
            let cookie = Some(cookie_u64(d.cookie));
            match nl.destroy(now.local.into(), now.peer.into(), d.cookie) {
                Ok(()) => Kill::killed(cookie),
                Err(e) if e.errno() == Some(libc::ENOENT) => {
                    Kill::new(Outcome::Skipped, CLOSED).with_cookie(cookie)
                }
                Err(e) => Kill::new(
                    Outcome::Failed,
                    format!("SOCK_DESTROY: {:#}", anyhow::Error::new(e)),
                )
                .with_cookie(cookie),
            }
        }
        Err(e) => Kill::new(
            Outcome::Failed,
            format!("sock_diag lookup: {:#}", anyhow::Error::new(e)),
        ),
    }
}
