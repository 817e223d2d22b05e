//! The one owner of the kernel scanner and the reclaimer, on a dedicated thread. Scans,
//! detectors and reclaim rounds block or walk the whole table (BPF iterators, netlink, the
//! audit file), so the daemon's whole per-scan pipeline ([`Periodic`]) runs here, never on the
//! async runtime; API handlers ask for extra rounds over a channel and await the answer on a
//! oneshot. Rounds never run concurrently.
use std::{
    sync::{
        atomic::{AtomicBool, Ordering},
        mpsc, Arc,
    },
    time::{Duration, Instant},
};

use tokio::sync::{oneshot, watch};

use crate::{
    config::{Config, PolicyConfig},
    kernel::{Counters, Kernel, KernelError, ProgramStats, TrackerStatus},
    quota::QuotaStatus,
    reclaim::{
        exec::{Asker, Reclaimer, RoundResult},
        Decision,
    },
    scan::{NamespaceReport, Scanner},
    table::Socket,
};

/// One scan's table and the kernel's counters at that time.
pub struct ScanOutput {
    pub table: Vec<Socket>,
    pub counters: Counters,
    pub programs: Vec<ProgramStats>,
    /// Whether the state tracker is attached (re-attached if its pins were removed).
    pub tracker: TrackerStatus,
    /// The namespaces the scan covered, and those it could not.
    pub namespaces: NamespaceReport,
}

/// The engine stopped (its thread ended): the daemon is shutting down or the thread panicked.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("scan failed")]
    Scan(#[from] KernelError),
    #[error("the scan/reclaim thread is gone")]
    Gone,
}

enum Request {
    /// Stop the thread (the daemon is shutting down).
    Stop,
    /// One policy's round on a fresh scan (POST /v1/reclaim).
    ReclaimNow {
        policy: Box<PolicyConfig>,
        dry_run: bool,
        quotas: Arc<Vec<QuotaStatus>>,
        reply: oneshot::Sender<Result<RoundResult, KernelError>>,
    },
}

/// The scanner and the reclaimer, used synchronously: by the engine thread, and directly by
/// the one-shot `connreap reclaim`.
pub struct Core {
    pub scanner: Scanner,
    pub reclaimer: Reclaimer,
    cfg: Config,
}

impl Core {
    /// `role` ("daemon", "cli") names this process in the host's reclaim lock.
    pub fn new(cfg: Config, kernel: Kernel, verbose: bool, role: &'static str) -> Core {
        let reclaimer = Reclaimer::new(&cfg, &kernel, verbose, role);
        let mut scanner = Scanner::new(kernel);
        scanner.walk_every(crate::scan::walk_every(
            cfg.agent.netns_walk_interval,
            cfg.agent.scan_interval,
        ));
        Core {
            scanner,
            reclaimer,
            cfg,
        }
    }

    pub fn scan(&mut self) -> Result<ScanOutput, KernelError> {
        let table = self.scanner.scan()?;
        Ok(ScanOutput {
            table,
            counters: self.scanner.kernel.counters()?,
            programs: self.scanner.kernel.program_stats(),
            tracker: self.scanner.kernel.check_tracker(),
            namespaces: self.scanner.namespace_report.clone(),
        })
    }

    /// One round of `policy` against `table`.
    pub fn round(
        &mut self,
        policy: &PolicyConfig,
        table: &[Socket],
        quotas: &[QuotaStatus],
        dry_run: bool,
        asker: Asker,
    ) -> RoundResult {
        let (cfg, scanner) = (&self.cfg, &mut self.scanner);
        self.reclaimer
            .round(policy, cfg, scanner, table, quotas, dry_run, asker)
    }

    /// Answer one request; `report` sees every round run.
    fn handle(&mut self, req: Request, report: &mut dyn FnMut(&RoundResult)) {
        // A dropped reply means the asker went away (e.g. an API client disconnected): the
        // round has still been run and audited, nothing else to do.
        match req {
            Request::ReclaimNow {
                policy,
                dry_run,
                quotas,
                reply,
            } => {
                let result = self.scanner.scan().map(|table| {
                    let round = self.round(&policy, &table, &quotas, dry_run, Asker::Extra);
                    report(&round);
                    round
                });
                let _ = reply.send(result);
            }
            Request::Stop => {}
        }
    }
}

/// What the API shows of the reclaimer.
#[derive(Clone, Default)]
pub struct EngineStatus {
    pub recent: Arc<Vec<Decision>>,
    /// The last audit write error, until a write succeeds again.
    pub audit_error: Option<String>,
    /// The engine thread ended: why (a panic's message). Nothing scans or reclaims any more.
    pub dead: Option<String>,
}

