//! `connreap_sweep`: one pass over the state table that reads every tracked socket of every
//! network namespace, fresh. The table's keys are socket addresses (state.rs); for each, the
//! program reads what `iter/tcp` reports (queues, idle times, keepalive, owner inode, uid,
//! cookie) and the socket's namespace, through checked reads (`bpf_probe_read_kernel`: a key is
//! a plain number to the verifier). Its cost is proportional to the tracked sockets alone,
//! where an `iter/tcp` dump sees one namespace and walks the host-wide TCP hash to do it.
//!
//! Never attached: userspace runs it with `BPF_PROG_TEST_RUN`, many sets of the table per run
//! (`args[0]` = the first set; the return value counts the sets read), and reads the run's
//! records out of `CONNREAP_SWEEP`, a memory-mapped array with a slot per way (an empty slot
//! has skaddr 0). Two forms: `connreap_sweep_loop` reads 256 sets per run through `bpf_loop`
//! (5.17+); `connreap_sweep`, for older kernels, 4 sets per run in a loop the verifier walks
//! way by way. `connreap_sweep_direct` is the `bpf_loop` form for kernels with the
//! `bpf_rdonly_cast` kfunc (6.2+): it casts each key to the kernel's `struct tcp_sock` and
//! reads the fields with plain loads (a fault reads zero), where the other forms make a helper
//! call per field; the CPU then overlaps the socket's cache misses, and the sweep costs about a
//! third as much.
//!
//! A key can be stale: a socket freed without a transition to CLOSE (no such path is known,
//! but the table cannot tell) leaves its address behind, and TCP sockets' slab memory is
//! reused by other TCP sockets (`SLAB_TYPESAFE_BY_RCU`). A record is written only when the
//! memory at the address is still a TCP socket of the record's family with a state the record
//! could have; a record whose state differs from the table's (a transition under way, or a
//! reused address) is written without a known age.
use core::ffi::c_void;

use aya_ebpf::{
    bindings::BPF_F_MMAPABLE,
    helpers::{bpf_jiffies64, generated::bpf_loop},
    macros::map,
    maps::Array,
};
use connreap_ebpf::{
    sock_flags, tcp_state, SockRecord, StateEntry, SweepRecord, AF_INET, AF_INET6, IPPROTO_TCP,
    MAX_SWEEP_SETS, STATE_WAYS, UNROLLED_SWEEP_SETS,
};

use crate::{off, programs::read, state};

/// One run's output: up to all ways of [`MAX_SWEEP_SETS`] sets.
#[map(name = "CONNREAP_SWEEP")]
static CONNREAP_SWEEP: Array<SweepRecord> =
    Array::with_max_entries(MAX_SWEEP_SETS * STATE_WAYS as u32, BPF_F_MMAPABLE);

/// What a run is asked (the test run's arguments: a raw tracepoint's context is its u64
/// arguments, and BPF_PROG_TEST_RUN passes 12): its first set (`args[0]`) and the namespace
/// whose sockets it skips (`args[1]`, 0 for none: the daemon's own when it walked it this
/// scan); and the jiffies now.
#[derive(Clone, Copy)]
struct Ask {
    first: u32,
    skip_netns: u32,
    now: u64,
}

/// The run's [`Ask`]; None when the loader set no kernel offsets.
#[inline(always)]
fn start(ctx: *mut c_void) -> Option<Ask> {
    // SAFETY: the context holds 12 u64 arguments (see above).
    let (first, skip) = unsafe { (*(ctx as *const u64), *(ctx as *const u64).add(1)) };
    if off!(valid) != connreap_ebpf::KernelOffsets::MAGIC as u64 {
        return None;
    }
    Some(Ask {
        first: first as u32,
        skip_netns: skip as u32,
        // SAFETY: a helper without arguments that only reads the kernel's jiffies counter.
        now: unsafe { bpf_jiffies64() },
    })
}

/// BTF id of the kernel's `struct tcp_sock`, written by the loader of the direct form (0 in
/// the others, which never read it).
#[no_mangle]
static CONNREAP_TCP_SOCK_ID: u32 = 0;

