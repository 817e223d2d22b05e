//! The state tracker: a BTF tracepoint on `inet_sock_set_state(sk, oldstate, newstate)` that
//! keeps each socket's state, the jiffy it entered it and its 4-tuple in `CONNREAP_STATE` (the
//! set-associative table of state.rs), and sends every
//! transition to userspace through a per-CPU staging batch and the `CONNREAP_EVENTS` ring; plus
//! `connreap_flush_events`, which the daemon runs on each CPU to send partial batches.
//!
//! Bench-only builds of the tracker, to measure what each part of it costs, are this source
//! compiled with `cfg(tracker_variant = "...")`, one per build, which build.rs sets only in the
//! bench's own target directory for `cargo xtask bench --probe-parts` (what each measures:
//! `VARIANTS` in the bench's probe_parts.rs). The shipped build sets none: the flags below are
//! then `false` and their branches compile to nothing, and the `hash` variant's map and code
//! (module `hash`) are not compiled at all.
use core::ffi::c_void;

use aya_ebpf::{
    bindings::{BPF_RB_AVAIL_DATA, BPF_RB_FORCE_WAKEUP, BPF_RB_NO_WAKEUP, BPF_RB_PROD_POS},
    helpers::{bpf_get_current_pid_tgid, generated as gen},
    macros::btf_tracepoint,
    programs::BtfTracePointContext,
};
use connreap_ebpf::{
    counter, flush, tcp_state, EventBatch, StateEntry, TransitionEvent, AF_INET6, EVENT_BATCH,
    IPPROTO_TCP,
};

use crate::{
    off,
    programs::{addr16, bump, bump_by, bytes16, sk_field, CONNREAP_EVENTS, CONNREAP_STAGING},
};
#[cfg(tracker_variant = "hash")]
use hash::track;

/// Bench-only `sk-storage`: the record in the socket's own storage (agent-ebpf's sk_storage.rs,
/// which knows nothing of this module).
#[cfg(tracker_variant = "sk-storage")]
#[inline(always)]
fn track(t: &Transition, _batch: *mut EventBatch) {
    crate::sk_storage::track(t.skaddr, t.newstate, &t.entry());
}

#[btf_tracepoint(function = "inet_sock_set_state")]
pub fn connreap_set_state(ctx: BtfTracePointContext) -> i32 {
    let _ = try_set_state(&ctx);
    0
}

/// Wake the ring reader once per this much ring traffic (the daemon also drains on a timer, so
/// most batches cost no wakeup). A quarter of the 2 MiB ring: the reader has 1.5 MiB of slack
/// to answer a wakeup before events drop, and fewer wakeups (and context switches) than with a
/// smaller step cost the daemon less CPU per connection under churn.
const WAKEUP_BYTES: u64 = 512 * 1024;

/// Bench-only `count-only`: count the transition and stop (the floor: entry, stats, ctx loads).
const COUNT_ONLY: bool = cfg!(tracker_variant = "count-only");
/// Bench-only `no-map`: everything but the per-socket state table.
const NO_MAP: bool = cfg!(tracker_variant = "no-map");
/// Bench-only `no-ring`: everything but the event ring.
const NO_RING: bool = cfg!(tracker_variant = "no-ring");
/// Bench-only `unbatched`: one ring record per transition (the design before per-CPU batches).
const UNBATCHED: bool = cfg!(tracker_variant = "unbatched");

fn try_set_state(ctx: &BtfTracePointContext) -> Result<(), i32> {
    let sk: *const u8 = ctx.arg(0);
    let protocol: u16 = sk_field(sk, off!(sk_protocol));
    if protocol != IPPROTO_TCP {
        return Ok(());
    }
    // This CPU's staging batch: its header counts the transition (the events go in below).
    let Some(batch) = CONNREAP_STAGING.get_ptr_mut(0) else {
        return Ok(());
    };
    // SAFETY: a valid per-CPU map value. Nothing else writes `transitions` (the tracker does
    // not nest on a CPU; the flush only sends the batch).
    unsafe { (*batch).transitions += 1 };
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
        now: now(),
        netns: netns_of(sk),
        skaddr: sk as u64,
        saddr,
        daddr,
        family,
        sport: sk_field(sk, off!(skc_num)),
        dport: u16::from_be(sk_field(sk, off!(skc_dport))),
        oldstate,
        newstate,
    };

    if !NO_MAP {
        track(&t, batch);
    }
    if NO_RING {
        return Ok(());
    }
    if UNBATCHED {
        send_one(&t);
    } else {
        stage(&t, batch);
    }
    Ok(())
}

/// The transition's timestamp: jiffies, not bpf_ktime_get_ns, a plain load instead of a clock
/// read, and the unit of the kernel's own TCP timestamps that the iterator reports idle times in.
#[cfg(not(tracker_variant = "ktime"))]
#[inline(always)]
fn now() -> u64 {
    // SAFETY: a helper without arguments that only reads the kernel's jiffies counter.
    unsafe { aya_ebpf::helpers::bpf_jiffies64() }
}

/// Bench-only `ktime`: stamp transitions with bpf_ktime_get_ns instead of jiffies (the ages
/// come out wrong: this build measures the cost only).
#[cfg(tracker_variant = "ktime")]
#[inline(always)]
fn now() -> u64 {
    // SAFETY: a helper without arguments that only reads the monotonic clock.
    unsafe { aya_ebpf::helpers::bpf_ktime_get_ns() }
}

