//! One network namespace per test.

use std::{
    ffi::OsStr,
    fs::File,
    os::{fd::AsRawFd, unix::process::CommandExt},
    path::Path,
    process::{Command, Stdio},
    sync::{
        atomic::{AtomicUsize, Ordering},
        Arc,
    },
};

use super::process::connreap_bin;

/// A network namespace `cr-<name>-<pid>-<n>` with `lo` up, deleted on drop.
pub struct NetNs {
    name: String,
    /// Open handle on /run/netns/<name>, shared with commands that enter it.
    handle: Arc<File>,
}

static NS_COUNTER: AtomicUsize = AtomicUsize::new(0);

/// `ip ARGS`, which must succeed (the test fails naming the command and its stderr).
pub fn ip(args: &[&str]) {
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
