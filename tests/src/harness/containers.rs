//! Processes placed in cgroups named like containers' (Docker, containerd and CRI-O under
//! Kubernetes, podman), the way connreap attributes sockets to containers: by the owner's
//! cgroup path.
//!
//! A [`FakeContainer`] creates its cgroup v2 directories (only the ones that did not exist),
//! and a process started with [`FakeContainer::command`] enters the container's cgroup before
//! it runs (it writes `0` to `cgroup.procs` in a `pre_exec`), so it is in the container from
//! its first instruction, like a real one. On drop, processes left in the cgroup are moved
//! back to the root cgroup and the directories it created are removed, deepest first.

use std::{
    ffi::{CString, OsStr},
    fs,
    io::{self, Read},
    os::unix::{ffi::OsStrExt, process::CommandExt},
    path::{Path, PathBuf},
    process::Command,
    thread,
    time::Duration,
};

use super::netns::NetNs;

/// `CGROUP2_SUPER_MAGIC` from linux/magic.h.
const CGROUP2_MAGIC: i64 = 0x6367_7270;

fn is_cgroup2(path: &Path) -> bool {
    let Ok(c) = CString::new(path.as_os_str().as_bytes()) else {
        return false;
    };
    // SAFETY: `statfs` is plain old data; all zeroes is a valid value.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: statfs(2) on a NUL-terminated path, writing into a struct we own.
    let rc = unsafe { libc::statfs(c.as_ptr(), &mut st) };
    // `f_type` is a `long` on 64-bit targets (the only ones connreap supports).
    rc == 0 && st.f_type == CGROUP2_MAGIC
}

/// Where the cgroup v2 hierarchy is mounted: `/sys/fs/cgroup` (unified hosts) or
/// `/sys/fs/cgroup/unified` (hybrid hosts, where the v2 path is the `0::` line of
/// /proc/PID/cgroup). `Err(reason)` when there is none: the caller prints `skipped: reason`.
pub fn cgroup2_root() -> Result<PathBuf, String> {
    ["/sys/fs/cgroup", "/sys/fs/cgroup/unified"]
        .into_iter()
        .map(PathBuf::from)
        .find(|p| is_cgroup2(p))
        .ok_or_else(|| {
            "no cgroup v2 hierarchy at /sys/fs/cgroup or /sys/fs/cgroup/unified".to_string()
        })
}

/// `n` random bytes as lowercase hex, from /dev/urandom.
pub fn random_hex(n: usize) -> String {
    let mut buf = vec![0u8; n];
    fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut buf))
        .unwrap_or_else(|e| panic!("/dev/urandom: {e}"));
    buf.iter().map(|b| format!("{b:02x}")).collect()
}

/// A random pod UID (a dashed UUID, lowercase).
fn random_uuid() -> String {
    let h = random_hex(16);
    format!(
        "{}-{}-{}-{}-{}",
        &h[..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..]
    )
}

/// A container's cgroup, named as its runtime names it, and the kubelet's pod log directory
/// for a Kubernetes one.
pub struct FakeContainer {
    /// The 64-hex container id.
    pub id: String,
    /// What connreap reports as `container_runtime`: `docker`, `containerd`, `crio`, `podman`.
    pub runtime: &'static str,
    /// For a Kubernetes container: the pod UID, its name and namespace.
    pub pod: Option<Pod>,
    root: PathBuf,
    /// The container's own cgroup directory.
    leaf: PathBuf,
    /// Directories this container created, outermost first.
    created: Vec<PathBuf>,
    /// Runtime state written for it (CRI-O's `config.json`): directories this container
    /// created, outermost first, and files, removed on drop.
    state_dirs: Vec<PathBuf>,
    state_files: Vec<PathBuf>,
}

/// The Kubernetes pod a [`FakeContainer::kube`] container belongs to.
#[derive(Debug, Clone)]
pub struct Pod {
    pub uid: String,
    pub name: String,
    pub namespace: String,
    /// `/var/log/pods/<namespace>_<name>_<uid>`, created for the pod (and removed on drop);
    /// `None` for a pod whose names only its runtime's state holds ([`FakeContainer::crio`]).
    log_dir: Option<PathBuf>,
    /// `/var/log/pods` itself when this pod created it.
    created_logs: bool,
}

