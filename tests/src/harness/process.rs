//! The programs under test and the fixture processes: where they are, starting them (inside a
//! namespace), waiting for them, and bounded polling.

use std::{
    collections::BTreeSet,
    io::{BufRead, BufReader, Read},
    path::{Path, PathBuf},
    process::{Command, ExitStatus, Stdio},
    sync::{mpsc, Arc, Mutex},
    thread,
    time::{Duration, Instant},
};

use super::{consts::READY_TIMEOUT, consts::TESTPEER, netns::NetNs};
use crate::fixtures::ReadyChild;

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

/// A fixture program of this crate ([`TESTPEER`], [`super::INSTANCE_SIM`], ...). Cargo builds a
/// package's binaries with its integration tests and puts them next to the `deps/` directory
/// the test executable runs from (the `CARGO_BIN_EXE_<name>` it gives the tests points there
/// too, but only the test crate itself sees that variable, not this library).
pub fn program(name: &str) -> PathBuf {
    let exe = std::env::current_exe().unwrap_or_else(|e| panic!("current_exe: {e}"));
    let path = exe
        .parent()
        .and_then(Path::parent)
        .map(|dir| dir.join(name))
        .unwrap_or_else(|| panic!("no target directory above {}", exe.display()));
    assert!(
        path.is_file(),
        "fixture program {name} not found at {} (cargo builds it with the tests)",
        path.display()
    );
    path
}

/// Whether `pid` runs. A child that died but was not reaped yet is a zombie: state `Z` after
/// the `(comm)` field of /proc/PID/stat.
pub fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            s.rsplit_once(')')
                .map(|(_, rest)| !rest.trim_start().starts_with('Z'))
        })
        .unwrap_or(false)
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

/// Start `connreap-testpeer ARGS` in `ns` and wait for its `ready` line.
pub fn peer(ns: &NetNs, args: &[&str]) -> (Child, Ready) {
    let mut cmd = ns.command(program(TESTPEER));
    cmd.args(args);
    let mut child = Child::spawn(&mut cmd, &format!("connreap-testpeer {}", args.join(" ")));
    let ready = child.wait_ready(READY_TIMEOUT);
    (child, ready)
}

/// Start the fixture program `name ARGS` in `ns` and wait until it printed `ready`.
pub fn spawn_ready(ns: &NetNs, name: &str, args: &[&str]) -> ReadyChild {
    ReadyChild::spawn_in_netns(ns.name(), program(name), args, READY_TIMEOUT)
        .unwrap_or_else(|e| panic!("cannot start {name} {args:?}: {e}"))
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

    /// Send `signal` (e.g. `libc::SIGTERM`) to the process; panics if it cannot be sent.
    pub fn signal(&self, signal: i32) {
        let pid = libc::pid_t::try_from(self.pid()).expect("pid fits pid_t");
        // SAFETY: kill(2) on our own child, which is not reaped yet (so the pid is still ours).
        if unsafe { libc::kill(pid, signal) } != 0 {
            panic!(
                "kill({pid}, {signal}) for {}: {}",
                self.what,
                std::io::Error::last_os_error()
            );
        }
    }

    /// Wait up to `timeout` for the process to exit: `Some(status)` once it has (reaped).
    pub fn wait_timeout(&mut self, timeout: Duration) -> Option<ExitStatus> {
        wait_until(timeout, Duration::from_millis(10), || self.try_wait())
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

    /// The comma-separated `locals=` field: the local address of each socket a testpeer made.
    pub fn locals(&self) -> BTreeSet<String> {
        self.get("locals").split(',').map(str::to_string).collect()
    }
}
