//! connreap posting to a real Alertmanager (Debian's `prometheus-alertmanager`, started by the
//! test on loopback in its namespace), which routes to a webhook receiver: the pool-leak
//! alert arrives with identity labels and no pid, survives an Alertmanager restart (connreap
//! re-posts every `alertmanager_resend`), and resolves when the leak ends.

use std::{
    net::SocketAddr,
    path::Path,
    process::Command,
    time::{Duration, Instant},
};

use connreap_tests::{
    fixtures::{get_json_in_netns, WebhookReceiver},
    harness::{
        alerts::receiver, peer, require_privileges, wait_until, Agent, Child, Config, NetNs,
        TempDir, HOST, HTTP, PEER_COMM, POLL,
    },
};
use serde_json::Value;

const ALERTMANAGER: &str = "/usr/bin/prometheus-alertmanager";
const AM: &str = "127.0.0.1:9093";
const RESEND: Duration = Duration::from_secs(2);

#[test]
fn alerts_reach_alertmanager_survive_its_restart_and_resolve() {
    let Some(_env) = require_privileges() else {
        return;
    };
    if !Path::new(ALERTMANAGER).exists() {
        // `cargo xtask test` installs it; a plain `cargo test` on another machine may not.
        assert!(
            std::env::var("CI").is_err(),
            "{ALERTMANAGER} missing under CI"
        );
        eprintln!(
            "skipped: {ALERTMANAGER} not installed (apt-get install prometheus-alertmanager)"
        );
        return;
    }
    let ns = NetNs::new("am");
    let dir = TempDir::new("am");
    let hook = receiver(&ns);
    let mut am = start_alertmanager(&ns, &dir, "data1");
    let config = Config::alerting(&dir)
        .alertmanager(&format!("http://{AM}/api/v2/alerts"))
        .alerts(&format!("alertmanager_resend = \"{}s\"", RESEND.as_secs()))
        .detect("close_wait_min_age = \"3s\"\nclose_wait_threshold = 8");
    let agent = Agent::start(&ns, &dir, &config);
    let (_server, _) = peer(
        &ns,
        &[
            "listen",
            "--addr",
            "127.0.0.1:7402",
            "--close-after-ms",
            "1000",
        ],
    );
    let (client, _) = peer(
        &ns,
        &["connect", "--addr", "127.0.0.1:7402", "--count", "12"],
    );

    let alert = wait_for_alert(&ns, &agent, "the leak's alert", |a| a.is_some());
    assert_identity(&alert, client.pid());
    // Alertmanager routed it to its webhook receiver.
    wait_for_am_post(&hook, &agent, "firing");

    // A restarted Alertmanager (its state gone) has the alert back within a resend interval
    // and a scan, because connreap re-posts firing alerts.
    am.kill();
    am = start_alertmanager(&ns, &dir, "data2");
    let restarted = Instant::now();
    wait_for_alert(&ns, &agent, "the alert after a restart", |a| a.is_some());
    assert!(
        restarted.elapsed() <= RESEND * 3 + Duration::from_secs(3),
        "back after {:?}",
        restarted.elapsed()
    );

    // The leak ends: the alert resolves in Alertmanager, which tells its receiver.
    client.kill();
    wait_for_alert(&ns, &agent, "the alert to resolve", |a| a.is_none());
    wait_for_am_post(&hook, &agent, "resolved");
    am.kill();
}

