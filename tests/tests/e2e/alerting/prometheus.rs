//! A real Prometheus (Debian's `prometheus` package) scrapes the agent every second with
//! deploy/prometheus/connreap-rules.yml loaded, while a pool leak (incident 2) piles up
//! CLOSE_WAIT sockets: PromQL over its HTTP API sees the finding gauge, the rules are loaded
//! and healthy, and ConnreapFinding fires. On the way: /metrics answers both exposition
//! formats, and the agent logs JSON lines whose webhook failures name their cause.

use std::{
    net::SocketAddr,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::Duration,
};

use connreap_tests::{
    fixtures::{get_json_in_netns, http_request_ns},
    harness::{
        peer, require_privileges, wait_until, Agent, Child, Config, NetNs, TempDir, API, FINDING,
        HTTP, PEER_COMM, POLL,
    },
};
use serde_json::Value;

/// Prometheus's web listener, inside the test's namespace.
const PROMETHEUS: &str = "127.0.0.1:9090";
/// A webhook nobody listens on: every delivery is refused.
const DEAD_HOOK: &str = "http://127.0.0.1:9/hook";

fn rules_file() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../deploy/prometheus/connreap-rules.yml")
        .components()
        .collect()
}

/// Whether Debian's `prometheus` is installed (`cargo xtask test` installs it). Missing, the
/// test is skipped, except under `CI=true`.
fn have_prometheus() -> bool {
    let ok = Command::new("prometheus")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        assert!(
            std::env::var("CI").map_or(true, |v| v != "true" && v != "1"),
            "CI=true but the prometheus binary is missing (cargo xtask test installs it)"
        );
        println!("skipped: the prometheus binary is not installed (apt-get install prometheus)");
    }
    ok
}

/// `prometheus` in `ns` scraping the agent's API every second and evaluating the shipped rules
/// every second, its data in `dir`; ready when `/-/ready` answers 200.
fn start_prometheus(ns: &NetNs, dir: &TempDir) -> Child {
    let config = dir.write(
        "prometheus.yml",
        &format!(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n\
             rule_files:\n  - {}\n\
             scrape_configs:\n  - job_name: connreap\n    static_configs:\n      - targets: ['{API}']\n",
            rules_file().display()
        ),
    );
    let mut cmd = ns.command("prometheus");
    cmd.arg(format!("--config.file={}", config.display()))
        .arg(format!(
            "--storage.tsdb.path={}",
            dir.path("tsdb").display()
        ))
        .arg(format!("--web.listen-address={PROMETHEUS}"))
        .arg("--log.level=warn");
    let mut prom = Child::spawn(&mut cmd, "prometheus");
    let ready = wait_until(Duration::from_secs(20), POLL, || {
        if let Some(status) = prom.try_wait() {
            panic!("prometheus exited ({status}): {}", prom.stderr());
        }
        http_request_ns(
            Some(ns.name()),
            addr(PROMETHEUS),
            "GET",
            "/-/ready",
            &[],
            &[],
            HTTP,
        )
        .ok()
        .filter(|r| r.status == 200)
    });
    assert!(ready.is_some(), "prometheus not ready: {}", prom.stderr());
    prom
}

fn addr(s: &str) -> SocketAddr {
    s.parse().expect("a socket address")
}

/// `GET path` on Prometheus's API: its `data`, which must come with status success.
fn api(ns: &NetNs, path: &str) -> Value {
    let (code, body) = get_json_in_netns(ns.name(), addr(PROMETHEUS), path, HTTP)
        .unwrap_or_else(|e| panic!("GET {path} on prometheus: {e}"));
    assert_eq!(
        (code, body["status"].as_str()),
        (200, Some("success")),
        "GET {path}: {body}"
    );
    body["data"].clone()
}

/// An instant PromQL query: every (labels, value) of its vector result.
fn query(ns: &NetNs, promql: &str) -> Vec<(Value, f64)> {
    let data = api(
        ns,
        &format!("/api/v1/query?query={}", percent_encode(promql)),
    );
    assert_eq!(data["resultType"], "vector", "{promql}: {data}");
    data["result"]
        .as_array()
        .unwrap_or_else(|| panic!("{promql}: {data}"))
        .iter()
        .map(|r| {
            let v = r["value"][1].as_str().and_then(|v| v.parse().ok());
            (r["metric"].clone(), v.unwrap_or(f64::NAN))
        })
        .collect()
}

