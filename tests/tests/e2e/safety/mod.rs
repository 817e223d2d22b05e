//! Safety under faults, each fault reproduced for real and checked where a user
//! sees it (exit codes and messages, `ss`, the audit log, the API, the log): a full or
//! read-only filesystem under the audit log (a tmpfs), a flood of hostile API clients, a second
//! daemon on the host, SIGTERM with a client holding a request open, rounds asked for faster
//! than the scan interval, an audit log that must not grow every round, a lying quota endpoint,
//! a huge body, absurd config values, unusable token files, sockets nobody owns, pins removed
//! under the daemon, foreign objects under the pin root, a load failing half-way. The leaked sockets are `connreap-testpeer close-wait` pools: real CLOSE_WAIT
//! clients held by a live process, checked with `ss` before and after.

mod api_limits;
mod audit_growth;
mod audit_repair;
mod config;
mod failing;
mod faults;
mod lock;
mod pins;
mod quota;
mod shutdown;

use std::collections::BTreeSet;

use connreap_tests::{
    fixtures::ss_tcp,
    harness::{addr, peer, Child, NetNs, PEER_COMM},
};

/// The API token of the tests that turn `POST /v1/reclaim` on.
const TOKEN: &str = "s3cret-safety-token-0123456789";

/// `count` clients of a `connreap-testpeer` pool to `127.0.0.1:port` in CLOSE_WAIT (the server
/// side closed, the pool never did), and their local addresses.
fn pool(ns: &NetNs, port: u16, count: usize) -> (Child, BTreeSet<String>) {
    let (child, ready) = peer(
        ns,
        &[
            "close-wait",
            "--addr",
            &format!("127.0.0.1:{port}"),
            "--count",
            &count.to_string(),
        ],
    );
    let locals = ready.locals();
    assert_eq!(locals.len(), count, "{}", ready.line);
    assert_eq!(
        close_wait_to(ns, port, child.pid()),
        locals,
        "right after start"
    );
    (child, locals)
}

/// The local addresses of the CLOSE_WAIT sockets to `127.0.0.1:port` that process `pid` still
/// holds, as `ss` shows them.
fn close_wait_to(ns: &NetNs, port: u16, pid: u32) -> BTreeSet<String> {
    let peer = addr(&format!("127.0.0.1:{port}"));
    ss_tcp(Some(ns.name()))
        .unwrap_or_else(|e| panic!("ss: {e}"))
        .into_iter()
        .filter(|x| x.state == "CLOSE-WAIT" && x.peer == peer && x.pids.contains(&pid))
        .map(|x| x.local.to_string())
        .collect()
}

/// A policy over the pools' CLOSE_WAIT sockets to `port`, `trigger = "always"`, plus `extra`
/// TOML lines.
fn pool_policy(name: &str, mode: &str, port: u16, extra: &str) -> String {
    format!(
        r#"[[policy]]
name = "{name}"
mode = "{mode}"
trigger = "always"
select = {{ comm = "{PEER_COMM}", peer_port = {port}, states = ["CLOSE_WAIT"] }}
{extra}
"#
    )
}
