//! The maps and shared helpers, and the two dump programs: an `iter/tcp` dump of the socket
//! table and an `iter/task_file` dump of socket owners (the state tracker is in `tracker.rs`,
//! the owner dump that also reads other namespaces' sockets in `netns_socks.rs`).
//! Each program is a thin entry that calls a `try_*` function. Kernel memory is read at offsets
//! the loader resolved from the running kernel's BTF (`CONNREAP_OFFSETS`), never at build-time
//! offsets: by direct loads through trusted BTF pointers where the verifier can check them, by
//! `bpf_probe_read_kernel` elsewhere.
use core::ffi::c_void;

use aya_ebpf::{
    helpers::{
        bpf_jiffies64,
        generated::{self as gen, bpf_seq_write, bpf_sock_from_file},
    },
    macros::map,
    maps::{PerCpuArray, RingBuf},
};
use aya_log_ebpf::{error, warn};
use connreap_ebpf::{
    counter, sock_flags, tcp_state, EventBatch, KernelOffsets, OwnerRecord, SockRecord, StateEntry,
    AF_INET, AF_INET6, EVENTS_RING_BYTES, SOCK_STREAM,
};

#[no_mangle]
#[link_section = "license"]
pub static LICENSE: [u8; 4] = *b"GPL\0";

/// Set by the loader from the running kernel's BTF.
#[no_mangle]
pub(crate) static CONNREAP_OFFSETS: KernelOffsets = KernelOffsets::zeroed();

#[map(name = "CONNREAP_EVENTS")]
pub(crate) static CONNREAP_EVENTS: RingBuf = RingBuf::pinned(EVENTS_RING_BYTES, 0);

/// Per-CPU staging batch of transition events (see [`EventBatch`]).
#[map(name = "CONNREAP_STAGING")]
pub(crate) static CONNREAP_STAGING: PerCpuArray<EventBatch> = PerCpuArray::pinned(1, 0);

#[map(name = "CONNREAP_COUNTERS")]
static CONNREAP_COUNTERS: PerCpuArray<u64> = PerCpuArray::pinned(counter::COUNT, 0);

#[macro_export]
macro_rules! off {
    ($field:ident) => {
        // SAFETY: a plain read of a field of a static; volatile so the loader's value is used.
        unsafe { core::ptr::read_volatile(&$crate::programs::CONNREAP_OFFSETS.$field) as u64 }
    };
}

#[inline(always)]
pub(crate) fn bump(index: u32) {
    bump_by(index, 1)
}

/// Count `n` lost items in counter `index` (every counter counts a loss) and, each time this
/// CPU's count passes a power of two, say so through aya-log: a first loss is logged at once,
/// a lasting one ever more rarely. Out of line and called only on the loss paths, so the
/// tracker's common path carries no logging code.
#[inline(never)]
pub(crate) fn bump_by(index: u32, n: u64) {
    let Some(slot) = CONNREAP_COUNTERS.get_ptr_mut(index) else {
        return;
    };
    // SAFETY: per-CPU slot, no concurrent writer on this CPU.
    let (before, after) = unsafe {
        let before = *slot;
        *slot = before + n;
        (before, before + n)
    };
    if before.leading_zeros() == after.leading_zeros() {
        return;
    }
    if index == counter::MAP_FULL {
        warn!(
            &(),
            "state table: a socket's set is full, so the socket is not tracked (its age is a lower bound); {} on this CPU so far",
            after
        );
    } else {
        warn!(
            &(),
            "event ring full: transition events dropped (the reader is behind); {} on this CPU so far",
            after
        );
    }
}

/// Whether the loader wrote the kernel offsets. When it did not, an iterator reads nothing:
/// said once per pass (on its first element), naming the program.
#[inline(always)]
pub(crate) fn offsets_set(program: &str, meta: u64) -> bool {
    if off!(valid) == KernelOffsets::MAGIC as u64 {
        return true;
    }
    let seq_num = if meta == 0 {
        0
    } else {
        // SAFETY: meta points at struct bpf_iter_meta { seq, session_id, seq_num }.
        unsafe { *(meta as *const u64).add(2) }
    };
    if seq_num == 0 {
        offsets_unset(program);
    }
    false
}

#[inline(never)]
fn offsets_unset(program: &str) {
    error!(
        &(),
        "{} reads nothing: the loader did not set the kernel offsets", program
    );
}

