//! The transition ring reader: drains the tracker's event ring, flushes the per-CPU batches on a
//! fixed tick, and reports active opens counted per (process, connecting thread, remote port,
//! network namespace), with the process's container, and the outcomes of outbound connections
//! per (process, network namespace, remote address) (see `outcome`).
use std::{
    collections::HashSet,
    sync::Arc,
    time::{Duration, Instant},
};

use aya::maps::{MapData, RingBuf};
use connreap_ebpf::tcp_state;
use rustc_hash::FxHashMap;

use super::{
    bpf_log::BpfLog,
    events::{self, FlushRound, Flusher},
    outcome::{Attempts, Outcomes, RawTarget, Tally},
    procfs,
};
use crate::containers::{self, Container, ContainerNames, PodNames};

/// An active open's key: the connecting process (pid, and its name as the owner dump and
/// `snapshot` show it), the connecting thread's name, the remote port and the socket's network
/// namespace; and where the process runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OpenKey {
    pub pid: u32,
    /// The process's name: its thread-group leader's comm, from /proc; the thread's own name
    /// when the process was gone before the drain.
    pub comm: String,
    /// The connecting thread's name (what the kernel had on the CPU at the connect: a worker
    /// thread's, e.g. `tokio-rt-worker`, in a multi-threaded client).
    pub thread: String,
    pub port: u16,
    /// The inode of the connecting socket's network namespace, from the event (0: unknown).
    pub netns: u32,
    /// The process's container, from its /proc/PID/cgroup read at the drain (None: not in
    /// one, or gone before the drain).
    pub container: Option<Arc<Container>>,
}

/// The target of outbound connection attempts: the connecting process (named as in
/// [`OpenKey`]), the socket's network namespace and the remote address; and where the process
/// runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AttemptKey {
    pub pid: u32,
    pub comm: String,
    pub netns: u32,
    pub remote: std::net::SocketAddr,
    pub container: Option<Arc<Container>>,
}

/// How long what was read from /proc about a pid is reused (a pid is not reused that fast: the
/// kernel hands pids out in increasing order up to pid_max).
const NAME_TTL: Duration = Duration::from_secs(10);

/// What the drain knows of a process: its name and container.
#[derive(Debug, Clone, Default, PartialEq)]
struct Process {
    /// None when it has gone.
    name: Option<String>,
    container: Option<Arc<Container>>,
}

/// Processes by pid, read from /proc/PID/comm and /proc/PID/cgroup at most once per
/// [`NAME_TTL`]: the tracker records the connecting thread's comm, and a storm from a thread
/// pool would otherwise be charged to a thread name; the container is read as a scan reads a
/// socket owner's (cgroup path, pod names from the host's files).
struct Processes {
    procs: FxHashMap<u32, (Process, Instant)>,
    pods: PodNames,
    names: ContainerNames,
}

impl Default for Processes {
    fn default() -> Self {
        Processes {
            procs: FxHashMap::default(),
            pods: PodNames::new("/"),
            names: ContainerNames::new("/"),
        }
    }
}

impl Processes {
    /// Process `pid` as of `now` within NAME_TTL.
    fn get(&mut self, pid: u32, now: Instant) -> Process {
        let (pods, names) = (&mut self.pods, &mut self.names);
        let (p, at) = self
            .procs
            .entry(pid)
            .or_insert_with(|| (read_process(pid, pods, names), now));
        if now.duration_since(*at) >= NAME_TTL {
            *p = read_process(pid, pods, names);
            *at = now;
        }
        p.clone()
    }

    /// Forget processes read longer than NAME_TTL ago, and pods none of the others runs in
    /// (once per drain).
    fn sweep(&mut self, now: Instant) {
        self.procs
            .retain(|_, (_, at)| now.duration_since(*at) < NAME_TTL);
        let live: HashSet<String> = self
            .procs
            .values()
            .filter_map(|(p, _)| p.container.as_ref()?.pod_uid.clone())
            .collect();
        self.pods.retain(&live);
        let live: HashSet<String> = self
            .procs
            .values()
            .filter_map(|(p, _)| Some(p.container.as_ref()?.id.clone()))
            .collect();
        self.names.retain(&live);
    }
}

