//! Types shared between the BPF programs (`src/main.rs`, built for `bpfel-unknown-none`) and the
//! userspace agent (built with the `user` feature, which adds `aya::Pod` impls).
//!
//! Every type here is `#[repr(C)]` plain data with explicit padding, so both sides agree on the
//! layout byte for byte.
//!
//! Time base: every age connreap reports — time in state and idle times — is measured on the
//! kernel's `jiffies_64` clock, the clock of TCP's own timestamps. The tracker stamps transitions
//! with `bpf_jiffies64()` (a load, where `bpf_ktime_get_ns` is a clock read on the hot path),
//! the iterator reports ages as "jiffies ago", and userspace converts them with the kernel's
//! `CONFIG_HZ` (resolution 1/HZ: 4 ms at HZ=250). The first-seen lower bounds of sockets whose
//! transition the tracker never saw are kept on userspace's `CLOCK_MONOTONIC`, read once per
//! scan rather than once per record (a clock read per socket on every scan).
#![no_std]

/// Linux TCP states (`include/net/tcp_states.h`).
pub mod tcp_state {
    pub const ESTABLISHED: u8 = 1;
    pub const SYN_SENT: u8 = 2;
    pub const SYN_RECV: u8 = 3;
    pub const FIN_WAIT1: u8 = 4;
    pub const FIN_WAIT2: u8 = 5;
    pub const TIME_WAIT: u8 = 6;
    pub const CLOSE: u8 = 7;
    pub const CLOSE_WAIT: u8 = 8;
    pub const LAST_ACK: u8 = 9;
    pub const LISTEN: u8 = 10;
    pub const CLOSING: u8 = 11;
    pub const NEW_SYN_RECV: u8 = 12;
}

pub const AF_INET: u16 = 2;
pub const AF_INET6: u16 = 10;
/// `enum sock_type`'s SOCK_STREAM (struct socket's `type`).
pub const SOCK_STREAM: u16 = 1;
pub const IPPROTO_TCP: u16 = 6;

/// Names of the maps, programs and globals in the object, used by the loader.
pub mod names {
    pub const STATE_MAP: &str = "CONNREAP_STATE";
    pub const EVENTS: &str = "CONNREAP_EVENTS";
    pub const COUNTERS: &str = "CONNREAP_COUNTERS";
    pub const OFFSETS: &str = "CONNREAP_OFFSETS";
    pub const SET_BITS: &str = "CONNREAP_SET_BITS";
    pub const PROG_STATE: &str = "connreap_set_state";
    pub const PROG_ITER_TCP: &str = "connreap_iter_tcp";
    pub const PROG_ITER_FILES: &str = "connreap_iter_task_file";
    pub const PROG_ITER_NETNS_SOCKS: &str = "connreap_iter_netns_socks";
    pub const DESTROY_MAP: &str = "CONNREAP_DESTROY";
    pub const PROG_ITER_DESTROY: &str = "connreap_iter_destroy";
    pub const STAGING: &str = "CONNREAP_STAGING";
    pub const SWEEP_MAP: &str = "CONNREAP_SWEEP";
    pub const PROG_SWEEP: &str = "connreap_sweep";
    pub const PROG_SWEEP_LOOP: &str = "connreap_sweep_loop";
    pub const PROG_SWEEP_DIRECT: &str = "connreap_sweep_direct";
    /// BTF id of the running kernel's `struct tcp_sock`, for the direct sweep's cast.
    pub const TCP_SOCK_ID: &str = "CONNREAP_TCP_SOCK_ID";
    pub const PROG_FLUSH: &str = "connreap_flush_events";
    /// aya-log's ring of the programs' log records (the name aya-log-ebpf gives it).
    pub const LOGS: &str = "AYA_LOGS";
    /// Bench-only `sk-storage`: the per-socket storage map and its iterator.
    pub const SK_MAP: &str = "CONNREAP_SK";
    pub const PROG_ITER_SK: &str = "connreap_iter_sk";
}

