//! Loading the BPF object: the state tracker attached and pinned (or reused from its pins), the
//! iterators loaded and pinned, the state table sized (see the parent module's docs).
use std::{
    fs,
    path::{Path, PathBuf},
};

use aya::{
    maps::MapData,
    programs::{
        links::{FdLink, PinnedLink},
        BtfTracePoint, Iter, RawTracePoint,
    },
    Btf, Ebpf, EbpfLoader,
};
use connreap_ebpf::names;

use super::{
    error::program_error,
    host::{ensure_mounted, load_lock, raise_memlock},
    hz, memory, offsets,
    pins::{self, clean_failed_load, existing_pins, prepare_pin_dir},
    sk_pass, sweep, tracker, Kernel, KernelError, Maps, BPFFS, BTF_PATH, OBJECT, TRACEFS,
};

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
        let loaded = Self::load_in(pin_dir.clone(), verbose, max_sockets.map(set_bits_for));
        super::return_freed_memory();
        loaded.inspect_err(|_| {
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
            reading: super::Reading::default(),
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
pub(super) const SHARED_MAPS: [(&str, &str); 6] = [
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
pub(super) struct Loaded {
    pub(super) ebpf: Ebpf,
    pub(super) verbose: bool,
}

impl Loaded {
    /// The object with the kernel offsets and the table's size set, its maps from their pins
    /// in `pin_dir` (created there when missing); no program is loaded yet.
    pub(super) fn object(
        pin_dir: &Path,
        verbose: bool,
        set_bits: u32,
    ) -> Result<Self, KernelError> {
        Self::object_with(pin_dir, verbose, set_bits, OBJECT, 0)
    }

    /// [`Loaded::object`] from `object` (the embedded one with its kfunc calls patched), with
    /// the kernel's BTF id of `struct tcp_sock` for the direct sweep (0: not used).
    pub(super) fn object_with(
        pin_dir: &Path,
        verbose: bool,
        set_bits: u32,
        object: &[u8],
        tcp_sock_id: u32,
    ) -> Result<Self, KernelError> {
        let offsets = offsets::resolve(Path::new(BTF_PATH))?;
        let mut loader = EbpfLoader::new();
        loader.override_global(names::OFFSETS, &offsets, true);
        loader.override_global(names::SET_BITS, &set_bits, true);
        loader.override_global(names::TCP_SOCK_ID, &tcp_sock_id, true);
        loader.map_max_entries(names::STATE_MAP, 1 << set_bits);
        let ebpf = with_pinned_maps(&mut loader, pin_dir)
            .load(object)
            .map_err(KernelError::Object)?;
        Ok(Loaded { ebpf, verbose })
    }

    pub(super) fn program<T>(&mut self, name: &'static str) -> Result<&mut T, KernelError>
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
