//! Who else uses connreap's pins: a process holding an fd of a pinned map or program (or of a
//! link to one), as its `/proc/PID/fdinfo` names the object's id. `connreap unpin` refuses to
//! reset a tracker that another running connreap uses (a DaemonSet pod beside a package
//! install, whose prerm runs `unpin`).
//!
//! Why fdinfo and not a lock file: bpffs cannot hold a regular file, and a lock file elsewhere
//! (`/run/lock`) is not shared between a pod and its host, while the pins are. A process that
//! uses the pins holds their fds whatever its mount or pid namespace, the host's /proc shows
//! them, and it needs no cooperation (an older connreap that takes no lock is seen too). An fd
//! can be closed the moment after the check; that race is the operator's, as with any `rm`.
use std::{collections::HashSet, fs, path::Path};

use aya::{maps::MapInfo, programs::ProgramInfo};

use super::pins::PIN_NAMES;

/// A process that holds one of the pinned objects.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PinUser {
    pub pid: u32,
    pub comm: String,
}

impl std::fmt::Display for PinUser {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "pid {} ({})", self.pid, self.comm.escape_debug())
    }
}

/// The ids of the maps and programs pinned in connreap's directories.
#[derive(Debug, Default)]
pub struct Ids {
    maps: HashSet<u32>,
    progs: HashSet<u32>,
}

impl Ids {
    /// Add the objects pinned under `dir` (only connreap's own pin names).
    pub fn add_dir(&mut self, dir: &Path) {
        for name in PIN_NAMES {
            let p = dir.join(name);
            if let Ok(m) = MapInfo::from_pin(&p) {
                self.maps.insert(m.id());
            } else if let Ok(prog) = ProgramInfo::from_pin(&p) {
                self.progs.insert(prog.id());
            }
        }
    }

    pub fn is_empty(&self) -> bool {
        self.maps.is_empty() && self.progs.is_empty()
    }

    /// Whether an fd's fdinfo text names one of these objects (`map_id:` of a map fd,
    /// `prog_id:` of a program or link fd).
    fn named_in(&self, fdinfo: &str) -> bool {
        fdinfo.lines().any(|l| {
            let id = |prefix: &str| {
                l.strip_prefix(prefix)
                    .and_then(|v| v.trim().parse::<u32>().ok())
            };
            id("map_id:").is_some_and(|i| self.maps.contains(&i))
                || id("prog_id:").is_some_and(|i| self.progs.contains(&i))
        })
    }
}

/// Every process but this one that holds an fd of one of `ids`, by pid.
pub fn users(ids: &Ids) -> Vec<PinUser> {
    let me = std::process::id();
    let Ok(procs) = fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut out: Vec<PinUser> = procs
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| *pid != me && holds(*pid, ids))
        .map(|pid| PinUser {
            pid,
            comm: fs::read_to_string(format!("/proc/{pid}/comm"))
                .map(|c| c.trim_end().to_string())
                .unwrap_or_else(|_| "?".into()),
        })
        .collect();
    out.sort_by_key(|u| u.pid);
    out
}

/// Whether process `pid` holds a BPF map, program or link fd naming one of `ids`.
fn holds(pid: u32, ids: &Ids) -> bool {
    let Ok(fds) = fs::read_dir(format!("/proc/{pid}/fd")) else {
        return false;
    };
    fds.flatten().any(|fd| {
        let bpf = fs::read_link(fd.path()).is_ok_and(|t| {
            t.to_str().is_some_and(|t| {
                t.starts_with("anon_inode:bpf-") || t.starts_with("anon_inode:bpf_")
            })
        });
        bpf && fs::read_to_string(format!(
            "/proc/{pid}/fdinfo/{}",
            fd.file_name().to_string_lossy()
        ))
        .is_ok_and(|info| ids.named_in(&info))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fdinfo_names_pinned_maps_and_programs() {
        let ids = Ids {
            maps: HashSet::from([17]),
            progs: HashSet::from([40]),
        };
        let map = "pos:\t0\nflags:\t02000002\nmnt_id:\t15\nino:\t1057\nmap_type:\t1\nmap_id:\t17\n";
        let other_map = "map_type:\t1\nmap_id:\t170\n";
        let link = "link_type:\ttracing\nlink_id:\t3\nprog_tag:\tab\nprog_id:\t40\n";
        let other_prog = "prog_type:\t26\nprog_id:\t41\n";
        assert!(ids.named_in(map));
        assert!(ids.named_in(link));
        assert!(!ids.named_in(other_map));
        assert!(!ids.named_in(other_prog));
        assert!(!ids.named_in("pos:\t0\nflags:\t02\n"));
        // A map id is not a program id.
        let crossed = Ids {
            maps: HashSet::from([40]),
            progs: HashSet::new(),
        };
        assert!(!crossed.named_in(link));
    }

    #[test]
    fn a_user_is_named_by_pid_and_escaped_comm() {
        let u = PinUser {
            pid: 812,
            comm: "con\u{1b}[31m".into(),
        };
        assert_eq!(u.to_string(), "pid 812 (con\\u{1b}[31m)");
    }
}
