//! Reclaim policies: which sockets a policy may close this round (pure), and the decisions
//! that come out of a round. Execution (re-check, destroy, audit) lives in `exec`.
//!
//! Namespaces: a policy whose `select` names no `netns`/`container` applies in every network
//! namespace; one that names one applies only there. A quota-saturated policy moreover only
//! takes sockets of its quota's namespace and, of each process feeding the quota, that
//! process's sockets in its own namespace (whatever its selector says). `protect_ports` apply
//! in every namespace.
//!
//! Downstreams: a relaying process's upstream that may still serve a connected downstream (see
//! `detect::downstream`) is never taken unless the policy says `include_serving = true`;
//! orphaned ones go first.
pub mod audit;
mod audit_repair;
pub mod exec;
pub mod kill;
pub mod lock;

use chrono::{DateTime, Utc};
use serde::Serialize;

use crate::{
    config::{PolicyConfig, PolicyMode, ReclaimConfig, Selector, Trigger},
    detect::{Orphan, QuotaRef, Relations},
    quota::{QuotaStatus, Scope},
    table::{canon, Socket, TcpState},
};

/// States a policy may act on when it names none.
pub const DEFAULT_STATES: [TcpState; 2] = [TcpState::Established, TcpState::CloseWait];

/// Does the socket match the policy's selectors (not its thresholds)? A socket with no owner
/// (a connection still in a listener's accept queue, or one whose owner was not found) matches
/// only a selector that says `unowned = true`, which config validation allows only with a
/// port: `comm = "?"` (how such sockets are shown) alone never selects them. `netns` is the
/// socket's namespace (a name, an inode or "host"); `container` a prefix of its owner's
/// container id (so an unowned socket never matches it).
pub fn selected(sel: &Selector, s: &Socket) -> bool {
    let states: &[TcpState] = if sel.states.is_empty() {
        &DEFAULT_STATES
    } else {
        &sel.states
    };
    let owner_ok =
        s.owner.is_some() || (sel.unowned && (sel.local_port.is_some() || sel.peer_port.is_some()));
    owner_ok
        && states.contains(&s.state)
        && sel.comm.as_deref().is_none_or(|c| c == s.comm())
        && sel.pid.is_none_or(|p| s.pid() == Some(p))
        && sel
            .unit
            .as_deref()
            .is_none_or(|u| s.owner.as_ref().and_then(|o| o.unit.as_deref()) == Some(u))
        && sel.local_port.is_none_or(|p| p == s.local.port())
        && sel.peer_port.is_none_or(|p| p == s.peer.port())
        && sel.peer.is_none_or(|p| canon(p) == canon(s.peer))
        && sel.netns.as_deref().is_none_or(|n| s.netns.matches(n))
        && sel
            .container
            .as_deref()
            .is_none_or(|c| s.container_id().is_some_and(|id| id.starts_with(c)))
}

/// Idle and age thresholds. Unknown ages count as their lower bound (never over-estimated).
pub fn old_enough(p: &PolicyConfig, s: &Socket) -> bool {
    p.min_idle
        .is_none_or(|min| s.idle().is_some_and(|i| i >= min))
        && p.min_age.is_none_or(|min| s.age() >= min)
}

/// Why a selected socket must not be touched, whatever the policy says.
pub fn protected(rc: &ReclaimConfig, own_pid: u32, s: &Socket) -> Option<String> {
    if matches!(
        s.state,
        TcpState::Listen | TcpState::TimeWait | TcpState::NewSynRecv
    ) {
        return Some(format!("{} sockets are never reclaimed", s.state));
    }
    for port in [s.local.port(), s.peer.port()] {
        if rc.protect_ports.contains(&port) {
            return Some(format!("port {port} is in reclaim.protect_ports"));
        }
    }
    if s.pid() == Some(own_pid) || s.shared_with.contains(&own_pid) {
        return Some("connreap's own socket".into());
    }
    None
}

/// Why a quota-triggered policy is not armed this round (shown in the round's note).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum NotArmed {
    #[error("quota {0} has no reading yet")]
    NoReading(String),
    #[error("quota {name} unavailable ({error}): never act on stale data")]
    Unavailable { name: String, error: String },
    #[error("quota {0} below saturation")]
    BelowSaturation(String),
}

