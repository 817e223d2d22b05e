//! A live stream through the saturated relay is never selected (it is not idle), while the
//! idle leaks around it are killed and it keeps flowing.

use std::{
    io::{ErrorKind, Read, Write},
    net::{SocketAddr, TcpStream},
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc, Mutex,
    },
    thread,
    time::{Duration, Instant},
};

use connreap_tests::{
    fixtures::http::connect,
    harness::{
        addr,
        audit::{naming, result_is},
        relay_policy, require_privileges, snapshot, sockets, wait_until, Agent, Chain, Config,
        NetNs, TempDir, DIAL, HTTP, MAX_STREAMS, POLL, PROXY, SCAN,
    },
};
use serde_json::Value;

use super::{assert_relay_decision, start_agent};

#[test]
fn a_busy_stream_is_never_selected_while_idle_leaks_are_killed() {
    let Some(_env) = require_privileges() else {
        return;
    };
    let ns = NetNs::new("rc-busy");
    let dir = TempDir::new("busy");
    let chain = Chain::start(&ns);
    let config = Config::reclaiming(&dir).policy(&relay_policy("enforce", "10s"));
    let agent = start_agent(&ns, &dir, &config);

    // A user watching a live stream through the chain: a tick every second, read as it comes.
    let ticks = TicksClient::open(ns.name(), addr(PROXY));
    assert!(
        wait_until(Duration::from_secs(5), POLL, || (ticks.count() >= 2)
            .then_some(()))
        .is_some(),
        "no ticks through the chain: ended {:?}",
        ticks.ended()
    );
    let busy = chain.proxy_upstreams("ESTAB");
    assert_eq!(busy.len(), 1, "one upstream for the live stream: {busy:#?}");
    let busy = busy[0].local;

    // 63 users give up on quiet pages: 64/64, the live stream being the oldest of them.
    chain.leak(MAX_STREAMS as usize - 1, Duration::from_millis(500));
    assert_eq!(chain.streams(), MAX_STREAMS, "{}", chain.status());

    let killed = idle_leaks_killed(&chain, &agent, &ticks);
    for d in &killed {
        assert_relay_decision(d, &chain, &agent, "enforce", 10.0);
    }
    // Nothing ever named the live stream's socket, whatever the result.
    let lines = agent.audit();
    let named = naming(&lines, &busy);
    assert!(
        named.is_empty(),
        "the busy stream {busy} was selected: {named:#?}"
    );
    assert!(
        ticks.ended().is_none(),
        "live stream ended: {:?}",
        ticks.ended()
    );
    let gap = ticks.longest_gap();
    assert!(
        gap < Duration::from_millis(2500),
        "the live stream stalled for {gap:?} (ticks every second)"
    );
    assert!(
        chain
            .proxy_upstreams("ESTAB")
            .iter()
            .any(|x| x.local == busy),
        "busy upstream {busy} gone"
    );
    assert_oldest_but_not_idle(&ns, &chain, busy);
}

/// Idle leaks get killed once idle 10s (quota saturated all along), slots free up, and the
/// live stream keeps flowing after the kills. Returns the killed decisions.
fn idle_leaks_killed(chain: &Chain, agent: &Agent, ticks: &TicksClient) -> Vec<Value> {
    let killed = wait_until(Duration::from_secs(10) + SCAN * 8, POLL, || {
        let k: Vec<Value> = result_is(&agent.audit(), "killed")
            .into_iter()
            .cloned()
            .collect();
        (!k.is_empty()).then_some(k)
    })
    .unwrap_or_else(|| {
        panic!(
            "no idle leak killed while saturated: {}\n{}",
            chain.status(),
            agent.ctx()
        )
    });
    assert!(
        wait_until(SCAN * 5, POLL, || (chain.streams() < MAX_STREAMS)
            .then_some(()))
        .is_some(),
        "{}",
        chain.status()
    );
    let seen = ticks.count();
    assert!(
        wait_until(Duration::from_secs(5), POLL, || (ticks.count() >= seen + 2)
            .then_some(()))
        .is_some(),
        "the live stream stopped: ended {:?}\n{}",
        ticks.ended(),
        agent.ctx()
    );
    killed
}

