//! The kinds of findings: what the detectors report and what `[alerts.severity]` may name.
//! A leaf module, so that config validation and the detectors share one list.
use serde::Serialize;

/// One kind of finding; its name (`as_str`) is what alerts, metrics and the config use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Kind {
    CloseWaitBuildup,
    StuckEstablishedPairs,
    QuotaExhaustedByLeak,
    ReconnectStorm,
    QuotaSourceUnavailable,
    IdleEstablishedBuildup,
    FailingUpstream,
}

impl Kind {
    pub fn as_str(self) -> &'static str {
        match self {
            Kind::CloseWaitBuildup => "close_wait_buildup",
            Kind::StuckEstablishedPairs => "stuck_established_pairs",
            Kind::QuotaExhaustedByLeak => "quota_exhausted_by_leak",
            Kind::ReconnectStorm => "reconnect_storm",
            Kind::QuotaSourceUnavailable => "quota_source_unavailable",
            Kind::IdleEstablishedBuildup => "idle_established_buildup",
            Kind::FailingUpstream => "failing_upstream",
        }
    }
    /// The `severity` label a kind's alerts carry unless `[alerts.severity]` says otherwise:
    /// critical where users are already failing or about to (a full quota, a storm, requests
    /// retried against a broken upstream).
    pub fn default_severity(self) -> &'static str {
        match self {
            Kind::QuotaExhaustedByLeak | Kind::ReconnectStorm | Kind::FailingUpstream => "critical",
            Kind::CloseWaitBuildup
            | Kind::StuckEstablishedPairs
            | Kind::QuotaSourceUnavailable
            | Kind::IdleEstablishedBuildup => "warning",
        }
    }
    pub const ALL: [Kind; 7] = [
        Kind::CloseWaitBuildup,
        Kind::StuckEstablishedPairs,
        Kind::QuotaExhaustedByLeak,
        Kind::ReconnectStorm,
        Kind::QuotaSourceUnavailable,
        Kind::IdleEstablishedBuildup,
        Kind::FailingUpstream,
    ];
}
