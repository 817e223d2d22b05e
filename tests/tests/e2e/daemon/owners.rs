//! The daemon reuses its last owner dump while nothing that changes owners is counted (no TCP
//! state change, no holder reaped, no process started with a socket), also while processes
//! without sockets come and go, and dumps again when a holder goes or a process with a socket
//! appears: a socket handed to a new process, with no state change at all, shows under that
//! process on the next scan, not one `netns_walk_interval` later.

use std::{path::PathBuf, thread, time::Duration};

use connreap_tests::harness::{require_privileges, Agent, Child, Config, NetNs, TempDir};
use serde_json::Value;

const PORT: u16 = 7820;
const READY: Duration = Duration::from_secs(10);

/// Kills the forked holder however the test ends (it outlives its parent, the test's child).
struct Killed(u32);

impl Drop for Killed {
    fn drop(&mut self) {
        // SAFETY: kill(2) on a pid this test created; it is reaped by init or the subreaper.
        unsafe { libc::kill(self.0 as libc::pid_t, libc::SIGKILL) };
    }
}

/// The pid of each row on [`PORT`] (the listener and both ends of the connection).
fn owners(agent: &Agent) -> Vec<(String, Value)> {
    let body = agent.get_ok(&format!("/v1/sockets?port={PORT}"));
    body["sockets"]
        .as_array()
        .unwrap_or_else(|| panic!("no `sockets` array: {body}"))
        .iter()
        .map(|r| (format!("{} {}", r["local"], r["state"]), r["pid"].clone()))
        .collect()
}

#[test]
fn a_socket_handed_to_a_new_process_shows_under_it_on_the_next_scan() {
    let Some(_env) = require_privileges() else {
        return;
    };
    let ns = NetNs::new("owners");
    let dir = TempDir::new("owners");
    let go: PathBuf = dir.path("go");
    // The default netns_walk_interval (60 s): a stale owner dump could be reused that long.
    let config = Config::new(&dir).scan_interval("200ms");
    let mut agent = Agent::start_with(&ns, &dir, &config, |cmd| {
        cmd.env("RUST_LOG", "connreap=info,connreap::scan=debug");
    });
    // One process holds a listener and both ends of a connection to it; told to, it forks and
    // exits: the child holds all three, and no socket changes state.
    let script = format!(
        "import os, socket, time\n\
         l = socket.socket(); l.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n\
         l.bind(('127.0.0.1', {PORT})); l.listen()\n\
         c = socket.create_connection(('127.0.0.1', {PORT})); a, _ = l.accept()\n\
         print('ready', flush=True)\n\
         while not os.path.exists('{go}'): time.sleep(0.02)\n\
         pid = os.fork()\n\
         if pid == 0:\n    time.sleep(600); os._exit(0)\n\
         print('ready child=%d' % pid, flush=True)\n\
         os._exit(0)\n",
        go = go.display()
    );
    let mut parent = Child::spawn(
        ns.command("python3").args(["-c", &script]),
        "python3 holder",
    );
    parent.wait_ready(READY);
    let first = parent.pid();
    agent.wait_scans(3);
    let before = owners(&agent);
    assert_eq!(before.len(), 3, "listener and both ends: {before:?}");
    assert!(
        before.iter().all(|(_, pid)| *pid == first),
        "all held by pid {first}: {before:?}"
    );

    // No request to the API for 2 s (each opens a connection: a state change): quiet scans
    // reuse the last dump.
    let marks = |agent: &Agent| agent.stderr().matches("owners_reused=true").count();
    let reused_before = marks(&agent);
    thread::sleep(Duration::from_secs(2));
    let reused = marks(&agent) - reused_before;
    assert!(
        reused > 0,
        "no scan reused the owner dump in 2 s of quiet:\n{}",
        agent.ctx()
    );

    // Processes with no socket starting and exiting all the time (cron jobs, shells, probes
    // before they connect): every scan sees another set of pids, and still reuses the dump.
    let reused_before = marks(&agent);
    let until = std::time::Instant::now() + Duration::from_secs(2);
    while std::time::Instant::now() < until {
        let mut p = std::process::Command::new("sleep")
            .arg("0.05")
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("spawn sleep");
        p.wait().expect("reap sleep");
    }
    let reused = marks(&agent) - reused_before;
    assert!(
        reused > 0,
        "no scan reused the owner dump in 2 s of socketless processes coming and going:\n{}",
        agent.ctx()
    );

    std::fs::write(&go, b"").expect("write the go file");
    let child: u32 = parent.wait_ready(READY).get("child").parse().expect("pid");
    let _killed = Killed(child);
    parent
        .wait_timeout(READY)
        .unwrap_or_else(|| panic!("the parent {first} did not exit"));
    // Again no request until several scans have run: the table the API then serves was built
    // by scans that saw no TCP state change, only the process set change.
    thread::sleep(Duration::from_millis(1500));
    let after = owners(&agent);
    assert_eq!(after.len(), 3, "listener and both ends: {after:?}");
    assert!(
        after.iter().all(|(_, pid)| *pid == child),
        "all three now held by the child {child} (the parent {first} has exited): {after:?}\n{}",
        agent.ctx()
    );
    agent.assert_alive();
}
