//! A pod-to-pod idle pair through a Service: a client in one pod (Docker-style container)
//! holds idle connections to a server in another (containerd pod e2e/backend-0) through a
//! ClusterIP, DNATed to the server pod in the node namespace. The client's sockets name the
//! ClusterIP as their peer; the server's name the client pod's address. Both ends are on this
//! host: connreap must pair them (the client's own address and port are the server's peer)
//! and report `stuck_established_pairs` naming both processes, never two one-sided
//! `idle_established_buildup` "ghosts", whose thresholds here are lower than the pairs'.

use std::{collections::BTreeSet, net::SocketAddr};

use connreap_tests::{
    fixtures::ss_tcp,
    harness::{
        alerts::describe, containers::FakeContainer, pods::Node, wait_until, Agent, TempDir, HTTP,
        POLL,
    },
};
use serde_json::Value;

use super::{host_config, host_receiver, names_pid, setup, wait_alert, Parts};

/// The server's port in its pod, and the Service's.
const SERVER_PORT: u16 = 8080;
const CLUSTER: &str = "10.96.0.30:80";
/// Idle connections the client holds: the pairs' threshold.
const PAIRS: usize = 8;

#[test]
fn idle_pair_through_a_service_is_a_pair_not_two_ghosts() {
    let Some((_env, root)) = setup() else { return };
    let node = Node::new("node");
    let server_pod = node.pod(
        "backend",
        Some(FakeContainer::kube(&root, "e2e", "backend-0")),
    );
    let client_pod = node.pod("frontend", Some(FakeContainer::docker(&root)));
    let cluster: SocketAddr = CLUSTER.parse().expect("address");
    let backend = server_pod.addr(SERVER_PORT);
    let _service = node.service(cluster, backend);
    let (server, _) = server_pod.peer(&["listen", "--addr", &format!("0.0.0.0:{SERVER_PORT}")]);
    let (client, ready) =
        client_pod.peer(&["connect", "--addr", CLUSTER, "--count", &PAIRS.to_string()]);

    // The Service works both ways: every connection completed its handshake through the DNAT,
    // and the server sees each one from the client pod's address and the client's own port.
    let client_locals: BTreeSet<SocketAddr> = ready
        .locals()
        .iter()
        .map(|a| a.parse().expect("address"))
        .collect();
    assert!(
        client_locals.iter().all(|a| a.ip() == client_pod.ip),
        "{client_locals:?}"
    );
    let server_peers = wait_until(HTTP, POLL, || {
        let peers: BTreeSet<SocketAddr> = ss_tcp(Some(server_pod.name()))
            .unwrap_or_default()
            .into_iter()
            .filter(|s| s.is_established() && s.local == backend && s.pids.contains(&server.pid()))
            .map(|s| s.peer)
            .collect();
        (peers == client_locals).then_some(peers)
    });
    assert!(
        server_peers.is_some(),
        "the server in {} should hold one connection from each of the client's {client_locals:?} \
         (through {CLUSTER}); ss: {:#?}\nnode NAT table:\n{}",
        server_pod.describe(),
        ss_tcp(Some(server_pod.name())),
        node.nat_rules()
    );
    let client_side = ss_tcp(Some(client_pod.name())).unwrap_or_default();
    let to_cluster = client_side
        .iter()
        .filter(|s| s.is_established() && s.peer == cluster && s.pids.contains(&client.pid()))
        .count();
    assert_eq!(to_cluster, PAIRS, "client side: {client_side:#?}");

    let dir = TempDir::new("pods-pair");
    let hook = host_receiver();
    let config = host_config(&dir, &hook).detect(&format!(
        "stuck_pair_min_idle = \"3s\"\nstuck_pair_threshold = {PAIRS}\n\
         idle_established_min_idle = \"3s\"\nidle_established_threshold = 4"
    ));
    let agent = Agent::start_in_host(&dir, &config);

    let both = |b: &Value| names_pid(b, client.pid()) && names_pid(b, server.pid());
    let mut parts = Parts::new();
    parts.check("a stuck_established_pairs naming both ends", || {
        let pair = wait_alert(
            &hook,
            &agent,
            "a stuck_established_pairs alert naming both the client and the server (pairs across \
             namespaces, through a Service's DNAT)",
            |b| b["kind"] == "stuck_established_pairs" && b["status"] == "firing" && both(b),
        );
        assert_eq!(pair["count"], PAIRS, "{pair:#}");
        assert_eq!(
            pair["service_port"], SERVER_PORT,
            "the service port is the server's own (what it listens on), not the ClusterIP's: \
             {pair:#}"
        );
    });
    // Not ghosts: over the next scans, neither end is an idle_established_buildup.
    agent.wait_scans(3);
    parts.check("no idle_established_buildup for either end", || {
        let ghost = |b: &Value| {
            b["kind"] == "idle_established_buildup"
                && (names_pid(b, client.pid()) || names_pid(b, server.pid()))
        };
        let ghosts: Vec<Value> = agent.findings().into_iter().filter(|f| ghost(f)).collect();
        let posted: Vec<_> = hook
            .posts()
            .into_iter()
            .filter(|p| ghost(&p.body))
            .collect();
        assert!(
            ghosts.is_empty() && posted.is_empty(),
            "paired connections must not be reported as one-sided ghosts; the \
             receiver got:\n{}\ncurrent ghost findings: {ghosts:#?}",
            describe(&posted)
        );
    });
    parts.finish();
}
