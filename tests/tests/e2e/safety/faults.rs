//! The audit log's filesystem fails under an enforce policy: a full tmpfs (the daemon kills
//! nothing and says so until space returns, then writes each kill's intent before the kill) and
//! a read-only or full one under `connreap reclaim` (exit 3, with why).

use std::{collections::BTreeSet, path::Path};

use connreap_tests::harness::{
    alive,
    audit::{read_audit, result_is, text},
    require_privileges, run, wait_until, Agent, Config, NetNs, Output, TempDir, Tmpfs,
    CONNREAP_TIMEOUT, POLL, SCAN,
};
use serde_json::Value;

use super::{close_wait_to, pool, pool_policy};

/// Size of the tmpfs under the audit log: a few pages.
const FS_SIZE: usize = 64 * 1024;
const PORT: u16 = 7500;
const AUDIT_ERRORS: &str = "connreap_audit_write_errors_total";
const KILLED: &str = r#"connreap_reclaims_total{policy="pool-leak",result="killed"}"#;

#[test]
fn full_audit_disk_kills_nothing_until_space_returns_then_each_intent_precedes_its_kill() {
    let Some(_env) = require_privileges() else {
        return;
    };
    let ns = NetNs::new("sf-full");
    let dir = TempDir::new("sf-full");
    let fs = Tmpfs::mount(&dir.path("auditfs"), FS_SIZE, false);
    let audit = fs.path("audit.jsonl");
    fs.fill();
    let (client, leaked) = pool(&ns, PORT, 4);
    let config = Config::new(&dir)
        .protect_ports(&[22])
        .audit_log(&audit)
        .policy(&pool_policy("pool-leak", "enforce", PORT, ""));
    let mut agent = Agent::start(&ns, &dir, &config);

    // Rounds run, the kill intents cannot be written: several rounds later nothing was killed.
    wait_until(SCAN * 10, POLL, || {
        (agent.metric(AUDIT_ERRORS).unwrap_or(0.0) >= 3.0).then_some(())
    })
    .unwrap_or_else(|| {
        panic!(
            "{AUDIT_ERRORS} never reached 3 on a full disk:\n{}\n{}",
            agent.metrics(),
            agent.ctx()
        )
    });
    assert_eq!(
        close_wait_to(&ns, PORT, client.pid()),
        leaked,
        "a socket was closed although its kill could not be audited:\n{}",
        agent.ctx()
    );
    assert!(alive(client.pid()), "the pool's process died");
    assert_eq!(
        agent.metric(KILLED).unwrap_or(0.0),
        0.0,
        "{}",
        agent.metrics()
    );
    let lines = read_audit(&audit);
    assert!(
        result_is(&lines, "killed").is_empty() && result_is(&lines, "kill-intent").is_empty(),
        "{lines:#?}"
    );

    // The user sees why: /healthz degraded naming the file, the ERROR line, and decisions
    // that are would-kill in a dry-run mode naming the audit log.
    agent.assert_alive();
    let (code, health) = agent.get("/healthz");
    assert_eq!(code, 200, "{health}");
    assert_eq!(health["status"], "degraded", "{health}");
    let audit_shown = audit.display().to_string();
    let problems = health["problems"].as_array().cloned().unwrap_or_default();
    assert!(
        problems.iter().any(|p| p
            .as_str()
            .is_some_and(|p| p.contains(&audit_shown) && p.contains("No space left"))),
        "/healthz names no audit log problem: {health}"
    );
    let stderr = agent.stderr();
    assert!(
        stderr
            .lines()
            .any(|l| l.contains("ERROR") && l.contains("kill intents") && l.contains(&audit_shown)),
        "no ERROR line about the kill intents:\n{stderr}"
    );
    let recent = agent.get_ok("/v1/reclaims")["reclaims"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let would = result_is(&recent, "would-kill");
    assert!(!would.is_empty(), "{recent:#?}");
    for d in &would {
        let mode = text(d, "mode");
        assert!(
            mode.starts_with("dry-run") && mode.contains("audit log is not writable"),
            "{d}"
        );
    }

    // Space again: the next round kills every leaked socket, intent first.
    fs.free();
    wait_until(SCAN * 8, POLL, || {
        close_wait_to(&ns, PORT, client.pid())
            .is_empty()
            .then_some(())
    })
    .unwrap_or_else(|| panic!("nothing killed after space returned:\n{}", agent.ctx()));
    assert!(alive(client.pid()), "the pool's process died");
    let lines = read_audit(&audit);
    let killed = result_is(&lines, "killed");
    let locals: BTreeSet<String> = killed.iter().map(|d| text(d, "local").into()).collect();
    assert_eq!(
        (killed.len(), &locals),
        (leaked.len(), &leaked),
        "{lines:#?}"
    );
    assert_write_ahead(&lines);
    // A good write clears the problem.
    wait_until(SCAN * 5, POLL, || {
        let (_, h) = agent.get("/healthz");
        (h["status"] == "ok").then_some(())
    })
    .unwrap_or_else(|| panic!("/healthz still degraded:\n{}", agent.ctx()));
}

/// A dry-run policy's decisions made while the disk was full are written once space returns:
/// "unchanged decisions are written once" must count only lines that were written.
#[test]
fn dry_run_decisions_lost_to_a_full_audit_disk_are_written_once_space_returns() {
    let Some(_env) = require_privileges() else {
        return;
    };
    let ns = NetNs::new("sf-lost");
    let dir = TempDir::new("sf-lost");
    let fs = Tmpfs::mount(&dir.path("auditfs"), FS_SIZE, false);
    let audit = fs.path("audit.jsonl");
    fs.fill();
    let (client, leaked) = pool(&ns, PORT, 3);
    let config = Config::new(&dir)
        .protect_ports(&[22])
        .audit_log(&audit)
        .policy(&pool_policy("pool-leak", "dry-run", PORT, ""));
    let agent = Agent::start(&ns, &dir, &config);
    wait_until(SCAN * 10, POLL, || {
        (agent.metric(AUDIT_ERRORS).unwrap_or(0.0) >= 2.0).then_some(())
    })
    .unwrap_or_else(|| panic!("no audit write error on a full disk:\n{}", agent.ctx()));
    assert!(read_audit(&audit).is_empty());
    let (_, health) = agent.get("/healthz");
    assert_eq!(health["status"], "degraded", "{health}");

    fs.free();
    wait_until(SCAN * 6, POLL, || {
        (read_audit(&audit).len() >= leaked.len()).then_some(())
    })
    .unwrap_or_else(|| {
        panic!(
            "the decisions never reached the audit log after space returned:\n{}",
            agent.ctx()
        )
    });
    agent.wait_scans(2);
    let lines = read_audit(&audit);
    let would = result_is(&lines, "would-kill");
    let locals: BTreeSet<String> = would.iter().map(|d| text(d, "local").into()).collect();
    assert_eq!(
        (lines.len(), &locals),
        (leaked.len(), &leaked),
        "{lines:#?}"
    );
    assert!(would.iter().all(|d| d["mode"] == "dry-run"), "{lines:#?}");
    let (_, health) = agent.get("/healthz");
    assert_eq!(health["status"], "ok", "{health}");
    assert_eq!(close_wait_to(&ns, PORT, client.pid()), leaked);
}

/// Every `killed` line comes after a `kill-intent` line for the same socket, policy and round.
fn assert_write_ahead(lines: &[Value]) {
    let key = |d: &Value| {
        (
            d["agent_pid"].clone(),
            d["round"].clone(),
            d["policy"].clone(),
            d["local"].clone(),
            d["peer"].clone(),
            d["inode"].clone(),
        )
    };
    for (i, d) in lines.iter().enumerate() {
        if d["result"] != "killed" {
            continue;
        }
        assert_eq!(text(d, "mode"), "enforce", "{d}");
        assert!(
            lines[..i]
                .iter()
                .any(|e| e["result"] == "kill-intent" && key(e) == key(d)),
            "killed line {} has no kill-intent line before it:\n{lines:#?}",
            i + 1
        );
    }
}

/// `connreap reclaim --policy POLICY --config CONFIG` in `ns`.
fn reclaim(ns: &NetNs, config: &Path, policy: &str) -> Output {
    let mut cmd = ns.connreap(["reclaim", "--policy", policy, "--config"]);
    cmd.arg(config);
    run(&mut cmd, CONNREAP_TIMEOUT)
}

/// The decisions `connreap reclaim` printed (JSON lines on stdout).
fn printed(out: &Output) -> Vec<Value> {
    out.stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l:?}\n{out:?}")))
        .collect()
}

