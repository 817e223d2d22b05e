//! The one owner of the kernel scanner and the reclaimer. Scans and reclaim rounds block (BPF
//! iterators, netlink, the audit file), so they run on a dedicated thread that takes requests
//! over a channel and answers on a oneshot: async code (the scan loop, API handlers) awaits
//! the answer and never blocks a runtime worker, and rounds never run concurrently.
use std::sync::Arc;

use tokio::sync::{mpsc, oneshot, watch};

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
    Scan(oneshot::Sender<Result<ScanOutput, KernelError>>),
    /// Every configured policy's round on the scan loop's table; the table comes back.
    Rounds {
        table: Vec<Socket>,
        quotas: Arc<Vec<QuotaStatus>>,
        reply: oneshot::Sender<(Vec<Socket>, Vec<RoundResult>)>,
    },
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
            Request::Scan(reply) => {
                let _ = reply.send(self.scan());
            }
            Request::Rounds {
                table,
                quotas,
                reply,
            } => {
                let policies = self.cfg.policy.clone();
                let rounds = policies
                    .iter()
                    .map(|p| {
                        let round = self.round(p, &table, &quotas, false, Asker::Scheduled);
                        report(&round);
                        round
                    })
                    .collect();
                let _ = reply.send((table, rounds));
            }
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

/// Handle to the engine thread; cheap to clone.
#[derive(Clone)]
pub struct Engine {
    tx: mpsc::Sender<Request>,
    /// The destroy mechanism chosen at start ("none" if there is none).
    pub mechanism: &'static str,
    /// Recent reclaim decisions and the audit log's state, republished after every round.
    pub status: watch::Receiver<EngineStatus>,
}

impl Engine {
    /// Start the engine thread around `core`; `report` sees every reclaim round (metrics,
    /// notifications), whoever asked for it.
    pub fn spawn(
        mut core: Core,
        mut report: impl FnMut(&RoundResult) + Send + 'static,
    ) -> std::io::Result<Engine> {
        let (tx, mut rx) = mpsc::channel::<Request>(16);
        let (status_tx, status) = watch::channel(EngineStatus::default());
        let mechanism = core.reclaimer.mechanism_name();
        std::thread::Builder::new()
            .name("connreap-engine".into())
            .spawn(move || {
                // A panic ends the thread: say why on the status channel, so the scan loop
                // names the cause on /healthz instead of a bare "thread is gone".
                let run = std::panic::AssertUnwindSafe(|| {
                    while let Some(req) = rx.blocking_recv() {
                        let rounds = core.reclaimer.rounds();
                        core.handle(req, &mut report);
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
                    Ok(()) => "stopped".to_string(),
                    Err(p) => format!("panicked: {}", crate::tasks::panic_message(p)),
                };
                tracing::error!(thread = "connreap-engine", "the scan/reclaim thread {why}");
                status_tx.send_modify(|s| s.dead = Some(format!("the scan/reclaim thread {why}")));
            })?;
        Ok(Engine {
            tx,
            mechanism,
            status,
        })
    }

    async fn ask<T>(
        &self,
        make: impl FnOnce(oneshot::Sender<T>) -> Request,
    ) -> Result<T, EngineError> {
        let (reply, rx) = oneshot::channel();
        self.tx
            .send(make(reply))
            .await
            .map_err(|_| EngineError::Gone)?;
        rx.await.map_err(|_| EngineError::Gone)
    }

    pub async fn scan(&self) -> Result<ScanOutput, EngineError> {
        Ok(self.ask(Request::Scan).await??)
    }

    /// Every policy's round on `table`; gives the table back.
    pub async fn rounds(
        &self,
        table: Vec<Socket>,
        quotas: Arc<Vec<QuotaStatus>>,
    ) -> Result<(Vec<Socket>, Vec<RoundResult>), EngineError> {
        self.ask(|reply| Request::Rounds {
            table,
            quotas,
            reply,
        })
        .await
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
