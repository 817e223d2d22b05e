//! The pod layout itself, without connreap: pods reach each other through the node, directly
//! and through a Service (a real HTTP request each way), a Service's rule goes with it, and
//! dropping the pods and the node leaves nothing behind (namespaces, links, cgroups, the
//! runtimes' state files).

use std::{
    net::SocketAddr,
    path::{Path, PathBuf},
};

use connreap_tests::{
    fixtures::http_request_ns,
    harness::{containers::FakeContainer, pods::Node, HTTP, INSTANCE_SIM},
};
use serde_json::json;

use super::setup;

const CLUSTER: &str = "10.96.0.40:80";

/// `GET /json` from pod namespace `from` to `to`: (status, body), or the error.
fn get_json(from: &str, to: SocketAddr) -> Result<(u16, serde_json::Value), String> {
    let r = http_request_ns(Some(from), to, "GET", "/json", &[], &[], HTTP)
        .map_err(|e| format!("GET http://{to}/json from {from}: {e}"))?;
    let v = r.json().map_err(|e| format!("{e}: {:?}", r.text()))?;
    Ok((r.status, v))
}

#[test]
fn pods_talk_through_the_node_and_a_service_and_leave_nothing_behind() {
    let Some((_env, root)) = setup() else { return };
    let node = Node::new("node");
    let a = node.pod("pod-a", Some(FakeContainer::kube(&root, "e2e", "pod-a")));
    let b = node.pod("pod-b", Some(FakeContainer::crio(&root, "e2e", "pod-b")));
    let names = [node.ns().name(), a.name(), b.name()].map(str::to_string);
    let cgroups: Vec<PathBuf> = [&a, &b]
        .iter()
        .map(|p| root.join(p.container().cgroup().trim_start_matches('/')))
        .collect();
    let crio_state =
        Path::new("/run/containers/storage/overlay-containers").join(&b.container().id);
    assert!(crio_state.join("userdata/config.json").is_file());
    for dir in &cgroups {
        assert!(dir.is_dir(), "{}", dir.display());
    }

    // Both ways, directly: an instance in each pod, asked from the other.
    let (ia, _) = a.spawn(
        connreap_tests::harness::program(INSTANCE_SIM),
        &["--listen", "0.0.0.0:8080", "--name", "a"],
    );
    let (ib, _) = b.spawn(
        connreap_tests::harness::program(INSTANCE_SIM),
        &["--listen", "0.0.0.0:8080", "--name", "b"],
    );
    let ok = |name: &str| (200, json!({"ok": true, "instance": name}));
    assert_eq!(get_json(a.name(), b.addr(8080)), Ok(ok("b")));
    assert_eq!(get_json(b.name(), a.addr(8080)), Ok(ok("a")));

    // Through a Service (DNAT in the node namespace), from the other pod.
    let cluster: SocketAddr = CLUSTER.parse().expect("address");
    let service = node.service(cluster, b.addr(8080));
    assert_eq!(
        get_json(a.name(), cluster),
        Ok(ok("b")),
        "node NAT table:\n{}",
        node.nat_rules()
    );
    drop(service);
    assert!(
        !node.nat_rules().contains(&cluster.ip().to_string()),
        "the Service's rule is gone: {}",
        node.nat_rules()
    );
    assert!(
        get_json(a.name(), cluster).is_err(),
        "no Service, no answer"
    );

    drop((ia, ib));
    drop((a, b));
    for dir in &cgroups {
        assert!(!dir.exists(), "{} left behind", dir.display());
    }
    assert!(!crio_state.exists(), "{} left behind", crio_state.display());
    drop(node);
    for name in &names {
        assert!(
            !Path::new("/run/netns").join(name).exists(),
            "namespace {name} left behind"
        );
    }
}
