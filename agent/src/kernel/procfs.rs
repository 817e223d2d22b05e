//! What a scan reads about the host outside the BPF programs: the namespace's ephemeral port
//! range, a process's systemd unit and command name (from /proc), and the monotonic clock that
//! first-seen bounds are kept in.
use std::{fs, ops::RangeInclusive};

/// net.ipv4.ip_local_port_range of this network namespace, if readable.
pub fn ephemeral_ports() -> Option<RangeInclusive<u16>> {
    fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|t| parse_port_range(&t))
}

/// net.ipv4.tcp_keepalive_{time,intvl,probes} of this network namespace, if readable.
pub fn keepalive() -> Option<crate::table::Keepalive> {
    let read = |name: &str| -> Option<u64> {
        fs::read_to_string(format!("/proc/sys/net/ipv4/tcp_keepalive_{name}"))
            .ok()?
            .trim()
            .parse()
            .ok()
    };
    Some(crate::table::Keepalive {
        time_secs: read("time")?,
        intvl_secs: read("intvl")?,
        probes: read("probes")?,
    })
}

/// What the kernel counts of the TCP sockets of the calling thread's network namespace
/// (`/proc/thread-self/net/sockstat` and `sockstat6`): no socket is visited to count them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SockStat {
    /// Hashed full sockets, IPv4 and IPv6 (`TCP: inuse`, `TCP6: inuse`): listening,
    /// connecting, connected and closing ones.
    pub inuse: u64,
    /// Timewait sockets (`TCP: tw`, both families).
    pub tw: u64,
}

/// [`SockStat`] of this thread's network namespace; None when unreadable.
pub fn sockstat() -> Option<SockStat> {
    let v4 = fs::read_to_string("/proc/thread-self/net/sockstat").ok()?;
    // Without IPv6 there is no sockstat6.
    let v6 = fs::read_to_string("/proc/thread-self/net/sockstat6").unwrap_or_default();
    parse_sockstat(&v4, &v6)
}

/// The counts of [`sockstat`] from the two files' text; None when `TCP:` lacks them.
pub fn parse_sockstat(v4: &str, v6: &str) -> Option<SockStat> {
    fn field(text: &str, line: &str, name: &str) -> Option<u64> {
        let rest = text.lines().find_map(|l| l.strip_prefix(line))?;
        let mut words = rest.split_whitespace();
        while let Some(w) = words.next() {
            if w == name {
                return words.next()?.parse().ok();
            }
        }
        None
    }
    Some(SockStat {
        inuse: field(v4, "TCP:", "inuse")? + field(v6, "TCP6:", "inuse").unwrap_or(0),
        tw: field(v4, "TCP:", "tw")?,
    })
}

/// The TCP connections this network namespace's conntrack translated (DNAT/SNAT), from
/// `/proc/net/nf_conntrack`; empty when connection tracking is not loaded or not readable.
pub fn conntrack() -> Vec<crate::detect::Nat> {
    fs::read_to_string("/proc/net/nf_conntrack")
        .map(|t| crate::detect::parse_conntrack(&t))
        .unwrap_or_default()
}

/// The contents of `/proc/<pid>/cgroup`; None when the process has gone.
pub fn cgroup(pid: u32) -> Option<String> {
    fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()
}

/// The command name of process `pid` (its thread-group leader's, as the owner dump reports
/// it); None when it has gone.
pub fn process_comm(pid: u32) -> Option<String> {
    let mut comm = fs::read_to_string(format!("/proc/{pid}/comm")).ok()?;
    if comm.ends_with('\n') {
        comm.pop();
    }
    Some(comm)
}

/// The processes of this PID namespace (the host's, for the daemon: see hostPID in the
/// Kubernetes manifest), sorted: the numeric entries of /proc (thread groups; threads are not
/// listed). None when /proc cannot be listed.
pub fn processes() -> Option<Vec<u32>> {
    let mut pids: Vec<u32> = fs::read_dir("/proc")
        .ok()?
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .collect();
    pids.sort_unstable();
    Some(pids)
}

