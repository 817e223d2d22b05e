//! The programs: a BTF tracepoint keeping per-socket state and ages, an `iter/tcp` dump of the
//! socket table, and an `iter/task_file` dump of socket owners. Each is a thin entry that calls a
//! `try_*` function; kernel memory is read with `bpf_probe_read_kernel` at offsets the loader
//! resolved from the running kernel's BTF (`CONNREAP_OFFSETS`), never at build-time offsets.
use core::ffi::c_void;

use aya_ebpf::{
    bindings::{
        BPF_F_NO_PREALLOC, BPF_RB_AVAIL_DATA, BPF_RB_FORCE_WAKEUP, BPF_RB_NO_WAKEUP,
        BPF_RB_PROD_POS,
    },
    helpers::{
        bpf_get_current_pid_tgid, bpf_jiffies64, bpf_ktime_get_ns, bpf_probe_read_kernel,
        generated::{self as gen, bpf_seq_write, bpf_sock_from_file},
    },
    macros::{btf_tracepoint, map, raw_tracepoint},
    maps::{HashMap, PerCpuArray, RingBuf},
    programs::{BtfTracePointContext, RawTracePointContext},
};
use connreap_ebpf::{
    counter, sock_flags, tcp_state, EventBatch, KernelOffsets, OwnerRecord, SockRecord, StateEntry,
    TransitionEvent, AF_INET, AF_INET6, EVENTS_RING_BYTES, EVENT_BATCH, IPPROTO_TCP,
    STATE_MAP_ENTRIES,
};

#[no_mangle]
#[link_section = "license"]
pub static LICENSE: [u8; 4] = *b"GPL\0";

/// Set by the loader from the running kernel's BTF.
#[no_mangle]
pub(crate) static CONNREAP_OFFSETS: KernelOffsets = KernelOffsets::zeroed();

/// Per-socket state and the jiffy it was entered, keyed by the kernel socket address.
///
/// Allocated on demand, so its kernel memory follows the number of tracked sockets (≈ 4 MB of
/// buckets + ≈ 128 B per socket, exported as `connreap_bpf_map_memory_bytes`). A preallocated
/// map would cost a fixed ≈ 31 MB; measured side by side under churn it was not reliably faster
/// on this machine (BENCHMARKS.md).
#[map(name = "CONNREAP_STATE")]
static CONNREAP_STATE: HashMap<u64, StateEntry> =
    HashMap::pinned(STATE_MAP_ENTRIES, BPF_F_NO_PREALLOC);

#[map(name = "CONNREAP_EVENTS")]
static CONNREAP_EVENTS: RingBuf = RingBuf::pinned(EVENTS_RING_BYTES, 0);

/// Per-CPU staging batch of transition events (see [`EventBatch`]).
#[map(name = "CONNREAP_STAGING")]
static CONNREAP_STAGING: PerCpuArray<EventBatch> = PerCpuArray::pinned(1, 0);

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
fn bump(index: u32) {
    bump_by(index, 1)
}

#[inline(always)]
fn bump_by(index: u32, n: u64) {
    if let Some(slot) = CONNREAP_COUNTERS.get_ptr_mut(index) {
        // SAFETY: per-CPU slot, no concurrent writer on this CPU.
        unsafe { *slot += n };
    }
}

#[inline(always)]
pub(crate) fn read<T: Default>(addr: u64) -> T {
    // SAFETY: bpf_probe_read_kernel tolerates any address and fails cleanly.
    unsafe { bpf_probe_read_kernel(addr as *const T) }.unwrap_or_default()
}

// ---------------------------------------------------------------------------------------------
// BTF tracepoint inet_sock_set_state(const struct sock *sk, int oldstate, int newstate).
// ---------------------------------------------------------------------------------------------
#[btf_tracepoint(function = "inet_sock_set_state")]
pub fn connreap_set_state(ctx: BtfTracePointContext) -> i32 {
    let _ = try_set_state(&ctx);
    0
}

