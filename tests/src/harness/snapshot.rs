//! `connreap snapshot --json`, run and parsed into typed rows.

use serde::Deserialize;
use serde_json::Value;

use std::process::Command;

use super::{
    consts::CONNREAP_TIMEOUT,
    netns::NetNs,
    process::{connreap_bin, run},
};

/// `connreap snapshot --json ARGS` inside `ns`, parsed. Panics (with stderr) when it fails.
pub fn snapshot(ns: &NetNs, args: &[&str]) -> Value {
    snapshot_with(ns.connreap(["snapshot", "--json"]), args)
}

/// [`snapshot`] in the host's network namespace (this test process's).
pub fn snapshot_in_host(args: &[&str]) -> Value {
    let mut cmd = Command::new(connreap_bin());
    cmd.args(["snapshot", "--json"]);
    snapshot_with(cmd, args)
}

fn snapshot_with(mut cmd: Command, args: &[&str]) -> Value {
    cmd.args(args);
    let out = run(&mut cmd, CONNREAP_TIMEOUT);
    assert!(
        out.status.success(),
        "`connreap snapshot --json {}` failed ({}):\n{}",
        args.join(" "),
        out.status,
        out.stderr
    );
    serde_json::from_str(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "`connreap snapshot --json {}` printed invalid JSON ({e}):\n{}\nstderr:\n{}",
            args.join(" "),
            out.stdout,
            out.stderr
        )
    })
}

/// One entry of `sockets` in `connreap snapshot --json`. Owner fields are absent when no
/// process holds the socket.
#[derive(Debug, Clone, Deserialize)]
pub struct SocketRow {
    pub pid: Option<u32>,
    pub comm: Option<String>,
    pub fd: Option<u32>,
    pub unit: Option<String>,
    pub local: String,
    pub peer: String,
    pub state: String,
    pub age_secs: f64,
    pub age_exact: bool,
    pub idle_secs: Option<f64>,
    pub last_recv_secs: Option<f64>,
    pub last_send_secs: Option<f64>,
    pub rx_queue: u32,
    pub tx_queue: u32,
    pub inode: u64,
    pub cookie: Option<u64>,
    pub uid: u32,
    pub direction: String,
    pub service_port: u16,
    /// The network namespace's inode (absent from connreaps without namespace support).
    #[serde(default)]
    pub netns: Option<u64>,
    /// Its name under /run/netns or /run/docker/netns, if any.
    #[serde(default)]
    pub netns_name: Option<String>,
    /// The owner's container id, when it runs in one.
    #[serde(default)]
    pub container: Option<String>,
    #[serde(default)]
    pub container_runtime: Option<String>,
    #[serde(default)]
    pub pod_uid: Option<String>,
    #[serde(default)]
    pub pod_name: Option<String>,
    #[serde(default)]
    pub pod_namespace: Option<String>,
}

impl SocketRow {
    pub fn local_port(&self) -> u16 {
        port_of(&self.local)
    }
    pub fn peer_port(&self) -> u16 {
        port_of(&self.peer)
    }
}

fn port_of(addr: &str) -> u16 {
    addr.rsplit_once(':')
        .and_then(|(_, p)| p.parse().ok())
        .unwrap_or_else(|| panic!("address without a port: {addr}"))
}

/// One entry of `summary`.
#[derive(Debug, Clone, Deserialize)]
pub struct GroupRow {
    pub pid: Option<u32>,
    pub comm: String,
    pub unit: Option<String>,
    pub service_port: u16,
    pub state: String,
    pub count: usize,
    pub oldest_age_secs: f64,
    pub oldest_age_exact: bool,
    pub idle_count: usize,
}

/// The `sockets` of a snapshot, typed (panics if the JSON does not have the documented shape).
pub fn sockets(snap: &Value) -> Vec<SocketRow> {
    serde_json::from_value(snap["sockets"].clone())
        .unwrap_or_else(|e| panic!("bad `sockets` in snapshot ({e}):\n{snap:#}"))
}

/// The `summary` of a snapshot, typed.
pub fn summary(snap: &Value) -> Vec<GroupRow> {
    serde_json::from_value(snap["summary"].clone())
        .unwrap_or_else(|e| panic!("bad `summary` in snapshot ({e}):\n{snap:#}"))
}
