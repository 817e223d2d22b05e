//! Reclaim under policy, end to end: the agent (`connreap run`) runs inside a fresh network
//! namespace per test next to real leaking processes (incident 1's leaky-proxy -> relay-sim ->
//! instance-sim chain, `connreap-testpeer` pools), and its decisions are checked where they have
//! effects: the relay's `/status`, a real request through the chain (status AND body), `ss`,
//! the audit log, the API, the webhook receiver and the processes that held the sockets.
use std::{
    collections::{BTreeMap, BTreeSet, HashSet},
    fs,
    io::{ErrorKind, Read, Write},
    net::{SocketAddr, TcpStream},
    path::{Path, PathBuf},
    sync::{
        atomic::{AtomicBool, AtomicUsize, Ordering},
        Arc, Mutex,
    },
    thread,
    time::{Duration, Instant},
};

use connreap_tests::{
    connreap_bin,
    fixtures::{
        abandon_requests_in_netns, get_json_in_netns, http::connect, http_get_in_netns,
        http_request_ns, relay_status_json, ss_tcp, EndpointStatus, QuotaMode, QuotaServer,
        ReadyChild, SsSocket, WebhookReceiver,
    },
    require_privileges, run, snapshot, sockets, wait_until, Child, NetNs, Ready, CONNREAP_TIMEOUT,
};
use serde_json::{json, Value};

const TESTPEER: &str = env!("CARGO_BIN_EXE_connreap-testpeer");
const INSTANCE_SIM: &str = env!("CARGO_BIN_EXE_instance-sim");
const RELAY_SIM: &str = env!("CARGO_BIN_EXE_relay-sim");
const LEAKY_PROXY: &str = env!("CARGO_BIN_EXE_leaky-proxy");
/// The kernel keeps 15 characters of the executable name.
const PEER_COMM: &str = "connreap-testpe";

const API: &str = "127.0.0.1:9477";
const INSTANCE: &str = "127.0.0.1:21000";
const DIAL: &str = "127.0.0.1:25001";
const RELAY_STATUS: &str = "127.0.0.1:20080";
const PROXY: &str = "127.0.0.1:8080";
const MAX_STREAMS: u64 = 64;

const SCAN: Duration = Duration::from_secs(1);
const READY: Duration = Duration::from_secs(10);
const POLL: Duration = Duration::from_millis(100);
const HTTP: Duration = Duration::from_secs(5);
const AGENT_START: Duration = Duration::from_secs(30);
const TOKEN: &str = "s3cret-reclaim-token-0123456789";

fn addr(a: &str) -> SocketAddr {
    a.parse().expect("socket address")
}

// ---------------------------------------------------------------------------------------------
// Temp dir, config, agent

/// A directory under the system temp dir, removed on drop unless the test is failing (then
/// its path is printed so the audit log and config can be inspected).
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> TempDir {
        static N: AtomicUsize = AtomicUsize::new(0);
        let p = std::env::temp_dir().join(format!(
            "connreap-reclaim-{tag}-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = fs::remove_dir_all(&p);
        fs::create_dir_all(&p).unwrap_or_else(|e| panic!("mkdir {}: {e}", p.display()));
        TempDir(p)
    }
    fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        if thread::panicking() {
            eprintln!("kept {} for inspection", self.0.display());
        } else {
            let _ = fs::remove_dir_all(&self.0);
        }
    }
}

/// An agent configuration: scan every second, the relay quota of incident 1, `extra` appended
/// (webhooks, policies).
fn config(audit: &Path, protect: &[u16], token_file: Option<&Path>, extra: &str) -> String {
    let protect: Vec<String> = protect.iter().map(u16::to_string).collect();
    let token = token_file
        .map(|p| p.display().to_string())
        .unwrap_or_default();
    format!(
        r#"[agent]
listen = "{API}"
scan_interval = "1s"

[api]
token_file = "{token}"

[reclaim]
protect_ports = [{protect}]
audit_log = "{audit}"

[[quota]]
name = "relay"
url = "http://{RELAY_STATUS}/status"
items = "/endpoints"
port_field = "port"
used_field = "streams"
limit_field = "maxStreams"
poll_interval = "1s"

{extra}
"#,
        protect = protect.join(", "),
        audit = audit.display(),
    )
}

fn alive(pid: u32) -> bool {
    // A child that died but was not reaped yet is a zombie: state `Z` after the `(comm)` field.
    fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            s.rsplit_once(')')
                .map(|(_, rest)| !rest.trim_start().starts_with('Z'))
        })
        .unwrap_or(false)
}

/// `connreap run --config FILE` inside a namespace, healthy (first scan done) when returned.
struct Agent {
    child: Child,
    ns: String,
    audit: PathBuf,
}

impl Agent {
    fn start(ns: &NetNs, config_path: &Path, audit: &Path, text: &str) -> Agent {
        fs::write(config_path, text)
            .unwrap_or_else(|e| panic!("write {}: {e}", config_path.display()));
        let mut cmd = ns.connreap(["run", "--config"]);
        cmd.arg(config_path);
        let child = Child::spawn(&mut cmd, "connreap run");
        let agent = Agent {
            child,
            ns: ns.name().to_string(),
            audit: audit.to_path_buf(),
        };
        let healthy = wait_until(AGENT_START, POLL, || {
            assert!(
                alive(agent.pid()),
                "connreap run exited during startup; stderr:\n{}",
                agent.child.stderr()
            );
            agent
                .get("/healthz")
                .ok()
                .filter(|(code, _)| *code == 200)
                .map(|(_, body)| body)
        })
        .unwrap_or_else(|| {
            panic!(
                "agent not healthy after {AGENT_START:?}; stderr:\n{}",
                agent.child.stderr()
            )
        });
        let mechanism = if text.contains(BPF_ITER) {
            "bpf-sock-destroy"
        } else {
            "netlink-sock-destroy"
        };
        assert_eq!(healthy["reclaim_mechanism"], json!(mechanism), "{healthy}");
        agent
    }

    fn pid(&self) -> u32 {
        self.child.pid()
    }

    /// Completed scans, from /healthz.
    fn scans(&self) -> u64 {
        let (_, h) = self
            .get("/healthz")
            .unwrap_or_else(|e| panic!("GET /healthz: {e}"));
        h["scans"]
            .as_u64()
            .unwrap_or_else(|| panic!("/healthz without scans: {h}"))
    }

    /// Wait until the agent has completed `n` more scans (and reclaim rounds).
    fn wait_scans(&self, n: u64) {
        let target = self.scans() + n;
        wait_until(SCAN * (n as u32 + 5), POLL, || {
            (self.scans() >= target).then_some(())
        })
        .unwrap_or_else(|| panic!("the agent stopped scanning:\n{}", self.ctx()));
    }

