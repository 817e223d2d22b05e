//! A quota source that lies: readings that cannot be true (`1e30`, used far above the limit,
//! negative, fractional, text, a limit of 0) make the source unavailable with the reason, and
//! an enforce policy armed by that quota kills nothing; a body far above `max_body` is
//! refused without being read into memory.

use std::{collections::BTreeSet, fs};

use connreap_tests::{
    fixtures::{relay_status_json, ss_tcp, EndpointStatus, QuotaMode, QuotaServer},
    harness::{
        addr,
        audit::{result_is, text},
        peer, require_privileges, wait_until, Agent, Config, NetNs, RelayQuota, TempDir, FINDING,
        PEER_COMM, POLL, SCAN,
    },
};
use serde_json::{json, Value};

const TARGETS: usize = 6;

/// `{"endpoints":[{"port":21000,"streams":USED,"maxStreams":LIMIT}]}` with the values as given.
fn reading(used: Value, limit: Value) -> Value {
    json!({"endpoints": [{"port": 21000, "dialPort": 25001, "streams": used, "maxStreams": limit}]})
}

/// Waits until /v1/quotas shows an error containing every needle, and the
/// quota_source_unavailable finding carries it; returns the error.
fn unavailable_with(agent: &Agent, source: &QuotaServer, needles: &[&str]) -> String {
    let error = wait_until(FINDING, POLL, || {
        let q = agent.get_ok("/v1/quotas");
        q["quotas"][0]["error"]
            .as_str()
            .filter(|e| needles.iter().all(|n| e.contains(n)))
            .map(str::to_string)
    })
    .unwrap_or_else(|| {
        panic!(
            "/v1/quotas never showed an error with {needles:?} (source {:?}): {:#}\n{}",
            source.mode(),
            agent.get_ok("/v1/quotas"),
            agent.ctx()
        )
    });
    let finding = wait_until(FINDING, POLL, || {
        agent.find("quota_source_unavailable", |f| {
            f["reason"].as_str().is_some_and(|r| r.contains(&error))
        })
    });
    assert!(
        finding.is_some(),
        "no quota_source_unavailable finding with {error:?}: {:#?}",
        agent.findings()
    );
    error
}

#[test]
fn impossible_quota_readings_never_arm_an_enforce_policy() {
    let Some(_env) = require_privileges() else {
        return;
    };
    let ns = NetNs::new("liar");
    let dir = TempDir::new("liar");
    let source = QuotaServer::start_in_netns(
        ns.name(),
        addr("127.0.0.1:20080"),
        QuotaMode::Json(reading(json!(1e30), json!(1e30))),
    )
    .unwrap();
    // The targets: testpeer's clients to port 7600, selected by the policy whenever the quota
    // reads saturated.
    let (_server, _) = peer(&ns, &["listen", "--addr", "127.0.0.1:7600"]);
    let (clients, ready) = peer(
        &ns,
        &[
            "connect",
            "--addr",
            "127.0.0.1:7600",
            "--count",
            &TARGETS.to_string(),
        ],
    );
    let targets = ready.locals();
    let policy = format!(
        "[[policy]]\nname = \"liar\"\nmode = \"enforce\"\ntrigger = \"quota-saturated\"\n\
         quota = \"relay\"\nselect = {{ comm = \"{PEER_COMM}\", peer_port = 7600 }}\nmax_per_round = 8\n"
    );
    let config = Config::new(&dir).quota(RelayQuota::relay()).policy(&policy);
    let mut agent = Agent::start(&ns, &dir, &config);

    let lies: [(Value, Value, &[&str]); 7] = [
        // Both u64::MAX before: "full".
        (
            json!(1e30),
            json!(1e30),
            &["port 21000", "`streams` is 1e+30"],
        ),
        (
            json!(1000000),
            json!(10),
            &["port 21000", "`streams` 1000000 is above `maxStreams` 10"],
        ),
        // Within twice the limit, but far beyond any believable overshoot.
        (
            json!(100),
            json!(64),
            &["`streams` 100 is above `maxStreams` 64 by more than 6"],
        ),
        (json!(-1), json!(64), &["`streams` is -1"]),
        (json!(1.5), json!(64), &["`streams` is 1.5"]),
        (json!("abc"), json!(64), &["`streams` is \"abc\""]),
        (json!(64), json!(0), &["`maxStreams` is 0"]),
    ];
    for (used, limit, needles) in lies {
        source.set_json(reading(used, limit));
        unavailable_with(&agent, &source, needles);
        agent.wait_scans(2);
        agent.assert_alive();
        assert_nothing_killed(&agent, &ns, &targets);
    }

    // The same policy on a true, saturated reading does kill: the rounds above were armed by
    // nothing but the lies.
    source.set_json(relay_status_json(
        &[EndpointStatus {
            port: 21000,
            dial_port: 25001,
            streams: 64,
            max_streams: 64,
        }],
        0,
        0,
        64,
    ));
    let killed = wait_until(SCAN * 15, POLL, || {
        let lines = agent.audit();
        let k: Vec<Value> = result_is(&lines, "killed").into_iter().cloned().collect();
        (!k.is_empty()).then_some(k)
    })
    .unwrap_or_else(|| panic!("a true saturated reading never armed it:\n{}", agent.ctx()));
    for d in &killed {
        assert!(targets.contains(text(d, "local")), "{d}");
        assert_eq!(d["quota"]["used"], json!(64), "{d}");
    }
    drop(clients);
}

