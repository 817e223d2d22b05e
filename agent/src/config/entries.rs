//! The entries of the arrays of tables (`[[quota]]`, `[[webhook]]`, `[[policy]]` and a
//! policy's `select`): every key declared once, with its range, doc and the value the
//! example entry shows.
use std::{collections::BTreeMap, net::SocketAddr, time::Duration};

use serde::{Deserialize, Serialize};

use super::{
    decl::settings,
    lowercase,
    ranges::{ms, secs, DAY, HOUR, KIB, MAX_COUNT, MIB, MINUTE},
    size::ByteSize,
    Action, Order, PolicyMode, Trigger, WebhookFormat,
};
use crate::table::TcpState;

settings! {
    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
    #[serde(deny_unknown_fields)]
    pub struct QuotaConfig in "quota" {
        /// Unique; policies name it in `quota`.
        name: String, example("\"relay\""), default_is("required");
        /// HTTP JSON source (e.g. a relay's GET /status): the URL polled.
        url: Option<String>, example("\"http://127.0.0.1:20080/status\"");
        /// HTTP: JSON pointer to the array of entries.
        items: Option<String>, example("\"/endpoints\"");
        /// HTTP: the entry's field holding its port.
        port_field: Option<String>, example("\"port\"");
        /// HTTP: the entry's field holding what is used.
        used_field: Option<String>, example("\"streams\"");
        /// HTTP: the entry's field holding its limit, or a fixed `limit`.
        limit_field: Option<String>, example("\"maxStreams\"");
        /// HTTP: how often it is polled.
        #[serde(default, with = "humantime_serde::option")]
        poll_interval: Option<Duration>, range(ms(100), secs(HOUR)), example("\"5s\""),
            default_is("agent.scan_interval");
        /// HTTP: how long a poll may take.
        #[serde(default, with = "humantime_serde::option")]
        timeout: Option<Duration>, range(ms(100), secs(5 * MINUTE)), example("\"2s\""),
            default_is("min(poll_interval, 5s)");
        /// HTTP: quota port -> local service port whose sockets carry its streams (e.g. a
        /// relay that reports the instance port 21000 for streams arriving on its dial slot
        /// 25001). Without it, connreap follows one relay hop itself.
        #[serde(default)]
        port_map: BTreeMap<String, u16>, example("{ \"21000\" = 25001 }");
        /// HTTP: the largest response body read; a larger one makes the source unavailable.
        max_body: Option<ByteSize>, range(ByteSize(KIB), ByteSize(64 * MIB)),
            example("\"1MiB\""), default_is("1MiB");
        /// Static source (e.g. an HTTP client pool's max-per-route): the process (comm) whose
        /// sockets to `peer` count as used.
        process: Option<String>, example("\"java\"");
        /// Static: sockets of that process to this peer count as used.
        peer: Option<SocketAddr>, example("\"10.0.16.36:80\"");
        /// The fixed limit (static sources, or HTTP sources without limit_field).
        limit: Option<u64>, range(1, MAX_COUNT), example("1000");
        /// The network namespace the quota's ports live in and its URL is polled from: a name
        /// (/run/netns, /run/docker/netns), an inode or "host". Neither this nor container:
        /// connreap's own namespace.
        netns: Option<String>, example("\"blue\"");
        /// Instead of netns: the namespace of the container whose id starts with this (4 to
        /// 64 hex digits).
        #[serde(default, deserialize_with = "lowercase")]
        container: Option<String>, example("\"3f2a9c\"");
    }
}

settings! {
    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
    #[serde(deny_unknown_fields)]
    pub struct WebhookConfig in "webhook" {
        /// Where notifications are POSTed (http or https).
        url: String, example("\"http://127.0.0.1:9999/alerts\""), default_is("required");
        /// "json", or "alertmanager" (POST to Alertmanager's /api/v2/alerts).
        #[serde(default = "default_format")]
        format: WebhookFormat, example("\"json\""), default_is("\"json\"");
        /// Per-request timeout.
        #[serde(default, with = "humantime_serde::option", skip_serializing_if = "Option::is_none")]
        timeout: Option<Duration>, range(ms(100), secs(5 * MINUTE)), example("\"5s\""),
            default_is("5s");
        /// Notifications kept while the receiver is down; beyond this the oldest are dropped
        /// (connreap_webhook_dropped_total, and a log line).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        queue_capacity: Option<usize>, range(1, 1_000_000), example("1024"),
            default_is("1024");
        /// Longest wait between retries to the receiver while it is down (exponential
        /// backoff from 1s).
        #[serde(default, with = "humantime_serde::option", skip_serializing_if = "Option::is_none")]
        max_backoff: Option<Duration>, range(secs(1), secs(DAY)), example("\"1m\""),
            default_is("1m");
    }
}

