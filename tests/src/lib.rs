//! Harness for connreap's privileged end-to-end tests (in the style of aya's
//! `test/integration-test`): real kernel, real sockets, one network namespace per test.
//!
//! A test starts with
//! ```ignore
//! let Some(_env) = connreap_tests::require_privileges() else { return };
//! let ns = connreap_tests::NetNs::new("snap");
//! ```
//! and then spawns helper processes (`connreap-testpeer`) and `connreap` inside `ns`.
//!
//! Processes enter a namespace with `setns(2)` only (like `nsenter --net`), not with
//! `ip netns exec`: that one also unshares the mount namespace and remounts `/sys`, which hides
//! the host's bpffs at `/sys/fs/bpf`. connreap would then mount a private bpffs, its pinned state
//! tracker would die with the process, and no age would ever be exact.
use std::{
    ffi::OsStr,
    fs::File,
    io::{BufRead, BufReader, Read},
    os::{fd::AsRawFd, unix::process::CommandExt},
    path::{Path, PathBuf},
    process::{Command, ExitStatus, Stdio},
    sync::{
        atomic::{AtomicUsize, Ordering},
        mpsc, Arc, Mutex,
    },
    thread,
    time::{Duration, Instant},
};

use serde::Deserialize;
use serde_json::Value;

/// Where connreap pins its state tracker (removed by `connreap unpin`).
pub const PIN_ROOT: &str = "/sys/fs/bpf/connreap";
const BTF: &str = "/sys/kernel/btf/vmlinux";
const LOCK_FILE: &str = "/tmp/connreap-e2e.lock";
/// Upper bound for one `connreap` run.
pub const CONNREAP_TIMEOUT: Duration = Duration::from_secs(30);

/// Held for the duration of a privileged test: serializes tests (threads and processes), since
/// they share the host-wide pinned state tracker and `connreap unpin` resets it.
pub struct Privileged {
    _lock: File,
}

fn is_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true" || v == "1")
}

fn has_ip() -> bool {
    Command::new("ip")
        .arg("-V")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// `Some` when the test can run. Otherwise prints `skipped: <reason>` and returns `None`, and the
/// test returns early. Under `CI=true` a missing root or `ip` fails the test instead: CI runs as
/// root with iproute2 installed, so a skip there would hide that nothing ran.
pub fn require_privileges() -> Option<Privileged> {
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    let reason = if !root {
        Some(("not running as root (connreap loads BPF programs)", true))
    } else if !has_ip() {
        Some(("`ip` (iproute2) not found", true))
    } else if !Path::new(BTF).exists() {
        Some(("kernel BTF missing at /sys/kernel/btf/vmlinux", false))
    } else {
        None
    };
    if let Some((reason, fatal_in_ci)) = reason {
        if fatal_in_ci && is_ci() {
            panic!("CI=true but privileged tests cannot run: {reason}");
        }
        println!("skipped: {reason}");
        return None;
    }
    let lock = File::options()
        .create(true)
        .truncate(false)
        .write(true)
        .open(LOCK_FILE)
        .unwrap_or_else(|e| panic!("cannot open {LOCK_FILE}: {e}"));
    // SAFETY: flock on a file we own; the lock is released when `lock` is closed.
    if unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX) } != 0 {
        panic!("flock {LOCK_FILE}: {}", std::io::Error::last_os_error());
    }
    Some(Privileged { _lock: lock })
}

/// The connreap binary under test: `$CONNREAP_BIN`, else `<workspace>/target/release/connreap`.
pub fn connreap_bin() -> PathBuf {
    let path = std::env::var_os("CONNREAP_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../target/release/connreap")
                .components()
                .collect()
        });
    assert!(
        path.is_file(),
        "connreap binary not found at {} (run `cargo xtask build`, or set CONNREAP_BIN)",
        path.display()
    );
    path
}

/// A network namespace `cr-<name>-<pid>-<n>` with `lo` up, deleted on drop.
pub struct NetNs {
    name: String,
    /// Open handle on /run/netns/<name>, shared with commands that enter it.
    handle: Arc<File>,
}

static NS_COUNTER: AtomicUsize = AtomicUsize::new(0);

fn ip(args: &[&str]) {
    let out = Command::new("ip")
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("cannot run `ip`: {e}"));
    assert!(
        out.status.success(),
        "`ip {}` failed ({}): {}",
        args.join(" "),
        out.status,
        String::from_utf8_lossy(&out.stderr).trim()
    );
}

/// Delete namespaces left by earlier test processes that died without cleaning up.
fn remove_stale_namespaces() {
    let Ok(entries) = std::fs::read_dir("/run/netns") else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(rest) = name.strip_prefix("cr-") else {
            continue;
        };
        let mut parts = rest.rsplitn(3, '-');
        let (_n, pid) = (parts.next(), parts.next());
        if let Some(pid) = pid.and_then(|p| p.parse::<u32>().ok()) {
            if !Path::new(&format!("/proc/{pid}")).exists() {
                let _ = Command::new("ip").args(["netns", "del", &name]).status();
            }
        }
    }
}