/// Whether this is the bench-only `sk-storage` build (per-socket storage and one
/// `iter/bpf_sk_storage_map` pass: agent-ebpf's sk_storage.rs). Always false when shipped.
pub const SK_STORAGE: bool = cfg!(tracker_variant = "sk-storage");

/// The fallback destroy path (`connreap_iter_destroy`): an `iter/tcp` program calling the
/// `bpf_sock_destroy` kfunc for the sockets userspace put into `CONNREAP_DESTROY`.
///
/// rustc cannot emit BTF for an `extern` kfunc, so the call is a hand-encoded instruction
/// (`BPF_JMP|BPF_CALL`, `src_reg = BPF_PSEUDO_KFUNC_CALL`) whose `imm` is this placeholder; the
/// loader replaces it with the running kernel's BTF id of `bpf_sock_destroy` before loading.
pub mod kfunc {
    /// Placeholder `imm` of the hand-encoded kfunc call.
    pub const PLACEHOLDER: u32 = 0x7ead_50c7;
    /// The instruction as it appears in the object: opcode, regs (src = 2), off = 0, imm.
    pub const INSN: u64 = ((PLACEHOLDER as u64) << 32) | 0x2085;
    /// Placeholder `imm` of the hand-encoded `bpf_rdonly_cast` call (the direct sweep).
    pub const CAST_PLACEHOLDER: u32 = 0x7ead_ca57;
    /// That call as it appears in the object.
    pub const CAST_INSN: u64 = ((CAST_PLACEHOLDER as u64) << 32) | 0x2085;
    /// Capacity of `CONNREAP_DESTROY`: the most sockets one destroy pass can target.
    pub const MAX_TARGETS: u32 = 1024;
    /// `DestroyRequest::result` when the socket at that inode is not at the expected address.
    pub const MISMATCH: i32 = -1000;
}

/// Value of `CONNREAP_DESTROY`, keyed by socket inode. Userspace fills `skaddr` (0 = any) and
/// zeroes `done`; the iterator sets `done = 1` and `result` (0, `-errno` or
/// [`kfunc::MISMATCH`]) when it meets the socket.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DestroyRequest {
    pub skaddr: u64,
    pub result: i32,
    pub done: u32,
}

/// Indexes into the per-CPU `CONNREAP_COUNTERS` array (the rare events; the count of
/// transitions is [`EventBatch::transitions`], on the cache line the tracker writes anyway).
pub mod counter {
    /// Transition events lost because the ring buffer was full (no reader, or reader too slow).
    pub const RING_DROPS: u32 = 0;
    /// Sockets not tracked because their set of the state table was full.
    pub const MAP_FULL: u32 = 1;
    pub const COUNT: u32 = 2;
}

/// Capacity of the per-socket state table at its default size: [`STATE_SETS`] sets of
/// [`STATE_WAYS`] ways.
pub const STATE_MAP_ENTRIES: u32 = STATE_SETS * STATE_WAYS as u32;
/// log2 of the number of sets of the per-socket state table, by default. The loader sets the
/// table's size (`agent.max_tracked_sockets`) and writes its log2 into the programs'
/// `CONNREAP_SET_BITS`, within [`MIN_SET_BITS`]..=[`MAX_SET_BITS`].
pub const STATE_SET_BITS: u32 = 14;
pub const STATE_SETS: u32 = 1 << STATE_SET_BITS;
/// The smallest table: 1024 sets, 16384 sockets.
pub const MIN_SET_BITS: u32 = 10;
/// The largest table: 262144 sets, 4194304 sockets (235 MB of kernel memory).
pub const MAX_SET_BITS: u32 = 18;
/// Ways per set: 16 keys on two cache lines. A socket whose set is full is not tracked
/// (`counter::MAP_FULL`); at 100k sockets (≈ 6 per set on average) a uniform hash leaves few
/// or none untracked (measure 3 of `cargo xtask bench` reports how many had an exact age).
pub const STATE_WAYS: usize = 16;
/// Ring buffer size for transition events (must be a power of two multiple of the page size).
/// The daemon maps the ring twice (records that wrap stay contiguous), and the kernel maps
/// every page up front, so each MiB here is 2 MiB of the daemon's VmRSS. BENCHMARKS.md has the
/// drops measured under churn at this size.
pub const EVENTS_RING_BYTES: u32 = 1 << 21;

