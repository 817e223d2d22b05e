//! The daemon's per-scan pipeline, run by the engine thread every `scan_interval` (never on
//! the async runtime): a scan, quota readings, the detectors, alert notifications, reclaim
//! rounds, then what the API serves.
use std::{
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use tokio::sync::{mpsc, watch};

use super::{
    api::{Published, ServedTable, TableView},
    health::{self, Failures},
};
use crate::{
    alert::webhook::Webhooks,
    alert::{Cadence, Tracker},
    config::Config,
    detect::{self, ConnKey, FailTracker, Memory, StormTracker, Target},
    engine::{Core, Periodic, ScanOutput},
    kernel::{
        outcome::Attempts,
        ring::{AttemptKey, OpenKey},
    },
    metrics::Metrics,
    quota::{self, QuotaStatus},
    reclaim::exec::{Asker, RoundResult},
    table::{Netns, Socket},
    tasks::Supervisor,
};

pub struct ScanLoop {
    pub cfg: Config,
    pub host: String,
    pub quotas: quota::feeds::QuotaFeeds,
    /// Active opens from the ring reader, per drain.
    pub opens: mpsc::UnboundedReceiver<Vec<(OpenKey, u64)>>,
    /// Outbound connection attempts whose outcome is known, from the ring reader, per drain.
    pub attempts: mpsc::UnboundedReceiver<Vec<(AttemptKey, Attempts)>>,
    pub published: watch::Sender<Published>,
    pub metrics: Arc<Metrics>,
    pub webhooks: Webhooks,
    /// The supervised background tasks: one that stopped fails the daemon (see [`health`]).
    pub tasks: Supervisor,
}

/// The systemd watchdog is pinged once per scan (in [`Pipeline::tick`]) while the daemon is not
/// failing ([`health::fatal`]), so a watchdog interval
/// near `agent.scan_interval` would kill a healthy daemon whenever one scan runs a little long.
#[derive(Debug, thiserror::Error)]
#[error(
    "the systemd watchdog (WatchdogSec={}) must be at least twice agent.scan_interval ({}): \
     the daemon pings it once per scan; raise WatchdogSec or lower agent.scan_interval",
    humantime::format_duration(*.watchdog),
    humantime::format_duration(*.scan_interval)
)]
pub struct WatchdogTooShort {
    watchdog: Duration,
    scan_interval: Duration,
}

/// At start: refuse a watchdog (`WATCHDOG_USEC` from systemd) shorter than twice the scan
/// interval.
pub fn check_watchdog(scan_interval: Duration) -> Result<(), WatchdogTooShort> {
    let mut usec = 0u64;
    if !sd_notify::watchdog_enabled(false, &mut usec) {
        return Ok(());
    }
    check_watchdog_interval(Duration::from_micros(usec), scan_interval)
}

fn check_watchdog_interval(
    watchdog: Duration,
    scan_interval: Duration,
) -> Result<(), WatchdogTooShort> {
    if watchdog < scan_interval.saturating_mul(2) {
        return Err(WatchdogTooShort {
            watchdog,
            scan_interval,
        });
    }
    Ok(())
}

/// At most one "scan failed" line per this long while scans keep failing (the line counts them).
const ERROR_LOG_EVERY: Duration = Duration::from_secs(60);

/// How long a kill is remembered for the resolved text of a quota alert.
const FREED_KEPT_MINUTES: i64 = 30;

/// State carried from one scan to the next.
struct Carry {
    alerts: Tracker,
    /// What was last written of the firing alerts (kept across restarts), and the last error.
    firing_saved: std::collections::BTreeMap<String, chrono::DateTime<chrono::Utc>>,
    firing_saved_error: Option<String>,
    memory: Memory,
    storm: StormTracker,
    failing: FailTracker,
    window_start: Instant,
    failures: Failures,
    /// Scan and round errors, logged once at once then as a count per interval.
    errors: crate::logging::Repeats,
    /// Why the daemon is failing, as last logged.
    fatal: Option<String>,
}

/// The scan loop and the state it carries from one scan to the next: what the engine thread
/// runs.
pub struct Pipeline {
    lp: ScanLoop,
    carry: Carry,
    watchdog: bool,
}

impl ScanLoop {
    pub fn into_pipeline(self) -> Pipeline {
        let mut alerts = Tracker::new(self.host.clone(), Cadence::from_config(&self.cfg.alerts));
        let firing_saved =
            crate::alert::load_firing(&crate::alert::firing_path(&self.cfg.reclaim.audit_log));
        alerts.inherit(firing_saved.clone());
        let carry = Carry {
            firing_saved,
            firing_saved_error: None,
            alerts,
            memory: Memory::default(),
            storm: StormTracker::default(),
            failing: FailTracker::default(),
            window_start: Instant::now(),
            failures: Failures::default(),
            errors: crate::logging::Repeats::new(ERROR_LOG_EVERY),
            fatal: None,
        };
        let mut watchdog_usec = 0u64;
        let watchdog = sd_notify::watchdog_enabled(false, &mut watchdog_usec);
        Pipeline {
            lp: self,
            carry,
            watchdog,
        }
    }
}

