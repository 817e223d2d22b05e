//! Prometheus metrics (prometheus-client) on GET /metrics, in OpenMetrics or the Prometheus
//! text format as the scraper asks ([`exposition`]), with the agent's own `process_*` metrics
//! ([`process`]).
mod exposition;
mod netns;
mod process;
mod upstream;

use std::{
    collections::HashMap,
    sync::{
        atomic::{AtomicU64, Ordering},
        Mutex,
    },
};

use prometheus_client::{
    encoding::{text::encode, EncodeLabelSet},
    metrics::{counter::Counter, family::Family, gauge::Gauge, histogram::Histogram, info::Info},
    registry::Registry,
};

pub use exposition::Format;
use netns::{NetnsKindLabels, SocketLabels};

use crate::{detect::Finding, kernel::Counters, table::Socket};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabels {
    pub kind: String,
}

/// One webhook receiver (its URL without credentials or query) and, for sends, the result.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct WebhookLabels {
    pub receiver: String,
    pub result: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReceiverLabels {
    pub receiver: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BuildLabels {
    pub version: String,
    pub commit: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReclaimLabels {
    pub policy: String,
    pub result: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ProgramLabels {
    pub program: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct MapLabels {
    pub map: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct MechanismLabels {
    pub mechanism: String,
}

pub struct Metrics {
    registry: Registry,
    sockets: Family<SocketLabels, Gauge>,
    findings: Family<KindLabels, Gauge>,
    transitions: Counter,
    ring_drops: Counter,
    map_full: Counter,
    map_memory: Family<MapLabels, Gauge>,
    last_kernel: Mutex<Counters>,
    pub events_read: Counter,
    pub batches_flushed: Counter,
    pub flush_busy: Counter,
    webhook_sends: Family<WebhookLabels, Counter>,
    webhook_dropped: Family<ReceiverLabels, Counter>,
    pub scan_duration: Histogram,
    pub scan_errors: Counter,
    pub audit_errors: Counter,
    pub reclaims: Family<ReclaimLabels, Counter>,
    pub reclaim_mechanism: Family<MechanismLabels, Gauge>,
    program_run_seconds: Family<ProgramLabels, Counter<f64, AtomicU64>>,
    program_runs: Family<ProgramLabels, Counter>,
    program_recursion_misses: Family<ProgramLabels, Counter>,
    /// The kernel's cumulative program statistics at the last observation, by program.
    last_programs: Mutex<HashMap<&'static str, crate::kernel::ProgramStats>>,
    scans: AtomicU64,
    netns_scanned: Gauge,
    netns_walked: Gauge,
    netns_failed: Gauge,
    netns_gone: Counter,
    netns_scan_failures: Counter,
    netns_findings: Family<NetnsKindLabels, Gauge>,
    upstream_connections: Family<upstream::UpstreamLabels, Counter>,
    /// The label groups of `upstream_connections` (see `upstream::MAX_TARGETS`).
    upstream_groups: Mutex<std::collections::HashSet<upstream::UpstreamLabels>>,
}

/// `connreap_build_info`'s commit: `CONNREAP_COMMIT` at build time, when the build sets it.
const COMMIT: &str = match option_env!("CONNREAP_COMMIT") {
    Some(c) => c,
    None => "unknown",
};

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("connreap");
        let m = Metrics {
            registry: Registry::default(),
            sockets: Family::default(),
            findings: Family::default(),
            transitions: Counter::default(),
            ring_drops: Counter::default(),
            map_full: Counter::default(),
            map_memory: Family::default(),
            last_kernel: Mutex::new(Counters::default()),
            events_read: Counter::default(),
            batches_flushed: Counter::default(),
            flush_busy: Counter::default(),
            webhook_sends: Family::default(),
            webhook_dropped: Family::default(),
            scan_duration: Histogram::new([
                0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
            ]),
            scan_errors: Counter::default(),
            audit_errors: Counter::default(),
            reclaims: Family::default(),
            reclaim_mechanism: Family::default(),
            program_run_seconds: Family::default(),
            program_runs: Family::default(),
            program_recursion_misses: Family::default(),
            last_programs: Mutex::new(HashMap::new()),
            scans: AtomicU64::new(0),
            netns_scanned: Gauge::default(),
            netns_walked: Gauge::default(),
            netns_failed: Gauge::default(),
            netns_gone: Counter::default(),
            netns_scan_failures: Counter::default(),
            netns_findings: Family::default(),
            upstream_connections: Family::default(),
            upstream_groups: Mutex::new(std::collections::HashSet::new()),
        };
        m.register(&mut registry);
        Metrics { registry, ..m }
    }

    /// Every series under its name and help text.
    fn register(&self, registry: &mut Registry) {
        let m = self;
        registry.register(
            "build",
            "Version and commit of this agent (always 1)",
            Info::new(BuildLabels {
                version: env!("CARGO_PKG_VERSION").to_string(),
                commit: COMMIT.to_string(),
            }),
        );
        registry.register(
            "sockets",
            "TCP sockets by state, owner command, service port, network namespace and (for owners in one) container",
            m.sockets.clone(),
        );
        registry.register("findings", "Active findings by kind", m.findings.clone());
        registry.register(
            "tcp_transitions",
            "TCP state transitions seen by the kernel probe",
            m.transitions.clone(),
        );
        registry.register(
            "bpf_ring_drops",
            "Transition events lost because the ring buffer was full",
            m.ring_drops.clone(),
        );
        registry.register(
            "bpf_map_full",
            "Sockets not tracked because their set of the state table was full",
            m.map_full.clone(),
        );
        registry.register(
            "bpf_map_memory_bytes",
            "Kernel memory of each BPF map (the kernel's memlock accounting)",
            m.map_memory.clone(),
        );
        registry.register(
            "events_read",
            "Transition events read by the daemon",
            m.events_read.clone(),
        );
        registry.register(
            "event_batches_flushed",
            "Partial per-CPU batches of transition events sent by the daemon's periodic flush",
            m.batches_flushed.clone(),
        );
        registry.register(
            "event_flush_busy",
            "Per-CPU flushes skipped because the batch was in use (its events go out later)",
            m.flush_busy.clone(),
        );
        registry.register(
            "webhook_sends",
            "Webhook delivery attempts by receiver and result",
            m.webhook_sends.clone(),
        );
        registry.register(
            "webhook_dropped",
            "Notifications dropped because the receiver's queue was full",
            m.webhook_dropped.clone(),
        );
        registry.register(
            "scan_duration_seconds",
            "Time to build the socket table and run the detectors",
            m.scan_duration.clone(),
        );
        registry.register("scan_errors", "Scans that failed", m.scan_errors.clone());
        registry.register(
            "audit_write_errors",
            "Reclaim rounds whose audit lines could not be written (enforce rounds then kill nothing)",
            m.audit_errors.clone(),
        );
        registry.register(
            "reclaims",
            "Reclaim decisions by policy and result",
            m.reclaims.clone(),
        );
        registry.register(
            "reclaim_mechanism",
            "Socket destroy mechanism in use (1 = active)",
            m.reclaim_mechanism.clone(),
        );
        registry.register(
            "bpf_program_run_time_seconds",
            "Run time of each BPF program (counts only while kernel.bpf_stats_enabled=1)",
            m.program_run_seconds.clone(),
        );
        registry.register(
            "bpf_program_runs",
            "Runs of each BPF program (counts only while kernel.bpf_stats_enabled=1)",
            m.program_runs.clone(),
        );
        registry.register(
            "bpf_program_recursion_misses",
            "Runs of each BPF program the kernel skipped because it was already running on that CPU; for the state tracker, transitions whose socket then shows a lower-bound age",
            m.program_recursion_misses.clone(),
        );
        m.register_netns(registry);
        registry.register(
            "upstream_connections",
            "Outbound TCP connection attempts by process, remote port and result: success, refused (connect failed within 1s), timeout, reset or closed (by the peer within detect.failing_short_lifetime)",
            m.upstream_connections.clone(),
        );
    }

    pub fn observe_table(&self, table: &[Socket]) {
        // Count first (no label allocation per socket), then publish one gauge per group: a
        // group's sockets share state, command, port, namespace and container, so its first
        // socket names them all.
        type Group<'a> = (
            crate::table::TcpState,
            &'a str,
            Option<u16>,
            u32,
            Option<&'a str>,
        );
        let ports = netns::PortLabels::of(table);
        let mut counts: rustc_hash::FxHashMap<Group<'_>, (&Socket, i64)> =
            rustc_hash::FxHashMap::default();
        for s in table {
            let key = (
                s.state,
                s.comm(),
                ports.port(s),
                s.netns.inode,
                s.container_id(),
            );
            counts.entry(key).or_insert((s, 0)).1 += 1;
        }
        self.sockets.clear();
        for ((_, _, port, _, _), (s, n)) in counts {
            self.sockets
                .get_or_create(&SocketLabels::of(s, port))
                .set(n);
        }
        self.scans.fetch_add(1, Ordering::Relaxed);
    }

    pub fn observe_findings(&self, findings: &[Finding]) {
        for kind in crate::detect::Kind::ALL {
            let n = findings.iter().filter(|f| f.kind() == kind).count();
            self.findings
                .get_or_create(&KindLabels {
                    kind: kind.as_str().to_string(),
                })
                .set(n as i64);
        }
        self.observe_netns_findings(findings);
    }

    /// Kernel counters are cumulative (and survive agent restarts); export the increase.
    pub fn observe_kernel(&self, now: Counters) {
        let mut last = self.last_kernel.lock().unwrap_or_else(|e| e.into_inner());
        self.transitions
            .inc_by(now.transitions.saturating_sub(last.transitions));
        self.ring_drops
            .inc_by(now.ring_drops.saturating_sub(last.ring_drops));
        self.map_full
            .inc_by(now.map_full.saturating_sub(last.map_full));
        for (map, bytes) in &now.map_memory {
            self.map_memory
                .get_or_create(&MapLabels {
                    map: map.to_string(),
                })
                .set(*bytes as i64);
        }
        *last = now;
    }

    /// The kernel's program statistics are cumulative since each program was loaded (and
    /// survive agent restarts, like the pinned tracker); export their increase. A value below
    /// the last one means the program was loaded again: its counts started over.
    pub fn observe_programs(&self, stats: &[crate::kernel::ProgramStats]) {
        let mut last = self.last_programs.lock().unwrap_or_else(|e| e.into_inner());
        for s in stats {
            let l = ProgramLabels {
                program: s.program.to_string(),
            };
            let before = last.get(s.program);
            let grew = |now: u64, then: Option<u64>| match then {
                Some(then) if now >= then => now - then,
                _ => now,
            };
            let run_ns = grew(s.run_time_ns, before.map(|b| b.run_time_ns));
            let runs = grew(s.run_count, before.map(|b| b.run_count));
            let misses = s
                .recursion_misses
                .map(|n| grew(n, before.and_then(|b| b.recursion_misses)));
            self.program_run_seconds
                .get_or_create(&l)
                .inc_by(run_ns as f64 / 1e9);
            self.program_runs.get_or_create(&l).inc_by(runs);
            if let Some(n) = misses {
                self.program_recursion_misses.get_or_create(&l).inc_by(n);
            }
            last.insert(s.program, s.clone());
        }
    }

    /// Every decision of a reclaim round, by policy and result.
    pub fn observe_round(&self, round: &crate::reclaim::exec::RoundResult) {
        for d in &round.decisions {
            self.reclaims
                .get_or_create(&ReclaimLabels {
                    policy: d.policy.clone(),
                    result: d.result.as_str().to_string(),
                })
                .inc();
        }
    }

    /// Create a receiver's series at zero, so rates over them exist before the first send.
    pub fn webhook_receiver(&self, receiver: &str) {
        for result in ["ok", "error"] {
            self.webhook_sends
                .get_or_create(&WebhookLabels {
                    receiver: receiver.to_string(),
                    result: result.to_string(),
                })
                .inc_by(0);
        }
        self.webhook_dropped
            .get_or_create(&ReceiverLabels {
                receiver: receiver.to_string(),
            })
            .inc_by(0);
    }

    pub fn webhook_sent(&self, receiver: &str, ok: bool) {
        self.webhook_sends
            .get_or_create(&WebhookLabels {
                receiver: receiver.to_string(),
                result: if ok { "ok" } else { "error" }.into(),
            })
            .inc();
    }

    pub fn webhook_dropped(&self, receiver: &str) {
        self.webhook_dropped
            .get_or_create(&ReceiverLabels {
                receiver: receiver.to_string(),
            })
            .inc();
    }

    /// Every series in `format`.
    pub fn render(&self, format: Format) -> String {
        let mut out = String::new();
        if encode(&mut out, &self.registry).is_err() {
            out.clear();
        }
        // The process families go before OpenMetrics' closing `# EOF`.
        let body_len = out.strip_suffix("# EOF\n").map_or(out.len(), str::len);
        out.insert_str(body_len, &process::render());
        match format {
            Format::OpenMetrics => out,
            Format::Prometheus => exposition::to_prometheus(&out),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_families() {
        let m = Metrics::new();
        let s = crate::detect::testutil::sock(
            1,
            "java",
            "127.0.0.1:40000",
            "127.0.0.1:80",
            crate::table::TcpState::CloseWait,
        );
        m.observe_table(&[s]);
        m.observe_kernel(Counters {
            transitions: 10,
            ring_drops: 1,
            map_full: 0,
            map_memory: vec![("state", 100)],
        });
        m.observe_kernel(Counters {
            transitions: 15,
            ring_drops: 1,
            map_full: 0,
            map_memory: vec![("state", 31_458_464), ("events", 4_223_304)],
        });
        let hook = "http://127.0.0.1:9999/alerts";
        m.webhook_receiver(hook);
        m.webhook_sent(hook, false);
        let text = m.render(Format::OpenMetrics);
        assert!(
            text.contains(
                r#"connreap_sockets{state="CLOSE_WAIT",comm="java",service_port="80",netns="host"} 1"#
            ),
            "{text}"
        );
        assert!(text.contains("connreap_tcp_transitions_total 15"), "{text}");
        assert!(
            text.contains(r#"connreap_bpf_map_memory_bytes{map="state"} 31458464"#),
            "{text}"
        );
        assert!(
            text.contains(r#"connreap_webhook_sends_total{receiver="http://127.0.0.1:9999/alerts",result="error"} 1"#),
            "{text}"
        );
        // Created at zero with the receiver, before anything was sent or dropped.
        assert!(
            text.contains(r#"connreap_webhook_sends_total{receiver="http://127.0.0.1:9999/alerts",result="ok"} 0"#),
            "{text}"
        );
        assert!(
            text.contains(
                r#"connreap_webhook_dropped_total{receiver="http://127.0.0.1:9999/alerts"} 0"#
            ),
            "{text}"
        );
        assert!(text.ends_with("# EOF\n"), "{text}");
    }

    #[test]
    fn build_info_names_version_and_commit() {
        let m = Metrics::new();
        let line = format!(
            r#"connreap_build_info{{version="{}",commit="{COMMIT}"}} 1"#,
            env!("CARGO_PKG_VERSION")
        );
        let om = m.render(Format::OpenMetrics);
        assert!(om.contains("# TYPE connreap_build info\n"), "{om}");
        assert!(om.contains(&line), "{om}");
        let text = m.render(Format::Prometheus);
        assert!(
            text.contains("# TYPE connreap_build_info gauge\n"),
            "{text}"
        );
        assert!(text.contains(&line), "{text}");
        assert!(!text.contains("# EOF"), "{text}");
    }

    #[test]
    fn process_families_in_both_formats() {
        let m = Metrics::new();
        let om = m.render(Format::OpenMetrics);
        assert!(om.contains("# TYPE process_cpu_seconds counter\n"), "{om}");
        assert!(om.contains("\nprocess_cpu_seconds_total "), "{om}");
        assert!(
            om.ends_with("# EOF\n") && om.matches("# EOF").count() == 1,
            "{om}"
        );
        let text = m.render(Format::Prometheus);
        assert!(
            text.contains("# TYPE process_cpu_seconds_total counter\n"),
            "{text}"
        );
        assert!(
            text.contains("# TYPE process_resident_memory_bytes gauge\n"),
            "{text}"
        );
        assert!(!text.contains("# UNIT"), "{text}");
    }

    /// The kernel's cumulative program statistics become counters of their increase, the run
    /// time in seconds; a reloaded program (counts lower than before) starts over.
    #[test]
    fn program_stats_are_counters_in_seconds() {
        let m = Metrics::new();
        let stats = |ns: u64, runs: u64, misses: u64| {
            vec![crate::kernel::ProgramStats {
                program: "connreap_set_state",
                run_time_ns: ns,
                run_count: runs,
                recursion_misses: Some(misses),
            }]
        };
        m.observe_programs(&stats(1_500_000_000, 10, 1));
        m.observe_programs(&stats(2_000_000_000, 30, 1));
        m.observe_programs(&stats(250_000_000, 5, 0));
        let text = m.render(Format::Prometheus);
        let l = r#"{program="connreap_set_state"}"#;
        for want in [
            format!("connreap_bpf_program_run_time_seconds_total{l} 2.25\n"),
            format!("connreap_bpf_program_runs_total{l} 35\n"),
            format!("connreap_bpf_program_recursion_misses_total{l} 1\n"),
            "# TYPE connreap_bpf_program_run_time_seconds_total counter\n".to_string(),
            "# TYPE connreap_bpf_program_runs_total counter\n".to_string(),
        ] {
            assert!(text.contains(&want), "{want:?} in\n{text}");
        }
        assert!(!text.contains("run_time_ns"), "{text}");
    }
}