/// Whether process `pid` has a socket of any kind among its descriptors (a `socket:[N]` link
/// in /proc/PID/fd). A process that is gone has none; one whose descriptors cannot be read
/// is taken to have some.
pub fn holds_sockets(pid: u32) -> bool {
    use std::{io::ErrorKind::NotFound, os::unix::ffi::OsStrExt as _};
    let dir = match fs::read_dir(format!("/proc/{pid}/fd")) {
        Ok(dir) => dir,
        Err(e) if e.kind() == NotFound => return false,
        Err(_) => return true,
    };
    for entry in dir {
        let Ok(entry) = entry else {
            return true;
        };
        match fs::read_link(entry.path()) {
            Ok(link) if link.as_os_str().as_bytes().starts_with(b"socket:") => return true,
            Ok(_) => {}
            // Closed since the listing.
            Err(e) if e.kind() == NotFound => {}
            Err(_) => return true,
        }
    }
    false
}

/// CLOCK_MONOTONIC in ns.
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes the timespec we pass; CLOCK_MONOTONIC always exists.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Parse /proc/sys/net/ipv4/ip_local_port_range ("32768\t60999").
fn parse_port_range(text: &str) -> Option<RangeInclusive<u16>> {
    let mut it = text.split_whitespace().map(|v| v.parse::<u16>());
    match (it.next(), it.next()) {
        (Some(Ok(a)), Some(Ok(b))) if a <= b => Some(a..=b),
        _ => None,
    }
}

/// systemd unit from the contents of /proc/<pid>/cgroup: the last `.service`/`.scope` path
/// component, else the cgroup path itself (None for the root cgroup).
pub fn unit_from_cgroup(contents: &str) -> Option<String> {
    let path = contents
        .lines()
        .find_map(|l| l.strip_prefix("0::"))
        .or_else(|| {
            contents
                .lines()
                .next()
                .and_then(|l| l.splitn(3, ':').nth(2))
        })?
        .trim();
    if path.is_empty() || path == "/" {
        return None;
    }
    path.rsplit('/')
        .find(|c| c.ends_with(".service") || c.ends_with(".scope"))
        .map(str::to_string)
        .or_else(|| Some(path.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_port_ranges() {
        assert_eq!(parse_port_range("10000\t20000\n"), Some(10000..=20000));
        assert_eq!(parse_port_range("20000\t10000\n"), None);
        assert_eq!(parse_port_range("garbage"), None);
    }

    #[test]
    fn reads_process_names() {
        let me = process_comm(std::process::id()).expect("own comm");
        assert!(!me.is_empty() && !me.ends_with('\n'), "{me:?}");
        assert_eq!(process_comm(u32::MAX), None);
    }

    #[test]
    fn units_from_cgroups() {
        assert_eq!(
            unit_from_cgroup("0::/system.slice/nginx.service\n").as_deref(),
            Some("nginx.service")
        );
        assert_eq!(unit_from_cgroup("0::/\n"), None);
        assert_eq!(
            unit_from_cgroup("0::/mygroup\n").as_deref(),
            Some("/mygroup")
        );
        assert_eq!(
            unit_from_cgroup("12:pids:/user.slice/session-4.scope\n").as_deref(),
            Some("session-4.scope")
        );
    }

    #[test]
    fn sockstat_counts_both_families_and_names_a_missing_field() {
        let v4 = "sockets: used 12\nTCP: inuse 3 orphan 32 tw 157 alloc 44 mem 249\nUDP: inuse 0 mem 0\n";
        let v6 = "TCP6: inuse 2\nUDP6: inuse 0\n";
        assert_eq!(parse_sockstat(v4, v6), Some(SockStat { inuse: 5, tw: 157 }));
        assert_eq!(parse_sockstat(v4, ""), Some(SockStat { inuse: 3, tw: 157 }));
        assert_eq!(parse_sockstat("TCP: inuse 3 orphan 0\n", v6), None);
        assert_eq!(parse_sockstat("garbage", ""), None);
        assert!(
            sockstat().is_some(),
            "this thread's namespace has a sockstat"
        );
    }

    #[test]
    fn processes_are_listed_sorted_and_a_new_one_is_seen_with_its_sockets() {
        let before = processes().expect("/proc lists");
        assert!(before.windows(2).all(|w| w[0] < w[1]), "sorted, no repeats");
        assert!(before.contains(&std::process::id()));
        let mut child = std::process::Command::new("sleep")
            .arg("5")
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("sleep");
        let during = processes().expect("/proc lists");
        assert!(during.contains(&child.id()) && !before.contains(&child.id()));
        // `sleep` with its standard streams on /dev/null has no socket; this process, with a
        // listener open, has one.
        assert!(!holds_sockets(child.id()));
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        assert!(holds_sockets(std::process::id()));
        drop(listener);
        child.kill().expect("kill");
        child.wait().expect("reap");
        // Gone (reaped): none.
        assert!(!holds_sockets(child.id()));
    }
}