fn percent_encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            b => format!("%{b:02X}"),
        })
        .collect()
}

#[test]
fn prometheus_scrapes_findings_and_evaluates_the_shipped_rules() {
    let Some(_env) = require_privileges() else {
        return;
    };
    if !have_prometheus() {
        return;
    }
    let ns = NetNs::new("prom");
    let dir = TempDir::new("prom");
    let config = Config::new(&dir)
        .detect("close_wait_min_age = \"3s\"\nclose_wait_threshold = 8")
        .webhook(DEAD_HOOK)
        .log_format("json");
    let mut agent = Agent::start(&ns, &dir, &config);
    assert_exposition_formats(&ns);
    let prom = start_prometheus(&ns, &dir);

    // Incident 2: the backend closes idle keep-alives after 1 s, the client never closes its
    // 12 pooled connections.
    let (_server, _) = peer(
        &ns,
        &[
            "listen",
            "--addr",
            "127.0.0.1:7450",
            "--close-after-ms",
            "1000",
        ],
    );
    let (client, ready) = peer(
        &ns,
        &["connect", "--addr", "127.0.0.1:7450", "--count", "12"],
    );
    assert_eq!(ready.get("count"), "12");

    let finding = r#"connreap_findings{kind="close_wait_buildup"}"#;
    let seen = wait_until(FINDING, POLL, || {
        agent.assert_alive();
        let r = query(&ns, finding);
        r.first().filter(|(_, v)| *v == 1.0).map(|(m, _)| m.clone())
    })
    .unwrap_or_else(|| {
        panic!(
            "{finding} never was 1 in Prometheus: {:?}; agent findings: {:#?}; prometheus: {}",
            query(&ns, finding),
            agent.findings(),
            prom.stderr()
        )
    });
    assert_eq!(seen["job"], "connreap", "{seen}");
    assert_eq!(seen["instance"], API, "{seen}");
    assert_rules_loaded_and_firing(&ns);
    assert_agent_series(&ns);
    assert_json_logs(&agent, client.pid(), ns.name());
    agent.assert_alive();
}

/// /metrics: the Prometheus text format (counter families named `_total`, no `# EOF`) by
/// default, for `*/*` and when asked for text/plain; OpenMetrics when asked for it, as
/// Prometheus's Accept header does.
fn assert_exposition_formats(ns: &NetNs) {
    let get = |accept: Option<&str>| {
        let headers: Vec<(&str, &str)> = accept.map(|a| ("Accept", a)).into_iter().collect();
        let r = http_request_ns(
            Some(ns.name()),
            addr(API),
            "GET",
            "/metrics",
            &headers,
            &[],
            HTTP,
        )
        .unwrap_or_else(|e| panic!("GET /metrics: {e}"));
        assert_eq!(r.status, 200);
        (r.header("content-type").unwrap_or("").to_string(), r.text())
    };
    for accept in [None, Some("*/*")] {
        let (ct, _) = get(accept);
        assert_eq!(ct, "text/plain; version=0.0.4; charset=utf-8", "{accept:?}");
    }
    let (ct, om) = get(Some("application/openmetrics-text"));
    assert!(
        ct.starts_with("application/openmetrics-text; version=1.0.0"),
        "{ct}"
    );
    assert!(om.ends_with("# EOF\n"), "{om}");
    assert!(om.contains("# TYPE connreap_scan_errors counter\n"), "{om}");
    let (ct, _) = get(Some(
        "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5,*/*;q=0.1",
    ));
    assert!(ct.starts_with("application/openmetrics-text"), "{ct}");
    let (ct, text) = get(Some("text/plain; version=0.0.4"));
    assert_eq!(ct, "text/plain; version=0.0.4; charset=utf-8");
    assert!(!text.contains("# EOF"), "{text}");
    assert!(
        text.contains("# TYPE connreap_scan_errors_total counter\n"),
        "{text}"
    );
    assert!(
        text.contains("# TYPE connreap_build_info gauge\n"),
        "{text}"
    );
}

