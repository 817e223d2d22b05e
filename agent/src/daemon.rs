//! `connreap run`: the scan loop, quota pollers, transition-event reader, webhooks and the API.
use std::{
    collections::BTreeMap,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use anyhow::Context as _;
use aya::maps::{MapData, RingBuf};
use connreap_ebpf::tcp_state;
use tokio::io::unix::AsyncFd;

use crate::{
    alert::Tracker,
    api::{self, AppState},
    config::{Config, QuotaConfig},
    detect::{self, ConnKey, Memory, StormTracker},
    kernel::{events::Flusher, Kernel, KernelError, ProgramStats},
    metrics::{MechanismLabels, Metrics, ReclaimLabels},
    quota::{self, QuotaStatus},
    reclaim::{
        exec::{Reclaimer, RoundResult},
        Outcome,
    },
    scan::Scanner,
    table::Socket,
    webhook::Webhooks,
};

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

pub fn host_name(cfg: &Config) -> String {
    if !cfg.agent.host.is_empty() {
        return cfg.agent.host.clone();
    }
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_else(|_| "unknown".into())
}

/// Feed active opens (CLOSE -> SYN_SENT, seen in the connecting task) to the storm tracker.
async fn read_events(
    ring: RingBuf<MapData>,
    flusher: Flusher,
    storm: Arc<Mutex<StormTracker>>,
    metrics: Arc<Metrics>,
) {
    // SAFETY: the ring's fd is owned by `ring`, which the AsyncFd owns for its whole life.
    let mut fd = match unsafe { AsyncFd::register(ring) } {
        Ok(fd) => fd,
        Err(e) => {
            let (_, e) = e.into_parts();
            tracing::error!(error = %e, "cannot poll the transition ring; reconnect_storm is disabled");
            return;
        }
    };
    let mut flush_failing = false;
    // Partial per-CPU batches are sent on a fixed cadence, not on every wakeup: under load the
    // probe wakes us every 1 MiB of events (tens of times a second), and a flush costs a
    // BPF_PROG_TEST_RUN per CPU, each an IPI that interrupts the CPU doing the work. Full batches
    // need no flush, so a wakeup only drains; no transition waits longer than one tick.
    let mut flush_tick = tokio::time::interval(Duration::from_millis(500));
    flush_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        // The probe wakes us only when a lot is pending; otherwise drain on the tick.
        let flush = tokio::select! {
            r = fd.readable_mut() => match r {
                Ok(mut guard) => {
                    guard.clear_ready();
                    false
                }
                Err(e) => {
                    tracing::error!(error = %e, "transition ring poll failed; reconnect_storm is disabled");
                    return;
                }
            },
            _ = flush_tick.tick() => true,
        };
        if flush {
            match flusher.flush() {
                Ok(round) => {
                    flush_failing = false;
                    metrics.batches_flushed.inc_by(round.sent.into());
                    metrics.flush_busy.inc_by(round.busy.into());
                }
                Err(e) if !flush_failing => {
                    flush_failing = true;
                    tracing::warn!(error = %format_args!("{:#}", anyhow::Error::new(e)), "cannot flush the per-CPU event batches; events arrive in full batches only");
                }
                Err(_) => {}
            }
        }
        let ring = fd.get_mut();
        let mut n = 0u64;
        // Counted per (pid, comm, port) as raw bytes first, then one storm key per distinct
        // triple: a churning client makes tens of thousands of opens a second, each of which
        // would otherwise cost a String and a tree insert.
        let mut opens: rustc_hash::FxHashMap<(u32, [u8; 16], u16), u64> =
            rustc_hash::FxHashMap::default();
        while let Some(item) = ring.next() {
            let events = match crate::kernel::events::decode(&item) {
                Ok(events) => events,
                Err(e) => {
                    tracing::warn!(error = %e, "skipping a transition ring record");
                    continue;
                }
            };
            n += events.len() as u64;
            for ev in events {
                if ev.oldstate == tcp_state::CLOSE && ev.newstate == tcp_state::SYN_SENT {
                    *opens.entry((ev.pid, ev.comm, ev.dport)).or_default() += 1;
                }
            }
        }
        metrics.events_read.inc_by(n);
        let mut st = lock(&storm);
        for ((pid, comm, port), count) in opens {
            let end = comm.iter().position(|b| *b == 0).unwrap_or(comm.len());
            let key = ConnKey {
                pid,
                comm: String::from_utf8_lossy(&comm[..end]).into_owned(),
                port,
            };
            st.record_connects(key, count);
        }
    }
}

async fn poll_quota(
    cfg: QuotaConfig,
    scan_interval: Duration,
    out: Arc<Mutex<BTreeMap<String, QuotaStatus>>>,
) {
    let client = reqwest::Client::builder()
        .no_proxy()
        .build()
        .unwrap_or_default();
    let interval = quota::poll_interval(&cfg, scan_interval);
    let timeout = quota::timeout(&cfg, scan_interval);
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticker.tick().await;
        let previous = lock(&out).get(&cfg.name).cloned();
        let status = quota::poll(&client, &cfg, timeout, previous.as_ref()).await;
        if let Some(err) = &status.error {
            if previous.as_ref().and_then(|p| p.error.as_ref()) != Some(err) {
                tracing::warn!(quota = %cfg.name, error = %err, "quota source unavailable");
            }
        }
        lock(&out).insert(cfg.name.clone(), status);
    }
}

