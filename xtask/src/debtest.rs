//! The .deb on this machine (root, Debian; `cargo xtask test` runs it after the end-to-end
//! tests): lintian reports no error or warning (installed with apt when missing), `dpkg -i`, every file in place and the unit enabled, `connreap snapshot` prints the
//! table, `systemd-analyze verify` accepts the installed unit, a reinstall (the upgrade path)
//! keeps a locally edited conffile and the pinned tracker, `dpkg -r` removes the program and
//! unpins, and `dpkg --purge` leaves nothing behind but the audit log.
use std::{
    fs::{self, File, OpenOptions},
    io::Write,
    os::{fd::AsRawFd, unix::fs::PermissionsExt},
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

use anyhow::{bail, Context, Result};

use crate::dist::{CONFFILE, PACKAGED};

const PKG: &str = "connreap";
const BIN: &str = "/usr/bin/connreap";
const UNIT: &str = "/usr/lib/systemd/system/connreap.service";
const ENABLED: &str = "/etc/systemd/system/multi-user.target.wants/connreap.service";
const PINS: &str = "/sys/fs/bpf/connreap";
const STATE_DIR: &str = "/var/lib/connreap";
const AUDIT: &str = "/var/lib/connreap/audit.jsonl";
/// Stands for anything else connreap might leave in its state directory: purge removes it.
const STRAY: &str = "/var/lib/connreap/left-by-the-package-test";
/// The end-to-end tests' lock: `connreap snapshot` replaces the host's pinned tracker.
const E2E_LOCK: &str = "/tmp/connreap-e2e.lock";

/// Made by installing or using the package, not listed by `dpkg -L`: purge removes them all.
const RUNTIME_PATHS: &[&str] = &[
    ENABLED,
    "/var/lib/systemd/deb-systemd-helper-enabled/connreap.service.dsh-also",
    "/var/lib/systemd/deb-systemd-helper-enabled/multi-user.target.wants/connreap.service",
    PINS,
    "/run/lock/connreap.load.lock",
    "/run/lock/connreap.reclaim.lock",
    "/etc/connreap",
];

pub fn run(deb: &Path) -> Result<()> {
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        bail!("the package test installs the .deb: it needs root");
    }
    if let Some(s) = status() {
        bail!("package {PKG} is already on this machine ({s}); the package test installs and purges it: `dpkg --purge {PKG}` first");
    }
    if Path::new(STATE_DIR).exists() {
        bail!("{STATE_DIR} exists (a connreap ran here with the default audit log): the package test checks what purging leaves there; move it away first");
    }
    lintian(deb)?;
    let _lock = e2e_lock()?;
    let _cleanup = Cleanup;
    dpkg(&["--install"], Some(deb))?;
    let files = listed_files()?;
    check_installed(&files)?;
    check_use()?;
    check_reinstall(deb)?;
    check_remove()?;
    check_purge(&files)?;
    eprintln!(
        "xtask: package test passed ({}: installed, snapshot, unit verified, reinstalled, removed, purged)",
        deb.display()
    );
    Ok(())
}

/// `lintian` on the package: no error and no warning (informational tags are shown, not
/// fatal).
fn lintian(deb: &Path) -> Result<()> {
    if !Path::new("/usr/bin/lintian").exists() {
        eprintln!("xtask: installing lintian with apt (the package test)");
        crate::run(Command::new("apt-get").args(["update", "-qq"]))?;
        crate::run(
            Command::new("apt-get")
                .args(["install", "-y", "-qq", "--no-install-recommends", "lintian"])
                .env("DEBIAN_FRONTEND", "noninteractive"),
        )?;
    }
    let out = Command::new("lintian")
        .args(["--fail-on", "error,warning", "--no-tag-display-limit"])
        .arg(deb)
        .output()
        .context("cannot run lintian")?;
    let said =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    let flagged: Vec<&str> = said
        .lines()
        .filter(|l| l.starts_with("E: ") || l.starts_with("W: "))
        .collect();
    if !out.status.success() || !flagged.is_empty() {
        bail!("lintian {} ({}):\n{said}", deb.display(), out.status);
    }
    eprintln!(
        "xtask: lintian: no errors or warnings ({} informational tags)",
        said.lines().filter(|l| l.starts_with("I: ")).count()
    );
    Ok(())
}

