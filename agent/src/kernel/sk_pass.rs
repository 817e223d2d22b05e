//! Bench-only `sk-storage` build (see agent-ebpf's sk_storage.rs): one `iter/bpf_sk_storage_map`
//! pass over the per-socket storage, i.e. over every tracked socket of every namespace, timed
//! next to the per-namespace `iter/tcp` walks of the same scan. Nothing here runs in the
//! shipped build (`connreap_ebpf::SK_STORAGE` is false there).
use std::{
    collections::BTreeMap,
    fs,
    io::Read as _,
    os::fd::{AsFd as _, AsRawFd as _, FromRawFd as _, OwnedFd},
    path::Path,
    time::{Duration, Instant},
};

use aya::{
    maps::MapData,
    programs::{Iter, ProgramInfo},
    Btf,
};
use connreap_ebpf::{names, SockRecord};

use super::{error::program_error, load::Loaded, KernelError};

pub(super) const MAP_PIN: &str = "sk";
pub(super) const ITER_PIN: &str = "iter_sk";

/// Load and pin the storage iterator (its map is pinned by the loader, see
/// `with_pinned_maps`). On the kernel this was first tried on (6.18, lockdown=integrity),
/// map-element iterators are refused at load with EPERM, even a two-instruction one, while the
/// tracker's `bpf_sk_storage_get` loads: then the variant runs without the pass (the caller
/// logs why), so the tracker's cost can still be measured.
pub(super) fn load(loaded: &mut Loaded, btf: &Btf, pin_dir: &Path) -> Result<(), KernelError> {
    let verbose = loaded.verbose;
    let it: &mut Iter = loaded.program(names::PROG_ITER_SK)?;
    it.load("bpf_sk_storage_map", btf)
        .map_err(|e| program_error(verbose, names::PROG_ITER_SK, e))?;
    let pin = pin_dir.join(ITER_PIN);
    let _ = fs::remove_file(&pin);
    it.pin(&pin).map_err(KernelError::pin(&pin))
}

/// One pass: its records by network namespace, and the time in read() and in all.
pub struct Pass {
    pub by_netns: BTreeMap<u32, usize>,
    pub records: usize,
    pub in_kernel: Duration,
    pub total: Duration,
}

const BPF_LINK_CREATE: libc::c_long = 28;
const BPF_ITER_CREATE: libc::c_long = 33;
const BPF_TRACE_ITER: u32 = 28;

fn bpf(cmd: libc::c_long, attr: &mut [u8; 128]) -> std::io::Result<OwnedFd> {
    // SAFETY: bpf(2) with a zero-filled attr buffer of the kernel's maximum union size.
    let fd = unsafe { libc::syscall(libc::SYS_bpf, cmd, attr.as_mut_ptr(), attr.len()) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: bpf(2) returned a new fd that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// Run the pinned storage iterator over the pinned storage map (aya 0.14 cannot attach a map
/// iterator: the link is created here with `bpf_iter_link_info.map.map_fd`).
pub fn run(pin_dir: &Path) -> Result<Pass, KernelError> {
    let start = Instant::now();
    let io = |e: std::io::Error| KernelError::SkPass(e.to_string());
    let prog = ProgramInfo::from_pin(pin_dir.join(ITER_PIN))
        .and_then(|p| p.fd())
        .map_err(|e| KernelError::SkPass(e.to_string()))?;
    let map =
        MapData::from_pin(pin_dir.join(MAP_PIN)).map_err(|e| KernelError::SkPass(e.to_string()))?;
    let map_fd: u32 = map.fd().as_fd().as_raw_fd() as u32;
    let mut attr = [0u8; 128];
    attr[0..4].copy_from_slice(&(prog.as_fd().as_raw_fd() as u32).to_ne_bytes());
    attr[8..12].copy_from_slice(&BPF_TRACE_ITER.to_ne_bytes());
    attr[16..24].copy_from_slice(&(&map_fd as *const u32 as u64).to_ne_bytes());
    attr[24..28].copy_from_slice(&4u32.to_ne_bytes());
    let link = bpf(BPF_LINK_CREATE, &mut attr).map_err(io)?;
    let mut attr = [0u8; 128];
    attr[0..4].copy_from_slice(&(link.as_raw_fd() as u32).to_ne_bytes());
    let mut file = fs::File::from(bpf(BPF_ITER_CREATE, &mut attr).map_err(io)?);
    let size = std::mem::size_of::<SockRecord>();
    let mut buf = vec![0u8; 64 * 1024];
    let mut filled = 0;
    let mut pass = Pass {
        by_netns: BTreeMap::new(),
        records: 0,
        in_kernel: Duration::ZERO,
        total: Duration::ZERO,
    };
    loop {
        let t = Instant::now();
        let n = file.read(&mut buf[filled..]);
        pass.in_kernel += t.elapsed();
        let n = match n {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(io(e)),
        };
        filled += n;
        let whole = filled - filled % size;
        for chunk in buf[..whole].chunks_exact(size) {
            // SAFETY: a whole record written by the iterator (plain old data).
            let r: SockRecord = unsafe { std::ptr::read_unaligned(chunk.as_ptr().cast()) };
            *pass.by_netns.entry(r._pad).or_default() += 1;
            pass.records += 1;
        }
        buf.copy_within(whole..filled, 0);
        filled -= whole;
    }
    pass.total = start.elapsed();
    Ok(pass)
}

impl super::Kernel {
    /// Bench-only: one storage pass after a scan, its time and records logged next to the
    /// scan's own line (`RUST_LOG=connreap::scan=debug`).
    pub fn log_sk_pass(&self) {
        if !self.pin_dir.join(ITER_PIN).exists() {
            return;
        }
        match run(&self.pin_dir) {
            Ok(p) => tracing::debug!(
                target: "connreap::scan",
                sk_records = p.records,
                sk_namespaces = p.by_netns.len(),
                sk_pass_kernel_us = p.in_kernel.as_micros() as u64,
                sk_pass_us = p.total.as_micros() as u64,
                "sk pass"
            ),
            Err(e) => tracing::warn!(target: "connreap::scan", error = %e, "sk pass failed"),
        }
    }
}
