//! The pod layout of a Kubernetes node, for real: a "node" network namespace with a Linux
//! bridge, pod namespaces each joined to it by a veth pair with an address of its own, a
//! Service (an iptables DNAT rule in the node namespace, as kube-proxy writes one), and each
//! pod's workloads in a [`FakeContainer`]'s cgroup.
//!
//! Addresses: the pod network is [`POD_NET`]`.0/24`, the node's bridge [`GATEWAY`], pods from
//! `.2` up; ClusterIPs are taken from `10.96.0.0/16` by the tests.
//!
//! Routing: each pod has a `/32` address on its `eth0`, a link route to the gateway and a
//! default route via it, so every packet between pods, even on the same bridge, is routed
//! through the node namespace (`ip_forward = 1`, `send_redirects = 0`, so the node never tells
//! a pod to go direct). That makes a Service work both ways: the DNAT in PREROUTING rewrites
//! the request, and the reply comes back through the same node namespace, where conntrack
//! un-DNATs it. (With plain /24 addresses the reply would go pod-to-pod on the bridge,
//! skipping the un-DNAT, and the client would drop it: the bridge-hairpin problem.) A pod
//! reaching itself through its own Service would need kube-proxy's hairpin masquerade, which
//! is not set up here.
//!
//! Everything is removed on drop: a [`Pod`] deletes its node-side veth (which takes the pod's
//! `eth0` with it), its container's cgroup, then its namespace; a [`Service`] its rule; the
//! [`Node`] its namespace (with the bridge). A pod namespace that a process still holds a
//! socket in lives on until that socket is closed, but without a name or a link.

use std::{
    cell::Cell,
    ffi::OsStr,
    net::{Ipv4Addr, SocketAddr},
    os::unix::fs::MetadataExt,
    path::PathBuf,
    process::{Command, Stdio},
};

use super::{
    consts::{READY_TIMEOUT, TESTPEER},
    containers::FakeContainer,
    netns::{ip, NetNs},
    process::{program, Child, Ready},
};

/// The pod network's first three octets: pods are `10.244.0.N/32`.
pub const POD_NET: [u8; 3] = [10, 244, 0];
/// The node's address on the bridge: every pod's gateway.
pub const GATEWAY: Ipv4Addr = Ipv4Addr::new(10, 244, 0, 1);
/// The bridge's name inside the node namespace.
const BRIDGE: &str = "cni0";

/// Why the pod tests cannot run here (`iptables` or `node` missing), for `skipped: reason`.
pub fn missing_pod_tools() -> Option<String> {
    if !runs(Command::new("iptables").arg("-V")) {
        return Some("`iptables` not found (cargo xtask installs it: TEST_PACKAGES)".into());
    }
    if node_bin().is_none() {
        return Some("`node` (Node.js) not found (cargo xtask installs `nodejs`)".into());
    }
    None
}

fn runs(cmd: &mut Command) -> bool {
    cmd.stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// The Node.js interpreter: `$NODE`, else `/usr/bin/node`, else `node` on `$PATH`.
pub fn node_bin() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("NODE").map(PathBuf::from) {
        return p.is_file().then_some(p);
    }
    let usr = PathBuf::from("/usr/bin/node");
    if usr.is_file() {
        return Some(usr);
    }
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join("node"))
            .find(|p| p.is_file())
    })
}

/// `tests/node/NAME`: a Node.js fixture program of this crate.
pub fn node_script(name: &str) -> PathBuf {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("node")
        .join(name);
    assert!(p.is_file(), "Node.js fixture {} missing", p.display());
    p
}

/// Runs `cmd` (a command inside some namespace), which must succeed.
fn must(mut cmd: Command, what: &str) {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("cannot run {what}: {e}"));
    assert!(
        out.status.success(),
        "{what} failed ({}): {}",
        out.status,
        String::from_utf8_lossy(&out.stderr).trim()
    );
}

/// `sysctl -w KEY=VALUE` inside namespace `ns` (network sysctls are per namespace).
pub fn netns_sysctl(ns: &NetNs, key: &str, value: &str) {
    let mut cmd = ns.command("sysctl");
    cmd.args(["-q", "-w", &format!("{key}={value}")]);
    must(cmd, &format!("sysctl -w {key}={value} in {}", ns.name()));
}

/// The inode of a named namespace (what connreap reports as `netns`).
fn inode_of(ns: &NetNs) -> u64 {
    let path = format!("/run/netns/{}", ns.name());
    std::fs::metadata(&path)
        .unwrap_or_else(|e| panic!("stat {path}: {e}"))
        .ino()
}

