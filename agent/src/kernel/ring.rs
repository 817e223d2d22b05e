//! The transition ring reader: drains the tracker's event ring, flushes the per-CPU batches on a
//! fixed tick, and reports active opens counted per (process, connecting thread, remote port).
use std::time::{Duration, Instant};

use aya::maps::{MapData, RingBuf};
use connreap_ebpf::tcp_state;
use rustc_hash::FxHashMap;
use tokio::io::unix::AsyncFd;

use super::{
    events::{self, FlushRound, Flusher},
    procfs,
};

/// An active open's key: the connecting process (pid, and its name as the owner dump and
/// `snapshot` show it), the connecting thread's name, and the remote port.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct OpenKey {
    pub pid: u32,
    /// The process's name: its thread-group leader's comm, from /proc; the thread's own name
    /// when the process was gone before the drain.
    pub comm: String,
    /// The connecting thread's name (what the kernel had on the CPU at the connect: a worker
    /// thread's, e.g. `tokio-rt-worker`, in a multi-threaded client).
    pub thread: String,
    pub port: u16,
}

/// How long a process name read from /proc is reused for the same pid (a pid is not reused
/// that fast: the kernel hands pids out in increasing order up to pid_max).
const NAME_TTL: Duration = Duration::from_secs(10);

/// Process names by pid, read from /proc/PID/comm at most once per [`NAME_TTL`]: the tracker
/// records the connecting thread's comm, and a storm from a thread pool would otherwise be
/// charged to a thread name.
#[derive(Debug, Default)]
struct ProcessNames {
    names: FxHashMap<u32, (Option<String>, Instant)>,
}

impl ProcessNames {
    /// The name of process `pid` (None when it has gone), as of `now` within NAME_TTL.
    fn get(&mut self, pid: u32, now: Instant) -> Option<String> {
        let (name, at) = self
            .names
            .entry(pid)
            .or_insert_with(|| (procfs::process_comm(pid), now));
        if now.duration_since(*at) >= NAME_TTL {
            *name = procfs::process_comm(pid);
            *at = now;
        }
        name.clone()
    }

    /// Forget names older than NAME_TTL (once per drain).
    fn sweep(&mut self, now: Instant) {
        self.names
            .retain(|_, (_, at)| now.duration_since(*at) < NAME_TTL);
    }
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
    let mut names = ProcessNames::default();
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
        let mut drained = drain(fd.get_mut(), &mut names);
        drained.flushed = flushed;
        sink(drained);
    }
}

/// Everything in the ring now. Opens are counted per raw (pid, comm bytes, port) first and
/// turned into keys once per distinct triple: a churning client makes many opens a second.
fn drain(ring: &mut RingBuf<MapData>, names: &mut ProcessNames) -> Drained {
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
    let now = Instant::now();
    names.sweep(now);
    let opens = opens
        .into_iter()
        .map(|((pid, comm, port), count)| {
            let end = comm.iter().position(|b| *b == 0).unwrap_or(comm.len());
            let thread = String::from_utf8_lossy(&comm[..end]).into_owned();
            let comm = names.get(pid, now).unwrap_or_else(|| thread.clone());
            (
                OpenKey {
                    pid,
                    comm,
                    thread,
                    port,
                },
                count,
            )
        })
        .collect();
    Drained {
        events,
        flushed: None,
        opens,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_processes_by_pid_and_caches_them() {
        let mut names = ProcessNames::default();
        let me = std::process::id();
        let t0 = Instant::now();
        let name = names.get(me, t0).expect("own process name");
        assert_eq!(Some(name.clone()), procfs::process_comm(me));
        // Within the TTL the cached name is used, even if /proc says otherwise now.
        names.names.insert(me, (Some("cached".into()), t0));
        assert_eq!(names.get(me, t0 + NAME_TTL / 2).as_deref(), Some("cached"));
        assert_eq!(names.get(me, t0 + NAME_TTL), Some(name));
        assert_eq!(names.get(u32::MAX, t0), None, "a process that has gone");
    }
}
