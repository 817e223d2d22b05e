//! OS plumbing for the bench: network namespaces, sysctls, child processes, the e2e lock and
//! /proc readers. Everything that changes the host is a guard that undoes it on drop, so an
//! error (or Ctrl-C, which only sets a flag that every wait checks) still cleans up.
use std::{
    ffi::OsStr,
    fs::File,
    os::{fd::AsRawFd, unix::process::CommandExt},
    path::{Path, PathBuf},
    process::Command,
    sync::{
        atomic::{AtomicBool, AtomicUsize, Ordering},
        Arc,
    },
    thread,
    time::{Duration, Instant},
};

use anyhow::{bail, Context, Result};

static INTERRUPTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    INTERRUPTED.store(true, Ordering::SeqCst);
}

/// SIGINT/SIGTERM only set a flag: the bench then fails at its next wait and the guards clean up.
pub fn install_signal_handlers() {
    let handler = on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
    // SAFETY: the handler only stores to an atomic (async-signal-safe).
    unsafe {
        libc::signal(libc::SIGINT, handler);
        libc::signal(libc::SIGTERM, handler);
    }
}

pub fn interrupted() -> bool {
    INTERRUPTED.load(Ordering::SeqCst)
}

pub fn check_interrupted() -> Result<()> {
    if interrupted() {
        bail!("interrupted");
    }
    Ok(())
}

/// Sleep in small steps, failing early on Ctrl-C.
pub fn sleep(d: Duration) -> Result<()> {
    let end = Instant::now() + d;
    while let Some(left) = end.checked_duration_since(Instant::now()) {
        check_interrupted()?;
        thread::sleep(left.min(Duration::from_millis(50)));
    }
    check_interrupted()
}

/// Poll `f` until it returns `Some`, failing with `what` after `timeout`.
pub fn wait_for<T>(what: &str, timeout: Duration, mut f: impl FnMut() -> Option<T>) -> Result<T> {
    let end = Instant::now() + timeout;
    loop {
        if let Some(v) = f() {
            return Ok(v);
        }
        if Instant::now() > end {
            bail!("timed out after {timeout:?} waiting for {what}");
        }
        sleep(Duration::from_millis(100))?;
    }
}

const NS_PREFIX: &str = "crbench-";
static NS_COUNTER: AtomicUsize = AtomicUsize::new(0);

/// A handle on a network namespace: enter it in a thread or a child process.
#[derive(Clone)]
pub struct NsHandle(Arc<File>);

fn setns(f: &File) -> std::io::Result<()> {
    // SAFETY: setns(2) on an open namespace fd; affects only the calling thread.
    if unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) } == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

impl NsHandle {
    /// The calling thread's own namespace.
    pub fn current() -> Result<NsHandle> {
        let f = File::open("/proc/thread-self/ns/net").context("open /proc/thread-self/ns/net")?;
        Ok(NsHandle(Arc::new(f)))
    }

    /// `program` started inside the namespace (network namespace only, like `nsenter --net`).
    pub fn command(&self, program: impl AsRef<OsStr>) -> Command {
        let mut cmd = Command::new(program);
        let f = self.0.clone();
        // SAFETY: setns is async-signal-safe; the closure owns the fd (O_CLOEXEC).
        unsafe { cmd.pre_exec(move || setns(&f)) };
        cmd
    }

    /// Move the calling thread into the namespace.
    pub fn enter(&self) -> Result<()> {
        setns(&self.0).context("setns")
    }

    /// Run `f` on a new thread inside the namespace (sockets it creates belong there).
    pub fn spawn<T: Send + 'static>(
        &self,
        f: impl FnOnce() -> Result<T> + Send + 'static,
    ) -> thread::JoinHandle<Result<T>> {
        let ns = self.0.clone();
        thread::spawn(move || {
            setns(&ns).context("setns")?;
            f()
        })
    }

    pub fn run<T: Send + 'static>(
        &self,
        f: impl FnOnce() -> Result<T> + Send + 'static,
    ) -> Result<T> {
        self.spawn(f)
            .join()
            .map_err(|_| anyhow::anyhow!("namespace thread panicked"))?
    }
}

/// A network namespace `crbench-<pid>-<n>-<tag>` with `lo` up, deleted on drop.
pub struct NetNs {
    name: String,
    handle: NsHandle,
}