impl NetNs {
    pub fn new(name: &str) -> NetNs {
        remove_stale_namespaces();
        let n = NS_COUNTER.fetch_add(1, Ordering::Relaxed);
        let name = format!("cr-{name}-{}-{n}", std::process::id());
        ip(&["netns", "add", &name]);
        let path = format!("/run/netns/{name}");
        let handle = match File::open(&path) {
            Ok(f) => Arc::new(f),
            Err(e) => {
                let _ = Command::new("ip").args(["netns", "del", &name]).status();
                panic!("cannot open {path}: {e}");
            }
        };
        let ns = NetNs { name, handle };
        ip(&["-n", &ns.name, "link", "set", "lo", "up"]);
        ns
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// A command that runs `program` inside this namespace (network namespace only: mounts,
    /// including /sys/fs/bpf, stay the host's).
    pub fn command(&self, program: impl AsRef<OsStr>) -> Command {
        let mut cmd = Command::new(program);
        let handle = Arc::clone(&self.handle);
        // SAFETY: setns(2) is a plain syscall, async-signal-safe; the fd stays open because the
        // closure owns a reference to the file (O_CLOEXEC: the program does not inherit it).
        unsafe {
            cmd.pre_exec(move || {
                if libc::setns(handle.as_raw_fd(), libc::CLONE_NEWNET) == 0 {
                    Ok(())
                } else {
                    Err(std::io::Error::last_os_error())
                }
            });
        }
        cmd
    }

    /// `connreap ARGS` inside this namespace.
    pub fn connreap<I, S>(&self, args: I) -> Command
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        let mut cmd = self.command(connreap_bin());
        cmd.args(args);
        cmd
    }
}

impl Drop for NetNs {
    fn drop(&mut self) {
        let ok = Command::new("ip")
            .args(["netns", "del", &self.name])
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if !ok {
            eprintln!("warning: could not delete network namespace {}", self.name);
        }
    }
}

/// Output of a finished command.
#[derive(Debug)]
pub struct Output {
    pub status: ExitStatus,
    pub stdout: String,
    pub stderr: String,
}

fn drain(r: impl Read + Send + 'static) -> thread::JoinHandle<String> {
    thread::spawn(move || {
        let mut buf = Vec::new();
        let _ = BufReader::new(r).read_to_end(&mut buf);
        String::from_utf8_lossy(&buf).into_owned()
    })
}

/// Run `cmd` to completion; kill it and panic after `timeout`.
pub fn run(cmd: &mut Command, timeout: Duration) -> Output {
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {cmd:?}: {e}"));
    let out = drain(child.stdout.take().expect("piped stdout"));
    let err = drain(child.stderr.take().expect("piped stderr"));
    let deadline = Instant::now() + timeout;
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if Instant::now() < deadline => thread::sleep(Duration::from_millis(20)),
            Ok(None) => {
                let _ = child.kill();
                let _ = child.wait();
                panic!(
                    "{cmd:?} still running after {timeout:?}; stderr: {}",
                    err.join().unwrap_or_default()
                );
            }
            Err(e) => panic!("waiting for {cmd:?}: {e}"),
        }
    };
    Output {
        status,
        stdout: out.join().unwrap_or_default(),
        stderr: err.join().unwrap_or_default(),
    }
}

/// `connreap snapshot --json ARGS` inside `ns`, parsed. Panics (with stderr) when it fails.
pub fn snapshot(ns: &NetNs, args: &[&str]) -> Value {
    let mut cmd = ns.connreap(["snapshot", "--json"]);
    cmd.args(args);
    let out = run(&mut cmd, CONNREAP_TIMEOUT);
    assert!(
        out.status.success(),
        "`connreap snapshot --json {}` failed ({}):\n{}",
        args.join(" "),
        out.status,
        out.stderr
    );
    serde_json::from_str(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "`connreap snapshot --json {}` printed invalid JSON ({e}):\n{}\nstderr:\n{}",
            args.join(" "),
            out.stdout,
            out.stderr
        )
    })
}

/// One entry of `sockets` in `connreap snapshot --json`. Owner fields are absent when no
/// process holds the socket.
#[derive(Debug, Clone, Deserialize)]
pub struct SocketRow {
    pub pid: Option<u32>,
    pub comm: Option<String>,
    pub fd: Option<u32>,
    pub unit: Option<String>,
    pub local: String,
    pub peer: String,
    pub state: String,
    pub age_secs: f64,
    pub age_exact: bool,
    pub idle_secs: Option<f64>,
    pub last_recv_secs: Option<f64>,
    pub last_send_secs: Option<f64>,
    pub rx_queue: u32,
    pub tx_queue: u32,
    pub inode: u64,
    pub cookie: Option<u64>,
    pub uid: u32,
    pub direction: String,
    pub service_port: u16,
}

impl SocketRow {
    pub fn local_port(&self) -> u16 {
        port_of(&self.local)
    }
    pub fn peer_port(&self) -> u16 {
        port_of(&self.peer)
    }
}