/// It was the oldest candidate: only min_idle kept it out of an oldest-first round.
fn assert_oldest_but_not_idle(ns: &NetNs, chain: &Chain, busy: SocketAddr) {
    let snap = snapshot(ns, &["--pid", &chain.proxy_pid().to_string()]);
    let ups: Vec<_> = sockets(&snap)
        .into_iter()
        .filter(|x| x.state == "ESTABLISHED" && x.peer == DIAL)
        .collect();
    let me = ups
        .iter()
        .find(|x| x.local == busy.to_string())
        .unwrap_or_else(|| panic!("busy upstream not in snapshot:\n{snap:#}"));
    assert!(
        ups.iter().all(|x| x.age_secs <= me.age_secs),
        "the busy stream is not the oldest upstream:\n{snap:#}"
    );
    assert!(
        me.idle_secs.is_some_and(|i| i < 2.0),
        "busy upstream looks idle: {me:?}"
    );
}

/// A client that reads an SSE stream and records when each `data: tick N` event arrived.
struct TicksClient {
    ticks: Arc<Mutex<Vec<Instant>>>,
    ended: Arc<Mutex<Option<String>>>,
    stop: Arc<AtomicBool>,
    reader: Option<thread::JoinHandle<()>>,
    _stream: TcpStream,
}

impl TicksClient {
    fn open(ns: &str, to: SocketAddr) -> TicksClient {
        let stream = connect(Some(ns), to, HTTP).expect("connect for /ticks");
        (&stream)
            .write_all(
                b"GET /ticks HTTP/1.1\r\nHost: instance\r\nAccept: text/event-stream\r\n\r\n",
            )
            .unwrap();
        stream
            .set_read_timeout(Some(Duration::from_millis(200)))
            .unwrap();
        let ticks = Arc::new(Mutex::new(Vec::new()));
        let ended = Arc::new(Mutex::new(None));
        let stop = Arc::new(AtomicBool::new(false));
        let r = stream.try_clone().unwrap();
        let (t, e, st) = (ticks.clone(), ended.clone(), stop.clone());
        let reader = thread::spawn(move || read_ticks(r, &t, &e, &st));
        TicksClient {
            ticks,
            ended,
            stop,
            reader: Some(reader),
            _stream: stream,
        }
    }

    fn count(&self) -> usize {
        self.ticks.lock().unwrap().len()
    }

    fn ended(&self) -> Option<String> {
        self.ended.lock().unwrap().clone()
    }

    /// The longest wait between two ticks, and since the last one.
    fn longest_gap(&self) -> Duration {
        let v = self.ticks.lock().unwrap();
        let mut gap = v.last().map(|l| l.elapsed()).unwrap_or(Duration::MAX);
        for w in v.windows(2) {
            gap = gap.max(w[1] - w[0]);
        }
        gap
    }
}

/// Reads `r` until `stop`, EOF or an error (recorded in `ended`), stamping each tick's arrival.
fn read_ticks(
    mut r: TcpStream,
    ticks: &Mutex<Vec<Instant>>,
    ended: &Mutex<Option<String>>,
    stop: &AtomicBool,
) {
    let mut text = String::new();
    let mut seen = 0;
    let mut buf = [0u8; 4096];
    while !stop.load(Ordering::SeqCst) {
        match r.read(&mut buf) {
            Ok(0) => {
                *ended.lock().unwrap() = Some("EOF".into());
                return;
            }
            Ok(n) => {
                text.push_str(&String::from_utf8_lossy(&buf[..n]));
                let now = text.matches("data: tick ").count();
                let mut v = ticks.lock().unwrap();
                for _ in seen..now {
                    v.push(Instant::now());
                }
                seen = now;
            }
            Err(err) if matches!(err.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
            Err(err) => {
                *ended.lock().unwrap() = Some(err.to_string());
                return;
            }
        }
    }
}

impl Drop for TicksClient {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(r) = self.reader.take() {
            let _ = r.join();
        }
    }
}
