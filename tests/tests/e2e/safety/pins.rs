//! The pinned state tracker under faults: its pins removed under a running
//! daemon, foreign objects under the pin root, a pin root that is a mount point, and a load that
//! fails half-way. Foreign pinned objects are real BPF maps, created and pinned by the test with
//! the bpf(2) syscall.

use std::{
    ffi::CString,
    fs,
    os::{fd::AsRawFd, unix::ffi::OsStrExt, unix::fs::MetadataExt},
    path::{Path, PathBuf},
    time::Duration,
};

use connreap_tests::harness::{
    peer, require_privileges, run, sockets, wait_until, Agent, Config, NetNs, Output, SocketRow,
    TempDir, CONNREAP_TIMEOUT, PIN_ROOT, POLL, SCAN,
};

/// The lock connreap takes while it loads or changes pins (agent/src/kernel/host.rs).
const LOAD_LOCK: &str = "/run/lock/connreap.load.lock";

/// `connreap unpin` while the daemon runs is refused (exit 75, naming the daemon's pid; nothing
/// removed); `connreap unpin --force` while the daemon runs: at its next scan the daemon pins its tracker again
/// (a new link), says so in its log, and a transition after that has an exact age again, while
/// a socket that entered its state before the gap shows a lower bound (its old record was
/// cleared: never a stale exact age). /healthz stays ok.
#[test]
fn unpin_under_a_running_daemon_is_repaired_at_its_next_scan() {
    let Some(_env) = require_privileges() else {
        return;
    };
    let ns = NetNs::new("unpin");
    let dir = TempDir::new("unpin");
    let mut agent = Agent::start(&ns, &dir, &Config::new(&dir));
    let link = tracker_link(Path::new(PIN_ROOT))
        .unwrap_or_else(|| panic!("the daemon pinned no tracker under {PIN_ROOT}"));
    let ino = fs::metadata(&link).unwrap().ino();

    // A listener that enters LISTEN while the tracker runs: exact age.
    let (listener, _) = peer(&ns, &["listen", "--addr", "127.0.0.1:7810"]);
    let before = wait_rows(&agent, "LISTEN", 7810, listener.pid(), 1);
    assert!(before[0].age_exact, "{before:?}\n{}", agent.ctx());

    // The daemon uses the pins: a plain unpin refuses (exit 75), naming its pid, and removes
    // nothing (what the .deb's prerm runs beside a DaemonSet pod).
    let out = run(&mut ns.connreap(["unpin"]), CONNREAP_TIMEOUT);
    assert_eq!(out.status.code(), Some(75), "unpin under a daemon: {out:?}");
    let holder = format!("pid {} (connreap)", agent.pid());
    assert!(
        out.stderr.contains("refusing to unpin")
            && out.stderr.contains(&holder)
            && out.stderr.contains("--force"),
        "{out:?}"
    );
    assert_eq!(out.stderr.trim_end().lines().count(), 1, "{out:?}");
    assert_eq!(
        fs::metadata(&link).map(|m| m.ino()).ok(),
        Some(ino),
        "a refused unpin removed the tracker's link"
    );
    agent.assert_healthy();

    // `--force`: the operator means it.
    let out = run(&mut ns.connreap(["unpin", "--force"]), CONNREAP_TIMEOUT);
    assert!(
        out.status.success(),
        "connreap unpin --force failed: {out:?}"
    );
    assert!(out.stderr.contains("state tracker unpinned"), "{out:?}");

    // Re-pinned: a new link pin (a new inode), and the daemon's log says why.
    wait_until(SCAN * 5, POLL, || {
        fs::metadata(&link).ok().filter(|m| m.ino() != ino)
    })
    .unwrap_or_else(|| panic!("the tracker was not pinned again:\n{}", agent.ctx()));
    let log = wait_until(SCAN * 2, POLL, || {
        let e = agent.stderr();
        e.contains("re-attached").then_some(e)
    })
    .unwrap_or_else(|| panic!("no re-attach logged:\n{}", agent.ctx()));
    assert!(
        log.contains("WARN") && log.contains("state tracker was detached"),
        "{log}"
    );

    // Transitions after the re-attach are seen: CLOSE_WAIT sockets made now have exact ages.
    let (cw, _) = peer(
        &ns,
        &["close-wait", "--addr", "127.0.0.1:7811", "--count", "2"],
    );
    let rows = wait_rows(&agent, "CLOSE_WAIT", 7811, cw.pid(), 2);
    assert!(
        rows.iter().all(|s| s.age_exact && s.age_secs < 10.0),
        "transitions after the re-attach must have exact ages: {rows:?}\n{}",
        agent.ctx()
    );
    // The listener's record from before the gap is gone: a lower bound now.
    let after = wait_rows(&agent, "LISTEN", 7810, listener.pid(), 1);
    assert!(!after[0].age_exact, "{after:?}\n{}", agent.ctx());
    agent.assert_healthy();
    let (_, h) = agent.get("/healthz");
    assert_eq!(h["problems"], serde_json::json!([]), "{h}");
}