/// Is a quota-saturated policy armed? Ok(Some(quota)) armed, Ok(None) for "always", Err(why not).
pub fn armed(
    p: &PolicyConfig,
    quotas: &[QuotaStatus],
    saturation: f64,
) -> Result<Option<QuotaRef>, NotArmed> {
    if p.trigger == Trigger::Always {
        return Ok(None);
    }
    let name = p.quota.as_deref().unwrap_or("");
    let q = quotas
        .iter()
        .find(|q| q.name == name)
        .ok_or_else(|| NotArmed::NoReading(name.to_string()))?;
    if let Some(e) = &q.error {
        return Err(NotArmed::Unavailable {
            name: name.to_string(),
            error: e.clone(),
        });
    }
    if q.last_poll.is_none() {
        return Err(NotArmed::NoReading(name.to_string()));
    }
    // Fill ratios in floating point: used * limit can overflow u64 on absurd readings (which
    // the quota parser rejects, but this must not panic or wrap whatever it is given).
    let fill = |e: &crate::quota::QuotaEntry| e.used as f64 / e.limit as f64;
    q.entries
        .iter()
        .filter(|e| e.limit > 0 && e.used <= e.limit.saturating_mul(2))
        .filter(|e| fill(e) >= saturation)
        .max_by(|a, b| fill(a).total_cmp(&fill(b)))
        .map(|e| {
            Some(QuotaRef {
                name: name.to_string(),
                used: e.used,
                limit: e.limit,
                port: Some(e.port),
            })
        })
        .ok_or_else(|| NotArmed::BelowSaturation(name.to_string()))
}

/// The sockets to act on this round (orphaned first, then oldest first, at most
/// max_per_round), the selected ones that must be skipped, with why, and, when there are no
/// targets, why the policy selects nothing.
pub struct Plan<'a> {
    pub targets: Vec<&'a Socket>,
    pub skipped: Vec<(&'a Socket, String)>,
    pub nothing: Option<String>,
}

/// Where a quota-saturated policy may act: its quota's namespace (connreap's own if the quota
/// names none) and, for each process feeding that quota, that process's sockets in its own
/// namespace (the proxy's pod, when the leak runs through a relay).
pub struct QuotaReach<'a> {
    pub quota: Scope<'a>,
    /// (pid, namespace inode) of the feeding processes (see `detect::feeders`).
    pub feeders: Vec<(u32, u32)>,
}

impl QuotaReach<'_> {
    fn contains(&self, s: &Socket) -> bool {
        self.quota.contains(s)
            || s.pid()
                .is_some_and(|p| self.feeders.binary_search(&(p, s.netns.inode)).is_ok())
    }

    fn describe(&self) -> String {
        let q = self
            .quota
            .describe()
            .unwrap_or_else(|| "in connreap's own namespace".into());
        if self.feeders.is_empty() {
            format!("the quota's sockets ({q}; no process feeds it through a relay)")
        } else {
            let pids: Vec<String> = self.feeders.iter().map(|(p, _)| p.to_string()).collect();
            format!(
                "the quota's sockets ({q}) and its feeders' (pid {})",
                pids.join(", ")
            )
        }
    }
}

/// Whether the downstream rule spares `s`: it may still serve a connected downstream (see
/// `detect::downstream`), and the policy does not say `include_serving = true`.
pub(super) fn spared(p: &PolicyConfig, rel: &Relations<'_>, s: &Socket) -> Option<String> {
    if p.include_serving {
        return None;
    }
    match rel.serving(s)? {
        Orphan::Orphaned => None,
        Orphan::Serving => {
            Some("serves a connected downstream (include_serving = true to take it anyway)".into())
        }
        Orphan::Ambiguous => Some(
            "may serve a connected downstream: which of its process's upstreams are orphaned is \
             ambiguous (include_serving = true to take it anyway)"
                .into(),
        ),
    }
}

