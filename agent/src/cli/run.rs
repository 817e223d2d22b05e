//! `connreap run`: the daemon, on a two-thread runtime (see `daemon`).
use std::{process::ExitCode, time::Duration};

use crate::{config, daemon};

pub(super) fn run(
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
    if let Err(e) = daemon::scan_loop::check_watchdog(cfg.agent.scan_interval) {
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