/// Byte offsets of the kernel struct members the programs read, resolved by the loader from the
/// running kernel's BTF (`/sys/kernel/btf/vmlinux`) and written into `.rodata` before load, so the
/// same object is correct on any kernel. `valid` is set to [`KernelOffsets::MAGIC`] by the loader;
/// the programs do nothing while it is not.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KernelOffsets {
    pub valid: u32,
    // struct sock_common (at offset 0 of struct sock)
    pub skc_daddr: u32,
    pub skc_rcv_saddr: u32,
    pub skc_dport: u32,
    pub skc_num: u32,
    pub skc_family: u32,
    pub skc_state: u32,
    pub skc_v6_daddr: u32,
    pub skc_v6_rcv_saddr: u32,
    pub skc_cookie: u32,
    // struct sock
    pub sk_protocol: u32,
    pub sk_socket: u32,
    pub sk_ack_backlog: u32,
    pub sk_max_ack_backlog: u32,
    /// `sk_flags` (`sock_common.skc_flags`: an unsigned long of `enum sock_flags` bits)
    pub sk_flags: u32,
    /// The bit of `SOCK_KEEPOPEN` in `sk_flags` (SO_KEEPALIVE set on the socket)
    pub sock_keepopen_bit: u32,
    // struct socket / socket_alloc / inode
    pub socket_sk: u32,
    /// offsetof(socket_alloc, vfs_inode) - offsetof(socket_alloc, socket)
    pub socket_to_inode: u32,
    pub inode_ino: u32,
    // struct tcp_sock (inet_connection_sock at offset 0)
    pub tcp_rcv_nxt: u32,
    pub tcp_copied_seq: u32,
    pub tcp_write_seq: u32,
    pub tcp_snd_una: u32,
    pub tcp_lsndtime: u32,
    pub tcp_rcv_tstamp: u32,
    /// offsetof(inet_connection_sock, icsk_ack) + offsetof(icsk_ack, lrcvtime)
    pub icsk_lrcvtime: u32,
    // struct task_struct
    pub task_tgid: u32,
    pub task_comm: u32,
    /// struct inet_timewait_sock: the real state (FIN_WAIT2 or TIME_WAIT) of a timewait socket
    pub tw_substate: u32,
    /// and when it became one (0: the kernel has no `tw_entry_stamp`)
    pub tw_entry_stamp: u32,
    // struct socket and its struct proto_ops: which sockets a file holds, without touching the
    // struct sock (a cache miss per socket in the owner dump)
    pub socket_type: u32,
    pub socket_ops: u32,
    pub ops_family: u32,
    // A socket's network namespace against the reader's (the `iter/task_file` socket dump of
    // the other namespaces): `sock_common.skc_net.net`, `net.ns.inum`, `task_struct.nsproxy`,
    // `nsproxy.net_ns`, and the owner's uid (`sock.sk_uid`), which iter/tcp gets in its context.
    pub skc_net: u32,
    pub net_ns_inum: u32,
    pub task_nsproxy: u32,
    pub nsproxy_net_ns: u32,
    pub sk_uid: u32,
    /// A listener's request sockets (SYN_RECV): `inet_connection_sock.icsk_accept_queue.qlen`,
    /// read by the sweep.
    pub icsk_qlen: u32,
}

