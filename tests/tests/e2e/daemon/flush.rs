//! The event path from the kernel's per-CPU batches to the daemon, seen from outside.

use std::{
    net::{TcpListener, TcpStream},
    time::{Duration, Instant},
};

use connreap_tests::harness::{
    alerts::{describe, is, names_pid, receiver},
    require_privileges, run, wait_until, Agent, Config, NetNs, TempDir, CONNREAP_TIMEOUT,
};

/// The tracker sends transitions to the ring in per-CPU batches; a process that opens only a
/// handful of connections must still be seen promptly (the daemon flushes the partial batches of
/// every CPU on a timer), not whenever some batch happens to fill. With a storm threshold of
/// 0.5 connections/s and no growth required, three connects from this test process must reach
/// the webhook as a reconnect_storm within a few seconds, while nothing else polls the agent.
#[test]
fn a_few_transitions_reach_the_daemon_without_waiting_for_a_full_batch() {
    let Some(_env) = require_privileges() else {
        return;
    };
    let ns = NetNs::new("flush");
    let dir = TempDir::new("flush");
    let hook = receiver(&ns);
    let config = Config::alerting(&dir).detect("storm_rate = 0.5\nstorm_growth_windows = 0");
    let mut agent = Agent::start(&ns, &dir, &config);
    // Quiet: no API polling from here on, so no other connections fill the batches.
    std::thread::sleep(Duration::from_secs(3));
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let me = std::process::id();
    let mut held = Vec::new();
    for _ in 0..3 {
        held.push(TcpStream::connect(("127.0.0.1", port)).unwrap());
        held.push(listener.accept().unwrap().0);
    }
    let made = Instant::now();
    let post = hook.wait_for_body(Duration::from_secs(6), |b| {
        is(b, "reconnect_storm", "firing") && names_pid(b, me) && b["service_port"] == port
    });
    agent.assert_alive();
    assert!(
        post.is_some(),
        "3 connects to port {port} by pid {me} never reached the storm detector within {:?}: partial per-CPU batches are not flushed; posts:\n{}\nagent stderr:\n{}",
        made.elapsed(),
        describe(&hook.posts()),
        agent.stderr()
    );
    // They came through the flush, not through a batch that other traffic happened to fill.
    let flushed = agent
        .metric("connreap_event_batches_flushed_total")
        .unwrap_or(0.0);
    assert!(
        flushed >= 1.0,
        "connreap_event_batches_flushed_total = {flushed}: the storm was seen, but no partial batch was flushed"
    );
    drop(held);
    // The kernel side's memory is visible: the event ring (2 MiB) and the state map's buckets.
    for (map, at_least) in [("events", 2 << 20), ("state", 1 << 20)] {
        let series = format!(r#"connreap_bpf_map_memory_bytes{{map="{map}"}}"#);
        let bytes = agent.metric(&series).unwrap_or(0.0);
        assert!(bytes >= at_least as f64, "{series} = {bytes}");
    }
    // So are transitions the kernel skipped (a tracker run nested in another on one CPU).
    let misses = r#"connreap_bpf_program_recursion_misses_total{program="connreap_set_state"}"#;
    assert!(
        agent.metric(misses).is_some_and(|n| n >= 0.0),
        "{misses} missing from /metrics"
    );
    agent.assert_healthy();
}

/// The BPF programs' rare paths are logged through aya-log into the daemon's own log. With a
/// pin root of its own (a fresh tracker, counters at 0), `snapshot` attaches the tracker and
/// leaves it pinned with no reader; loopback churn then overflows the 2 MiB event ring. The
/// daemon started afterwards reads the programs' log ring: its stderr names the loss (target
/// `connreap::bpf`), and the drops are in `connreap_bpf_ring_drops_total`.
#[test]
fn a_ring_overflow_with_no_reader_reaches_the_daemons_log_through_aya_log() {
    let Some(_env) = require_privileges() else {
        return;
    };
    const ROOT: &str = "/sys/fs/bpf/connreap-test-bpflog";
    let ns = NetNs::new("bpflog");
    let dir = TempDir::new("bpflog");
    let _ = std::fs::remove_dir_all(ROOT);
    let cli = |args: &[&str]| {
        let mut cmd = ns.connreap(args);
        cmd.env("CONNREAP_PIN_ROOT", ROOT);
        run(&mut cmd, CONNREAP_TIMEOUT)
    };
    let out = cli(&["snapshot", "--json"]);
    assert!(out.status.success(), "snapshot failed: {out:?}");

    // Each connect-and-reset sends several transitions (~64 bytes each) into the ring; 20k
    // of them are well over 2 MiB. The reset (SO_LINGER 0) leaves no TIME_WAIT behind, so the
    // ephemeral ports never run out.
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    for _ in 0..20_000 {
        let c = TcpStream::connect(addr).unwrap();
        let (s, _) = listener.accept().unwrap();
        socket2::SockRef::from(&c)
            .set_linger(Some(Duration::ZERO))
            .unwrap();
        drop(c);
        drop(s);
    }

    let config = Config::alerting(&dir);
    let agent = Agent::start_with(&ns, &dir, &config, |cmd| {
        cmd.env("CONNREAP_PIN_ROOT", ROOT);
    });
    let logged = wait_until(Duration::from_secs(10), Duration::from_millis(200), || {
        let err = agent.stderr();
        err.lines()
            .any(|l| l.contains("connreap::bpf") && l.contains("event ring full"))
            .then_some(())
    });
    let drops = agent.metric("connreap_bpf_ring_drops_total").unwrap_or(0.0);
    drop(agent);
    let unpinned = cli(&["unpin"]);
    assert!(
        logged.is_some(),
        "the daemon's log never said the event ring was full (connreap_bpf_ring_drops_total = {drops})"
    );
    assert!(drops > 0.0, "connreap_bpf_ring_drops_total = {drops}");
    assert!(unpinned.status.success(), "unpin failed: {unpinned:?}");
}
