//! `cargo xtask bench`: measures connreap against its targets on this machine and writes
//! BENCHMARKS.md (or target/bench-smoke.md with `--smoke`). xtask calls [`run`] and
//! [`worker`], and hands over how it builds the agent and agent-ebpf ([`Builds`]).
//!
//! The bench makes its own load, loopback only and inside network namespaces it creates and
//! deletes: a connect/accept/send/close churn, socket holders (this binary re-executed as
//! `bench-worker holder`), CLOSE_WAIT groups and a webhook receiver. It holds the e2e tests' lock
//! (both use the host-wide pinned tracker, which the bench unpins), and every change it makes
//! (namespaces, processes, kernel.bpf_stats_enabled, the pinned tracker) is undone by a guard.
//!
//! One file per measure: probe.rs (1, with probe_parts.rs for `--probe-parts`), churn.rs (2),
//! snapshot.rs (3), memory_cpu.rs (4 and 6, one daemon observed at measure 3's largest size),
//! latency.rs (5), namespaces.rs (7). The tools they share: agent.rs (the agent binary, its
//! daemon and a webhook receiver), load.rs (the load generators), proc.rs (processes, times,
//! /proc), sys.rs (namespaces, sysctls, signals, the e2e lock), scan_split.rs (where a
//! snapshot's time goes), report.rs (rows, BENCHMARKS.md), profile.rs (`--profile`: perf),
//! baseline/ (`--baseline`: an older build timed side by side).
pub mod agent;
mod baseline;
mod churn;
mod latency;
mod load;
mod memory_cpu;
mod million;
mod namespaces;
mod probe;
mod probe_parts;
pub mod proc;
mod profile;
mod report;
mod scan_split;
mod snapshot;
pub mod sys;

use std::{
    path::{Path, PathBuf},
    process::Command,
    time::{Duration, Instant},
};

use anyhow::{bail, Context as _, Result};

pub use load::{worker, WorkerArgs};
use report::{Row, Verdict};

/// `--spread`'s NAMESPACESxCONNECTIONS.
fn parse_spread(s: &str) -> Result<(usize, usize), String> {
    let (n, c) = s
        .split_once(['x', '×'])
        .ok_or_else(|| format!("{s}: expected NAMESPACESxCONNECTIONS, like 300x500"))?;
    let num = |v: &str| {
        v.trim()
            .parse::<usize>()
            .ok()
            .filter(|&v| v > 0)
            .ok_or_else(|| format!("{s}: {v:?} is not a positive number"))
    };
    Ok((num(n)?, num(c)?))
}

#[derive(clap::Args)]
pub struct BenchArgs {
    /// Quick check of the bench itself (~1k sockets, seconds per measure); writes
    /// target/bench-smoke.md and fails only when the bench machinery fails.
    #[arg(long)]
    smoke: bool,
    /// Use the existing target/release/connreap instead of building it first.
    #[arg(long)]
    no_build: bool,
    /// Also exit non-zero when a target is missed.
    #[arg(long)]
    strict: bool,
    /// Also run the diagnostics that explain figures (perf profiles, the gdb malloc_trim step).
    #[arg(long)]
    profile: bool,
    /// The default now (profiles are opt-in with `--profile`); kept so older command lines work.
    #[arg(long, hide = true, conflicts_with = "profile")]
    no_profile: bool,
    /// Also measure what each part of the tracker costs (measure 1), from bench-only builds of
    /// it (builds an extra agent per variant first: a few minutes).
    #[arg(long)]
    probe_parts: bool,
    /// With --probe-parts: only these variants (comma-separated names from probe_parts.rs),
    /// each still measured against the shipped program.
    #[arg(long, value_delimiter = ',', requires = "probe_parts")]
    variants: Vec<String>,
    /// Only these measures (1-8, comma-separated); writes target/bench-partial.md.
    #[arg(long, value_delimiter = ',')]
    only: Vec<u8>,
    /// Measure 7's size: NAMESPACES×CONNECTIONS (each connection is two sockets, held by one
    /// process per namespace), default 100×500.
    #[arg(long, value_name = "NxC", value_parser = parse_spread)]
    spread: Option<(usize, usize)>,
    /// Measure 7: only its row of the daemon's CPU per scan with the sockets spread over many
    /// namespaces against the same sockets in one (the other rows walk every namespace on
    /// every scan, which takes hours at 300 namespaces × 1k sockets).
    #[arg(long)]
    spread_only: bool,
    /// How long to wait for e2e tests and compiles to finish before measuring anyway (noted in
    /// the report).
    #[arg(long, default_value_t = 600)]
    wait_quiet: u64,
    /// Also time this connreap binary (built from an older commit) in measures 3, 6 and 7 (and
    /// its tracker in measure 1 with `--probe-parts`, as the variant `baseline`),
    /// alternated with the current one on the same sockets: a row per size with the ratio of
    /// snapshot times current/baseline, one of daemon CPU per scan at the largest size, and
    /// (for a baseline that knows namespaces) one of daemon CPU per scan at many namespaces
    /// (targets ≤ 1.05×). Its tracker is pinned under /sys/fs/bpf/connreap-baseline, removed
    /// at the end.
    #[arg(
        long,
        value_name = "PATH",
        group = "baseline_src",
        conflicts_with = "baseline_commit"
    )]
    baseline: Option<PathBuf>,
    /// Build the baseline from this commit (a git worktree in target/bench-baseline-src,
    /// reused; its own `cargo xtask build`) and use its target/release/connreap as --baseline.
    #[arg(long, value_name = "REV", group = "baseline_src")]
    baseline_commit: Option<String>,
    /// How the rows name the baseline (default: its commit).
    #[arg(long, value_name = "TEXT", requires = "baseline_src")]
    baseline_label: Option<String>,
}