/// Purges the package if a step failed with it installed, and removes the state directory.
struct Cleanup;

impl Drop for Cleanup {
    fn drop(&mut self) {
        if status().is_some() {
            eprintln!("xtask: package test failed; purging {PKG}");
            let _ = Command::new("dpkg").args(["--purge", PKG]).status();
        }
        let _ = fs::remove_dir_all(STATE_DIR);
    }
}

fn e2e_lock() -> Result<File> {
    let f = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(E2E_LOCK)?;
    // SAFETY: flock on an fd we own.
    if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) } != 0 {
        bail!(
            "cannot lock {E2E_LOCK}: {}",
            std::io::Error::last_os_error()
        );
    }
    Ok(f)
}

/// dpkg's status of the package, None when it is not on the machine at all.
fn status() -> Option<String> {
    let out = Command::new("dpkg-query")
        .args(["--show", "--showformat=${Status}", PKG])
        .stderr(Stdio::null())
        .output()
        .ok()?;
    let s = String::from_utf8_lossy(&out.stdout).trim().to_string();
    (out.status.success() && !s.is_empty() && !s.ends_with("not-installed")).then_some(s)
}

fn dpkg(args: &[&str], deb: Option<&Path>) -> Result<()> {
    let mut cmd = Command::new("dpkg");
    cmd.args(args)
        .stdin(Stdio::null())
        .env("DEBIAN_FRONTEND", "noninteractive");
    match deb {
        Some(d) => cmd.arg(d),
        None => cmd.arg(PKG),
    };
    crate::run(&mut cmd)
}

