//! Measure 7: many network namespaces. The bench creates them (deleted on drop), each with
//! `lo` up and a holder process keeping loopback connections open inside it. Side by side, in
//! alternated rounds: one `connreap snapshot --json` (every namespace in one run) against what a
//! user would script without connreap, `ss -tanp` entered into each namespace in turn with
//! `nsenter --net`. Then a daemon scanning them all: its CPU per scan and its VmRSS.
use std::{
    collections::HashSet,
    path::Path,
    process::{Command, Stdio},
    time::Duration,
};

use anyhow::{bail, Context, Result};

use crate::{
    agent::{self, Daemon, Side, Window},
    baseline::{self, Baseline},
    load::{self, Holders},
    memory_cpu,
    proc::{self, Timed},
    report::{ms, Row, Verdict},
    scan_split::ScanSplit,
    sys::{NetNs, NsHandle},
    Ctx,
};

/// The target: a snapshot of every namespace in at most a tenth of the scripted loop.
const VS_LOOP: f64 = 0.1;

/// How many namespaces, connections per namespace (two sockets each, plus the listener),
/// alternated rounds, daemon scan interval and scans observed.
struct Size {
    spaces: usize,
    conns: usize,
    rounds: usize,
    interval: f64,
    scans: usize,
}

impl Size {
    fn of(ctx: &Ctx) -> Size {
        if ctx.smoke {
            Size {
                spaces: 5,
                conns: 50,
                rounds: 2,
                interval: 1.0,
                scans: 3,
            }
        } else {
            let (spaces, conns) = ctx.spread.unwrap_or((100, 500));
            Size {
                spaces,
                conns,
                rounds: 3,
                interval: 2.0,
                scans: 10,
            }
        }
    }
}

/// The namespaces and the holders in them; the holders stop before the namespaces go.
struct Population {
    holders: Vec<Holders>,
    spaces: Vec<NetNs>,
    held: usize,
}

impl Population {
    fn start(size: &Size) -> Result<Population> {
        let mut p = Population {
            holders: Vec::new(),
            spaces: Vec::new(),
            held: 0,
        };
        for i in 0..size.spaces {
            let ns = NetNs::new(&format!("many{i}"))?;
            let h = Holders::start(&ns.handle(), &[size.conns])?;
            p.held += h.sockets;
            p.holders.push(h);
            p.spaces.push(ns);
        }
        Ok(p)
    }

    /// The same holders and sockets, all in one namespace.
    fn start_in_one(size: &Size) -> Result<Population> {
        let ns = NetNs::new("manyone")?;
        let h = Holders::start(&ns.handle(), &vec![size.conns; size.spaces])?;
        Ok(Population {
            held: h.sockets,
            holders: vec![h],
            spaces: vec![ns],
        })
    }

    fn names(&self) -> Vec<String> {
        self.spaces.iter().map(|n| n.name().to_string()).collect()
    }
}

impl Drop for Population {
    fn drop(&mut self) {
        self.holders.clear();
        self.spaces.clear();
    }
}

/// What one parsed snapshot saw: all its rows, the rows in the bench's namespaces, those with
/// an owner, and the distinct namespaces with at least one row.
struct Seen {
    rows: usize,
    ours: usize,
    ours_owned: usize,
    spaces: usize,
}

fn snapshot_cmd(host: &NsHandle) -> Command {
    let mut c = host.command(agent::bin());
    c.args(["snapshot", "--json"]);
    c
}

fn verify(host: &NsHandle, names: &[String]) -> Result<Seen> {
    let v = agent::snapshot_json(host, &[])?;
    let socks = v["sockets"].as_array().context("no sockets in snapshot")?;
    let ours: HashSet<&str> = names.iter().map(String::as_str).collect();
    let mine: Vec<&serde_json::Value> = socks
        .iter()
        .filter(|s| s["netns_name"].as_str().is_some_and(|n| ours.contains(n)))
        .collect();
    let spaces: HashSet<u64> = socks.iter().filter_map(|s| s["netns"].as_u64()).collect();
    Ok(Seen {
        rows: socks.len(),
        ours: mine.len(),
        ours_owned: mine.iter().filter(|s| s["pid"].is_u64()).count(),
        spaces: spaces.len(),
    })
}

