//! Incident 4, retries that keep hitting one dead upstream: three upstream nodes of a service,
//! each in its own pod on the node's bridge, behind a real Node.js gateway whose retry
//! selector re-picks the node that just failed. One layout has a node that refuses
//! connections (nothing listens), another a node that accepts and resets at once; users of
//! those gateways see requests hang for the whole retry budget and then fail with 502, while
//! the two healthy nodes serve every request that reaches them.
//!
//! connreap must name each gateway and its broken node (failing_upstream, with the failure
//! kind, the retry interval and the healthy alternatives with their counts), never a healthy
//! node; a third gateway under the same load, whose nodes are healthy but one resets a
//! connection now and then, raises nothing; a fourth, whose every node is broken, is reported
//! as an outage, not a selector bug. Thresholds are the defaults.

use std::{
    net::SocketAddr,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    thread,
    time::{Duration, Instant},
};

use connreap_tests::{
    fixtures::http_get_in_netns,
    harness::{
        containers::FakeContainer,
        pods::{node_bin, node_script, Node, Pod},
        Agent, Child, TempDir,
    },
};
use serde_json::Value;

use super::{assert_in_pod, host_config, host_receiver, names_pid, setup, wait_alert, Parts};

/// The service's port on every upstream node.
const PORT: u16 = 8080;
/// The gateways' port.
const GW_PORT: u16 = 8000;

/// `node SCRIPT ARGS` in `pod`, once it printed `ready`.
fn node_in(pod: &Pod, script: &str, args: &[&str]) -> Child {
    let bin = node_bin().expect("node (checked by setup)");
    let script = node_script(script);
    let mut all = vec![script.to_str().expect("a UTF-8 path")];
    all.extend_from_slice(args);
    pod.spawn(&bin, &all).0
}

fn upstream(pod: &Pod, name: &str, extra: &[&str]) -> Child {
    let listen = pod.addr(PORT).to_string();
    let mut args = vec!["--listen", listen.as_str(), "--name", name];
    args.extend_from_slice(extra);
    node_in(pod, "upstream-node.js", &args)
}

fn gateway(pod: &Pod, upstreams: &[&Pod]) -> Child {
    let listen = pod.addr(GW_PORT).to_string();
    let ups: Vec<String> = upstreams.iter().map(|p| p.addr(PORT).to_string()).collect();
    let ups = ups.join(",");
    node_in(
        pod,
        "retry-gateway.js",
        &[
            "--listen",
            &listen,
            "--upstreams",
            &ups,
            "--retries",
            "8",
            "--backoff-ms",
            "100-300",
        ],
    )
}

/// What users of one gateway saw: each request's status (0: no answer) and duration.
#[derive(Debug, Default)]
struct Seen {
    answers: Vec<(u16, Duration)>,
}

impl Seen {
    fn count(&self, status: u16) -> usize {
        self.answers.iter().filter(|(s, _)| *s == status).count()
    }
    fn slowest(&self, status: u16) -> Duration {
        self.answers
            .iter()
            .filter(|(s, _)| *s == status)
            .map(|(_, d)| *d)
            .max()
            .unwrap_or_default()
    }
}

/// Two users sending a request every 100 ms to `gw` from the node's namespace until `stop`.
fn users(node: &Node, gw: SocketAddr, stop: Arc<AtomicBool>) -> Vec<thread::JoinHandle<Seen>> {
    (0..2)
        .map(|_| {
            let (ns, stop) = (node.ns().name().to_string(), stop.clone());
            thread::spawn(move || {
                let mut seen = Seen::default();
                while !stop.load(Ordering::Relaxed) {
                    let t = Instant::now();
                    let status = http_get_in_netns(&ns, gw, "/api", Duration::from_secs(10))
                        .map(|(s, _)| s)
                        .unwrap_or(0);
                    seen.answers.push((status, t.elapsed()));
                    thread::sleep(Duration::from_millis(100));
                }
                seen
            })
        })
        .collect()
}

fn joined(handles: Vec<thread::JoinHandle<Seen>>) -> Seen {
    let mut all = Seen::default();
    for h in handles {
        all.answers.extend(h.join().expect("a user thread").answers);
    }
    all
}

/// Whether alert or finding `b` lists every one of `pods` among the alternatives that
/// succeed. The first alert may come before the gateway reached both healthy nodes; its
/// updates (re-sent as the failures grow) list them.
fn lists_healthy(b: &Value, pods: [&Pod; 2]) -> bool {
    pods.iter().all(|p| {
        b["failing"]["alternatives"].as_array().is_some_and(|a| {
            a.iter().any(|e| {
                e["endpoint"] == p.addr(PORT).to_string().as_str()
                    && e["successes"].as_u64().is_some_and(|n| n > 0)
            })
        })
    })
}

