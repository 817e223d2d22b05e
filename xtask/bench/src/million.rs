//! Measure 8: a million tracked sockets (issue 31). A daemon whose state table is sized for
//! them (`agent.max_tracked_sockets`) watches while holder processes, each within its fd
//! limit, open half a million loopback connections in a namespace of their own; then every
//! socket must be in the daemon's table with an exact age (the tracker saw it created), and
//! no socket may have been turned away by a full set of the table.
use std::{
    process::Stdio,
    time::{Duration, Instant},
};

use anyhow::{bail, Context, Result};

use crate::{
    agent::{self, Daemon},
    load::{self, Holders},
    report::{ms, Row, Verdict},
    sys::NetNs,
    Ctx,
};

/// Sockets the tracker must follow.
const TARGET: usize = 1_000_000;

/// Rows of a `snapshot --json` and those with an exact age, counted in its bytes (a million
/// rows parsed as JSON values would take gigabytes).
fn exact_ages(json: &[u8]) -> (usize, usize) {
    let count = |needle: &[u8]| json.windows(needle.len()).filter(|w| *w == needle).count();
    (count(b"\"age_exact\":"), count(b"\"age_exact\":true"))
}

pub fn million(ctx: &mut Ctx) -> Result<Vec<Row>> {
    // Holders × connections: two sockets each, plus each holder's listener.
    let (holders, conns, table) = if ctx.smoke {
        (4, 250, 16_384)
    } else {
        // 2^18 sets: at 1M sockets ≈ 3.8 per set of 16, so no set fills.
        (500, 1_000, 4_194_304)
    };
    load::raise_nofile()?;
    let ctl = NetNs::new("millionctl")?;
    let mut d = Daemon::start(
        &ctl.handle(),
        &ctx.dir,
        "million",
        "10s",
        &format!("max_tracked_sockets = {table}\nnetns_walk_interval = \"1h\"\n"),
    )?;
    let full_before = d.scrape()?.sum("connreap_bpf_map_full_total");
    let ns = NetNs::new("million")?;
    let t = Instant::now();
    let h = Holders::start(&ns.handle(), &vec![conns; holders])?;
    let opened = t.elapsed();
    let timeout = Duration::from_secs(600);
    // A scan that began after the last connection, then a window of scans.
    d.wait_scans(2.0, timeout)?;
    let w = d.window(3, |d| d.wait_scans(1.0, timeout).map(drop))?;
    let full = w.m1.sum("connreap_bpf_map_full_total") - full_before;
    let in_table = w.m1.sum("connreap_sockets");
    let t = Instant::now();
    let out = ns
        .handle()
        .command(agent::bin())
        .args(["snapshot", "--json", "--netns", ns.name()])
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .output()
        .context("connreap snapshot")?;
    let snap_time = t.elapsed();
    if !out.status.success() {
        bail!(
            "connreap snapshot --json --netns {} failed: {}",
            ns.name(),
            out.status
        );
    }
    let (rows, exact) = exact_ages(&out.stdout);
    let scans = w.scans().max(1.0);
    let per_scan = w.cpu().div_f64(scans);
    let mean_scan = Duration::from_secs_f64(w.scan_seconds() / scans);
    let held = h.sockets;
    drop(h);
    drop(d);
    let pass = exact >= TARGET && full == 0.0;
    Ok(vec![Row {
        id: "8",
        name: format!("tracked sockets @ {held} held (max_tracked_sockets = {table})"),
        result: format!("{exact} exact ages, {full:.0} turned away"),
        figures: format!(
            "snapshot of their namespace: {rows} rows, {exact} with an exact age ({}); daemon \
             table {in_table:.0} sockets; {} CPU per scan, mean scan {} at 10s",
            ms(snap_time),
            ms(per_scan),
            ms(mean_scan)
        ),
        target: format!("≥ {TARGET} exact, none turned away"),
        verdict: if ctx.smoke {
            Verdict::Info
        } else {
            Verdict::of(pass)
        },
        details: vec![format!(
            "{holders} holder processes × {conns} connections opened in {} ({} sockets with \
             their listeners); the state table: {table} slots, {} MB of kernel memory.",
            ms(opened),
            held,
            table * 56 / 1_000_000
        )],
        diagnosis: vec![],
    }])
}

#[cfg(test)]
mod tests {
    #[test]
    fn exact_ages_are_counted_in_the_bytes() {
        let json = br#"{"sockets":[{"age_exact":true},{"age_exact":false},{"age_exact":true}]}"#;
        assert_eq!(super::exact_ages(json), (3, 2));
    }
}
