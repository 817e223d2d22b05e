//! Incident 1 across pods, as it runs in production: users in a client pod -> the Node.js
//! proxy in its pod (Docker-style cgroup), which never aborts an upstream request when its
//! user leaves -> the relay pod (relay-sim with 64 streams per port on 21000, and the
//! instance, containerd-style cgroup of pod e2e/relay-0). Two users stay on a quiet page and
//! one on a live page; then 61 users open a quiet page and leave after a second, and their
//! upstreams leak: the relay's quota is full, every new request is refused.
//!
//! connreap, in the host's namespace, with the README's worked relay policy as it is written
//! (`comm = "node"`, `peer_port = 25001`, quota-saturated, enforce) must: name the proxy in the
//! `quota_exhausted_by_leak` alert (pid, comm, namespace, container) with `verdict: leak` and
//! say how many of the connections feeding the quota are orphaned (their user gone); free the
//! quota by killing only orphaned upstreams of the proxy, in the proxy's namespace; and leave
//! every user who is still connected with its stream. A fresh request through the proxy then
//! answers 200 with a body. The same holds for a policy written from the relay's side
//! (`comm = "relay-sim"`, `local_port = 25001`), whose oldest idle streams are the users who
//! stayed on a quiet page. A harness self-test does by hand (`ss -K`) what a right reclaim
//! does, so the outcome asked of connreap is known to be reachable in this layout.
//!
//! Each test checks its parts (alert, reclaim, users, audit, fresh request) one after the
//! other and reports every part that failed.
//!
//! Expected, on the proxy's entry of the alert's `upstream` array: `pid`, `comm`,
//! `netns` (the proxy pod's inode), `container` (its id), `pod_name` / `pod_namespace` (null
//! for this Docker container), and the counts `orphaned` (upstreams whose downstream user is
//! gone), `serving` (upstreams serving a connected user) and `ambiguous` (cannot tell; never
//! called orphaned), which add up to the entry's `count` (the proxy's connections matched to
//! the relay's streams); `container` on the proxy's entry of `processes`; and the summary
//! saying `N orphaned`.

use std::{collections::BTreeSet, net::SocketAddr, thread, time::Duration};

use connreap_tests::harness::{
    audit::{result_is, text},
    pod_chain::{PodChain, Upstream, DIAL_PORT, INSTANCE_PORT, RELAY_STATUS_URL},
    users::{check_all, User},
    wait_until, Agent, RelayQuota, TempDir, HTTP, MAX_STREAMS, POLL, SCAN,
};
use serde_json::{json, Value};

use super::{
    assert_in_pod, entry, host_config, host_receiver, names_pid, setup, wait_alert, Parts,
};

/// Users who open a page and stay (2 quiet, 1 live).
const STAYING: [&str; 3] = ["/events", "/events", "/ticks"];
/// Users who open a quiet page and leave: with those who stay, the relay's whole quota.
const LEAVING: usize = MAX_STREAMS as usize - STAYING.len();
/// The policy's min_idle: later than the quota alert (quota_idle_min 2s).
const MIN_IDLE: Duration = Duration::from_secs(4);
/// connreap tells an orphaned upstream from one serving a user by timing (an upstream dialled
/// within ~2 s of a connected user's last request may be that user's): the leaving users
/// arrive this long after the last staying one.
const SETTLE: Duration = Duration::from_millis(3500);

/// Which end of the proxy's connections to the relay the policy selects, as a policy is
/// written today (no new key).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Side {
    /// The README's worked relay policy: the proxy's upstreams (`comm = "node"`,
    /// `peer_port = 25001`).
    Proxy,
    /// The relay's side of them: `comm = "relay-sim"`, `local_port = 25001` (what operators
    /// could write when the proxy was out of reach; oldest first, it took the users who
    /// stayed on a quiet page first).
    Relay,
}

