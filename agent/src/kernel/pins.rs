//! The pin root and what connreap keeps in it.
//!
//! connreap pins its state tracker under `<root>/<object-hash>/` (root `/sys/fs/bpf/connreap`,
//! or `CONNREAP_PIN_ROOT`). The root may hold other things (someone's own pins, another tool's
//! directory): connreap only ever removes what it created, which it recognizes by name — a
//! directory named like an object hash (16 lowercase hex digits), and in it only the pins named
//! in [`PIN_NAMES`]. Anything else stays, and so does a directory still holding it. bpffs cannot
//! hold a regular file or a symlink, so there is no marker file: the names are the mark.
//!
//! A root that is itself a mount point (`CONNREAP_PIN_ROOT=/sys/fs/bpf`) or not on bpffs is
//! refused before anything is created or removed.
use std::{
    fs, io,
    path::{Path, PathBuf},
};

use aya::programs::links::PinnedLink;

use super::{KernelError, OBJECT};

const PIN_ROOT: &str = "/sys/fs/bpf/connreap";
/// Overrides [`PIN_ROOT`]: a second connreap with another root (on bpffs) runs its own tracker
/// next to the first instead of replacing it (a canary build; the benchmarks' side-by-side
/// measures).
const PIN_ROOT_ENV: &str = "CONNREAP_PIN_ROOT";

/// Every pin connreap creates in its object-hash directory: the tracker's link, the maps it
/// shares, the iterators and the flush program. Nothing else there is ever removed.
pub(super) const PIN_NAMES: [&str; 15] = [
    "link",
    "state",
    "events",
    "counters",
    "staging",
    "logs",
    "iter_tcp",
    "iter_task_file",
    "iter_netns_socks",
    "flush",
    "sweep",
    "sweep_unrolled",
    "sweep_out",
    // The bench-only sk-storage build's map and iterator (see sk_pass.rs).
    "sk",
    "iter_sk",
];

/// `statfs(2)`'s f_type of a bpf filesystem.
const BPF_FS_MAGIC: i64 = 0xcafe_4a11;

/// The pin root, checked: absolute, on bpffs, and not a mount point itself.
pub(super) fn pin_root() -> Result<PathBuf, KernelError> {
    let root = root_path();
    check_root(&root)?;
    Ok(root)
}

fn root_path() -> PathBuf {
    std::env::var_os(PIN_ROOT_ENV)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(PIN_ROOT))
}

fn check_root(root: &Path) -> Result<(), KernelError> {
    let bad = |why: String| KernelError::PinRoot {
        root: root.to_path_buf(),
        why,
    };
    if !root.is_absolute() {
        return Err(bad("not an absolute path".into()));
    }
    // An existing root is judged by where it really is (a trailing slash, `..`, a symlink).
    let real = fs::canonicalize(root).ok();
    if let Some(real) = &real {
        let mountinfo = fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
        if let Some(fstype) = mount_at(&mountinfo, real) {
            return Err(bad(format!(
                "it is a mount point ({fstype}) itself; connreap removes what it created under \
                 its root and wants one of its own: use a directory under it, e.g. {}",
                real.join("connreap-canary").display()
            )));
        }
    }
    // The nearest existing ancestor tells the filesystem the pins would land on.
    let probe = real.unwrap_or_else(|| {
        root.ancestors()
            .find(|a| a.exists())
            .unwrap_or(Path::new("/"))
            .to_path_buf()
    });
    match fs_type(&probe) {
        Some(t) if t != BPF_FS_MAGIC => Err(bad(format!(
            "{} is not on a bpf filesystem (BPF objects can only be pinned on bpffs, e.g. \
             under /sys/fs/bpf)",
            probe.display()
        ))),
        _ => Ok(()),
    }
}

/// The filesystem type (`f_type`) of `path`, if it can be read.
fn fs_type(path: &Path) -> Option<i64> {
    use std::os::unix::ffi::OsStrExt as _;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).ok()?;
    let mut st = std::mem::MaybeUninit::<libc::statfs>::uninit();
    // SAFETY: statfs with a valid NUL-terminated path and a buffer of the right type.
    if unsafe { libc::statfs(c.as_ptr(), st.as_mut_ptr()) } != 0 {
        return None;
    }
    // SAFETY: statfs returned 0, so it filled the buffer.
    #[allow(clippy::unnecessary_cast)]
    Some(unsafe { st.assume_init() }.f_type as i64)
}

/// The filesystem type mounted exactly at `path`, from `/proc/self/mountinfo` (whose mount
/// points escape space, tab, newline and backslash in octal).
fn mount_at(mountinfo: &str, path: &Path) -> Option<String> {
    let want = path.to_str()?;
    mountinfo.lines().find_map(|l| {
        let (left, right) = l.split_once(" - ")?;
        let point = left.split(' ').nth(4)?;
        (unescape(point) == want).then(|| right.split(' ').next().unwrap_or("?").to_string())
    })
}

fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let oct = b
            .get(i + 1..i + 4)
            .filter(|d| d.iter().all(|c| (b'0'..=b'7').contains(c)));
        match (b[i], oct) {
            (b'\\', Some(d)) => {
                out.push(
                    d.iter()
                        .fold(0u8, |acc, c| acc.wrapping_mul(8) + (c - b'0')),
                );
                i += 4;
            }
            (c, _) => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
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

/// Whether `name` is one of connreap's object-hash directories.
fn is_hash_dir_name(name: &str) -> bool {
    name.len() == 16 && name.bytes().all(|c| matches!(c, b'0'..=b'9' | b'a'..=b'f'))
}

/// This build's pin directory under `root`, created if missing.
pub(super) fn create_pin_dir(root: &Path) -> Result<PathBuf, KernelError> {
    let dir = root.join(object_hash(OBJECT));
    fs::create_dir_all(&dir).map_err(|source| KernelError::PinDir {
        path: dir.clone(),
        source,
    })?;
    Ok(dir)
}

/// The directory for this object's pins; other builds' pin directories are removed (removing
/// a pinned link detaches that build's tracker). Nothing connreap did not create is touched.
pub(super) fn prepare_pin_dir() -> Result<PathBuf, KernelError> {
    let root = pin_root()?;
    let dir = create_pin_dir(&root)?;
    for other in own_dirs(&root).into_iter().filter(|d| *d != dir) {
        tracing::info!(path = %other.display(), "removing tracker pinned by another connreap build");
        remove_own_pins(&other);
    }
    Ok(dir)
}

/// Remove connreap's pins in its directory `dir` (a load then starts afresh there).
pub(super) fn reset_dir(dir: &Path) {
    remove_own_pins(dir);
    let _ = fs::create_dir_all(dir);
}

/// connreap's object-hash directories under `root`.
fn own_dirs(root: &Path) -> Vec<PathBuf> {
    let Ok(entries) = fs::read_dir(root) else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
        .filter(|e| e.file_name().to_str().is_some_and(is_hash_dir_name))
        .map(|e| e.path())
        .collect()
}

/// Remove connreap's pins in `dir` (the names of [`PIN_NAMES`]), then `dir` itself unless
/// something else is still in it. True when something was removed.
fn remove_own_pins(dir: &Path) -> bool {
    let mut removed = false;
    for name in PIN_NAMES {
        let path = dir.join(name);
        // A directory of that name is not a pin: it stays.
        if fs::symlink_metadata(&path).is_ok_and(|m| m.is_dir()) {
            continue;
        }
        match fs::remove_file(&path) {
            Ok(()) => removed = true,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => tracing::warn!(path = %path.display(), error = %e, "cannot remove pin"),
        }
    }
    keep_or_remove_dir(dir) || removed
}

/// `rmdir dir`; if it is not empty, name what is left (not connreap's, so kept). True when removed.
fn keep_or_remove_dir(dir: &Path) -> bool {
    match fs::remove_dir(dir) {
        Ok(()) => true,
        Err(e) if e.kind() == io::ErrorKind::NotFound => false,
        Err(_) => {
            let left: Vec<String> = fs::read_dir(dir)
                .map(|es| {
                    es.flatten()
                        .map(|e| e.file_name().to_string_lossy().into_owned())
                        .collect()
                })
                .unwrap_or_default();
            tracing::info!(
                path = %dir.display(),
                left = %left.join(", "),
                "kept: holds objects connreap did not create"
            );
            false
        }
    }
}

/// Which of [`PIN_NAMES`] exist in `dir` now (taken before a load, see [`clean_failed_load`]).
pub(super) fn existing_pins(dir: &Path) -> Vec<&'static str> {
    PIN_NAMES
        .into_iter()
        .filter(|n| fs::symlink_metadata(dir.join(n)).is_ok())
        .collect()
}

/// Undo a load that failed: remove the pins it created (those not in `before`). If no tracker
/// is attached through `dir` after that, its remaining pins are leftovers no load will use as
/// they are: remove them too, and the directory and the root when they are then empty. Used on
/// every error path of a load, so a kernel that refuses a program keeps no pinned maps.
pub(super) fn clean_failed_load(dir: &Path, before: &[&str]) {
    for name in PIN_NAMES.into_iter().filter(|n| !before.contains(n)) {
        let _ = fs::remove_file(dir.join(name));
    }
    if PinnedLink::from_pin(dir.join("link")).is_ok() {
        return;
    }
    remove_own_pins(dir);
    if let Some(root) = dir.parent() {
        let _ = fs::remove_dir(root);
    }
}

