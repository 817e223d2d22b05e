//! A policy scoped to one container never touches the same port in another: two pods leak
//! CLOSE_WAIT on 8080, a policy selects by container (comm, port and state match both); only
//! the first pod's leak is reclaimed, in its namespace, and the audit log says where.

use connreap_tests::harness::{
    alive,
    audit::{assert_decision_shape, result_is, text},
    containers::FakeContainer,
    require_privileges, wait_until, Agent, TempDir, POLL, SCAN,
};
use connreap_tests::{fixtures::http::connect, harness::addr, harness::HTTP};
use serde_json::json;

use super::{
    assert_names_pod, cgroups, close_wait_policy, host_config, host_receiver, Pod, LEAKED, PORT,
};

#[test]
fn policy_scoped_to_one_container() {
    let Some(_env) = require_privileges() else {
        return;
    };
    let Some(root) = cgroups() else { return };
    let a = Pod::start("scope-a", FakeContainer::docker(&root));
    let b = Pod::start("scope-b", FakeContainer::docker(&root));
    a.leak(LEAKED);
    b.leak(LEAKED);
    let b_before = b.close_wait_pairs();
    let a_before = a.close_wait_pairs();
    assert_eq!((a_before.len(), b_before.len()), (LEAKED, LEAKED));

    let policy = close_wait_policy(
        "only-a",
        &format!("container = \"{}\"", a.container().short()),
    );
    let dir = TempDir::new("ns-scope");
    let hook = host_receiver();
    let config = host_config(&dir, &hook)
        .protect_ports(&[22])
        .policy(&policy);
    let mut agent = Agent::start_in_host(&dir, &config);

    wait_until(SCAN * 8, POLL, || a.close_wait().is_empty().then_some(())).unwrap_or_else(|| {
        panic!(
            "{}: CLOSE-WAIT left in its namespace: {:#?}\n{}",
            a.describe(),
            a.close_wait(),
            agent.ctx()
        )
    });
    // A few more rounds: B is never touched.
    agent.wait_scans(3);
    assert_eq!(
        b.close_wait_pairs(),
        b_before,
        "{}: the policy scoped to {} touched another container's sockets\n{}",
        b.describe(),
        a.container().short(),
        agent.ctx()
    );
    // A's server lives on, and its listener still accepts.
    assert!(alive(a.pid()), "{} died", a.describe());
    let probe = connect(Some(a.name()), addr(&format!("127.0.0.1:{PORT}")), HTTP);
    assert!(probe.is_ok(), "{}: listener gone: {probe:?}", a.describe());

    // The audit log: exactly A's leaked sockets, each naming A's container and namespace;
    // no decision about B at all.
    let lines = agent.audit();
    let killed = result_is(&lines, "killed");
    let killed_pairs: std::collections::BTreeSet<(String, String)> = killed
        .iter()
        .map(|d| (text(d, "local").to_string(), text(d, "peer").to_string()))
        .collect();
    let want: std::collections::BTreeSet<(String, String)> = a_before
        .iter()
        .map(|(l, p)| (l.to_string(), p.to_string()))
        .collect();
    assert_eq!(killed_pairs, want, "{}", agent.ctx());
    assert_eq!(killed.len(), LEAKED, "{}", agent.ctx());
    for d in &killed {
        assert_decision_shape(d);
        assert_eq!(text(d, "policy"), "only-a", "{d}");
        assert_eq!(d["pid"], json!(a.pid()), "{d}");
        assert_names_pod(d, &a, false, "audit line");
        assert_eq!(
            d["container"],
            json!(a.container().id),
            "audit lines name the container (part (b) of the attribution): {d}"
        );
    }
    for d in &lines {
        assert!(
            d["pid"] != json!(b.pid())
                && d["netns"] != json!(b.inode)
                && d["container"] != json!(b.container().id),
            "a decision about {}: {d}",
            b.describe()
        );
    }
    agent.assert_healthy();
}
