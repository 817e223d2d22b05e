//! The agent under test: `connreap run` in a namespace, its /metrics, and a webhook receiver.
use std::{
    io::{Read as _, Write as _},
    net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream},
    path::{Path, PathBuf},
    process::{Command, Stdio},
    sync::{
        atomic::{AtomicBool, Ordering},
        mpsc, Arc,
    },
    time::{Duration, Instant},
};

use anyhow::{bail, Context, Result};

use crate::{
    proc::{self, Proc},
    sys::{self, NsHandle},
};

pub const LISTEN: &str = "127.0.0.1:9477";

static BIN: std::sync::Mutex<Option<PathBuf>> = std::sync::Mutex::new(None);

/// Copy the built agent to `dir` and use that copy for the whole run: a rebuild by someone else
/// mid-run can then neither mix two builds into one report nor break perf's symbol lookup.
pub fn use_copy_in(dir: &Path) -> Result<()> {
    let copy = dir.join("connreap");
    let _ = std::fs::remove_file(&copy);
    std::fs::copy(crate::agent_bin(), &copy).with_context(|| {
        format!(
            "copy {} to {}",
            crate::agent_bin().display(),
            copy.display()
        )
    })?;
    set_bin(copy);
    Ok(())
}

/// Use this agent binary from now on (the probe-parts measure switches between variants).
pub fn set_bin(path: PathBuf) {
    if let Ok(mut b) = BIN.lock() {
        *b = Some(path);
    }
}

pub fn bin() -> PathBuf {
    BIN.lock()
        .ok()
        .and_then(|b| b.clone())
        .unwrap_or_else(crate::agent_bin)
}

/// `connreap ARGS` on the host (stdout/stderr discarded), failing on a non-zero exit.
pub fn connreap(args: &[&str]) -> Result<()> {
    let st = Command::new(bin())
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .with_context(|| format!("run connreap {}", args.join(" ")))?;
    if !st.success() {
        bail!("connreap {} failed: {st}", args.join(" "));
    }
    Ok(())
}

/// One `connreap snapshot --json ARGS` run in `ns`, parsed.
pub fn snapshot_json(ns: &NsHandle, args: &[&str]) -> Result<serde_json::Value> {
    let out = ns
        .command(bin())
        .args(["snapshot", "--json"])
        .args(args)
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .output()?;
    if !out.status.success() {
        bail!("connreap snapshot --json failed: {}", out.status);
    }
    Ok(serde_json::from_slice(&out.stdout)?)
}

pub fn is_pinned() -> bool {
    std::fs::read_dir("/sys/fs/bpf/connreap").is_ok_and(|mut d| d.next().is_some())
}

/// Puts the pinned tracker back the way the bench found it.
pub struct PinRestore {
    was_pinned: bool,
}

impl PinRestore {
    pub(crate) fn new() -> PinRestore {
        PinRestore {
            was_pinned: is_pinned(),
        }
    }
}

impl Drop for PinRestore {
    fn drop(&mut self) {
        let r = match (self.was_pinned, is_pinned()) {
            (true, false) => connreap(&["snapshot", "--json"]),
            (false, true) => connreap(&["unpin", "--force"]),
            _ => Ok(()),
        };
        if let Err(e) = r {
            eprintln!("bench: warning: cannot restore the pinned tracker: {e:#}");
        }
    }
}

/// One scrape of /metrics.
#[derive(Clone)]
pub struct Scrape(Vec<(String, f64)>);

impl Scrape {
    pub fn parse(text: &str) -> Scrape {
        Scrape(
            text.lines()
                .filter(|l| !l.starts_with('#'))
                .filter_map(|l| {
                    let (k, v) = l.rsplit_once(' ')?;
                    Some((k.to_string(), v.parse().ok()?))
                })
                .collect(),
        )
    }

