//! What the daemon tells webhook receivers: alert lifecycle events and reclaim rounds, as typed
//! values that `webhook` renders per receiver format.
use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use serde::Serialize;

use crate::{
    detect::{Finding, QuotaRef, MAX_SOCKETS},
    present::{ser_rfc3339, ser_rfc3339_opt},
    reclaim::{exec::RoundResult, Decision, Mode, Outcome},
};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    Firing,
    Resolved,
}

/// A finding as sent to webhooks and served on /v1/findings.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Alert {
    #[serde(flatten)]
    pub finding: Finding,
    pub status: Status,
    pub host: String,
    #[serde(serialize_with = "ser_rfc3339")]
    pub started_at: DateTime<Utc>,
    #[serde(
        serialize_with = "ser_rfc3339_opt",
        skip_serializing_if = "Option::is_none"
    )]
    pub ended_at: Option<DateTime<Utc>>,
    /// Resolved alerts: how long the alert fired, in seconds.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub duration_secs: Option<f64>,
    /// Updates: what changed since the last notification (`count 8 -> 59`,
    /// `verdict pending -> leak`, `new process node pid 812`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub change: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(untagged)]
pub enum Notification {
    /// A finding started firing.
    Fired(Alert),
    /// A firing finding, sent again (its verdict changed, or the repeat interval passed).
    Updated(Alert),
    /// A finding cleared; carries its last observed content.
    Resolved(Alert),
    /// Unchanged and not due for an update: re-posted to Alertmanager receivers only, which
    /// forget alerts that are not re-posted.
    Refresh(Alert),
    /// A reclaim round closed sockets.
    Reclaimed(Reclaimed),
}

impl Notification {
    /// What a log line names this notification by.
    pub fn key(&self) -> &str {
        match self {
            Notification::Fired(a)
            | Notification::Updated(a)
            | Notification::Resolved(a)
            | Notification::Refresh(a) => &a.finding.fingerprint,
            Notification::Reclaimed(r) => &r.policy,
        }
    }
}

/// A process whose sockets a round closed.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ReclaimedProcess {
    pub pid: Option<u32>,
    pub comm: String,
    pub count: usize,
}

/// The `reclaimed` event: one per round that closed anything.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Reclaimed {
    /// Always "reclaimed" (the JSON body's kind, like a finding's).
    pub kind: &'static str,
    /// Always "firing": an event, it never resolves.
    pub status: &'static str,
    pub host: String,
    pub policy: String,
    pub mode: Mode,
    pub count: usize,
    pub summary: String,
    pub processes: Vec<ReclaimedProcess>,
    pub quota: Option<QuotaRef>,
    /// The killed sockets' decisions (at most MAX_SOCKETS).
    pub sockets: Vec<Decision>,
    #[serde(serialize_with = "ser_rfc3339")]
    pub time: DateTime<Utc>,
}

impl Reclaimed {
    /// The event for a round, if it closed anything.
    pub fn from_round(host: &str, round: &RoundResult, time: DateTime<Utc>) -> Option<Reclaimed> {
        let killed: Vec<&Decision> = round
            .decisions
            .iter()
            .filter(|d| d.result == Outcome::Killed)
            .collect();
        let n = killed.len();
        if n == 0 {
            return None;
        }
        let mut owners: BTreeMap<(Option<u32>, &str), usize> = BTreeMap::new();
        for d in &killed {
            *owners.entry((d.pid, d.comm.as_str())).or_default() += 1;
        }
        let quota_text = round
            .quota
            .as_ref()
            .map(|q| format!(" ({} quota at {}/{} before)", q.name, q.used, q.limit))
            .unwrap_or_default();
        Some(Reclaimed {
            kind: "reclaimed",
            status: "firing",
            host: host.to_string(),
            policy: round.policy.clone(),
            mode: round.mode.clone(),
            count: n,
            summary: format!(
                "policy {} closed {n} socket{}{quota_text}",
                round.policy,
                if n == 1 { "" } else { "s" }
            ),
            processes: owners
                .into_iter()
                .map(|((pid, comm), count)| ReclaimedProcess {
                    pid,
                    comm: comm.to_string(),
                    count,
                })
                .collect(),
            quota: round.quota.clone(),
            sockets: killed.into_iter().take(MAX_SOCKETS).cloned().collect(),
            time,
        })
    }
}
