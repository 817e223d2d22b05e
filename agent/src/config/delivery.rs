//! How notifications reach one webhook: its `[[webhook]]` entry's `timeout`, `queue_capacity`
//! and `max_backoff`. Those keys lived under `[alerts]`, for every webhook at once; that
//! location is still accepted (with a warning naming the new key) and applies to every
//! webhook that does not set its own. Setting a key in both places is refused: which one was
//! meant is not for connreap to guess.
use std::time::Duration;

use super::{keys::KeyPath, validate::Invalid, AlertsConfig, Config, WebhookConfig};

/// Delivery settings of one receiver, defaults applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Delivery {
    /// Per-request timeout.
    pub timeout: Duration,
    /// Notifications kept while the receiver is down.
    pub queue_capacity: usize,
    /// Longest wait between retries.
    pub max_backoff: Duration,
}

impl Default for Delivery {
    fn default() -> Self {
        Delivery {
            timeout: Duration::from_secs(5),
            queue_capacity: 1024,
            max_backoff: Duration::from_secs(60),
        }
    }
}

impl WebhookConfig {
    /// This webhook's delivery settings: its own, else those still given under `[alerts]`,
    /// else the defaults.
    pub fn delivery(&self, alerts: &AlertsConfig) -> Delivery {
        let d = Delivery::default();
        Delivery {
            timeout: self.timeout.or(alerts.timeout).unwrap_or(d.timeout),
            queue_capacity: self
                .queue_capacity
                .or(alerts.queue_capacity)
                .unwrap_or(d.queue_capacity),
            max_backoff: self
                .max_backoff
                .or(alerts.max_backoff)
                .unwrap_or(d.max_backoff),
        }
    }
}

/// The delivery keys set under `[alerts]` (the old location).
fn moved(alerts: &AlertsConfig) -> impl Iterator<Item = &'static str> + '_ {
    [
        ("timeout", alerts.timeout.is_some()),
        ("queue_capacity", alerts.queue_capacity.is_some()),
        ("max_backoff", alerts.max_backoff.is_some()),
    ]
    .into_iter()
    .filter_map(|(k, set)| set.then_some(k))
}

fn set_on(w: &WebhookConfig, key: &str) -> bool {
    match key {
        "timeout" => w.timeout.is_some(),
        "queue_capacity" => w.queue_capacity.is_some(),
        _ => w.max_backoff.is_some(),
    }
}

/// A delivery key given both under `[alerts]` and on a webhook is refused.
pub(super) fn validate(cfg: &Config) -> Result<(), Invalid> {
    for key in moved(&cfg.alerts) {
        if let Some(i) = cfg.webhook.iter().position(|w| set_on(w, key)) {
            return Err((
                KeyPath::default().key("alerts").key(key),
                format!(
                    "set both here and as webhook[{i}].{key}: alerts.{key} is deprecated \
                     (it applies to every webhook); keep webhook.{key} on each [[webhook]] \
                     and remove alerts.{key}"
                ),
            ));
        }
    }
    Ok(())
}

/// One warning per delivery key still under `[alerts]`.
pub(super) fn warnings(cfg: &Config) -> Vec<String> {
    moved(&cfg.alerts)
        .map(|key| {
            format!(
                "alerts.{key} is deprecated and will be removed: set {key} on each [[webhook]] \
                 (webhook.{key}); until then it applies to every webhook"
            )
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::config::{parse, warnings};

    fn refused(text: &str) -> String {
        parse(text, "c.toml").unwrap_err().to_string()
    }

    #[test]
    fn delivery_defaults_are_the_documented_ones() {
        let d = Delivery::default();
        let doc = |name: &str| {
            WebhookConfig::keys()
                .into_iter()
                .find(|k| k.name == name)
                .and_then(|k| k.default_is)
                .unwrap()
        };
        assert_eq!(
            humantime::format_duration(d.timeout).to_string(),
            doc("timeout")
        );
        assert_eq!(
            humantime::format_duration(d.max_backoff).to_string(),
            doc("max_backoff")
        );
        assert_eq!(d.queue_capacity.to_string(), doc("queue_capacity"));
        assert_eq!(super::super::DEFAULT_MAX_BODY.to_string(), "1MiB");
    }

    #[test]
    fn webhook_delivery_settings_live_on_the_webhook() {
        let c = parse(
            "[[webhook]]\nurl = \"http://a/\"\ntimeout = \"2s\"\nqueue_capacity = 3\nmax_backoff = \"4s\"\n\
             [[webhook]]\nurl = \"http://b/\"\n",
            "c.toml",
        )
        .unwrap();
        let d = c.webhook[0].delivery(&c.alerts);
        assert_eq!(
            (d.timeout, d.queue_capacity, d.max_backoff),
            (Duration::from_secs(2), 3, Duration::from_secs(4))
        );
        assert_eq!(c.webhook[1].delivery(&c.alerts), Delivery::default());
        assert!(warnings(&c).is_empty());
        let e = refused("[[webhook]]\nurl = \"http://a/\"\nmax_backoff = \"0s\"\n");
        assert!(
            e.starts_with("c.toml:3: `webhook[0].max_backoff`: must be from 1s to 1day (got 0s)"),
            "{e}"
        );
    }

    /// `[alerts]` timeout, queue_capacity and max_backoff still work, for every webhook, with a
    /// warning naming the new key; set in both places they are refused.
    #[test]
    fn delivery_settings_under_alerts_are_deprecated_not_refused() {
        let c = parse(
            "[alerts]\ntimeout = \"2s\"\nmax_backoff = \"3s\"\n[[webhook]]\nurl = \"http://a/\"\n\
             queue_capacity = 7\n",
            "c.toml",
        )
        .unwrap();
        let d = c.webhook[0].delivery(&c.alerts);
        assert_eq!(
            (d.timeout, d.queue_capacity, d.max_backoff),
            (Duration::from_secs(2), 7, Duration::from_secs(3))
        );
        let w = warnings(&c);
        assert_eq!(w.len(), 2, "{w:?}");
        assert!(
            w[0].starts_with("alerts.timeout is deprecated") && w[0].contains("webhook.timeout"),
            "{w:?}"
        );
        assert!(w[1].contains("webhook.max_backoff"), "{w:?}");
        let e = refused(
            "[alerts]\nqueue_capacity = 5\n[[webhook]]\nurl = \"http://a/\"\n[[webhook]]\n\
             url = \"http://b/\"\nqueue_capacity = 6\n",
        );
        assert!(
            e.starts_with(
                "c.toml:2: `alerts.queue_capacity`: set both here and as webhook[1].queue_capacity"
            ),
            "{e}"
        );
    }
}
