//! What API clients cannot do: push a policy past `max_per_round` by asking for rounds
//! (item 4), or take the daemon's file descriptors and scans away by holding connections open
//! (item 6).

use std::{
    io::{ErrorKind, Read, Write},
    net::TcpStream,
    os::unix::process::CommandExt,
    thread,
    time::{Duration, Instant},
};

use connreap_tests::{
    fixtures::run_in_netns,
    harness::{
        alive, audit::result_is, require_privileges, wait_until, Agent, Config, NetNs, TempDir,
        POLL, SCAN,
    },
};
use serde_json::{json, Value};

use super::{close_wait_to, pool, pool_policy, TOKEN};

const PORT: u16 = 7500;

#[test]
fn api_rounds_count_against_max_per_round_per_scan_interval() {
    let Some(_env) = require_privileges() else {
        return;
    };
    let ns = NetNs::new("sf-budget");
    let dir = TempDir::new("sf-budget");
    let (client, leaked) = pool(&ns, PORT, 6);
    let token = dir.write("token", &format!("{TOKEN}\n"));
    let interval = Duration::from_secs(6);
    let config = Config::new(&dir)
        .protect_ports(&[22])
        .scan_interval("6s")
        .token_file(&token)
        .policy(&pool_policy(
            "pool-leak",
            "enforce",
            PORT,
            "max_per_round = 1",
        ));
    let agent = Agent::start(&ns, &dir, &config);
    let killed = || result_is(&agent.audit(), "killed").len();

    // The first scheduled round (at start) kills one socket.
    wait_until(SCAN * 3, POLL, || (killed() == 1).then_some(()))
        .unwrap_or_else(|| panic!("the first round killed nothing:\n{}", agent.ctx()));
    let first = Instant::now();

    // Rounds asked for within the same interval may kill nothing more.
    for i in 0..4 {
        let (code, round) = agent.post_reclaim(
            Some(TOKEN),
            &json!({"policy": "pool-leak", "dry_run": false}),
        );
        assert_eq!(code, 200, "POST {i}: {round}");
        let decisions = round["decisions"].as_array().cloned().unwrap_or_default();
        assert!(
            result_is(&decisions, "killed").is_empty(),
            "POST /v1/reclaim {i} killed past max_per_round = 1 per interval: {round:#}"
        );
        assert!(
            round["note"]
                .as_str()
                .is_some_and(|n| n.contains("max_per_round")),
            "POST {i} does not say why it killed nothing: {round:#}"
        );
        thread::sleep(Duration::from_millis(200));
    }
    let asked = first.elapsed();
    assert!(
        asked < interval - Duration::from_secs(2),
        "the requests took {asked:?}: not within one interval"
    );
    assert_eq!(killed(), 1, "{}", agent.ctx());
    assert_eq!(
        close_wait_to(&ns, PORT, client.pid()).len(),
        leaked.len() - 1
    );

    // The next scheduled round, one interval later, kills the next one (and only one).
    wait_until(interval * 2, POLL, || (killed() >= 2).then_some(()))
        .unwrap_or_else(|| panic!("the next scheduled round killed nothing:\n{}", agent.ctx()));
    let gap = first.elapsed();
    assert!(
        gap >= interval - Duration::from_millis(1500),
        "second kill {gap:?} after the first, within one {interval:?} interval:\n{}",
        agent.ctx()
    );
    assert_eq!(killed(), 2, "{}", agent.ctx());
    assert_eq!(
        close_wait_to(&ns, PORT, client.pid()).len(),
        leaked.len() - 2
    );
    assert!(alive(client.pid()));
}

/// The daemon's open-files limit in the flood test: its own descriptors plus the API's 64
/// connections fit; the flood alone would not.
const NOFILE: u64 = 160;
/// Connections the API serves at once (`server::MAX_CONNECTIONS`).
const MAX_CONNECTIONS: usize = 64;
/// Connections opened beyond those: more than the whole open-files limit.
const FLOOD: usize = 240;
/// The API's header-read / idle deadline (`server::HEADER_TIMEOUT`).
const HEADER_TIMEOUT: Duration = Duration::from_secs(5);

/// Reads `s` until the peer closes it (EOF or reset) or `timeout` passes: whether it closed.
fn closed_within(s: &mut TcpStream, timeout: Duration) -> bool {
    let deadline = Instant::now() + timeout;
    let mut buf = [0u8; 1024];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return false;
        }
        s.set_read_timeout(Some(left)).expect("set_read_timeout");
        match s.read(&mut buf) {
            Ok(0) => return true,
            // An error response before the close: keep reading.
            Ok(_) => {}
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                return false
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(_) => return true,
        }
    }
}

/// `n` connections to the agent's API from inside `ns`.
fn connect_many(ns: &NetNs, agent: &Agent, n: usize) -> Vec<TcpStream> {
    let api = agent.api();
    run_in_netns(ns.name(), || {
        (0..n)
            .map(|_| TcpStream::connect_timeout(&api, Duration::from_secs(5)))
            .collect()
    })
    .unwrap_or_else(|e| panic!("connect to the API: {e}"))
}

