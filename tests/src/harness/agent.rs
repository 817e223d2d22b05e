//! `connreap run` inside a test's namespace, and its HTTP API.

use std::{
    fs,
    io::ErrorKind,
    net::SocketAddr,
    path::PathBuf,
    process::{Command, ExitStatus},
    time::Duration,
};

use serde_json::Value;

use super::{
    audit::read_audit,
    config::{Config, TempDir},
    consts::{AGENT_START, HTTP, POLL, SCAN},
    metrics::Metrics,
    netns::NetNs,
    process::{connreap_bin, wait_until, Child},
};
use crate::fixtures::http_request_ns;

/// `connreap run --config FILE` inside a test's namespace (or the host's, see
/// [`Agent::start_in_host`]); killed when dropped.
pub struct Agent {
    child: Child,
    /// The namespace it runs in; `None`: the host's (this test process's).
    ns: Option<String>,
    api: SocketAddr,
    audit: PathBuf,
}

impl Agent {
    /// Writes `config` to `dir/connreap.toml`, starts the agent with it in `ns` and waits until
    /// /healthz answers 200 (BPF loaded, first scan done). Panics with its stderr if it exits
    /// or never gets there.
    pub fn start(ns: &NetNs, dir: &TempDir, config: &Config) -> Agent {
        Agent::start_with(ns, dir, config, |_| {})
    }

    /// [`Agent::start`], with `setup` applied to the command first (environment, resource
    /// limits in a `pre_exec`, ...).
    pub fn start_with(
        ns: &NetNs,
        dir: &TempDir,
        config: &Config,
        setup: impl FnOnce(&mut Command),
    ) -> Agent {
        Agent::launch(Some(ns), dir, config, None, setup)
    }

    /// [`Agent::start_with`] as systemd starts a `Type=notify` service with `WatchdogSec=`:
    /// `NOTIFY_SOCKET=notify`, `WATCHDOG_USEC` and `WATCHDOG_PID` (the agent's own pid: a `sh`
    /// sets it, then execs the agent in its place).
    pub fn start_notify(
        ns: &NetNs,
        dir: &TempDir,
        config: &Config,
        notify: &std::path::Path,
        watchdog: Duration,
        setup: impl FnOnce(&mut Command),
    ) -> Agent {
        Agent::launch(
            Some(ns),
            dir,
            config,
            Some(r#"WATCHDOG_PID=$$ exec "$0" "$@""#),
            |cmd| {
                cmd.env("NOTIFY_SOCKET", notify)
                    .env("WATCHDOG_USEC", watchdog.as_micros().to_string());
                setup(cmd);
            },
        )
    }

    /// [`Agent::start`] in the host's network namespace (this test process's), as connreap
    /// runs in production next to containers. Give the config a free port with
    /// [`Config::listen`]: [`super::API`] may be taken there.
    pub fn start_in_host(dir: &TempDir, config: &Config) -> Agent {
        Agent::start_in_host_with(dir, config, |_| {})
    }

    /// [`Agent::start_in_host`], with `setup` applied to the command first.
    pub fn start_in_host_with(
        dir: &TempDir,
        config: &Config,
        setup: impl FnOnce(&mut Command),
    ) -> Agent {
        Agent::launch(None, dir, config, None, setup)
    }

    /// `sh`: a shell script that execs `"$0" "$@"` (the agent and its arguments) after setting
    /// something only known once the process exists.
    fn launch(
        ns: Option<&NetNs>,
        dir: &TempDir,
        config: &Config,
        sh: Option<&str>,
        setup: impl FnOnce(&mut Command),
    ) -> Agent {
        let path = dir.write("connreap.toml", &config.to_string());
        let program = match sh {
            Some(_) => std::ffi::OsString::from("sh"),
            None => connreap_bin().into(),
        };
        let mut cmd = match ns {
            Some(ns) => ns.command(&program),
            None => Command::new(&program),
        };
        if let Some(script) = sh {
            cmd.args(["-c", script]).arg(connreap_bin());
        }
        cmd.args(["run", "--config"]).arg(&path);
        setup(&mut cmd);
        let mut agent = Agent {
            child: Child::spawn(&mut cmd, "connreap run"),
            ns: ns.map(|n| n.name().to_string()),
            api: config.api(),
            audit: config.audit().to_path_buf(),
        };
        let up = wait_until(AGENT_START, POLL, || {
            agent.assert_alive();
            agent
                .try_get("/healthz")
                .ok()
                .filter(|(code, _)| *code == 200)
        });
        if up.is_none() {
            panic!(
                "connreap run never answered 200 on /healthz within {AGENT_START:?}; stderr:\n{}",
                agent.stderr()
            );
        }
        agent
    }

    pub fn pid(&self) -> u32 {
        self.child.pid()
    }

    /// Send `signal` (e.g. `libc::SIGTERM`) to the agent.
    pub fn signal(&self, signal: i32) {
        self.child.signal(signal);
    }

    /// Wait up to `timeout` for the agent to exit: `Some(status)` once it has.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<ExitStatus> {
        self.child.wait_timeout(timeout)
    }

    /// The agent's API address (inside its namespace).
    pub fn api(&self) -> SocketAddr {
        self.api
    }

    /// SIGKILL: the agent dies without any cleanup, as in a crash.
    pub fn kill(self) {
        self.child.kill();
    }