/// The namespaces one snapshot scanned (its `connreap::scan` debug line's `namespaces=`).
fn scanned_namespaces(host: &NsHandle) -> Option<u64> {
    let out = snapshot_cmd(host)
        .env("RUST_LOG", "connreap::scan=debug")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .output()
        .ok()?;
    String::from_utf8_lossy(&out.stderr)
        .split_whitespace()
        .find_map(|w| w.strip_prefix("namespaces=")?.parse().ok())
}

/// The loop a user would write: `ss ARGS` in each namespace in turn, entered with
/// `nsenter --net` (lighter than `ip netns exec`, which also remounts /sys in a new mount
/// namespace). Timed as one command: the shell waits for each child, so its CPU times include
/// theirs.
fn ss_loop(names: &[String], args: &str) -> Command {
    let mut c = Command::new("sh");
    c.arg("-c")
        .arg(format!(
            "for n in \"$@\"; do nsenter --net=\"/run/netns/$n\" ss {args} || exit 1; done"
        ))
        .arg("sh")
        .args(names);
    c
}

/// Lines of `ss -tanH` over all the bench's namespaces (the sockets the loop reports).
fn ss_loop_count(names: &[String]) -> Result<usize> {
    let out = ss_loop(names, "-tanH").stderr(Stdio::null()).output()?;
    if !out.status.success() {
        bail!("nsenter + ss loop failed: {}", out.status);
    }
    Ok(String::from_utf8_lossy(&out.stdout).lines().count())
}

/// Every round's times: connreap's snapshot, the `ss -tanp` loop and the `ss -tan` loop.
struct Rounds {
    snap: Vec<Timed>,
    ssp: Vec<Timed>,
    ss: Vec<Timed>,
}

/// `n` rounds; the snapshot runs first in even rounds and last in odd ones, so a drift of the
/// machine during a round weighs on both sides alike.
fn rounds(host: &NsHandle, names: &[String], n: usize) -> Result<Rounds> {
    let timeout = Duration::from_secs(1800);
    let mut r = Rounds {
        snap: Vec::new(),
        ssp: Vec::new(),
        ss: Vec::new(),
    };
    for i in 0..n {
        if i % 2 == 0 {
            r.snap.push(proc::timed(&mut snapshot_cmd(host), timeout)?);
        }
        r.ssp
            .push(proc::timed(&mut ss_loop(names, "-tanp"), timeout)?);
        r.ss.push(proc::timed(&mut ss_loop(names, "-tan"), timeout)?);
        if i % 2 == 1 {
            r.snap.push(proc::timed(&mut snapshot_cmd(host), timeout)?);
        }
        eprintln!(
            "bench: measure 7 round {}: snapshot {}, ss -tanp loop {}",
            i + 1,
            ms(r.snap[i].wall),
            ms(r.ssp[i].wall)
        );
    }
    Ok(r)
}

pub fn namespaces(ctx: &mut Ctx) -> Result<Vec<Row>> {
    let size = Size::of(ctx);
    load::raise_nofile()?;
    if Command::new("nsenter").arg("-V").output().is_err() {
        bail!("`nsenter` (util-linux) not found");
    }
    if ctx.spread_only {
        return Ok(vec![one_namespace_row(ctx, &size)?]);
    }
    let pop = Population::start(&size)?;
    let names = pop.names();
    let host = NsHandle::current()?;
    let seen = verify(&host, &names)?;
    if seen.ours < pop.held {
        bail!(
            "the snapshot saw {} sockets in the bench's namespaces but {} are held",
            seen.ours,
            pop.held
        );
    }
    let scanned = scanned_namespaces(&host);
    let ss_seen = ss_loop_count(&names)?;
    let r = rounds(&host, &names, size.rounds)?;
    let split = ScanSplit::measure(&host, size.rounds)?;
    let mut rows = vec![snapshot_row(
        &size, &pop, &seen, scanned, ss_seen, &r, &split,
    )];
    rows.extend(daemon_rows(ctx, &size, &pop)?);
    drop(pop);
    rows.push(one_namespace_row(ctx, &size)?);
    Ok(rows)
}

