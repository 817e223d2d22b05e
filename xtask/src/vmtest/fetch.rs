//! What the VMs need from Debian's archive: QEMU from bookworm-backports (installed on the
//! host), and kernel packages plus busybox-static (downloaded and unpacked under the work
//! directory, never installed). Extra suites go through a private apt configuration (its own
//! sources list, package lists and cache) so the host's apt setup is left as it was.
use std::{
    path::{Path, PathBuf},
    process::Command,
    time::{Duration, SystemTime},
};

use anyhow::{bail, Context, Result};

use crate::run;

/// Suites the matrix takes packages from, plus bookworm's own for QEMU's dependencies.
const SOURCES: &str = "\
deb http://deb.debian.org/debian bookworm main
deb http://deb.debian.org/debian bookworm-updates main
deb http://deb.debian.org/debian-security bookworm-security main
deb http://deb.debian.org/debian bookworm-backports main
deb http://deb.debian.org/debian-security bullseye-security main
";

/// Package lists younger than this are reused (local reruns); CI starts without any.
const LISTS_MAX_AGE: Duration = Duration::from_secs(3600);

/// Bookworm's own QEMU (7.2) corrupts 6.12 guests under TCG; 10.0 from backports does not.
const QEMU_MIN_MAJOR: u32 = 10;
pub const QEMU: &str = "qemu-system-x86_64";

/// apt with the private configuration under `dir`.
pub struct Apt {
    dir: PathBuf,
}

impl Apt {
    pub fn new(dir: &Path) -> Result<Apt> {
        for sub in ["lists/partial", "parts", "cache/archives/partial"] {
            std::fs::create_dir_all(dir.join(sub))?;
        }
        std::fs::write(dir.join("sources.list"), SOURCES)?;
        Ok(Apt {
            dir: dir.to_path_buf(),
        })
    }

    fn options(&self) -> Vec<String> {
        let d = self.dir.display();
        vec![
            format!("-oDir::Etc::SourceList={d}/sources.list"),
            format!("-oDir::Etc::SourceParts={d}/parts"),
            format!("-oDir::State::Lists={d}/lists"),
            format!("-oDir::Cache={d}/cache"),
            // Downloads land in our own directories, which the _apt user may not reach.
            "-oAPT::Sandbox::User=root".into(),
            "-qq".into(),
        ]
    }

    fn cmd(&self, tool: &str) -> Command {
        let mut c = Command::new(tool);
        c.args(self.options())
            .env("DEBIAN_FRONTEND", "noninteractive");
        c
    }