/// GET /api/v1/rules: the shipped group with all its rules healthy, and ConnreapFinding
/// firing for the leak.
fn assert_rules_loaded_and_firing(ns: &NetNs) {
    let firing = wait_until(Duration::from_secs(10), POLL, || {
        let data = api(ns, "/api/v1/rules?type=alert");
        let group = data["groups"]
            .as_array()
            .and_then(|g| g.iter().find(|g| g["name"] == "connreap"))
            .cloned()
            .unwrap_or_else(|| panic!("no connreap rule group: {data:#}"));
        let rules = group["rules"].as_array().cloned().unwrap_or_default();
        assert_eq!(rules.len(), 11, "{group:#}");
        for r in &rules {
            assert_eq!(r["health"], "ok", "{r:#}");
        }
        let finding = rules
            .iter()
            .find(|r| r["name"] == "ConnreapFinding")
            .unwrap_or_else(|| panic!("no ConnreapFinding rule: {group:#}"));
        (finding["state"] == "firing").then(|| finding["alerts"].clone())
    })
    .unwrap_or_else(|| {
        panic!(
            "ConnreapFinding never fired: {:#}",
            api(ns, "/api/v1/rules")
        )
    });
    let alerts = firing.as_array().cloned().unwrap_or_default();
    assert_eq!(alerts.len(), 1, "{firing:#}");
    assert_eq!(
        alerts[0]["labels"]["kind"], "close_wait_buildup",
        "{firing:#}"
    );
    assert_eq!(alerts[0]["labels"]["severity"], "warning", "{firing:#}");
    assert_eq!(
        alerts[0]["annotations"]["summary"],
        format!("1 close_wait_buildup finding(s) on {API}"),
        "{firing:#}"
    );
}

/// What else Prometheus got from the agent: the build, its health, and the webhook counters
/// by receiver (the dead hook failed at least once).
fn assert_agent_series(ns: &NetNs) {
    let build = query(ns, "connreap_build_info");
    assert_eq!(build.len(), 1, "{build:?}");
    assert_eq!(build[0].1, 1.0);
    assert!(
        build[0].0["version"].is_string() && build[0].0["commit"].is_string(),
        "{build:?}"
    );
    assert_eq!(query(ns, r#"up{job="connreap"}"#)[0].1, 1.0);
    let errors =
        format!(r#"connreap_webhook_sends_total{{receiver="{DEAD_HOOK}",result="error"}}"#);
    let failed = wait_until(Duration::from_secs(10), POLL, || {
        query(ns, &errors)
            .first()
            .map(|(_, v)| *v)
            .filter(|v| *v >= 1.0)
    });
    assert!(failed.is_some(), "{errors}: {:?}", query(ns, &errors));
}

/// `log_format = "json"`: every line the agent wrote is a JSON object with a level and a
/// message, the refused webhook deliveries say so in `cause`, and the firing line carries the
/// finding's owner and place as fields a log tool can filter on (values, not debug text).
fn assert_json_logs(agent: &Agent, client: u32, netns: &str) {
    let stderr = agent.stderr();
    let lines: Vec<Value> = stderr
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect();
    assert!(!lines.is_empty(), "the agent logged nothing");
    for l in &lines {
        assert!(l["level"].is_string() && l["message"].is_string(), "{l}");
    }
    let refused = lines
        .iter()
        .find(|l| l["message"] == "webhook delivery failed; will retry")
        .unwrap_or_else(|| panic!("no failed delivery logged:\n{stderr}"));
    assert_eq!(refused["cause"], "connection refused", "{refused}");
    assert_eq!(refused["receiver"], DEAD_HOOK, "{refused}");
    assert_eq!(refused["level"], "WARN", "{refused}");
    let firing = lines
        .iter()
        .find(|l| {
            l["kind"] == "close_wait_buildup"
                && l["message"]
                    .as_str()
                    .is_some_and(|m| m.starts_with("firing: "))
        })
        .unwrap_or_else(|| panic!("no firing line for close_wait_buildup:\n{stderr}"));
    assert_eq!(firing["pid"], u64::from(client), "{firing}");
    assert_eq!(firing["comm"], PEER_COMM, "{firing}");
    assert_eq!(firing["port"], 7450, "{firing}");
    assert_eq!(firing["netns"], netns, "{firing}");
    assert_eq!(firing["count"], 12, "{firing}");
    assert!(
        firing.get("container").is_none() && firing.get("pod").is_none(),
        "no container here: fields without a value are left out: {firing}"
    );
}
