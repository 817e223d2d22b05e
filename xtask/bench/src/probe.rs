//! Measure 1: average run time of each BPF program under the churn load, from the daemon's
//! /metrics with kernel.bpf_stats_enabled=1, and a perf profile of the tracker's kernel path.
use std::time::Duration;

use anyhow::Result;

use crate::{
    agent::{Daemon, Scrape},
    churn::WORKERS,
    load::{self, Churn},
    proc, profile,
    report::{Row, Verdict},
    sys::{NetNs, NsHandle, Sysctl},
    Ctx,
};

/// The programs whose run time measure 1 reports. The owner dump is one of the last two on
/// any scan: the plain one when no other namespace is read between walks, the one that also
/// writes other namespaces' sockets otherwise (a bench host has the bench's namespaces).
const PROGRAMS: [&str; 4] = [
    "connreap_set_state",
    "connreap_iter_tcp",
    "connreap_iter_task_file",
    "connreap_iter_netns_socks",
];
const SET_STATE_TARGET_NS: f64 = 150.0;

/// One stats window: (program, Δrun_time ns, Δruns, ns/run) per program over all its
/// repetitions, connreap_set_state's ns/run in each repetition, and the churn.
struct Window {
    per: Vec<(&'static str, f64, f64, f64)>,
    reps: Vec<f64>,
    churn: Churn,
    transitions: f64,
    rss_kb: u64,
    /// VmRSS by kind, as text.
    kinds: String,
}

impl Window {
    /// ns per element of the socket iterator and of the owner dump (both owner programs
    /// together), or None when either did not run in the window.
    fn iterator_ns(&self) -> Option<(f64, f64)> {
        let (_, _, tcp_n, tcp_ns) = self.per[1];
        let (t, n) = self.per[2..]
            .iter()
            .fold((0.0, 0.0), |(t, n), &(_, dt, dn, _)| (t + dt, n + dn));
        (tcp_n > 0.0 && n > 0.0).then(|| (tcp_ns, t / n))
    }