impl FakeContainer {
    /// Docker with the systemd cgroup driver: `/system.slice/docker-<id>.scope`.
    pub fn docker(root: &Path) -> FakeContainer {
        let id = random_hex(32);
        let rel = ["system.slice".to_string(), format!("docker-{id}.scope")];
        FakeContainer::create(root, id, "docker", &rel, None)
    }

    /// containerd under Kubernetes (systemd driver, best-effort pod):
    /// `/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod<uid_>.slice/
    /// cri-containerd-<id>.scope`; the pod's name and namespace are left where connreap reads
    /// them without a network client, the kubelet's pod log directory
    /// `/var/log/pods/<namespace>_<name>_<uid>`.
    pub fn kube(root: &Path, namespace: &str, name: &str) -> FakeContainer {
        let id = random_hex(32);
        let uid = random_uuid();
        let rel = [
            "kubepods.slice".to_string(),
            "kubepods-besteffort.slice".to_string(),
            format!("kubepods-besteffort-pod{}.slice", uid.replace('-', "_")),
            format!("cri-containerd-{id}.scope"),
        ];
        let logs = Path::new("/var/log/pods");
        let created_logs = !logs.exists();
        let log_dir = logs.join(format!("{namespace}_{name}_{uid}"));
        fs::create_dir_all(&log_dir).unwrap_or_else(|e| panic!("mkdir {}: {e}", log_dir.display()));
        let pod = Pod {
            uid,
            name: name.to_string(),
            namespace: namespace.to_string(),
            log_dir: Some(log_dir),
            created_logs,
        };
        FakeContainer::create(root, id, "containerd", &rel, Some(pod))
    }

    /// CRI-O under Kubernetes (systemd driver, best-effort pod):
    /// `/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod<uid_>.slice/
    /// crio-<id>.scope`. The pod's name and namespace are only in CRI-O's own state, as CRI-O
    /// keeps it: the container's OCI spec
    /// `/run/containers/storage/overlay-containers/<id>/userdata/config.json`, annotations
    /// `io.kubernetes.pod.name`, `io.kubernetes.pod.namespace`, `io.kubernetes.pod.uid` (no
    /// kubelet log directory, so connreap must read CRI-O's file to name the pod).
    pub fn crio(root: &Path, namespace: &str, name: &str) -> FakeContainer {
        let id = random_hex(32);
        let uid = random_uuid();
        let rel = [
            "kubepods.slice".to_string(),
            "kubepods-besteffort.slice".to_string(),
            format!("kubepods-besteffort-pod{}.slice", uid.replace('-', "_")),
            format!("crio-{id}.scope"),
        ];
        let pod = Pod {
            uid: uid.clone(),
            name: name.to_string(),
            namespace: namespace.to_string(),
            log_dir: None,
            created_logs: false,
        };
        let mut c = FakeContainer::create(root, id, "crio", &rel, Some(pod));
        let userdata = Path::new("/run/containers/storage/overlay-containers")
            .join(&c.id)
            .join("userdata");
        let mut dir = PathBuf::from("/");
        for comp in userdata.components().skip(1) {
            dir.push(comp);
            match fs::create_dir(&dir) {
                Ok(()) => c.state_dirs.push(dir.clone()),
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
                Err(e) => panic!("mkdir {}: {e}", dir.display()),
            }
        }
        let spec = serde_json::json!({
            "ociVersion": "1.0.2-dev",
            "annotations": {
                "io.kubernetes.cri-o.ContainerType": "container",
                "io.kubernetes.cri-o.Name": format!("k8s_app_{name}_{namespace}_{uid}_0"),
                "io.kubernetes.cri-o.Namespace": namespace,
                "io.kubernetes.pod.name": name,
                "io.kubernetes.pod.namespace": namespace,
                "io.kubernetes.pod.uid": uid,
                "io.kubernetes.container.name": "app",
            }
        });
        let file = userdata.join("config.json");
        fs::write(&file, spec.to_string())
            .unwrap_or_else(|e| panic!("write {}: {e}", file.display()));
        c.state_files.push(file);
        c
    }

