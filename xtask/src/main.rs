//! `cargo xtask`: builds the BPF object and drives everything else (setup, build, run, test,
//! bench). Every command that needs the BPF toolchain first checks it and installs what is
//! missing, saying what it installs.
mod debtest;
mod dist;
mod image;
mod imagetest;
mod monitoring;
mod promtool;
mod setup;
mod shipcheck;
mod vmtest;

use std::process::Command;

use anyhow::{bail, Result};
use clap::{Parser, Subcommand};
pub use connreap_bench::{agent_bin, root, run_cmd as run};

#[derive(Parser)]
#[command(about = "Build, run and test connreap")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Install what the build needs (nightly rust-src, LLVM 22, bpf-linker). Idempotent.
    Setup,
    /// Compile agent-ebpf for bpfel-unknown-none.
    BuildEbpf,
    /// Build the BPF object and the agent (release).
    Build,
    /// Build and run `connreap ARGS` (as the current user; connreap needs root).
    Run {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// fmt check, clippy, unit tests, then the privileged end-to-end tests.
    Test {
        /// Only the unit tests and lints (no root needed).
        #[arg(long)]
        unit_only: bool,
        /// Passed to the end-to-end test binary (e.g. a test name filter).
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// The kernel matrix: boot Debian kernels under QEMU and run a smoke scenario in each.
    Vmtest(vmtest::VmtestArgs),
    /// The .deb (target/dist/deb/): BPF object, release agent, man pages, completions, conffile.
    Dist,
    /// The OCI image localhost/connreap:VERSION, with no registry: the stripped release binary
    /// on a Debian base made with mmdebstrap (root; installs podman, buildah, mmdebstrap, runc).
    Image {
        /// Then run it under podman as the DaemonSet does, next to a leaking container.
        #[arg(long)]
        test: bool,
        /// Use the release binary already built.
        #[arg(long)]
        no_build: bool,
    },
    /// What ships: the unit's security score, the Kubernetes manifests, and (root) the .deb
    /// installed, used and purged. All three without flags.
    ShipCheck(shipcheck::Args),
    /// Benchmarks (the connreap-bench crate, xtask/bench); writes BENCHMARKS.md.
    Bench(connreap_bench::BenchArgs),
    /// Load generators the bench re-executes (internal).
    #[command(hide = true)]
    BenchWorker(connreap_bench::WorkerArgs),
}

pub const BPF_TARGET: &str = "bpfel-unknown-none";

fn cargo() -> Command {
    let mut c = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    c.current_dir(root());
    c
}

/// The shipped BPF object, at target/bpfel-unknown-none/release/connreap-ebpf (what
/// agent/build.rs embeds).
pub fn build_ebpf() -> Result<()> {
    run(&mut ebpf_cargo("build")?)
}

/// Clippy over the BPF programs, for the BPF target (the host clippy only sees the shared types).
fn clippy_ebpf() -> Result<()> {
    let mut cmd = ebpf_cargo("clippy")?;
    cmd.args(["--", "-D", "warnings"]);
    run(&mut cmd)
}

/// `cargo SUBCOMMAND` on agent-ebpf with nightly for the BPF target, with BTF, and without a
/// bench-only tracker variant (agent-ebpf's build.rs selects one from CONNREAP_TRACKER_VARIANT;
/// the bench sets it, in a target directory of its own).
fn ebpf_cargo(subcommand: &str) -> Result<Command> {
    setup::ensure()?;
    let mut cmd = Command::new("rustup");
    cmd.current_dir(root().join("agent-ebpf"))
        .args(["run", "nightly", "cargo", subcommand, "--release"])
        .args(["--target", BPF_TARGET, "-Z", "build-std=core"])
        .env_remove("RUSTC")
        .env_remove("RUSTC_WORKSPACE_WRAPPER")
        .env_remove("CARGO")
        .env_remove("CONNREAP_TRACKER_VARIANT")
        .env(
            "CARGO_ENCODED_RUSTFLAGS",
            ["-Cdebuginfo=2", "-Clink-arg=--btf"].join("\x1f"),
        )
        .env("AYA_BPF_TARGET_ARCH", std::env::consts::ARCH)
        .env("PATH", setup::path_with_cargo_bin());
    Ok(cmd)
}

pub fn build_agent() -> Result<()> {
    build_ebpf()?;
    build_agent_only()
}

/// The agent around whatever BPF object was built last.
pub fn build_agent_only() -> Result<()> {
    run(cargo()
        .args(["build", "--release", "--package", "connreap"])
        .env_remove("CONNREAP_TRACKER_VARIANT"))
}

/// `systemd-analyze verify` on the unit, with ExecStart pointed at the freshly built binary
/// (verify checks that the executable exists).
fn verify_unit() -> Result<()> {
    if Command::new("systemd-analyze")
        .arg("--version")
        .output()
        .is_err()
    {
        eprintln!("xtask: systemd-analyze not found; skipping unit verification");
        return Ok(());
    }
    let unit = std::fs::read_to_string(root().join("systemd/connreap.service"))?;
    let unit = unit.replace("/usr/bin/connreap", &agent_bin().display().to_string());
    let dir = std::env::temp_dir().join(format!("connreap-unit-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let path = dir.join("connreap.service");
    std::fs::write(&path, unit)?;
    let out = Command::new("systemd-analyze")
        .args(["verify", "--man=no"])
        .arg(&path)
        .output()?;
    let _ = std::fs::remove_dir_all(&dir);
    let text =
        String::from_utf8_lossy(&out.stderr).to_string() + &String::from_utf8_lossy(&out.stdout);
    if !out.status.success() || text.contains("connreap.service:") {
        bail!("systemd-analyze verify systemd/connreap.service failed:\n{text}");
    }
    eprintln!("xtask: systemd/connreap.service verified");
    Ok(())
}

fn main() -> Result<()> {
    match Cli::parse().cmd {
        Cmd::Setup => setup::install().and_then(|()| promtool::ensure().map(drop)),
        Cmd::BuildEbpf => build_ebpf(),
        Cmd::Build => build_agent(),
        Cmd::Run { args } => {
            build_agent()?;
            let status = Command::new(agent_bin()).args(&args).status()?;
            std::process::exit(status.code().unwrap_or(1));
        }
        Cmd::Test { unit_only, args } => {
            build_ebpf()?;
            run(cargo().args(["fmt", "--all", "--check"]))?;
            run(cargo().args(["clippy", "--all-targets", "--", "-D", "warnings"]))?;
            clippy_ebpf()?;
            build_agent_only()?;
            shipcheck::embedded_object()?;
            run(cargo().args([
                "test",
                "--release",
                "--package",
                "connreap",
                "--package",
                "xtask",
                "--package",
                "connreap-bench",
            ]))?;
            verify_unit()?;
            shipcheck::security()?;
            shipcheck::manifests()?;
            let promtool = promtool::ensure()?;
            if promtool {
                promtool::check_rules()?;
            }
            if unit_only {
                return Ok(());
            }
            // Privileged end-to-end tests: one network namespace per test, run one at a time.
            setup::ensure_test_packages()?;
            let mut cmd = cargo();
            cmd.args(["test", "--release", "--package", "connreap-tests", "--"])
                .args(["--test-threads=1"])
                .args(&args)
                .env("CONNREAP_BIN", agent_bin());
            run(&mut cmd)?;
            if promtool {
                promtool::check_live_metrics()?;
            }
            // The image under podman as the DaemonSet runs it.
            imagetest::run_test(true)?;
            // The kernel matrix under QEMU (skipped when CONNREAP_SKIP_VMTEST=1).
            vmtest::from_test()?;
            // The .deb installed, used, reinstalled and purged on this machine.
            debtest::run(&dist::build()?)?;
            // The benchmarks stay out of CI except this small smoke run (about 1k sockets,
            // under a minute) that proves `cargo xtask bench` still works.
            let exe = std::env::current_exe()?;
            run(Command::new(exe).args(["bench", "--smoke", "--no-build", "--wait-quiet", "0"]))
        }
        Cmd::Vmtest(args) => vmtest::run(args),
        Cmd::Dist => dist::build().map(|_| ()),
        Cmd::Image { test, no_build } => {
            if test {
                imagetest::run_test(no_build)
            } else {
                image::build(no_build).map(drop)
            }
        }
        Cmd::ShipCheck(args) => shipcheck::check(args),
        Cmd::Bench(args) => connreap_bench::run(
            args,
            &connreap_bench::Builds {
                agent: build_agent,
                ebpf_cargo,
            },
        ),
        Cmd::BenchWorker(args) => connreap_bench::worker(args),
    }
}
