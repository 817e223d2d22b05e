//! Alert lifecycle: findings become firing alerts (sent once, then every repeat interval) and
//! resolved alerts when they clear. Pure; `notify` holds what is sent, `webhook` sends it.
pub mod notify;
pub mod webhook;

use std::{
    collections::{btree_map::Entry, BTreeMap},
    time::{Duration, Instant},
};

use chrono::{DateTime, Utc};

use crate::{
    alert::notify::{Alert, Notification, Status},
    detect::Finding,
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
    /// Alerts that were firing when the daemon last stopped (fingerprint -> when they
    /// started), read back at start: one that fires again is the same alert, not a new one.
    inherited: BTreeMap<String, DateTime<Utc>>,
    /// Scans left before inherited alerts that did not come back are forgotten.
    inherit_scans: u32,
}

/// Scans an alert firing before a restart may take to come back and stay the same alert.
const INHERIT_SCANS: u32 = 3;

/// Where the daemon keeps what is firing across restarts: beside the audit log (the state
/// directory).
pub fn firing_path(audit_log: &str) -> std::path::PathBuf {
    std::path::Path::new(audit_log)
        .parent()
        .unwrap_or(std::path::Path::new("."))
        .join("alerts-firing.json")
}

/// What was firing when the daemon stopped; empty when there is no file. A file that cannot
/// be read or parsed is logged and ignored (the alerts then fire anew).
pub fn load_firing(path: &std::path::Path) -> BTreeMap<String, DateTime<Utc>> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return BTreeMap::new(),
        Err(e) => {
            tracing::warn!(path = %path.display(), error = %e, "cannot read the alerts firing before the restart");
            return BTreeMap::new();
        }
    };
    let parsed: Result<BTreeMap<String, String>, _> = serde_json::from_str(&text);
    let map = parsed.map_err(|e| e.to_string()).and_then(|m| {
        m.into_iter()
            .map(|(k, t)| {
                DateTime::parse_from_rfc3339(&t)
                    .map(|t| (k, t.with_timezone(&Utc)))
                    .map_err(|e| format!("{t}: {e}"))
            })
            .collect::<Result<BTreeMap<_, _>, String>>()
    });
    map.unwrap_or_else(|e| {
        tracing::warn!(path = %path.display(), error = %e, "ignoring a malformed file of alerts firing before the restart");
        BTreeMap::new()
    })
}

/// Write what is firing (a temporary file renamed over the old one: never half a file).
pub fn save_firing(
    path: &std::path::Path,
    firing: &BTreeMap<String, DateTime<Utc>>,
) -> std::io::Result<()> {
    let tmp = path.with_extension("json.tmp");
    let text: BTreeMap<&str, String> = firing
        .iter()
        .map(|(k, t)| (k.as_str(), t.to_rfc3339()))
        .collect();
    let body = serde_json::to_vec(&text).map_err(std::io::Error::other)?;
    std::fs::write(&tmp, body)?;
    std::fs::rename(&tmp, path)
}

/// What one scan produced: the current alerts, and what to notify now.
pub struct Update {
    pub current: Vec<Alert>,
    pub notify: Vec<Notification>,
}

