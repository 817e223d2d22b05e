//! Outbound connection outcomes per process and remote port: the per-upstream connection
//! errors an SRE graphs next to request errors. Label sets stay bounded: the remote port (a
//! service's, never an ephemeral local port), no remote address unless
//! `detect.failing_metrics_by_address` asks for it, and at most [`MAX_TARGETS`] distinct
//! (command, port, namespace, address) groups; later ones are counted under
//! `remote_port="other"`.
use std::fmt;

use prometheus_client::encoding::{EncodeLabel, EncodeLabelSet, LabelSetEncoder};

use super::Metrics;
use crate::{
    kernel::{
        outcome::{Attempts, Outcome},
        ring::AttemptKey,
    },
    table::Netns,
};

/// Distinct groups of labels (all results of one group count once) kept before new ones are
/// folded into `remote_port="other"`.
pub const MAX_TARGETS: usize = 2000;

/// `connreap_upstream_connections_total`'s labels.
#[derive(Clone, Debug, Hash, PartialEq, Eq)]
pub struct UpstreamLabels {
    pub comm: String,
    pub remote_port: String,
    pub netns: String,
    pub container: Option<String>,
    pub remote_addr: Option<String>,
    pub result: &'static str,
}

impl EncodeLabelSet for UpstreamLabels {
    fn encode(&self, mut e: LabelSetEncoder) -> Result<(), fmt::Error> {
        ("comm", self.comm.as_str()).encode(e.encode_label())?;
        ("remote_port", self.remote_port.as_str()).encode(e.encode_label())?;
        if let Some(a) = &self.remote_addr {
            ("remote_addr", a.as_str()).encode(e.encode_label())?;
        }
        ("netns", self.netns.as_str()).encode(e.encode_label())?;
        if let Some(c) = &self.container {
            ("container", c.as_str()).encode(e.encode_label())?;
        }
        ("result", self.result).encode(e.encode_label())?;
        Ok(())
    }
}

impl Metrics {
    /// Attempts of one target whose outcome became known; `netns` its namespace as the scan
    /// names it (None: not among the scan's).
    pub fn observe_attempts(
        &self,
        k: &AttemptKey,
        a: &Attempts,
        netns: Option<&Netns>,
        by_address: bool,
    ) {
        let netns = match (netns, k.netns) {
            (Some(n), _) => n.label(),
            (None, 0) => "unknown".to_string(),
            (None, inode) => inode.to_string(),
        };
        let mut group = UpstreamLabels {
            comm: k.comm.clone(),
            remote_port: k.remote.port().to_string(),
            netns,
            container: k.container.as_ref().map(|c| c.short_id().to_string()),
            remote_addr: by_address.then(|| k.remote.ip().to_string()),
            result: "",
        };
        {
            let mut seen = self
                .upstream_groups
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            if !seen.contains(&group) {
                if seen.len() >= MAX_TARGETS {
                    group.remote_port = "other".to_string();
                    group.remote_addr = group.remote_addr.as_ref().map(|_| "other".to_string());
                } else {
                    seen.insert(group.clone());
                }
            }
        }
        for o in Outcome::ALL {
            let labels = UpstreamLabels {
                result: o.as_str(),
                ..group.clone()
            };
            // Every result of a group exists from its first attempt, so rates over the
            // failure series are defined before the first failure.
            self.upstream_connections
                .get_or_create(&labels)
                .inc_by(a.get(o));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::Format;

    #[test]
    fn attempts_are_counted_by_process_port_and_result() {
        let m = Metrics::new();
        let mut a = Attempts::default();
        a.add(Outcome::Reset, 7);
        a.add(Outcome::Success, 2);
        let key = |addr: &str| AttemptKey {
            pid: 9,
            comm: "node".into(),
            netns: 0,
            remote: addr.parse().unwrap(),
            container: None,
        };
        let ns = Netns {
            own: true,
            ..Netns::default()
        };
        m.observe_attempts(&key("10.0.0.3:8080"), &a, Some(&ns), false);
        m.observe_attempts(&key("10.0.0.1:8080"), &a, Some(&ns), false);
        let text = m.render(Format::Prometheus);
        let l = r#"comm="node",remote_port="8080",netns="host""#;
        for want in [
            format!("connreap_upstream_connections_total{{{l},result=\"reset\"}} 14\n"),
            format!("connreap_upstream_connections_total{{{l},result=\"success\"}} 4\n"),
            format!("connreap_upstream_connections_total{{{l},result=\"refused\"}} 0\n"),
        ] {
            assert!(text.contains(&want), "{want:?} in\n{text}");
        }
        assert!(
            !text.contains("10.0.0.3"),
            "no address unless asked: {text}"
        );
        m.observe_attempts(&key("10.0.0.3:8080"), &a, Some(&ns), true);
        let text = m.render(Format::Prometheus);
        assert!(
            text.contains(r#"connreap_upstream_connections_total{comm="node",remote_port="8080",remote_addr="10.0.0.3",netns="host",result="reset"} 7"#),
            "{text}"
        );
    }

    #[test]
    fn label_sets_are_bounded() {
        let m = Metrics::new();
        let mut a = Attempts::default();
        a.add(Outcome::Refused, 1);
        for port in 0..(MAX_TARGETS as u32 + 50) {
            let k = AttemptKey {
                pid: 1,
                comm: "scanner".into(),
                netns: 0,
                remote: std::net::SocketAddr::from(([10, 0, 0, 1], 1000 + port as u16)),
                container: None,
            };
            m.observe_attempts(&k, &a, None, false);
        }
        let text = m.render(Format::Prometheus);
        let series = text
            .lines()
            .filter(|l| {
                l.starts_with("connreap_upstream_connections_total{")
                    && l.contains("result=\"refused\"")
            })
            .count();
        assert_eq!(
            series,
            MAX_TARGETS + 1,
            "the rest under remote_port=\"other\""
        );
        assert!(
            text.contains(r#"connreap_upstream_connections_total{comm="scanner",remote_port="other",netns="unknown",result="refused"} 50"#),
            "{text}"
        );
    }
}
