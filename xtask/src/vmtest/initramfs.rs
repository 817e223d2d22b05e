//! The guest's initramfs, as an uncompressed cpio ("newc") archive written here (no cpio tool
//! needed; the kernel unpacks it without a decompressor, which is faster under TCG). A base
//! archive (busybox, the binaries and their libraries, /init) is shared by all kernels; each
//! kernel appends a small second archive with its config and diag modules, which the kernel
//! unpacks over the first.
use std::{collections::BTreeSet, path::Path, process::Command};

use anyhow::{bail, Context, Result};

/// A cpio newc archive being built in memory.
#[derive(Default)]
pub struct Cpio {
    out: Vec<u8>,
    ino: u32,
    dirs: BTreeSet<String>,
}

impl Cpio {
    fn entry(&mut self, name: &str, mode: u32, rdev: (u32, u32), data: &[u8]) {
        self.ino += 1;
        let fields = [
            self.ino,
            mode,
            0, // uid
            0, // gid
            if mode & 0o170000 == 0o040000 { 2 } else { 1 },
            0, // mtime
            data.len() as u32,
            0, // dev major
            0, // dev minor
            rdev.0,
            rdev.1,
            name.len() as u32 + 1,
            0, // check
        ];
        self.out.extend_from_slice(b"070701");
        for f in fields {
            self.out.extend_from_slice(format!("{f:08x}").as_bytes());
        }
        self.out.extend_from_slice(name.as_bytes());
        self.out.push(0);
        self.pad();
        self.out.extend_from_slice(data);
        self.pad();
    }

    fn pad(&mut self) {
        while !self.out.len().is_multiple_of(4) {
            self.out.push(0);
        }
    }

    /// A directory and its parents (names without the leading slash).
    pub fn dir(&mut self, path: &str) {
        let mut prefix = String::new();
        for part in path.trim_matches('/').split('/') {
            if !prefix.is_empty() {
                prefix.push('/');
            }
            prefix.push_str(part);
            if self.dirs.insert(prefix.clone()) {
                let name = prefix.clone();
                self.entry(&name, 0o040755, (0, 0), &[]);
            }
        }
    }

    pub fn file(&mut self, path: &str, mode: u32, data: &[u8]) {
        let path = path.trim_start_matches('/');
        if let Some((parent, _)) = path.rsplit_once('/') {
            self.dir(parent);
        }
        self.entry(path, 0o100000 | mode, (0, 0), data);
    }

    pub fn char_dev(&mut self, path: &str, major: u32, minor: u32) {
        let path = path.trim_start_matches('/');
        if let Some((parent, _)) = path.rsplit_once('/') {
            self.dir(parent);
        }
        self.entry(path, 0o020600, (major, minor), &[]);
    }

    pub fn finish(mut self) -> Vec<u8> {
        self.entry("TRAILER!!!", 0, (0, 0), &[]);
        self.out
    }
}

/// Shared libraries `ldd` lists for `bin`, with the paths the dynamic loader will look at.
fn libraries(bin: &Path) -> Result<Vec<String>> {
    let out = Command::new("ldd").arg(bin).output()?;
    if !out.status.success() {
        bail!("ldd {} failed", bin.display());
    }
    let text = String::from_utf8_lossy(&out.stdout);
    Ok(text
        .lines()
        .filter_map(|l| {
            // "libc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x...)" or "/lib64/ld-linux-x86-64.so.2 (0x...)"
            let path = match l.split_once("=>") {
                Some((_, rest)) => rest.split_whitespace().next()?,
                None => l.split_whitespace().next()?,
            };
            path.starts_with('/').then(|| path.to_string())
        })
        .collect())
}

/// The archive every kernel boots: busybox as /bin/busybox, `bins` under /bin with their
/// libraries, and `init` as /init.
pub fn base(busybox: &Path, bins: &[&Path], init: &str) -> Result<Vec<u8>> {
    let mut cpio = Cpio::default();
    for d in [
        "bin", "sbin", "usr/bin", "usr/sbin", "proc", "sys", "dev", "tmp", "run", "etc", "boot",
        "root", "var/lib",
    ] {
        cpio.dir(d);
    }
    // The kernel opens /dev/console for init before anything is mounted.
    cpio.char_dev("dev/console", 5, 1);
    let read = |p: &Path| std::fs::read(p).with_context(|| format!("reading {}", p.display()));
    cpio.file("bin/busybox", 0o755, &read(busybox)?);
    let mut libs = BTreeSet::new();
    for bin in bins {
        let name = bin
            .file_name()
            .and_then(|n| n.to_str())
            .context("binary without a file name")?;
        cpio.file(&format!("bin/{name}"), 0o755, &read(bin)?);
        libs.extend(libraries(bin)?);
    }
    for lib in &libs {
        // std::fs::read follows the symlinks (e.g. /lib64 -> usr/lib64 on merged-/usr hosts).
        cpio.file(lib, 0o755, &read(Path::new(lib))?);
    }
    cpio.file("init", 0o755, init.as_bytes());
    Ok(cpio.finish())
}

/// The per-kernel archive: the kernel's config (connreap reads CONFIG_HZ there) and modules.
pub fn kernel_extras(release: &str, config: &Path, modules: &Path) -> Result<Vec<u8>> {
    let mut cpio = Cpio::default();
    cpio.file(
        &format!("boot/config-{release}"),
        0o644,
        &std::fs::read(config)?,
    );
    for m in ["inet_diag", "tcp_diag"] {
        let data = std::fs::read(modules.join(format!("{m}.ko")))?;
        cpio.file(&format!("lib/modules/{m}.ko"), 0o644, &data);
    }
    Ok(cpio.finish())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn newc_entries_are_aligned_and_end_with_a_trailer() {
        let mut c = Cpio::default();
        c.file("a/b/c", 0o644, b"hello");
        let out = c.finish();
        assert_eq!(out.len() % 4, 0);
        let text = String::from_utf8_lossy(&out);
        // a, a/b, a/b/c, trailer
        assert_eq!(text.matches("070701").count(), 4);
        assert!(text.contains("a/b/c\0"));
        assert!(text.contains("TRAILER!!!\0"));
        // The file's header: mode 0100644, size 5, name size 6.
        let at = text.find("a/b/c\0").unwrap() - 110;
        let header = &text[at..at + 110];
        assert_eq!(&header[14..22], "000081a4");
        assert_eq!(&header[54..62], "00000005");
        assert_eq!(&header[94..102], "00000006");
    }
}
