//! CLOSE_WAIT clients over IPv4, IPv6 and IPv4-mapped IPv6: owner, service port, exact age.

use std::{
    thread,
    time::{Duration, Instant},
};

use connreap_tests::harness::{
    peer, require_privileges, snapshot, sockets, summary, NetNs, PEER_COMM,
};

use super::{assert_close_wait_clients, owned_by, pin_tracker, secs, WAIT};

#[test]
fn close_wait_sockets_show_owner_service_port_and_age() {
    let Some(_env) = require_privileges() else {
        return;
    };
    let ns = NetNs::new("cw");
    pin_tracker(&ns);
    let started = Instant::now();
    let (child, ready) = peer(
        &ns,
        &["close-wait", "--addr", "127.0.0.1:7000", "--count", "3"],
    );
    assert_eq!(ready.get("port"), "7000");
    thread::sleep(WAIT);

    let snap = snapshot(&ns, &["--state", "CLOSE_WAIT"]);
    let elapsed = started.elapsed() + Duration::from_millis(500);
    assert_close_wait_clients(
        &snap,
        &child,
        3,
        "127.0.0.1",
        "127.0.0.1",
        7000,
        WAIT,
        elapsed,
    );
    let all = sockets(&snap);
    assert!(
        all.iter().all(|s| s.state == "CLOSE_WAIT"),
        "--state CLOSE_WAIT let other states through:\n{snap:#}"
    );
    let locals: Vec<&str> = ready.get("locals").split(',').collect();
    for s in owned_by(&all, child.pid()) {
        assert!(
            locals.contains(&s.local.as_str()),
            "{} is not one of the child's clients {locals:?}",
            s.local
        );
    }

    let group = summary(&snap)
        .into_iter()
        .find(|g| g.pid == Some(child.pid()))
        .unwrap_or_else(|| panic!("no summary group for pid {}:\n{snap:#}", child.pid()));
    assert_eq!(group.comm, PEER_COMM, "{group:?}");
    assert_eq!(
        (group.service_port, group.state.as_str(), group.count),
        (7000, "CLOSE_WAIT", 3),
        "{group:?}"
    );
    assert!(
        group.oldest_age_exact && group.oldest_age_secs >= secs(WAIT),
        "{group:?}"
    );

    // --pid selects exactly the child's sockets: its listener and its three clients.
    let by_pid = sockets(&snapshot(&ns, &["--pid", &child.pid().to_string()]));
    let mut states: Vec<&str> = by_pid.iter().map(|s| s.state.as_str()).collect();
    states.sort_unstable();
    assert_eq!(
        states,
        ["CLOSE_WAIT", "CLOSE_WAIT", "CLOSE_WAIT", "LISTEN"],
        "{by_pid:#?}"
    );
    let listener = by_pid.iter().find(|s| s.state == "LISTEN").unwrap();
    assert_eq!(
        (
            listener.local.as_str(),
            listener.direction.as_str(),
            listener.service_port
        ),
        ("127.0.0.1:7000", "listen", 7000)
    );
}

#[test]
fn ipv6_and_v4_mapped_close_wait_addresses() {
    let Some(_env) = require_privileges() else {
        return;
    };
    let ns = NetNs::new("v6");
    pin_tracker(&ns);
    let started = Instant::now();
    let (v6, _) = peer(&ns, &["close-wait", "--addr", "[::1]:7300", "--count", "2"]);
    let (mapped, _) = peer(
        &ns,
        &[
            "close-wait",
            "--addr",
            "[::ffff:127.0.0.1]:7301",
            "--count",
            "2",
        ],
    );
    let snap = snapshot(&ns, &["--state", "CLOSE_WAIT"]);
    let max_age = started.elapsed() + Duration::from_millis(500);
    assert_close_wait_clients(
        &snap,
        &v6,
        2,
        "[::1]",
        "[::1]",
        7300,
        Duration::ZERO,
        max_age,
    );
    assert_close_wait_clients(
        &snap,
        &mapped,
        2,
        "[::ffff:127.0.0.1]",
        "[::ffff:127.0.0.1]",
        7301,
        Duration::ZERO,
        max_age,
    );

    // The mapped clients reach a dual-stack listener on [::].
    let listeners = sockets(&snapshot(&ns, &["--state", "LISTEN"]));
    let find = |pid: u32| {
        owned_by(&listeners, pid)
            .first()
            .map(|s| s.local.clone())
            .unwrap_or_else(|| panic!("no listener of pid {pid}:\n{listeners:#?}"))
    };
    assert_eq!(find(v6.pid()), "[::1]:7300");
    assert_eq!(find(mapped.pid()), "[::]:7301");
}