/// The tracker's pins are removed and its directory's place is taken (a foreign pinned map
/// where the daemon's directory goes), so the daemon cannot re-attach: /healthz answers 200
/// `degraded` with a problem naming the state tracker and why, the log has one ERROR for it (not
/// one per scan), and once the place is free again the daemon re-attaches and reports ok.
#[test]
fn a_tracker_that_cannot_be_reattached_is_degraded_on_healthz() {
    let Some(_env) = require_privileges() else {
        return;
    };
    let ns = NetNs::new("detached");
    let dir = TempDir::new("detached");
    let mut agent = Agent::start(&ns, &dir, &Config::new(&dir));
    let link = tracker_link(Path::new(PIN_ROOT))
        .unwrap_or_else(|| panic!("the daemon pinned no tracker under {PIN_ROOT}"));
    let hash_dir = link.parent().unwrap().to_path_buf();
    let squatter = RemoveOnDrop(hash_dir.clone());
    {
        // Holding connreap's load lock, the daemon cannot repair in between these two steps.
        let _lock = flock(LOAD_LOCK);
        fs::remove_dir_all(&hash_dir).unwrap();
        pin_new_map(&squatter.0);
    }

    let problem = wait_until(SCAN * 5, POLL, || {
        let (code, h) = agent.get("/healthz");
        let p = h["problems"].as_array()?.iter().find_map(|p| {
            let p = p.as_str()?;
            p.contains("cannot prepare pin directory")
                .then(|| p.to_string())
        })?;
        assert_eq!((code, h["status"].as_str()), (200, Some("degraded")), "{h}");
        Some(p)
    })
    .unwrap_or_else(|| {
        panic!(
            "/healthz never reported the detached tracker:\n{}",
            agent.ctx()
        )
    });
    assert!(
        problem.starts_with("state tracker detached (its link pin ")
            && problem.contains(&hash_dir.display().to_string())
            && problem.contains("File exists"),
        "{problem}"
    );
    agent.wait_scans(3);
    let errors = agent
        .stderr()
        .lines()
        .filter(|l| l.contains("ERROR") && l.contains("cannot prepare pin directory"))
        .count();
    assert_eq!(
        errors,
        1,
        "one ERROR for a lasting problem:\n{}",
        agent.ctx()
    );

    drop(squatter);
    wait_until(SCAN * 5, POLL, || {
        let (_, h) = agent.get("/healthz");
        (h["status"] == "ok" && link.exists()).then_some(())
    })
    .unwrap_or_else(|| panic!("the daemon did not re-attach:\n{}", agent.ctx()));
    agent.assert_healthy();
}

/// A pin root holding things connreap did not create: a map, a directory with a map, and a
/// directory named like another build's object hash holding one of connreap's pin names and a
/// foreign map. A load removes only the other build's pin; `unpin` removes only connreap's own
/// directory and keeps the root, which still holds the rest.
#[test]
fn foreign_objects_under_the_pin_root_survive_load_and_unpin() {
    let Some(_env) = require_privileges() else {
        return;
    };
    let root = TestRoot::new("/sys/fs/bpf/connreap-test-foreign");
    let ns = NetNs::new("foreign");
    let other_build = root.0.join("00000000000000ff");
    let foreign = [
        root.0.join("foreign"),
        root.0.join("foreign-dir").join("map"),
        other_build.join("keep"),
    ];
    for f in &foreign {
        fs::create_dir_all(f.parent().unwrap()).unwrap();
        pin_new_map(f);
    }
    pin_new_map(&other_build.join("state"));

    let out = root.connreap(&ns, &["snapshot", "--json"]);
    assert!(out.status.success(), "{out:?}");
    let link = tracker_link(&root.0).unwrap_or_else(|| panic!("no tracker pinned: {out:?}"));
    for f in &foreign {
        assert!(f.exists(), "the load removed {}: {out:?}", f.display());
    }
    assert!(
        !other_build.join("state").exists(),
        "another build's pin stays"
    );

    let out = root.connreap(&ns, &["unpin"]);
    assert!(out.status.success(), "{out:?}");
    assert!(
        !link.parent().unwrap().exists(),
        "connreap's directory stays"
    );
    for f in &foreign {
        assert!(f.exists(), "unpin removed {}: {out:?}", f.display());
    }
}