/// A field of the socket the tracepoint passes, loaded directly: `sk` is a trusted BTF pointer
/// and `off` a value of the frozen `.rodata` (a constant to the verifier), so the verifier checks
/// the load against the running kernel's own `struct sock`; no helper call.
#[inline(always)]
fn sk_field<T: Copy>(sk: *const u8, off: u64) -> T {
    // SAFETY: see above; the verifier rejects the program if the offset is not a field of T's
    // size inside struct sock.
    unsafe { core::ptr::read_volatile(sk.add(off as usize) as *const T) }
}

/// Wake the ring reader once per this much ring traffic (the daemon also drains on a timer, so
/// most batches cost no wakeup).
const WAKEUP_BYTES: u64 = 256 * 1024;

/// Bench-only build variants of the tracker, to measure what each part of it costs
/// (`cargo xtask bench --probe-parts` builds one object per variant). Normal builds never set
/// `CONNREAP_PROBE_VARIANT`: these are compile-time constants and the checks compile away.
const VARIANT: &str = match option_env!("CONNREAP_PROBE_VARIANT") {
    Some(v) => v,
    None => "full",
};
const fn variant_is(name: &str) -> bool {
    let (a, b) = (VARIANT.as_bytes(), name.as_bytes());
    if a.len() != b.len() {
        return false;
    }
    let mut i = 0;
    while i < a.len() {
        if a[i] != b[i] {
            return false;
        }
        i += 1;
    }
    true
}
/// Count the transition and stop: the floor (entry, stats, ctx loads).
const COUNT_ONLY: bool = variant_is("count-only");
/// Everything but the per-socket state map.
const NO_MAP: bool = variant_is("no-map");
/// Everything but the event ring.
const NO_RING: bool = variant_is("no-ring");
/// One ring record per transition (the design before per-CPU batches).
const UNBATCHED: bool = variant_is("unbatched");
/// Stamps transitions with bpf_ktime_get_ns instead of jiffies (ages are wrong: cost only).
const KTIME: bool = variant_is("ktime");

fn try_set_state(ctx: &BtfTracePointContext) -> Result<(), i32> {
    let sk: *const u8 = ctx.arg(0);
    let protocol: u16 = sk_field(sk, off!(sk_protocol));
    if protocol != IPPROTO_TCP {
        return Ok(());
    }
    bump(counter::TRANSITIONS);
    if COUNT_ONLY {
        return Ok(());
    }
    let oldstate = ctx.arg::<i32>(1) as u8;
    let newstate = ctx.arg::<i32>(2) as u8;
    let family: u16 = sk_field(sk, off!(skc_family));
    // Addresses as two 8-byte words each (an IPv4 address in the low 4 bytes): plain register
    // stores, where byte arrays built with copy_from_slice compile to memset/memcpy calls.
    let (saddr, daddr) = if family == AF_INET6 {
        (
            addr16(sk, off!(skc_v6_rcv_saddr)),
            addr16(sk, off!(skc_v6_daddr)),
        )
    } else {
        let s: u32 = sk_field(sk, off!(skc_rcv_saddr));
        let d: u32 = sk_field(sk, off!(skc_daddr));
        ([s as u64, 0], [d as u64, 0])
    };
    let t = Transition {
        // Jiffies, not bpf_ktime_get_ns: a plain load instead of a clock read, and the unit of
        // the kernel's own TCP timestamps that the iterator reports idle times in.
        now: if KTIME {
            unsafe { bpf_ktime_get_ns() }
        } else {
            unsafe { bpf_jiffies64() }
        },
        skaddr: sk as u64,
        saddr,
        daddr,
        family,
        sport: sk_field(sk, off!(skc_num)),
        dport: u16::from_be(sk_field(sk, off!(skc_dport))),
        oldstate,
        newstate,
    };

    if NO_MAP {
    } else if newstate == tcp_state::CLOSE {
        let _ = CONNREAP_STATE.remove(&t.skaddr);
    } else {
        let entry = StateEntry {
            since_jiffies: t.now,
            saddr: bytes16(t.saddr),
            daddr: bytes16(t.daddr),
            family: t.family,
            sport: t.sport,
            dport: t.dport,
            state: newstate,
            _pad: 0,
        };
        if oldstate == tcp_state::CLOSE || oldstate == tcp_state::LISTEN {
            // A new socket (connect, listen, or a child cloned from a listener): insert without
            // looking up first (BPF_ANY also replaces a stale record at a reused address).
            if CONNREAP_STATE.insert(&t.skaddr, &entry, 0).is_err() {
                bump(counter::MAP_FULL);
            }
        } else if let Some(existing) = CONNREAP_STATE.get_ptr_mut(&t.skaddr) {
            // Update in place: no allocation for sockets already tracked.
            // SAFETY: a valid map value pointer; a concurrent reader may see a torn update,
            // which the iterator tolerates (it only uses since_jiffies when the state matches).
            unsafe { *existing = entry };
        } else if CONNREAP_STATE.insert(&t.skaddr, &entry, 0).is_err() {
            bump(counter::MAP_FULL);
        }
    }

    if NO_RING {
        return Ok(());
    }
    if UNBATCHED {
        send_one(&t);
    } else {
        stage(&t);
    }
    Ok(())
}