impl Side {
    /// The policy, enforcing, quota-saturated, oldest first, 8 per round, a short min_idle.
    fn policy(self) -> String {
        let select = match self {
            Side::Proxy => format!("comm = \"node\", peer_port = {DIAL_PORT}"),
            Side::Relay => format!("comm = \"relay-sim\", local_port = {DIAL_PORT}"),
        };
        format!(
            r#"[[policy]]
name = "relay-leaks"
mode = "enforce"
trigger = "quota-saturated"
quota = "relay"
select = {{ {select}, states = ["ESTABLISHED"] }}
min_idle = "{}s"
order = "oldest-first"
max_per_round = 8
action = "destroy"
"#,
            MIN_IDLE.as_secs()
        )
    }
}

/// The relay's quota polled inside the relay pod's namespace (named by the namespace), no
/// `port_map`: connreap follows the hop from the relay to the proxy itself. The proxy dials
/// the relay pod's address.
#[test]
fn relay_incident_across_pods_without_port_map() {
    let Some((_env, root)) = setup() else { return };
    let chain = PodChain::start(&root, Upstream::PodIp);
    let quota = RelayQuota::new("relay", RELAY_STATUS_URL).netns(chain.relay_pod.name());
    relay_incident(&chain, quota, Side::Proxy);
}

/// The same through a Service: the proxy dials ClusterIP:25001, DNATed in the node namespace
/// to the relay pod; the quota is named by the relay's container and has a `port_map`.
#[test]
fn relay_incident_across_pods_through_a_service_with_port_map() {
    let Some((_env, root)) = setup() else { return };
    let chain = PodChain::start(&root, Upstream::Service);
    let quota = RelayQuota::new("relay", RELAY_STATUS_URL)
        .container(chain.relay_pod.container().short())
        .port_map(INSTANCE_PORT, DIAL_PORT);
    relay_incident(&chain, quota, Side::Proxy);
}

/// The policy written from the relay's side (its connections accepted on the dial slot): it
/// must take orphaned streams too, never one serving a user who stayed, although those are
/// the oldest idle ones.
#[test]
fn relay_side_policy_takes_orphans_not_the_oldest_users() {
    let Some((_env, root)) = setup() else { return };
    let chain = PodChain::start(&root, Upstream::PodIp);
    let quota = RelayQuota::new("relay", RELAY_STATUS_URL).netns(chain.relay_pod.name());
    relay_incident(&chain, quota, Side::Relay);
}

fn relay_incident(chain: &PodChain, quota: RelayQuota, side: Side) {
    let dir = TempDir::new("pods-relay");
    let hook = host_receiver();
    let config = host_config(&dir, &hook)
        .protect_ports(&[22])
        .detect("quota_idle_min = \"2s\"")
        .quota(quota)
        .policy(&side.policy());
    let mut agent = Agent::start_in_host(&dir, &config);
    let (staying, serving) = fill_the_quota(chain);

    let mut parts = Parts::new();
    parts.check(
        "the quota alert names the proxy and its orphaned upstreams",
        || {
            let what = format!(
            "a firing quota_exhausted_by_leak alert, verdict leak, naming the proxy (node pid {}) \
             in `upstream`",
            chain.proxy_pid()
        );
            let b = wait_alert(&hook, &agent, &what, |b| {
                b["kind"] == "quota_exhausted_by_leak"
                    && b["status"] == "firing"
                    && b["verdict"] == "leak"
                    && b["quota"]["used"] == MAX_STREAMS
                    && entry(b, "upstream", chain.proxy_pid()).is_some()
            });
            assert_quota_alert(chain, &b);
        },
    );
    let part = match side {
        Side::Proxy => "the README's relay policy (the proxy's side), enforced, frees the quota",
        Side::Relay => "the relay-side policy, enforced, frees the quota",
    };
    parts.check(part, || {
        let freed = wait_until(MIN_IDLE + SCAN * 6, POLL, || {
            chain.try_streams().filter(|n| *n < MAX_STREAMS)
        });
        assert!(
            freed.is_some(),
            "expected this policy to free the relay's quota, acting where the leak is \
             (for the proxy's side: in the proxy's namespace): streams still {:?}\npolicy:\n{}\n{}",
            chain.try_streams(),
            side.policy(),
            agent.ctx()
        );
    });
    // Whatever was killed, a few rounds on: no user who stayed lost its stream.
    agent.wait_scans(3);
    parts.check("every user still connected keeps its stream", || {
        if let Err(e) = check_all(&staying) {
            panic!(
                "reclaim never takes a connection serving a connected downstream:\n{e}\n{}",
                agent.ctx()
            );
        }
    });
    parts.check("only orphaned connections were killed", || {
        assert_only_orphans_killed(chain, &agent, &serving, side)
    });
    parts.check(
        "a fresh request through the proxy answers 200 with a body",
        || chain.assert_json_ok(),
    );
    agent.assert_healthy();
    parts.finish();
}