    /// The series `name` (exactly, or `name{...label...}` when `label` is given).
    pub fn get(&self, name: &str, label: Option<&str>) -> Option<f64> {
        self.0.iter().find_map(|(k, v)| {
            let (n, labels) = k.split_once('{').unwrap_or((k, ""));
            (n == name && label.is_none_or(|l| labels.contains(l))).then_some(*v)
        })
    }

    /// Sum of every series named `name`, whatever its labels.
    pub fn sum(&self, name: &str) -> f64 {
        self.0
            .iter()
            .filter(|(k, _)| k.split_once('{').map_or(k.as_str(), |(n, _)| n) == name)
            .map(|(_, v)| v)
            .sum()
    }

    pub fn scans(&self) -> f64 {
        self.get("connreap_scan_duration_seconds_count", None)
            .unwrap_or(0.0)
    }

    pub fn scan_seconds(&self) -> f64 {
        self.get("connreap_scan_duration_seconds_sum", None)
            .unwrap_or(0.0)
    }

    /// (run_time_ns, runs) of a BPF program.
    pub fn program(&self, prog: &str) -> (f64, f64) {
        let l = format!("program=\"{prog}\"");
        (
            self.get("connreap_bpf_program_run_time_seconds_total", Some(&l))
                .unwrap_or(0.0)
                * 1e9,
            self.get("connreap_bpf_program_runs_total", Some(&l))
                .unwrap_or(0.0),
        )
    }
}

fn dechunk(body: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    let mut rest = body;
    while let Some(i) = rest.windows(2).position(|w| w == b"\r\n") {
        let len =
            usize::from_str_radix(String::from_utf8_lossy(&rest[..i]).trim(), 16).unwrap_or(0);
        rest = &rest[i + 2..];
        if len == 0 || rest.len() < len {
            break;
        }
        out.extend_from_slice(&rest[..len]);
        rest = rest.get(len + 2..).unwrap_or_default();
    }
    out
}

/// Split an HTTP message into (lower-cased head, body), de-chunking the body if needed.
fn split_http(raw: &[u8]) -> Option<(String, Vec<u8>)> {
    let i = raw.windows(4).position(|w| w == b"\r\n\r\n")?;
    let head = String::from_utf8_lossy(&raw[..i]).to_ascii_lowercase();
    let body = &raw[i + 4..];
    let body = if head.contains("transfer-encoding: chunked") {
        dechunk(body)
    } else {
        body.to_vec()
    };
    Some((head, body))
}

/// `GET path` from inside `ns`.
pub fn http_get(ns: &NsHandle, addr: &str, path: &str) -> Result<String> {
    let addr: SocketAddr = addr.parse()?;
    let path = path.to_string();
    ns.run(move || {
        let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(2))?;
        s.set_read_timeout(Some(Duration::from_secs(10)))?;
        write!(
            s,
            "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
        )?;
        let mut raw = Vec::new();
        s.read_to_end(&mut raw)?;
        let (head, body) = split_http(&raw).context("bad HTTP response")?;
        if !head.starts_with("http/1.1 200") {
            bail!("GET {path}: {}", head.lines().next().unwrap_or_default());
        }
        Ok(String::from_utf8_lossy(&body).into_owned())
    })
}

/// `connreap run` inside a namespace with a generated config; stopped (SIGTERM) on drop.
pub struct Daemon {
    proc: Proc,
    ns: NsHandle,
    listen: String,
}

/// A daemon of another build next to the usual one: its binary, API address and pin root
/// (`CONNREAP_PIN_ROOT`, so its tracker does not replace the other's).
pub struct Side<'a> {
    pub bin: PathBuf,
    pub listen: &'a str,
    pub pin_root: &'a Path,
}

/// What a daemon did over a window: its CPU time, /metrics at both ends, VmRSS after each step.
pub struct Window {
    pub user: Duration,
    pub sys: Duration,
    pub wall: Duration,
    pub m0: Scrape,
    pub m1: Scrape,
    /// VmRSS after each step, kB.
    pub rss: Vec<u64>,
}

