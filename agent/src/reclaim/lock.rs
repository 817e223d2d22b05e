//! One reclaimer per host: an exclusive, non-blocking flock that a process holds while it may
//! close sockets. Two agents (or an agent and `connreap reclaim`) never run rounds on the same
//! targets at once; the lock file names its holder.
use std::{
    fs::{self, File, OpenOptions},
    io::{Read, Seek, Write},
    os::fd::AsRawFd,
    path::PathBuf,
};

/// Where the lock lives (`CONNREAP_LOCK_DIR` overrides, e.g. for a canary with its own pins).
fn lock_path() -> PathBuf {
    let dir = std::env::var_os("CONNREAP_LOCK_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/run/lock"));
    dir.join("connreap.reclaim.lock")
}

/// The held lock (released when dropped, or when the process exits).
#[derive(Debug)]
pub struct ReclaimLock {
    _file: File,
}

#[derive(Debug, thiserror::Error)]
pub enum LockError {
    #[error("another connreap holds the reclaim lock {path} ({holder})")]
    Held { path: String, holder: String },
    #[error("cannot open the reclaim lock {path}: {error}")]
    Open { path: String, error: std::io::Error },
}

impl ReclaimLock {
    /// Take the lock now or say who has it. `role` ("daemon", "cli") is written for others.
    pub fn try_acquire(role: &str) -> Result<ReclaimLock, LockError> {
        let path = lock_path();
        let shown = path.display().to_string();
        let open_err = |error| LockError::Open {
            path: shown.clone(),
            error,
        };
        if let Some(dir) = path.parent() {
            fs::create_dir_all(dir).map_err(open_err)?;
        }
        let mut f = OpenOptions::new()
            .create(true)
            .truncate(false)
            .read(true)
            .write(true)
            .open(&path)
            .map_err(open_err)?;
        // SAFETY: flock on an fd this function owns.
        if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            let mut holder = String::new();
            let _ = f.read_to_string(&mut holder);
            let holder = holder.trim();
            return Err(LockError::Held {
                path: shown,
                holder: if holder.is_empty() {
                    "holder unknown".into()
                } else {
                    holder.to_string()
                },
            });
        }
        let me = format!("pid {} ({role})\n", std::process::id());
        let _ = f
            .set_len(0)
            .and_then(|()| f.rewind())
            .and_then(|()| f.write_all(me.as_bytes()));
        Ok(ReclaimLock { _file: f })
    }
}