/// The node: its network namespace, with the bridge [`BRIDGE`] at [`GATEWAY`]/24, forwarding
/// on and redirects off. Pods are added with [`Node::pod`].
pub struct Node {
    ns: NetNs,
    /// The last octet of the next pod's address.
    next: Cell<u8>,
}

impl Node {
    pub fn new(tag: &str) -> Node {
        let ns = NetNs::new(tag);
        let n = ns.name();
        ip(&["-n", n, "link", "add", BRIDGE, "type", "bridge"]);
        ip(&[
            "-n",
            n,
            "addr",
            "add",
            &format!("{GATEWAY}/24"),
            "dev",
            BRIDGE,
        ]);
        ip(&["-n", n, "link", "set", BRIDGE, "up"]);
        netns_sysctl(&ns, "net.ipv4.ip_forward", "1");
        for dev in ["all", "default", BRIDGE] {
            netns_sysctl(&ns, &format!("net.ipv4.conf.{dev}.send_redirects"), "0");
        }
        Node {
            ns,
            next: Cell::new(2),
        }
    }

    pub fn ns(&self) -> &NetNs {
        &self.ns
    }

    /// A new pod `tag`: its namespace, a veth pair to the bridge, the next free address, and
    /// (when given) the container its workloads run in.
    pub fn pod(&self, tag: &str, container: Option<FakeContainer>) -> Pod {
        let octet = self.next.get();
        assert!(octet < 250, "too many pods on one node");
        self.next.set(octet + 1);
        let ip4 = Ipv4Addr::new(POD_NET[0], POD_NET[1], POD_NET[2], octet);
        let ns = NetNs::new(tag);
        let inode = inode_of(&ns);
        let veth = format!("veth{octet}");
        let (node, pod) = (self.ns.name(), ns.name().to_string());
        let pod = pod.as_str();
        ip(&[
            "-n", node, "link", "add", &veth, "type", "veth", "peer", "name", "eth0", "netns", pod,
        ]);
        let p = Pod {
            container,
            ns,
            node: node.to_string(),
            veth,
            ip: ip4,
            inode,
        };
        ip(&["-n", node, "link", "set", &p.veth, "master", BRIDGE]);
        ip(&["-n", node, "link", "set", &p.veth, "up"]);
        ip(&[
            "-n",
            pod,
            "addr",
            "add",
            &format!("{ip4}/32"),
            "dev",
            "eth0",
        ]);
        ip(&["-n", pod, "link", "set", "eth0", "up"]);
        let gw = GATEWAY.to_string();
        ip(&[
            "-n", pod, "route", "add", &gw, "dev", "eth0", "scope", "link",
        ]);
        ip(&[
            "-n", pod, "route", "add", "default", "via", &gw, "dev", "eth0",
        ]);
        p
    }

    /// A Service: `cluster` (a ClusterIP:port) DNATed to `backend` (a pod's ip:port) in the
    /// node namespace, removed when the [`Service`] is dropped.
    pub fn service(&self, cluster: SocketAddr, backend: SocketAddr) -> Service {
        let rule = vec![
            "PREROUTING".to_string(),
            "-d".to_string(),
            format!("{}/32", cluster.ip()),
            "-p".to_string(),
            "tcp".to_string(),
            "--dport".to_string(),
            cluster.port().to_string(),
            "-j".to_string(),
            "DNAT".to_string(),
            "--to-destination".to_string(),
            backend.to_string(),
        ];
        self.iptables("-A", &rule);
        Service {
            node: self.ns.name().to_string(),
            rule,
            cluster,
            backend,
        }
    }

