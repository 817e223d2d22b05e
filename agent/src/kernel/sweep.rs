//! The sweep over the state table (agent-ebpf's `sweep.rs`): every tracked socket of every
//! network namespace, fresh, in runs of many sets of the table (256 with `bpf_loop`, 4 on
//! kernels without it). The program writes a run's records into
//! `CONNREAP_SWEEP`, an array this process maps read-only, a slot per way (empty: skaddr 0),
//! and returns how many sets it read; the next run starts after them.
//!
//! The output array is pinned with the tracker and shared by every connreap process that uses
//! this pin directory (the program is pinned too, and a program's maps are fixed at load), so
//! a sweep holds an exclusive `flock` on the pin directory for its duration (two daemons on one
//! pin root take turns). Only the daemon sweeps: the program is loaded (and pinned) on its
//! first ask (`Kernel::sweeps`).
use std::{
    fs,
    os::fd::{AsFd as _, AsRawFd as _},
    path::Path,
    time::{Duration, Instant},
};

use aya::{
    maps::MapData,
    programs::{ProgramError, RawTracePoint},
    RawTracePointRunOptions, TestRun as _,
};
use connreap_ebpf::{names, SweepRecord, MAX_SWEEP_SETS, STATE_WAYS};

use super::{error::program_error, load::Loaded, Dump, Kernel, KernelError};
use crate::flock::Exclusive;

/// Pin files of the program and its output array, in the pin directory.
pub(super) const PROG_PIN: &str = "sweep";
pub(super) const MAP_PIN: &str = "sweep_out";

/// `CONNREAP_SWEEP_FORM=unrolled` loads the form for kernels without `bpf_loop` whatever the
/// kernel (pinned apart, as `sweep_unrolled`): how the tests check that form on a kernel that
/// has `bpf_loop`.
const FORM_ENV: &str = "CONNREAP_SWEEP_FORM";

/// The forms of the sweep to try, best first, and the pin of the one loaded. `=unrolled` and
/// `=loop` load that form whatever the kernel, pinned apart.
fn forms() -> (&'static [&'static str], &'static str) {
    match std::env::var(FORM_ENV).as_deref() {
        Ok("unrolled") => (&[names::PROG_SWEEP], "sweep_unrolled"),
        Ok("loop") => (&[names::PROG_SWEEP_LOOP], "sweep_loop"),
        _ => (
            &[
                names::PROG_SWEEP_DIRECT,
                names::PROG_SWEEP_LOOP,
                names::PROG_SWEEP,
            ],
            PROG_PIN,
        ),
    }
}

/// The object for the direct form: its `bpf_rdonly_cast` calls patched to the kernel's id of
/// the kfunc, and the id of `struct tcp_sock` it casts to. An error when the kernel's BTF
/// lacks either (before 6.2: no such kfunc).
fn direct_object() -> Result<(Vec<u8>, u32), KernelError> {
    let btf = super::offsets::Resolver::open(Path::new(super::BTF_PATH))?;
    let cast = btf.func_id("bpf_rdonly_cast")?;
    let tcp_sock = btf.struct_id("tcp_sock")?;
    let mut object = super::OBJECT.to_vec();
    if super::destroy::bpf::patch_call(&mut object, connreap_ebpf::kfunc::CAST_INSN, cast) == 0 {
        return Err(KernelError::NoKfuncCall("bpf_rdonly_cast"));
    }
    Ok((object, tcp_sock))
}

/// Records one run can write.
const RUN_RECORDS: usize = MAX_SWEEP_SETS as usize * STATE_WAYS;

