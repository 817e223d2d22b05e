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
    started: Instant,
    /// When a notification (fired/updated) was last sent to every receiver.
    last_sent: Instant,
    /// When Alertmanager receivers last got this alert (any notification or a refresh).
    last_refresh: Instant,
    /// The finding as last seen, sent again with status "resolved" when it clears.
    last: Finding,
    /// The finding as last notified, what material changes are measured against.
    sent: Finding,
}

/// How often a firing alert is sent again.
#[derive(Debug, Clone, Copy)]
pub struct Cadence {
    /// Unchanged: every `repeat`.
    pub repeat: Duration,
    /// Materially changed (count, owners): at most every `renotify`; a new verdict at once.
    pub renotify: Duration,
    /// To Alertmanager: every `resend` (it forgets alerts not re-posted).
    pub resend: Duration,
}

impl Cadence {
    pub fn from_config(c: &crate::config::AlertsConfig) -> Cadence {
        Cadence {
            repeat: c.repeat_interval,
            renotify: c.renotify_interval,
            resend: c.alertmanager_resend,
        }
    }
}

pub struct Tracker {
    host: String,
    cadence: Cadence,
    active: BTreeMap<String, Active>,
}

/// What one scan produced: the current alerts, and what to notify now.
pub struct Update {
    pub current: Vec<Alert>,
    pub notify: Vec<Notification>,
}

/// A change worth telling receivers about, and whether it waits for `renotify`.
fn material_change(sent: &Finding, now: &Finding) -> Option<(String, bool)> {
    if sent.verdict != now.verdict {
        let name = |v: Option<crate::detect::Verdict>| v.map_or("none", |v| v.as_str());
        let text = format!("verdict {} -> {}", name(sent.verdict), name(now.verdict));
        return Some((text, false));
    }
    // Grew by half or more (so 8 -> 12, 59 -> 89): the scale of the problem changed.
    if now.count * 2 >= sent.count * 3 && now.count > sent.count {
        return Some((format!("count {} -> {}", sent.count, now.count), true));
    }
    let new_pids: Vec<String> = now
        .processes
        .iter()
        .filter(|p| !sent.processes.iter().any(|q| q.pid == p.pid))
        .map(|p| {
            format!(
                "{} pid {}",
                p.comm,
                p.pid.map_or("?".into(), |x| x.to_string())
            )
        })
        .collect();
    if !new_pids.is_empty() {
        return Some((format!("new process {}", new_pids.join(", ")), true));
    }
    None
}

