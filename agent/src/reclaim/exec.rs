//! One reclaim round: arm, plan, write the kill intents, re-check and kill (`kill`), and record
//! every decision in the audit log.
use std::{
    collections::{HashMap, VecDeque},
    path::PathBuf,
    time::{Duration, Instant},
};

use chrono::{DateTime, Utc};
use serde::Serialize;

use super::{
    armed,
    audit::AuditLog,
    decision,
    kill::{kill_all, Kill},
    lock::{LockError, ReclaimLock},
    plan, spared, Decision, Mode, Outcome, PolicyNote, QuotaReach,
};
use crate::{
    config::{Config, PolicyConfig, PolicyMode, Trigger},
    detect::{feeders, QuotaRef, Relations},
    kernel::{
        destroy::{Destroyer, MechanismError},
        Kernel,
    },
    quota::QuotaStatus,
    quota::Scope,
    scan::Scanner,
    table::Socket,
};

const RECENT: usize = 1000;
/// How the reason of a target spared at the re-check (after its kill intent) begins.
const RECHECK: &str = "at the re-check: ";

/// Where a quota-saturated policy may act this round: its quota's namespace and the feeders'
/// (see [`QuotaReach`]); None for other policies.
fn reach<'a>(
    p: &'a PolicyConfig,
    cfg: &'a Config,
    quotas: &[QuotaStatus],
    rel: &Relations<'_>,
) -> Option<QuotaReach<'a>> {
    if p.trigger != Trigger::QuotaSaturated {
        return None;
    }
    let qcfg = cfg.quota.iter().find(|q| Some(&q.name) == p.quota.as_ref());
    let feeding = match (
        qcfg,
        quotas.iter().find(|q| Some(&q.name) == p.quota.as_ref()),
    ) {
        (Some(q), Some(st)) if st.error.is_none() => {
            feeders(q, st, cfg.detect.quota_saturation, rel)
        }
        _ => Vec::new(),
    };
    Some(QuotaReach {
        quota: Scope::at(qcfg.and_then(|q| q.place()), rel.table()),
        feeders: feeding,
    })
}
/// The audit log rotates past this size, keeping AUDIT_KEEP older files.
const AUDIT_MAX_BYTES: u64 = 64 * 1024 * 1024;
const AUDIT_KEEP: usize = 5;

#[derive(Debug, Serialize)]
pub struct RoundResult {
    pub policy: String,
    pub mode: Mode,
    /// Why the policy did nothing this round (not armed, waiting for a fresh reading...).
    pub note: Option<String>,
    pub quota: Option<QuotaRef>,
    pub decisions: Vec<Decision>,
    /// Why the round's audit lines could not be written, if they could not.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub audit_error: Option<String>,
}

impl RoundResult {
    pub fn killed(&self) -> usize {
        self.decisions
            .iter()
            .filter(|d| d.result == Outcome::Killed)
            .count()
    }
}

/// What a round may do once its policy is armed.
struct Armed {
    mode: Mode,
    quota: Option<QuotaRef>,
    /// When the quota reading the round acts on was taken (quota-triggered policies).
    reading: Option<DateTime<Utc>>,
    /// This round's number (agent_pid + round identify a round).
    round: u64,
    /// Kills this round may still make (max_per_round less what this interval already used).
    budget: usize,
}

/// Who asked for a round: the scan loop's round for this interval, or an extra one (API, CLI).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Asker {
    Scheduled,
    Extra,
}

pub struct Reclaimer {
    /// The destroy mechanism, or why there is none.
    mechanism: Result<Destroyer, MechanismError>,
    audit: AuditLog,
    /// The host-wide reclaim lock, taken when an enforce round first needs it.
    lock: Option<ReclaimLock>,
    /// Role written into the lock file ("daemon" or "cli").
    role: &'static str,
    scan_interval: Duration,
    recent: VecDeque<Decision>,
    /// Per policy: when its last killing round ended. A quota-triggered policy acts again only
    /// on a reading whose poll was sent after that, so it never acts twice on counts that do
    /// not include its own kills.
    acted_on: HashMap<String, DateTime<Utc>>,
    /// Per policy: recent kills and whether a scheduled round made them (the per-interval cap).
    kills: HashMap<String, VecDeque<(Instant, Asker)>>,
    /// Outcome lines of written kill intents that could not be written yet: written first by
    /// the next append (every intent gets its outcome).
    unwritten: Vec<Decision>,
    /// The last audit write error (cleared by the next good write), for /healthz.
    pub audit_error: Option<String>,
    /// Per policy: the last "selects nothing" reason said (its wording without counts).
    nothing: HashMap<String, String>,
    rounds: u64,
}

