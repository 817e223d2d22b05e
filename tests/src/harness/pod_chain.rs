//! Incident 1 laid out the way it runs in production, on a [`Node`]: users in a client pod ->
//! the proxy pod (the real Node.js proxy, `tests/node/leaky-proxy.js`, which never aborts its
//! upstream; Docker-style cgroup) -> the relay pod (relay-sim with its quota of 64 streams per
//! port and instance-sim behind it on loopback, in ONE namespace and one containerd/Kubernetes
//! container of pod `e2e/relay-0`).
//!
//! Ports: instance-sim on `127.0.0.1:21000` in the relay pod; relay-sim's dial slot on
//! `RELAY_POD:25001` for it and its `GET /status` on `:20080` (reachable at
//! `127.0.0.1:20080` inside the relay pod, where connreap polls it); the proxy on
//! `PROXY_POD:8080`, dialling the relay pod directly or through a Service
//! ([`Upstream::Service`], ClusterIP [`RELAY_CLUSTER_IP`]`:25001`).

use std::{
    collections::BTreeSet,
    net::{Ipv4Addr, SocketAddr},
    path::Path,
    time::Duration,
};

use serde_json::{json, Value};

use super::{
    consts::{HTTP, INSTANCE_SIM, MAX_STREAMS, POLL, RELAY_SIM},
    containers::FakeContainer,
    pods::{node_bin, node_script, Node, Pod, Service},
    process::{program, wait_until, Child},
    users::User,
};
use crate::fixtures::{
    abandon_requests_with, http_request_ns, ss_tcp, GiveUp, HttpResponse, SsSocket,
};

/// The instance's port, which the relay's quota counts streams for.
pub const INSTANCE_PORT: u16 = 21000;
/// The relay's dial slot for the instance: the proxy's upstream port.
pub const DIAL_PORT: u16 = 25001;
/// The relay's `GET /status` port.
pub const STATUS_PORT: u16 = 20080;
/// Where the proxy listens (in its pod).
pub const PROXY_PORT: u16 = 8080;
/// The relay Service's ClusterIP (port [`DIAL_PORT`]).
pub const RELAY_CLUSTER_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 25);
/// The relay's `/status`, as connreap polls it from inside the relay pod's namespace.
pub const RELAY_STATUS_URL: &str = "http://127.0.0.1:20080/status";
/// The Kubernetes namespace and name of the relay's pod.
pub const RELAY_POD: (&str, &str) = ("e2e", "relay-0");

/// How the proxy reaches the relay.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Upstream {
    /// The relay pod's own address.
    PodIp,
    /// A Service: ClusterIP [`RELAY_CLUSTER_IP`]:[`DIAL_PORT`] DNATed to the relay pod.
    Service,
}

/// The three pods and their processes; dropping it kills the processes, then removes the
/// Service, the pods and the node (fields drop in this order).
pub struct PodChain {
    instance: Child,
    relay: Child,
    proxy: Child,
    service: Option<Service>,
    pub users: Pod,
    pub proxy_pod: Pod,
    pub relay_pod: Pod,
    pub node: Node,
    /// What the proxy dials: the relay pod's `:25001` or the Service's ClusterIP.
    pub upstream: SocketAddr,
}

