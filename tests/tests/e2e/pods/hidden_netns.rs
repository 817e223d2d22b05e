//! The hidden namespace: a process in the host's namespace `setns`-es into a fresh network
//! namespace, opens a listener and leaks CLOSE_WAIT sockets there, and comes back to its own
//! namespace holding them (`connreap-testpeer close-wait --netns-file`). Then the namespace's
//! name goes (`ip netns del`): no name, no process in it, only sockets a process elsewhere
//! holds. The leak goes on, so connreap must go on showing it in that namespace: `snapshot`,
//! `/v1/sockets` and the `close_wait_buildup` finding (issue 26: no namespace is lost while a
//! socket in it is alive).

use std::{os::unix::fs::MetadataExt, process::Command};

use connreap_tests::harness::{
    ip, program, snapshot_in_host, sockets, wait_until, Agent, Child, TempDir, FINDING, POLL,
    READY_TIMEOUT, TESTPEER,
};
use serde_json::Value;

use super::{host_config, host_receiver, names_pid, setup};

const PORT: u16 = 7700;
const LEAKED: usize = 6;

/// A namespace made with `ip netns add`, whose name the test deletes; deleted on drop if the
/// test did not get there.
struct Named(String);

impl Drop for Named {
    fn drop(&mut self) {
        let path = format!("/run/netns/{}", self.0);
        if std::path::Path::new(&path).exists() {
            let _ = Command::new("ip").args(["netns", "del", &self.0]).status();
        }
    }
}

/// Pids of processes whose network namespace is `inode`.
fn processes_in(inode: u64) -> Vec<u32> {
    std::fs::read_dir("/proc")
        .map(|d| {
            d.flatten()
                .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
                .filter(|pid| {
                    std::fs::metadata(format!("/proc/{pid}/ns/net")).is_ok_and(|m| m.ino() == inode)
                })
                .collect()
        })
        .unwrap_or_default()
}

#[test]
fn sockets_of_a_namespace_with_no_name_and_no_process_are_still_seen() {
    let Some((_env, _root)) = setup() else { return };
    let ns = Named(format!("cr-hidden-{}", std::process::id()));
    ip(&["netns", "add", &ns.0]);
    ip(&["-n", &ns.0, "link", "set", "lo", "up"]);
    let path = format!("/run/netns/{}", ns.0);
    let inode = std::fs::metadata(&path)
        .unwrap_or_else(|e| panic!("stat {path}: {e}"))
        .ino();
    let host = std::fs::metadata("/proc/self/ns/net")
        .expect("own netns")
        .ino();

    let mut cmd = Command::new(program(TESTPEER));
    cmd.args([
        "close-wait",
        "--addr",
        &format!("127.0.0.1:{PORT}"),
        "--count",
        &LEAKED.to_string(),
        "--netns-file",
        &path,
    ]);
    let mut holder = Child::spawn(&mut cmd, "connreap-testpeer close-wait --netns-file");
    let ready = holder.wait_ready(READY_TIMEOUT);
    assert_eq!(ready.get("netns"), inode.to_string(), "{}", ready.line);
    assert_eq!(
        ready.get("home"),
        host.to_string(),
        "came back home: {}",
        ready.line
    );

    let dir = TempDir::new("pods-hidden");
    let hook = host_receiver();
    let config = host_config(&dir, &hook)
        .detect("close_wait_min_age = \"1s\"\nclose_wait_threshold = 4")
        .netns_walk_interval("2s");
    let agent = Agent::start_in_host(&dir, &config);
    let mine = |f: &Value| {
        f["kind"] == "close_wait_buildup" && f["netns"] == inode && names_pid(f, holder.pid())
    };
    // While it has a name, the leak is found (what connreap did before issue 26).
    wait_until(FINDING, POLL, || agent.find("close_wait_buildup", mine)).unwrap_or_else(|| {
        panic!(
            "no close_wait_buildup in the named namespace {} (inode {inode}): {:#?}\n{}",
            ns.0,
            agent.findings(),
            agent.ctx()
        )
    });

    // Its name goes; no process is in it (the holder lives in the host's namespace).
    ip(&["netns", "del", &ns.0]);
    assert!(!std::path::Path::new(&path).exists(), "{path} still there");
    assert_eq!(
        processes_in(inode),
        Vec::<u32>::new(),
        "processes in {inode}"
    );
    let ss_count = || {
        let out = Command::new("ss")
            .args(["-Htanp", "state", "close-wait"])
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            .unwrap_or_default();
        out.lines()
            .filter(|l| l.contains(&format!("pid={},", holder.pid())))
            .count()
    };
    // `ss` in the host's namespace cannot see them: they are in the hidden one.
    assert_eq!(ss_count(), 0, "the leak is not in the host's namespace");

    // Over several walks (every 2 s) and the scans between, the leak stays in view.
    for _ in 0..3 {
        agent.wait_scans(2);
        let f = agent.find("close_wait_buildup", mine).unwrap_or_else(|| {
            panic!(
                "issue 26: after `ip netns del`, the close_wait_buildup in namespace {inode} \
                 (held by pid {}) must go on: findings {:#?}\n{}",
                holder.pid(),
                agent.findings(),
                agent.ctx()
            )
        });
        assert_eq!(f["count"], LEAKED, "{f:#}");
    }
    let (code, body) = agent.get(&format!(
        "/v1/sockets?state=CLOSE_WAIT&pid={}",
        holder.pid()
    ));
    assert_eq!(code, 200, "{body}");
    let rows = body["sockets"].as_array().cloned().unwrap_or_default();
    assert_eq!(
        rows.iter().filter(|r| r["netns"] == inode).count(),
        LEAKED,
        "issue 26: /v1/sockets must show the {LEAKED} CLOSE_WAIT sockets in namespace {inode}: {body:#}"
    );

    // A fresh `connreap snapshot`, which never saw the namespace's name, finds them too.
    let snap = snapshot_in_host(&["--state", "CLOSE_WAIT"]);
    let found: Vec<_> = sockets(&snap)
        .into_iter()
        .filter(|r| r.pid == Some(holder.pid()))
        .collect();
    assert_eq!(
        found.len(),
        LEAKED,
        "issue 26: `connreap snapshot` must show the {LEAKED} CLOSE_WAIT sockets of pid {} in \
         the unnamed namespace {inode}: {snap:#}",
        holder.pid()
    );
    for r in &found {
        assert_eq!(r.netns, Some(inode), "{r:#?}");
        assert_eq!(r.netns_name, None, "no name any more: {r:#?}");
        assert_eq!(r.service_port, PORT, "{r:#?}");
    }
}
