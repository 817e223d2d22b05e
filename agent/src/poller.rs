//! HTTP quota sources, each polled by its own task; the latest reading of each is published on
//! a watch channel that the scan loop reads.
use std::time::Duration;

use tokio::sync::watch;

use crate::{
    config::{Config, QuotaConfig},
    quota::{self, QuotaStatus},
    tasks::Supervisor,
};

/// The latest reading of every HTTP quota source, by name.
pub struct QuotaFeeds {
    feeds: Vec<(String, watch::Receiver<Option<QuotaStatus>>)>,
}

impl QuotaFeeds {
    /// Start one poller task per HTTP source of `cfg`.
    pub fn spawn(cfg: &Config, tasks: &Supervisor) -> QuotaFeeds {
        let feeds = cfg
            .quota
            .iter()
            .filter(|q| q.is_http())
            .map(|q| {
                let (tx, rx) = watch::channel(None);
                let task = poll_forever(q.clone(), cfg.agent.scan_interval, tx);
                tasks.spawn(format!("quota poller {}", q.name), task);
                (q.name.clone(), rx)
            })
            .collect();
        QuotaFeeds { feeds }
    }

    /// The last reading of source `name`; None before its first poll finished.
    pub fn latest(&self, name: &str) -> Option<QuotaStatus> {
        let (_, rx) = self.feeds.iter().find(|(n, _)| n == name)?;
        let latest = rx.borrow().clone();
        latest
    }
}

async fn poll_forever(
    cfg: QuotaConfig,
    scan_interval: Duration,
    out: watch::Sender<Option<QuotaStatus>>,
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
        let previous = out.borrow().clone();
        let status = quota::poll(&client, &cfg, timeout, previous.as_ref()).await;
        if let Some(err) = &status.error {
            if previous.as_ref().and_then(|p| p.error.as_ref()) != Some(err) {
                tracing::warn!(quota = %cfg.name, error = %err, "quota source unavailable");
            }
        }
        out.send_replace(Some(status));
    }
}
