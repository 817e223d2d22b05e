//! One daemon in the host's network namespace covering every namespace and container
//! on the host. Each test makes its "pods" itself: a network namespace, a cgroup v2 directory
//! named like a Docker / containerd (Kubernetes) / podman container's, and a real process in
//! both that listens on the same port as every other pod ([`PORT`]) and never closes the
//! connections its clients closed (CLOSE_WAIT). connreap runs in the host's namespace, as in
//! production, with its API on a free port.
//!
//! Tests that need no cgroup v2 hierarchy print `skipped: <reason>` without one (hybrid hosts
//! mount it at /sys/fs/cgroup/unified, which is used then).

mod between_walks;
mod bpf_fallback;
mod disappears;
mod hidden;
mod relay_chain;
mod scoped_policy;
mod sockets_api;
mod storm_in_pod;
mod three_containers;

use connreap_tests::harness::alerts::host_receiver;
use std::{
    collections::BTreeSet,
    net::{SocketAddr, TcpStream},
    path::PathBuf,
};

use connreap_tests::{
    fixtures::{free_addr, http::connect, ss_tcp, SsSocket, WebhookReceiver},
    harness::{
        addr,
        alerts::describe,
        containers::{cgroup2_root, FakeContainer},
        program, wait_until, Agent, Child, Config, NetNs, TempDir, FINDING, HTTP, PEER_COMM, POLL,
        READY_TIMEOUT, TESTPEER,
    },
};
use serde_json::{json, Value};

/// The port every pod's server listens on (inside its own namespace).
const PORT: u16 = 8080;
/// CLOSE_WAIT sockets each leaking pod holds.
const LEAKED: usize = 6;
/// `[detect]` for the tests: CLOSE_WAIT counts after 1 s, 4 of them make a finding.
const FAST_CLOSE_WAIT: &str = "close_wait_min_age = \"1s\"\nclose_wait_threshold = 4";

/// The cgroup v2 root, or `None` after printing why the test is skipped.
fn cgroups() -> Option<PathBuf> {
    match cgroup2_root() {
        Ok(root) => Some(root),
        Err(reason) => {
            println!("skipped: {reason}");
            None
        }
    }
}

/// The inode of the network namespace `pid` runs in (`/proc/PID/ns/net` -> `net:[INODE]`).
fn netns_inode_of(pid: u32) -> u64 {
    let link = std::fs::read_link(format!("/proc/{pid}/ns/net"))
        .unwrap_or_else(|e| panic!("readlink /proc/{pid}/ns/net: {e}"));
    let text = link.to_string_lossy();
    text.strip_prefix("net:[")
        .and_then(|s| s.strip_suffix(']'))
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("/proc/{pid}/ns/net -> {text}: not net:[INODE]"))
}

/// A pod: its network namespace, its container's cgroup and the server that leaks in both
/// (or a bare namespace with no container). Dropping it kills the server, removes the cgroup,
/// then deletes the namespace (fields drop in this order).
struct Pod {
    server: Child,
    cgroup: Option<FakeContainer>,
    ns: NetNs,
    /// The namespace's inode, read from the server's /proc/PID/ns/net.
    inode: u64,
}

impl Pod {
    /// A namespace `tag`, `container`'s cgroup and `connreap-testpeer listen` on [`PORT`] in
    /// both, holding whatever it accepts.
    fn start(tag: &str, container: FakeContainer) -> Pod {
        Pod::spawn(tag, Some(container))
    }

    /// [`Pod::start`] without a container: a bare namespace, as `ip netns add` makes one.
    fn bare(tag: &str) -> Pod {
        Pod::spawn(tag, None)
    }

    fn spawn(tag: &str, cgroup: Option<FakeContainer>) -> Pod {
        let ns = NetNs::new(tag);
        let mut cmd = match &cgroup {
            Some(c) => c.command(&ns, program(TESTPEER)),
            None => ns.command(program(TESTPEER)),
        };
        cmd.args(["listen", "--addr", &format!("127.0.0.1:{PORT}")]);
        let mut server = Child::spawn(&mut cmd, &format!("{TESTPEER} listen in {}", ns.name()));
        server.wait_ready(READY_TIMEOUT);
        let inode = netns_inode_of(server.pid());
        if let Some(c) = &cgroup {
            assert!(
                c.pids().contains(&server.pid()),
                "the server (pid {}) is not in its container's cgroup {}: {:?}",
                server.pid(),
                c.cgroup(),
                std::fs::read_to_string(format!("/proc/{}/cgroup", server.pid()))
            );
        }
        Pod {
            server,
            cgroup,
            ns,
            inode,
        }
    }

    /// The pod's container; panics for a bare namespace.
    fn container(&self) -> &FakeContainer {
        self.cgroup
            .as_ref()
            .unwrap_or_else(|| panic!("{} has no container", self.name()))
    }

    fn pid(&self) -> u32 {
        self.server.pid()
    }

    fn name(&self) -> &str {
        self.ns.name()
    }

    /// `n` clients in the pod's namespace connect and close: the server, which never closes,
    /// holds `n` more CLOSE_WAIT sockets. Returns once `ss` in the namespace shows them.
    fn leak(&self, n: usize) {
        let before = self.close_wait().len();
        let clients: Vec<TcpStream> = (0..n)
            .map(|_| {
                connect(Some(self.name()), addr(&format!("127.0.0.1:{PORT}")), HTTP)
                    .unwrap_or_else(|e| panic!("connect in {}: {e}", self.name()))
            })
            .collect();
        drop(clients);
        let want = before + n;
        wait_until(HTTP, POLL, || {
            (self.close_wait().len() == want).then_some(())
        })
        .unwrap_or_else(|| {
            panic!(
                "{}: expected {want} CLOSE-WAIT on port {PORT}, ss shows {:#?}",
                self.name(),
                self.close_wait()
            )
        });
    }