async fn shutdown_signal() {
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term => {}
    }
    tracing::info!("shutting down");
    let _ = sd_notify::notify(false, &[sd_notify::NotifyState::Stopping]);
}

/// Metrics and the `reclaimed` notification for one reclaim round.
pub fn after_round(st: &AppState, round: &RoundResult) {
    for d in &round.decisions {
        st.metrics
            .reclaims
            .get_or_create(&ReclaimLabels {
                policy: d.policy.clone(),
                result: serde_json::to_value(d.result)
                    .ok()
                    .and_then(|v| v.as_str().map(String::from))
                    .unwrap_or_default(),
            })
            .inc();
    }
    let n = round.killed();
    if n == 0 {
        return;
    }
    let mut owners: BTreeMap<(Option<u32>, String), usize> = BTreeMap::new();
    for d in round
        .decisions
        .iter()
        .filter(|d| d.result == Outcome::Killed)
    {
        *owners.entry((d.pid, d.comm.clone())).or_default() += 1;
    }
    let processes: Vec<serde_json::Value> = owners
        .iter()
        .map(|((pid, comm), count)| serde_json::json!({"pid": pid, "comm": comm, "count": count}))
        .collect();
    let quota_text = round
        .quota
        .as_ref()
        .map(|q| format!(" ({} quota at {}/{} before)", q.name, q.used, q.limit))
        .unwrap_or_default();
    let sockets: Vec<&crate::reclaim::Decision> = round
        .decisions
        .iter()
        .filter(|d| d.result == Outcome::Killed)
        .take(crate::detect::MAX_SOCKETS)
        .collect();
    st.webhooks.send_event(&serde_json::json!({
        "kind": "reclaimed",
        "status": "firing",
        "host": host_name(&st.cfg),
        "policy": round.policy,
        "mode": round.mode,
        "count": n,
        "summary": format!("policy {} closed {n} socket{}{quota_text}", round.policy, if n == 1 { "" } else { "s" }),
        "processes": processes,
        "quota": round.quota,
        "sockets": sockets,
        "time": crate::present::rfc3339(chrono::Utc::now()),
    }));
}

struct Loop {
    cfg: Config,
    storm: Arc<Mutex<StormTracker>>,
    http_quotas: Arc<Mutex<BTreeMap<String, QuotaStatus>>>,
    state: Arc<AppState>,
}

impl Loop {
    async fn scan(
        &self,
    ) -> Result<(Vec<Socket>, crate::kernel::Counters, Vec<ProgramStats>), String> {
        let sc = self.state.scanner.clone();
        let res = tokio::task::spawn_blocking(move || -> Result<_, KernelError> {
            let mut s = lock(&sc);
            let table = s.scan()?;
            let counters = s.kernel.counters()?;
            Ok((table, counters, s.kernel.program_stats()))
        })
        .await;
        match res {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => Err(format!("{:#}", anyhow::Error::new(e))),
            Err(e) => Err(format!("scan task failed: {e}")),
        }
    }

    fn quotas(&self, table: &[Socket]) -> Vec<QuotaStatus> {
        let now = crate::present::rfc3339_ms(chrono::Utc::now());
        let http = lock(&self.http_quotas);
        self.cfg
            .quota
            .iter()
            .map(|q| {
                if q.is_http() {
                    http.get(&q.name).cloned().unwrap_or_else(|| QuotaStatus {
                        name: q.name.clone(),
                        source: "http",
                        url: q.url.clone(),
                        last_poll: None,
                        entries: vec![],
                        error: None,
                    })
                } else {
                    quota::static_status(q, table, &now)
                }
            })
            .collect()
    }

    fn reclaim_rounds(&self, table: &[Socket], quotas: &[QuotaStatus]) {
        for policy in &self.cfg.policy {
            let round = tokio::task::block_in_place(|| {
                let mut scanner = lock(&self.state.scanner);
                lock(&self.state.reclaimer).round(
                    policy,
                    &self.cfg,
                    &mut scanner,
                    table,
                    quotas,
                    false,
                )
            });
            after_round(&self.state, &round);
        }
    }