#[derive(Debug, thiserror::Error)]
pub enum SweepError {
    #[error("cannot open the pinned sweep program")]
    Program(#[source] ProgramError),
    #[error("cannot open the pinned sweep output array")]
    Map(#[source] aya::maps::MapError),
    #[error("cannot map the sweep output array into memory")]
    Mmap(#[source] std::io::Error),
    #[error("cannot lock the pin directory {} for a sweep", .0)]
    Lock(String, #[source] std::io::Error),
    #[error("running the sweep over sets {first}..")]
    Run {
        first: u32,
        #[source]
        source: ProgramError,
    },
    #[error("the sweep program read nothing: the loader did not set the kernel offsets")]
    NoOffsets,
    #[error("the sweep program says it read {0} sets from set {1} of {2}: a run reads 1 to {MAX_SWEEP_SETS} sets and never past the table's end")]
    BadCount(i64, u32, u32),
}

/// The pinned sweep program, its output array mapped into this process, and the directory
/// whose lock serialises sweeps.
pub struct Sweeper {
    prog: RawTracePoint,
    /// Keeps the array's fd (and so the mapping's map) open.
    _map: MapData,
    out: *const SweepRecord,
    len: usize,
    dir: fs::File,
    dir_name: String,
    /// Sets of the state table.
    sets: u32,
}

// SAFETY: `out` points into a shared read-only mapping owned by this value; nothing else
// aliases it mutably in this process.
unsafe impl Send for Sweeper {}

impl Sweeper {
    pub(super) fn open(pin_dir: &Path, prog_pin: &Path, sets: u32) -> Result<Self, SweepError> {
        let prog = RawTracePoint::from_pin(prog_pin).map_err(SweepError::Program)?;
        let map = MapData::from_pin(pin_dir.join(MAP_PIN)).map_err(SweepError::Map)?;
        let len = RUN_RECORDS * std::mem::size_of::<SweepRecord>();
        // SAFETY: a shared read-only mapping of an mmapable array map's fd, at offset 0, no
        // longer than the array (RUN_RECORDS values of exactly this size, 8-byte aligned).
        let out = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ,
                libc::MAP_SHARED,
                map.fd().as_fd().as_raw_fd(),
                0,
            )
        };
        if out == libc::MAP_FAILED {
            return Err(SweepError::Mmap(std::io::Error::last_os_error()));
        }
        let dir_name = pin_dir.display().to_string();
        let dir = fs::File::open(pin_dir).map_err(|e| SweepError::Lock(dir_name.clone(), e))?;
        Ok(Sweeper {
            prog,
            _map: map,
            out: out as *const SweepRecord,
            len,
            dir,
            dir_name,
            sets,
        })
    }

    /// Every tracked socket, one record at a time, but those of namespace `skip` (0: none).
    pub fn sweep(
        &mut self,
        skip: u32,
        mut f: impl FnMut(&SweepRecord),
    ) -> Result<Dump, SweepError> {
        let start = Instant::now();
        let _lock =
            Exclusive::lock(&self.dir).map_err(|e| SweepError::Lock(self.dir_name.clone(), e))?;
        let mut dump = Dump::default();
        let mut in_kernel = Duration::ZERO;
        let mut first = 0;
        while first < self.sets {
            let mut opts = RawTracePointRunOptions::new();
            opts.args[0] = u64::from(first);
            opts.args[1] = u64::from(skip);
            let t = Instant::now();
            let run = self
                .prog
                .test_run(opts)
                .map_err(|source| SweepError::Run { first, source })?;
            in_kernel += t.elapsed();
            let sets = sets_read(run.return_value, first, self.sets)?;
            // SAFETY: the mapping holds RUN_RECORDS records; the program wrote a slot per way
            // of the `sets` sets it read in the run that just returned, and no other sweep
            // runs while the lock is held.
            let records =
                unsafe { std::slice::from_raw_parts(self.out, sets as usize * STATE_WAYS) };
            for r in records.iter().filter(|r| r.sock.skaddr != 0) {
                f(r);
                dump.records += 1;
            }
            first += sets;
        }
        dump.in_kernel = in_kernel;
        dump.total = start.elapsed();
        Ok(dump)
    }
}

/// The sets a run read, from its return value (`ret`, an i32 in the register's low half) when
/// it started at set `first` of a table of `table` sets. The count sizes the slice of the
/// output array read next, so anything a run cannot have done is an error: a negative value
/// (the loader set no offsets), none at all (a run stops only at the table's end), more than
/// a run reads, or sets past the end.
fn sets_read(ret: u32, first: u32, table: u32) -> Result<u32, SweepError> {
    let sets = i64::from(ret as i32);
    if sets < 0 {
        return Err(SweepError::NoOffsets);
    }
    if sets == 0
        || sets > i64::from(MAX_SWEEP_SETS)
        || sets > i64::from(table.saturating_sub(first))
    {
        return Err(SweepError::BadCount(sets, first, table));
    }
    Ok(sets as u32)
}

impl Drop for Sweeper {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `open`, unmapped once.
        unsafe { libc::munmap(self.out as *mut libc::c_void, self.len) };
    }
}

/// Whether the sweep program is loaded.
pub(super) enum SweepState {
    NotTried,
    Ready(Box<Sweeper>),
    Refused,
}

impl Kernel {
    /// Whether this kernel runs the sweep (see `sweep`): its program is loaded (and pinned)
    /// on the first ask, the best form the kernel takes (direct, 6.2+; `bpf_loop`, 5.17+;
    /// unrolled). A kernel whose verifier refuses every form is
    /// said once, and the daemon then walks every namespace on every scan instead.
    pub fn sweeps(&mut self) -> bool {
        if let SweepState::NotTried = self.sweeper {
            let (forms, pin_name) = forms();
            let pin = self.pin_dir.join(pin_name);
            if !pin.exists() {
                let loaded = Self::load_sweep(&pin, forms, self.verbose, self.set_bits);
                // Loading parsed the kernel's BTF on this (the scanning) thread.
                super::return_freed_memory();
                if let Err(e) = loaded {
                    tracing::warn!(
                        error = %format!("{:#}", anyhow::Error::new(e)),
                        "no sweep over the state table on this kernel: every network namespace is walked on every scan (netns_walk_interval is not used)"
                    );
                    self.sweeper = SweepState::Refused;
                    return false;
                }
            }
            self.sweeper = match Sweeper::open(&self.pin_dir, &pin, 1 << self.set_bits) {
                Ok(s) => SweepState::Ready(Box::new(s)),
                Err(e) => {
                    tracing::warn!(
                        error = %format!("{:#}", anyhow::Error::new(e)),
                        "cannot open the sweep over the state table: every network namespace is walked on every scan"
                    );
                    SweepState::Refused
                }
            };
        }
        matches!(self.sweeper, SweepState::Ready(_))
    }

