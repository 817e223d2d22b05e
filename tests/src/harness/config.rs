//! Agent configurations for the tests, written into a per-test temporary directory.

use std::{
    fmt, fs,
    net::SocketAddr,
    path::{Path, PathBuf},
    sync::atomic::{AtomicUsize, Ordering},
    thread,
};

use super::consts::{API, HOOK, HOST, RELAY_STATUS};

/// A directory under the system temp dir for one test's config and audit log, removed on drop
/// unless the test is failing (then its path is printed so they can be inspected).
pub struct TempDir(PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> TempDir {
        static N: AtomicUsize = AtomicUsize::new(0);
        let p = std::env::temp_dir().join(format!(
            "connreap-e2e-{tag}-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = fs::remove_dir_all(&p);
        fs::create_dir_all(&p).unwrap_or_else(|e| panic!("mkdir {}: {e}", p.display()));
        TempDir(p)
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }

    /// Writes `text` to the file `name` in this directory and returns its path.
    pub fn write(&self, name: &str, text: &str) -> PathBuf {
        let path = self.path(name);
        fs::write(&path, text).unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
        path
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        if thread::panicking() {
            eprintln!("kept {} for inspection", self.0.display());
        } else {
            let _ = fs::remove_dir_all(&self.0);
        }
    }
}

/// A `[[quota]]` source in the shape relay-sim's `GET /status` has
/// (`{"endpoints": [{"port", "streams", "maxStreams"}]}`), polled every second unless set.
#[derive(Debug, Clone)]
pub struct RelayQuota {
    name: String,
    url: String,
    poll_interval: String,
    timeout: Option<String>,
    /// `port_map = { "TARGET" = LOCAL }`: the relay's connections for TARGET use local port LOCAL.
    port_map: Option<(u16, u16)>,
    /// `netns = "NAME"`: the namespace the quota's ports (and a loopback URL) live in.
    netns: Option<String>,
    /// `container = "ID-PREFIX"`: the same, named by a container of that namespace.
    container: Option<String>,
}

impl RelayQuota {
    pub fn new(name: &str, url: &str) -> RelayQuota {
        RelayQuota {
            name: name.to_string(),
            url: url.to_string(),
            poll_interval: "1s".to_string(),
            timeout: None,
            port_map: None,
            netns: None,
            container: None,
        }
    }

    /// Incident 1's relay: `relay` at `http://RELAY_STATUS/status`.
    pub fn relay() -> RelayQuota {
        RelayQuota::new("relay", &format!("http://{RELAY_STATUS}/status"))
    }

    pub fn poll_interval(mut self, interval: &str) -> RelayQuota {
        self.poll_interval = interval.to_string();
        self
    }

    pub fn timeout(mut self, timeout: &str) -> RelayQuota {
        self.timeout = Some(timeout.to_string());
        self
    }

    pub fn port_map(mut self, target: u16, local: u16) -> RelayQuota {
        self.port_map = Some((target, local));
        self
    }

    /// `netns = "NAME"` (a name, an inode or `host`).
    pub fn netns(mut self, netns: &str) -> RelayQuota {
        self.netns = Some(netns.to_string());
        self
    }

    /// `container = "ID-PREFIX"`.
    pub fn container(mut self, prefix: &str) -> RelayQuota {
        self.container = Some(prefix.to_string());
        self
    }
}

impl fmt::Display for RelayQuota {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "[[quota]]")?;
        writeln!(f, "name = \"{}\"", self.name)?;
        writeln!(f, "url = \"{}\"", self.url)?;
        writeln!(f, "items = \"/endpoints\"")?;
        writeln!(f, "port_field = \"port\"")?;
        writeln!(f, "used_field = \"streams\"")?;
        writeln!(f, "limit_field = \"maxStreams\"")?;
        writeln!(f, "poll_interval = \"{}\"", self.poll_interval)?;
        if let Some(t) = &self.timeout {
            writeln!(f, "timeout = \"{t}\"")?;
        }
        if let Some((target, local)) = self.port_map {
            writeln!(f, "port_map = {{ \"{target}\" = {local} }}")?;
        }
        if let Some(ns) = &self.netns {
            writeln!(f, "netns = \"{ns}\"")?;
        }
        if let Some(c) = &self.container {
            writeln!(f, "container = \"{c}\"")?;
        }
        Ok(())
    }
}