/// Read set `idx` of the table into the output slots of the run's `slot`-th set; false past
/// the table's end. `DIRECT`: read sockets with plain loads ([`sweep_one_direct`]).
///
/// Each way has its own output slot, marked empty (skaddr 0) unless a record is written:
/// nothing in the program's state depends on which ways held a socket, so the verifier's
/// states after each way are alike (a running count of records would make them differ, and
/// older verifiers give up on the unrolled loop: E2BIG on 6.1).
#[inline(always)]
fn sweep_set<const DIRECT: bool>(idx: u32, slot: u32, ask: &Ask) -> bool {
    if idx >= state::sets() {
        return false;
    }
    let Some(set) = state::set(idx) else {
        return false;
    };
    for way in 0..STATE_WAYS {
        let Some(out) = CONNREAP_SWEEP.get_ptr_mut(slot * STATE_WAYS as u32 + way as u32) else {
            continue;
        };
        // SAFETY: a valid map value of this run's output; one sweep runs at a time
        // (userspace holds a lock around each).
        let out = unsafe { &mut *out };
        out.sock.skaddr = 0;
        let (sk, entry) = state::way(set, way);
        // A socket of the skipped namespace costs only its record here.
        if sk != 0 && (entry.netns == 0 || entry.netns != ask.skip_netns) {
            if DIRECT {
                sweep_one_direct(sk, &entry, ask, out);
            } else {
                sweep_one(sk, &entry, ask, out);
            }
        }
    }
    true
}

/// The sweep where `bpf_loop` exists (5.17+): [`MAX_SWEEP_SETS`] sets per run, the loop's body
/// verified once. Returns the sets read, -1 without kernel offsets.
///
/// Declared by hand, like the flush program: the daemon reads the return value, which
/// aya-ebpf's `#[raw_tracepoint]` entry would discard.
#[no_mangle]
#[link_section = "raw_tp/connreap_sweep_loop"]
pub fn connreap_sweep_loop(ctx: *mut c_void) -> i32 {
    let Some(ask) = start(ctx) else {
        return -1;
    };
    run_loop(ask, sweep_loop_body as *mut c_void)
}

/// The direct form of [`connreap_sweep_loop`] (see the module docs): `bpf_rdonly_cast`, 6.2+.
#[no_mangle]
#[link_section = "raw_tp/connreap_sweep_direct"]
pub fn connreap_sweep_direct(ctx: *mut c_void) -> i32 {
    let Some(ask) = start(ctx) else {
        return -1;
    };
    run_loop(ask, sweep_loop_body_direct as *mut c_void)
}

/// Up to [`MAX_SWEEP_SETS`] sets through `bpf_loop` with `body`; returns the sets read.
#[inline(always)]
fn run_loop(ask: Ask, body: *mut c_void) -> i32 {
    let mut run = LoopRun { ask, sets: 0 };
    // SAFETY: the callback is a static function of the signature bpf_loop calls; its context
    // is this stack value, alive for the call.
    unsafe {
        bpf_loop(
            MAX_SWEEP_SETS,
            body,
            &mut run as *mut LoopRun as *mut c_void,
            0,
        )
    };
    run.sets as i32
}

/// What the loop's body needs and counts.
#[repr(C)]
struct LoopRun {
    ask: Ask,
    sets: u32,
}

/// One set per call; returns 1 (stop) past the table's end.
#[inline(never)]
extern "C" fn sweep_loop_body(i: u64, ctx: *mut c_void) -> i64 {
    // SAFETY: `ctx` is the LoopRun on connreap_sweep_loop's stack, passed through bpf_loop.
    let run = unsafe { &mut *(ctx as *mut LoopRun) };
    let slot = i as u32;
    if !sweep_set::<false>(run.ask.first.wrapping_add(slot), slot, &run.ask) {
        return 1;
    }
    run.sets += 1;
    0
}

/// [`sweep_loop_body`] for the direct form.
#[inline(never)]
extern "C" fn sweep_loop_body_direct(i: u64, ctx: *mut c_void) -> i64 {
    // SAFETY: `ctx` is the LoopRun on connreap_sweep_direct's stack, passed through bpf_loop.
    let run = unsafe { &mut *(ctx as *mut LoopRun) };
    let slot = i as u32;
    if !sweep_set::<true>(run.ask.first.wrapping_add(slot), slot, &run.ask) {
        return 1;
    }
    run.sets += 1;
    0
}

/// The sweep for kernels without `bpf_loop`: [`UNROLLED_SWEEP_SETS`] sets per run, every way
/// walked by the verifier. Returns the sets read, -1 without kernel offsets.
#[no_mangle]
#[link_section = "raw_tp/connreap_sweep"]
pub fn connreap_sweep(ctx: *mut c_void) -> i32 {
    let Some(ask) = start(ctx) else {
        return -1;
    };
    let mut sets = 0;
    for s in 0..UNROLLED_SWEEP_SETS {
        if !sweep_set::<false>(ask.first.wrapping_add(s), s, &ask) {
            break;
        }
        sets += 1;
    }
    sets
}

