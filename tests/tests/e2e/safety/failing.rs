//! A daemon that can no longer scan must be restarted: its scans keep failing (here /proc is
//! hidden from it, as a broken mount would), so it stops the systemd watchdog pings and
//! /healthz answers 503 naming the cause; /v1/sockets answers an error, never an empty list.
//! When scans work again, pings resume and /healthz is 200.

use std::{
    os::unix::{net::UnixDatagram, process::CommandExt as _},
    process::Command,
    time::{Duration, Instant},
};

use connreap_tests::harness::{
    require_privileges, run, wait_until, Agent, Config, NetNs, TempDir, CONNREAP_TIMEOUT, POLL,
    SCAN,
};

/// What systemd would be told: every `KEY=VALUE` line received on the notify socket in `window`.
fn notifications(sock: &UnixDatagram, window: Duration) -> Vec<String> {
    let mut lines = Vec::new();
    let end = Instant::now() + window;
    let mut buf = [0u8; 4096];
    while Instant::now() < end {
        if let Ok(n) = sock.recv(&mut buf) {
            let text = String::from_utf8_lossy(&buf[..n]).into_owned();
            lines.extend(text.lines().map(str::to_string));
        }
    }
    lines
}

fn pings(lines: &[String]) -> usize {
    lines.iter().filter(|l| *l == "WATCHDOG=1").count()
}

/// `mount ARGS` (or `umount`) in the agent's mount namespace.
fn in_agent_mounts(agent: &Agent, args: &[&str]) {
    let out = run(
        Command::new("nsenter")
            .arg("-t")
            .arg(agent.pid().to_string())
            .arg("-m")
            .args(args),
        CONNREAP_TIMEOUT,
    );
    assert!(out.status.success(), "nsenter {args:?}: {}", out.stderr);
}

#[test]
fn scans_that_keep_failing_stop_the_watchdog_and_fail_healthz_until_they_work_again() {
    let Some(_env) = require_privileges() else {
        return;
    };
    let ns = NetNs::new("sf-failing");
    let dir = TempDir::new("sf-failing");
    let notify_path = dir.path("notify.sock");
    let notify = UnixDatagram::bind(&notify_path).expect("bind the notify socket");
    notify
        .set_read_timeout(Some(Duration::from_millis(100)))
        .expect("read timeout");
    let config = Config::new(&dir);
    let mut agent = Agent::start_notify(
        &ns,
        &dir,
        &config,
        &notify_path,
        Duration::from_secs(60),
        |cmd| {
            // SAFETY: unshare(2) and mount(2) are plain syscalls, async-signal-safe. A mount
            // namespace of its own (slave: nothing it mounts reaches the host), so the fault
            // below hides /proc from the agent alone.
            unsafe {
                cmd.pre_exec(|| {
                    if libc::unshare(libc::CLONE_NEWNS) != 0
                        || libc::mount(
                            std::ptr::null(),
                            c"/".as_ptr(),
                            std::ptr::null(),
                            libc::MS_REC | libc::MS_SLAVE,
                            std::ptr::null(),
                        ) != 0
                    {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
        },
    );

    // Healthy: READY=1, then one WATCHDOG=1 per scan.
    let seen = notifications(&notify, SCAN * 3);
    assert!(
        seen.iter().any(|l| l == "READY=1") && pings(&seen) >= 2,
        "a healthy daemon must tell systemd it is ready and ping the watchdog every scan: {seen:?}\n{}",
        agent.stderr()
    );

    // The fault: every scan fails.
    in_agent_mounts(&agent, &["mount", "-t", "tmpfs", "none", "/proc"]);
    let health = wait_until(SCAN * 10, POLL, || {
        let (code, h) = agent.try_get("/healthz").ok()?;
        (code == 503 && h["status"] == "failing").then_some(h)
    })
    .unwrap_or_else(|| {
        panic!(
            "/healthz never turned 503 \"failing\" while every scan failed: {:?}\n{}",
            agent.try_get("/healthz").ok(),
            agent.stderr()
        )
    });
    let cause = health["cause"].as_str().unwrap_or_default();
    assert!(
        cause.contains("scans failed in a row") && cause.contains("network namespace"),
        "the cause must say scans fail and why: {health}"
    );
    // No ping while failing: systemd's watchdog would restart the daemon.
    let _ = notifications(&notify, SCAN);
    let failing = notifications(&notify, SCAN * 4);
    assert_eq!(
        pings(&failing),
        0,
        "the watchdog is still pinged while every scan fails: {failing:?}"
    );
    // The table is an error, not an empty list.
    let (code, body) = agent.get("/v1/sockets");
    assert_eq!(code, 503, "{body}");
    assert!(
        body["error"]
            .as_str()
            .is_some_and(|e| e.contains("the last scan failed")),
        "{body}"
    );
    agent.assert_alive();

    // The fault goes away: scans, pings and /healthz recover.
    in_agent_mounts(&agent, &["umount", "/proc"]);
    wait_until(SCAN * 10, POLL, || {
        let (code, h) = agent.try_get("/healthz").ok()?;
        (code == 200 && h["status"] == "ok").then_some(())
    })
    .unwrap_or_else(|| panic!("/healthz never recovered: {}", agent.stderr()));
    let recovered = notifications(&notify, SCAN * 3);
    assert!(
        pings(&recovered) >= 2,
        "watchdog pings did not resume: {recovered:?}"
    );
    let log = agent.stderr();
    assert!(
        log.contains("failing: no more watchdog pings") && log.contains("recovered"),
        "the log must say when the daemon starts failing and when it recovers:\n{log}"
    );
    assert_eq!(
        log.matches("failing: no more watchdog pings").count(),
        1,
        "one line when it starts failing, not one per scan:\n{log}"
    );
}
