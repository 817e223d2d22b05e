//! Bench-only `sk-storage`: the candidate design for one pass over every namespace's sockets.
//! The tracker keeps each socket's record in the socket's own storage (a
//! `BPF_MAP_TYPE_SK_STORAGE` map: allocated on the socket's first transition, freed by the
//! kernel with the socket, no bound but memory) instead of the set-associative table, and
//! `connreap_iter_sk`, an `iter/bpf_sk_storage_map` program, writes one `SockRecord` per
//! tracked socket of every namespace in one pass over that map (the namespace's inode in
//! `_pad`), where `iter/tcp` walks the host-wide TCP table once per namespace. Mini sockets
//! (TIME_WAIT, NEW_SYN_RECV) have no storage: the pass does not see them.
use core::ffi::c_void;

use aya_ebpf::{
    bindings::BPF_SK_STORAGE_GET_F_CREATE,
    btf_maps::SkStorage,
    helpers::generated::{self as gen, bpf_sk_storage_get},
    macros::btf_map,
};
use connreap_ebpf::{counter, tcp_state, StateEntry};

use crate::{
    off,
    programs::{addresses, bump, full_sock, offsets_set, seq_write, sk_field, sock_record},
};

#[btf_map]
static CONNREAP_SK: SkStorage<StateEntry> = SkStorage::new();

fn map() -> *mut c_void {
    &CONNREAP_SK as *const SkStorage<StateEntry> as *mut c_void
}

/// The shipped `track`, on per-socket storage: `skaddr` is, to the verifier, still the
/// tracepoint's trusted socket pointer, `entry` the record for the state it entered.
#[inline(always)]
pub(crate) fn track(skaddr: u64, newstate: u8, entry: &StateEntry) {
    let sk = skaddr as *mut c_void;
    if newstate == tcp_state::CLOSE {
        // The kernel frees the storage with the socket; deleting it here as the table's
        // `remove` does cost more in the probe (measured in BENCHMARKS.md).
        return;
    }
    // SAFETY: as above; the value is created zeroed when the socket has none.
    let p = unsafe {
        bpf_sk_storage_get(
            map(),
            sk,
            core::ptr::null_mut(),
            BPF_SK_STORAGE_GET_F_CREATE as u64,
        )
    } as *mut StateEntry;
    if p.is_null() {
        bump(counter::MAP_FULL);
    } else {
        // SAFETY: this socket's storage value; its transitions run under its lock.
        unsafe { *p = *entry };
    }
}

#[no_mangle]
#[link_section = "iter/bpf_sk_storage_map"]
pub fn connreap_iter_sk(ctx: *mut c_void) -> i32 {
    let _ = try_iter_sk(ctx);
    0
}

fn try_iter_sk(ctx: *mut c_void) -> Result<(), i64> {
    // SAFETY: the iterator context layout is fixed by the kernel's
    // bpf_iter__bpf_sk_storage_map { meta, map, sk, value }.
    let (meta, sk, value) = unsafe {
        let words = ctx as *const u64;
        (*words, *words.add(2), *words.add(3))
    };
    if !offsets_set("connreap_iter_sk", meta) {
        return Err(-1);
    }
    if meta == 0 || sk == 0 || value == 0 {
        return Ok(());
    }
    // SAFETY: meta points at struct bpf_iter_meta whose first member is the seq_file.
    let seq = unsafe { *(meta as *const u64) };
    let skc = sk as *const u8;
    let family: u16 = sk_field(skc, off!(skc_family));
    let state: u8 = sk_field(skc, off!(skc_state));
    let Some(addrs) = addresses(skc, family) else {
        return Ok(());
    };
    // SAFETY: sk is the iterator's socket; NULL unless it is a full TCP socket.
    let tp = unsafe { gen::bpf_skc_to_tcp_sock(sk as *mut c_void) as *const u8 };
    if tp.is_null() {
        return Ok(());
    }
    let full = full_sock(
        || Some(value as *const StateEntry),
        tp,
        state,
        sk_field::<u32>,
    );
    let mut rec = sock_record(sk, skc, family, state, addrs, &full, 0, 0);
    let net: *const u8 = sk_field(skc, off!(skc_net));
    rec._pad = if net.is_null() {
        0
    } else {
        sk_field(net, off!(net_ns_inum))
    };
    // SAFETY: seq is the iterator's seq_file.
    unsafe { seq_write(seq, &rec) }
}