/// Bytes of `struct sock_common` read at once: every field of it the record needs lies in its
/// first 104 bytes on the kernels connreap runs on (a field past this span is read alone).
const SPAN: usize = 128;

/// The socket's first [`SPAN`] bytes, read with one helper call instead of one per field.
struct Common([u64; SPAN / 8]);

impl Common {
    /// The field of type T at `off`: from the span when it lies inside (the offsets are
    /// constants to the verifier, so the other branch is dropped at load), else read alone.
    #[inline(always)]
    fn get<T: Copy + Default>(&self, sk: u64, off: u64) -> T {
        if off as usize + core::mem::size_of::<T>() <= SPAN {
            // SAFETY: inside the span (checked above); read_unaligned allows any offset.
            unsafe {
                core::ptr::read_unaligned(
                    (self.0.as_ptr() as *const u8).add(off as usize) as *const T
                )
            }
        } else {
            read(sk + off)
        }
    }
}

/// `bpf_rdonly_cast(sk, <struct tcp_sock>)`, hand-encoded like `bpf_sock_destroy` (destroy.rs):
/// the loader patches the call's placeholder to the kfunc's BTF id. The result is an untrusted
/// pointer to the kernel's `struct tcp_sock`: the verifier checks each load against that
/// struct's BTF, and a load that faults (memory no longer a socket) reads zero.
#[inline(always)]
fn cast(sk: u64) -> *const u8 {
    // SAFETY: a plain read of a static; volatile so the loader's value is used (a constant to
    // the verifier, which the kfunc requires).
    let id = unsafe { core::ptr::read_volatile(&CONNREAP_TCP_SOCK_ID) } as u64;
    let ret: u64;
    // SAFETY: the kfunc takes any value and a BTF type id and only returns a pointer the
    // verifier tracks; the clobbers are the BPF calling convention's.
    unsafe {
        core::arch::asm!(
            ".quad {insn}",
            insn = const connreap_ebpf::kfunc::CAST_INSN,
            inlateout("r1") sk => _,
            inlateout("r2") id => _,
            lateout("r0") ret,
            lateout("r3") _,
            lateout("r4") _,
            lateout("r5") _,
        );
    }
    ret as *const u8
}

/// How a form reads a socket's fields; the record and its checks ([`fill`]) are the same.
trait Fields {
    /// The field of type T at `off` in the socket (its `struct tcp_sock`).
    fn at<T: Copy + Default>(&self, off: u64) -> T;
    /// The inode of the socket's namespace, through `skc_net` (0 without one).
    fn netns_inum(&self) -> u32;
}

/// Checked reads: the socket's first [`SPAN`] bytes at once, any other field with a helper
/// call of its own.
struct Helper {
    sk: u64,
    span: Common,
}

impl Fields for Helper {
    #[inline(always)]
    fn at<T: Copy + Default>(&self, off: u64) -> T {
        self.span.get(self.sk, off)
    }

    #[inline(always)]
    fn netns_inum(&self) -> u32 {
        let net: u64 = self.at(off!(skc_net));
        if net == 0 {
            0
        } else {
            read(net + off!(net_ns_inum))
        }
    }
}

/// Plain loads through [`cast`] (6.2+).
struct Direct(*const u8);

impl Fields for Direct {
    #[inline(always)]
    fn at<T: Copy + Default>(&self, off: u64) -> T {
        crate::programs::sk_field(self.0, off)
    }

    #[inline(always)]
    fn netns_inum(&self) -> u32 {
        let net: *const u8 = self.at(off!(skc_net));
        if net.is_null() {
            0
        } else {
            crate::programs::sk_field(net, off!(net_ns_inum))
        }
    }
}

/// The sweep's record of the socket at `sk`, read with checked reads.
#[inline(never)]
fn sweep_one(sk: u64, entry: &StateEntry, ask: &Ask, out: &mut SweepRecord) {
    let fields = Helper {
        sk,
        span: Common(read(sk)),
    };
    fill(&fields, sk, entry, ask, out);
}

