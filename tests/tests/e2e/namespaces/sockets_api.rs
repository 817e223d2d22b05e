//! `GET /v1/sockets?netns=..&container=..` of the daemon in the host's namespace: the same
//! filters as `snapshot --netns/--container`, on two pods that use the same port.

use connreap_tests::harness::{
    containers::FakeContainer, require_privileges, Agent, Config, TempDir,
};
use serde_json::Value;

use super::{cgroups, Pod, FAST_CLOSE_WAIT, LEAKED, PORT};
use connreap_tests::fixtures::free_addr;

/// The rows of `GET /v1/sockets?QUERY` on port [`PORT`], listeners and CLOSE_WAIT only (the
/// clients' orphaned FIN_WAIT2 ends are left out); its `count` must match.
fn rows(agent: &Agent, query: &str) -> Vec<Value> {
    let path = format!("/v1/sockets?port={PORT}&state=LISTEN,CLOSE_WAIT&{query}");
    let body = agent.get_ok(&path);
    let rows = body["sockets"]
        .as_array()
        .unwrap_or_else(|| panic!("GET {path}: no `sockets` array: {body}"))
        .clone();
    assert_eq!(body["count"], rows.len(), "GET {path}: {body}");
    rows
}

/// Every row is `pod`'s: its namespace, its container, its server; listener included.
fn assert_only(rows: &[Value], pod: &Pod, query: &str) {
    assert_eq!(
        rows.len(),
        LEAKED + 1,
        "?{query}: {}'s listener and {LEAKED} CLOSE_WAIT sockets: {rows:#?}",
        pod.describe()
    );
    for r in rows {
        assert_eq!(r["netns"], pod.inode, "?{query} let in {r}");
        assert_eq!(r["netns_name"], pod.name(), "?{query}: {r}");
        assert_eq!(r["container"], pod.container().id.as_str(), "?{query}: {r}");
        assert_eq!(r["pid"], pod.pid(), "?{query}: {r}");
    }
}

#[test]
fn sockets_api_filters_by_netns_and_container() {
    let Some(_env) = require_privileges() else {
        return;
    };
    let Some(root) = cgroups() else { return };
    let a = Pod::start("api-a", FakeContainer::docker(&root));
    let b = Pod::start("api-b", FakeContainer::podman(&root));
    a.leak(LEAKED);
    b.leak(LEAKED);
    let dir = TempDir::new("ns-api");
    let config = Config::new(&dir)
        .listen(free_addr())
        .detect(FAST_CLOSE_WAIT);
    let mut agent = Agent::start_in_host(&dir, &config);
    // The first scan may predate the last connections: wait for one that has them all.
    agent.wait_scans(1);

    let q = format!("netns={}", a.name());
    assert_only(&rows(&agent, &q), &a, &q);
    let q = format!("netns={}", b.inode);
    assert_only(&rows(&agent, &q), &b, &q);
    let q = format!("container={}", b.container().short());
    assert_only(&rows(&agent, &q), &b, &q);
    let q = format!("netns={}&container={}", a.name(), &a.container().id[..8]);
    assert_only(&rows(&agent, &q), &a, &q);
    // Both pods at once, by either filter: the two namespaces' sockets on the same port.
    let q = format!("netns={},{}", a.name(), b.name());
    assert_eq!(rows(&agent, &q).len(), 2 * (LEAKED + 1), "?{q}");
    let q = format!(
        "container={},{}",
        a.container().short(),
        b.container().short()
    );
    assert_eq!(rows(&agent, &q).len(), 2 * (LEAKED + 1), "?{q}");
    // A's namespace holds no socket of B's container; the host's none of either pod's.
    let q = format!("netns={}&container={}", a.name(), b.container().short());
    assert!(rows(&agent, &q).is_empty(), "?{q}");
    let host = rows(&agent, "netns=host");
    assert!(
        host.iter()
            .all(|r| r["netns"] != a.inode && r["netns"] != b.inode),
        "?netns=host let in a pod's sockets: {host:#?}"
    );
    // A container prefix too short to mean anything is refused, not matched.
    let (code, body) = agent.get(&format!("/v1/sockets?container={}", &a.container().id[..3]));
    assert_eq!(code, 400, "{body}");
    agent.assert_healthy();
}