fn snapshot_row(
    size: &Size,
    pop: &Population,
    seen: &Seen,
    scanned: Option<u64>,
    ss_seen: usize,
    r: &Rounds,
    split: &ScanSplit,
) -> Row {
    let (snap, ssp, ss) = (
        Timed::median(r.snap.clone()),
        Timed::median(r.ssp.clone()),
        Timed::median(r.ss.clone()),
    );
    let ratio = snap.wall.as_secs_f64() / ssp.wall.as_secs_f64().max(1e-9);
    let each = |v: &[Timed]| v.iter().map(|t| ms(t.wall)).collect::<Vec<_>>().join(", ");
    let spaces = size.spaces;
    let scanned = scanned.map_or("?".to_string(), |n| n.to_string());
    let details = vec![
        format!(
            "{spaces} namespaces, each with `lo` up and one holder process keeping {} loopback \
             connections (both ends) to a listener of its own: {} sockets held. The snapshot \
             (run in the host namespace, every namespace by default) scanned {scanned} \
             namespaces (the bench's, the host's and any other on the machine) and returned {} \
             rows in {} namespaces; {} of them in the bench's namespaces, {} with an owner. The \
             loop's `ss -tan` reported {ss_seen} sockets. Medians of {} alternated rounds, \
             stdout to /dev/null:",
            size.conns,
            pop.held,
            seen.rows,
            seen.spaces,
            seen.ours,
            seen.ours_owned,
            size.rounds,
        ),
        format!(
            "\n| command | wall | user | sys | each round (wall) |\n|---|---|---|---|---|\n\
             | `connreap snapshot --json` | {} | {} | {} | {} |\n\
             | `nsenter --net=/run/netns/NAME ss -tanp`, for each namespace in turn | {} | {} | {} | {} |\n\
             | `nsenter --net=/run/netns/NAME ss -tan`, for each namespace in turn | {} | {} | {} | {} |",
            ms(snap.wall),
            ms(snap.user),
            ms(snap.sys),
            each(&r.snap),
            ms(ssp.wall),
            ms(ssp.user),
            ms(ssp.sys),
            each(&r.ssp),
            ms(ss.wall),
            ms(ss.user),
            ms(ss.sys),
            each(&r.ss),
        ),
        format!(
            "\nInside the snapshot (its `RUST_LOG=connreap::scan=debug,connreap::snapshot=debug` \
             lines, median of {} more runs): opening the pinned programs and maps {}; both dumps \
             (namespace discovery, then one iter/tcp dump per namespace from a thread that \
             enters it, next to the one iter/task_file dump) {}: the socket dumps {} ({} of it in \
             the kernel), the owner dump {} ({} in the kernel); the merge {}; sorting, the \
             summary and the JSON {}.",
            size.rounds,
            ms(split.load),
            ms(split.dumps),
            ms(split.socket_total),
            ms(split.socket_kernel),
            ms(split.owner_total),
            ms(split.owner_kernel),
            ms(split.merge),
            ms(split.output),
        ),
    ];
    let verdict = Verdict::of(ratio <= VS_LOOP);
    let diagnosis = if verdict == Verdict::Miss {
        vec![format!(
            "`connreap snapshot --json` took {} for all namespaces; the `ss -tanp` loop {}, of \
             which the same loop without `-p` (no owner walk over /proc) takes {}.",
            snap.show(),
            ssp.show(),
            ss.show()
        )]
    } else {
        vec![]
    };
    Row {
        id: "7",
        name: format!(
            "snapshot @ {spaces} namespaces × {} sockets vs nsenter + ss -tanp per namespace",
            2 * size.conns
        ),
        result: format!("{ratio:.3}×"),
        figures: format!("connreap {}; the loop {}", snap.show(), ssp.show()),
        target: format!("≤ {VS_LOOP}×"),
        verdict,
        details,
        diagnosis,
    }
}

/// What the daemon did over the observed scans.
struct Observed {
    /// One step per scan.
    w: Window,
    hwm: u64,
    kinds: String,
}