    /// Masquerade what the node forwards to `backend` (kube-proxy's SNAT for hairpin and some
    /// Service modes): the server then sees the node's address, not the client's. Removed on
    /// drop, like a [`Service`].
    pub fn masquerade(&self, cluster: SocketAddr, backend: SocketAddr) -> Service {
        let rule: Vec<String> = [
            "POSTROUTING",
            "-d",
            &format!("{}/32", backend.ip()),
            "-p",
            "tcp",
            "--dport",
            &backend.port().to_string(),
            "-j",
            "MASQUERADE",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        self.iptables("-A", &rule);
        Service {
            node: self.ns.name().to_string(),
            rule,
            cluster,
            backend,
        }
    }

    /// `iptables -t nat OP RULE...` in the node namespace; must succeed.
    fn iptables(&self, op: &str, rule: &[String]) {
        let mut cmd = self.ns.command("iptables");
        cmd.args(["-w", "5", "-t", "nat", op]).args(rule);
        must(cmd, &format!("iptables -t nat {op} {}", rule.join(" ")));
    }

    /// The node namespace's NAT table, for failure messages.
    pub fn nat_rules(&self) -> String {
        let out = self
            .ns
            .command("iptables")
            .args(["-w", "5", "-t", "nat", "-S"])
            .output();
        match out {
            Ok(o) => String::from_utf8_lossy(&o.stdout).into_owned(),
            Err(e) => format!("(iptables -S: {e})"),
        }
    }
}

/// A ClusterIP rule of a [`Node`]; deleted on drop.
pub struct Service {
    node: String,
    rule: Vec<String>,
    /// The ClusterIP:port clients dial.
    pub cluster: SocketAddr,
    /// The pod ip:port it leads to.
    pub backend: SocketAddr,
}

impl Drop for Service {
    fn drop(&mut self) {
        let ok = Command::new("ip")
            .args([
                "netns", "exec", &self.node, "iptables", "-w", "5", "-t", "nat", "-D",
            ])
            .args(&self.rule)
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if !ok {
            eprintln!(
                "warning: could not delete the Service rule {} in {}",
                self.rule.join(" "),
                self.node
            );
        }
    }
}

/// A pod: its namespace, joined to the node's bridge, its address, and the container (cgroup)
/// its workloads run in. Processes started with [`Pod::command`] (and the helpers built on it)
/// are the test's to hold; drop them before the pod.
pub struct Pod {
    container: Option<FakeContainer>,
    ns: NetNs,
    node: String,
    /// The veth's node-side name.
    veth: String,
    /// The pod's address.
    pub ip: Ipv4Addr,
    inode: u64,
}

impl Pod {
    pub fn ns(&self) -> &NetNs {
        &self.ns
    }

    pub fn name(&self) -> &str {
        self.ns.name()
    }

    /// The namespace's inode, as connreap reports it in `netns`.
    pub fn inode(&self) -> u64 {
        self.inode
    }

    /// `ip:port` of this pod.
    pub fn addr(&self, port: u16) -> SocketAddr {
        SocketAddr::new(self.ip.into(), port)
    }

    /// The pod's container; panics for a pod without one.
    pub fn container(&self) -> &FakeContainer {
        self.container
            .as_ref()
            .unwrap_or_else(|| panic!("pod {} has no container", self.name()))
    }

    pub fn has_container(&self) -> bool {
        self.container.is_some()
    }

    /// `program` inside this pod: its network namespace and its container's cgroup.
    pub fn command(&self, program: impl AsRef<OsStr>) -> Command {
        match &self.container {
            Some(c) => c.command(&self.ns, program),
            None => self.ns.command(program),
        }
    }

    /// Starts `program ARGS` in the pod and waits for its `ready` line; checks it landed in
    /// the container's cgroup.
    pub fn spawn(&self, program: impl AsRef<OsStr>, args: &[&str]) -> (Child, Ready) {
        let what = format!(
            "{} {} in pod {}",
            program.as_ref().to_string_lossy(),
            args.join(" "),
            self.name()
        );
        let mut cmd = self.command(program);
        cmd.args(args);
        let mut child = Child::spawn(&mut cmd, &what);
        let ready = child.wait_ready(READY_TIMEOUT);
        if let Some(c) = &self.container {
            assert!(
                c.pids().contains(&child.pid()),
                "{what} (pid {}) is not in its container's cgroup {}: {:?}",
                child.pid(),
                c.cgroup(),
                std::fs::read_to_string(format!("/proc/{}/cgroup", child.pid()))
            );
        }
        (child, ready)
    }

    /// `connreap-testpeer ARGS` in the pod (see [`Pod::spawn`]).
    pub fn peer(&self, args: &[&str]) -> (Child, Ready) {
        self.spawn(program(TESTPEER), args)
    }

    /// The pod leaves the network at once: its veth is deleted, so nothing it sends from now
    /// on (a FIN, a RST) reaches anyone. Kill its processes afterwards to make it vanish
    /// without its peers ever hearing of it.
    pub fn unplug(&self) {
        ip(&["-n", &self.node, "link", "del", &self.veth]);
    }

    /// Who this pod is, for failure messages.
    pub fn describe(&self) -> String {
        let container = match &self.container {
            Some(c) => match &c.pod {
                Some(p) => format!(
                    "{} container {} of pod {}/{}",
                    c.runtime,
                    c.short(),
                    p.namespace,
                    p.name
                ),
                None => format!("{} container {}", c.runtime, c.short()),
            },
            None => "no container".to_string(),
        };
        format!(
            "pod {} ({}, netns inode {}, {container})",
            self.name(),
            self.ip,
            self.inode
        )
    }
}

impl Drop for Pod {
    fn drop(&mut self) {
        // Gone already after `unplug`, or with the node: either way nothing to report.
        let _ = Command::new("ip")
            .args(["-n", &self.node, "link", "del", &self.veth])
            .stderr(Stdio::null())
            .status();
        // Then `container` (its cgroup) and `ns` drop, in that order.
    }
}