    fn output(&self, tool: &str, args: &[&str]) -> Result<String> {
        let out = self.cmd(tool).args(args).output()?;
        if !out.status.success() {
            bail!(
                "{tool} {} failed: {}",
                args.join(" "),
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// `apt-get update` on the private lists, unless they were updated within the hour. The
    /// host's own lists seed them, so only the extra suites' indexes are downloaded.
    pub fn update(&self) -> Result<()> {
        let lists = self.dir.join("lists");
        let stamp = self.dir.join("updated");
        let fresh = std::fs::metadata(&stamp)
            .and_then(|m| m.modified())
            .is_ok_and(|t| {
                SystemTime::now()
                    .duration_since(t)
                    .is_ok_and(|age| age < LISTS_MAX_AGE)
            });
        if fresh {
            return Ok(());
        }
        if let Ok(entries) = std::fs::read_dir("/var/lib/apt/lists") {
            for e in entries.flatten() {
                let name = e.file_name();
                if name.to_string_lossy().starts_with("deb.debian.org_")
                    && !lists.join(&name).exists()
                {
                    let _ = std::fs::copy(e.path(), lists.join(&name));
                }
            }
        }
        run(self.cmd("apt-get").arg("update"))?;
        std::fs::write(stamp, b"")?;
        Ok(())
    }

    /// The version of `package` that `suite` carries.
    fn version_in(&self, package: &str, suite: &str) -> Result<String> {
        let policy = self.output("apt-cache", &["policy", package])?;
        version_in_policy(&policy, suite)
            .with_context(|| format!("{suite} has no {package} (apt-cache policy:\n{policy})"))
    }

    /// The kernel image package a metapackage of `suite` points at: (name, version).
    pub fn resolve_image(&self, meta: &str, suite: &str) -> Result<(String, String)> {
        let version = self.version_in(meta, suite)?;
        let show = self.output("apt-cache", &["show", &format!("{meta}={version}")])?;
        let depends = show
            .lines()
            .find_map(|l| l.strip_prefix("Depends: "))
            .with_context(|| format!("{meta}={version} has no Depends"))?;
        let image = depends
            .split(',')
            .map(|d| d.trim())
            .find(|d| d.starts_with("linux-image-"))
            .and_then(|d| d.split_whitespace().next())
            .with_context(|| format!("{meta}={version} depends on no linux-image: {depends}"))?;
        Ok((image.to_string(), version))
    }

    /// Download `package=version` into `dir` unless it is there already; returns the .deb.
    pub fn download(&self, package: &str, version: &str, dir: &Path) -> Result<PathBuf> {
        std::fs::create_dir_all(dir)?;
        // apt names the file package_version_arch.deb, with an epoch's colon as %3a.
        let prefix = format!("{package}_{}_", version.replace(':', "%3a"));
        let find = || -> Option<PathBuf> {
            std::fs::read_dir(dir)
                .ok()?
                .flatten()
                .map(|e| e.path())
                .find(|p| {
                    p.file_name()
                        .and_then(|n| n.to_str())
                        .is_some_and(|n| n.starts_with(&prefix) && n.ends_with(".deb"))
                })
        };
        if let Some(deb) = find() {
            return Ok(deb);
        }
        eprintln!("vmtest: downloading {package} {version}");
        run(self
            .cmd("apt-get")
            .current_dir(dir)
            .args(["download", &format!("{package}={version}")]))?;
        find().with_context(|| format!("apt-get download {package}={version} left no .deb"))
    }

    /// Install QEMU from bookworm-backports unless a new enough one is there (idempotent).
    pub fn ensure_qemu(&self) -> Result<()> {
        if let Some(major) = qemu_major() {
            if major >= QEMU_MIN_MAJOR {
                return Ok(());
            }
            eprintln!("vmtest: {QEMU} {major}.x crashes 6.12 guests under TCG; upgrading");
        }
        // SAFETY: geteuid has no preconditions and cannot fail.
        if unsafe { libc::geteuid() } != 0 {
            bail!(
                "vmtest needs {QEMU} >= {QEMU_MIN_MAJOR} (bookworm-backports); installing it needs root"
            );
        }
        eprintln!("vmtest: installing qemu-system-x86 from bookworm-backports with apt");
        self.update()?;
        run(self.cmd("apt-get").args([
            "install",
            "-y",
            "--no-install-recommends",
            "-t",
            "bookworm-backports",
            "qemu-system-x86",
        ]))?;
        match qemu_major() {
            Some(m) if m >= QEMU_MIN_MAJOR => Ok(()),
            other => bail!("after the install {QEMU} reports major version {other:?}"),
        }
    }
}

/// The installed QEMU's major version, if any.
fn qemu_major() -> Option<u32> {
    let out = Command::new(QEMU).arg("--version").output().ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    // "QEMU emulator version 10.0.2 (Debian 1:10.0.2+ds-2+deb13u1~bpo12+1)"
    let version = text.split("version ").nth(1)?;
    version.split('.').next()?.trim().parse().ok()
}

/// From `apt-cache policy` output: the version whose origins include `suite`.
fn version_in_policy(policy: &str, suite: &str) -> Option<String> {
    let mut current: Option<&str> = None;
    for line in policy.lines() {
        let t = line.trim_start_matches(['*', ' ']);
        let words: Vec<&str> = t.split_whitespace().collect();
        // A version line: "6.12.95-1~bpo12+1 100"; an origin line: "100 http://... suite/main ...".
        match words.as_slice() {
            [v, prio] if prio.parse::<i32>().is_ok() && !v.ends_with(':') => current = Some(v),
            [_, url, dist, ..]
                if url.starts_with("http") && dist.split('/').next() == Some(suite) =>
            {
                if let Some(v) = current {
                    return Some(v.to_string());
                }
            }
            _ => {}
        }
    }
    None
}

/// Unpack the parts of a kernel package a VM needs (image, config, diag modules) into `dir`,
/// unless done already. Returns the kernel release (e.g. `6.1.0-57-cloud-amd64`).
pub fn unpack_kernel(deb: &Path, dir: &Path) -> Result<String> {
    let release_of = |dir: &Path| -> Option<String> {
        std::fs::read_dir(dir.join("boot"))
            .ok()?
            .flatten()
            .find_map(|e| {
                e.file_name()
                    .to_str()?
                    .strip_prefix("vmlinuz-")
                    .map(str::to_string)
            })
    };
    if let Some(release) = release_of(dir) {
        if dir.join("modules/tcp_diag.ko").exists() {
            return Ok(release);
        }
    }
    std::fs::create_dir_all(dir)?;
    let script = format!(
        "dpkg-deb --fsys-tarfile '{}' | tar -xf - -C '{}' --wildcards \
         './boot/vmlinuz-*' './boot/config-*' '*/net/ipv4/inet_diag.ko*' '*/net/ipv4/tcp_diag.ko*'",
        deb.display(),
        dir.display()
    );
    run(Command::new("sh").args(["-c", &script]))?;
    let release = release_of(dir).with_context(|| format!("{} has no vmlinuz", deb.display()))?;
    let modules = dir.join("modules");
    std::fs::create_dir_all(&modules)?;
    for name in ["inet_diag", "tcp_diag"] {
        let found = find_file(dir, &|n| n.starts_with(&format!("{name}.ko")))
            .with_context(|| format!("{} has no {name} module", deb.display()))?;
        decompress_module(&found, &modules.join(format!("{name}.ko")))?;
    }
    Ok(release)
}

/// Copy a module, decompressing .ko.xz / .ko.zst (busybox insmod takes plain ELF). The
/// signature is inside the compressed file, so lockdown still accepts the result.
fn decompress_module(from: &Path, to: &Path) -> Result<()> {
    let name = from.to_string_lossy();
    let tool = if name.ends_with(".xz") {
        Some("xz")
    } else if name.ends_with(".zst") {
        Some("zstd")
    } else {
        None
    };
    match tool {
        None => {
            std::fs::copy(from, to)?;
        }
        Some(tool) => {
            let out = Command::new(tool).arg("-dc").arg(from).output()?;
            if !out.status.success() {
                bail!("{tool} -dc {name} failed");
            }
            std::fs::write(to, out.stdout)?;
        }
    }
    Ok(())
}

fn find_file(dir: &Path, pred: &dyn Fn(&str) -> bool) -> Option<PathBuf> {
    for e in std::fs::read_dir(dir).ok()?.flatten() {
        let path = e.path();
        let ft = e.file_type().ok()?;
        if ft.is_dir() {
            if let Some(p) = find_file(&path, pred) {
                return Some(p);
            }
        } else if e.file_name().to_str().is_some_and(pred) {
            return Some(path);
        }
    }
    None
}

/// busybox-static's binary, downloaded and unpacked into `dir`.
pub fn busybox(apt: &Apt, dir: &Path) -> Result<PathBuf> {
    let bin = dir.join("bin/busybox");
    if bin.exists() {
        return Ok(bin);
    }
    let version = apt.version_in("busybox-static", "bookworm")?;
    let deb = apt.download("busybox-static", &version, dir)?;
    run(Command::new("dpkg-deb").arg("-x").arg(&deb).arg(dir))?;
    if !bin.exists() {
        bail!("{} has no bin/busybox", deb.display());
    }
    Ok(bin)
}

#[cfg(test)]
mod tests {
    use super::*;

    const POLICY: &str = "\
linux-image-cloud-amd64:
  Installed: (none)
  Candidate: 6.1.192-3
  Version table:
     6.12.95-1~bpo12+1 100
        100 http://deb.debian.org/debian bookworm-backports/main amd64 Packages
 *** 6.1.192-3 500
        500 http://deb.debian.org/debian-security bookworm-security/main amd64 Packages
        100 /var/lib/dpkg/status
     6.1.176-1 500
        500 http://deb.debian.org/debian bookworm/main amd64 Packages
     5.10.262-1 500
        500 http://deb.debian.org/debian-security bullseye-security/main amd64 Packages
";

    #[test]
    fn picks_the_version_of_a_suite() {
        let v = |s| version_in_policy(POLICY, s);
        assert_eq!(
            v("bookworm-backports").as_deref(),
            Some("6.12.95-1~bpo12+1")
        );
        assert_eq!(v("bookworm-security").as_deref(), Some("6.1.192-3"));
        assert_eq!(v("bookworm").as_deref(), Some("6.1.176-1"));
        assert_eq!(v("bullseye-security").as_deref(), Some("5.10.262-1"));
        assert_eq!(v("trixie"), None);
    }
}