#[test]
fn cli_reclaim_exits_3_when_its_enforce_policy_cannot_write_the_audit_log() {
    let Some(_env) = require_privileges() else {
        return;
    };
    let ns = NetNs::new("sf-cli");
    let dir = TempDir::new("sf-cli");
    let read_only = Tmpfs::mount(&dir.path("ro"), FS_SIZE, true);
    let full = Tmpfs::mount(&dir.path("full"), FS_SIZE, false);
    full.fill();
    let (client, leaked) = pool(&ns, PORT, 3);
    let config_on = |name: &str, fs: &Tmpfs| {
        let audit = fs.path("audit.jsonl");
        let c = Config::new(&dir)
            .protect_ports(&[22])
            .audit_log(&audit)
            .policy(&pool_policy("enforce-pool", "enforce", PORT, ""))
            .policy(&pool_policy("dry-pool", "dry-run", PORT, ""));
        (dir.write(name, &c.to_string()), audit)
    };

    for (fs, why) in [
        (&read_only, "Read-only file system"),
        (&full, "No space left on device"),
    ] {
        let (config, audit) = config_on("connreap.toml", fs);
        let out = reclaim(&ns, &config, "enforce-pool");
        assert_eq!(out.status.code(), Some(3), "{why}: {out:?}");
        let audit_shown = audit.display().to_string();
        assert!(
            out.stderr.lines().any(|l| l.contains("enforce-pool")
                && l.contains("audit log is not writable")
                && l.contains(&audit_shown)
                && l.contains(why)),
            "stderr must say why the enforce policy did not enforce: {out:?}"
        );
        let decisions = printed(&out);
        assert_eq!(decisions.len(), leaked.len(), "{out:?}");
        assert!(
            decisions.iter().all(|d| d["result"] == "would-kill"),
            "{out:?}"
        );
        assert_eq!(close_wait_to(&ns, PORT, client.pid()), leaked, "{why}");

        // A dry-run policy is not refused anything: exit 0.
        let out = reclaim(&ns, &config, "dry-pool");
        assert_eq!(out.status.code(), Some(0), "{why}: {out:?}");
        assert_eq!(printed(&out).len(), leaked.len(), "{out:?}");
        assert_eq!(close_wait_to(&ns, PORT, client.pid()), leaked, "{why}");
    }

    // With space again the same command kills (exit 0): the 3 above was the audit log.
    full.free();
    let (config, audit) = config_on("connreap.toml", &full);
    let out = reclaim(&ns, &config, "enforce-pool");
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    assert!(close_wait_to(&ns, PORT, client.pid()).is_empty(), "{out:?}");
    let lines = read_audit(&audit);
    assert_eq!(
        result_is(&lines, "killed").len(),
        leaked.len(),
        "{lines:#?}"
    );
    assert_write_ahead(&lines);
    assert!(alive(client.pid()), "the pool's process died");
}
