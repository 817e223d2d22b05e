//! A pool's CLOSE_WAIT leak reclaimed by an `always` policy, on both destroy mechanisms: the
//! leaked sockets go, the process and its listener live on.

use std::collections::BTreeSet;

use connreap_tests::{
    fixtures::{http::connect, ss_tcp, SsSocket},
    harness::{
        addr, alive,
        audit::{assert_decision_shape, per_round, result_is, text},
        peer, require_privileges, snapshot, sockets, wait_until, Agent, Config, NetNs, TempDir,
        HTTP, PEER_COMM, POLL, SCAN,
    },
};
use serde_json::json;

use super::{start_agent, TOKEN};

const N: usize = 10;

#[test]
fn close_wait_pool_leak_is_reclaimed_and_the_client_lives_on() {
    close_wait_pool_leak("rc-cw", None);
}

/// The same leak on the fallback path that kernels without CONFIG_INET_DIAG_DESTROY use.
#[test]
fn close_wait_pool_leak_is_reclaimed_through_the_bpf_sock_destroy_fallback() {
    close_wait_pool_leak("rc-cwb", Some("bpf-iter"));
}

/// The local addresses of the CLOSE_WAIT clients to 127.0.0.1:7500 in `ss`.
fn close_wait_of(ss: &[SsSocket]) -> BTreeSet<String> {
    ss.iter()
        .filter(|x| x.state == "CLOSE-WAIT" && x.peer == addr("127.0.0.1:7500"))
        .map(|x| x.local.to_string())
        .collect()
}

fn close_wait_pool_leak(ns_name: &str, mechanism: Option<&str>) {
    let Some(_env) = require_privileges() else {
        return;
    };
    let ns = NetNs::new(ns_name);
    let dir = TempDir::new(ns_name);
    let (client, ready) = peer(
        &ns,
        &[
            "close-wait",
            "--addr",
            "127.0.0.1:7500",
            "--count",
            &N.to_string(),
        ],
    );
    let leaked = ready.locals();
    assert_eq!(close_wait_of(&ss_tcp(Some(ns.name())).unwrap()), leaked);

    let policy = format!(
        r#"[[policy]]
name = "pool-leak"
mode = "enforce"
trigger = "always"
select = {{ comm = "{PEER_COMM}", peer_port = 7500, states = ["CLOSE_WAIT"] }}
"#
    );
    let mut config = Config::reclaiming(&dir).policy(&policy);
    if let Some(m) = mechanism {
        config = config.mechanism(m);
    }
    let agent = start_agent(&ns, &dir, &config);

    // Without api.token_file the endpoint is off.
    let (code, body) = agent.post_reclaim(
        Some(TOKEN),
        &json!({"policy": "pool-leak", "dry_run": true}),
    );
    assert_eq!(code, 404, "{body}");

    assert!(
        wait_until(SCAN * 8, POLL, || {
            close_wait_of(&ss_tcp(Some(ns.name())).unwrap())
                .is_empty()
                .then_some(())
        })
        .is_some(),
        "CLOSE_WAIT sockets left:\n{}",
        agent.ctx()
    );
    let snap = snapshot(&ns, &["--pid", &client.pid().to_string()]);
    let left = sockets(&snap);
    assert!(
        left.iter().all(|x| x.state != "CLOSE_WAIT"),
        "snapshot still shows CLOSE_WAIT:\n{snap:#}"
    );
    // The listener of the same process is never touched.
    assert!(
        left.iter()
            .any(|x| x.state == "LISTEN" && x.local == "127.0.0.1:7500"),
        "{snap:#}"
    );
    assert!(alive(client.pid()), "the pool's process died");

    assert_killed_the_leak(&agent, &leaked, client.pid());
    // Still alive a couple of scans later, and its listener still accepts.
    agent.wait_scans(2);
    assert!(alive(client.pid()), "the pool's process died");
    let probe = connect(Some(ns.name()), addr("127.0.0.1:7500"), HTTP);
    assert!(probe.is_ok(), "listener gone: {probe:?}");
}

/// The audit log killed exactly the leaked sockets, of the pool's process, at most 8 a round.
fn assert_killed_the_leak(agent: &Agent, leaked: &BTreeSet<String>, pid: u32) {
    let lines = agent.audit();
    let killed = result_is(&lines, "killed");
    let killed_locals: BTreeSet<String> = killed
        .iter()
        .map(|d| text(d, "local").to_string())
        .collect();
    assert_eq!(&killed_locals, leaked, "{}", agent.ctx());
    assert_eq!(killed.len(), N, "{}", agent.ctx());
    for d in &killed {
        assert_decision_shape(d);
        assert_eq!(
            (text(d, "policy"), text(d, "state"), text(d, "comm")),
            ("pool-leak", "CLOSE_WAIT", PEER_COMM),
            "{d}"
        );
        assert_eq!(d["pid"], json!(pid), "{d}");
    }
    for (round, n) in per_round(&lines, "killed") {
        assert!(
            n <= 8,
            "round {round:?} killed {n} > default max_per_round 8"
        );
    }
}