/// `reach`: for a quota-saturated policy, where it may act (see [`QuotaReach`]).
pub fn plan<'a>(
    p: &PolicyConfig,
    rc: &ReclaimConfig,
    own_pid: u32,
    rel: &Relations<'a>,
    reach: Option<&QuotaReach<'_>>,
) -> Plan<'a> {
    let table = rel.table();
    let mut targets = Vec::new();
    let mut skipped = Vec::new();
    // Why sockets the selector matches are not taken, counted for the "selects nothing" note.
    let (mut matched, mut out_of_reach, mut too_young, mut live) = (0usize, 0usize, 0usize, 0usize);
    for s in table.iter().filter(|s| selected(&p.select, s)) {
        matched += 1;
        if reach.is_some_and(|r| !r.contains(s)) {
            out_of_reach += 1;
            continue;
        }
        if !old_enough(p, s) {
            too_young += 1;
            continue;
        }
        if let Some(why) = protected(rc, own_pid, s) {
            skipped.push((s, why));
            continue;
        }
        if let Some(why) = spared(p, rel, s) {
            live += 1;
            skipped.push((s, why));
            continue;
        }
        targets.push(s);
    }
    // Orphaned connections first (their downstream is gone), then the oldest: time in state,
    // then idle time.
    let orphan = |s: &Socket| rel.serving(s) != Some(Orphan::Orphaned);
    targets.sort_by(|a, b| {
        orphan(a)
            .cmp(&orphan(b))
            .then(b.age().cmp(&a.age()))
            .then(b.idle().cmp(&a.idle()))
    });
    targets.truncate(p.max_per_round);
    let nothing = targets.is_empty().then(|| {
        nothing_selected(
            p,
            reach,
            matched,
            out_of_reach,
            too_young,
            live,
            skipped.len(),
        )
    });
    Plan {
        targets,
        skipped,
        nothing,
    }
}

/// Why a policy selects nothing, from the counts of [`plan`].
fn nothing_selected(
    p: &PolicyConfig,
    reach: Option<&QuotaReach<'_>>,
    matched: usize,
    out_of_reach: usize,
    too_young: usize,
    live: usize,
    skipped: usize,
) -> String {
    if matched == 0 {
        return "no socket matches its select".into();
    }
    let mut parts = vec![format!(
        "{matched} socket{} match{} its select",
        if matched == 1 { "" } else { "s" },
        if matched == 1 { "es" } else { "" }
    )];
    if out_of_reach > 0 {
        let reach = reach.map(QuotaReach::describe).unwrap_or_default();
        parts.push(format!(
            "{out_of_reach} outside where a quota-saturated policy acts: {reach}"
        ));
    }
    if too_young > 0 {
        let mut t = Vec::new();
        if let Some(m) = p.min_idle {
            t.push(format!("min_idle {}", humantime::format_duration(m)));
        }
        if let Some(m) = p.min_age {
            t.push(format!("min_age {}", humantime::format_duration(m)));
        }
        parts.push(format!("{too_young} not yet past {}", t.join(" / ")));
    }
    if live > 0 {
        parts.push(format!(
            "{live} spared: they may serve a connected downstream"
        ));
    }
    if skipped > live {
        parts.push(format!("{} protected", skipped - live));
    }
    parts.join("; ")
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Outcome {
    /// Written (and fsynced) before a kill is attempted; the outcome line follows.
    KillIntent,
    WouldKill,
    Killed,
    Skipped,
    Failed,
}

impl Outcome {
    /// The name in audit lines and metric labels.
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::KillIntent => "kill-intent",
            Outcome::WouldKill => "would-kill",
            Outcome::Killed => "killed",
            Outcome::Skipped => "skipped",
            Outcome::Failed => "failed",
        }
    }
}

