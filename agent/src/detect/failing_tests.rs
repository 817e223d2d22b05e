use std::time::{Duration, Instant};

use super::*;
use crate::kind::Kind;

const GATEWAY: u32 = 812;

fn target(pid: u32, remote: &str) -> Target {
    Target {
        pid,
        comm: "node".into(),
        netns: 0,
        remote: remote.parse().unwrap(),
    }
}

/// Attempts: `n` of outcome `o`, failed ones `gap_ms` apart from `from_ms`.
fn attempts(o: Outcome, n: u64, from_ms: u64, gap_ms: u64) -> Attempts {
    let mut a = Attempts::default();
    a.add(o, n);
    if o != Outcome::Success {
        a.failed_at_ms = (0..n).map(|i| from_ms + i * gap_ms).collect();
        if o == Outcome::Reset {
            a.max_short_life_ms = 4;
        }
    }
    a
}

/// The gateway of the incident: every scan (1 s), 2 retries reset by the broken node within a
/// few ms, 300 ms apart, and a success on each healthy node now and then.
fn incident(t: &mut FailTracker, cfg: &DetectConfig, scans: u64, start: Instant) -> Instant {
    let mut now = start;
    for i in 0..scans {
        t.record(
            target(GATEWAY, "10.0.0.3:8080"),
            None,
            &attempts(Outcome::Reset, 2, i * 1000, 300),
        );
        if i % 2 == 0 {
            t.record(
                target(GATEWAY, "10.0.0.1:8080"),
                None,
                &attempts(Outcome::Success, 1, 0, 0),
            );
            t.record(
                target(GATEWAY, "10.0.0.2:8080"),
                None,
                &attempts(Outcome::Success, 2, 0, 0),
            );
        }
        now += Duration::from_secs(1);
        t.close_window(now, Duration::from_secs(1), cfg);
    }
    now
}

#[test]
fn retries_that_keep_hitting_one_dead_upstream_are_named() {
    let cfg = DetectConfig::default();
    let mut t = FailTracker::default();
    incident(&mut t, &cfg, 4, Instant::now());
    assert!(
        t.findings(&cfg).is_empty(),
        "8 failures: below failing_min_failures"
    );
    let start = Instant::now();
    let mut t = FailTracker::default();
    incident(&mut t, &cfg, 20, start);
    let f = t.findings(&cfg);
    assert_eq!(f.len(), 1, "{f:#?}");
    let f = &f[0];
    assert_eq!(f.kind(), Kind::FailingUpstream);
    assert_eq!(f.fingerprint, "failing_upstream:node:10.0.0.3:8080");
    assert_eq!((f.count, f.service_port), (40, Some(8080)));
    assert_eq!(f.processes[0].pid, Some(GATEWAY));
    let u = f.failing().expect("failing detail");
    assert_eq!(u.endpoint, "10.0.0.3:8080");
    assert_eq!((u.attempts, u.failures), (40, 40));
    assert_eq!(u.kinds, BTreeMap::from([("reset", 40)]));
    assert_eq!(u.retry_interval_secs, Some(0.3));
    assert_eq!(u.verdict, "retries_do_not_switch");
    let alt: Vec<(&str, u64, u64)> = u
        .alternatives
        .iter()
        .map(|e| (e.endpoint.as_str(), e.successes, e.failures))
        .collect();
    assert_eq!(alt, [("10.0.0.2:8080", 20, 0), ("10.0.0.1:8080", 10, 0)]);
    assert_eq!(
        f.summary,
        "node pid 812 made 40 failed connections in 20s to 10.0.0.3:8080 (40 reset by peer \
         within 4ms) of 40 attempts, a failed attempt every 300ms; other endpoints of port 8080 \
         succeed: 10.0.0.2:8080 (20 ok), 10.0.0.1:8080 (10 ok): retries do not switch to them"
    );
}

#[test]
fn when_no_endpoint_succeeds_it_is_an_outage() {
    let cfg = DetectConfig::default();
    let mut t = FailTracker::default();
    let mut now = Instant::now();
    for i in 0..10 {
        t.record(
            target(7, "10.0.0.3:5432"),
            None,
            &attempts(Outcome::Refused, 2, i * 1000, 500),
        );
        t.record(
            target(7, "10.0.0.4:5432"),
            None,
            &attempts(Outcome::Timeout, 1, i * 1000, 0),
        );
        now += Duration::from_secs(1);
        t.close_window(now, Duration::from_secs(1), &cfg);
    }
    let f = t.findings(&cfg);
    assert_eq!(f.len(), 2, "both endpoints fail: {f:#?}");
    let u = f[0].failing().unwrap();
    assert_eq!(
        (u.endpoint.as_str(), u.verdict),
        ("10.0.0.3:5432", "outage")
    );
    assert!(
        f[0].summary.contains(
            "(20 refused) of 20 attempts, a failed attempt every 500ms; no other endpoint of port 5432 \
             succeeds either (10.0.0.4:5432 (10 failed)): an outage of the service"
        ),
        "{}",
        f[0].summary
    );
    assert_eq!(
        f[1].failing().unwrap().kinds,
        BTreeMap::from([("timeout", 10)])
    );
}

