//! `connreap snapshot --json` end to end: real sockets made by `connreap-testpeer` in a fresh
//! network namespace per test, checked the way a user reads them (owner, state, ports, ages,
//! idle times, addresses).

mod cli;
mod close_wait;
mod established;
mod filters;
mod tracker;

use std::{path::Path, time::Duration};

use connreap_tests::harness::{snapshot, sockets, Child, NetNs, SocketRow, PEER_COMM, PIN_ROOT};

/// How long a socket is left alone before its age / idle time is checked.
const WAIT: Duration = Duration::from_secs(3);

/// Run connreap once so the state tracker is attached and pinned: later transitions get exact ages.
fn pin_tracker(ns: &NetNs) {
    snapshot(ns, &[]);
    assert!(
        Path::new(PIN_ROOT).is_dir(),
        "connreap snapshot did not pin its state tracker under {PIN_ROOT}"
    );
}

fn owned_by(socks: &[SocketRow], pid: u32) -> Vec<&SocketRow> {
    socks.iter().filter(|s| s.pid == Some(pid)).collect()
}

fn secs(d: Duration) -> f64 {
    d.as_secs_f64()
}

/// Checks shared by every CLOSE_WAIT test: `n` client sockets of `child`, dialled to `peer_ip`
/// on `port`, from local addresses `local_ip`, each in CLOSE_WAIT with an exact age in
/// [min_age, max_age].
#[allow(clippy::too_many_arguments)]
fn assert_close_wait_clients(
    snap: &serde_json::Value,
    child: &Child,
    n: usize,
    local_ip: &str,
    peer_ip: &str,
    port: u16,
    min_age: Duration,
    max_age: Duration,
) {
    let all = sockets(snap);
    let mine: Vec<&SocketRow> = owned_by(&all, child.pid())
        .into_iter()
        .filter(|s| s.state == "CLOSE_WAIT")
        .collect();
    assert_eq!(
        mine.len(),
        n,
        "expected {n} CLOSE_WAIT sockets of pid {}:\n{snap:#}",
        child.pid()
    );
    let mut inodes = Vec::new();
    for s in &mine {
        let ctx = format!("socket {s:?} in\n{snap:#}");
        assert_eq!(s.comm.as_deref(), Some(PEER_COMM), "{ctx}");
        assert!(s.fd.is_some_and(|fd| fd > 2), "{ctx}");
        assert_eq!(s.peer, format!("{peer_ip}:{port}"), "{ctx}");
        assert!(s.local.starts_with(&format!("{local_ip}:")), "{ctx}");
        assert_ne!(s.local_port(), port, "{ctx}");
        assert_eq!(s.service_port, port, "{ctx}");
        assert_eq!(s.direction, "outbound", "{ctx}");
        // Not asserted: `cookie` (connreap reads sk_cookie, which stays 0 until something asks
        // the kernel to generate it).
        assert!(s.inode != 0, "{ctx}");
        assert_eq!(s.uid, 0, "{ctx}");
        assert!(s.age_exact, "the tracker saw this transition: {ctx}");
        assert!(
            s.age_secs >= secs(min_age) && s.age_secs <= secs(max_age),
            "age {} outside [{min_age:?}, {max_age:?}]: {ctx}",
            s.age_secs
        );
        inodes.push(s.inode);
    }
    inodes.sort_unstable();
    inodes.dedup();
    assert_eq!(inodes.len(), n, "inodes must be distinct:\n{snap:#}");
}
