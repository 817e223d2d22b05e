//! connreap: finds leaked TCP connections with eBPF and, under policy, reclaims them.
mod alert;
mod cli;
mod config;
mod containers;
mod daemon;
mod detect;
mod docs;
mod engine;
mod flock;
mod kernel;
mod kind;
mod logging;
mod metrics;
mod present;
mod quota;
mod reclaim;
mod scan;
mod snapshot;
mod table;
mod tasks;

use std::process::ExitCode;

fn main() -> ExitCode {
    // The socket table (tens of MB at 100k sockets) is rebuilt every scan. Keep glibc from
    // growing RSS with it: few arenas, and a fixed mmap threshold so large tables are mmapped
    // and returned to the kernel when freed (the default threshold adapts upwards after the
    // first free and then serves them from fragmenting heap arenas).
    // SAFETY: mallopt only changes allocator tunables.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 2);
        libc::mallopt(libc::M_MMAP_THRESHOLD, 256 * 1024);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 1024 * 1024);
    }
    cli::main()
}
