//! `--probe-parts` (measure 1): what each part of the state-change program costs, from
//! bench-only builds of the tracker (`cfg(tracker_variant = "...")`, set by agent-ebpf's
//! build.rs from `CONNREAP_TRACKER_VARIANT` only in the variants' own target directory,
//! target/bench-variants; see agent-ebpf's tracker.rs).
//!
//! Each variant is measured *at the same time* as the shipped program: two daemons, each with
//! its own pin root (`CONNREAP_PIN_ROOT`), keep both trackers attached to the tracepoint while
//! the churn runs, and each reports its own program's bpf_stats. The two see the same
//! transitions under the same machine state, so the difference is not swamped by the VM's
//! drift between windows of the same binary. The program attached first runs first
//! and takes the cache misses on each socket that the second then finds warm, so every pair is
//! measured in both orders and the two differences averaged: that cancels the order effect,
//! which is reported too.
use std::time::Duration;
use std::{
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context, Result};

use crate::{
    agent::{self, Daemon, Scrape, Side},
    churn::WORKERS,
    load,
    report::median,
    sys::NsHandle,
    Ctx,
};

/// (variant, what that build of connreap_set_state does). "full" is the shipped program.
pub const VARIANTS: [(&str, &str); 9] = [
    (
        "full",
        "the shipped program: state table + events staged per CPU, one ring record per 64",
    ),
    (
        "no-ring",
        "state table, no events (the transition is still counted in the staging batch's header)",
    ),
    ("no-map", "events (batched), no state table"),
    (
        "count-only",
        "counts the transition and returns (entry, bpf_stats accounting, protocol load, the \
         per-CPU count)",
    ),
    (
        "unbatched",
        "state table + one ring record per transition (the design before per-CPU batches)",
    ),
    (
        "ktime",
        "the shipped program stamping transitions with bpf_ktime_get_ns instead of jiffies",
    ),
    (
        "hash",
        "the shipped program with the per-socket state in a kernel hash map (allocated per \
         socket) instead of the set-associative table (the design before it)",
    ),
    (
        "batch32",
        "the shipped program sending one ring record per 32 events instead of 64 (the design \
         before it)",
    ),
    (
        "sk-storage",
        "the shipped program with the per-socket state in per-socket storage \
         (BPF_MAP_TYPE_SK_STORAGE, freed with the socket, no bound) instead of the \
         set-associative table (the candidate for one pass over every namespace)",
    ),
];
const ROUNDS: usize = 3;

/// `--variants baseline`: the `--baseline` binary's own tracker, measured like a variant (the
/// shipped program of an older commit against this one's).
pub const BASELINE: &str = "baseline";

/// The variants (not "full") named in `only`, or all of them.
fn selected(only: &[String]) -> Vec<(&'static str, &'static str)> {
    VARIANTS[1..]
        .iter()
        .copied()
        .filter(|(v, _)| only.is_empty() || only.iter().any(|o| o == v))
        .collect()
}

/// Every name in `only` is a variant (or `baseline`).
pub fn check_variants(only: &[String]) -> Result<()> {
    for o in only {
        if o != BASELINE && !VARIANTS[1..].iter().any(|(v, _)| v == o) {
            let names: Vec<&str> = VARIANTS[1..].iter().map(|(v, _)| *v).collect();
            anyhow::bail!(
                "--variants: no variant `{o}` (variants: {})",
                names.join(", ")
            );
        }
    }
    Ok(())
}

fn bin_of(ctx: &Ctx, variant: &str) -> PathBuf {
    let dir = &ctx.dir;
    if variant == BASELINE {
        if let Some(b) = &ctx.baseline {
            return b.bin.clone();
        }
    }
    if variant == "full" {
        dir.join("connreap")
    } else {
        dir.join(format!("connreap-{variant}"))
    }
}

/// The variable agent-ebpf's build.rs reads to select a tracker variant.
const VARIANT_ENV: &str = "CONNREAP_TRACKER_VARIANT";

/// The variants' own target directory. agent-ebpf's build.rs honours a variant only under a
/// directory of this name, and the shipped build (target/bpfel-unknown-none/release, which
/// agent/build.rs embeds from) never uses it, so a variant cannot end up in a plain build, even
/// after a failed run.
pub fn variants_dir() -> PathBuf {
    crate::root().join("target/bench-variants")
}

