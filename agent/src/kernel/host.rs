//! Preparing the host for a load: bpffs and tracefs mounted, RLIMIT_MEMLOCK on old kernels, and
//! the load lock. (The pin root and directory: `pins`.)
use std::{fs, os::fd::AsRawFd, path::Path};

use super::KernelError;

pub(super) fn is_mounted(path: &str, fstype: &str) -> bool {
    fs::read_to_string("/proc/self/mounts").is_ok_and(|m| {
        m.lines().any(|l| {
            let mut f = l.split_whitespace();
            let _src = f.next();
            f.next() == Some(path) && f.next() == Some(fstype)
        })
    })
}

pub(super) fn ensure_mounted(fstype: &'static str, path: &'static str) -> Result<(), KernelError> {
    if is_mounted(path, fstype) {
        return Ok(());
    }
    let c = |s: &str| std::ffi::CString::new(s).unwrap_or_default();
    let (src, target, ty) = (c(fstype), c(path), c(fstype));
    // SAFETY: plain mount(2) with valid NUL-terminated strings.
    let rc = unsafe {
        libc::mount(
            src.as_ptr(),
            target.as_ptr(),
            ty.as_ptr(),
            0,
            std::ptr::null(),
        )
    };
    if rc != 0 {
        return Err(KernelError::Mount {
            fs: fstype,
            path,
            source: std::io::Error::last_os_error(),
        });
    }
    tracing::warn!(
        fstype,
        path,
        "mounted {fstype} at {path}: if this mount namespace is not the host's, the pinned state tracker is private to it (enter only the network namespace, e.g. nsenter --net)"
    );
    Ok(())
}

/// Kernels before 5.11 charge BPF memory to RLIMIT_MEMLOCK; newer ones use the memcg. Raising
/// the limit may be refused (no CAP_SYS_RESOURCE): that is fine on new kernels.
pub(super) fn raise_memlock() {
    let lim = libc::rlimit {
        rlim_cur: libc::RLIM_INFINITY,
        rlim_max: libc::RLIM_INFINITY,
    };
    // SAFETY: setrlimit with a valid struct.
    if unsafe { libc::setrlimit(libc::RLIMIT_MEMLOCK, &lim) } != 0 {
        tracing::debug!("could not raise RLIMIT_MEMLOCK (fine on kernels >= 5.11)");
    }
}

/// An exclusive flock held while loading or changing pins (released on drop). Best effort:
/// without it the load still works, only the rare simultaneous first load can fail.
pub(super) fn load_lock() -> Option<fs::File> {
    let f = open_load_lock()?;
    // SAFETY: flock on an fd we own.
    if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) } != 0 {
        return None;
    }
    Some(f)
}

/// The load lock is held by another process right now.
#[derive(Debug)]
pub(super) struct LockBusy;

/// [`load_lock`] without waiting: a daemon repairing its pins between scans must not stall
/// its scans behind a slow load elsewhere; it tries again at the next scan.
pub(super) fn try_load_lock() -> Result<Option<fs::File>, LockBusy> {
    let Some(f) = open_load_lock() else {
        return Ok(None);
    };
    // SAFETY: flock on an fd we own.
    if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        return match std::io::Error::last_os_error().raw_os_error() {
            Some(libc::EWOULDBLOCK) => Err(LockBusy),
            _ => Ok(None),
        };
    }
    Ok(Some(f))
}

fn open_load_lock() -> Option<fs::File> {
    let dir = Path::new("/run/lock");
    let _ = fs::create_dir_all(dir);
    fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(dir.join("connreap.load.lock"))
        .ok()
}
