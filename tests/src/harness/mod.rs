//! The harness every end-to-end test uses (in the style of aya's `test/integration-test`): real
//! kernel, real sockets, one network namespace per test, the agent under test started inside it.
//!
//! A test starts with
//! ```ignore
//! let Some(_env) = require_privileges() else { return };
//! let ns = NetNs::new("snap");
//! ```
//! and then spawns helper processes ([`peer`], [`Chain`]) and `connreap` inside `ns`: one-shot
//! commands with [`snapshot`] or [`run`], the daemon with [`Agent::start`] on a [`Config`]
//! written into a [`TempDir`].
//!
//! Processes enter a namespace with `setns(2)` only (like `nsenter --net`), not with
//! `ip netns exec`: that one also unshares the mount namespace and remounts `/sys`, which hides
//! the host's bpffs at `/sys/fs/bpf`. connreap would then mount a private bpffs, its pinned state
//! tracker would die with the process, and no age would ever be exact.

mod agent;
pub mod alerts;
pub mod audit;
mod chain;
mod config;
mod consts;
pub mod containers;
mod metrics;
mod netns;
pub mod pod_chain;
pub mod pods;
mod privileges;
mod process;
mod snapshot;
mod tmpfs;
pub mod users;

pub use agent::Agent;
pub use chain::{Chain, ChainAddrs};
pub use config::{relay_policy, Config, RelayQuota, TempDir};
pub use consts::*;
pub use metrics::{Metrics, Sample};
pub use netns::{ip, NetNs};
pub use privileges::{require_privileges, Privileged};
pub use process::{
    alive, connreap_bin, peer, program, run, spawn_ready, wait_until, Child, Output, Ready,
};
pub use snapshot::{snapshot, snapshot_in_host, sockets, summary, GroupRow, SocketRow};
pub use tmpfs::Tmpfs;

/// `s` as a socket address; panics if it is not one.
pub fn addr(s: &str) -> std::net::SocketAddr {
    s.parse()
        .unwrap_or_else(|e| panic!("not a socket address: {s:?}: {e}"))
}
