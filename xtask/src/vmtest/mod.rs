//! `cargo xtask vmtest`: the kernel matrix. Boots Debian's kernels under QEMU (TCG: no KVM
//! needed) with an initramfs holding the release binary, the test peer, busybox and the diag
//! modules; the guest runs `guest.sh` and prints its findings on the serial console; the host
//! judges them (check.rs) and writes the matrix table to `target/vmtest/matrix.md`.
mod check;
mod fetch;
mod initramfs;

use std::{
    fmt::Write as _,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{bail, Context, Result};
use check::{Cell, GuestLog};

/// The guest's /init.
const GUEST: &str = include_str!("guest.sh");

/// Set to skip vmtest in `cargo xtask test` (local runs).
pub const SKIP_ENV: &str = "CONNREAP_SKIP_VMTEST";

/// The oldest kernel connreap can load on (the tracker's 64-bit BPF atomics came in 5.12),
/// and the first with the bpf_sock_destroy kfunc.
const MIN_KERNEL: (u32, u32) = (5, 12);
const KFUNC_KERNEL: (u32, u32) = (6, 5);

/// One boot of the matrix.
struct Boot {
    /// Short name for `--only` and file names.
    id: &'static str,
    /// The metapackage that points at the current kernel image, and the suite to take it from.
    meta: &'static str,
    suite: &'static str,
    /// Boot with `lockdown=integrity`.
    lockdown: bool,
}

const MATRIX: &[Boot] = &[
    Boot {
        id: "5.10-cloud",
        meta: "linux-image-cloud-amd64",
        suite: "bullseye-security",
        lockdown: false,
    },
    Boot {
        id: "6.1-cloud",
        meta: "linux-image-cloud-amd64",
        suite: "bookworm-security",
        lockdown: false,
    },
    Boot {
        id: "6.1-cloud-lockdown",
        meta: "linux-image-cloud-amd64",
        suite: "bookworm-security",
        lockdown: true,
    },
    Boot {
        id: "6.1-generic",
        meta: "linux-image-amd64",
        suite: "bookworm-security",
        lockdown: false,
    },
    Boot {
        id: "6.12-bpo-cloud",
        meta: "linux-image-cloud-amd64",
        suite: "bookworm-backports",
        lockdown: false,
    },
    Boot {
        id: "6.12-security-cloud",
        meta: "linux-image-6.12-cloud-amd64",
        suite: "bookworm-security",
        lockdown: false,
    },
    Boot {
        id: "6.12-security-cloud-lockdown",
        meta: "linux-image-6.12-cloud-amd64",
        suite: "bookworm-security",
        lockdown: true,
    },
];

/// A boot still running after this is killed and counted as failed (a hung guest).
const BOOT_TIMEOUT_SECS: u64 = 300;

#[derive(clap::Args)]
pub struct VmtestArgs {
    /// Use the binaries already built (target/release/connreap and connreap-testpeer).
    #[arg(long)]
    no_build: bool,
    /// Only these boots (comma-separated ids; `--list` shows them).
    #[arg(long, value_delimiter = ',')]
    only: Vec<String>,
    /// List the boots and exit.
    #[arg(long)]
    list: bool,
    /// Longest a boot may take, in seconds, before it is killed and counted as failed.
    #[arg(long, default_value_t = BOOT_TIMEOUT_SECS)]
    timeout: u64,
}

/// A kernel ready to boot.
struct Kernel {
    package: String,
    version: String,
    release: String,
    dir: PathBuf,
}

impl Kernel {
    /// (major, minor) from the release, e.g. 6.12 from `6.12.95+deb12-cloud-amd64`.
    fn version(&self) -> (u32, u32) {
        let mut parts = self
            .release
            .split(|c: char| !c.is_ascii_digit())
            .map(|p| p.parse().unwrap_or(0));
        (parts.next().unwrap_or(0), parts.next().unwrap_or(0))
    }
}

/// One row of the matrix.
struct Row {
    boot: &'static Boot,
    kernel: String,
    cells: Vec<Cell>,
    secs: f64,
}

fn work_dir() -> PathBuf {
    crate::root().join("target/vmtest")
}

/// `cargo xtask vmtest` from `cargo xtask test`, after the end-to-end tests (which built the
/// BPF object and the agent already).
pub fn from_test() -> Result<()> {
    if std::env::var_os(SKIP_ENV).is_some_and(|v| v != "0" && !v.is_empty()) {
        eprintln!("xtask: {SKIP_ENV} is set: skipping the kernel matrix (vmtest)");
        return Ok(());
    }
    run(VmtestArgs {
        no_build: true,
        only: Vec::new(),
        list: false,
        timeout: BOOT_TIMEOUT_SECS,
    })
}

pub fn run(args: VmtestArgs) -> Result<()> {
    if args.list {
        for b in MATRIX {
            println!("{:<30} {} from {}", b.id, b.meta, b.suite);
        }
        return Ok(());
    }
    let boots: Vec<&'static Boot> = MATRIX
        .iter()
        .filter(|b| args.only.is_empty() || args.only.iter().any(|o| o == b.id))
        .collect();
    if boots.is_empty() {
        bail!("no boot matches --only {:?} (see --list)", args.only);
    }
    let t0 = Instant::now();
    if !args.no_build {
        crate::build_agent()?;
    }
    // The test peer (a few hundred KB) is built whatever --no-build says: cargo skips it
    // when it is up to date.
    crate::run(crate::cargo().args([
        "build",
        "--release",
        "--package",
        "connreap-tests",
        "--bin",
        "connreap-testpeer",
    ]))?;
    let work = work_dir();
    let apt = fetch::Apt::new(&work.join("apt"))?;
    apt.ensure_qemu()?;
    apt.update()?;
    let busybox = fetch::busybox(&apt, &work.join("busybox"))?;
    let bins = [
        crate::agent_bin(),
        crate::root().join("target/release/connreap-testpeer"),
    ];
    let bin_refs: Vec<&Path> = bins.iter().map(PathBuf::as_path).collect();
    let base = initramfs::base(&busybox, &bin_refs, GUEST)?;
    // Every download before the first boot: a missing package fails in seconds, not minutes.
    let kernels = boots
        .iter()
        .map(|b| prepare(&apt, b, &work))
        .collect::<Result<Vec<_>>>()?;
    let setup = t0.elapsed();
    let mut rows = Vec::new();
    for (boot, kernel) in boots.into_iter().zip(&kernels) {
        rows.push(boot_one(boot, kernel, &base, &work, args.timeout)?);
    }
    let table = format!("{}\n\n{}", provenance(), render(&rows));
    std::fs::write(work.join("matrix.md"), &table)?;
    println!("{table}");
    eprintln!(
        "vmtest: {} boots in {:.0} s (setup, downloads and builds {:.0} s); table in {}",
        rows.len(),
        t0.elapsed().as_secs_f64(),
        setup.as_secs_f64(),
        work.join("matrix.md").display()
    );
    let failed: Vec<&str> = rows
        .iter()
        .filter(|r| r.cells.iter().any(|c| !c.ok))
        .map(|r| r.boot.id)
        .collect();
    if !failed.is_empty() {
        bail!(
            "kernel matrix failed on {} (serial logs in {})",
            failed.join(", "),
            work.join("logs").display()
        );
    }
    Ok(())
}

/// Resolve, download and unpack the boot's kernel.
fn prepare(apt: &fetch::Apt, boot: &Boot, work: &Path) -> Result<Kernel> {
    let (package, version) = apt.resolve_image(boot.meta, boot.suite)?;
    let deb = apt.download(&package, &version, &work.join("debs"))?;
    let dir = work.join("kernels").join(format!("{package}_{version}"));
    let release = fetch::unpack_kernel(&deb, &dir)?;
    Ok(Kernel {
        package,
        version,
        release,
        dir,
    })
}

fn boot_one(
    boot: &'static Boot,
    k: &Kernel,
    base: &[u8],
    work: &Path,
    timeout: u64,
) -> Result<Row> {
    let boot_dir = work.join("boot").join(boot.id);
    std::fs::create_dir_all(&boot_dir)?;
    let mut initrd = base.to_vec();
    initrd.extend(initramfs::kernel_extras(
        &k.release,
        &k.dir.join(format!("boot/config-{}", k.release)),
        &k.dir.join("modules"),
    )?);
    let initrd_path = boot_dir.join("initrd.cpio");
    std::fs::write(&initrd_path, initrd)?;
    let logs = work.join("logs");
    std::fs::create_dir_all(&logs)?;
    let log_path = logs.join(format!("{}.log", boot.id));
    eprintln!("vmtest: booting {} ({} {})", boot.id, k.package, k.version);
    let started = Instant::now();
    let outcome = qemu(
        &k.dir.join(format!("boot/vmlinuz-{}", k.release)),
        &initrd_path,
        boot.lockdown,
        &log_path,
        Duration::from_secs(timeout),
    )?;
    let secs = started.elapsed().as_secs_f64();
    let serial = String::from_utf8_lossy(&std::fs::read(&log_path)?).into_owned();
    let log = GuestLog::parse(&serial);
    let mut row = judge(boot, k, &log, outcome);
    row.secs = secs;
    let verdict = if row.cells.iter().all(|c| c.ok) {
        "ok"
    } else {
        "FAILED"
    };
    eprintln!(
        "vmtest: {} {verdict} in {secs:.0} s (guest uptime at each step: {})",
        boot.id,
        timeline(&log)
    );
    if verdict != "ok" {
        for c in row.cells.iter().filter(|c| !c.ok) {
            eprintln!("  {}", c.text);
        }
        let tail: Vec<&str> = serial.lines().rev().take(30).collect();
        eprintln!("  last lines of {}:", log_path.display());
        for l in tail.iter().rev() {
            eprintln!("  | {l}");
        }
    }
    Ok(row)
}

/// "init 4.2, peers 6.0, ...": the guest's uptime at each `mark` of guest.sh.
fn timeline(log: &GuestLog) -> String {
    let mut marks: Vec<(f64, &str)> = log
        .facts
        .iter()
        .filter_map(|(k, v)| Some((v.parse().ok()?, k.strip_prefix("t_")?)))
        .collect();
    marks.sort_by(|a, b| a.0.total_cmp(&b.0));
    let marks: Vec<String> = marks.iter().map(|(t, k)| format!("{k} {t:.1}")).collect();
    marks.join(", ")
}

/// Run QEMU until the guest powers off; Some(reason) when it had to be killed or failed.
fn qemu(
    vmlinuz: &Path,
    initrd: &Path,
    lockdown: bool,
    log: &Path,
    timeout: Duration,
) -> Result<Option<String>> {
    let mut append = "console=ttyS0 rdinit=/init panic=-1 oops=panic quiet".to_string();
    if lockdown {
        append.push_str(" lockdown=integrity");
    }
    let mut child = Command::new(fetch::QEMU)
        .args([
            "-accel",
            "tcg,thread=single",
            "-cpu",
            "max",
            "-smp",
            "2",
            "-m",
            "2048",
        ])
        .arg("-kernel")
        .arg(vmlinuz)
        .arg("-initrd")
        .arg(initrd)
        .args(["-append", &append])
        .args([
            "-display",
            "none",
            "-monitor",
            "none",
            "-no-reboot",
            "-nic",
            "none",
        ])
        .arg("-serial")
        .arg(format!("file:{}", log.display()))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("starting {}", fetch::QEMU))?;
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(status) = child.try_wait()? {
            if status.success() {
                return Ok(None);
            }
            let mut err = String::new();
            if let Some(mut e) = child.stderr.take() {
                let _ = std::io::Read::read_to_string(&mut e, &mut err);
            }
            return Ok(Some(format!("qemu exited with {status}: {}", err.trim())));
        }
        if Instant::now() > deadline {
            // Our own child, by pid.
            let _ = child.kill();
            let _ = child.wait();
            return Ok(Some(format!("killed after {} s", timeout.as_secs())));
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// The verdicts for one boot, by what its kernel is expected to do.
fn judge(boot: &'static Boot, k: &Kernel, log: &GuestLog, qemu_failed: Option<String>) -> Row {
    let version = k.version();
    let mut kernel = format!(
        "{} `{}`",
        k.package.trim_start_matches("linux-image-"),
        k.version
    );
    if boot.lockdown {
        kernel.push_str(" + `lockdown=integrity`");
    }
    let mut cells = Vec::new();
    if version < MIN_KERNEL {
        cells.push(check::refusal(log));
        let not_run = || Cell::ok("not run (refused)");
        cells.extend([not_run(), not_run(), not_run()]);
    } else {
        cells.push(check::snapshot(log));
        cells.push(check::daemon(log));
        cells.push(check::netlink(log));
        cells.push(check::bpf_iter(log, version >= KFUNC_KERNEL));
    }
    cells.push(match qemu_failed {
        Some(why) => Cell::fail(why),
        None if log.fact("release") != Some(k.release.as_str()) => Cell::fail(format!(
            "the guest did not report release {} (got {:?})",
            k.release,
            log.fact("release")
        )),
        None => check::health(log, boot.lockdown),
    });
    Row {
        boot,
        kernel,
        cells,
        secs: 0.0,
    }
}

/// Which build and which emulator made the table.
fn provenance() -> String {
    let out = |cmd: &mut Command| {
        cmd.output()
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
            .unwrap_or_default()
    };
    let commit =
        out(Command::new("git")
            .current_dir(crate::root())
            .args(["rev-parse", "--short", "HEAD"]));
    let qemu = out(Command::new(fetch::QEMU).arg("--version"));
    let qemu = qemu
        .lines()
        .next()
        .unwrap_or("")
        .replace("QEMU emulator version", "QEMU");
    format!(
        "Generated by `cargo xtask vmtest` from commit {commit}: {qemu}, TCG, 2 vCPUs, 2 GiB; \
         time is the whole boot (kernel start to power-off) on a 2-core host."
    )
}

fn render(rows: &[Row]) -> String {
    let mut t = String::new();
    let _ = writeln!(
        t,
        "| kernel (Debian package) | suite | snapshot = /proc view | daemon: CLOSE_WAIT finding | enforce, netlink kill | bpf-iter fallback | kernel health | time |"
    );
    let _ = writeln!(t, "|---|---|---|---|---|---|---|---|");
    for r in rows {
        let cells: Vec<String> = r.cells.iter().map(|c| c.text.replace('|', "\\|")).collect();
        let _ = writeln!(
            t,
            "| {} | {} | {} | {:.0} s |",
            r.kernel,
            r.boot.suite,
            cells.join(" | "),
            r.secs
        );
    }
    t
}