/// What xtask builds for the bench: the release agent (around the shipped BPF object), and the
/// `cargo SUBCOMMAND` that builds agent-ebpf for the BPF target (toolchain checked, no tracker
/// variant selected), which `--probe-parts` runs in a target directory of its own.
pub struct Builds {
    pub agent: fn() -> Result<()>,
    pub ebpf_cargo: fn(&str) -> Result<Command>,
}

/// The workspace root.
pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .nth(2)
        .expect("the bench lives in xtask/bench of the workspace")
        .to_path_buf()
}

/// The release agent `cargo xtask build` makes.
pub fn agent_bin() -> PathBuf {
    root().join("target/release/connreap")
}

/// Run `cmd` (echoed first); fail on a non-zero exit.
pub fn run_cmd(cmd: &mut Command) -> Result<()> {
    eprintln!("+ {cmd:?}");
    let status = cmd
        .status()
        .with_context(|| format!("failed to start {cmd:?}"))?;
    if !status.success() {
        bail!("{cmd:?} failed: {status}");
    }
    Ok(())
}

/// State shared between measures (later ones reuse earlier figures in their diagnosis).
#[derive(Default)]
pub struct Ctx {
    pub smoke: bool,
    /// Measure the tracker by parts (the variant agents are built).
    pub parts: bool,
    /// The variants measured (all when empty).
    pub variants: Vec<String>,
    /// Profile with perf to explain figures.
    pub perf: bool,
    /// Configs and daemon logs.
    pub dir: PathBuf,
    pub idle_rss_kb: Option<u64>,
    /// The idle daemon's VmRSS by kind, as text.
    pub idle_kinds: Option<String>,
    /// ns per run of (iter/tcp, iter/task_file), from measure 1.
    pub iter_ns: Option<(f64, f64)>,
    /// ns per run of connreap_set_state and its runs per churn connection, from measure 1.
    pub set_state_ns: Option<f64>,
    pub runs_per_conn: Option<f64>,
    /// ns per transition of the classic tracepoint's dispatch (outside the program), from perf.
    pub dispatch_ns: Option<f64>,
    /// µs of CPU per churn connection in the tracker and its dispatch with bpf_stats off (as in
    /// measure 2), from perf's share of all samples.
    pub tracker_perf_us: Option<f64>,
    /// The older connreap measure 3 also times (`--baseline`, `--baseline-commit`).
    pub baseline: Option<baseline::Baseline>,
    /// Measure 7's namespaces and connections per namespace (`--spread`).
    pub spread: Option<(usize, usize)>,
    /// Measure 7's spread row alone (`--spread-only`).
    pub spread_only: bool,
}

impl Ctx {
    fn new(args: &BenchArgs, dir: PathBuf, baseline: Option<baseline::Baseline>) -> Ctx {
        Ctx {
            smoke: args.smoke,
            parts: args.probe_parts,
            variants: args.variants.clone(),
            perf: args.profile && profile::available(),
            dir,
            baseline,
            spread: args.spread,
            spread_only: args.spread_only,
            ..Ctx::default()
        }
    }

    /// Longest churn warm-up before measuring (filling the TIME_WAIT table).
    pub fn warm_up(&self) -> Duration {
        Duration::from_secs(if self.smoke { 2 } else { 30 })
    }
}

type Measure = fn(&mut Ctx) -> Result<Vec<Row>>;

