//! Connections between pods of one node. Each test lays out a node for real
//! ([`connreap_tests::harness::pods`]): a "node" network namespace with a bridge, pod
//! namespaces on veth pairs with addresses of their own, Services as iptables DNAT rules in
//! the node namespace, workloads in cgroups named as Docker / containerd / CRI-O name them.
//! connreap runs in the host's namespace, as the DaemonSet runs it, with its API on a free
//! port and alerts to a receiver in the host's namespace.
//!
//! Each test first proves its layout works (requests through the Service answer, the leak is
//! visible with `ss` inside the pods, the relay's quota is full), so that what fails after
//! that is connreap's doing. Where connreap's report is checked, the expected fields
//! are named in the assertion message ("expected ...").
//!
//! Without a cgroup v2 hierarchy, `iptables` or Node.js, the tests print `skipped: <reason>`.

mod dnat_pair;
mod failing_upstream;
mod ghost;
mod hidden_netns;
mod layout;
mod masquerade_pair;
mod relay_incident;
mod storm;

use connreap_tests::harness::alerts::host_receiver;
use std::{path::PathBuf, time::Duration};

use connreap_tests::{
    fixtures::{free_addr, WebhookReceiver},
    harness::{
        alerts::describe,
        containers::cgroup2_root,
        pods::{missing_pod_tools, Pod},
        require_privileges, Agent, Config, Privileged, TempDir,
    },
};
use serde_json::{json, Value};

/// Root, the e2e lock, a cgroup v2 hierarchy and the pod tools (`iptables`, `node`), or
/// `None` after printing why the test is skipped.
fn setup() -> Option<(Privileged, PathBuf)> {
    let env = require_privileges()?;
    let root = match cgroup2_root() {
        Ok(root) => root,
        Err(reason) => {
            println!("skipped: {reason}");
            return None;
        }
    };
    if let Some(reason) = missing_pod_tools() {
        println!("skipped: {reason}");
        return None;
    }
    Some((env, root))
}

/// The tests' host daemon: alerts to `hook` (fast retries, changes re-sent within a second),
/// the API on a free port.
fn host_config(dir: &TempDir, hook: &WebhookReceiver) -> Config {
    Config::alerting_to(dir, &hook.url("/alerts"))
        .listen(free_addr())
        .alerts("renotify_interval = \"1s\"")
}

/// How long a report may take once its cause is in place (thresholds here are 1-3 s, scans
/// every second): shorter than the harness's `FINDING`, so that a test that fails on one
/// part still checks the others well within a minute.
const REPORT_WAIT: Duration = Duration::from_secs(12);

/// The body of the first alert the receiver got that matches `pred`, waiting up to
/// [`REPORT_WAIT`]; panics saying `what` was expected, with every alert received and the
/// current findings (kind and summary).
fn wait_alert(
    hook: &WebhookReceiver,
    agent: &Agent,
    what: &str,
    pred: impl Fn(&Value) -> bool,
) -> Value {
    hook.wait_for_body(REPORT_WAIT, pred)
        .map(|p| p.body)
        .unwrap_or_else(|| {
            let findings: Vec<String> = agent
                .findings()
                .iter()
                .map(|f| format!("  {} {}: {}", f["kind"], f["fingerprint"], f["summary"]))
                .collect();
            panic!(
                "expected {what} within {REPORT_WAIT:?}; the receiver got:\n{}\n\
                 current findings:\n{}",
                describe(&hook.posts()),
                findings.join("\n")
            )
        })
}

/// The entry of `f[key]` (`processes`, `upstream`) whose `pid` is `pid`.
fn entry<'a>(f: &'a Value, key: &str, pid: u32) -> Option<&'a Value> {
    f[key].as_array()?.iter().find(|p| p["pid"] == json!(pid))
}

/// Whether a finding names `pid` among its `processes`.
fn names_pid(f: &Value, pid: u32) -> bool {
    entry(f, "processes", pid).is_some()
}

/// `b` (a finding, an alert, an audit line, an `upstream` entry) names `pod`'s namespace
/// (`netns` inode and `netns_name`) and, when the pod has one, its container (`container`,
/// `container_runtime`) and Kubernetes pod (`pod_uid`, `pod_name`, `pod_namespace`).
fn assert_in_pod(b: &Value, pod: &Pod, what: &str) {
    assert_eq!(
        (&b["netns"], &b["netns_name"]),
        (&json!(pod.inode()), &json!(pod.name())),
        "{what} must be in {} (`netns`, `netns_name`):\n{b:#}",
        pod.describe()
    );
    assert_container(b, pod, what);
}

/// The container fields of [`assert_in_pod`].
fn assert_container(b: &Value, pod: &Pod, what: &str) {
    if !pod.has_container() {
        assert!(
            b.get("container").is_none_or(Value::is_null),
            "{what}: {} has no container:\n{b:#}",
            pod.describe()
        );
        return;
    }
    let c = pod.container();
    assert_eq!(
        (&b["container"], &b["container_runtime"]),
        (&json!(c.id), &json!(c.runtime)),
        "{what} must name the container of {} (`container`, `container_runtime`):\n{b:#}",
        pod.describe()
    );
    match &c.pod {
        Some(p) => assert_eq!(
            (&b["pod_uid"], &b["pod_name"], &b["pod_namespace"]),
            (&json!(p.uid), &json!(p.name), &json!(p.namespace)),
            "{what} must name the Kubernetes pod of {} (`pod_uid`, `pod_name`, \
             `pod_namespace`):\n{b:#}",
            pod.describe()
        ),
        None => assert!(
            b.get("pod_name").is_none_or(Value::is_null),
            "{what}: {} is not a Kubernetes pod:\n{b:#}",
            pod.describe()
        ),
    }
}

/// The parts of a test that are worth checking even when an earlier one failed (what
/// connreap reports, what it reclaims, what users see): each part's panic is caught and
/// kept, and [`Parts::finish`] fails the test naming every part that failed, so one run
/// tells the whole story. The harness's own checks are not parts: they fail at once.
struct Parts {
    failed: Vec<String>,
}

impl Parts {
    fn new() -> Parts {
        Parts { failed: Vec::new() }
    }

    /// Runs `f`; on a panic keeps its message under `part` and returns `None`.
    fn check<T>(&mut self, part: &str, f: impl FnOnce() -> T) -> Option<T> {
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
            Ok(v) => {
                println!("part ok: {part}");
                Some(v)
            }
            Err(payload) => {
                let msg = payload
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_else(|| "(no message)".to_string());
                println!("part FAILED: {part}");
                self.failed.push(format!("[{part}] {msg}"));
                None
            }
        }
    }

    /// Fails the test if any part failed: each with the first lines of its message (the
    /// whole message was printed when it failed).
    fn finish(self) {
        if self.failed.is_empty() {
            return;
        }
        let short: Vec<String> = self
            .failed
            .iter()
            .map(|m| {
                let lines: Vec<&str> = m.lines().collect();
                let head = lines[..lines.len().min(12)].join("\n");
                if lines.len() > 12 {
                    format!("{head}\n  ... ({} more lines above)", lines.len() - 12)
                } else {
                    head
                }
            })
            .collect();
        panic!(
            "{} part(s) failed:\n\n{}",
            self.failed.len(),
            short.join("\n\n")
        );
    }
}
