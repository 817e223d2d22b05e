//! Kernel struct member offsets, resolved from the running kernel's BTF at load time and handed
//! to the BPF programs as `.rodata` globals (rustc emits no CO-RE relocations).
use std::path::Path;

use btf_rs::{Btf, Type};
use connreap_ebpf::KernelOffsets;

#[derive(Debug, thiserror::Error)]
pub enum OffsetError {
    #[error(
        "cannot read kernel BTF from {} (connreap needs CONFIG_DEBUG_INFO_BTF=y)",
        path.display()
    )]
    Read {
        path: std::path::PathBuf,
        /// btf-rs reports its errors as `anyhow::Error`; boxed here to stay a `std` error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    #[error("kernel BTF has no struct `{0}`")]
    NoStruct(String),
    #[error("kernel BTF: struct `{strukt}` has no member `{member}`")]
    NoMember { strukt: String, member: String },
    #[error("kernel BTF: `{strukt}.{member}` is a bitfield or not byte aligned")]
    Unaligned { strukt: String, member: String },
    #[error("kernel BTF has no function `{0}` (kfunc missing: too old a kernel?)")]
    NoFunc(String),
    #[error("kernel BTF: enum `{enumeration}` has no value `{value}`")]
    NoEnumValue { enumeration: String, value: String },
}

/// The running kernel's BTF, parsed once for everything the loaders need from it.
pub struct Resolver {
    btf: Btf,
}

impl Resolver {
    pub fn open(path: &Path) -> Result<Self, OffsetError> {
        let btf = Btf::from_file(path).map_err(|e| OffsetError::Read {
            path: path.to_path_buf(),
            source: e.into(),
        })?;
        Ok(Resolver { btf })
    }

    /// BTF id of a kernel function (a kfunc), for a `BPF_PSEUDO_KFUNC_CALL`.
    pub fn func_id(&self, name: &str) -> Result<u32, OffsetError> {
        self.btf
            .resolve_ids_by_name(name)
            .unwrap_or_default()
            .into_iter()
            .find(|id| matches!(self.btf.resolve_type_by_id(*id), Ok(Type::Func(_))))
            .ok_or_else(|| OffsetError::NoFunc(name.into()))
    }

    /// BTF id of the kernel's `struct name`.
    pub fn struct_id(&self, name: &str) -> Result<u32, OffsetError> {
        self.btf
            .resolve_ids_by_name(name)
            .unwrap_or_default()
            .into_iter()
            .find(|id| {
                matches!(self.btf.resolve_type_by_id(*id), Ok(Type::Struct(s)) if !s.members.is_empty())
            })
            .ok_or_else(|| OffsetError::NoStruct(name.into()))
    }

    /// The value of `value` in `enum enumeration`.
    fn enum_value(&self, enumeration: &str, value: &str) -> Result<u32, OffsetError> {
        let types = self
            .btf
            .resolve_types_by_name(enumeration)
            .unwrap_or_default();
        types
            .iter()
            .find_map(|t| match t {
                Type::Enum(e) => e
                    .members
                    .iter()
                    .find_map(|m| (self.btf.resolve_name(m).ok()? == value).then(|| m.val())),
                _ => None,
            })
            .ok_or_else(|| OffsetError::NoEnumValue {
                enumeration: enumeration.into(),
                value: value.into(),
            })
    }

    fn structure(&self, name: &str) -> Result<btf_rs::Struct, OffsetError> {
        let types = self
            .btf
            .resolve_types_by_name(name)
            .map_err(|_| OffsetError::NoStruct(name.into()))?;
        types
            .into_iter()
            .find_map(|t| match t {
                Type::Struct(s) if !s.members.is_empty() => Some(s),
                _ => None,
            })
            .ok_or_else(|| OffsetError::NoStruct(name.into()))
    }

    /// Bit offset of `member` in `s`, looking through anonymous structs and unions.
    fn find(&self, s: &btf_rs::Struct, member: &str) -> Option<(u32, Option<u32>, Type)> {
        for m in &s.members {
            let name = self.btf.resolve_name(m).unwrap_or_default();
            let ty = self.btf.resolve_chained_type(m).ok()?;
            if name == member {
                return Some((m.bit_offset(), m.bitfield_size(), ty));
            }
            if name.is_empty() {
                if let Type::Struct(inner) | Type::Union(inner) = &ty {
                    if let Some((off, bits, t)) = self.find(inner, member) {
                        return Some((m.bit_offset() + off, bits, t));
                    }
                }
            }
        }
        None
    }

    /// The type behind typedefs and qualifiers (`possible_net_t` is a typedef of a struct).
    fn strip(&self, mut ty: Type) -> Type {
        for _ in 0..8 {
            ty = match &ty {
                Type::Typedef(t) => match self.btf.resolve_chained_type(t) {
                    Ok(next) => next,
                    Err(_) => return ty,
                },
                Type::Const(t) => match self.btf.resolve_chained_type(t) {
                    Ok(next) => next,
                    Err(_) => return ty,
                },
                Type::Volatile(t) => match self.btf.resolve_chained_type(t) {
                    Ok(next) => next,
                    Err(_) => return ty,
                },
                _ => return ty,
            };
        }
        ty
    }

