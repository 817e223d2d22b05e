//! The audit log stays bounded under a policy that decides the same thing every round
//! (item 9): an unchanged would-kill or skip is written once, not once per round, while the
//! rounds still count in `/metrics`; a new socket is written when it appears.

use std::collections::BTreeSet;

use connreap_tests::harness::{
    audit::{result_is, text},
    require_privileges, wait_until, Agent, Config, NetNs, TempDir, PEER_COMM, POLL, SCAN,
};

use super::pool;

const ROUNDS: f64 = 8.0;

#[test]
fn unchanged_dry_run_decisions_are_audited_once_not_every_round() {
    let Some(_env) = require_privileges() else {
        return;
    };
    let ns = NetNs::new("sf-grow");
    let dir = TempDir::new("sf-grow");
    // 8 sockets the policy would kill, 8 it must skip (their peer port is protected).
    let (_targets, would_kill) = pool(&ns, 7500, 8);
    let (_protected, skipped) = pool(&ns, 7501, 8);
    let policy = format!(
        r#"[[policy]]
name = "pool-leak"
mode = "dry-run"
trigger = "always"
select = {{ comm = "{PEER_COMM}", states = ["CLOSE_WAIT"] }}
max_per_round = 32
"#
    );
    let config = Config::new(&dir).protect_ports(&[22, 7501]).policy(&policy);
    let agent = Agent::start(&ns, &dir, &config);

    // Every round decides all 16 again ...
    let series = |result: &str| {
        format!(r#"connreap_reclaims_total{{policy="pool-leak",result="{result}"}}"#)
    };
    wait_until(SCAN * (ROUNDS as u32 + 6), POLL, || {
        let m = agent.metrics();
        (m.value(&series("would-kill")).unwrap_or(0.0) >= 8.0 * ROUNDS
            && m.value(&series("skipped")).unwrap_or(0.0) >= 8.0 * ROUNDS)
            .then_some(())
    })
    .unwrap_or_else(|| panic!("not {ROUNDS} rounds:\n{}\n{}", agent.metrics(), agent.ctx()));

    // ... and the audit log has each of them once.
    let lines = agent.audit();
    let locals = |result: &str| -> (usize, BTreeSet<String>) {
        let of = result_is(&lines, result);
        (
            of.len(),
            of.iter().map(|d| text(d, "local").into()).collect(),
        )
    };
    assert_eq!(locals("would-kill"), (8, would_kill), "{}", agent.ctx());
    assert_eq!(locals("skipped"), (8, skipped), "{}", agent.ctx());
    assert_eq!(lines.len(), 16, "{}", agent.ctx());
    for d in result_is(&lines, "skipped") {
        assert!(
            d["reason"]
                .as_str()
                .is_some_and(|r| r.contains("port 7501")),
            "{d}"
        );
    }

    // A new leak is audited when it appears, and only it.
    let (_more, new) = pool(&ns, 7502, 4);
    agent.wait_scans(3);
    let lines = agent.audit();
    assert_eq!(lines.len(), 20, "{}", agent.ctx());
    let added: BTreeSet<String> = lines[16..]
        .iter()
        .filter(|d| d["result"] == "would-kill")
        .map(|d| text(d, "local").into())
        .collect();
    assert_eq!(added, new, "{}", agent.ctx());
}
