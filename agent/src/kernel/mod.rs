//! All kernel access lives here: loading the BPF object, pinning the state tracker, running the
//! socket and owner iterators, reading counters and transition events, (in `diag`) netlink
//! sock_diag, and (in `procfs`) what a scan reads from /proc and the clock. Everything above
//! this module works on plain data.
//!
//! The state tracker (tracepoint + per-socket map + event ring + counters) is pinned under
//! `/sys/fs/bpf/connreap/<object-hash>/` (another root with `CONNREAP_PIN_ROOT`, see `host`) so
//! that socket ages survive agent restarts and one-shot commands like `snapshot` see ages of
//! sockets created before they ran. A new object (upgrade)
//! gets a new directory and the stale ones are removed, which detaches the old tracker. Only
//! what connreap created is ever removed (see `pins`); a load that fails removes the pins it
//! made; a daemon whose tracker gets unpinned re-attaches it (see `tracker`).
pub mod bpf_log;
pub mod destroy;
mod dump;
pub mod error;
pub mod events;
mod host;
mod hz;
mod load;
mod memory;
pub mod netns;
pub mod offsets;
pub mod outcome;
mod pin_users;
mod pins;
pub mod procfs;
pub mod ring;
mod sk_pass;
pub mod sweep;
mod too_old;
mod tracker;

pub use dump::{Dump, Owned, Reading};
use error::program_error;
pub use error::{IterError, KernelError};
pub(crate) use load::with_pinned_maps;
pub use memory::advise_huge_pages;
pub use pins::unpin_all;
pub use tracker::TrackerStatus;

use std::{
    collections::HashMap,
    os::fd::AsFd as _,
    path::{Path, PathBuf},
    time::Duration,
};

use aya::{
    maps::{Map, MapData, PerCpuArray},
    programs::{
        links::{FdLink, PinnedLink},
        Iter,
    },
    Ebpf,
};
use connreap_ebpf::{counter, names, EventBatch, OwnerRecord, SockRecord};

/// The BPF object, embedded at build time (empty when `cargo xtask build-ebpf` has not run).
static OBJECT: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/connreap-ebpf.o"));

pub const BTF_PATH: &str = "/sys/kernel/btf/vmlinux";
pub const BPFFS: &str = "/sys/fs/bpf";
pub const TRACEFS: &str = "/sys/kernel/tracing";
/// Drop counters kept by the BPF side (summed over CPUs).
#[derive(Debug, Default, Clone, serde::Serialize)]
pub struct Counters {
    pub transitions: u64,
    pub ring_drops: u64,
    pub map_full: u64,
    /// Kernel memory of each shared map (pin name, bytes).
    pub map_memory: Vec<(&'static str, u64)>,
}

/// Run-time statistics of one BPF program (non-zero only while kernel.bpf_stats_enabled=1).
#[derive(Debug, Clone, serde::Serialize)]
pub struct ProgramStats {
    pub program: &'static str,
    pub run_time_ns: u64,
    pub run_count: u64,
    /// Runs the kernel skipped because the program was already running on that CPU (for the
    /// tracker: a transition in softirq context during another one in process context). The
    /// kernel counts them whether or not bpf_stats is on; None where it does not say.
    pub recursion_misses: Option<u64>,
}

/// What a socket dump hands its caller, in order: a namespace, then its sockets.
#[derive(Debug)]
pub enum NsEvent<'n> {
    Enter(&'n netns::Namespace),
    Socket(SockRecord),
}

/// A socket dump over namespaces.
#[derive(Debug, Default)]
pub struct SocketDump {
    /// All namespaces' records and time.
    pub dump: Dump,
    /// Namespaces dumped.
    pub namespaces: usize,
    /// Of those, namespaces other than connreap's own, and their dumps' time in the kernel.
    pub others: usize,
    pub others_in_kernel: Duration,
    /// Namespaces entered but not dumped (see [`Kernel::for_each_socket_where`]).
    pub quiet: usize,
    /// Namespaces that went away between discovery and their dump.
    pub gone: usize,
    /// Namespaces that could not be entered or dumped (inode, why): their sockets are missing
    /// from this scan.
    pub failed: Vec<(u32, anyhow::Error)>,
}

pub struct Kernel {
    /// The maps userspace reads (counters, event ring), by name.
    ebpf: Maps,
    pin_dir: PathBuf,
    iter_tcp: Iter,
    iter_files: Iter,
    /// Sockets held by processes in namespaces other than the reader's (iter/task_file).
    iter_netns_socks: Iter,
    /// Every tracked socket of every namespace (see `sweep`): loaded on first use, since
    /// only the daemon sweeps.
    sweeper: sweep::SweepState,
    memory: memory::MapMemory,
    /// Whether the tracker is still attached through this process's pins (see `tracker`).
    tracker: tracker::Watch,
    verbose: bool,
    /// Ticks per second of the kernel's jiffies clock (CONFIG_HZ).
    pub hz: u32,
    /// log2 of the state table's sets (its size, see [`load::set_bits_for`]).
    set_bits: u32,
    /// How big dumps are read: pipelined unless the caller sets otherwise.
    reading: dump::Reading,
}

/// The object's maps this process uses, by name: taken from the loaded object on a first load,
/// or opened straight from their pins when an earlier run left everything pinned (then the ELF
/// is not parsed and `EbpfLoader::new()` never reads the kernel's BTF).
pub(crate) struct Maps {
    maps: HashMap<&'static str, Map>,
}

/// Wraps a pinned map's fd as the right kind of [`Map`].
type WrapMap = fn(MapData) -> Map;

/// The maps kept by [`Kernel`]: name, pin file, and how to wrap a pinned map's fd.
const KEPT_MAPS: [(&str, &str, WrapMap); 3] = [
    (names::COUNTERS, "counters", Map::PerCpuArray),
    (names::EVENTS, "events", Map::RingBuf),
    (names::STAGING, "staging", Map::PerCpuArray),
];

impl Maps {
    fn from_pins(pin_dir: &Path) -> Result<Self, aya::maps::MapError> {
        let mut maps = HashMap::new();
        for (name, pin, wrap) in KEPT_MAPS {
            maps.insert(name, wrap(MapData::from_pin(pin_dir.join(pin))?));
        }
        Ok(Maps { maps })
    }

