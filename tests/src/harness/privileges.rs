//! Whether a privileged test can run, and the lock that runs them one at a time.

use std::{
    fs::File,
    os::fd::AsRawFd,
    path::Path,
    process::{Command, Stdio},
};

const BTF: &str = "/sys/kernel/btf/vmlinux";
const LOCK_FILE: &str = "/tmp/connreap-e2e.lock";

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
    let asked = std::time::Instant::now();
    // SAFETY: flock on a file we own; the lock is released when `lock` is closed.
    if unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX) } != 0 {
        panic!("flock {LOCK_FILE}: {}", std::io::Error::last_os_error());
    }
    // Other runs (other checkouts) hold it too: say so when a test's time went into waiting.
    if asked.elapsed() >= std::time::Duration::from_secs(1) {
        println!("waited {:?} for {LOCK_FILE}", asked.elapsed());
    }
    Some(Privileged { _lock: lock })
}
