//! failing_upstream: a process keeps connecting to one remote endpoint whose connections keep
//! failing (refused, timed out, or reset/closed by the peer within the short lifetime), over
//! `failing_window`, at least `failing_min_failures` times and at least `failing_share` of its
//! attempts there. The finding says whether other endpoints of the same port succeed for the
//! same process (its retries do not switch to them: a selector that re-picks the broken
//! node) or none do (an outage of the service, not a selector bug), with their counts, the
//! failure kinds and the interval between failed attempts (the retry backoff seen).
//!
//! The attempts come from the ring reader's outcome tracking (`kernel::outcome`), window by
//! window (one per scan); this module is pure over them.
use std::{
    collections::{BTreeMap, VecDeque},
    net::SocketAddr,
    sync::Arc,
    time::{Duration, Instant},
};

use rustc_hash::FxHashMap;
use serde::Serialize;

use super::{identity, Detail, Finding, ProcessCount};
use crate::{
    config::DetectConfig,
    containers::Container,
    kernel::outcome::{Attempts, Outcome},
    present::human,
    table::Netns,
};

/// Attempts of one process in one network namespace to one remote endpoint.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Target {
    pub pid: u32,
    pub comm: String,
    /// The inode of the connecting sockets' network namespace (0: not known).
    pub netns: u32,
    pub remote: SocketAddr,
}

/// Another endpoint of the same port, and how the process's attempts there went.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct EndpointCount {
    pub endpoint: String,
    pub successes: u64,
    pub failures: u64,
}

/// What the finding is about, beyond the common fields.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct FailingUpstream {
    /// The failing remote endpoint.
    pub endpoint: String,
    /// Attempts there in the window, and how many failed, by kind.
    pub attempts: u64,
    pub failures: u64,
    pub kinds: BTreeMap<&'static str, u64>,
    /// The span the counts cover.
    pub window_secs: f64,
    /// The median interval between consecutive failed attempts: the retry backoff when one
    /// request retries at a time, a fraction of it when several do at once.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub retry_interval_secs: Option<f64>,
    /// The longest life of a connection counted reset or closed by the peer.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_life_ms: Option<u64>,
    /// `retries_do_not_switch` when other endpoints of the port succeed for this process
    /// (some successes, failures below `failing_share`), `outage` when none does.
    pub verdict: &'static str,
    /// The other endpoints of the port this process connected to, successes first (at most
    /// [`MAX_ALTERNATIVES`]).
    pub alternatives: Vec<EndpointCount>,
}

/// Other endpoints listed in a finding.
pub const MAX_ALTERNATIVES: usize = 8;

/// Targets kept per window before successes-only ones are dropped (see `FailTracker::record`).
const MAX_TARGETS: usize = 20_000;

/// The endpoints of one port a process connects to: (pid, comm, netns inode, port).
type Group<'a> = (u32, &'a str, u32, u16);

/// One scan interval's attempts.
#[derive(Debug)]
struct Window {
    end: Instant,
    attempts: BTreeMap<Target, Attempts>,
}

#[derive(Debug, Default)]
pub struct FailTracker {
    current: BTreeMap<Target, Attempts>,
    /// Closed windows within `failing_window`, oldest first.
    windows: VecDeque<Window>,
    /// When the first window started: the counts cover less than `failing_window` before.
    started: Option<Instant>,
    /// Each process's container as read when its attempts were drained.
    containers: BTreeMap<u32, Arc<Container>>,
    /// The namespaces of the last scan by inode.
    namespaces: FxHashMap<u32, Arc<Netns>>,
    /// The span the kept windows cover (at most `failing_window`).
    span: Duration,
}

impl FailTracker {
    /// Attempts of `target` whose outcome became known, by a process in `container`. Beyond
    /// [`MAX_TARGETS`] targets in one window, only those with failures are kept (the memory of
    /// a proxy talking to very many endpoints stays bounded; successes only matter as the
    /// alternatives of a failing endpoint).
    pub fn record(&mut self, target: Target, container: Option<Arc<Container>>, a: &Attempts) {
        if self.current.len() >= MAX_TARGETS
            && a.failures() == 0
            && !self.current.contains_key(&target)
        {
            return;
        }
        match container {
            Some(c) => self.containers.insert(target.pid, c),
            None => self.containers.remove(&target.pid),
        };
        self.current.entry(target).or_default().merge(a);
    }

    /// The namespaces the scan at the window's end found, to name those of the targets.
    pub fn set_namespaces(&mut self, spaces: &[Arc<Netns>]) {
        self.namespaces = spaces.iter().map(|n| (n.inode, n.clone())).collect();
    }