impl PodChain {
    /// Builds the node and the pods (cgroups under `cgroup_root`), starts the processes and
    /// checks that a request from the users' pod through the proxy answers 200 with the
    /// instance's body.
    pub fn start(cgroup_root: &Path, upstream: Upstream) -> PodChain {
        let node = Node::new("node");
        let relay_pod = node.pod(
            "relay",
            Some(FakeContainer::kube(cgroup_root, RELAY_POD.0, RELAY_POD.1)),
        );
        let proxy_pod = node.pod("proxy", Some(FakeContainer::docker(cgroup_root)));
        let users = node.pod("users", None);
        let relay_dial = relay_pod.addr(DIAL_PORT);
        let service = (upstream == Upstream::Service).then(|| {
            node.service(
                SocketAddr::new(RELAY_CLUSTER_IP.into(), DIAL_PORT),
                relay_dial,
            )
        });
        let upstream = service.as_ref().map_or(relay_dial, |s| s.cluster);

        let instance_addr = format!("127.0.0.1:{INSTANCE_PORT}");
        let (instance, _) = relay_pod.spawn(program(INSTANCE_SIM), &["--listen", &instance_addr]);
        let (relay, _) = relay_pod.spawn(
            program(RELAY_SIM),
            &[
                "--dial",
                &format!("0.0.0.0:{DIAL_PORT}={instance_addr}"),
                "--status",
                &format!("0.0.0.0:{STATUS_PORT}"),
                "--max-streams",
                &MAX_STREAMS.to_string(),
            ],
        );
        let node_js = node_bin().unwrap_or_else(|| panic!("Node.js not found"));
        let script = node_script("leaky-proxy.js");
        let (proxy, _) = proxy_pod.spawn(
            &node_js,
            &[
                script.to_str().expect("UTF-8 path"),
                "--listen",
                &format!("0.0.0.0:{PROXY_PORT}"),
                "--upstream",
                &upstream.to_string(),
            ],
        );
        let chain = PodChain {
            instance,
            relay,
            proxy,
            service,
            users,
            proxy_pod,
            relay_pod,
            node,
            upstream,
        };
        chain.assert_json_ok();
        chain
    }

    /// The relay's Service, with [`Upstream::Service`].
    pub fn service(&self) -> Option<&Service> {
        self.service.as_ref()
    }

    pub fn proxy_pid(&self) -> u32 {
        self.proxy.pid()
    }

    pub fn relay_pid(&self) -> u32 {
        self.relay.pid()
    }

    pub fn instance_pid(&self) -> u32 {
        self.instance.pid()
    }

    /// The proxy's address, where users connect.
    pub fn proxy_addr(&self) -> SocketAddr {
        self.proxy_pod.addr(PROXY_PORT)
    }

    /// What the processes wrote to stderr, for failure messages.
    pub fn stderr(&self) -> String {
        format!(
            "--- proxy (node) stderr:\n{}\n--- relay-sim stderr:\n{}",
            self.proxy.stderr(),
            self.relay.stderr()
        )
    }

    /// A real request from the users' pod through proxy -> relay -> instance.
    pub fn get_json(&self) -> std::io::Result<HttpResponse> {
        http_request_ns(
            Some(self.users.name()),
            self.proxy_addr(),
            "GET",
            "/json",
            &[],
            &[],
            HTTP,
        )
    }

    /// `GET /json` through the chain answers 200 with the instance's JSON body (bytes > 0).
    pub fn assert_json_ok(&self) {
        let r = self.get_json().unwrap_or_else(|e| {
            panic!(
                "GET /json from {} through the proxy {}: {e}\n{}",
                self.users.describe(),
                self.proxy_addr(),
                self.stderr()
            )
        });
        let body = r.text();
        assert_eq!(r.status, 200, "GET /json through the chain: {body:?}");
        assert!(!body.is_empty(), "GET /json: 200 without a body");
        let v: Value = serde_json::from_str(&body)
            .unwrap_or_else(|e| panic!("GET /json body is not JSON ({e}): {body:?}"));
        assert_eq!(v["ok"], json!(true), "{body}");
    }

    /// The relay's `/status` (asked inside the relay pod), `None` when it does not answer.
    pub fn try_status(&self) -> Option<Value> {
        let r = http_request_ns(
            Some(self.relay_pod.name()),
            SocketAddr::from(([127, 0, 0, 1], STATUS_PORT)),
            "GET",
            "/status",
            &[],
            &[],
            HTTP,
        )
        .ok()?;
        (r.status == 200).then(|| r.json().ok()).flatten()
    }