/// Build an agent per variant (its tracker and the agent around it, both in
/// [`variants_dir`]) and copy it into `dir`.
pub fn build(dir: &Path, builds: &crate::Builds, only: &[String]) -> Result<()> {
    let target = variants_dir();
    for (v, _) in selected(only) {
        eprintln!("bench: building the {v} variant of the tracker");
        let mut bpf = (builds.ebpf_cargo)("build")?;
        bpf.env(VARIANT_ENV, v).env("CARGO_TARGET_DIR", &target);
        crate::run_cmd(&mut bpf)?;
        // Each variant's object is kept, for the check that the shipped object is none of them
        // (xtask's shipcheck).
        let objects = target.join("objects");
        std::fs::create_dir_all(&objects)?;
        std::fs::copy(
            target.join("bpfel-unknown-none/release/connreap-ebpf"),
            objects.join(v),
        )
        .with_context(|| format!("keep the {v} object in {}", objects.display()))?;
        // The agent's copy of connreap-ebpf gets the same variant (shared types such as
        // EVENT_BATCH), and its build.rs embeds the object from this target directory.
        let mut agent = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
        agent
            .current_dir(crate::root())
            .args(["build", "--release", "--package", "connreap"])
            .env(VARIANT_ENV, v)
            .env("CARGO_TARGET_DIR", &target);
        crate::run_cmd(&mut agent)?;
        let to = dir.join(format!("connreap-{v}"));
        let _ = std::fs::remove_file(&to);
        std::fs::copy(target.join("release/connreap"), &to)
            .with_context(|| format!("copy the {v} agent to {}", to.display()))?;
    }
    Ok(())
}

/// The two pin roots and API addresses of a pair (never the default root or port).
const SIDES: [(&str, &str); 2] = [
    ("/sys/fs/bpf/connreap-bench-first", "127.0.0.1:9478"),
    ("/sys/fs/bpf/connreap-bench-second", "127.0.0.1:9479"),
];
const WINDOW: Duration = Duration::from_secs(3);

fn remove_roots() {
    for (root, _) in SIDES {
        // Removing the pins detaches that root's tracker.
        let _ = std::fs::remove_dir_all(root);
    }
}

/// Removes both pair roots when dropped, so a failed pair leaves no tracker attached.
struct Roots;

impl Drop for Roots {
    fn drop(&mut self) {
        remove_roots();
    }
}

/// Both builds' trackers attached (`first` attached first), one churn window: each program's
/// ns/run.
fn pair(
    ctx: &Ctx,
    (agent_ns, load_ns): (&NsHandle, &NsHandle),
    first: &str,
    second: &str,
    tag: &str,
) -> Result<(f64, f64)> {
    remove_roots();
    let _roots = Roots;
    let mut daemons = Vec::new();
    for (i, v) in [first, second].into_iter().enumerate() {
        let (root, listen) = SIDES[i];
        let side = Side {
            bin: bin_of(ctx, v),
            listen,
            pin_root: Path::new(root),
        };
        daemons.push(Daemon::start_side(
            agent_ns,
            &ctx.dir,
            &format!("{tag}-{i}-{v}"),
            "1s",
            &side,
        )?);
    }
    let timeout = Duration::from_secs(60);
    let before: Vec<Scrape> = daemons.iter().map(|d| d.scrape()).collect::<Result<_>>()?;
    load::churn(load_ns, WORKERS, WINDOW)?;
    let mut out = [f64::NAN; 2];
    for (i, d) in daemons.iter_mut().enumerate() {
        // The second scan after the churn ended covers all of it.
        let after = d.wait_scans(2.0, timeout)?;
        let ((t0, n0), (t1, n1)) = (
            before[i].program("connreap_set_state"),
            after.program("connreap_set_state"),
        );
        if n1 > n0 {
            out[i] = (t1 - t0) / (n1 - n0);
        }
    }
    // Daemons stop before their pins go (drop order: daemons, then _roots).
    drop(daemons);
    Ok((out[0], out[1]))
}