/// The scenario: users who stay open their pages first, [`SETTLE`] later the leaving users
/// open a quiet page and leave after a second, and the quota is full (checked, see
/// [`assert_leak_is_real`]). Returns the users who stay and their upstreams' local addresses.
fn fill_the_quota(chain: &PodChain) -> (Vec<User>, BTreeSet<SocketAddr>) {
    let staying: Vec<User> = STAYING.iter().map(|p| chain.stay(p)).collect();
    let serving = wait_until(HTTP, POLL, || {
        let locals = chain.proxy_upstream_locals();
        (locals.len() == STAYING.len()).then_some(locals)
    })
    .unwrap_or_else(|| {
        panic!(
            "the proxy should hold one upstream per staying user: {:#?}",
            chain.proxy_upstreams()
        )
    });
    thread::sleep(SETTLE);
    chain.leave(LEAVING, Duration::from_secs(1));
    assert_leak_is_real(chain, &staying);
    (staying, serving)
}

/// The harness on its own, without connreap: what a correct reclaim does, done by hand
/// (`ss -K` on 8 orphaned upstreams of the proxy, through the Service), frees 8 of the
/// relay's streams, no staying user loses its stream, the Node.js proxy survives and a fresh
/// request answers 200 with a body. So the outcome the tests above ask of connreap is
/// reachable in this layout.
#[test]
fn harness_killing_orphans_by_hand_frees_the_quota_and_spares_the_users() {
    let Some((_env, root)) = setup() else { return };
    let chain = PodChain::start(&root, Upstream::Service);
    let (staying, serving) = fill_the_quota(&chain);
    let orphans: Vec<SocketAddr> = chain
        .proxy_upstream_locals()
        .difference(&serving)
        .copied()
        .collect();
    assert_eq!(orphans.len(), LEAVING, "{orphans:?}");
    for local in &orphans[..8] {
        chain.kill_upstream(*local);
    }
    chain.wait_streams(MAX_STREAMS - 8, HTTP);
    assert!(chain.proxy_alive(), "the proxy died:\n{}", chain.stderr());
    let left = chain.proxy_upstream_locals();
    assert!(
        serving.is_subset(&left) && left.len() == MAX_STREAMS as usize - 8,
        "the staying users' upstreams {serving:?} are still there, 8 others gone: {left:?}"
    );
    thread::sleep(SCAN);
    check_all(&staying).unwrap_or_else(|e| panic!("{e}\n{}", chain.stderr()));
    chain.assert_json_ok();
    check_all(&staying).unwrap_or_else(|e| panic!("{e}"));

    // And the users' check has teeth: kill the staying users' upstreams, every one of them
    // loses its stream (the proxy ends the response when its upstream breaks).
    for local in &serving {
        chain.kill_upstream(*local);
    }
    let all_lost = wait_until(HTTP, POLL, || {
        staying.iter().all(|u| u.check().is_err()).then_some(())
    });
    assert!(
        all_lost.is_some(),
        "users whose upstream was killed should have lost their stream: {:?}",
        staying.iter().map(User::check).collect::<Vec<_>>()
    );
}

