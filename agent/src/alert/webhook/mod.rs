//! Webhook delivery: one bounded queue and one sender task per receiver, in order, retried with
//! exponential backoff while the receiver is down. When a queue is full the oldest
//! notification is dropped, counted and logged: nothing is lost silently.
mod receiver;

use std::{
    collections::VecDeque,
    sync::{Arc, Mutex, MutexGuard, PoisonError},
    time::{Duration, Instant},
};

use serde_json::{json, Value};
use tokio::sync::Notify;

use crate::{
    alert::notify::{Alert, Notification, Reclaimed, Status},
    config::{AlertsConfig, Delivery, WebhookConfig, WebhookFormat},
    logging::Repeats,
    metrics::Metrics,
    present::rfc3339,
    tasks::Supervisor,
};

/// What Alertmanager bodies need beyond the notification.
#[derive(Clone, Default)]
pub struct AmContext {
    /// Re-post interval: firing alerts end four of these ahead.
    pub resend: Duration,
    /// `[alerts.severity]` overrides by kind.
    pub severity: std::collections::BTreeMap<String, String>,
    /// `http://HOST:PORT` of this agent's API, for `generatorURL`.
    pub api_base: String,
}

/// Body of one notification in the given format; None when this format does not get it
/// (refreshes are for Alertmanager only).
pub fn body(n: &Notification, format: WebhookFormat, am: &AmContext) -> Option<Value> {
    Some(match (n, format) {
        (Notification::Refresh(_), WebhookFormat::Json) => return None,
        (n, WebhookFormat::Json) => serde_json::to_value(n).unwrap_or(Value::Null),
        (Notification::Reclaimed(r), WebhookFormat::Alertmanager) => reclaimed_alertmanager(r),
        (
            Notification::Fired(a)
            | Notification::Updated(a)
            | Notification::Resolved(a)
            | Notification::Refresh(a),
            WebhookFormat::Alertmanager,
        ) => alert_alertmanager(a, am),
    })
}

/// A finding as an Alertmanager alert. Labels are its identity (they must not change while
/// it fires: kind, fingerprint, host, network namespace, container and pod, command, unit,
/// service port, quota, severity); what changes (pids, counts, the verdict's text) and the
/// full attribution (namespace inode, container id and runtime, pod UID) go in annotations.
fn alert_alertmanager(alert: &Alert, am: &AmContext) -> Value {
    let f = &alert.finding;
    let severity = am
        .severity
        .get(f.kind().as_str())
        .map_or(f.kind().default_severity(), String::as_str);
    let mut labels = json!({
        "alertname": f.kind().as_str(),
        "fingerprint": f.fingerprint,
        "host": alert.host,
        "service": "connreap",
        "severity": severity,
    });
    if let Some(p) = f.processes.first() {
        labels["comm"] = json!(p.comm);
        if let Some(unit) = &p.unit {
            labels["unit"] = json!(unit);
        }
    }
    if let Some(p) = f.service_port {
        labels["service_port"] = json!(p.to_string());
    }
    if let Some(q) = &f.quota {
        labels["quota"] = json!(q.name);
    }
    labels["netns"] = json!(f.netns_label());
    if let Some(c) = &f.container {
        labels["container"] = json!(c.short_id());
        if let Some(pod) = &c.pod_name {
            labels["pod"] = json!(pod);
        }
        if let Some(ns) = &c.pod_namespace {
            labels["pod_namespace"] = json!(ns);
        }
    }
    let resend = am.resend;
    // A firing alert is re-posted every `resend` and valid for four of those, as Prometheus
    // does: a restarted Alertmanager has it back within one resend, a dead agent's alert
    // expires; resolved alerts end when they ended.
    let ends_at = match (alert.status, alert.ended_at) {
        (Status::Resolved, Some(end)) => rfc3339(end),
        _ => {
            let now = chrono::Utc::now();
            let valid = chrono::Duration::from_std(resend.saturating_mul(4))
                .unwrap_or(chrono::Duration::minutes(4));
            // Checked: a huge interval must not overflow the calendar (config validation
            // bounds it; this holds whatever it is given).
            rfc3339(now.checked_add_signed(valid).unwrap_or(now))
        }
    };
    let mut annotations = json!({
        "summary": f.summary,
        "count": f.count.to_string(),
        "oldest_age_secs": f.oldest_age_secs.to_string(),
        "processes": serde_json::to_string(&f.processes).unwrap_or_default(),
        "pids": f.processes.iter().filter_map(|p| p.pid).map(|p| p.to_string()).collect::<Vec<_>>().join(","),
        "verdict": f.verdict().map_or("", |v| v.as_str()),
        "change": alert.change.as_deref().unwrap_or(""),
        "netns": f.netns.to_string(),
        "netns_name": f.netns_name.as_deref().unwrap_or(""),
    });
    if let Some(c) = &f.container {
        annotations["container"] = json!(c.id);
        annotations["container_runtime"] = json!(c.runtime.as_str());
        annotations["container_name"] = json!(c.name.as_deref().unwrap_or(""));
        annotations["container_image"] = json!(c.image.as_deref().unwrap_or(""));
        annotations["pod_uid"] = json!(c.pod_uid.as_deref().unwrap_or(""));
        annotations["pod_name"] = json!(c.pod_name.as_deref().unwrap_or(""));
        annotations["pod_namespace"] = json!(c.pod_namespace.as_deref().unwrap_or(""));
    }
    json!([{
        "labels": labels,
        "annotations": annotations,
        "startsAt": rfc3339(alert.started_at),
        "endsAt": ends_at,
        "generatorURL": format!("{}/v1/findings?fingerprint={}", am.api_base, urlencode(&f.fingerprint)),
    }])
}