fn port_of(addr: &str) -> u16 {
    addr.rsplit_once(':')
        .and_then(|(_, p)| p.parse().ok())
        .unwrap_or_else(|| panic!("address without a port: {addr}"))
}

/// One entry of `summary`.
#[derive(Debug, Clone, Deserialize)]
pub struct GroupRow {
    pub pid: Option<u32>,
    pub comm: String,
    pub unit: Option<String>,
    pub service_port: u16,
    pub state: String,
    pub count: usize,
    pub oldest_age_secs: f64,
    pub oldest_age_exact: bool,
    pub idle_count: usize,
}

/// The `sockets` of a snapshot, typed (panics if the JSON does not have the documented shape).
pub fn sockets(snap: &Value) -> Vec<SocketRow> {
    serde_json::from_value(snap["sockets"].clone())
        .unwrap_or_else(|e| panic!("bad `sockets` in snapshot ({e}):\n{snap:#}"))
}

/// The `summary` of a snapshot, typed.
pub fn summary(snap: &Value) -> Vec<GroupRow> {
    serde_json::from_value(snap["summary"].clone())
        .unwrap_or_else(|e| panic!("bad `summary` in snapshot ({e}):\n{snap:#}"))
}

/// Poll `check` every `poll` until it returns `Some`, or `None` once `timeout` has passed.
pub fn wait_until<T>(
    timeout: Duration,
    poll: Duration,
    mut check: impl FnMut() -> Option<T>,
) -> Option<T> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = check() {
            return Some(v);
        }
        if Instant::now() >= deadline {
            return None;
        }
        thread::sleep(poll);
    }
}

/// A spawned helper process, killed (SIGKILL) and reaped on drop. Its stdout is read line by line
/// (for [`Child::wait_ready`]) and its stderr collected for error messages.
pub struct Child {
    inner: std::process::Child,
    what: String,
    lines: mpsc::Receiver<String>,
    stderr: Arc<Mutex<String>>,
}

impl Child {
    /// Spawn `cmd` with stdout and stderr piped; `what` names it in messages.
    pub fn spawn(cmd: &mut Command, what: &str) -> Child {
        let mut inner = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {what} ({cmd:?}): {e}"));
        let (tx, lines) = mpsc::channel();
        let stdout = inner.stdout.take().expect("piped stdout");
        thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let stderr = Arc::new(Mutex::new(String::new()));
        let sink = Arc::clone(&stderr);
        let err = inner.stderr.take().expect("piped stderr");
        thread::spawn(move || {
            for line in BufReader::new(err).lines() {
                let Ok(line) = line else { break };
                let mut s = sink.lock().unwrap_or_else(|e| e.into_inner());
                s.push_str(&line);
                s.push('\n');
            }
        });
        Child {
            inner,
            what: what.to_string(),
            lines,
            stderr,
        }
    }

    pub fn pid(&self) -> u32 {
        self.inner.id()
    }

    /// What the process wrote to stderr so far.
    pub fn stderr(&self) -> String {
        self.stderr
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Wait for a stdout line starting with `ready`; returns its `key=value` fields. Panics on
    /// timeout or if the process exits first.
    pub fn wait_ready(&mut self, timeout: Duration) -> Ready {
        let deadline = Instant::now() + timeout;
        let mut other = Vec::new();
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) if line == "ready" || line.starts_with("ready ") => {
                    return Ready::parse(&line)
                }
                Ok(line) => other.push(line),
                Err(mpsc::RecvTimeoutError::Timeout) => panic!(
                    "{} (pid {}) not ready after {timeout:?}; stdout: {other:?}; stderr: {}",
                    self.what,
                    self.pid(),
                    self.stderr()
                ),
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    let status = self.inner.wait();
                    // Give the stderr reader a moment to collect the last words.
                    thread::sleep(Duration::from_millis(50));
                    panic!(
                        "{} exited before it was ready ({status:?}); stdout: {other:?}; stderr: {}",
                        self.what,
                        self.stderr()
                    );
                }
            }
        }
    }

    /// `Some(status)` once the process has exited (reaped), `None` while it runs.
    pub fn try_wait(&mut self) -> Option<ExitStatus> {
        self.inner.try_wait().ok().flatten()
    }

    /// Kill (SIGKILL) and reap now.
    pub fn kill(mut self) {
        self.stop();
    }

    fn stop(&mut self) {
        let _ = self.inner.kill();
        let _ = self.inner.wait();
    }
}

impl Drop for Child {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The fields of a `ready key=value ...` line.
#[derive(Debug, Clone)]
pub struct Ready {
    pub line: String,
    fields: Vec<(String, String)>,
}

impl Ready {
    fn parse(line: &str) -> Ready {
        let fields = line
            .split_whitespace()
            .skip(1)
            .filter_map(|kv| kv.split_once('='))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Ready {
            line: line.to_string(),
            fields,
        }
    }

    /// The value of `key`; panics if the line has none.
    pub fn get(&self, key: &str) -> &str {
        self.fields
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
            .unwrap_or_else(|| panic!("no `{key}=` in ready line `{}`", self.line))
    }
}

pub mod fixtures;
