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

pub use dump::{Dump, Owned};
use error::program_error;
pub use error::{IterError, KernelError};
use host::{ensure_mounted, load_lock, raise_memlock};
pub use pins::unpin_all;
use pins::{clean_failed_load, existing_pins, prepare_pin_dir};
pub use tracker::TrackerStatus;

use std::{
    collections::HashMap,
    fs,
    os::fd::AsFd as _,
    path::{Path, PathBuf},
    time::Duration,
};

use aya::{
    maps::{Map, MapData, PerCpuArray},
    programs::{
        links::{FdLink, PinnedLink},
        BtfTracePoint, Iter, RawTracePoint,
    },
    Btf, Ebpf, EbpfLoader,
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
    /// log2 of the state table's sets (its size, see [`set_bits_for`]).
    set_bits: u32,
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
    /// Load the object, (re)use the pinned state tracker and load the iterators; the state
    /// table keeps the size it was pinned with (the default size when nothing is pinned).
    pub fn load(verbose: bool) -> Result<Self, KernelError> {
        Self::load_sized(verbose, None)
    }

    /// [`Kernel::load`] with a state table for `max_sockets` sockets (see [`set_bits_for`]):
    /// a table pinned with another size is replaced, which restarts the tracker (the ages of
    /// the sockets open now become lower bounds).
    pub fn load_sized(verbose: bool, max_sockets: Option<u32>) -> Result<Self, KernelError> {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 {
            return Err(KernelError::NotRoot);
        }
        if OBJECT.is_empty() {
            return Err(KernelError::NotBuilt);
        }
        if !Path::new(BTF_PATH).exists() {
            return Err(KernelError::NoBtf);
        }
        ensure_mounted("bpf", BPFFS)?;
        ensure_mounted("tracefs", TRACEFS)?;
        raise_memlock();
        // Serialize loads: two connreap processes starting together must not both create the
        // pinned maps (the second pin would fail) or remove each other's pins.
        let _lock = load_lock();
        let pin_dir = prepare_pin_dir()?;
        let before = existing_pins(&pin_dir);
        Self::load_in(pin_dir.clone(), verbose, max_sockets.map(set_bits_for)).inspect_err(|_| {
            // Whatever failed, the pins this load made go (none are left by a refused program).
            clean_failed_load(&pin_dir, &before);
        })
    }

    /// [`Kernel::load`] once the pin directory is ready (under the load lock).
    fn load_in(pin_dir: PathBuf, verbose: bool, wanted: Option<u32>) -> Result<Self, KernelError> {
        let pinned_bits = pinned_set_bits(&pin_dir);
        if let (Some(pinned), Some(wanted)) = (pinned_bits, wanted) {
            if pinned != wanted {
                tracing::warn!(
                    pinned = 16u64 << pinned,
                    wanted = 16u64 << wanted,
                    "state table resized (agent.max_tracked_sockets): the tracker restarts, so the ages of the sockets open now become lower bounds"
                );
                pins::reset_dir(&pin_dir);
            }
        }
        let set_bits = match (pinned_bits, wanted) {
            (Some(p), Some(w)) if p != w => w,
            (p, w) => p.or(w).unwrap_or(connreap_ebpf::STATE_SET_BITS),
        };
        let tcp_pin = pin_dir.join("iter_tcp");
        let files_pin = pin_dir.join("iter_task_file");
        let flush_pin = pin_dir.join("flush");
        let netns_pin = pin_dir.join("iter_netns_socks");
        // Fast path: an earlier run left the tracker, its maps and verified iterators pinned;
        // reuse them (no ELF or BTF parsing, no verification). Their offsets were resolved
        // when they were loaded.
        let reuse = PinnedLink::from_pin(pin_dir.join("link")).is_ok()
            && tcp_pin.exists()
            && files_pin.exists()
            && netns_pin.exists()
            && flush_pin.exists();
        let pinned = if reuse {
            Maps::from_pins(&pin_dir)
                .map_err(
                    |e| tracing::debug!(error = %e, "pinned maps unusable; loading the object"),
                )
                .ok()
        } else {
            None
        };
        let maps = match pinned {
            Some(maps) => maps,
            None => Self::load_object(&pin_dir, verbose, set_bits)?,
        };
        let from_pin = |path: &Path, prog: &'static str| {
            Iter::from_pin(path).map_err(|e| program_error(verbose, prog, e))
        };
        let memory = memory::MapMemory::open(&pin_dir);
        Ok(Kernel {
            iter_tcp: from_pin(&tcp_pin, names::PROG_ITER_TCP)?,
            iter_files: from_pin(&files_pin, names::PROG_ITER_FILES)?,
            iter_netns_socks: from_pin(&netns_pin, names::PROG_ITER_NETNS_SOCKS)?,
            sweeper: sweep::SweepState::NotTried,
            ebpf: maps,
            tracker: tracker::Watch::new(&memory),
            memory,
            pin_dir,
            verbose,
            hz: hz::kernel_hz(),
            set_bits,
        })
    }

    /// Load the object with offsets from the kernel's BTF, attach and pin the state tracker
    /// (unless alive), load and pin both iterators; keep the maps userspace reads.
    pub(crate) fn load_object(
        pin_dir: &Path,
        verbose: bool,
        set_bits: u32,
    ) -> Result<Maps, KernelError> {
        let mut loaded = Loaded::object(pin_dir, verbose, set_bits)?;
        let btf = Btf::from_sys_fs().map_err(KernelError::KernelBtf)?;
        loaded.attach_tracker(&pin_dir.join("link"), &btf)?;
        for (prog, iter_type, pin) in [
            (names::PROG_ITER_TCP, "tcp", pin_dir.join("iter_tcp")),
            (
                names::PROG_ITER_FILES,
                "task_file",
                pin_dir.join("iter_task_file"),
            ),
            (
                names::PROG_ITER_NETNS_SOCKS,
                "task_file",
                pin_dir.join("iter_netns_socks"),
            ),
        ] {
            let it: &mut Iter = loaded.program(prog)?;
            it.load(iter_type, &btf)
                .map_err(|e| program_error(verbose, prog, e))?;
            let _ = fs::remove_file(&pin);
            it.pin(&pin).map_err(KernelError::pin(&pin))?;
        }
        if connreap_ebpf::SK_STORAGE {
            if let Err(e) = sk_pass::load(&mut loaded, &btf, pin_dir) {
                tracing::warn!(error = %format!("{:#}", anyhow::Error::new(e)), "bench-only sk-storage build: no storage pass");
            }
        }
        let flush: &mut RawTracePoint = loaded.program(names::PROG_FLUSH)?;
        flush
            .load()
            .map_err(|e| program_error(verbose, names::PROG_FLUSH, e))?;
        let pin = pin_dir.join("flush");
        let _ = fs::remove_file(&pin);
        flush.pin(&pin).map_err(KernelError::pin(&pin))?;
        Ok(Maps::from_object(&mut loaded.ebpf))
    }
}

