//! SIGTERM with a client holding a request half-sent (item 7): the daemon exits at once with
//! status 0, and no scan or reclaim round starts after "shutting down".

use std::{
    io::Write,
    net::TcpStream,
    thread,
    time::{Duration, Instant},
};

use connreap_tests::{
    fixtures::run_in_netns,
    harness::{
        alive, require_privileges, wait_until, Agent, Config, NetNs, TempDir, PEER_COMM, POLL, SCAN,
    },
};

use super::{close_wait_to, pool};

/// Longest exit after SIGTERM this test accepts (systemd's TimeoutStopSec is far longer; the
/// daemon has nothing to wait for here: no webhooks, and the API closes at once).
const EXIT: Duration = Duration::from_secs(5);
/// The policy's `min_age`: sockets that leak right before the signal become targets this long
/// after it, when a daemon still scanning would kill them.
const MIN_AGE: Duration = Duration::from_secs(3);

#[test]
fn sigterm_with_a_partial_request_open_exits_at_once_and_stops_reclaiming() {
    let Some(_env) = require_privileges() else {
        return;
    };
    let ns = NetNs::new("sf-term");
    let dir = TempDir::new("sf-term");
    let (early, _) = pool(&ns, 7500, 2);
    let policy = format!(
        r#"[[policy]]
name = "pool-leak"
mode = "enforce"
trigger = "always"
select = {{ comm = "{PEER_COMM}", states = ["CLOSE_WAIT"] }}
min_age = "{}s"
"#,
        MIN_AGE.as_secs()
    );
    let config = Config::new(&dir).protect_ports(&[22]).policy(&policy);
    let mut agent = Agent::start_with(&ns, &dir, &config, |cmd| {
        cmd.env("RUST_LOG", "connreap=info,connreap::scan=debug");
    });
    // The policy works: the early leak goes once old enough.
    wait_until(MIN_AGE + SCAN * 10, POLL, || {
        close_wait_to(&ns, 7500, early.pid())
            .is_empty()
            .then_some(())
    })
    .unwrap_or_else(|| panic!("the policy killed nothing:\n{}", agent.ctx()));

    // A fresh leak, and a client that sent half a request and waits.
    let (late, late_leak) = pool(&ns, 7501, 3);
    let api = agent.api();
    let (mut partial, _idle) = run_in_netns(ns.name(), || {
        let p = TcpStream::connect_timeout(&api, Duration::from_secs(5))?;
        let i = TcpStream::connect_timeout(&api, Duration::from_secs(5))?;
        Ok((p, i))
    })
    .unwrap_or_else(|e| panic!("connect to the API: {e}"));
    partial
        .write_all(b"POST /v1/reclaim HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n")
        .expect("half a request");
    thread::sleep(Duration::from_millis(300));
    let audited = agent.audit().len();

    agent.signal(libc::SIGTERM);
    let signalled = Instant::now();
    let status = agent
        .wait_exit(EXIT)
        .unwrap_or_else(|| panic!("still running {EXIT:?} after SIGTERM:\n{}", agent.stderr()));
    let took = signalled.elapsed();
    assert!(
        status.success(),
        "exit status {status} after SIGTERM:\n{}",
        agent.stderr()
    );
    println!("exited {took:?} after SIGTERM");

    // Had scans gone on, the fresh leak would be killed from MIN_AGE on.
    thread::sleep((MIN_AGE + SCAN * 2).saturating_sub(signalled.elapsed()));
    assert_eq!(close_wait_to(&ns, 7501, late.pid()), late_leak);
    assert!(alive(late.pid()));
    assert_eq!(
        agent.audit().len(),
        audited,
        "audit lines written after SIGTERM:\n{}",
        agent.ctx()
    );
    let stderr = agent.stderr();
    let lines: Vec<&str> = stderr.lines().collect();
    let stop = lines
        .iter()
        .position(|l| l.contains("shutting down"))
        .unwrap_or_else(|| panic!("no `shutting down` line:\n{stderr}"));
    let after = &lines[stop..];
    // A scan already running when the signal came may still log; none may start after it.
    let scans = after
        .iter()
        .filter(|l| l.contains("DEBUG") && l.contains("connreap::scan"))
        .count();
    assert!(scans <= 1, "{scans} scans after shutting down:\n{stderr}");
    assert!(
        !after.iter().any(|l| l.contains("reclaim decision")),
        "reclaim decisions after shutting down:\n{stderr}"
    );
}