/// Every variant against the shipped program, both orders per round; returns the report lines
/// and a diagnosis sentence. Runs with bpf_stats enabled and without the default root's tracker
/// (a third program on the tracepoint would take the first run's misses for both).
pub fn measure(ctx: &Ctx, handles: (&NsHandle, &NsHandle)) -> Result<(Vec<String>, String)> {
    agent::connreap(&["unpin", "--force"])?;
    let mut others: Vec<(&str, String)> = selected(&ctx.variants)
        .into_iter()
        .map(|(v, what)| (v, what.to_string()))
        .collect();
    if let Some(b) = &ctx.baseline {
        if ctx.variants.is_empty() || ctx.variants.iter().any(|v| v == BASELINE) {
            let what = format!("the shipped program of {} (`--baseline`)", b.label);
            others.push((BASELINE, what));
        }
    }
    // Per variant: the difference (variant − full) of each round, and the order effect.
    let mut diffs: Vec<Vec<f64>> = vec![Vec::new(); others.len()];
    let mut order: Vec<f64> = Vec::new();
    let mut full_first: Vec<f64> = Vec::new();
    for round in 0..ROUNDS {
        for (i, (v, _)) in others.iter().enumerate() {
            let (f1, v2) = pair(ctx, handles, "full", v, &format!("parts-{round}-a"))?;
            let (v1, f2) = pair(ctx, handles, v, "full", &format!("parts-{round}-b"))?;
            // full first: v − full = D − O; variant first: v − full = D + O.
            let (x, y) = (v2 - f1, v1 - f2);
            diffs[i].push((x + y) / 2.0);
            order.push((y - x) / 2.0);
            full_first.push(f1);
        }
    }
    let full = median(&full_first);
    let d: Vec<f64> = diffs.iter().map(|v| median(v)).collect();
    let o = median(&order);
    let mut lines = vec![
        format!(
            "\nParts of connreap_set_state, from bench-only builds of the tracker, each measured \
             at the same time as the shipped program (both attached, two daemons with their own \
             pin roots, the same {}s churn windows, {ROUNDS} rounds, each pair in both orders; \
             `cargo xtask bench --probe-parts`). The shipped program ran at {full:.0} ns/run \
             (median) when attached first, as it is alone; the program attached first pays \
             {o:.0} ns/run more than the same program second (the order effect the two orders \
             cancel):\n",
            WINDOW.as_secs()
        ),
        "| variant | what it does | variant − full, per round | median | ≈ ns/run alone |\n|---|---|---|---|---|".into(),
        format!("| full | {} | – | – | {full:.0} ns |", VARIANTS[0].1),
    ];
    for (i, (v, what)) in others.iter().enumerate() {
        let each: Vec<String> = diffs[i].iter().map(|x| format!("{x:+.0}")).collect();
        lines.push(format!(
            "| {v} | {what} | {} | {:+.0} ns | {:.0} ns |",
            each.join(", "),
            d[i],
            full + d[i]
        ));
    }
    if let Some(i) = others.iter().position(|(v, _)| *v == BASELINE) {
        lines.push(format!(
            "\nThis commit's tracker against the baseline's, side by side: {:.3}× ({full:.0} \
             against ≈ {:.0} ns/run).",
            full / (full + d[i]),
            full + d[i]
        ));
    }
    let of = |name: &str| {
        others
            .iter()
            .position(|(v, _)| *v == name)
            .map_or(f64::NAN, |i| d[i])
    };
    let diagnosis = format!(
        "Measured by parts (bench-only builds attached side by side with the shipped program, \
         {full:.0} ns/run here): the events cost ≈ {:.0} ns/run (no-ring {:+.0}), the state \
         table ≈ {:.0} ns/run (no-map {:+.0}), and the floor with neither (entry, bpf_stats \
         accounting, one load, the count) is ≈ {:.0} ns/run (count-only {:+.0}). Sending each \
         transition as its own ring record instead of per-CPU batches costs {:+.0} ns/run; \
         stamping with bpf_ktime_get_ns instead of jiffies {:+.0} ns/run; keeping the state in \
         the kernel's hash map instead of the set-associative table {:+.0} ns/run; one ring record \
         per 32 events instead of 64 {:+.0} ns/run; per-socket storage instead of the table \
         {:+.0} ns/run (NaN: a variant not measured in this run). Of the shipped program's time, \
         ≈ {o:.0} ns/run are cache misses on the socket that a second program on the same \
         tracepoint does not pay.",
        -of("no-ring"),
        of("no-ring"),
        -of("no-map"),
        of("no-map"),
        full + of("count-only"),
        of("count-only"),
        of("unbatched"),
        of("ktime"),
        of("hash"),
        of("batch32"),
        of("sk-storage")
    );
    Ok((lines, diagnosis))
}