/// log2 of the state table's sets for up to `max_sockets` tracked sockets: the smallest table
/// that holds them (sets of [`connreap_ebpf::STATE_WAYS`] ways), within
/// [`connreap_ebpf::MIN_SET_BITS`]..=[`connreap_ebpf::MAX_SET_BITS`].
pub fn set_bits_for(max_sockets: u32) -> u32 {
    let sets = max_sockets
        .div_ceil(connreap_ebpf::STATE_WAYS as u32)
        .max(1);
    let bits = u32::BITS - (sets - 1).leading_zeros();
    bits.clamp(connreap_ebpf::MIN_SET_BITS, connreap_ebpf::MAX_SET_BITS)
}

/// log2 of the sets of the state table pinned in `pin_dir`, if one is.
fn pinned_set_bits(pin_dir: &Path) -> Option<u32> {
    let map = MapData::from_pin(pin_dir.join("state")).ok()?;
    let entries = map.info().ok()?.max_entries();
    entries.is_power_of_two().then(|| entries.trailing_zeros())
}

/// The maps every load of the object shares with the pinned tracker (name, pin file).
const SHARED_MAPS: [(&str, &str); 6] = [
    (names::STATE_MAP, "state"),
    (names::EVENTS, "events"),
    (names::COUNTERS, "counters"),
    (names::STAGING, "staging"),
    (names::LOGS, "logs"),
    (names::SWEEP_MAP, sweep::MAP_PIN),
];

/// Point the loader at the pins of [`SHARED_MAPS`] (created on the first load, reused after).
pub(crate) fn with_pinned_maps<'a, 'l>(
    loader: &'l mut EbpfLoader<'a>,
    pin_dir: &Path,
) -> &'l mut EbpfLoader<'a> {
    for (name, pin) in SHARED_MAPS {
        loader.map_pin_path(name, pin_dir.join(pin));
    }
    if connreap_ebpf::SK_STORAGE {
        loader.map_pin_path(names::SK_MAP, pin_dir.join(sk_pass::MAP_PIN));
    }
    loader
}

/// The object during load, before the iterators are taken from their pins.
struct Loaded {
    ebpf: Ebpf,
    verbose: bool,
}

impl Loaded {
    /// The object with the kernel offsets and the table's size set, its maps from their pins
    /// in `pin_dir` (created there when missing); no program is loaded yet.
    fn object(pin_dir: &Path, verbose: bool, set_bits: u32) -> Result<Self, KernelError> {
        let offsets = offsets::resolve(Path::new(BTF_PATH))?;
        let mut loader = EbpfLoader::new();
        loader.override_global(names::OFFSETS, &offsets, true);
        loader.override_global(names::SET_BITS, &set_bits, true);
        loader.map_max_entries(names::STATE_MAP, 1 << set_bits);
        let ebpf = with_pinned_maps(&mut loader, pin_dir)
            .load(OBJECT)
            .map_err(KernelError::Object)?;
        Ok(Loaded { ebpf, verbose })
    }