/// `T` (a plain integer, or an array of them) at kernel address `addr`, zero when it cannot be
/// read. Branch-free: the helper zeroes its destination when the read fails, so its result is
/// not looked at (a branch per read would give the verifier two states per read to explore,
/// and 6.1's gives up on the sweep).
///
/// The destination is not zeroed first: the helper writes all of it either way (the verifier
/// treats it as uninitialised memory the helper fills). Zeroing it cost a byte-by-byte
/// `memset` loop for arrays (the BPF target has no wider one): 128 stores per socket for the
/// sweep's span of `sock_common`.
#[inline(always)]
pub(crate) fn read<T: Copy + Default>(addr: u64) -> T {
    let mut v = core::mem::MaybeUninit::<T>::uninit();
    // SAFETY: bpf_probe_read_kernel tolerates any address and fails cleanly; it fills all of
    // `v` with the bytes read or with zeros, and every bit pattern is a valid T here.
    unsafe {
        gen::bpf_probe_read_kernel(
            v.as_mut_ptr() as *mut c_void,
            core::mem::size_of::<T>() as u32,
            addr as *const c_void,
        );
        v.assume_init()
    }
}

/// A field of the socket the tracepoint passes, loaded directly: `sk` is a trusted BTF pointer
/// and `off` a value of the frozen `.rodata` (a constant to the verifier), so the verifier checks
/// the load against the running kernel's own `struct sock`; no helper call.
#[inline(always)]
pub(crate) fn sk_field<T: Copy>(sk: *const u8, off: u64) -> T {
    // SAFETY: see above; the verifier rejects the program if the offset is not a field of T's
    // size inside struct sock.
    unsafe { core::ptr::read_volatile(sk.add(off as usize) as *const T) }
}

/// 16 address bytes as two 8-byte loads.
#[inline(always)]
pub(crate) fn addr16(sk: *const u8, off: u64) -> [u64; 2] {
    [sk_field(sk, off), sk_field(sk, off + 8)]
}

#[inline(always)]
pub(crate) fn bytes16(words: [u64; 2]) -> [u8; 16] {
    // SAFETY: same size, every bit pattern valid; native order keeps the address bytes in place.
    unsafe { core::mem::transmute::<[u64; 2], [u8; 16]>(words) }
}

// ---------------------------------------------------------------------------------------------
// iter/tcp: every TCP socket of the reader's network namespace.
// ctx is struct bpf_iter__tcp { meta; sk_common; uid_t uid; }, each member 8-byte aligned.
// ---------------------------------------------------------------------------------------------
#[no_mangle]
#[link_section = "iter/tcp"]
pub fn connreap_iter_tcp(ctx: *mut c_void) -> i32 {
    let _ = try_iter_tcp(ctx);
    0
}

/// What only a full socket has (zero for mini sockets).
#[derive(Default)]
pub(crate) struct FullSock {
    pub(crate) flags: u8,
    pub(crate) inode: u64,
    pub(crate) queues: (u32, u32),
    /// Jiffies since the last data received, sent, and ACK received.
    pub(crate) idle: [u32; 3],
    pub(crate) state_age_jiffies: u64,
}

/// Fields of a full TCP socket: direct loads of struct sock's, and `tcp` reading the u32
/// fields of tcp_sock and inet_connection_sock (a direct load through the helper's trusted
/// tcp_sock view in iter/tcp, a checked read where the pointer is typed only as struct sock).
///
/// `record` gives the socket's record in the state table, if any; with `locked` (the caller
/// holds the socket's lock, as iter/tcp does) the inode read is kept in it.
#[inline(always)]
pub(crate) fn full_sock(
    record: impl FnOnce() -> Option<*mut StateEntry>,
    locked: bool,
    tp: *const u8,
    state: u8,
    tcp: impl Fn(*const u8, u64) -> u32,
) -> FullSock {
    let record = record();
    let socket: u64 = sk_field(tp, off!(sk_socket));
    let inode = if socket != 0 {
        inode_of(socket, record, locked, tp)
    } else {
        0
    };
    let queues = if state == tcp_state::LISTEN {
        (
            sk_field(tp, off!(sk_ack_backlog)),
            sk_field(tp, off!(sk_max_ack_backlog)),
        )
    } else {
        let rcv_nxt: u32 = tcp(tp, off!(tcp_rcv_nxt));
        let copied: u32 = tcp(tp, off!(tcp_copied_seq));
        let write_seq: u32 = tcp(tp, off!(tcp_write_seq));
        let snd_una: u32 = tcp(tp, off!(tcp_snd_una));
        (
            rcv_nxt.wrapping_sub(copied),
            write_seq.wrapping_sub(snd_una),
        )
    };
    // SAFETY: a helper without arguments that only reads the kernel's jiffies counter.
    let now_j = unsafe { bpf_jiffies64() };
    let now32 = now_j as u32;
    let idle = [
        now32.wrapping_sub(tcp(tp, off!(icsk_lrcvtime))),
        now32.wrapping_sub(tcp(tp, off!(tcp_lsndtime))),
        now32.wrapping_sub(tcp(tp, off!(tcp_rcv_tstamp))),
    ];
    // SO_KEEPALIVE: one bit of sk_flags (the bit number is a verifier constant too).
    let sk_flags: u64 = sk_field(tp, off!(sk_flags));
    let keepalive = if (sk_flags >> (off!(sock_keepopen_bit) & 63)) & 1 != 0 {
        sock_flags::KEEPALIVE
    } else {
        0
    };
    let mut out = FullSock {
        flags: sock_flags::FULL | keepalive,
        inode,
        queues,
        idle,
        state_age_jiffies: 0,
    };
    if let Some(entry) = record {
        // SAFETY: the socket's record (in the state table, or its own storage); the socket's
        // lock, which the iterator holds, keeps its own transitions from changing it meanwhile.
        let entry = unsafe { &*entry };
        // A record the iterator seeded (since 0) has no known age.
        if entry.state == state && entry.since_jiffies != 0 {
            out.state_age_jiffies = now_j.wrapping_sub(entry.since_jiffies);
            out.flags |= sock_flags::SINCE_KNOWN;
        }
    }
    out
}

