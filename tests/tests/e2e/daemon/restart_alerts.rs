//! A daemon restarted while an alert fires takes that alert over: the receiver gets no second
//! `firing` for it (same fingerprint, same `started_at`), and when the leak ends, one
//! `resolved` that states the figures at resolution (not the firing text).

use std::time::Duration;

use connreap_tests::{
    fixtures::WebhookReceiver,
    harness::{
        addr,
        alerts::{describe, is, names_pid, statuses, wait_post},
        peer, require_privileges, Agent, Config, NetNs, TempDir, HOOK,
    },
};

#[test]
fn a_restart_does_not_fire_active_alerts_again() {
    let Some(_env) = require_privileges() else {
        return;
    };
    let ns = NetNs::new("restart-alerts");
    let dir = TempDir::new("restart-alerts");
    let hook = WebhookReceiver::start_in_netns(ns.name(), addr(HOOK))
        .unwrap_or_else(|e| panic!("receiver: {e}"));
    let (cw, _) = peer(
        &ns,
        &["close-wait", "--addr", "127.0.0.1:7600", "--count", "2"],
    );
    let config =
        Config::alerting(&dir).detect("close_wait_min_age = \"1s\"\nclose_wait_threshold = 2");
    let mut agent = Agent::start(&ns, &dir, &config);
    let fired = wait_post(&hook, &agent, "close_wait_buildup firing", |b| {
        is(b, "close_wait_buildup", "firing") && names_pid(b, cw.pid())
    });
    let fingerprint = fired.body["fingerprint"].clone();
    let started_at = fired.body["started_at"].clone();

    agent.signal(libc::SIGTERM);
    assert!(
        agent.wait_exit(Duration::from_secs(10)).is_some(),
        "the daemon did not stop on SIGTERM"
    );
    let agent = Agent::start(&ns, &dir, &config);
    agent.wait_scans(5);
    let current = agent
        .find("close_wait_buildup", |f| names_pid(f, cw.pid()))
        .unwrap_or_else(|| panic!("still a finding after the restart: {:#?}", agent.findings()));
    assert_eq!(current["fingerprint"], fingerprint);
    assert_eq!(
        statuses(&hook, &fingerprint),
        ["firing"],
        "the restarted daemon must not fire the same alert again:\n{}",
        describe(&hook.posts())
    );
    assert_eq!(
        current["started_at"], started_at,
        "the alert keeps its start across the restart: {current:#}"
    );

    drop(cw);
    let resolved = wait_post(&hook, &agent, "close_wait_buildup resolved", |b| {
        is(b, "close_wait_buildup", "resolved") && b["fingerprint"] == fingerprint
    });
    let summary = resolved.body["summary"].as_str().unwrap_or_default();
    assert!(
        summary.starts_with("resolved after ")
            && summary.contains("fewer than close_wait_threshold 2 CLOSE_WAIT sockets"),
        "the resolved notification states the figures at resolution: {summary}"
    );
    assert_eq!(resolved.body["started_at"], started_at);
    assert_eq!(statuses(&hook, &fingerprint), ["firing", "resolved"]);
}