impl Tracker {
    pub fn new(host: String, cadence: Cadence) -> Self {
        Tracker {
            host,
            cadence,
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
            let mut alert = Alert {
                status: Status::Firing,
                host: self.host.clone(),
                started_at: wall,
                ended_at: None,
                duration_secs: None,
                change: None,
                finding: f,
            };
            let n = match self.active.entry(alert.finding.fingerprint.clone()) {
                Entry::Vacant(v) => {
                    let f = &alert.finding;
                    tracing::warn!(kind = f.kind.as_str(), fingerprint = %f.fingerprint, "firing: {}", f.summary);
                    v.insert(Active {
                        started_at: wall,
                        started: now,
                        last_sent: now,
                        last_refresh: now,
                        last: f.clone(),
                        sent: f.clone(),
                    });
                    Some(Notification::Fired(alert.clone()))
                }
                Entry::Occupied(o) => Self::again(o.into_mut(), &mut alert, now, self.cadence),
            };
            notify.extend(n);
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
                    duration_secs: Some(crate::present::round_secs(now.duration_since(a.started))),
                    change: None,
                }));
            }
        }
        Update { current, notify }
    }

    /// What to send for an alert that was already firing: an update (changed, or the repeat
    /// interval passed), a refresh for Alertmanager, or nothing.
    fn again(a: &mut Active, alert: &mut Alert, now: Instant, c: Cadence) -> Option<Notification> {
        alert.started_at = a.started_at;
        a.last = alert.finding.clone();
        let since_sent = now.duration_since(a.last_sent);
        let change = material_change(&a.sent, &alert.finding)
            .filter(|(_, waits)| !*waits || since_sent >= c.renotify);
        if let Some((text, _)) = &change {
            let f = &alert.finding;
            tracing::warn!(kind = f.kind.as_str(), fingerprint = %f.fingerprint, change = %text, "changed: {}", f.summary);
        }
        if change.is_some() || since_sent >= c.repeat {
            alert.change = change.map(|(text, _)| text);
            a.sent = alert.finding.clone();
            a.last_sent = now;
            a.last_refresh = now;
            return Some(Notification::Updated(alert.clone()));
        }
        if now.duration_since(a.last_refresh) >= c.resend {
            a.last_refresh = now;
            return Some(Notification::Refresh(alert.clone()));
        }
        None
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
            Notification::Fired(a)
            | Notification::Updated(a)
            | Notification::Resolved(a)
            | Notification::Refresh(a) => a,
            Notification::Reclaimed(_) => panic!("not an alert: {n:?}"),
        }
    }

    /// Hourly repeats, renotify at most every minute, Alertmanager refresh every `resend`.
    fn cadence(resend: u64) -> Cadence {
        Cadence {
            repeat: Duration::from_secs(3600),
            renotify: Duration::from_secs(60),
            resend: Duration::from_secs(resend),
        }
    }

    fn finding(fp: &str, count: usize) -> Finding {
        let mut f = crate::detect::testutil_finding(Kind::CloseWaitBuildup, fp);
        f.count = count;
        f
    }

    #[test]
    fn verdict_change_is_notified_again() {
        let mut t = Tracker::new("h1".into(), cadence(7200));
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
        let mut t = Tracker::new("h1".into(), cadence(7200));
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
        assert_eq!(json["duration_secs"], 3700.0);
    }

    #[test]
    fn material_changes_renotify_at_most_once_a_minute() {
        let mut t = Tracker::new("h1".into(), cadence(7200));
        let t0 = Instant::now();
        let w0 = Utc::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        assert_eq!(t.update(vec![finding("p", 8)], t0, w0).notify.len(), 1);
        // 8 -> 11 is not half again: nothing.
        assert!(t
            .update(vec![finding("p", 11)], at(70), w0)
            .notify
            .is_empty());
        // 8 -> 59 is, and a minute has passed since the last notification: an update naming it.
        let u = t.update(vec![finding("p", 59)], at(80), w0);
        assert!(matches!(u.notify[..], [Notification::Updated(_)]));
        assert_eq!(alert(&u.notify[0]).change.as_deref(), Some("count 8 -> 59"));
        assert_eq!(alert(&u.notify[0]).finding.count, 59);
        // 59 -> 100 ten seconds later: rate-limited until a minute after the last one.
        assert!(t
            .update(vec![finding("p", 100)], at(90), w0)
            .notify
            .is_empty());
        let u = t.update(vec![finding("p", 100)], at(141), w0);
        assert_eq!(
            alert(&u.notify[0]).change.as_deref(),
            Some("count 59 -> 100")
        );
        // A new owning process is news too.
        let mut f = finding("p", 100);
        f.processes.push(crate::detect::ProcessCount {
            pid: Some(812),
            comm: "node".into(),
            unit: None,
            count: 1,
            ..Default::default()
        });
        let u = t.update(vec![f], at(202), w0);
        assert_eq!(
            alert(&u.notify[0]).change.as_deref(),
            Some("new process node pid 812")
        );
    }

    /// The same problem in two namespaces is two alerts, each resolving on its own.
    #[test]
    fn one_alert_per_namespace() {
        use crate::detect::scope_testutil::netns;
        let mut t = Tracker::new("h1".into(), cadence(7200));
        let (t0, w0) = (Instant::now(), Utc::now());
        let a = finding("java:8080", 20).scoped(&netns(1, Some("a")), None);
        let b = finding("java:8080", 20).scoped(&netns(2, Some("b")), None);
        let u = t.update(vec![a.clone(), b], t0, w0);
        assert_eq!((u.current.len(), u.notify.len()), (2, 2));
        let u = t.update(vec![a], t0 + Duration::from_secs(5), w0);
        assert_eq!(u.current.len(), 1);
        assert!(
            matches!(&u.notify[..], [Notification::Resolved(r)] if r.finding.netns == 2),
            "{:?}",
            u.notify
        );
    }

    #[test]
    fn alertmanager_gets_refreshes_between_updates() {
        let mut t = Tracker::new("h1".into(), cadence(60));
        let t0 = Instant::now();
        let w0 = Utc::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        t.update(vec![finding("r", 16)], t0, w0);
        assert!(t
            .update(vec![finding("r", 16)], at(30), w0)
            .notify
            .is_empty());
        let u = t.update(vec![finding("r", 16)], at(61), w0);
        assert!(
            matches!(u.notify[..], [Notification::Refresh(_)]),
            "{:?}",
            u.notify
        );
        assert!(t
            .update(vec![finding("r", 16)], at(90), w0)
            .notify
            .is_empty());
        assert_eq!(
            t.update(vec![finding("r", 16)], at(122), w0).notify.len(),
            1
        );
    }
}
