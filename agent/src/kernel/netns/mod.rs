//! Network namespaces: finding every one on the host and running code inside one.
//!
//! A namespace counts when a process lives in it or a name is bind-mounted for it under
//! `/run/netns` (`ip netns add`) or `/run/docker/netns` (Docker's sandboxes); namespaces are
//! identified by the inode of their nsfs file and deduplicated by it. Discovery runs on every
//! scan (pods come and go) and holds nothing open between scans, so connreap never keeps a
//! dead namespace alive. A namespace with neither, alive only through sockets processes hold
//! in it, is entered through one of those sockets (see `held`; the scan finds them).
//!
//! Entering one is `setns(2)` on a thread of our own, never on a thread that does anything
//! else: a socket (netlink, TCP, a BPF iterator) is bound to the namespace of the thread that
//! creates it, and a thread left in the wrong namespace would act on the wrong sockets. The
//! threads entering namespaces end with the work they did there, so there is nothing to restore.
mod held;

use std::{
    fs,
    os::{
        fd::{AsRawFd as _, OwnedFd},
        unix::fs::MetadataExt as _,
    },
    path::PathBuf,
};

pub use held::HeldError;

/// Directories where namespaces get names: `ip netns` (`/var/run` is normally a link to `/run`,
/// so both are read and the duplicates dropped by inode) and Docker.
const NAMED_DIRS: [&str; 3] = ["/run/netns", "/var/run/netns", "/run/docker/netns"];

/// Set once the missing-CAP_SYS_PTRACE warning was logged (it would repeat on every scan).
static WARNED_DENIED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// One network namespace of the host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Namespace {
    /// The namespace's inode (what `ls -L -i /proc/<pid>/ns/net` and `lsns` print).
    pub inode: u32,
    /// Its name under `/run/netns` or `/run/docker/netns`, if it has one.
    pub name: Option<String>,
    /// connreap's own namespace.
    pub own: bool,
    /// How to open it.
    source: Source,
}

/// Where a namespace is opened from.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Source {
    /// A file that refers to it: a bind mount, or `/proc/<pid>/ns/net` of a process in it.
    Path(PathBuf),
    /// A socket of it that process `pid` holds at `fd` (no process lives in it, it has no
    /// name: see `held`).
    Held { pid: u32, fd: u32 },
}

