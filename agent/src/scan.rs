//! One scan: run both iterators and merge them into the socket table. The kernel and /proc are
//! reached only through `kernel` (the dumps, `kernel::procfs`); this module only drives them.
use std::{
    collections::{HashMap, HashSet},
    time::{Duration, Instant},
};

use crate::{
    kernel::{procfs, Kernel, KernelError},
    table::{self, FirstSeen, Holders, Socket, TableBuilder},
};

pub struct Scanner {
    pub kernel: Kernel,
    host: table::HostInfo,
    first_seen: FirstSeen,
    units: HashMap<u32, Option<String>>,
    /// Size of the previous table, to size the next one.
    last_len: usize,
}

impl Scanner {
    pub fn new(kernel: Kernel) -> Self {
        // The namespace's ephemeral port range (falls back to Linux's default).
        let ephemeral =
            procfs::ephemeral_ports().unwrap_or_else(|| table::HostInfo::default().ephemeral);
        Scanner {
            host: table::HostInfo {
                hz: kernel.hz,
                ephemeral,
            },
            kernel,
            first_seen: FirstSeen::default(),
            units: HashMap::new(),
            last_len: 0,
        }
    }

    /// One scan, the owner dump after the socket dump (so a socket seen has had the time to
    /// get its owner): what the daemon and reclaim decisions use.
    pub fn scan(&mut self) -> Result<Vec<Socket>, KernelError> {
        self.scan_with(false)
    }

    /// One scan with both dumps at once (see [`Kernel::for_each_both`]): for a one-shot
    /// snapshot, where the wall time is what a person waits for.
    pub fn scan_parallel(&mut self) -> Result<Vec<Socket>, KernelError> {
        self.scan_with(true)
    }

    fn scan_with(&mut self, parallel: bool) -> Result<Vec<Socket>, KernelError> {
        // Socket records become table rows as they are read.
        let start = Instant::now();
        let mut b = TableBuilder::new(
            &self.host,
            &mut self.first_seen,
            self.last_len,
            procfs::monotonic_ns(),
        );
        let mut holders = Holders::default();
        let (sockets, owners) = if parallel {
            self.kernel
                .for_each_both(|r| b.push(&r), |o| holders.push(&o))?
        } else {
            let sockets = self.kernel.for_each_socket(|r| b.push(&r))?;
            (sockets, self.kernel.for_each_owner(|o| holders.push(&o))?)
        };
        let dumps_done = Instant::now();
        let end_ns = procfs::monotonic_ns();
        // Forget units of pids that hold no socket any more (pids get reused).
        let live: HashSet<u32> = holders.pids().collect();
        self.units.retain(|pid, _| live.contains(pid));
        let units = &mut self.units;
        let mut unit_of = |pid: u32| {
            units
                .entry(pid)
                .or_insert_with(|| procfs::unit_of(pid))
                .clone()
        };
        let table = b.finish(holders, end_ns, &mut unit_of);
        self.last_len = table.len();
        // Where a scan's time goes, for `RUST_LOG=connreap::scan=debug` and the benchmarks:
        // each dump's time in the kernel (the iterator producing records) and in total (plus
        // decoding them here), both dumps' wall time (their sum, or the longer one in a
        // parallel scan), then the merge.
        let us = |d: Duration| d.as_micros() as u64;
        tracing::debug!(
            sockets = sockets.records,
            owner_records = owners.records,
            socket_dump_kernel_us = us(sockets.in_kernel),
            socket_dump_us = us(sockets.total),
            owner_dump_kernel_us = us(owners.in_kernel),
            owner_dump_us = us(owners.total),
            dumps_us = us(dumps_done - start),
            merge_us = us(dumps_done.elapsed()),
            "scan"
        );
        Ok(table)
    }
}