/// One decision: a line of the audit log and an entry of GET /v1/reclaims.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Decision {
    #[serde(serialize_with = "crate::present::ser_rfc3339")]
    pub time: DateTime<Utc>,
    pub policy: String,
    pub mode: Mode,
    pub result: Outcome,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    pub local: String,
    pub peer: String,
    pub inode: u64,
    /// The socket cookie (the one the kill went by, for kills); null when not known.
    pub cookie: Option<String>,
    pub pid: Option<u32>,
    pub comm: String,
    pub unit: Option<String>,
    /// The socket's network namespace: its inode, and its name when it has one.
    pub netns: u32,
    pub netns_name: Option<String>,
    /// Whether that namespace is connreap's own (not written: `netns` says which it is; the
    /// `reclaimed` event's summary names only the other ones).
    #[serde(skip)]
    pub netns_own: bool,
    /// The full id of the container its owner runs in, when it runs in one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub container: Option<String>,
    /// Killed lines: the destroy mechanism that closed the socket (`netlink-sock-destroy` or
    /// `bpf-sock-destroy`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mechanism: Option<&'static str>,
    pub state: TcpState,
    pub age_secs: f64,
    pub age_exact: bool,
    pub idle_secs: Option<f64>,
    pub quota: Option<QuotaRef>,
    pub agent_pid: u32,
    /// Round number within this agent run (agent_pid + round identify a round).
    pub round: u64,
}

pub fn decision(
    p: &PolicyConfig,
    mode: &Mode,
    s: &Socket,
    quota: &Option<QuotaRef>,
    result: Outcome,
    reason: Option<String>,
    round: u64,
) -> Decision {
    Decision {
        time: Utc::now(),
        policy: p.name.clone(),
        mode: mode.clone(),
        result,
        reason,
        local: s.local.to_string(),
        peer: s.peer.to_string(),
        inode: s.inode,
        cookie: (s.cookie != 0).then(|| format!("{:#x}", s.cookie)),
        pid: s.pid(),
        comm: s.comm().to_string(),
        unit: s.unit(),
        netns: s.netns.inode,
        netns_name: s.netns.name.as_deref().map(String::from),
        netns_own: s.netns.own,
        container: s.container_id().map(String::from),
        mechanism: None,
        state: s.state,
        age_secs: crate::present::round_secs(s.age()),
        age_exact: s.age_exact,
        idle_secs: s.idle().map(crate::present::round_secs),
        quota: quota.clone(),
        agent_pid: std::process::id(),
        round,
    }
}

/// An audit line for an armed quota-saturated policy that selects nothing (written when the
/// reason changes): `result` is `nothing-selected`, `reason` says why.
#[derive(Debug, Clone, Serialize)]
pub struct PolicyNote {
    #[serde(serialize_with = "crate::present::ser_rfc3339")]
    pub time: DateTime<Utc>,
    pub policy: String,
    pub mode: Mode,
    pub result: &'static str,
    pub reason: String,
    pub quota: Option<QuotaRef>,
    pub agent_pid: u32,
    pub round: u64,
}

/// The mode a round runs in: the policy's own, or dry-run and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Mode {
    Enforce,
    DryRun,
    /// An enforce policy run with `--dry-run` / `"dry_run": true`.
    DryRunRequested,
    /// An enforce policy, but no destroy mechanism works here.
    NoMechanism(String),
    /// An enforce policy, but its audit lines cannot be written (the error names the file).
    AuditUnwritable(String),
    /// An enforce policy, but another connreap holds the host's reclaim lock.
    Locked(String),
}

impl Mode {
    /// The mode a policy asks for, before anything can turn it into a dry run.
    pub fn of(p: PolicyMode, requested_dry_run: bool) -> Mode {
        match (p, requested_dry_run) {
            (PolicyMode::DryRun, _) => Mode::DryRun,
            (PolicyMode::Enforce, true) => Mode::DryRunRequested,
            (PolicyMode::Enforce, false) => Mode::Enforce,
        }
    }

    /// Whether this round closes sockets.
    pub fn enforces(&self) -> bool {
        *self == Mode::Enforce
    }
}

impl std::fmt::Display for Mode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Mode::Enforce => f.write_str("enforce"),
            Mode::DryRun => f.write_str("dry-run"),
            Mode::DryRunRequested => f.write_str("dry-run (requested)"),
            Mode::NoMechanism(why) => write!(
                f,
                "dry-run (enforce requested, but no destroy mechanism: {why})"
            ),
            Mode::AuditUnwritable(error) => write!(
                f,
                "dry-run (enforce requested, but the audit log is not writable: {error})"
            ),
            Mode::Locked(why) => write!(f, "dry-run (enforce requested, but {why})"),
        }
    }
}

impl Serialize for Mode {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

#[cfg(test)]
mod tests;
