//! The daemon's own namespace is walked (iter/tcp over the host's whole TCP table) only when
//! the kernel counts something there that the sweep over the state table cannot read: a
//! timewait or request socket, or more hashed sockets than the sweep read. Otherwise the scan
//! is "quiet": the sweep reads the namespace's sockets, fresh, and the table still shows them,
//! held by their process. A socket made since is shown on the next scan.

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
    // Every API request is a connection that closes: without this its TIME_WAIT socket would
    // make each scan of the next minute walk the namespace. No timewait socket is kept here.
    let status = ns
        .command("sysctl")
        .args(["-qw", "net.ipv4.tcp_max_tw_buckets=0"])
        .status()
        .expect("run sysctl");
    assert!(
        status.success(),
        "sysctl tcp_max_tw_buckets=0 in {}",
        ns.name()
    );
    let dir = TempDir::new("own-quiet");
    let go: PathBuf = dir.path("go");
    // One process holds a listener and both ends of a connection; told to, a second one.
    let script = format!(
        "import os, socket, time\n\
         l = socket.socket(); l.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n\
         l.bind(('127.0.0.1', {PORT})); l.listen()\n\
         c = socket.create_connection(('127.0.0.1', {PORT})); a, _ = l.accept()\n\
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
    // No request to the API meanwhile (each one's sockets are new to the next scan).
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
    let established = before.iter().filter(|(s, _)| s == "ESTABLISHED").count();
    assert_eq!(
        (before.len(), established),
        (3, 2),
        "listener and both ends: {before:?}"
    );
    assert!(
        before.iter().all(|(_, p)| *p == pid),
        "all held by {pid}: {before:?}"
    );

    // A connection made after the quiet scans: shown, held, on a later scan.
    std::fs::write(&go, b"").expect("write the go file");
    holder.wait_ready(READY);
    let after = wait_until(Duration::from_secs(10), POLL, || {
        let r = rows(&agent);
        (r.len() == 5).then_some(r)
    })
    .unwrap_or_else(|| {
        panic!(
            "the second connection never showed: {:?}\n{}",
            rows(&agent),
            agent.ctx()
        )
    });
    assert!(
        after.iter().all(|(_, p)| *p == pid),
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
    assert_eq!(again.len(), 5, "after quiet scans: {again:?}");
}
