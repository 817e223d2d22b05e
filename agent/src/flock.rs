//! An exclusive `flock(2)` held for a scope, by which connreap processes take turns: appenders
//! of one audit log (reclaim/audit.rs) and sweeps through one pin directory (kernel/sweep.rs).
use std::fs::File;

/// The lock on a file (or directory) held until drop; the kernel also releases it when the
/// process dies holding it.
pub struct Exclusive<'a>(&'a File);

impl<'a> Exclusive<'a> {
    /// Block until this process holds the lock on `f`.
    pub fn lock(f: &'a File) -> std::io::Result<Self> {
        f.lock()?;
        Ok(Exclusive(f))
    }
}

impl Drop for Exclusive<'_> {
    fn drop(&mut self) {
        // Unlocking a lock this process holds does not fail; closing the file would release it
        // anyway.
        let _ = self.0.unlock();
    }
}