/// The inode of the file of the socket `tp` (whose struct socket is at `socket`): from its
/// record when iter/tcp kept it there (and the record's ports are the socket's: a record is
/// never trusted for another socket at a reused address), else a checked read (struct
/// socket's inode lies outside struct socket), kept in the record when `locked`.
#[inline(always)]
fn inode_of(socket: u64, record: Option<*mut StateEntry>, locked: bool, tp: *const u8) -> u64 {
    let read_it = || read::<u64>(socket + off!(socket_to_inode) + off!(inode_ino));
    let Some(entry) = record else {
        return read_it();
    };
    // SAFETY: the socket's record in the state table; writes to it are the socket's own,
    // under its lock, which a `locked` caller holds.
    let entry = unsafe { &mut *entry };
    let sport: u16 = sk_field(tp, off!(skc_num));
    let dport = u16::from_be(sk_field(tp, off!(skc_dport)));
    if entry.sport != sport || entry.dport != dport {
        return read_it();
    }
    if entry.inode != 0 {
        return u64::from(entry.inode);
    }
    let inode = read_it();
    if locked && inode <= u64::from(u32::MAX) {
        entry.inode = inode as u32;
    }
    inode
}

/// A timewait socket's real state (orphaned FIN_WAIT2 sockets live on as timewait sockets too)
/// and, where the kernel keeps it, when it became one: (state, tw_entry_ms, flags).
#[inline(always)]
fn timewait(sk: u64) -> (u8, u32, u8) {
    // SAFETY: sk is the iterator's socket; the helper returns NULL unless it is a TCP timewait
    // socket (or one of IPv6 built as a module), and a trusted pointer otherwise.
    let tw = unsafe { gen::bpf_skc_to_tcp_timewait_sock(sk as *mut c_void) as *const u8 };
    if tw.is_null() {
        return (read(sk + off!(tw_substate)), 0, 0);
    }
    // Direct loads on the socket's own line (the offsets are verifier constants: without
    // tw_entry_stamp in this kernel the branch is dropped at load).
    let state: u8 = sk_field(tw, off!(tw_substate));
    if off!(tw_entry_stamp) == 0 {
        return (state, 0, 0);
    }
    (
        state,
        sk_field(tw, off!(tw_entry_stamp)),
        sock_flags::TW_ENTRY,
    )
}