impl Window {
    pub fn cpu(&self) -> Duration {
        self.user + self.sys
    }

    pub fn scans(&self) -> f64 {
        self.m1.scans() - self.m0.scans()
    }

    /// The seconds its scans took.
    pub fn scan_seconds(&self) -> f64 {
        self.m1.scan_seconds() - self.m0.scan_seconds()
    }
}

impl Daemon {
    /// Observe the daemon over `steps` runs of `step` (a sleep, or waiting for a scan).
    pub fn window(
        &mut self,
        steps: usize,
        mut step: impl FnMut(&mut Daemon) -> Result<()>,
    ) -> Result<Window> {
        let (u0, s0) = proc::cpu_times(self.pid())?;
        let t0 = Instant::now();
        let m0 = self.scrape()?;
        let mut rss = Vec::new();
        for _ in 0..steps {
            step(self)?;
            rss.push(proc::status_kb(self.pid(), "VmRSS")?);
        }
        let (u1, s1) = proc::cpu_times(self.pid())?;
        let wall = t0.elapsed();
        let m1 = self.scrape()?;
        Ok(Window {
            user: u1.saturating_sub(u0),
            sys: s1.saturating_sub(s0),
            wall,
            m0,
            m1,
            rss,
        })
    }

    /// Start with `[agent]` listen + `scan_interval` plus `extra` TOML, and wait for its first
    /// scan. The config and log go to `dir`.
    pub fn start(
        ns: &NsHandle,
        dir: &Path,
        tag: &str,
        scan_interval: &str,
        extra: &str,
    ) -> Result<Daemon> {
        Self::start_as(ns, dir, tag, scan_interval, extra, None)
    }

    /// [`Daemon::start`] for a [`Side`] daemon.
    pub fn start_side(
        ns: &NsHandle,
        dir: &Path,
        tag: &str,
        scan_interval: &str,
        side: &Side,
    ) -> Result<Daemon> {
        Self::start_as(ns, dir, tag, scan_interval, "", Some(side))
    }

    /// [`Daemon::start`] with `extra` TOML for a [`Side`] daemon, or the current one (None).
    pub fn start_as(
        ns: &NsHandle,
        dir: &Path,
        tag: &str,
        scan_interval: &str,
        extra: &str,
        side: Option<&Side>,
    ) -> Result<Daemon> {
        let listen = side.map_or(LISTEN, |s| s.listen).to_string();
        let cfg = dir.join(format!("{tag}.toml"));
        std::fs::write(
            &cfg,
            format!("[agent]\nlisten = \"{listen}\"\nscan_interval = \"{scan_interval}\"\n{extra}"),
        )?;
        let log = std::fs::File::create(dir.join(format!("{tag}.log")))?;
        let mut cmd = ns.command(side.map_or_else(bin, |s| s.bin.clone()));
        if let Some(s) = side {
            cmd.env("CONNREAP_PIN_ROOT", s.pin_root);
        }
        cmd.arg("run")
            .arg("--config")
            .arg(&cfg)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log);
        let mut d = Daemon {
            proc: Proc::spawn(&mut cmd, &format!("connreap run ({tag})"))?,
            ns: ns.clone(),
            listen,
        };
        let end = Instant::now() + Duration::from_secs(60);
        loop {
            d.proc
                .check_alive()
                .with_context(|| format!("see {}", dir.join(format!("{tag}.log")).display()))?;
            if d.scrape().is_ok_and(|s| s.scans() >= 1.0) {
                return Ok(d);
            }
            if Instant::now() > end {
                bail!("connreap run ({tag}) not ready after 60 s");
            }
            sys::sleep(Duration::from_millis(100))?;
        }
    }

    pub fn pid(&self) -> u32 {
        self.proc.pid()
    }

    pub fn scrape(&self) -> Result<Scrape> {
        Ok(Scrape::parse(&http_get(
            &self.ns,
            &self.listen,
            "/metrics",
        )?))
    }

    /// Wait until `n` more scans have completed; the scrape taken then.
    pub fn wait_scans(&mut self, n: f64, timeout: Duration) -> Result<Scrape> {
        let start = self.scrape()?.scans();
        let end = Instant::now() + timeout;
        loop {
            self.proc.check_alive()?;
            let s = self.scrape()?;
            if s.scans() >= start + n {
                return Ok(s);
            }
            if Instant::now() > end {
                bail!("daemon did not complete {n} scans in {timeout:?}");
            }
            sys::sleep(Duration::from_millis(50))?;
        }
    }
}

