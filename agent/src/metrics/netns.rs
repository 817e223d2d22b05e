//! Network namespace series: what the last scan covered (namespaces scanned, gone, failed) and
//! the active findings per namespace; the `netns` and `container` labels of the socket gauge.
use std::fmt;

use prometheus_client::{
    encoding::{EncodeLabel, EncodeLabelSet, LabelSetEncoder},
    registry::Registry,
};

use super::Metrics;
use crate::{detect::Finding, scan::NamespaceReport, table::Socket};

/// `connreap_sockets`' labels: state, owner command, service port, the namespace's label
/// (name, "host", or inode) and, for owners in a container, its short id (absent otherwise).
#[derive(Clone, Debug, Hash, PartialEq, Eq)]
pub struct SocketLabels {
    pub state: String,
    pub comm: String,
    pub service_port: String,
    pub netns: String,
    pub container: Option<String>,
}

/// The ports a socket's `service_port` label may take, so that series do not grow with
/// ephemeral ports (a TIME_WAIT socket whose listener is gone would otherwise be labelled with
/// its peer's ephemeral port): a port some socket listens on in that namespace, or a port
/// outside the ephemeral range; any other is labelled `ephemeral`.
pub struct PortLabels {
    listeners: rustc_hash::FxHashSet<(u32, u16)>,
    ephemeral: (u16, u16),
}

/// The kernel's default `net.ipv4.ip_local_port_range`.
const DEFAULT_EPHEMERAL: (u16, u16) = (32768, 60999);

impl PortLabels {
    pub fn of(table: &[Socket]) -> PortLabels {
        static EPHEMERAL: std::sync::OnceLock<(u16, u16)> = std::sync::OnceLock::new();
        let ephemeral = *EPHEMERAL.get_or_init(|| {
            std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
                .ok()
                .and_then(|t| parse_range(&t))
                .unwrap_or(DEFAULT_EPHEMERAL)
        });
        PortLabels::with(table, ephemeral)
    }

    fn with(table: &[Socket], ephemeral: (u16, u16)) -> PortLabels {
        let listeners = table
            .iter()
            .filter(|s| s.state == crate::table::TcpState::Listen)
            .map(|s| (s.netns.inode, s.local.port()))
            .collect();
        PortLabels {
            listeners,
            ephemeral,
        }
    }

    /// The label value of `s`'s service port: the port, or None for `ephemeral`.
    pub fn port(&self, s: &Socket) -> Option<u16> {
        let p = s.service_port;
        let (lo, hi) = self.ephemeral;
        (!(lo..=hi).contains(&p) || self.listeners.contains(&(s.netns.inode, p))).then_some(p)
    }
}

/// `ip_local_port_range`'s text: two numbers separated by whitespace.
fn parse_range(text: &str) -> Option<(u16, u16)> {
    let mut it = text.split_whitespace().map(|n| n.parse::<u16>().ok());
    let (lo, hi) = (it.next()??, it.next()??);
    (lo <= hi).then_some((lo, hi))
}

impl SocketLabels {
    /// `port`: from [`PortLabels::port`].
    pub fn of(s: &Socket, port: Option<u16>) -> SocketLabels {
        SocketLabels {
            state: s.state.to_string(),
            comm: s.comm().to_string(),
            service_port: port.map_or_else(|| "ephemeral".to_string(), |p| p.to_string()),
            netns: s.netns.label(),
            container: s.container().map(|c| c.short_id().to_string()),
        }
    }
}

impl EncodeLabelSet for SocketLabels {
    fn encode(&self, mut e: LabelSetEncoder) -> Result<(), fmt::Error> {
        ("state", self.state.as_str()).encode(e.encode_label())?;
        ("comm", self.comm.as_str()).encode(e.encode_label())?;
        ("service_port", self.service_port.as_str()).encode(e.encode_label())?;
        ("netns", self.netns.as_str()).encode(e.encode_label())?;
        if let Some(c) = &self.container {
            ("container", c.as_str()).encode(e.encode_label())?;
        }
        Ok(())
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, prometheus_client::encoding::EncodeLabelSet)]
pub struct NetnsKindLabels {
    pub kind: String,
    pub netns: String,
}

impl Metrics {
    pub(super) fn register_netns(&self, registry: &mut Registry) {
        let m = self;
        registry.register(
            "netns_scanned",
            "Network namespaces whose sockets the last scan dumped",
            m.netns_scanned.clone(),
        );
        registry.register(
            "netns_walked",
            "Of those, namespaces the last scan walked whole (its own when the sweep cannot account for all of its sockets; each other at most once per agent.netns_walk_interval)",
            m.netns_walked.clone(),
        );
        registry.register(
            "netns_failed",
            "Network namespaces the last scan could not enter or dump (their sockets are missing from it; /healthz names them)",
            m.netns_failed.clone(),
        );
        registry.register(
            "netns_gone",
            "Network namespaces that went away between discovery and their dump",
            m.netns_gone.clone(),
        );
        registry.register(
            "netns_scan_failures",
            "Namespace dumps that failed, over all scans",
            m.netns_scan_failures.clone(),
        );
        registry.register(
            "netns_findings",
            "Active findings by kind and network namespace (name, \"host\" or inode)",
            m.netns_findings.clone(),
        );
    }

