//! `connreap run` end to end: one network namespace per test, real processes and real sockets
//! reproducing the incidents, the agent started inside the namespace with a config file, and
//! assertions on what a webhook receiver got and what the HTTP API serves.
//!
//! Every wait is a bounded poll; scans run every second and thresholds/ages are a few seconds,
//! so each test takes well under a minute even on a loaded machine.
use std::{
    net::SocketAddr,
    path::{Path, PathBuf},
    sync::atomic::{AtomicUsize, Ordering},
    time::{Duration, Instant},
};

use connreap_tests::{
    fixtures::{
        abandon_requests_in_netns, get_json_in_netns, http_get_in_netns, relay_status_json,
        EndpointStatus, QuotaMode, QuotaServer, ReadyChild, WebhookPost, WebhookReceiver,
    },
    require_privileges, run, wait_until, Child, NetNs, Ready, CONNREAP_TIMEOUT,
};
use serde_json::{json, Value};

const TESTPEER: &str = env!("CARGO_BIN_EXE_connreap-testpeer");
const INSTANCE_SIM: &str = env!("CARGO_BIN_EXE_instance-sim");
const RELAY_SIM: &str = env!("CARGO_BIN_EXE_relay-sim");
const LEAKY_PROXY: &str = env!("CARGO_BIN_EXE_leaky-proxy");
/// The kernel keeps 15 characters of the executable name.
const PEER_COMM: &str = "connreap-testpe";

/// agent.listen inside each test's namespace.
const API: &str = "127.0.0.1:9477";
/// Where each test's webhook receiver listens (inside the namespace).
const HOOK: &str = "127.0.0.1:9999";
const HOST: &str = "e2e-host";

const READY_TIMEOUT: Duration = Duration::from_secs(10);
/// Agent start (BPF load, first scan) until /healthz answers 200.
const AGENT_START: Duration = Duration::from_secs(30);
/// Longest wait for one finding / notification; scans run every second.
const FINDING: Duration = Duration::from_secs(25);
const POLL: Duration = Duration::from_millis(200);
const HTTP: Duration = Duration::from_secs(5);

fn addr(s: &str) -> SocketAddr {
    s.parse().expect("socket address")
}

/// A config file removed on drop.
struct TempConfig {
    path: PathBuf,
}

