//! `connreap reclaim`: one round of one policy now, its decisions as JSON lines.
use std::process::ExitCode;

use anyhow::Context as _;

use super::{NoSuchPolicy, EX_ENFORCE_NOT_RUN, EX_TEMPFAIL};
use crate::{config, engine, kernel, quota, reclaim};

pub(super) fn reclaim_once(
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
                    &client, q, timeout, None, &mut None, &mut None,
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
