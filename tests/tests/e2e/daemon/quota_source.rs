//! A quota source that fails in every way: each failure is named, one alert covers them all,
//! the agent never crashes, and recovery resolves it.

use connreap_tests::{
    fixtures::{relay_status_json, EndpointStatus, QuotaMode, QuotaServer, WebhookReceiver},
    harness::{
        addr,
        alerts::{assert_alert_shape, describe, is, receiver, wait_post},
        require_privileges, wait_until, Agent, Config, NetNs, RelayQuota, TempDir, FINDING, POLL,
    },
};
use serde_json::{json, Value};

const FINGERPRINT: &str = "quota_source_unavailable:relay";

#[test]
fn quota_source_unavailable_names_each_reason_and_never_crashes() {
    let Some(_env) = require_privileges() else {
        return;
    };
    let ns = NetNs::new("quotabad");
    let dir = TempDir::new("quotabad");
    let hook = receiver(&ns);
    let source =
        QuotaServer::start_in_netns(ns.name(), addr("127.0.0.1:20080"), QuotaMode::Http500)
            .unwrap();
    let config = Config::alerting(&dir).quota(RelayQuota::relay().timeout("1s"));
    let mut agent = Agent::start(&ns, &dir, &config);

    http_500_fires(&mut agent, &hook, &source);
    // 2. 200 with a body that is not JSON.
    source.set_mode(QuotaMode::Garbage);
    let f = reason_with(&mut agent, &source, "not JSON");
    assert_eq!(f["fingerprint"], FINGERPRINT, "{f:#}");
    assert!(
        f["reason"].as_str().unwrap().contains("<html>502 oops"),
        "the reason quotes the start of the body: {f:#}"
    );
    // 3. JSON without the configured pointer.
    source.set_mode(QuotaMode::JsonWithoutEndpoints);
    let f = reason_with(&mut agent, &source, "not found");
    assert!(
        f["reason"].as_str().unwrap().contains("`/endpoints`"),
        "the reason names the pointer: {f:#}"
    );
    // 4. No answer at all.
    source.set_mode(QuotaMode::Hang);
    let f = reason_with(&mut agent, &source, "no answer within 1s");
    assert_eq!(f["fingerprint"], FINGERPRINT, "{f:#}");

    // One problem, one alert: the changing reason did not re-send it.
    let firing = hook
        .posts()
        .iter()
        .filter(|p| is(&p.body, "quota_source_unavailable", "firing"))
        .count();
    assert_eq!(firing, 1, "{}", describe(&hook.posts()));

    recovery_resolves(&mut agent, &hook, &source);
}

/// 1. HTTP 500: the finding, the webhook and /v1/quotas all carry the reason.
fn http_500_fires(agent: &mut Agent, hook: &WebhookReceiver, source: &QuotaServer) {
    let f = reason_with(agent, source, "500");
    assert_eq!(f["fingerprint"], FINGERPRINT, "{f:#}");
    assert_eq!(f["status"], "firing", "{f:#}");
    let reason = f["reason"].as_str().unwrap();
    assert!(
        reason.contains("http://127.0.0.1:20080/status") && reason.contains("HTTP 500"),
        "{reason}"
    );
    assert!(
        f["summary"].as_str().unwrap().contains(reason),
        "the summary carries the reason: {f:#}"
    );
    let post = wait_post(hook, agent, "quota_source_unavailable firing", |b| {
        is(b, "quota_source_unavailable", "firing")
    });
    assert_alert_shape(&post.body);
    assert_eq!(post.body["fingerprint"], FINGERPRINT);
    assert!(
        post.body["reason"]
            .as_str()
            .is_some_and(|r| r.contains("500")),
        "{:#}",
        post.body
    );
    let q = agent.get_ok("/v1/quotas");
    assert!(
        q["quotas"][0]["error"]
            .as_str()
            .is_some_and(|e| e.contains("500")),
        "{q:#}"
    );
}

/// The source recovers: resolved, and /v1/quotas shows its entries.
fn recovery_resolves(agent: &mut Agent, hook: &WebhookReceiver, source: &QuotaServer) {
    source.set_json(relay_status_json(
        &[EndpointStatus {
            port: 21000,
            dial_port: 25001,
            streams: 3,
            max_streams: 64,
        }],
        0,
        0,
        3,
    ));
    let resolved = wait_post(hook, agent, "quota_source_unavailable resolved", |b| {
        is(b, "quota_source_unavailable", "resolved")
    });
    assert_alert_shape(&resolved.body);
    assert_eq!(resolved.body["fingerprint"], FINGERPRINT);
    let q = wait_until(FINDING, POLL, || {
        let q = agent.get_ok("/v1/quotas");
        (q["quotas"][0]["error"].is_null()).then_some(q)
    })
    .expect("the quota error never cleared");
    assert_eq!(
        q["quotas"][0]["entries"],
        json!([{"port": 21000, "used": 3, "limit": 64}]),
        "{q:#}"
    );
    assert!(agent.find("quota_source_unavailable", |_| true).is_none());
    agent.assert_healthy();
    assert!(!agent.stderr().contains("panicked"), "{}", agent.stderr());
}

/// Polls /v1/findings (checking /healthz every time) until quota_source_unavailable's reason
/// contains `needle`.
fn reason_with(agent: &mut Agent, source: &QuotaServer, needle: &str) -> Value {
    wait_until(FINDING, POLL, || {
        agent.assert_healthy();
        agent.find("quota_source_unavailable", |f| {
            f["reason"].as_str().is_some_and(|r| r.contains(needle))
        })
    })
    .unwrap_or_else(|| {
        panic!(
            "no quota_source_unavailable with a reason containing {needle:?} (source mode {:?}, {} polls); findings: {:#?}\nagent stderr:\n{}",
            source.mode(),
            source.hits(),
            agent.findings(),
            agent.stderr()
        )
    })
}