    /// The relay's open streams for the instance's port.
    pub fn try_streams(&self) -> Option<u64> {
        self.try_status()?["endpoints"]
            .as_array()?
            .iter()
            .find(|e| e["port"] == INSTANCE_PORT)?["streams"]
            .as_u64()
    }

    /// Waits (up to `timeout`) until the relay reports exactly `n` streams.
    pub fn wait_streams(&self, n: u64, timeout: Duration) {
        let ok = wait_until(timeout, POLL, || {
            (self.try_streams() == Some(n)).then_some(())
        });
        assert!(
            ok.is_some(),
            "the relay should have {n} streams: /status says {:?}\n{}",
            self.try_status(),
            self.stderr()
        );
    }

    /// The proxy's upstream connections (node -> relay), ESTABLISHED, as `ss` shows them in
    /// the proxy pod.
    pub fn proxy_upstreams(&self) -> Vec<SsSocket> {
        self.proxy_sockets()
            .into_iter()
            .filter(|s| s.is_established() && s.peer == self.upstream)
            .collect()
    }

    /// The proxy's users' connections (accepted on [`PROXY_PORT`]), ESTABLISHED.
    pub fn proxy_downstreams(&self) -> Vec<SsSocket> {
        self.proxy_sockets()
            .into_iter()
            .filter(|s| s.is_established() && s.local.port() == PROXY_PORT)
            .collect()
    }

    fn proxy_sockets(&self) -> Vec<SsSocket> {
        ss_tcp(Some(self.proxy_pod.name()))
            .unwrap_or_else(|e| panic!("ss in {}: {e}", self.proxy_pod.name()))
            .into_iter()
            .filter(|s| s.pids.contains(&self.proxy.pid()))
            .collect()
    }

    /// The local addresses of [`PodChain::proxy_upstreams`].
    pub fn proxy_upstream_locals(&self) -> BTreeSet<SocketAddr> {
        self.proxy_upstreams().iter().map(|s| s.local).collect()
    }

    /// Closes the proxy's upstream connection from `local` by hand, as `ss -K` does (netlink
    /// SOCK_DESTROY, inside the proxy pod): the relay gets a RST, the proxy an error. What a
    /// reclaim of that one connection does.
    pub fn kill_upstream(&self, local: SocketAddr) {
        let out = std::process::Command::new("ip")
            .args(["netns", "exec", self.proxy_pod.name(), "ss", "-K", "-tn"])
            .args([
                "src",
                &local.ip().to_string(),
                "sport",
                "=",
                &format!(":{}", local.port()),
            ])
            .args(["dst", &self.upstream.ip().to_string()])
            .args(["dport", "=", &format!(":{}", self.upstream.port())])
            .output()
            .unwrap_or_else(|e| panic!("ss -K: {e}"));
        assert!(
            out.status.success(),
            "ss -K {local} -> {}: {}",
            self.upstream,
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// Whether the proxy still runs.
    pub fn proxy_alive(&self) -> bool {
        super::process::alive(self.proxy.pid())
    }

    /// A user in the users' pod who opens `path` (`/events` quiet, `/ticks` live) and stays.
    pub fn stay(&self, path: &str) -> User {
        User::open(self.users.ns(), self.proxy_addr(), path)
    }

    /// `n` users in the users' pod open a quiet SSE page at once and leave (close) after
    /// `after`. Each got the page's head: a stream through the whole chain.
    pub fn leave(&self, n: usize, after: Duration) {
        let ab = abandon_requests_with(
            Some(self.users.name()),
            self.proxy_addr(),
            "/events",
            n,
            after,
            GiveUp::Close,
        )
        .unwrap_or_else(|e| panic!("{n} users leaving: {e}\n{}", self.stderr()));
        assert_eq!(ab.connected, n, "{ab:?}");
        assert_eq!(
            ab.responded,
            n,
            "every SSE head must reach its user (a stream through the whole chain): {ab:?}\n{}",
            self.stderr()
        );
    }
}
