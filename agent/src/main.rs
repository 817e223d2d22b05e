//! connreap: finds leaked TCP connections with eBPF and, under policy, reclaims them.
mod alert;
mod api;
mod config;
mod containers;
mod daemon;
mod detect;
mod docs;
mod engine;
mod health;
mod kernel;
mod logging;
mod metrics;
mod notify;
mod present;
mod quota;
mod reclaim;
mod scan;
mod scan_loop;
mod server;
mod snapshot;
mod table;
mod tasks;
mod webhook;

use std::{process::ExitCode, time::Duration};

use anyhow::Context as _;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "connreap", version = docs::VERSION, long_version = docs::LONG_VERSION, about)]
struct Cli {
    /// More logging; on load failures, include the BPF verifier log.
    #[arg(short, long, global = true)]
    verbose: bool,
    /// Log lines on stderr as text (key=value) or json; default: the config's
    /// `agent.log_format`, else text.
    #[arg(long, global = true, value_enum)]
    log_format: Option<logging::LogFormat>,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run the agent: scan, detect, alert, serve the API.
    Run {
        /// Config file (default /etc/connreap/connreap.toml if present, else built-in defaults).
        #[arg(long)]
        config: Option<std::path::PathBuf>,
        /// Serve the API on this address instead of agent.listen's, keeping its port (the
        /// DaemonSet passes the pod IP).
        #[arg(long, value_name = "IP")]
        listen_ip: Option<std::net::IpAddr>,
    },
    /// Validate a config file; exit 78 with file, line and key when it is invalid.
    CheckConfig { path: std::path::PathBuf },
    /// Print every TCP socket with its owner, age in state, idle time and queues.
    Snapshot {
        #[command(flatten)]
        filter: snapshot::FilterArgs,
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
    },
    /// Run one reclaim round of a policy now and print its decisions (JSON lines).
    Reclaim {
        /// The `[[policy]]` to run, by its `name`.
        #[arg(long)]
        policy: String,
        /// Decide but close nothing, even for an enforce policy.
        #[arg(long)]
        dry_run: bool,
        /// Config file (default /etc/connreap/connreap.toml if present, else built-in defaults).
        #[arg(long)]
        config: Option<std::path::PathBuf>,
    },
    /// Remove the pinned state tracker (/sys/fs/bpf/connreap): ages start over. Refused (exit
    /// 75, naming the pid) while another process, such as a running connreap, uses it.
    Unpin {
        /// Remove the pins even while another connreap uses them (its tracker is reset).
        #[arg(long)]
        force: bool,
    },
    /// Mount the BPF filesystem at /sys/fs/bpf unless one is mounted there, then exit. The
    /// DaemonSet's init container runs it with a bidirectional mount, so that the pins outlive
    /// the pod on a host that had no bpffs mounted.
    MountBpffs,
    /// Write the man pages and shell completions (`cargo xtask dist`).
    #[command(hide = true)]
    GenerateDocs(docs::Args),
}

fn snapshot(verbose: bool, filter: &snapshot::FilterArgs, json: bool) -> anyhow::Result<()> {
    let filter = filter.parse()?;
    let t0 = std::time::Instant::now();
    let mut scanner = scan::Scanner::new(kernel::Kernel::load(verbose)?);
    scanner.only(filter.netns.clone());
    let loaded = t0.elapsed();
    let table = scanner.scan_parallel()?;
    let scanned = t0.elapsed();
    let mut selected: Vec<&table::Socket> = table.iter().filter(|s| filter.matches(s)).collect();
    snapshot::sort_for_display(&mut selected);
    let groups = snapshot::summarize(
        &selected,
        filter.idle_min.unwrap_or(Duration::from_secs(30)),
    );
    let counters = if json {
        Some(scanner.kernel.counters()?)
    } else {
        None
    };
    let written = (|| -> std::io::Result<()> {
        let mut out = stdout_file()?;
        match &counters {
            Some(counters) => {
                let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
                // Compact, streamed in rounds: no intermediate JSON tree for 100k sockets.
                let mut w = std::io::BufWriter::with_capacity(1 << 16, out);
                snapshot::write_snapshot_json(&mut w, &selected, &groups, counters, threads)?;
                std::io::Write::write_all(&mut w, b"\n")?;
                std::io::Write::flush(&mut w)
            }
            None => {
                let text = snapshot::render_table(&selected, &groups);
                std::io::Write::write_all(&mut out, text.as_bytes())
            }
        }
    })();
    // A reader that stopped early (`connreap snapshot | head`) is told apart by `main`.
    written.context("writing the snapshot to standard output")?;
    // Where a snapshot's time goes (`RUST_LOG=connreap::snapshot=debug`; the benchmarks read it).
    tracing::debug!(
        target: "connreap::snapshot",
        load_us = loaded.as_micros() as u64,
        scan_us = (scanned - loaded).as_micros() as u64,
        output_us = (t0.elapsed() - scanned).as_micros() as u64,
        "snapshot"
    );
    // The process ends here: freeing 100k rows one by one would only delay the exit.
    std::mem::forget(selected);
    std::mem::forget(table);
    Ok(())
}