/// What the tracker read about one transition.
struct Transition {
    now: u64,
    skaddr: u64,
    saddr: [u64; 2],
    daddr: [u64; 2],
    family: u16,
    sport: u16,
    dport: u16,
    oldstate: u8,
    newstate: u8,
}

#[inline(always)]
fn addr16(sk: *const u8, off: u64) -> [u64; 2] {
    [sk_field(sk, off), sk_field(sk, off + 8)]
}

#[inline(always)]
fn bytes16(words: [u64; 2]) -> [u8; 16] {
    // SAFETY: same size, every bit pattern valid; native order keeps the address bytes in place.
    unsafe { core::mem::transmute::<[u64; 2], [u8; 16]>(words) }
}

/// Store 16 bytes as two 8-byte stores (a plain array assignment may become a memmove call).
///
/// # Safety
/// `dst` must be 8-byte aligned, as every 16-byte field of the event and state types is.
#[inline(always)]
unsafe fn put16(dst: *mut [u8; 16], words: [u64; 2]) {
    let p = dst as *mut u64;
    // SAFETY: per the contract.
    unsafe {
        p.write(words[0]);
        p.add(1).write(words[1]);
    }
}

/// A compiler barrier: memory accesses are not moved across it (no instruction is emitted).
#[inline(always)]
fn barrier() {
    // SAFETY: an empty asm block; without `nomem` the compiler assumes it reads and writes
    // memory, so it keeps stores on either side in order.
    unsafe { core::arch::asm!("", options(nostack, preserves_flags)) };
}

/// Fill the event for `t` in place (the ring slot or the staging slot).
///
/// # Safety
/// `ev` must point to writable memory for one TransitionEvent.
#[inline(always)]
unsafe fn fill(ev: *mut TransitionEvent, t: &Transition) {
    // SAFETY: per the contract.
    unsafe {
        (*ev).ts_jiffies = t.now;
        (*ev).skaddr = t.skaddr;
        put16(&mut (*ev).saddr, t.saddr);
        put16(&mut (*ev).daddr, t.daddr);
        (*ev).family = t.family;
        (*ev).sport = t.sport;
        (*ev).dport = t.dport;
        (*ev).oldstate = t.oldstate;
        (*ev).newstate = t.newstate;
        (*ev)._pad = 0;
        // The task on the CPU is the socket's user only for transitions out of CLOSE (connect,
        // listen): the others mostly run in softirq context, so they skip the helper calls.
        if t.oldstate == tcp_state::CLOSE {
            (*ev).pid = (bpf_get_current_pid_tgid() >> 32) as u32;
            let comm = &mut (*ev).comm;
            if gen::bpf_get_current_comm(comm.as_mut_ptr() as *mut c_void, 16) != 0 {
                put16(comm, [0, 0]);
            }
        } else {
            (*ev).pid = 0;
            put16(&mut (*ev).comm, [0, 0]);
        }
    }
}