/// `CONNREAP_PIN_ROOT` naming a bpffs mount point is refused, in one line that says why, and
/// nothing there is removed: first on a private bpffs holding a foreign map, then on the host's
/// /sys/fs/bpf itself.
#[test]
fn a_pin_root_that_is_a_mount_point_is_refused() {
    let Some(_env) = require_privileges() else {
        return;
    };
    let ns = NetNs::new("mountroot");
    let dir = TempDir::new("mountroot");
    let mnt = PrivateBpffs::mount(dir.path("bpffs"));
    let foreign = mnt.0.join("foreign");
    pin_new_map(&foreign);
    for args in [&["snapshot", "--json"][..], &["unpin"]] {
        let out = run(
            ns.connreap(args).env("CONNREAP_PIN_ROOT", &mnt.0),
            CONNREAP_TIMEOUT,
        );
        assert_refused(&out, &mnt.0);
        assert!(foreign.exists(), "{args:?} removed {}", foreign.display());
    }
    drop(mnt);

    let host = Path::new("/sys/fs/bpf");
    let listing = || -> Vec<String> {
        fs::read_dir(host)
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect()
    };
    let before = listing();
    let out = run(
        ns.connreap(["snapshot", "--json"])
            .env("CONNREAP_PIN_ROOT", host),
        CONNREAP_TIMEOUT,
    );
    assert_refused(&out, host);
    let after = listing();
    let gone: Vec<&String> = before.iter().filter(|e| !after.contains(e)).collect();
    assert!(gone.is_empty(), "removed from /sys/fs/bpf: {gone:?}");
}

/// A load that fails after it pinned maps, the link and the iterators (the flush program's pin
/// path is taken by a directory) removes every pin it made: no maps are left behind, and the
/// one error line names the pin.
#[test]
fn a_load_failing_half_way_leaves_no_pins() {
    let Some(_env) = require_privileges() else {
        return;
    };
    let root = TestRoot::new("/sys/fs/bpf/connreap-test-halfway");
    let ns = NetNs::new("halfway");
    // A first load shows where this build pins; unpin it again.
    let out = root.connreap(&ns, &["snapshot", "--json"]);
    assert!(out.status.success(), "{out:?}");
    let hash_dir = tracker_link(&root.0)
        .and_then(|l| l.parent().map(Path::to_path_buf))
        .unwrap_or_else(|| panic!("no tracker pinned: {out:?}"));
    let out = root.connreap(&ns, &["unpin"]);
    assert!(out.status.success(), "{out:?}");
    assert!(!root.0.exists(), "{} still exists", root.0.display());

    fs::create_dir_all(hash_dir.join("flush")).unwrap();
    let out = root.connreap(&ns, &["snapshot", "--json"]);
    assert!(!out.status.success(), "{out:?}");
    let line = last_line(&out);
    assert!(
        line.starts_with("connreap: cannot pin ") && line.contains("/flush"),
        "{out:?}"
    );
    let mut left: Vec<String> = fs::read_dir(&hash_dir)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    left.sort();
    assert_eq!(left, ["flush"], "pins left behind by the failed load");
}

/// The first `<root>/<object-hash>/link` pin under `root`.
fn tracker_link(root: &Path) -> Option<PathBuf> {
    fs::read_dir(root)
        .ok()?
        .flatten()
        .map(|e| e.path().join("link"))
        .find(|p| p.exists())
}

/// Rows of `pid` in `state` on `port` from the daemon's /v1/sockets, once there are `n`.
fn wait_rows(agent: &Agent, state: &str, port: u16, pid: u32, n: usize) -> Vec<SocketRow> {
    let path = format!("/v1/sockets?state={state}&port={port}");
    let mut last = serde_json::Value::Null;
    wait_until(Duration::from_secs(10), POLL, || {
        last = agent.get_ok(&path);
        let rows: Vec<SocketRow> = sockets(&last)
            .into_iter()
            .filter(|s| s.pid == Some(pid))
            .collect();
        (rows.len() == n).then_some(rows)
    })
    .unwrap_or_else(|| panic!("want {n} {state} sockets of pid {pid}; last:\n{last:#}"))
}

fn last_line(out: &Output) -> &str {
    out.stderr.trim_end().lines().last().unwrap_or("")
}

