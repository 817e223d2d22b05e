//! The daemon's own namespace is walked (iter/tcp over the host's whole TCP table) only when
//! the kernel counts something there that neither the sweep over the state table nor the last
//! walk's carried TIME_WAIT sockets account for: a new timewait socket, a request socket, or
//! more hashed sockets than the sweep read. Otherwise the scan is "quiet": the sweep reads the
//! namespace's sockets, fresh, the TIME_WAIT sockets are carried, and the table still shows
//! them all, held by their process. A socket made since is shown on the next scan.

use std::{path::PathBuf, time::Duration};

use connreap_tests::harness::{
    require_privileges, wait_until, Agent, Child, Config, NetNs, TempDir, POLL,
};
use serde_json::Value;

const PORT: u16 = 7830;
const READY: Duration = Duration::from_secs(10);

/// How many scans (logged with `connreap::scan=debug`) did not walk the own namespace: none
/// walked (the own namespace is entered on every scan: walked, or quiet).
fn quiet_scans(agent: &Agent) -> usize {
    agent
        .stderr()
        .lines()
        .filter(|l| l.contains(" others_walked=") && l.contains(" walked=0 "))
        .count()
}

/// Rows on [`PORT`] (`GET /v1/sockets?port=`): state and owner pid.
fn rows(agent: &Agent) -> Vec<(String, Value)> {
    let body = agent.get_ok(&format!("/v1/sockets?port={PORT}"));
    body["sockets"]
        .as_array()
        .unwrap_or_else(|| panic!("no `sockets` array: {body}"))
        .iter()
        .map(|r| {
            (
                r["state"].as_str().unwrap_or("").to_string(),
                r["pid"].clone(),
            )
        })
        .collect()
}

#[test]
fn the_own_namespace_is_swept_when_the_kernel_counts_nothing_a_walk_would_add() {
    let Some(_env) = require_privileges() else {
        return;
    };
    let ns = NetNs::new("ownquiet");
    let dir = TempDir::new("own-quiet");
    let go: PathBuf = dir.path("go");
    // One process holds a listener and both ends of a connection, and leaves a TIME_WAIT
    // socket of a connection it closed first; told to, it makes a second connection.
    let script = format!(
        "import os, socket, time\n\
         l = socket.socket(); l.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n\
         l.bind(('127.0.0.1', {PORT})); l.listen()\n\
         c = socket.create_connection(('127.0.0.1', {PORT})); a, _ = l.accept()\n\
         t = socket.create_connection(('127.0.0.1', {PORT})); s, _ = l.accept()\n\
         t.close(); time.sleep(0.1); s.close(); time.sleep(0.1)\n\
         print('ready', flush=True)\n\
         while not os.path.exists('{go}'): time.sleep(0.02)\n\
         c2 = socket.create_connection(('127.0.0.1', {PORT})); a2, _ = l.accept()\n\
         print('ready second', flush=True)\n\
         time.sleep(600)\n",
        go = go.display()
    );
    let mut holder = Child::spawn(
        ns.command("python3").args(["-c", &script]),
        "python3 holder",
    );
    holder.wait_ready(READY);
    let pid = Value::from(holder.pid());
    let config = Config::new(&dir).scan_interval("500ms");
    let agent = Agent::start_with(&ns, &dir, &config, |cmd| {
        cmd.env("RUST_LOG", "connreap=info,connreap::scan=debug");
    });
    // No request to the API meanwhile (each one's sockets are new to the next scan). The
    // TIME_WAIT sockets (this test's, and those of the requests that saw the agent start)
    // are walked once, then carried: the kernel counts no other.
    wait_until(Duration::from_secs(20), POLL, || {
        (quiet_scans(&agent) >= 3).then_some(())
    })
    .unwrap_or_else(|| {
        panic!(
            "no 3 scans left the own namespace unwalked in 20 s:\n{}",
            agent.stderr()
        )
    });
    // Served from the last quiet scan: the next one, seeing this request's sockets, walks.
    let before = rows(&agent);
    let count =
        |rows: &[(String, Value)], state: &str| rows.iter().filter(|(s, _)| s == state).count();
    assert_eq!(
        (
            before.len(),
            count(&before, "ESTABLISHED"),
            count(&before, "TIME_WAIT")
        ),
        (4, 2, 1),
        "listener, both ends, and the TIME_WAIT socket: {before:?}"
    );
    assert!(
        before
            .iter()
            .filter(|(s, _)| s != "TIME_WAIT")
            .all(|(_, p)| *p == pid),
        "all held by {pid}: {before:?}"
    );

    // A connection made after the quiet scans: shown, held, on a later scan.
    std::fs::write(&go, b"").expect("write the go file");
    holder.wait_ready(READY);
    let after = wait_until(Duration::from_secs(10), POLL, || {
        let r = rows(&agent);
        (r.len() == 6).then_some(r)
    })
    .unwrap_or_else(|| {
        panic!(
            "the second connection never showed: {:?}\n{}",
            rows(&agent),
            agent.ctx()
        )
    });
    assert!(
        after
            .iter()
            .filter(|(s, _)| s != "TIME_WAIT")
            .all(|(_, p)| *p == pid),
        "all held by {pid}: {after:?}"
    );
    // The namespace goes quiet again once no request comes, and the rows are still there.
    let seen = quiet_scans(&agent);
    wait_until(Duration::from_secs(20), POLL, || {
        (quiet_scans(&agent) >= seen + 2).then_some(())
    })
    .unwrap_or_else(|| {
        panic!(
            "no quiet scans after the second connection:\n{}",
            agent.stderr()
        )
    });
    let again = rows(&agent);
    assert_eq!(
        (again.len(), count(&again, "TIME_WAIT")),
        (6, 1),
        "after quiet scans: {again:?}"
    );
}
