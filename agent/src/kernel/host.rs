//! Preparing the host for a load: bpffs and tracefs mounted, RLIMIT_MEMLOCK on old kernels, the
//! pin directory of this build (other builds' pins removed), and the load lock.
use std::{
    fs,
    os::fd::AsRawFd,
    path::{Path, PathBuf},
};

use super::{KernelError, OBJECT};

const PIN_ROOT: &str = "/sys/fs/bpf/connreap";
/// Overrides [`PIN_ROOT`]: a second connreap with another root (on bpffs) runs its own tracker
/// next to the first instead of replacing it (a canary build; the benchmarks' side-by-side
/// measures).
const PIN_ROOT_ENV: &str = "CONNREAP_PIN_ROOT";

fn pin_root() -> PathBuf {
    std::env::var_os(PIN_ROOT_ENV)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(PIN_ROOT))
}

fn is_mounted(path: &str, fstype: &str) -> bool {
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

fn object_hash(object: &[u8]) -> String {
    // FNV-1a: only needs to tell object versions apart.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in object {
        h ^= *b as u64;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    format!("{h:016x}")
}

pub(super) fn pin_error(path: &Path, source: aya::pin::PinError) -> KernelError {
    KernelError::Pin {
        path: path.to_path_buf(),
        source,
    }
}

/// The directory for this object's pins; stale directories from other builds are removed
/// (removing the pinned link detaches the old tracker).
pub(super) fn prepare_pin_dir() -> Result<PathBuf, KernelError> {
    let root = pin_root();
    let dir = root.join(object_hash(OBJECT));
    fs::create_dir_all(&dir).map_err(|source| KernelError::PinDir {
        path: dir.clone(),
        source,
    })?;
    if let Ok(entries) = fs::read_dir(&root) {
        for e in entries.flatten() {
            if e.path() != dir {
                tracing::info!(path = %e.path().display(), "removing tracker pinned by another connreap build");
                let _ = fs::remove_dir_all(e.path());
            }
        }
    }
    Ok(dir)
}

/// An exclusive flock held while loading (released on drop). Best effort: without it the load
/// still works, only the rare simultaneous first load can fail.
pub(super) fn load_lock() -> Option<fs::File> {
    let dir = Path::new("/run/lock");
    let _ = fs::create_dir_all(dir);
    let f = fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(dir.join("connreap.load.lock"))
        .ok()?;
    // SAFETY: flock on an fd we own.
    if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) } != 0 {
        return None;
    }
    Some(f)
}

/// Remove every pin (detaches the state tracker). Used by `connreap unpin`.
pub fn unpin_all() -> std::io::Result<bool> {
    match fs::remove_dir_all(pin_root()) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn object_hash_differs_per_content() {
        assert_ne!(object_hash(b"a"), object_hash(b"b"));
        assert_eq!(object_hash(b"a").len(), 16);
    }
}