/// No kill (nor an intent to kill) in the audit log, and every target still connected.
fn assert_nothing_killed(agent: &Agent, ns: &NetNs, targets: &BTreeSet<String>) {
    let lines = agent.audit();
    for result in ["killed", "kill-intent", "would-kill"] {
        assert!(
            result_is(&lines, result).is_empty(),
            "{result} on a lying quota:\n{}",
            agent.ctx()
        );
    }
    let ss = ss_tcp(Some(ns.name())).unwrap();
    for t in targets {
        let t = addr(t);
        assert!(
            ss.iter().any(|x| x.is_established() && x.local == t),
            "target {t} was closed:\n{}",
            agent.ctx()
        );
    }
}

/// The agent's peak resident memory (VmHWM), in KiB.
fn vm_hwm_kib(pid: u32) -> u64 {
    let status = fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or_else(|| panic!("no VmHWM in /proc/{pid}/status"))
}

#[test]
fn a_quota_body_above_max_body_is_refused_with_memory_bounded() {
    let Some(_env) = require_privileges() else {
        return;
    };
    let ns = NetNs::new("bigbody");
    let dir = TempDir::new("bigbody");
    let small = reading(json!(3), json!(64));
    let source = QuotaServer::start_in_netns(
        ns.name(),
        addr("127.0.0.1:20080"),
        QuotaMode::Json(small.clone()),
    )
    .unwrap();
    let mut agent = Agent::start(&ns, &dir, &Config::new(&dir).quota(RelayQuota::relay()));
    wait_until(FINDING, POLL, || {
        let q = agent.get_ok("/v1/quotas");
        (q["quotas"][0]["error"].is_null() && q["quotas"][0]["entries"][0]["used"] == 3)
            .then_some(())
    })
    .unwrap_or_else(|| panic!("the first reading never came:\n{}", agent.ctx()));
    let before = vm_hwm_kib(agent.pid());

    // 50 MiB of valid JSON (max_body is 1 MiB by default).
    let mut big = small.clone();
    big["pad"] = json!("x".repeat(50 << 20));
    source.set_json(big);
    let error = unavailable_with(&agent, &source, &["larger than max_body (1MiB)"]);
    assert!(error.contains("http://127.0.0.1:20080/status"), "{error}");
    let hits = source.hits();
    wait_until(FINDING, POLL, || (source.hits() >= hits + 3).then_some(()))
        .expect("the agent stopped polling");
    agent.assert_alive();
    let after = vm_hwm_kib(agent.pid());
    assert!(
        after < before + 20 * 1024,
        "peak RSS grew from {before} kB to {after} kB on a 50 MiB body"
    );

    // Back to a normal body: available again.
    source.set_json(small);
    wait_until(FINDING, POLL, || {
        agent.get_ok("/v1/quotas")["quotas"][0]["error"]
            .is_null()
            .then_some(())
    })
    .unwrap_or_else(|| panic!("the source never recovered:\n{}", agent.ctx()));
    agent.assert_healthy();
}