    /// End the current window (of length `len`, ending `now`); forget windows older than
    /// `failing_window`.
    pub fn close_window(&mut self, now: Instant, len: Duration, cfg: &DetectConfig) {
        self.started
            .get_or_insert(now.checked_sub(len).unwrap_or(now));
        let attempts = std::mem::take(&mut self.current);
        if !attempts.is_empty() {
            self.windows.push_back(Window { end: now, attempts });
        }
        while self
            .windows
            .front()
            .is_some_and(|w| now.duration_since(w.end) >= cfg.failing_window)
        {
            self.windows.pop_front();
        }
        let live: std::collections::BTreeSet<u32> = self
            .windows
            .iter()
            .flat_map(|w| w.attempts.keys().map(|t| t.pid))
            .collect();
        self.containers.retain(|pid, _| live.contains(pid));
        self.span = match self.started {
            Some(s) => now.duration_since(s).min(cfg.failing_window),
            None => Duration::ZERO,
        };
    }

    /// Every target's attempts over the windows kept (newest first, so the failure times kept
    /// are the latest ones).
    pub fn totals(&self) -> BTreeMap<&Target, Attempts> {
        let mut all: BTreeMap<&Target, Attempts> = BTreeMap::new();
        for w in self.windows.iter().rev() {
            for (t, a) in &w.attempts {
                all.entry(t).or_default().merge(a);
            }
        }
        all
    }

    pub fn findings(&self, cfg: &DetectConfig) -> Vec<Finding> {
        let totals = self.totals();
        // Endpoints per (process, namespace, port).
        let mut groups: BTreeMap<Group<'_>, Vec<(&Target, &Attempts)>> = BTreeMap::new();
        for (t, a) in &totals {
            groups
                .entry((t.pid, t.comm.as_str(), t.netns, t.remote.port()))
                .or_default()
                .push((t, a));
        }
        let mut out = Vec::new();
        for endpoints in groups.values() {
            for (t, a) in endpoints {
                let (failures, total) = (a.failures(), a.total());
                if failures < cfg.failing_min_failures as u64
                    || (failures as f64) < cfg.failing_share * total as f64
                {
                    continue;
                }
                let others: Vec<(&Target, &Attempts)> = endpoints
                    .iter()
                    .filter(|(o, _)| o.remote != t.remote)
                    .copied()
                    .collect();
                out.push(self.finding(t, a, &others, cfg.failing_share));
            }
        }
        out
    }