fn try_iter_tcp(ctx: *mut c_void) -> Result<(), i64> {
    // SAFETY: the iterator context layout is fixed by the kernel's bpf_iter__tcp.
    let (meta, sk, uid) = unsafe {
        let words = ctx as *const u64;
        (*words, *words.add(1), *(words.add(2) as *const u32))
    };
    if !offsets_set("connreap_iter_tcp", meta) {
        return Err(-1);
    }
    if sk == 0 || meta == 0 {
        return Ok(());
    }
    // SAFETY: meta points at struct bpf_iter_meta whose first member is the seq_file.
    let seq = unsafe { *(meta as *const u64) };

    // sock_common fields are direct loads (ctx->sk_common is a trusted BTF pointer), like the
    // tracker's; fields past sock_common go through the helpers' typed views below.
    let skc = sk as *const u8;
    let family: u16 = sk_field(skc, off!(skc_family));
    let mini: u8 = sk_field(skc, off!(skc_state));
    let (state, tw_entry_ms, tw_flags) = if mini == tcp_state::TIME_WAIT {
        timewait(sk)
    } else {
        (mini, 0, 0)
    };
    let Some(addrs) = addresses(skc, family) else {
        return Ok(());
    };
    // TIME_WAIT and NEW_SYN_RECV entries are mini sockets: only sock_common is valid.
    let tp = if mini != tcp_state::TIME_WAIT && mini != tcp_state::NEW_SYN_RECV {
        // SAFETY: sk is the iterator's socket; the helper returns NULL unless it is a full TCP
        // socket, and a trusted tcp_sock pointer (struct sock at offset 0) otherwise.
        unsafe { gen::bpf_skc_to_tcp_sock(sk as *mut c_void) as *const u8 }
    } else {
        core::ptr::null()
    };
    let full = if tp.is_null() {
        FullSock {
            flags: tw_flags,
            ..FullSock::default()
        }
    } else {
        // The socket's address as a number for the state table (see state.rs): the context's
        // pointer field read through a probe read is a plain value to the verifier.
        let sk_number = read::<u64>(ctx as u64 + 8);
        let mut full = full_sock(
            || crate::state::get(sk_number),
            true,
            tp,
            state,
            sk_field::<u32>,
        );
        if full.flags & sock_flags::SINCE_KNOWN == 0 {
            seed(sk_number, skc, family, state, addrs, &mut full);
        }
        full
    };
    let rec = sock_record(sk, skc, family, state, addrs, &full, uid, tw_entry_ms);
    // SAFETY: seq is the iterator's seq_file.
    unsafe { seq_write(seq, &rec) }
}

/// Give a full socket the tracker has no record of (it predates the tracker, or its set was
/// full) a record of its current state with no known age (`since_jiffies` 0), so that the
/// sweep (sweep.rs) reads it from now on; `UNTRACKED` when its set is still full. The
/// iterator holds the socket's lock, as the tracker's writes do. A record of the socket in
/// another state (a transition under way) is left alone.
#[inline(always)]
fn seed(
    sk: u64,
    skc: *const u8,
    family: u16,
    state: u8,
    (saddr, daddr): ([u64; 2], [u64; 2]),
    full: &mut FullSock,
) {
    if crate::state::get(sk).is_some() {
        return;
    }
    let entry = StateEntry {
        since_jiffies: 0,
        saddr: bytes16(saddr),
        daddr: bytes16(daddr),
        family,
        sport: sk_field(skc, off!(skc_num)),
        dport: u16::from_be(sk_field(skc, off!(skc_dport))),
        state,
        _pad: 0,
        netns: {
            let net: u64 = sk_field(skc, off!(skc_net));
            read(net + off!(net_ns_inum))
        },
        // What the caller just read (full sockets only reach here).
        inode: u32::try_from(full.inode).unwrap_or(0),
    };
    if !crate::state::put(sk, &entry) {
        full.flags |= sock_flags::UNTRACKED;
    }
}

/// A socket's local and remote addresses from its sock_common (`skc`), as 16 bytes each;
/// None for a family other than IPv4 and IPv6.
#[inline(always)]
pub(crate) fn addresses(skc: *const u8, family: u16) -> Option<([u64; 2], [u64; 2])> {
    if family == AF_INET {
        let s: u32 = sk_field(skc, off!(skc_rcv_saddr));
        let d: u32 = sk_field(skc, off!(skc_daddr));
        Some(([s as u64, 0], [d as u64, 0]))
    } else if family == AF_INET6 {
        Some((
            addr16(skc, off!(skc_v6_rcv_saddr)),
            addr16(skc, off!(skc_v6_daddr)),
        ))
    } else {
        None
    }
}

/// A socket's record: its sock_common fields (`skc`, direct loads) and what `full` read.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn sock_record(
    skaddr: u64,
    skc: *const u8,
    family: u16,
    state: u8,
    (saddr, daddr): ([u64; 2], [u64; 2]),
    full: &FullSock,
    uid: u32,
    tw_entry_ms: u32,
) -> SockRecord {
    SockRecord {
        skaddr,
        inode: full.inode,
        cookie: sk_field(skc, off!(skc_cookie)),
        state_age_jiffies: full.state_age_jiffies,
        saddr: bytes16(saddr),
        daddr: bytes16(daddr),
        family,
        sport: sk_field(skc, off!(skc_num)),
        dport: u16::from_be(sk_field(skc, off!(skc_dport))),
        state,
        flags: full.flags,
        uid,
        rx_queue: full.queues.0,
        tx_queue: full.queues.1,
        last_rcv_jiffies: full.idle[0],
        last_snd_jiffies: full.idle[1],
        last_ack_jiffies: full.idle[2],
        tw_entry_ms,
        _pad: 0,
    }
}

