//! The top-level tables (`[agent]`, `[detect]`, `[api]`, `[alerts]`, `[reclaim]`): every key
//! declared once, with its default, range and doc (which `connreap.example.toml`, the man page
//! and docs/config.md show).
use std::{collections::BTreeMap, net::SocketAddr, time::Duration};

use serde::{Deserialize, Serialize};

use super::{
    decl::settings,
    ranges::{ms, secs, DAY, HOUR, MINUTE},
    DestroyMechanism,
};
use crate::logging::LogFormat;

settings! {
    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
    #[serde(default, deny_unknown_fields)]
    pub struct AgentConfig in "agent", defaults {
        /// HTTP API and Prometheus /metrics. Loopback only by default: the API shows socket
        /// owners; put a proxy in front to share it.
        listen: SocketAddr = SocketAddr::from(([127, 0, 0, 1], 9477));
        /// How often the socket table is rebuilt and the detectors run.
        #[serde(with = "humantime_serde")]
        scan_interval: Duration = secs(5), range(ms(100), secs(HOUR));
        /// How often each network namespace other than connreap's own is walked whole (each
        /// walk passes over every TCP socket of the host, so walking 100 namespaces on every
        /// scan costs far more CPU than the scan itself: measure 7 in BENCHMARKS.md). Between
        /// walks, one sweep over the state tracker's table reads every namespace's full
        /// sockets (held or not) on every scan; its TIME_WAIT and SYN_RECV sockets are
        /// carried from its last walk, and a walk that would read nothing else is skipped.
        /// Also the longest the daemon reuses its last owner dump (which process holds which
        /// socket: a pass over every process's files) while nothing that changes owners is
        /// counted (no TCP state change, no holder reaped, no process started with a socket;
        /// docs/containers.md).
        /// 0s: every namespace and every process's files on every scan.
        #[serde(with = "humantime_serde")]
        netns_walk_interval: Duration = secs(60), range(secs(0), secs(HOUR));
        /// Sockets the state tracker can follow at once, every namespace's together (rounded
        /// up to a power of two; 64 bytes of kernel memory each, preallocated). A socket the
        /// table has no room for gets no exact age and is read only when its namespace is
        /// walked (`connreap_bpf_map_full_total` counts them). Changing it restarts the
        /// tracker: the ages of the sockets open then become lower bounds.
        max_tracked_sockets: usize = 262_144, range(16_384, 4_194_304);
        /// Host name in alerts; empty = the kernel's host name.
        host: String = String::new();
        /// Log lines on stderr: "text" (key=value fields, quoted when needed) or "json" (one
        /// object per line). `connreap --log-format` overrides it.
        log_format: LogFormat = LogFormat::Text;
    }
}

settings! {
    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
    #[serde(default, deny_unknown_fields)]
    pub struct DetectConfig in "detect", defaults {
        /// CLOSE_WAIT younger than this is a normal shutdown in progress.
        #[serde(with = "humantime_serde")]
        close_wait_min_age: Duration = secs(30), range(secs(0), secs(7 * DAY));
        /// CLOSE_WAIT sockets per (process, service port) that make a finding. Any single
        /// CLOSE_WAIT held ten times longer than close_wait_min_age makes one too.
        close_wait_threshold: usize = 16, range(1, 1_000_000);
        /// Both ends of a local ESTABLISHED pair idle this long, queues empty, count as
        /// stuck...
        #[serde(with = "humantime_serde")]
        stuck_pair_min_idle: Duration = secs(300), range(secs(0), secs(30 * DAY));
        /// ...and this many per (client process, server process, service port) make a
        /// finding.
        stuck_pair_threshold: usize = 16, range(1, 1_000_000);
        /// One-sided leaks (the other end on another host, or gone without a FIN):
        /// ESTABLISHED sockets whose peer is not on this host, queues empty, idle this long...
        #[serde(with = "humantime_serde")]
        idle_established_min_idle: Duration = secs(600), range(secs(0), secs(30 * DAY));
        /// ...and this many per (process, service port) make an idle_established_buildup
        /// finding. Healthy pools stay below both: HTTP keep-alive pools close idle
        /// connections within a minute or two (nginx 75s, Go 90s, load balancers ~60s), and
        /// database/Redis pools that do keep connections idle for long hold tens per process,
        /// not 64. Raise the threshold for a server that legitimately holds many quiet
        /// long-lived streams (SSE, WebSocket without heartbeats), where the finding is the
        /// cue to add heartbeats or TCP keepalive.
        idle_established_threshold: usize = 64, range(1, 1_000_000);
        /// used/limit at or above this is "saturated".
        quota_saturation: f64 = 0.9, above(0.0, 1.0);
        /// A connection counted against a saturated quota is "idle" after this long without
        /// data.
        #[serde(with = "humantime_serde")]
        quota_idle_min: Duration = secs(60), range(secs(0), secs(30 * DAY));
        /// New outbound connections per second per (process, peer service port) that make a
        /// reconnect storm when the rate also grew for storm_growth_windows scan intervals in
        /// a row.
        storm_rate: f64 = 50.0, range(0.001, 1_000_000.0);
        /// Scan intervals in a row over which the rate must grow (see storm_rate).
        storm_growth_windows: usize = 2, range(0, 100);
        /// failing_upstream: a process's outbound connection attempts per remote endpoint are
        /// counted over this long (a connect refused or timed out, or a connection reset or
        /// closed by the peer within failing_short_lifetime, failed; any other that got
        /// established succeeded).
        #[serde(with = "humantime_serde")]
        failing_window: Duration = secs(60), range(secs(5), secs(HOUR));
        /// It fires for an endpoint with at least this many failed attempts in the window...
        failing_min_failures: usize = 10, range(1, 1_000_000);
        /// ...making at least this share of the process's attempts there (a healthy service's
        /// occasional reset stays below both).
        failing_share: f64 = 0.5, range(0.01, 1.0);
        /// A connection the peer resets within this long of its handshake failed; so did one
        /// the peer closed within it and then reset (a server that accepts and closes without
        /// reading). A FIN answered by this side's own close is a normal end (HTTP
        /// Connection: close), whatever its lifetime.
        #[serde(with = "humantime_serde")]
        failing_short_lifetime: Duration = ms(50), range(ms(1), secs(10));
        /// connreap_upstream_connections_total by remote address too (label remote_addr): one
        /// series per upstream address, for hosts that talk to a few of them. Off: by remote
        /// port only.
        failing_metrics_by_address: bool = false;
    }
}

