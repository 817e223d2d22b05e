//! Incident 2, a pool leak: the server closes idle keep-alives, the client never closes its
//! side, and its CLOSE_WAIT sockets pile up.

use std::{
    collections::BTreeSet,
    time::{Duration, Instant},
};

use connreap_tests::{
    fixtures::{WebhookPost, WebhookReceiver},
    harness::{
        alerts::{assert_alert_shape, describe, is, names_pid, owners, receiver, wait_post},
        peer, require_privileges, Agent, Config, NetNs, TempDir, PEER_COMM,
    },
};
use serde_json::Value;

#[test]
fn pool_leak_close_wait_buildup_names_the_client() {
    pool_leak("poolv4", 7400, "127.0.0.1:7400", "127.0.0.1");
}

#[test]
fn pool_leak_over_ipv4_mapped_ipv6_sockets() {
    // A JVM-like client: AF_INET6 sockets to an IPv4 backend, seen as ::ffff:127.0.0.1.
    pool_leak(
        "poolv6",
        7401,
        "[::ffff:127.0.0.1]:7401",
        "[::ffff:127.0.0.1]",
    );
}

/// Where the leaking client connects: the backend's `port`, dialled as `dial`, seen by the
/// agent as `expected_peer:port`.
struct Target {
    port: u16,
    expected_peer: &'static str,
}

