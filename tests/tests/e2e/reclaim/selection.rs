//! An `always` policy on testpeer pools: it kills exactly what it selects, at most
//! max_per_round at a time, and never a protected port, another comm or another state.

use std::{
    collections::{BTreeMap, BTreeSet},
    io::{ErrorKind, Read, Write},
    net::TcpStream,
};

use connreap_tests::{
    fixtures::{http::connect, ss_tcp, SsSocket},
    harness::{
        addr, alive,
        audit::{assert_decision_shape, naming, per_round, result_is, text},
        peer, require_privileges, spawn_ready, wait_until, Agent, Config, NetNs, TempDir, HTTP,
        INSTANCE_SIM, PEER_COMM, POLL, SCAN,
    },
};
use serde_json::{json, Value};

use super::start_agent;

const MAX: usize = 3;
const N: usize = 12;

#[test]
fn protected_and_unselected_sockets_survive_and_max_per_round_holds() {
    let Some(_env) = require_privileges() else {
        return;
    };
    let ns = NetNs::new("rc-sel");
    let dir = TempDir::new("select");

    // Targets: N testpeer clients held open to a server of another comm (instance-sim).
    let _server = spawn_ready(&ns, INSTANCE_SIM, &["--listen", "127.0.0.1:7400"]);
    let (targets, ready) = peer(
        &ns,
        &[
            "connect",
            "--addr",
            "127.0.0.1:7400",
            "--count",
            &N.to_string(),
        ],
    );
    let target_locals = ready.locals();
    // Same comm and state, but on a protected port (both ends match the selector).
    let (_p_srv, _) = peer(&ns, &["listen", "--addr", "127.0.0.1:7402"]);
    let (_p_cli, p_ready) = peer(
        &ns,
        &["connect", "--addr", "127.0.0.1:7402", "--count", "2"],
    );
    // Same port as the targets, other comm (this test process).
    let other_comm = connect(Some(ns.name()), addr("127.0.0.1:7400"), HTTP).unwrap();
    (&other_comm)
        .write_all(b"GET /events HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    // Same comm, other state: CLOSE_WAIT clients.
    let (cw, cw_ready) = peer(
        &ns,
        &["close-wait", "--addr", "127.0.0.1:7404", "--count", "2"],
    );

    let policy = format!(
        r#"[[policy]]
name = "sweep"
mode = "enforce"
trigger = "always"
select = {{ comm = "{PEER_COMM}", states = ["ESTABLISHED"] }}
max_per_round = {MAX}
"#
    );
    let config = Config::reclaiming(&dir)
        .protect_ports(&[22, 7402])
        .policy(&policy);
    let agent = start_agent(&ns, &dir, &config);

    let lines = rounds_until_only_protected_left(&agent, &target_locals);
    assert_killed_exactly(&agent, &lines, &target_locals, targets.pid());

    // Protected: selected, skipped with the reason, never killed; still connected.
    let ss = ss_tcp(Some(ns.name())).unwrap();
    assert_protected_survive(&lines, &ss, &p_ready.locals());
    // Other comm: never named, still open.
    assert_still_open(&lines, &ss, &other_comm);
    // Other state: CLOSE_WAIT clients untouched.
    for l in cw_ready.locals() {
        let l = addr(&l);
        assert!(naming(&lines, &l).is_empty(), "CLOSE_WAIT {l} considered");
        assert!(
            ss.iter().any(|x| x.state == "CLOSE-WAIT" && x.local == l),
            "CLOSE_WAIT client {l} gone: {ss:#?}"
        );
    }
    assert!(alive(cw.pid()));

    // The targets are really closed.
    for l in &target_locals {
        let l = addr(l);
        assert!(
            !ss.iter().any(|x| x.state == "ESTAB" && x.local == l),
            "target {l} still ESTABLISHED"
        );
    }
}

/// Waits until every target was killed, MAX at a time, then for a few more rounds over what is
/// left (all protected or unselected). Returns the audit log then.
fn rounds_until_only_protected_left(agent: &Agent, targets: &BTreeSet<String>) -> Vec<Value> {
    wait_until(SCAN * (N as u32 / MAX as u32 + 10), POLL, || {
        let lines = agent.audit();
        let done: BTreeSet<String> = result_is(&lines, "killed")
            .iter()
            .map(|d| text(d, "local").to_string())
            .collect();
        // Stop early when a non-target was killed: asserted below.
        (targets.is_subset(&done) || !done.is_subset(targets)).then_some(lines)
    })
    .unwrap_or_else(|| {
        panic!(
            "not every target was killed ({targets:?}):\n{}",
            agent.ctx()
        )
    });
    // Later rounds decide the same skips again: counted each round in the metric, but written
    // to the audit log once per socket while nothing about them changes.
    let skips = || agent.metric(r#"connreap_reclaims_total{policy="sweep",result="skipped"}"#);
    let before = skips().unwrap_or(0.0);
    agent.wait_scans(agent.scans() + 3);
    let after = skips().unwrap_or(0.0);
    assert!(
        after >= before + 2.0,
        "skips are decided every round ({before} -> {after}):\n{}",
        agent.ctx()
    );
    let lines = agent.audit();
    let mut skipped_per_socket: BTreeMap<String, usize> = BTreeMap::new();
    for d in result_is(&lines, "skipped") {
        *skipped_per_socket
            .entry(format!("{} {}", text(d, "local"), text(d, "peer")))
            .or_default() += 1;
    }
    assert!(
        !skipped_per_socket.is_empty() && skipped_per_socket.values().all(|n| *n == 1),
        "each unchanged skip is audited once: {skipped_per_socket:?}\n{}",
        agent.ctx()
    );
    lines
}

/// Killed exactly the targets, each once, at most MAX per round, in enough rounds; their owner
/// lives on.
fn assert_killed_exactly(agent: &Agent, lines: &[Value], targets: &BTreeSet<String>, pid: u32) {
    let killed = result_is(lines, "killed");
    let killed_locals: BTreeSet<String> = killed
        .iter()
        .map(|d| text(d, "local").to_string())
        .collect();
    assert_eq!(
        &killed_locals,
        targets,
        "killed exactly the targets:\n{}",
        agent.ctx()
    );
    assert_eq!(killed.len(), N, "a target killed twice:\n{}", agent.ctx());
    for d in &killed {
        assert_decision_shape(d);
        assert_eq!(
            (
                text(d, "policy"),
                text(d, "mode"),
                text(d, "comm"),
                text(d, "peer")
            ),
            ("sweep", "enforce", PEER_COMM, "127.0.0.1:7400"),
            "{d}"
        );
        assert_eq!(d["pid"], json!(pid), "{d}");
        assert_eq!(d["quota"], Value::Null, "{d}");
    }
    let groups = per_round(lines, "killed");
    for (round, n) in &groups {
        assert!(
            *n <= MAX,
            "round {round:?} killed {n} > max_per_round {MAX}"
        );
    }
    assert!(
        groups.len() >= N.div_ceil(MAX),
        "{N} kills in {} rounds",
        groups.len()
    );
    assert!(alive(pid), "the targets' owner died");
}

/// The protected pair (port 7402) was considered and skipped because of protect_ports, and
/// both of its ends are still connected.
fn assert_protected_survive(lines: &[Value], ss: &[SsSocket], clients: &BTreeSet<String>) {
    let protected: Vec<&Value> = lines
        .iter()
        .filter(|d| text(d, "local").ends_with(":7402") || text(d, "peer").ends_with(":7402"))
        .collect();
    assert!(!protected.is_empty(), "protected sockets never considered");
    for d in &protected {
        assert_eq!(text(d, "result"), "skipped", "{d}");
        assert!(
            d["reason"]
                .as_str()
                .is_some_and(|r| r.contains("protect_ports")),
            "{d}"
        );
    }
    for l in clients {
        let l = addr(l);
        assert!(
            ss.iter().any(|x| x.state == "ESTAB" && x.local == l),
            "protected client {l} gone: {ss:#?}"
        );
        assert!(
            ss.iter().any(|x| x.state == "ESTAB" && x.peer == l),
            "protected server end for {l} gone: {ss:#?}"
        );
    }
}

/// `conn` (another comm on the targets' port) was never named and is still open.
fn assert_still_open(lines: &[Value], ss: &[SsSocket], conn: &TcpStream) {
    let local = conn.local_addr().unwrap();
    assert!(naming(lines, &local).is_empty());
    conn.set_nonblocking(true).unwrap();
    let mut buf = [0u8; 4096];
    loop {
        match (&*conn).read(&mut buf) {
            Ok(0) => panic!("other-comm connection was closed"),
            Ok(_) => continue, // the SSE head
            Err(e) if e.kind() == ErrorKind::WouldBlock => break,
            Err(e) => panic!("other-comm connection broken: {e}"),
        }
    }
    assert!(
        ss.iter().any(|x| x.state == "ESTAB" && x.local == local),
        "{ss:#?}"
    );
}