/// A daemon in a namespace of its own (for its API port; wherever it runs, it scans every
/// namespace) walking each other namespace once per `walk` (`agent.netns_walk_interval`):
/// after 2 warm-up scans (the first walks every namespace, all being new), its CPU over
/// `size.scans` scans and VmRSS after each.
/// `side`: the baseline's daemon instead of the current one.
fn observe(ctx: &Ctx, size: &Size, walk: &str, side: Option<&Baseline>) -> Result<Observed> {
    let ctl = NetNs::new("manyctl")?;
    let h = ctl.handle();
    let timeout = Duration::from_secs(120);
    let side = side.map(|b| Side {
        bin: b.bin.clone(),
        listen: baseline::BASE_LISTEN,
        pin_root: Path::new(baseline::PIN_ROOT),
    });
    let mut d = Daemon::start_as(
        &h,
        &ctx.dir,
        if side.is_some() {
            "netns-baseline"
        } else {
            "netns"
        },
        &format!("{}s", size.interval),
        &format!(
            "netns_walk_interval = \"{walk}\"\nmax_tracked_sockets = {}\n",
            table_for(size.spaces * (2 * size.conns + 1))
        ),
        side.as_ref(),
    )?;
    d.wait_scans(2.0, timeout)?;
    let w = d.window(size.scans, |d| d.wait_scans(1.0, timeout).map(drop))?;
    let o = Observed {
        w,
        hwm: proc::status_kb(d.pid(), "VmHWM")?,
        kinds: memory_cpu::kinds(d.pid())?,
    };
    drop(d);
    drop(ctl);
    Ok(o)
}

/// The daemon's state table for `sockets`: the default (262,144) or, for more than a third of
/// that, the power of two ≥ 3 × sockets (16-way sets then rarely fill: a socket the table has
/// no room for is carried from walks instead of swept fresh).
fn table_for(sockets: usize) -> usize {
    (3 * sockets).next_power_of_two().clamp(262_144, 4_194_304)
}

/// CPU per scan, mean scan time and the row's figures of an observation.
fn cpu_figures(o: &Observed, size: &Size) -> (Duration, String) {
    let w = &o.w;
    let scans = w.scans().max(1.0);
    let per_scan = w.cpu().div_f64(scans);
    let mean_scan = Duration::from_secs_f64(w.scan_seconds() / scans);
    let pct = w.cpu().as_secs_f64() / w.wall.as_secs_f64().max(1e-9) * 100.0;
    let figures = format!(
        "user {} + sys {} over {:.0} scans at {}s ({pct:.1} % of one core); mean scan {}; \
         {:.0} sockets in its last scan",
        ms(w.user),
        ms(w.sys),
        w.scans(),
        size.interval,
        ms(mean_scan),
        w.m1.sum("connreap_sockets")
    );
    (per_scan, figures)
}

fn daemon_rows(ctx: &Ctx, size: &Size, pop: &Population) -> Result<Vec<Row>> {
    // Side by side: walking every namespace on every scan (what every scan did before
    // netns_walk_interval), then once per observed window: `size.scans` scans are one walk
    // period, so each namespace is walked exactly once in it (spread over the scans).
    let all = observe(ctx, size, "0s", None)?;
    let period = format!("{}s", size.interval * size.scans as f64);
    let o = observe(ctx, size, &period, None)?;
    let spaces = size.spaces;
    let (per_scan_all, figures_all) = cpu_figures(&all, size);
    let (per_scan, figures) = cpu_figures(&o, size);
    let walk_all = Row::info("7", format!(
            "daemon CPU per scan @ {spaces} namespaces ({} sockets), netns_walk_interval = 0s (every namespace walked on every scan)",
            pop.held
        ), format!("{} CPU per scan", ms(per_scan_all)), figures_all);
    let ratio = per_scan.as_secs_f64() / per_scan_all.as_secs_f64().max(1e-9);
    let cpu = Row::info("7", format!(
            "daemon CPU per scan @ {spaces} namespaces ({} sockets), netns_walk_interval = {period} ({} scans: each namespace walked once)",
            pop.held, size.scans
        ), format!(
            "{} CPU per scan ({ratio:.3}× walking all on every scan)",
            ms(per_scan)
        ), figures);
    let peak_kb = o.w.rss.iter().copied().max().unwrap_or(0);
    let peak = peak_kb as f64 / 1024.0;
    let series: Vec<String> =
        o.w.rss
            .iter()
            .map(|k| format!("{:.1}", *k as f64 / 1024.0))
            .collect();
    let verdict = Verdict::of(peak <= memory_cpu::RSS_TARGET_MB);
    let facts = vec![
        format!(
            "VmRSS (MB) after each of {} scans, from the 3rd scan on: {} (the largest is judged); \
             VmHWM {:.1} MB.",
            size.scans,
            series.join(", "),
            o.hwm as f64 / 1024.0
        ),
        format!("At the end: {}.", o.kinds),
    ];
    let mem = Row {
        id: "7",
        name: format!("daemon memory @ {spaces} namespaces ({} sockets)", pop.held),
        result: format!("{peak:.1} MB VmRSS"),
        figures: format!(
            "largest VmRSS sampled after each scan; VmHWM {:.1} MB",
            o.hwm as f64 / 1024.0
        ),
        target: format!("≤ {} MB", memory_cpu::RSS_TARGET_MB),
        verdict,
        details: facts.clone(),
        diagnosis: if verdict == Verdict::Miss {
            facts
        } else {
            vec![]
        },
    };
    let mut rows = vec![walk_all, cpu, mem];
    if let Some(b) = ctx.baseline.clone() {
        let what = format!(
            "daemon CPU per scan @ {spaces} namespaces ({} sockets), netns_walk_interval = {period}",
            pop.held
        );
        if !baseline::knows_namespaces(&b) {
            println!(
                "bench: measure 7 has no baseline row: baseline {} knows no network namespaces \
                 (its snapshot has no --netns)",
                b.label
            );
        } else {
            let row = baseline::namespaces_row(ctx, &b, &what, |side| {
                observe(ctx, size, &period, side).map(|o| cpu_figures(&o, size).0)
            });
            rows.push(row.unwrap_or_else(|e| {
                eprintln!("bench: the baseline comparison of measure 7 failed: {e:#}");
                Row::failed("7", &format!("{what} vs baseline {}", b.label), &e)
            }));
        }
    }
    Ok(rows)
}

