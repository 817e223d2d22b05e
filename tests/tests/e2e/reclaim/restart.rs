//! The agent is killed in the middle of reclaiming a leak and started again: the audit log is
//! appended to, and no socket is killed twice.

use std::{
    collections::{BTreeSet, HashSet},
    fs,
    path::Path,
    time::Duration,
};

use connreap_tests::harness::{
    audit::{assert_decision_shape, int, per_round, read_audit, result_is, text},
    require_privileges, wait_until, Agent, Chain, Config, NetNs, TempDir, POLL, SCAN,
};

use super::start_agent;

const N: usize = 12;

#[test]
fn agent_restart_mid_leak_appends_and_never_kills_twice() {
    let Some(_env) = require_privileges() else {
        return;
    };
    let ns = NetNs::new("rc-rst");
    let dir = TempDir::new("restart");
    let chain = Chain::start(&ns);
    let policy = r#"[[policy]]
name = "proxy-leaks"
mode = "enforce"
trigger = "always"
select = { comm = "leaky-proxy", peer_port = 25001, states = ["ESTABLISHED"] }
min_idle = "2s"
max_per_round = 2
"#;
    let config = Config::reclaiming(&dir).policy(policy);
    let audit = config.audit().to_path_buf();
    let first = start_agent(&ns, &dir, &config);
    chain.leak(N, Duration::from_millis(500));
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
    first.kill();
    let first_text = fs::read_to_string(&audit).unwrap();
    let first_killed = result_is(&read_audit(&audit), "killed").len();
    assert!(
        first_killed < N,
        "the first agent finished before the restart:\n{first_ctx}"
    );

    let second = start_agent(&ns, &dir, &config);
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

    assert_appended_once_each(
        &audit,
        &first_text,
        &leaked,
        [first_pid, second_pid],
        &second,
    );
    // Relay slots are back and the real path works.
    assert!(
        wait_until(SCAN * 3, POLL, || (chain.streams() == 0).then_some(())).is_some(),
        "{}",
        chain.status()
    );
    chain.assert_json_ok();
}

/// The second run appended to the first run's audit log; together they killed every leak
/// exactly once, 2 per round at most, and both runs (agent pids `runs`) killed.
fn assert_appended_once_each(
    audit: &Path,
    first_text: &str,
    leaked: &BTreeSet<String>,
    runs: [u64; 2],
    second: &Agent,
) {
    let text_now = fs::read_to_string(audit).unwrap();
    assert!(
        text_now.starts_with(first_text),
        "the first run's audit lines were rewritten"
    );
    let lines = read_audit(audit);
    let killed = result_is(&lines, "killed");
    let mut inodes = HashSet::new();
    for d in &killed {
        assert_decision_shape(d);
        assert!(
            inodes.insert(int(d, "inode")),
            "inode killed twice: {d}\n{}",
            second.ctx()
        );
        assert!(leaked.contains(text(d, "local")), "not a leak: {d}");
    }
    let killed_locals: BTreeSet<String> = killed
        .iter()
        .map(|d| text(d, "local").to_string())
        .collect();
    assert_eq!(&killed_locals, leaked, "{}", second.ctx());
    let pids: BTreeSet<u64> = killed.iter().map(|d| int(d, "agent_pid")).collect();
    assert_eq!(
        pids,
        BTreeSet::from(runs),
        "killed decisions from both runs"
    );
    for (round, n) in per_round(&lines, "killed") {
        assert!(n <= 2, "round {round:?} killed {n}");
    }
}
