//! Prometheus metrics (prometheus-client, OpenMetrics text on GET /metrics).
use std::sync::{
    atomic::{AtomicU64, Ordering},
    Mutex,
};

use prometheus_client::{
    encoding::{text::encode, EncodeLabelSet},
    metrics::{counter::Counter, family::Family, gauge::Gauge, histogram::Histogram},
    registry::Registry,
};

use crate::{detect::Finding, kernel::Counters, table::Socket};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct SocketLabels {
    pub state: String,
    pub comm: String,
    pub service_port: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabels {
    pub kind: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabels {
    pub result: String,
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
    webhook_sends: Family<ResultLabels, Counter>,
    pub webhook_dropped: Counter,
    pub scan_duration: Histogram,
    pub scan_errors: Counter,
    pub audit_errors: Counter,
    pub reclaims: Family<ReclaimLabels, Counter>,
    pub reclaim_mechanism: Family<MechanismLabels, Gauge>,
    program_run_ns: Family<ProgramLabels, Gauge>,
    program_runs: Family<ProgramLabels, Gauge>,
    program_recursion_misses: Family<ProgramLabels, Gauge>,
    scans: AtomicU64,
}

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
            webhook_dropped: Counter::default(),
            scan_duration: Histogram::new([
                0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
            ]),
            scan_errors: Counter::default(),
            audit_errors: Counter::default(),
            reclaims: Family::default(),
            reclaim_mechanism: Family::default(),
            program_run_ns: Family::default(),
            program_runs: Family::default(),
            program_recursion_misses: Family::default(),
            scans: AtomicU64::new(0),
        };
        m.register(&mut registry);
        Metrics { registry, ..m }
    }

    /// Every series under its name and help text.
    fn register(&self, registry: &mut Registry) {
        let m = self;
        registry.register(
            "sockets",
            "TCP sockets by state, owner command and service port",
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
            "Webhook delivery attempts by result",
            m.webhook_sends.clone(),
        );
        registry.register(
            "webhook_dropped",
            "Notifications dropped because a webhook queue was full",
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
            "bpf_program_run_time_ns",
            "Cumulative run time of each BPF program in ns (counts only while kernel.bpf_stats_enabled=1)",
            m.program_run_ns.clone(),
        );
        registry.register(
            "bpf_program_runs",
            "Cumulative runs of each BPF program (counts only while kernel.bpf_stats_enabled=1)",
            m.program_runs.clone(),
        );
        registry.register(
            "bpf_program_recursion_misses",
            "Cumulative runs of each BPF program the kernel skipped because it was already running on that CPU; for the state tracker, transitions whose socket then shows a lower-bound age",
            m.program_recursion_misses.clone(),
        );
    }

    pub fn observe_table(&self, table: &[Socket]) {
        // Count first (no label allocation per socket), then publish one gauge per group.
        let mut counts: rustc_hash::FxHashMap<(crate::table::TcpState, &str, u16), i64> =
            rustc_hash::FxHashMap::default();
        for s in table {
            *counts
                .entry((s.state, s.comm(), s.service_port))
                .or_default() += 1;
        }
        self.sockets.clear();
        for ((state, comm, port), n) in counts {
            self.sockets
                .get_or_create(&SocketLabels {
                    state: state.to_string(),
                    comm: comm.to_string(),
                    service_port: port.to_string(),
                })
                .set(n);
        }
        self.scans.fetch_add(1, Ordering::Relaxed);
    }

    pub fn observe_findings(&self, findings: &[Finding]) {
        for kind in crate::detect::Kind::ALL {
            let n = findings.iter().filter(|f| f.kind == kind).count();
            self.findings
                .get_or_create(&KindLabels {
                    kind: kind.as_str().to_string(),
                })
                .set(n as i64);
        }
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

    pub fn observe_programs(&self, stats: &[crate::kernel::ProgramStats]) {
        for s in stats {
            let l = ProgramLabels {
                program: s.program.to_string(),
            };
            self.program_run_ns
                .get_or_create(&l)
                .set(s.run_time_ns as i64);
            self.program_runs.get_or_create(&l).set(s.run_count as i64);
            if let Some(n) = s.recursion_misses {
                self.program_recursion_misses
                    .get_or_create(&l)
                    .set(n as i64);
            }
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

    pub fn webhook_sent(&self, ok: bool) {
        self.webhook_sends
            .get_or_create(&ResultLabels {
                result: if ok { "ok" } else { "error" }.into(),
            })
            .inc();
    }

    pub fn render(&self) -> String {
        let mut out = String::new();
        if encode(&mut out, &self.registry).is_err() {
            out.clear();
        }
        out
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
        m.webhook_sent(false);
        let text = m.render();
        assert!(
            text.contains(
                r#"connreap_sockets{state="CLOSE_WAIT",comm="java",service_port="80"} 1"#
            ),
            "{text}"
        );
        assert!(text.contains("connreap_tcp_transitions_total 15"), "{text}");
        assert!(
            text.contains(r#"connreap_bpf_map_memory_bytes{map="state"} 31458464"#),
            "{text}"
        );
        assert!(
            text.contains(r#"connreap_webhook_sends_total{result="error"} 1"#),
            "{text}"
        );
    }
}
