//! Kernel memory held by the pinned maps, as the kernel accounts it (`memlock:` in
//! `/proc/self/fdinfo/<fd>`), for `connreap_bpf_map_memory_bytes`.
use std::{
    fs,
    os::fd::{AsFd as _, AsRawFd as _},
    path::Path,
};

use aya::maps::MapData;

use super::SHARED_MAPS;

/// Bytes of each map of [`SHARED_MAPS`], by pin name; a map that cannot be opened is left out.
pub(crate) fn map_memory(pin_dir: &Path) -> Vec<(&'static str, u64)> {
    SHARED_MAPS
        .iter()
        .filter_map(|(_, pin)| Some((*pin, pinned_memlock(&pin_dir.join(pin))?)))
        .collect()
}

fn pinned_memlock(path: &Path) -> Option<u64> {
    let map = MapData::from_pin(path).ok()?;
    let fd = map.fd().as_fd().as_raw_fd();
    parse_memlock(&fs::read_to_string(format!("/proc/self/fdinfo/{fd}")).ok()?)
}

fn parse_memlock(fdinfo: &str) -> Option<u64> {
    fdinfo
        .lines()
        .find_map(|l| l.strip_prefix("memlock:"))
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
        assert_eq!(parse_memlock(info), Some(31_458_464));
        assert_eq!(parse_memlock("pos:\t0\n"), None);
        assert_eq!(parse_memlock("memlock:\tlots\n"), None);
    }
}