/// Percent-encoding for a query value (fingerprints hold `:`, `@`, `>`, `/`).
fn urlencode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                out.push(b as char)
            }
            _ => out.push_str(&format!("%{b:02X}")),
        }
    }
    out
}

/// A reclaim round as an Alertmanager alert that starts and ends at once. Labels: the
/// policy, and where it closed sockets: `netns` (the namespaces' labels, comma-separated, as
/// a finding's `netns` label names one) and `container` (short id) when all were in one
/// container; annotations: the count, the namespaces' inodes and names, the container ids and
/// the destroy mechanism.
fn reclaimed_alertmanager(r: &Reclaimed) -> Value {
    let at = rfc3339(r.time);
    let joined = |f: &dyn Fn(&crate::alert::notify::ReclaimedNamespace) -> String| {
        r.namespaces.iter().map(f).collect::<Vec<_>>().join(",")
    };
    let mut containers: Vec<&str> = r
        .namespaces
        .iter()
        .flat_map(|n| n.containers.iter().map(String::as_str))
        .collect();
    containers.sort_unstable();
    containers.dedup();
    let mut labels = json!({
        "alertname": r.kind,
        "host": r.host,
        "policy": r.policy,
        "service": "connreap",
        "netns": joined(&|n| n.label.clone()),
    });
    if let [c] = containers.as_slice() {
        labels["container"] = json!(c.get(..12).unwrap_or(c));
    }
    json!([{
        "labels": labels,
        "annotations": {
            "summary": r.summary,
            "count": r.count.to_string(),
            "netns": joined(&|n| n.netns.to_string()),
            "netns_name": joined(&|n| n.netns_name.clone().unwrap_or_default()),
            "containers": containers.join(","),
            "mechanism": r.mechanism.unwrap_or(""),
        },
        "startsAt": at,
        "endsAt": at,
    }])
}

/// A rendered notification waiting for its receiver.
#[derive(Clone, PartialEq)]
struct Item {
    body: Value,
    /// What log lines name it by (fingerprint or policy).
    key: String,
}

struct Queue {
    items: Mutex<VecDeque<Item>>,
    notify: Notify,
    capacity: usize,
    /// The receiver's name in logs and metrics ([`receiver::name`]).
    receiver: String,
    /// Notifications dropped on overflow, logged as a count per interval.
    drops: Mutex<Repeats>,
}