impl Periodic for Pipeline {
    fn interval(&self) -> Duration {
        self.lp.cfg.agent.scan_interval
    }

    fn tick(
        &mut self,
        core: &mut Core,
        report: &mut dyn FnMut(&RoundResult),
        stopping: &AtomicBool,
    ) {
        let (lp, carry) = (&mut self.lp, &mut self.carry);
        let t0 = Instant::now();
        let outcome = lp.once(carry, t0, core, report, stopping);
        lp.metrics.scan_duration.observe(t0.elapsed().as_secs_f64());
        match outcome {
            Ok(()) => carry.failures.ok(),
            Err(e) => carry.failures.failed(e),
        }
        // This thread is the engine: it is alive if this runs.
        let fatal = health::fatal(&carry.failures, None, &lp.tasks.failures());
        lp.published
            .send_modify(|p| p.failures = carry.failures.clone());
        if carry.failures.in_row == 0 && lp.published.borrow().scans == 1 {
            let _ = sd_notify::notify(false, &[sd_notify::NotifyState::Ready]);
            tracing::info!(
                scan_ms = t0.elapsed().as_millis() as u64,
                "first scan done; ready"
            );
        }
        if fatal.is_some() != carry.fatal.is_some() {
            match &fatal {
                Some(cause) => tracing::error!(
                    cause = %cause,
                    "failing: no more watchdog pings (systemd restarts the daemon), /healthz answers 503"
                ),
                None => {
                    tracing::info!("recovered: watchdog pings resume, /healthz answers 200")
                }
            }
        }
        carry.fatal = fatal;
        if self.watchdog && carry.fatal.is_none() {
            let _ = sd_notify::notify(false, &[sd_notify::NotifyState::Watchdog]);
        }
    }
}

impl ScanLoop {
    /// One scan and everything that follows from it; Err: why the scan or the reclaim rounds
    /// failed (then nothing new is published but the error).
    fn once(
        &mut self,
        carry: &mut Carry,
        t0: Instant,
        core: &mut Core,
        report: &mut dyn FnMut(&RoundResult),
        stopping: &AtomicBool,
    ) -> Result<(), String> {
        // Free the published table before building the next one: two tables would double the
        // daemon's memory at 100k sockets. GET /v1/sockets waits for the new one.
        self.published.send_modify(|p| p.table = TableView::Pending);
        let ScanOutput {
            table,
            counters,
            programs,
            tracker,
            namespaces,
        } = match core.scan() {
            Ok(out) => out,
            Err(e) => {
                self.metrics.scan_errors.inc();
                let e = format!("scan failed: {:#}", anyhow::Error::new(e));
                carry.errors.record();
                if let Some(n) = carry.errors.due(Instant::now()) {
                    tracing::error!(error = %e, failures = n, "scan failed");
                }
                self.publish_failure(e.clone());
                return Err(e);
            }
        };
        let quotas = Arc::new(self.quotas(&table));
        self.feed_storm(
            &mut carry.storm,
            t0.duration_since(carry.window_start),
            &table,
            &namespaces.known,
        );
        self.feed_failing(
            &mut carry.failing,
            t0,
            t0.duration_since(carry.window_start),
            &namespaces.known,
        );
        carry.window_start = t0;
        let freed = freed(&core.reclaimer.recent(), &quotas);
        let findings = detect::run(
            &detect::Input {
                table: &table,
                cfg: &self.cfg.detect,
                quota_cfgs: &self.cfg.quota,
                quotas: &quotas,
                storm: &carry.storm,
                failing: Some(&carry.failing),
                nat: Some(&crate::kernel::procfs::conntrack),
                freed: &freed,
            },
            &mut carry.memory,
        );
        self.metrics.observe_table(&table);
        self.metrics.observe_findings(&findings);
        self.metrics.observe_kernel(counters);
        self.metrics.observe_programs(&programs);
        self.metrics.observe_namespaces(&namespaces);
        let cfg = &self.cfg.detect;
        let update =
            carry
                .alerts
                .update_with(findings, Instant::now(), chrono::Utc::now(), &|f, since| {
                    detect::resolution(f, since, cfg, &quotas, &freed)
                });
        let firing = carry.alerts.firing_since();
        if firing != carry.firing_saved {
            let path = crate::alert::firing_path(&self.cfg.reclaim.audit_log);
            match crate::alert::save_firing(&path, &firing) {
                Ok(()) => carry.firing_saved = firing,
                Err(e) => {
                    if carry.firing_saved_error.is_none() {
                        tracing::warn!(path = %path.display(), error = %e, "cannot keep the firing alerts for a restart");
                    }
                    carry.firing_saved_error = Some(e.to_string());
                }
            }
        }
        // The API serves the alerts before receivers hear of them: an alert's generatorURL
        // (/v1/findings?fingerprint=...) followed at once finds it.
        let alerts = Arc::new(update.current);
        self.published.send_modify(move |p| p.alerts = alerts);
        for n in &update.notify {
            self.webhooks.send(n);
        }
        for p in &self.cfg.policy {
            // The daemon is shutting down: no round starts.
            if stopping.load(Ordering::Relaxed) {
                break;
            }
            let round = core.round(p, &table, &quotas, false, Asker::Scheduled);
            report(&round);
        }
        self.webhooks.log_drops();
        let queued = self.webhooks.queued();
        self.published.send_modify(|p| {
            p.sockets = table.len();
            p.table = TableView::Ready(Arc::new(ServedTable::new(table)));
            p.quotas = quotas;
            p.last_scan = Some(Instant::now());
            p.last_scan_error = None;
            p.scans += 1;
            p.webhook_queued = queued;
            p.tracker_problem = tracker.problem().map(str::to_string);
            p.netns_failed = namespaces.failed;
        });
        Ok(())
    }