impl TempConfig {
    fn new(name: &str, text: &str) -> TempConfig {
        static N: AtomicUsize = AtomicUsize::new(0);
        let path = std::env::temp_dir().join(format!(
            "connreap-daemon-{}-{}-{name}.toml",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::write(&path, text)
            .unwrap_or_else(|e| panic!("cannot write {}: {e}", path.display()));
        TempConfig { path }
    }

    fn arg(&self) -> String {
        self.path.display().to_string()
    }
}

impl Drop for TempConfig {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// A complete config: 1 s scans, the API on [`API`], fast webhook retries, one JSON webhook to
/// [`HOOK`], the given `[detect]` keys, and `extra` (e.g. `[[quota]]` tables) at the end.
fn config(detect: &str, extra: &str) -> String {
    let audit = std::env::temp_dir().join(format!(
        "connreap-daemon-{}-audit.jsonl",
        std::process::id()
    ));
    format!(
        r#"[agent]
listen = "{API}"
scan_interval = "1s"
host = "{HOST}"

[detect]
{detect}

[alerts]
max_backoff = "2s"
timeout = "2s"

[reclaim]
audit_log = "{}"

[[webhook]]
url = "http://{HOOK}/alerts"
format = "json"

{extra}
"#,
        audit.display()
    )
}

/// `connreap run --config FILE` inside a namespace, with helpers for its API.
struct Agent {
    ns_name: String,
    child: Child,
    api: SocketAddr,
    _config: TempConfig,
}

impl Agent {
    /// Start the agent in `ns` and wait until /healthz answers 200 (first scan done).
    fn start(ns: &NetNs, name: &str, config_text: &str) -> Agent {
        let config = TempConfig::new(name, config_text);
        let mut cmd = ns.connreap(["run", "--config", &config.arg()]);
        let child = Child::spawn(&mut cmd, "connreap run");
        let mut agent = Agent {
            ns_name: ns.name().to_string(),
            child,
            api: addr(API),
            _config: config,
        };
        let up = wait_until(AGENT_START, POLL, || {
            agent.assert_alive();
            http_get_in_netns(&agent.ns_name, agent.api, "/healthz", HTTP)
                .ok()
                .filter(|(code, _)| *code == 200)
        });
        if up.is_none() {
            panic!(
                "connreap run never answered 200 on /healthz within {AGENT_START:?}; stderr:\n{}",
                agent.stderr()
            );
        }
        agent
    }

    fn stderr(&self) -> String {
        self.child.stderr()
    }

    /// Panics (with the agent's stderr) if the agent has exited.
    fn assert_alive(&mut self) {
        if let Some(status) = self.child.try_wait() {
            std::thread::sleep(Duration::from_millis(100));
            panic!("connreap run exited ({status}); stderr:\n{}", self.stderr());
        }
    }

    fn get(&self, path: &str) -> (u16, Value) {
        get_json_in_netns(&self.ns_name, self.api, path, HTTP).unwrap_or_else(|e| {
            panic!(
                "GET {path} on the agent failed: {e}; agent stderr:\n{}",
                self.stderr()
            )
        })
    }

    fn get_ok(&self, path: &str) -> Value {
        let (code, body) = self.get(path);
        assert_eq!(code, 200, "GET {path}: {body}");
        body
    }

    /// GET /healthz must answer 200 with status ok, and the process must be running.
    fn assert_healthy(&mut self) {
        self.assert_alive();
        let (code, body) = self.get("/healthz");
        assert_eq!(
            (code, body["status"].as_str()),
            (200, Some("ok")),
            "/healthz: {body}; agent stderr:\n{}",
            self.stderr()
        );
    }

    fn findings(&self) -> Vec<Value> {
        let body = self.get_ok("/v1/findings");
        body["findings"]
            .as_array()
            .unwrap_or_else(|| panic!("/v1/findings has no `findings` array: {body}"))
            .clone()
    }

    /// Current findings of `kind` matching `pred`.
    fn find(&self, kind: &str, pred: impl Fn(&Value) -> bool) -> Option<Value> {
        self.findings()
            .into_iter()
            .find(|f| f["kind"] == kind && pred(f))
    }

    fn metrics(&self) -> String {
        let (code, text) = http_get_in_netns(&self.ns_name, self.api, "/metrics", HTTP)
            .unwrap_or_else(|e| panic!("GET /metrics failed: {e}"));
        assert_eq!(code, 200, "/metrics: {text}");
        text
    }

    /// Value of one exact series (`name{labels}`) in /metrics, if present.
    fn metric(&self, series: &str) -> Option<f64> {
        metric_value(&self.metrics(), series)
    }
}

fn metric_value(text: &str, series: &str) -> Option<f64> {
    text.lines().find_map(|l| {
        l.strip_prefix(series)
            .and_then(|rest| rest.strip_prefix(' '))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
    })
}

/// Start `connreap-testpeer ARGS` in `ns` and wait for its `ready` line.
fn peer(ns: &NetNs, args: &[&str]) -> (Child, Ready) {
    let mut cmd = ns.command(TESTPEER);
    cmd.args(args);
    let mut child = Child::spawn(&mut cmd, &format!("connreap-testpeer {}", args.join(" ")));
    let ready = child.wait_ready(READY_TIMEOUT);
    (child, ready)
}

fn spawn_ready(ns: &NetNs, program: &str, args: &[&str]) -> ReadyChild {
    ReadyChild::spawn_in_netns(ns.name(), program, args, READY_TIMEOUT)
        .unwrap_or_else(|e| panic!("cannot start {program} {args:?}: {e}"))
}

fn is(b: &Value, kind: &str, status: &str) -> bool {
    b["kind"] == kind && b["status"] == status
}

/// (pid, comm) of each entry of a finding's `processes`.
fn owners(f: &Value) -> Vec<(Option<u64>, String)> {
    f["processes"]
        .as_array()
        .unwrap_or_else(|| panic!("`processes` is not an array: {f}"))
        .iter()
        .map(|p| {
            (
                p["pid"].as_u64(),
                p["comm"].as_str().unwrap_or("").to_string(),
            )
        })
        .collect()
}

fn names_pid(f: &Value, pid: u32) -> bool {
    owners(f).iter().any(|(p, _)| *p == Some(pid as u64))
}

/// One line per recorded POST, for failure messages.
fn describe(posts: &[WebhookPost]) -> String {
    posts
        .iter()
        .map(|p| {
            format!(
                "  {} {} {} {}",
                p.body["status"], p.body["kind"], p.body["fingerprint"], p.body["summary"]
            )
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// Wait for a POST whose JSON body matches `pred`; panics with everything received so far.
fn wait_post(
    hook: &WebhookReceiver,
    agent: &Agent,
    what: &str,
    pred: impl Fn(&Value) -> bool,
) -> WebhookPost {
    hook.wait_for_body(FINDING, pred).unwrap_or_else(|| {
        panic!(
            "the webhook receiver never got {what} within {FINDING:?}; it got:\n{}\ncurrent findings: {:#?}\nagent stderr:\n{}",
            describe(&hook.posts()),
            agent.findings(),
            agent.stderr()
        )
    })
}

/// Fields every JSON alert body carries.
fn assert_alert_shape(b: &Value) {
    for key in [
        "kind",
        "status",
        "fingerprint",
        "host",
        "summary",
        "service_port",
        "count",
        "oldest_age_secs",
        "processes",
        "quota",
        "sockets",
        "started_at",
    ] {
        assert!(b.get(key).is_some(), "alert lacks `{key}`: {b:#}");
    }
    assert_eq!(b["host"], HOST, "{b:#}");
    let fp = b["fingerprint"].as_str().unwrap_or_default();
    assert!(
        fp.starts_with(&format!("{}:", b["kind"].as_str().unwrap_or("?"))),
        "fingerprint {fp:?} does not start with the kind: {b:#}"
    );
    if b["status"] == "resolved" {
        assert!(
            b["ended_at"].is_string(),
            "resolved without ended_at: {b:#}"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// 1. The relay incident.

#[test]
fn relay_quota_exhausted_by_leaky_proxy_alerts_and_resolves() {
    let Some(_env) = require_privileges() else {
        return;
    };
    let ns = NetNs::new("relay");
    let hook = WebhookReceiver::start_in_netns(ns.name(), addr(HOOK)).unwrap();
    let _instance = spawn_ready(&ns, INSTANCE_SIM, &["--listen", "127.0.0.1:21000"]);
    let relay = spawn_ready(
        &ns,
        RELAY_SIM,
        &[
            "--dial",
            "127.0.0.1:25001=127.0.0.1:21000",
            "--status",
            "127.0.0.1:20080",
            "--max-streams",
            "64",
        ],
    );
    let mut proxy = spawn_ready(
        &ns,
        LEAKY_PROXY,
        &[
            "--listen",
            "127.0.0.1:8080",
            "--upstream",
            "127.0.0.1:25001",
        ],
    );
    let mut agent = Agent::start(
        &ns,
        "relay",
        &config(
            r#"stuck_pair_min_idle = "3s"
stuck_pair_threshold = 16
quota_idle_min = "3s""#,
            r#"[[quota]]
name = "relay"
url = "http://127.0.0.1:20080/status"
items = "/endpoints"
port_field = "port"
used_field = "streams"
limit_field = "maxStreams"
poll_interval = "1s"
port_map = { "21000" = 25001 }"#,
        ),
    );
    let relay_status = addr("127.0.0.1:20080");
    let proxy_addr = addr("127.0.0.1:8080");

    // The real path works first: 200 with a body through proxy -> relay -> instance.
    let (code, body) = http_get_in_netns(ns.name(), proxy_addr, "/json", HTTP).unwrap();
    assert_eq!(code, 200, "{body}");
    assert!(body.contains("\"ok\":true"), "{body}");

    // 64 users open a quiet SSE page through the proxy and give up after a second.
    let ab =
        abandon_requests_in_netns(ns.name(), proxy_addr, "/events", 64, Duration::from_secs(1))
            .unwrap();
    assert_eq!((ab.connected, ab.responded), (64, 64), "{ab:?}");
    let streams = || {
        get_json_in_netns(ns.name(), relay_status, "/status", HTTP)
            .ok()
            .and_then(|(_, v)| v["endpoints"][0]["streams"].as_u64())
    };
    assert!(
        wait_until(HTTP, POLL, || (streams() == Some(64)).then_some(())).is_some(),
        "the relay's quota did not fill: streams {:?}",
        streams()
    );
    // The incident's symptom: every new request is refused.
    let (code, body) = http_get_in_netns(ns.name(), proxy_addr, "/json", HTTP).unwrap();
    assert_eq!((code, body.as_str()), (503, "busy"));

    // The receiver learns that the quota is exhausted by a leak, and who holds it.
    let fingerprint = "quota_exhausted_by_leak:relay:21000";
    let post = wait_post(
        &hook,
        &agent,
        "quota_exhausted_by_leak (verdict leak)",
        |b| is(b, "quota_exhausted_by_leak", "firing") && b["verdict"] == "leak",
    );
    let b = &post.body;
    assert_alert_shape(b);
    assert_eq!(b["fingerprint"], fingerprint, "{b:#}");
    assert_eq!(b["service_port"], 21000, "{b:#}");
    assert_eq!(
        b["quota"],
        json!({"name": "relay", "used": 64, "limit": 64}),
        "{b:#}"
    );
    assert_eq!(
        b["count"], 64,
        "64 relay streams on local port 25001: {b:#}"
    );
    let procs = owners(b);
    assert!(
        procs.contains(&(Some(proxy.pid() as u64), "leaky-proxy".into())),
        "the leaky proxy (pid {}) is not named: {b:#}",
        proxy.pid()
    );
    assert!(
        procs.contains(&(Some(relay.pid() as u64), "relay-sim".into())),
        "the relay (pid {}) is not named: {b:#}",
        relay.pid()
    );
    assert!(
        procs
            .iter()
            .all(|(_, c)| c == "leaky-proxy" || c == "relay-sim"),
        "only the two ends of the relay's streams hold them: {b:#}"
    );
    for p in b["processes"].as_array().unwrap() {
        assert_eq!(p["count"], 64, "each side holds 64 sockets: {b:#}");
    }
    let summary = b["summary"].as_str().unwrap();
    assert!(
        summary.starts_with("relay quota on port 21000 at 64/64 (connections on local port 25001); 64 of 64 connections idle"),
        "{summary}"
    );
    assert!(summary.ends_with("verdict: leak"), "{summary}");
    let socks = b["sockets"].as_array().unwrap();
    assert!(!socks.is_empty(), "{b:#}");
    for s in socks {
        assert_eq!(s["state"], "ESTABLISHED", "{s}");
        let on_dial_slot = s["local"] == "127.0.0.1:25001" || s["peer"] == "127.0.0.1:25001";
        assert!(on_dial_slot, "socket not on the dial slot: {s}");
        assert!(
            s["idle_secs"].as_f64().is_some_and(|i| i >= 3.0),
            "not idle ≥ quota_idle_min: {s}"
        );
    }

    // Idle ESTABLISHED pairs: proxy -> relay on the dial slot, relay -> instance on 21000.
    let pairs = wait_post(&hook, &agent, "stuck_established_pairs on 25001", |b| {
        is(b, "stuck_established_pairs", "firing") && b["service_port"] == 25001
    });
    let b = &pairs.body;
    assert_alert_shape(b);
    assert_eq!(b["count"], 64, "{b:#}");
    assert_eq!(
        owners(b),
        vec![
            (Some(proxy.pid() as u64), "leaky-proxy".to_string()),
            (Some(relay.pid() as u64), "relay-sim".to_string())
        ],
        "client (proxy) then server (relay): {b:#}"
    );
    assert_eq!(b["quota"], Value::Null, "{b:#}");
    let inner = wait_post(&hook, &agent, "stuck_established_pairs on 21000", |b| {
        is(b, "stuck_established_pairs", "firing") && b["service_port"] == 21000
    });
    assert_eq!(inner.body["count"], 64, "{:#}", inner.body);
    assert_eq!(
        owners(&inner.body)[0],
        (Some(relay.pid() as u64), "relay-sim".to_string()),
        "{:#}",
        inner.body
    );

    // The API shows the same while it fires.
    let f = agent
        .find("quota_exhausted_by_leak", |f| {
            f["fingerprint"] == fingerprint
        })
        .unwrap_or_else(|| panic!("/v1/findings lacks {fingerprint}: {:#?}", agent.findings()));
    assert_eq!(f["status"], "firing", "{f:#}");
    assert_eq!(f["verdict"], "leak", "{f:#}");
    assert_eq!(
        f["quota"],
        json!({"name": "relay", "used": 64, "limit": 64}),
        "{f:#}"
    );
    assert!(
        names_pid(&f, proxy.pid()) && names_pid(&f, relay.pid()),
        "{f:#}"
    );
    let quotas = agent.get_ok("/v1/quotas");
    let relay_q = quotas["quotas"]
        .as_array()
        .and_then(|qs| qs.iter().find(|q| q["name"] == "relay"))
        .unwrap_or_else(|| panic!("/v1/quotas lacks relay: {quotas:#}"));
    assert_eq!(relay_q["error"], Value::Null, "{relay_q:#}");
    assert_eq!(
        relay_q["url"], "http://127.0.0.1:20080/status",
        "{relay_q:#}"
    );
    assert_eq!(
        relay_q["entries"],
        json!([{"port": 21000, "used": 64, "limit": 64}]),
        "{relay_q:#}"
    );
    let metrics = agent.metrics();
    assert_eq!(
        metric_value(
            &metrics,
            r#"connreap_findings{kind="quota_exhausted_by_leak"}"#
        ),
        Some(1.0),
        "{metrics}"
    );
    assert!(
        metric_value(
            &metrics,
            r#"connreap_findings{kind="stuck_established_pairs"}"#
        )
        .is_some_and(|n| n >= 1.0),
        "{metrics}"
    );
    assert!(
        metric_value(&metrics, r#"connreap_webhook_sends_total{result="ok"}"#)
            .is_some_and(|n| n >= 2.0),
        "{metrics}"
    );
    agent.assert_healthy();

    // Only a restart of the proxy frees the quota: kill it and the alert resolves.
    let killed_at = Instant::now();
    proxy.kill().unwrap();
    assert!(
        wait_until(FINDING, POLL, || (streams() == Some(0)).then_some(())).is_some(),
        "the relay did not release its streams: {:?}",
        streams()
    );
    let resolved = wait_post(&hook, &agent, "quota_exhausted_by_leak resolved", |b| {
        is(b, "quota_exhausted_by_leak", "resolved")
    });
    let b = &resolved.body;
    assert_alert_shape(b);
    assert!(resolved.at > killed_at, "resolved before the proxy died");
    assert_eq!(b["fingerprint"], fingerprint, "{b:#}");
    assert_eq!(b["service_port"], 21000, "{b:#}");
    wait_post(
        &hook,
        &agent,
        "stuck_established_pairs on 25001 resolved",
        |b| is(b, "stuck_established_pairs", "resolved") && b["service_port"] == 25001,
    );
    let gone = wait_until(FINDING, POLL, || {
        agent
            .find("quota_exhausted_by_leak", |_| true)
            .is_none()
            .then_some(())
    });
    assert!(gone.is_some(), "{:#?}", agent.findings());
    assert_eq!(
        agent.metric(r#"connreap_findings{kind="quota_exhausted_by_leak"}"#),
        Some(0.0)
    );
    // Sent once while it fired, then resolved once.
    let mine: Vec<WebhookPost> = hook
        .posts()
        .into_iter()
        .filter(|p| p.body["fingerprint"] == fingerprint)
        .collect();
    let statuses: Vec<&str> = mine
        .iter()
        .map(|p| p.body["status"].as_str().unwrap_or("?"))
        .collect();
    assert_eq!(
        statuses.last(),
        Some(&"resolved"),
        "{}",
        describe(&hook.posts())
    );
    assert_eq!(
        statuses.iter().filter(|s| **s == "resolved").count(),
        1,
        "{}",
        describe(&hook.posts())
    );
    // The chain works again once a proxy runs.
    let _proxy2 = spawn_ready(
        &ns,
        LEAKY_PROXY,
        &[
            "--listen",
            "127.0.0.1:8080",
            "--upstream",
            "127.0.0.1:25001",
        ],
    );
    let (code, body) = http_get_in_netns(ns.name(), proxy_addr, "/json", HTTP).unwrap();
    assert_eq!(code, 200, "{body}");
    assert!(!body.is_empty());
    agent.assert_healthy();
}

// ---------------------------------------------------------------------------------------------
// 2. Pool leak: the server closes idle keep-alives, the client never closes its side.

fn pool_leak(ns_name: &str, port: u16, dial: &str, expected_peer: &str) {
    let Some(_env) = require_privileges() else {
        return;
    };
    let ns = NetNs::new(ns_name);
    let hook = WebhookReceiver::start_in_netns(ns.name(), addr(HOOK)).unwrap();
    let mut agent = Agent::start(
        &ns,
        ns_name,
        &config(
            r#"close_wait_min_age = "3s"
close_wait_threshold = 8"#,
            "",
        ),
    );
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

    let post = wait_post(&hook, &agent, "close_wait_buildup for the client", |b| {
        is(b, "close_wait_buildup", "firing") && names_pid(b, client.pid())
    });
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
        format!("close_wait_buildup:{PEER_COMM}/{}:{port}", client.pid()),
        "{b:#}"
    );
    assert_eq!(b["service_port"], port, "{b:#}");
    assert_eq!(b["count"], 12, "{b:#}");
    assert_eq!(
        owners(b),
        vec![(Some(client.pid() as u64), PEER_COMM.to_string())],
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
            "{PEER_COMM} pid {} holds 12 CLOSE_WAIT sockets to {expected_peer}:{port} (service port {port})",
            client.pid()
        )),
        "{summary}"
    );
    let socks = b["sockets"].as_array().unwrap();
    assert_eq!(socks.len(), 12, "{b:#}");
    let locals: Vec<&str> = ready.get("locals").split(',').collect();
    for s in socks {
        assert_eq!(s["state"], "CLOSE_WAIT", "{s}");
        assert_eq!(s["peer"], format!("{expected_peer}:{port}"), "{s}");
        assert_eq!(s["pid"], client.pid(), "{s}");
        assert_eq!(s["comm"], PEER_COMM, "{s}");
        let local = s["local"].as_str().unwrap();
        assert!(locals.contains(&local), "{local} is not one of {locals:?}");
        assert!(s["age_secs"].as_f64().is_some_and(|a| a >= 3.0), "{s}");
    }

    // The API agrees; nobody else is blamed: not the server that closed, not the small pool.
    let findings = agent.findings();
    let cw: Vec<&Value> = findings
        .iter()
        .filter(|f| f["kind"] == "close_wait_buildup")
        .collect();
    assert_eq!(cw.len(), 1, "{findings:#?}");
    assert_eq!(cw[0]["fingerprint"], b["fingerprint"], "{findings:#?}");
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
    // The socket table over the API, with snapshot's filters: the client's 12 CLOSE_WAIT
    // sockets, each with its owner; a bad filter is a 400 that names it.
    let path = format!("/v1/sockets?state=CLOSE_WAIT&pid={}", client.pid());
    let list = agent.get_ok(&path);
    assert_eq!(list["count"], 12, "GET {path}: {list:#}");
    let rows = list["sockets"].as_array().unwrap();
    assert_eq!(rows.len(), 12, "GET {path}: {list:#}");
    for s in rows {
        assert_eq!(
            (&s["state"], &s["pid"], &s["comm"], &s["service_port"]),
            (
                &Value::from("CLOSE_WAIT"),
                &Value::from(client.pid()),
                &Value::from(PEER_COMM),
                &Value::from(port)
            ),
            "{s}"
        );
        let local = s["local"].as_str().unwrap();
        assert!(locals.contains(&local), "{local} is not one of {locals:?}");
    }
    let (code, bad) = agent.get("/v1/sockets?state=BOGUS");
    assert_eq!(code, 400, "{bad}");
    assert!(
        bad["error"].as_str().is_some_and(|e| e.contains("BOGUS")),
        "{bad}"
    );
    agent.assert_healthy();

    // The client releases its pool (restart): resolved.
    let fingerprint = b["fingerprint"].clone();
    client.kill();
    let resolved = wait_post(&hook, &agent, "close_wait_buildup resolved", |b| {
        is(b, "close_wait_buildup", "resolved") && b["fingerprint"] == fingerprint
    });
    assert_alert_shape(&resolved.body);
    assert!(
        hook.posts()
            .iter()
            .all(|p| !names_pid(&p.body, small.pid()) && !names_pid(&p.body, server.pid())),
        "{}",
        describe(&hook.posts())
    );
    agent.assert_healthy();
}

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

// ---------------------------------------------------------------------------------------------
// 3. Reconnect storm.

#[test]
fn reconnect_storm_names_the_process_and_port() {
    let Some(_env) = require_privileges() else {
        return;
    };
    let ns = NetNs::new("storm");
    let hook = WebhookReceiver::start_in_netns(ns.name(), addr(HOOK)).unwrap();
    let mut agent = Agent::start(
        &ns,
        "storm",
        &config(
            r#"storm_rate = 50.0
storm_growth_windows = 2"#,
            "",
        ),
    );
    let (_server, _) = peer(
        &ns,
        &[
            "listen",
            "--addr",
            "127.0.0.1:7500",
            "--close-after-ms",
            "0",
        ],
    );
    // A client whose reconnects double every second, 20/s up to 320/s, for 12 s; and a
    // polite one that also grows but stays below the rate (1/s up to 16/s).
    let (storm, _) = peer(
        &ns,
        &[
            "storm",
            "--addr",
            "127.0.0.1:7500",
            "--start-rate",
            "20",
            "--max-rate",
            "320",
            "--duration-ms",
            "12000",
        ],
    );
    let started = Instant::now();
    let (polite, _) = peer(
        &ns,
        &[
            "storm",
            "--addr",
            "127.0.0.1:7500",
            "--start-rate",
            "1",
            "--max-rate",
            "16",
            "--duration-ms",
            "12000",
        ],
    );

    let post = wait_post(
        &hook,
        &agent,
        "reconnect_storm for the storming client",
        |b| is(b, "reconnect_storm", "firing") && names_pid(b, storm.pid()),
    );
    let b = &post.body;
    assert_alert_shape(b);
    assert!(
        post.at.duration_since(started) >= Duration::from_secs(2),
        "needs three growing windows at 1 s scans: fired after {:?}",
        post.at.duration_since(started)
    );
    assert_eq!(
        b["fingerprint"],
        format!("reconnect_storm:{PEER_COMM}/{}:7500", storm.pid()),
        "{b:#}"
    );
    assert_eq!(b["service_port"], 7500, "{b:#}");
    assert_eq!(
        owners(b),
        vec![(Some(storm.pid() as u64), PEER_COMM.to_string())],
        "{b:#}"
    );
    let rate = b["rate_per_sec"].as_f64().unwrap_or(0.0);
    assert!(
        (50.0..=400.0).contains(&rate),
        "rate {rate}/s should be ≥ storm_rate and ≤ what the client can do: {b:#}"
    );
    let summary = b["summary"].as_str().unwrap();
    assert!(
        summary.contains(&format!(
            "{PEER_COMM} pid {} opens {rate:.0} new connections/s to port 7500",
            storm.pid()
        )),
        "{summary}"
    );

    // While it fires: the API shows it, the polite client is never a storm.
    let f = agent
        .find("reconnect_storm", |f| names_pid(f, storm.pid()))
        .unwrap_or_else(|| panic!("/v1/findings lacks the storm: {:#?}", agent.findings()));
    assert!(
        f["rate_per_sec"].as_f64().is_some_and(|r| r >= 50.0),
        "{f:#}"
    );
    assert!(
        agent
            .find("reconnect_storm", |f| names_pid(f, polite.pid()))
            .is_none(),
        "{:#?}",
        agent.findings()
    );
    assert!(agent
        .metric(r#"connreap_findings{kind="reconnect_storm"}"#)
        .is_some_and(|n| n >= 1.0));
    agent.assert_healthy();

    // The storm stops after 12 s: the alert resolves.
    let resolved = wait_post(&hook, &agent, "reconnect_storm resolved", |b| {
        is(b, "reconnect_storm", "resolved") && names_pid(b, storm.pid())
    });
    assert_alert_shape(&resolved.body);
    assert!(
        resolved.at.duration_since(started) >= Duration::from_secs(11),
        "resolved while the storm still ran: {:?}",
        resolved.at.duration_since(started)
    );
    assert!(
        hook.posts()
            .iter()
            .all(|p| !names_pid(&p.body, polite.pid())),
        "{}",
        describe(&hook.posts())
    );
    agent.assert_healthy();
}

/// The tracker sends transitions in per-CPU batches of 32; a process that opens only a handful
/// of connections must still be seen within a drain (the daemon flushes partial batches on every
/// CPU before each read), not whenever some batch happens to fill. With a storm threshold of
/// 0.5 connections/s and no growth required, three connects from this test process must reach
/// the webhook as a reconnect_storm within a few seconds, while nothing else polls the agent.
#[test]
fn a_few_transitions_reach_the_daemon_without_waiting_for_a_full_batch() {
    let Some(_env) = require_privileges() else {
        return;
    };
    let ns = NetNs::new("flush");
    let hook = WebhookReceiver::start_in_netns(ns.name(), addr(HOOK)).unwrap();
    let mut agent = Agent::start(
        &ns,
        "flush",
        &config(
            r#"storm_rate = 0.5
storm_growth_windows = 0"#,
            "",
        ),
    );
    // Quiet: no API polling from here on, so no other connections fill the batches.
    std::thread::sleep(Duration::from_secs(3));
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let me = std::process::id();
    let mut held = Vec::new();
    for _ in 0..3 {
        held.push(std::net::TcpStream::connect(("127.0.0.1", port)).unwrap());
        held.push(listener.accept().unwrap().0);
    }
    let made = Instant::now();
    let post = hook.wait_for_body(Duration::from_secs(6), |b| {
        is(b, "reconnect_storm", "firing") && names_pid(b, me) && b["service_port"] == port
    });
    agent.assert_alive();
    assert!(
        post.is_some(),
        "3 connects to port {port} by pid {me} never reached the storm detector within {:?}: partial per-CPU batches are not flushed; posts:\n{}\nagent stderr:\n{}",
        made.elapsed(),
        describe(&hook.posts()),
        agent.stderr()
    );
    // They came through the flush, not through a batch that other traffic happened to fill.
    let flushed = agent
        .metric("connreap_event_batches_flushed_total")
        .unwrap_or(0.0);
    assert!(
        flushed >= 1.0,
        "connreap_event_batches_flushed_total = {flushed}: the storm was seen, but no partial batch was flushed"
    );
    drop(held);
    // The kernel side's memory is visible: the event ring (4 MiB) and the state map's buckets.
    for (map, at_least) in [("events", 4 << 20), ("state", 1 << 20)] {
        let series = format!(r#"connreap_bpf_map_memory_bytes{{map="{map}"}}"#);
        let bytes = agent.metric(&series).unwrap_or(0.0);
        assert!(bytes >= at_least as f64, "{series} = {bytes}");
    }
    // So are transitions the kernel skipped (a tracker run nested in another on one CPU).
    let misses = r#"connreap_bpf_program_recursion_misses{program="connreap_set_state"}"#;
    assert!(
        agent.metric(misses).is_some_and(|n| n >= 0.0),
        "{misses} missing from /metrics"
    );
    agent.assert_healthy();
}

// ---------------------------------------------------------------------------------------------
// 4. Webhook receiver down for a while, then up.

#[test]
fn webhook_delivery_is_retried_until_the_receiver_is_up() {
    let Some(_env) = require_privileges() else {
        return;
    };
    let ns = NetNs::new("hookdown");
    let hook = WebhookReceiver::new_stopped_in_netns(ns.name(), addr(HOOK));
    let (cw, _) = peer(
        &ns,
        &["close-wait", "--addr", "127.0.0.1:7600", "--count", "2"],
    );
    let mut agent = Agent::start(
        &ns,
        "hookdown",
        &config(
            r#"close_wait_min_age = "1s"
close_wait_threshold = 2"#,
            "",
        ),
    );

    // The finding fires while nobody listens on the webhook URL.
    let f = wait_until(FINDING, POLL, || {
        agent.assert_healthy();
        agent.find("close_wait_buildup", |f| names_pid(f, cw.pid()))
    })
    .unwrap_or_else(|| panic!("no close_wait_buildup: {:#?}", agent.findings()));
    assert_eq!(f["service_port"], 7600, "{f:#}");
    // Deliveries fail and are retried (1 s, then 2 s apart); the agent stays healthy.
    let errors = r#"connreap_webhook_sends_total{result="error"}"#;
    let retried = wait_until(FINDING, POLL, || {
        agent.assert_healthy();
        agent.metric(errors).filter(|n| *n >= 3.0)
    });
    assert!(
        retried.is_some(),
        "no failed deliveries counted: {}",
        agent.metrics()
    );
    let (_, health) = agent.get("/healthz");
    assert!(
        health["webhook_queued"].as_u64().is_some_and(|n| n >= 1),
        "the undelivered alert is queued: {health}"
    );
    assert_eq!(hook.count(), 0);

    // Receiver up: the queued alert arrives (within the 2 s max backoff plus a scan or two).
    let up_at = Instant::now();
    hook.restart().unwrap();
    let post = wait_post(&hook, &agent, "the queued close_wait_buildup", |b| {
        is(b, "close_wait_buildup", "firing")
    });
    assert!(post.at >= up_at);
    assert!(
        post.at.duration_since(up_at) < Duration::from_secs(8),
        "took {:?} after the receiver came up",
        post.at.duration_since(up_at)
    );
    let b = &post.body;
    assert_alert_shape(b);
    assert_eq!(b["service_port"], 7600, "{b:#}");
    assert_eq!(
        owners(b),
        vec![(Some(cw.pid() as u64), PEER_COMM.to_string())],
        "{b:#}"
    );
    assert_eq!(post.content_type.as_deref(), Some("application/json"));
    assert_eq!(post.path, "/alerts");
    let delivered = wait_until(FINDING, POLL, || {
        let h = agent.get_ok("/healthz");
        (h["webhook_queued"] == 0).then_some(())
    });
    assert!(delivered.is_some(), "{}", agent.get_ok("/healthz"));
    let metrics = agent.metrics();
    assert!(
        metric_value(&metrics, errors).is_some_and(|n| n >= 3.0),
        "{metrics}"
    );
    assert!(
        metric_value(&metrics, r#"connreap_webhook_sends_total{result="ok"}"#)
            .is_some_and(|n| n >= 1.0),
        "{metrics}"
    );
    assert_eq!(
        metric_value(&metrics, "connreap_webhook_dropped_total"),
        Some(0.0),
        "{metrics}"
    );

    // Retries did not duplicate it: one firing, then (sockets gone) one resolved.
    let fingerprint = b["fingerprint"].clone();
    drop(cw);
    wait_post(&hook, &agent, "close_wait_buildup resolved", |b| {
        is(b, "close_wait_buildup", "resolved") && b["fingerprint"] == fingerprint
    });
    let statuses: Vec<Value> = hook
        .posts()
        .iter()
        .filter(|p| p.body["fingerprint"] == fingerprint)
        .map(|p| p.body["status"].clone())
        .collect();
    assert_eq!(
        statuses,
        [json!("firing"), json!("resolved")],
        "{}",
        describe(&hook.posts())
    );
    agent.assert_healthy();
}

// ---------------------------------------------------------------------------------------------
// 5. A quota source that fails in every way.

/// Polls /v1/findings (checking /healthz every time) until quota_source_unavailable's reason
/// contains `needle`.
fn reason_with(agent: &mut Agent, source: &QuotaServer, needle: &str) -> Value {
    wait_until(FINDING, POLL, || {
        agent.assert_healthy();
        agent.find("quota_source_unavailable", |f| {
            f["reason"].as_str().is_some_and(|r| r.contains(needle))
        })
    })
    .unwrap_or_else(|| {
        panic!(
            "no quota_source_unavailable with a reason containing {needle:?} (source mode {:?}, {} polls); findings: {:#?}\nagent stderr:\n{}",
            source.mode(),
            source.hits(),
            agent.findings(),
            agent.stderr()
        )
    })
}

#[test]
fn quota_source_unavailable_names_each_reason_and_never_crashes() {
    let Some(_env) = require_privileges() else {
        return;
    };
    let ns = NetNs::new("quotabad");
    let hook = WebhookReceiver::start_in_netns(ns.name(), addr(HOOK)).unwrap();
    let source =
        QuotaServer::start_in_netns(ns.name(), addr("127.0.0.1:20080"), QuotaMode::Http500)
            .unwrap();
    let mut agent = Agent::start(
        &ns,
        "quotabad",
        &config(
            "",
            r#"[[quota]]
name = "relay"
url = "http://127.0.0.1:20080/status"
items = "/endpoints"
port_field = "port"
used_field = "streams"
limit_field = "maxStreams"
poll_interval = "1s"
timeout = "1s""#,
        ),
    );
    let fingerprint = "quota_source_unavailable:relay";

    // 1. HTTP 500.
    let f = reason_with(&mut agent, &source, "500");
    assert_eq!(f["fingerprint"], fingerprint, "{f:#}");
    assert_eq!(f["status"], "firing", "{f:#}");
    let reason = f["reason"].as_str().unwrap();
    assert!(
        reason.contains("http://127.0.0.1:20080/status") && reason.contains("HTTP 500"),
        "{reason}"
    );
    assert!(
        f["summary"].as_str().unwrap().contains(reason),
        "the summary carries the reason: {f:#}"
    );
    let post = wait_post(&hook, &agent, "quota_source_unavailable firing", |b| {
        is(b, "quota_source_unavailable", "firing")
    });
    assert_alert_shape(&post.body);
    assert_eq!(post.body["fingerprint"], fingerprint);
    assert!(
        post.body["reason"]
            .as_str()
            .is_some_and(|r| r.contains("500")),
        "{:#}",
        post.body
    );
    let q = agent.get_ok("/v1/quotas");
    assert!(
        q["quotas"][0]["error"]
            .as_str()
            .is_some_and(|e| e.contains("500")),
        "{q:#}"
    );

    // 2. 200 with a body that is not JSON.
    source.set_mode(QuotaMode::Garbage);
    let f = reason_with(&mut agent, &source, "not JSON");
    assert_eq!(f["fingerprint"], fingerprint, "{f:#}");
    assert!(
        f["reason"].as_str().unwrap().contains("<html>502 oops"),
        "the reason quotes the start of the body: {f:#}"
    );

    // 3. JSON without the configured pointer.
    source.set_mode(QuotaMode::JsonWithoutEndpoints);
    let f = reason_with(&mut agent, &source, "not found");
    assert!(
        f["reason"].as_str().unwrap().contains("`/endpoints`"),
        "the reason names the pointer: {f:#}"
    );

    // 4. No answer at all.
    source.set_mode(QuotaMode::Hang);
    let f = reason_with(&mut agent, &source, "no answer within 1s");
    assert_eq!(f["fingerprint"], fingerprint, "{f:#}");

    // One problem, one alert: the changing reason did not re-send it.
    let firing = hook
        .posts()
        .iter()
        .filter(|p| is(&p.body, "quota_source_unavailable", "firing"))
        .count();
    assert_eq!(firing, 1, "{}", describe(&hook.posts()));

    // The source recovers: resolved, and /v1/quotas shows its entries.
    source.set_json(relay_status_json(
        &[EndpointStatus {
            port: 21000,
            dial_port: 25001,
            streams: 3,
            max_streams: 64,
        }],
        0,
        0,
        3,
    ));
    let resolved = wait_post(&hook, &agent, "quota_source_unavailable resolved", |b| {
        is(b, "quota_source_unavailable", "resolved")
    });
    assert_alert_shape(&resolved.body);
    assert_eq!(resolved.body["fingerprint"], fingerprint);
    let q = wait_until(FINDING, POLL, || {
        let q = agent.get_ok("/v1/quotas");
        (q["quotas"][0]["error"].is_null()).then_some(q)
    })
    .expect("the quota error never cleared");
    assert_eq!(
        q["quotas"][0]["entries"],
        json!([{"port": 21000, "used": 3, "limit": 64}]),
        "{q:#}"
    );
    assert!(agent.find("quota_source_unavailable", |_| true).is_none());
    agent.assert_healthy();
    assert!(!agent.stderr().contains("panicked"), "{}", agent.stderr());
}

// ---------------------------------------------------------------------------------------------
// Invalid configuration.

#[test]
fn invalid_config_exits_78_naming_file_line_and_key() {
    let Some(_env) = require_privileges() else {
        return;
    };
    let ns = NetNs::new("badcfg");
    let cases = [
        // (file text, line, key)
        (
            "[agent]\nscan_interval = \"1s\"\n\n[detect]\nclose_wait_threshhold = 3\n",
            5,
            "close_wait_threshhold",
        ),
        (
            "[agent]\nlisten = \"127.0.0.1:9477\"\nscan_interval = \"soon\"\n",
            3,
            "scan_interval",
        ),
        (
            "[agent]\nscan_interval = \"1s\"\n\n[detect]\nclose_wait_threshold = 4\nquota_saturation = 1.5\n",
            6,
            "quota_saturation",
        ),
        (
            "[agent]\nscan_interval = \"1s\"\n\n[[webhook]]\nurl = \"http://127.0.0.1:9999/a\"\n\n[[webhook]]\nformat = \"json\"\nurl = \"ftp://example\"\n",
            9,
            "url",
        ),
    ];
    for (text, line, key) in cases {
        let cfg = TempConfig::new("bad", text);
        let path = cfg.arg();
        let out = run(&mut ns.connreap(["check-config", &path]), CONNREAP_TIMEOUT);
        let ctx = format!("connreap check-config on\n{text}\n-> {out:?}");
        assert_eq!(out.status.code(), Some(78), "{ctx}");
        assert!(!out.stderr.contains("panicked"), "{ctx}");
        assert!(out.stderr.contains(&path), "must name the file: {ctx}");
        assert!(
            out.stderr.contains(&format!("{path}:{line}:")),
            "must name line {line} as {path}:{line}: {ctx}"
        );
        assert!(out.stderr.contains(key), "must name the key `{key}`: {ctx}");

        // `run` refuses to start with it, with the same message and exit code.
        let out = run(
            &mut ns.connreap(["run", "--config", &path]),
            CONNREAP_TIMEOUT,
        );
        let ctx = format!("connreap run --config on\n{text}\n-> {out:?}");
        assert_eq!(out.status.code(), Some(78), "{ctx}");
        assert!(out.stderr.contains(&format!("{path}:{line}:")), "{ctx}");
        assert!(out.stderr.contains(key), "{ctx}");
    }
    assert!(
        http_get_in_netns(ns.name(), addr(API), "/healthz", HTTP).is_err(),
        "nothing may listen after a refused start"
    );

    // A good file passes; the example with every default passes.
    let good = TempConfig::new("good", &config("close_wait_threshold = 4", ""));
    let out = run(
        &mut ns.connreap(["check-config", &good.arg()]),
        CONNREAP_TIMEOUT,
    );
    assert!(out.status.success(), "{out:?}");
    assert!(
        out.stdout.contains(&good.arg()) && out.stdout.contains("1 webhooks"),
        "{out:?}"
    );
    let example = Path::new(env!("CARGO_MANIFEST_DIR")).join("../connreap.example.toml");
    let out = run(
        &mut ns.connreap([Path::new("check-config"), example.as_path()]),
        CONNREAP_TIMEOUT,
    );
    assert!(out.status.success(), "{out:?}");
}
