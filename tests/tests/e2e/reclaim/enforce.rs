//! Incident 1 under an enforcing policy: the agent frees the saturated relay, real requests
//! work again, and every kill is audited, announced and counted.

use std::{
    collections::HashSet,
    time::{Duration, Instant},
};

use connreap_tests::{
    fixtures::WebhookReceiver,
    harness::{
        addr,
        alerts::is,
        audit::{int, per_round, result_is, text},
        relay_policy, require_privileges, wait_until, Agent, Chain, Config, NetNs, TempDir,
        MAX_STREAMS, POLL, SCAN,
    },
};
use serde_json::{json, Value};

use super::{assert_relay_decision, start_agent};

#[test]
fn enforce_frees_the_saturated_relay_and_real_requests_work_again() {
    let Some(_env) = require_privileges() else {
        return;
    };
    let ns = NetNs::new("rc-enf");
    let dir = TempDir::new("enforce");
    let chain = Chain::start(&ns);
    let hook = WebhookReceiver::start_in_netns(ns.name(), addr("127.0.0.1:0")).unwrap();
    let config = Config::reclaiming(&dir)
        .webhook(&hook.url("/hook"))
        .policy(&relay_policy("enforce", "2s"));
    let agent = start_agent(&ns, &dir, &config);
    let metrics = agent.metrics();
    assert_eq!(
        metrics.value(r#"connreap_reclaim_mechanism{mechanism="netlink-sock-destroy"}"#),
        Some(1.0),
        "{metrics}"
    );

    saturate_until_freed(&chain, &agent);
    let killed = assert_kills(&chain, &agent);

    // Once the quota reads below saturation the policy stops: no more kills over the next
    // scan intervals (one round of 8 takes 64 to 56 < 0.9 * 64).
    let settled = wait_until(SCAN * 5, POLL, || {
        (result_is(&agent.audit(), "killed").len() > killed).then_some(())
    });
    assert!(
        settled.is_none(),
        "kept killing below saturation: relay {}\n{}",
        chain.status(),
        agent.ctx()
    );
    assert_eq!(
        chain.streams(),
        MAX_STREAMS - killed as u64,
        "{}",
        agent.ctx()
    );

    assert_reclaimed_event(&hook, &chain, &agent, killed);
    assert_quota_alert_names_the_reclaim(&hook, &agent);
    // Metrics count the decisions.
    let metrics = agent.metrics();
    assert_eq!(
        metrics.value(r#"connreap_reclaims_total{policy="relay-leaks",result="killed"}"#),
        Some(killed as f64),
        "{metrics}"
    );
}

/// 64 users give up on a quiet SSE page: the relay's quota for the instance is full, until
/// the agent frees slots (min_idle plus a few scans); then the real path works again.
fn saturate_until_freed(chain: &Chain, agent: &Agent) {
    chain.leak(MAX_STREAMS as usize, Duration::from_millis(500));
    let saturated = Instant::now();
    let st = chain.status();
    assert_eq!(st["endpoints"][0]["streams"], json!(MAX_STREAMS), "{st}");
    // The incident as users saw it (unless the agent already freed a slot: min_idle is 2s).
    let (code, body) = chain.get_json();
    if result_is(&agent.audit(), "killed").is_empty() {
        assert_eq!(
            (code, body.as_str()),
            (503, "busy"),
            "a full relay must refuse the dial"
        );
    }

    // min_idle (2s) plus a few scan intervals: slots are free again.
    let freed_within = Duration::from_secs(2) + SCAN * 6;
    let streams = wait_until(freed_within, POLL, || {
        Some(chain.streams()).filter(|n| *n < MAX_STREAMS)
    })
    .unwrap_or_else(|| {
        panic!(
            "relay still full {:?} after saturation: {}\n{}",
            saturated.elapsed(),
            chain.status(),
            agent.ctx()
        )
    });
    println!(
        "relay below its quota ({streams}/{MAX_STREAMS}) {:?} after saturation",
        saturated.elapsed()
    );
    // The real path works: 200 AND a body, through proxy -> relay -> instance.
    chain.assert_json_ok();
}

/// The audit log says who was closed, and why; the killed sockets are really gone. Returns
/// how many were killed.
fn assert_kills(chain: &Chain, agent: &Agent) -> usize {
    let lines = agent.audit();
    let killed = result_is(&lines, "killed");
    assert!(!killed.is_empty(), "no killed decision:\n{}", agent.ctx());
    for d in &killed {
        assert_relay_decision(d, chain, agent, "enforce", 2.0);
    }
    for (round, n) in per_round(&lines, "killed") {
        assert!(n <= 8, "round {round:?} killed {n} > max_per_round 8");
    }
    let inodes: HashSet<u64> = killed.iter().map(|d| int(d, "inode")).collect();
    assert_eq!(inodes.len(), killed.len(), "an inode killed twice");
    // The log says the same with fields a log tool can filter on: values, not debug text.
    let log = agent.stderr();
    let logged: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("reclaim decision") && l.contains(" result=killed"))
        .collect();
    assert_eq!(logged.len(), killed.len(), "{log}");
    for l in &logged {
        let pid = l
            .split_whitespace()
            .find_map(|w| w.strip_prefix("pid="))
            .unwrap_or_else(|| panic!("no pid field: {l}"));
        assert!(pid.parse::<u32>().is_ok(), "pid={pid} is not a value: {l}");
        assert!(
            l.contains(" policy=relay-leaks") && l.contains(" quota=relay"),
            "{l}"
        );
    }
    // ... and the killed sockets are really gone, the others still leak.
    let left = chain.proxy_upstreams("ESTAB");
    for d in &killed {
        assert!(
            !left.iter().any(|x| x.local.to_string() == text(d, "local")),
            "killed socket {} still ESTABLISHED: {left:#?}",
            text(d, "local")
        );
    }
    killed.len()
}

/// One `reclaimed` event per killing round: the policy, its mode, what it killed and whose.
fn assert_reclaimed_event(hook: &WebhookReceiver, chain: &Chain, agent: &Agent, killed: usize) {
    let ev: Value = hook
        .wait_for_body(Duration::from_secs(10), |b| b["kind"] == "reclaimed")
        .unwrap_or_else(|| {
            panic!(
                "no `reclaimed` webhook; got {:#?}\n{}",
                hook.posts().iter().map(|p| &p.body).collect::<Vec<_>>(),
                agent.ctx()
            )
        })
        .body;
    assert_eq!(ev["policy"], json!("relay-leaks"), "{ev}");
    assert_eq!(ev["mode"], json!("enforce"), "{ev}");
    let n = ev["count"].as_u64().unwrap_or(0);
    assert!(n >= 1 && n <= killed as u64, "{ev}");
    assert_eq!(ev["quota"]["name"], json!("relay"), "{ev}");
    assert!(
        ev["processes"].as_array().is_some_and(|p| p
            .iter()
            .any(|p| p["comm"] == "leaky-proxy" && p["pid"] == json!(chain.proxy_pid()))),
        "{ev}"
    );
    assert!(
        ev["sockets"]
            .as_array()
            .is_some_and(|v| v.len() as u64 == n),
        "{ev}"
    );
}

/// The quota alert says what the reclaim did: once the relay reads below saturation it
/// resolves naming the connections freed by the policy, and no text after a kill calls the
/// freed quota "load (connections are busy)".
fn assert_quota_alert_names_the_reclaim(hook: &WebhookReceiver, agent: &Agent) {
    let resolved = hook
        .wait_for_body(Duration::from_secs(15), |b| {
            is(b, "quota_exhausted_by_leak", "resolved")
        })
        .unwrap_or_else(|| {
            panic!(
                "no resolved quota alert: {:#?}\n{}",
                hook.posts(),
                agent.ctx()
            )
        });
    let resolved = resolved.body;
    let summary = resolved["summary"].as_str().unwrap_or_default();
    assert!(
        summary.contains("freed by reclaim (policy relay-leaks) while it fired"),
        "{resolved:#}"
    );
    for p in hook.posts() {
        let b = &p.body;
        if b["kind"] == "quota_exhausted_by_leak" {
            let s = b["summary"].as_str().unwrap_or_default();
            assert!(!s.contains("connections are busy"), "{b:#}");
        }
    }
}