/// Why a namespace could not be entered.
#[derive(Debug, thiserror::Error)]
pub enum NetnsError {
    /// It went away (its last process exited, its name was removed) or its file now refers to
    /// another namespace (the pid was reused): not an error for a scan, its sockets are gone.
    #[error("network namespace {inode} is gone")]
    Gone { inode: u32 },
    #[error("cannot open network namespace {inode} at {}", path.display())]
    Open {
        inode: u32,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot enter network namespace {inode} (setns; connreap needs CAP_SYS_ADMIN)")]
    Enter {
        inode: u32,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot read connreap's own network namespace")]
    Own(#[source] std::io::Error),
    #[error("the thread working in network namespace {inode} panicked")]
    Panicked { inode: u32 },
    #[error("cannot open network namespace {inode} through a socket a process holds in it")]
    Held {
        inode: u32,
        #[source]
        source: HeldError,
    },
}

impl NetnsError {
    pub fn is_gone(&self) -> bool {
        matches!(self, NetnsError::Gone { .. })
    }
}

/// The inode of the namespace the calling thread is in.
pub fn current_inode() -> Result<u32, NetnsError> {
    fs::metadata("/proc/thread-self/ns/net")
        .map(|m| m.ino() as u32)
        .map_err(NetnsError::Own)
}

/// Every network namespace of the host, connreap's own first, then named ones, then the rest
/// by the lowest pid living in them.
pub fn discover() -> Result<Vec<Namespace>, NetnsError> {
    let own = current_inode()?;
    let mut found = vec![Namespace {
        inode: own,
        name: None,
        own: true,
        source: Source::Path(PathBuf::from("/proc/thread-self/ns/net")),
    }];
    for dir in NAMED_DIRS {
        let Ok(entries) = fs::read_dir(dir) else {
            continue;
        };
        let mut named: Vec<(String, PathBuf)> = entries
            .flatten()
            .map(|e| (e.file_name().to_string_lossy().into_owned(), e.path()))
            .collect();
        named.sort();
        for (name, path) in named {
            if let Ok(m) = fs::metadata(&path) {
                add(&mut found, m.ino() as u32, Some(name), path);
            }
        }
    }
    let mut pids: Vec<u32> = fs::read_dir("/proc")
        .map(|d| {
            d.flatten()
                .filter_map(|e| e.file_name().to_str()?.parse().ok())
                .collect()
        })
        .unwrap_or_default();
    pids.sort_unstable();
    let mut denied = 0usize;
    for pid in pids {
        let path = PathBuf::from(format!("/proc/{pid}/ns/net"));
        // readlink gives "net:[INODE]" from the namespace itself; a stat would also make the
        // kernel set up a dentry and inode for it, several times the cost.
        match fs::read_link(&path) {
            Ok(link) => {
                if let Some(inode) = link_inode(&link) {
                    add(&mut found, inode, None, path);
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => denied += 1,
            // A process that exited meanwhile: skipped.
            Err(_) => {}
        }
    }
    // With CAP_SYS_PTRACE a refusal is some other protection (a process of another user
    // namespace, say): nothing the operator can grant.
    if denied > 0
        && !has_cap_sys_ptrace()
        && !WARNED_DENIED.swap(true, std::sync::atomic::Ordering::Relaxed)
    {
        tracing::warn!(
            processes = denied,
            "cannot read the network namespace of some processes (other users' processes need CAP_SYS_PTRACE): their unnamed namespaces are not scanned"
        );
    }
    Ok(found)
}

/// Whether the calling thread has CAP_SYS_PTRACE in its effective set (`CapEff` of its
/// /proc status; bit 19).
fn has_cap_sys_ptrace() -> bool {
    fs::read_to_string("/proc/thread-self/status")
        .ok()
        .and_then(|s| {
            let hex = s.lines().find_map(|l| l.strip_prefix("CapEff:"))?;
            u64::from_str_radix(hex.trim(), 16).ok()
        })
        .is_some_and(|eff| eff & (1 << 19) != 0)
}

/// Add a namespace unless known; a name found later for a known namespace is kept.
/// The inode in a namespace link's target, `net:[4026531840]`.
fn link_inode(link: &std::path::Path) -> Option<u32> {
    link.to_str()?
        .strip_prefix("net:[")?
        .strip_suffix(']')?
        .parse()
        .ok()
}

fn add(found: &mut Vec<Namespace>, inode: u32, name: Option<String>, path: PathBuf) {
    match found.iter_mut().find(|n| n.inode == inode) {
        Some(known) => {
            if known.name.is_none() {
                known.name = name;
            }
        }
        None => found.push(Namespace {
            inode,
            name,
            own: false,
            source: Source::Path(path),
        }),
    }
}

/// Why the namespace a quota names could not be found (it makes the source unavailable).
#[derive(Debug, thiserror::Error)]
pub enum FindError {
    #[error("network namespace `{0}` not found")]
    NoNetns(String),
    #[error("no running process of container `{0}` found, so no network namespace to poll in")]
    NoContainer(String),
    #[error("container id prefix `{prefix}` is ambiguous: it starts {}", ids.join(", "))]
    Ambiguous { prefix: String, ids: Vec<String> },
    #[error(transparent)]
    Netns(#[from] NetnsError),
}

/// The namespace `wanted` names: "host" (connreap's own), a name under `/run/netns` or
/// `/run/docker/netns`, or an inode (of a namespace a process lives in or a name refers to).
pub fn find(wanted: &str) -> Result<Namespace, FindError> {
    let is_name = wanted != "host" && wanted.parse::<u32>().is_err();
    if is_name && !wanted.contains('/') {
        // Names only come from these directories: no need to walk /proc.
        for dir in NAMED_DIRS {
            let path = std::path::Path::new(dir).join(wanted);
            if let Ok(m) = fs::metadata(&path) {
                let inode = m.ino() as u32;
                return Ok(Namespace {
                    inode,
                    name: Some(wanted.to_string()),
                    own: inode == current_inode()?,
                    source: Source::Path(path),
                });
            }
        }
        return Err(FindError::NoNetns(wanted.to_string()));
    }
    let spaces = if wanted == "host" {
        // Only the own namespace can match: no need to walk /proc.
        vec![Namespace {
            inode: current_inode()?,
            name: None,
            own: true,
            source: Source::Path(PathBuf::from("/proc/thread-self/ns/net")),
        }]
    } else {
        discover()?
    };
    spaces
        .into_iter()
        .find(|n| n.is(wanted))
        .ok_or_else(|| FindError::NoNetns(wanted.to_string()))
}

/// The namespace of the container whose id starts with `prefix` (lowercase hex), through
/// `/proc/<pid>/ns/net` of one of its processes; also that pid. `hint` (the pid found last
/// time) is tried first: while it still runs in such a container, /proc is not walked. A
/// walk finding processes of two containers with that prefix is an error, never a guess.
pub fn of_container(prefix: &str, hint: Option<u32>) -> Result<(Namespace, u32), FindError> {
    let in_container = |pid: u32| {
        let c = crate::containers::from_cgroup(&crate::kernel::procfs::cgroup(pid)?)?;
        c.id.starts_with(prefix).then_some((c.id, pid))
    };
    let pid = match hint.and_then(in_container) {
        Some((_, pid)) => pid,
        None => {
            let pids = fs::read_dir("/proc").map(|d| {
                d.flatten()
                    .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
                    .collect::<Vec<u32>>()
            });
            pick_container(
                prefix,
                pids.unwrap_or_default()
                    .into_iter()
                    .filter_map(in_container),
            )?
        }
    };
    let path = PathBuf::from(format!("/proc/{pid}/ns/net"));
    let inode = fs::metadata(&path)
        .map_err(|_| FindError::NoContainer(prefix.to_string()))?
        .ino() as u32;
    let ns = Namespace {
        inode,
        name: None,
        own: inode == current_inode()?,
        source: Source::Path(path),
    };
    Ok((ns, pid))
}

/// The lowest pid among `(container id, pid)` of the containers matching `prefix`, unless
/// they are more than one container.
fn pick_container(
    prefix: &str,
    found: impl Iterator<Item = (String, u32)>,
) -> Result<u32, FindError> {
    let mut ids: Vec<String> = Vec::new();
    let mut lowest: Option<u32> = None;
    for (id, pid) in found {
        if !ids.contains(&id) {
            ids.push(id);
        }
        lowest = Some(lowest.map_or(pid, |l| l.min(pid)));
    }
    match (ids.len(), lowest) {
        (1, Some(pid)) => Ok(pid),
        (0, _) | (_, None) => Err(FindError::NoContainer(prefix.to_string())),
        _ => {
            ids.sort();
            Err(FindError::Ambiguous {
                prefix: prefix.to_string(),
                ids,
            })
        }
    }
}

impl Namespace {
    /// Whether `wanted` (a name, an inode or "host") names this namespace, as
    /// `table::Netns::matches` reads it (less "all").
    pub fn is(&self, wanted: &str) -> bool {
        (wanted == "host" && self.own)
            || self.name.as_deref() == Some(wanted)
            || wanted.parse::<u32>().is_ok_and(|i| i == self.inode)
    }

    /// The namespace of a file.
    #[cfg(test)]
    pub fn at(path: &std::path::Path) -> Result<Namespace, NetnsError> {
        let own = current_inode()?;
        let m = fs::metadata(path).map_err(|source| NetnsError::Open {
            inode: 0,
            path: path.to_path_buf(),
            source,
        })?;
        let inode = m.ino() as u32;
        Ok(Namespace {
            inode,
            name: None,
            own: inode == own,
            source: Source::Path(path.to_path_buf()),
        })
    }

    /// Open the namespace and check the fd refers to this namespace (a reused pid's, a
    /// reused descriptor's would not).
    fn open(&self) -> Result<OwnedFd, NetnsError> {
        let file = match &self.source {
            Source::Path(path) => self.open_path(path)?,
            Source::Held { pid, fd } => match held::open(*pid, *fd) {
                Ok(fd) => fs::File::from(fd),
                Err(e) if e.is_gone() => return Err(NetnsError::Gone { inode: self.inode }),
                Err(source) => {
                    return Err(NetnsError::Held {
                        inode: self.inode,
                        source,
                    })
                }
            },
        };
        match file.metadata() {
            Ok(m) if m.ino() as u32 == self.inode => Ok(file.into()),
            _ => Err(NetnsError::Gone { inode: self.inode }),
        }
    }

    /// Open the namespace's file.
    fn open_path(&self, path: &std::path::Path) -> Result<fs::File, NetnsError> {
        match fs::File::open(path) {
            Ok(f) => Ok(f),
            Err(e)
                if matches!(
                    e.raw_os_error(),
                    Some(libc::ENOENT) | Some(libc::ESRCH) | Some(libc::EINVAL)
                ) =>
            {
                Err(NetnsError::Gone { inode: self.inode })
            }
            Err(source) => Err(NetnsError::Open {
                inode: self.inode,
                path: path.to_path_buf(),
                source,
            }),
        }
    }

    /// Move the calling thread into this namespace. Only for threads of [`run_in`], [`visit`]
    /// and [`spawn_in`], which end with the work done there.
    fn enter(&self) -> Result<(), NetnsError> {
        let fd = self.open()?;
        // SAFETY: setns on a valid namespace fd; it changes only the calling thread's network
        // namespace.
        if unsafe { libc::setns(fd.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
            return Err(NetnsError::Enter {
                inode: self.inode,
                source: std::io::Error::last_os_error(),
            });
        }
        Ok(())
    }
}

/// Start a thread of its own that enters `ns` and runs `f` with whether it got there, for work
/// that stays in a namespace (a quota poller keeping its connections). The thread ends with
/// `f`. Err: the thread could not be started.
pub fn spawn_in<F>(ns: Namespace, f: F) -> std::io::Result<()>
where
    F: FnOnce(Result<(), NetnsError>) + Send + 'static,
{
    std::thread::Builder::new()
        .name("connreap-netns".into())
        .spawn(move || {
            let entered = if ns.own { Ok(()) } else { ns.enter() };
            f(entered)
        })
        .map(drop)
}

/// Run `f` inside `ns`: on the calling thread for connreap's own namespace, else on a thread
/// of its own that enters the namespace first and ends with `f`.
pub fn run_in<R: Send>(ns: &Namespace, f: impl FnOnce() -> R + Send) -> Result<R, NetnsError> {
    if ns.own {
        return Ok(f());
    }
    std::thread::scope(|scope| {
        let worker = std::thread::Builder::new()
            .name("connreap-netns".into())
            .spawn_scoped(scope, || {
                ns.enter()?;
                Ok(f())
            });
        match worker {
            Ok(handle) => handle
                .join()
                .unwrap_or(Err(NetnsError::Panicked { inode: ns.inode })),
            Err(source) => Err(NetnsError::Enter {
                inode: ns.inode,
                source,
            }),
        }
    })
}

/// Run `f` inside each of `spaces` in turn, on one thread of its own (which starts in
/// connreap's namespace, so its own is visited without setns); `f` is not called for a
/// namespace that could not be entered, whose error is returned with it instead.
pub fn visit<'n>(
    spaces: &'n [Namespace],
    mut f: impl FnMut(&'n Namespace) + Send,
) -> Vec<(&'n Namespace, NetnsError)> {
    let mut failed = Vec::new();
    let (own, others): (Vec<&Namespace>, Vec<&Namespace>) = spaces.iter().partition(|n| n.own);
    for ns in own {
        f(ns);
    }
    if others.is_empty() {
        return failed;
    }
    std::thread::scope(|scope| {
        let worker = std::thread::Builder::new()
            .name("connreap-netns".into())
            .spawn_scoped(scope, || {
                let mut failed = Vec::new();
                for ns in others.iter().copied() {
                    match ns.enter() {
                        Ok(()) => f(ns),
                        Err(e) => failed.push((ns, e)),
                    }
                }
                failed
            });
        match worker.map(|h| h.join()) {
            Ok(Ok(mut f)) => failed.append(&mut f),
            Ok(Err(_)) => failed.extend(
                others
                    .iter()
                    .map(|ns| (*ns, NetnsError::Panicked { inode: ns.inode })),
            ),
            Err(_) => failed.extend(others.iter().map(|ns| {
                (
                    *ns,
                    NetnsError::Enter {
                        inode: ns.inode,
                        source: std::io::Error::other("cannot start a thread"),
                    },
                )
            })),
        }
    });
    failed
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn namespace_links_give_their_inode() {
        use std::path::Path;
        assert_eq!(link_inode(Path::new("net:[4026531840]")), Some(4026531840));
        for bad in [
            "net:[]",
            "mnt:[4026531840]",
            "net:[x]",
            "net:[99999999999]",
            "",
        ] {
            assert_eq!(link_inode(Path::new(bad)), None, "{bad}");
        }
        // The own namespace's link and its inode agree.
        let link = fs::read_link("/proc/self/ns/net").expect("own ns link");
        let ino = fs::metadata("/proc/self/ns/net").expect("own ns").ino() as u32;
        assert_eq!(link_inode(&link), Some(ino));
    }

    #[test]
    fn own_namespace_comes_first_and_once() {
        let found = discover().expect("discover");
        assert!(found[0].own);
        assert_eq!(found[0].inode, current_inode().unwrap());
        let mut inodes: Vec<u32> = found.iter().map(|n| n.inode).collect();
        inodes.sort_unstable();
        inodes.dedup();
        assert_eq!(inodes.len(), found.len(), "deduplicated: {found:?}");
        assert_eq!(found.iter().filter(|n| n.own).count(), 1);
    }

    #[test]
    fn names_are_kept_for_known_namespaces() {
        let mut found = Vec::new();
        add(&mut found, 7, None, "/proc/1/ns/net".into());
        add(&mut found, 7, Some("blue".into()), "/run/netns/blue".into());
        add(&mut found, 8, Some("red".into()), "/run/netns/red".into());
        add(
            &mut found,
            8,
            Some("other".into()),
            "/run/docker/netns/x".into(),
        );
        assert_eq!(found.len(), 2);
        assert_eq!(found[0].name.as_deref(), Some("blue"));
        assert_eq!(found[1].name.as_deref(), Some("red"));
    }

    #[test]
    fn a_namespace_file_that_vanished_is_gone_not_an_error() {
        let ns = Namespace {
            inode: 1,
            name: None,
            own: false,
            source: Source::Path("/proc/4294967295/ns/net".into()),
        };
        let err = run_in(&ns, || ()).unwrap_err();
        assert!(err.is_gone(), "{err:?}");
        let visited = visit(std::slice::from_ref(&ns), |_| panic!("not entered"));
        assert!(visited[0].1.is_gone());
    }

    #[test]
    fn namespaces_are_found_by_name_inode_or_host() {
        let ns = |inode, name: Option<&str>, own| Namespace {
            inode,
            name: name.map(String::from),
            own,
            source: Source::Path("/x".into()),
        };
        let blue = ns(7, Some("blue"), false);
        assert!(blue.is("blue") && blue.is("7"));
        assert!(!blue.is("host") && !blue.is("all") && !blue.is("8") && !blue.is("red"));
        let own = ns(9, None, true);
        assert!(own.is("host") && own.is("9"));
        // The real host: "host" is found without walking /proc; unknown names are errors.
        let host = find("host").unwrap();
        assert!(host.own);
        assert_eq!(find(&host.inode.to_string()).unwrap().inode, host.inode);
        let e = find("connreap-no-such-netns").unwrap_err();
        assert_eq!(
            e.to_string(),
            "network namespace `connreap-no-such-netns` not found"
        );
    }

    #[test]
    fn a_container_prefix_names_one_container() {
        let a = || "ab".repeat(32);
        let b = || format!("abcd{}", "0".repeat(60));
        let found = |list: Vec<(String, u32)>| pick_container("ab", list.into_iter());
        assert_eq!(found(vec![(a(), 30), (a(), 20)]).unwrap(), 20);
        let e = found(vec![(a(), 30), (b(), 20)]).unwrap_err().to_string();
        assert!(
            e.starts_with("container id prefix `ab` is ambiguous: it starts abab"),
            "{e}"
        );
        assert!(e.contains(&b()), "{e}");
        let e = found(vec![]).unwrap_err().to_string();
        assert!(
            e.starts_with("no running process of container `ab` found"),
            "{e}"
        );
        // No container on this host has such an id.
        assert!(matches!(
            of_container("fedcba9876543210", None),
            Err(FindError::NoContainer(_))
        ));
    }

    #[test]
    fn own_namespace_runs_inline() {
        let own = Namespace::at(std::path::Path::new("/proc/self/ns/net")).unwrap();
        assert!(own.own);
        let me = std::thread::current().id();
        assert_eq!(run_in(&own, || std::thread::current().id()).unwrap(), me);
    }
}
