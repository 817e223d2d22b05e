//! A network namespace with no process in it and no name, kept alive by sockets a
//! process in the host's namespace holds (it `setns`-ed in, made a listener and CLOSE_WAIT
//! sockets, came back; then `ip netns del`), is still scanned: the running daemon keeps its
//! sockets in `/v1/sockets` and its close_wait_buildup firing under the namespace's inode, a
//! daemon started afterwards finds it, and `connreap snapshot` shows it, walked (the orphaned
//! FIN_WAIT2 ends no process holds come only from a walk inside it).

use std::{collections::BTreeMap, fs};

use connreap_tests::{
    fixtures::WebhookReceiver,
    harness::{
        program, require_privileges, snapshot_in_host, sockets, Agent, Child, NetNs, Ready,
        SocketRow, TempDir, FINDING, PEER_COMM, READY_TIMEOUT, TESTPEER,
    },
};
use serde_json::{json, Value};

use super::{
    assert_names_netns, host_config, host_receiver, names_pid, netns_inode_of,
    wait_close_wait_alert_of, LEAKED, PORT,
};

/// `connreap-testpeer close-wait --netns-file`: [`LEAKED`] CLOSE_WAIT sockets and their
/// listener on [`PORT`], made inside `ns` and held from the host's namespace.
fn holder(ns: &NetNs) -> (Child, Ready) {
    let mut cmd = std::process::Command::new(program(TESTPEER));
    cmd.args([
        "close-wait",
        "--addr",
        &format!("127.0.0.1:{PORT}"),
        "--count",
        &LEAKED.to_string(),
        "--netns-file",
        &format!("/run/netns/{}", ns.name()),
    ]);
    let mut child = Child::spawn(
        &mut cmd,
        &format!("{TESTPEER} close-wait --netns-file in {}", ns.name()),
    );
    let ready = child.wait_ready(READY_TIMEOUT);
    (child, ready)
}

/// The pids whose /proc/PID/ns/net is namespace `inode`.
fn pids_in(inode: u64) -> Vec<u32> {
    let link = format!("net:[{inode}]");
    fs::read_dir("/proc")
        .map(|d| {
            d.flatten()
                .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
                .filter(|pid| {
                    fs::read_link(format!("/proc/{pid}/ns/net"))
                        .is_ok_and(|l| l.to_string_lossy() == link)
                })
                .collect()
        })
        .unwrap_or_default()
}

/// Rows per state of the sockets on [`PORT`] in namespace `inode`.
fn states(rows: &[SocketRow], inode: u64) -> BTreeMap<String, usize> {
    let mut out = BTreeMap::new();
    for r in rows.iter().filter(|r| r.netns == Some(inode)) {
        *out.entry(r.state.clone()).or_default() += 1;
    }
    out
}

/// A snapshot's rows of namespace `inode`: the listener and the CLOSE_WAIT sockets held by
/// `pid`, the accepted ends' FIN_WAIT2 held by no one (walked); the namespace has no name.
fn assert_snapshot_shows(snap: &Value, inode: u64, pid: u32, what: &str) {
    let rows: Vec<SocketRow> = sockets(snap)
        .into_iter()
        .filter(|r| r.netns == Some(inode))
        .collect();
    let by_state = states(&rows, inode);
    assert_eq!(
        (
            by_state.get("LISTEN"),
            by_state.get("CLOSE_WAIT"),
            by_state.get("FIN_WAIT2")
        ),
        (Some(&1), Some(&LEAKED), Some(&LEAKED)),
        "{what}: namespace {inode} must show its listener, {LEAKED} CLOSE_WAIT and the {LEAKED} \
         orphaned FIN_WAIT2 a walk inside it finds: {rows:#?}"
    );
    for r in &rows {
        assert_eq!(r.netns_name, None, "{what}: {r:?}");
        if r.state != "FIN_WAIT2" {
            assert_eq!(
                (r.pid, r.comm.as_deref()),
                (Some(pid), Some(PEER_COMM)),
                "{what}: {r:?}"
            );
        }
    }
}

