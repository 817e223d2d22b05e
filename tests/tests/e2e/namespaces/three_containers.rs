//! Three pods, one port: every pod's server listens on 8080 in its own namespace and leaks
//! CLOSE_WAIT there, from cgroups named like a Docker, a containerd (Kubernetes) and a podman
//! container. The snapshot tells them apart (namespace, container, runtime, pod), its filters
//! pick each one, and the daemon in the host's namespace makes three findings, one per pod.

use connreap_tests::harness::{
    containers::FakeContainer, require_privileges, snapshot_in_host, sockets, Agent, SocketRow,
    TempDir, PEER_COMM,
};
use serde_json::Value;

use super::{
    assert_names_pod, cgroups, host_config, host_receiver, wait_close_wait_alert, Pod, LEAKED, PORT,
};

#[test]
fn three_containers_same_port() {
    let Some(_env) = require_privileges() else {
        return;
    };
    let Some(root) = cgroups() else { return };
    let pods = [
        Pod::start("docker", FakeContainer::docker(&root)),
        Pod::start("kube", FakeContainer::kube(&root, "e2e", "web-0")),
        Pod::start("podman", FakeContainer::podman(&root)),
    ];
    for pod in &pods {
        pod.leak(LEAKED);
    }
    let inodes: std::collections::BTreeSet<u64> = pods.iter().map(|p| p.inode).collect();
    assert_eq!(inodes.len(), 3, "three namespaces, three inodes");

    assert_snapshot_rows(&pods);
    assert_snapshot_filters(&pods);

    let dir = TempDir::new("ns-three");
    let hook = host_receiver();
    let mut agent = Agent::start_in_host(&dir, &host_config(&dir, &hook));
    let mut fingerprints = std::collections::BTreeSet::new();
    for pod in &pods {
        let b = wait_close_wait_alert(&hook, &agent, pod, "firing");
        assert_eq!(b["service_port"], PORT, "{b:#}");
        assert_eq!(
            b["count"],
            LEAKED,
            "{} holds {LEAKED} CLOSE_WAIT sockets in its namespace, no more: {b:#}",
            pod.describe()
        );
        assert_names_pod(&b, pod, true, "close_wait_buildup alert");
        let socks = b["sockets"].as_array().cloned().unwrap_or_default();
        assert!(!socks.is_empty(), "{b:#}");
        for s in &socks {
            assert_eq!(s["state"], "CLOSE_WAIT", "{s}");
        }
        fingerprints.insert(b["fingerprint"].as_str().unwrap_or_default().to_string());
    }
    assert_eq!(
        fingerprints.len(),
        3,
        "three pods on one port are three findings, not one: {fingerprints:?}"
    );
    // /v1/findings says the same: one close_wait_buildup per pod, each naming its namespace.
    for pod in &pods {
        let f = agent
            .find("close_wait_buildup", |f| f["netns"] == pod.inode)
            .unwrap_or_else(|| {
                panic!(
                    "/v1/findings has no close_wait_buildup with netns {} ({}): {:#?}",
                    pod.inode,
                    pod.describe(),
                    agent.findings()
                )
            });
        assert_names_pod(&f, pod, true, "/v1/findings entry");
    }
    agent.assert_healthy();
}

/// `connreap snapshot --json` in the host's namespace: each pod's CLOSE_WAIT sockets, with
/// its namespace, container, runtime and (Kubernetes) pod.
fn assert_snapshot_rows(pods: &[Pod]) {
    let snap = snapshot_in_host(&["--state", "CLOSE_WAIT", "--port", &PORT.to_string()]);
    let rows = sockets(&snap);
    for pod in pods {
        let mine: Vec<&SocketRow> = rows.iter().filter(|r| r.pid == Some(pod.pid())).collect();
        assert_eq!(
            mine.len(),
            LEAKED,
            "{}: expected {LEAKED} CLOSE_WAIT rows:\n{snap:#}",
            pod.describe()
        );
        for r in mine {
            let ctx = format!("{} row {r:#?}", pod.describe());
            assert_eq!(r.comm.as_deref(), Some(PEER_COMM), "{ctx}");
            assert_eq!((r.local_port(), r.service_port), (PORT, PORT), "{ctx}");
            assert_eq!(r.netns, Some(pod.inode), "{ctx}");
            assert_eq!(r.netns_name.as_deref(), Some(pod.name()), "{ctx}");
            let c = pod.container();
            assert_eq!(r.container.as_deref(), Some(c.id.as_str()), "{ctx}");
            assert_eq!(r.container_runtime.as_deref(), Some(c.runtime), "{ctx}");
            match &c.pod {
                Some(p) => assert_eq!(
                    (
                        r.pod_uid.as_deref(),
                        r.pod_name.as_deref(),
                        r.pod_namespace.as_deref()
                    ),
                    (
                        Some(p.uid.as_str()),
                        Some(p.name.as_str()),
                        Some(p.namespace.as_str())
                    ),
                    "{ctx}"
                ),
                None => assert_eq!(r.pod_uid, None, "{ctx}"),
            }
        }
    }
}

