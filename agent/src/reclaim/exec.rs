//! One reclaim round: arm, plan, re-check each target against the kernel right before the kill,
//! destroy through netlink, and record every decision in the audit log.
use std::{
    collections::{HashMap, VecDeque},
    fs::{self, OpenOptions},
    io::Write,
    path::PathBuf,
};

use serde::Serialize;

use super::{armed, decision, mode_name, old_enough, plan, selected, Decision, Outcome};
use crate::{
    config::{Config, DestroyMechanism, PolicyConfig, PolicyMode},
    detect::QuotaRef,
    kernel::{
        destroy::{self, BpfDestroyer, DestroyResult},
        diag, Kernel,
    },
    quota::QuotaStatus,
    scan::Scanner,
    table::Socket,
};

const RECENT: usize = 1000;

#[derive(Debug, Default, Serialize)]
pub struct RoundResult {
    pub policy: String,
    pub mode: String,
    /// Why the policy did nothing this round (not armed, waiting for a fresh reading...).
    pub note: Option<String>,
    pub quota: Option<QuotaRef>,
    pub decisions: Vec<Decision>,
}

impl RoundResult {
    pub fn killed(&self) -> usize {
        self.decisions
            .iter()
            .filter(|d| d.result == Outcome::Killed)
            .count()
    }
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
    ) -> Result<Destroyer, String> {
        let fallback = |e| format!("bpf_sock_destroy fallback: {:#}", e);
        let bpf = || -> Result<Destroyer, String> {
            let mut d = kernel
                .destroyer(verbose)
                .map_err(|e| fallback(anyhow::Error::new(e)))?;
            d.probe().map_err(|e| fallback(anyhow::Error::new(e)))?;
            Ok(Destroyer::Bpf(d))
        };
        let netlink = || diag::probe().map_err(|e| format!("{:#}", anyhow::Error::new(e)));
        match wanted {
            DestroyMechanism::Netlink => netlink().map(|_| Destroyer::Netlink),
            DestroyMechanism::BpfIter => bpf(),
            DestroyMechanism::Auto => match netlink() {
                Ok(_) => Ok(Destroyer::Netlink),
                Err(netlink) => {
                    tracing::warn!(reason = %netlink, "netlink socket destroy unavailable; trying the bpf_sock_destroy fallback");
                    bpf().map_err(|fallback| format!("{netlink}; {fallback}"))
                }
            },
        }
    }
}

pub struct Reclaimer {
    /// The destroy mechanism, or why there is none.
    pub mechanism: Result<Destroyer, String>,
    audit_path: PathBuf,
    recent: VecDeque<Decision>,
    /// Per policy: when its last killing round ended (RFC 3339 UTC, ms). A quota-triggered
    /// policy acts again only on a reading whose poll was sent after that, so it never acts
    /// twice on counts that do not include its own kills.
    acted_on: HashMap<String, String>,
    rounds: u64,
}

impl Reclaimer {
    pub fn new(cfg: &Config, kernel: &Kernel, verbose: bool) -> Self {
        let mechanism = Destroyer::choose(cfg.reclaim.mechanism, kernel, verbose);
        match &mechanism {
            Ok(m) => tracing::info!(mechanism = m.name(), "socket destroy works"),
            Err(e) if cfg.policy.iter().any(|p| p.mode == PolicyMode::Enforce) => {
                tracing::error!(reason = %e, "NO socket destroy mechanism: enforce policies will run as DRY-RUN")
            }
            Err(e) => tracing::warn!(reason = %e, "no socket destroy mechanism"),
        }
        Reclaimer {
            mechanism,
            audit_path: PathBuf::from(&cfg.reclaim.audit_log),
            recent: VecDeque::new(),
            acted_on: HashMap::new(),
            rounds: 0,
        }
    }

    pub fn mechanism_name(&self) -> &str {
        match &self.mechanism {
            Ok(m) => m.name(),
            Err(_) => "none",
        }
    }

    pub fn recent(&self) -> Vec<Decision> {
        self.recent.iter().cloned().collect()
    }

    fn audit(&mut self, decisions: &[Decision]) -> std::io::Result<()> {
        // One write(2) for the whole round: `writeln!` on a File issues the line and its
        // newline separately, so another appender (`connreap reclaim`) or a crash could
        // splice or truncate lines.
        let mut buf = String::new();
        for d in decisions {
            buf.push_str(&serde_json::to_string(d).map_err(std::io::Error::other)?);
            buf.push('\n');
        }
        let mut f = open_audit(&self.audit_path)?;
        f.write_all(buf.as_bytes())?;
        f.flush()
    }