impl KernelOffsets {
    pub const MAGIC: u32 = 0x636f_6e6e;
    pub const fn zeroed() -> Self {
        KernelOffsets {
            valid: 0,
            skc_daddr: 0,
            skc_rcv_saddr: 0,
            skc_dport: 0,
            skc_num: 0,
            skc_family: 0,
            skc_state: 0,
            skc_v6_daddr: 0,
            skc_v6_rcv_saddr: 0,
            skc_cookie: 0,
            sk_protocol: 0,
            sk_socket: 0,
            sk_ack_backlog: 0,
            sk_max_ack_backlog: 0,
            sk_flags: 0,
            sock_keepopen_bit: 0,
            socket_sk: 0,
            socket_to_inode: 0,
            inode_ino: 0,
            tcp_rcv_nxt: 0,
            tcp_copied_seq: 0,
            tcp_write_seq: 0,
            tcp_snd_una: 0,
            tcp_lsndtime: 0,
            tcp_rcv_tstamp: 0,
            icsk_lrcvtime: 0,
            task_tgid: 0,
            task_comm: 0,
            tw_substate: 0,
            tw_entry_stamp: 0,
            socket_type: 0,
            socket_ops: 0,
            ops_family: 0,
            skc_net: 0,
            net_ns_inum: 0,
            task_nsproxy: 0,
            nsproxy_net_ns: 0,
            sk_uid: 0,
            icsk_qlen: 0,
        }
    }
}

/// A socket's record in the per-socket state table (its key, the kernel socket address
/// `skaddr`, is in [`StateSet::keys`]).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StateEntry {
    /// `jiffies_64` when the socket entered `state`.
    pub since_jiffies: u64,
    pub saddr: [u8; 16],
    pub daddr: [u8; 16],
    pub family: u16,
    pub sport: u16,
    pub dport: u16,
    pub state: u8,
    pub _pad: u8,
    /// `net.ns.inum` of the socket's namespace (0: not read), so that the sweep can pass over
    /// the sockets of a namespace it skips without reading them.
    pub netns: u32,
    /// The inode of the socket's file (`SOCK_INODE(sk->sk_socket)->i_ino`; sockfs numbers are
    /// 32-bit), written by iter/tcp the first time it reads it (0: not read yet; a transition
    /// rewrites the record without it). It lies in another cache line than anything else read
    /// per socket, so an idle socket's walk reads it once, not on every scan.
    pub inode: u32,
}

/// One set of the per-socket state table (`CONNREAP_STATE`, an array of [`STATE_SETS`] sets):
/// the socket addresses of its ways (0 = free) together on two cache lines, then their records
/// (see agent-ebpf's `state.rs`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StateSet {
    pub keys: [u64; STATE_WAYS],
    pub entries: [StateEntry; STATE_WAYS],
}

/// One TCP state transition, sent over the `CONNREAP_EVENTS` ring buffer.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TransitionEvent {
    /// `jiffies_64` at the transition.
    pub ts_jiffies: u64,
    pub skaddr: u64,
    pub saddr: [u8; 16],
    pub daddr: [u8; 16],
    pub family: u16,
    pub sport: u16,
    pub dport: u16,
    pub oldstate: u8,
    pub newstate: u8,
    /// Task on the CPU, for transitions out of CLOSE only (connect, listen: the process that
    /// owns the socket); 0 with an empty `comm` for the others, which mostly run in softirq
    /// context where the current task is unrelated.
    pub pid: u32,
    /// The inode of the socket's network namespace (`net.ns.inum`, what `/proc/<pid>/ns/net`
    /// names), for every transition; 0 when it could not be read.
    pub netns: u32,
    pub comm: [u8; 16],
}

/// Return values of the flush program (`connreap_flush_events`) for one CPU.
pub mod flush {
    /// Nothing was staged on that CPU.
    pub const EMPTY: i32 = 0;
    /// A partial batch was sent to the ring.
    pub const SENT: i32 = 2;
    /// The batch was in use at that instant (its events go out with it or on the next round).
    pub const BUSY: i32 = 1;
}

/// Transitions sent over the ring per record. The tracker stages events in a per-CPU
/// [`EventBatch`] and outputs the whole batch when it is full: one ring reservation (lock,
/// producer position, wakeup check) per batch instead of per transition, and no cache line
/// shared between CPUs on the hot path. Partial batches are sent by `connreap_flush_events`,
/// which the daemon runs on every CPU on a periodic tick, so no transition waits longer than
/// one tick. 64 rather than 32 (the `batch32` variant of `cargo xtask bench --probe-parts`,
/// the bench-only `cfg(tracker_variant = "batch32")`) for a few KB more staging per CPU; the
/// measured difference is in BENCHMARKS.md.
pub const EVENT_BATCH: usize = if cfg!(tracker_variant = "batch32") {
    32
} else {
    64
};