settings! {
    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
    #[serde(default, deny_unknown_fields)]
    pub struct ApiConfig in "api", defaults {
        /// File with the bearer token for POST /v1/reclaim; empty = that endpoint is off. The
        /// file must hold at least 16 characters and be private to its owner (chmod 600), else
        /// the configuration is invalid. With agent.listen not on loopback, the agent warns at
        /// start.
        token_file: String = String::new();
    }
}

settings! {
    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
    #[serde(default, deny_unknown_fields)]
    pub struct AlertsConfig in "alerts", defaults {
        /// A firing alert is re-sent this often while it keeps firing.
        #[serde(with = "humantime_serde")]
        repeat_interval: Duration = secs(HOUR), range(secs(1), secs(30 * DAY));
        /// A firing alert whose content changed materially (count grew by half, a new owning
        /// process) is re-sent at most this often; a changed verdict (pending -> leak) is sent
        /// at once.
        #[serde(with = "humantime_serde")]
        renotify_interval: Duration = secs(60), range(secs(1), secs(30 * DAY));
        /// Alertmanager receivers get every firing alert re-posted this often, endsAt 4x this
        /// ahead (as Prometheus does): an Alertmanager restart loses nothing for long, and a
        /// dead agent's alerts expire (Alertmanager forgets an alert at its endsAt).
        #[serde(with = "humantime_serde")]
        alertmanager_resend: Duration = secs(60), range(secs(1), secs(DAY));
        /// The `severity` label per finding kind, where it should differ from the built-in
        /// one: quota_exhausted_by_leak, reconnect_storm and failing_upstream "critical", the
        /// other kinds "warning".
        severity: BTreeMap<String, String> = BTreeMap::new(),
            example("close_wait_buildup = \"critical\"");
        /// Deprecated: set queue_capacity on each [[webhook]] instead.
        #[serde(skip_serializing_if = "Option::is_none")]
        queue_capacity: Option<usize> = None, range(1, 1_000_000),
            moved_to("webhook.queue_capacity");
        /// Deprecated: set max_backoff on each [[webhook]] instead.
        #[serde(with = "humantime_serde::option", skip_serializing_if = "Option::is_none")]
        max_backoff: Option<Duration> = None, range(secs(1), secs(DAY)),
            moved_to("webhook.max_backoff");
        /// Deprecated: set timeout on each [[webhook]] instead.
        #[serde(with = "humantime_serde::option", skip_serializing_if = "Option::is_none")]
        timeout: Option<Duration> = None, range(ms(100), secs(5 * MINUTE)),
            moved_to("webhook.timeout");
    }
}

settings! {
    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
    #[serde(default, deny_unknown_fields)]
    pub struct ReclaimConfig in "reclaim", defaults {
        /// Never touched, whatever a policy says.
        protect_ports: Vec<u16> = vec![22];
        /// Every reclaim decision as one JSON line; appended, never rewritten.
        audit_log: String = "/var/lib/connreap/audit.jsonl".into();
        /// How sockets are destroyed: "auto" (netlink SOCK_DESTROY, else the bpf_sock_destroy
        /// kfunc from an iter/tcp program, Linux 6.5+), "netlink" or "bpf-iter" (only that
        /// one).
        mechanism: DestroyMechanism = DestroyMechanism::Auto;
    }
}