    fn get(&self, path: &str) -> std::io::Result<(u16, Value)> {
        get_json_in_netns(&self.ns, addr(API), path, HTTP)
    }

    fn post_reclaim(&self, token: Option<&str>, body: &Value) -> (u16, Value) {
        let auth = token.map(|t| format!("Bearer {t}"));
        let mut headers = vec![("Content-Type", "application/json")];
        if let Some(a) = &auth {
            headers.push(("Authorization", a.as_str()));
        }
        let r = http_request_ns(
            Some(&self.ns),
            addr(API),
            "POST",
            "/v1/reclaim",
            &headers,
            body.to_string().as_bytes(),
            Duration::from_secs(15),
        )
        .unwrap_or_else(|e| panic!("POST /v1/reclaim: {e}"));
        let v = r.json().unwrap_or(Value::Null);
        (r.status, v)
    }

    fn metrics(&self) -> String {
        let (code, body) = http_get_in_netns(&self.ns, addr(API), "/metrics", HTTP)
            .unwrap_or_else(|e| panic!("GET /metrics: {e}"));
        assert_eq!(code, 200, "{body}");
        body
    }

    fn audit(&self) -> Vec<Value> {
        read_audit(&self.audit)
    }

    /// Audit log text and agent stderr, for failure messages.
    fn ctx(&self) -> String {
        let audit = fs::read_to_string(&self.audit).unwrap_or_default();
        let tail: Vec<&str> = audit.lines().rev().take(60).collect();
        let tail: Vec<&str> = tail.into_iter().rev().collect();
        let err = self.child.stderr();
        let err_tail: Vec<&str> = err.lines().rev().take(40).collect();
        let err_tail: Vec<&str> = err_tail.into_iter().rev().collect();
        format!(
            "--- audit log {} (last 60 lines):\n{}\n--- agent stderr (last 40 lines):\n{}",
            self.audit.display(),
            tail.join("\n"),
            err_tail.join("\n")
        )
    }
}

/// Every line of the audit log, parsed. A line that is not a JSON object fails the test.
fn read_audit(path: &Path) -> Vec<Value> {
    let text = match fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == ErrorKind::NotFound => return Vec::new(),
        Err(e) => panic!("read {}: {e}", path.display()),
    };
    assert!(
        text.is_empty() || text.ends_with('\n'),
        "audit log does not end with a newline:\n{text}"
    );
    text.lines()
        .enumerate()
        .map(|(i, l)| {
            let v: Value = serde_json::from_str(l)
                .unwrap_or_else(|e| panic!("audit line {} is not JSON ({e}): {l:?}", i + 1));
            assert!(v.is_object(), "audit line {} is not an object: {l}", i + 1);
            v
        })
        .collect()
}

fn result_is<'a>(lines: &'a [Value], result: &str) -> Vec<&'a Value> {
    lines.iter().filter(|d| d["result"] == result).collect()
}

fn s<'a>(d: &'a Value, key: &str) -> &'a str {
    d[key]
        .as_str()
        .unwrap_or_else(|| panic!("decision without string `{key}`: {d}"))
}

fn u(d: &Value, key: &str) -> u64 {
    d[key]
        .as_u64()
        .unwrap_or_else(|| panic!("decision without integer `{key}`: {d}"))
}

/// Decisions of `result` grouped by round (agent_pid, round).
fn per_round(lines: &[Value], result: &str) -> BTreeMap<(u64, u64), usize> {
    let mut m = BTreeMap::new();
    for d in result_is(lines, result) {
        *m.entry((u(d, "agent_pid"), u(d, "round"))).or_default() += 1;
    }
    m
}

/// Every documented audit field is present with the right type.
fn assert_decision_shape(d: &Value) {
    for k in [
        "time", "policy", "mode", "result", "local", "peer", "comm", "state",
    ] {
        assert!(d[k].is_string(), "`{k}` missing or not a string: {d}");
    }
    // The cookie may be unknown (null) until the kernel generated one; a kill goes by it.
    assert!(
        d["cookie"].is_string() || d["cookie"].is_null(),
        "`cookie` missing: {d}"
    );
    if d["result"] == "killed" {
        let c = d["cookie"].as_str().unwrap_or("");
        let v = c
            .strip_prefix("0x")
            .and_then(|h| u64::from_str_radix(h, 16).ok());
        assert!(
            v.is_some_and(|v| v != 0),
            "a kill must record the cookie it went by: {d}"
        );
    }
    for k in ["inode", "agent_pid", "round"] {
        assert!(d[k].is_u64(), "`{k}` missing or not an integer: {d}");
    }
    assert!(d["age_secs"].is_number(), "age_secs: {d}");
    for k in ["pid", "unit", "idle_secs", "quota"] {
        assert!(d.get(k).is_some(), "`{k}` missing: {d}");
    }
    assert!(
        ["would-kill", "killed", "skipped", "failed"].contains(&s(d, "result")),
        "{d}"
    );
}

// ---------------------------------------------------------------------------------------------
// Incident 1: the relay chain

/// instance-sim <- relay-sim (64 streams per port) <- leaky-proxy, on their production ports.
struct Chain {
    ns: String,
    _instance: ReadyChild,
    _relay: ReadyChild,
    proxy: ReadyChild,
}

impl Chain {
    fn start(ns: &NetNs) -> Chain {
        let n = ns.name();
        let instance =
            ReadyChild::spawn_in_netns(n, INSTANCE_SIM, ["--listen", INSTANCE], READY).unwrap();
        let relay = ReadyChild::spawn_in_netns(
            n,
            RELAY_SIM,
            [
                "--dial",
                &format!("{DIAL}={INSTANCE}"),
                "--status",
                RELAY_STATUS,
                "--max-streams",
                &MAX_STREAMS.to_string(),
            ],
            READY,
        )
        .unwrap();
        let proxy = ReadyChild::spawn_in_netns(
            n,
            LEAKY_PROXY,
            ["--listen", PROXY, "--upstream", DIAL],
            READY,
        )
        .unwrap();
        let chain = Chain {
            ns: n.to_string(),
            _instance: instance,
            _relay: relay,
            proxy,
        };
        let (code, body) = chain.get_json();
        assert_eq!(code, 200, "fresh chain must serve /json: {body:?}");
        chain
    }

    fn status(&self) -> Value {
        let (code, v) = get_json_in_netns(&self.ns, addr(RELAY_STATUS), "/status", HTTP)
            .unwrap_or_else(|e| panic!("relay /status: {e}"));
        assert_eq!(code, 200, "{v}");
        v
    }

