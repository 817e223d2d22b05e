//! Filters that read like `ss`: state groups, source and destination ports with ranges, and a
//! socket shared by two processes (after fork) found by either one's pid.

use std::{collections::BTreeSet, process::Command};

use connreap_tests::harness::{
    peer, require_privileges, snapshot, Child, NetNs, SocketRow, READY_TIMEOUT,
};

fn rows(ns: &NetNs, args: &[&str]) -> Vec<SocketRow> {
    let v = snapshot(ns, args);
    serde_json::from_value(v["sockets"].clone()).expect("socket rows")
}

fn states(rows: &[SocketRow]) -> BTreeSet<String> {
    rows.iter().map(|r| r.state.clone()).collect()
}

#[test]
fn state_groups_port_ranges_and_every_holder_of_a_shared_socket() {
    let Some(_env) = require_privileges() else {
        return;
    };
    let ns = NetNs::new("ssfilt");
    // A listener on 7801 with 3 established clients, and a second listener on 7802.
    let (_server, _) = peer(&ns, &["listen", "--addr", "127.0.0.1:7801"]);
    let (_other, _) = peer(&ns, &["listen", "--addr", "127.0.0.1:7802"]);
    let (_clients, _) = peer(
        &ns,
        &["connect", "--addr", "127.0.0.1:7801", "--count", "3"],
    );

    // `connected` leaves the listeners out; `--state listening`-style single states still work.
    let connected = rows(&ns, &["--state", "connected", "--port", "7800-7809"]);
    assert_eq!(
        connected.len(),
        6,
        "3 clients and 3 accepted: {connected:#?}"
    );
    assert_eq!(
        states(&connected),
        BTreeSet::from(["ESTABLISHED".to_string()])
    );
    let listening = rows(&ns, &["--state", "LISTEN", "--sport", "7800-7809"]);
    assert_eq!(listening.len(), 2, "{listening:#?}");
    let big = rows(&ns, &["--state", "big", "--port", "7801"]);
    assert_eq!(
        big.len(),
        7,
        "the listener and both ends of 3 connections: {big:#?}"
    );

    // --sport is the local port, --dport the peer's: the accepted ends, then the clients.
    let accepted = rows(&ns, &["--sport", "7801", "--state", "synchronized"]);
    let clients = rows(&ns, &["--dport", "7801"]);
    assert_eq!(
        (accepted.len(), clients.len()),
        (3, 3),
        "{accepted:#?}\n{clients:#?}"
    );
    assert!(accepted.iter().all(|r| r.local.ends_with(":7801")));
    assert!(clients.iter().all(|r| r.peer.ends_with(":7801")));
    let none = rows(&ns, &["--dport", "7803-7900"]);
    assert!(none.is_empty(), "{none:#?}");

    // A client socket held by a parent and its forked child: `--pid CHILD` finds it too.
    let script = "import os, socket, sys, time\n\
        s = socket.create_connection(('127.0.0.1', 7802))\n\
        pid = os.fork()\n\
        if pid == 0:\n    time.sleep(600); sys.exit(0)\n\
        print('ready child=%d local=%s' % (pid, s.getsockname()[1]), flush=True)\n\
        time.sleep(600)\n";
    let mut parent = Child::spawn(ns.command("python3").args(["-c", script]), "python3 fork");
    let ready = parent.wait_ready(READY_TIMEOUT);
    let child: u32 = ready.get("child").parse().expect("child pid");
    let local = format!("127.0.0.1:{}", ready.get("local"));
    for pid in [parent.pid(), child] {
        let by_pid = rows(&ns, &["--pid", &pid.to_string(), "--dport", "7802"]);
        assert_eq!(
            by_pid.iter().map(|r| r.local.as_str()).collect::<Vec<_>>(),
            [local.as_str()],
            "--pid {pid} must find the shared socket (parent {}, child {child})",
            parent.pid()
        );
    }
    let _ = Command::new("kill").arg(child.to_string()).status();
}