    /// Median of the repetitions' connreap_set_state ns/run.
    fn median(&self) -> f64 {
        let mut v = self.reps.clone();
        v.sort_by(|a, b| a.total_cmp(b));
        v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
    }
}

fn delta(m0: &Scrape, m1: &Scrape, prog: &str) -> (f64, f64) {
    let ((t0, n0), (t1, n1)) = (m0.program(prog), m1.program(prog));
    (t1 - t0, n1 - n0)
}

/// A daemon in `agent` (scanning every `interval`) while the churn runs in `load`, `reps`
/// times for `dur`.
fn window(
    ctx: &Ctx,
    tag: &str,
    (agent, load): (&NsHandle, &NsHandle),
    interval: f64,
    reps: usize,
    dur: Duration,
) -> Result<Window> {
    let mut d = Daemon::start(agent, &ctx.dir, tag, &format!("{interval}s"), "")?;
    let timeout = Duration::from_secs_f64(4.0 * interval + 60.0);
    let m0: Scrape = d.wait_scans(1.0, timeout)?;
    let rss_kb = proc::status_kb(d.pid(), "VmRSS")?;
    let kinds = crate::memory_cpu::kinds(d.pid())?;
    let mut churn = Churn {
        conns: 0,
        elapsed: Duration::ZERO,
    };
    let mut per_rep = Vec::new();
    let mut last = m0.clone();
    for _ in 0..reps {
        let r = load::churn(load, WORKERS, dur)?;
        churn.conns += r.conns;
        churn.elapsed += r.elapsed;
        // The second scan after the load started after it ended: its figures cover all of it.
        let m = d.wait_scans(2.0, timeout)?;
        let (dt, dn) = delta(&last, &m, PROGRAMS[0]);
        per_rep.push(if dn > 0.0 { dt / dn } else { f64::NAN });
        last = m;
    }
    let per = PROGRAMS
        .iter()
        .map(|p| {
            let (dt, dn) = delta(&m0, &last, p);
            (*p, dt, dn, if dn > 0.0 { dt / dn } else { f64::NAN })
        })
        .collect();
    let tp = "connreap_tcp_transitions_total";
    Ok(Window {
        per,
        reps: per_rep,
        churn,
        transitions: last.get(tp, None).unwrap_or(0.0) - m0.get(tp, None).unwrap_or(0.0),
        rss_kb,
        kinds,
    })
}

fn table(w: &Window) -> Vec<String> {
    let mut t =
        vec!["| program | run time Δ | runs Δ | avg per run |\n|---|---|---|---|".to_string()];
    for (p, dt, dn, avg) in &w.per {
        t.push(format!(
            "| {p} | {:.2} ms | {dn:.0} | {avg:.0} ns |",
            dt / 1e6
        ));
    }
    t
}

/// Measure 1's windows: A (judged) `reps_a` × `dur_a` s with the daemon scanning an empty
/// namespace every second; B `dur_b` s with it scanning the churn's own namespace every
/// `interval_b` s.
struct Plan {
    reps_a: usize,
    dur_a: u64,
    dur_b: u64,
    interval_b: f64,
}

pub fn probe_cost(ctx: &mut Ctx) -> Result<Vec<Row>> {
    let load_ns = NetNs::new("probe")?;
    let agent_ns = NetNs::new("probeagent")?;
    let h = load_ns.handle();
    let plan = if ctx.smoke {
        Plan {
            reps_a: 1,
            dur_a: 2,
            dur_b: 2,
            interval_b: 1.0,
        }
    } else {
        Plan {
            reps_a: 3,
            dur_a: 4,
            dur_b: 10,
            interval_b: 5.0,
        }
    };
    let warm = load::warm_up(&h, WORKERS, ctx.warm_up())?;
    let stats = Sysctl::set("kernel.bpf_stats_enabled", "1")?;
    // A (judged): the daemon scans an empty namespace every second, so nothing else competes
    // with the churn. B: it scans the churn's own namespace at the default interval.
    let a = window(
        ctx,
        "probe-a",
        (&agent_ns.handle(), &h),
        1.0,
        plan.reps_a,
        Duration::from_secs(plan.dur_a),
    )?;
    let b = window(
        ctx,
        "probe-b",
        (&h, &h),
        plan.interval_b,
        1,
        Duration::from_secs(plan.dur_b),
    )?;
    let by_parts = if ctx.parts {
        Some(crate::probe_parts::measure(ctx, (&agent_ns.handle(), &h))?)
    } else {
        None
    };
    drop(stats);
    ctx.idle_rss_kb = Some(a.rss_kb);
    ctx.idle_kinds = Some(a.kinds.clone());
    ctx.iter_ns = b.iterator_ns();
    ctx.set_state_ns = Some(a.median());
    let runs_per_conn = a.per[0].2 / a.churn.conns.max(1) as f64;
    // Before the profile, which reports per-transition figures with it.
    ctx.runs_per_conn = Some(runs_per_conn);
    let prof = ctx.perf.then(|| tracker_profile(ctx, &h)).and_then(|p| {
        p.map_err(|e| eprintln!("bench: perf profile of the tracker failed: {e:#}"))
            .ok()
    });
    let mut row = probe_row(&plan, warm, &a, &b);
    if let Some((lines, diagnosis)) = by_parts {
        row.details.extend(lines);
        if row.verdict == Verdict::Miss {
            row.diagnosis.push(diagnosis);
        }
    }
    if let Some((details, diagnosis, dispatch_ns, perf_us)) = prof {
        ctx.dispatch_ns = dispatch_ns;
        ctx.tracker_perf_us = perf_us;
        row.details.extend(details);
        if row.verdict == Verdict::Miss {
            row.diagnosis.extend(diagnosis);
        }
    }
    if row.verdict == Verdict::Miss {
        let st_avg = a.median();
        row.diagnosis.insert(
            0,
            format!(
                "Every TCP transition pays it in-line (syscall or softirq context): {runs_per_conn:.1} \
                 runs per loopback connection, so {st_avg:.0} ns/run is {:.2} µs per connection \
                 ({:.0} ns/run while the daemon scans the same namespace).",
                st_avg * runs_per_conn / 1e3,
                b.per[0].3
            ),
        );
    }
    Ok(vec![row])
}

/// Measure 1's row from windows `a` (judged on its median) and `b`, with both windows' tables.
/// `(tw, tw_max)`: the TIME_WAIT sockets after the warm-up and their cap.
fn probe_row(plan: &Plan, (tw, tw_max): (u64, u64), a: &Window, b: &Window) -> Row {
    let Plan {
        reps_a,
        dur_a,
        dur_b,
        interval_b,
    } = *plan;
    let st_avg = a.median();
    let (_, st_t, st_n, _) = a.per[0];
    let runs_per_conn = st_n / a.churn.conns.max(1) as f64;
    let reps: Vec<String> = a.reps.iter().map(|r| format!("{r:.0}")).collect();
    let share = st_t / (a.churn.elapsed.as_secs_f64() * 1e9 * WORKERS as f64) * 100.0;
    let b_avg = b.per[0].3;
    let mut row = Row {
        id: "1",
        name: "probe cost (connreap_set_state)".into(),
        result: format!("{st_avg:.0} ns/run"),
        figures: format!(
            "median of {reps_a} windows ({} ns/run); {:.1} ms over {st_n:.0} runs in {:.1}s of churn ({:.0} conn/s); {b_avg:.0} ns/run while the daemon scans the churn's namespace",
            reps.join(", "),
            st_t / 1e6,
            a.churn.elapsed.as_secs_f64(),
            a.churn.rate()
        ),
        target: format!("≤ {SET_STATE_TARGET_NS:.0} ns"),
        verdict: Verdict::of(st_avg <= SET_STATE_TARGET_NS),
        details: vec![format!(
            "The churn's namespace was first filled to {tw} TIME_WAIT sockets (cap {tw_max}), the \
             steady state of a busy server.\n\nWindow A ({reps_a} × {dur_a}s of churn, the daemon \
             scanning an empty namespace every 1s; judged on the median of the {reps_a}: {} ns/run):\n",
            reps.join(", ")
        )],
        diagnosis: vec![],
    };
    row.details.extend(table(a));
    row.details.push(format!(
        "\nThe tracepoint ran {st_n:.0} times for {:.0} TCP transitions counted by the program and {} \
         connections ({runs_per_conn:.1} runs per connection); its run time is {share:.2} % of the \
         {WORKERS} churning cores.\n\nWindow B ({dur_b}s of churn, the daemon in the churn's namespace \
         scanning every {interval_b}s, {:.0} conn/s). Iterator figures are per element: one socket \
         (iter/tcp, here mostly TIME_WAIT) or one open file of any process (iter/task_file):\n",
        a.transitions,
        a.churn.conns,
        b.churn.rate()
    ));
    row.details.extend(table(b));
    row
}

/// `perf record -a` over a churn window: the tracker's kernel symbols by part.
/// What the tracker's profile gives: report lines, diagnosis, the dispatch's ns per transition,
/// and the tracker's µs per connection with bpf_stats off.
type TrackerProfile = (Vec<String>, Vec<String>, Option<f64>, Option<f64>);

fn tracker_profile(ctx: &Ctx, h: &NsHandle) -> Result<TrackerProfile> {
    // A daemon that reads the event ring but does not scan during the window, so the iterators'
    // helpers do not mix into the tracker's symbols.
    let _d = Daemon::start(h, &ctx.dir, "profile", "1h", "")?;
    let rec = profile::Recording::start(None, &ctx.dir, "tracker")?;
    let dur = Duration::from_secs(if ctx.smoke { 1 } else { 3 });
    let churn = load::churn(h, WORKERS, dur)?;
    let prof = rec.finish()?;
    let parts = prof.tracker_parts();
    let total: f64 = parts.iter().map(|p| p.1).sum();
    // perf -a samples every CPU, idle or not: its share of all samples is that share of
    // (CPUs × window) of CPU time, here with bpf_stats off (no clock reads around each run).
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
    let perf_us = (churn.conns > 0 && total > 0.0)
        .then(|| total / 100.0 * cpus * churn.elapsed.as_secs_f64() * 1e6 / churn.conns as f64);
    let inside: f64 = parts
        .iter()
        .filter(|p| !p.0.starts_with("tracepoint dispatch"))
        .map(|p| p.1)
        .sum();
    let mut details = vec![format!(
        "\n`perf record -a` during {}s more of the same churn (bpf_stats off, a daemon reading \
         the ring but not scanning in that window): the tracker's kernel symbols are {total:.2} % of all CPU samples on the machine:\n",
        dur.as_secs()
    )];
    details.push("| part | % of all samples | top symbols |\n|---|---|---|".into());
    for (name, pct, syms) in &parts {
        details.push(format!("| {name} | {pct:.2} % | {} |", syms.join(", ")));
    }
    let mut diagnosis = Vec::new();
    if inside > 0.0 {
        let mut by: Vec<&(&str, f64, Vec<String>)> = parts
            .iter()
            .filter(|p| !p.0.starts_with("tracepoint dispatch"))
            .collect();
        by.sort_by(|a, b| b.1.total_cmp(&a.1));
        let split: Vec<String> = by
            .iter()
            .map(|p| {
                let share = p.1 / inside;
                let ns = ctx
                    .set_state_ns
                    .map(|ns| format!(", ≈ {:.0} ns/run", share * ns))
                    .unwrap_or_default();
                format!("{} {:.0} %{ns}", p.0, share * 100.0)
            })
            .collect();
        diagnosis.push(format!(
            "perf splits the time spent inside the program (what run_time_ns counts) as: {}. \
             Top symbols of the largest part: {}.",
            split.join(", "),
            by[0].2.join(", ")
        ));
    }
    // The dispatch (the tracepoint's iterator and bpf_trace_run) is outside run_time_ns.
    let dispatch = parts
        .iter()
        .find(|p| p.0.starts_with("tracepoint dispatch"))
        .map(|p| p.1);
    let dispatch_ns = match (dispatch, ctx.set_state_ns) {
        (Some(d), Some(ns)) if inside > 0.0 => Some(ns * d / inside),
        _ => None,
    };
    if let Some(d) = dispatch_ns {
        details.push(format!(
            "\nBy the same proportions, the BTF tracepoint's dispatch (outside the program, not \
             in run_time_ns) adds about {d:.0} ns per transition."
        ));
    }
    if let Some(us) = perf_us {
        details.push(format!(
            "\nWith bpf_stats off, the tracker and its dispatch cost {us:.2} µs of CPU per \
             connection ({:.0} ns per transition at {:.1} runs per connection): that share of \
             ({cpus:.0} CPUs × the window) over its {} connections. run_time_ns also counts the \
             clock reads bpf_stats adds around each run; measure 2 runs with bpf_stats off and \
             uses this figure.",
            us * 1e3 / ctx.runs_per_conn.unwrap_or(f64::NAN),
            ctx.runs_per_conn.unwrap_or(f64::NAN),
            churn.conns
        ));
    }
    Ok((details, diagnosis, dispatch_ns, perf_us))
}