/// Remove every pin connreap created under the root (detaches the state tracker), and the root
/// if nothing else is left in it. Used by `connreap unpin`; true if anything was removed.
/// Unless `force`, refuses (removing nothing) while another process holds one of the pinned
/// maps or programs: another connreap runs with this pin root and its tracker would be reset.
pub fn unpin_all(force: bool) -> Result<bool, KernelError> {
    let root = root_path();
    if fs::symlink_metadata(&root).is_err() {
        return Ok(false);
    }
    check_root(&root)?;
    let _lock = super::host::load_lock();
    let dirs = own_dirs(&root);
    if !force {
        let mut ids = super::pin_users::Ids::default();
        for dir in &dirs {
            ids.add_dir(dir);
        }
        let users = super::pin_users::users(&ids);
        if !ids.is_empty() && !users.is_empty() {
            let users: Vec<String> = users.iter().map(ToString::to_string).collect();
            return Err(KernelError::PinsInUse {
                root,
                users: users.join(", "),
            });
        }
    }
    let mut removed = false;
    for dir in dirs {
        removed |= remove_own_pins(&dir);
    }
    if root.exists() {
        removed |= keep_or_remove_dir(&root);
    }
    Ok(removed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn object_hash_differs_per_content() {
        assert_ne!(object_hash(b"a"), object_hash(b"b"));
        assert_eq!(object_hash(b"a").len(), 16);
        assert!(is_hash_dir_name(&object_hash(b"a")));
        assert!(!is_hash_dir_name("connreap-canary"));
        assert!(!is_hash_dir_name("0123456789ABCDEF"));
    }

    #[test]
    fn every_shared_map_pin_is_one_connreap_may_remove() {
        for (_, pin) in super::super::load::SHARED_MAPS {
            assert!(PIN_NAMES.contains(&pin), "{pin} missing from PIN_NAMES");
        }
    }

    #[test]
    fn finds_mount_points_in_mountinfo() {
        let info = "23 1 0:21 / / rw - ext4 /dev/root rw\n\
                    47 23 0:40 / /sys/fs/bpf rw,relatime - bpf bpf rw\n\
                    48 23 0:41 / /mnt/with\\040space rw shared:1 - tmpfs tmpfs rw\n";
        assert_eq!(
            mount_at(info, Path::new("/sys/fs/bpf")).as_deref(),
            Some("bpf")
        );
        assert_eq!(mount_at(info, Path::new("/")).as_deref(), Some("ext4"));
        assert_eq!(
            mount_at(info, Path::new("/mnt/with space")).as_deref(),
            Some("tmpfs")
        );
        assert_eq!(mount_at(info, Path::new("/sys/fs/bpf/connreap")), None);
    }

    #[test]
    fn refuses_relative_and_non_bpffs_roots() {
        let msg = |r: &str| check_root(Path::new(r)).map_err(|e| e.to_string());
        assert!(msg("connreap")
            .unwrap_err()
            .contains("not an absolute path"));
        // / is a mount point; /proc/self is not on bpffs.
        assert!(msg("/").unwrap_err().contains("mount point"));
        let e = msg("/proc/self/no-such-dir").unwrap_err();
        assert!(e.contains("not on a bpf filesystem"), "{e}");
    }

    /// A scratch directory standing in for a pin directory (plain files in place of pins).
    fn scratch(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("connreap-pins-{tag}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&d);
        fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn a_failed_first_load_leaves_nothing_of_its_own() {
        let root = scratch("failed-first");
        let dir = root.join(object_hash(b"x"));
        fs::create_dir_all(&dir).unwrap();
        let before = existing_pins(&dir);
        assert!(before.is_empty());
        // The load pinned its maps and the tracker's link, then failed.
        for n in ["state", "events", "counters", "staging", "link"] {
            fs::write(dir.join(n), "").unwrap();
        }
        clean_failed_load(&dir, &before);
        assert!(!root.exists(), "root left behind");
    }

    #[test]
    fn cleanup_and_unpin_keep_what_connreap_did_not_create() {
        let root = scratch("foreign");
        let dir = root.join(object_hash(b"x"));
        fs::create_dir_all(dir.join("flush")).unwrap(); // a directory where a pin would go
        fs::write(dir.join("state"), "").unwrap();
        fs::write(dir.join("someone-elses"), "").unwrap();
        fs::write(root.join("foreign"), "").unwrap();
        clean_failed_load(&dir, &[]);
        let mut left: Vec<String> = fs::read_dir(&dir)
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        left.sort();
        assert_eq!(left, ["flush", "someone-elses"]);
        assert!(root.join("foreign").exists());

        // Other builds' directories: only hash-named ones, only connreap's pins in them.
        let other = root.join("00000000000000ff");
        fs::create_dir_all(&other).unwrap();
        fs::write(other.join("link"), "").unwrap();
        let gone = root.join("00000000000000fe");
        fs::create_dir_all(&gone).unwrap();
        fs::write(gone.join("state"), "").unwrap();
        fs::create_dir_all(root.join("not-a-hash")).unwrap();
        fs::write(root.join("not-a-hash").join("state"), "").unwrap();
        for d in own_dirs(&root) {
            remove_own_pins(&d);
        }
        assert!(!gone.exists() && !other.exists());
        assert!(root.join("not-a-hash").join("state").exists());
        assert!(dir.join("someone-elses").exists());
        assert!(!keep_or_remove_dir(&root));
        fs::remove_dir_all(&root).unwrap();
    }
}