fn pool_leak(ns_name: &str, port: u16, dial: &str, expected_peer: &'static str) {
    let Some(_env) = require_privileges() else {
        return;
    };
    let target = Target {
        port,
        expected_peer,
    };
    let ns = NetNs::new(ns_name);
    let dir = TempDir::new(ns_name);
    let hook = receiver(&ns);
    let config =
        Config::alerting(&dir).detect("close_wait_min_age = \"3s\"\nclose_wait_threshold = 8");
    let mut agent = Agent::start(&ns, &dir, &config);
    let listen = format!("127.0.0.1:{port}");
    // The backend (nginx in the incident): closes every connection after ~1 s.
    let (server, _) = peer(
        &ns,
        &["listen", "--addr", &listen, "--close-after-ms", "1000"],
    );
    // The leaking client holds 12 pooled connections and never closes them; a well-behaved
    // one with 3 stays below the threshold.
    let (client, ready) = peer(&ns, &["connect", "--addr", dial, "--count", "12"]);
    let connected = Instant::now();
    let (small, _) = peer(&ns, &["connect", "--addr", dial, "--count", "3"]);
    assert_eq!(ready.get("count"), "12");
    let locals = ready.locals();

    let post = wait_post(&hook, &agent, "close_wait_buildup for the client", |b| {
        is(b, "close_wait_buildup", "firing") && names_pid(b, client.pid())
    });
    assert_buildup_alert(&post, connected, client.pid(), &locals, &target);
    let fingerprint = post.body["fingerprint"].clone();
    // The API agrees; nobody else is blamed: not the server that closed, not the small pool.
    let findings = agent.findings();
    let cw: Vec<&Value> = findings
        .iter()
        .filter(|f| f["kind"] == "close_wait_buildup")
        .collect();
    assert_eq!(cw.len(), 1, "{findings:#?}");
    assert_eq!(cw[0]["fingerprint"], fingerprint, "{findings:#?}");
    assert_eq!(cw[0]["count"], 12, "{findings:#?}");
    for f in &findings {
        assert!(
            !names_pid(f, server.pid()) && !names_pid(f, small.pid()),
            "only the leaking client is a finding: {findings:#?}"
        );
    }
    assert_eq!(
        agent.metric(r#"connreap_findings{kind="close_wait_buildup"}"#),
        Some(1.0)
    );
    assert_socket_table(&mut agent, client.pid(), &locals, &target);

    // The client releases its pool (restart): resolved.
    client.kill();
    let resolved = wait_post(&hook, &agent, "close_wait_buildup resolved", |b| {
        is(b, "close_wait_buildup", "resolved") && b["fingerprint"] == fingerprint
    });
    assert_alert_shape(&resolved.body);
    assert_blames_none_of(&hook, &[small.pid(), server.pid()]);
    agent.assert_healthy();
}

/// The alert names the leaking client, its 12 CLOSE_WAIT sockets and their peer, and came no
/// earlier than close_wait_min_age.
fn assert_buildup_alert(
    post: &WebhookPost,
    connected: Instant,
    client: u32,
    locals: &BTreeSet<String>,
    target: &Target,
) {
    let (port, expected_peer) = (target.port, target.expected_peer);
    let b = &post.body;
    assert_alert_shape(b);
    // The server closed ~1 s after accepting; CLOSE_WAIT younger than 3 s is not reported.
    assert!(
        post.at.duration_since(connected) >= Duration::from_secs(3),
        "fired {:?} after connecting, before close_wait_min_age: {b:#}",
        post.at.duration_since(connected)
    );
    assert_eq!(
        b["fingerprint"],
        // Identity without the pid (it is in `processes`): a restarted client keeps its alert.
        format!("close_wait_buildup:{PEER_COMM}:{port}"),
        "{b:#}"
    );
    assert_eq!(b["service_port"], port, "{b:#}");
    assert_eq!(b["count"], 12, "{b:#}");
    assert_eq!(
        owners(b),
        vec![(Some(client as u64), PEER_COMM.to_string())],
        "{b:#}"
    );
    assert_eq!(b["processes"][0]["count"], 12, "{b:#}");
    assert!(
        b["oldest_age_secs"].as_f64().is_some_and(|a| a >= 3.0),
        "{b:#}"
    );
    assert_eq!(b["quota"], Value::Null, "{b:#}");
    assert!(
        b["growth"].is_i64(),
        "close_wait_buildup carries growth: {b:#}"
    );
    let summary = b["summary"].as_str().unwrap();
    assert!(
        summary.contains(&format!(
            "{PEER_COMM} pid {client} holds 12 CLOSE_WAIT sockets to {expected_peer}:{port} (service port {port})"
        )),
        "{summary}"
    );
    let socks = b["sockets"].as_array().unwrap();
    assert_eq!(socks.len(), 12, "{b:#}");
    for s in socks {
        assert_eq!(s["state"], "CLOSE_WAIT", "{s}");
        assert_eq!(s["peer"], format!("{expected_peer}:{port}"), "{s}");
        assert_eq!(s["pid"], client, "{s}");
        assert_eq!(s["comm"], PEER_COMM, "{s}");
        let local = s["local"].as_str().unwrap();
        assert!(locals.contains(local), "{local} is not one of {locals:?}");
        assert!(s["age_secs"].as_f64().is_some_and(|a| a >= 3.0), "{s}");
    }
}

/// The socket table over the API, with snapshot's filters: the client's 12 CLOSE_WAIT
/// sockets, each with its owner; a bad filter is a 400 that names it.
fn assert_socket_table(agent: &mut Agent, client: u32, locals: &BTreeSet<String>, target: &Target) {
    let path = format!("/v1/sockets?state=CLOSE_WAIT&pid={client}");
    let list = agent.get_ok(&path);
    assert_eq!(list["count"], 12, "GET {path}: {list:#}");
    let rows = list["sockets"].as_array().unwrap();
    assert_eq!(rows.len(), 12, "GET {path}: {list:#}");
    for s in rows {
        assert_eq!(
            (&s["state"], &s["pid"], &s["comm"], &s["service_port"]),
            (
                &Value::from("CLOSE_WAIT"),
                &Value::from(client),
                &Value::from(PEER_COMM),
                &Value::from(target.port)
            ),
            "{s}"
        );
        let local = s["local"].as_str().unwrap();
        assert!(locals.contains(local), "{local} is not one of {locals:?}");
    }
    let (code, bad) = agent.get("/v1/sockets?state=BOGUS");
    assert_eq!(code, 400, "{bad}");
    assert!(
        bad["error"].as_str().is_some_and(|e| e.contains("BOGUS")),
        "{bad}"
    );
    agent.assert_healthy();
}

/// No POST the receiver got names any of `pids`.
fn assert_blames_none_of(hook: &WebhookReceiver, pids: &[u32]) {
    assert!(
        hook.posts()
            .iter()
            .all(|p| pids.iter().all(|pid| !names_pid(&p.body, *pid))),
        "{}",
        describe(&hook.posts())
    );
}