    /// Load the sweep program from the object (its maps from their pins) and pin it at `pin`:
    /// the first of `forms` the verifier takes (the form with `bpf_loop`, 5.17+, else the
    /// unrolled one); the last refusal is the error.
    fn load_sweep(
        pin: &Path,
        forms: &[&'static str],
        verbose: bool,
        set_bits: u32,
    ) -> Result<(), KernelError> {
        let pin_dir = pin.parent().unwrap_or(pin);
        let mut refused = None;
        for &name in forms {
            let t = Instant::now();
            let mut loaded = if name == names::PROG_SWEEP_DIRECT {
                match direct_object() {
                    Ok((object, id)) => {
                        Loaded::object_with(pin_dir, verbose, set_bits, &object, id)?
                    }
                    Err(e) => {
                        tracing::debug!(program = name, error = %e, "this form of the sweep needs what this kernel lacks");
                        refused = Some(e);
                        continue;
                    }
                }
            } else {
                Loaded::object(pin_dir, verbose, set_bits)?
            };
            let prog: &mut RawTracePoint = loaded.program(name)?;
            match prog.load() {
                Ok(()) => {
                    tracing::info!(
                        program = name,
                        load_ms = t.elapsed().as_millis() as u64,
                        "sweep over the state table loaded"
                    );
                    let _ = fs::remove_file(pin);
                    return prog.pin(pin).map_err(KernelError::pin(pin));
                }
                Err(e) => {
                    let e = program_error(verbose, name, e);
                    tracing::debug!(
                        program = name,
                        load_ms = t.elapsed().as_millis() as u64,
                        error = %e,
                        "the verifier refused this form of the sweep"
                    );
                    refused = Some(e);
                }
            }
        }
        Err(refused.unwrap_or(KernelError::MissingProgram(names::PROG_SWEEP)))
    }

    /// Every tracked socket of every network namespace but `skip` (0: none), fresh (see
    /// `sweep`); an error when [`Kernel::sweeps`] is false. The skipped namespace's sockets
    /// cost a cache line or two each instead of a dozen.
    pub fn sweep(
        &mut self,
        skip: u32,
        f: impl FnMut(&connreap_ebpf::SweepRecord),
    ) -> Result<Dump, KernelError> {
        match &mut self.sweeper {
            SweepState::Ready(s) => Ok(s.sweep(skip, f)?),
            _ => Err(KernelError::NoSweep),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What a run may report, and every way it may not: the count sizes a slice of the mapped
    /// output, so an impossible one must stop the sweep with an error naming it.
    #[test]
    fn a_run_reports_one_to_max_sets_never_past_the_end() {
        assert_eq!(sets_read(4, 0, 16_384).unwrap(), 4);
        assert_eq!(
            sets_read(MAX_SWEEP_SETS, 256, 16_384).unwrap(),
            MAX_SWEEP_SETS
        );
        assert_eq!(sets_read(10, 16_374, 16_384).unwrap(), 10);
        assert!(matches!(
            sets_read((-1i32) as u32, 0, 16_384),
            Err(SweepError::NoOffsets)
        ));
        for (ret, first) in [(0, 0), (MAX_SWEEP_SETS + 1, 0), (11, 16_374), (1, 16_384)] {
            let err = sets_read(ret, first, 16_384).unwrap_err();
            assert!(matches!(err, SweepError::BadCount(..)), "{err}");
            assert!(
                err.to_string()
                    .contains(&format!("read {ret} sets from set {first} of 16384")),
                "{err}"
            );
        }
    }
}
