//! The command line: one file per subcommand; this module parses, starts logging, dispatches
//! and maps results to exit statuses (0 ok, 1 runtime failure, 2 bad input, 3, 75 and 78 as
//! the man page says).
mod check_config;
mod reclaim;
mod run;
mod snapshot;
mod unpin;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

use crate::{config, docs, logging};

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
        filter: crate::snapshot::FilterArgs,
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

/// `connreap reclaim`: another connreap holds the host's reclaim lock; `connreap unpin`:
/// another connreap uses the pins (EX_TEMPFAIL).
pub(super) const EX_TEMPFAIL: u8 = 75;
/// `connreap reclaim`: an enforce policy ran as a dry run (no destroy mechanism, audit log not
/// writable): nothing was killed although the policy says enforce.
pub(super) const EX_ENFORCE_NOT_RUN: u8 = 3;
/// Bad input on the command line (as clap's own usage errors): a filter that does not parse,
/// a policy that is not configured. Runtime failures exit 1.
const EX_USAGE: u8 = 2;

/// A command-line value that names nothing usable.
#[derive(Debug, thiserror::Error)]
#[error("no policy named `{name}` (configured: {configured})")]
pub(super) struct NoSuchPolicy {
    pub(super) name: String,
    pub(super) configured: String,
}

/// Parse the command line, run the subcommand, and turn its result into the exit status.
pub fn main() -> ExitCode {
    let cli = Cli::parse();
    let verbose = cli.verbose;
    let result = match &cli.cmd {
        Cmd::Run { config, listen_ip } => with_config(&cli, config.as_deref(), |cfg, source| {
            run::run(verbose, cfg, source, *listen_ip)
        }),
        Cmd::Reclaim {
            policy,
            dry_run,
            config,
        } => with_config(&cli, config.as_deref(), |cfg, _| {
            reclaim::reclaim_once(verbose, &cfg, policy, *dry_run)
        }),
        Cmd::CheckConfig { path } => {
            init_logging(&cli, None);
            check_config::check_config(path)
        }
        Cmd::Snapshot { filter, json } => {
            init_logging(&cli, None);
            snapshot::snapshot(verbose, filter, *json).map(|()| ExitCode::SUCCESS)
        }
        Cmd::Unpin { force } => {
            init_logging(&cli, None);
            unpin::unpin(*force)
        }
        Cmd::MountBpffs => {
            init_logging(&cli, None);
            unpin::mount_bpffs().map(|()| ExitCode::SUCCESS)
        }
        Cmd::GenerateDocs(args) => {
            init_logging(&cli, None);
            docs::generate(<Cli as clap::CommandFactory>::command(), args)
                .map(|()| ExitCode::SUCCESS)
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

/// Whether `e` is bad command-line input rather than a runtime failure.
fn is_usage(e: &anyhow::Error) -> bool {
    e.chain()
        .any(|c| c.is::<crate::snapshot::FilterError>() || c.is::<NoSuchPolicy>())
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
