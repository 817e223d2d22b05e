//! The hidden namespace: a process in the host's namespace `setns`-es into a fresh network
//! namespace, opens a listener and leaks CLOSE_WAIT sockets there, and comes back to its own
//! namespace holding them (`connreap-testpeer close-wait --netns-file`). Then the namespace's
//! name goes (`ip netns del`): no name, no process in it, only sockets a process elsewhere
//! holds. The leak goes on, so connreap must go on showing it in that namespace: `snapshot`,
//! `/v1/sockets` and the `close_wait_buildup` finding (no namespace is lost while a
//! socket in it is alive).

use std::{
    os::{
        fd::{AsRawFd, FromRawFd, OwnedFd},
        unix::{fs::MetadataExt, process::CommandExt},
    },
    process::Command,
};

use connreap_tests::harness::{
    ip, program, snapshot_in_host, sockets, wait_until, Agent, Child, TempDir, FINDING, POLL,
    READY_TIMEOUT, TESTPEER,
};
use serde_json::Value;

use super::{host_config, host_receiver, names_pid, setup, Parts};

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
    let ns = Named(format!("cr-hidden-{}-0", std::process::id()));
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
    // While it has a name, the leak is found (what connreap did without namespace support).
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
    // `ss` in the host's namespace cannot see them; `ss` inside the hidden namespace, reached
    // through one of the holder's sockets (SIOCGSKNS), shows them all, still CLOSE-WAIT.
    assert_eq!(
        close_wait_of(holder.pid(), None),
        0,
        "the leak is not in the host's namespace"
    );
    let ns_fd = netns_of_sockets(holder.pid(), inode);
    assert_eq!(
        close_wait_of(holder.pid(), Some(&ns_fd)),
        LEAKED,
        "the leak goes on in namespace {inode}"
    );

    let mut parts = Parts::new();
    parts.check("the close_wait_buildup goes on", || {
        // Over several walks (every 2 s) and the scans between, the leak stays in view.
        for _ in 0..3 {
            agent.wait_scans(2);
            let f = agent.find("close_wait_buildup", mine).unwrap_or_else(|| {
                panic!(
                    "after `ip netns del`, the close_wait_buildup in namespace {inode} \
                     (held by pid {}) must go on; findings: {:#?}\n{}",
                    holder.pid(),
                    agent.findings(),
                    agent.ctx()
                )
            });
            assert_eq!(f["count"], LEAKED, "{f:#}");
        }
    });
    parts.check("/v1/sockets shows them", || {
        let (code, body) = agent.get(&format!(
            "/v1/sockets?state=CLOSE_WAIT&pid={}",
            holder.pid()
        ));
        assert_eq!(code, 200, "{body}");
        let rows = body["sockets"].as_array().cloned().unwrap_or_default();
        assert_eq!(
            rows.iter().filter(|r| r["netns"] == inode).count(),
            LEAKED,
            "/v1/sockets must show the {LEAKED} CLOSE_WAIT sockets in namespace \
             {inode}: {body:#}"
        );
    });
    parts.check("a fresh `connreap snapshot` shows them", || {
        // It never saw the namespace's name.
        let snap = snapshot_in_host(&["--state", "CLOSE_WAIT"]);
        let found: Vec<_> = sockets(&snap)
            .into_iter()
            .filter(|r| r.pid == Some(holder.pid()))
            .collect();
        assert_eq!(
            found.len(),
            LEAKED,
            "`connreap snapshot` must show the {LEAKED} CLOSE_WAIT sockets of pid {} \
             in the unnamed namespace {inode}: {snap:#}",
            holder.pid()
        );
        for r in &found {
            assert_eq!(r.netns, Some(inode), "{r:#?}");
            assert_eq!(r.netns_name, None, "no name any more: {r:#?}");
            assert_eq!(r.service_port, PORT, "{r:#?}");
        }
    });
    parts.finish();
}

/// `SIOCGSKNS` (linux/sockios.h): a socket's network namespace, as a new namespace fd.
const SIOCGSKNS: libc::c_ulong = 0x894C;

/// A namespace fd for `inode`, found through one of `pid`'s sockets: each socket fd of the
/// process is copied here (`pidfd_getfd`) and asked for its namespace (`SIOCGSKNS`).
fn netns_of_sockets(pid: u32, inode: u64) -> OwnedFd {
    // SAFETY: pidfd_open(2) on a pid, no pointers; a negative result is an error.
    let pidfd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    assert!(
        pidfd >= 0,
        "pidfd_open({pid}): {}",
        std::io::Error::last_os_error()
    );
    // SAFETY: a fresh fd that nothing else owns.
    let pidfd = unsafe { OwnedFd::from_raw_fd(pidfd as i32) };
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).expect("fd directory");
    for e in fds.flatten() {
        let is_socket =
            std::fs::read_link(e.path()).is_ok_and(|l| l.to_string_lossy().starts_with("socket:"));
        let Some(target) = e.file_name().to_str().and_then(|n| n.parse::<i32>().ok()) else {
            continue;
        };
        if !is_socket {
            continue;
        }
        // SAFETY: pidfd_getfd(2) copies fd `target` of the process into this one.
        let sock = unsafe { libc::syscall(libc::SYS_pidfd_getfd, pidfd.as_raw_fd(), target, 0) };
        if sock < 0 {
            continue;
        }
        // SAFETY: a fresh fd that nothing else owns.
        let sock = unsafe { OwnedFd::from_raw_fd(sock as i32) };
        // SAFETY: SIOCGSKNS takes no argument and returns a new fd (or -1).
        let ns = unsafe { libc::ioctl(sock.as_raw_fd(), SIOCGSKNS as _) };
        if ns < 0 {
            continue;
        }
        // SAFETY: a fresh fd that nothing else owns.
        let ns = unsafe { OwnedFd::from_raw_fd(ns) };
        if std::fs::File::from(ns.try_clone().expect("dup"))
            .metadata()
            .is_ok_and(|m| m.ino() == inode)
        {
            return ns;
        }
    }
    panic!("no socket of pid {pid} is in namespace {inode}");
}

/// CLOSE-WAIT sockets of `pid` that `ss` shows in this process's namespace, or in `ns`.
fn close_wait_of(pid: u32, ns: Option<&OwnedFd>) -> usize {
    let mut cmd = Command::new("ss");
    cmd.args(["-Htanp"]);
    if let Some(ns) = ns {
        let fd = ns.as_raw_fd();
        // SAFETY: setns(2) on an fd that stays open until exec; only the child changes.
        unsafe {
            cmd.pre_exec(move || {
                if libc::setns(fd, libc::CLONE_NEWNET) == 0 {
                    Ok(())
                } else {
                    Err(std::io::Error::last_os_error())
                }
            });
        }
    }
    let out = cmd.output().expect("ss");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.starts_with("CLOSE-WAIT") && l.contains(&format!("pid={pid},")))
        .count()
}