fn read_process(pid: u32, pods: &mut PodNames, names: &mut ContainerNames) -> Process {
    let container = procfs::cgroup(pid)
        .and_then(|c| containers::from_cgroup(&c))
        .map(|mut c| {
            pods.fill(&mut c);
            names.fill(&mut c);
            Arc::new(c)
        });
    Process {
        name: procfs::process_comm(pid),
        container,
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
    /// Outbound connection attempts whose outcome became known, per target.
    pub attempts: Vec<(AttemptKey, Attempts)>,
}

/// How often partial per-CPU batches are sent. Under load the probe wakes the reader per
/// 1 MiB of events and full batches need no flush, while a flush is a BPF_PROG_TEST_RUN per CPU,
/// each an IPI to a CPU doing the work: so a wakeup only drains, and no transition waits longer
/// than one tick.
const FLUSH_TICK: Duration = Duration::from_millis(500);

/// Read the ring until it fails, calling `sink` after every drain. Errors are logged: the ring
/// only feeds the reconnect-storm and failing-upstream detectors (and the upstream connection
/// metrics); the rest of the daemon goes on without it. Blocking (poll(2) on the ring, the
/// flush's BPF_PROG_TEST_RUN on every CPU, /proc reads): run it on a thread of its own, never
/// on the async runtime.
///
/// `log`, the BPF programs' log ring, is read on the same thread: its records are rare.
pub fn read(
    mut ring: RingBuf<MapData>,
    flusher: Flusher,
    mut outcomes: Outcomes,
    mut log: Option<BpfLog>,
    mut sink: impl FnMut(Drained),
) {
    use std::os::fd::AsRawFd as _;
    let mut flush_failing = false;
    let mut names = Processes::default();
    let mut next_flush = Instant::now() + FLUSH_TICK;
    loop {
        let wait = next_flush.saturating_duration_since(Instant::now());
        let pfd = |fd| libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        // With no log ring, the second entry's negative fd is ignored by poll(2).
        let mut pfds = [
            pfd(ring.as_raw_fd()),
            pfd(log.as_ref().map_or(-1, BpfLog::raw_fd)),
        ];
        // SAFETY: two valid pollfds for fds owned by `ring` and `log` for the whole call.
        let r = unsafe {
            libc::poll(
                pfds.as_mut_ptr(),
                pfds.len() as libc::nfds_t,
                wait.as_millis().min(i32::MAX as u128) as i32,
            )
        };
        if r < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            tracing::error!(error = %e, "transition ring poll failed; reconnect_storm and failing_upstream are disabled");
            return;
        }
        let flushed = if Instant::now() >= next_flush {
            // A late flush delays the next one (no burst to catch up).
            next_flush = Instant::now() + FLUSH_TICK;
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
        if pfds[1].revents != 0 {
            if let Some(log) = log.as_mut() {
                log.drain();
            }
        }
        let mut drained = drain(&mut ring, &mut names, &mut outcomes);
        drained.flushed = flushed;
        sink(drained);
    }
}

/// Everything in the ring now. Opens are counted per raw (pid, comm bytes, port, netns) first
/// and turned into keys once per distinct tuple: a churning client makes many opens a second.
/// Outcomes follow each socket through its transitions in time order (the batches of several
/// CPUs arrive in any order; within one batch, in order).
fn drain(ring: &mut RingBuf<MapData>, names: &mut Processes, outcomes: &mut Outcomes) -> Drained {
    let mut events = 0u64;
    let mut opens: FxHashMap<RawOpen, u64> = FxHashMap::default();
    let mut transitions = Vec::new();
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
                *opens
                    .entry((ev.pid, ev.comm, ev.dport, ev.netns))
                    .or_default() += 1;
            }
            if is_outbound_step(ev.oldstate) {
                transitions.push(*ev);
            }
        }
    }
    let now = Instant::now();
    transitions.sort_by_key(|ev| ev.ts_jiffies);
    let mut tally = Tally::default();
    for ev in &transitions {
        outcomes.observe(ev, now, &mut tally);
    }
    outcomes.settle(now, &mut tally);
    names.sweep(now);
    let opens = opens
        .into_iter()
        .map(|(raw, count)| (open_key(raw, names.get(raw.0, now)), count))
        .collect();
    let attempts = tally
        .into_iter()
        .map(|(raw, a)| (attempt_key(raw, names.get(raw.0, now)), a))
        .collect();
    Drained {
        events,
        flushed: None,
        opens,
        attempts,
    }
}

