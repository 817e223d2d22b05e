//! Where one snapshot's time goes, read from its own debug lines: shared by the scale measure
//! and the baseline comparison.
use std::{
    process::{Command, Stdio},
    time::Duration,
};

use anyhow::{Context as _, Result};

use crate::{agent, sys::NsHandle};

/// The snapshot of the holders' namespace alone (`--netns host`: the namespace it runs in),
/// the single-namespace figure: a snapshot of every namespace also dumps the host's, whose
/// dump walks the holders' sockets again (the kernel's TCP table is shared by all namespaces);
/// measure 7 has the every-namespace figures.
pub(super) fn snapshot_cmd(h: &NsHandle) -> Command {
    let mut c = h.command(agent::bin());
    c.args(["snapshot", "--json", "--netns", "host"]);
    c
}

/// [`snapshot_cmd`] in the default output, the table a person reads.
pub(super) fn snapshot_table_cmd(h: &NsHandle) -> Command {
    let mut c = h.command(agent::bin());
    c.args(["snapshot", "--netns", "host"]);
    c
}

/// Where one snapshot's scan spends its time, from its `connreap::scan` debug line (medians of
/// `runs`): the iterators' time in the kernel, their total (plus decoding), and the merge.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
pub(super) struct ScanSplit {
    pub socket_kernel: Duration,
    pub socket_total: Duration,
    pub owner_kernel: Duration,
    pub owner_total: Duration,
    /// Both dumps' wall time (the snapshot runs them at the same time).
    pub dumps: Duration,
    pub merge: Duration,
    /// From the `connreap::snapshot` line: opening the pinned programs and maps, and sorting,
    /// summarising and writing the JSON after the scan.
    pub load: Duration,
    pub output: Duration,
}

impl ScanSplit {
    /// The kernel's part of the wall time: the two dumps run at once, so the longer of the
    /// two iterators' times in the kernel.
    pub(super) fn kernel(&self) -> Duration {
        self.socket_kernel.max(self.owner_kernel)
    }

    /// The fields of a snapshot's `connreap::scan` and `connreap::snapshot` debug lines
    /// (`key=value` words).
    fn parse(log: &str) -> Option<ScanSplit> {
        let field = |key: &str| -> Option<Duration> {
            log.split_whitespace()
                .find_map(|w| w.strip_prefix(key)?.strip_prefix('='))
                .and_then(|v| v.parse().ok())
                .map(Duration::from_micros)
        };
        Some(ScanSplit {
            load: field("load_us")?,
            output: field("output_us")?,
            socket_kernel: field("socket_dump_kernel_us")?,
            socket_total: field("socket_dump_us")?,
            owner_kernel: field("owner_dump_kernel_us")?,
            owner_total: field("owner_dump_us")?,
            dumps: field("dumps_us")?,
            merge: field("merge_us")?,
        })
    }

    /// Medians of `runs` snapshots run in `ns`.
    pub(super) fn measure(ns: &NsHandle, runs: usize) -> Result<ScanSplit> {
        Self::measure_with(|| snapshot_cmd(ns), runs)
    }

    /// Medians of `runs` snapshots, each the command `snapshot` makes.
    pub(super) fn measure_with(snapshot: impl Fn() -> Command, runs: usize) -> Result<ScanSplit> {
        let mut all = Vec::new();
        for _ in 0..runs {
            let out = snapshot()
                .env("RUST_LOG", "connreap::scan=debug,connreap::snapshot=debug")
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .output()?;
            let err = String::from_utf8_lossy(&out.stderr);
            let split = ScanSplit::parse(&err).with_context(|| {
                format!("no scan and snapshot timing lines in the snapshot's log:\n{err}")
            })?;
            all.push(split);
        }
        let med = |f: fn(&ScanSplit) -> Duration| {
            let mut v: Vec<Duration> = all.iter().map(f).collect();
            v.sort();
            v[v.len() / 2]
        };
        Ok(ScanSplit {
            socket_kernel: med(|s| s.socket_kernel),
            socket_total: med(|s| s.socket_total),
            owner_kernel: med(|s| s.owner_kernel),
            owner_total: med(|s| s.owner_total),
            dumps: med(|s| s.dumps),
            merge: med(|s| s.merge),
            load: med(|s| s.load),
            output: med(|s| s.output),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_scan_debug_line() {
        let line = "2026-12-03T09:54:47.746651Z DEBUG connreap::scan: scan sockets=10001 \
                    owner_records=10001 socket_dump_kernel_us=12440 socket_dump_us=14191 \
                    owner_dump_kernel_us=5782 owner_dump_us=6177 dumps_us=14300 merge_us=1902\n\
                    2026-12-03T09:54:47.756651Z DEBUG connreap::snapshot: snapshot load_us=1342 \
                    scan_us=14394 output_us=7832";
        let s = ScanSplit::parse(line).unwrap();
        assert_eq!(s.load, Duration::from_micros(1342));
        assert_eq!(s.output, Duration::from_micros(7832));
        assert_eq!(s.socket_kernel, Duration::from_micros(12440));
        assert_eq!(s.socket_total, Duration::from_micros(14191));
        assert_eq!(s.owner_kernel, Duration::from_micros(5782));
        assert_eq!(s.owner_total, Duration::from_micros(6177));
        assert_eq!(s.merge, Duration::from_micros(1902));
        assert_eq!(s.dumps, Duration::from_micros(14300));
        assert_eq!(s.kernel(), Duration::from_micros(12440));
        assert_eq!(ScanSplit::parse("scan sockets=3 merge_us=1"), None);
        assert_eq!(ScanSplit::parse(line.lines().next().unwrap()), None);
    }
}