/// Write one record to an iterator's output.
///
/// # Safety
/// `seq` must be the iterator's seq_file (the first member of its context's meta).
#[inline(always)]
pub(crate) unsafe fn seq_write<T>(seq: u64, rec: &T) -> Result<(), i64> {
    // SAFETY: seq is the iterator's seq_file (the caller's promise); the record is a plain
    // value of size_of::<T>() bytes.
    let ret = unsafe {
        bpf_seq_write(
            seq as *mut _,
            rec as *const T as *const c_void,
            core::mem::size_of::<T>() as u32,
        )
    };
    if ret < 0 {
        return Err(ret);
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// iter/task_file: (socket, process) pairs, to attribute sockets to owners.
// ctx is struct bpf_iter__task_file { meta; task; u32 fd; file; }, each member 8-byte aligned.
// ---------------------------------------------------------------------------------------------
#[no_mangle]
#[link_section = "iter/task_file"]
pub fn connreap_iter_task_file(ctx: *mut c_void) -> i32 {
    let _ = try_iter_task_file(ctx);
    0
}

fn try_iter_task_file(ctx: *mut c_void) -> Result<(), i64> {
    let (meta, task, fd, file) = task_file_ctx(ctx);
    if !offsets_set("connreap_iter_task_file", meta) {
        return Err(-1);
    }
    if meta == 0 || task == 0 || file.is_null() {
        return Ok(());
    }
    // SAFETY: `file` is the trusted pointer from the iterator context.
    let socket = unsafe { bpf_sock_from_file(file) } as *const u8;
    if socket.is_null() {
        return Ok(());
    }
    let Some(sk) = inet_stream_sk(socket) else {
        return Ok(());
    };
    // SAFETY: meta points at struct bpf_iter_meta whose first member is the seq_file.
    let seq = unsafe { *(meta as *const u64) };
    // SAFETY: seq is the iterator's seq_file.
    unsafe { seq_write(seq, &owner_record(sk, task, fd)) }
}

/// The owner record of socket `sk` held by `task` at `fd` (`netns` 0: no socket record follows).
#[inline(always)]
pub(crate) fn owner_record(sk: u64, task: u64, fd: u32) -> OwnerRecord {
    let t = task as *const u8;
    OwnerRecord {
        skaddr: sk,
        tgid: sk_field(t, off!(task_tgid)),
        fd,
        comm: bytes16(addr16(t, off!(task_comm))),
        netns: 0,
        _pad: 0,
    }
}

/// The members of an iter/task_file context, struct bpf_iter__task_file { meta; task; u32 fd;
/// file; }, each 8-byte aligned: (meta, task, fd, file).
#[inline(always)]
pub(crate) fn task_file_ctx(ctx: *mut c_void) -> (u64, u64, u32, *mut aya_ebpf::bindings::file) {
    // SAFETY: the iterator context layout is fixed by the kernel's bpf_iter__task_file.
    unsafe {
        let words = ctx as *const u64;
        (
            *words,
            *words.add(1),
            *(words.add(2) as *const u32),
            *(words.add(3) as *const *mut aya_ebpf::bindings::file),
        )
    }
}

/// The struct sock of a file's socket if it is a TCP candidate, else None.
///
/// Direct BTF-checked loads, as in the tracker: a TCP socket is a stream socket of the inet
/// families, read from struct socket (the line that holds socket->sk) and its proto_ops
/// (static, cached), not from the struct sock, which would cost a cache miss per socket.
/// MPTCP and SCTP stream sockets pass too; they match no row of the TCP dump.
#[inline(always)]
pub(crate) fn inet_stream_sk(socket: *const u8) -> Option<u64> {
    let kind: u16 = sk_field(socket, off!(socket_type));
    if kind != SOCK_STREAM {
        return None;
    }
    let ops: *const u8 = sk_field(socket, off!(socket_ops));
    if ops.is_null() {
        return None;
    }
    let family: i32 = sk_field(ops, off!(ops_family));
    if family != AF_INET as i32 && family != AF_INET6 as i32 {
        return None;
    }
    let sk: u64 = sk_field(socket, off!(socket_sk));
    (sk != 0).then_some(sk)
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}