    /// The API answers `error` instead of a table until a scan succeeds again.
    fn publish_failure(&self, error: String) {
        self.published.send_modify(|p| {
            p.table = TableView::Failed(error.clone());
            p.last_scan_error = Some(error);
        });
    }

    /// Active opens since the last scan into the storm tracker, and close its window (the
    /// scan's namespaces name the events' ones; `table` places the connecting processes whose
    /// events did not say where they are).
    fn feed_storm(
        &mut self,
        storm: &mut StormTracker,
        window: Duration,
        table: &[Socket],
        namespaces: &[Arc<Netns>],
    ) {
        while let Ok(opens) = self.opens.try_recv() {
            for (k, n) in opens {
                storm.record_container(k.pid, k.container);
                let key = ConnKey {
                    pid: k.pid,
                    comm: k.comm,
                    port: k.port,
                    netns: k.netns,
                };
                storm.record_connects(key, &k.thread, n);
            }
        }
        storm.set_namespaces(namespaces);
        storm.close_window(window, &self.cfg.detect, table);
    }

    /// Connection outcomes since the last scan into the failing-upstream tracker and the
    /// upstream connection metrics, and close its window.
    fn feed_failing(
        &mut self,
        failing: &mut FailTracker,
        now: Instant,
        window: Duration,
        namespaces: &[Arc<Netns>],
    ) {
        let by_inode: rustc_hash::FxHashMap<u32, &Netns> =
            namespaces.iter().map(|n| (n.inode, &**n)).collect();
        while let Ok(attempts) = self.attempts.try_recv() {
            for (k, a) in attempts {
                let netns = by_inode.get(&k.netns).copied();
                self.metrics.observe_attempts(
                    &k,
                    &a,
                    netns,
                    self.cfg.detect.failing_metrics_by_address,
                );
                let target = Target {
                    pid: k.pid,
                    comm: k.comm,
                    netns: k.netns,
                    remote: k.remote,
                };
                failing.record(target, k.container, &a);
            }
        }
        failing.set_namespaces(namespaces);
        failing.close_window(now, window, &self.cfg.detect);
    }

    /// Every quota source's reading: HTTP sources from their pollers, static ones counted from
    /// `table`.
    fn quotas(&self, table: &[Socket]) -> Vec<QuotaStatus> {
        let now = chrono::Utc::now();
        self.cfg
            .quota
            .iter()
            .map(|q| {
                if q.is_http() {
                    self.quotas.latest(&q.name).unwrap_or_else(|| QuotaStatus {
                        name: q.name.clone(),
                        source: quota::Source::Http,
                        url: q.url.clone(),
                        last_poll: None,
                        entries: vec![],
                        error: None,
                    })
                } else {
                    quota::static_status(q, table, now)
                }
            })
            .collect()
    }
}

/// The connections recent reclaim rounds (scheduled or asked for) closed for a quota whose
/// reading is not yet newer than the kill, from the reclaimer's recent decisions.
fn freed(recent: &[crate::reclaim::Decision], quotas: &[QuotaStatus]) -> Vec<detect::Freed> {
    recent
        .iter()
        .filter(|d| d.result == crate::reclaim::Outcome::Killed)
        .filter_map(|d| {
            let q = d.quota.as_ref()?;
            let reading = quotas.iter().find(|s| s.name == q.name)?.last_poll;
            // Older kills are in the reading already; kept only while an alert that fired
            // before them may still resolve (its text says what the reclaim did).
            let keep = reading.is_none_or(|t| d.time >= t)
                || chrono::Utc::now() - d.time < chrono::Duration::minutes(FREED_KEPT_MINUTES);
            keep.then(|| detect::Freed {
                quota: q.name.clone(),
                port: q.port,
                policy: d.policy.clone(),
                at: d.time,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn watchdog_must_be_twice_the_scan_interval() {
        let s = Duration::from_secs;
        assert!(check_watchdog_interval(s(60), s(5)).is_ok());
        assert!(check_watchdog_interval(s(10), s(5)).is_ok());
        let e = check_watchdog_interval(s(60), s(45)).expect_err("too short");
        let msg = e.to_string();
        assert!(msg.contains("WatchdogSec=1m"), "{msg}");
        assert!(msg.contains("agent.scan_interval (45s)"), "{msg}");
    }
}
