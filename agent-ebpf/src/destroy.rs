//! The fallback socket destroy path for kernels built without `CONFIG_INET_DIAG_DESTROY`: an
//! `iter/tcp` program that calls the `bpf_sock_destroy` kfunc (Linux 6.5+) on the sockets
//! userspace listed in `CONNREAP_DESTROY` (by inode, with the expected socket address).
//! Loaded only when the agent needs it; the netlink path is the primary one.
use core::{arch::asm, ffi::c_void};

use aya_ebpf::{macros::map, maps::HashMap};
use connreap_ebpf::{kfunc, tcp_state, DestroyRequest, KernelOffsets};

use crate::{off, programs::read};

#[map(name = "CONNREAP_DESTROY")]
static CONNREAP_DESTROY: HashMap<u64, DestroyRequest> =
    HashMap::with_max_entries(kfunc::MAX_TARGETS, 0);

#[no_mangle]
#[link_section = "iter/tcp"]
pub fn connreap_iter_destroy(ctx: *mut c_void) -> i32 {
    let _ = try_iter_destroy(ctx);
    0
}

/// `bpf_sock_destroy(sk)`, hand-encoded: the `.quad` is `call <kfunc>` with
/// `src_reg = BPF_PSEUDO_KFUNC_CALL` and the placeholder BTF id the loader patches.
///
/// # Safety
/// `sk` must be the trusted `sk_common` pointer of the `iter/tcp` context.
#[inline(always)]
unsafe fn bpf_sock_destroy(sk: u64) -> i64 {
    let ret: i64;
    // SAFETY: per the contract, `sk` is what the kfunc takes; the loader patches the call's
    // placeholder to the kfunc's BTF id, and the clobbers are the BPF calling convention's
    // (r0 the result, r1-r5 caller-saved).
    unsafe {
        asm!(
            ".quad {insn}",
            insn = const kfunc::INSN,
            inlateout("r1") sk => _,
            lateout("r0") ret,
            lateout("r2") _,
            lateout("r3") _,
            lateout("r4") _,
            lateout("r5") _,
        );
    }
    ret
}

fn try_iter_destroy(ctx: *mut c_void) -> Result<(), i64> {
    if off!(valid) != KernelOffsets::MAGIC as u64 {
        return Err(-1);
    }
    // SAFETY: the iterator context layout is fixed by the kernel's bpf_iter__tcp.
    let sk = unsafe { *((ctx as *const u64).add(1)) };
    if sk == 0 {
        return Ok(());
    }
    // Mini sockets (TIME_WAIT, NEW_SYN_RECV) have no file, so no inode: never targets.
    let state: u8 = read(sk + off!(skc_state));
    if state == tcp_state::TIME_WAIT || state == tcp_state::NEW_SYN_RECV {
        return Ok(());
    }
    let socket: u64 = read(sk + off!(sk_socket));
    if socket == 0 {
        return Ok(());
    }
    let inode: u64 = read(socket + off!(socket_to_inode) + off!(inode_ino));
    let Some(req) = CONNREAP_DESTROY.get_ptr_mut(inode) else {
        return Ok(());
    };
    // SAFETY: a valid map value pointer; userspace does not touch it during the pass. `sk` is
    // the trusted `sk_common` pointer of the iterator context, as bpf_sock_destroy requires.
    unsafe {
        if (*req).skaddr != 0 && (*req).skaddr != sk {
            (*req).result = kfunc::MISMATCH;
        } else {
            (*req).result = bpf_sock_destroy(sk) as i32;
        }
        (*req).done = 1;
    }
    Ok(())
}
