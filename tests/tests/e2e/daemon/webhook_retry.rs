//! The webhook receiver is down for a while, then up: the alert is retried, delivered once,
//! and the agent stays healthy meanwhile.

use std::time::{Duration, Instant};

use connreap_tests::{
    fixtures::WebhookReceiver,
    harness::{
        addr,
        alerts::{assert_alert_shape, describe, is, names_pid, owners, statuses, wait_post},
        peer, require_privileges, wait_until, Agent, Config, NetNs, TempDir, FINDING, HOOK,
        PEER_COMM, POLL,
    },
};
use serde_json::Value;

/// `connreap_webhook_sends_total` of the test's receiver for `result` (ok, error).
fn sends(result: &str) -> String {
    format!(r#"connreap_webhook_sends_total{{receiver="http://{HOOK}/alerts",result="{result}"}}"#)
}

#[test]
fn webhook_delivery_is_retried_until_the_receiver_is_up() {
    let Some(_env) = require_privileges() else {
        return;
    };
    let ns = NetNs::new("hookdown");
    let dir = TempDir::new("hookdown");
    let hook = WebhookReceiver::new_stopped_in_netns(ns.name(), addr(HOOK));
    let (cw, _) = peer(
        &ns,
        &["close-wait", "--addr", "127.0.0.1:7600", "--count", "2"],
    );
    let config =
        Config::alerting(&dir).detect("close_wait_min_age = \"1s\"\nclose_wait_threshold = 2");
    let mut agent = Agent::start(&ns, &dir, &config);

    fires_while_nobody_listens(&mut agent, &hook, cw.pid());
    let fingerprint = delivered_once_the_receiver_is_up(&agent, &hook, cw.pid());

    // Retries did not duplicate it: one firing, then (sockets gone) one resolved.
    drop(cw);
    wait_post(&hook, &agent, "close_wait_buildup resolved", |b| {
        is(b, "close_wait_buildup", "resolved") && b["fingerprint"] == fingerprint
    });
    assert_eq!(
        statuses(&hook, &fingerprint),
        ["firing", "resolved"],
        "{}",
        describe(&hook.posts())
    );
    agent.assert_healthy();
}

/// The finding fires while nobody listens on the webhook URL; deliveries fail and are retried
/// (1 s, then 2 s apart), the alert stays queued, and the agent stays healthy.
fn fires_while_nobody_listens(agent: &mut Agent, hook: &WebhookReceiver, cw: u32) {
    let f = wait_until(FINDING, POLL, || {
        agent.assert_healthy();
        agent.find("close_wait_buildup", |f| names_pid(f, cw))
    })
    .unwrap_or_else(|| panic!("no close_wait_buildup: {:#?}", agent.findings()));
    assert_eq!(f["service_port"], 7600, "{f:#}");
    let retried = wait_until(FINDING, POLL, || {
        agent.assert_healthy();
        agent.metric(&sends("error")).filter(|n| *n >= 3.0)
    });
    assert!(
        retried.is_some(),
        "no failed deliveries counted: {}",
        agent.metrics()
    );
    // The log says why: nobody listens.
    let stderr = agent.stderr();
    assert!(
        stderr.lines().any(|l| l.contains("webhook delivery failed")
            && l.contains(&format!("receiver=http://{HOOK}/alerts"))
            && l.contains(r#"cause="connection refused""#)),
        "no log line names the cause:\n{stderr}"
    );
    let (_, health) = agent.get("/healthz");
    assert!(
        health["webhook_queued"].as_u64().is_some_and(|n| n >= 1),
        "the undelivered alert is queued: {health}"
    );
    assert_eq!(hook.count(), 0);
}

/// Receiver up: the queued alert arrives (within the 2 s max backoff plus a scan or two), the
/// queue empties and the counters say what happened. Returns the alert's fingerprint.
fn delivered_once_the_receiver_is_up(agent: &Agent, hook: &WebhookReceiver, cw: u32) -> Value {
    let up_at = Instant::now();
    hook.restart().unwrap();
    let post = wait_post(hook, agent, "the queued close_wait_buildup", |b| {
        is(b, "close_wait_buildup", "firing")
    });
    assert!(post.at >= up_at);
    assert!(
        post.at.duration_since(up_at) < Duration::from_secs(8),
        "took {:?} after the receiver came up",
        post.at.duration_since(up_at)
    );
    let b = &post.body;
    assert_alert_shape(b);
    assert_eq!(b["service_port"], 7600, "{b:#}");
    assert_eq!(
        owners(b),
        vec![(Some(cw as u64), PEER_COMM.to_string())],
        "{b:#}"
    );
    assert_eq!(post.content_type.as_deref(), Some("application/json"));
    assert_eq!(post.path, "/alerts");
    let delivered = wait_until(FINDING, POLL, || {
        let h = agent.get_ok("/healthz");
        (h["webhook_queued"] == 0).then_some(())
    });
    assert!(delivered.is_some(), "{}", agent.get_ok("/healthz"));
    let metrics = agent.metrics();
    assert!(
        metrics.value(&sends("error")).is_some_and(|n| n >= 3.0),
        "{metrics}"
    );
    assert!(
        metrics.value(&sends("ok")).is_some_and(|n| n >= 1.0),
        "{metrics}"
    );
    assert_eq!(
        metrics.value(&format!(
            r#"connreap_webhook_dropped_total{{receiver="http://{HOOK}/alerts"}}"#
        )),
        Some(0.0),
        "{metrics}"
    );
    b["fingerprint"].clone()
}

/// A burst of notifications overflows the queue of a receiver that is down: each drop is
/// counted at once, the log says so once at once and then once per interval with the count,
/// not one ERROR line per dropped notification.
#[test]
fn a_queue_overflow_is_logged_as_counts_not_one_line_per_drop() {
    let Some(_env) = require_privileges() else {
        return;
    };
    let ns = NetNs::new("hookfull");
    let dir = TempDir::new("hookfull");
    let _hook = WebhookReceiver::new_stopped_in_netns(ns.name(), addr(HOOK));
    const PORTS: u16 = 8;
    let pools: Vec<_> = (0..PORTS)
        .map(|i| {
            let a = format!("127.0.0.1:{}", 7610 + i);
            peer(&ns, &["close-wait", "--addr", &a, "--count", "2"])
        })
        .collect();
    let config = Config::alerting(&dir)
        .detect("close_wait_min_age = \"1s\"\nclose_wait_threshold = 2")
        .webhook_delivery("queue_capacity = 1");
    let mut agent = Agent::start(&ns, &dir, &config);
    let series = format!(r#"connreap_webhook_dropped_total{{receiver="http://{HOOK}/alerts"}}"#);
    // One per port fires; the queue holds one (the sender may hold another in flight).
    let dropped = wait_until(FINDING, POLL, || {
        agent.assert_alive();
        let n = agent.metric(&series).unwrap_or(0.0);
        (n >= f64::from(PORTS) - 2.0).then_some(n)
    })
    .unwrap_or_else(|| panic!("the queue never overflowed:\n{}", agent.ctx()));
    let lines = |log: &str| -> Vec<u64> {
        log.lines()
            .filter(|l| l.contains("webhook queue full"))
            .map(|l| {
                let n = l
                    .split_whitespace()
                    .find_map(|w| w.strip_prefix("dropped="))
                    .unwrap_or_else(|| panic!("no dropped= field: {l}"));
                n.parse()
                    .unwrap_or_else(|_| panic!("dropped={n} is not a count: {l}"))
            })
            .collect()
    };
    let first = lines(&agent.stderr());
    assert_eq!(
        first.len(),
        1,
        "{dropped} drops must give one line at once, not one each:\n{}",
        agent.stderr()
    );
    // Within one interval (10 s) and a scan, the rest of the burst is written as one count.
    let counted = wait_until(Duration::from_secs(15), POLL, || {
        let l = lines(&agent.stderr());
        let total = l.iter().sum::<u64>() as f64;
        (l.len() == 2 && total == agent.metric(&series).unwrap_or(-1.0)).then_some(l)
    });
    assert!(
        counted.is_some(),
        "the log's counts never added up to {series} ({:?}) in two lines:\n{}",
        agent.metric(&series),
        agent.stderr()
    );
    drop(pools);
    agent.assert_alive();
}