/// Target of the daemon's CPU per scan with the sockets spread over many namespaces against
/// the same sockets and holders in one (issue 31): the scan's cost should follow the sockets,
/// not the namespaces.
const SPREAD_VS_ONE: f64 = 1.2;

/// The daemon's CPU per scan at the default walk period (60 s: in a window of 10 scans, each
/// namespace's turn comes at most once), with the sockets in many namespaces and then, after
/// those namespaces are gone, the same holders and sockets in one. Measured one after the
/// other (the daemon watches every namespace, so the two cannot share the host), by a daemon
/// that was started after each population was up (its first scan walks every namespace).
fn one_namespace_row(ctx: &Ctx, size: &Size) -> Result<Row> {
    let spread = {
        let pop = Population::start(size)?;
        let o = observe(ctx, size, "60s", None)?;
        let held = pop.held;
        drop(pop);
        (cpu_figures(&o, size), held)
    };
    let one = {
        let pop = Population::start_in_one(size)?;
        let o = observe(ctx, size, "60s", None)?;
        drop(pop);
        cpu_figures(&o, size)
    };
    let ((spread_cpu, spread_figures), held) = spread;
    let (one_cpu, one_figures) = one;
    let ratio = spread_cpu.as_secs_f64() / one_cpu.as_secs_f64().max(1e-9);
    Ok(Row {
        id: "7",
        name: format!(
            "daemon CPU per scan @ {} namespaces × {} sockets vs 1 namespace × {held}",
            size.spaces,
            held / size.spaces.max(1)
        ),
        result: format!("{ratio:.3}×"),
        figures: format!(
            "{} vs {} CPU per scan (netns_walk_interval 60s)",
            ms(spread_cpu),
            ms(one_cpu)
        ),
        target: format!("≤ {SPREAD_VS_ONE}×"),
        verdict: Verdict::of(ratio <= SPREAD_VS_ONE),
        details: vec![
            format!("Spread over {} namespaces: {spread_figures}.", size.spaces),
            format!("In one namespace: {one_figures}."),
        ],
        diagnosis: vec![],
    })
}

#[cfg(test)]
mod tests {
    use super::table_for;

    #[test]
    fn the_table_grows_only_past_a_third_of_the_default() {
        assert_eq!(table_for(1_000), 262_144);
        assert_eq!(table_for(87_381), 262_144);
        assert_eq!(table_for(300 * 1001), 1_048_576);
        assert_eq!(table_for(10_000_000), 4_194_304);
    }
}
