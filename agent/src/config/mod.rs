//! Configuration: TOML file, every key with a commented default. `connreap.example.toml` at the
//! repository root is the reference; a unit test keeps it equal to `Config::default()`.
mod keys;
mod ranges;
mod shown;
mod size;
mod token;
mod validate;

use std::{collections::BTreeMap, net::SocketAddr, path::Path, time::Duration};

use serde::{Deserialize, Serialize};

use crate::table::TcpState;
use keys::{KeyPath, Positions};
pub use ranges::{DEFAULT_MAX_BODY, MAX_COUNT};
pub use shown::{shown, INPUT_MAX};
pub use size::ByteSize;
pub use token::read_token;
use validate::validate;
pub use validate::warnings;

/// Exit code for an invalid configuration (sysexits.h EX_CONFIG).
pub const EX_CONFIG: u8 = 78;
pub const DEFAULT_PATH: &str = "/etc/connreap/connreap.toml";

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{path}: cannot read")]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}:{line}:{column}: {message}")]
    Parse {
        path: String,
        line: usize,
        column: usize,
        /// The parser's message, led by the key it is about (or, in text that is not valid
        /// TOML, by the line). The parser's own error is not kept as a source: its display
        /// repeats the position with a snippet of the file.
        message: String,
    },
    #[error("{path}:{} `{key}`: {message}", line_part(.line))]
    Invalid {
        path: String,
        /// Line of the key (or of its table) in the file, when it is there.
        line: Option<usize>,
        key: String,
        message: String,
    },
}

impl ConfigError {
    /// The error as it may be printed: every part that comes from the file or its path with
    /// control characters escaped and capped (see [`shown`]).
    fn shown(self) -> ConfigError {
        use shown::{shown, PART_MAX};
        match self {
            ConfigError::Read { path, source } => ConfigError::Read {
                path: shown(&path, PART_MAX),
                source,
            },
            ConfigError::Parse {
                path,
                line,
                column,
                message,
            } => ConfigError::Parse {
                path: shown(&path, PART_MAX),
                line,
                column,
                message: shown(&message, PART_MAX),
            },
            ConfigError::Invalid {
                path,
                line,
                key,
                message,
            } => ConfigError::Invalid {
                path: shown(&path, PART_MAX),
                line,
                key: shown(&key, PART_MAX),
                message: shown(&message, PART_MAX),
            },
        }
    }
}

fn line_part(line: &Option<usize>) -> String {
    line.map(|l| format!("{l}:")).unwrap_or_default()
}

/// The whole configuration. By default there are no quota sources, webhooks or policies:
/// findings are logged and served by the API, and nothing is ever closed.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    pub agent: AgentConfig,
    pub detect: DetectConfig,
    pub api: ApiConfig,
    pub alerts: AlertsConfig,
    pub reclaim: ReclaimConfig,
    pub quota: Vec<QuotaConfig>,
    pub webhook: Vec<WebhookConfig>,
    pub policy: Vec<PolicyConfig>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AgentConfig {
    /// Address of the HTTP API and /metrics.
    pub listen: SocketAddr,
    /// How often the socket table is rebuilt and the detectors run.
    #[serde(with = "humantime_serde")]
    pub scan_interval: Duration,
    /// How often each network namespace other than connreap's own is walked whole; between
    /// walks, its sockets held by a process are read on every scan in one pass over all
    /// processes, and those no process holds (TIME_WAIT, SYN_RECV, orphans, not yet accepted)
    /// are carried from its last walk. 0s: every namespace on every scan.
    #[serde(with = "humantime_serde")]
    pub netns_walk_interval: Duration,
    /// Host name reported in alerts; empty means the kernel's host name.
    pub host: String,
    /// Log lines on stderr: "text" or "json" (`--log-format` overrides).
    pub log_format: crate::logging::LogFormat,
}

