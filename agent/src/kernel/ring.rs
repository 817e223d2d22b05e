//! The transition ring reader: drains the tracker's event ring, flushes the per-CPU batches on a
//! fixed tick, and reports active opens counted per (pid, comm, remote port).
use std::time::Duration;

use aya::maps::{MapData, RingBuf};
use connreap_ebpf::tcp_state;
use rustc_hash::FxHashMap;
use tokio::io::unix::AsyncFd;

use super::events::{self, FlushRound, Flusher};

/// An active open's key: the connecting task's pid and comm, and the remote port.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct OpenKey {
    pub pid: u32,
    pub comm: String,
    pub port: u16,
}

/// What one drain of the ring read.
#[derive(Debug, Default)]
pub struct Drained {
    /// Transition events read.
    pub events: u64,
    /// The flush that ran before this drain (on the tick), if any.
    pub flushed: Option<FlushRound>,
    /// Active opens (CLOSE -> SYN_SENT, seen in the connecting task) per key.
    pub opens: Vec<(OpenKey, u64)>,
}

/// How often partial per-CPU batches are sent. Under load the probe wakes the reader per
/// 1 MiB of events and full batches need no flush, while a flush is a BPF_PROG_TEST_RUN per CPU,
/// each an IPI to a CPU doing the work: so a wakeup only drains, and no transition waits longer
/// than one tick.
const FLUSH_TICK: Duration = Duration::from_millis(500);

/// Read the ring until it fails, calling `sink` after every drain. Errors are logged: the ring
/// only feeds the reconnect-storm detector, the rest of the daemon goes on without it.
pub async fn read(ring: RingBuf<MapData>, flusher: Flusher, mut sink: impl FnMut(Drained)) {
    // SAFETY: the ring's fd is owned by `ring`, which the AsyncFd owns for its whole life.
    let mut fd = match unsafe { AsyncFd::register(ring) } {
        Ok(fd) => fd,
        Err(e) => {
            let (_, e) = e.into_parts();
            tracing::error!(error = %e, "cannot poll the transition ring; reconnect_storm is disabled");
            return;
        }
    };
    let mut flush_failing = false;
    let mut flush_tick = tokio::time::interval(FLUSH_TICK);
    flush_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let flush = tokio::select! {
            r = fd.readable_mut() => match r {
                Ok(mut guard) => {
                    guard.clear_ready();
                    false
                }
                Err(e) => {
                    tracing::error!(error = %e, "transition ring poll failed; reconnect_storm is disabled");
                    return;
                }
            },
            _ = flush_tick.tick() => true,
        };
        let flushed = if flush {
            match flusher.flush() {
                Ok(round) => {
                    flush_failing = false;
                    Some(round)
                }
                Err(e) => {
                    if !flush_failing {
                        tracing::warn!(error = %format!("{:#}", anyhow::Error::new(e)), "cannot flush the per-CPU event batches; events arrive in full batches only");
                    }
                    flush_failing = true;
                    None
                }
            }
        } else {
            None
        };
        let mut drained = drain(fd.get_mut());
        drained.flushed = flushed;
        sink(drained);
    }
}

/// Everything in the ring now. Opens are counted per raw (pid, comm bytes, port) first and
/// turned into keys once per distinct triple: a churning client makes many opens a second.
fn drain(ring: &mut RingBuf<MapData>) -> Drained {
    let mut events = 0u64;
    let mut opens: FxHashMap<(u32, [u8; 16], u16), u64> = FxHashMap::default();
    while let Some(item) = ring.next() {
        let batch = match events::decode(&item) {
            Ok(batch) => batch,
            Err(e) => {
                tracing::warn!(error = %e, "skipping a transition ring record");
                continue;
            }
        };
        events += batch.len() as u64;
        for ev in batch {
            if ev.oldstate == tcp_state::CLOSE && ev.newstate == tcp_state::SYN_SENT {
                *opens.entry((ev.pid, ev.comm, ev.dport)).or_default() += 1;
            }
        }
    }
    let opens = opens
        .into_iter()
        .map(|((pid, comm, port), count)| {
            let end = comm.iter().position(|b| *b == 0).unwrap_or(comm.len());
            let comm = String::from_utf8_lossy(&comm[..end]).into_owned();
            (OpenKey { pid, comm, port }, count)
        })
        .collect();
    Drained {
        events,
        flushed: None,
        opens,
    }
}