    /// Byte offset of a dotted member path, e.g. `icsk_ack.lrcvtime`.
    fn offset(&self, strukt: &str, path: &str) -> Result<u32, OffsetError> {
        let err = || OffsetError::NoMember {
            strukt: strukt.into(),
            member: path.into(),
        };
        let mut current = self.structure(strukt)?;
        let mut bits = 0;
        let parts: Vec<&str> = path.split('.').collect();
        for (i, part) in parts.iter().enumerate() {
            let (off, bitfield, ty) = self.find(&current, part).ok_or_else(err)?;
            if bitfield.is_some_and(|b| b != 0) {
                return Err(OffsetError::Unaligned {
                    strukt: strukt.into(),
                    member: path.into(),
                });
            }
            bits += off;
            if i + 1 < parts.len() {
                current = match self.strip(ty) {
                    Type::Struct(s) | Type::Union(s) => s,
                    _ => return Err(err()),
                };
            }
        }
        if bits % 8 != 0 {
            return Err(OffsetError::Unaligned {
                strukt: strukt.into(),
                member: path.into(),
            });
        }
        Ok(bits / 8)
    }
}

/// Resolve every offset the programs need from the BTF file at `path`.
pub fn resolve(path: &Path) -> Result<KernelOffsets, OffsetError> {
    Resolver::open(path)?.offsets()
}

impl Resolver {
    /// Every offset the programs read.
    pub fn offsets(&self) -> Result<KernelOffsets, OffsetError> {
        let r = self;
        let inode_in_alloc = r.offset("socket_alloc", "vfs_inode")?;
        let socket_in_alloc = r.offset("socket_alloc", "socket")?;
        Ok(KernelOffsets {
            valid: KernelOffsets::MAGIC,
            skc_daddr: r.offset("sock_common", "skc_daddr")?,
            skc_rcv_saddr: r.offset("sock_common", "skc_rcv_saddr")?,
            skc_dport: r.offset("sock_common", "skc_dport")?,
            skc_num: r.offset("sock_common", "skc_num")?,
            skc_family: r.offset("sock_common", "skc_family")?,
            skc_state: r.offset("sock_common", "skc_state")?,
            skc_v6_daddr: r.offset("sock_common", "skc_v6_daddr")?,
            skc_v6_rcv_saddr: r.offset("sock_common", "skc_v6_rcv_saddr")?,
            skc_cookie: r.offset("sock_common", "skc_cookie")?,
            sk_protocol: r.offset("sock", "sk_protocol")?,
            sk_socket: r.offset("sock", "sk_socket")?,
            sk_ack_backlog: r.offset("sock", "sk_ack_backlog")?,
            sk_max_ack_backlog: r.offset("sock", "sk_max_ack_backlog")?,
            // `sk_flags` is `#define sk_flags __sk_common.skc_flags` (sock_common is at 0).
            sk_flags: r.offset("sock_common", "skc_flags")?,
            sock_keepopen_bit: r.enum_value("sock_flags", "SOCK_KEEPOPEN")?,
            socket_sk: r.offset("socket", "sk")?,
            socket_to_inode: inode_in_alloc.wrapping_sub(socket_in_alloc),
            inode_ino: r.offset("inode", "i_ino")?,
            tcp_rcv_nxt: r.offset("tcp_sock", "rcv_nxt")?,
            tcp_copied_seq: r.offset("tcp_sock", "copied_seq")?,
            tcp_write_seq: r.offset("tcp_sock", "write_seq")?,
            tcp_snd_una: r.offset("tcp_sock", "snd_una")?,
            tcp_lsndtime: r.offset("tcp_sock", "lsndtime")?,
            tcp_rcv_tstamp: r.offset("tcp_sock", "rcv_tstamp")?,
            icsk_lrcvtime: r.offset("inet_connection_sock", "icsk_ack.lrcvtime")?,
            task_tgid: r.offset("task_struct", "tgid")?,
            task_comm: r.offset("task_struct", "comm")?,
            tw_substate: r.offset("inet_timewait_sock", "tw_substate")?,
            // Linux 6.13+; older kernels age timewait sockets from when connreap first saw them.
            tw_entry_stamp: r
                .offset("inet_timewait_sock", "tw_entry_stamp")
                .unwrap_or(0),
            socket_type: r.offset("socket", "type")?,
            socket_ops: r.offset("socket", "ops")?,
            ops_family: r.offset("proto_ops", "family")?,
            // possible_net_t holds the pointer as `net` (with CONFIG_NET_NS).
            skc_net: r.offset("sock_common", "skc_net.net")?,
            net_ns_inum: r.offset("net", "ns.inum")?,
            task_nsproxy: r.offset("task_struct", "nsproxy")?,
            nsproxy_net_ns: r.offset("nsproxy", "net_ns")?,
            sk_uid: r.offset("sock", "sk_uid")?,
            icsk_qlen: r.offset("inet_connection_sock", "icsk_accept_queue.qlen")?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs wherever the kernel exposes BTF (no root needed: the file is world-readable).
    #[test]
    fn resolves_on_this_kernel() {
        let path = Path::new("/sys/kernel/btf/vmlinux");
        if !path.exists() {
            eprintln!("skipped: no /sys/kernel/btf/vmlinux");
            return;
        }
        let o = resolve(path).expect("offsets");
        // sock_common starts with the address pair; skc_daddr precedes skc_rcv_saddr.
        assert_eq!(o.skc_daddr, 0);
        assert_eq!(o.skc_rcv_saddr, 4);
        assert!(o.tcp_rcv_nxt > o.icsk_lrcvtime);
        assert!(o.task_comm > o.task_tgid);
        assert!(o.socket_to_inode > 0);
        // enum sock_flags { SOCK_DEAD, SOCK_DONE, SOCK_URGINLINE, SOCK_KEEPOPEN, ... }
        assert_eq!(o.sock_keepopen_bit, 3);
        assert!(o.sk_flags > 0);
        assert!(o.net_ns_inum > 0 && o.sk_uid > 0 && o.task_nsproxy > 0);
    }
}