settings! {
    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
    #[serde(deny_unknown_fields)]
    pub struct PolicyConfig in "policy" {
        /// Unique; named in the audit log and the metrics.
        name: String, example("\"relay-leaks\""), default_is("required");
        /// "dry-run" (decide and audit, close nothing) or "enforce".
        #[serde(default = "default_mode")]
        mode: PolicyMode, example("\"dry-run\""), default_is("\"dry-run\"");
        /// "quota-saturated" (only while `quota` is saturated) or "always".
        trigger: Trigger, example("\"quota-saturated\""), default_is("required");
        /// The [[quota]] a quota-saturated policy watches.
        quota: Option<String>, example("\"relay\"");
        /// Which sockets: an inline table of the keys indented below (select.comm, ...).
        select: Selector, example("{ comm = \"node\", peer_port = 25001 }"),
            default_is("required");
        /// Only sockets idle at least this long.
        #[serde(default, with = "humantime_serde::option")]
        min_idle: Option<Duration>, range(secs(0), secs(30 * DAY)), example("\"10s\"");
        /// Only sockets in their state at least this long.
        #[serde(default, with = "humantime_serde::option")]
        min_age: Option<Duration>, range(secs(0), secs(30 * DAY)), example("\"1m\"");
        /// Which selected sockets a round takes first: longest in their state, then longest
        /// idle.
        #[serde(default)]
        order: Order, example("\"oldest-first\""), default_is("\"oldest-first\"");
        /// The most sockets one round takes.
        #[serde(default = "default_max_per_round")]
        max_per_round: usize, range(1, 10_000), example("8"), default_is("8");
        /// What a round does to a socket it takes: SOCK_DESTROY (or the bpf_sock_destroy
        /// fallback), a RST where the state calls for it.
        #[serde(default)]
        action: Action, example("\"destroy\""), default_is("\"destroy\"");
        /// true: also a relaying process's upstream connections that may still serve a
        /// connected downstream (a user on a quiet page); orphaned ones (downstream gone)
        /// always go first. false: only orphaned ones, and connections of processes that do
        /// not relay.
        #[serde(default)]
        include_serving: bool, example("false"), default_is("false");
    }
}

settings! {
    #[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
    #[serde(deny_unknown_fields)]
    pub struct Selector in "policy.select" {
        /// Sockets of processes with this command name (comm, at most 15 bytes).
        comm: Option<String>, example("\"node\"");
        /// Sockets of this process.
        pid: Option<u32>, example("4242");
        /// Sockets of processes of this systemd unit.
        unit: Option<String>, example("\"relay.service\"");
        /// Sockets on this local port.
        local_port: Option<u16>, example("8080");
        /// Sockets to this remote port.
        peer_port: Option<u16>, example("25001");
        /// Sockets to this remote address.
        peer: Option<SocketAddr>, example("\"10.0.16.36:80\"");
        /// Only sockets in these states (LISTEN is never reclaimed).
        #[serde(default)]
        states: Vec<TcpState>, example("[\"ESTABLISHED\"]"), default_is("any state");
        /// Also select sockets with no owner (e.g. connections still in a listener's accept
        /// queue). Only with local_port or peer_port: without it they are never selected.
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        unowned: bool, example("false"), default_is("false");
        /// Only sockets in this network namespace (a name, an inode or "host"). Without netns
        /// and container a policy applies in every namespace; a quota-saturated one only in
        /// its quota's. protect_ports apply everywhere.
        netns: Option<String>, example("\"blue\"");
        /// Only sockets whose owner runs in a container whose id starts with this (4 to 64 hex
        /// digits). Sockets with no owner never match it.
        #[serde(default, deserialize_with = "lowercase")]
        container: Option<String>, example("\"3f2a9c\"");
    }
}

fn default_format() -> WebhookFormat {
    WebhookFormat::Json
}
fn default_mode() -> PolicyMode {
    PolicyMode::DryRun
}
fn default_max_per_round() -> usize {
    8
}