    fn finding(
        &self,
        t: &Target,
        a: &Attempts,
        others: &[(&Target, &Attempts)],
        share: f64,
    ) -> Finding {
        let span = self.span.max(Duration::from_secs(1));
        let mut alternatives: Vec<EndpointCount> = others
            .iter()
            .map(|(o, oa)| EndpointCount {
                endpoint: o.remote.to_string(),
                successes: oa.get(Outcome::Success),
                failures: oa.failures(),
            })
            .collect();
        // An endpoint succeeds when it has successes and is not failing itself (below the
        // share): one lucky connection to another broken node does not make it healthy.
        let succeeds = |e: &EndpointCount| {
            e.successes > 0 && (e.failures as f64) < share * (e.successes + e.failures) as f64
        };
        alternatives.sort_by(|x, y| {
            succeeds(y)
                .cmp(&succeeds(x))
                .then(y.successes.cmp(&x.successes))
                .then(x.endpoint.cmp(&y.endpoint))
        });
        let healthy_count = alternatives.iter().filter(|e| succeeds(e)).count();
        let more = alternatives.len().saturating_sub(MAX_ALTERNATIVES);
        alternatives.truncate(MAX_ALTERNATIVES);
        let more_text = match more {
            0 => String::new(),
            n => format!(" and {n} more"),
        };
        let healthy: Vec<&EndpointCount> = alternatives.iter().filter(|e| succeeds(e)).collect();
        let verdict = if healthy_count == 0 {
            "outage"
        } else {
            "retries_do_not_switch"
        };
        let kinds: BTreeMap<&'static str, u64> = Outcome::FAILURES
            .iter()
            .filter(|o| a.get(**o) > 0)
            .map(|o| (o.as_str(), a.get(*o)))
            .collect();
        let max_life_ms =
            (a.get(Outcome::Reset) + a.get(Outcome::Closed) > 0).then_some(a.max_short_life_ms);
        let retry = retry_interval(&a.failed_at_ms);
        let port = t.remote.port();
        let kinds_text: Vec<String> = Outcome::FAILURES
            .iter()
            .filter(|o| a.get(**o) > 0)
            .map(|o| format!("{} {}", a.get(*o), describe_kind(*o, max_life_ms)))
            .collect();
        let retry_text = retry
            .map(|s| format!(", a failed attempt every {}", secs_text(s)))
            .unwrap_or_default();
        let tail = if healthy_count == 0 {
            let tried: Vec<String> = alternatives
                .iter()
                .map(|e| format!("{} ({} failed)", e.endpoint, e.failures))
                .collect();
            if tried.is_empty() {
                format!(
                    "; it connects to no other endpoint of port {port}: an outage of the \
                     service, not a retry selector bug"
                )
            } else {
                format!(
                    "; no other endpoint of port {port} succeeds either ({}{more_text}): an \
                     outage of the service, not a retry selector bug",
                    tried.join(", ")
                )
            }
        } else {
            let ok: Vec<String> = healthy
                .iter()
                .map(|e| format!("{} ({} ok)", e.endpoint, e.successes))
                .collect();
            let more_ok = match healthy_count - healthy.len() {
                0 => String::new(),
                n => format!(" and {n} more"),
            };
            format!(
                "; other endpoints of port {port} succeed: {}{more_ok}: retries do not switch \
                 to them",
                ok.join(", ")
            )
        };
        let netns = self.netns_of(t.netns);
        let container = self.containers.get(&t.pid).cloned();
        let failing = FailingUpstream {
            endpoint: t.remote.to_string(),
            attempts: a.total(),
            failures: a.failures(),
            kinds,
            window_secs: span.as_secs_f64().round(),
            retry_interval_secs: retry,
            max_life_ms,
            verdict,
            alternatives,
        };
        let detail = Detail::FailingUpstream {
            rate_per_sec: (a.failures() as f64 / span.as_secs_f64() * 100.0).round() / 100.0,
            failing,
        };
        let mut f = Finding::new(
            detail,
            &format!(
                "{}:{}",
                identity(&t.comm, None, container.as_deref()),
                t.remote
            ),
            format!(
                "{} pid {} made {} failed connections in {} to {} ({}) of {} attempts{retry_text}{tail}",
                t.comm,
                t.pid,
                a.failures(),
                human(span),
                t.remote,
                kinds_text.join(", "),
                a.total(),
            ),
        )
        .scoped(&netns, container.as_deref());
        f.service_port = Some(port);
        f.count = a.failures() as usize;
        let c = container.as_deref();
        f.processes = vec![ProcessCount {
            pid: Some(t.pid),
            comm: t.comm.clone(),
            unit: None,
            count: a.failures() as usize,
            container: c.map(|c| c.id.clone()),
            container_runtime: c.map(|c| c.runtime.as_str()),
            pod_name: c.and_then(|c| c.pod_name.clone()),
            pod_namespace: c.and_then(|c| c.pod_namespace.clone()),
            netns: t.netns,
        }];
        f
    }

    /// The namespace of inode `inode` as the last scan named it; connreap's own when unknown.
    fn netns_of(&self, inode: u32) -> Arc<Netns> {
        if inode == 0 {
            return self
                .namespaces
                .values()
                .find(|n| n.own)
                .cloned()
                .unwrap_or_else(Netns::unknown);
        }
        self.namespaces.get(&inode).cloned().unwrap_or_else(|| {
            Arc::new(Netns {
                inode,
                ..Netns::default()
            })
        })
    }
}

/// The median gap between consecutive failed attempts (ms timestamps), in seconds rounded to
/// the ms; None with fewer than two.
fn retry_interval(at_ms: &[u64]) -> Option<f64> {
    let mut t = at_ms.to_vec();
    t.sort_unstable();
    let mut gaps: Vec<u64> = t.windows(2).map(|w| w[1] - w[0]).collect();
    if gaps.is_empty() {
        return None;
    }
    gaps.sort_unstable();
    Some(gaps[gaps.len() / 2] as f64 / 1000.0)
}

fn secs_text(s: f64) -> String {
    if s < 1.0 {
        format!("{:.0}ms", s * 1000.0)
    } else {
        format!("{s:.1}s")
    }
}

fn describe_kind(o: Outcome, max_life_ms: Option<u64>) -> String {
    let within = max_life_ms
        .map(|ms| format!(" within {}ms", ms.max(1)))
        .unwrap_or_default();
    match o {
        Outcome::Refused => "refused".to_string(),
        Outcome::Timeout => "timed out".to_string(),
        Outcome::Reset => format!("reset by peer{within}"),
        Outcome::Closed => format!("closed by peer{within}"),
        Outcome::Success => "succeeded".to_string(),
    }
}

#[cfg(test)]
#[path = "failing_tests.rs"]
mod tests;