    fn from_object(ebpf: &mut Ebpf) -> Self {
        let maps = KEPT_MAPS
            .iter()
            .filter_map(|(name, _, _)| Some((*name, ebpf.take_map(name)?)))
            .collect();
        Maps { maps }
    }

    pub(crate) fn map(&self, name: &str) -> Option<&Map> {
        self.maps.get(name)
    }

    pub(crate) fn take_map(&mut self, name: &str) -> Option<Map> {
        self.maps.remove(name)
    }
}

impl SocketDump {
    /// Count `more`, a dump of other namespaces, in this one.
    pub fn absorb(&mut self, mut more: SocketDump) {
        self.dump.records += more.dump.records;
        self.dump.in_kernel += more.dump.in_kernel;
        self.dump.total += more.dump.total;
        self.namespaces += more.namespaces;
        self.others += more.others;
        self.others_in_kernel += more.others_in_kernel;
        self.quiet += more.quiet;
        self.gone += more.gone;
        self.failed.append(&mut more.failed);
    }
}

/// Mount bpffs at [`BPFFS`] unless it is mounted; whether this call mounted it.
pub fn mount_bpffs() -> Result<bool, KernelError> {
    let was = host::is_mounted(BPFFS, "bpf");
    host::ensure_mounted("bpf", BPFFS)?;
    Ok(!was)
}

impl Kernel {
    /// Load the fallback destroy iterator (see [`destroy`]).
    pub fn destroyer(&self, verbose: bool) -> Result<destroy::bpf::BpfDestroyer, KernelError> {
        destroy::bpf::BpfDestroyer::load(OBJECT, &self.pin_dir, verbose)
    }

    /// Run an iterator and hand each complete record to `f` as it is read.
    fn run_iter<T: aya::Pod>(
        it: &mut Iter,
        reading: dump::Reading,
        what: &'static str,
        f: impl FnMut(T),
    ) -> Result<Dump, KernelError> {
        dump::fixed(it, reading, f).map_err(KernelError::iterate(what))
    }

    /// Read big dumps on the calling thread alone (the daemon, where CPU per scan counts),
    /// or pipelined on two (the default: a one-shot snapshot's wall time). See
    /// [`dump::Reading`].
    pub fn set_reading(&mut self, reading: dump::Reading) {
        self.reading = reading;
    }

