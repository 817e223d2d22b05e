//! The fallback destroy mechanism, for kernels built without `CONFIG_INET_DIAG_DESTROY` (where
//! netlink SOCK_DESTROY answers EOPNOTSUPP): the `connreap_iter_destroy` iter/tcp program calls
//! the `bpf_sock_destroy` kfunc (Linux 6.5+) on sockets listed by inode in `CONNREAP_DESTROY`.
//!
//! The kfunc call in the object is a hand-encoded instruction with a placeholder BTF id (rustc
//! cannot emit BTF for an extern kfunc); [`patch_kfunc`] writes the running kernel's id of
//! `bpf_sock_destroy` into a copy of the object before it is loaded.
use std::{io::Read as _, net::TcpStream, os::fd::AsRawFd, path::Path};

use aya::{
    maps::{HashMap as BpfHashMap, MapData},
    programs::Iter,
    Btf, Ebpf, EbpfLoader,
};
use connreap_ebpf::{kfunc, names, DestroyRequest};

use super::probe::{probe_pair, PairError};
use crate::kernel::{offsets, program_error, IterError, KernelError, BTF_PATH};

pub const MECHANISM: &str = "bpf-sock-destroy";

/// Replace every placeholder `bpf_sock_destroy` call's `imm` with `btf_id`; returns how many
/// were patched.
pub fn patch_kfunc(object: &mut [u8], btf_id: u32) -> usize {
    patch_call(object, kfunc::INSN, btf_id)
}

/// Replace the `imm` of every hand-encoded kfunc call `insn` (its placeholder form) with
/// `btf_id`; returns how many were patched.
pub fn patch_call(object: &mut [u8], insn: u64, btf_id: u32) -> usize {
    let needle = insn.to_le_bytes();
    let mut patched = 0;
    let mut i = 0;
    // Instructions are 8-byte aligned within their section, but sections need not be aligned
    // to 8 in the file: scan every offset.
    while i + 8 <= object.len() {
        if object[i..i + 8] == needle {
            object[i + 4..i + 8].copy_from_slice(&btf_id.to_le_bytes());
            patched += 1;
            i += 8;
        } else {
            i += 1;
        }
    }
    patched
}

/// What the iterator reported for one target.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DestroyResult {
    Destroyed,
    /// No socket with that inode in this network namespace (closed meanwhile).
    NotFound,
    /// The inode belongs to a socket at another address: not the selected socket.
    Mismatch,
    /// bpf_sock_destroy returned this errno.
    Errno(i32),
}

pub struct BpfDestroyer {
    ebpf: Ebpf,
    verbose: bool,
}

impl BpfDestroyer {
    /// Load the destroy iterator (the pinned maps of `pin_dir` are reused, not recreated).
    pub fn load(object: &[u8], pin_dir: &Path, verbose: bool) -> Result<Self, KernelError> {
        let kernel_btf = offsets::Resolver::open(Path::new(BTF_PATH))?;
        let btf_id = kernel_btf.func_id("bpf_sock_destroy")?;
        let mut object = object.to_vec();
        if patch_kfunc(&mut object, btf_id) == 0 {
            return Err(KernelError::NoKfuncCall("bpf_sock_destroy"));
        }
        let offsets = kernel_btf.offsets()?;
        let mut loader = EbpfLoader::new();
        loader.override_global(names::OFFSETS, &offsets, true);
        let ebpf = crate::kernel::with_pinned_maps(&mut loader, pin_dir)
            .load(&object)
            .map_err(KernelError::Object)?;
        let mut me = BpfDestroyer { ebpf, verbose };
        let btf = Btf::from_sys_fs().map_err(KernelError::KernelBtf)?;
        let verbose = me.verbose;
        me.iter()?
            .load("tcp", &btf)
            .map_err(|e| program_error(verbose, names::PROG_ITER_DESTROY, e))?;
        Ok(me)
    }

    fn iter(&mut self) -> Result<&mut Iter, KernelError> {
        let p = self
            .ebpf
            .program_mut(names::PROG_ITER_DESTROY)
            .ok_or(KernelError::MissingProgram(names::PROG_ITER_DESTROY))?;
        p.try_into()
            .map_err(|_| KernelError::ProgramType(names::PROG_ITER_DESTROY))
    }

    fn requests(&mut self) -> Result<BpfHashMap<&mut MapData, u64, DestroyRequest>, KernelError> {
        let map = self
            .ebpf
            .map_mut(names::DESTROY_MAP)
            .ok_or(KernelError::MissingMap(names::DESTROY_MAP))?;
        BpfHashMap::try_from(map).map_err(KernelError::map(names::DESTROY_MAP))
    }