/// A healthy service under load: thousands of successes and a reset now and then, to every
/// endpoint, stays quiet; so does a burst below the share.
#[test]
fn a_healthy_service_with_an_occasional_reset_is_quiet() {
    let cfg = DetectConfig::default();
    let mut t = FailTracker::default();
    let mut now = Instant::now();
    for i in 0..60 {
        for host in 1..=3 {
            let addr = format!("10.0.0.{host}:8080");
            t.record(
                target(1, &addr),
                None,
                &attempts(Outcome::Success, 50, 0, 0),
            );
            if i % 10 == host {
                t.record(
                    target(1, &addr),
                    None,
                    &attempts(Outcome::Reset, 1, i * 1000, 0),
                );
            }
        }
        now += Duration::from_secs(1);
        t.close_window(now, Duration::from_secs(1), &cfg);
    }
    assert!(t.findings(&cfg).is_empty());
    // 30 failures, but most attempts there succeed: below failing_share.
    t.record(
        target(1, "10.0.0.1:8080"),
        None,
        &attempts(Outcome::Reset, 30, 0, 10),
    );
    t.close_window(now + Duration::from_secs(1), Duration::from_secs(1), &cfg);
    assert!(t.findings(&cfg).is_empty());
}

/// Failures older than failing_window are forgotten: the finding resolves once retries stop.
#[test]
fn failures_leave_the_window() {
    let cfg = DetectConfig {
        failing_window: Duration::from_secs(10),
        ..DetectConfig::default()
    };
    let mut t = FailTracker::default();
    let now = incident(&mut t, &cfg, 10, Instant::now());
    assert_eq!(t.findings(&cfg).len(), 1);
    let f = &t.findings(&cfg)[0];
    assert!(f.summary.contains(" in 10s "), "{}", f.summary);
    let mut later = now;
    for _ in 0..10 {
        later += Duration::from_secs(1);
        t.close_window(later, Duration::from_secs(1), &cfg);
    }
    assert!(t.findings(&cfg).is_empty());
}

/// A process in a pod: the finding is filed under its namespace and pod.
#[test]
fn findings_are_placed_in_the_process_pod() {
    use crate::{
        containers::Runtime,
        detect::scope_testutil::{container, netns},
    };
    let cfg = DetectConfig::default();
    let ns = netns(41, Some("cni-gw"));
    let c = Arc::new(container(
        "c0c0",
        Runtime::Containerd,
        Some(("shop", "gw-0")),
    ));
    let mut t = FailTracker::default();
    t.set_namespaces(std::slice::from_ref(&ns));
    let mut tg = target(5, "10.0.0.3:8080");
    tg.netns = 41;
    t.record(tg, Some(c.clone()), &attempts(Outcome::Refused, 12, 0, 200));
    t.close_window(Instant::now(), Duration::from_secs(5), &cfg);
    let f = t.findings(&cfg);
    assert_eq!(
        f[0].fingerprint,
        "failing_upstream:node@pod:shop/gw-0:10.0.0.3:8080@netns:cni-gw"
    );
    assert_eq!(f[0].processes[0].pod_name.as_deref(), Some("gw-0"));
    assert_eq!(f[0].netns, 41);
    assert!(
        f[0].summary
            .contains("it connects to no other endpoint of port 8080"),
        "{}",
        f[0].summary
    );
}

#[test]
fn retry_interval_is_the_median_gap() {
    assert_eq!(retry_interval(&[]), None);
    assert_eq!(retry_interval(&[5]), None);
    assert_eq!(retry_interval(&[1000, 0, 300, 600, 5000]), Some(0.4));
}

/// A window holds at most MAX_TARGETS targets; beyond, failing ones are still kept.
#[test]
fn targets_per_window_are_bounded_but_failures_kept() {
    let cfg = DetectConfig::default();
    let mut t = FailTracker::default();
    for i in 0..(MAX_TARGETS as u32 + 100) {
        let remote = std::net::SocketAddr::from((std::net::Ipv4Addr::from(0x0a00_0000 + i), 443));
        t.record(
            Target {
                pid: 1,
                comm: "proxy".into(),
                netns: 0,
                remote,
            },
            None,
            &attempts(Outcome::Success, 1, 0, 0),
        );
    }
    let mut failing = target(1, "192.0.2.1:443");
    failing.comm = "proxy".into();
    t.record(failing, None, &attempts(Outcome::Refused, 12, 0, 100));
    assert_eq!(t.current.len(), MAX_TARGETS + 1);
    t.close_window(Instant::now(), Duration::from_secs(5), &cfg);
    let f = t.findings(&cfg);
    assert_eq!(f.len(), 1);
    let u = f[0].failing().unwrap();
    assert_eq!(u.endpoint, "192.0.2.1:443");
    // The alternatives are listed up to MAX_ALTERNATIVES; the summary says how many more.
    assert_eq!(u.alternatives.len(), MAX_ALTERNATIVES);
    assert!(
        f[0].summary.ends_with(&format!(
            " and {} more: retries do not switch to them",
            MAX_TARGETS - MAX_ALTERNATIVES
        )),
        "{}",
        f[0].summary
    );
}

/// Another endpoint that mostly fails too does not count as a healthy alternative because of
/// one lucky connection: the service is out.
#[test]
fn an_alternative_that_mostly_fails_is_not_healthy() {
    let cfg = DetectConfig::default();
    let mut t = FailTracker::default();
    t.record(
        target(7, "10.0.0.3:8080"),
        None,
        &attempts(Outcome::Refused, 20, 0, 200),
    );
    t.record(
        target(7, "10.0.0.4:8080"),
        None,
        &attempts(Outcome::Reset, 40, 0, 100),
    );
    t.record(
        target(7, "10.0.0.4:8080"),
        None,
        &attempts(Outcome::Success, 1, 0, 0),
    );
    t.close_window(Instant::now(), Duration::from_secs(5), &cfg);
    let f = t.findings(&cfg);
    assert_eq!(f.len(), 2);
    for f in &f {
        assert_eq!(f.failing().unwrap().verdict, "outage", "{}", f.summary);
    }
    assert!(
        f[0].summary
            .contains("no other endpoint of port 8080 succeeds either (10.0.0.4:8080 (40 failed))"),
        "{}",
        f[0].summary
    );
}
