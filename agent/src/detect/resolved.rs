//! What a resolved notification says: the figures when the finding cleared, not a copy of the
//! firing text.
use chrono::{DateTime, Utc};

use super::{Detail, Finding, Freed};
use crate::{config::DetectConfig, present::human, quota::QuotaStatus};

/// The state of things when `f` cleared: the quota's reading now for a quota finding, else
/// the threshold it no longer reaches.
/// `freed`: connections reclaim rounds closed for quotas; those since the alert started
/// (`since`) are named: they are why a quota alert resolves.
pub fn resolution(
    f: &Finding,
    since: DateTime<Utc>,
    cfg: &DetectConfig,
    quotas: &[QuotaStatus],
    freed: &[Freed],
) -> Option<String> {
    let last = format!("last seen: count {}", f.count);
    Some(match &f.detail {
        Detail::QuotaExhaustedByLeak(_) => {
            let q = f.quota.as_ref()?;
            let status = quotas.iter().find(|s| s.name == q.name)?;
            let by_reclaim: Vec<&Freed> = freed
                .iter()
                .filter(|x| x.of(&q.name, f.service_port.unwrap_or_default(), Some(since)))
                .collect();
            let by_reclaim = super::freed_text(&by_reclaim)
                .map(|t| format!("; {t} while it fired"))
                .unwrap_or_default();
            if let Some(e) = &status.error {
                return Some(format!(
                    "quota {} cannot be read ({e}), so it is no longer known to be saturated ({last} of {})",
                    q.name, q.limit
                ));
            }
            match status
                .entries
                .iter()
                .find(|e| Some(e.port) == f.service_port)
            {
                Some(e) => format!(
                    "{} quota on port {} now at {}/{}, below quota_saturation {} (was {}/{}){by_reclaim}",
                    q.name, e.port, e.used, e.limit, cfg.quota_saturation, q.used, q.limit
                ),
                None => format!(
                    "{} quota no longer reports port {} (was {}/{})",
                    q.name,
                    f.service_port.unwrap_or_default(),
                    q.used,
                    q.limit
                ),
            }
        }
        Detail::CloseWaitBuildup { .. } => format!(
            "fewer than close_wait_threshold {} CLOSE_WAIT sockets older than {} ({last})",
            cfg.close_wait_threshold,
            human(cfg.close_wait_min_age)
        ),
        Detail::StuckEstablishedPairs => format!(
            "fewer than stuck_pair_threshold {} pairs idle ≥ {} ({last})",
            cfg.stuck_pair_threshold,
            human(cfg.stuck_pair_min_idle)
        ),
        Detail::IdleEstablishedBuildup(_) => format!(
            "fewer than idle_established_threshold {} one-sided sockets idle ≥ {} ({last})",
            cfg.idle_established_threshold,
            human(cfg.idle_established_min_idle)
        ),
        Detail::ReconnectStorm { rate_per_sec } => format!(
            "new connections below storm_rate {}/s (last seen: {rate_per_sec}/s)",
            cfg.storm_rate,
        ),
        Detail::QuotaSourceUnavailable { .. } => "the quota source answers again".to_string(),
        Detail::FailingUpstream { failing, .. } => format!(
            "fewer than failing_min_failures {} failed connections to {}, or below failing_share {} of the attempts, in the last {} ({last})",
            cfg.failing_min_failures,
            failing.endpoint,
            cfg.failing_share,
            human(cfg.failing_window)
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{detect::QuotaRef, kind::Kind, quota::QuotaEntry};

    #[test]
    fn a_quota_resolves_with_its_reading_now() {
        let mut f = crate::detect::testutil_finding(Kind::QuotaExhaustedByLeak, "relay:21000");
        f.service_port = Some(21000);
        f.quota = Some(QuotaRef {
            name: "relay".into(),
            used: 64,
            limit: 64,
            port: Some(21000),
        });
        let status = QuotaStatus {
            name: "relay".into(),
            source: crate::quota::Source::Http,
            url: None,
            last_poll: None,
            entries: vec![QuotaEntry {
                port: 21000,
                used: 56,
                limit: 64,
            }],
            error: None,
        };
        let since: DateTime<Utc> = "2026-12-06T10:00:00Z".parse().expect("time");
        let status = [status];
        let cfg = DetectConfig::default();
        assert_eq!(
            resolution(&f, since, &cfg, &status, &[]).as_deref(),
            Some("relay quota on port 21000 now at 56/64, below quota_saturation 0.9 (was 64/64)")
        );
        // Kills for this entry while it fired are named; older ones and other entries' are not.
        let kill = |port: u16, at: &str| Freed {
            quota: "relay".into(),
            port: Some(port),
            policy: "relay-leaks".into(),
            at: at.parse().expect("time"),
        };
        let freed = [
            kill(21000, "2026-12-06T10:00:05Z"),
            kill(21000, "2026-12-06T10:00:06Z"),
            kill(21001, "2026-12-06T10:00:06Z"),
            kill(21000, "2026-12-06T09:59:00Z"),
        ];
        assert_eq!(
            resolution(&f, since, &cfg, &status, &freed).as_deref(),
            Some("relay quota on port 21000 now at 56/64, below quota_saturation 0.9 (was 64/64); 2 connections freed by reclaim (policy relay-leaks) while it fired")
        );
        let mut c = crate::detect::testutil_finding(Kind::CloseWaitBuildup, "java:80");
        c.count = 40;
        assert_eq!(
            resolution(&c, since, &cfg, &[], &[]).as_deref(),
            Some("fewer than close_wait_threshold 16 CLOSE_WAIT sockets older than 30s (last seen: count 40)")
        );
    }
}
