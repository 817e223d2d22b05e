//! HTTP quota sources, each polled by its own task; the latest reading of each is published on
//! a watch channel that the scan loop reads.
//!
//! A source whose quota names a network namespace (`netns`) or a container (`container`) is
//! polled from inside that namespace, so a URL on 127.0.0.1 reaches the service there (a
//! relay's status port inside a pod). The namespace is looked up again on every poll (pods
//! restart, names are re-created); a thread of its own lives in it ([`NsPoller`]) and makes
//! the requests with a client and runtime made there, kept for as long as the namespace is the
//! same (its connections are kept alive: a poll is not a new connection each time). A socket
//! belongs to the namespace of the thread that creates it. A namespace that cannot be found or
//! entered makes the source unavailable, saying why.
use std::time::Duration;

use tokio::sync::watch;

use crate::{
    config::{Config, Place, QuotaConfig},
    kernel::netns::{self, Namespace},
    quota::{self, poll, QuotaStatus},
    tasks::Supervisor,
};

/// The latest reading of every HTTP quota source, by name.
pub struct QuotaFeeds {
    feeds: Vec<(String, watch::Receiver<Option<QuotaStatus>>)>,
}

impl QuotaFeeds {
    /// Start one poller task per HTTP source of `cfg`. Err: the HTTP client cannot be built.
    pub fn spawn(cfg: &Config, tasks: &Supervisor) -> Result<QuotaFeeds, reqwest::Error> {
        let client = poll::http_client()?;
        let feeds = cfg
            .quota
            .iter()
            .filter(|q| q.is_http())
            .map(|q| {
                let (tx, rx) = watch::channel(None);
                let task = poll_forever(client.clone(), q.clone(), cfg.agent.scan_interval, tx);
                tasks.spawn(format!("quota poller {}", q.name), task);
                (q.name.clone(), rx)
            })
            .collect();
        Ok(QuotaFeeds { feeds })
    }

    /// The last reading of source `name`; None before its first poll finished.
    pub fn latest(&self, name: &str) -> Option<QuotaStatus> {
        let (_, rx) = self.feeds.iter().find(|(n, _)| n == name)?;
        let latest = rx.borrow().clone();
        latest
    }
}

async fn poll_forever(
    client: reqwest::Client,
    cfg: QuotaConfig,
    scan_interval: Duration,
    out: watch::Sender<Option<QuotaStatus>>,
) {
    let interval = quota::poll_interval(&cfg, scan_interval);
    let timeout = quota::timeout(&cfg, scan_interval);
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut hint = None;
    let mut poller = None;
    loop {
        ticker.tick().await;
        let previous = out.borrow().clone();
        let status = poll_once(
            &client,
            &cfg,
            timeout,
            previous.as_ref(),
            &mut hint,
            &mut poller,
        )
        .await;
        if let Some(err) = &status.error {
            if previous.as_ref().and_then(|p| p.error.as_ref()) != Some(err) {
                tracing::warn!(quota = %cfg.name, error = %err, "quota source unavailable");
            }
        }
        out.send_replace(Some(status));
    }
}

/// Poll one HTTP source once, from inside its namespace when it names one (`client` serves
/// connreap's own). `hint` carries the pid a container was found by from poll to poll, and
/// `poller` the thread that polls in another namespace (replaced when the namespace changes).
/// Never fails: problems become the status's `error`.
pub async fn poll_once(
    client: &reqwest::Client,
    cfg: &QuotaConfig,
    timeout: Duration,
    previous: Option<&QuotaStatus>,
    hint: &mut Option<u32>,
    poller: &mut Option<NsPoller>,
) -> QuotaStatus {
    let Some(place) = cfg.place() else {
        return poll::poll(client, cfg, timeout, previous).await;
    };
    let failed = |why: String| quota::failed(cfg, previous, chrono::Utc::now(), why);
    // Finding it reads /proc (every process's cgroup, for a container): off the runtime.
    let wanted = Wanted::of(place, *hint);
    let ns = match tokio::task::spawn_blocking(move || wanted.find()).await {
        Ok(Ok((ns, pid))) => {
            *hint = pid;
            ns
        }
        Ok(Err(e)) => {
            // The namespace is gone: let go of it (the poller's thread would keep it alive).
            *poller = None;
            return failed(e.to_string());
        }
        Err(e) => return failed(format!("finding the namespace to poll in failed: {e}")),
    };
    if ns.own {
        *poller = None;
        return poll::poll(client, cfg, timeout, previous).await;
    }
    let (inode, place) = (ns.inode, place.to_string());
    if poller.as_ref().is_none_or(|p| p.inode != inode) {
        *poller = match NsPoller::start(ns, cfg.clone(), timeout) {
            Ok(p) => Some(p),
            Err(why) => return failed(why),
        };
    }
    let Some(p) = poller.as_ref() else {
        return failed(format!("no poller in network namespace {inode}"));
    };
    match p.poll(previous.cloned()).await {
        Ok(status) => status,
        Err(why) => {
            // Started again at the next poll (the namespace may have gone with its pod).
            *poller = None;
            failed(format!("{place}: {why}"))
        }
    }
}

