//! `connreap check-config FILE`: validate; exit 78 with file, line and key when invalid.
use std::{path::Path, process::ExitCode};

use crate::config;

pub(super) fn check_config(path: &Path) -> anyhow::Result<ExitCode> {
    match config::load(path) {
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
            Ok(ExitCode::SUCCESS)
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
