//! `connreap run`: build every part, start them, serve until a signal, shut down. The daemon's
//! own parts: the scan loop, when it must be restarted (`health`), the HTTP API and its
//! accept loop (`server`).
pub mod api;
pub mod health;
pub mod scan_loop;
mod server;

use std::{sync::Arc, time::Instant};

use anyhow::Context as _;
use tokio::sync::{mpsc, watch};

use self::{api::AppState, scan_loop::ScanLoop};
use crate::{
    alert::notify::{Notification, Reclaimed},
    alert::webhook::Webhooks,
    config::Config,
    engine::{Core, Engine},
    kernel::{self, Kernel},
    metrics::{MechanismLabels, Metrics},
    tasks::Supervisor,
};

/// How long queued notifications may delay the exit after a signal.
const WEBHOOK_DRAIN: std::time::Duration = std::time::Duration::from_secs(3);

/// The host name alerts carry: `agent.host`, else the kernel's.
fn host_name(cfg: &Config) -> String {
    if !cfg.agent.host.is_empty() {
        return cfg.agent.host.clone();
    }
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_else(|_| "unknown".into())
}

/// This agent's API as receivers should reach it (alerts' generatorURL).
fn api_base(cfg: &Config, host: &str) -> String {
    let l = cfg.agent.listen;
    if l.ip().is_unspecified() {
        format!("http://{host}:{}", l.port())
    } else {
        format!("http://{l}")
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

pub async fn run(cfg: Config, source: String, verbose: bool) -> anyhow::Result<()> {
    let metrics = Arc::new(Metrics::new());
    let host = host_name(&cfg);
    let token = api::read_token(&cfg)?;
    let max_tracked = u32::try_from(cfg.agent.max_tracked_sockets).unwrap_or(u32::MAX);
    let mut kernel =
        tokio::task::spawn_blocking(move || Kernel::load_sized(verbose, Some(max_tracked)))
            .await??;
    // CPU per scan is what counts here, not a scan's wall time: big dumps are read and
    // decoded on the scanning thread, with no hand-over between threads per read.
    kernel.set_reading(kernel::Reading::OneThread);

    // The transition ring: its reader counts active opens for the scan loop's storm detector
    // and the outcomes of outbound connections for its failing-upstream detector.
    let (ring, flusher) = kernel.take_events()?;
    // The programs' rare-path messages: without them the daemon still runs, and the losses
    // they report are still counted in connreap_ring_drops_total / _state_map_full_total.
    let bpf_log = kernel
        .open_log()
        .map_err(|e| {
            tracing::warn!(error = %format!("{:#}", anyhow::Error::new(e)), "the BPF programs' messages will not be logged");
        })
        .ok();
    let (opens_tx, opens) = mpsc::unbounded_channel();
    let (attempts_tx, attempts) = mpsc::unbounded_channel();
    let outcomes = kernel::outcome::Outcomes::new(kernel.hz, cfg.detect.failing_short_lifetime);
    let ring_metrics = metrics.clone();
    let tasks = Supervisor::default();
    let reader = move || {
        kernel::ring::read(ring, flusher, outcomes, bpf_log, move |d| {
            ring_metrics.events_read.inc_by(d.events);
            if let Some(f) = d.flushed {
                ring_metrics.batches_flushed.inc_by(f.sent.into());
                ring_metrics.flush_busy.inc_by(f.busy.into());
            }
            if !d.opens.is_empty() {
                let _ = opens_tx.send(d.opens);
            }
            if !d.attempts.is_empty() {
                let _ = attempts_tx.send(d.attempts);
            }
        })
    };
    // On a thread of its own (it blocks), supervised like the async tasks.
    tasks.spawn_blocking("transition ring reader", reader);

    let webhooks = Webhooks::spawn(
        &cfg.webhook,
        &cfg.alerts,
        metrics.clone(),
        &tasks,
        &api_base(&cfg, &host),
    )?;
    // Scans and reclaim rounds: one owner, on its own thread.
    let core = {
        let cfg = cfg.clone();
        tokio::task::spawn_blocking(move || Core::new(cfg, kernel, verbose, "daemon")).await?
    };
    // Listen before the first scan: a daemon that cannot serve its API never starts reclaiming.
    let listener = tokio::net::TcpListener::bind(cfg.agent.listen)
        .await
        .with_context(|| format!("cannot listen on {} (agent.listen)", cfg.agent.listen))?;
    let (published, _) = watch::channel(api::Published::default());
    let scan_loop = ScanLoop {
        quotas: crate::quota::feeds::QuotaFeeds::spawn(&cfg, &tasks)
            .context("cannot build the quota sources' HTTP client")?,
        cfg: cfg.clone(),
        host: host.clone(),
        opens,
        attempts,
        published: published.clone(),
        metrics: metrics.clone(),
        webhooks: webhooks.clone(),
        tasks: tasks.clone(),
    };
    // The per-scan pipeline runs on the engine thread, the first scan at once: nothing on the
    // async runtime walks the table.
    let engine = {
        let (metrics, webhooks, host) = (metrics.clone(), webhooks.clone(), host.clone());
        Engine::spawn(
            core,
            Some(Box::new(scan_loop.into_pipeline())),
            move |round| {
                metrics.observe_round(round);
                if round.audit_error.is_some() {
                    metrics.audit_errors.inc();
                }
                if let Some(r) = Reclaimed::from_round(&host, round, chrono::Utc::now()) {
                    webhooks.send(&Notification::Reclaimed(r));
                }
            },
        )
        .context("cannot start the scan/reclaim thread")?
    };
    metrics
        .reclaim_mechanism
        .get_or_create(&MechanismLabels {
            mechanism: engine.mechanism.to_string(),
        })
        .set(1);

    let state = Arc::new(AppState {
        published,
        metrics,
        cfg: cfg.clone(),
        started: Instant::now(),
        engine: engine.clone(),
        token,
        tasks,
    });
    tracing::info!(config = %source, listen = %cfg.agent.listen, scan_interval = %humantime::format_duration(cfg.agent.scan_interval),
        quotas = cfg.quota.len(), webhooks = cfg.webhook.len(), "connreap running");
    // On a signal everything stops at once: no new scan or reclaim round starts (a round in
    // progress has already written its kill intents), the API closes; queued notifications
    // get a short, bounded chance to go out. A dead engine thread does not end the daemon:
    // /healthz names it and the watchdog pings stop (see `health`).
    server::serve(listener, api::router(state), shutdown_signal()).await;
    engine.stop();
    if !webhooks.drain(WEBHOOK_DRAIN).await {
        tracing::warn!(
            queued = webhooks.queued(),
            "shutting down with undelivered notifications"
        );
    }
    Ok(())
}