/// Connections in `ns` whose local port is `port` and whose local end is still open: the
/// agent still serves them, so they hold a slot. From /proc/net/tcp: the local address's port
/// in hex; states 01 ESTABLISHED, 03 SYN_RECV, 08 CLOSE_WAIT (a TIME_WAIT or FIN_WAIT end was
/// closed by the agent: its slot is free).
fn api_connections(ns: &NetNs, port: u16) -> usize {
    let tcp = run_in_netns(ns.name(), || {
        std::fs::read_to_string("/proc/thread-self/net/tcp")
    })
    .unwrap_or_else(|e| panic!("/proc/net/tcp in {}: {e}", ns.name()));
    let local = format!(":{port:04X}");
    tcp.lines()
        .skip(1)
        .filter(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            f.len() > 3 && f[1].ends_with(&local) && ["01", "03", "08"].contains(&f[3])
        })
        .count()
}

fn open_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count())
        .unwrap_or_else(|e| panic!("/proc/{pid}/fd: {e}"))
}

#[test]
fn api_connection_flood_is_capped_and_timed_out_while_scans_go_on() {
    let Some(_env) = require_privileges() else {
        return;
    };
    let ns = NetNs::new("sf-flood");
    let dir = TempDir::new("sf-flood");
    let config = Config::new(&dir).protect_ports(&[22]);
    let mut agent = Agent::start_with(&ns, &dir, &config, |cmd| {
        // SAFETY: setrlimit is async-signal-safe; it only lowers this child's own limits.
        unsafe {
            cmd.pre_exec(|| {
                let lim = libc::rlimit {
                    rlim_cur: NOFILE,
                    rlim_max: NOFILE,
                };
                if libc::setrlimit(libc::RLIMIT_NOFILE, &lim) == 0 {
                    Ok(())
                } else {
                    Err(std::io::Error::last_os_error())
                }
            });
        }
    });
    let own = open_fds(agent.pid());
    println!("the agent has {own} descriptors open, NOFILE {NOFILE}");
    assert!(
        own + MAX_CONNECTIONS + 16 < NOFILE as usize && own + FLOOD > NOFILE as usize,
        "the agent has {own} descriptors open: NOFILE {NOFILE} no longer tells capped from not"
    );
    let scans = agent.scans();
    // The harness's own requests (/healthz, /metrics) hold a slot until the agent has seen them
    // closed: wait until no connection to the API is left, or one of the held ones below could
    // be refused and its slot go to the flood once that request's slot frees.
    let port = agent.api().port();
    wait_until(Duration::from_secs(10), POLL, || {
        (api_connections(&ns, port) == 0).then_some(())
    })
    .unwrap_or_else(|| {
        panic!(
            "{} connections to the API left after the harness's requests",
            api_connections(&ns, port)
        )
    });
    let t0 = Instant::now();

    // Every slot taken: a third of them with a request line and no end of headers.
    let mut held = connect_many(&ns, &agent, MAX_CONNECTIONS);
    for s in held.iter_mut().step_by(3) {
        s.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
            .expect("partial request");
    }
    let opened = Instant::now();
    thread::sleep(Duration::from_millis(500));
    // Connections beyond them are closed at once ...
    let mut flood = connect_many(&ns, &agent, FLOOD);
    let flooded = Instant::now();
    let kept: Vec<usize> = flood
        .iter_mut()
        .enumerate()
        .filter_map(|(i, s)| (!closed_within(s, Duration::from_secs(2))).then_some(i))
        .collect();
    assert!(
        kept.is_empty(),
        "connections beyond {MAX_CONNECTIONS} kept open: {} of {FLOOD} (indices {kept:?}), \
         checked over {:?}",
        kept.len(),
        flooded.elapsed()
    );
    drop(flood);
    // ... while the held ones are not (yet).
    let early: Vec<usize> = held
        .iter_mut()
        .enumerate()
        .filter_map(|(i, s)| closed_within(s, Duration::from_millis(10)).then_some(i))
        .collect();
    assert!(
        opened.elapsed() < HEADER_TIMEOUT - Duration::from_secs(1) && early.is_empty(),
        "held connections closed early ({:?} after opening): {early:?}",
        opened.elapsed()
    );
    // Idle and partial connections are closed at the header deadline.
    let deadline = opened + HEADER_TIMEOUT + Duration::from_secs(3);
    let open: Vec<usize> = held
        .iter_mut()
        .enumerate()
        .filter_map(|(i, s)| {
            let left = deadline.saturating_duration_since(Instant::now());
            (!closed_within(s, left)).then_some(i)
        })
        .collect();
    assert!(
        open.is_empty(),
        "still open {:?} after opening (partial ones: every third): {open:?}",
        opened.elapsed()
    );

    // The agent answers again, kept scanning all along and never ran out of descriptors.
    agent.assert_healthy();
    let done = agent.scans() - scans;
    let elapsed = t0.elapsed().as_secs();
    assert!(
        done + 3 >= elapsed,
        "{done} scans in {elapsed} s: scanning stalled during the flood:\n{}",
        agent.ctx()
    );
    assert_eq!(
        agent.metric("connreap_scan_errors_total"),
        Some(0.0),
        "{}",
        agent.ctx()
    );
    let stderr = agent.stderr();
    assert!(
        !stderr.contains("Too many open files") && !stderr.contains("scan failed"),
        "{stderr}"
    );
    let health: Value = agent.get_ok("/healthz");
    assert!(health["last_scan_error"].is_null(), "{health}");
}
