//! Measure 5: detection latency, from a CLOSE_WAIT buildup crossing its threshold to the
//! webhook's arrival.
use std::time::{Duration, Instant};

use anyhow::{Context, Result};

use crate::{
    agent::{Daemon, Receiver},
    load::CloseWait,
    report::{ms, Row, Verdict},
    sys::{self, NetNs},
    Ctx,
};

/// Measure 5: from the moment `close_wait_threshold` sockets cross `close_wait_min_age` to the arrival of
/// the `close_wait_buildup` webhook.
pub fn detection(ctx: &mut Ctx) -> Result<Vec<Row>> {
    let ns = NetNs::new("detect")?;
    let h = ns.handle();
    let rx = Receiver::start(&h)?;
    let (interval, min_age, phases): (f64, f64, &[f64]) = if ctx.smoke {
        (2.0, 1.0, &[0.05])
    } else {
        (5.0, 2.0, &[0.05, 0.5, 0.95])
    };
    let threshold = 16;
    let extra = format!(
        "[detect]\nclose_wait_min_age = \"{min_age}s\"\nclose_wait_threshold = {threshold}\n\
         [[webhook]]\nurl = \"http://127.0.0.1:{}/alerts\"\nformat = \"json\"\n",
        rx.port
    );
    let mut d = Daemon::start(&h, &ctx.dir, "detect", &format!("{interval}s"), &extra)?;
    let mut lat = Vec::new();
    for (i, phase) in phases.iter().enumerate() {
        let mut cw = CloseWait::open(&h, threshold, 18080 + i as u16)?;
        // Put the threshold crossing `phase` of an interval after a scan (0.05: just missed).
        d.wait_scans(1.0, Duration::from_secs(30))?;
        let delay = (phase * interval - min_age).rem_euclid(interval);
        sys::sleep(Duration::from_secs_f64(delay))?;
        cw.close_peers();
        let cross = Instant::now() + Duration::from_secs_f64(min_age);
        let port = cw.port;
        let at = rx
            .wait(
                Duration::from_secs_f64(min_age + 3.0 * interval + 5.0),
                |v| {
                    v["kind"] == "close_wait_buildup"
                        && v["status"] == "firing"
                        && v["service_port"] == port
                },
            )?
            .with_context(|| format!("no close_wait_buildup webhook for port {port}"))?;
        lat.push((phase, at.saturating_duration_since(cross)));
        drop(cw);
    }
    let worst = lat.iter().map(|l| l.1).max().unwrap_or_default();
    let target = Duration::from_secs_f64(interval + 1.0);
    let list: Vec<String> = lat
        .iter()
        .map(|(p, l)| {
            format!(
                "{} (crossing {:.0} % into a scan interval)",
                ms(*l),
                *p * 100.0
            )
        })
        .collect();
    let mut row = Row {
        id: "5",
        name: "detection latency".into(),
        result: format!("{} worst", ms(worst)),
        figures: format!(
            "{} trials: {}; scan_interval {interval}s, close_wait_min_age {min_age}s",
            lat.len(),
            lat.iter().map(|l| ms(l.1)).collect::<Vec<_>>().join(", ")
        ),
        target: format!("≤ {} (scan interval + 1 s)", ms(target)),
        verdict: Verdict::of(worst <= target),
        details: vec![format!(
            "{threshold} CLOSE_WAIT sockets per trial (one new service port each); latencies: {}.",
            list.join("; ")
        )],
        diagnosis: vec![],
    };
    if row.verdict == Verdict::Miss {
        let s = d.scrape()?;
        let mean = s.scan_seconds() / s.scans().max(1.0);
        row.diagnosis.push(format!(
            "Detection waits for the next scan (up to one interval, {interval}s) plus the scan itself \
             (mean {} here) plus webhook delivery; the worst trial exceeded that by {}.",
            ms(Duration::from_secs_f64(mean)),
            ms(worst.saturating_sub(Duration::from_secs_f64(interval + mean)))
        ));
    }
    Ok(vec![row])
}