impl Default for AgentConfig {
    fn default() -> Self {
        AgentConfig {
            // Loopback only: the API exposes socket owners; put a proxy in front to share it.
            listen: SocketAddr::from(([127, 0, 0, 1], 9477)),
            scan_interval: Duration::from_secs(5),
            // A walk per namespace costs a pass over every socket of the host (one TCP hash
            // for all namespaces): at 100 namespaces, walking each on every scan cost 1.27 s
            // of CPU per scan (BENCHMARKS.md, measure 7). TIME_WAIT lasts 60 s.
            netns_walk_interval: Duration::from_secs(60),
            host: String::new(),
            log_format: crate::logging::LogFormat::Text,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DetectConfig {
    /// CLOSE_WAIT younger than this is normal shutdown in progress.
    #[serde(with = "humantime_serde")]
    pub close_wait_min_age: Duration,
    /// CLOSE_WAIT sockets per (process, service port) that make a finding. Any single
    /// CLOSE_WAIT older than ten times `close_wait_min_age` makes one too.
    pub close_wait_threshold: usize,
    /// Both ends of a local ESTABLISHED pair idle at least this long count as stuck.
    #[serde(with = "humantime_serde")]
    pub stuck_pair_min_idle: Duration,
    /// Stuck pairs per (client process, server process, service port) that make a finding.
    pub stuck_pair_threshold: usize,
    /// An ESTABLISHED socket whose other end is not on this host, queues empty, idle at least
    /// this long, counts toward idle_established_buildup...
    #[serde(with = "humantime_serde")]
    pub idle_established_min_idle: Duration,
    /// ...and this many per (process, service port) make a finding. Both defaults sit above
    /// what healthy keep-alive pools hold idle (see connreap.example.toml).
    pub idle_established_threshold: usize,
    /// used/limit at or above this is "saturated".
    pub quota_saturation: f64,
    /// A connection counted against a saturated quota is "idle" after this long without data.
    #[serde(with = "humantime_serde")]
    pub quota_idle_min: Duration,
    /// New outbound connections per second per (process, peer service port) that count as a
    /// storm when the rate also grew over `storm_growth_windows` consecutive scan intervals.
    pub storm_rate: f64,
    pub storm_growth_windows: usize,
    /// failing_upstream counts a process's outbound connection attempts per remote endpoint
    /// over this long...
    #[serde(with = "humantime_serde")]
    pub failing_window: Duration,
    /// ...and fires when at least this many of them failed...
    pub failing_min_failures: usize,
    /// ...making at least this share of its attempts to that endpoint.
    pub failing_share: f64,
    /// A connection reset by the peer within this long of its handshake failed (or closed by
    /// the peer within it, then reset: see `kernel::outcome`).
    #[serde(with = "humantime_serde")]
    pub failing_short_lifetime: Duration,
    /// connreap_upstream_connections_total also carries the remote address (`remote_addr`):
    /// one series per upstream address, for a host talking to few of them.
    pub failing_metrics_by_address: bool,
}

impl Default for DetectConfig {
    fn default() -> Self {
        DetectConfig {
            close_wait_min_age: Duration::from_secs(30),
            close_wait_threshold: 16,
            stuck_pair_min_idle: Duration::from_secs(300),
            stuck_pair_threshold: 16,
            idle_established_min_idle: Duration::from_secs(600),
            idle_established_threshold: 64,
            quota_saturation: 0.9,
            quota_idle_min: Duration::from_secs(60),
            storm_rate: 50.0,
            storm_growth_windows: 2,
            failing_window: Duration::from_secs(60),
            failing_min_failures: 10,
            failing_share: 0.5,
            failing_short_lifetime: Duration::from_millis(50),
            failing_metrics_by_address: false,
        }
    }
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ApiConfig {
    /// File holding the bearer token for POST /v1/reclaim; empty disables that endpoint.
    pub token_file: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AlertsConfig {
    /// A firing alert is sent again this often while it keeps firing.
    #[serde(with = "humantime_serde")]
    pub repeat_interval: Duration,
    /// A firing alert whose content changed materially (count grew by half, a new owning
    /// process) is sent again at most this often; a changed verdict is sent at once.
    #[serde(with = "humantime_serde")]
    pub renotify_interval: Duration,
    /// Alertmanager receivers get every firing alert re-posted this often, with `endsAt` four
    /// of these ahead (as Prometheus does): an Alertmanager restart loses nothing for long, and
    /// a dead agent's alerts expire.
    #[serde(with = "humantime_serde")]
    pub alertmanager_resend: Duration,
    /// The `severity` label per finding kind, where it differs from the built-in one
    /// (quota_exhausted_by_leak and reconnect_storm critical, the others warning).
    pub severity: std::collections::BTreeMap<String, String>,
    /// Notifications kept while receivers are down; beyond this the oldest are dropped
    /// (counted in connreap_webhook_dropped_total and logged).
    pub queue_capacity: usize,
    /// Longest wait between retries to an unreachable receiver.
    #[serde(with = "humantime_serde")]
    pub max_backoff: Duration,
    /// Per-request timeout.
    #[serde(with = "humantime_serde")]
    pub timeout: Duration,
}

impl Default for AlertsConfig {
    fn default() -> Self {
        AlertsConfig {
            repeat_interval: Duration::from_secs(3600),
            renotify_interval: Duration::from_secs(60),
            alertmanager_resend: Duration::from_secs(60),
            severity: std::collections::BTreeMap::new(),
            queue_capacity: 1024,
            max_backoff: Duration::from_secs(60),
            timeout: Duration::from_secs(5),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ReclaimConfig {
    /// Never touched, whatever a policy says.
    pub protect_ports: Vec<u16>,
    /// Every reclaim decision, one JSON line each; appended, never rewritten.
    pub audit_log: String,
    /// How sockets are destroyed: "auto" (netlink SOCK_DESTROY, else the bpf_sock_destroy
    /// kfunc from an iter/tcp program), "netlink" or "bpf-iter" (only that one).
    pub mechanism: DestroyMechanism,
}

impl Default for ReclaimConfig {
    fn default() -> Self {
        ReclaimConfig {
            protect_ports: vec![22],
            audit_log: "/var/lib/connreap/audit.jsonl".into(),
            mechanism: DestroyMechanism::Auto,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum DestroyMechanism {
    Auto,
    Netlink,
    BpfIter,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QuotaConfig {
    pub name: String,
    // HTTP JSON source
    pub url: Option<String>,
    /// JSON pointer to the array of entries.
    pub items: Option<String>,
    pub port_field: Option<String>,
    pub used_field: Option<String>,
    pub limit_field: Option<String>,
    #[serde(default, with = "humantime_serde::option")]
    pub poll_interval: Option<Duration>,
    #[serde(default, with = "humantime_serde::option")]
    pub timeout: Option<Duration>,
    /// Quota port -> local service port whose sockets carry its streams (e.g. a relay that
    /// reports the instance port 21000 for streams arriving on its dial slot 25001).
    #[serde(default)]
    pub port_map: BTreeMap<String, u16>,
    // Static source
    /// Process (comm) whose sockets to `peer` count as used.
    pub process: Option<String>,
    pub peer: Option<SocketAddr>,
    /// Fixed limit (static sources, or HTTP sources without `limit_field`).
    pub limit: Option<u64>,
    /// Largest response body read from an HTTP source (default [`DEFAULT_MAX_BODY`]); a
    /// bigger one makes the source unavailable.
    pub max_body: Option<ByteSize>,
    /// The network namespace the quota's ports live in, and its URL is polled from: a name
    /// under /run/netns or /run/docker/netns, an inode, or "host". Without it (and without
    /// `container`): connreap's own namespace.
    pub netns: Option<String>,
    /// Instead of `netns`: the network namespace of the container whose id starts with this
    /// (at least 4 hex digits; stored lowercase).
    #[serde(default, deserialize_with = "lowercase")]
    pub container: Option<String>,
}

/// Where a quota's ports, or a policy's sockets, live: `netns = ...` or `container = ...`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Place<'a> {
    /// A network namespace: a name, an inode or "host".
    Netns(&'a str),
    /// A container, by lowercase id prefix.
    Container(&'a str),
}

/// `netns` and `container` of a table (validation refuses both at once; netns wins).
fn place_of<'a>(netns: &'a Option<String>, container: &'a Option<String>) -> Option<Place<'a>> {
    match (netns, container) {
        (Some(n), _) => Some(Place::Netns(n)),
        (None, Some(c)) => Some(Place::Container(c)),
        (None, None) => None,
    }
}

impl std::fmt::Display for Place<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Place::Netns(n) => write!(f, "netns {n}"),
            Place::Container(c) => write!(f, "container {c}"),
        }
    }
}

/// An optional string, lowercased (container ids are lowercase hex).
fn lowercase<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    Ok(Option::<String>::deserialize(d)?.map(|s| s.to_ascii_lowercase()))
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum WebhookFormat {
    Json,
    Alertmanager,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WebhookConfig {
    pub url: String,
    #[serde(default = "default_format")]
    pub format: WebhookFormat,
}

fn default_format() -> WebhookFormat {
    WebhookFormat::Json
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PolicyMode {
    DryRun,
    Enforce,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Trigger {
    QuotaSaturated,
    Always,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Selector {
    pub comm: Option<String>,
    pub pid: Option<u32>,
    pub unit: Option<String>,
    pub local_port: Option<u16>,
    pub peer_port: Option<u16>,
    pub peer: Option<SocketAddr>,
    #[serde(default)]
    pub states: Vec<TcpState>,
    /// Also select sockets with no owner (e.g. connections still in a listener's accept
    /// queue). Only with local_port or peer_port: without it they are never selected.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub unowned: bool,
    /// Only sockets in this network namespace (a name, an inode or "host"). Without `netns`
    /// and `container` a policy applies in every namespace.
    pub netns: Option<String>,
    /// Only sockets whose owner runs in a container whose id starts with this (at least 4
    /// hex digits; stored lowercase). Sockets with no owner never match it.
    #[serde(default, deserialize_with = "lowercase")]
    pub container: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PolicyConfig {
    pub name: String,
    #[serde(default = "default_mode")]
    pub mode: PolicyMode,
    pub trigger: Trigger,
    pub quota: Option<String>,
    pub select: Selector,
    #[serde(default, with = "humantime_serde::option")]
    pub min_idle: Option<Duration>,
    #[serde(default, with = "humantime_serde::option")]
    pub min_age: Option<Duration>,
    #[serde(default)]
    pub order: Order,
    #[serde(default = "default_max_per_round")]
    pub max_per_round: usize,
    #[serde(default)]
    pub action: Action,
    /// Also take a relaying process's upstream connections that may still serve a connected
    /// downstream (a user on a quiet page). Off: only orphaned ones (downstream gone) and
    /// connections of processes that do not relay are taken.
    #[serde(default)]
    pub include_serving: bool,
}

/// Which selected sockets a round takes first.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Order {
    /// Longest in their state first, then longest idle (the relay operators' rule: age, not
    /// idleness, because quiet streams are legitimately idle).
    #[default]
    OldestFirst,
}

/// What a round does to a socket it takes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Action {
    /// SOCK_DESTROY (or the bpf_sock_destroy fallback): RST where the state calls for it.
    #[default]
    Destroy,
}

fn default_mode() -> PolicyMode {
    PolicyMode::DryRun
}
fn default_max_per_round() -> usize {
    8
}

impl QuotaConfig {
    pub fn is_http(&self) -> bool {
        self.url.is_some()
    }
    /// The local service port whose sockets count against quota entry `port`.
    pub fn socket_port(&self, port: u16) -> u16 {
        self.port_map
            .get(&port.to_string())
            .copied()
            .unwrap_or(port)
    }
    /// `max_body`, else the default.
    pub fn max_body(&self) -> u64 {
        self.max_body.unwrap_or(DEFAULT_MAX_BODY).0
    }
    /// The namespace or container the quota names; None: connreap's own namespace.
    pub fn place(&self) -> Option<Place<'_>> {
        place_of(&self.netns, &self.container)
    }
}

/// 1-based line and column of byte `offset`.
fn line_col(text: &str, offset: usize) -> (usize, usize) {
    let before = &text[..offset.min(text.len())];
    let line = before.matches('\n').count() + 1;
    let column = before.len() - before.rfind('\n').map(|i| i + 1).unwrap_or(0) + 1;
    (line, column)
}

/// The byte range of the line holding `offset`, without its line break.
fn line_range(text: &str, offset: usize) -> std::ops::Range<usize> {
    let offset = offset.min(text.len());
    let start = text[..offset].rfind('\n').map_or(0, |i| i + 1);
    let end = text[start..].find('\n').map_or(text.len(), |i| start + i);
    start..end
}

/// Parse and validate a configuration text; `path` is only used in messages.
pub fn parse(text: &str, path: &str) -> Result<Config, ConfigError> {
    parse_unshown(text, path).map_err(ConfigError::shown)
}

fn parse_unshown(text: &str, path: &str) -> Result<Config, ConfigError> {
    let cfg: Config = toml::from_str(text).map_err(|e| parse_error(text, path, &e))?;
    validate(&cfg).map_err(|(key, message)| ConfigError::Invalid {
        path: path.into(),
        line: Positions::of(text)
            .and_then(|p| p.find(&key))
            .map(|at| line_col(text, at).0),
        key: key.to_string(),
        message,
    })?;
    Ok(cfg)
}

/// A parse error at file:line:column, naming the key it is about: the innermost key on the
/// error's line, from the parser's spans. Text that is not TOML at all has no keys to name;
/// its line is quoted instead.
fn parse_error(text: &str, path: &str, e: &toml::de::Error) -> ConfigError {
    let message = e.message().to_string();
    let Some(start) = e.span().map(|s| s.start) else {
        return ConfigError::Parse {
            path: path.into(),
            line: 0,
            column: 0,
            message,
        };
    };
    let (line, column) = line_col(text, start);
    let range = line_range(text, start);
    let what = match Positions::of(text) {
        Some(p) => p.at(start, range).map(KeyPath::to_string),
        None => Some(text[range].trim().to_string()).filter(|l| !l.is_empty()),
    }
    .map(|w| shown::shown(&w, shown::INPUT_MAX));
    ConfigError::Parse {
        path: path.into(),
        line,
        column,
        message: match what {
            Some(what) => format!("`{what}`: {message}"),
            None => message,
        },
    }
}

pub fn load(path: &Path) -> Result<Config, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| {
        ConfigError::Read {
            path: path.display().to_string(),
            source,
        }
        .shown()
    })?;
    parse(&text, &path.display().to_string())
}

/// `--config PATH`, else /etc/connreap/connreap.toml if it exists, else built-in defaults.
pub fn load_default(explicit: Option<&Path>) -> Result<(Config, String), ConfigError> {
    match explicit {
        Some(p) => Ok((load(p)?, p.display().to_string())),
        None if Path::new(DEFAULT_PATH).exists() => {
            Ok((load(Path::new(DEFAULT_PATH))?, DEFAULT_PATH.to_string()))
        }
        None => Ok((Config::default(), "built-in defaults".into())),
    }
}

#[cfg(test)]
mod tests;
