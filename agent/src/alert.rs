//! Alert lifecycle: findings become firing alerts (sent once, then every repeat interval) and
//! resolved alerts when they clear. Pure; `notify` holds what is sent, `webhook` sends it.
use std::{
    collections::{btree_map::Entry, BTreeMap},
    time::{Duration, Instant},
};

use chrono::{DateTime, Utc};

use crate::{
    detect::Finding,
    notify::{Alert, Notification, Status},
};

struct Active {
    started_at: DateTime<Utc>,
    last_sent: Instant,
    /// The finding as last seen, sent again with status "resolved" when it clears.
    last: Finding,
}

pub struct Tracker {
    host: String,
    repeat: Duration,
    active: BTreeMap<String, Active>,
}

/// What one scan produced: the current alerts, and what to notify now.
pub struct Update {
    pub current: Vec<Alert>,
    pub notify: Vec<Notification>,
}

impl Tracker {
    pub fn new(host: String, repeat: Duration) -> Self {
        Tracker {
            host,
            repeat,
            active: BTreeMap::new(),
        }
    }

    pub fn update(&mut self, findings: Vec<Finding>, now: Instant, wall: DateTime<Utc>) -> Update {
        let mut current = Vec::new();
        let mut notify = Vec::new();
        let mut seen = std::collections::BTreeSet::new();
        for f in findings {
            if !seen.insert(f.fingerprint.clone()) {
                continue; // one alert per fingerprint
            }
            let (active, new, changed) = match self.active.entry(f.fingerprint.clone()) {
                Entry::Occupied(o) => {
                    let a = o.into_mut();
                    // A changed verdict is news (a quota saturated by young connections first
                    // reads as "load", and as "leak" once they have been idle): notify again.
                    let changed = a.last.verdict != f.verdict;
                    if changed {
                        tracing::warn!(kind = f.kind.as_str(), fingerprint = %f.fingerprint, "verdict changed: {}", f.summary);
                    }
                    a.last = f.clone();
                    (a, false, changed)
                }
                Entry::Vacant(v) => {
                    tracing::warn!(kind = f.kind.as_str(), fingerprint = %f.fingerprint, "firing: {}", f.summary);
                    let a = v.insert(Active {
                        started_at: wall,
                        last_sent: now,
                        last: f.clone(),
                    });
                    (a, true, false)
                }
            };
            let alert = Alert {
                status: Status::Firing,
                host: self.host.clone(),
                started_at: active.started_at,
                ended_at: None,
                finding: f,
            };
            if new {
                notify.push(Notification::Fired(alert.clone()));
            } else if changed || now.duration_since(active.last_sent) >= self.repeat {
                active.last_sent = now;
                notify.push(Notification::Updated(alert.clone()));
            }
            current.push(alert);
        }
        let gone: Vec<String> = self
            .active
            .keys()
            .filter(|k| !seen.contains(*k))
            .cloned()
            .collect();
        for key in gone {
            if let Some(a) = self.active.remove(&key) {
                tracing::info!(fingerprint = %key, "resolved");
                notify.push(Notification::Resolved(Alert {
                    finding: a.last,
                    status: Status::Resolved,
                    host: self.host.clone(),
                    started_at: a.started_at,
                    ended_at: Some(wall),
                }));
            }
        }
        Update { current, notify }
    }

    /// Fingerprints currently firing.
    #[cfg(test)]
    pub fn firing(&self) -> usize {
        self.active.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::detect::{Kind, Verdict};

    fn alert(n: &Notification) -> &Alert {
        match n {
            Notification::Fired(a) | Notification::Updated(a) | Notification::Resolved(a) => a,
            Notification::Reclaimed(_) => panic!("not an alert: {n:?}"),
        }
    }

    fn finding(fp: &str, count: usize) -> Finding {
        let mut f = crate::detect::testutil_finding(Kind::CloseWaitBuildup, fp);
        f.count = count;
        f
    }

    #[test]
    fn verdict_change_is_notified_again() {
        let mut t = Tracker::new("h1".into(), Duration::from_secs(3600));
        let t0 = Instant::now();
        let w0 = Utc::now();
        let mut f = finding("q", 64);
        f.verdict = Some(Verdict::Load);
        assert_eq!(t.update(vec![f.clone()], t0, w0).notify.len(), 1);
        assert!(t.update(vec![f.clone()], t0, w0).notify.is_empty());
        f.verdict = Some(Verdict::Leak);
        let u = t.update(vec![f.clone()], t0 + Duration::from_secs(3), w0);
        assert_eq!(u.notify.len(), 1);
        assert!(matches!(u.notify[0], Notification::Updated(_)));
        assert_eq!(alert(&u.notify[0]).finding.verdict, Some(Verdict::Leak));
        assert_eq!(alert(&u.notify[0]).started_at, w0, "same alert, same start");
        assert!(t
            .update(vec![f], t0 + Duration::from_secs(4), w0)
            .notify
            .is_empty());
    }

    #[test]
    fn fires_once_repeats_then_resolves_with_last_content() {
        let mut t = Tracker::new("h1".into(), Duration::from_secs(3600));
        let t0 = Instant::now();
        let w0 = Utc::now();
        let u = t.update(vec![finding("a", 16)], t0, w0);
        assert_eq!(u.notify.len(), 1);
        assert!(matches!(u.notify[0], Notification::Fired(_)));
        assert_eq!(alert(&u.notify[0]).status, Status::Firing);
        assert_eq!(alert(&u.notify[0]).host, "h1");
        let u = t.update(vec![finding("a", 20)], t0 + Duration::from_secs(5), w0);
        assert!(u.notify.is_empty(), "not re-sent before repeat_interval");
        assert_eq!(u.current[0].finding.count, 20);
        let u = t.update(vec![finding("a", 21)], t0 + Duration::from_secs(3601), w0);
        assert_eq!(u.notify.len(), 1, "re-sent after repeat_interval");
        let u = t.update(vec![], t0 + Duration::from_secs(3700), w0);
        assert_eq!(u.notify.len(), 1);
        assert!(matches!(u.notify[0], Notification::Resolved(_)));
        let r = alert(&u.notify[0]);
        assert_eq!((r.status, r.finding.count), (Status::Resolved, 21));
        assert!(r.ended_at.is_some());
        assert_eq!(t.firing(), 0);
        let json = serde_json::to_value(r).unwrap();
        for key in [
            "kind",
            "status",
            "fingerprint",
            "host",
            "summary",
            "service_port",
            "count",
            "oldest_age_secs",
            "processes",
            "quota",
            "sockets",
            "started_at",
        ] {
            assert!(json.get(key).is_some(), "missing {key} in {json}");
        }
        assert_eq!(json["status"], "resolved");
        assert_eq!(json["kind"], "close_wait_buildup");
    }
}
