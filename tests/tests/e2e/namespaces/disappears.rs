//! Pods come and go: a namespace with a CLOSE_WAIT buildup is deleted (its processes killed,
//! `ip netns del`) while the daemon scans, with more short-lived namespaces created and
//! deleted around it so that some vanish between discovery and the dump. No error, no crash;
//! the deleted pod's finding resolves.

use std::{path::Path, thread, time::Duration};

use connreap_tests::harness::{
    containers::FakeContainer, peer, require_privileges, Agent, NetNs, TempDir,
};

use super::{
    assert_names_netns, cgroups, host_config, host_receiver, netns_inode_of, wait_close_wait_alert,
    wait_close_wait_alert_of, Pod, LEAKED, PORT,
};

/// Short-lived namespaces created and deleted while the daemon scans.
const CHURN: usize = 12;

#[test]
fn namespace_disappears() {
    let Some(_env) = require_privileges() else {
        return;
    };
    let Some(root) = cgroups() else { return };
    let pod = Pod::start("gone", FakeContainer::docker(&root));
    pod.leak(LEAKED);
    let dir = TempDir::new("ns-gone");
    let hook = host_receiver();
    let mut agent = Agent::start_in_host(&dir, &host_config(&dir, &hook));
    let firing = wait_close_wait_alert(&hook, &agent, &pod, "firing");

    // Namespaces with a process in them appear and vanish, a few per scan.
    let mut vanished = Vec::new();
    for _ in 0..CHURN {
        let ns = NetNs::new("churn");
        let (child, _) = peer(&ns, &["listen", "--addr", &format!("127.0.0.1:{PORT}")]);
        vanished.push(netns_inode_of(child.pid()));
        thread::sleep(Duration::from_millis(150));
        drop(child);
        drop(ns);
    }
    // The pod goes: its server killed, its cgroup removed, its namespace deleted.
    let (inode, name, pid, who) = (pod.inode, pod.name().to_string(), pod.pid(), pod.describe());
    drop(pod);
    vanished.push(inode);
    assert!(
        !Path::new(&format!("/run/netns/{name}")).exists(),
        "{name} was not deleted"
    );

    let resolved = wait_close_wait_alert_of(&hook, &agent, pid, &who, "resolved");
    agent.assert_healthy();
    agent.wait_scans(2);
    agent.assert_healthy();
    let stderr = agent.stderr();
    for bad in ["panicked", "scan failed"] {
        assert!(
            !stderr.contains(bad),
            "the daemon logged `{bad}` while namespaces vanished:\n{stderr}"
        );
    }
    for line in stderr.lines().filter(|l| l.contains("not scanned")) {
        assert!(
            !vanished.iter().any(|i| line.contains(&i.to_string())),
            "a deleted namespace is gone, not a failure: {line}\n{stderr}"
        );
    }
    // Both notifications name the namespace the finding was in.
    for (b, what) in [(&firing, "firing"), (&resolved, "resolved")] {
        assert_names_netns(b, inode, &name, &format!("the {what} alert of {who}"));
    }
}