fn start_alertmanager(ns: &NetNs, dir: &TempDir, data: &str) -> Child {
    let config = dir.write(
        "alertmanager.yml",
        "route:\n  receiver: hook\n  group_by: ['alertname', 'fingerprint']\n  group_wait: 1s\n  \
         group_interval: 1s\n  repeat_interval: 1h\nreceivers:\n  - name: hook\n    \
         webhook_configs:\n      - url: http://127.0.0.1:9999/am\n        send_resolved: true\n",
    );
    let mut cmd: Command = ns.command(ALERTMANAGER);
    cmd.arg(format!("--config.file={}", config.display()))
        .arg(format!("--storage.path={}", dir.path(data).display()))
        .arg(format!("--web.listen-address={AM}"))
        // No gossip cluster: a single instance on loopback.
        .arg("--cluster.listen-address=");
    let am = Child::spawn(&mut cmd, "alertmanager");
    let ready = wait_until(Duration::from_secs(20), POLL, || {
        get_json_in_netns(ns.name(), addr(AM), "/api/v2/status", HTTP)
            .ok()
            .filter(|(code, _)| *code == 200)
    });
    assert!(ready.is_some(), "alertmanager not ready:\n{}", am.stderr());
    am
}

fn addr(s: &str) -> SocketAddr {
    s.parse().expect("socket address")
}

/// Alertmanager's active close_wait_buildup alert (None when there is none), once `done` says so.
fn wait_for_alert(
    ns: &NetNs,
    agent: &Agent,
    what: &str,
    done: impl Fn(&Option<Value>) -> bool,
) -> Value {
    let found = wait_until(Duration::from_secs(40), POLL * 5, || {
        let (code, alerts) =
            get_json_in_netns(ns.name(), addr(AM), "/api/v2/alerts?active=true", HTTP).ok()?;
        if code != 200 {
            return None;
        }
        let ours = alerts
            .as_array()?
            .iter()
            .find(|a| a["labels"]["alertname"] == "close_wait_buildup")
            .cloned();
        done(&ours).then(|| ours.unwrap_or(Value::Null))
    });
    found.unwrap_or_else(|| panic!("waited for {what} in Alertmanager:\n{}", agent.ctx()))
}

/// Labels are the alert's identity (no pid: a restarted client keeps its alert); the pid is an
/// annotation; generatorURL points at the agent's finding.
fn assert_identity(alert: &Value, client_pid: u32) {
    let labels = &alert["labels"];
    assert_eq!(labels["severity"], "warning", "{alert:#}");
    assert_eq!(labels["comm"], PEER_COMM, "{alert:#}");
    assert_eq!(labels["host"], HOST, "{alert:#}");
    assert_eq!(labels["service_port"], "7402", "{alert:#}");
    assert_eq!(
        labels["fingerprint"],
        format!("close_wait_buildup:{PEER_COMM}:7402"),
        "{alert:#}"
    );
    assert!(labels.get("pid").is_none(), "{alert:#}");
    let pids = alert["annotations"]["pids"].as_str().unwrap_or("");
    assert!(
        pids.split(',').any(|p| p == client_pid.to_string()),
        "{alert:#}"
    );
    let url = alert["generatorURL"].as_str().unwrap_or("");
    assert!(
        url.starts_with("http://127.0.0.1:9477/v1/findings?fingerprint=close_wait_buildup%3A"),
        "{alert:#}"
    );
    // endsAt is a few resend intervals ahead, not hours.
    let ends = chrono::DateTime::parse_from_rfc3339(alert["endsAt"].as_str().unwrap_or(""))
        .unwrap_or_else(|e| panic!("endsAt: {e}: {alert:#}"));
    let ahead = ends.signed_duration_since(chrono::Utc::now());
    assert!(
        ahead <= chrono::Duration::seconds(RESEND.as_secs() as i64 * 4 + 2),
        "endsAt {ahead} ahead: {alert:#}"
    );
}

/// Alertmanager's own webhook notification with `status`.
fn wait_for_am_post(hook: &WebhookReceiver, agent: &Agent, status: &str) {
    let post = hook.wait_for_body(Duration::from_secs(30), |b| {
        b["receiver"] == "hook"
            && b["status"] == status
            && b["alerts"].as_array().is_some_and(|a| {
                a.iter()
                    .any(|x| x["labels"]["alertname"] == "close_wait_buildup")
            })
    });
    assert!(
        post.is_some(),
        "Alertmanager sent no {status} notification:\n{}",
        agent.ctx()
    );
}