    /// Destroy the sockets with these inodes (each at the given kernel address, 0 = any) in one
    /// pass over the namespace's TCP sockets.
    pub fn destroy(&mut self, targets: &[(u64, u64)]) -> Result<Vec<DestroyResult>, KernelError> {
        let mut out = Vec::with_capacity(targets.len());
        for chunk in targets.chunks(kfunc::MAX_TARGETS as usize) {
            self.destroy_chunk(chunk, &mut out)?;
        }
        Ok(out)
    }

    /// One pass of the destroy iterator over at most `kfunc::MAX_TARGETS` targets.
    fn destroy_chunk(
        &mut self,
        chunk: &[(u64, u64)],
        out: &mut Vec<DestroyResult>,
    ) -> Result<(), KernelError> {
        let err = KernelError::iterate("destroy");
        {
            let mut reqs = self.requests()?;
            let stale: Vec<u64> = reqs.keys().flatten().collect();
            for k in stale {
                let _ = reqs.remove(&k);
            }
            for &(inode, skaddr) in chunk {
                let req = DestroyRequest {
                    skaddr,
                    ..Default::default()
                };
                reqs.insert(inode, req, 0)
                    .map_err(|e| err(IterError::Map(e)))?;
            }
        }
        let it = self.iter()?;
        let run = |it: &mut Iter| -> Result<(), IterError> {
            let id = it.attach()?;
            let mut file = it.take_link(id)?.into_file()?;
            file.read_to_end(&mut Vec::new())?;
            Ok(())
        };
        run(it).map_err(&err)?;
        let mut reqs = self.requests()?;
        for &(inode, _) in chunk {
            let r = match reqs.get(&inode, 0) {
                Ok(r) if r.done == 0 => DestroyResult::NotFound,
                Ok(r) if r.result == 0 => DestroyResult::Destroyed,
                Ok(r) if r.result == kfunc::MISMATCH => DestroyResult::Mismatch,
                Ok(r) => DestroyResult::Errno(-r.result),
                Err(e) => return Err(err(IterError::Map(e))),
            };
            let _ = reqs.remove(&inode);
            out.push(r);
        }
        Ok(())
    }

    /// Check that the fallback works here, on a loopback pair of our own.
    pub fn probe(&mut self) -> Result<(), ProbeError> {
        probe_pair(|_, _, client| {
            let inode = inode_of(client).map_err(ProbeError::Fstat)?;
            match self.destroy(&[(inode, 0)]) {
                Ok(r) if r == [DestroyResult::Destroyed] => Ok(()),
                Ok(r) => Err(ProbeError::BpfResult(r)),
                Err(e) => Err(ProbeError::Bpf(Box::new(e))),
            }
        })
    }
}

/// Why the fallback failed its check on a loopback pair of our own.
#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    #[error(transparent)]
    Pair(#[from] PairError),
    #[error("fstat of the probe socket")]
    Fstat(#[source] std::io::Error),
    #[error("bpf_sock_destroy on the probe socket: {0:?}")]
    BpfResult(Vec<DestroyResult>),
    #[error("bpf_sock_destroy on the probe socket")]
    Bpf(#[source] Box<KernelError>),
}

fn inode_of(s: &TcpStream) -> std::io::Result<u64> {
    // SAFETY: fstat on an fd we own, into a zeroed struct.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: as above; st is a valid, writable libc::stat.
    if unsafe { libc::fstat(s.as_raw_fd(), &mut st) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(st.st_ino)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patches_every_placeholder_call_and_nothing_else() {
        let insn = kfunc::INSN.to_le_bytes();
        let mut obj = vec![0xaa; 3];
        obj.extend_from_slice(&insn);
        obj.extend_from_slice(&[0x85, 0x20, 0, 0, 1, 2, 3, 4]);
        obj.extend_from_slice(&insn);
        let before = obj.clone();
        assert_eq!(patch_kfunc(&mut obj, 0x1234_5678), 2);
        assert_eq!(&obj[3..7], &[0x85, 0x20, 0, 0]);
        assert_eq!(&obj[7..11], &0x1234_5678u32.to_le_bytes());
        assert_eq!(&obj[11..19], &before[11..19]);
        assert_eq!(&obj[23..27], &0x1234_5678u32.to_le_bytes());
        assert_eq!(patch_kfunc(&mut obj, 7), 0);
    }
}