/// Whether a transition out of `old` can tell an outbound connection's outcome (its open,
/// handshake, or end).
fn is_outbound_step(old: u8) -> bool {
    matches!(
        old,
        tcp_state::CLOSE | tcp_state::SYN_SENT | tcp_state::ESTABLISHED | tcp_state::CLOSE_WAIT
    )
}

/// The key of attempts `raw` of process `p` (named as [`open_key`] names it).
fn attempt_key((pid, comm, netns, remote): RawTarget, p: Process) -> AttemptKey {
    let end = comm.iter().position(|b| *b == 0).unwrap_or(comm.len());
    AttemptKey {
        pid,
        comm: p
            .name
            .unwrap_or_else(|| String::from_utf8_lossy(&comm[..end]).into_owned()),
        netns,
        remote,
        container: p.container,
    }
}

/// An active open as the events give it: (pid, thread comm bytes, remote port, netns inode).
type RawOpen = (u32, [u8; 16], u16, u32);

/// The key of the opens `raw` of process `p`: named by its process name, else (gone) by the
/// connecting thread's.
fn open_key((pid, comm, port, netns): RawOpen, p: Process) -> OpenKey {
    let end = comm.iter().position(|b| *b == 0).unwrap_or(comm.len());
    let thread = String::from_utf8_lossy(&comm[..end]).into_owned();
    OpenKey {
        pid,
        comm: p.name.unwrap_or_else(|| thread.clone()),
        thread,
        port,
        netns,
        container: p.container,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_processes_by_pid_and_caches_them() {
        let mut names = Processes::default();
        let me = std::process::id();
        let t0 = Instant::now();
        let now = names.get(me, t0);
        let name = now.name.clone().expect("own process name");
        assert_eq!(Some(name.clone()), procfs::process_comm(me));
        // The container as a scan reads it, from the same cgroup file.
        let expected = procfs::cgroup(me).and_then(|c| containers::from_cgroup(&c));
        assert_eq!(
            now.container.as_deref().map(|c| &c.id),
            expected.as_ref().map(|c| &c.id)
        );
        // Within the TTL the cached process is used, even if /proc says otherwise now.
        let cached = Process {
            name: Some("cached".into()),
            container: None,
        };
        names.procs.insert(me, (cached.clone(), t0));
        assert_eq!(names.get(me, t0 + NAME_TTL / 2), cached);
        assert_eq!(names.get(me, t0 + NAME_TTL).name, Some(name));
        assert_eq!(
            names.get(u32::MAX, t0),
            Process::default(),
            "a process that has gone"
        );
        names.sweep(t0 + NAME_TTL * 3);
        assert!(names.procs.is_empty());
    }

    #[test]
    fn open_keys_carry_the_namespace_and_the_container() {
        let mut comm = [0u8; 16];
        comm[..6].copy_from_slice(b"worker");
        let cgroup = format!("0::/system.slice/docker-{}.scope\n", "ab".repeat(32));
        let c = Arc::new(containers::from_cgroup(&cgroup).expect("a docker cgroup"));
        let p = Process {
            name: Some("client".into()),
            container: Some(c.clone()),
        };
        let k = open_key((5, comm, 443, 4026532001), p);
        assert_eq!(
            (k.pid, k.comm.as_str(), k.thread.as_str(), k.port, k.netns),
            (5, "client", "worker", 443, 4026532001)
        );
        assert_eq!(k.container, Some(c));
        // Gone before the drain: the thread's name stands in, no container.
        let k = open_key((5, comm, 443, 0), Process::default());
        assert_eq!((k.comm.as_str(), k.container), ("worker", None));
    }
}
