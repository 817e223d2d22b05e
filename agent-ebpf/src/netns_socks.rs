//! `iter/task_file` dump of socket owners that also reads the sockets processes hold in network
//! namespaces other than the reader's: one pass over every process's files gives every owner
//! and covers every namespace, where an `iter/tcp` dump sees one namespace and walks the
//! kernel's host-wide TCP hash to do it (so a dump per namespace costs namespaces × all sockets
//! of the host). The daemon runs it instead of the plain owner dump on the scans that read
//! namespaces between their walks (one pass over the files instead of two). Sockets no process
//! holds (TIME_WAIT, SYN_RECV, orphans, connections not yet accepted) are not here: userspace
//! walks each namespace with iter/tcp for them, less often.
use core::ffi::c_void;

use aya_ebpf::helpers::generated::{self as gen, bpf_sock_from_file};
use connreap_ebpf::{HeldElsewhere, OwnerRecord, SockRecord, IPPROTO_TCP};

use crate::{
    off,
    programs::{
        addresses, full_sock, inet_stream_sk, offsets_set, owner_record, read, seq_write, sk_field,
        sock_record, task_file_ctx,
    },
};

#[no_mangle]
#[link_section = "iter/task_file"]
pub fn connreap_iter_netns_socks(ctx: *mut c_void) -> i32 {
    let _ = try_netns_socks(ctx);
    0
}

fn try_netns_socks(ctx: *mut c_void) -> Result<(), i64> {
    let (meta, task, fd, file) = task_file_ctx(ctx);
    if !offsets_set("connreap_iter_netns_socks", meta) {
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
    let mut owner = owner_record(sk, task, fd);
    match elsewhere(socket, sk) {
        Some((netns, sock)) => {
            owner.netns = netns;
            // SAFETY: seq is the iterator's seq_file.
            unsafe { seq_write(seq, &HeldElsewhere { owner, sock }) }
        }
        // SAFETY: seq is the iterator's seq_file.
        None => unsafe { seq_write::<OwnerRecord>(seq, &owner) },
    }
}

/// The namespace inode and record of `sk` (the struct sock of `socket`) if it is a TCP socket
/// of another network namespace than the reader's, else None.
#[inline(always)]
fn elsewhere(socket: *const u8, sk: u64) -> Option<(u32, SockRecord)> {
    // The reader's namespace (the task reading the iterator is `current`) against the
    // socket's, by inode: plain numbers (the verifier refuses comparing kernel pointers).
    // SAFETY: a helper without arguments returning the trusted current task.
    let current = unsafe { gen::bpf_get_current_task_btf() } as *const u8;
    let nsproxy: *const u8 = sk_field(current, off!(task_nsproxy));
    if nsproxy.is_null() {
        return None;
    }
    let own_net: *const u8 = sk_field(nsproxy, off!(nsproxy_net_ns));
    let net: *const u8 = sk_field(sk as *const u8, off!(skc_net));
    if own_net.is_null() || net.is_null() {
        return None;
    }
    let own: u32 = sk_field(own_net, off!(net_ns_inum));
    let netns: u32 = sk_field(net, off!(net_ns_inum));
    if netns == own {
        return None;
    }
    // A TCP socket, not MPTCP or SCTP (stream sockets of the inet families too). `sk` is a
    // BTF pointer the verifier calls untrusted (loaded from struct socket), which the
    // bpf_skc_to_* helpers refuse: struct sock's own fields are direct loads, tcp_sock's and
    // inet_connection_sock's (past struct sock) checked reads.
    let tp = sk as *const u8;
    let protocol: u16 = sk_field(tp, off!(sk_protocol));
    if protocol != IPPROTO_TCP {
        return None;
    }
    let family: u16 = sk_field(tp, off!(skc_family));
    let state: u8 = sk_field(tp, off!(skc_state));
    let addrs = addresses(tp, family)?;
    // The socket's address as a number for the state table (a probe read gives a plain value).
    let sk_number = read::<u64>(socket as u64 + off!(socket_sk));
    let full = full_sock(
        || crate::state::get(sk_number),
        false,
        tp,
        state,
        |p, o| read::<u32>(p as u64 + o),
    );
    let sock = sock_record(
        sk,
        tp,
        family,
        state,
        addrs,
        &full,
        sk_field(tp, off!(sk_uid)),
        0,
    );
    Some((netns, sock))
}
