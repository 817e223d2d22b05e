//! The audit log is always whole JSON lines and every kill intent gets an outcome: a torn last
//! line and an intent without outcome (what a full disk mid-line and a SIGTERM mid-round left
//! behind before) are found in the file at start, the tail is cut off and logged, and the
//! intent gets its `failed` line; the daemon's own lines follow, whole.

use std::{collections::BTreeSet, fs};

use connreap_tests::harness::{
    alive,
    audit::{int, read_audit, result_is, text},
    require_privileges, wait_until, Agent, Config, NetNs, TempDir, Tmpfs, POLL, SCAN,
};
use serde_json::{json, Value};

use super::{close_wait_to, pool, pool_policy};

const PORT: u16 = 7540;
const FULL_PORT: u16 = 7541;
/// Free bytes left in the audit log's last page on a full tmpfs: less than one kill intent.
const ROOM: usize = 60;
/// A pid no process has (above the kernel's largest pid_max).
const GONE_PID: u64 = 4_194_305;

#[test]
fn a_torn_audit_line_and_an_intent_without_outcome_are_repaired_at_start() {
    let Some(_env) = require_privileges() else {
        return;
    };
    let ns = NetNs::new("sf-arep");
    let dir = TempDir::new("sf-arep");
    let audit = dir.path("audit.jsonl");
    let intent = json!({
        "time": "2026-12-06T05:00:00Z", "policy": "pool-leak", "mode": "enforce",
        "result": "kill-intent", "local": "127.0.0.1:40001", "peer": format!("127.0.0.1:{PORT}"),
        "inode": 4242, "cookie": "0x1f", "pid": 4321, "comm": "java", "unit": null,
        "netns": 4026531840u64, "netns_name": null, "state": "CLOSE_WAIT", "age_secs": 90.0,
        "age_exact": true, "idle_secs": 60.0, "quota": null, "agent_pid": GONE_PID, "round": 17
    });
    // An earlier round whose intent got its outcome: no second one.
    let mut done = intent.clone();
    done["round"] = json!(16);
    let mut killed = done.clone();
    killed["result"] = json!("killed");
    let torn = r#"{"time":"2026-12-06T05:00:01Z","policy":"pool-leak","mode":"enf"#;
    let before = format!("{done}\n{killed}\n{intent}\n{torn}");
    fs::write(&audit, &before).unwrap_or_else(|e| panic!("write {}: {e}", audit.display()));

    let (_client, leaked) = pool(&ns, PORT, 2);
    let config =
        Config::new(&dir)
            .audit_log(&audit)
            .policy(&pool_policy("pool-leak", "dry-run", PORT, ""));
    let agent = Agent::start(&ns, &dir, &config);

    // The daemon's own would-kill lines arrive after the repair, each on a line of its own.
    let lines = wait_until(SCAN * 10, POLL, || {
        let l = agent.audit();
        (result_is(&l, "would-kill").len() >= leaked.len()).then_some(l)
    })
    .unwrap_or_else(|| panic!("no would-kill lines:\n{}", agent.ctx()));
    let all = fs::read_to_string(&audit).expect("audit log");
    assert!(
        all.starts_with(&format!("{done}\n{killed}\n{intent}\n")),
        "the whole lines before the torn one changed:\n{all}"
    );
    assert!(
        !all.contains("\"enf{"),
        "the torn line is still there:\n{all}"
    );

    // Exactly one outcome for the intent of round 17, as the intent named it.
    let outcomes: Vec<&Value> = lines
        .iter()
        .filter(|l| l["result"] != "kill-intent" && int(l, "round") == 17)
        .filter(|l| int(l, "agent_pid") == GONE_PID)
        .collect();
    assert_eq!(outcomes.len(), 1, "{}", agent.ctx());
    let o = outcomes[0];
    assert_eq!(text(o, "result"), "failed");
    assert_eq!(text(o, "reason"), "not executed: the daemon stopped");
    for key in [
        "policy", "mode", "local", "peer", "inode", "cookie", "pid", "comm", "netns",
    ] {
        assert_eq!(o[key], intent[key], "{key} of {o}");
    }
    assert_eq!(
        lines
            .iter()
            .filter(|l| int(l, "agent_pid") == GONE_PID && int(l, "round") == 16)
            .count(),
        2,
        "round 16 had its outcome: nothing added\n{}",
        agent.ctx()
    );

    // Both repairs are logged, naming the file and the bytes cut.
    let log = agent.stderr();
    let shown = audit.display().to_string();
    assert!(
        log.lines().any(|l| l.contains("WARN")
            && l.contains("torn last line")
            && l.contains(&shown)
            && l.contains(&format!("bytes_removed={}", torn.len()))),
        "no WARN naming {shown} and {} bytes removed:\n{log}",
        torn.len()
    );
    assert!(
        log.lines()
            .any(|l| l.contains("WARN") && l.contains("kill intents without an outcome")),
        "{log}"
    );
}

