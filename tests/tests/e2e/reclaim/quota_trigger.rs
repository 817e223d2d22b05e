//! The quota trigger, against a relay status we control: a policy acts once per saturated
//! reading, never on a failed or low one, and again once the quota saturates again.

use std::{collections::BTreeSet, time::Duration};

use connreap_tests::fixtures::EndpointStatus;
use connreap_tests::{
    fixtures::{relay_status_json, QuotaMode, QuotaServer},
    harness::{
        addr, alive,
        audit::{assert_decision_shape, per_round, result_is, text},
        peer, require_privileges, spawn_ready, wait_until, Agent, Config, NetNs, RelayQuota,
        TempDir, INSTANCE_SIM, MAX_STREAMS, PEER_COMM, POLL, SCAN,
    },
};
use serde_json::{json, Value};

use super::start_agent;

const N: usize = 24;

/// A relay `/status` with one endpoint at `streams`/64.
fn frozen_status(streams: u64) -> Value {
    relay_status_json(
        &[EndpointStatus {
            port: 7600,
            dial_port: 7600,
            streams,
            max_streams: MAX_STREAMS,
        }],
        0,
        0,
        0,
    )
}

/// Waits until the agent has polled `status` at least `n` times.
fn wait_hits(status: &QuotaServer, n: usize) {
    wait_until(Duration::from_secs(10), POLL, || {
        (status.hits() >= n).then_some(())
    })
    .unwrap_or_else(|| {
        panic!(
            "the agent stopped polling the quota ({} polls)",
            status.hits()
        )
    })
}

#[test]
fn quota_trigger_acts_once_per_saturated_reading_and_never_on_bad_or_low_readings() {
    let Some(_env) = require_privileges() else {
        return;
    };
    let ns = NetNs::new("rc-gate");
    let dir = TempDir::new("gate");
    // Plenty of candidates: testpeer clients to an instance-sim.
    let _server = spawn_ready(&ns, INSTANCE_SIM, &["--listen", "127.0.0.1:7600"]);
    let (targets, ready) = peer(
        &ns,
        &[
            "connect",
            "--addr",
            "127.0.0.1:7600",
            "--count",
            &N.to_string(),
        ],
    );
    // A status source read every 3s while the agent scans every second: each reading is seen
    // by about three rounds, and only one of them may act on it.
    let status = QuotaServer::start_in_netns(
        ns.name(),
        addr("127.0.0.1:0"),
        QuotaMode::Json(frozen_status(MAX_STREAMS)),
    )
    .unwrap();
    let policy = format!(
        r#"[[policy]]
name = "gate"
mode = "enforce"
trigger = "quota-saturated"
quota = "frozen"
select = {{ comm = "{PEER_COMM}", peer_port = 7600 }}
max_per_round = 2
"#
    );
    let config = Config::reclaiming(&dir)
        .quota(RelayQuota::new("frozen", &status.url()).poll_interval("3s"))
        .policy(&policy);
    let agent = start_agent(&ns, &dir, &config);

    acts_once_per_saturated_reading(&agent, &status, targets.pid(), &ready.locals());
    let killed = || result_is(&agent.audit(), "killed").len();

    // The source fails (stale data), then reads below saturation: no kill from the first
    // failed reading on, over two full poll periods.
    status.set_mode(QuotaMode::Http500);
    let h = status.hits();
    wait_hits(&status, h + 1);
    // Every earlier reading was acted on in the round right after it (rounds every second,
    // readings every 3s): from here on nothing may be killed.
    let before = killed();
    status.set_json(frozen_status(32));
    wait_hits(&status, h + 2);
    wait_hits(&status, h + 3);
    assert_eq!(
        killed(),
        before,
        "killed while the quota was unavailable or below saturation:\n{}",
        agent.ctx()
    );

    // Saturated again: it acts again.
    status.set_json(frozen_status(MAX_STREAMS));
    assert!(
        wait_until(Duration::from_secs(3) + SCAN * 4, POLL, || {
            (killed() > before).then_some(())
        })
        .is_some(),
        "no kill after the quota saturated again:\n{}",
        agent.ctx()
    );
    assert!(alive(targets.pid()));
}

/// Saturated all along: it acts, again on each new reading, but once per reading, and only on
/// the targets.
fn acts_once_per_saturated_reading(
    agent: &Agent,
    status: &QuotaServer,
    targets: u32,
    target_locals: &BTreeSet<String>,
) {
    wait_hits(status, 4);
    let (rounds, hits) = (per_round(&agent.audit(), "killed").len(), status.hits());
    assert!(
        rounds >= 2,
        "{rounds} killing rounds over {hits} saturated readings:\n{}",
        agent.ctx()
    );
    assert!(
        rounds <= hits,
        "{rounds} killing rounds on {hits} readings: acted twice on one reading\n{}",
        agent.ctx()
    );
    let lines = agent.audit();
    for d in result_is(&lines, "killed") {
        assert_decision_shape(d);
        assert_eq!(
            d["quota"],
            json!({"name": "frozen", "used": 64, "limit": 64, "port": 7600}),
            "{d}"
        );
        assert!(target_locals.contains(text(d, "local")), "{d}");
        assert_eq!(d["pid"], json!(targets), "{d}");
    }
    for (round, n) in per_round(&lines, "killed") {
        assert!(n <= 2, "round {round:?} killed {n} > max_per_round 2");
    }
}