    async fn run(self) -> anyhow::Result<()> {
        let interval = self.cfg.agent.scan_interval;
        let mut ticker = tokio::time::interval(interval);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut tracker = Tracker::new(host_name(&self.cfg), self.cfg.alerts.repeat_interval);
        let mut memory = Memory::default();
        let mut window_start = Instant::now();
        let mut watchdog_usec = 0u64;
        let watchdog = sd_notify::watchdog_enabled(false, &mut watchdog_usec);
        let metrics = self.state.metrics.clone();
        loop {
            ticker.tick().await;
            let t0 = Instant::now();
            // Free the published table before building the next one: at 100k sockets two
            // tables would double the daemon's memory. GET /v1/sockets waits for the new one.
            {
                let mut p = self.state.write();
                p.table = Vec::new();
                p.table_pending = true;
            }
            let (table, counters, programs) = match self.scan().await {
                Ok(v) => v,
                Err(e) => {
                    metrics.scan_errors.inc();
                    tracing::error!(error = %e, "scan failed");
                    {
                        let mut p = self.state.write();
                        p.last_scan_error = Some(e);
                        p.table_pending = false;
                    }
                    self.state.table_ready.notify_waiters();
                    continue;
                }
            };
            let quotas = self.quotas(&table);
            let findings = {
                let mut storm = lock(&self.storm);
                storm.close_window(t0.duration_since(window_start), &self.cfg.detect);
                window_start = t0;
                detect::run(
                    &detect::Input {
                        table: &table,
                        cfg: &self.cfg.detect,
                        quota_cfgs: &self.cfg.quota,
                        quotas: &quotas,
                        storm: &storm,
                    },
                    &mut memory,
                )
            };
            metrics.observe_table(&table);
            metrics.observe_findings(&findings);
            metrics.observe_kernel(counters);
            metrics.observe_programs(&programs);
            let update = tracker.update(findings, Instant::now(), chrono::Utc::now());
            for alert in &update.notify {
                self.state.webhooks.send(alert);
            }
            self.reclaim_rounds(&table, &quotas);
            let first = {
                let mut p = self.state.write();
                p.sockets = table.len();
                p.table = table;
                p.table_pending = false;
                p.alerts = update.current;
                p.quotas = quotas;
                p.last_scan = Some(Instant::now());
                p.last_scan_error = None;
                p.scans += 1;
                p.webhook_queued = self.state.webhooks.queued();
                p.scans == 1
            };
            self.state.table_ready.notify_waiters();
            metrics.scan_duration.observe(t0.elapsed().as_secs_f64());
            if first {
                let _ = sd_notify::notify(false, &[sd_notify::NotifyState::Ready]);
                tracing::info!(
                    scan_ms = t0.elapsed().as_millis() as u64,
                    "first scan done; ready"
                );
            }
            if watchdog {
                let _ = sd_notify::notify(false, &[sd_notify::NotifyState::Watchdog]);
            }
        }
    }
}

/// The bearer token for POST /v1/reclaim, if configured.
fn read_token(cfg: &Config) -> anyhow::Result<Option<String>> {
    if cfg.api.token_file.is_empty() {
        return Ok(None);
    }
    let t = std::fs::read_to_string(&cfg.api.token_file)
        .with_context(|| format!("cannot read api.token_file {}", cfg.api.token_file))?;
    let t = t.trim().to_string();
    if t.len() < 16 {
        anyhow::bail!(
            "api.token_file {}: token must be at least 16 characters",
            cfg.api.token_file
        );
    }
    Ok(Some(t))
}

pub async fn run(cfg: Config, source: String, verbose: bool) -> anyhow::Result<()> {
    let metrics = Arc::new(Metrics::new());
    let kernel = tokio::task::spawn_blocking(move || Kernel::load(verbose)).await??;
    let mut scanner = Scanner::new(kernel);
    let (ring, flusher) = scanner.kernel.take_events()?;
    let storm = Arc::new(Mutex::new(StormTracker::default()));
    tokio::spawn(read_events(ring, flusher, storm.clone(), metrics.clone()));

    let http_quotas = Arc::new(Mutex::new(BTreeMap::new()));
    for q in cfg.quota.iter().filter(|q| q.is_http()) {
        tokio::spawn(poll_quota(
            q.clone(),
            cfg.agent.scan_interval,
            http_quotas.clone(),
        ));
    }
    let webhooks = Webhooks::spawn(&cfg.webhook, &cfg.alerts, metrics.clone());
    let token = read_token(&cfg)?;
    let reclaimer = tokio::task::block_in_place(|| Reclaimer::new(&cfg, &scanner.kernel, verbose));
    metrics
        .reclaim_mechanism
        .get_or_create(&MechanismLabels {
            mechanism: reclaimer.mechanism_name().to_string(),
        })
        .set(1);
    let state = Arc::new(AppState {
        published: Default::default(),
        metrics,
        cfg: cfg.clone(),
        started: Instant::now(),
        table_ready: tokio::sync::Notify::new(),
        scanner: Arc::new(Mutex::new(scanner)),
        reclaimer: Arc::new(Mutex::new(reclaimer)),
        token,
        webhooks,
    });
    let listener = tokio::net::TcpListener::bind(cfg.agent.listen)
        .await
        .with_context(|| format!("cannot listen on {} (agent.listen)", cfg.agent.listen))?;
    tracing::info!(config = %source, listen = %cfg.agent.listen, scan_interval = ?cfg.agent.scan_interval,
        quotas = cfg.quota.len(), webhooks = cfg.webhook.len(), "connreap running");
    let server =
        axum::serve(listener, api::router(state.clone())).with_graceful_shutdown(shutdown_signal());
    let scan_loop = Loop {
        cfg,
        storm,
        http_quotas,
        state,
    };
    tokio::select! {
        r = server => r.context("HTTP API failed")?,
        r = scan_loop.run() => r?,
    }
    Ok(())
}