    /// The server's CLOSE-WAIT sockets on [`PORT`], as `ip netns exec NS ss` shows them.
    fn close_wait(&self) -> Vec<SsSocket> {
        ss_tcp(Some(self.name()))
            .unwrap_or_else(|e| panic!("ss in {}: {e}", self.name()))
            .into_iter()
            .filter(|s| s.state == "CLOSE-WAIT" && s.local.port() == PORT)
            .collect()
    }

    /// The (local, peer) pairs of [`Pod::close_wait`].
    fn close_wait_pairs(&self) -> BTreeSet<(SocketAddr, SocketAddr)> {
        self.close_wait()
            .into_iter()
            .map(|s| (s.local, s.peer))
            .collect()
    }

    /// Who this pod is, for failure messages.
    fn describe(&self) -> String {
        let container = match &self.cgroup {
            Some(c) => format!("{} container {}", c.runtime, c.short()),
            None => "no container".to_string(),
        };
        format!(
            "pod {} (netns inode {}, {container}, pid {})",
            self.name(),
            self.inode,
            self.pid()
        )
    }
}

/// An enforcing `[[policy]]` named `name` that always runs and kills the CLOSE_WAIT of the
/// pods' server ([`PEER_COMM`] on [`PORT`]) matching `scope` too (`netns = "..."`,
/// `container = "..."`): comm, port and state match every pod's leak, so only `scope` tells
/// them apart.
fn close_wait_policy(name: &str, scope: &str) -> String {
    format!(
        r#"[[policy]]
name = "{name}"
mode = "enforce"
trigger = "always"
select = {{ {scope}, comm = "{PEER_COMM}", local_port = {PORT}, states = ["CLOSE_WAIT"] }}
"#
    )
}

/// What the tests' host daemon runs: alerts to `hook` (fast retries), the API on a free port,
/// fast CLOSE_WAIT detection.
fn host_config(dir: &TempDir, hook: &WebhookReceiver) -> Config {
    Config::alerting_to(dir, &hook.url("/alerts"))
        .listen(free_addr())
        .detect(FAST_CLOSE_WAIT)
}

/// Whether an alert or finding names `pid` among its processes.
fn names_pid(b: &Value, pid: u32) -> bool {
    b["processes"]
        .as_array()
        .is_some_and(|ps| ps.iter().any(|p| p["pid"] == json!(pid)))
}

/// Wait for a `close_wait_buildup` alert with `status` naming `pod`'s server; panics saying
/// what arrived instead.
fn wait_close_wait_alert(hook: &WebhookReceiver, agent: &Agent, pod: &Pod, status: &str) -> Value {
    wait_close_wait_alert_of(hook, agent, pod.pid(), &pod.describe(), status)
}

/// [`wait_close_wait_alert`] by the server's pid (`who` describes it in the message).
fn wait_close_wait_alert_of(
    hook: &WebhookReceiver,
    agent: &Agent,
    pid: u32,
    who: &str,
    status: &str,
) -> Value {
    hook.wait_for_body(FINDING, |b| {
        b["kind"] == "close_wait_buildup" && b["status"] == status && names_pid(b, pid)
    })
    .map(|p| p.body)
    .unwrap_or_else(|| {
        panic!(
            "no {status} close_wait_buildup alert naming pid {pid} of {who} within {FINDING:?} \
             (one finding per namespace: part (a) of the attribution); the receiver got:\n{}\n\
             current findings: {:#?}\nagent stderr:\n{}",
            describe(&hook.posts()),
            agent.findings(),
            agent.stderr()
        )
    })
}

/// Where the attribution of findings, alerts and audit lines comes from.
const ATTRIBUTION: &str = "the attribution of findings, alerts and audit lines to namespaces";

/// An alert, finding or audit line names the namespace `inode` (`netns`) and its `name`
/// (`netns_name`).
fn assert_names_netns(b: &Value, inode: u64, name: &str, what: &str) {
    assert_eq!(
        (&b["netns"], &b["netns_name"]),
        (&json!(inode), &json!(name)),
        "{what} must carry `netns` = {inode} and `netns_name` = {name:?} ({ATTRIBUTION}):\n{b:#}"
    );
}

/// An alert, finding, or audit line names `pod`'s namespace (`netns` inode, `netns_name`)
/// and, with `container`, its container (`container` id, `container_runtime`, pod fields).
fn assert_names_pod(b: &Value, pod: &Pod, container: bool, what: &str) {
    assert_names_netns(
        b,
        pod.inode,
        pod.name(),
        &format!("{what} for {}", pod.describe()),
    );
    if !container {
        return;
    }
    let c = pod.container();
    assert_eq!(
        (&b["container"], &b["container_runtime"]),
        (&json!(c.id), &json!(c.runtime)),
        "{what} for {} must carry `container` and `container_runtime` ({ATTRIBUTION}):\n{b:#}",
        pod.describe()
    );
    if let Some(p) = &c.pod {
        assert_eq!(
            (&b["pod_uid"], &b["pod_name"], &b["pod_namespace"]),
            (&json!(p.uid), &json!(p.name), &json!(p.namespace)),
            "{what} for {} must carry its pod ({ATTRIBUTION}):\n{b:#}",
            pod.describe()
        );
    }
}
