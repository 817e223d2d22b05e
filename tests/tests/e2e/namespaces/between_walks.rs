//! Between two walks of a namespace (`agent.netns_walk_interval`), the daemon reads its full
//! sockets, held or not, from the sweep over the state tracker's table, and carries what only
//! a walk sees (timewait sockets) from the last walk. Here the walk interval is 1h: after the
//! first scan walked the pod's namespace, no scan walks it again, yet a leak made afterwards is
//! seen and alerted on (read fresh), connections waiting in an accept queue show (no process
//! holds them), and the clients' orphaned FIN-WAIT-2 sockets of the leak made before (timewait
//! sockets) stay in the table with ages that keep growing (carried).

use std::time::Duration;

use connreap_tests::{
    fixtures::{http::connect, netns::maybe_in_netns},
    harness::{require_privileges, wait_until, Agent, TempDir, POLL},
};
use serde_json::Value;

use super::{host_config, host_receiver, wait_close_wait_alert, Pod, LEAKED, PORT};

/// Rows of `GET /v1/sockets?netns=NAME&state=STATE` on [`PORT`] (either end).
fn rows(agent: &Agent, pod: &Pod, state: &str) -> Vec<Value> {
    rows_on(agent, pod, state, PORT, &["local", "peer"])
}

/// Rows of `GET /v1/sockets?netns=NAME&state=STATE` whose address at one of `ends` ("local",
/// "peer") has port `port`.
fn rows_on(agent: &Agent, pod: &Pod, state: &str, port: u16, ends: &[&str]) -> Vec<Value> {
    let (code, body) = agent.get(&format!("/v1/sockets?netns={}&state={state}", pod.name()));
    assert_eq!(code, 200, "GET /v1/sockets: {body}");
    let suffix = format!(":{port}");
    body["sockets"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .into_iter()
        .filter(|s| {
            ends.iter()
                .any(|k| s[k].as_str().is_some_and(|a| a.ends_with(&suffix)))
        })
        .collect()
}

/// The agent's scans so far, and how many walked a namespace other than its own (the scan's
/// debug line: `others_walked`, with `RUST_LOG` from [`SCAN_LOG`]).
fn scans(agent: &Agent) -> (usize, usize) {
    let err = agent.stderr();
    let lines: Vec<&str> = err
        .lines()
        .filter(|l| l.contains(" others_walked="))
        .collect();
    let walking = lines
        .iter()
        .filter(|l| !l.contains(" others_walked=0 "))
        .count();
    (lines.len(), walking)
}

const SCAN_LOG: &str = "connreap=info,connreap::scan=debug";

/// Panics unless a scan ran since `mark` (a [`scans`] result) and none of them walked a
/// namespace other than the agent's own.
fn no_walk_since(agent: &Agent, mark: (usize, usize), what: &str) {
    let now = scans(agent);
    assert!(now.0 > mark.0, "{what}: no scan since\n{}", agent.ctx());
    assert_eq!(
        now.1,
        mark.1,
        "{what}: a scan walked the pod's namespace\n{}",
        agent.stderr()
    );
}

#[test]
fn sockets_between_walks_are_read_fresh_or_carried() {
    let Some(_env) = require_privileges() else {
        return;
    };
    let pod = Pod::bare("walks");
    // Before the daemon starts: LEAKED CLOSE_WAIT held by the server, and the clients' ends,
    // closed, as orphaned FIN-WAIT-2 sockets no process holds.
    pod.leak(LEAKED);
    let dir = TempDir::new("ns-walks");
    let hook = host_receiver();
    let config = host_config(&dir, &hook).netns_walk_interval("1h");
    let agent = Agent::start_in_host_with(&dir, &config, |cmd| {
        cmd.env("RUST_LOG", SCAN_LOG);
    });
    agent.wait_scans(3);
    // No namespace but the daemon's own is walked now: the pod's was walked once, when new.
    let mark = scans(&agent);
    agent.wait_scans(1);
    no_walk_since(
        &agent,
        mark,
        "with netns_walk_interval = 1h only connreap's own namespace may be walked after the first scan",
    );
    let orphans = rows(&agent, &pod, "FIN_WAIT2");
    assert_eq!(
        orphans.len(),
        LEAKED,
        "the clients' FIN-WAIT-2 ends (no process holds them) are carried from the walk: {orphans:#?}"
    );
    assert!(
        orphans.iter().all(|s| s["pid"].is_null()),
        "orphans have no owner: {orphans:#?}"
    );
    let age = |rows: &[Value]| {
        rows.iter()
            .filter_map(|s| s["age_secs"].as_f64())
            .fold(0.0, f64::max)
    };
    let first = age(&orphans);

    // A leak made after the walk: only the sweep can see it.
    pod.leak(LEAKED);
    let held = wait_until(Duration::from_secs(20), POLL, || {
        let r = rows(&agent, &pod, "CLOSE_WAIT");
        (r.len() == 2 * LEAKED).then_some(r)
    })
    .unwrap_or_else(|| {
        panic!(
            "{}: the {} CLOSE_WAIT made after the namespace's walk never all showed: {:#?}\n{}",
            pod.describe(),
            2 * LEAKED,
            rows(&agent, &pod, "CLOSE_WAIT"),
            agent.ctx()
        )
    });
    assert!(
        held.iter()
            .all(|s| s["pid"].as_u64() == Some(u64::from(pod.pid()))),
        "every CLOSE_WAIT is the server's, pid {}: {held:#?}",
        pod.pid()
    );
    wait_close_wait_alert(&hook, &agent, &pod, "firing");
    // Once the second leak's sockets are old enough, the finding counts both leaks.
    wait_until(Duration::from_secs(20), POLL, || {
        agent.find("close_wait_buildup", |f| {
            f["count"].as_u64() == Some(2 * LEAKED as u64)
        })
    })
    .unwrap_or_else(|| {
        panic!(
            "no close_wait_buildup finding counting {} sockets: {:#?}\n{}",
            2 * LEAKED,
            agent.findings(),
            agent.ctx()
        )
    });
    no_walk_since(&agent, mark, "after the second leak");

    // Carried rows age: a later scan shows them older by about the time passed.
    std::thread::sleep(Duration::from_secs(2));
    agent.wait_scans(1);
    let later = rows(&agent, &pod, "FIN_WAIT2");
    assert_eq!(later.len(), LEAKED, "{later:#?}");
    assert!(
        age(&later) >= first + 1.5,
        "carried FIN-WAIT-2 ages must advance between scans: {first} then {}",
        age(&later)
    );
}

/// Connections made after the namespace's only walk to a listener that never accepts them:
/// their server ends are full sockets no process holds (no file until accepted), which only a
/// walk could read before; the sweep over the state table reads them on every scan, fresh.
/// The form this kernel gets by default: plain loads through `bpf_rdonly_cast` (6.2+).
#[test]
fn unheld_sockets_made_after_the_walk_are_read_by_the_sweep() {
    unheld_sockets_read_by(None, "connreap_sweep_direct");
}

/// The same with the `bpf_loop` form and a helper call per field (5.17-6.1), forced here.
#[test]
fn unheld_sockets_made_after_the_walk_are_read_by_the_loop_sweep() {
    unheld_sockets_read_by(Some("loop"), "connreap_sweep_loop");
}

/// The same with the sweep's form for kernels without `bpf_loop` (5.12-5.16), forced here.
#[test]
fn unheld_sockets_made_after_the_walk_are_read_by_the_unrolled_sweep() {
    unheld_sockets_read_by(Some("unrolled"), "connreap_sweep");
}

/// `form`: `CONNREAP_SWEEP_FORM`; `program`: the sweep program the agent must say it loaded.
fn unheld_sockets_read_by(form: Option<&str>, program: &str) {
    let Some(_env) = require_privileges() else {
        return;
    };
    const BACKLOG_PORT: u16 = 8181;
    const QUEUED: usize = 5;
    let pod = Pod::bare("sweep");
    let dir = TempDir::new("ns-sweep");
    let hook = host_receiver();
    let config = host_config(&dir, &hook).netns_walk_interval("1h");
    // A pin root of its own: the sweep program is loaded (and its form logged) by this agent.
    let pins = PinRoot::new(&format!("/sys/fs/bpf/connreap-test-sweep-{program}"));
    let agent = Agent::start_in_host_with(&dir, &config, |cmd| {
        cmd.env("RUST_LOG", SCAN_LOG);
        cmd.env("CONNREAP_PIN_ROOT", &pins.0);
        if let Some(f) = form {
            cmd.env("CONNREAP_SWEEP_FORM", f);
        }
    });
    agent.wait_scans(3);
    let loaded = format!("program={program} ");
    assert!(
        agent
            .stderr()
            .lines()
            .any(|l| l.contains("sweep over the state table loaded") && l.contains(&loaded)),
        "the agent never said it loaded {program}:\n{}",
        agent.stderr()
    );
    let mark = scans(&agent);

    let addr: std::net::SocketAddr = format!("127.0.0.1:{BACKLOG_PORT}").parse().unwrap();
    let listener = maybe_in_netns(Some(pod.name()), || std::net::TcpListener::bind(addr))
        .unwrap_or_else(|e| panic!("listen in {}: {e}", pod.name()));
    let clients: Vec<std::net::TcpStream> = (0..QUEUED)
        .map(|_| {
            connect(Some(pod.name()), addr, Duration::from_secs(5))
                .unwrap_or_else(|e| panic!("connect in {}: {e}", pod.name()))
        })
        .collect();
    // The server ends wait in the accept queue: ESTABLISHED, local port BACKLOG_PORT, no owner.
    let queued = |agent: &Agent| rows_on(agent, &pod, "ESTABLISHED", BACKLOG_PORT, &["local"]);
    let rows = wait_until(Duration::from_secs(20), POLL, || {
        let r = queued(&agent);
        (r.len() == QUEUED).then_some(r)
    })
    .unwrap_or_else(|| {
        panic!(
            "the {QUEUED} connections waiting in {}'s accept queue never all showed between walks: {:#?}\n{}",
            pod.describe(),
            queued(&agent),
            agent.ctx()
        )
    });
    assert!(
        rows.iter().all(|s| s["pid"].is_null()),
        "not yet accepted: no process holds them: {rows:#?}"
    );
    no_walk_since(&agent, mark, "while connections wait in the accept queue");
    // Gone from the table the scan after they close (no carried copy outlives them).
    drop(clients);
    drop(listener);
    wait_until(Duration::from_secs(20), POLL, || {
        queued(&agent).is_empty().then_some(())
    })
    .unwrap_or_else(|| {
        panic!(
            "closed connections still listed: {:#?}\n{}",
            queued(&agent),
            agent.ctx()
        )
    });
}

/// A pin root of a test's own, removed (its tracker detached) before and after.
struct PinRoot(String);

impl PinRoot {
    fn new(path: &str) -> PinRoot {
        let _ = std::fs::remove_dir_all(path);
        PinRoot(path.to_string())
    }
}

impl Drop for PinRoot {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
