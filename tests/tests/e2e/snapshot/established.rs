//! ESTABLISHED pairs: idle times of a quiet pair and of a chatty one, and `--idle-min`.

use std::time::{Duration, Instant};

use connreap_tests::harness::{
    peer, require_privileges, snapshot, sockets, wait_until, Child, NetNs, SocketRow, PEER_COMM,
    SNAPSHOT_POLL,
};
use serde_json::Value;

use super::{owned_by, secs, WAIT};

#[test]
fn idle_and_chatty_established_pairs() {
    let Some(_env) = require_privileges() else {
        return;
    };
    let ns = NetNs::new("idle");
    let started = Instant::now();
    let (idle_srv, _) = peer(&ns, &["listen", "--addr", "127.0.0.1:7200"]);
    let (idle_cli, _) = peer(
        &ns,
        &["connect", "--addr", "127.0.0.1:7200", "--count", "1"],
    );
    let chatty = ["--chatty-ms", "100"];
    let (chat_srv, _) = peer(
        &ns,
        &[&["listen", "--addr", "127.0.0.1:7201"][..], &chatty].concat(),
    );
    let (chat_cli, _) = peer(
        &ns,
        &[
            &["connect", "--addr", "127.0.0.1:7201", "--count", "1"][..],
            &chatty,
        ]
        .concat(),
    );

    // Poll until the idle pair has been idle WAIT: no fixed sleep, and no idle time can pass
    // that check before WAIT has really gone by (asserted below against the wall clock).
    let mut last = Value::Null;
    let (srv, cli) = wait_until(WAIT + Duration::from_secs(10), SNAPSHOT_POLL, || {
        last = snapshot(&ns, &["--state", "ESTABLISHED"]);
        established(&last, &idle_srv, &idle_cli).filter(|(s, c)| {
            [s, c]
                .iter()
                .all(|x| x.idle_secs.is_some_and(|i| i >= secs(WAIT)))
        })
    })
    .unwrap_or_else(|| panic!("idle pair never reached {WAIT:?} idle:\n{last:#}"));
    let max_idle = secs(started.elapsed()) + 0.5;
    assert_idle_pair(&last, (&srv, &cli), (&idle_srv, &idle_cli), max_idle);

    // The chatty pair has been running as long, yet both ends sent and received just now.
    let (srv, cli) = established(&last, &chat_srv, &chat_cli)
        .unwrap_or_else(|| panic!("chatty pair missing:\n{last:#}"));
    for (s, direction) in [(&srv, "inbound"), (&cli, "outbound")] {
        let ctx = format!("socket {s:?} in\n{last:#}");
        assert_eq!(s.comm.as_deref(), Some(PEER_COMM), "{ctx}");
        assert_eq!(
            (s.service_port, s.direction.as_str()),
            (7201, direction),
            "{ctx}"
        );
        for t in [s.idle_secs, s.last_recv_secs, s.last_send_secs] {
            assert!(
                t.is_some_and(|t| t < 1.0),
                "chatty socket looks idle: {ctx}"
            );
        }
    }
    assert_eq!(srv.peer, cli.local, "{last:#}");

    // --idle-min keeps the idle pair and drops the chatty one (and listeners: no idle time).
    let idle_only = sockets(&snapshot(&ns, &["--idle-min", "3s"]));
    let mut pids: Vec<Option<u32>> = idle_only.iter().map(|s| s.pid).collect();
    pids.sort_unstable();
    let mut want = vec![Some(idle_srv.pid()), Some(idle_cli.pid())];
    want.sort_unstable();
    assert_eq!(pids, want, "{idle_only:#?}");
}

/// The ESTABLISHED sockets of `srv` and `cli` in `snap`, if both are there.
fn established(snap: &Value, srv: &Child, cli: &Child) -> Option<(SocketRow, SocketRow)> {
    let socks = sockets(snap);
    let s = owned_by(&socks, srv.pid())
        .into_iter()
        .find(|s| s.state == "ESTABLISHED")
        .cloned();
    let c = owned_by(&socks, cli.pid())
        .into_iter()
        .find(|s| s.state == "ESTABLISHED")
        .cloned();
    s.zip(c)
}

/// The quiet pair on port 7200: owners, directions, idle times no longer than the test ran
/// (`max_idle`) and no shorter than the last send and receive, empty queues, mirrored ends.
fn assert_idle_pair(
    last: &Value,
    (srv, cli): (&SocketRow, &SocketRow),
    (idle_srv, idle_cli): (&Child, &Child),
    max_idle: f64,
) {
    for (s, pid, direction) in [
        (srv, idle_srv.pid(), "inbound"),
        (cli, idle_cli.pid(), "outbound"),
    ] {
        let ctx = format!("socket {s:?} in\n{last:#}");
        assert_eq!(s.pid, Some(pid), "{ctx}");
        assert_eq!(s.comm.as_deref(), Some(PEER_COMM), "{ctx}");
        assert_eq!(
            (s.service_port, s.direction.as_str()),
            (7200, direction),
            "{ctx}"
        );
        let idle = s.idle_secs.unwrap();
        assert!(idle <= max_idle, "idle {idle} > time since start: {ctx}");
        assert!(
            s.last_recv_secs.unwrap() >= idle && s.last_send_secs.unwrap() >= idle,
            "{ctx}"
        );
        assert_eq!((s.rx_queue, s.tx_queue), (0, 0), "{ctx}");
    }
    assert_eq!(
        (srv.local.as_str(), srv.peer.as_str()),
        (cli.peer.as_str(), cli.local.as_str()),
        "the two ends must mirror each other"
    );
    assert_eq!(srv.local, "127.0.0.1:7200");
}