    /// What the last scan saw of the host's namespaces.
    pub fn observe_namespaces(&self, r: &NamespaceReport) {
        self.netns_scanned.set(r.scanned as i64);
        self.netns_walked.set(r.walked as i64);
        self.netns_failed.set(r.failed.len() as i64);
        self.netns_gone.inc_by(r.gone as u64);
        self.netns_scan_failures.inc_by(r.failed.len() as u64);
    }

    /// Active findings per (kind, namespace): only the pairs that have some (namespaces come
    /// and go; a series of a namespace without findings disappears).
    pub(super) fn observe_netns_findings(&self, findings: &[Finding]) {
        self.netns_findings.clear();
        for f in findings {
            self.netns_findings
                .get_or_create(&NetnsKindLabels {
                    kind: f.kind().as_str().to_string(),
                    netns: f.netns_label(),
                })
                .inc();
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::{
        containers::Runtime,
        detect::testutil::sock,
        metrics::{Format, Metrics},
        scan::NamespaceReport,
        table::TcpState,
    };

    #[test]
    fn sockets_carry_netns_and_container() {
        use crate::detect::scope_testutil::{container, netns, place};
        let m = Metrics::new();
        let blue = netns(4026532001, Some("blue"));
        let c = container("abcd", Runtime::Docker, None);
        let host = sock(
            1,
            "java",
            "127.0.0.1:40000",
            "127.0.0.1:80",
            TcpState::CloseWait,
        );
        let pod = place(host.clone(), &blue, Some(&c));
        m.observe_table(&[host, pod]);
        let text = m.render(Format::Prometheus);
        for want in [
            r#"connreap_sockets{state="CLOSE_WAIT",comm="java",service_port="80",netns="host"} 1"#,
            r#"connreap_sockets{state="CLOSE_WAIT",comm="java",service_port="80",netns="blue",container="abcd00000000"} 1"#,
        ] {
            assert!(text.contains(want), "{want} in\n{text}");
        }
    }

    #[test]
    fn namespace_report_and_findings_per_namespace() {
        let m = Metrics::new();
        let report = NamespaceReport {
            scanned: 3,
            walked: 2,
            gone: 1,
            failed: vec![(4026532009, "permission denied".into())],
            known: Vec::new(),
        };
        m.observe_namespaces(&report);
        m.observe_namespaces(&report);
        let mut a = crate::detect::testutil_finding(crate::detect::Kind::CloseWaitBuildup, "a");
        let b = a.clone();
        a.netns = 4026532001;
        a.netns_name = Some("blue".into());
        a.netns_own = false;
        m.observe_findings(&[a, b]);
        let text = m.render(Format::Prometheus);
        for want in [
            "connreap_netns_scanned 3\n",
            "connreap_netns_walked 2\n",
            "connreap_netns_failed 1\n",
            "connreap_netns_gone_total 2\n",
            "connreap_netns_scan_failures_total 2\n",
            "# HELP connreap_netns_failed Network namespaces the last scan could not enter",
            r#"connreap_netns_findings{kind="close_wait_buildup",netns="blue"} 1"#,
            r#"connreap_netns_findings{kind="close_wait_buildup",netns="host"} 1"#,
            // The per-kind total keeps its labels (rules and dashboards use it).
            r#"connreap_findings{kind="close_wait_buildup"} 2"#,
        ] {
            assert!(text.contains(want), "{want} in\n{text}");
        }
        m.observe_findings(&[]);
        let text = m.render(Format::Prometheus);
        assert!(!text.contains("connreap_netns_findings{"), "{text}");
    }
}

#[cfg(test)]
mod port_tests {
    use super::*;
    use crate::table::TcpState;

    fn sock(local: &str, peer: &str, state: TcpState, service_port: u16) -> Socket {
        let mut s = Socket::new(
            local.parse().expect("addr"),
            peer.parse().expect("addr"),
            state,
        );
        s.service_port = service_port;
        s
    }

    #[test]
    fn only_listeners_and_ports_outside_the_ephemeral_range_become_labels() {
        let table = vec![
            sock("0.0.0.0:40000", "0.0.0.0:0", TcpState::Listen, 40000),
            // Accepted on the listener in the ephemeral range: its port stays.
            sock(
                "10.0.0.1:40000",
                "10.0.0.2:51000",
                TcpState::Established,
                40000,
            ),
            // A TIME_WAIT whose listener is gone, taken for outbound: its peer's ephemeral port.
            sock("10.0.0.1:7900", "10.0.0.2:51234", TcpState::TimeWait, 51234),
            // Outbound to a well-known port.
            sock(
                "10.0.0.1:52000",
                "10.0.0.3:5432",
                TcpState::Established,
                5432,
            ),
        ];
        let p = PortLabels::with(&table, DEFAULT_EPHEMERAL);
        let got: Vec<Option<u16>> = table.iter().map(|s| p.port(s)).collect();
        assert_eq!(got, [Some(40000), Some(40000), None, Some(5432)]);
        assert_eq!(parse_range("32768\t60999\n"), Some((32768, 60999)));
        assert_eq!(parse_range("9 1"), None);
    }
}
