//! Measures 3, 6 and 7 against an older connreap (`--baseline PATH`, or `--baseline-commit REV` to
//! build one): both binaries' snapshots of the same sockets, alternated in one run, so a
//! regression is a ratio measured side by side rather than a comparison with a run from another
//! time; and both as daemons over those sockets ([`daemon`]).
//!
//! The current binary runs as measure 3 runs it (`snapshot --json --netns host`: its own
//! namespace alone); an older one may know no `--netns` and only ever dumped its own namespace,
//! so it runs `snapshot --json`. The row counts of both are compared before timing. The baseline
//! pins its tracker under a root of its own ([`PIN_ROOT`]), so neither binary removes the other's
//! pins (each removes pins of another object hash under its root); the root is removed at the end.
use std::{
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{bail, Context, Result};

mod daemon;
mod namespaces;
pub use daemon::{daemon_row, BASE_LISTEN};
pub use namespaces::{knows_namespaces, namespaces_row};

use super::{
    proc::{self, Timed},
    report::{ms, Row, Verdict},
    scan_split::ScanSplit,
    sys::NsHandle,
    BenchArgs, Ctx,
};

/// The baseline's pin root (on bpffs, next to the default `/sys/fs/bpf/connreap`).
pub const PIN_ROOT: &str = "/sys/fs/bpf/connreap-baseline";
/// The current snapshot may take at most this much of the baseline's time (the
/// single-namespace figures must not get worse by more than 5 %).
pub const TARGET: f64 = 1.05;
/// Where `--baseline-commit` checks out the old source (a git worktree, reused).
const SRC_DIR: &str = "target/bench-baseline-src";
const CURRENT_ARGS: [&str; 4] = ["snapshot", "--json", "--netns", "host"];
const BASELINE_ARGS: [&str; 2] = ["snapshot", "--json"];

/// The older connreap measure 3 compares with.
#[derive(Clone, Debug)]
pub struct Baseline {
    /// The bench's copy of the binary (a rebuild of the source cannot change it mid-run).
    pub bin: PathBuf,
    /// Where it came from.
    pub source: PathBuf,
    /// How rows name it (a commit, or the label given).
    pub label: String,
}

/// The baseline the arguments ask for, copied into the bench's `dir`; with `--baseline-commit`
/// built first.
pub fn resolve(args: &BenchArgs, dir: &Path) -> Result<Option<Baseline>> {
    let (source, label) = match (&args.baseline, &args.baseline_commit) {
        (Some(p), _) => (p.clone(), label_of(p)),
        (None, Some(rev)) => build_commit(rev)?,
        (None, None) => return Ok(None),
    };
    if !source.is_file() {
        bail!("baseline binary {} not found", source.display());
    }
    let bin = dir.join("connreap-baseline");
    let _ = std::fs::remove_file(&bin);
    std::fs::copy(&source, &bin)
        .with_context(|| format!("copy {} to {}", source.display(), bin.display()))?;
    Ok(Some(Baseline {
        bin,
        source: source.canonicalize().unwrap_or(source),
        label: args.baseline_label.clone().unwrap_or(label),
    }))
}

/// A name for a baseline binary: the commit of the git worktree it was built in
/// (`<tree>/target/release/connreap`), else its file name.
fn label_of(bin: &Path) -> String {
    let tree = bin
        .canonicalize()
        .ok()
        .and_then(|p| Some(p.parent()?.parent()?.parent()?.to_path_buf()));
    let rev = tree.and_then(|t| git_out(&t, &["rev-parse", "--short", "HEAD"]).ok());
    rev.unwrap_or_else(|| bin.display().to_string())
}

fn git_out(dir: &Path, args: &[&str]) -> Result<String> {
    let out = Command::new("git")
        .current_dir(dir)
        .args(args)
        .output()
        .context("run git")?;
    if !out.status.success() {
        bail!(
            "git {} failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// Check out `rev` into [`SRC_DIR`] (a detached git worktree, created once and reused) and
/// build it with its own `cargo xtask build`; returns its agent binary and the short commit.
pub fn build_commit(rev: &str) -> Result<(PathBuf, String)> {
    let root = crate::root();
    let want = git_out(
        &root,
        &["rev-parse", "--verify", &format!("{rev}^{{commit}}")],
    )?;
    let short = git_out(&root, &["rev-parse", "--short", &want])?;
    let src = root.join(SRC_DIR);
    if src.join(".git").exists() {
        if git_out(&src, &["rev-parse", "HEAD"])? != want {
            crate::run_cmd(
                Command::new("git")
                    .current_dir(&src)
                    .args(["checkout", "--detach", "--quiet", &want]),
            )?;
        }
    } else {
        std::fs::create_dir_all(root.join("target"))?;
        crate::run_cmd(
            Command::new("git")
                .current_dir(&root)
                .args(["worktree", "add", "--detach"])
                .arg(&src)
                .arg(&want),
        )?;
    }
    let t0 = Instant::now();
    // Its own xtask, workspace and target dir: nothing of this build is shared with ours.
    crate::run_cmd(
        Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
            .current_dir(&src)
            .args(["xtask", "build"])
            .env_remove("CARGO_TARGET_DIR"),
    )?;
    eprintln!(
        "bench: baseline {short} built in {:.0?}: {}",
        t0.elapsed(),
        src.join("target/release/connreap").display()
    );
    Ok((src.join("target/release/connreap"), short))
}

/// One binary's snapshot as the comparison runs it.
struct Side {
    bin: PathBuf,
    args: &'static [&'static str],
    /// `CONNREAP_PIN_ROOT`, when not the default root.
    pin_root: Option<&'static str>,
}

impl Side {
    fn command(&self, h: &NsHandle) -> Command {
        let mut c = h.command(&self.bin);
        c.args(self.args);
        match self.pin_root {
            Some(r) => c.env("CONNREAP_PIN_ROOT", r),
            None => c.env_remove("CONNREAP_PIN_ROOT"),
        };
        c
    }

    /// The rows of one snapshot.
    fn rows(&self, h: &NsHandle) -> Result<usize> {
        let out = self
            .command(h)
            .stdin(Stdio::null())
            .stderr(Stdio::piped())
            .output()?;
        if !out.status.success() {
            bail!(
                "{} {} failed ({}): {}",
                self.bin.display(),
                self.args.join(" "),
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        let v: serde_json::Value = serde_json::from_slice(&out.stdout)?;
        Ok(v["sockets"]
            .as_array()
            .context("no sockets in the snapshot")?
            .len())
    }
}

fn current() -> Side {
    Side {
        bin: crate::agent::bin(),
        args: &CURRENT_ARGS,
        pin_root: None,
    }
}

fn baseline(b: &Baseline) -> Side {
    Side {
        bin: b.bin.clone(),
        args: &BASELINE_ARGS,
        pin_root: Some(PIN_ROOT),
    }
}

/// The baseline's tracker pinned under [`PIN_ROOT`]: created (and warmed up, the first load
/// verifies the programs) by [`Pins::warm`], removed on drop with the baseline's own
/// `connreap unpin`, then whatever is left of the root (only connreap's pins are there).
pub struct Pins<'a> {
    b: &'a Baseline,
}

impl<'a> Pins<'a> {
    pub fn warm(b: &'a Baseline, h: &NsHandle) -> Result<Pins<'a>> {
        let pins = Pins { b };
        pins.remove();
        proc::timed(&mut baseline(b).command(h), Duration::from_secs(60))
            .context("the baseline's warm-up snapshot")?;
        Ok(pins)
    }

    fn remove(&self) {
        unpin(self.b);
    }
}

/// Detach the baseline's tracker: its own `connreap unpin`, then whatever is left of its root
/// (only connreap's pins are there).
pub fn unpin(b: &Baseline) {
    let st = Command::new(&b.bin)
        .arg("unpin")
        .env("CONNREAP_PIN_ROOT", PIN_ROOT)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
    if !st.is_ok_and(|s| s.success()) {
        eprintln!("bench: warning: the baseline's `connreap unpin` failed");
    }
    let root = Path::new(PIN_ROOT);
    if root.exists() {
        if let Err(e) = std::fs::remove_dir_all(root) {
            eprintln!("bench: warning: cannot remove {PIN_ROOT}: {e}");
        }
    }
}

impl Drop for Pins<'_> {
    fn drop(&mut self) {
        self.remove();
    }
}

/// Alternated order of `pairs` ABBA blocks: true runs the current binary. Blocks alternate
/// which binary starts (ABBA BAAB ...), so neither is always first after the other.
fn order(pairs: usize) -> Vec<bool> {
    (0..pairs)
        .flat_map(|k| {
            let a = k % 2 == 0;
            [a, !a, !a, a]
        })
        .collect()
}

/// Ratio current/baseline of the median wall times, and its verdict against [`TARGET`].
fn judge(current: Duration, baseline: Duration) -> (f64, Verdict) {
    let r = current.as_secs_f64() / baseline.as_secs_f64().max(1e-9);
    (r, Verdict::of(r <= TARGET))
}

/// Both snapshots return about the same rows (1 %, at least 5 sockets of slack for sockets
/// that come and go): else they did not dump the same namespace.
fn rows_agree(current: usize, baseline: usize) -> bool {
    current.abs_diff(baseline) <= (current.max(baseline) / 100).max(5)
}

/// Median times of both over alternated ABBA blocks, and each block's ratio of sums.
struct Timings {
    current: Timed,
    baseline: Timed,
    block_ratios: Vec<f64>,
    runs: usize,
}

fn time_both(h: &NsHandle, cur: &Side, base: &Side, pairs: usize) -> Result<Timings> {
    let timeout = Duration::from_secs(120);
    let (mut c, mut b) = (Vec::new(), Vec::new());
    let mut block_ratios = Vec::new();
    for block in order(pairs).chunks(4) {
        let (mut sc, mut sb) = (0.0, 0.0);
        for &is_current in block {
            let side = if is_current { cur } else { base };
            let t = proc::timed(&mut side.command(h), timeout)?;
            if is_current {
                sc += t.wall.as_secs_f64();
                c.push(t);
            } else {
                sb += t.wall.as_secs_f64();
                b.push(t);
            }
        }
        block_ratios.push(sc / sb.max(1e-9));
    }
    Ok(Timings {
        runs: c.len(),
        current: Timed::median(c),
        baseline: Timed::median(b),
        block_ratios,
    })
}

/// The row "snapshot @ N vs baseline LABEL": in the namespace of `h` (the holders' sockets),
/// with the baseline's tracker pinned and warmed up (`_pins`).
pub fn row(ctx: &Ctx, h: &NsHandle, tag: &str, b: &Baseline, _pins: &Pins) -> Result<Row> {
    let (cur, base) = (current(), baseline(b));
    let (cur_rows, base_rows) = (cur.rows(h)?, base.rows(h)?);
    if !rows_agree(cur_rows, base_rows) {
        bail!(
            "the snapshots do not see the same sockets: {cur_rows} rows (current, {}) vs \
             {base_rows} (baseline {}, {})",
            cur.args.join(" "),
            b.label,
            base.args.join(" ")
        );
    }
    let pairs = if ctx.smoke { 2 } else { 10 };
    let t = time_both(h, &cur, &base, pairs)?;
    let split_runs = if ctx.smoke { 3 } else { 5 };
    let split_cur = ScanSplit::measure_with(|| cur.command(h), split_runs)?;
    let split_base = ScanSplit::measure_with(|| base.command(h), split_runs)?;
    let (r, verdict) = judge(t.current.wall, t.baseline.wall);
    let (lo, hi) = t
        .block_ratios
        .iter()
        .fold((f64::MAX, f64::MIN), |(lo, hi), &x| (lo.min(x), hi.max(x)));
    let split = split_table(&split_cur, &split_base, &b.label);
    let details = vec![
        format!(
            "Baseline: {} (copied from {}), run as `{}` with CONNREAP_PIN_ROOT={PIN_ROOT}; \
             current: `{}` with the default pin root. Each warmed up before timing. Rows: \
             {cur_rows} (current) and {base_rows} (baseline). {} alternated ABBA blocks \
             ({} runs each), stdout to /dev/null; medians:",
            b.label,
            b.source.display(),
            base.args.join(" "),
            cur.args.join(" "),
            pairs,
            t.runs
        ),
        format!(
            "\n| binary | wall | user | sys |\n|---|---|---|---|\n| current | {} | {} | {} |\n\
             | baseline {} | {} | {} | {} |",
            ms(t.current.wall),
            ms(t.current.user),
            ms(t.current.sys),
            b.label,
            ms(t.baseline.wall),
            ms(t.baseline.user),
            ms(t.baseline.sys)
        ),
        format!(
            "\nEach block's ratio (current / baseline, sums of its two runs each): {} (from \
             {lo:.3}× to {hi:.3}×).",
            t.block_ratios
                .iter()
                .map(|x| format!("{x:.3}"))
                .collect::<Vec<_>>()
                .join(", ")
        ),
        format!("\n{split}"),
    ];
    Ok(Row {
        id: "3",
        name: format!("snapshot @ {cur_rows} sockets ({tag}) vs baseline {}", b.label),
        result: format!("{r:.3}×"),
        figures: format!(
            "current {}; baseline {} {}; rows {cur_rows} vs {base_rows}; medians of {} runs each, ABBA",
            t.current.show(),
            b.label,
            t.baseline.show(),
            t.runs
        ),
        target: format!("≤ {TARGET}×"),
        verdict,
        details,
        diagnosis: if verdict == Verdict::Pass {
            vec![]
        } else {
            vec![split]
        },
    })
}

/// One part of a snapshot's split of its time.
type Part = fn(&ScanSplit) -> Duration;

/// Both snapshots' own split of their time (their debug lines), part by part.
fn split_table(cur: &ScanSplit, base: &ScanSplit, label: &str) -> String {
    let parts: [(&str, Part); 8] = [
        ("opening pins", |s| s.load),
        ("both dumps (wall)", |s| s.dumps),
        ("socket dump", |s| s.socket_total),
        ("of it iter/tcp in the kernel", |s| s.socket_kernel),
        ("owner dump", |s| s.owner_total),
        ("of it iter/task_file in the kernel", |s| s.owner_kernel),
        ("merge", |s| s.merge),
        ("sort, summary, JSON", |s| s.output),
    ];
    let cells: Vec<String> = parts
        .iter()
        .map(|(name, f)| format!("{name} {} vs {}", ms(f(cur)), ms(f(base))))
        .collect();
    format!(
        "Inside the snapshots (their `connreap::scan`/`connreap::snapshot` debug lines, medians), \
         current vs baseline {label}: {}.",
        cells.join("; ")
    )
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        bench: BenchArgs,
    }

    fn parse(args: &[&str]) -> Result<BenchArgs, clap::Error> {
        Cli::try_parse_from(std::iter::once("bench").chain(args.iter().copied())).map(|c| c.bench)
    }

    #[test]
    fn parses_the_baseline_options() {
        let a = parse(&["--only", "3", "--smoke", "--baseline", "/tmp/old"]).unwrap();
        assert_eq!(a.baseline.as_deref(), Some(Path::new("/tmp/old")));
        assert_eq!(a.baseline_commit, None);
        assert!(a.smoke);
        let a = parse(&["--baseline-commit", "f807df7", "--baseline-label", "old"]).unwrap();
        assert_eq!(a.baseline_commit.as_deref(), Some("f807df7"));
        assert_eq!(a.baseline_label.as_deref(), Some("old"));
        assert!(parse(&["--baseline", "/x", "--baseline-commit", "f807df7"]).is_err());
        assert!(parse(&["--baseline-label", "old"]).is_err());
        let a = parse(&[]).unwrap();
        assert!(a.baseline.is_none() && a.baseline_commit.is_none());
    }

    #[test]
    fn ratio_and_verdict() {
        let ms = Duration::from_millis;
        let (r, v) = judge(ms(105), ms(100));
        assert!((r - 1.05).abs() < 1e-9);
        assert!(v == Verdict::Pass);
        let (r, v) = judge(ms(262), ms(226));
        assert!((r - 1.159).abs() < 1e-3);
        assert!(v == Verdict::Miss);
        assert!(judge(ms(90), ms(100)).1 == Verdict::Pass);
        assert!(judge(ms(1), Duration::ZERO).1 == Verdict::Miss);
    }

    #[test]
    fn abba_blocks_balance_both_binaries() {
        let o = order(3);
        assert_eq!(o.len(), 12);
        assert_eq!(o.iter().filter(|&&c| c).count(), 6);
        assert_eq!(
            &o[..8],
            &[true, false, false, true, false, true, true, false]
        );
        for block in o.chunks(4) {
            assert_eq!(block.iter().filter(|&&c| c).count(), 2);
            assert_eq!(block[0], block[3]);
        }
    }

    #[test]
    fn row_counts_agree_roughly() {
        assert!(rows_agree(10001, 10001));
        assert!(rows_agree(1003, 1001));
        assert!(rows_agree(102006, 101100));
        assert!(!rows_agree(102006, 100000));
        assert!(!rows_agree(10001, 20002));
        assert!(!rows_agree(10, 0));
    }
}