fn ip(args: &[&str]) -> Result<()> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .context("cannot run `ip`")?;
    if !out.status.success() {
        bail!(
            "`ip {}` failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}

impl NetNs {
    pub fn new(tag: &str) -> Result<NetNs> {
        let n = NS_COUNTER.fetch_add(1, Ordering::Relaxed);
        let name = format!("{NS_PREFIX}{}-{n}-{tag}", std::process::id());
        ip(&["netns", "add", &name])?;
        let file = File::open(format!("/run/netns/{name}"));
        let ns = NetNs {
            handle: NsHandle(Arc::new(
                file.with_context(|| format!("open netns {name}"))?,
            )),
            name,
        };
        ip(&["-n", &ns.name, "link", "set", "lo", "up"])?;
        Ok(ns)
    }

    pub fn handle(&self) -> NsHandle {
        self.handle.clone()
    }

    /// Its name under /run/netns.
    pub fn name(&self) -> &str {
        &self.name
    }
}

impl Drop for NetNs {
    fn drop(&mut self) {
        if ip(&["netns", "del", &self.name]).is_err() {
            eprintln!("bench: warning: could not delete netns {}", self.name);
        }
    }
}

/// Delete namespaces left by bench processes that died without cleaning up.
pub fn remove_stale_namespaces() {
    let Ok(entries) = std::fs::read_dir("/run/netns") else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(pid) = name
            .strip_prefix(NS_PREFIX)
            .and_then(|r| r.split('-').next())
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        if !Path::new(&format!("/proc/{pid}")).exists() {
            eprintln!("bench: removing stale namespace {name}");
            let _ = ip(&["netns", "del", &name]);
        }
    }
}

/// A sysctl set for the bench, restored to its old value on drop.
pub struct Sysctl {
    path: PathBuf,
    old: String,
}

impl Sysctl {
    pub fn set(name: &str, value: &str) -> Result<Sysctl> {
        let path = PathBuf::from("/proc/sys").join(name.replace('.', "/"));
        let old = std::fs::read_to_string(&path).with_context(|| format!("read {name}"))?;
        std::fs::write(&path, value).with_context(|| format!("set {name}={value}"))?;
        Ok(Sysctl {
            path,
            old: old.trim().to_string(),
        })
    }
}

impl Drop for Sysctl {
    fn drop(&mut self) {
        if let Err(e) = std::fs::write(&self.path, &self.old) {
            eprintln!(
                "bench: warning: cannot restore {}: {e}",
                self.path.display()
            );
        }
    }
}

/// The lock the privileged e2e tests hold while they run: they share the pinned tracker, which
/// the bench unpins. Held until dropped.
pub struct E2eLock(#[allow(dead_code)] File);

pub fn e2e_lock(wait: Duration) -> Result<(E2eLock, bool)> {
    let path = "/tmp/connreap-e2e.lock";
    let f = File::options()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path)
        .with_context(|| format!("open {path}"))?;
    let mut waited = false;
    let end = Instant::now() + wait;
    // SAFETY: flock on a file we own.
    while unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        if !waited {
            eprintln!("bench: e2e tests hold {path}; waiting for them (up to {wait:?})");
            waited = true;
        }
        if Instant::now() > end {
            bail!("{path} still held after {wait:?}: e2e tests are running");
        }
        sleep(Duration::from_secs(1))?;
    }
    Ok((E2eLock(f), waited))
}

/// What else is running that skews the numbers (empty when quiet).
pub fn busy() -> Vec<String> {
    let mut out = Vec::new();
    for (args, what) in [
        (&["-f", "connreap-tests"][..], "connreap-tests"),
        (&["-f", "cargo test"][..], "cargo test"),
        (&["-x", "rustc"][..], "rustc"),
    ] {
        let n = Command::new("pgrep")
            .args(args)
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).lines().count())
            .unwrap_or(0);
        if n > 0 {
            out.push(format!("{n} `{what}` process(es)"));
        }
    }
    out
}

pub fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

/// (all, steal) CPU ticks since boot from /proc/stat: steal is time the hypervisor ran
/// something else while this VM wanted the CPU.
pub fn cpu_ticks() -> (u64, u64) {
    let s = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let f: Vec<u64> = s
        .lines()
        .next()
        .unwrap_or_default()
        .split_whitespace()
        .skip(1)
        .filter_map(|v| v.parse().ok())
        .collect();
    (f.iter().take(8).sum(), f.get(7).copied().unwrap_or(0))
}
