//! Background tasks that must not die silently: each is spawned with a watcher that logs a
//! panic (or an unexpected end) and records it, and /healthz reports what it recorded.
use std::future::Future;

use tokio::sync::watch;

/// Spawns supervised tasks; cheap to clone.
#[derive(Clone)]
pub struct Supervisor {
    failed: watch::Sender<Vec<String>>,
}

impl Default for Supervisor {
    fn default() -> Self {
        Supervisor {
            failed: watch::channel(Vec::new()).0,
        }
    }
}

impl Supervisor {
    /// Run `fut` as task `name`; it is meant to run until the daemon stops, so both a panic and
    /// an end are failures.
    pub fn spawn<F>(&self, name: impl Into<String>, fut: F)
    where
        F: Future<Output = ()> + Send + 'static,
    {
        let name = name.into();
        let handle = tokio::spawn(fut);
        let failed = self.failed.clone();
        tokio::spawn(async move {
            let why = match handle.await {
                Ok(()) => "stopped".to_string(),
                Err(e) if e.is_panic() => format!("panicked: {}", panic_message(e.into_panic())),
                // Cancelled: the runtime is shutting down.
                Err(_) => return,
            };
            tracing::error!(task = %name, "background task {why}");
            failed.send_modify(|v| v.push(format!("task {name} {why}")));
        });
    }

    /// [`Supervisor::spawn`] for blocking work: `f` runs on a thread of tokio's blocking pool
    /// for as long as it lasts; a panic or an end is recorded the same way.
    pub fn spawn_blocking<F>(&self, name: impl Into<String>, f: F)
    where
        F: FnOnce() + Send + 'static,
    {
        self.spawn(name, async move {
            if let Err(e) = tokio::task::spawn_blocking(f).await {
                if e.is_panic() {
                    std::panic::resume_unwind(e.into_panic());
                }
            }
        });
    }

    /// Tasks that panicked or stopped, with why.
    pub fn failures(&self) -> Vec<String> {
        self.failed.borrow().clone()
    }
}

pub fn panic_message(p: Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "(no message)".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_panicking_task_is_recorded_with_its_message() {
        let s = Supervisor::default();
        s.spawn("quota poller relay", async {
            panic!("period must be non-zero")
        });
        s.spawn("forever", std::future::pending());
        for _ in 0..100 {
            if !s.failures().is_empty() {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        assert_eq!(
            s.failures(),
            vec!["task quota poller relay panicked: period must be non-zero".to_string()]
        );
    }

    #[tokio::test]
    async fn a_blocking_task_that_panics_or_ends_is_recorded() {
        let s = Supervisor::default();
        s.spawn_blocking("ring reader", || panic!("poll failed"));
        s.spawn_blocking("short", || {});
        for _ in 0..200 {
            if s.failures().len() == 2 {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        let mut got = s.failures();
        got.sort();
        assert_eq!(
            got,
            vec![
                "task ring reader panicked: poll failed".to_string(),
                "task short stopped".to_string()
            ]
        );
    }
}
