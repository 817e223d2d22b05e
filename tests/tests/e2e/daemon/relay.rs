//! Incident 1: the leaky proxy fills the relay's quota; the agent says so, names who holds it,
//! and resolves once a proxy restart frees it.

use std::time::{Duration, Instant};

use connreap_tests::{
    fixtures::{WebhookPost, WebhookReceiver},
    harness::{
        alerts::{
            assert_alert_shape, describe, is, names_pid, owners, receiver, statuses, wait_post,
        },
        require_privileges, wait_until, Agent, Chain, Config, NetNs, RelayQuota, TempDir, FINDING,
        HOOK, HTTP, POLL,
    },
};
use serde_json::{json, Value};

const FINGERPRINT: &str = "quota_exhausted_by_leak:relay:21000";

#[test]
fn relay_quota_exhausted_by_leaky_proxy_alerts_and_resolves() {
    let Some(_env) = require_privileges() else {
        return;
    };
    let ns = NetNs::new("relay");
    let dir = TempDir::new("relay");
    let hook = receiver(&ns);
    let mut chain = Chain::start(&ns);
    let config = Config::alerting(&dir)
        .detect("stuck_pair_min_idle = \"3s\"\nstuck_pair_threshold = 16\nquota_idle_min = \"3s\"")
        .quota(RelayQuota::relay().port_map(21000, 25001));
    let mut agent = Agent::start(&ns, &dir, &config);
    // The real path works first: 200 with a body through proxy -> relay -> instance.
    chain.assert_json_ok();

    fill_the_relay(&chain);
    assert_quota_alert(&hook, &agent, &chain);
    assert_pair_alerts(&hook, &agent, &chain);
    assert_api_while_firing(&mut agent, &chain);
    assert_proxy_restart_resolves(&hook, &mut agent, &mut chain);
}

/// 64 users open a quiet SSE page through the proxy and give up after a second: the relay's
/// quota is full and every new request is refused.
fn fill_the_relay(chain: &Chain) {
    chain.leak(64, Duration::from_secs(1));
    assert!(
        wait_until(HTTP, POLL, || (chain.try_streams() == Some(64))
            .then_some(()))
        .is_some(),
        "the relay's quota did not fill: streams {:?}",
        chain.try_streams()
    );
    // The incident's symptom: every new request is refused.
    let (code, body) = chain.get_json();
    assert_eq!((code, body.as_str()), (503, "busy"));
}

/// The receiver learns that the quota is exhausted by a leak, and who holds it.
fn assert_quota_alert(hook: &WebhookReceiver, agent: &Agent, chain: &Chain) {
    let post = wait_post(hook, agent, "quota_exhausted_by_leak (verdict leak)", |b| {
        is(b, "quota_exhausted_by_leak", "firing") && b["verdict"] == "leak"
    });
    let b = &post.body;
    assert_alert_shape(b);
    assert_eq!(b["fingerprint"], FINGERPRINT, "{b:#}");
    assert_eq!(b["service_port"], 21000, "{b:#}");
    assert_eq!(
        b["quota"],
        json!({"name": "relay", "used": 64, "limit": 64, "port": 21000}),
        "{b:#}"
    );
    assert_eq!(
        b["count"], 64,
        "64 relay streams on local port 25001: {b:#}"
    );
    let procs = owners(b);
    assert!(
        procs.contains(&(Some(chain.proxy_pid() as u64), "leaky-proxy".into())),
        "the leaky proxy (pid {}) is not named: {b:#}",
        chain.proxy_pid()
    );
    assert!(
        procs.contains(&(Some(chain.relay_pid() as u64), "relay-sim".into())),
        "the relay (pid {}) is not named: {b:#}",
        chain.relay_pid()
    );
    assert!(
        procs
            .iter()
            .all(|(_, c)| c == "leaky-proxy" || c == "relay-sim"),
        "only the two ends of the relay's streams hold them: {b:#}"
    );
    for p in b["processes"].as_array().unwrap() {
        assert_eq!(p["count"], 64, "each side holds 64 sockets: {b:#}");
    }
    let summary = b["summary"].as_str().unwrap();
    assert!(
        summary.starts_with("relay quota on port 21000 at 64/64 (connections on local port 25001); 64 of 64 connections idle"),
        "{summary}"
    );
    assert!(summary.ends_with("verdict: leak"), "{summary}");
    let socks = b["sockets"].as_array().unwrap();
    assert!(!socks.is_empty(), "{b:#}");
    for s in socks {
        assert_eq!(s["state"], "ESTABLISHED", "{s}");
        let on_dial_slot = s["local"] == "127.0.0.1:25001" || s["peer"] == "127.0.0.1:25001";
        assert!(on_dial_slot, "socket not on the dial slot: {s}");
        assert!(
            s["idle_secs"].as_f64().is_some_and(|i| i >= 3.0),
            "not idle ≥ quota_idle_min: {s}"
        );
    }
}

