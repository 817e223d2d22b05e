//! Entering a network namespace through a socket a process holds in it.
//!
//! A namespace stays alive while a socket of it is open, even with no process in it and no
//! name (a process `setns`-ed in, opened sockets and came back; then `ip netns del`). Nothing
//! under /proc or /run names such a namespace; the owner dump finds its sockets and their
//! holders (pid, fd). To enter it, this process takes a duplicate of one of those sockets
//! (`pidfd_open` + `pidfd_getfd`, Linux 5.6; CAP_SYS_PTRACE over the holder) and asks the socket
//! for its namespace (`ioctl(SIOCGSKNS)`, CAP_NET_ADMIN), which gives an fd that `setns(2)`
//! accepts like a namespace file's. The duplicates are closed at once: nothing is kept open.
use std::os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd};

use super::{Namespace, NetnsError, Source};

/// `SIOCGSKNS` (`linux/sockios.h`): a new fd of a socket's network namespace (Linux 4.9).
const SIOCGSKNS: libc::c_ulong = 0x894C;

/// Why a held socket gave no namespace fd.
#[derive(Debug, thiserror::Error)]
pub enum HeldError {
    /// The process exited, closed the descriptor, or holds something else there now: the
    /// namespace may well be alive through other sockets; this holder is no way in.
    #[error("process {pid} no longer holds a socket at fd {fd}")]
    Gone { pid: u32, fd: u32 },
    #[error("cannot open process {pid} (pidfd_open)")]
    Pidfd {
        pid: u32,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot take fd {fd} of process {pid} (pidfd_getfd; connreap needs CAP_SYS_PTRACE)")]
    GetFd {
        pid: u32,
        fd: u32,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "cannot read the network namespace of fd {fd} of process {pid} (SIOCGSKNS; connreap needs CAP_NET_ADMIN)"
    )]
    SockNs {
        pid: u32,
        fd: u32,
        #[source]
        source: std::io::Error,
    },
}

impl HeldError {
    pub fn is_gone(&self) -> bool {
        matches!(self, HeldError::Gone { .. })
    }
}

/// A syscall's fd result as an owned fd, or the error it set.
fn owned(ret: libc::c_long) -> Result<OwnedFd, std::io::Error> {
    if ret < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a non-negative return of a syscall that creates an fd is a new fd that nothing
    // else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(ret as i32) })
}

/// An fd of the network namespace of the socket process `pid` holds at `fd`.
pub(super) fn open(pid: u32, fd: u32) -> Result<OwnedFd, HeldError> {
    let gone = || HeldError::Gone { pid, fd };
    let no_flags: libc::c_long = 0;
    // SAFETY: pidfd_open(pid, flags) takes plain integers (passed as the longs syscall(2)
    // reads) and returns a new fd or -1.
    let pidfd =
        owned(unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::c_long, no_flags) })
            .map_err(|source| match source.raw_os_error() {
                Some(libc::ESRCH) => gone(),
                _ => HeldError::Pidfd { pid, source },
            })?;
    // SAFETY: pidfd_getfd(pidfd, targetfd, flags) takes a pidfd we own and plain integers;
    // it returns a new fd (a duplicate of the target's file) or -1.
    let sock = owned(unsafe {
        libc::syscall(
            libc::SYS_pidfd_getfd,
            pidfd.as_raw_fd() as libc::c_long,
            fd as libc::c_long,
            no_flags,
        )
    })
    .map_err(|source| match source.raw_os_error() {
        // Closed since the dump, or the process is exiting.
        Some(libc::EBADF) | Some(libc::ESRCH) => gone(),
        _ => HeldError::GetFd { pid, fd, source },
    })?;
    // SAFETY: ioctl on an fd we own; SIOCGSKNS takes no argument and returns a new fd or -1.
    owned(unsafe { libc::ioctl(sock.as_raw_fd(), SIOCGSKNS as _) }.into()).map_err(|source| {
        match source.raw_os_error() {
            // Not a socket (the descriptor was reused for another file).
            Some(libc::ENOTTY) | Some(libc::EINVAL) | Some(libc::ENOTSOCK) => gone(),
            _ => HeldError::SockNs { pid, fd, source },
        }
    })
}

impl Namespace {
    /// Namespace `inode`, entered through the socket process `pid` holds at `fd` in it (one of
    /// no process and no name: see the module docs).
    pub fn held(inode: u32, pid: u32, fd: u32) -> Namespace {
        Namespace {
            inode,
            name: None,
            own: false,
            source: Source::Held { pid, fd },
        }
    }

    /// The (pid, fd) of the socket it is entered through, for a namespace known only that way.
    pub fn holder(&self) -> Option<(u32, u32)> {
        match self.source {
            Source::Held { pid, fd } => Some((pid, fd)),
            Source::Path(_) => None,
        }
    }

    /// Whether it can be opened now (and still is this namespace); nothing stays open.
    pub fn check(&self) -> Result<(), NetnsError> {
        self.open().map(drop)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernel::netns::{current_inode, run_in};

    /// A socket in a namespace of its own that nothing else refers to: made by a thread that
    /// unshares its network namespace and ends, so only the socket keeps the namespace alive.
    /// None without the privilege to unshare.
    fn hidden_socket() -> Option<(u32, OwnedFd)> {
        std::thread::spawn(|| {
            // SAFETY: unshare(CLONE_NEWNET) changes only the calling thread's namespace; this
            // thread ends right after.
            if unsafe { libc::unshare(libc::CLONE_NEWNET) } != 0 {
                return None;
            }
            let inode = current_inode().ok()?;
            // SAFETY: socket(2) with plain arguments returns a new fd or -1.
            let sock = owned(
                unsafe { libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0) }
                    .into(),
            )
            .ok()?;
            Some((inode, sock))
        })
        .join()
        .ok()
        .flatten()
    }

    #[test]
    fn a_namespace_is_entered_through_a_held_socket() {
        let Some((inode, sock)) = hidden_socket() else {
            eprintln!("skipped: cannot unshare a network namespace (not root?)");
            return;
        };
        assert_ne!(inode, current_inode().unwrap());
        let me = std::process::id();
        let ns = Namespace::held(inode, me, sock.as_raw_fd() as u32);
        assert_eq!(ns.holder(), Some((me, sock.as_raw_fd() as u32)));
        ns.check().expect("open through the socket");
        assert_eq!(run_in(&ns, current_inode).unwrap().unwrap(), inode);
        // A holder of a socket of another namespace is not a way into this one.
        let wrong = Namespace::held(inode + 1, me, sock.as_raw_fd() as u32);
        assert!(wrong.check().unwrap_err().is_gone());
        // The socket closed: gone, not an error; so for a descriptor that is no socket and a
        // process that is no more.
        let fd = sock.as_raw_fd() as u32;
        drop(sock);
        assert!(ns.check().unwrap_err().is_gone());
        let file = std::fs::File::open("/proc/self/status").unwrap();
        let not_a_socket = Namespace::held(inode, me, file.as_raw_fd() as u32);
        assert!(not_a_socket.check().unwrap_err().is_gone());
        assert!(open(me, fd).unwrap_err().is_gone());
        assert!(open(u32::MAX / 2, 0).unwrap_err().is_gone());
    }
}