    /// Run one round of `policy` against `table`. `force_dry_run` for `--dry-run` requests.
    pub fn round(
        &mut self,
        p: &PolicyConfig,
        cfg: &Config,
        scanner: &mut Scanner,
        table: &[Socket],
        quotas: &[QuotaStatus],
        force_dry_run: bool,
    ) -> RoundResult {
        let mut res = RoundResult {
            policy: p.name.clone(),
            ..Default::default()
        };
        let quota = match armed(p, quotas, cfg.detect.quota_saturation) {
            Ok(q) => q,
            Err(why) => {
                res.mode = mode_name(p.mode).into();
                res.note = Some(why);
                return res;
            }
        };
        let reading = quotas
            .iter()
            .find(|q| Some(&q.name) == p.quota.as_ref())
            .and_then(|q| q.last_poll.clone());
        let mut mode = mode_name(p.mode).to_string();
        let mut enforce = p.mode == PolicyMode::Enforce && !force_dry_run;
        if force_dry_run && p.mode == PolicyMode::Enforce {
            mode = "dry-run (requested)".into();
        }
        if enforce {
            if let Err(why) = &self.mechanism {
                enforce = false;
                mode = format!("dry-run (enforce requested, but no destroy mechanism: {why})");
            } else if let Err(e) = open_audit(&self.audit_path) {
                enforce = false;
                mode = format!(
                    "dry-run (enforce requested, but the audit log {} is not writable: {e})",
                    self.audit_path.display()
                );
            } else if reading.is_some()
                && self
                    .acted_on
                    .get(&p.name)
                    .is_some_and(|t| reading.as_ref() <= Some(t))
            {
                res.mode = mode;
                res.note =
                    Some("waiting for a quota reading taken after the last round's kills".into());
                return res;
            }
        }
        res.mode = mode.clone();
        res.quota = quota.clone();
        let own = std::process::id();
        let planned = plan(p, &cfg.reclaim, own, table);
        for (s, why) in &planned.skipped {
            res.decisions.push(decision(
                p,
                &mode,
                s,
                &quota,
                Outcome::Skipped,
                Some(why.clone()),
            ));
        }
        if !enforce {
            for s in &planned.targets {
                res.decisions
                    .push(decision(p, &mode, s, &quota, Outcome::WouldKill, None));
            }
        } else if !planned.targets.is_empty() {
            // Re-read the table right before killing: same socket (address and inode), same
            // owner, still selected and still idle enough.
            match scanner.scan() {
                Err(e) => {
                    for s in &planned.targets {
                        res.decisions.push(decision(
                            p,
                            &mode,
                            s,
                            &quota,
                            Outcome::Failed,
                            Some(format!("re-check scan failed: {e}")),
                        ));
                    }
                }
                Ok(fresh) => {
                    let now: HashMap<(u64, u64), &Socket> =
                        fresh.iter().map(|s| ((s.skaddr, s.inode), s)).collect();
                    let outcomes = match self.mechanism.as_mut() {
                        Ok(destroyer) => kill_all(p, destroyer, &planned.targets, &now),
                        Err(_) => Vec::new(),
                    };
                    for (s, (outcome, why, cookie)) in planned.targets.iter().zip(outcomes) {
                        let mut d = decision(p, &mode, s, &quota, outcome, why);
                        if let Some(c) = cookie {
                            // The cookie the kill went by (the table's may still be 0).
                            d.cookie = Some(format!("{c:#x}"));
                        }
                        res.decisions.push(d);
                    }
                }
            }
            if res.killed() > 0 && reading.is_some() {
                let done = crate::present::rfc3339_ms(chrono::Utc::now());
                self.acted_on.insert(p.name.clone(), done);
            }
        }
        if !res.decisions.is_empty() {
            self.rounds += 1;
            for d in &mut res.decisions {
                d.round = self.rounds;
            }
            if let Err(e) = self.audit(&res.decisions) {
                tracing::error!(path = %self.audit_path.display(), error = %e, "cannot append to the audit log");
            }
            for d in &res.decisions {
                tracing::info!(policy = %d.policy, mode = %d.mode, result = ?d.result, reason = d.reason.as_deref().unwrap_or(""),
                    local = %d.local, peer = %d.peer, pid = ?d.pid, comm = %d.comm, "reclaim decision");
                self.recent.push_back(d.clone());
            }
            while self.recent.len() > RECENT {
                self.recent.pop_front();
            }
        }
        res
    }
}

fn open_audit(path: &PathBuf) -> std::io::Result<fs::File> {
    if let Some(dir) = path.parent() {
        fs::create_dir_all(dir)?;
    }
    OpenOptions::new().create(true).append(true).open(path)
}

/// sock_diag's cookie (two host-order u32, low word first) as the kernel's u64 socket cookie.
fn cookie_u64(c: [u8; 8]) -> u64 {
    let lo = u32::from_ne_bytes([c[0], c[1], c[2], c[3]]);
    let hi = u32::from_ne_bytes([c[4], c[5], c[6], c[7]]);
    (u64::from(hi) << 32) | u64::from(lo)
}

type KillOutcome = (Outcome, Option<String>, Option<u64>);

/// Re-check every target against its fresh kernel view and destroy those that still qualify.
/// One outcome per target, in order; also the cookie a netlink destroy went by.
fn kill_all(
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
                out.push((Outcome::Skipped, Some(why), None));
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

/// The fresh view of a target if it still qualifies: same socket, same owner, still selected
/// and still old/idle enough.
fn recheck<'a>(
    p: &PolicyConfig,
    was: &Socket,
    now: Option<&'a Socket>,
) -> Result<&'a Socket, String> {
    let Some(now) = now else {
        return Err("gone before the kill".into());
    };
    if now.pid() != was.pid() {
        return Err("owner changed since selection".into());
    }
    if !selected(&p.select, now) || !old_enough(p, now) {
        return Err(format!(
            "no longer matches on re-check (state {}, idle {})",
            now.state,
            now.idle
                .map(crate::present::human)
                .unwrap_or_else(|| "-".into())
        ));
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
                Err(e) => (Outcome::Failed, Some(format!("SOCK_DESTROY: {e}")), cookie),
            }
        }
        Err(e) => (
            Outcome::Failed,
            Some(format!("sock_diag lookup: {e}")),
            None,
        ),
    }
}
