//! Reclaim under policy, end to end: the agent (`connreap run`) runs inside a fresh network
//! namespace per test next to real leaking processes (incident 1's leaky-proxy -> relay-sim ->
//! instance-sim chain, `connreap-testpeer` pools), and its decisions are checked where they have
//! effects: the relay's `/status`, a real request through the chain (status AND body), `ss`,
//! the audit log, the API, the webhook receiver and the processes that held the sockets.

mod busy_stream;
mod close_wait;
mod config;
mod dry_run;
mod enforce;
mod quota_trigger;
mod restart;
mod selection;

use connreap_tests::harness::{
    audit::{assert_decision_shape, int, text},
    Agent, Chain, Config, NetNs, TempDir, DIAL, MAX_STREAMS,
};
use serde_json::{json, Value};

/// The API token of the tests that turn `POST /v1/reclaim` on.
const TOKEN: &str = "s3cret-reclaim-token-0123456789";

/// [`Agent::start`], then the destroy mechanism /healthz reports must be the one `config` asks
/// for (netlink SOCK_DESTROY unless it forces the bpf_sock_destroy fallback).
fn start_agent(ns: &NetNs, dir: &TempDir, config: &Config) -> Agent {
    let agent = Agent::start(ns, dir, config);
    let mechanism = match config.forced_mechanism() {
        Some("bpf-iter") => "bpf-sock-destroy",
        _ => "netlink-sock-destroy",
    };
    let healthy = agent.get_ok("/healthz");
    assert_eq!(healthy["reclaim_mechanism"], json!(mechanism), "{healthy}");
    agent
}

/// Checks a killed/would-kill decision of [`connreap_tests::harness::relay_policy`] against
/// what it acted on.
fn assert_relay_decision(d: &Value, chain: &Chain, agent: &Agent, mode: &str, min_idle: f64) {
    assert_decision_shape(d);
    assert_eq!(text(d, "policy"), "relay-leaks", "{d}");
    assert_eq!(text(d, "mode"), mode, "{d}");
    assert_eq!(text(d, "comm"), "leaky-proxy", "{d}");
    assert_eq!(d["pid"], json!(chain.proxy_pid()), "{d}");
    assert_eq!(text(d, "peer"), DIAL, "{d}");
    assert_eq!(text(d, "state"), "ESTABLISHED", "{d}");
    assert_eq!(int(d, "agent_pid"), u64::from(agent.pid()), "{d}");
    assert!(int(d, "inode") != 0, "{d}");
    let idle = d["idle_secs"].as_f64().unwrap_or(-1.0);
    assert!(idle >= min_idle, "idle {idle} < min_idle {min_idle}: {d}");
    let q = &d["quota"];
    assert_eq!(q["name"], json!("relay"), "{d}");
    let (used, limit) = (int(q, "used"), int(q, "limit"));
    assert_eq!(limit, MAX_STREAMS, "{d}");
    // Acts only while the quota is saturated (detect.quota_saturation = 0.9).
    assert!(
        used as f64 >= 0.9 * limit as f64,
        "acted below saturation: {d}"
    );
}