/// Work the engine thread runs every [`Periodic::interval`], between requests: the daemon's
/// per-scan pipeline. `report` sees every reclaim round it runs (metrics, notifications);
/// once `stopping` is set no round may start.
pub trait Periodic: Send + 'static {
    fn interval(&self) -> Duration;
    fn tick(
        &mut self,
        core: &mut Core,
        report: &mut dyn FnMut(&RoundResult),
        stopping: &AtomicBool,
    );
}

/// Handle to the engine thread; cheap to clone.
#[derive(Clone)]
pub struct Engine {
    tx: mpsc::Sender<Request>,
    /// Set by [`Engine::stop`]: no tick or round starts after it.
    stopping: Arc<AtomicBool>,
    /// The destroy mechanism chosen at start ("none" if there is none).
    pub mechanism: &'static str,
    /// Recent reclaim decisions and the audit log's state, republished after every round.
    pub status: watch::Receiver<EngineStatus>,
}

impl Engine {
    /// Start the engine thread around `core`, running `periodic` (if any) at its interval, the
    /// first time at once; `report` sees every reclaim round (metrics, notifications), whoever
    /// asked for it.
    pub fn spawn(
        mut core: Core,
        mut periodic: Option<Box<dyn Periodic>>,
        mut report: impl FnMut(&RoundResult) + Send + 'static,
    ) -> std::io::Result<Engine> {
        let (tx, rx) = mpsc::channel::<Request>();
        let (status_tx, status) = watch::channel(EngineStatus::default());
        let stopping = Arc::new(AtomicBool::new(false));
        let stop = stopping.clone();
        let mechanism = core.reclaimer.mechanism_name();
        std::thread::Builder::new()
            .name("connreap-engine".into())
            .spawn(move || {
                // A panic ends the thread: say why on the status channel, so /healthz names
                // the cause instead of a bare "thread is gone".
                let run = std::panic::AssertUnwindSafe(|| {
                    let mut next = Instant::now();
                    loop {
                        if stop.load(Ordering::Relaxed) {
                            break;
                        }
                        let rounds = core.reclaimer.rounds();
                        let now = Instant::now();
                        match periodic.as_mut() {
                            Some(p) if now >= next => {
                                p.tick(&mut core, &mut report, &stop);
                                // A late tick delays the next one (no burst to catch up).
                                next = (next + p.interval()).max(now);
                            }
                            _ => {
                                let wait = periodic.as_ref().map(|_| next - now);
                                let req = match wait {
                                    Some(wait) => rx.recv_timeout(wait),
                                    None => {
                                        rx.recv().map_err(|_| mpsc::RecvTimeoutError::Disconnected)
                                    }
                                };
                                match req {
                                    Ok(Request::Stop) => break,
                                    Ok(req) if !stop.load(Ordering::Relaxed) => {
                                        core.handle(req, &mut report)
                                    }
                                    Ok(_) => break,
                                    Err(mpsc::RecvTimeoutError::Timeout) => {}
                                    Err(mpsc::RecvTimeoutError::Disconnected) => break,
                                }
                            }
                        }
                        let audit_error = core.reclaimer.audit_error.clone();
                        if core.reclaimer.rounds() != rounds
                            || status_tx.borrow().audit_error != audit_error
                        {
                            status_tx.send_replace(EngineStatus {
                                recent: Arc::new(core.reclaimer.recent()),
                                audit_error,
                                dead: None,
                            });
                        }
                    }
                });
                let why = match std::panic::catch_unwind(run) {
                    Ok(()) if stop.load(Ordering::Relaxed) => return,
                    Ok(()) => "stopped".to_string(),
                    Err(p) => format!("panicked: {}", crate::tasks::panic_message(p)),
                };
                tracing::error!(thread = "connreap-engine", "the scan/reclaim thread {why}");
                status_tx.send_modify(|s| s.dead = Some(format!("the scan/reclaim thread {why}")));
            })?;
        Ok(Engine {
            tx,
            stopping,
            mechanism,
            status,
        })
    }

    /// No tick or round starts after this (one in progress ends as it would).
    pub fn stop(&self) {
        self.stopping.store(true, Ordering::Relaxed);
        let _ = self.tx.send(Request::Stop);
    }

    async fn ask<T>(
        &self,
        make: impl FnOnce(oneshot::Sender<T>) -> Request,
    ) -> Result<T, EngineError> {
        let (reply, rx) = oneshot::channel();
        self.tx.send(make(reply)).map_err(|_| EngineError::Gone)?;
        rx.await.map_err(|_| EngineError::Gone)
    }

    /// One round of `policy` on a fresh scan.
    pub async fn reclaim_now(
        &self,
        policy: PolicyConfig,
        dry_run: bool,
        quotas: Arc<Vec<QuotaStatus>>,
    ) -> Result<RoundResult, EngineError> {
        Ok(self
            .ask(|reply| Request::ReclaimNow {
                policy: Box::new(policy),
                dry_run,
                quotas,
                reply,
            })
            .await??)
    }
}