/// Ask for a wakeup only when a lot is pending: the daemon also drains on a timer.
#[inline(always)]
fn ring_flags() -> u64 {
    if CONNREAP_EVENTS.query(BPF_RB_AVAIL_DATA as u64) >= WAKEUP_BYTES {
        BPF_RB_FORCE_WAKEUP as u64
    } else {
        BPF_RB_NO_WAKEUP as u64
    }
}

/// The wakeup decision for a full batch: wake the reader each time the ring's producer position
/// crosses another WAKEUP_BYTES since this CPU last did. Reading the producer position (just
/// written by this CPU's previous output) costs no cache miss, where the pending-data query
/// reads the consumer position the reader's CPU writes.
///
/// # Safety
/// `batch` is this CPU's staging batch, held busy by the caller.
#[inline(always)]
unsafe fn batch_ring_flags(batch: *mut EventBatch) -> u64 {
    let mark = CONNREAP_EVENTS.query(BPF_RB_PROD_POS as u64) / WAKEUP_BYTES;
    // SAFETY: per the contract.
    unsafe {
        if mark != (*batch).wake_mark {
            (*batch).wake_mark = mark;
            BPF_RB_FORCE_WAKEUP as u64
        } else {
            BPF_RB_NO_WAKEUP as u64
        }
    }
}

/// One event as its own ring record (the rare path: kept out of line).
#[inline(never)]
fn send_one(t: &Transition) {
    match CONNREAP_EVENTS.reserve::<TransitionEvent>(0) {
        Some(mut slot) => {
            // SAFETY: a reserved slot of exactly one event.
            unsafe { fill(slot.as_mut_ptr(), t) };
            slot.submit(ring_flags());
        }
        None => bump(counter::RING_DROPS),
    }
}

/// Write the event into this CPU's staging batch and send the batch when it is full.
///
/// Only code on this CPU touches the batch, but a run can be interrupted by another (a softirq
/// transition during a process-context one is skipped by the kernel's recursion guard, but the
/// flush program may run from an IPI): whoever finds `busy` set leaves the batch alone and
/// sends its event directly. Barriers keep the stores in program order.
#[inline(always)]
fn stage(t: &Transition) {
    let Some(batch) = CONNREAP_STAGING.get_ptr_mut(0) else {
        send_one(t);
        return;
    };
    // SAFETY: a valid per-CPU map value; see above for why compiler barriers suffice.
    unsafe {
        if core::ptr::read_volatile(&(*batch).busy) != 0 {
            send_one(t);
            return;
        }
        core::ptr::write_volatile(&mut (*batch).busy, 1);
        barrier();
        let n = core::ptr::read_volatile(&(*batch).count) as usize & (EVENT_BATCH - 1);
        fill(&mut (*batch).events[n], t);
        barrier();
        let mut count = n as u32 + 1;
        core::ptr::write_volatile(&mut (*batch).count, count);
        if count as usize == EVENT_BATCH {
            if CONNREAP_EVENTS
                .output::<EventBatch>(&*batch, batch_ring_flags(batch))
                .is_err()
            {
                bump_by(counter::RING_DROPS, EVENT_BATCH as u64);
            }
            count = 0;
            core::ptr::write_volatile(&mut (*batch).count, count);
        }
        barrier();
        core::ptr::write_volatile(&mut (*batch).busy, 0);
    }
}