/// A webhook receiver on 127.0.0.1 inside a namespace: every POST body with its arrival time.
pub struct Receiver {
    pub port: u16,
    rx: mpsc::Receiver<(Instant, serde_json::Value)>,
    stop: Arc<AtomicBool>,
}

fn serve_one(mut s: TcpStream) -> Option<(Instant, serde_json::Value)> {
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    let mut raw = Vec::new();
    let mut buf = [0u8; 8192];
    loop {
        let n = s.read(&mut buf).ok()?;
        if n == 0 {
            break;
        }
        raw.extend_from_slice(&buf[..n]);
        if let Some((head, body)) = split_http(&raw) {
            let len = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .and_then(|v| v.trim().parse::<usize>().ok());
            let complete = match len {
                Some(len) => body.len() >= len,
                None => raw.ends_with(b"0\r\n\r\n"),
            };
            if complete {
                let at = Instant::now();
                let _ = s.write_all(
                    b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
                );
                return Some((at, serde_json::from_slice(&body).ok()?));
            }
        }
    }
    None
}

impl Receiver {
    pub fn start(ns: &NsHandle) -> Result<Receiver> {
        let l = ns.run(|| Ok(TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?))?;
        l.set_nonblocking(true)?;
        let port = l.local_addr()?.port();
        let (tx, rx) = mpsc::channel();
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        std::thread::spawn(move || {
            while !flag.load(Ordering::SeqCst) {
                match l.accept() {
                    Ok((s, _)) => {
                        let _ = s.set_nonblocking(false);
                        if let Some(m) = serve_one(s) {
                            let _ = tx.send(m);
                        }
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(5)),
                }
            }
        });
        Ok(Receiver { port, rx, stop })
    }

    /// The first message matching `pred` within `timeout`.
    pub fn wait(
        &self,
        timeout: Duration,
        pred: impl Fn(&serde_json::Value) -> bool,
    ) -> Result<Option<Instant>> {
        let end = Instant::now() + timeout;
        loop {
            sys::check_interrupted()?;
            let left = end.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Ok(None);
            }
            match self.rx.recv_timeout(left.min(Duration::from_millis(100))) {
                Ok((at, v)) if pred(&v) => return Ok(Some(at)),
                Ok(_) | Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => bail!("webhook receiver stopped"),
            }
        }
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_openmetrics() {
        let s = Scrape::parse(
            "# HELP x y\nconnreap_scan_duration_seconds_count 3\n\
             connreap_bpf_program_run_time_seconds_total{program=\"connreap_set_state\"} 0.0000012\n\
             connreap_bpf_program_runs_total{program=\"connreap_set_state\"} 4\n# EOF\n",
        );
        assert_eq!(s.scans(), 3.0);
        let (ns, runs) = s.program("connreap_set_state");
        assert!((ns - 1200.0).abs() < 1e-6, "{ns}");
        assert_eq!(runs, 4.0);
        assert_eq!(s.program("connreap_iter_tcp"), (0.0, 0.0));
    }

    #[test]
    fn splits_chunked_http() {
        let raw = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n";
        let (head, body) = split_http(raw).unwrap();
        assert!(head.starts_with("http/1.1 200"));
        assert_eq!(body, b"abcde");
    }
}