/// The policy the relay tests reclaim with: incident 1's leak (the proxy's idle upstreams to
/// the relay's dial slot), armed while the `relay` quota is saturated, at most 8 per round.
pub fn relay_policy(mode: &str, min_idle: &str) -> String {
    format!(
        r#"[[policy]]
name = "relay-leaks"
mode = "{mode}"
trigger = "quota-saturated"
quota = "relay"
select = {{ comm = "leaky-proxy", peer_port = 25001, states = ["ESTABLISHED"] }}
min_idle = "{min_idle}"
max_per_round = 8
"#
    )
}

/// An agent configuration: the API on [`API`], a scan every second, the audit log in the test's
/// [`TempDir`], plus what the test adds. Rendered with `to_string()`.
#[derive(Debug, Clone)]
pub struct Config {
    audit: PathBuf,
    /// `agent.listen` when not [`API`].
    listen: Option<String>,
    scan_interval: String,
    netns_walk_interval: Option<String>,
    host: Option<String>,
    log_format: Option<String>,
    token_file: Option<PathBuf>,
    detect: Vec<String>,
    fast_alerts: bool,
    protect_ports: Option<Vec<u16>>,
    mechanism: Option<String>,
    webhooks: Vec<String>,
    alertmanagers: Vec<String>,
    alerts: Vec<String>,
    delivery: Vec<String>,
    quotas: Vec<RelayQuota>,
    policies: Vec<String>,
}

impl Config {
    /// Nothing but the API, 1 s scans and the audit log `dir/audit.jsonl`.
    pub fn new(dir: &TempDir) -> Config {
        Config {
            audit: dir.path("audit.jsonl"),
            listen: None,
            scan_interval: "1s".to_string(),
            netns_walk_interval: None,
            host: None,
            log_format: None,
            token_file: None,
            detect: Vec::new(),
            fast_alerts: false,
            protect_ports: None,
            mechanism: None,
            webhooks: Vec::new(),
            alertmanagers: Vec::new(),
            alerts: Vec::new(),
            delivery: Vec::new(),
            quotas: Vec::new(),
            policies: Vec::new(),
        }
    }

    /// What the alerting tests run: `host` [`HOST`], fast webhook retries (2 s max backoff, 2 s
    /// timeout) and one JSON webhook to `http://HOOK/alerts`.
    pub fn alerting(dir: &TempDir) -> Config {
        Config::alerting_to(dir, &format!("http://{HOOK}/alerts"))
    }

    /// [`Config::alerting`] with its JSON webhook at `url`.
    pub fn alerting_to(dir: &TempDir, url: &str) -> Config {
        let mut c = Config::new(dir);
        c.host = Some(HOST.to_string());
        c.fast_alerts = true;
        c.webhooks.push(url.to_string());
        c
    }

    /// What the reclaim tests run: port 22 protected and incident 1's relay quota.
    pub fn reclaiming(dir: &TempDir) -> Config {
        Config::new(dir)
            .protect_ports(&[22])
            .quota(RelayQuota::relay())
    }

    /// `agent.listen` (default [`API`]): an agent in the host's namespace, where other
    /// programs may hold that port, listens on a free one.
    pub fn listen(mut self, addr: SocketAddr) -> Config {
        self.listen = Some(addr.to_string());
        self
    }

    /// The agent's API address (`agent.listen`).
    pub fn api(&self) -> SocketAddr {
        self.listen
            .as_deref()
            .unwrap_or(API)
            .parse()
            .expect("agent.listen is a socket address")
    }

    /// The audit log (`reclaim.audit_log`).
    pub fn audit(&self) -> &Path {
        &self.audit
    }

    /// Puts the audit log (`reclaim.audit_log`) at `path` instead of the test's directory.
    pub fn audit_log(mut self, path: &Path) -> Config {
        self.audit = path.to_path_buf();
        self
    }

    /// `agent.scan_interval` (default `"1s"`, see [`super::SCAN`]).
    pub fn scan_interval(mut self, interval: &str) -> Config {
        self.scan_interval = interval.to_string();
        self
    }

    /// `agent.netns_walk_interval` (default: the daemon's, 1m).
    pub fn netns_walk_interval(mut self, interval: &str) -> Config {
        self.netns_walk_interval = Some(interval.to_string());
        self
    }

    /// Lines for `[detect]`, e.g. `close_wait_threshold = 4` (several separated by newlines).
    pub fn detect(mut self, lines: &str) -> Config {
        self.detect.push(lines.to_string());
        self
    }