fn output(cmd: &mut Command) -> Result<String> {
    let out = cmd
        .output()
        .with_context(|| format!("cannot run {cmd:?}"))?;
    if !out.status.success() {
        bail!(
            "{cmd:?} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn listed_files() -> Result<Vec<PathBuf>> {
    Ok(output(Command::new("dpkg").args(["--listfiles", PKG]))?
        .lines()
        .map(PathBuf::from)
        .collect())
}

fn check_installed(files: &[PathBuf]) -> Result<()> {
    for p in PACKAGED {
        let path = Path::new(p.trim_start_matches('.'));
        if !files.iter().any(|f| f == path) || !path.exists() {
            bail!("{} not installed by the package", path.display());
        }
    }
    let mode = fs::metadata(CONFFILE)?.permissions().mode() & 0o777;
    if mode != 0o600 {
        bail!("{CONFFILE} has mode {mode:o}, expected 600");
    }
    let conffiles =
        output(Command::new("dpkg-query").args(["--show", "--showformat=${Conffiles}", PKG]))?;
    if !conffiles.contains(CONFFILE) {
        bail!("{CONFFILE} is not a conffile: {conffiles}");
    }
    if !fs::symlink_metadata(ENABLED).is_ok_and(|m| m.file_type().is_symlink()) {
        bail!("the unit was not enabled on install ({ENABLED} missing)");
    }
    let version = output(Command::new(BIN).arg("--version"))?;
    if !version.contains("(commit ") || !version.contains("bytes embedded") {
        bail!("{BIN} --version: {version}");
    }
    output(Command::new(BIN).args(["check-config", CONFFILE]))?;
    // The installed unit as systemd would load it: binary present, man page found.
    let man = if Command::new("man").arg("--version").output().is_ok() {
        "--man=yes"
    } else {
        "--man=no"
    };
    let out = Command::new("systemd-analyze")
        .args(["verify", man, UNIT])
        .output()
        .context("cannot run systemd-analyze")?;
    let text =
        String::from_utf8_lossy(&out.stderr).to_string() + &String::from_utf8_lossy(&out.stdout);
    if !out.status.success() || text.contains("connreap.service:") {
        bail!("systemd-analyze verify {UNIT} failed:\n{text}");
    }
    eprintln!(
        "xtask: installed: {} ; {UNIT} verified",
        version.lines().next().unwrap_or_default()
    );
    Ok(())
}

/// `connreap snapshot` from the package prints the socket table; an audit line is written
/// where the daemon writes them.
fn check_use() -> Result<()> {
    let table = output(Command::new(BIN).arg("snapshot"))?;
    let header = table.lines().next().unwrap_or_default();
    let is_table = header.starts_with("NETNS")
        && header.contains("STATE")
        && table.contains(" sockets. By owner");
    if !is_table {
        bail!("{BIN} snapshot printed no table:\n{table}");
    }
    eprintln!(
        "xtask: {BIN} snapshot: {}",
        table
            .lines()
            .find(|l| l.contains(" sockets. "))
            .unwrap_or_default()
    );
    fs::create_dir_all(STATE_DIR)?;
    let mut audit = OpenOptions::new().create(true).append(true).open(AUDIT)?;
    audit.write_all(b"{\"note\":\"written by the package test, kept by purge\"}\n")?;
    fs::write(STRAY, b"purge removes this\n")?;
    Ok(())
}

/// Installing the same package again runs the upgrade path of the maintainer scripts: a
/// locally edited conffile stays, the pinned state tracker stays.
fn check_reinstall(deb: &Path) -> Result<()> {
    const EDIT: &str = "# edited locally by the package test\n";
    OpenOptions::new()
        .append(true)
        .open(CONFFILE)?
        .write_all(EDIT.as_bytes())?;
    dpkg(&["--install"], Some(deb))?;
    if !fs::read_to_string(CONFFILE)?.contains(EDIT) {
        bail!("reinstalling replaced the locally edited {CONFFILE}");
    }
    if !Path::new(PINS).exists() {
        bail!("reinstalling removed the pinned state tracker {PINS}");
    }
    Ok(())
}

fn check_remove() -> Result<()> {
    dpkg(&["--remove"], None)?;
    for gone in [BIN, UNIT, PINS] {
        if Path::new(gone).exists() {
            bail!("{gone} still there after dpkg --remove");
        }
    }
    if !Path::new(CONFFILE).exists() {
        bail!("dpkg --remove removed the conffile {CONFFILE} (only purge should)");
    }
    let s = status().unwrap_or_default();
    if s != "deinstall ok config-files" {
        bail!("status after dpkg --remove: {s:?}");
    }
    Ok(())
}

fn check_purge(files: &[PathBuf]) -> Result<()> {
    dpkg(&["--purge"], None)?;
    if let Some(s) = status() {
        bail!("{PKG} still known to dpkg after purge: {s}");
    }
    let mut left: Vec<String> = files
        .iter()
        .filter(|f| f.to_string_lossy().contains("connreap") && f.exists())
        .map(|f| f.display().to_string())
        .collect();
    left.extend(
        RUNTIME_PATHS
            .iter()
            .filter(|p| fs::symlink_metadata(p).is_ok())
            .map(|p| p.to_string()),
    );
    left.extend(
        fs::read_dir("/var/lib/dpkg/info")?
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().starts_with("connreap."))
            .map(|e| e.path().display().to_string()),
    );
    left.extend(
        fs::read_dir(STATE_DIR)
            .with_context(|| format!("purge removed {STATE_DIR} with the audit log"))?
            .flatten()
            .filter(|e| !e.file_name().to_string_lossy().starts_with("audit.jsonl"))
            .map(|e| e.path().display().to_string()),
    );
    if !left.is_empty() {
        bail!("left behind after dpkg --purge: {left:?}");
    }
    if !fs::read_to_string(AUDIT)?.contains("kept by purge") {
        bail!("purge changed the audit log {AUDIT}");
    }
    Ok(())
}
