//! The transition event ring and the flush of the per-CPU staging batches.
//!
//! The tracker stages transitions per CPU and sends them over `CONNREAP_EVENTS` a full batch at
//! a time (see `connreap_ebpf::EventBatch`). A CPU that sees few transitions would hold its
//! partial batch indefinitely, so the ring reader periodically runs `connreap_flush_events` on
//! every online CPU through aya's `TestRun` (`BPF_PROG_TEST_RUN` with
//! `BPF_F_TEST_RUN_ON_CPU`, kernel >= 5.10): the kernel runs it on that CPU (an IPI), where it
//! sends the partial batch.
use std::{os::fd::AsRawFd as _, path::Path};

use aya::{
    maps::{MapData, RingBuf},
    programs::{ProgramError, RawTracePoint},
    RawTracePointRunOptions, TestRun as _,
};
use connreap_ebpf::{flush, names, EventBatch, TransitionEvent};

use super::KernelError;

/// Runs the flush program on every online CPU.
pub struct Flusher {
    prog: RawTracePoint,
    cpus: Vec<u32>,
}

/// What one flush round did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct FlushRound {
    /// CPUs that had a partial batch, now sent.
    pub sent: u32,
    /// CPUs whose batch was in use at that instant: their events go out on the next round.
    pub busy: u32,
}

impl Flusher {
    pub(crate) fn from_pin(pin: &Path) -> Result<Self, KernelError> {
        let prog = RawTracePoint::from_pin(pin).map_err(|source| KernelError::Program {
            program: names::PROG_FLUSH,
            source,
        })?;
        let cpus = aya::util::online_cpus()
            .map_err(|(path, source)| KernelError::OnlineCpus { path, source })?;
        Ok(Flusher { prog, cpus })
    }

    /// Send every CPU's partial batch to the ring.
    pub fn flush(&self) -> Result<FlushRound, KernelError> {
        let mut round = FlushRound::default();
        for &cpu in &self.cpus {
            let run = self.prog.test_run(RawTracePointRunOptions {
                cpu: Some(cpu),
                ..RawTracePointRunOptions::new()
            });
            let retval = match run {
                Ok(r) => r.return_value,
                // A CPU taken offline since start: nothing staged there can be reached.
                Err(ProgramError::SyscallError(e))
                    if e.io_error.raw_os_error() == Some(libc::ENXIO) =>
                {
                    continue
                }
                Err(source) => {
                    return Err(KernelError::Run {
                        program: names::PROG_FLUSH,
                        cpu,
                        source,
                    })
                }
            };
            match retval as i32 {
                flush::SENT => round.sent += 1,
                flush::BUSY => round.busy += 1,
                _ => {}
            }
        }
        Ok(round)
    }
}

impl super::Kernel {
    /// The transition event ring and the flusher of the per-CPU batches (one consumer at a
    /// time: the daemon).
    pub fn take_events(&mut self) -> Result<(RingBuf<MapData>, Flusher), KernelError> {
        let map = self
            .ebpf
            .take_map(names::EVENTS)
            .ok_or(KernelError::MissingMap(names::EVENTS))?;
        let ring = RingBuf::try_from(map).map_err(KernelError::map(names::EVENTS))?;
        tracing::debug!(fd = ring.as_raw_fd(), "transition ring opened");
        Ok((ring, Flusher::from_pin(&self.pin_dir.join("flush"))?))
    }
}

/// The transitions in one ring record; a record of unexpected size is an error naming it.
pub fn decode(record: &[u8]) -> Result<&[TransitionEvent], DecodeError> {
    EventBatch::decode(record).ok_or(DecodeError { len: record.len() })
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("transition ring record of {len} bytes is neither one event ({} bytes) nor a batch ({} bytes)", std::mem::size_of::<TransitionEvent>(), std::mem::size_of::<EventBatch>())]
pub struct DecodeError {
    pub len: usize,
}

#[cfg(test)]
mod tests {
    use super::*;
    use connreap_ebpf::EVENT_BATCH;

    fn bytes<T>(v: &T) -> Vec<u64> {
        // u64 storage keeps the bytes 8-byte aligned like the ring's records.
        let n = std::mem::size_of::<T>();
        let mut out = vec![0u64; n.div_ceil(8)];
        // SAFETY: copying the bytes of a Pod value into a buffer at least as large.
        unsafe {
            std::ptr::copy_nonoverlapping(
                v as *const T as *const u8,
                out.as_mut_ptr() as *mut u8,
                n,
            )
        };
        out
    }

    fn as_bytes(words: &[u64], len: usize) -> &[u8] {
        // SAFETY: viewing initialised u64s as bytes.
        unsafe { std::slice::from_raw_parts(words.as_ptr() as *const u8, len) }
    }

    #[test]
    fn decodes_single_events_and_partial_batches() {
        let ev = |i: u16| TransitionEvent {
            sport: i,
            ..Default::default()
        };
        let one = bytes(&ev(7));
        let got = decode(as_bytes(&one, std::mem::size_of::<TransitionEvent>())).unwrap();
        assert_eq!(got, &[ev(7)]);

        let mut batch = EventBatch {
            count: 3,
            busy: 0,
            wake_mark: 0,
            transitions: 0,
            scratch: 0,
            events: [ev(99); EVENT_BATCH],
        };
        for i in 0..3 {
            batch.events[i] = ev(i as u16);
        }
        let b = bytes(&batch);
        let got = decode(as_bytes(&b, std::mem::size_of::<EventBatch>())).unwrap();
        assert_eq!(
            got,
            &[ev(0), ev(1), ev(2)],
            "stale slots past count are not events"
        );

        batch.count = EVENT_BATCH as u32 + 1;
        let b = bytes(&batch);
        assert_eq!(
            decode(as_bytes(&b, std::mem::size_of::<EventBatch>())).unwrap_err(),
            DecodeError {
                len: std::mem::size_of::<EventBatch>()
            },
            "a count past the batch is rejected, not trusted"
        );
        let err = decode(as_bytes(&b, 24)).unwrap_err();
        assert!(err.to_string().contains("24 bytes"), "{err}");
    }
}
