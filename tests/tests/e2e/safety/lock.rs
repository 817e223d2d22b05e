//! One reclaimer per host (item 5): two daemons (each in its own network namespace, with its
//! own leak) and the CLI share the host's reclaim lock; only its holder kills.

use std::path::Path;

use connreap_tests::harness::{
    alive,
    audit::{result_is, text},
    require_privileges, run, wait_until, Agent, Config, NetNs, TempDir, CONNREAP_TIMEOUT, POLL,
    SCAN,
};
use serde_json::json;

use super::{close_wait_to, pool, pool_policy, TOKEN};

const PORT: u16 = 7500;
const LOCK: &str = "another connreap holds the reclaim lock";

/// `connreap reclaim --policy pool-leak --config CONFIG` in `ns` must refuse with exit 75,
/// naming the daemon `holder` that holds the lock.
fn cli_refuses(ns: &NetNs, config: &Path, holder: u32) {
    let mut cmd = ns.connreap(["reclaim", "--policy", "pool-leak", "--config"]);
    cmd.arg(config);
    let out = run(&mut cmd, CONNREAP_TIMEOUT);
    assert_eq!(out.status.code(), Some(75), "{out:?}");
    assert!(
        out.stderr.contains(LOCK)
            && out.stderr.contains(&format!("pid {holder} (daemon)"))
            && out.stderr.contains("POST /v1/reclaim"),
        "must name the holder and the way in: {out:?}"
    );
    assert!(out.stdout.is_empty(), "decided anything: {out:?}");
}

/// The pool policy, scoped to `ns`: both daemons see every namespace of the host, and a policy
/// without a namespace selector applies in all of them; here each reclaims only its own leak.
fn policy_in(ns: &NetNs) -> String {
    pool_policy("pool-leak", "enforce", PORT, "").replace(
        "states = [\"CLOSE_WAIT\"] }",
        &format!("states = [\"CLOSE_WAIT\"], netns = \"{}\" }}", ns.name()),
    )
}

#[test]
fn one_reclaimer_per_host_a_second_daemon_dry_runs_and_the_cli_refuses() {
    let Some(_env) = require_privileges() else {
        return;
    };
    // The first daemon takes the lock at its first enforce round and kills its leak.
    let ns_a = NetNs::new("sf-lock-a");
    let policy = policy_in(&ns_a);
    let dir_a = TempDir::new("sf-lock-a");
    let (client_a, _) = pool(&ns_a, PORT, 3);
    let mut first = Agent::start(
        &ns_a,
        &dir_a,
        &Config::new(&dir_a).protect_ports(&[22]).policy(&policy),
    );
    wait_until(SCAN * 8, POLL, || {
        close_wait_to(&ns_a, PORT, client_a.pid())
            .is_empty()
            .then_some(())
    })
    .unwrap_or_else(|| panic!("the first daemon killed nothing:\n{}", first.ctx()));

    // The second one, same host, its own leak: its enforce rounds are dry runs naming the holder.
    let ns_b = NetNs::new("sf-lock-b");
    let dir_b = TempDir::new("sf-lock-b");
    let (client_b, leaked_b) = pool(&ns_b, PORT, 3);
    let token = dir_b.write("token", &format!("{TOKEN}\n"));
    let config_b = Config::new(&dir_b)
        .protect_ports(&[22])
        .token_file(&token)
        .policy(&policy_in(&ns_b));
    let second = Agent::start(&ns_b, &dir_b, &config_b);
    second.wait_scans(3);
    assert_eq!(
        close_wait_to(&ns_b, PORT, client_b.pid()),
        leaked_b,
        "the second daemon killed while the first holds the lock:\n{}",
        second.ctx()
    );
    let holder = format!("pid {} (daemon)", first.pid());
    let lines = second.audit();
    let would = result_is(&lines, "would-kill");
    assert_eq!(would.len(), leaked_b.len(), "{}", second.ctx());
    assert!(result_is(&lines, "killed").is_empty(), "{}", second.ctx());
    for d in &would {
        let mode = text(d, "mode");
        assert!(
            mode.starts_with("dry-run") && mode.contains(LOCK) && mode.contains(&holder),
            "{d}"
        );
    }
    // Asking the second daemon over its API does not get round the lock.
    let (code, round) = second.post_reclaim(
        Some(TOKEN),
        &json!({"policy": "pool-leak", "dry_run": false}),
    );
    assert_eq!(code, 200, "{round}");
    let mode = round["mode"].as_str().unwrap_or_default();
    assert!(mode.contains(LOCK) && mode.contains(&holder), "{round:#}");
    let decisions = round["decisions"].as_array().cloned().unwrap_or_default();
    assert!(
        !decisions.is_empty() && decisions.iter().all(|d| d["result"] == "would-kill"),
        "{round:#}"
    );
    // Nor does the CLI, in either namespace.
    cli_refuses(&ns_b, &dir_b.path("connreap.toml"), first.pid());
    cli_refuses(&ns_a, &dir_a.path("connreap.toml"), first.pid());
    assert_eq!(close_wait_to(&ns_b, PORT, client_b.pid()), leaked_b);
    first.assert_alive();

    // Once the first daemon is gone, the second takes over and kills.
    first.signal(libc::SIGTERM);
    first
        .wait_exit(SCAN * 10)
        .unwrap_or_else(|| panic!("the first daemon did not exit:\n{}", first.stderr()));
    wait_until(SCAN * 8, POLL, || {
        close_wait_to(&ns_b, PORT, client_b.pid())
            .is_empty()
            .then_some(())
    })
    .unwrap_or_else(|| panic!("the second daemon never took over:\n{}", second.ctx()));
    let lines = second.audit();
    let killed = result_is(&lines, "killed");
    assert_eq!(killed.len(), leaked_b.len(), "{}", second.ctx());
    assert!(killed.iter().all(|d| d["mode"] == "enforce"), "{killed:#?}");
    assert!(alive(client_b.pid()));
    // Now the second daemon is the one the CLI names.
    cli_refuses(&ns_b, &dir_b.path("connreap.toml"), second.pid());
}