    fn streams(&self) -> u64 {
        let st = self.status();
        st["endpoints"][0]["streams"]
            .as_u64()
            .unwrap_or_else(|| panic!("relay /status without endpoints[0].streams: {st}"))
    }

    /// A real request through proxy -> relay -> instance: (status, body).
    fn get_json(&self) -> (u16, String) {
        http_get_in_netns(&self.ns, addr(PROXY), "/json", HTTP)
            .unwrap_or_else(|e| panic!("GET /json through the proxy: {e}"))
    }

    fn assert_json_ok(&self) {
        let (code, body) = self.get_json();
        assert_eq!(code, 200, "GET /json through the chain: {body:?}");
        assert!(!body.is_empty(), "200 without a body");
        let v: Value = serde_json::from_str(&body)
            .unwrap_or_else(|e| panic!("GET /json body is not JSON ({e}): {body:?}"));
        assert_eq!(v["ok"], json!(true), "{body}");
    }

    /// The proxy's upstream sockets (leaky-proxy -> relay dial slot) that `ss` sees.
    fn proxy_upstreams(&self, state: &str) -> Vec<SsSocket> {
        ss_tcp(Some(&self.ns))
            .unwrap_or_else(|e| panic!("ss: {e}"))
            .into_iter()
            .filter(|x| {
                x.state == state && x.peer == addr(DIAL) && x.pids.contains(&self.proxy.pid())
            })
            .collect()
    }

    /// `n` users open a quiet SSE page through the proxy and give up after half a second.
    fn leak(&self, n: usize) {
        let ab = abandon_requests_in_netns(
            &self.ns,
            addr(PROXY),
            "/events",
            n,
            Duration::from_millis(500),
        )
        .unwrap_or_else(|e| panic!("abandon {n} requests: {e}"));
        assert_eq!(ab.connected, n);
        assert_eq!(
            ab.responded, n,
            "every SSE head must reach its client (a stream through the whole chain)"
        );
    }
}

fn relay_policy(mode: &str, min_idle: &str) -> String {
    format!(
        r#"[[policy]]
name = "relay-leaks"
mode = "{mode}"
trigger = "quota-saturated"
quota = "relay"
select = {{ comm = "leaky-proxy", peer_port = 25001, states = ["ESTABLISHED"] }}
min_idle = "{min_idle}"
max_per_round = 8
"#
    )
}

/// Checks every killed/would-kill decision of the relay policy against what it acted on.
fn assert_relay_decision(d: &Value, chain: &Chain, agent: &Agent, mode: &str, min_idle: f64) {
    assert_decision_shape(d);
    assert_eq!(s(d, "policy"), "relay-leaks", "{d}");
    assert_eq!(s(d, "mode"), mode, "{d}");
    assert_eq!(s(d, "comm"), "leaky-proxy", "{d}");
    assert_eq!(d["pid"], json!(chain.proxy.pid()), "{d}");
    assert_eq!(s(d, "peer"), DIAL, "{d}");
    assert_eq!(s(d, "state"), "ESTABLISHED", "{d}");
    assert_eq!(u(d, "agent_pid"), u64::from(agent.pid()), "{d}");
    assert!(u(d, "inode") != 0, "{d}");
    let idle = d["idle_secs"].as_f64().unwrap_or(-1.0);
    assert!(idle >= min_idle, "idle {idle} < min_idle {min_idle}: {d}");
    let q = &d["quota"];
    assert_eq!(q["name"], json!("relay"), "{d}");
    let (used, limit) = (u(q, "used"), u(q, "limit"));
    assert_eq!(limit, MAX_STREAMS, "{d}");
    // Acts only while the quota is saturated (detect.quota_saturation = 0.9).
    assert!(
        used as f64 >= 0.9 * limit as f64,
        "acted below saturation: {d}"
    );
}

/// Decisions naming a given local address (either end of the 4-tuple).
fn naming<'a>(lines: &'a [Value], a: &SocketAddr) -> Vec<&'a Value> {
    let a = a.to_string();
    lines
        .iter()
        .filter(|d| d["local"] == a.as_str() || d["peer"] == a.as_str())
        .collect()
}

