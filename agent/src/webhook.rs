//! Webhook delivery: one bounded queue and one sender task per receiver, in order, retried with
//! exponential backoff while the receiver is down. When a queue is full the oldest
//! notification is dropped, counted and logged: nothing is lost silently.
use std::{
    collections::VecDeque,
    sync::{Arc, Mutex},
    time::Duration,
};

use serde_json::{json, Value};
use tokio::sync::Notify;

use crate::{
    alert::{Alert, Status},
    config::{AlertsConfig, WebhookConfig, WebhookFormat},
    metrics::Metrics,
};

/// Body for one alert in the given format.
pub fn body(alert: &Alert, format: WebhookFormat, repeat: Duration) -> Value {
    match format {
        WebhookFormat::Json => serde_json::to_value(alert).unwrap_or(Value::Null),
        WebhookFormat::Alertmanager => {
            let f = &alert.finding;
            let mut labels = json!({
                "alertname": f.kind.as_str(),
                "fingerprint": f.fingerprint,
                "host": alert.host,
                "service": "connreap",
            });
            if let Some(p) = f.service_port {
                labels["service_port"] = json!(p.to_string());
            }
            if let Some(q) = &f.quota {
                labels["quota"] = json!(q.name);
            }
            if let Some(v) = &f.verdict {
                labels["verdict"] = json!(v);
            }
            // A firing alert is valid for two repeat intervals unless re-sent, so a dead agent's
            // alerts expire instead of firing forever; resolved alerts end now.
            let ends_at = match (&alert.status, &alert.ended_at) {
                (Status::Resolved, Some(end)) => end.clone(),
                _ => crate::present::rfc3339(
                    chrono::Utc::now()
                        + chrono::Duration::from_std(repeat * 2)
                            .unwrap_or(chrono::Duration::hours(2)),
                ),
            };
            json!([{
                "labels": labels,
                "annotations": {
                    "summary": f.summary,
                    "count": f.count.to_string(),
                    "oldest_age_secs": f.oldest_age_secs.to_string(),
                    "processes": serde_json::to_string(&f.processes).unwrap_or_default(),
                },
                "startsAt": alert.started_at,
                "endsAt": ends_at,
            }])
        }
    }
}

struct Queue {
    items: Mutex<VecDeque<Value>>,
    notify: Notify,
    capacity: usize,
}

/// Handle to every receiver's queue.
#[derive(Clone, Default)]
pub struct Webhooks {
    receivers: Vec<(WebhookConfig, Arc<Queue>)>,
    repeat: Duration,
    metrics: Option<Arc<Metrics>>,
}

impl Webhooks {
    /// Start one sender task per receiver.
    pub fn spawn(cfgs: &[WebhookConfig], alerts: &AlertsConfig, metrics: Arc<Metrics>) -> Self {
        let client = reqwest::Client::builder()
            .timeout(alerts.timeout)
            .user_agent(concat!("connreap/", env!("CARGO_PKG_VERSION")))
            .build()
            .unwrap_or_default();
        let mut receivers = Vec::new();
        for cfg in cfgs {
            let q = Arc::new(Queue {
                items: Mutex::new(VecDeque::new()),
                notify: Notify::new(),
                capacity: alerts.queue_capacity,
            });
            tokio::spawn(deliver(
                client.clone(),
                cfg.url.clone(),
                q.clone(),
                alerts.max_backoff,
                metrics.clone(),
            ));
            receivers.push((cfg.clone(), q));
        }
        Webhooks {
            receivers,
            repeat: alerts.repeat_interval,
            metrics: Some(metrics),
        }
    }

    pub fn send(&self, alert: &Alert) {
        self.enqueue(|format| body(alert, format, self.repeat));
    }

