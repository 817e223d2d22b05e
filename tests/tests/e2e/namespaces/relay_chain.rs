//! Incident 1 inside a pod: the seed relay chain (leaky-proxy -> relay-sim with its quota of
//! streams per target port -> instance-sim) runs in one namespace, connreap in the host's.
//! The relay's `/status` is on loopback inside that namespace only, so the `[[quota]]` names
//! the namespace and is polled from inside it; a decoy `/status` on the same address in the
//! host's namespace (a relay with free slots) must never be read. The leak is detected
//! (quota_exhausted_by_leak naming the namespace), reclaimed there by an enforce policy, and a
//! real request through the chain answers 200 with a body afterwards.

use std::time::Duration;

use connreap_tests::{
    fixtures::{free_addr, relay_status_json, EndpointStatus, QuotaMode, QuotaServer},
    harness::{
        addr,
        alerts::wait_post,
        audit::{result_is, text},
        require_privileges, wait_until, Agent, Chain, Config, NetNs, RelayQuota, TempDir, DIAL,
        HTTP, MAX_STREAMS, POLL, RELAY_STATUS, SCAN,
    },
};
use serde_json::json;

use super::{assert_names_netns, host_receiver, names_pid, netns_inode_of};

/// The policy's min_idle: later than the quota finding (quota_idle_min 2s), so the finding
/// fires before the first kill.
const MIN_IDLE: Duration = Duration::from_secs(4);

#[test]
fn relay_chain_in_a_namespace() {
    let Some(_env) = require_privileges() else {
        return;
    };
    let ns = NetNs::new("relay-pod");
    let chain = Chain::start(&ns);
    let inode = netns_inode_of(chain.relay_pid());
    // The decoy: 127.0.0.1:20080 in the host's namespace, with nothing used.
    let decoy = QuotaServer::start(
        addr(RELAY_STATUS),
        QuotaMode::Json(relay_status_json(
            &[EndpointStatus {
                port: 21000,
                dial_port: 25001,
                streams: 0,
                max_streams: MAX_STREAMS,
            }],
            0,
            0,
            0,
        )),
    );
    if let Err(e) = &decoy {
        println!("no decoy /status in the host's namespace ({RELAY_STATUS}: {e})");
    }

    let dir = TempDir::new("ns-relay");
    let hook = host_receiver();
    let policy = format!(
        r#"[[policy]]
name = "relay-leaks"
mode = "enforce"
trigger = "quota-saturated"
quota = "relay"
select = {{ netns = "{}", comm = "leaky-proxy", peer_port = 25001, states = ["ESTABLISHED"] }}
min_idle = "{}s"
max_per_round = 8
"#,
        ns.name(),
        MIN_IDLE.as_secs()
    );
    let config = Config::alerting_to(&dir, &hook.url("/alerts"))
        .listen(free_addr())
        .protect_ports(&[22])
        .detect("quota_idle_min = \"2s\"")
        .quota(RelayQuota::relay().port_map(21000, 25001).netns(ns.name()))
        .policy(&policy);
    let mut agent = Agent::start_in_host(&dir, &config);
    chain.assert_json_ok();

    // 64 users give up on a quiet SSE page: the relay's quota is full.
    chain.leak(MAX_STREAMS as usize, Duration::from_secs(1));
    let full = wait_until(HTTP, POLL, || {
        (chain.try_streams() == Some(MAX_STREAMS)).then_some(())
    });
    assert!(
        full.is_some(),
        "the relay's quota did not fill: {:?}",
        chain.try_streams()
    );

    let post = wait_post(&hook, &agent, "quota_exhausted_by_leak", |b| {
        b["kind"] == "quota_exhausted_by_leak" && b["status"] == "firing"
    });
    let b = &post.body;
    assert_eq!(b["service_port"], 21000, "{b:#}");
    assert_eq!(b["quota"]["name"], "relay", "{b:#}");
    assert_eq!(b["quota"]["limit"], MAX_STREAMS, "{b:#}");
    assert!(
        names_pid(b, chain.proxy_pid()) && names_pid(b, chain.relay_pid()),
        "the proxy (pid {}) and the relay (pid {}) hold the quota: {b:#}",
        chain.proxy_pid(),
        chain.relay_pid()
    );
    assert_names_netns(b, inode, ns.name(), "the quota_exhausted_by_leak alert");

    // The policy frees slots in the namespace: the real path works again, 200 with a body.
    let freed = wait_until(MIN_IDLE + SCAN * 8, POLL, || {
        chain.try_streams().filter(|n| *n < MAX_STREAMS)
    });
    assert!(
        freed.is_some(),
        "the relay is still full ({:?}):\n{}",
        chain.try_streams(),
        agent.ctx()
    );
    chain.assert_json_ok();

    let lines = agent.audit();
    let killed = result_is(&lines, "killed");
    assert!(!killed.is_empty(), "no kill audited:\n{}", agent.ctx());
    for d in &killed {
        assert_eq!(text(d, "comm"), "leaky-proxy", "{d}");
        assert_eq!(d["pid"], json!(chain.proxy_pid()), "{d}");
        assert_eq!(text(d, "peer"), DIAL, "{d}");
        assert_eq!(d["quota"]["name"], "relay", "{d}");
        assert_names_netns(d, inode, ns.name(), "an audit line");
    }
    if let Ok(decoy) = &decoy {
        assert_eq!(
            decoy.hits(),
            0,
            "the quota was read from the host's namespace, not from {}",
            ns.name()
        );
    }
    agent.assert_healthy();
}