    pub fn stderr(&self) -> String {
        self.child.stderr()
    }

    /// Panics (with the agent's stderr) if the agent has exited.
    pub fn assert_alive(&mut self) {
        if let Some(status) = self.child.try_wait() {
            std::thread::sleep(Duration::from_millis(100));
            panic!("connreap run exited ({status}); stderr:\n{}", self.stderr());
        }
    }

    /// GET /healthz must answer 200 with status ok, and the process must be running.
    pub fn assert_healthy(&mut self) {
        self.assert_alive();
        let (code, body) = self.get("/healthz");
        assert_eq!(
            (code, body["status"].as_str()),
            (200, Some("ok")),
            "/healthz: {body}; agent stderr:\n{}",
            self.stderr()
        );
    }

    /// `GET path` with a JSON answer: (status, body).
    pub fn try_get(&self, path: &str) -> std::io::Result<(u16, Value)> {
        let r = http_request_ns(self.ns.as_deref(), self.api, "GET", path, &[], &[], HTTP)?;
        let v = r.json().map_err(|e| {
            std::io::Error::new(
                ErrorKind::InvalidData,
                format!("status {} body is not JSON ({e}): {:?}", r.status, r.text()),
            )
        })?;
        Ok((r.status, v))
    }

    /// [`Agent::try_get`], panicking (with the agent's stderr) when the request fails.
    pub fn get(&self, path: &str) -> (u16, Value) {
        self.try_get(path).unwrap_or_else(|e| {
            panic!(
                "GET {path} on the agent failed: {e}; agent stderr:\n{}",
                self.stderr()
            )
        })
    }

    /// The body of `GET path`, which must answer 200.
    pub fn get_ok(&self, path: &str) -> Value {
        let (code, body) = self.get(path);
        assert_eq!(code, 200, "GET {path}: {body}");
        body
    }

    /// Completed scans, from /healthz.
    pub fn scans(&self) -> u64 {
        let (_, h) = self.get("/healthz");
        h["scans"]
            .as_u64()
            .unwrap_or_else(|| panic!("/healthz without scans: {h}"))
    }

    /// Wait until the agent has completed `n` more scans (and reclaim rounds).
    pub fn wait_scans(&self, n: u64) {
        let target = self.scans() + n;
        wait_until(SCAN * (n as u32 + 5), POLL, || {
            (self.scans() >= target).then_some(())
        })
        .unwrap_or_else(|| panic!("the agent stopped scanning:\n{}", self.ctx()));
    }

    /// The current findings (`GET /v1/findings`).
    pub fn findings(&self) -> Vec<Value> {
        let body = self.get_ok("/v1/findings");
        body["findings"]
            .as_array()
            .unwrap_or_else(|| panic!("/v1/findings has no `findings` array: {body}"))
            .clone()
    }

    /// The current finding of `kind` matching `pred`, if any.
    pub fn find(&self, kind: &str, pred: impl Fn(&Value) -> bool) -> Option<Value> {
        self.findings()
            .into_iter()
            .find(|f| f["kind"] == kind && pred(f))
    }

    /// `GET /metrics`, which must answer 200 with a well-formed exposition.
    pub fn metrics(&self) -> Metrics {
        let r = http_request_ns(
            self.ns.as_deref(),
            self.api,
            "GET",
            "/metrics",
            &[],
            &[],
            HTTP,
        )
        .unwrap_or_else(|e| panic!("GET /metrics failed: {e}"));
        let (code, text) = (r.status, r.text());
        assert_eq!(code, 200, "/metrics: {text}");
        Metrics::parse(&text).unwrap_or_else(|e| panic!("/metrics: {e}\n{text}"))
    }

    /// The value of one series (`name{labels}`) in /metrics, if present.
    pub fn metric(&self, series: &str) -> Option<f64> {
        self.metrics().value(series)
    }

    /// `POST /v1/reclaim` with `body`, with `Authorization: Bearer TOKEN` when given.
    pub fn post_reclaim(&self, token: Option<&str>, body: &Value) -> (u16, Value) {
        let auth = token.map(|t| format!("Bearer {t}"));
        let mut headers = vec![("Content-Type", "application/json")];
        if let Some(a) = &auth {
            headers.push(("Authorization", a.as_str()));
        }
        let r = http_request_ns(
            self.ns.as_deref(),
            self.api,
            "POST",
            "/v1/reclaim",
            &headers,
            body.to_string().as_bytes(),
            Duration::from_secs(15),
        )
        .unwrap_or_else(|e| panic!("POST /v1/reclaim: {e}"));
        let v = r.json().unwrap_or(Value::Null);
        (r.status, v)
    }

    /// Every line of the audit log so far, parsed (see [`read_audit`]).
    pub fn audit(&self) -> Vec<Value> {
        read_audit(&self.audit)
    }

    /// The audit log's and the agent's stderr's last lines, for failure messages.
    pub fn ctx(&self) -> String {
        let audit = match fs::read_to_string(&self.audit) {
            Ok(t) => t,
            Err(e) if e.kind() == ErrorKind::NotFound => String::new(),
            Err(e) => format!("(cannot read: {e})"),
        };
        format!(
            "--- audit log {} (last 60 lines):\n{}\n--- agent stderr (last 40 lines):\n{}",
            self.audit.display(),
            tail(&audit, 60),
            tail(&self.stderr(), 40)
        )
    }
}

fn tail(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}