/// A thread inside one network namespace that polls one source there, with one runtime and
/// one HTTP client for as long as it lives; it ends when this handle is dropped.
pub struct NsPoller {
    inode: u32,
    jobs: std::sync::mpsc::Sender<Job>,
}

/// One poll for the thread: the previous reading, and where to send the new one.
struct Job {
    previous: Option<QuotaStatus>,
    reply: tokio::sync::oneshot::Sender<Result<QuotaStatus, String>>,
}

impl NsPoller {
    fn start(ns: Namespace, cfg: QuotaConfig, timeout: Duration) -> Result<NsPoller, String> {
        let inode = ns.inode;
        let (jobs, rx) = std::sync::mpsc::channel::<Job>();
        netns::spawn_in(ns, move |entered| {
            let made = entered
                .map_err(|e| format!("{:#}", anyhow::Error::new(e)))
                .and_then(|()| {
                    let rt = tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build()
                        .map_err(|e| {
                            format!("cannot start a runtime to poll in the namespace: {e}")
                        })?;
                    let client = poll::http_client()
                        .map_err(|e| format!("cannot make an HTTP client in the namespace: {e}"))?;
                    Ok((rt, client))
                });
            for job in rx {
                let status = match &made {
                    Ok((rt, client)) => {
                        Ok(rt.block_on(poll::poll(client, &cfg, timeout, job.previous.as_ref())))
                    }
                    Err(why) => Err(why.clone()),
                };
                let _ = job.reply.send(status);
            }
        })
        .map_err(|e| format!("cannot start a thread to poll in network namespace {inode}: {e}"))?;
        Ok(NsPoller { inode, jobs })
    }

    async fn poll(&self, previous: Option<QuotaStatus>) -> Result<QuotaStatus, String> {
        let gone = || format!("the poller in network namespace {} ended", self.inode);
        let (reply, rx) = tokio::sync::oneshot::channel();
        self.jobs
            .send(Job { previous, reply })
            .map_err(|_| gone())?;
        rx.await.map_err(|_| gone())?
    }
}

/// A place to find, owned (for a blocking task).
enum Wanted {
    Netns(String),
    Container { prefix: String, hint: Option<u32> },
}

impl Wanted {
    fn of(place: Place<'_>, hint: Option<u32>) -> Wanted {
        match place {
            Place::Netns(n) => Wanted::Netns(n.to_string()),
            Place::Container(c) => Wanted::Container {
                prefix: c.to_string(),
                hint,
            },
        }
    }

    /// The namespace, and for a container the pid it was found by.
    fn find(self) -> Result<(Namespace, Option<u32>), netns::FindError> {
        match self {
            Wanted::Netns(n) => netns::find(&n).map(|ns| (ns, None)),
            Wanted::Container { prefix, hint } => {
                netns::of_container(&prefix, hint).map(|(ns, pid)| (ns, Some(pid)))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A source on `url` in `place` (netns = "..." or container = "...").
    fn source(url: &str, place: &str) -> QuotaConfig {
        let text = crate::quota::tests::relay_toml(url, &format!("limit = 64\n{place}"));
        crate::config::parse(&text, "t").unwrap().quota.remove(0)
    }

    /// Serves `body` to one request.
    async fn serve_once(body: &'static str) -> String {
        crate::quota::poll::tests::serve_once(body.into(), false).await
    }

    async fn poll(cfg: &QuotaConfig) -> QuotaStatus {
        let client = poll::http_client().expect("client");
        poll_once(
            &client,
            cfg,
            Duration::from_secs(5),
            None,
            &mut None,
            &mut None,
        )
        .await
    }

    #[tokio::test]
    async fn the_own_namespace_is_polled_as_before() {
        let body = r#"{"endpoints":[{"port":21000,"streams":3}]}"#;
        for place in ["", "netns = \"host\""] {
            let q = poll(&source(&serve_once(body).await, place)).await;
            assert_eq!((q.error, q.entries.len()), (None, 1), "{place}");
        }
    }

    #[tokio::test]
    async fn a_namespace_that_is_not_there_makes_the_source_unavailable() {
        let url = "http://127.0.0.1:9/status";
        let previous = QuotaStatus {
            name: "relay".into(),
            source: quota::Source::Http,
            url: Some(url.into()),
            last_poll: None,
            entries: vec![quota::QuotaEntry {
                port: 1,
                used: 1,
                limit: 64,
            }],
            error: None,
        };
        let cfg = source(url, "netns = \"connreap-no-such-netns\"");
        let client = poll::http_client().expect("client");
        let t = Duration::from_secs(1);
        let q = poll_once(&client, &cfg, t, Some(&previous), &mut None, &mut None).await;
        assert_eq!(
            q.error.as_deref(),
            Some("network namespace `connreap-no-such-netns` not found")
        );
        // The last good entries stay for display; a poll was attempted now.
        assert_eq!((q.entries.len(), q.url.as_deref()), (1, Some(url)));
        assert!(q.last_poll.is_some());
        let q = poll(&source(url, "container = \"fedcba9876543210\"")).await;
        let e = q.error.unwrap();
        assert!(
            e.starts_with("no running process of container `fedcba9876543210` found"),
            "{e}"
        );
    }
}
