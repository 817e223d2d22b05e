//! Active opens are made by threads; a storm is charged to the process and
//! named by the process's name (its thread-group leader's comm, as `snapshot` shows it), not
//! by the connecting thread's (a tokio client's `tokio-rt-worker`).

use connreap_tests::harness::{
    alerts::{assert_alert_shape, describe, is, names_pid, owners, receiver, wait_post},
    peer, require_privileges, Agent, Config, NetNs, TempDir, PEER_COMM,
};

const THREAD: &str = "storm-worker";

#[test]
fn reconnect_storm_names_the_process_not_the_connecting_thread() {
    let Some(_env) = require_privileges() else {
        return;
    };
    let ns = NetNs::new("pname");
    let dir = TempDir::new("pname");
    let hook = receiver(&ns);
    let config = Config::alerting(&dir).detect("storm_rate = 50.0\nstorm_growth_windows = 2");
    let agent = Agent::start(&ns, &dir, &config);
    let (_server, _) = peer(
        &ns,
        &[
            "listen",
            "--addr",
            "127.0.0.1:7500",
            "--close-after-ms",
            "0",
        ],
    );
    // Connects from a thread named `storm-worker`, 20/s doubling every second up to 320/s.
    let (storm, _) = peer(
        &ns,
        &[
            "storm",
            "--addr",
            "127.0.0.1:7500",
            "--start-rate",
            "20",
            "--max-rate",
            "320",
            "--duration-ms",
            "12000",
            "--thread-name",
            THREAD,
        ],
    );
    let post = wait_post(
        &hook,
        &agent,
        "reconnect_storm for the storming client",
        |b| is(b, "reconnect_storm", "firing") && names_pid(b, storm.pid()),
    );
    let b = &post.body;
    assert_alert_shape(b);
    assert_eq!(
        owners(b),
        vec![(Some(storm.pid() as u64), PEER_COMM.to_string())],
        "the process's name, not the thread's: {b:#}"
    );
    let summary = b["summary"].as_str().unwrap_or_default();
    assert!(
        summary.starts_with(&format!("{PEER_COMM} pid {} opens", storm.pid())),
        "{summary}"
    );
    assert!(
        summary.ends_with(&format!("; connecting thread: {THREAD}")),
        "the thread name as a detail: {summary}"
    );
    assert!(
        hook.posts()
            .iter()
            .all(|p| owners(&p.body).iter().all(|(_, comm)| comm != THREAD)),
        "no alert is charged to the thread name:\n{}",
        describe(&hook.posts())
    );
}