/// Wait for a firing close_wait_buildup naming `pid` in namespace `inode` with no name.
fn wait_hidden_alert(hook: &WebhookReceiver, agent: &Agent, pid: u32, inode: u64) -> Value {
    hook.wait_for_body(FINDING, |b| {
        b["kind"] == "close_wait_buildup"
            && b["status"] == "firing"
            && names_pid(b, pid)
            && b["netns"] == json!(inode)
            && b["netns_name"].is_null()
    })
    .map(|p| p.body)
    .unwrap_or_else(|| {
        panic!(
            "no firing close_wait_buildup in the unnamed namespace {inode} for pid {pid} within \
             {FINDING:?}; findings: {:#?}\nagent stderr:\n{}",
            agent.findings(),
            agent.stderr()
        )
    })
}

#[test]
fn a_namespace_only_held_sockets_keep_alive_is_still_scanned() {
    let Some(_env) = require_privileges() else {
        return;
    };
    let ns = NetNs::new("hidden");
    let name = ns.name().to_string();
    let (peer, ready) = holder(&ns);
    let pid = peer.pid();
    let inode: u64 = ready.get("netns").parse().expect("netns=INODE");
    assert_ne!(
        netns_inode_of(pid),
        inode,
        "the holder went back to its own namespace"
    );

    // A daemon that knows the namespace by its name first.
    let dir = TempDir::new("ns-hidden");
    let hook = host_receiver();
    let agent = Agent::start_in_host(&dir, &host_config(&dir, &hook));
    let named = wait_close_wait_alert_of(&hook, &agent, pid, &name, "firing");
    assert_names_netns(
        &named,
        inode,
        &name,
        "the alert while the namespace has a name",
    );

    // The name goes: nothing names the namespace any more, no process lives in it.
    drop(ns);
    assert!(!fs::exists(format!("/run/netns/{name}")).unwrap_or(true));
    assert_eq!(pids_in(inode), Vec::<u32>::new(), "no process in {inode}");

    let b = wait_hidden_alert(&hook, &agent, pid, inode);
    assert_eq!(b["count"], LEAKED, "{b:#}");
    agent.wait_scans(2);
    let path = format!("/v1/sockets?netns={inode}&port={PORT}&state=LISTEN,CLOSE_WAIT");
    let body = agent.get_ok(&path);
    let rows = body["sockets"].as_array().cloned().unwrap_or_default();
    assert_eq!(rows.len(), LEAKED + 1, "GET {path}: {body:#}");
    for r in &rows {
        assert_eq!(
            (&r["netns"], &r["pid"]),
            (&json!(inode), &json!(pid)),
            "{r}"
        );
    }
    assert!(
        agent
            .find("close_wait_buildup", |f| f["netns"] == json!(inode)
                && names_pid(f, pid))
            .is_some(),
        "{:#?}",
        agent.findings()
    );
    assert!(
        agent.stderr().contains(&format!("netns={inode}")),
        "the daemon says it scans {inode} through a held socket:\n{}",
        agent.stderr()
    );

    // A daemon started now finds it too (its first scan looks, the next walks it).
    let dir2 = TempDir::new("ns-hidden-2");
    let hook2 = host_receiver();
    let fresh = Agent::start_in_host(&dir2, &host_config(&dir2, &hook2));
    wait_hidden_alert(&hook2, &fresh, pid, inode);
    drop(fresh);

    // And a snapshot, of every namespace or of that one by its inode.
    assert_snapshot_shows(&snapshot_in_host(&[]), inode, pid, "snapshot");
    let only = snapshot_in_host(&["--netns", &inode.to_string()]);
    assert_snapshot_shows(&only, inode, pid, "snapshot --netns INODE");
    assert!(
        sockets(&only).iter().all(|r| r.netns == Some(inode)),
        "--netns {inode} let in other namespaces' rows"
    );
    drop(agent);

    // The holder lets go: the namespace is gone, and so are its rows.
    drop(peer);
    let after = snapshot_in_host(&[]);
    assert!(
        sockets(&after).iter().all(|r| r.netns != Some(inode)),
        "rows of a namespace that is gone"
    );
}
