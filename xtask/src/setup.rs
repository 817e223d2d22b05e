//! Toolchain setup for the BPF build: nightly rust-src, LLVM 22 and a bpf-linker built against
//! it. `ensure` checks and installs only what is missing, saying what it does.
use std::{path::PathBuf, process::Command};

use anyhow::{bail, Result};

use crate::run;

const LLVM_PREFIX: &str = "/usr/lib/llvm-22";
const APT_PACKAGES: &[&str] = &[
    "llvm-22-dev",
    "libpolly-22-dev",
    "libzstd-dev",
    "zlib1g-dev",
    "iproute2",
];

fn cargo_bin() -> PathBuf {
    let home = std::env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cargo")))
        .unwrap_or_else(|| PathBuf::from("/root/.cargo"));
    home.join("bin")
}

/// PATH with ~/.cargo/bin first, so a freshly installed bpf-linker is found.
pub fn path_with_cargo_bin() -> String {
    let path = std::env::var("PATH").unwrap_or_default();
    format!("{}:{path}", cargo_bin().display())
}

fn has_rust_src() -> bool {
    Command::new("rustup")
        .args(["component", "list", "--toolchain", "nightly", "--installed"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).contains("rust-src"))
        .unwrap_or(false)
}

fn has_bpf_linker() -> bool {
    cargo_bin().join("bpf-linker").exists()
        || Command::new("bpf-linker")
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success())
}

fn has_llvm() -> bool {
    std::path::Path::new(LLVM_PREFIX)
        .join("lib/libLLVM.so")
        .exists()
}

fn has_ip() -> bool {
    Command::new("ip").arg("-V").output().is_ok()
}

/// Install whatever is missing; a no-op when everything is there.
pub fn ensure() -> Result<()> {
    if !has_rust_src() {
        eprintln!("xtask: installing rust-src for the nightly toolchain (needed for -Z build-std)");
        run(Command::new("rustup").args([
            "component",
            "add",
            "rust-src",
            "--toolchain",
            "nightly",
        ]))?;
    }
    if !has_llvm() || !has_ip() {
        eprintln!(
            "xtask: installing {} with apt (LLVM 22 for bpf-linker, iproute2 for tests)",
            APT_PACKAGES.join(" ")
        );
        // SAFETY: geteuid has no preconditions and cannot fail.
        if unsafe { libc::geteuid() } != 0 {
            bail!("installing packages needs root: run `sudo cargo xtask setup`");
        }
        run(Command::new("apt-get").args(["update", "-qq"]))?;
        run(Command::new("apt-get")
            .args(["install", "-y", "-qq", "--no-install-recommends"])
            .args(APT_PACKAGES)
            .env("DEBIAN_FRONTEND", "noninteractive"))?;
    }
    if !has_bpf_linker() {
        eprintln!("xtask: installing bpf-linker built against LLVM 22 (about a minute)");
        run(Command::new("cargo")
            .args(["install", "bpf-linker", "--version", "0.13.0"])
            .args(["--no-default-features", "--features", "llvm-22"])
            .env("LLVM_PREFIX", LLVM_PREFIX)
            .env(
                "PATH",
                format!("{LLVM_PREFIX}/bin:{}", path_with_cargo_bin()),
            ))?;
    }
    Ok(())
}

/// Debian packages the end-to-end tests run for real next to connreap (what users run):
/// Alertmanager and Prometheus (with promtool).
const TEST_PACKAGES: &[(&str, &str)] = &[
    (
        "prometheus-alertmanager",
        "/usr/bin/prometheus-alertmanager",
    ),
    ("prometheus", "/usr/bin/promtool"),
    // The pod tests: Services as DNAT rules, and the relay incident's proxy on Node.js.
    ("iptables", "/usr/sbin/iptables"),
    ("nodejs", "/usr/bin/node"),
    // `curl /metrics | promtool check metrics`, as an operator checks an agent.
    ("curl", "/usr/bin/curl"),
];

/// Install the test-only packages that are missing (their services are not started: there
/// is no systemd here and the tests start what they need on loopback ports).
pub fn ensure_test_packages() -> Result<()> {
    let missing: Vec<&str> = TEST_PACKAGES
        .iter()
        .filter(|(_, bin)| !std::path::Path::new(bin).exists())
        .map(|(pkg, _)| *pkg)
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    eprintln!(
        "xtask: installing {} with apt (end-to-end tests)",
        missing.join(" ")
    );
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        bail!("installing packages needs root: run the tests as root");
    }
    run(Command::new("apt-get").args(["update", "-qq"]))?;
    run(Command::new("apt-get")
        .args(["install", "-y", "-qq", "--no-install-recommends"])
        .args(&missing)
        .env("DEBIAN_FRONTEND", "noninteractive"))
}

pub fn install() -> Result<()> {
    ensure()?;
    eprintln!("xtask: setup complete (rust-src, LLVM 22, bpf-linker present)");
    Ok(())
}