/// At most one "queue full" line per receiver per this long (each drop is counted in
/// `connreap_webhook_dropped_total` at once).
const DROP_LOG_EVERY: Duration = Duration::from_secs(10);

impl Queue {
    /// The queue. A panic while it was held (poisoning) leaves a deque that is still whole
    /// (every change to it is one call), so every user takes it as it is: delivery goes on.
    fn items(&self) -> MutexGuard<'_, VecDeque<Item>> {
        self.items.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Log the drops counted and not yet logged, if one interval has passed since the last line.
    fn log_drops(&self, now: Instant, last: Option<&str>) {
        let due = self
            .drops
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .due(now);
        if let Some(n) = due {
            tracing::error!(receiver = %self.receiver, capacity = self.capacity, dropped = n,
                last_dropped = last.unwrap_or(""),
                "webhook queue full: dropped the oldest notifications (each counted in connreap_webhook_dropped_total)");
        }
    }
}

/// Handle to every receiver's queue.
#[derive(Clone, Default)]
pub struct Webhooks {
    receivers: Vec<(WebhookConfig, Arc<Queue>)>,
    am: AmContext,
    metrics: Option<Arc<Metrics>>,
}

impl Webhooks {
    /// Start one sender task per receiver.
    pub fn spawn(
        cfgs: &[WebhookConfig],
        alerts: &AlertsConfig,
        metrics: Arc<Metrics>,
        tasks: &Supervisor,
        api_base: &str,
    ) -> anyhow::Result<Self> {
        // Never follow a redirect: a receiver answering 3xx would otherwise have the whole alert
        // (pids, sockets, namespaces) re-posted wherever its Location points. A 3xx is a failed
        // delivery naming the status and the Location, retried like any failure.
        // Each receiver's timeout is set on its requests (see `deliver`).
        let client = reqwest::Client::builder()
            .user_agent(concat!("connreap/", env!("CARGO_PKG_VERSION")))
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .map_err(|e| anyhow::anyhow!("cannot build the webhook HTTP client: {e}"))?;
        let mut receivers = Vec::new();
        for cfg in cfgs {
            let delivery = cfg.delivery(alerts);
            let q = Arc::new(Queue {
                items: Mutex::new(VecDeque::new()),
                notify: Notify::new(),
                capacity: delivery.queue_capacity,
                receiver: receiver::name(&cfg.url),
                drops: Mutex::new(Repeats::new(DROP_LOG_EVERY)),
            });
            metrics.webhook_receiver(&q.receiver);
            let sender = deliver(
                client.clone(),
                cfg.url.clone(),
                q.clone(),
                delivery,
                metrics.clone(),
            );
            tasks.spawn(format!("webhook sender {}", q.receiver), sender);
            receivers.push((cfg.clone(), q));
        }
        Ok(Webhooks {
            receivers,
            am: AmContext {
                resend: alerts.alertmanager_resend,
                severity: alerts.severity.clone(),
                api_base: api_base.to_string(),
            },
            metrics: Some(metrics),
        })
    }

    /// Queue `n` for every receiver.
    pub fn send(&self, n: &Notification) {
        for (cfg, q) in &self.receivers {
            let Some(body) = body(n, cfg.format, &self.am) else {
                continue;
            };
            let item = Item {
                body,
                key: n.key().to_string(),
            };
            self.enqueue(q, item);
        }
    }

    fn enqueue(&self, q: &Queue, item: Item) {
        let dropped = {
            let mut items = q.items();
            items.push_back(item);
            if items.len() > q.capacity {
                items.pop_front()
            } else {
                None
            }
        };
        if let Some(d) = dropped {
            q.drops
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .record();
            q.log_drops(Instant::now(), Some(&d.key));
            if let Some(m) = &self.metrics {
                m.webhook_dropped(&q.receiver);
            }
        }
        q.notify.notify_one();
    }

