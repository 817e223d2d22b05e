//! The bpf_sock_destroy fallback (what kernels without CONFIG_INET_DIAG_DESTROY use) closes
//! sockets in another network namespace: two namespaces leak CLOSE_WAIT on the same port, the
//! daemon runs in the host's namespace with `reclaim.mechanism = "bpf-iter"` and a policy
//! selecting the first namespace. The fallback's `iter/tcp` program walks only the namespace
//! of the thread that opens it, so this passes only if the kill runs inside the target
//! namespace (`setns`); the second namespace's identical leak stays.

use std::collections::BTreeSet;

use connreap_tests::{
    fixtures::http::connect,
    harness::{
        addr, alive,
        audit::{assert_decision_shape, result_is, text},
        require_privileges, wait_until, Agent, TempDir, FINDING, HTTP, POLL, SCAN,
    },
};
use serde_json::{json, Value};

use super::{assert_names_netns, close_wait_policy, host_config, host_receiver, Pod, LEAKED, PORT};

/// What /healthz and the audit lines call the fallback.
const BPF_MECHANISM: &str = "bpf-sock-destroy";

#[test]
fn bpf_sock_destroy_fallback_reclaims_in_another_namespace_only() {
    let Some(_env) = require_privileges() else {
        return;
    };
    let a = Pod::bare("fb-a");
    let b = Pod::bare("fb-b");
    a.leak(LEAKED);
    b.leak(LEAKED);
    let a_before = a.close_wait_pairs();
    let b_before = b.close_wait_pairs();
    assert_eq!((a_before.len(), b_before.len()), (LEAKED, LEAKED));

    // comm, port and state match both namespaces' leaks: only `netns` tells them apart.
    let policy = close_wait_policy("fallback-in-a", &format!("netns = \"{}\"", a.name()));
    let dir = TempDir::new("ns-bpf-fallback");
    let hook = host_receiver();
    let config = host_config(&dir, &hook)
        .protect_ports(&[22])
        .mechanism("bpf-iter")
        .policy(&policy);
    let mut agent = Agent::start_in_host(&dir, &config);
    let health = agent.get_ok("/healthz");
    assert_eq!(
        health["reclaim_mechanism"],
        json!(BPF_MECHANISM),
        "reclaim.mechanism = \"bpf-iter\" must force the fallback: {health}\n{}",
        agent.ctx()
    );

    // What a user sees: `ip netns exec A ss` has no CLOSE-WAIT left on the port.
    wait_until(SCAN * 8, POLL, || a.close_wait().is_empty().then_some(())).unwrap_or_else(|| {
        panic!(
            "{}: CLOSE-WAIT left in its namespace after the bpf_sock_destroy fallback: {:#?}\n{}",
            a.describe(),
            a.close_wait(),
            agent.ctx()
        )
    });
    // A few more rounds: B's leak on the same port is never touched.
    agent.wait_scans(3);
    assert_eq!(
        b.close_wait_pairs(),
        b_before,
        "{}: a policy selecting netns {} closed sockets in another namespace\n{}",
        b.describe(),
        a.name(),
        agent.ctx()
    );
    assert!(alive(a.pid()), "{} died", a.describe());
    let probe = connect(Some(a.name()), addr(&format!("127.0.0.1:{PORT}")), HTTP);
    assert!(probe.is_ok(), "{}: listener gone: {probe:?}", a.describe());

    assert_audit(&agent, &a, &b, &a_before);
    assert_reclaimed_events(&hook, &agent, &a);
    agent.assert_healthy();
}

/// The audit log killed exactly A's leaked sockets, each line naming A's namespace and the
/// fallback mechanism; no decision names B.
fn assert_audit(
    agent: &Agent,
    a: &Pod,
    b: &Pod,
    a_before: &BTreeSet<(std::net::SocketAddr, std::net::SocketAddr)>,
) {
    let lines = agent.audit();
    let killed = result_is(&lines, "killed");
    let killed_pairs: BTreeSet<(String, String)> = killed
        .iter()
        .map(|d| (text(d, "local").to_string(), text(d, "peer").to_string()))
        .collect();
    let want: BTreeSet<(String, String)> = a_before
        .iter()
        .map(|(l, p)| (l.to_string(), p.to_string()))
        .collect();
    assert_eq!(killed_pairs, want, "{}", agent.ctx());
    assert_eq!(killed.len(), LEAKED, "{}", agent.ctx());
    for d in &killed {
        assert_decision_shape(d);
        assert_eq!(text(d, "policy"), "fallback-in-a", "{d}");
        assert_eq!(d["pid"], json!(a.pid()), "{d}");
        assert_names_netns(d, a.inode, a.name(), "killed audit line");
        assert_eq!(
            d["mechanism"],
            json!(BPF_MECHANISM),
            "a killed line says which destroy mechanism closed the socket: {d}"
        );
    }
    for d in &lines {
        assert!(
            d["pid"] != json!(b.pid()) && d["netns"] != json!(b.inode),
            "a decision about {}: {d}",
            b.describe()
        );
    }
}

/// The `reclaimed` events add up to A's leak and name A's namespace (per process, per
/// namespace, in the summary) and the mechanism.
fn assert_reclaimed_events(
    hook: &connreap_tests::fixtures::WebhookReceiver,
    agent: &Agent,
    a: &Pod,
) {
    let events = || -> Vec<Value> {
        hook.posts()
            .into_iter()
            .map(|p| p.body)
            .filter(|b| b["kind"] == "reclaimed")
            .collect()
    };
    let total = |evs: &[Value]| evs.iter().filter_map(|e| e["count"].as_u64()).sum::<u64>();
    let evs = wait_until(FINDING, POLL, || {
        let evs = events();
        (total(&evs) >= LEAKED as u64).then_some(evs)
    })
    .unwrap_or_else(|| {
        panic!(
            "`reclaimed` events for {LEAKED} sockets within {FINDING:?}; got {:#?}\n{}",
            events(),
            agent.ctx()
        )
    });
    assert_eq!(total(&evs), LEAKED as u64, "{evs:#?}");
    for ev in &evs {
        assert_eq!(ev["policy"], json!("fallback-in-a"), "{ev}");
        assert_eq!(ev["mechanism"], json!(BPF_MECHANISM), "{ev}");
        let where_ = format!("; in netns {}", a.name());
        assert!(
            text(ev, "summary").ends_with(&where_),
            "the summary names the namespace ({where_:?}): {ev}"
        );
        let spaces = ev["namespaces"].as_array().cloned().unwrap_or_default();
        assert_eq!(spaces.len(), 1, "{ev}");
        assert_names_netns(
            &spaces[0],
            a.inode,
            a.name(),
            "the reclaimed event's namespace",
        );
        assert_eq!(spaces[0]["count"], ev["count"], "{ev}");
        let procs = ev["processes"].as_array().cloned().unwrap_or_default();
        assert!(!procs.is_empty(), "{ev}");
        for p in &procs {
            assert_eq!(p["pid"], json!(a.pid()), "{ev}");
            assert_names_netns(p, a.inode, a.name(), "the reclaimed event's process");
        }
    }
}