/// The pids of rows of `snap`, for the pods' servers only.
fn pod_pids(snap: &Value, pods: &[Pod]) -> Vec<u32> {
    let pids: std::collections::BTreeSet<u32> = sockets(snap)
        .iter()
        .filter_map(|r| r.pid)
        .filter(|p| pods.iter().any(|pod| pod.pid() == *p))
        .collect();
    pids.into_iter().collect()
}

/// `--netns NAME|INODE` and `--container PREFIX` pick exactly one pod; both at once intersect.
fn assert_snapshot_filters(pods: &[Pod]) {
    let port = PORT.to_string();
    let by_name = snapshot_in_host(&["--port", &port, "--netns", pods[1].name()]);
    for r in sockets(&by_name) {
        assert_eq!(r.netns, Some(pods[1].inode), "--netns NAME let in {r:#?}");
    }
    assert_eq!(pod_pids(&by_name, pods), [pods[1].pid()], "{by_name:#}");
    // Its server's listener and leaked sockets (the clients' orphaned FIN_WAIT2 ends, which
    // no process owns, are in that namespace too).
    let owned = sockets(&by_name)
        .into_iter()
        .filter(|r| r.pid == Some(pods[1].pid()))
        .count();
    assert_eq!(owned, LEAKED + 1, "{by_name:#}");

    let inode = pods[0].inode.to_string();
    let by_inode = snapshot_in_host(&["--port", &port, "--netns", &inode]);
    assert_eq!(pod_pids(&by_inode, pods), [pods[0].pid()], "{by_inode:#}");

    let c = pods[2].container();
    let by_container = snapshot_in_host(&["--port", &port, "--container", c.short()]);
    for r in sockets(&by_container) {
        assert_eq!(
            r.container.as_deref(),
            Some(c.id.as_str()),
            "--container let in {r:#?}"
        );
    }
    assert_eq!(
        pod_pids(&by_container, pods),
        [pods[2].pid()],
        "{by_container:#}"
    );

    let none = snapshot_in_host(&[
        "--port",
        &port,
        "--netns",
        pods[0].name(),
        "--container",
        pods[1].container().short(),
    ]);
    assert!(
        sockets(&none).is_empty(),
        "pod 0's namespace holds no socket of pod 1's container:\n{none:#}"
    );
}

/// Without containers nothing but the namespace tells two pods apart (same program, same
/// port, same cgroup): still two findings, each naming its namespace and pid, and no container.
#[test]
fn bare_namespaces_same_port_are_two_findings() {
    let Some(_env) = require_privileges() else {
        return;
    };
    let pods = [Pod::bare("bare-a"), Pod::bare("bare-b")];
    for pod in &pods {
        pod.leak(LEAKED);
    }
    let dir = TempDir::new("ns-bare");
    let hook = host_receiver();
    let mut agent = Agent::start_in_host(&dir, &host_config(&dir, &hook));
    let mut fingerprints = std::collections::BTreeSet::new();
    for pod in &pods {
        let b = wait_close_wait_alert(&hook, &agent, pod, "firing");
        assert_eq!(
            (&b["count"], &b["service_port"]),
            (&serde_json::json!(LEAKED), &serde_json::json!(PORT)),
            "{} alone holds {LEAKED} CLOSE_WAIT on {PORT} in its namespace: {b:#}",
            pod.describe()
        );
        assert_eq!(
            b["processes"].as_array().map(Vec::len),
            Some(1),
            "only {}'s server: {b:#}",
            pod.describe()
        );
        assert_names_pod(&b, pod, false, "close_wait_buildup alert");
        assert!(
            b.get("container").is_none_or(Value::is_null),
            "no container here: {b:#}"
        );
        fingerprints.insert(b["fingerprint"].as_str().unwrap_or_default().to_string());
    }
    assert_eq!(fingerprints.len(), 2, "{fingerprints:?}");
    agent.assert_healthy();
}