/// What the test itself checks before asking connreap anything: the relay's quota is full,
/// the proxy holds one idle upstream per stream, only the staying users' downstreams are
/// left, a new request is refused (503 busy), and the staying users have their streams.
fn assert_leak_is_real(chain: &PodChain, staying: &[User]) {
    chain.wait_streams(MAX_STREAMS, HTTP);
    let layout = wait_until(HTTP, POLL, || {
        let (up, down) = (chain.proxy_upstreams(), chain.proxy_downstreams());
        (up.len() == MAX_STREAMS as usize && down.len() == STAYING.len()).then_some((up, down))
    });
    let (up, _) = layout.unwrap_or_else(|| {
        panic!(
            "in {}, the proxy (node pid {}) should hold {MAX_STREAMS} upstreams to {} and \
             {} downstreams: upstreams {:#?}\ndownstreams {:#?}",
            chain.proxy_pod.describe(),
            chain.proxy_pid(),
            chain.upstream,
            STAYING.len(),
            chain.proxy_upstreams(),
            chain.proxy_downstreams()
        )
    });
    assert!(
        up.iter().all(|s| s.recv_q == 0 && s.send_q == 0),
        "leaked upstreams have empty queues: {up:#?}"
    );
    let refused = chain
        .get_json()
        .unwrap_or_else(|e| panic!("GET /json: {e}"));
    assert_eq!(
        (refused.status, refused.text()),
        (503, "busy".to_string()),
        "with the quota full the relay refuses, the proxy answers 503 busy"
    );
    let status = chain.try_status().unwrap_or_default();
    assert!(
        status["dialDenied"].as_u64().is_some_and(|n| n >= 1),
        "the relay counted the refused dial: {status}"
    );
    check_all(staying).unwrap_or_else(|e| panic!("before connreap did anything:\n{e}"));
}

/// The quota alert: where it is, who holds the quota, and the proxy behind the relay.
fn assert_quota_alert(chain: &PodChain, b: &Value) {
    let ctx = format!("quota_exhausted_by_leak alert:\n{b:#}");
    assert_eq!(b["service_port"], INSTANCE_PORT, "{ctx}");
    assert_eq!(
        b["quota"],
        json!({"name": "relay", "used": MAX_STREAMS, "limit": MAX_STREAMS, "port": INSTANCE_PORT}),
        "{ctx}"
    );
    assert_in_pod(b, &chain.relay_pod, "the quota alert (the relay's pod)");
    assert!(
        names_pid(b, chain.relay_pid()),
        "the relay holds the quota's streams: {ctx}"
    );

    // The proxy in `processes`, with its container.
    let p = entry(b, "processes", chain.proxy_pid()).unwrap_or_else(|| {
        panic!(
            "expected the proxy (node pid {}) in `processes`: {ctx}",
            chain.proxy_pid()
        )
    });
    assert_eq!(p["comm"], "node", "{ctx}");
    assert_eq!(
        p["container"],
        json!(chain.proxy_pod.container().id),
        "expected the proxy's entry of `processes` to carry its `container`: {ctx}"
    );

    // The proxy in `upstream`: where it runs, through which relay, and how many of its
    // connections are orphaned.
    let u = entry(b, "upstream", chain.proxy_pid())
        .expect("the alert was picked for naming the proxy in `upstream`");
    let what = "the proxy's entry of `upstream`";
    assert_eq!(u["comm"], "node", "{what}: {ctx}");
    assert_eq!(
        u["netns"],
        json!(chain.proxy_pod.inode()),
        "expected `upstream[].netns` = the proxy pod's namespace: {ctx}"
    );
    assert_eq!(
        u["container"],
        json!(chain.proxy_pod.container().id),
        "expected `upstream[].container` = the proxy's container id: {ctx}"
    );
    assert!(
        u.get("pod_name").is_none_or(Value::is_null)
            && u.get("pod_namespace").is_none_or(Value::is_null),
        "{what}: a Docker container has no Kubernetes pod: {ctx}"
    );
    assert_eq!(
        (&u["via_pid"], &u["via_comm"], &u["via_port"]),
        (
            &json!(chain.relay_pid()),
            &json!("relay-sim"),
            &json!(DIAL_PORT)
        ),
        "{what}: {ctx}"
    );
    let count = |k: &str| {
        u[k].as_u64()
            .unwrap_or_else(|| panic!("expected the count `upstream[].{k}` (a number): {ctx}"))
    };
    let (orphaned, serving, ambiguous) = (count("orphaned"), count("serving"), count("ambiguous"));
    // The proxy's connections matched to the relay's streams: all 64, but as in the hop test
    // of one namespace (detect::relay_hop), a few whose state change the tracker missed may
    // go unmatched.
    let matched = count("count");
    assert!(
        (MAX_STREAMS - 4..=MAX_STREAMS).contains(&matched),
        "one proxy connection per relay stream: `upstream[].count` = {matched}: {ctx}"
    );
    let leaving = LEAVING as u64;
    // A socket whose state change the tracker missed has only a lower-bound age and may be
    // left ambiguous: allow a few of the leaving users' upstreams to be.
    assert!(
        (leaving - 4..=leaving).contains(&orphaned),
        "{LEAVING} users left, so {LEAVING} of the proxy's upstreams are orphaned (a few may be \
         ambiguous), and the {} of users who stay never are: orphaned = {orphaned}: {ctx}",
        STAYING.len()
    );
    assert_eq!(
        orphaned + serving + ambiguous,
        matched,
        "expected orphaned + serving + ambiguous = the entry's `count`: {ctx}"
    );
    // An upstream left unmatched (above) is in none of the three counts, and it may be a
    // staying user's as well as a leaving one's. Whether a staying user's upstream is ever
    // taken is checked where it matters: after the reclaim, every staying user keeps its stream.
    let unmatched = MAX_STREAMS - matched;
    assert!(
        serving + ambiguous + unmatched >= STAYING.len() as u64,
        "the {} upstreams of users who stay are serving (or ambiguous, or among the {unmatched} \
         unmatched): {ctx}",
        STAYING.len()
    );
    let summary = b["summary"].as_str().unwrap_or_default();
    assert!(
        summary.contains(&format!("{orphaned} orphaned")),
        "expected the summary to say how many are orphaned (`{orphaned} orphaned`): \
         {summary}"
    );
    assert!(summary.ends_with("verdict: leak"), "{summary}");
}

