//! Incident 3, a reconnect storm: a client whose reconnect rate keeps growing is named with
//! its port, while a polite client that also grows but stays below the rate is not.

use std::time::{Duration, Instant};

use connreap_tests::{
    fixtures::WebhookPost,
    harness::{
        alerts::{assert_alert_shape, describe, is, names_pid, owners, receiver, wait_post},
        peer, require_privileges, Agent, Child, Config, NetNs, TempDir, PEER_COMM,
    },
};

#[test]
fn reconnect_storm_names_the_process_and_port() {
    let Some(_env) = require_privileges() else {
        return;
    };
    let ns = NetNs::new("storm");
    let dir = TempDir::new("storm");
    let hook = receiver(&ns);
    let config = Config::alerting(&dir).detect("storm_rate = 50.0\nstorm_growth_windows = 2");
    let mut agent = Agent::start(&ns, &dir, &config);
    let (_server, _) = peer(
        &ns,
        &[
            "listen",
            "--addr",
            "127.0.0.1:7500",
            "--close-after-ms",
            "0",
        ],
    );
    // A client whose reconnects double every second, 20/s up to 320/s, for 12 s; and a
    // polite one that also grows but stays below the rate (1/s up to 16/s).
    let storm = storming_client(&ns, "20", "320");
    let started = Instant::now();
    let polite = storming_client(&ns, "1", "16");

    let post = wait_post(
        &hook,
        &agent,
        "reconnect_storm for the storming client",
        |b| is(b, "reconnect_storm", "firing") && names_pid(b, storm.pid()),
    );
    assert_storm_alert(&post, started, storm.pid());

    // While it fires: the API shows it, the polite client is never a storm.
    let f = agent
        .find("reconnect_storm", |f| names_pid(f, storm.pid()))
        .unwrap_or_else(|| panic!("/v1/findings lacks the storm: {:#?}", agent.findings()));
    assert!(
        f["rate_per_sec"].as_f64().is_some_and(|r| r >= 50.0),
        "{f:#}"
    );
    assert!(
        agent
            .find("reconnect_storm", |f| names_pid(f, polite.pid()))
            .is_none(),
        "{:#?}",
        agent.findings()
    );
    assert!(agent
        .metric(r#"connreap_findings{kind="reconnect_storm"}"#)
        .is_some_and(|n| n >= 1.0));
    agent.assert_healthy();

    // The storm stops after 12 s: the alert resolves.
    let resolved = wait_post(&hook, &agent, "reconnect_storm resolved", |b| {
        is(b, "reconnect_storm", "resolved") && names_pid(b, storm.pid())
    });
    assert_alert_shape(&resolved.body);
    assert!(
        resolved.at.duration_since(started) >= Duration::from_secs(11),
        "resolved while the storm still ran: {:?}",
        resolved.at.duration_since(started)
    );
    assert!(
        hook.posts()
            .iter()
            .all(|p| !names_pid(&p.body, polite.pid())),
        "{}",
        describe(&hook.posts())
    );
    agent.assert_healthy();
}

/// A testpeer reconnecting to 127.0.0.1:7500 at `start_rate`/s, doubling every second up to
/// `max_rate`/s, for 12 s.
fn storming_client(ns: &NetNs, start_rate: &str, max_rate: &str) -> Child {
    peer(
        ns,
        &[
            "storm",
            "--addr",
            "127.0.0.1:7500",
            "--start-rate",
            start_rate,
            "--max-rate",
            max_rate,
            "--duration-ms",
            "12000",
        ],
    )
    .0
}

/// The storm alert names the client, its port and a plausible rate, after three growing windows.
fn assert_storm_alert(post: &WebhookPost, started: Instant, storm: u32) {
    let b = &post.body;
    assert_alert_shape(b);
    assert!(
        post.at.duration_since(started) >= Duration::from_secs(2),
        "needs three growing windows at 1 s scans: fired after {:?}",
        post.at.duration_since(started)
    );
    assert_eq!(
        b["fingerprint"],
        // Identity without the pid: a restarted client keeps its alert (the pid is in
        // `processes`).
        format!("reconnect_storm:{PEER_COMM}:7500"),
        "{b:#}"
    );
    assert_eq!(b["service_port"], 7500, "{b:#}");
    assert_eq!(
        owners(b),
        vec![(Some(storm as u64), PEER_COMM.to_string())],
        "{b:#}"
    );
    let rate = b["rate_per_sec"].as_f64().unwrap_or(0.0);
    assert!(
        (50.0..=400.0).contains(&rate),
        "rate {rate}/s should be ≥ storm_rate and ≤ what the client can do: {b:#}"
    );
    let summary = b["summary"].as_str().unwrap();
    assert!(
        summary.contains(&format!(
            "{PEER_COMM} pid {storm} opens {rate:.0} new connections/s to port 7500"
        )),
        "{summary}"
    );
}
