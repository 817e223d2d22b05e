//! Measure 7 against the baseline: the daemon's CPU per scan over the bench's namespaces, the
//! current and the baseline daemon one at a time in alternated windows (ABBA blocks, as
//! measure 6), each with the same `netns_walk_interval`. Only for a baseline that knows network
//! namespaces (since namespace support): an older one would read its own namespace alone.
use std::{process::Command, time::Duration};

use anyhow::Result;

use super::{daemon::cpu_row, order, Baseline, Pins};
use crate::{
    report::{ms, Row},
    sys::NsHandle,
    Ctx,
};

/// Whether the baseline's snapshot takes `--netns` (so its daemon scans every namespace).
pub fn knows_namespaces(b: &Baseline) -> bool {
    Command::new(&b.bin)
        .args(["snapshot", "--help"])
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains("--netns"))
}

/// The row "`what` vs baseline LABEL": `window(side)` runs one daemon (the baseline's when
/// `side` is set) over its window and returns its CPU per scan.
pub fn namespaces_row(
    ctx: &Ctx,
    b: &Baseline,
    what: &str,
    mut window: impl FnMut(Option<&Baseline>) -> Result<Duration>,
) -> Result<Row> {
    // The baseline's tracker under its own pin root, removed at the end.
    let _pins = Pins::warm(b, &NsHandle::current()?)?;
    let blocks = if ctx.smoke { 1 } else { 2 };
    let (mut cur, mut base) = (Vec::new(), Vec::new());
    for is_current in order(blocks) {
        if is_current {
            cur.push(window(None)?);
        } else {
            base.push(window(Some(b))?);
        }
    }
    let each = |v: &[Duration]| v.iter().map(|t| ms(*t)).collect::<Vec<_>>().join(", ");
    let details = vec![format!(
        "Each daemon started for its window in a namespace of its own, scanning every namespace \
         (the baseline with its own pin root and API port); {blocks} alternated ABBA block(s). \
         CPU per scan, current: {}; baseline {}: {}.",
        each(&cur),
        b.label,
        each(&base)
    )];
    cpu_row(
        "7",
        format!("{what} vs baseline {}", b.label),
        (cur, base),
        details,
    )
}
