//! Measures 4 (daemon memory) and 6 (daemon CPU), with the daemon in the namespace of the
//! largest socket population of measure 3.
use std::{
    process::{Command, Stdio},
    time::Duration,
};

use anyhow::Result;

use crate::{
    agent::{Daemon, Window},
    proc::{self, Timed},
    profile,
    report::{ms, Row, Verdict},
    sys::{self, NsHandle},
    Ctx,
};

pub(super) const RSS_TARGET_MB: f64 = 40.0;

fn mb(kb: u64) -> f64 {
    kb as f64 / 1024.0
}

/// "a MB anonymous, b MB BPF maps, c MB files" of a process.
pub fn kinds(pid: u32) -> Result<String> {
    let (anon, bpf, file) = proc::rss_by_kind(pid)?;
    Ok(format!(
        "{:.1} MB anonymous (heap, allocator arenas, stacks), {:.1} MB BPF maps mmapped by the \
         daemon (the event ring buffer), {:.1} MB file-backed (binary, libraries)",
        mb(anon),
        mb(bpf),
        mb(file)
    ))
}

/// Ask glibc to return freed memory (`malloc_trim(0)` through gdb, if installed): the VmRSS
/// that remains is live data. Done last, on a daemon whose figures are already taken and which
/// is stopped right after (on this kernel gdb cannot restore the AVX state after the call and
/// exits 1, though the call ran). `None` when VmRSS did not drop.
fn trimmed_rss(pid: u32) -> Option<(u64, u64)> {
    let before = proc::status_kb(pid, "VmRSS").ok()?;
    Command::new("gdb")
        .args([
            "-p",
            &pid.to_string(),
            "-batch",
            "-ex",
            "call (int)malloc_trim(0)",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .ok()?;
    let after = proc::status_kb(pid, "VmRSS").ok()?;
    (after < before).then_some((before, after))
}

/// The detectors' idle thresholds for measures 4 and 6: beyond the run, so the held sockets are
/// idle and no finding is made. With the defaults, the holders' pairs would become stuck pairs
/// 5 min after measure 3 started them, sometimes inside the window: two costs in one figure.
const IDLE: &str = "[detect]\nstuck_pair_min_idle = \"1h\"\nidle_established_min_idle = \"1h\"\n";
/// The same sockets as the incident at its worst: every pair a stuck pair and every socket
/// idle past `idle_established_min_idle` (the detectors pair and group all of them each scan).
const LEAKED: &str = "[detect]\nstuck_pair_min_idle = \"0s\"\nidle_established_min_idle = \"0s\"\n";

/// Measures 4 and 6: a daemon in `h`, where the holders keep `held` sockets (`tag`: the size);
/// then measure 6 again with every socket leaked.
/// `ss`: `ss -tan` over the same sockets (measure 3's median, same run), the yardstick each CPU
/// row is also given against: an absolute CPU share moves with the machine (the same scan code
/// measured 141 ms per idle scan one night and 203 ms the next), a ratio side by side less.
pub fn daemon_rows(
    ctx: &mut Ctx,
    h: &NsHandle,
    tag: &str,
    held: usize,
    ss: &Timed,
) -> Result<Vec<Row>> {
    let o = observe(ctx, h, IDLE, true)?;
    let mem = memory_row(ctx, &o, tag, held);
    let cpu = cpu_row(&o, &format!("{held} idle sockets ({tag})"), ss);
    let leaked = observe(ctx, h, LEAKED, false)?;
    let leaked = cpu_row(
        &leaked,
        &format!("{held} leaked sockets ({tag}: every pair stuck, every socket idle)"),
        ss,
    );
    Ok(vec![mem, cpu, leaked])
}

/// What one daemon run gave: VmRSS and CPU over the window, /metrics at both ends, and the
/// diagnostics taken after it.
struct Observed {
    interval: f64,
    window: f64,
    /// VmRSS after the first scans, at each scan interval through the window, and at the end.
    rss_a: u64,
    series: Vec<u64>,
    rss_b: u64,
    hwm: u64,
    /// The VmRSS by kind at the end, as text.
    kinds_end: String,
    /// The daemon's CPU time and /metrics over the window.
    w: Window,
    prof: Option<profile::Profile>,
    /// VmRSS before and after `malloc_trim(0)`.
    trimmed: Option<(u64, u64)>,
}

/// Run a daemon in `h` with `extra` config: VmRSS once per scan through the CPU window, then
/// (with `--perf` and `profile`) a profile over two scans and the `malloc_trim` step.
fn observe(ctx: &Ctx, h: &NsHandle, extra: &str, profile: bool) -> Result<Observed> {
    let (interval, window): (f64, f64) = if ctx.smoke { (1.0, 5.0) } else { (5.0, 60.0) };
    let tag = if profile { "scale" } else { "scale-leaked" };
    let mut d = Daemon::start(h, &ctx.dir, tag, &format!("{interval}s"), extra)?;
    d.wait_scans(2.0, Duration::from_secs(60))?;
    let rss_a = proc::status_kb(d.pid(), "VmRSS")?;
    // VmRSS once per scan interval through the CPU window (reading /proc costs nothing).
    let steps = (window / interval).round().max(1.0) as usize;
    let step = Duration::from_secs_f64(window / steps as f64);
    let w = d.window(steps, |_| sys::sleep(step))?;
    let series = [vec![rss_a], w.rss.clone()].concat();
    let rss_b = proc::status_kb(d.pid(), "VmRSS")?;
    let hwm = proc::status_kb(d.pid(), "VmHWM")?;
    let kinds_end = kinds(d.pid())?;
    let prof = if ctx.perf && profile {
        let rec = profile::Recording::start(Some(d.pid()), &ctx.dir, "daemon")?;
        sys::sleep(Duration::from_secs_f64(2.0 * interval))?;
        rec.finish()
            .map_err(|e| eprintln!("bench: perf profile of the daemon failed: {e:#}"))
            .ok()
    } else {
        None
    };
    let trimmed = if ctx.perf && profile {
        trimmed_rss(d.pid())
    } else {
        None
    };
    drop(d);
    Ok(Observed {
        interval,
        window,
        rss_a,
        series,
        rss_b,
        hwm,
        kinds_end,
        w,
        prof,
        trimmed,
    })
}

/// Measure 4's row: the largest VmRSS sampled against the target.
fn memory_row(ctx: &Ctx, o: &Observed, tag: &str, held: usize) -> Row {
    let (m0, m1) = (&o.w.m0, &o.w.m1);
    let scans = m1.scans() - m0.scans();
    let peak = o
        .series
        .iter()
        .copied()
        .max()
        .unwrap_or(o.rss_b)
        .max(o.rss_b);
    let rss_mb = mb(peak);
    let idle = ctx.idle_rss_kb.map(mb);
    let mut mem = Row::new("4", format!("daemon memory @ {held} sockets ({tag})"), format!("{rss_mb:.1} MB VmRSS"), format!(
            "largest VmRSS sampled once per scan; {:.1} MB after 3 scans, {:.1} MB after {scans:.0} more; VmHWM {:.1} MB; idle daemon {}; kernel-side BPF maps {:.1} MB",
            mb(o.rss_a),
            mb(o.rss_b),
            mb(o.hwm),
            idle.map(|m| format!("{m:.1} MB")).unwrap_or("-".into()),
            m1.sum("connreap_bpf_map_memory_bytes") / 1048576.0
        ), format!("≤ {RSS_TARGET_MB} MB"), Verdict::of(rss_mb <= RSS_TARGET_MB));
    let facts = memory_facts(ctx, o, rss_mb, held);
    mem.details.clone_from(&facts);
    if mem.verdict == Verdict::Miss {
        mem.diagnosis = facts;
        mem.diagnosis.push(format!(
            "VmHWM {:.1} MB is the peak: a scan's transient allocations at this size.",
            mb(o.hwm)
        ));
    }
    mem
}

/// Where the memory is: the VmRSS series, by kind, the kernel side, the growth from the idle
/// daemon, and what `malloc_trim` returned. `rss_mb`: the judged VmRSS.
fn memory_facts(ctx: &Ctx, o: &Observed, rss_mb: f64, held: usize) -> Vec<String> {
    let m1 = &o.w.m1;
    let series_txt: Vec<String> = o.series.iter().map(|k| format!("{:.0}", mb(*k))).collect();
    let mut facts = vec![
        format!(
            "VmRSS (MB) once per scan interval from the 3rd scan on: {} (the largest is judged).",
            series_txt.join(", ")
        ),
        format!("At the end: {}.", o.kinds_end),
        format!(
            "Kernel side (not in VmRSS, the kernel's own accounting from /metrics \
             `connreap_bpf_map_memory_bytes`): {:.1} MB of BPF maps, of which the per-socket \
             state table (preallocated, fixed) is {:.1} MB and the event ring {:.1} MB.",
            m1.sum("connreap_bpf_map_memory_bytes") / 1048576.0,
            m1.get("connreap_bpf_map_memory_bytes", Some("map=\"state\""))
                .unwrap_or(0.0)
                / 1048576.0,
            m1.get("connreap_bpf_map_memory_bytes", Some("map=\"events\""))
                .unwrap_or(0.0)
                / 1048576.0,
        ),
    ];
    if let (Some(idle), Some(k)) = (ctx.idle_rss_kb.map(mb), &ctx.idle_kinds) {
        facts.push(format!(
            "The idle daemon (measure 1, an empty namespace) already had {idle:.1} MB: {k}."
        ));
        facts.push(format!(
            "Growth with the sockets: {:.0} bytes of VmRSS per socket.",
            (rss_mb - idle) * 1024.0 * 1024.0 / held as f64
        ));
    }
    if let Some((before, after)) = o.trimmed {
        facts.push(format!(
            "After `malloc_trim(0)` (called through gdb once the figures above were taken) VmRSS \
             fell from {:.1} MB to {:.1} MB: {:.1} MB was memory the scans had freed but glibc's \
             allocator kept; {:.1} MB is live (the idle baseline included).",
            mb(before),
            mb(after),
            mb(before) - mb(after),
            mb(after)
        ));
    }
    facts
}

/// Measure 6's row (informational): the daemon's CPU over the window, and its profile.
fn cpu_row(o: &Observed, what: &str, ss: &Timed) -> Row {
    let (du, ds, window) = (o.w.user, o.w.sys, o.window);
    let cpu_pct = (du + ds).as_secs_f64() / window * 100.0;
    let scans = o.w.scans();
    let mean_scan = o.w.scan_seconds() / scans.max(1.0);
    let per_scan_cpu = (du + ds).as_secs_f64() / scans.max(1.0);
    let interval = o.interval;
    let mut cpu = Row::info("6", format!("daemon CPU @ {what}"), format!("{cpu_pct:.2} % of one core"), format!(
            "user {} + sys {} over {window:.0} s; {scans:.0} scans at {interval}s, mean scan {}, {} CPU per scan \
             ({:.2}× the CPU of one `ss -tan` over the same sockets, {})",
            ms(du),
            ms(ds),
            ms(Duration::from_secs_f64(mean_scan)),
            ms(Duration::from_secs_f64(per_scan_cpu)),
            per_scan_cpu / (ss.user + ss.sys).as_secs_f64().max(1e-9),
            ms(ss.user + ss.sys)
        ));
    if let Some(p) = &o.prof {
        cpu.details.push(format!(
            "`perf record -p` of the daemon over two scan intervals, by component: {}. Top symbols: {}.",
            p.components(8).join(", "),
            p.top(10).join(", ")
        ));
    }
    cpu
}