/// [`sweep_one`] with plain loads through [`cast`].
#[inline(never)]
fn sweep_one_direct(sk: u64, entry: &StateEntry, ask: &Ask, out: &mut SweepRecord) {
    fill(&Direct(cast(sk)), sk, entry, ask, out);
}

/// Fill `out` from the socket at `sk`, tracked as `entry`, read through `f`; left empty
/// (skaddr 0) when the memory there is no longer a TCP socket the entry could describe, or
/// when it is in the namespace the run skips (a record without the namespace: read first).
#[inline(always)]
fn fill<F: Fields>(f: &F, sk: u64, entry: &StateEntry, ask: &Ask, out: &mut SweepRecord) {
    let now = ask.now;
    let netns: u32 = if entry.netns != 0 {
        entry.netns
    } else {
        f.netns_inum()
    };
    if netns == ask.skip_netns && netns != 0 {
        return;
    }
    out.netns = netns;
    let family: u16 = f.at(off!(skc_family));
    let state: u8 = f.at(off!(skc_state));
    let protocol: u16 = f.at(off!(sk_protocol));
    if family != entry.family
        || protocol != IPPROTO_TCP
        || state == 0
        || state == tcp_state::CLOSE
        || state == tcp_state::TIME_WAIT
        || state > tcp_state::CLOSING
    {
        return;
    }
    let (saddr, daddr) = if family == AF_INET {
        let d: u32 = f.at(off!(skc_daddr));
        let s: u32 = f.at(off!(skc_rcv_saddr));
        ([s as u64, 0], [d as u64, 0])
    } else if family == AF_INET6 {
        let (s, d) = (off!(skc_v6_rcv_saddr), off!(skc_v6_daddr));
        ([f.at(s), f.at(s + 8)], [f.at(d), f.at(d + 8)])
    } else {
        return;
    };
    let sport: u16 = f.at(off!(skc_num));
    let dport = u16::from_be(f.at(off!(skc_dport)));
    let socket: u64 = f.at(off!(sk_socket));
    // The inode iter/tcp kept in the record, if the record is this socket's (its ports); else
    // through the socket (past the socket's struct, so a checked read in either form).
    let kept = entry.inode != 0 && entry.sport == sport && entry.dport == dport;
    let inode = if socket == 0 {
        0
    } else if kept {
        u64::from(entry.inode)
    } else {
        read::<u64>(socket + off!(socket_to_inode) + off!(inode_ino))
    };
    out.requests = 0;
    let queues: (u32, u32) = if state == tcp_state::LISTEN {
        out.requests = f.at(off!(icsk_qlen));
        (f.at(off!(sk_ack_backlog)), f.at(off!(sk_max_ack_backlog)))
    } else {
        let rcv_nxt: u32 = f.at(off!(tcp_rcv_nxt));
        let copied: u32 = f.at(off!(tcp_copied_seq));
        let write_seq: u32 = f.at(off!(tcp_write_seq));
        let snd_una: u32 = f.at(off!(tcp_snd_una));
        (
            rcv_nxt.wrapping_sub(copied),
            write_seq.wrapping_sub(snd_una),
        )
    };
    let now32 = now as u32;
    let sk_flags: u64 = f.at(off!(sk_flags));
    let mut flags = sock_flags::FULL;
    if (sk_flags >> (off!(sock_keepopen_bit) & 63)) & 1 != 0 {
        flags |= sock_flags::KEEPALIVE;
    }
    let mut age = 0;
    if entry.state == state && entry.since_jiffies != 0 {
        age = now.wrapping_sub(entry.since_jiffies);
        flags |= sock_flags::SINCE_KNOWN;
    }
    let lrcv: u32 = f.at(off!(icsk_lrcvtime));
    let lsnd: u32 = f.at(off!(tcp_lsndtime));
    let ack: u32 = f.at(off!(tcp_rcv_tstamp));
    out.sock = SockRecord {
        skaddr: sk,
        inode,
        cookie: f.at(off!(skc_cookie)),
        state_age_jiffies: age,
        saddr: crate::programs::bytes16(saddr),
        daddr: crate::programs::bytes16(daddr),
        family,
        sport,
        dport,
        state,
        flags,
        uid: f.at(off!(sk_uid)),
        rx_queue: queues.0,
        tx_queue: queues.1,
        last_rcv_jiffies: now32.wrapping_sub(lrcv),
        last_snd_jiffies: now32.wrapping_sub(lsnd),
        last_ack_jiffies: now32.wrapping_sub(ack),
        tw_entry_ms: 0,
        _pad: 0,
    };
}