#[test]
fn enforce_frees_the_saturated_relay_and_real_requests_work_again() {
    let Some(_env) = require_privileges() else {
        return;
    };
    let ns = NetNs::new("rc-enf");
    let dir = TempDir::new("enforce");
    let chain = Chain::start(&ns);
    let hook = WebhookReceiver::start_in_netns(ns.name(), addr("127.0.0.1:0")).unwrap();
    let audit = dir.path("audit.jsonl");
    let extra = format!(
        "[[webhook]]\nurl = \"{}\"\nformat = \"json\"\n\n{}",
        hook.url("/hook"),
        relay_policy("enforce", "2s")
    );
    let agent = Agent::start(
        &ns,
        &dir.path("connreap.toml"),
        &audit,
        &config(&audit, &[22], None, &extra),
    );
    let metrics = agent.metrics();
    assert!(
        metrics.contains("connreap_reclaim_mechanism{mechanism=\"netlink-sock-destroy\"} 1"),
        "{metrics}"
    );

    // 64 users give up on a quiet SSE page: the relay's quota for the instance is full.
    chain.leak(MAX_STREAMS as usize);
    let saturated = Instant::now();
    let st = chain.status();
    assert_eq!(st["endpoints"][0]["streams"], json!(MAX_STREAMS), "{st}");
    // The incident as users saw it (unless the agent already freed a slot: min_idle is 2s).
    let (code, body) = chain.get_json();
    if result_is(&agent.audit(), "killed").is_empty() {
        assert_eq!(
            (code, body.as_str()),
            (503, "busy"),
            "a full relay must refuse the dial"
        );
    }

    // min_idle (2s) plus a few scan intervals: slots are free again.
    let freed_within = Duration::from_secs(2) + SCAN * 6;
    let streams = wait_until(freed_within, POLL, || {
        Some(chain.streams()).filter(|n| *n < MAX_STREAMS)
    })
    .unwrap_or_else(|| {
        panic!(
            "relay still full {:?} after saturation: {}\n{}",
            saturated.elapsed(),
            chain.status(),
            agent.ctx()
        )
    });
    println!(
        "relay below its quota ({streams}/{MAX_STREAMS}) {:?} after saturation",
        saturated.elapsed()
    );
    // The real path works: 200 AND a body, through proxy -> relay -> instance.
    chain.assert_json_ok();

    // The audit log says who was closed, and why.
    let lines = agent.audit();
    let killed = result_is(&lines, "killed");
    assert!(!killed.is_empty(), "no killed decision:\n{}", agent.ctx());
    for d in &killed {
        assert_relay_decision(d, &chain, &agent, "enforce", 2.0);
    }
    for (round, n) in per_round(&lines, "killed") {
        assert!(n <= 8, "round {round:?} killed {n} > max_per_round 8");
    }
    let inodes: HashSet<u64> = killed.iter().map(|d| u(d, "inode")).collect();
    assert_eq!(inodes.len(), killed.len(), "an inode killed twice");
    // ... and the killed sockets are really gone, the others still leak.
    let left = chain.proxy_upstreams("ESTAB");
    for d in &killed {
        assert!(
            !left.iter().any(|x| x.local.to_string() == s(d, "local")),
            "killed socket {} still ESTABLISHED: {left:#?}",
            s(d, "local")
        );
    }

    // Once the quota reads below saturation the policy stops: no more kills over the next
    // scan intervals (one round of 8 takes 64 to 56 < 0.9 * 64).
    let settled = wait_until(SCAN * 5, POLL, || {
        (result_is(&agent.audit(), "killed").len() > killed.len()).then_some(())
    });
    assert!(
        settled.is_none(),
        "kept killing below saturation: relay {}\n{}",
        chain.status(),
        agent.ctx()
    );
    assert_eq!(
        chain.streams(),
        MAX_STREAMS - killed.len() as u64,
        "{}",
        agent.ctx()
    );

    // One `reclaimed` event per killing round.
    let ev = hook
        .wait_for_body(Duration::from_secs(10), |b| b["kind"] == "reclaimed")
        .unwrap_or_else(|| {
            panic!(
                "no `reclaimed` webhook; got {:#?}\n{}",
                hook.posts().iter().map(|p| &p.body).collect::<Vec<_>>(),
                agent.ctx()
            )
        })
        .body;
    assert_eq!(ev["policy"], json!("relay-leaks"), "{ev}");
    assert_eq!(ev["mode"], json!("enforce"), "{ev}");
    let n = ev["count"].as_u64().unwrap_or(0);
    assert!(n >= 1 && n <= killed.len() as u64, "{ev}");
    assert_eq!(ev["quota"]["name"], json!("relay"), "{ev}");
    assert!(
        ev["processes"].as_array().is_some_and(|p| p
            .iter()
            .any(|p| p["comm"] == "leaky-proxy" && p["pid"] == json!(chain.proxy.pid()))),
        "{ev}"
    );
    assert!(
        ev["sockets"]
            .as_array()
            .is_some_and(|v| v.len() as u64 == n),
        "{ev}"
    );

    // Metrics count the decisions.
    let metrics = agent.metrics();
    let counted = metric_value(
        &metrics,
        "connreap_reclaims_total",
        &["policy=\"relay-leaks\"", "result=\"killed\""],
    );
    assert_eq!(counted, Some(killed.len() as f64), "{metrics}");
}