    /// Every TCP socket of each of `spaces`, one record at a time: `f` gets
    /// [`NsEvent::Enter`] inside each namespace (on the thread that is in it, so /proc/sys/net
    /// reads are that namespace's) before its sockets. A namespace that went away meanwhile is
    /// skipped; one that could not be entered or dumped is reported with the result; a failure
    /// in connreap's own namespace fails the dump.
    pub fn for_each_socket(
        &mut self,
        spaces: &[netns::Namespace],
        f: impl FnMut(NsEvent<'_>) + Send,
    ) -> Result<SocketDump, KernelError> {
        Self::sockets_in(&mut self.iter_tcp, self.reading, spaces, |_| true, f)
    }

    /// [`Kernel::for_each_socket`], but a namespace is dumped only when `walk`, asked inside
    /// it after its [`NsEvent::Enter`], says so (the others count as `quiet`).
    pub fn for_each_socket_where(
        &mut self,
        spaces: &[netns::Namespace],
        walk: impl FnMut(&netns::Namespace) -> bool + Send,
        f: impl FnMut(NsEvent<'_>) + Send,
    ) -> Result<SocketDump, KernelError> {
        Self::sockets_in(&mut self.iter_tcp, self.reading, spaces, walk, f)
    }

    fn sockets_in(
        it: &mut Iter,
        reading: dump::Reading,
        spaces: &[netns::Namespace],
        mut walk: impl FnMut(&netns::Namespace) -> bool + Send,
        mut f: impl FnMut(NsEvent<'_>) + Send,
    ) -> Result<SocketDump, KernelError> {
        let mut out = SocketDump::default();
        let mut own_error = None;
        let mut failed_dumps = Vec::new();
        let failed = netns::visit(spaces, |ns| {
            f(NsEvent::Enter(ns));
            if !walk(ns) {
                out.quiet += 1;
                return;
            }
            match Self::run_iter(it, reading, "iter/tcp", |r| f(NsEvent::Socket(r))) {
                Ok(d) => {
                    out.dump.records += d.records;
                    out.dump.in_kernel += d.in_kernel;
                    out.dump.total += d.total;
                    out.namespaces += 1;
                    if !ns.own {
                        out.others += 1;
                        out.others_in_kernel += d.in_kernel;
                    }
                }
                Err(e) if ns.own => own_error = Some(e),
                Err(e) => failed_dumps.push((ns.inode, e.into())),
            }
        });
        if let Some(e) = own_error {
            return Err(e);
        }
        for (ns, e) in failed {
            if e.is_gone() {
                out.gone += 1;
            } else {
                out.failed.push((ns.inode, e.into()));
            }
        }
        out.failed.append(&mut failed_dumps);
        Ok(out)
    }

    /// Every (socket, process) pair on the host, one record at a time.
    pub fn for_each_owner(&mut self, f: impl FnMut(OwnerRecord)) -> Result<Dump, KernelError> {
        Self::run_iter(&mut self.iter_files, self.reading, "iter/task_file", f)
    }

    /// Every (socket, process) pair on the host like [`Kernel::for_each_owner`], and with it
    /// every TCP socket a process holds in a namespace other than this thread's, in one pass
    /// over every process's files (see agent-ebpf's `netns_socks.rs`): what a scan reads of the
    /// other namespaces between their walks. A socket shared by several descriptors comes once
    /// per descriptor.
    pub fn for_each_owner_and_elsewhere(
        &mut self,
        f: impl FnMut(Owned),
    ) -> Result<Dump, KernelError> {
        dump::owned(&mut self.iter_netns_socks, self.reading, f).map_err(KernelError::iterate(
            "iter/task_file (owners, other namespaces)",
        ))
    }

    /// Both dumps at once, the owner dump on a second thread: a one-shot snapshot's wall time
    /// is the longer dump instead of their sum. A socket created while they run may show no
    /// owner (the owner dump may pass its process first); the daemon dumps one after the
    /// other, so a socket it sees has had the time to get its owner. With `elsewhere`, the
    /// owner dump is [`Kernel::for_each_owner_and_elsewhere`]'s.
    pub fn for_each_both(
        &mut self,
        spaces: &[netns::Namespace],
        on_socket: impl FnMut(NsEvent<'_>) + Send,
        elsewhere: bool,
        mut on_owner: impl FnMut(Owned) + Send,
    ) -> Result<(SocketDump, Dump), KernelError> {
        let (iter_tcp, iter_files, iter_netns_socks, reading) = (
            &mut self.iter_tcp,
            &mut self.iter_files,
            &mut self.iter_netns_socks,
            self.reading,
        );
        std::thread::scope(|scope| {
            let owners = scope.spawn(move || {
                if elsewhere {
                    dump::owned(iter_netns_socks, reading, on_owner).map_err(KernelError::iterate(
                        "iter/task_file (owners, other namespaces)",
                    ))
                } else {
                    Self::run_iter(iter_files, reading, "iter/task_file", |o| {
                        on_owner(Owned::Owner(o))
                    })
                }
            });
            let sockets = Self::sockets_in(iter_tcp, reading, spaces, |_| true, on_socket);
            let owners = owners.join().unwrap_or_else(|_| {
                Err(KernelError::iterate("iter/task_file")(IterError::Panicked))
            });
            Ok((sockets?, owners?))
        })
    }

    /// A per-CPU array this process keeps, by name.
    fn per_cpu<V: aya::Pod>(
        &self,
        name: &'static str,
    ) -> Result<PerCpuArray<&MapData, V>, KernelError> {
        let map = self.ebpf.map(name).ok_or(KernelError::MissingMap(name))?;
        PerCpuArray::try_from(map).map_err(KernelError::map(name))
    }

    /// TCP state transitions the tracker has seen, all CPUs'. The count lives in each CPU's
    /// staging batch header (see EventBatch); None when its lookup fails.
    pub fn transitions(&self) -> Result<Option<u64>, KernelError> {
        Ok(self
            .per_cpu::<EventBatch>(names::STAGING)?
            .get(&0, 0)
            .ok()
            .map(|v| v.iter().map(|b| b.transitions).sum()))
    }

    pub fn counters(&self) -> Result<Counters, KernelError> {
        let arr = self.per_cpu::<u64>(names::COUNTERS)?;
        let sum = |i: u32| arr.get(&i, 0).map(|v| v.iter().sum()).unwrap_or(0);
        Ok(Counters {
            transitions: self.transitions()?.unwrap_or(0),
            ring_drops: sum(counter::RING_DROPS),
            map_full: sum(counter::MAP_FULL),
            map_memory: self.memory.read(),
        })
    }

    /// Run time and count of each program. The state tracker may have been attached by an
    /// earlier connreap: its program is found through the pinned link.
    pub fn program_stats(&self) -> Vec<ProgramStats> {
        let mut out = Vec::new();
        let tracker_id = PinnedLink::from_pin(self.pin_dir.join("link"))
            .ok()
            .and_then(|l| FdLink::from(l).info().ok())
            .map(|i| i.program_id());
        if let Some(id) = tracker_id {
            if let Some(info) = aya::programs::loaded_programs()
                .flatten()
                .find(|p| p.id() == id)
            {
                out.push(ProgramStats {
                    program: names::PROG_STATE,
                    run_time_ns: info.run_time().as_nanos() as u64,
                    run_count: info.run_count(),
                    recursion_misses: info.fd().ok().and_then(|fd| recursion_misses(&fd)),
                });
            }
        }
        for (name, it) in [
            (names::PROG_ITER_TCP, &self.iter_tcp),
            (names::PROG_ITER_FILES, &self.iter_files),
            (names::PROG_ITER_NETNS_SOCKS, &self.iter_netns_socks),
        ] {
            if let Ok(info) = it.info() {
                out.push(ProgramStats {
                    program: name,
                    run_time_ns: info.run_time().as_nanos() as u64,
                    run_count: info.run_count(),
                    recursion_misses: it.fd().ok().and_then(recursion_misses),
                });
            }
        }
        out
    }
}

/// A program's runs the kernel skipped as nested (its fdinfo; aya's ProgramInfo lacks it).
fn recursion_misses(fd: &aya::programs::ProgramFd) -> Option<u64> {
    memory::fdinfo_u64(fd.as_fd(), "recursion_misses")
}

/// Hand back to the system the heap memory a load freed. Parsing the kernel's BTF (the
/// offsets, and aya's loader) allocates tens of MB for a moment; glibc keeps freed memory in
/// the arena of the thread that freed it, and after a lazy load on the scanning thread that
/// stayed in the daemon's VmRSS, scattered between the scans' allocations. Called once per
/// load (the sweep's is lazy: once, in the first scan that sweeps), never per scan.
pub(crate) fn return_freed_memory() {
    #[cfg(target_env = "gnu")]
    // SAFETY: malloc_trim has no preconditions; it only releases free memory.
    unsafe {
        libc::malloc_trim(0);
    }
}