/// Idle ESTABLISHED pairs: proxy -> relay on the dial slot, relay -> instance on 21000.
fn assert_pair_alerts(hook: &WebhookReceiver, agent: &Agent, chain: &Chain) {
    let pairs = wait_post(hook, agent, "stuck_established_pairs on 25001", |b| {
        is(b, "stuck_established_pairs", "firing") && b["service_port"] == 25001
    });
    let b = &pairs.body;
    assert_alert_shape(b);
    assert_eq!(b["count"], 64, "{b:#}");
    assert_eq!(
        owners(b),
        vec![
            (Some(chain.proxy_pid() as u64), "leaky-proxy".to_string()),
            (Some(chain.relay_pid() as u64), "relay-sim".to_string())
        ],
        "client (proxy) then server (relay): {b:#}"
    );
    assert_eq!(b["quota"], Value::Null, "{b:#}");
    let inner = wait_post(hook, agent, "stuck_established_pairs on 21000", |b| {
        is(b, "stuck_established_pairs", "firing") && b["service_port"] == 21000
    });
    assert_eq!(inner.body["count"], 64, "{:#}", inner.body);
    assert_eq!(
        owners(&inner.body)[0],
        (Some(chain.relay_pid() as u64), "relay-sim".to_string()),
        "{:#}",
        inner.body
    );
}

/// The API shows the same while it fires: /v1/findings, /v1/quotas, /metrics.
fn assert_api_while_firing(agent: &mut Agent, chain: &Chain) {
    let f = agent
        .find("quota_exhausted_by_leak", |f| {
            f["fingerprint"] == FINGERPRINT
        })
        .unwrap_or_else(|| panic!("/v1/findings lacks {FINGERPRINT}: {:#?}", agent.findings()));
    assert_eq!(f["status"], "firing", "{f:#}");
    assert_eq!(f["verdict"], "leak", "{f:#}");
    assert_eq!(
        f["quota"],
        json!({"name": "relay", "used": 64, "limit": 64, "port": 21000}),
        "{f:#}"
    );
    assert!(
        names_pid(&f, chain.proxy_pid()) && names_pid(&f, chain.relay_pid()),
        "{f:#}"
    );
    let quotas = agent.get_ok("/v1/quotas");
    let relay_q = quotas["quotas"]
        .as_array()
        .and_then(|qs| qs.iter().find(|q| q["name"] == "relay"))
        .unwrap_or_else(|| panic!("/v1/quotas lacks relay: {quotas:#}"));
    assert_eq!(relay_q["error"], Value::Null, "{relay_q:#}");
    assert_eq!(
        relay_q["url"], "http://127.0.0.1:20080/status",
        "{relay_q:#}"
    );
    assert_eq!(
        relay_q["entries"],
        json!([{"port": 21000, "used": 64, "limit": 64}]),
        "{relay_q:#}"
    );
    let metrics = agent.metrics();
    assert_eq!(
        metrics.value(r#"connreap_findings{kind="quota_exhausted_by_leak"}"#),
        Some(1.0),
        "{metrics}"
    );
    assert!(
        metrics
            .value(r#"connreap_findings{kind="stuck_established_pairs"}"#)
            .is_some_and(|n| n >= 1.0),
        "{metrics}"
    );
    assert!(
        metrics
            .value(&format!(
                r#"connreap_webhook_sends_total{{receiver="http://{HOOK}/alerts",result="ok"}}"#
            ))
            .is_some_and(|n| n >= 2.0),
        "{metrics}"
    );
    agent.assert_healthy();
}

/// Only a restart of the proxy frees the quota: kill it and the alerts resolve, once; with a
/// new proxy the chain works again.
fn assert_proxy_restart_resolves(hook: &WebhookReceiver, agent: &mut Agent, chain: &mut Chain) {
    let killed_at = Instant::now();
    chain.kill_proxy();
    assert!(
        wait_until(FINDING, POLL, || (chain.try_streams() == Some(0))
            .then_some(()))
        .is_some(),
        "the relay did not release its streams: {:?}",
        chain.try_streams()
    );
    let resolved: WebhookPost = wait_post(hook, agent, "quota_exhausted_by_leak resolved", |b| {
        is(b, "quota_exhausted_by_leak", "resolved")
    });
    let b = &resolved.body;
    assert_alert_shape(b);
    assert!(resolved.at > killed_at, "resolved before the proxy died");
    assert_eq!(b["fingerprint"], FINGERPRINT, "{b:#}");
    assert_eq!(b["service_port"], 21000, "{b:#}");
    wait_post(
        hook,
        agent,
        "stuck_established_pairs on 25001 resolved",
        |b| is(b, "stuck_established_pairs", "resolved") && b["service_port"] == 25001,
    );
    let gone = wait_until(FINDING, POLL, || {
        agent
            .find("quota_exhausted_by_leak", |_| true)
            .is_none()
            .then_some(())
    });
    assert!(gone.is_some(), "{:#?}", agent.findings());
    assert_eq!(
        agent.metric(r#"connreap_findings{kind="quota_exhausted_by_leak"}"#),
        Some(0.0)
    );
    // Sent once while it fired, then resolved once.
    let sent = statuses(hook, &json!(FINGERPRINT));
    assert_eq!(
        sent.last().map(String::as_str),
        Some("resolved"),
        "{}",
        describe(&hook.posts())
    );
    assert_eq!(
        sent.iter().filter(|s| *s == "resolved").count(),
        1,
        "{}",
        describe(&hook.posts())
    );
    // The chain works again once a proxy runs.
    chain.restart_proxy();
    let (code, body) = chain.get_json();
    assert_eq!(code, 200, "{body}");
    assert!(!body.is_empty());
    agent.assert_healthy();
}