impl Reclaimer {
    pub fn new(cfg: &Config, kernel: &Kernel, verbose: bool, role: &'static str) -> Self {
        let mechanism = Destroyer::choose(cfg.reclaim.mechanism, || kernel.destroyer(verbose));
        match &mechanism {
            Ok(m) => tracing::info!(mechanism = m.name(), "socket destroy works"),
            Err(e) if cfg.policy.iter().any(|p| p.mode == PolicyMode::Enforce) => {
                tracing::error!(reason = %e, "NO socket destroy mechanism: enforce policies will run as DRY-RUN")
            }
            Err(e) => tracing::warn!(reason = %e, "no socket destroy mechanism"),
        }
        let mut audit = AuditLog::new(
            PathBuf::from(&cfg.reclaim.audit_log),
            AUDIT_MAX_BYTES,
            AUDIT_KEEP,
        );
        // A torn tail and intents left without outcome by an earlier run are repaired now (and
        // retried at the audit log's first use if this fails).
        if let Err(e) = audit.repair() {
            tracing::error!(error = %e, "cannot repair the audit log at start");
        }
        Reclaimer {
            mechanism,
            audit,
            unwritten: Vec::new(),
            lock: None,
            role,
            scan_interval: cfg.agent.scan_interval,
            recent: VecDeque::new(),
            acted_on: HashMap::new(),
            kills: HashMap::new(),
            audit_error: None,
            nothing: HashMap::new(),
            rounds: 0,
        }
    }

