//! Kernel memory held by the pinned maps, as the kernel accounts it (`memlock:` in
//! `/proc/self/fdinfo/<fd>`), for `connreap_bpf_map_memory_bytes`; and other fdinfo fields.
//! The fds opened here also keep the shared maps for re-pinning them (see `tracker`).
//! Also the daemon's one memory hint to the kernel: huge pages for a scan's table.
use std::{
    fs,
    os::fd::{AsFd as _, AsRawFd as _, BorrowedFd},
    path::Path,
};

use aya::maps::MapData;

use super::load::SHARED_MAPS;

/// The shared maps' fds, opened once from their pins, for reading their memory every scan.
pub(crate) struct MapMemory {
    maps: Vec<(&'static str, MapData)>,
}

impl MapMemory {
    /// Open each map of [`SHARED_MAPS`] by pin; a map that cannot be opened is left out.
    pub(crate) fn open(pin_dir: &Path) -> Self {
        let maps = SHARED_MAPS
            .iter()
            .filter_map(|(_, pin)| match MapData::from_pin(pin_dir.join(pin)) {
                Ok(map) => Some((*pin, map)),
                Err(e) => {
                    tracing::debug!(map = pin, error = %e, "map memory will not be reported");
                    None
                }
            })
            .collect();
        MapMemory { maps }
    }

    /// The map pinned as `pin`, if it was opened.
    pub(crate) fn get(&self, pin: &str) -> Option<&MapData> {
        self.maps.iter().find(|(p, _)| *p == pin).map(|(_, m)| m)
    }

    /// Bytes of each map, by pin name (a map whose fdinfo cannot be read is left out).
    pub(crate) fn read(&self) -> Vec<(&'static str, u64)> {
        self.maps
            .iter()
            .filter_map(|(pin, map)| Some((*pin, fdinfo_u64(map.fd().as_fd(), "memlock")?)))
            .collect()
    }
}

/// Ask the kernel for transparent huge pages under the spare capacity of `v` (its 2 MiB-aligned
/// part), before that memory is first written. A scan builds its table in fresh memory (14 MB
/// at 100k sockets), and faulting it in 4 KiB at a time took about a tenth of the idle daemon's
/// CPU (BENCHMARKS.md). A hint only: where THP is `never`, or the range holds no whole huge
/// page, nothing changes, and a refusal is not an error.
pub fn advise_huge_pages<T>(v: &mut Vec<T>) {
    const HUGE: usize = 2 << 20;
    let size = std::mem::size_of::<T>();
    let base = v.as_mut_ptr() as usize;
    let lo = (base + v.len() * size).next_multiple_of(HUGE);
    let hi = (base + v.capacity() * size) & !(HUGE - 1);
    if hi <= lo {
        return;
    }
    // SAFETY: [lo, hi) lies inside the Vec's own allocation; MADV_HUGEPAGE changes only how
    // the kernel backs those pages, never their contents.
    let r = unsafe { libc::madvise(lo as *mut libc::c_void, hi - lo, libc::MADV_HUGEPAGE) };
    if r != 0 {
        tracing::trace!(error = %std::io::Error::last_os_error(), "no huge pages for the table");
    }
}

/// A numeric field of the kernel's `/proc/self/fdinfo` entry for a BPF map or program fd
/// (`memlock`, `recursion_misses`, ...).
pub(crate) fn fdinfo_u64(fd: BorrowedFd<'_>, key: &str) -> Option<u64> {
    let info = fs::read_to_string(format!("/proc/self/fdinfo/{}", fd.as_raw_fd())).ok()?;
    parse_field(&info, key)
}

fn parse_field(fdinfo: &str, key: &str) -> Option<u64> {
    fdinfo
        .lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix(':'))
        .and_then(|v| v.trim().parse().ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_memlock_from_fdinfo() {
        let info = "pos:\t0\nflags:\t02000002\nmnt_id:\t15\nino:\t1057\nmap_type:\t1\n\
                    key_size:\t8\nvalue_size:\t48\nmax_entries:\t262144\nmap_flags:\t0x0\n\
                    map_extra:\t0x0\nmemlock:\t31458464\nmap_id:\t107\nfrozen:\t0\n";
        assert_eq!(parse_field(info, "memlock"), Some(31_458_464));
        assert_eq!(parse_field("pos:\t0\n", "memlock"), None);
        assert_eq!(parse_field("memlock:\tlots\n", "memlock"), None);
        let prog = "prog_type:\t26\nrun_time_ns:\t0\nrun_cnt:\t0\nrecursion_misses:\t1650\n";
        assert_eq!(parse_field(prog, "recursion_misses"), Some(1650));
        assert_eq!(parse_field(prog, "run_cnt"), Some(0));
        assert_eq!(parse_field(prog, "run"), None);
    }
}
