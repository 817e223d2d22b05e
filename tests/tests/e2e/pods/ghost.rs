//! A ghost across pods: a client pod (containerd pod e2e/ghost-client) holds idle connections
//! to a server pod; the server pod vanishes without its FIN or RST reaching anyone (its veth
//! is deleted first, then its processes killed, then its namespace deleted). The client's
//! connections stay ESTABLISHED, idle, with no other end anywhere: `idle_established_buildup`
//! on the client, as on one host (the pairing across namespaces must not hide it).
//!
//! With TCP keepalive on (`connect --keepalive`), the kernel will reap them: after the
//! namespace's `tcp_keepalive_time` idle, then `tcp_keepalive_probes` unanswered probes
//! `tcp_keepalive_intvl` apart. The client pod's namespace has its own values (600 s, 4 x
//! 30 s: 720 s) unlike the host's; the finding must state when the kernel
//! will reap them, from that namespace's sysctls: the field `keepalive_reap_secs` (seconds
//! from the finding's time, about 720 minus their idle time) and the words `reaped by
//! keepalive in` in its summary. 720 s is later than the alert's own threshold (3 s), so
//! they are still ghosts.

use connreap_tests::{
    fixtures::ss_tcp,
    harness::{
        containers::FakeContainer,
        pods::{netns_sysctl, Node},
        wait_until, Agent, TempDir, HTTP, PEER_COMM, POLL,
    },
};
use serde_json::{json, Value};

use super::{assert_in_pod, host_config, host_receiver, names_pid, setup, wait_alert, Parts};

/// Connections per client: the finding's threshold.
const GHOSTS: usize = 8;
/// The client pod's keepalive sysctls: time, interval, probes.
const KEEPALIVE: (u64, u64, u64) = (600, 30, 4);

#[test]
fn ghosts_of_a_deleted_pod_stay_ghosts_and_keepalive_says_when_they_go() {
    let Some((_env, root)) = setup() else { return };
    let node = Node::new("node");
    let client_pod = node.pod(
        "ghost-cli",
        Some(FakeContainer::kube(&root, "e2e", "ghost-client")),
    );
    let (time, intvl, probes) = KEEPALIVE;
    for (key, v) in [
        ("tcp_keepalive_time", time),
        ("tcp_keepalive_intvl", intvl),
        ("tcp_keepalive_probes", probes),
    ] {
        netns_sysctl(client_pod.ns(), &format!("net.ipv4.{key}"), &v.to_string());
    }
    let server_pod = node.pod("ghost-srv", None);
    let server_ip = server_pod.ip.to_string();
    let (plain_srv, _) = server_pod.peer(&["listen", "--addr", &format!("{server_ip}:7600")]);
    let (kept_srv, _) = server_pod.peer(&["listen", "--addr", &format!("{server_ip}:7601")]);
    let count = GHOSTS.to_string();
    let (plain, _) = client_pod.peer(&[
        "connect",
        "--addr",
        &format!("{server_ip}:7600"),
        "--count",
        &count,
    ]);
    let (kept, _) = client_pod.peer(&[
        "connect",
        "--addr",
        &format!("{server_ip}:7601"),
        "--count",
        &count,
        "--keepalive",
    ]);

    // The server pod vanishes: unplugged first, so its FINs (or RSTs) go nowhere.
    server_pod.unplug();
    drop(plain_srv);
    drop(kept_srv);
    drop(server_pod);
    // The client still holds them all, ESTABLISHED (nothing told it otherwise).
    let held = wait_until(HTTP, POLL, || {
        let n = ss_tcp(Some(client_pod.name()))
            .unwrap_or_default()
            .iter()
            .filter(|s| {
                s.is_established()
                    && (s.pids.contains(&plain.pid()) || s.pids.contains(&kept.pid()))
            })
            .count();
        (n == 2 * GHOSTS).then_some(())
    });
    assert!(
        held.is_some(),
        "the client should still hold {} ESTABLISHED connections: {:#?}",
        2 * GHOSTS,
        ss_tcp(Some(client_pod.name()))
    );

    let dir = TempDir::new("pods-ghost");
    let hook = host_receiver();
    let config = host_config(&dir, &hook).detect(&format!(
        "idle_established_min_idle = \"3s\"\nidle_established_threshold = {GHOSTS}\n\
         stuck_pair_min_idle = \"3s\"\nstuck_pair_threshold = 4"
    ));
    let agent = Agent::start_in_host(&dir, &config);

    let mut parts = Parts::new();
    for (client, port, keepalive) in [(&plain, 7600, false), (&kept, 7601, true)] {
        let part = format!("the ghosts of {server_ip}:{port} (keepalive {keepalive})");
        parts.check(&part, || {
            let what = format!("an idle_established_buildup for the client of {server_ip}:{port}");
            let b = wait_alert(&hook, &agent, &what, |b| {
                b["kind"] == "idle_established_buildup"
                    && b["status"] == "firing"
                    && names_pid(b, client.pid())
            });
            let ctx = format!("idle_established_buildup:\n{b:#}");
            assert_eq!(b["count"], GHOSTS, "{ctx}");
            assert_eq!(b["service_port"], port, "{ctx}");
            assert_eq!(b["keepalive"], keepalive, "{ctx}");
            assert_eq!(
                b["peers"],
                json!([{"addr": server_ip, "count": GHOSTS}]),
                "{ctx}"
            );
            assert_eq!(b["processes"][0]["comm"], PEER_COMM, "{ctx}");
            assert_in_pod(&b, &client_pod, "the ghost finding");
            let summary = b["summary"].as_str().unwrap_or_default();
            if keepalive {
                assert_reap_time(&b, summary);
            } else {
                assert!(
                    b.get("keepalive_reap_secs").is_none_or(Value::is_null),
                    "no keepalive, no reap time: {ctx}"
                );
                assert!(!summary.contains("reaped by keepalive"), "{summary}");
            }
        });
    }
    parts.check("not paired with anything", || {
        let pairs: Vec<Value> = agent
            .findings()
            .into_iter()
            .filter(|f| {
                f["kind"] == "stuck_established_pairs"
                    && (names_pid(f, plain.pid()) || names_pid(f, kept.pid()))
            })
            .collect();
        assert!(pairs.is_empty(), "their other end is gone: {pairs:#?}");
    });
    parts.finish();
}

/// `keepalive_reap_secs` = when the kernel will reap the sockets, from the client
/// namespace's sysctls (720 s after their last activity), and the summary says it.
fn assert_reap_time(b: &Value, summary: &str) {
    let (time, intvl, probes) = KEEPALIVE;
    let full = (time + intvl * probes) as f64;
    let reap = b["keepalive_reap_secs"].as_f64().unwrap_or_else(|| {
        panic!(
            "expected `keepalive_reap_secs` (when the kernel will reap them, from the \
             namespace's tcp_keepalive_* sysctls: {time} + {probes} x {intvl} s after their \
             last activity): {b:#}"
        )
    });
    assert!(
        (full - 60.0..=full).contains(&reap),
        "keepalive_reap_secs = {reap}: the client pod's namespace reaps {full} s after the last \
         activity, which was seconds ago (the host's defaults would give 7875 s): {b:#}"
    );
    assert!(
        summary.contains("reaped by keepalive in"),
        "expected the summary to say when (`reaped by keepalive in ...`): {summary}"
    );
}
