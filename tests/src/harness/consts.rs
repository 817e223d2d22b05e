//! Addresses, names and time limits shared by the end-to-end tests. Addresses are inside each
//! test's own network namespace, so every test can use the same ones.

use std::time::Duration;

/// `agent.listen`: the agent's HTTP API.
pub const API: &str = "127.0.0.1:9477";
/// Where the alerting tests' webhook receiver listens ([`crate::harness::Config::alerting`]).
pub const HOOK: &str = "127.0.0.1:9999";
/// `agent.host`, as the alerts carry it.
pub const HOST: &str = "e2e-host";

/// Incident 1 on its production ports: instance-sim, the instance behind the relay.
pub const INSTANCE: &str = "127.0.0.1:21000";
/// relay-sim's dial slot for [`INSTANCE`] (the proxy's upstream).
pub const DIAL: &str = "127.0.0.1:25001";
/// relay-sim's `GET /status`.
pub const RELAY_STATUS: &str = "127.0.0.1:20080";
/// leaky-proxy, where users connect.
pub const PROXY: &str = "127.0.0.1:8080";
/// relay-sim's quota of streams per target port.
pub const MAX_STREAMS: u64 = 64;

/// The fixture programs of this crate ([`crate::harness::program`] finds them).
pub const TESTPEER: &str = "connreap-testpeer";
pub const INSTANCE_SIM: &str = "instance-sim";
pub const RELAY_SIM: &str = "relay-sim";
pub const LEAKY_PROXY: &str = "leaky-proxy";
/// `connreap-testpeer`'s comm: the kernel keeps 15 characters of the executable name.
pub const PEER_COMM: &str = "connreap-testpe";

/// Where connreap pins its state tracker (removed by `connreap unpin`).
pub const PIN_ROOT: &str = "/sys/fs/bpf/connreap";

/// Upper bound for one `connreap` command (snapshot, check-config, reclaim, unpin).
pub const CONNREAP_TIMEOUT: Duration = Duration::from_secs(30);
/// A fixture process until it prints `ready`.
pub const READY_TIMEOUT: Duration = Duration::from_secs(10);
/// Agent start (BPF load, first scan) until /healthz answers 200.
pub const AGENT_START: Duration = Duration::from_secs(30);
/// `agent.scan_interval` in every test config: scans (and reclaim rounds) run every second.
pub const SCAN: Duration = Duration::from_secs(1);
/// Longest wait for one finding or webhook notification (a few scans after its threshold).
pub const FINDING: Duration = Duration::from_secs(25);
/// One HTTP request to the agent or a fixture.
pub const HTTP: Duration = Duration::from_secs(5);
/// Poll interval for cheap checks: the agent's API, the audit log, the relay's status, `ss`.
pub const POLL: Duration = Duration::from_millis(100);
/// Poll interval for checks that run a whole `connreap snapshot` (loads the BPF programs).
pub const SNAPSHOT_POLL: Duration = Duration::from_millis(250);