    pub fn mechanism_name(&self) -> &'static str {
        match &self.mechanism {
            Ok(m) => m.name(),
            Err(_) => "none",
        }
    }

    /// Take the host-wide reclaim lock now (the one-shot CLI refuses to run without it).
    pub fn acquire_lock(&mut self) -> Result<(), LockError> {
        if self.lock.is_none() {
            self.lock = Some(ReclaimLock::try_acquire(self.role)?);
        }
        Ok(())
    }

    /// Rounds that decided anything so far.
    pub fn rounds(&self) -> u64 {
        self.rounds
    }

    /// The most recent decisions, oldest first.
    pub fn recent(&self) -> Vec<Decision> {
        self.recent.iter().cloned().collect()
    }

    /// Run one round of `policy` against `table`: arm, plan, re-check and kill, record.
    /// `force_dry_run` for `--dry-run` requests.
    #[allow(clippy::too_many_arguments)]
    pub fn round(
        &mut self,
        p: &PolicyConfig,
        cfg: &Config,
        scanner: &mut Scanner,
        table: &[Socket],
        quotas: &[QuotaStatus],
        force_dry_run: bool,
        asker: Asker,
    ) -> RoundResult {
        let armed = match self.arm(p, cfg, quotas, force_dry_run, asker) {
            Ok(a) => a,
            Err((mode, why)) => {
                return RoundResult {
                    policy: p.name.clone(),
                    mode,
                    note: Some(why),
                    quota: None,
                    decisions: Vec::new(),
                    audit_error: None,
                }
            }
        };
        let rel = Relations::new(table);
        let reach = reach(p, cfg, quotas, &rel);
        let mut planned = plan(p, &cfg.reclaim, std::process::id(), &rel, reach.as_ref());
        self.note_nothing(p, &armed, planned.nothing.as_deref());
        let mut decisions: Vec<Decision> = planned
            .skipped
            .iter()
            .map(|(s, why)| {
                let why = Some(why.clone());
                decision(
                    p,
                    &armed.mode,
                    s,
                    &armed.quota,
                    Outcome::Skipped,
                    why,
                    armed.round,
                )
            })
            .collect();
        let mut note = None;
        if armed.mode.enforces() && planned.targets.len() > armed.budget {
            planned.targets.truncate(armed.budget);
            note = Some(format!(
                "max_per_round: {} kill(s) left in this scan interval",
                armed.budget
            ));
        }
        let (executed, audit_error) = self.execute(p, &armed, scanner, &planned.targets, asker);
        decisions.extend(executed);
        let mut armed = armed;
        if let Some(e) = &audit_error {
            // The kill intents could not be written: nothing was killed, say so everywhere.
            armed.mode = Mode::AuditUnwritable(e.clone());
            for d in &mut decisions {
                d.mode = armed.mode.clone();
            }
        }
        let nothing = planned.nothing.clone();
        let mut res = self.record(p, armed, decisions);
        res.note = note.or(nothing);
        if audit_error.is_some() {
            res.audit_error = audit_error;
        }
        res
    }

    /// Say why an armed policy selects nothing, once per change of the reason (its wording
    /// without the counts): a log line, and for a quota-saturated policy (armed because a quota
    /// is full: someone expects it to act) an audit line.
    fn note_nothing(&mut self, p: &PolicyConfig, armed: &Armed, why: Option<&str>) {
        let Some(why) = why else {
            self.nothing.remove(&p.name);
            return;
        };
        let shape: String = why.chars().filter(|c| !c.is_ascii_digit()).collect();
        if self.nothing.get(&p.name) == Some(&shape) {
            return;
        }
        self.nothing.insert(p.name.clone(), shape);
        if p.trigger != Trigger::QuotaSaturated {
            tracing::info!(policy = %p.name, reason = %why, "policy selects nothing");
            return;
        }
        tracing::warn!(policy = %p.name, quota = p.quota.as_deref().unwrap_or(""), reason = %why,
            "policy armed by its quota selects nothing");
        let line = PolicyNote {
            time: Utc::now(),
            policy: p.name.clone(),
            mode: armed.mode.clone(),
            result: "nothing-selected",
            reason: why.to_string(),
            quota: armed.quota.clone(),
            agent_pid: std::process::id(),
            round: armed.round,
        };
        if let Err(e) = self.audit.append(&[line], false) {
            tracing::error!(error = %e, "cannot append to the audit log");
        }
    }

    /// Whether the policy acts this round, and in which mode; Err: the mode and why it does
    /// nothing.
    fn arm(
        &mut self,
        p: &PolicyConfig,
        cfg: &Config,
        quotas: &[QuotaStatus],
        force_dry_run: bool,
        asker: Asker,
    ) -> Result<Armed, (Mode, String)> {
        let mut mode = Mode::of(p.mode, force_dry_run);
        let quota = armed(p, quotas, cfg.detect.quota_saturation)
            .map_err(|why| (mode.clone(), why.to_string()))?;
        let reading = quotas
            .iter()
            .find(|q| Some(&q.name) == p.quota.as_ref())
            .and_then(|q| q.last_poll);
        if mode.enforces() {
            if let Err(why) = &self.mechanism {
                mode = Mode::NoMechanism(why.to_string());
            } else if let Err(e) = self.acquire_lock() {
                mode = Mode::Locked(e.to_string());
            } else if let Err(e) = self.audit.check() {
                mode = Mode::AuditUnwritable(e.to_string());
            } else if reading.is_some_and(|r| self.acted_on.get(&p.name).is_some_and(|t| r <= *t)) {
                let why = "waiting for a quota reading taken after the last round's kills";
                return Err((mode, why.into()));
            }
        }
        Ok(Armed {
            mode,
            quota,
            reading,
            round: self.rounds + 1,
            budget: self.budget(p, asker),
        })
    }

    /// Kills `p` may still make now: max_per_round per scan interval, whoever asks. A
    /// scheduled round does not count the previous scheduled round's kills (one interval ago).
    fn budget(&mut self, p: &PolicyConfig, asker: Asker) -> usize {
        let window = self.scan_interval;
        let kills = self.kills.entry(p.name.clone()).or_default();
        while kills.front().is_some_and(|(t, _)| t.elapsed() >= window) {
            kills.pop_front();
        }
        let used = kills
            .iter()
            .filter(|(_, by)| asker == Asker::Extra || *by == Asker::Extra)
            .count();
        p.max_per_round.saturating_sub(used)
    }

    /// Would-kill decisions in dry-run. In enforce: write and fsync the kill intents first
    /// (if that fails, nothing is killed and the round is a dry run that says why), re-read the
    /// table right before killing and destroy the targets that still qualify (same socket by
    /// address and inode, same owner, still selected and still idle enough).
    fn execute(
        &mut self,
        p: &PolicyConfig,
        armed: &Armed,
        scanner: &mut Scanner,
        targets: &[&Socket],
        asker: Asker,
    ) -> (Vec<Decision>, Option<String>) {
        let (quota, round) = (&armed.quota, armed.round);
        let would_kill = |mode: &Mode| -> Vec<Decision> {
            targets
                .iter()
                .map(|s| decision(p, mode, s, quota, Outcome::WouldKill, None, round))
                .collect()
        };
        if !armed.mode.enforces() || targets.is_empty() {
            return (would_kill(&armed.mode), None);
        }
        let intents: Vec<Decision> = targets
            .iter()
            .map(|s| decision(p, &armed.mode, s, quota, Outcome::KillIntent, None, round))
            .collect();
        if let Err(e) = self.audit.append(&intents, true) {
            let e = e.to_string();
            tracing::error!(error = %e, "cannot write the kill intents durably: this round kills nothing");
            self.audit_error = Some(e.clone());
            return (would_kill(&Mode::AuditUnwritable(e.clone())), Some(e));
        }
        self.audit.intended(&p.name, &intents);
        let Ok(destroyer) = self.mechanism.as_mut() else {
            return (would_kill(&armed.mode), None);
        };
        let mode = &armed.mode;
        // Every target's namespace walked now: a row carried from an earlier walk (a socket no
        // process holds) may be gone.
        let mut inodes: Vec<u32> = targets.iter().map(|s| s.netns.inode).collect();
        inodes.sort_unstable();
        inodes.dedup();
        let fresh = match scanner.scan_walking(&inodes) {
            Ok(fresh) => fresh,
            Err(e) => {
                let why = format!("re-check scan failed: {:#}", anyhow::Error::new(e));
                let failed = targets
                    .iter()
                    .map(|s| decision(p, mode, s, quota, Outcome::Failed, Some(why.clone()), round))
                    .collect();
                return (failed, None);
            }
        };
        let now: HashMap<(u64, u64), &Socket> =
            fresh.iter().map(|s| ((s.skaddr, s.inode), s)).collect();
        // A downstream may have connected since the plan: re-judged on the fresh table.
        let fresh_rel = Relations::new(&fresh);
        let respared: Vec<Option<String>> = targets
            .iter()
            .map(|t| {
                let f = now.get(&(t.skaddr, t.inode))?;
                spared(p, &fresh_rel, f).map(|why| format!("{RECHECK}{why}"))
            })
            .collect();
        let to_kill: Vec<&Socket> = targets
            .iter()
            .zip(&respared)
            .filter(|(_, why)| why.is_none())
            .map(|(s, _)| *s)
            .collect();
        let mechanism = destroyer.name();
        let mut killed_outcomes =
            kill_all(p, destroyer, &to_kill, &now, &scanner.namespaces).into_iter();
        let outcomes: Vec<_> = respared
            .into_iter()
            .map(|why| match why {
                Some(why) => Kill::new(Outcome::Skipped, why),
                None => killed_outcomes
                    .next()
                    .unwrap_or_else(|| Kill::new(Outcome::Failed, "not attempted")),
            })
            .collect();
        let decisions: Vec<Decision> = targets
            .iter()
            .zip(outcomes)
            .map(|(s, k)| {
                let mut d = decision(p, mode, s, quota, k.outcome, k.reason, round);
                if let Some(c) = k.cookie {
                    // The cookie the kill went by (the table's may still be 0).
                    d.cookie = Some(format!("{c:#x}"));
                }
                if d.result == Outcome::Killed {
                    d.mechanism = Some(mechanism);
                }
                d
            })
            .collect();
        let killed = decisions
            .iter()
            .filter(|d| d.result == Outcome::Killed)
            .count();
        let kills = self.kills.entry(p.name.clone()).or_default();
        kills.extend(std::iter::repeat_n((Instant::now(), asker), killed));
        if killed > 0 && armed.reading.is_some() {
            self.acted_on.insert(p.name.clone(), Utc::now());
        }
        (decisions, None)
    }

    /// Number the round, append its decisions to the audit log (repeated skip/would-kill lines
    /// once), log them and keep them for GET /v1/reclaims.
    fn record(&mut self, p: &PolicyConfig, armed: Armed, decisions: Vec<Decision>) -> RoundResult {
        let mut audit_error = None;
        if !decisions.is_empty() {
            self.rounds = armed.round;
            let fresh = self.audit.dedupe(&p.name, &decisions);
            let mut lines = std::mem::take(&mut self.unwritten);
            lines.extend(fresh.iter().cloned());
            match self.audit.append(&lines, true) {
                Ok(()) => {
                    if !fresh.is_empty() {
                        self.audit_error = None;
                    }
                }
                Err(e) => {
                    self.audit.forget(&p.name);
                    // Outcomes of intents already written are kept for the next write.
                    self.unwritten = lines
                        .into_iter()
                        .filter(|d| {
                            matches!(d.result, Outcome::Killed | Outcome::Failed)
                                || d.result == Outcome::Skipped
                                    && d.reason.as_deref().is_some_and(|r| r.starts_with(RECHECK))
                        })
                        .collect();
                    tracing::error!(error = %e, "cannot append to the audit log");
                    self.audit_error = Some(e.to_string());
                    audit_error = Some(e.to_string());
                }
            }
            for d in &fresh {
                let netns = d.netns_name.clone().unwrap_or_else(|| d.netns.to_string());
                tracing::info!(policy = %d.policy, mode = %d.mode, result = d.result.as_str(), reason = d.reason.as_deref(),
                    local = %d.local, peer = %d.peer, pid = d.pid, comm = %d.comm, netns = %netns,
                    container = d.container.as_deref().map(|c| c.get(..12).unwrap_or(c)),
                    quota = d.quota.as_ref().map(|q| q.name.as_str()), mechanism = d.mechanism,
                    "reclaim decision");
                self.recent.push_back(d.clone());
            }
            while self.recent.len() > RECENT {
                self.recent.pop_front();
            }
        }
        RoundResult {
            policy: p.name.clone(),
            mode: armed.mode,
            note: None,
            quota: armed.quota,
            decisions,
            audit_error,
        }
    }
}