/// The disk fills mid-line: the audit log's last page has room for part of a kill intent
/// only, so the write is cut short (a partial write, then ENOSPC). The file is left exactly as
/// it was (truncated back), nothing is killed; once space returns every kill follows its
/// intent and the file is whole JSON lines.
#[test]
fn a_write_cut_short_by_a_full_disk_leaves_the_audit_log_as_it_was() {
    let Some(_env) = require_privileges() else {
        return;
    };
    let ns = NetNs::new("sf-midline");
    let dir = TempDir::new("sf-midline");
    let fs = Tmpfs::mount(&dir.path("auditfs"), 64 * 1024, false);
    let audit = fs.path("audit.jsonl");
    // Whole lines filling one page but ROOM bytes.
    let mut before = String::new();
    let want = 4096 - ROOM;
    while before.len() < want {
        let left = want - before.len();
        let pad = if left > 300 {
            200
        } else {
            left - r#"{"result":"note","pad":""}"#.len() - 1
        };
        before += &format!("{{\"result\":\"note\",\"pad\":\"{}\"}}\n", "x".repeat(pad));
    }
    assert_eq!(before.len(), want);
    fs::write(&audit, &before).unwrap_or_else(|e| panic!("write {}: {e}", audit.display()));
    fs.fill();

    let (client, leaked) = pool(&ns, FULL_PORT, 3);
    let config = Config::new(&dir)
        .protect_ports(&[22])
        .audit_log(&audit)
        .policy(&pool_policy("pool-leak", "enforce", FULL_PORT, ""));
    let agent = Agent::start(&ns, &dir, &config);
    let errors = "connreap_audit_write_errors_total";
    wait_until(SCAN * 10, POLL, || {
        (agent.metric(errors).unwrap_or(0.0) >= 2.0).then_some(())
    })
    .unwrap_or_else(|| panic!("{errors} never reached 2:\n{}", agent.ctx()));
    let now = fs::read_to_string(&audit).expect("audit log");
    assert!(
        now == before,
        "the audit log changed although every write failed ({} bytes, was {}):\n{}",
        now.len(),
        before.len(),
        &now[before.len().min(now.len())..]
    );
    assert_eq!(
        close_wait_to(&ns, FULL_PORT, client.pid()),
        leaked,
        "a socket was closed without a durable intent:\n{}",
        agent.ctx()
    );

    fs.free();
    wait_until(SCAN * 8, POLL, || {
        close_wait_to(&ns, FULL_PORT, client.pid())
            .is_empty()
            .then_some(())
    })
    .unwrap_or_else(|| panic!("nothing killed after space returned:\n{}", agent.ctx()));
    assert!(alive(client.pid()), "the pool's process died");
    let lines = read_audit(&audit);
    assert!(fs::read_to_string(&audit)
        .expect("audit")
        .starts_with(&before));
    let killed = result_is(&lines, "killed");
    let locals: BTreeSet<String> = killed.iter().map(|d| text(d, "local").into()).collect();
    assert_eq!(locals, leaked, "{lines:#?}");
    for k in &killed {
        let intent = lines
            .iter()
            .position(|l| {
                l["result"] == "kill-intent" && l["local"] == k["local"] && l["round"] == k["round"]
            })
            .unwrap_or_else(|| panic!("a kill without its intent: {k}"));
        let at = lines.iter().position(|l| l == *k).expect("the kill");
        assert!(intent < at, "intent after its kill: {k}");
    }
}