/// A change worth telling receivers about, and whether it waits for `renotify`.
fn material_change(sent: &Finding, now: &Finding) -> Option<(String, bool)> {
    if sent.verdict() != now.verdict() {
        let name = |v: Option<crate::detect::Verdict>| v.map_or("none", |v| v.as_str());
        let text = format!(
            "verdict {} -> {}",
            name(sent.verdict()),
            name(now.verdict())
        );
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
            inherited: BTreeMap::new(),
            inherit_scans: 0,
        }
    }

    /// Take over the alerts that were firing before a restart (see [`Tracker::firing_since`]).
    pub fn inherit(&mut self, firing: BTreeMap<String, DateTime<Utc>>) {
        self.inherited = firing;
        self.inherit_scans = INHERIT_SCANS;
    }

    /// What is firing now and since when (what [`Tracker::inherit`] takes after a restart).
    pub fn firing_since(&self) -> BTreeMap<String, DateTime<Utc>> {
        self.active
            .iter()
            .map(|(k, a)| (k.clone(), a.started_at))
            .chain(self.inherited.iter().map(|(k, t)| (k.clone(), *t)))
            .collect()
    }

    /// [`Tracker::update_with`] saying nothing more at resolution than that it cleared.
    #[cfg(test)]
    pub fn update(&mut self, findings: Vec<Finding>, now: Instant, wall: DateTime<Utc>) -> Update {
        self.update_with(findings, now, wall, &|_, _| None)
    }

    /// One scan's findings. `resolution` gives, for a finding that cleared, the figures now
    /// (e.g. the quota's reading), which the resolved notification states.
    pub fn update_with(
        &mut self,
        findings: Vec<Finding>,
        now: Instant,
        wall: DateTime<Utc>,
        resolution: &dyn Fn(&Finding, DateTime<Utc>) -> Option<String>,
    ) -> Update {
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
                Entry::Vacant(v) if self.inherited.contains_key(v.key()) => {
                    // Firing before the restart and still: the same alert, not news. Alertmanager
                    // receivers get it again at once (they forget what is not re-posted).
                    let started_at = self.inherited.remove(v.key()).unwrap_or(wall);
                    let f = &alert.finding;
                    let l = LogFields::of(f);
                    tracing::info!(kind = f.kind().as_str(), fingerprint = %f.fingerprint, %started_at,
                        pid = l.pid, comm = l.comm, port = f.service_port, netns = %l.netns,
                        container = l.container, pod = l.pod.as_deref(), count = f.count,
                        "still firing since before the restart");
                    alert.started_at = started_at;
                    v.insert(Active {
                        started_at,
                        started: now,
                        last_sent: now,
                        last_refresh: now,
                        last: f.clone(),
                        sent: f.clone(),
                    });
                    Some(Notification::Refresh(alert.clone()))
                }
                Entry::Vacant(v) => {
                    let f = &alert.finding;
                    let l = LogFields::of(f);
                    tracing::warn!(kind = f.kind().as_str(), fingerprint = %f.fingerprint,
                        pid = l.pid, comm = l.comm, port = f.service_port, netns = %l.netns,
                        container = l.container, pod = l.pod.as_deref(), count = f.count,
                        "firing: {}", f.summary);
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
        if self.inherit_scans > 0 {
            self.inherit_scans -= 1;
            if self.inherit_scans == 0 {
                for (key, since) in std::mem::take(&mut self.inherited) {
                    tracing::info!(fingerprint = %key, %since,
                        "was firing before the restart and has not come back: forgotten (no resolved notification: its content was not kept)");
                }
            }
        }
        for key in gone {
            if let Some(a) = self.active.remove(&key) {
                let mut finding = a.last;
                let l = LogFields::of(&finding);
                tracing::info!(kind = finding.kind().as_str(), fingerprint = %key,
                    pid = l.pid, comm = l.comm, port = finding.service_port, netns = %l.netns,
                    container = l.container, pod = l.pod.as_deref(), "resolved");
                let held = crate::present::human(now.duration_since(a.started));
                finding.summary = match resolution(&finding, a.started_at) {
                    Some(now_text) => format!("resolved after {held}: {now_text}"),
                    None => format!(
                        "resolved after {held}: no longer found (last seen: count {}, oldest {})",
                        finding.count,
                        crate::present::human(std::time::Duration::from_secs_f64(
                            finding.oldest_age_secs.max(0.0)
                        ))
                    ),
                };
                notify.push(Notification::Resolved(Alert {
                    finding,
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
            let l = LogFields::of(f);
            tracing::warn!(kind = f.kind().as_str(), fingerprint = %f.fingerprint, change = %text,
                pid = l.pid, comm = l.comm, port = f.service_port, netns = %l.netns,
                container = l.container, pod = l.pod.as_deref(), count = f.count,
                "changed: {}", f.summary);
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

/// A finding's main owner and place as log fields, so log tools can filter on them: values,
/// not debug text (a field with no value is left out). Text written to the log is escaped by
/// the log format itself.
struct LogFields<'a> {
    pid: Option<u32>,
    comm: Option<&'a str>,
    /// Its name, "host", or its inode.
    netns: String,
    /// The short container id.
    container: Option<&'a str>,
    /// `namespace/name`.
    pod: Option<String>,
}

impl<'a> LogFields<'a> {
    fn of(f: &'a Finding) -> LogFields<'a> {
        let owner = f.processes.first();
        let c = f.container.as_ref();
        LogFields {
            pid: owner.and_then(|p| p.pid),
            comm: owner.map(|p| p.comm.as_str()),
            netns: f.netns_label(),
            container: c.map(|c| c.short_id()),
            pod: c.and_then(|c| match (&c.pod_namespace, &c.pod_name) {
                (Some(ns), Some(n)) => Some(format!("{ns}/{n}")),
                (None, Some(n)) => Some(n.clone()),
                _ => None,
            }),
        }
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

    /// After a restart, an alert still firing keeps its start and is not sent as new (only
    /// re-posted to Alertmanager receivers); one that cleared meanwhile is forgotten.
    #[test]
    fn a_restart_does_not_fire_active_alerts_again() {
        let mut t = Tracker::new("h1".into(), cadence(7200));
        let t0 = Instant::now();
        let w0 = Utc::now();
        t.update(vec![finding("a", 16), finding("b", 16)], t0, w0);
        let before = t.firing_since();
        let dir = std::env::temp_dir().join(format!("connreap-firing-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = firing_path(&dir.join("audit.jsonl").display().to_string());
        save_firing(&path, &before).unwrap();
        let mut after = Tracker::new("h1".into(), cadence(7200));
        after.inherit(load_firing(&path));
        let w1 = w0 + chrono::Duration::seconds(30);
        let u = after.update(vec![finding("a", 17)], t0, w1);
        assert!(
            matches!(u.notify[..], [Notification::Refresh(_)]),
            "{:?}",
            u.notify
        );
        assert_eq!(
            u.current[0].started_at,
            before[&u.current[0].finding.fingerprint]
        );
        for i in 1..4 {
            let u = after.update(vec![finding("a", 17)], t0 + Duration::from_secs(i), w1);
            assert!(u.notify.is_empty(), "{:?}", u.notify);
        }
        assert_eq!(after.firing_since().len(), 1, "b was forgotten");
        std::fs::write(&path, "{not json").unwrap();
        assert!(load_firing(&path).is_empty());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn verdict_change_is_notified_again() {
        let mut t = Tracker::new("h1".into(), cadence(7200));
        let t0 = Instant::now();
        let w0 = Utc::now();
        let mut f = crate::detect::testutil_finding(Kind::QuotaExhaustedByLeak, "q");
        f.count = 64;
        f.set_verdict(Verdict::Load);
        assert_eq!(t.update(vec![f.clone()], t0, w0).notify.len(), 1);
        assert!(t.update(vec![f.clone()], t0, w0).notify.is_empty());
        f.set_verdict(Verdict::Leak);
        let u = t.update(vec![f.clone()], t0 + Duration::from_secs(3), w0);
        assert_eq!(u.notify.len(), 1);
        assert!(matches!(u.notify[0], Notification::Updated(_)));
        assert_eq!(alert(&u.notify[0]).finding.verdict(), Some(Verdict::Leak));
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