    /// `agent.log_format` (`text` or `json`).
    pub fn log_format(mut self, format: &str) -> Config {
        self.log_format = Some(format.to_string());
        self
    }

    /// `api.token_file`. The file (when it exists) is made private to its owner (mode 0600):
    /// connreap refuses a token file that group or others can read.
    pub fn token_file(mut self, path: &Path) -> Config {
        use std::os::unix::fs::PermissionsExt as _;
        let _ = fs::set_permissions(path, fs::Permissions::from_mode(0o600));
        self.token_file = Some(path.to_path_buf());
        self
    }

    pub fn protect_ports(mut self, ports: &[u16]) -> Config {
        self.protect_ports = Some(ports.to_vec());
        self
    }

    /// `reclaim.mechanism` (`bpf-iter` forces the bpf_sock_destroy fallback).
    pub fn mechanism(mut self, mechanism: &str) -> Config {
        self.mechanism = Some(mechanism.to_string());
        self
    }

    /// The `reclaim.mechanism` set with [`Config::mechanism`], if any.
    pub fn forced_mechanism(&self) -> Option<&str> {
        self.mechanism.as_deref()
    }

    /// One more `[[webhook]]` with `format = "json"`.
    pub fn webhook(mut self, url: &str) -> Config {
        self.webhooks.push(url.to_string());
        self
    }

    /// One more `[[webhook]]` with `format = "alertmanager"` (`url` is Alertmanager's
    /// `/api/v2/alerts`).
    pub fn alertmanager(mut self, url: &str) -> Config {
        self.alertmanagers.push(url.to_string());
        self
    }

    /// Lines for `[alerts]`, e.g. `alertmanager_resend = "2s"`.
    pub fn alerts(mut self, lines: &str) -> Config {
        self.alerts.push(lines.to_string());
        self
    }

    /// Lines for every `[[webhook]]`, e.g. `queue_capacity = 1`.
    pub fn webhook_delivery(mut self, lines: &str) -> Config {
        self.delivery.push(lines.to_string());
        self
    }

    pub fn quota(mut self, quota: RelayQuota) -> Config {
        self.quotas.push(quota);
        self
    }

    /// One `[[policy]]` table, as TOML.
    pub fn policy(mut self, toml: &str) -> Config {
        self.policies.push(toml.to_string());
        self
    }
}

impl fmt::Display for Config {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "[agent]\nlisten = \"{}\"\nscan_interval = \"{}\"",
            self.api(),
            self.scan_interval
        )?;
        if let Some(walk) = &self.netns_walk_interval {
            writeln!(f, "netns_walk_interval = \"{walk}\"")?;
        }
        if let Some(host) = &self.host {
            writeln!(f, "host = \"{host}\"")?;
        }
        if let Some(format) = &self.log_format {
            writeln!(f, "log_format = \"{format}\"")?;
        }
        if let Some(token) = &self.token_file {
            writeln!(f, "\n[api]\ntoken_file = \"{}\"", token.display())?;
        }
        if !self.detect.is_empty() {
            writeln!(f, "\n[detect]\n{}", self.detect.join("\n"))?;
        }
        if !self.alerts.is_empty() {
            writeln!(f, "\n[alerts]")?;
        }
        for lines in &self.alerts {
            writeln!(f, "{lines}")?;
        }
        writeln!(f, "\n[reclaim]")?;
        if let Some(ports) = &self.protect_ports {
            let ports: Vec<String> = ports.iter().map(u16::to_string).collect();
            writeln!(f, "protect_ports = [{}]", ports.join(", "))?;
        }
        if let Some(m) = &self.mechanism {
            writeln!(f, "mechanism = \"{m}\"")?;
        }
        writeln!(f, "audit_log = \"{}\"", self.audit.display())?;
        let mut delivery = self.delivery.clone();
        if self.fast_alerts {
            delivery.insert(0, "max_backoff = \"2s\"\ntimeout = \"2s\"".to_string());
        }
        let hooks = self.webhooks.iter().map(|u| (u, "json"));
        let managers = self.alertmanagers.iter().map(|u| (u, "alertmanager"));
        for (url, format) in hooks.chain(managers) {
            writeln!(f, "\n[[webhook]]\nurl = \"{url}\"\nformat = \"{format}\"")?;
            for lines in &delivery {
                writeln!(f, "{lines}")?;
            }
        }
        for q in &self.quotas {
            write!(f, "\n{q}")?;
        }
        for p in &self.policies {
            write!(f, "\n{p}")?;
        }
        Ok(())
    }
}