/// In run order. Measure 1 turns bpf_stats on for its window only (2 needs it off); later
/// measures reuse its per-run costs in their diagnosis.
const MEASURES: [(&str, &[u8], &str, Measure); 6] = [
    ("1", &[1], "probe cost", probe::probe_cost),
    ("2", &[2], "churn overhead", churn::churn_overhead),
    ("5", &[5], "detection latency", latency::detection),
    (
        "3",
        &[3, 4, 6],
        "snapshot at scale, memory, CPU",
        snapshot::snapshot_at_scale,
    ),
    ("7", &[7], "many namespaces", namespaces::namespaces),
    ("8", &[8], "a million tracked sockets", million::million),
];

fn preflight() -> Result<()> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        bail!("the bench needs root (it loads BPF programs and creates network namespaces)");
    }
    for tool in ["ip", "ss"] {
        if Command::new(tool).arg("-V").output().is_err() {
            bail!("`{tool}` (iproute2) not found");
        }
    }
    if !agent::bin().is_file() {
        bail!(
            "{} not found: run `cargo xtask build`",
            agent::bin().display()
        );
    }
    Ok(())
}

/// Wait (up to `max`) for e2e tests and compiles to finish; returns what was still running.
fn wait_quiet(max: Duration) -> Result<Vec<String>> {
    let end = Instant::now() + max;
    let mut said = false;
    loop {
        let busy = sys::busy();
        if busy.is_empty() || Instant::now() > end {
            return Ok(busy);
        }
        if !said {
            eprintln!(
                "bench: waiting for a quiet machine ({}), up to {max:?}",
                busy.join(", ")
            );
            said = true;
        }
        sys::sleep(Duration::from_secs(5))?;
    }
}

pub fn run(args: BenchArgs, builds: &Builds) -> Result<()> {
    let (dir, built, base) = prepare(&args, builds)?;
    let busy = wait_quiet(Duration::from_secs(args.wait_quiet))?;
    let (lock, waited) = sys::e2e_lock(Duration::from_secs(args.wait_quiet.max(60)))?;
    let pins = agent::PinRestore::new();
    let load0 = sys::loadavg();
    let t0 = Instant::now();
    let mut ctx = Ctx::new(&args, dir.clone(), base.clone());
    let done = run_measures(&mut ctx, &args.only);
    drop(pins);
    drop(lock);
    let mut conditions = Vec::new();
    if waited {
        conditions
            .push("Waited for the e2e tests to release their lock before starting.".to_string());
    }
    conditions.extend(run_conditions(&busy, &done, &load0, t0));
    if let Some(b) = &base {
        conditions.push(format!(
            "The baseline {} ({}) was timed alternated with this build (measures 3, 6 and 7 as selected).",
            b.label,
            b.source.display()
        ));
    }
    write_report(&args, &dir, &built, conditions, &done.rows)?;
    check_verdicts(&args, &done.rows)
}

/// Build (unless `--no-build`), check the machine, and copy the agent (and, with
/// `--probe-parts`, build its variants; with `--baseline-commit`, build the baseline) into the
/// bench's directory; returns that directory, when the agent binary was built, and the baseline.
fn prepare(
    args: &BenchArgs,
    builds: &Builds,
) -> Result<(PathBuf, String, Option<baseline::Baseline>)> {
    if !args.no_build {
        (builds.agent)()?;
    }
    preflight()?;
    sys::install_signal_handlers();
    sys::remove_stale_namespaces();
    let dir = root().join("target/bench-tmp");
    std::fs::create_dir_all(&dir)?;
    let built = Command::new("date")
        .arg("-u")
        .arg("-r")
        .arg(agent_bin())
        .arg("+%Y-%m-%d %H:%M UTC")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default();
    agent::use_copy_in(&dir)?;
    if args.probe_parts {
        probe_parts::check_variants(&args.variants)?;
        probe_parts::build(&dir, builds, &args.variants)?;
    }
    let base = baseline::resolve(args, &dir)?;
    let probe_side = args.probe_parts && (args.only.is_empty() || args.only.contains(&1));
    if base.is_some()
        && !args.only.is_empty()
        && !args.only.contains(&3)
        && !args.only.contains(&7)
        && !probe_side
    {
        eprintln!("bench: warning: the baseline is only used by measures 3 and 6 (run with measure 3), 7, and 1 with --probe-parts, not selected");
    }
    Ok((dir, built, base))
}

/// What the measures produced, and what ran next to them.
struct Done {
    rows: Vec<Row>,
    /// Other work (e2e tests, compiles) seen after each measure.
    busy_during: Vec<String>,
    /// CPU steal during each measure, as text.
    steal: Vec<String>,
}