/// The failing_upstream alert's checks: it names `gw`'s process and `broken`'s address with
/// `kind` failures, says retries do not switch, and lists both healthy nodes as succeeding.
fn assert_names_broken(b: &Value, broken: &Pod, healthy: [&Pod; 2], kind: &str) {
    let u = &b["failing"];
    assert_eq!(
        u["endpoint"],
        broken.addr(PORT).to_string(),
        "the failing endpoint is the broken node: {b:#}"
    );
    assert!(
        u["kinds"][kind].as_u64().is_some_and(|n| n >= 10),
        "at least failing_min_failures `{kind}` failures: {b:#}"
    );
    assert_eq!(u["verdict"], "retries_do_not_switch", "{b:#}");
    let retry = u["retry_interval_secs"].as_f64().unwrap_or(0.0);
    // Two users' requests retry at once, each every 100-300 ms: failed attempts come about
    // every 50-150 ms.
    assert!(
        (0.03..=0.3).contains(&retry),
        "the interval between failed attempts follows the gateway's backoff (100-300 ms, two \
         requests retrying at once): {b:#}"
    );
    let summary = b["summary"].as_str().unwrap_or_default();
    assert!(
        summary.contains(&format!("to {}", broken.addr(PORT)))
            && summary.contains("retries do not switch"),
        "{summary}"
    );
    for h in healthy {
        let addr = h.addr(PORT).to_string();
        let alt = u["alternatives"]
            .as_array()
            .and_then(|a| a.iter().find(|e| e["endpoint"] == addr.as_str()))
            .unwrap_or_else(|| {
                panic!("healthy node {addr} is not listed as an alternative: {b:#}")
            });
        assert!(
            alt["successes"].as_u64().is_some_and(|n| n > 0) && alt["failures"] == 0,
            "{alt:#}"
        );
        assert!(summary.contains(&format!("{addr} (")), "{summary}");
    }
}

