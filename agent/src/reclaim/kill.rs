//! Destroying sockets: choosing the mechanism at start (netlink SOCK_DESTROY, or the
//! bpf_sock_destroy fallback), and a round's kills, each target re-checked against a fresh
//! kernel view right before it is destroyed.
use std::collections::HashMap;

use super::{old_enough, selected, Outcome};
use crate::{
    config::{DestroyMechanism, PolicyConfig},
    kernel::{
        destroy::{self, BpfDestroyer, DestroyResult},
        diag,
        netns::{self, Namespace},
        Kernel,
    },
    table::Socket,
};

/// A destroy mechanism's own error (netlink or the BPF fallback) with its whole chain.
type Cause = anyhow::Error;

/// Why no destroy mechanism could be set up. Shown in each dry-run decision's `mode`, so the
/// message carries the causes' whole chain (`{:#}`).
#[derive(Debug, thiserror::Error)]
pub enum MechanismError {
    #[error("{0:#}")]
    Netlink(Cause),
    #[error("bpf_sock_destroy fallback: {0:#}")]
    Bpf(Cause),
    #[error("{netlink:#}; bpf_sock_destroy fallback: {fallback:#}")]
    Neither { netlink: Cause, fallback: Cause },
}

/// How a socket gets destroyed.
pub enum Destroyer {
    /// netlink SOCK_DESTROY, by 4-tuple and cookie (what `ss -K` does).
    Netlink,
    /// The bpf_sock_destroy kfunc from an iter/tcp program, by inode and kernel address.
    Bpf(BpfDestroyer),
}

impl Destroyer {
    pub fn name(&self) -> &'static str {
        match self {
            Destroyer::Netlink => diag::MECHANISM,
            Destroyer::Bpf(_) => destroy::MECHANISM,
        }
    }

    /// The configured mechanism, checked on a loopback pair of our own.
    pub fn choose(
        wanted: DestroyMechanism,
        kernel: &Kernel,
        verbose: bool,
    ) -> Result<Destroyer, MechanismError> {
        let bpf = || -> Result<Destroyer, Cause> {
            let mut d = kernel.destroyer(verbose)?;
            d.probe()?;
            Ok(Destroyer::Bpf(d))
        };
        match wanted {
            DestroyMechanism::Netlink => diag::probe()
                .map(|_| Destroyer::Netlink)
                .map_err(|e| MechanismError::Netlink(e.into())),
            DestroyMechanism::BpfIter => bpf().map_err(MechanismError::Bpf),
            DestroyMechanism::Auto => {
                match diag::probe() {
                    Ok(_) => Ok(Destroyer::Netlink),
                    Err(netlink) => {
                        let netlink: Cause = netlink.into();
                        tracing::warn!(reason = format!("{netlink:#}"), "netlink socket destroy unavailable; trying the bpf_sock_destroy fallback");
                        bpf().map_err(|fallback| MechanismError::Neither { netlink, fallback })
                    }
                }
            }
        }
    }
}

/// sock_diag's cookie (two host-order u32, low word first) as the kernel's u64 socket cookie.
fn cookie_u64(c: [u8; 8]) -> u64 {
    let lo = u32::from_ne_bytes([c[0], c[1], c[2], c[3]]);
    let hi = u32::from_ne_bytes([c[4], c[5], c[6], c[7]]);
    (u64::from(hi) << 32) | u64::from(lo)
}

type KillOutcome = (Outcome, Option<String>, Option<u64>);

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
) -> Vec<KillOutcome> {
    let mut out: Vec<Option<KillOutcome>> = vec![None; targets.len()];
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
                    vec![(outcome, Some(why), None); group.len()]
                }),
            None => vec![
                (
                    Outcome::Skipped,
                    Some("network namespace gone before the kill".into()),
                    None,
                );
                group.len()
            ],
        };
        for (i, r) in idx.into_iter().zip(results) {
            out[i] = Some(r);
        }
    }
    out.into_iter()
        .map(|o| o.unwrap_or((Outcome::Failed, Some("not attempted".into()), None)))
        .collect()
}

