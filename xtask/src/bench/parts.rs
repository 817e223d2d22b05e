//! `--probe-parts`: what each part of the state-change program costs, from bench-only builds of
//! the tracker (`CONNREAP_PROBE_VARIANT`, see agent-ebpf's programs.rs) measured side by side,
//! alternated, in the same run and namespaces as measure 1.
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

use super::{agent, sys::NsHandle, Ctx};

/// (variant, what that build of connreap_set_state does). "full" is the shipped program.
pub const VARIANTS: [(&str, &str); 7] = [
    (
        "full",
        "the shipped program: state map + events staged per CPU, one ring record per 32",
    ),
    (
        "no-ring",
        "state map, no events (the transition is still counted in the staging batch's header)",
    ),
    ("no-map", "events (batched), no state map"),
    (
        "count-only",
        "counts the transition and returns (entry, bpf_stats accounting, protocol load, the \
         per-CPU count)",
    ),
    (
        "unbatched",
        "state map + one ring record per transition (the design before per-CPU batches)",
    ),
    (
        "ktime",
        "the shipped program stamping transitions with bpf_ktime_get_ns instead of jiffies",
    ),
    (
        "prealloc",
        "the shipped program with the state map's elements preallocated (a fixed ≈ 31 MB)",
    ),
];
const ROUNDS: usize = 3;

fn bin_of(dir: &Path, variant: &str) -> PathBuf {
    if variant == "full" {
        dir.join("connreap")
    } else {
        dir.join(format!("connreap-{variant}"))
    }
}

/// Build an agent per variant into `dir`, then rebuild the normal object and agent.
pub fn build(dir: &Path) -> Result<()> {
    for (v, _) in VARIANTS.iter().filter(|v| v.0 != "full") {
        eprintln!("bench: building the {v} variant of the tracker");
        crate::build_ebpf_variant(Some(v))?;
        crate::build_agent_only()?;
        let to = bin_of(dir, v);
        let _ = std::fs::remove_file(&to);
        std::fs::copy(crate::agent_bin(), &to)
            .with_context(|| format!("copy the {v} agent to {}", to.display()))?;
    }
    eprintln!("bench: rebuilding the normal tracker");
    crate::build_agent()
}

/// Each variant for one window per round; returns the report lines and a diagnosis sentence.
pub fn measure(
    ctx: &Ctx,
    handles: (&NsHandle, &NsHandle),
    window: impl Fn(&Ctx, &str, (&NsHandle, &NsHandle)) -> Result<f64>,
) -> Result<(Vec<String>, String)> {
    let mut runs: Vec<Vec<f64>> = vec![Vec::new(); VARIANTS.len()];
    for round in 0..ROUNDS {
        for (i, (v, _)) in VARIANTS.iter().enumerate() {
            agent::set_bin(bin_of(&ctx.dir, v));
            let ns = window(ctx, &format!("parts-{v}-{round}"), handles);
            agent::set_bin(bin_of(&ctx.dir, "full"));
            runs[i].push(ns?);
        }
    }
    let med: Vec<f64> = runs
        .iter()
        .map(|r| {
            let mut r = r.clone();
            r.sort_by(|a, b| a.total_cmp(b));
            r[r.len() / 2]
        })
        .collect();
    let mut lines = vec![
        format!(
            "\nParts of connreap_set_state, from bench-only builds of the tracker measured side by \
             side ({ROUNDS} rounds, variants alternated, one 3 s churn window each, same setup as \
             window A; `cargo xtask bench --probe-parts`):\n"
        ),
        "| variant | what it does | ns/run per round | median |\n|---|---|---|---|".into(),
    ];
    for (i, (v, what)) in VARIANTS.iter().enumerate() {
        let each: Vec<String> = runs[i].iter().map(|x| format!("{x:.0}")).collect();
        lines.push(format!(
            "| {v} | {what} | {} | {:.0} ns |",
            each.join(", "),
            med[i]
        ));
    }
    let diagnosis = format!(
        "Measured by parts (bench-only builds, side by side): the events cost ≈ {:.0} ns/run \
         (full {:.0} − no-ring {:.0}), the state map ≈ {:.0} ns/run (full − no-map {:.0}), and \
         the floor with neither (entry, bpf_stats accounting, one load, one counter) is {:.0} \
         ns/run. Sending each transition as its own ring record instead of per-CPU batches \
         costs {:.0} ns/run ({:+.0}); stamping with bpf_ktime_get_ns instead of jiffies {:.0} \
         ns/run ({:+.0}); preallocating the state map {:.0} ns/run ({:+.0}).",
        med[0] - med[1],
        med[0],
        med[1],
        med[0] - med[2],
        med[2],
        med[3],
        med[4],
        med[4] - med[0],
        med[5],
        med[5] - med[0],
        med[6],
        med[6] - med[0]
    );
    Ok((lines, diagnosis))
}