    fn program<T>(&mut self, name: &'static str) -> Result<&mut T, KernelError>
    where
        for<'a> &'a mut T: TryFrom<&'a mut aya::programs::Program>,
    {
        let p = self
            .ebpf
            .program_mut(name)
            .ok_or(KernelError::MissingProgram(name))?;
        <&mut T>::try_from(p).map_err(|_| KernelError::ProgramType(name))
    }

    /// Attach the state-change tracepoint unless a pinned link from an earlier run is alive.
    fn attach_tracker(&mut self, link_pin: &Path, btf: &Btf) -> Result<(), KernelError> {
        if PinnedLink::from_pin(link_pin).is_ok() {
            // The pinned tracker keeps running; this load's copy of the program stays unattached.
            return Ok(());
        }
        let _ = fs::remove_file(link_pin);
        let verbose = self.verbose;
        let tp: &mut BtfTracePoint = self.program(names::PROG_STATE)?;
        tp.load("inet_sock_set_state", btf)
            .map_err(|e| program_error(verbose, names::PROG_STATE, e))?;
        let program_error = |source| KernelError::Program {
            program: names::PROG_STATE,
            source,
        };
        let id = tp.attach().map_err(program_error)?;
        let link = tp.take_link(id).map_err(program_error)?;
        let fd_link: FdLink = link.into();
        match fd_link.pin(link_pin) {
            Ok(_) => Ok(()),
            // Another connreap pinned its tracker at the same moment: ours detaches on drop.
            Err(_) if PinnedLink::from_pin(link_pin).is_ok() => Ok(()),
            Err(e) => Err(KernelError::pin(link_pin)(e)),
        }
    }
}

impl Kernel {
    /// Load the fallback destroy iterator (see [`destroy`]).
    pub fn destroyer(&self, verbose: bool) -> Result<destroy::bpf::BpfDestroyer, KernelError> {
        destroy::bpf::BpfDestroyer::load(OBJECT, &self.pin_dir, verbose)
    }

    /// Run an iterator and hand each complete record to `f` as it is read.
    fn run_iter<T: aya::Pod>(
        it: &mut Iter,
        what: &'static str,
        f: impl FnMut(T),
    ) -> Result<Dump, KernelError> {
        dump::fixed(it, f).map_err(KernelError::iterate(what))
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
        Self::sockets_in(&mut self.iter_tcp, spaces, |_| true, f)
    }

    /// [`Kernel::for_each_socket`], but a namespace is dumped only when `walk`, asked inside
    /// it after its [`NsEvent::Enter`], says so (the others count as `quiet`).
    pub fn for_each_socket_where(
        &mut self,
        spaces: &[netns::Namespace],
        walk: impl FnMut(&netns::Namespace) -> bool + Send,
        f: impl FnMut(NsEvent<'_>) + Send,
    ) -> Result<SocketDump, KernelError> {
        Self::sockets_in(&mut self.iter_tcp, spaces, walk, f)
    }

    fn sockets_in(
        it: &mut Iter,
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
            match Self::run_iter(it, "iter/tcp", |r| f(NsEvent::Socket(r))) {
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
        Self::run_iter(&mut self.iter_files, "iter/task_file", f)
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
        dump::owned(&mut self.iter_netns_socks, f).map_err(KernelError::iterate(
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
        let (iter_tcp, iter_files, iter_netns_socks) = (
            &mut self.iter_tcp,
            &mut self.iter_files,
            &mut self.iter_netns_socks,
        );
        std::thread::scope(|scope| {
            let owners = scope.spawn(move || {
                if elsewhere {
                    dump::owned(iter_netns_socks, on_owner).map_err(KernelError::iterate(
                        "iter/task_file (owners, other namespaces)",
                    ))
                } else {
                    Self::run_iter(iter_files, "iter/task_file", |o| on_owner(Owned::Owner(o)))
                }
            });
            let sockets = Self::sockets_in(iter_tcp, spaces, |_| true, on_socket);
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

#[cfg(test)]
mod tests {
    use super::set_bits_for;

    #[test]
    fn the_table_is_the_smallest_power_of_two_that_holds_the_sockets() {
        // The default: 262144 sockets = 16384 sets of 16.
        assert_eq!(set_bits_for(262_144), 14);
        assert_eq!(set_bits_for(262_145), 15);
        assert_eq!(set_bits_for(1_000_000), 16);
        assert_eq!(set_bits_for(1 << 20), 16);
        // Bounded: at least 1024 sets, at most 262144.
        assert_eq!(set_bits_for(0), 10);
        assert_eq!(set_bits_for(16_384), 10);
        assert_eq!(set_bits_for(u32::MAX), 18);
    }
}