/// [`kill_all`] for the targets of one namespace, on a thread inside it.
fn kill_in_namespace(
    p: &PolicyConfig,
    destroyer: &mut Destroyer,
    targets: &[&Socket],
    now: &HashMap<(u64, u64), &Socket>,
) -> Vec<KillOutcome> {
    let mut out: Vec<KillOutcome> = Vec::with_capacity(targets.len());
    // Targets for the BPF mechanism, destroyed together in one iterator pass.
    let mut batch: Vec<(usize, (u64, u64))> = Vec::new();
    for s in targets {
        let fresh = match recheck(p, s, now.get(&(s.skaddr, s.inode)).copied()) {
            Ok(fresh) => fresh,
            Err(why) => {
                out.push((Outcome::Skipped, Some(why.to_string()), None));
                continue;
            }
        };
        match destroyer {
            Destroyer::Netlink => out.push(kill_netlink(fresh)),
            Destroyer::Bpf(_) if fresh.inode == 0 => out.push((
                Outcome::Skipped,
                Some("no inode to identify the socket by (bpf-sock-destroy needs one)".into()),
                None,
            )),
            Destroyer::Bpf(_) => {
                batch.push((out.len(), (fresh.inode, fresh.skaddr)));
                out.push((Outcome::Failed, Some("not attempted".into()), None));
            }
        }
    }
    if let (Destroyer::Bpf(d), false) = (destroyer, batch.is_empty()) {
        let wanted: Vec<(u64, u64)> = batch.iter().map(|(_, t)| *t).collect();
        match d.destroy(&wanted) {
            Ok(results) => {
                for ((i, _), r) in batch.iter().zip(results) {
                    out[*i] = match r {
                        DestroyResult::Destroyed => (Outcome::Killed, None, None),
                        DestroyResult::NotFound => (
                            Outcome::Skipped,
                            Some("closed before the kill".into()),
                            None,
                        ),
                        DestroyResult::Mismatch => (
                            Outcome::Skipped,
                            Some(
                                "inode now belongs to another socket: not the selected one".into(),
                            ),
                            None,
                        ),
                        DestroyResult::Errno(e) => (
                            Outcome::Failed,
                            Some(format!(
                                "bpf_sock_destroy: {}",
                                std::io::Error::from_raw_os_error(e)
                            )),
                            None,
                        ),
                    };
                }
            }
            Err(e) => {
                let e = format!("{:#}", anyhow::Error::new(e));
                for (i, _) in &batch {
                    out[*i] = (
                        Outcome::Failed,
                        Some(format!("bpf_sock_destroy: {e}")),
                        None,
                    );
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
                .idle
                .map(crate::present::human)
                .unwrap_or_else(|| "-".into()),
        });
    }
    Ok(now)
}

/// Exact lookup by 4-tuple (same inode), then SOCK_DESTROY by that cookie.
fn kill_netlink(now: &Socket) -> KillOutcome {
    match diag::lookup(now.local.into(), now.peer.into()) {
        Ok(None) => (
            Outcome::Skipped,
            Some("closed before the kill".into()),
            None,
        ),
        Ok(Some(d)) if d.inode as u64 != now.inode && now.inode != 0 => (
            Outcome::Skipped,
            Some(format!(
                "4-tuple now belongs to inode {}: not the selected socket",
                d.inode
            )),
            None,
        ),
        Ok(Some(d)) => {
            let cookie = Some(cookie_u64(d.cookie));
            match diag::destroy(now.local.into(), now.peer.into(), d.cookie) {
                Ok(()) => (Outcome::Killed, None, cookie),
                Err(e) if e.errno() == Some(libc::ENOENT) => (
                    Outcome::Skipped,
                    Some("closed before the kill".into()),
                    cookie,
                ),
                Err(e) => (
                    Outcome::Failed,
                    Some(format!("SOCK_DESTROY: {:#}", anyhow::Error::new(e))),
                    cookie,
                ),
            }
        }
        Err(e) => (
            Outcome::Failed,
            Some(format!("sock_diag lookup: {:#}", anyhow::Error::new(e))),
            None,
        ),
    }
}