/// The value of the first sample of `name` whose labels contain all of `labels`.
fn metric_value(text: &str, name: &str, labels: &[&str]) -> Option<f64> {
    text.lines()
        .filter(|l| l.starts_with(&format!("{name}{{")))
        .find(|l| labels.iter().all(|x| l.contains(x)))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

#[test]
fn dry_run_decides_but_closes_nothing_and_the_api_needs_the_token() {
    let Some(_env) = require_privileges() else {
        return;
    };
    let ns = NetNs::new("rc-dry");
    let dir = TempDir::new("dry");
    let chain = Chain::start(&ns);
    let token_file = dir.path("token");
    fs::write(&token_file, format!("{TOKEN}\n")).unwrap();
    let audit = dir.path("audit.jsonl");
    let cfg_path = dir.path("connreap.toml");
    let agent = Agent::start(
        &ns,
        &cfg_path,
        &audit,
        &config(
            &audit,
            &[22],
            Some(&token_file),
            &relay_policy("dry-run", "2s"),
        ),
    );

    chain.leak(MAX_STREAMS as usize);
    let before: BTreeSet<SocketAddr> = chain
        .proxy_upstreams("ESTAB")
        .iter()
        .map(|x| x.local)
        .collect();
    assert_eq!(before.len(), MAX_STREAMS as usize, "{before:?}");

    // Several rounds decide `would-kill`...
    let lines = wait_until(Duration::from_secs(2) + SCAN * 8, POLL, || {
        let lines = agent.audit();
        // Stop early on a kill: asserted just below.
        (per_round(&lines, "would-kill").len() >= 3 || !result_is(&lines, "killed").is_empty())
            .then_some(lines)
    })
    .unwrap_or_else(|| panic!("no three would-kill rounds:\n{}", agent.ctx()));
    let would = result_is(&lines, "would-kill");
    for d in &would {
        assert_relay_decision(d, &chain, &agent, "dry-run", 2.0);
        assert!(
            before.contains(&addr(s(d, "local"))),
            "would-kill names a socket that is not a leaked upstream: {d}"
        );
    }
    for (round, n) in per_round(&lines, "would-kill") {
        assert!(
            n <= 8,
            "round {round:?} has {n} would-kill > max_per_round 8"
        );
    }
    assert!(
        result_is(&lines, "killed").is_empty(),
        "a dry-run policy killed:\n{}",
        agent.ctx()
    );

    // ... and nothing was closed: the relay is still full, users still get 503, and the 64
    // leaked pairs are all still there.
    assert_eq!(chain.streams(), MAX_STREAMS, "{}", chain.status());
    let (code, body) = chain.get_json();
    assert_eq!((code, body.as_str()), (503, "busy"));
    let after: BTreeSet<SocketAddr> = chain
        .proxy_upstreams("ESTAB")
        .iter()
        .map(|x| x.local)
        .collect();
    assert_eq!(after, before, "dry-run closed upstream sockets");
    let relay_side = ss_tcp(Some(ns.name()))
        .unwrap()
        .into_iter()
        .filter(|x| x.state == "ESTAB" && x.local == addr(DIAL))
        .count();
    assert_eq!(relay_side, MAX_STREAMS as usize, "relay ends of the pairs");

    // GET /v1/reclaims lists the same decisions.
    let (code, recent) = agent.get("/v1/reclaims").unwrap();
    assert_eq!(code, 200, "{recent}");
    let recent = recent["reclaims"]
        .as_array()
        .unwrap_or_else(|| panic!("GET /v1/reclaims without `reclaims`: {recent}"))
        .clone();
    let api_would = result_is(&recent, "would-kill");
    assert!(!api_would.is_empty(), "{recent:#?}");
    for d in &api_would {
        assert_relay_decision(d, &chain, &agent, "dry-run", 2.0);
    }
    let audited: HashSet<(u64, u64, String)> = would
        .iter()
        .map(|d| (u(d, "round"), u(d, "inode"), s(d, "local").to_string()))
        .collect();
    assert!(
        api_would.iter().any(|d| audited.contains(&(
            u(d, "round"),
            u(d, "inode"),
            s(d, "local").to_string()
        ))),
        "GET /v1/reclaims shares no decision with the audit log"
    );

    // POST /v1/reclaim: the token is required.
    let req = json!({"policy": "relay-leaks", "dry_run": true});
    let (code, body) = agent.post_reclaim(None, &req);
    assert_eq!(code, 401, "without a token: {body}");
    let (code, body) = agent.post_reclaim(Some("wrong-token-wrong-token-wrong"), &req);
    assert_eq!(code, 401, "with a wrong token: {body}");
    let (code, body) = agent.post_reclaim(Some(TOKEN), &json!({"policy": "nope"}));
    assert_eq!(code, 400, "unknown policy: {body}");
    let (code, round) = agent.post_reclaim(Some(TOKEN), &req);
    assert_eq!(code, 200, "with the token: {round}");
    assert_eq!(round["policy"], json!("relay-leaks"), "{round}");
    let decisions = round["decisions"]
        .as_array()
        .unwrap_or_else(|| panic!("no decisions in {round}"));
    assert!(
        !decisions.is_empty() && decisions.len() <= 8,
        "expected 1..=8 decisions: {round:#}"
    );
    for d in decisions {
        assert_eq!(d["result"], json!("would-kill"), "{round:#}");
        assert_relay_decision(d, &chain, &agent, "dry-run", 2.0);
    }
    // Asking a dry-run policy to enforce does not make it kill.
    let (code, round) = agent.post_reclaim(
        Some(TOKEN),
        &json!({"policy": "relay-leaks", "dry_run": false}),
    );
    assert_eq!(code, 200, "{round}");
    assert!(
        round["decisions"]
            .as_array()
            .is_some_and(|v| !v.is_empty() && v.iter().all(|d| d["result"] == "would-kill")),
        "{round:#}"
    );

    // `connreap reclaim --dry-run` prints the same kind of decisions as JSON lines.
    let mut cmd = ns.connreap([
        "reclaim",
        "--policy",
        "relay-leaks",
        "--dry-run",
        "--config",
    ]);
    cmd.arg(&cfg_path);
    let out = run(&mut cmd, CONNREAP_TIMEOUT);
    assert!(out.status.success(), "connreap reclaim: {out:?}");
    let printed: Vec<Value> = out
        .stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l:?}")))
        .collect();
    assert!(
        !printed.is_empty() && printed.iter().all(|d| d["result"] == "would-kill"),
        "{out:?}"
    );

    // Still nothing closed.
    assert_eq!(chain.streams(), MAX_STREAMS, "{}", chain.status());
    assert!(
        result_is(&agent.audit(), "killed").is_empty(),
        "{}",
        agent.ctx()
    );
    let after: BTreeSet<SocketAddr> = chain
        .proxy_upstreams("ESTAB")
        .iter()
        .map(|x| x.local)
        .collect();
    assert_eq!(after, before, "dry-run closed upstream sockets");
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
        let mut r = stream.try_clone().unwrap();
        let (t, e, st) = (ticks.clone(), ended.clone(), stop.clone());
        let reader = thread::spawn(move || {
            let mut text = String::new();
            let mut seen = 0;
            let mut buf = [0u8; 4096];
            while !st.load(Ordering::SeqCst) {
                match r.read(&mut buf) {
                    Ok(0) => {
                        *e.lock().unwrap() = Some("EOF".into());
                        return;
                    }
                    Ok(n) => {
                        text.push_str(&String::from_utf8_lossy(&buf[..n]));
                        let now = text.matches("data: tick ").count();
                        let mut v = t.lock().unwrap();
                        for _ in seen..now {
                            v.push(Instant::now());
                        }
                        seen = now;
                    }
                    Err(err)
                        if matches!(err.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
                    Err(err) => {
                        *e.lock().unwrap() = Some(err.to_string());
                        return;
                    }
                }
            }
        });
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

impl Drop for TicksClient {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(r) = self.reader.take() {
            let _ = r.join();
        }
    }
}

#[test]
fn a_busy_stream_is_never_selected_while_idle_leaks_are_killed() {
    let Some(_env) = require_privileges() else {
        return;
    };
    let ns = NetNs::new("rc-busy");
    let dir = TempDir::new("busy");
    let chain = Chain::start(&ns);
    let audit = dir.path("audit.jsonl");
    let agent = Agent::start(
        &ns,
        &dir.path("connreap.toml"),
        &audit,
        &config(&audit, &[22], None, &relay_policy("enforce", "10s")),
    );

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
    chain.leak(MAX_STREAMS as usize - 1);
    assert_eq!(chain.streams(), MAX_STREAMS, "{}", chain.status());

    // Idle leaks get killed once idle 10s (quota saturated all along).
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
    // The live stream keeps flowing after the kills.
    let seen = ticks.count();
    assert!(
        wait_until(Duration::from_secs(5), POLL, || (ticks.count() >= seen + 2)
            .then_some(()))
        .is_some(),
        "the live stream stopped: ended {:?}\n{}",
        ticks.ended(),
        agent.ctx()
    );

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

    // It was the oldest candidate: only min_idle kept it out of an oldest-first round.
    let snap = snapshot(&ns, &["--pid", &chain.proxy.pid().to_string()]);
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

// ---------------------------------------------------------------------------------------------
// The quota trigger, against a relay status we control

/// A relay `/status` with one endpoint at `streams`/64.
fn frozen_status(streams: u64) -> Value {
    relay_status_json(
        &[EndpointStatus {
            port: 7600,
            dial_port: 7600,
            streams,
            max_streams: MAX_STREAMS,
        }],
        0,
        0,
        0,
    )
}

#[test]
fn quota_trigger_acts_once_per_saturated_reading_and_never_on_bad_or_low_readings() {
    let Some(_env) = require_privileges() else {
        return;
    };
    let ns = NetNs::new("rc-gate");
    let dir = TempDir::new("gate");
    const N: usize = 24;
    // Plenty of candidates: testpeer clients to an instance-sim.
    let _server = ReadyChild::spawn_in_netns(
        ns.name(),
        INSTANCE_SIM,
        ["--listen", "127.0.0.1:7600"],
        READY,
    )
    .unwrap();
    let (targets, ready) = peer(
        &ns,
        &[
            "connect",
            "--addr",
            "127.0.0.1:7600",
            "--count",
            &N.to_string(),
        ],
    );
    let target_locals = locals(&ready);
    // A status source read every 3s while the agent scans every second: each reading is seen
    // by about three rounds, and only one of them may act on it.
    let status = QuotaServer::start_in_netns(
        ns.name(),
        addr("127.0.0.1:0"),
        QuotaMode::Json(frozen_status(MAX_STREAMS)),
    )
    .unwrap();
    let audit = dir.path("audit.jsonl");
    let extra = format!(
        r#"[[quota]]
name = "frozen"
url = "{url}"
items = "/endpoints"
port_field = "port"
used_field = "streams"
limit_field = "maxStreams"
poll_interval = "3s"

[[policy]]
name = "gate"
mode = "enforce"
trigger = "quota-saturated"
quota = "frozen"
select = {{ comm = "{PEER_COMM}", peer_port = 7600 }}
max_per_round = 2
"#,
        url = status.url()
    );
    let agent = Agent::start(
        &ns,
        &dir.path("connreap.toml"),
        &audit,
        &config(&audit, &[22], None, &extra),
    );
    let killing_rounds = || per_round(&agent.audit(), "killed").len();
    let killed = || result_is(&agent.audit(), "killed").len();
    let wait_hits = |n: usize| {
        wait_until(Duration::from_secs(10), POLL, || {
            (status.hits() >= n).then_some(())
        })
        .unwrap_or_else(|| {
            panic!(
                "the agent stopped polling the quota ({} polls)",
                status.hits()
            )
        })
    };

    // Saturated all along: it acts, again on each new reading, but once per reading.
    wait_hits(4);
    let (rounds, hits) = (killing_rounds(), status.hits());
    assert!(
        rounds >= 2,
        "{rounds} killing rounds over {hits} saturated readings:\n{}",
        agent.ctx()
    );
    assert!(
        rounds <= hits,
        "{rounds} killing rounds on {hits} readings: acted twice on one reading\n{}",
        agent.ctx()
    );
    let lines = agent.audit();
    for d in result_is(&lines, "killed") {
        assert_decision_shape(d);
        assert_eq!(
            d["quota"],
            json!({"name": "frozen", "used": 64, "limit": 64}),
            "{d}"
        );
        assert!(target_locals.contains(s(d, "local")), "{d}");
        assert_eq!(d["pid"], json!(targets.pid()), "{d}");
    }
    for (round, n) in per_round(&lines, "killed") {
        assert!(n <= 2, "round {round:?} killed {n} > max_per_round 2");
    }

    // The source fails (stale data), then reads below saturation: no kill from the first
    // failed reading on, over two full poll periods.
    status.set_mode(QuotaMode::Http500);
    let h = status.hits();
    wait_hits(h + 1);
    // Every earlier reading was acted on in the round right after it (rounds every second,
    // readings every 3s): from here on nothing may be killed.
    let before = killed();
    status.set_json(frozen_status(32));
    wait_hits(h + 2);
    wait_hits(h + 3);
    assert_eq!(
        killed(),
        before,
        "killed while the quota was unavailable or below saturation:\n{}",
        agent.ctx()
    );

    // Saturated again: it acts again.
    status.set_json(frozen_status(MAX_STREAMS));
    assert!(
        wait_until(Duration::from_secs(3) + SCAN * 4, POLL, || {
            (killed() > before).then_some(())
        })
        .is_some(),
        "no kill after the quota saturated again:\n{}",
        agent.ctx()
    );
    assert!(alive(targets.pid()));
}

// ---------------------------------------------------------------------------------------------
// `always` policies on testpeer pools

/// Start `connreap-testpeer ARGS` in `ns` and wait for its `ready` line.
fn peer(ns: &NetNs, args: &[&str]) -> (Child, Ready) {
    let mut cmd = ns.command(TESTPEER);
    cmd.args(args);
    let mut child = Child::spawn(&mut cmd, &format!("connreap-testpeer {}", args.join(" ")));
    let ready = child.wait_ready(READY);
    (child, ready)
}

fn locals(ready: &Ready) -> BTreeSet<String> {
    ready.get("locals").split(',').map(str::to_string).collect()
}

#[test]
fn protected_and_unselected_sockets_survive_and_max_per_round_holds() {
    let Some(_env) = require_privileges() else {
        return;
    };
    let ns = NetNs::new("rc-sel");
    let dir = TempDir::new("select");
    const MAX: usize = 3;
    const N: usize = 12;

    // Targets: N testpeer clients held open to a server of another comm (instance-sim).
    let _server = ReadyChild::spawn_in_netns(
        ns.name(),
        INSTANCE_SIM,
        ["--listen", "127.0.0.1:7400"],
        READY,
    )
    .unwrap();
    let (targets, ready) = peer(
        &ns,
        &[
            "connect",
            "--addr",
            "127.0.0.1:7400",
            "--count",
            &N.to_string(),
        ],
    );
    let target_locals = locals(&ready);
    // Same comm and state, but on a protected port (both ends match the selector).
    let (_p_srv, _) = peer(&ns, &["listen", "--addr", "127.0.0.1:7402"]);
    let (_p_cli, p_ready) = peer(
        &ns,
        &["connect", "--addr", "127.0.0.1:7402", "--count", "2"],
    );
    // Same port as the targets, other comm (this test process).
    let other_comm = connect(Some(ns.name()), addr("127.0.0.1:7400"), HTTP).unwrap();
    (&other_comm)
        .write_all(b"GET /events HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    let other_local = other_comm.local_addr().unwrap();
    // Same comm, other state: CLOSE_WAIT clients.
    let (cw, cw_ready) = peer(
        &ns,
        &["close-wait", "--addr", "127.0.0.1:7404", "--count", "2"],
    );

    let audit = dir.path("audit.jsonl");
    let policy = format!(
        r#"[[policy]]
name = "sweep"
mode = "enforce"
trigger = "always"
select = {{ comm = "{PEER_COMM}", states = ["ESTABLISHED"] }}
max_per_round = {MAX}
"#
    );
    let agent = Agent::start(
        &ns,
        &dir.path("connreap.toml"),
        &audit,
        &config(&audit, &[22, 7402], None, &policy),
    );

    // Every target gets killed, MAX at a time.
    let lines = wait_until(SCAN * (N as u32 / MAX as u32 + 10), POLL, || {
        let lines = agent.audit();
        let done: BTreeSet<String> = result_is(&lines, "killed")
            .iter()
            .map(|d| s(d, "local").to_string())
            .collect();
        // Stop early when a non-target was killed: asserted below.
        (target_locals.is_subset(&done) || !done.is_subset(&target_locals)).then_some(lines)
    })
    .unwrap_or_else(|| {
        panic!(
            "not every target was killed ({target_locals:?}):\n{}",
            agent.ctx()
        )
    });
    // Let a few more rounds run over what is left (all protected or unselected).
    let rounds = per_round(&lines, "skipped").len();
    let lines = wait_until(SCAN * 6, POLL, || {
        let lines = agent.audit();
        let acted_on_other = lines
            .iter()
            .any(|d| d["result"] != "skipped" && !target_locals.contains(s(d, "local")));
        (acted_on_other || per_round(&lines, "skipped").len() >= rounds + 3).then_some(lines)
    })
    .unwrap_or_else(|| {
        panic!(
            "no further rounds over the protected sockets:\n{}",
            agent.ctx()
        )
    });

    let killed = result_is(&lines, "killed");
    let killed_locals: BTreeSet<String> =
        killed.iter().map(|d| s(d, "local").to_string()).collect();
    assert_eq!(
        killed_locals,
        target_locals,
        "killed exactly the targets:\n{}",
        agent.ctx()
    );
    assert_eq!(killed.len(), N, "a target killed twice:\n{}", agent.ctx());
    for d in &killed {
        assert_decision_shape(d);
        assert_eq!(
            (s(d, "policy"), s(d, "mode"), s(d, "comm"), s(d, "peer")),
            ("sweep", "enforce", PEER_COMM, "127.0.0.1:7400"),
            "{d}"
        );
        assert_eq!(d["pid"], json!(targets.pid()), "{d}");
        assert_eq!(d["quota"], Value::Null, "{d}");
    }
    let groups = per_round(&lines, "killed");
    for (round, n) in &groups {
        assert!(
            *n <= MAX,
            "round {round:?} killed {n} > max_per_round {MAX}"
        );
    }
    assert!(
        groups.len() >= N.div_ceil(MAX),
        "{N} kills in {} rounds",
        groups.len()
    );
    assert!(alive(targets.pid()), "the targets' owner died");

    // Protected: selected, skipped with the reason, never killed; still connected.
    let protected: Vec<&Value> = lines
        .iter()
        .filter(|d| s(d, "local").ends_with(":7402") || s(d, "peer").ends_with(":7402"))
        .collect();
    assert!(!protected.is_empty(), "protected sockets never considered");
    for d in &protected {
        assert_eq!(s(d, "result"), "skipped", "{d}");
        assert!(
            d["reason"]
                .as_str()
                .is_some_and(|r| r.contains("protect_ports")),
            "{d}"
        );
    }
    let ss = ss_tcp(Some(ns.name())).unwrap();
    for l in locals(&p_ready) {
        let l = addr(&l);
        assert!(
            ss.iter().any(|x| x.state == "ESTAB" && x.local == l),
            "protected client {l} gone: {ss:#?}"
        );
        assert!(
            ss.iter().any(|x| x.state == "ESTAB" && x.peer == l),
            "protected server end for {l} gone: {ss:#?}"
        );
    }

    // Other comm: never named, still open.
    assert!(naming(&lines, &other_local).is_empty());
    other_comm.set_nonblocking(true).unwrap();
    let mut buf = [0u8; 4096];
    loop {
        match (&other_comm).read(&mut buf) {
            Ok(0) => panic!("other-comm connection was closed"),
            Ok(_) => continue, // the SSE head
            Err(e) if e.kind() == ErrorKind::WouldBlock => break,
            Err(e) => panic!("other-comm connection broken: {e}"),
        }
    }
    assert!(
        ss.iter()
            .any(|x| x.state == "ESTAB" && x.local == other_local),
        "{ss:#?}"
    );

    // Other state: CLOSE_WAIT clients untouched.
    for l in locals(&cw_ready) {
        let l = addr(&l);
        assert!(naming(&lines, &l).is_empty(), "CLOSE_WAIT {l} considered");
        assert!(
            ss.iter().any(|x| x.state == "CLOSE-WAIT" && x.local == l),
            "CLOSE_WAIT client {l} gone: {ss:#?}"
        );
    }
    assert!(alive(cw.pid()));

    // The targets are really closed.
    for l in &target_locals {
        let l = addr(l);
        assert!(
            !ss.iter().any(|x| x.state == "ESTAB" && x.local == l),
            "target {l} still ESTABLISHED"
        );
    }
}

#[test]
fn agent_restart_mid_leak_appends_and_never_kills_twice() {
    let Some(_env) = require_privileges() else {
        return;
    };
    let ns = NetNs::new("rc-rst");
    let dir = TempDir::new("restart");
    const N: usize = 12;
    let chain = Chain::start(&ns);
    let audit = dir.path("audit.jsonl");
    let cfg_path = dir.path("connreap.toml");
    let policy = r#"[[policy]]
name = "proxy-leaks"
mode = "enforce"
trigger = "always"
select = { comm = "leaky-proxy", peer_port = 25001, states = ["ESTABLISHED"] }
min_idle = "2s"
max_per_round = 2
"#;
    let text = config(&audit, &[22], None, policy);
    let first = Agent::start(&ns, &cfg_path, &audit, &text);
    chain.leak(N);
    let leaked: BTreeSet<String> = chain
        .proxy_upstreams("ESTAB")
        .iter()
        .map(|x| x.local.to_string())
        .collect();
    assert_eq!(leaked.len(), N, "{leaked:?}");

    // Kill the agent as soon as it has killed something (there is more to do).
    wait_until(
        Duration::from_secs(2) + SCAN * 6,
        Duration::from_millis(20),
        || (!result_is(&first.audit(), "killed").is_empty()).then_some(()),
    )
    .unwrap_or_else(|| panic!("first agent killed nothing:\n{}", first.ctx()));
    let first_pid = u64::from(first.pid());
    let first_ctx = first.ctx();
    first.child.kill();
    let first_text = fs::read_to_string(&audit).unwrap();
    let first_lines = read_audit(&audit);
    let first_killed = result_is(&first_lines, "killed").len();
    assert!(
        first_killed < N,
        "the first agent finished before the restart:\n{first_ctx}"
    );

    let second = Agent::start(&ns, &cfg_path, &audit, &text);
    let second_pid = u64::from(second.pid());
    assert!(
        wait_until(SCAN * (N as u32 / 2 + 10), POLL, || {
            chain.proxy_upstreams("ESTAB").is_empty().then_some(())
        })
        .is_some(),
        "leaks left after the restart: {:#?}\n{}",
        chain.proxy_upstreams("ESTAB"),
        second.ctx()
    );

    let text_now = fs::read_to_string(&audit).unwrap();
    assert!(
        text_now.starts_with(&first_text),
        "the first run's audit lines were rewritten"
    );
    let lines = read_audit(&audit);
    let killed = result_is(&lines, "killed");
    let mut inodes = HashSet::new();
    for d in &killed {
        assert_decision_shape(d);
        assert!(
            inodes.insert(u(d, "inode")),
            "inode killed twice: {d}\n{}",
            second.ctx()
        );
        assert!(leaked.contains(s(d, "local")), "not a leak: {d}");
    }
    let killed_locals: BTreeSet<String> =
        killed.iter().map(|d| s(d, "local").to_string()).collect();
    assert_eq!(killed_locals, leaked, "{}", second.ctx());
    let pids: BTreeSet<u64> = killed.iter().map(|d| u(d, "agent_pid")).collect();
    assert_eq!(
        pids,
        BTreeSet::from([first_pid, second_pid]),
        "killed decisions from both runs"
    );
    for (round, n) in per_round(&lines, "killed") {
        assert!(n <= 2, "round {round:?} killed {n}");
    }
    // Relay slots are back and the real path works.
    assert!(
        wait_until(SCAN * 3, POLL, || (chain.streams() == 0).then_some(())).is_some(),
        "{}",
        chain.status()
    );
    chain.assert_json_ok();
}

/// Forces the fallback destroy mechanism (the bpf_sock_destroy kfunc from iter/tcp).
const BPF_ITER: &str = "mechanism = \"bpf-iter\"";

#[test]
fn close_wait_pool_leak_is_reclaimed_and_the_client_lives_on() {
    close_wait_pool_leak("rc-cw", None);
}

/// The same leak on the fallback path that kernels without CONFIG_INET_DIAG_DESTROY use.
#[test]
fn close_wait_pool_leak_is_reclaimed_through_the_bpf_sock_destroy_fallback() {
    close_wait_pool_leak("rc-cwb", Some(BPF_ITER));
}

fn close_wait_pool_leak(ns_name: &str, reclaim_extra: Option<&str>) {
    let Some(_env) = require_privileges() else {
        return;
    };
    let ns = NetNs::new(ns_name);
    let dir = TempDir::new(ns_name);
    const N: usize = 10;
    let (client, ready) = peer(
        &ns,
        &[
            "close-wait",
            "--addr",
            "127.0.0.1:7500",
            "--count",
            &N.to_string(),
        ],
    );
    let leaked = locals(&ready);
    let cw_of = |ss: &[SsSocket]| -> BTreeSet<String> {
        ss.iter()
            .filter(|x| x.state == "CLOSE-WAIT" && x.peer == addr("127.0.0.1:7500"))
            .map(|x| x.local.to_string())
            .collect()
    };
    assert_eq!(cw_of(&ss_tcp(Some(ns.name())).unwrap()), leaked);

    let audit = dir.path("audit.jsonl");
    let policy = format!(
        r#"[[policy]]
name = "pool-leak"
mode = "enforce"
trigger = "always"
select = {{ comm = "{PEER_COMM}", peer_port = 7500, states = ["CLOSE_WAIT"] }}
"#
    );
    let mut text = config(&audit, &[22], None, &policy);
    if let Some(extra) = reclaim_extra {
        text = text.replace("[reclaim]\n", &format!("[reclaim]\n{extra}\n"));
    }
    let agent = Agent::start(&ns, &dir.path("connreap.toml"), &audit, &text);

    // Without api.token_file the endpoint is off.
    let (code, body) = agent.post_reclaim(
        Some(TOKEN),
        &json!({"policy": "pool-leak", "dry_run": true}),
    );
    assert_eq!(code, 404, "{body}");

    assert!(
        wait_until(SCAN * 8, POLL, || {
            cw_of(&ss_tcp(Some(ns.name())).unwrap())
                .is_empty()
                .then_some(())
        })
        .is_some(),
        "CLOSE_WAIT sockets left:\n{}",
        agent.ctx()
    );
    let snap = snapshot(&ns, &["--pid", &client.pid().to_string()]);
    let left = sockets(&snap);
    assert!(
        left.iter().all(|x| x.state != "CLOSE_WAIT"),
        "snapshot still shows CLOSE_WAIT:\n{snap:#}"
    );
    // The listener of the same process is never touched.
    assert!(
        left.iter()
            .any(|x| x.state == "LISTEN" && x.local == "127.0.0.1:7500"),
        "{snap:#}"
    );
    assert!(alive(client.pid()), "the pool's process died");

    let lines = agent.audit();
    let killed = result_is(&lines, "killed");
    let killed_locals: BTreeSet<String> =
        killed.iter().map(|d| s(d, "local").to_string()).collect();
    assert_eq!(killed_locals, leaked, "{}", agent.ctx());
    assert_eq!(killed.len(), N, "{}", agent.ctx());
    for d in &killed {
        assert_decision_shape(d);
        assert_eq!(
            (s(d, "policy"), s(d, "state"), s(d, "comm")),
            ("pool-leak", "CLOSE_WAIT", PEER_COMM),
            "{d}"
        );
        assert_eq!(d["pid"], json!(client.pid()), "{d}");
    }
    for (round, n) in per_round(&lines, "killed") {
        assert!(
            n <= 8,
            "round {round:?} killed {n} > default max_per_round 8"
        );
    }
    // Still alive a couple of scans later, and its listener still accepts.
    agent.wait_scans(2);
    assert!(alive(client.pid()), "the pool's process died");
    let probe = connect(Some(ns.name()), addr("127.0.0.1:7500"), HTTP);
    assert!(probe.is_ok(), "listener gone: {probe:?}");
}

#[test]
fn a_policy_selecting_nothing_specific_is_a_config_error() {
    let dir = TempDir::new("cfg");
    let audit = dir.path("audit.jsonl");
    let path = dir.path("broad.toml");
    let policy = r#"[[policy]]
name = "everything-established"
mode = "enforce"
trigger = "always"
select = { states = ["ESTABLISHED"] }
"#;
    fs::write(&path, config(&audit, &[22], None, policy)).unwrap();
    let mut cmd = std::process::Command::new(connreap_bin());
    cmd.arg("check-config").arg(&path);
    let out = run(&mut cmd, CONNREAP_TIMEOUT);
    assert_eq!(out.status.code(), Some(78), "{out:?}");
    assert!(
        out.stderr.contains("everything-established") && out.stderr.contains("select"),
        "must name the policy and the key: {out:?}"
    );
    assert!(!audit.exists());

    // The same file with a selector is fine.
    let ok = dir.path("ok.toml");
    fs::write(
        &ok,
        config(
            &audit,
            &[22],
            None,
            &policy.replace("{ states", "{ comm = \"leaky-proxy\", states"),
        ),
    )
    .unwrap();
    let mut cmd = std::process::Command::new(connreap_bin());
    cmd.arg("check-config").arg(&ok);
    let out = run(&mut cmd, CONNREAP_TIMEOUT);
    assert!(out.status.success(), "{out:?}");
}