    /// Wait until every queue is empty, at most `limit`; whether they all emptied.
    pub async fn drain(&self, limit: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + limit;
        while self.queued() > 0 {
            if tokio::time::Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        true
    }

    pub fn queued(&self) -> usize {
        self.receivers.iter().map(|(_, q)| q.items().len()).sum()
    }

    /// Log the queue overflows not yet logged whose interval has passed (called every scan, so
    /// the count of a burst is written even when no more drops follow).
    pub fn log_drops(&self) {
        let now = Instant::now();
        for (_, q) in &self.receivers {
            q.log_drops(now, None);
        }
    }
}

/// The first wait before retrying a receiver that is down, and the shortest.
const MIN_BACKOFF: Duration = Duration::from_secs(1);

/// The wait after `backoff`: doubled, at most `max_backoff`, never under [`MIN_BACKOFF`]
/// (config validation refuses a smaller `max_backoff`; this holds whatever it is given).
fn next_backoff(backoff: Duration, max_backoff: Duration) -> Duration {
    backoff.saturating_mul(2).min(max_backoff).max(MIN_BACKOFF)
}

async fn deliver(
    client: reqwest::Client,
    url: String,
    q: Arc<Queue>,
    delivery: Delivery,
    metrics: Arc<Metrics>,
) {
    let Delivery {
        timeout,
        max_backoff,
        ..
    } = delivery;
    let mut backoff = MIN_BACKOFF;
    loop {
        let next = q.items().front().cloned();
        let Some(item) = next else {
            q.notify.notified().await;
            continue;
        };
        let result = client
            .post(&url)
            .timeout(timeout)
            .json(&item.body)
            .send()
            .await;
        match result {
            Ok(resp) if resp.status().is_success() => {
                metrics.webhook_sent(&q.receiver, true);
                {
                    let mut items = q.items();
                    // Pop only if the head is still ours (it may have been dropped meanwhile).
                    if items.front() == Some(&item) {
                        items.pop_front();
                    }
                }
                backoff = MIN_BACKOFF;
            }
            other => {
                metrics.webhook_sent(&q.receiver, false);
                let why = match other {
                    Ok(resp) => receiver::Failure::status(
                        resp.status(),
                        resp.headers()
                            .get(reqwest::header::LOCATION)
                            .map(|l| String::from_utf8_lossy(l.as_bytes()).into_owned()),
                    ),
                    Err(e) => receiver::Failure::error(&e, timeout),
                };
                tracing::warn!(receiver = %q.receiver, cause = %why.cause, error = why.detail.as_deref(),
                    retry_in = %humantime::format_duration(backoff), "webhook delivery failed; will retry");
                tokio::time::sleep(backoff).await;
                backoff = next_backoff(backoff, max_backoff);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::detect::Kind;

    #[test]
    fn backoff_doubles_to_the_maximum_and_never_under_a_second() {
        let s = Duration::from_secs;
        assert_eq!(next_backoff(s(1), s(60)), s(2));
        assert_eq!(next_backoff(s(32), s(60)), s(60));
        assert_eq!(next_backoff(s(60), s(60)), s(60));
        // A zero or tiny maximum must not turn retries into a hot loop.
        assert_eq!(next_backoff(s(1), Duration::ZERO), s(1));
        assert_eq!(next_backoff(s(1), Duration::from_millis(1)), s(1));
        assert_eq!(next_backoff(Duration::MAX, Duration::MAX), Duration::MAX);
    }

    #[test]
    fn alertmanager_body_has_labels_and_times() {
        let mut f = crate::detect::testutil_finding(Kind::QuotaExhaustedByLeak, "relay:21000");
        f.service_port = Some(21000);
        f.set_verdict(crate::detect::Verdict::Leak);
        let a = Alert {
            finding: f,
            status: Status::Resolved,
            host: "relay-1".into(),
            started_at: "2026-12-02T10:00:00Z".parse().unwrap(),
            ended_at: Some("2026-12-02T10:05:00Z".parse().unwrap()),
            duration_secs: Some(300.0),
            change: None,
        };
        let a = Notification::Resolved(a);
        let am = AmContext {
            resend: Duration::from_secs(60),
            api_base: "http://relay-1:9477".into(),
            ..Default::default()
        };
        let b = body(&a, WebhookFormat::Alertmanager, &am).unwrap();
        let first = &b[0];
        assert_eq!(first["labels"]["alertname"], "quota_exhausted_by_leak");
        assert_eq!(first["labels"]["service_port"], "21000");
        assert_eq!(first["annotations"]["verdict"], "leak");
        assert_eq!(first["startsAt"], "2026-12-02T10:00:00Z");
        assert_eq!(first["endsAt"], "2026-12-02T10:05:00Z");
        assert_eq!(first["labels"]["severity"], "critical");
        assert!(first["labels"].get("pid").is_none(), "the pid is no label");
        assert_eq!(
            first["generatorURL"],
            "http://relay-1:9477/v1/findings?fingerprint=quota_exhausted_by_leak%3Arelay%3A21000"
        );
        let j = body(&a, WebhookFormat::Json, &am).unwrap();
        assert_eq!(j["status"], "resolved");
        assert_eq!(j["host"], "relay-1");
        // connreap's own namespace: labelled "host", no container labels.
        assert_eq!(first["labels"]["netns"], "host");
        for key in ["container", "pod", "pod_namespace"] {
            assert!(first["labels"].get(key).is_none(), "{key}: {first}");
        }
    }

    /// A finding in a pod: namespace, short container id, pod and its namespace as labels;
    /// the full attribution in annotations and in the JSON body.
    #[test]
    fn alerts_carry_namespace_and_container() {
        use crate::{
            containers::Runtime,
            detect::scope_testutil::{container, netns},
        };
        let c = container("abcdef", Runtime::Containerd, Some(("shop", "web-1")));
        let f = crate::detect::testutil_finding(Kind::CloseWaitBuildup, "java:8080")
            .scoped(&netns(4026532001, Some("cni-1")), Some(&c));
        let a = Notification::Fired(Alert {
            finding: f,
            status: Status::Firing,
            host: "node-1".into(),
            started_at: "2026-12-02T10:00:00Z".parse().unwrap(),
            ended_at: None,
            duration_secs: None,
            change: None,
        });
        let am = AmContext::default();
        let b = body(&a, WebhookFormat::Alertmanager, &am).unwrap();
        let (labels, ann) = (&b[0]["labels"], &b[0]["annotations"]);
        assert_eq!(labels["netns"], "cni-1");
        assert_eq!(labels["container"], "abcdef000000");
        assert_eq!(labels["pod"], "web-1");
        assert_eq!(labels["pod_namespace"], "shop");
        assert_eq!(
            labels["fingerprint"],
            "close_wait_buildup:java:8080@netns:cni-1"
        );
        assert_eq!(ann["netns"], "4026532001");
        assert_eq!(ann["netns_name"], "cni-1");
        assert_eq!(ann["container"], c.id.as_str());
        assert_eq!(ann["container_runtime"], "containerd");
        assert_eq!(ann["container_name"], c.name.as_deref().unwrap_or(""));
        assert_eq!(ann["container_image"], c.image.as_deref().unwrap_or(""));
        assert_eq!(ann["pod_uid"], c.pod_uid.as_deref().unwrap());
        let j = body(&a, WebhookFormat::Json, &am).unwrap();
        assert_eq!(j["netns"], 4026532001u32);
        assert_eq!(j["netns_name"], "cni-1");
        assert_eq!(j["container"], c.id.as_str());
        assert_eq!(j["container_runtime"], "containerd");
        assert_eq!(j["pod_name"], "web-1");
        assert_eq!(j["pod_namespace"], "shop");
        assert_eq!(j["pod_uid"], c.pod_uid.as_deref().unwrap());
        // A container without a known pod: no pod labels.
        let bare = container("0a0a", Runtime::Docker, None);
        let f = crate::detect::testutil_finding(Kind::CloseWaitBuildup, "java:8080")
            .scoped(&crate::table::Netns::unknown(), Some(&bare));
        let n = Notification::Fired(Alert {
            finding: f,
            status: Status::Firing,
            host: "node-1".into(),
            started_at: "2026-12-02T10:00:00Z".parse().unwrap(),
            ended_at: None,
            duration_secs: None,
            change: None,
        });
        let b = body(&n, WebhookFormat::Alertmanager, &am).unwrap();
        let labels = &b[0]["labels"];
        assert_eq!(
            (labels["netns"].as_str(), labels["container"].as_str()),
            (Some("host"), Some("0a0a00000000"))
        );
        assert!(
            labels.get("pod").is_none() && labels.get("pod_namespace").is_none(),
            "{labels}"
        );
    }

    /// A reclaim round in a pod's namespace: its namespace and container as labels, their
    /// full attribution and the destroy mechanism as annotations; JSON bodies keep the fields
    /// they always had.
    #[test]
    fn reclaimed_alert_names_where_it_closed_sockets() {
        use crate::alert::notify::{Reclaimed, ReclaimedNamespace};
        let id = format!("abcdef{}", "0".repeat(58));
        let ns = |netns: u32, name: Option<&str>, containers: Vec<String>| ReclaimedNamespace {
            netns,
            netns_name: name.map(String::from),
            label: name.map_or(netns.to_string(), String::from),
            count: 2,
            containers,
        };
        let mut r = Reclaimed {
            kind: "reclaimed",
            status: "firing",
            host: "node-1".into(),
            policy: "leaks".into(),
            mode: crate::reclaim::Mode::Enforce,
            count: 2,
            summary: "policy leaks closed 2 sockets; in netns cni-a, container abcdef000000".into(),
            processes: Vec::new(),
            namespaces: vec![ns(4026532001, Some("cni-a"), vec![id.clone()])],
            mechanism: Some("bpf-sock-destroy"),
            quota: None,
            sockets: Vec::new(),
            time: "2026-12-05T10:00:00Z".parse().unwrap(),
        };
        let am = AmContext::default();
        let n = Notification::Reclaimed(r.clone());
        let b = body(&n, WebhookFormat::Alertmanager, &am).unwrap();
        let (labels, ann) = (&b[0]["labels"], &b[0]["annotations"]);
        assert_eq!(labels["alertname"], "reclaimed");
        assert_eq!(labels["policy"], "leaks");
        assert_eq!(labels["netns"], "cni-a");
        assert_eq!(labels["container"], "abcdef000000");
        assert_eq!(ann["netns"], "4026532001");
        assert_eq!(ann["netns_name"], "cni-a");
        assert_eq!(ann["containers"], id.as_str());
        assert_eq!(ann["mechanism"], "bpf-sock-destroy");
        assert_eq!(ann["count"], "2");
        assert_eq!(b[0]["startsAt"], b[0]["endsAt"]);
        let j = body(&n, WebhookFormat::Json, &am).unwrap();
        for key in [
            "kind", "status", "host", "policy", "mode", "count", "summary",
        ] {
            assert!(j.get(key).is_some(), "{key}: {j}");
        }
        assert_eq!(j["namespaces"][0]["label"], "cni-a");
        // Two namespaces, no container: both in the label, no container label.
        r.namespaces = vec![
            ns(4026532001, Some("cni-a"), Vec::new()),
            ns(4026532002, None, Vec::new()),
        ];
        let b = body(
            &Notification::Reclaimed(r),
            WebhookFormat::Alertmanager,
            &am,
        )
        .unwrap();
        assert_eq!(b[0]["labels"]["netns"], "cni-a,4026532002");
        assert!(b[0]["labels"].get("container").is_none(), "{b}");
        assert_eq!(b[0]["annotations"]["netns"], "4026532001,4026532002");
    }
}