/// Keep the socket's record in the state table: written on every transition, freed on close.
#[cfg(not(any(tracker_variant = "hash", tracker_variant = "sk-storage")))]
#[inline(always)]
fn track(t: &Transition, batch: *mut EventBatch) {
    // The socket's address as a plain number (see EventBatch::scratch and state.rs).
    // SAFETY: this CPU's staging value; only the tracker writes `scratch`, and it does not
    // nest on a CPU.
    let sk = unsafe {
        core::ptr::write_volatile(&mut (*batch).scratch, t.skaddr);
        core::ptr::read_volatile(&(*batch).scratch)
    };
    if t.newstate == tcp_state::CLOSE {
        crate::state::remove(sk);
    } else if !crate::state::put(sk, &t.entry()) {
        bump(counter::MAP_FULL);
    }
}

/// What the tracker read about one transition.
struct Transition {
    now: u64,
    netns: u32,
    /// The socket's address: to the verifier, still the tracepoint's trusted pointer (a cast
    /// is no instruction), so `fill` reads through it what only events carry.
    skaddr: u64,
    saddr: [u64; 2],
    daddr: [u64; 2],
    family: u16,
    sport: u16,
    dport: u16,
    oldstate: u8,
    newstate: u8,
}

impl Transition {
    /// The socket's record in the state table.
    #[inline(always)]
    fn entry(&self) -> StateEntry {
        StateEntry {
            since_jiffies: self.now,
            saddr: bytes16(self.saddr),
            daddr: bytes16(self.daddr),
            family: self.family,
            sport: self.sport,
            dport: self.dport,
            state: self.newstate,
            _pad: 0,
            netns: self.netns,
            inode: 0,
        }
    }
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
        (*ev).netns = t.netns;
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

/// The inode of the socket's network namespace, `sk->__sk_common.skc_net.net->ns.inum`, for
/// the state table (the sweep passes over a namespace's records by it) and the events. Two
/// direct loads, both checked by the
/// verifier against the running kernel's types like the fields above: `skc_net` lies on the
/// cache line of the addresses and ports already read, and the namespace's `struct net` is
/// shared by all its sockets; 0 when the socket has no namespace pointer.
#[inline(always)]
fn netns_of(sk: *const u8) -> u32 {
    let net: *const u8 = sk_field(sk, off!(skc_net));
    if net.is_null() {
        return 0;
    }
    sk_field(net, off!(net_ns_inum))
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
fn stage(t: &Transition, batch: *mut EventBatch) {
    // SAFETY: this CPU's staging value; see above for why compiler barriers suffice.
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
/// `BPF_PROG_TEST_RUN` + `BPF_F_TEST_RUN_ON_CPU` on a periodic tick, then drains the ring (a
/// wakeup from the probe only drains: full batches need no flush). Returns
/// [`flush::EMPTY`], [`flush::SENT`] (a partial batch went out) or [`flush::BUSY`] (the batch was
/// in use: its events go out with the batch or on the next round).
///
/// Declared by hand: aya-ebpf's `#[raw_tracepoint]` entry discards the function's result and
/// returns 0, and the daemon reads this one (`BPF_PROG_TEST_RUN`'s retval).
#[no_mangle]
#[link_section = "raw_tp/connreap_flush"]
pub fn connreap_flush_events(_ctx: *mut c_void) -> i32 {
    try_flush()
}

fn try_flush() -> i32 {
    let Some(batch) = CONNREAP_STAGING.get_ptr_mut(0) else {
        return flush::EMPTY;
    };
    let mut ret = flush::EMPTY;
    // SAFETY: as in `stage`.
    unsafe {
        if core::ptr::read_volatile(&(*batch).busy) != 0 {
            return flush::BUSY;
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
            ret = flush::SENT;
        }
        core::ptr::write_volatile(&mut (*batch).busy, 0);
    }
    ret
}

/// Bench-only `hash`: the per-socket state in the kernel hash map that the set-associative
/// table of state.rs replaced (allocated per socket, keyed by socket address). Not pinned, so
/// it lives and dies with the tracker that uses it.
#[cfg(tracker_variant = "hash")]
mod hash {
    use aya_ebpf::{bindings::BPF_F_NO_PREALLOC, macros::map, maps::HashMap};
    use connreap_ebpf::{counter, tcp_state, EventBatch, StateEntry, STATE_MAP_ENTRIES};

    use super::Transition;
    use crate::programs::bump;

    #[map(name = "CONNREAP_HASH")]
    static CONNREAP_HASH: HashMap<u64, StateEntry> =
        HashMap::with_max_entries(STATE_MAP_ENTRIES, BPF_F_NO_PREALLOC);

    /// The shipped `track`, on the hash map (the staging batch is not needed here).
    #[inline(always)]
    pub(super) fn track(t: &Transition, _batch: *mut EventBatch) {
        if t.newstate == tcp_state::CLOSE {
            let _ = CONNREAP_HASH.remove(t.skaddr);
            return;
        }
        let entry = t.entry();
        if t.oldstate == tcp_state::CLOSE || t.oldstate == tcp_state::LISTEN {
            // A new socket: insert without looking up first (BPF_ANY also replaces a stale
            // record at a reused address).
            if CONNREAP_HASH.insert(t.skaddr, entry, 0).is_err() {
                bump(counter::MAP_FULL);
            }
        } else if let Some(existing) = CONNREAP_HASH.get_ptr_mut(t.skaddr) {
            // SAFETY: a valid pointer to this socket's map value; only its own transitions
            // write it, and the kernel serialises those under the socket's lock.
            unsafe { *existing = entry };
        } else if CONNREAP_HASH.insert(t.skaddr, entry, 0).is_err() {
            bump(counter::MAP_FULL);
        }
    }
}