/// Audit: kills happened, each of them one of the proxy's connections to the relay, on the
/// policy's side and in that side's namespace, never one serving a user who stayed
/// (`serving`: the proxy-side addresses of their upstreams, which is also what the relay
/// sees as their peer when the proxy dials the relay pod directly).
fn assert_only_orphans_killed(
    chain: &PodChain,
    agent: &Agent,
    serving: &BTreeSet<SocketAddr>,
    side: Side,
) {
    let lines = agent.audit();
    let killed = result_is(&lines, "killed");
    assert!(!killed.is_empty(), "no kill audited:\n{}", agent.ctx());
    let serving: BTreeSet<String> = serving.iter().map(SocketAddr::to_string).collect();
    let (comm, pid, pod) = match side {
        Side::Proxy => ("node", chain.proxy_pid(), &chain.proxy_pod),
        Side::Relay => ("relay-sim", chain.relay_pid(), &chain.relay_pod),
    };
    for d in &killed {
        let ctx = format!("audit line {d}\n{}", agent.ctx());
        assert_eq!(
            (text(d, "comm"), &d["pid"]),
            (comm, &json!(pid)),
            "only the {side:?} side's connections are killed: {ctx}"
        );
        assert_eq!(
            d["netns"],
            json!(pod.inode()),
            "killed in {}: {ctx}",
            pod.describe()
        );
        assert_eq!(d["container"], json!(pod.container().id), "{ctx}");
        let (user_end, relay_end) = match side {
            Side::Proxy => (text(d, "local"), text(d, "peer")),
            Side::Relay => (text(d, "peer"), text(d, "local")),
        };
        let dial = match side {
            Side::Proxy => chain.upstream,
            Side::Relay => chain.relay_pod.addr(DIAL_PORT),
        };
        assert_eq!(
            relay_end,
            dial.to_string(),
            "a connection to the relay's dial slot: {ctx}"
        );
        assert!(
            !serving.contains(user_end),
            "killed the upstream of a user who stayed ({user_end}): {ctx}"
        );
    }
}