/// Refused naming the root and why, in one line; nothing else went wrong first.
fn assert_refused(out: &Output, root: &Path) {
    assert!(!out.status.success(), "{out:?}");
    let line = last_line(out);
    assert_eq!(
        line,
        format!(
            "connreap: pin root {} (CONNREAP_PIN_ROOT) refused: it is a mount point (bpf) itself; \
             connreap removes what it created under its root and wants one of its own: use a \
             directory under it, e.g. {}",
            root.display(),
            root.join("connreap-canary").display()
        ),
        "{out:?}"
    );
}

/// A foreign pin where connreap pins, removed when the test ends (or fails).
struct RemoveOnDrop(PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = fs::remove_file(&self.0);
    }
}

/// A pin root of the test's own, removed before and after.
struct TestRoot(PathBuf);

impl TestRoot {
    fn new(path: &str) -> TestRoot {
        let _ = fs::remove_dir_all(path);
        TestRoot(PathBuf::from(path))
    }

    fn connreap(&self, ns: &NetNs, args: &[&str]) -> Output {
        run(
            ns.connreap(args).env("CONNREAP_PIN_ROOT", &self.0),
            CONNREAP_TIMEOUT,
        )
    }
}

impl Drop for TestRoot {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

/// A bpffs instance of the test's own, unmounted (with everything pinned in it) on drop.
struct PrivateBpffs(PathBuf);

impl PrivateBpffs {
    fn mount(path: PathBuf) -> PrivateBpffs {
        fs::create_dir_all(&path).unwrap();
        let c = |s: &[u8]| CString::new(s).unwrap();
        let target = c(path.as_os_str().as_bytes());
        // SAFETY: mount(2) with valid NUL-terminated strings.
        let rc = unsafe {
            libc::mount(
                c(b"bpf").as_ptr(),
                target.as_ptr(),
                c(b"bpf").as_ptr(),
                0,
                std::ptr::null(),
            )
        };
        assert_eq!(
            rc,
            0,
            "mount bpffs at {}: {}",
            path.display(),
            std::io::Error::last_os_error()
        );
        PrivateBpffs(path)
    }
}

impl Drop for PrivateBpffs {
    fn drop(&mut self) {
        let target = CString::new(self.0.as_os_str().as_bytes()).unwrap();
        // SAFETY: umount2(2) with a valid NUL-terminated path.
        unsafe { libc::umount2(target.as_ptr(), libc::MNT_DETACH) };
    }
}

/// An exclusive flock on `path`, held until the file is dropped.
fn flock(path: &str) -> fs::File {
    let f = fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path)
        .unwrap_or_else(|e| panic!("open {path}: {e}"));
    // SAFETY: flock on an fd we own.
    let rc = unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) };
    assert_eq!(rc, 0, "flock {path}: {}", std::io::Error::last_os_error());
    f
}

/// Create a one-entry BPF array map and pin it at `path` (the map lives as long as the pin).
fn pin_new_map(path: &Path) {
    const BPF_MAP_CREATE: libc::c_long = 0;
    const BPF_OBJ_PIN: libc::c_long = 6;
    const BPF_MAP_TYPE_ARRAY: u32 = 2;
    // union bpf_attr, as much of it as these two commands read (the rest zero).
    let mut attr = [0u32; 32];
    attr[..4].copy_from_slice(&[BPF_MAP_TYPE_ARRAY, 4, 4, 1]);
    let bpf = |cmd: libc::c_long, attr: &[u32; 32]| {
        // SAFETY: bpf(2) with an attribute buffer of the size passed.
        unsafe {
            libc::syscall(
                libc::SYS_bpf,
                cmd,
                attr.as_ptr(),
                std::mem::size_of_val(attr),
            )
        }
    };
    let fd = bpf(BPF_MAP_CREATE, &attr);
    assert!(
        fd >= 0,
        "BPF_MAP_CREATE: {}",
        std::io::Error::last_os_error()
    );
    let name = CString::new(path.as_os_str().as_bytes()).unwrap();
    let ptr = name.as_ptr() as u64;
    let mut pin = [0u32; 32];
    pin[0] = ptr as u32;
    pin[1] = (ptr >> 32) as u32;
    pin[2] = fd as u32;
    let rc = bpf(BPF_OBJ_PIN, &pin);
    let err = std::io::Error::last_os_error();
    // SAFETY: closing the fd returned above; the pin keeps the map.
    unsafe { libc::close(fd as i32) };
    assert_eq!(rc, 0, "BPF_OBJ_PIN {}: {err}", path.display());
}
