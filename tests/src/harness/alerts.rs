//! What the alerting tests check in a webhook receiver's JSON alerts and in /v1/findings (the
//! same objects).

use serde_json::Value;

use super::{
    addr,
    agent::Agent,
    consts::{FINDING, HOOK, HOST},
    netns::NetNs,
};
use crate::fixtures::{WebhookPost, WebhookReceiver};

/// A webhook receiver in `ns` where [`super::Config::alerting`] sends its alerts ([`HOOK`]).
pub fn receiver(ns: &NetNs) -> WebhookReceiver {
    WebhookReceiver::start_in_netns(ns.name(), addr(HOOK))
        .unwrap_or_else(|e| panic!("webhook receiver on {HOOK}: {e}"))
}

/// Whether alert (or finding) `b` is of `kind` with `status` (`firing` / `resolved`).
/// A webhook receiver in the host's namespace, on a free port (for a daemon run in the host's
/// namespace, as on a node).
pub fn host_receiver() -> WebhookReceiver {
    WebhookReceiver::start(addr("127.0.0.1:0"))
        .unwrap_or_else(|e| panic!("webhook receiver on 127.0.0.1:0: {e}"))
}

pub fn is(b: &Value, kind: &str, status: &str) -> bool {
    b["kind"] == kind && b["status"] == status
}

/// (pid, comm) of each entry of an alert's `processes`.
pub fn owners(f: &Value) -> Vec<(Option<u64>, String)> {
    f["processes"]
        .as_array()
        .unwrap_or_else(|| panic!("`processes` is not an array: {f}"))
        .iter()
        .map(|p| {
            (
                p["pid"].as_u64(),
                p["comm"].as_str().unwrap_or("").to_string(),
            )
        })
        .collect()
}

/// Whether one of an alert's `processes` is `pid`.
pub fn names_pid(f: &Value, pid: u32) -> bool {
    owners(f).iter().any(|(p, _)| *p == Some(pid as u64))
}

/// One line per recorded POST, for failure messages.
pub fn describe(posts: &[WebhookPost]) -> String {
    posts
        .iter()
        .map(|p| {
            format!(
                "  {} {} {} {}",
                p.body["status"], p.body["kind"], p.body["fingerprint"], p.body["summary"]
            )
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// Wait (up to [`FINDING`]) for a POST whose JSON body matches `pred`; panics with everything
/// received so far, the agent's findings and its stderr.
pub fn wait_post(
    hook: &WebhookReceiver,
    agent: &Agent,
    what: &str,
    pred: impl Fn(&Value) -> bool,
) -> WebhookPost {
    hook.wait_for_body(FINDING, pred).unwrap_or_else(|| {
        panic!(
            "the webhook receiver never got {what} within {FINDING:?}; it got:\n{}\ncurrent findings: {:#?}\nagent stderr:\n{}",
            describe(&hook.posts()),
            agent.findings(),
            agent.stderr()
        )
    })
}

/// The statuses of every POST of the alert `fingerprint`, in order.
pub fn statuses(hook: &WebhookReceiver, fingerprint: &Value) -> Vec<String> {
    hook.posts()
        .iter()
        .filter(|p| &p.body["fingerprint"] == fingerprint)
        .map(|p| p.body["status"].as_str().unwrap_or("?").to_string())
        .collect()
}

/// Fields every JSON alert body carries.
pub fn assert_alert_shape(b: &Value) {
    for key in [
        "kind",
        "status",
        "fingerprint",
        "host",
        "summary",
        "service_port",
        "count",
        "oldest_age_secs",
        "processes",
        "quota",
        "sockets",
        "started_at",
    ] {
        assert!(b.get(key).is_some(), "alert lacks `{key}`: {b:#}");
    }
    assert_eq!(b["host"], HOST, "{b:#}");
    let fp = b["fingerprint"].as_str().unwrap_or_default();
    assert!(
        fp.starts_with(&format!("{}:", b["kind"].as_str().unwrap_or("?"))),
        "fingerprint {fp:?} does not start with the kind: {b:#}"
    );
    if b["status"] == "resolved" {
        assert!(
            b["ended_at"].is_string(),
            "resolved without ended_at: {b:#}"
        );
    }
}