    /// podman (rootful, systemd driver): `/machine.slice/libpod-<id>.scope`.
    pub fn podman(root: &Path) -> FakeContainer {
        let id = random_hex(32);
        let rel = ["machine.slice".to_string(), format!("libpod-{id}.scope")];
        FakeContainer::create(root, id, "podman", &rel, None)
    }

    fn create(
        root: &Path,
        id: String,
        runtime: &'static str,
        rel: &[String],
        pod: Option<Pod>,
    ) -> FakeContainer {
        let mut c = FakeContainer {
            id,
            runtime,
            pod,
            root: root.to_path_buf(),
            leaf: root.to_path_buf(),
            created: Vec::new(),
            state_dirs: Vec::new(),
            state_files: Vec::new(),
        };
        for comp in rel {
            c.leaf.push(comp);
            match fs::create_dir(&c.leaf) {
                Ok(()) => c.created.push(c.leaf.clone()),
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
                // Dropping `c` removes what was created so far.
                Err(e) => panic!("mkdir {}: {e}", c.leaf.display()),
            }
        }
        c
    }

    /// The first 12 characters of the id, as `docker ps` shows it (and the alert labels).
    pub fn short(&self) -> &str {
        &self.id[..12]
    }

    /// The container's cgroup path as /proc/PID/cgroup shows it (`/system.slice/...`).
    pub fn cgroup(&self) -> String {
        let rel = self.leaf.strip_prefix(&self.root).unwrap_or(&self.leaf);
        format!("/{}", rel.display())
    }

    /// `program` inside network namespace `ns` and inside this container's cgroup.
    pub fn command(&self, ns: &NetNs, program: impl AsRef<OsStr>) -> Command {
        let mut cmd = ns.command(program);
        self.join(&mut cmd);
        cmd
    }

    /// Makes `cmd` enter this container's cgroup before it runs.
    pub fn join(&self, cmd: &mut Command) {
        let procs = CString::new(self.leaf.join("cgroup.procs").as_os_str().as_bytes())
            .expect("cgroup path without NUL");
        // SAFETY: open/write/close are async-signal-safe syscalls; the path was allocated
        // before the fork. Writing "0" to cgroup.procs moves the writing process.
        unsafe {
            cmd.pre_exec(move || {
                let fd = libc::open(procs.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
                if fd < 0 {
                    return Err(io::Error::last_os_error());
                }
                let n = libc::write(fd, b"0".as_ptr().cast(), 1);
                let err = io::Error::last_os_error();
                libc::close(fd);
                if n == 1 {
                    Ok(())
                } else {
                    Err(err)
                }
            });
        }
    }

    /// The pids in this container's cgroup.
    pub fn pids(&self) -> Vec<u32> {
        fs::read_to_string(self.leaf.join("cgroup.procs"))
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.trim().parse().ok())
            .collect()
    }
}

impl Drop for FakeContainer {
    fn drop(&mut self) {
        // Whatever still runs in the cgroup goes back to the root one (the tests kill their
        // processes first; this covers a process they did not start).
        for pid in self.pids() {
            let _ = fs::write(self.root.join("cgroup.procs"), pid.to_string());
        }
        for dir in self.created.iter().rev() {
            // An exiting process may keep the cgroup busy for a moment.
            let mut last = None;
            for _ in 0..50 {
                match fs::remove_dir(dir) {
                    Ok(()) => {
                        last = None;
                        break;
                    }
                    Err(e) if e.kind() == io::ErrorKind::NotFound => {
                        last = None;
                        break;
                    }
                    Err(e) => last = Some(e),
                }
                thread::sleep(Duration::from_millis(20));
            }
            if let Some(e) = last {
                eprintln!("warning: cannot remove cgroup {}: {e}", dir.display());
            }
        }
        if let Some(pod) = &self.pod {
            if let Some(dir) = &pod.log_dir {
                let _ = fs::remove_dir(dir);
            }
            if pod.created_logs {
                let _ = fs::remove_dir("/var/log/pods");
            }
        }
        for file in &self.state_files {
            let _ = fs::remove_file(file);
        }
        for dir in self.state_dirs.iter().rev() {
            let _ = fs::remove_dir(dir);
        }
    }
}