/// Send this CPU's partial batch. Never attached: the daemon runs it on each CPU with
/// `BPF_PROG_TEST_RUN` + `BPF_F_TEST_RUN_ON_CPU` before draining the ring. Returns 0 when the
/// batch was sent (or empty), 1 when it was in use (try again later).
#[raw_tracepoint(tracepoint = "connreap_flush")]
pub fn connreap_flush_events(_ctx: RawTracePointContext) -> i32 {
    try_flush()
}

fn try_flush() -> i32 {
    let Some(batch) = CONNREAP_STAGING.get_ptr_mut(0) else {
        return 0;
    };
    // SAFETY: as in `stage`.
    unsafe {
        if core::ptr::read_volatile(&(*batch).busy) != 0 {
            return 1;
        }
        core::ptr::write_volatile(&mut (*batch).busy, 1);
        let count = core::ptr::read_volatile(&(*batch).count);
        if count != 0 {
            if CONNREAP_EVENTS
                .output::<EventBatch>(&*batch, BPF_RB_FORCE_WAKEUP as u64)
                .is_err()
            {
                bump_by(counter::RING_DROPS, count as u64);
            }
            core::ptr::write_volatile(&mut (*batch).count, 0);
        }
        core::ptr::write_volatile(&mut (*batch).busy, 0);
    }
    0
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
struct FullSock {
    flags: u8,
    inode: u64,
    queues: (u32, u32),
    /// Jiffies since the last data received, sent, and ACK received.
    idle: [u32; 3],
    state_age_jiffies: u64,
}

/// Fields of a full TCP socket: direct loads through the helper's tcp_sock view.
#[inline(always)]
fn full_sock(sk: u64, tp: *const u8, state: u8) -> FullSock {
    let socket: u64 = sk_field(tp, off!(sk_socket));
    // struct socket's inode lies outside struct socket: a checked read.
    let inode = if socket != 0 {
        read::<u64>(socket + off!(socket_to_inode) + off!(inode_ino))
    } else {
        0
    };
    let queues = if state == tcp_state::LISTEN {
        (
            sk_field(tp, off!(sk_ack_backlog)),
            sk_field(tp, off!(sk_max_ack_backlog)),
        )
    } else {
        let rcv_nxt: u32 = sk_field(tp, off!(tcp_rcv_nxt));
        let copied: u32 = sk_field(tp, off!(tcp_copied_seq));
        let write_seq: u32 = sk_field(tp, off!(tcp_write_seq));
        let snd_una: u32 = sk_field(tp, off!(tcp_snd_una));
        (
            rcv_nxt.wrapping_sub(copied),
            write_seq.wrapping_sub(snd_una),
        )
    };
    let now_j = unsafe { bpf_jiffies64() };
    let now32 = now_j as u32;
    let idle = [
        now32.wrapping_sub(sk_field(tp, off!(icsk_lrcvtime))),
        now32.wrapping_sub(sk_field(tp, off!(tcp_lsndtime))),
        now32.wrapping_sub(sk_field(tp, off!(tcp_rcv_tstamp))),
    ];
    let mut out = FullSock {
        flags: sock_flags::FULL,
        inode,
        queues,
        idle,
        state_age_jiffies: 0,
    };
    if let Some(entry) = unsafe { CONNREAP_STATE.get(&sk) } {
        if entry.state == state {
            out.state_age_jiffies = now_j.wrapping_sub(entry.since_jiffies);
            out.flags |= sock_flags::SINCE_KNOWN;
        }
    }
    out
}

fn try_iter_tcp(ctx: *mut c_void) -> Result<(), i64> {
    if off!(valid) != KernelOffsets::MAGIC as u64 {
        return Err(-1);
    }
    // SAFETY: the iterator context layout is fixed by the kernel's bpf_iter__tcp.
    let (meta, sk, uid) = unsafe {
        let words = ctx as *const u64;
        (*words, *words.add(1), *(words.add(2) as *const u32))
    };
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
    let state = if mini == tcp_state::TIME_WAIT {
        // Orphaned FIN_WAIT2 sockets live on as timewait sockets too; report the real state.
        read(sk + off!(tw_substate))
    } else {
        mini
    };
    let (saddr, daddr) = if family == AF_INET {
        let s: u32 = sk_field(skc, off!(skc_rcv_saddr));
        let d: u32 = sk_field(skc, off!(skc_daddr));
        ([s as u64, 0], [d as u64, 0])
    } else if family == AF_INET6 {
        (
            addr16(skc, off!(skc_v6_rcv_saddr)),
            addr16(skc, off!(skc_v6_daddr)),
        )
    } else {
        return Ok(());
    };
    // TIME_WAIT and NEW_SYN_RECV entries are mini sockets: only sock_common is valid.
    // SAFETY: sk is the iterator's socket; the helper returns NULL unless it is a full TCP
    // socket, and a trusted tcp_sock pointer (struct sock at offset 0) otherwise.
    let tp = if mini != tcp_state::TIME_WAIT && mini != tcp_state::NEW_SYN_RECV {
        unsafe { gen::bpf_skc_to_tcp_sock(sk as *mut c_void) as *const u8 }
    } else {
        core::ptr::null()
    };
    let full = if tp.is_null() {
        FullSock::default()
    } else {
        full_sock(sk, tp, state)
    };
    let rec = SockRecord {
        skaddr: sk,
        inode: full.inode,
        cookie: sk_field(skc, off!(skc_cookie)),
        state_age_jiffies: full.state_age_jiffies,
        now_ns: unsafe { bpf_ktime_get_ns() },
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
    };

    // SAFETY: seq is the iterator's seq_file; the record is a plain stack value.
    let ret = unsafe {
        bpf_seq_write(
            seq as *mut _,
            &rec as *const SockRecord as *const c_void,
            core::mem::size_of::<SockRecord>() as u32,
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
    if off!(valid) != KernelOffsets::MAGIC as u64 {
        return Err(-1);
    }
    // SAFETY: the iterator context layout is fixed by the kernel's bpf_iter__task_file.
    let (meta, task, fd, file) = unsafe {
        let words = ctx as *const u64;
        (
            *words,
            *words.add(1),
            *(words.add(2) as *const u32),
            *(words.add(3) as *const *mut aya_ebpf::bindings::file),
        )
    };
    if meta == 0 || task == 0 || file.is_null() {
        return Ok(());
    }
    // SAFETY: `file` is the trusted pointer from the iterator context.
    let socket = unsafe { bpf_sock_from_file(file) } as *const u8;
    if socket.is_null() {
        return Ok(());
    }
    // Direct BTF-checked loads, as in the tracker: socket->sk, then the sock's fields, then
    // the task's (ctx->task is a trusted task_struct pointer).
    let sk: u64 = sk_field(socket, off!(socket_sk));
    if sk == 0 {
        return Ok(());
    }
    let skp = sk as *const u8;
    let protocol: u16 = sk_field(skp, off!(sk_protocol));
    let family: u16 = sk_field(skp, off!(skc_family));
    if protocol != IPPROTO_TCP || (family != AF_INET && family != AF_INET6) {
        return Ok(());
    }
    let seq = unsafe { *(meta as *const u64) };
    let t = task as *const u8;
    let rec = OwnerRecord {
        skaddr: sk,
        tgid: sk_field(t, off!(task_tgid)),
        fd,
        comm: bytes16(addr16(t, off!(task_comm))),
    };
    let ret = unsafe {
        bpf_seq_write(
            seq as *mut _,
            &rec as *const OwnerRecord as *const c_void,
            core::mem::size_of::<OwnerRecord>() as u32,
        )
    };
    if ret < 0 {
        return Err(ret);
    }
    Ok(())
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}