    /// A one-off event (e.g. `reclaimed`): sent as is to JSON receivers, as an alert that
    /// starts and ends now to Alertmanager.
    pub fn send_event(&self, event: &Value) {
        self.enqueue(|format| match format {
            WebhookFormat::Json => event.clone(),
            WebhookFormat::Alertmanager => {
                let now = crate::present::rfc3339(chrono::Utc::now());
                json!([{
                    "labels": {
                        "alertname": event.get("kind").cloned().unwrap_or(json!("event")),
                        "host": event.get("host").cloned().unwrap_or_default(),
                        "policy": event.get("policy").cloned().unwrap_or_default(),
                        "service": "connreap",
                    },
                    "annotations": { "summary": event.get("summary").cloned().unwrap_or_default() },
                    "startsAt": now,
                    "endsAt": now,
                }])
            }
        });
    }

    fn enqueue(&self, make: impl Fn(WebhookFormat) -> Value) {
        for (cfg, q) in &self.receivers {
            let value = make(cfg.format);
            let dropped = {
                let mut items = q.items.lock().unwrap_or_else(|e| e.into_inner());
                items.push_back(value);
                if items.len() > q.capacity {
                    items.pop_front()
                } else {
                    None
                }
            };
            if let Some(d) = dropped {
                let fingerprint = d.get("fingerprint").cloned().unwrap_or_default();
                tracing::error!(url = %cfg.url, capacity = q.capacity, dropped = %fingerprint,
                    "webhook queue full: dropped the oldest notification");
                if let Some(m) = &self.metrics {
                    m.webhook_dropped.inc();
                }
            }
            q.notify.notify_one();
        }
    }

    pub fn queued(&self) -> usize {
        self.receivers
            .iter()
            .map(|(_, q)| q.items.lock().map(|i| i.len()).unwrap_or(0))
            .sum()
    }
}

async fn deliver(
    client: reqwest::Client,
    url: String,
    q: Arc<Queue>,
    max_backoff: Duration,
    metrics: Arc<Metrics>,
) {
    let mut backoff = Duration::from_secs(1);
    loop {
        let next = q.items.lock().ok().and_then(|i| i.front().cloned());
        let Some(item) = next else {
            q.notify.notified().await;
            continue;
        };
        let result = client.post(&url).json(&item).send().await;
        match result {
            Ok(resp) if resp.status().is_success() => {
                metrics.webhook_sent(true);
                if let Ok(mut items) = q.items.lock() {
                    // Pop only if the head is still ours (it may have been dropped meanwhile).
                    if items.front() == Some(&item) {
                        items.pop_front();
                    }
                }
                backoff = Duration::from_secs(1);
            }
            other => {
                metrics.webhook_sent(false);
                let why = match other {
                    Ok(resp) => format!("HTTP {}", resp.status()),
                    Err(e) => e.to_string(),
                };
                tracing::warn!(%url, error = %why, retry_in = ?backoff, "webhook delivery failed; will retry");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(max_backoff);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{alert::Alert, detect::Kind};

    #[test]
    fn alertmanager_body_has_labels_and_times() {
        let mut f = crate::detect::testutil_finding(Kind::QuotaExhaustedByLeak, "relay:21000");
        f.service_port = Some(21000);
        f.verdict = Some("leak".into());
        let a = Alert {
            finding: f,
            status: Status::Resolved,
            host: "relay-1".into(),
            started_at: "2026-12-02T10:00:00Z".into(),
            ended_at: Some("2026-12-02T10:05:00Z".into()),
        };
        let b = body(&a, WebhookFormat::Alertmanager, Duration::from_secs(3600));
        let first = &b[0];
        assert_eq!(first["labels"]["alertname"], "quota_exhausted_by_leak");
        assert_eq!(first["labels"]["service_port"], "21000");
        assert_eq!(first["labels"]["verdict"], "leak");
        assert_eq!(first["startsAt"], "2026-12-02T10:00:00Z");
        assert_eq!(first["endsAt"], "2026-12-02T10:05:00Z");
        let j = body(&a, WebhookFormat::Json, Duration::from_secs(3600));
        assert_eq!(j["status"], "resolved");
        assert_eq!(j["host"], "relay-1");
    }
}
