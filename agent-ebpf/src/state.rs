//! The per-socket state table `CONNREAP_STATE`: a bounded, set-associative hash table in an
//! array map, written by the tracker and read by the iter/tcp dump.
//!
//! 2^`CONNREAP_SET_BITS` sets (the loader sizes the table) of `STATE_WAYS` ways. A socket's set is a hash of its address; the way
//! that holds its record holds that address as its key (0 = free), and the keys of a set lie
//! together, so finding a socket reads two cache lines and takes no lock. A free way is claimed
//! with an atomic compare-and-swap (two sockets of one set may be created on two CPUs at once);
//! after that only the socket's own transitions write its way, and the kernel serialises those
//! (they run under the socket's lock, as the iterator's reads do).
//!
//! It replaced a `BPF_MAP_TYPE_HASH` (allocation, bucket lock and hashing in the kernel on
//! every insert and delete): the `hash` variant of `cargo xtask bench --probe-parts` measures
//! the difference side by side.
//!
//! Keys are socket addresses as plain numbers: the verifier allows no arithmetic on a kernel
//! pointer (the hash) and no pointer as an atomic operand, so callers pass the address as read
//! back from map memory or through a probe read.
use aya_ebpf::{macros::map, maps::Array};
use connreap_ebpf::{
    StateEntry, StateSet, MAX_SET_BITS, MIN_SET_BITS, STATE_SETS, STATE_SET_BITS, STATE_WAYS,
};

/// Per-socket state, the jiffy it was entered and the 4-tuple: the table this module keeps.
/// Preallocated: a fixed `sets × size_of::<StateSet>()` bytes of kernel memory (exported as
/// `connreap_bpf_map_memory_bytes`) for up to `sets × STATE_WAYS` sockets; `STATE_SETS` sets
/// unless the loader sizes it otherwise.
#[map(name = "CONNREAP_STATE")]
static CONNREAP_STATE: Array<StateSet> = Array::pinned(STATE_SETS, 0);

/// log2 of the table's sets, written by the loader with the table's size (a constant to the
/// verifier, like the kernel offsets).
#[no_mangle]
static CONNREAP_SET_BITS: u32 = STATE_SET_BITS;

/// log2 of the table's sets, within the bounds the loader keeps to.
#[inline(always)]
fn set_bits() -> u32 {
    // SAFETY: a plain read of a static; volatile so the loader's value is used.
    let bits = unsafe { core::ptr::read_volatile(&CONNREAP_SET_BITS) };
    bits.clamp(MIN_SET_BITS, MAX_SET_BITS)
}

/// The number of sets of the table.
#[inline(always)]
pub(crate) fn sets() -> u32 {
    1 << set_bits()
}

const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;

/// The set of the socket at address `sk`; none for 0, the key of a free way (a failed read of
/// the address must not find a free way's leftover record).
#[inline(always)]
fn set_of(sk: u64) -> Option<*mut StateSet> {
    if sk == 0 {
        return None;
    }
    // Socket addresses are slab objects: the low 6 bits carry nothing.
    let idx = ((sk >> 6).wrapping_mul(GOLDEN) >> (64 - set_bits())) as u32;
    CONNREAP_STATE.get_ptr_mut(idx)
}

#[inline(always)]
fn key(set: *mut StateSet, i: usize) -> u64 {
    // SAFETY: a valid set pointer; the index is masked into the array.
    unsafe { core::ptr::read_volatile(&(*set).keys[i & (STATE_WAYS - 1)]) }
}

/// The way holding `sk`'s record.
#[inline(always)]
fn find(set: *mut StateSet, sk: u64) -> Option<usize> {
    (0..STATE_WAYS).find(|&i| key(set, i) == sk)
}

#[inline(always)]
fn entry(set: *mut StateSet, i: usize) -> *mut StateEntry {
    // SAFETY: a valid set pointer; the index is masked into the array.
    unsafe { &mut (*set).entries[i & (STATE_WAYS - 1)] as *mut StateEntry }
}

/// Set `idx` of the table, for a pass over all of it (sweep.rs).
#[inline(always)]
pub(crate) fn set(idx: u32) -> Option<*const StateSet> {
    CONNREAP_STATE.get_ptr(idx)
}

/// Way `i` of `set`: its key (0: free) and a copy of its record.
#[inline(always)]
pub(crate) fn way(set: *const StateSet, i: usize) -> (u64, StateEntry) {
    let set = set as *mut StateSet;
    let k = key(set, i);
    // SAFETY: a valid set pointer; masked index.
    (k, unsafe { *entry(set, i) })
}

/// The record of the socket at `sk`, if it is tracked. Writable only where the socket's lock
/// is held (see the module docs).
#[inline(always)]
pub(crate) fn get(sk: u64) -> Option<*mut StateEntry> {
    let set = set_of(sk)?;
    let i = find(set, sk)?;
    Some(entry(set, i))
}

/// Store `rec` as the record of the socket at `sk`: in place when it has one (also a stale one
/// left at a reused address), else in a free way of its set. False when the set is full.
#[inline(always)]
pub(crate) fn put(sk: u64, rec: &StateEntry) -> bool {
    let Some(set) = set_of(sk) else {
        return false;
    };
    match find(set, sk).or_else(|| claim(set, sk)) {
        Some(i) => {
            // SAFETY: this socket's way (see the module docs).
            unsafe { *entry(set, i) = *rec };
            true
        }
        None => false,
    }
}

/// Claim a free way of `set` for `sk`.
#[inline(always)]
fn claim(set: *mut StateSet, sk: u64) -> Option<usize> {
    (0..STATE_WAYS).find(|&i| {
        // SAFETY: an aligned u64 of a map value; the index is masked into the array.
        key(set, i) == 0 && unsafe { cas_free(&mut (*set).keys[i & (STATE_WAYS - 1)], sk) }
    })
}

/// Free the way of the socket at `sk`.
#[inline(always)]
pub(crate) fn remove(sk: u64) {
    if let Some(set) = set_of(sk) {
        if let Some(i) = find(set, sk) {
            // SAFETY: this socket's way; masked index.
            unsafe { core::ptr::write_volatile(&mut (*set).keys[i & (STATE_WAYS - 1)], 0) };
        }
    }
}

/// `*p = new` if `*p == 0`, atomically (`BPF_ATOMIC | BPF_CMPXCHG`, Linux 5.12); true when it
/// swapped. Inline asm: core's atomics offer no compare-and-swap on the BPF target.
///
/// # Safety
/// `p` must be an aligned u64 in a map value.
#[inline(always)]
unsafe fn cas_free(p: *mut u64, new: u64) -> bool {
    let found: u64;
    // SAFETY: per the contract; r0 holds the expected value in and the found value out.
    unsafe {
        core::arch::asm!(
            "r0 = cmpxchg_64({p} + 0, r0, {new})",
            p = in(reg) p,
            new = in(reg) new,
            inout("r0") 0u64 => found,
            options(nostack),
        );
    }
    found == 0
}