/// A ring record of up to [`EVENT_BATCH`] transitions (`events[..count]`), and the per-CPU
/// staging area it is built in (`CONNREAP_STAGING`). A ring record of exactly
/// `size_of::<TransitionEvent>()` bytes is a single event, sent directly when the staging area
/// was in use by the code this run interrupted.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct EventBatch {
    pub count: u32,
    /// Non-zero while a program on this CPU is changing the batch.
    pub busy: u32,
    /// Ring producer position / 1 MiB when this CPU last asked for a wakeup (staging only).
    pub wake_mark: u64,
    /// TCP state transitions this CPU has seen (staging only; userspace sums the CPUs). Kept
    /// here, next to `busy` and `count`, rather than in `CONNREAP_COUNTERS`: one cache line for
    /// the tracker to touch per run instead of two.
    pub transitions: u64,
    /// The tracker's scratch word (staging only): the verifier allows no arithmetic on a kernel
    /// pointer, but a pointer stored to map memory reads back as a plain number.
    pub scratch: u64,
    pub events: [TransitionEvent; EVENT_BATCH],
}

impl EventBatch {
    /// The transitions in a ring record, whichever of the two record kinds it is; `None` for
    /// a record of another size (a corrupt or foreign ring).
    pub fn decode(record: &[u8]) -> Option<&[TransitionEvent]> {
        if record
            .as_ptr()
            .align_offset(core::mem::align_of::<EventBatch>())
            != 0
        {
            return None;
        }
        if record.len() == core::mem::size_of::<TransitionEvent>() {
            // SAFETY: a Pod record of exactly this size, aligned (checked above).
            let ev = unsafe { &*(record.as_ptr() as *const TransitionEvent) };
            return Some(core::slice::from_ref(ev));
        }
        if record.len() != core::mem::size_of::<EventBatch>() {
            return None;
        }
        // SAFETY: as above.
        let batch = unsafe { &*(record.as_ptr() as *const EventBatch) };
        batch.events.get(..batch.count as usize)
    }
}

/// Flags of [`SockRecord::flags`].
pub mod sock_flags {
    /// The socket is a full TCP socket: queues and idle times are valid.
    pub const FULL: u8 = 1;
    /// `state_age_jiffies` is known (the transition into the current state was seen).
    pub const SINCE_KNOWN: u8 = 2;
    /// A timewait socket's `tw_entry_ms` is valid.
    pub const TW_ENTRY: u8 = 4;
    /// TCP keepalive is on for the socket (`SO_KEEPALIVE`: `SOCK_KEEPOPEN` in `sk_flags`).
    pub const KEEPALIVE: u8 = 8;
    /// A full socket the state table has no record of (its set is full): the sweep cannot
    /// see it, so only a walk of its namespace (iter/tcp) reads it.
    pub const UNTRACKED: u8 = 16;
}

/// One socket from the `iter/tcp` dump.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SockRecord {
    pub skaddr: u64,
    pub inode: u64,
    pub cookie: u64,
    /// Jiffies since the socket entered its current state, if `SINCE_KNOWN`.
    pub state_age_jiffies: u64,
    pub saddr: [u8; 16],
    pub daddr: [u8; 16],
    pub family: u16,
    /// Local port, host byte order.
    pub sport: u16,
    /// Remote port, host byte order.
    pub dport: u16,
    pub state: u8,
    pub flags: u8,
    pub uid: u32,
    pub rx_queue: u32,
    pub tx_queue: u32,
    /// Jiffies since the last data segment was received (`icsk_ack.lrcvtime`).
    pub last_rcv_jiffies: u32,
    /// Jiffies since the last data segment was sent (`lsndtime`).
    pub last_snd_jiffies: u32,
    /// Jiffies since the last ACK was received (`rcv_tstamp`).
    pub last_ack_jiffies: u32,
    /// Timewait sockets (with `TW_ENTRY`): when the socket became one, CLOCK_MONOTONIC ms,
    /// low 32 bits (the kernel's `tw_entry_stamp`, Linux 6.13+).
    pub tw_entry_ms: u32,
    pub _pad: u32,
}

