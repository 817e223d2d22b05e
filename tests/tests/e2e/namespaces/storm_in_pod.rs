//! A reconnect storm of short-lived connections from a process in a pod is filed
//! under the pod's namespace and container, from the transition events themselves (no socket
//! of the storm lives long enough for a scan to see it), apart from a host process of the
//! same name storming to the same port at the same time.

use connreap_tests::{
    fixtures::free_addr,
    harness::{
        alerts::{describe, is, names_pid},
        containers::FakeContainer,
        program, require_privileges, Agent, Child, Config, NetNs, Ready, TempDir, FINDING,
        PEER_COMM, READY_TIMEOUT, TESTPEER,
    },
};
use serde_json::{json, Value};

use super::{cgroups, host_receiver, netns_inode_of};

/// `connreap-testpeer ARGS` from `cmd`, once it printed `ready`; and that line.
fn started(mut cmd: std::process::Command, args: &[&str], what: &str) -> (Child, Ready) {
    cmd.args(args);
    let mut child = Child::spawn(&mut cmd, what);
    let ready = child.wait_ready(READY_TIMEOUT);
    (child, ready)
}

/// A storm to 127.0.0.1:`port`: 20 connections/s, doubling every second up to 160/s, 12 s.
const STORM: [&str; 6] = [
    "--start-rate",
    "20",
    "--max-rate",
    "160",
    "--duration-ms",
    "12000",
];

#[test]
fn a_storm_in_a_pod_is_filed_under_the_pod() {
    let Some(_env) = require_privileges() else {
        return;
    };
    let Some(root) = cgroups() else { return };
    let ns = NetNs::new("storm-pod");
    let pod = FakeContainer::kube(&root, "e2e", "storm-0");
    // The host's server first, on a free port; the pod's on the same port in its namespace.
    let (_host_server, ready) = started(
        std::process::Command::new(program(TESTPEER)),
        &["listen", "--addr", "127.0.0.1:0", "--close-after-ms", "0"],
        "host server",
    );
    let port = ready.get("port").to_string();
    let addr = format!("127.0.0.1:{port}");
    let (_pod_server, _) = started(
        pod.command(&ns, program(TESTPEER)),
        &["listen", "--addr", &addr, "--close-after-ms", "0"],
        "pod server",
    );

    let dir = TempDir::new("ns-storm");
    let hook = host_receiver();
    let config = Config::alerting_to(&dir, &hook.url("/alerts"))
        .listen(free_addr())
        .detect("storm_rate = 50.0\nstorm_growth_windows = 2");
    let agent = Agent::start_in_host(&dir, &config);

    let mut storm_args = vec!["storm", "--addr", &addr];
    storm_args.extend(STORM);
    let (in_pod, _) = started(
        pod.command(&ns, program(TESTPEER)),
        &storm_args,
        "storm in the pod",
    );
    let (on_host, _) = started(
        std::process::Command::new(program(TESTPEER)),
        &storm_args,
        "storm on the host",
    );
    let inode = netns_inode_of(in_pod.pid());
    assert!(
        pod.pids().contains(&in_pod.pid()),
        "the pod's client is not in its cgroup"
    );

    let wait = |pid: u32, what: &str| -> Value {
        hook.wait_for_body(FINDING, |b| {
            is(b, "reconnect_storm", "firing") && names_pid(b, pid)
        })
        .map(|p| p.body)
        .unwrap_or_else(|| {
            panic!(
                "no reconnect_storm alert for the {what} (pid {pid}) within {FINDING:?}; got:\n{}\nfindings: {:#?}\nagent stderr:\n{}",
                describe(&hook.posts()),
                agent.findings(),
                agent.stderr()
            )
        })
    };
    let b = wait(in_pod.pid(), "client in the pod");
    let p = pod.pod.as_ref().expect("a kube container has a pod");
    assert_eq!(
        b["fingerprint"],
        format!(
            "reconnect_storm:{PEER_COMM}@pod:{}/{}:{port}@netns:{}",
            p.namespace,
            p.name,
            ns.name()
        ),
        "{b:#}"
    );
    assert_eq!(
        (&b["netns"], &b["netns_name"]),
        (&json!(inode), &json!(ns.name())),
        "the storm's namespace comes from its events: {b:#}"
    );
    assert_eq!(
        (&b["container"], &b["container_runtime"], &b["pod_name"]),
        (&json!(pod.id), &json!(pod.runtime), &json!(p.name)),
        "{b:#}"
    );
    assert_eq!(b["processes"][0]["container"], json!(pod.id), "{b:#}");
    let summary = b["summary"].as_str().unwrap_or_default();
    assert!(
        summary.contains(&format!(
            "; in netns {}, pod {}/{}",
            ns.name(),
            p.namespace,
            p.name
        )),
        "{summary}"
    );

    // The host's client of the same name and port: its own alert, in the host's namespace.
    let h = wait(on_host.pid(), "client on the host");
    assert_eq!(
        h["fingerprint"],
        format!("reconnect_storm:{PEER_COMM}:{port}"),
        "{h:#}"
    );
    assert_eq!(h["netns_name"], Value::Null, "{h:#}");
    assert!(h.get("container").is_none_or(Value::is_null), "{h:#}");
    assert_ne!(h["netns"], json!(inode), "{h:#}");
}
