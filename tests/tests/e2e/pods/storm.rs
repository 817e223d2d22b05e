//! A reconnect storm from a pod: a client in a CRI-O container of pod e2e/storm-0 connects and
//! closes at once, faster and faster, to a server in another pod. Its connections are short
//! lived (gone before a scan sees them), so connreap knows them only from the state
//! tracker's transition events; those must carry their namespace and the
//! owner's container, so the `reconnect_storm` finding is filed under the client pod
//! (`netns` its namespace's inode, `container` its container id, the pod's name from CRI-O's
//! own state), never under the host's namespace where it would merge with a host process of
//! the same name.

use connreap_tests::harness::{
    containers::FakeContainer,
    pods::{Node, Pod},
    snapshot_in_host, sockets, Agent, TempDir, PEER_COMM,
};

use super::{assert_in_pod, host_config, host_receiver, names_pid, setup, wait_alert, Parts};

const PORT: u16 = 7500;

#[test]
fn reconnect_storm_in_a_pod_is_filed_under_that_pod() {
    let Some((_env, root)) = setup() else { return };
    let node = Node::new("node");
    let server_pod = node.pod("storm-srv", None);
    let client_pod = node.pod(
        "storm-cli",
        Some(FakeContainer::crio(&root, "e2e", "storm-0")),
    );
    let target = server_pod.addr(PORT).to_string();
    let (_server, _) = server_pod.peer(&["listen", "--addr", &target, "--close-after-ms", "0"]);
    assert_pod_is_known(&client_pod, &target);

    let dir = TempDir::new("pods-storm");
    let hook = host_receiver();
    let config = host_config(&dir, &hook).detect("storm_rate = 50.0\nstorm_growth_windows = 2");
    let agent = Agent::start_in_host(&dir, &config);
    // 20/s doubling every second up to 320/s, for 12 s.
    let (storm, _) = client_pod.peer(&[
        "storm",
        "--addr",
        &target,
        "--start-rate",
        "20",
        "--max-rate",
        "320",
        "--duration-ms",
        "12000",
    ]);

    let b = wait_alert(
        &hook,
        &agent,
        "a reconnect_storm alert naming the storming client",
        |b| b["kind"] == "reconnect_storm" && b["status"] == "firing" && names_pid(b, storm.pid()),
    );
    assert_eq!(b["service_port"], PORT, "{b:#}");
    assert!(
        b["rate_per_sec"].as_f64().is_some_and(|r| r >= 50.0),
        "{b:#}"
    );
    // The storm is the pod's: its namespace, its container, its pod (from CRI-O's state).
    let mut parts = Parts::new();
    parts.check("the alert is in the pod", || {
        assert_in_pod(
            &b,
            &client_pod,
            "the reconnect_storm alert (transition events carry their namespace and \
             container)",
        )
    });
    parts.check("the alert is identified by the pod", || {
        let want = format!(
            "reconnect_storm:{PEER_COMM}@pod:e2e/storm-0:{PORT}@netns:{}",
            client_pod.name()
        );
        assert_eq!(
            b["fingerprint"], want,
            "identified by its pod and namespace, not as a host process: {b:#}"
        );
    });
    parts.check("/v1/findings says the same", || {
        let f = agent
            .find("reconnect_storm", |f| names_pid(f, storm.pid()))
            .unwrap_or_else(|| panic!("/v1/findings lacks the storm: {:#?}", agent.findings()));
        assert_in_pod(&f, &client_pod, "the reconnect_storm finding");
    });
    parts.finish();
}

/// The layout works and connreap knows the pod already: a connection the client pod holds
/// shows in `connreap snapshot` with the pod's namespace, its CRI-O container and the pod's
/// name and namespace read from CRI-O's state. (The server closes at once, so the client's
/// socket sits in CLOSE_WAIT.)
fn assert_pod_is_known(client_pod: &Pod, target: &str) {
    let (holder, _) = client_pod.peer(&["connect", "--addr", target, "--count", "1"]);
    let pid = holder.pid().to_string();
    let snap = snapshot_in_host(&["--pid", &pid]);
    let rows = sockets(&snap);
    assert!(!rows.is_empty(), "connreap snapshot --pid {pid}: {snap:#}");
    for r in rows {
        assert_eq!(r.netns, Some(client_pod.inode()), "{r:#?}");
        let c = client_pod.container();
        let p = c.pod.as_ref().expect("a Kubernetes pod");
        assert_eq!(
            (
                r.container.as_deref(),
                r.container_runtime.as_deref(),
                r.pod_name.as_deref(),
                r.pod_namespace.as_deref()
            ),
            (
                Some(c.id.as_str()),
                Some("crio"),
                Some(p.name.as_str()),
                Some(p.namespace.as_str())
            ),
            "the CRI-O container and its pod (from CRI-O's config.json): {r:#?}"
        );
    }
}