/// Sets of the state table one run of the sweep reads with `bpf_loop` (`connreap_sweep_loop`,
/// Linux 5.17+): its output array holds one record per way of these (4096 records, 448 KiB).
/// Each run is one `BPF_PROG_TEST_RUN` call, about 1.3 µs of fixed cost on this machine.
pub const MAX_SWEEP_SETS: u32 = 256;

/// Sets one run of the unrolled sweep reads (`connreap_sweep`, for kernels without
/// `bpf_loop`): the verifier walks every way of every set of a run, and 6.1's gave E2BIG
/// above 4 (6.18's refuses 64, at its limit of a million instructions, after 20 s).
pub const UNROLLED_SWEEP_SETS: u32 = 4;

/// One socket from the sweep over the state table: its record as iter/tcp would give it, and
/// the inode of its network namespace.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SweepRecord {
    pub sock: SockRecord,
    /// `net.ns.inum` of the socket's namespace; 0 when it could not be read.
    pub netns: u32,
    /// A listener's request sockets (connections in SYN_RECV, which are not full sockets and
    /// so never in the table); 0 for other sockets.
    pub requests: u32,
}

/// One (socket, process) pair from the `iter/task_file` dumps.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct OwnerRecord {
    pub skaddr: u64,
    pub tgid: u32,
    pub fd: u32,
    pub comm: [u8; 16],
    /// In the dump of `connreap_iter_netns_socks`: the inode of the socket's network namespace
    /// (`net.ns.inum`, what `/proc/<pid>/ns/net` names) when it is a TCP socket of another
    /// namespace than the reader's, and then the socket's record follows this one (the pair is
    /// a [`HeldElsewhere`]); else 0, as always in `connreap_iter_task_file`'s dump.
    pub netns: u32,
    pub _pad: u32,
}

/// A TCP socket a process holds in a network namespace other than the reader's, from the
/// `iter/task_file` dump of `connreap_iter_netns_socks`: its owner (with `owner.netns` set) and
/// the socket's record as iter/tcp would give it. One per file holding it (a socket shared by
/// several descriptors comes once per descriptor).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HeldElsewhere {
    pub owner: OwnerRecord,
    pub sock: SockRecord,
}

#[cfg(feature = "user")]
mod pod {
    /// `aya::Pod` for shared types.
    macro_rules! pod {
        ($($t:ident),*) => {$(
            // SAFETY: a #[repr(C)] struct of integers and byte arrays with explicit padding
            // fields (the size assertions below rule out implicit padding), so every bit
            // pattern is a valid value.
            unsafe impl aya::Pod for super::$t {}
        )*};
    }
    pod!(
        KernelOffsets,
        StateEntry,
        StateSet,
        TransitionEvent,
        SockRecord,
        OwnerRecord,
        HeldElsewhere,
        SweepRecord,
        DestroyRequest,
        EventBatch
    );
}

// Layouts are part of the kernel/user contract: catch accidental implicit padding.
const _: () = assert!(core::mem::size_of::<StateEntry>() == 56);
const _: () = assert!(core::mem::size_of::<TransitionEvent>() == 80);
const _: () = assert!(core::mem::size_of::<SockRecord>() == 104);
const _: () = assert!(core::mem::size_of::<EventBatch>() == 32 + 80 * EVENT_BATCH);
const _: () = assert!(EVENT_BATCH.is_power_of_two());
const _: () = assert!(STATE_WAYS.is_power_of_two());
const _: () = assert!(core::mem::size_of::<StateSet>() == (8 + 56) * STATE_WAYS);
const _: () = assert!(core::mem::size_of::<OwnerRecord>() == 40);
const _: () = assert!(core::mem::size_of::<HeldElsewhere>() == 40 + 104);
const _: () = assert!(core::mem::size_of::<DestroyRequest>() == 16);
const _: () = assert!(core::mem::size_of::<SweepRecord>() == 104 + 8);
const _: () = assert!(core::mem::size_of::<KernelOffsets>() == 39 * 4);