/// Standard output as a plain file (a duplicate of fd 1): `std::io::stdout()` is line
/// buffered and searches every write for a newline, which for megabytes of one-line JSON
/// costs a scan of all of it.
fn stdout_file() -> std::io::Result<std::fs::File> {
    use std::os::fd::AsFd as _;
    Ok(std::io::stdout().as_fd().try_clone_to_owned()?.into())
}

fn run(
    verbose: bool,
    mut cfg: config::Config,
    source: String,
    listen_ip: Option<std::net::IpAddr>,
) -> anyhow::Result<ExitCode> {
    if let Some(ip) = listen_ip {
        cfg.agent.listen.set_ip(ip);
    }
    for w in config::warnings(&cfg) {
        tracing::warn!("{source}: {w}");
    }
    if let Err(e) = scan_loop::check_watchdog(cfg.agent.scan_interval) {
        eprintln!("connreap: {e}");
        return Ok(ExitCode::from(config::EX_CONFIG));
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let result = rt.block_on(daemon::run(cfg, source, verbose));
    // Tasks still running (API connections, pollers, senders) are dropped, not awaited.
    rt.shutdown_timeout(Duration::from_millis(500));
    result?;
    Ok(ExitCode::SUCCESS)
}

/// `connreap reclaim`: another connreap holds the host's reclaim lock; `connreap unpin`:
/// another connreap uses the pins (EX_TEMPFAIL).
const EX_TEMPFAIL: u8 = 75;
/// `connreap reclaim`: an enforce policy ran as a dry run (no destroy mechanism, audit log not
/// writable): nothing was killed although the policy says enforce.
const EX_ENFORCE_NOT_RUN: u8 = 3;
/// Bad input on the command line (as clap's own usage errors): a filter that does not parse,
/// a policy that is not configured. Runtime failures exit 1.
const EX_USAGE: u8 = 2;

/// A command-line value that names nothing usable.
#[derive(Debug, thiserror::Error)]
#[error("no policy named `{name}` (configured: {configured})")]
struct NoSuchPolicy {
    name: String,
    configured: String,
}

fn reclaim_once(
    verbose: bool,
    cfg: &config::Config,
    name: &str,
    dry_run: bool,
) -> anyhow::Result<ExitCode> {
    let Some(policy) = cfg.policy.iter().find(|p| p.name == name) else {
        let names: Vec<&str> = cfg.policy.iter().map(|p| p.name.as_str()).collect();
        return Err(NoSuchPolicy {
            name: config::shown(name, config::INPUT_MAX),
            configured: names.join(", "),
        }
        .into());
    };
    let mut core = engine::Core::new(cfg.clone(), kernel::Kernel::load(verbose)?, verbose, "cli");
    // One reclaimer per host: while a daemon holds the lock, its API is the way in.
    if let Err(e) = core.reclaimer.acquire_lock() {
        eprintln!("connreap: {e}; ask the running agent instead (POST /v1/reclaim)");
        return Ok(ExitCode::from(EX_TEMPFAIL));
    }
    let table = core.scanner.scan()?;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let client =
        quota::poll::http_client().context("cannot build the quota sources' HTTP client")?;
    let now = chrono::Utc::now();
    let quotas: Vec<quota::QuotaStatus> = cfg
        .quota
        .iter()
        .map(|q| {
            if q.is_http() {
                let timeout = quota::timeout(q, cfg.agent.scan_interval);
                rt.block_on(quota::feeds::poll_once(
                    &client, q, timeout, None, &mut None,
                ))
            } else {
                quota::static_status(q, &table, now)
            }
        })
        .collect();
    let round = core.round(
        policy,
        &table,
        &quotas,
        dry_run,
        reclaim::exec::Asker::Extra,
    );
    for d in &round.decisions {
        println!("{}", serde_json::to_string(d)?);
    }
    eprintln!(
        "policy {} ({}): {} decisions, {} killed{}",
        round.policy,
        round.mode,
        round.decisions.len(),
        round.killed(),
        round
            .note
            .as_ref()
            .map(|n| format!("; {n}"))
            .unwrap_or_default()
    );
    let enforce_refused = policy.mode == config::PolicyMode::Enforce
        && !dry_run
        && !round.mode.enforces()
        && round.note.is_none();
    if enforce_refused {
        eprintln!(
            "connreap: policy {} is enforce but ran as {}",
            round.policy, round.mode
        );
        return Ok(ExitCode::from(EX_ENFORCE_NOT_RUN));
    }
    Ok(ExitCode::SUCCESS)
}

fn main() -> ExitCode {
    // The socket table (tens of MB at 100k sockets) is rebuilt every scan. Keep glibc from
    // growing RSS with it: few arenas, and a fixed mmap threshold so large tables are mmapped
    // and returned to the kernel when freed (the default threshold adapts upwards after the
    // first free and then serves them from fragmenting heap arenas).
    // SAFETY: mallopt only changes allocator tunables.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 2);
        libc::mallopt(libc::M_MMAP_THRESHOLD, 256 * 1024);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 1024 * 1024);
    }
    let cli = Cli::parse();
    let result = match &cli.cmd {
        Cmd::Run { config, listen_ip } => with_config(&cli, config.as_deref(), |cfg, source| {
            run(cli.verbose, cfg, source, *listen_ip)
        }),
        Cmd::Reclaim {
            policy,
            dry_run,
            config,
        } => with_config(&cli, config.as_deref(), |cfg, _| {
            reclaim_once(cli.verbose, &cfg, policy, *dry_run)
        }),
        cmd => {
            init_logging(&cli, None);
            other_command(cli.verbose, cmd)
        }
    };
    match result {
        Ok(code) => code,
        // `connreap snapshot | head`: the reader stopped reading; nothing went wrong here.
        Err(e) if is_broken_pipe(&e) => ExitCode::SUCCESS,
        Err(e) if is_usage(&e) => {
            eprintln!("connreap: {e:#}");
            ExitCode::from(EX_USAGE)
        }
        Err(e) => {
            eprintln!("connreap: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Logging on stderr in the format `--log-format` names, else the config's, else text.
fn init_logging(cli: &Cli, cfg: Option<&config::Config>) {
    let format = cli
        .log_format
        .or(cfg.map(|c| c.agent.log_format))
        .unwrap_or_default();
    logging::init(cli.verbose, logging::Options::for_stderr(format));
}

/// Load the config (exit 78 when it is invalid), start logging as it says and run `f` with it.
fn with_config(
    cli: &Cli,
    path: Option<&std::path::Path>,
    f: impl FnOnce(config::Config, String) -> anyhow::Result<ExitCode>,
) -> anyhow::Result<ExitCode> {
    match config::load_default(path) {
        Ok((cfg, source)) => {
            init_logging(cli, Some(&cfg));
            f(cfg, source)
        }
        Err(e) => {
            eprintln!(
                "connreap: invalid configuration: {:#}",
                anyhow::Error::new(e)
            );
            Ok(ExitCode::from(config::EX_CONFIG))
        }
    }
}

/// The commands that need no config.
fn other_command(verbose: bool, cmd: &Cmd) -> anyhow::Result<ExitCode> {
    let done = match cmd {
        Cmd::CheckConfig { path } => match config::load(path) {
            Ok(c) => {
                for w in config::warnings(&c) {
                    eprintln!("connreap: warning: {}: {w}", path.display());
                }
                println!(
                    "{}: ok ({} quota sources, {} webhooks, {} policies)",
                    path.display(),
                    c.quota.len(),
                    c.webhook.len(),
                    c.policy.len()
                );
                Ok(())
            }
            Err(e) => {
                eprintln!(
                    "connreap: invalid configuration: {:#}",
                    anyhow::Error::new(e)
                );
                return Ok(ExitCode::from(config::EX_CONFIG));
            }
        },
        Cmd::Snapshot { filter, json } => snapshot(verbose, filter, *json),
        Cmd::Unpin { force } => match kernel::unpin_all(*force) {
            Err(e @ kernel::KernelError::PinsInUse { .. }) => {
                eprintln!("connreap: {e}");
                return Ok(ExitCode::from(EX_TEMPFAIL));
            }
            r => r,
        }
        .map(|removed| {
            eprintln!(
                "{}",
                if removed {
                    "state tracker unpinned"
                } else {
                    "nothing pinned"
                }
            )
        })
        .map_err(Into::into),
        Cmd::MountBpffs => kernel::mount_bpffs()
            .map(|mounted| {
                eprintln!(
                    "{}",
                    if mounted {
                        "mounted bpffs at /sys/fs/bpf"
                    } else {
                        "bpffs already mounted at /sys/fs/bpf"
                    }
                )
            })
            .map_err(Into::into),
        Cmd::GenerateDocs(args) => docs::generate(<Cli as clap::CommandFactory>::command(), args),
        // Handled by `main` with their config.
        Cmd::Run { .. } | Cmd::Reclaim { .. } => Ok(()),
    };
    done.map(|()| ExitCode::SUCCESS)
}

/// Whether `e` is bad command-line input rather than a runtime failure.
fn is_usage(e: &anyhow::Error) -> bool {
    e.chain()
        .any(|c| c.is::<snapshot::FilterError>() || c.is::<NoSuchPolicy>())
}

/// Whether `e` is a write to a pipe whose reader has gone.
fn is_broken_pipe(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.downcast_ref::<std::io::Error>()
            .map(std::io::Error::kind)
            .or_else(|| {
                c.downcast_ref::<serde_json::Error>()
                    .and_then(serde_json::Error::io_error_kind)
            })
            == Some(std::io::ErrorKind::BrokenPipe)
    })
}