/// Run the selected measures in order (`only`: measure ids, empty for all); a failed measure
/// becomes a failed row, and Ctrl-C stops after the current one.
fn run_measures(ctx: &mut Ctx, only: &[u8]) -> Done {
    let mut done = Done {
        rows: Vec::new(),
        busy_during: Vec::new(),
        steal: Vec::new(),
    };
    for (id, ids, name, f) in MEASURES {
        if !only.is_empty() && !ids.iter().any(|i| only.contains(i)) {
            continue;
        }
        eprintln!("bench: measure {id}: {name}");
        let start = Instant::now();
        let ticks0 = sys::cpu_ticks();
        match f(ctx) {
            Ok(r) => done.rows.extend(
                r.into_iter()
                    .filter(|r| only.is_empty() || r.id.parse().is_ok_and(|i| only.contains(&i))),
            ),
            Err(e) => {
                eprintln!("bench: measure {id} failed: {e:#}");
                done.rows.push(Row::failed(id, name, &e));
                if sys::check_interrupted().is_err() {
                    break;
                }
            }
        }
        eprintln!("bench: measure {id} took {:.0?}", start.elapsed());
        let ticks1 = sys::cpu_ticks();
        let all = ticks1.0.saturating_sub(ticks0.0).max(1);
        done.steal.push(format!(
            "{id}: {:.1} %",
            ticks1.1.saturating_sub(ticks0.1) as f64 * 100.0 / all as f64
        ));
        for b in sys::busy() {
            done.busy_during.push(format!("{b} during measure {id}"));
        }
    }
    done
}

/// The report's run conditions: other load (`busy` at the start, then during the measures),
/// CPU steal, load average from `load0` to now, and the run's duration since `t0`.
fn run_conditions(busy: &[String], done: &Done, load0: &str, t0: Instant) -> Vec<String> {
    let load1 = sys::loadavg();
    let noisy: Vec<String> = busy.iter().chain(&done.busy_during).cloned().collect();
    let mut conditions = Vec::new();
    if noisy.is_empty() {
        conditions.push(
            "Quiet machine: no e2e tests, `cargo test` or rustc running at the start or after any measure."
                .into(),
        );
    } else {
        conditions.push(format!(
            "**Not a quiet run**: {} (numbers may be skewed by that load).",
            noisy.join("; ")
        ));
    }
    conditions.push(format!(
        "CPU steal (time the hypervisor gave this VM's CPUs to others) during each measure: {}.",
        done.steal.join(", ")
    ));
    conditions.push(format!(
        "Load average (1/5/15 min) {load0} at the start, {load1} at the end; the run took {:.0} s.",
        t0.elapsed().as_secs_f64()
    ));
    conditions
}

/// Print the summary and write the report: target/bench-smoke.md, target/bench-partial.md
/// (`--only`) or BENCHMARKS.md.
fn write_report(
    args: &BenchArgs,
    dir: &Path,
    built: &str,
    conditions: Vec<String>,
    rows: &[Row],
) -> Result<()> {
    let (title, command, out) = if args.smoke {
        (
            "connreap bench (smoke: not representative)",
            "cargo xtask bench --smoke",
            dir.join("../bench-smoke.md"),
        )
    } else if !args.only.is_empty() {
        (
            "connreap benchmarks (partial run)",
            "cargo xtask bench --only ...",
            dir.join("../bench-partial.md"),
        )
    } else {
        (
            "connreap benchmarks",
            "cargo xtask bench",
            root().join("BENCHMARKS.md"),
        )
    };
    let header = report::Header {
        title: title.into(),
        command: command.into(),
        machine: report::machine(built),
        conditions,
        methods: report::METHODS,
    };
    println!("\n{}", report::console(rows));
    let md = report::markdown(&header, rows);
    std::fs::write(&out, md)?;
    println!("wrote {}", out.canonicalize().unwrap_or(out).display());
    Ok(())
}

/// Fail when a measure failed, or (`--strict`, not `--smoke`) when a target was missed.
fn check_verdicts(args: &BenchArgs, rows: &[Row]) -> Result<()> {
    let failed: Vec<&str> = rows
        .iter()
        .filter(|r| r.verdict == Verdict::Failed)
        .map(|r| r.id)
        .collect();
    if !failed.is_empty() {
        bail!("the bench failed for measure(s) {}", failed.join(", "));
    }
    let missed = rows.iter().filter(|r| r.verdict == Verdict::Miss).count();
    if args.strict && !args.smoke && missed > 0 {
        bail!("{missed} target(s) missed");
    }
    Ok(())
}
