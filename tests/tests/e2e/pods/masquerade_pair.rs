//! A pod-to-pod idle pair through a Service that masquerades: the node DNATs the ClusterIP to
//! the server pod and SNATs the source to its own address, so the server sees neither the
//! client's address nor its port. Only the node's connection tracking ties the two ends:
//! connreap, running in the node's namespace as it does on a Kubernetes node, reads it and
//! reports one `stuck_established_pairs`, not two one-sided ghosts.

use std::net::SocketAddr;

use connreap_tests::{
    fixtures::ss_tcp,
    harness::{
        containers::FakeContainer, pods::Node, wait_until, Agent, Config, TempDir, FINDING, HTTP,
        POLL,
    },
};
use serde_json::Value;

use super::{names_pid, setup};

const SERVER_PORT: u16 = 8080;
const CLUSTER: &str = "10.96.0.31:80";
const PAIRS: usize = 6;

#[test]
fn idle_pair_through_a_masquerading_service_is_paired_by_conntrack() {
    let Some((_env, root)) = setup() else { return };
    let node = Node::new("mnode");
    let server_pod = node.pod("mback", Some(FakeContainer::kube(&root, "e2e", "mback-0")));
    let client_pod = node.pod("mfront", Some(FakeContainer::docker(&root)));
    let cluster: SocketAddr = CLUSTER.parse().expect("address");
    let backend = server_pod.addr(SERVER_PORT);
    let _service = node.service(cluster, backend);
    let _snat = node.masquerade(cluster, backend);
    let (server, _) = server_pod.peer(&["listen", "--addr", &format!("0.0.0.0:{SERVER_PORT}")]);
    let (client, _) =
        client_pod.peer(&["connect", "--addr", CLUSTER, "--count", &PAIRS.to_string()]);

    // The layout is what it claims: the server sees every connection from an address that is
    // not the client pod's.
    let seen = wait_until(HTTP, POLL, || {
        let peers: Vec<SocketAddr> = ss_tcp(Some(server_pod.name()))
            .unwrap_or_default()
            .into_iter()
            .filter(|s| s.is_established() && s.local == backend && s.pids.contains(&server.pid()))
            .map(|s| s.peer)
            .collect();
        (peers.len() == PAIRS).then_some(peers)
    })
    .unwrap_or_else(|| {
        panic!(
            "the server should hold {PAIRS} connections; node NAT table:\n{}",
            node.nat_rules()
        )
    });
    assert!(
        seen.iter().all(|p| p.ip() != client_pod.ip),
        "masquerading: the server must not see the client pod's address: {seen:?}"
    );

    let dir = TempDir::new("pods-masq");
    let config = Config::new(&dir).detect(&format!(
        "stuck_pair_min_idle = \"3s\"\nstuck_pair_threshold = {PAIRS}\n\
         idle_established_min_idle = \"3s\"\nidle_established_threshold = 3"
    ));
    // connreap in the node's namespace: the one whose conntrack translated the connections.
    let agent = Agent::start(node.ns(), &dir, &config);
    let both = |f: &Value| names_pid(f, client.pid()) && names_pid(f, server.pid());
    let pair = wait_until(FINDING, POLL, || {
        agent.find("stuck_established_pairs", both)
    });
    let pair = pair.unwrap_or_else(|| {
        panic!(
            "the two ends of a masqueraded Service connection are paired by \
             conntrack; findings: {:#?}",
            agent.findings()
        )
    });
    assert_eq!(pair["count"], PAIRS, "{pair:#}");
    assert_eq!(pair["service_port"], SERVER_PORT, "{pair:#}");
    agent.wait_scans(2);
    let ghosts: Vec<Value> = agent
        .findings()
        .into_iter()
        .filter(|f| {
            f["kind"] == "idle_established_buildup"
                && (names_pid(f, client.pid()) || names_pid(f, server.pid()))
        })
        .collect();
    assert!(
        ghosts.is_empty(),
        "paired ends reported as ghosts: {ghosts:#?}"
    );
}
