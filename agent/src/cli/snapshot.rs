//! `connreap snapshot`: one scan of every namespace (both dumps at once), filtered, as a table
//! or JSON on standard output.
use std::time::Duration;

use anyhow::Context as _;

use crate::{kernel, scan, snapshot, table};

pub(super) fn snapshot(
    verbose: bool,
    filter: &snapshot::FilterArgs,
    json: bool,
) -> anyhow::Result<()> {
    let filter = filter.parse()?;
    let t0 = std::time::Instant::now();
    let mut scanner = scan::Scanner::new(kernel::Kernel::load(verbose)?);
    scanner.only(filter.netns.clone());
    let loaded = t0.elapsed();
    let table = scanner.scan_parallel()?;
    let scanned = t0.elapsed();
    let mut selected: Vec<&table::Socket> = table.iter().filter(|s| filter.matches(s)).collect();
    let filtered = t0.elapsed();
    snapshot::sort_for_display(&mut selected);
    let sorted = t0.elapsed();
    let groups = snapshot::summarize(
        &selected,
        filter.idle_min.unwrap_or(Duration::from_secs(30)),
    );
    let counters = if json {
        Some(scanner.kernel.counters()?)
    } else {
        None
    };
    let summarized = t0.elapsed();
    let written = (|| -> std::io::Result<()> {
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        let mut w = std::io::BufWriter::with_capacity(1 << 16, stdout_file()?);
        match &counters {
            // Compact, streamed in rounds: no intermediate JSON tree for 100k sockets.
            Some(counters) => {
                snapshot::write_snapshot_json(&mut w, &selected, &groups, counters, threads)?;
                std::io::Write::write_all(&mut w, b"\n")?;
            }
            None => snapshot::write_table(&mut w, &selected, &groups, threads)?,
        }
        std::io::Write::flush(&mut w)
    })();
    // A reader that stopped early (`connreap snapshot | head`) is told apart by `main`.
    written.context("writing the snapshot to standard output")?;
    // Where a snapshot's time goes (`RUST_LOG=connreap::snapshot=debug`; the benchmarks read it).
    tracing::debug!(
        target: "connreap::snapshot",
        load_us = loaded.as_micros() as u64,
        scan_us = (scanned - loaded).as_micros() as u64,
        output_us = (t0.elapsed() - scanned).as_micros() as u64,
        filter_us = (filtered - scanned).as_micros() as u64,
        sort_us = (sorted - filtered).as_micros() as u64,
        summary_us = (summarized - sorted).as_micros() as u64,
        write_us = (t0.elapsed() - summarized).as_micros() as u64,
        "snapshot"
    );
    // The process ends here: freeing 100k rows one by one would only delay the exit.
    std::mem::forget(selected);
    std::mem::forget(table);
    Ok(())
}

/// Standard output as a plain file (a duplicate of fd 1): `std::io::stdout()` is line
/// buffered and searches every write for a newline, which for megabytes of one-line JSON
/// costs a scan of all of it.
fn stdout_file() -> std::io::Result<std::fs::File> {
    use std::os::fd::AsFd as _;
    Ok(std::io::stdout().as_fd().try_clone_to_owned()?.into())
}
