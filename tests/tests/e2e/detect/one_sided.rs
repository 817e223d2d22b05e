//! One-sided leaks (incident 3's ghost connections): clients in another network namespace,
//! reached over a veth pair, vanish without a FIN or RST (their link goes down, then they
//! die). The server keeps its ESTABLISHED sockets, idle, queues empty, forever;
//! idle_established_buildup names the server process, its port, the peers and whether TCP
//! keepalive is on for them.

use connreap_tests::harness::{
    alerts::{assert_alert_shape, is, owners, receiver, wait_post},
    ip, peer, require_privileges, wait_until, Agent, Config, NetNs, TempDir, FINDING, PEER_COMM,
    POLL,
};
use serde_json::{json, Value};

const SERVER_IP: &str = "10.77.0.1";
const CLIENT_IP: &str = "10.77.0.2";
/// Sockets per server: the threshold the test configures.
const GHOSTS: usize = 8;

/// A veth pair between `server` (`vs`, SERVER_IP) and `client` (`vc`, CLIENT_IP), both up.
fn link(server: &NetNs, client: &NetNs) {
    let (s, c) = (server.name(), client.name());
    ip(&[
        "-n", s, "link", "add", "vs", "type", "veth", "peer", "name", "vc", "netns", c,
    ]);
    ip(&[
        "-n",
        s,
        "addr",
        "add",
        &format!("{SERVER_IP}/24"),
        "dev",
        "vs",
    ]);
    ip(&[
        "-n",
        c,
        "addr",
        "add",
        &format!("{CLIENT_IP}/24"),
        "dev",
        "vc",
    ]);
    ip(&["-n", s, "link", "set", "vs", "up"]);
    ip(&["-n", c, "link", "set", "vc", "up"]);
}

#[test]
fn idle_sockets_whose_peer_vanished_are_named_with_keepalive() {
    let Some(_env) = require_privileges() else {
        return;
    };
    let server_ns = NetNs::new("ghost");
    let client_ns = NetNs::new("ghostc");
    link(&server_ns, &client_ns);
    let dir = TempDir::new("ghost");
    let hook = receiver(&server_ns);
    let config = Config::alerting(&dir).detect(&format!(
        "idle_established_min_idle = \"3s\"\nidle_established_threshold = {GHOSTS}"
    ));
    let agent = Agent::start(&server_ns, &dir, &config);
    // Two servers: one without keepalive, one with it.
    let (plain, _) = peer(
        &server_ns,
        &["listen", "--addr", &format!("{SERVER_IP}:7600")],
    );
    let (kept, _) = peer(
        &server_ns,
        &[
            "listen",
            "--addr",
            &format!("{SERVER_IP}:7601"),
            "--keepalive",
        ],
    );
    let count = GHOSTS.to_string();
    let clients: Vec<_> = ["7600", "7601"]
        .iter()
        .map(|port| {
            let addr = format!("{SERVER_IP}:{port}");
            peer(&client_ns, &["connect", "--addr", &addr, "--count", &count]).0
        })
        .collect();
    // The clients vanish: no FIN, no RST reaches the servers (the link is down first).
    ip(&["-n", server_ns.name(), "link", "set", "vs", "down"]);
    for c in clients {
        c.kill();
    }
    drop(client_ns);

    for (server, port, keepalive) in [(&plain, 7600, false), (&kept, 7601, true)] {
        let post = wait_post(
            &hook,
            &agent,
            &format!("idle_established_buildup on {port}"),
            |b| is(b, "idle_established_buildup", "firing") && b["service_port"] == port,
        );
        let b = &post.body;
        assert_alert_shape(b);
        assert_eq!(b["count"], GHOSTS, "{b:#}");
        assert_eq!(
            owners(b),
            vec![(Some(server.pid() as u64), PEER_COMM.to_string())],
            "{b:#}"
        );
        assert_eq!(b["keepalive"], keepalive, "{b:#}");
        assert_eq!(
            b["peers"],
            json!([{"addr": CLIENT_IP, "count": GHOSTS}]),
            "{b:#}"
        );
        let summary = b["summary"].as_str().unwrap_or_default();
        assert!(
            summary.starts_with(&format!(
                "{PEER_COMM} pid {} holds {GHOSTS} idle ESTABLISHED sockets accepted on port {port} with no local other end",
                server.pid()
            )),
            "{summary}"
        );
        assert!(
            summary.contains(if keepalive {
                "; TCP keepalive on: reaped by keepalive in ≤ "
            } else {
                "TCP keepalive off"
            }),
            "{summary}"
        );
        assert!(
            summary.ends_with(&format!("peers {CLIENT_IP} ({GHOSTS})")),
            "{summary}"
        );
        for s in b["sockets"].as_array().unwrap_or(&Vec::new()) {
            assert_eq!(s["state"], "ESTABLISHED", "{s}");
            assert_eq!(s["local"], format!("{SERVER_IP}:{port}"), "{s}");
            assert!(s["idle_secs"].as_f64().is_some_and(|i| i >= 3.0), "{s}");
        }
    }

    // The socket rows say it too (`keepalive` in /v1/sockets and snapshot --json).
    let rows = wait_until(FINDING, POLL, || {
        let (code, body) = agent.try_get("/v1/sockets?state=ESTABLISHED").ok()?;
        (code == 200).then_some(body)
    })
    .unwrap_or_else(|| panic!("/v1/sockets never answered"));
    let on_port = |port: u16| -> Vec<&Value> {
        rows["sockets"]
            .as_array()
            .map(|r| {
                r.iter()
                    .filter(|s| s["local"] == format!("{SERVER_IP}:{port}"))
                    .collect()
            })
            .unwrap_or_default()
    };
    assert_eq!(on_port(7600).len(), GHOSTS, "{rows:#}");
    assert!(
        on_port(7600).iter().all(|s| s["keepalive"] == false),
        "{rows:#}"
    );
    assert_eq!(on_port(7601).len(), GHOSTS, "{rows:#}");
    assert!(
        on_port(7601).iter().all(|s| s["keepalive"] == true),
        "{rows:#}"
    );
    drop(agent);
}
