//! Incident 1 under a dry-run policy: it decides, closes nothing, and its decisions show in
//! the audit log, the API and the CLI; `POST /v1/reclaim` needs the token.

use std::{
    collections::{BTreeSet, HashSet},
    net::SocketAddr,
    path::Path,
    time::Duration,
};

use connreap_tests::{
    fixtures::ss_tcp,
    harness::{
        addr,
        audit::{int, per_round, result_is, text},
        relay_policy, require_privileges, run, wait_until, Agent, Chain, Config, NetNs, TempDir,
        CONNREAP_TIMEOUT, DIAL, MAX_STREAMS, POLL, SCAN,
    },
};
use serde_json::{json, Value};

use super::{assert_relay_decision, start_agent, TOKEN};

#[test]
fn dry_run_decides_but_closes_nothing_and_the_api_needs_the_token() {
    let Some(_env) = require_privileges() else {
        return;
    };
    let ns = NetNs::new("rc-dry");
    let dir = TempDir::new("dry");
    let chain = Chain::start(&ns);
    let token_file = dir.write("token", &format!("{TOKEN}\n"));
    let config = Config::reclaiming(&dir)
        .token_file(&token_file)
        .policy(&relay_policy("dry-run", "2s"));
    let agent = start_agent(&ns, &dir, &config);

    chain.leak(MAX_STREAMS as usize, Duration::from_millis(500));
    let before = upstreams(&chain);
    assert_eq!(before.len(), MAX_STREAMS as usize, "{before:?}");

    let would = would_kill_rounds(&chain, &agent, &before);
    // ... and nothing was closed: the relay is still full, users still get 503, and the 64
    // leaked pairs are all still there.
    assert_eq!(chain.streams(), MAX_STREAMS, "{}", chain.status());
    let (code, body) = chain.get_json();
    assert_eq!((code, body.as_str()), (503, "busy"));
    assert_eq!(upstreams(&chain), before, "dry-run closed upstream sockets");
    let relay_side = ss_tcp(Some(ns.name()))
        .unwrap()
        .into_iter()
        .filter(|x| x.state == "ESTAB" && x.local == addr(DIAL))
        .count();
    assert_eq!(relay_side, MAX_STREAMS as usize, "relay ends of the pairs");

    api_lists_the_decisions(&chain, &agent, &would);
    api_reclaim_needs_the_token(&chain, &agent);
    cli_prints_the_decisions(&ns, &dir.path("connreap.toml"));

    // Still nothing closed.
    assert_eq!(chain.streams(), MAX_STREAMS, "{}", chain.status());
    assert!(
        result_is(&agent.audit(), "killed").is_empty(),
        "{}",
        agent.ctx()
    );
    assert_eq!(upstreams(&chain), before, "dry-run closed upstream sockets");
}

/// The local addresses of the proxy's ESTABLISHED upstreams.
fn upstreams(chain: &Chain) -> BTreeSet<SocketAddr> {
    chain
        .proxy_upstreams("ESTAB")
        .iter()
        .map(|x| x.local)
        .collect()
}

/// Rounds decide `would-kill` on leaked upstreams, at most 8 each, and none kills; repeated
/// rounds count in the metric but write each unchanged decision to the audit log once.
/// Returns those decisions.
fn would_kill_rounds(chain: &Chain, agent: &Agent, leaked: &BTreeSet<SocketAddr>) -> Vec<Value> {
    wait_until(Duration::from_secs(2) + SCAN * 8, POLL, || {
        let lines = agent.audit();
        // Stop early on a kill: asserted just below.
        (!result_is(&lines, "would-kill").is_empty() || !result_is(&lines, "killed").is_empty())
            .then_some(())
    })
    .unwrap_or_else(|| panic!("no would-kill round:\n{}", agent.ctx()));
    let series = r#"connreap_reclaims_total{policy="relay-leaks",result="would-kill"}"#;
    let before = agent.metric(series).unwrap_or(0.0);
    agent.wait_scans(agent.scans() + 3);
    let after = agent.metric(series).unwrap_or(0.0);
    assert!(
        after >= before + 16.0,
        "would-kill decided every round ({before} -> {after}):\n{}",
        agent.ctx()
    );
    let lines = agent.audit();
    let would: Vec<Value> = result_is(&lines, "would-kill")
        .into_iter()
        .cloned()
        .collect();
    for d in &would {
        assert_relay_decision(d, chain, agent, "dry-run", 2.0);
        assert!(
            leaked.contains(&addr(text(d, "local"))),
            "would-kill names a socket that is not a leaked upstream: {d}"
        );
    }
    let locals: BTreeSet<&str> = would.iter().map(|d| text(d, "local")).collect();
    assert_eq!(
        locals.len(),
        would.len(),
        "an unchanged would-kill is audited once:\n{}",
        agent.ctx()
    );
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
    would
}

/// GET /v1/reclaims lists the same decisions as the audit log.
fn api_lists_the_decisions(chain: &Chain, agent: &Agent, would: &[Value]) {
    let (code, recent) = agent.get("/v1/reclaims");
    assert_eq!(code, 200, "{recent}");
    let recent = recent["reclaims"]
        .as_array()
        .unwrap_or_else(|| panic!("GET /v1/reclaims without `reclaims`: {recent}"))
        .clone();
    let api_would = result_is(&recent, "would-kill");
    assert!(!api_would.is_empty(), "{recent:#?}");
    for d in &api_would {
        assert_relay_decision(d, chain, agent, "dry-run", 2.0);
    }
    let key = |d: &Value| {
        (
            int(d, "round"),
            int(d, "inode"),
            text(d, "local").to_string(),
        )
    };
    let audited: HashSet<(u64, u64, String)> = would.iter().map(key).collect();
    assert!(
        api_would.iter().any(|d| audited.contains(&key(d))),
        "GET /v1/reclaims shares no decision with the audit log"
    );
}

/// POST /v1/reclaim: the token is required; with it, a round of would-kill decisions, also
/// when asked to enforce (the policy is dry-run).
fn api_reclaim_needs_the_token(chain: &Chain, agent: &Agent) {
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
        assert_relay_decision(d, chain, agent, "dry-run", 2.0);
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
}

/// `connreap reclaim --dry-run` prints the same kind of decisions as JSON lines.
fn cli_prints_the_decisions(ns: &NetNs, config: &Path) {
    let mut cmd = ns.connreap([
        "reclaim",
        "--policy",
        "relay-leaks",
        "--dry-run",
        "--config",
    ]);
    cmd.arg(config);
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
}
