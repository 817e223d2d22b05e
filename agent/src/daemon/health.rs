//! When the daemon can no longer do its job and must be restarted: the scan/reclaim thread is
//! gone, scans keep failing, or a supervised background task stopped. The scan loop stops the
//! systemd watchdog pings then (systemd restarts the daemon) and /healthz answers 503 with the
//! same cause (a Kubernetes liveness probe restarts the pod).

/// Scans that may fail in a row before the daemon counts as failing: one failure can be a
/// passing fault (a namespace torn down mid-walk), three at the scan interval are not.
pub const MAX_FAILED_SCANS: u32 = 3;

/// Consecutive failed scans (or reclaim rounds), and the last one's error.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Failures {
    pub in_row: u32,
    pub last: Option<String>,
}

impl Failures {
    pub fn ok(&mut self) {
        *self = Failures::default();
    }

    pub fn failed(&mut self, error: String) {
        self.in_row = self.in_row.saturating_add(1);
        self.last = Some(error);
    }
}

/// Why the daemon must be restarted, if it must: `engine_dead` is why the scan/reclaim thread
/// ended, `tasks` the supervised tasks that stopped or panicked.
pub fn fatal(scans: &Failures, engine_dead: Option<&str>, tasks: &[String]) -> Option<String> {
    if let Some(why) = engine_dead {
        return Some(why.to_string());
    }
    if let Some(t) = tasks.first() {
        return Some(match tasks.len() {
            1 => t.clone(),
            n => format!("{t} (and {} more)", n - 1),
        });
    }
    if scans.in_row >= MAX_FAILED_SCANS {
        return Some(format!(
            "{} scans failed in a row, the last: {}",
            scans.in_row,
            scans.last.as_deref().unwrap_or("(no error text)")
        ));
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fails_after_max_scans_in_a_row_and_recovers_on_success() {
        let mut f = Failures::default();
        for _ in 0..MAX_FAILED_SCANS - 1 {
            f.failed("iter/tcp: Too many open files".into());
        }
        assert_eq!(fatal(&f, None, &[]), None);
        f.failed("iter/tcp: Too many open files".into());
        let cause = fatal(&f, None, &[]).expect("failing");
        assert!(cause.contains("3 scans failed in a row"), "{cause}");
        assert!(cause.contains("Too many open files"), "{cause}");
        f.ok();
        assert_eq!(fatal(&f, None, &[]), None);
    }

    #[test]
    fn a_dead_engine_or_a_stopped_task_fails_at_once() {
        let f = Failures::default();
        assert_eq!(
            fatal(&f, Some("the scan/reclaim thread panicked: boom"), &[]).as_deref(),
            Some("the scan/reclaim thread panicked: boom")
        );
        let tasks = vec![
            "task webhook sender a stopped".to_string(),
            "task quota poller relay panicked: x".to_string(),
        ];
        assert_eq!(
            fatal(&f, None, &tasks).as_deref(),
            Some("task webhook sender a stopped (and 1 more)")
        );
    }
}
