//! A small tmpfs mounted for one test (a full or read-only filesystem under the audit log),
//! unmounted on drop.

use std::{
    ffi::CString,
    fs,
    io::{ErrorKind, Write},
    os::unix::ffi::OsStrExt,
    path::{Path, PathBuf},
};

/// Name of the file [`Tmpfs::fill`] writes.
const FILLER: &str = "filler";

/// A tmpfs of a few KiB at a directory of the test (created if missing), in the host's mount
/// namespace (the agent enters the test's network namespace only, so it sees the mount).
/// Unmounted (lazily, so a process still holding a file on it cannot block the test) on drop.
pub struct Tmpfs {
    root: PathBuf,
}

fn c_path(p: &Path) -> CString {
    CString::new(p.as_os_str().as_bytes())
        .unwrap_or_else(|e| panic!("path with a NUL byte: {}: {e}", p.display()))
}

impl Tmpfs {
    /// Mount a tmpfs of `size` bytes (rounded up to pages) at `root`, read-only if `read_only`.
    pub fn mount(root: &Path, size: usize, read_only: bool) -> Tmpfs {
        fs::create_dir_all(root).unwrap_or_else(|e| panic!("mkdir {}: {e}", root.display()));
        let target = c_path(root);
        let data = CString::new(format!("size={size},mode=0755")).expect("no NUL");
        let flags = if read_only { libc::MS_RDONLY } else { 0 };
        // SAFETY: every pointer is a valid NUL-terminated string that outlives the call.
        let rc = unsafe {
            libc::mount(
                c"connreap-e2e".as_ptr(),
                target.as_ptr(),
                c"tmpfs".as_ptr(),
                flags,
                data.as_ptr().cast(),
            )
        };
        if rc != 0 {
            panic!(
                "mount -t tmpfs -o size={size} at {}: {}",
                root.display(),
                std::io::Error::last_os_error()
            );
        }
        Tmpfs {
            root: root.to_path_buf(),
        }
    }

    /// `name` on this filesystem.
    pub fn path(&self, name: &str) -> PathBuf {
        self.root.join(name)
    }

    /// Fill the filesystem: write a filler file until the kernel answers ENOSPC. Returns the
    /// bytes written.
    pub fn fill(&self) -> u64 {
        let path = self.path(FILLER);
        let mut f = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .unwrap_or_else(|e| panic!("open {}: {e}", path.display()));
        let chunk = [0xa5u8; 512];
        let mut written = 0u64;
        loop {
            match f.write(&chunk) {
                Ok(0) => break,
                Ok(n) => written += n as u64,
                Err(e) if e.raw_os_error() == Some(libc::ENOSPC) => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => panic!("filling {}: {e}", path.display()),
            }
        }
        // Nothing more fits, not even one byte.
        let one = f.write(b"x");
        assert!(
            one.as_ref()
                .is_err_and(|e| e.raw_os_error() == Some(libc::ENOSPC)),
            "{} is not full after {written} bytes: {one:?}",
            self.root.display()
        );
        written
    }

    /// Free the space [`Tmpfs::fill`] took.
    pub fn free(&self) {
        let path = self.path(FILLER);
        fs::remove_file(&path).unwrap_or_else(|e| panic!("rm {}: {e}", path.display()));
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let target = c_path(&self.root);
        // SAFETY: a valid NUL-terminated path; MNT_DETACH unmounts even while files are open.
        if unsafe { libc::umount2(target.as_ptr(), libc::MNT_DETACH) } != 0 {
            eprintln!(
                "warning: could not unmount {}: {}",
                self.root.display(),
                std::io::Error::last_os_error()
            );
        }
    }
}