#[test]
fn failing_upstream_names_the_gateway_and_its_broken_node() {
    let Some((_env, root)) = setup() else { return };
    let node = Node::new("fu-node");
    let up_a = node.pod("fu-a", None);
    let up_b = node.pod("fu-b", None);
    // Nothing listens here: connections are refused.
    let up_refuse = node.pod("fu-refuse", None);
    let up_reset = node.pod("fu-reset", None);
    let up_flaky = node.pod("fu-flaky", None);
    let gw_refuse = node.pod(
        "fu-gw1",
        Some(FakeContainer::crio(&root, "e2e", "gateway-refuse")),
    );
    let gw_reset = node.pod("fu-gw2", None);
    let gw_ok = node.pod("fu-gw3", None);
    let gw_down = node.pod("fu-gw4", None);
    let _a = upstream(&up_a, "a", &[]);
    let _b = upstream(&up_b, "b", &[]);
    let _reset = upstream(&up_reset, "reset", &["--mode", "reset"]);
    let _flaky = upstream(&up_flaky, "flaky", &["--reset-every", "10"]);
    let g1 = gateway(&gw_refuse, &[&up_a, &up_b, &up_refuse]);
    let g2 = gateway(&gw_reset, &[&up_a, &up_b, &up_reset]);
    let g3 = gateway(&gw_ok, &[&up_a, &up_b, &up_flaky]);
    // A gateway of a service whose every node is broken: an outage, not a selector bug.
    let g4 = gateway(&gw_down, &[&up_refuse, &up_reset]);

    let dir = TempDir::new("pods-failing");
    let hook = host_receiver();
    let agent = Agent::start_in_host(&dir, &host_config(&dir, &hook));

    let stop = Arc::new(AtomicBool::new(false));
    let load = [
        users(&node, gw_refuse.addr(GW_PORT), stop.clone()),
        users(&node, gw_reset.addr(GW_PORT), stop.clone()),
        users(&node, gw_ok.addr(GW_PORT), stop.clone()),
        users(&node, gw_down.addr(GW_PORT), stop.clone()),
    ];
    let mut parts = Parts::new();
    let refuse_alert = parts.check("the refusing node is named", || {
        let b = wait_alert(
            &hook,
            &agent,
            "a failing_upstream alert naming the gateway and the refusing node",
            |b| {
                b["kind"] == "failing_upstream"
                    && b["status"] == "firing"
                    && names_pid(b, g1.pid())
                    && lists_healthy(b, [&up_a, &up_b])
            },
        );
        assert_names_broken(&b, &up_refuse, [&up_a, &up_b], "refused");
        assert_in_pod(
            &b,
            &gw_refuse,
            "the failing_upstream alert of the refusing node",
        );
        b
    });
    parts.check("the resetting node is named", || {
        let b = wait_alert(
            &hook,
            &agent,
            "a failing_upstream alert naming the gateway and the resetting node",
            |b| {
                b["kind"] == "failing_upstream"
                    && b["status"] == "firing"
                    && names_pid(b, g2.pid())
                    && lists_healthy(b, [&up_a, &up_b])
            },
        );
        assert_names_broken(&b, &up_reset, [&up_a, &up_b], "reset");
        assert_in_pod(
            &b,
            &gw_reset,
            "the failing_upstream alert of the resetting node",
        );
    });
    parts.check("a service whose every node fails is an outage", || {
        let b = wait_alert(
            &hook,
            &agent,
            "a failing_upstream alert calling the all-broken service an outage",
            |b| {
                b["kind"] == "failing_upstream"
                    && b["status"] == "firing"
                    && names_pid(b, g4.pid())
                    && b["failing"]["endpoint"] == up_refuse.addr(PORT).to_string().as_str()
            },
        );
        assert_eq!(b["failing"]["verdict"], "outage", "{b:#}");
        let summary = b["summary"].as_str().unwrap_or_default();
        assert!(
            summary.contains("an outage of the service, not a retry selector bug"),
            "{summary}"
        );
    });
    parts.check("/v1/findings says the same", || {
        // Right after the alert went out: the API serves what receivers were told.
        let f = agent
            .find("failing_upstream", |f| names_pid(f, g1.pid()))
            .unwrap_or_else(|| {
                let log: Vec<String> = agent
                    .stderr()
                    .lines()
                    .filter(|l| l.contains("failing_upstream"))
                    .map(String::from)
                    .collect();
                panic!(
                    "/v1/findings lacks the gateway: {:#?}\nagent log:\n{}",
                    agent.findings(),
                    log.join("\n")
                )
            });
        assert_eq!(f["failing"]["endpoint"], up_refuse.addr(PORT).to_string());
        if let Some(b) = &refuse_alert {
            assert_eq!(f["fingerprint"], b["fingerprint"]);
        }
        assert_eq!(
            f["fingerprint"],
            format!(
                "failing_upstream:node@pod:e2e/gateway-refuse:{}@netns:{}",
                up_refuse.addr(PORT),
                gw_refuse.name()
            )
        );
    });
    parts.check(
        "the metrics count refused and reset connections per port",
        || {
            let m = agent.metrics();
            let sum = |result: &str| -> f64 {
                m.samples()
                    .iter()
                    .filter(|s| {
                        s.name == "connreap_upstream_connections_total"
                            && s.labels.get("comm").map(String::as_str) == Some("node")
                            && s.labels.get("remote_port") == Some(&PORT.to_string())
                            && s.labels.get("result").map(String::as_str) == Some(result)
                    })
                    .map(|s| s.value)
                    .sum()
            };
            for result in ["refused", "reset", "success"] {
                assert!(sum(result) >= 10.0, "{result}: {}\n{m}", sum(result));
            }
            assert!(
                !m.to_string().contains(&up_refuse.ip.to_string()),
                "no remote address label unless configured"
            );
        },
    );
    // Ten more seconds of the same load, then what users saw and what was never raised.
    thread::sleep(Duration::from_secs(10));
    parts.check("the alerts kept firing while the retries went on", || {
        let resolved: Vec<Value> = hook
            .posts()
            .into_iter()
            .map(|p| p.body)
            .filter(|b| b["kind"] == "failing_upstream" && b["status"] == "resolved")
            .collect();
        assert!(resolved.is_empty(), "{resolved:#?}");
        for g in [&g1, &g2] {
            assert!(
                agent
                    .find("failing_upstream", |f| names_pid(f, g.pid()))
                    .is_some(),
                "{:#?}",
                agent.findings()
            );
        }
    });
    stop.store(true, Ordering::Relaxed);
    let [l1, l2, l3, l4] = load;
    let (seen1, seen2, seen3, seen4) = (joined(l1), joined(l2), joined(l3), joined(l4));
    parts.check(
        "users of the broken gateways saw requests hang, then fail",
        || {
            for (gw, seen) in [("refusing", &seen1), ("resetting", &seen2)] {
                assert!(
                    seen.count(502) >= 3 && seen.count(200) >= 3,
                    "{gw}: some requests served, some failed: {seen:?}"
                );
                assert!(
                    seen.slowest(502) >= Duration::from_millis(800),
                    "{gw}: a failed request hung through its retries first: {seen:?}"
                );
            }
        },
    );
    parts.check(
        "users of the all-broken service got no answer but 502",
        || {
            assert!(
                seen4.count(502) == seen4.answers.len() && !seen4.answers.is_empty(),
                "{seen4:?}"
            );
        },
    );
    parts.check("the healthy gateway served every request", || {
        assert!(
            seen3.count(200) == seen3.answers.len() && seen3.answers.len() >= 20,
            "{seen3:?}"
        );
    });
    parts.check(
        "nothing names the healthy gateway or a healthy node",
        || {
            let healthy: Vec<String> = [&up_a, &up_b, &up_flaky]
                .iter()
                .map(|p| p.addr(PORT).to_string())
                .collect();
            let wrong: Vec<Value> = hook
                .posts()
                .into_iter()
                .map(|p| p.body)
                .chain(agent.findings())
                .filter(|b| b["kind"] == "failing_upstream")
                .filter(|b| {
                    names_pid(b, g3.pid())
                        || healthy
                            .iter()
                            .any(|h| b["failing"]["endpoint"] == h.as_str())
                })
                .collect();
            assert!(wrong.is_empty(), "{wrong:#?}");
        },
    );
    parts.finish();
}
