//! The host's reading of a guest's serial log (the protocol is in guest.sh) and the verdict
//! for each tested feature.
use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
};

use serde_json::Value;

/// What a guest printed: facts and blocks (with the exit status that produced them).
#[derive(Debug, Default)]
pub struct GuestLog {
    pub facts: HashMap<String, String>,
    pub blocks: HashMap<String, Block>,
}

#[derive(Debug, Default)]
pub struct Block {
    pub rc: i32,
    pub text: String,
}

impl GuestLog {
    pub fn parse(serial: &str) -> GuestLog {
        let mut log = GuestLog::default();
        let mut open: Option<(String, String)> = None;
        for raw in serial.lines() {
            let line = raw.trim_end_matches('\r');
            let marker = line.trim_start();
            if let Some((name, mut text)) = open.take() {
                match marker.strip_prefix("@@end ") {
                    Some(end) if end.split_whitespace().next() == Some(name.as_str()) => {
                        let rc = end
                            .split_whitespace()
                            .find_map(|w| w.strip_prefix("rc="))
                            .and_then(|v| v.parse().ok())
                            .unwrap_or(-1);
                        let text = text.trim_end().to_string();
                        log.blocks.insert(name, Block { rc, text });
                    }
                    _ => {
                        text.push_str(line);
                        text.push('\n');
                        open = Some((name, text));
                    }
                }
            } else if let Some(name) = marker.strip_prefix("@@begin ") {
                open = Some((name.trim().to_string(), String::new()));
            } else if let Some(fact) = marker.strip_prefix("@@fact ") {
                let (k, v) = fact.split_once(' ').unwrap_or((fact, ""));
                log.facts.insert(k.to_string(), v.trim().to_string());
            }
        }
        log
    }

    pub fn fact(&self, name: &str) -> Option<&str> {
        self.facts.get(name).map(String::as_str)
    }

    pub fn text(&self, name: &str) -> &str {
        self.blocks.get(name).map_or("", |b| b.text.as_str())
    }

    pub fn rc(&self, name: &str) -> Option<i32> {
        self.blocks.get(name).map(|b| b.rc)
    }
}

/// One table cell: the verdict on a feature and what was seen.
#[derive(Debug, Clone)]
pub struct Cell {
    pub ok: bool,
    pub text: String,
}

impl Cell {
    pub fn ok(text: impl Into<String>) -> Cell {
        Cell {
            ok: true,
            text: text.into(),
        }
    }
    pub fn fail(text: impl Into<String>) -> Cell {
        Cell {
            ok: false,
            text: format!("FAIL: {}", text.into()),
        }
    }
}

/// A TCP socket as /proc/net/tcp{,6} shows it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct KernelSocket {
    pub local: SocketAddr,
    pub peer: SocketAddr,
    pub state: &'static str,
    pub inode: u64,
}

const STATES: [&str; 12] = [
    "ESTABLISHED",
    "SYN_SENT",
    "SYN_RECV",
    "FIN_WAIT1",
    "FIN_WAIT2",
    "TIME_WAIT",
    "CLOSE",
    "CLOSE_WAIT",
    "LAST_ACK",
    "LISTEN",
    "CLOSING",
    "NEW_SYN_RECV",
];

/// "0100007F:1B59" (IPv4) or 32 hex digits and a port (IPv6): words in the kernel's
/// (little-endian) byte order, the port in host order.
fn proc_addr(s: &str) -> Option<SocketAddr> {
    let (ip, port) = s.split_once(':')?;
    let port = u16::from_str_radix(port, 16).ok()?;
    let mut bytes = Vec::with_capacity(16);
    for chunk in ip.as_bytes().chunks(8) {
        let word = u32::from_str_radix(std::str::from_utf8(chunk).ok()?, 16).ok()?;
        bytes.extend_from_slice(&word.to_le_bytes());
    }
    let ip = match bytes.len() {
        4 => IpAddr::V4(Ipv4Addr::new(bytes[0], bytes[1], bytes[2], bytes[3])),
        16 => IpAddr::V6(Ipv6Addr::from(<[u8; 16]>::try_from(bytes).ok()?)),
        _ => return None,
    };
    Some(SocketAddr::new(ip, port))
}

/// The rows of /proc/net/tcp and /proc/net/tcp6 (headers and noise skipped).
pub fn kernel_sockets(text: &str) -> Vec<KernelSocket> {
    text.lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            if f.len() < 10 || !f[0].ends_with(':') {
                return None;
            }
            let st = usize::from_str_radix(f[3], 16).ok()?;
            Some(KernelSocket {
                local: proc_addr(f[1])?,
                peer: proc_addr(f[2])?,
                state: STATES.get(st.checked_sub(1)?)?,
                inode: f[9].parse().ok()?,
            })
        })
        .collect()
}

/// The owners /proc/PID/fd shows for each socket inode: (pid, fd, comm).
fn fd_owners(text: &str) -> HashMap<u64, Vec<(u64, u64, String)>> {
    let mut owners: HashMap<u64, Vec<(u64, u64, String)>> = HashMap::new();
    for l in text.lines() {
        let mut f = l.splitn(4, ' ');
        let (Some(pid), Some(fd), Some(link)) = (f.next(), f.next(), f.next()) else {
            continue;
        };
        let inode = link
            .strip_prefix("socket:[")
            .and_then(|s| s.strip_suffix(']'))
            .and_then(|s| s.parse().ok());
        if let (Ok(pid), Ok(fd), Some(inode)) = (pid.parse(), fd.parse(), inode) {
            let comm = f.next().unwrap_or("").to_string();
            owners.entry(inode).or_default().push((pid, fd, comm));
        }
    }
    owners
}

fn is_mapped(a: &SocketAddr) -> bool {
    matches!(a.ip(), IpAddr::V6(ip) if ip.to_ipv4_mapped().is_some())
}

/// The snapshot against the kernel's view taken right after it: the same sockets (4-tuple,
/// state, inode), the owners /proc/PID/fd shows, and every family and state the fixtures made.
pub fn snapshot(log: &GuestLog) -> Cell {
    if log.rc("snapshot.out") != Some(0) {
        return Cell::fail(format!(
            "snapshot exited {:?}: {}",
            log.rc("snapshot.out"),
            first_line(log.text("snapshot.err"))
        ));
    }
    let json: Value = match serde_json::from_str(log.text("snapshot.out")) {
        Ok(v) => v,
        Err(e) => return Cell::fail(format!("snapshot --json is not JSON: {e}")),
    };
    let rows = json["sockets"].as_array().cloned().unwrap_or_default();
    let kernel = kernel_sockets(log.text("tcp-at-snapshot"));
    let owners = fd_owners(log.text("fds"));
    let mut problems = Vec::new();
    let mut seen = Vec::new();
    for r in &rows {
        let addr = |k: &str| r[k].as_str().and_then(|s| s.parse::<SocketAddr>().ok());
        let (Some(local), Some(peer), Some(state)) =
            (addr("local"), addr("peer"), r["state"].as_str())
        else {
            problems.push(format!("unreadable row {r}"));
            continue;
        };
        let inode = r["inode"].as_u64().unwrap_or(0);
        let Some(state) = STATES.iter().find(|s| **s == state) else {
            problems.push(format!("unknown state in {r}"));
            continue;
        };
        seen.push(KernelSocket {
            local,
            peer,
            state,
            inode,
        });
        let expected = owners.get(&inode).filter(|_| inode != 0);
        let got = (r["pid"].as_u64(), r["fd"].as_u64(), r["comm"].as_str());
        match (expected, got) {
            (None, (None, _, _)) => {}
            (Some(o), (Some(pid), Some(fd), Some(comm))) => {
                if !o.iter().any(|(p, f, c)| *p == pid && *f == fd && c == comm) {
                    problems.push(format!(
                        "{local} {state}: owner {pid}/{fd}/{comm}, /proc says {o:?}"
                    ));
                }
            }
            (o, _) => problems.push(format!("{local} {state}: owner {got:?}, /proc says {o:?}")),
        }
    }
    let (mut want, mut have) = (kernel.clone(), seen.clone());
    want.sort();
    have.sort();
    if want != have {
        let missing: Vec<_> = want.iter().filter(|k| !have.contains(k)).collect();
        let extra: Vec<_> = have.iter().filter(|k| !want.contains(k)).collect();
        problems.push(format!(
            "not in the snapshot: {missing:?}; not in /proc: {extra:?}"
        ));
    }
    let states: BTreeSet<&str> = seen.iter().map(|s| s.state).collect();
    for need in ["LISTEN", "ESTABLISHED", "CLOSE_WAIT", "FIN_WAIT2"] {
        if !states.contains(need) {
            problems.push(format!("no {need} socket"));
        }
    }
    let est = |f: &dyn Fn(&SocketAddr) -> bool| {
        seen.iter()
            .any(|s| s.state == "ESTABLISHED" && f(&s.local) && f(&s.peer))
    };
    if !est(&|a| a.is_ipv4()) || !est(&|a| a.is_ipv6() && !is_mapped(a)) || !est(&is_mapped) {
        problems.push("missing one of v4, v6, v4-mapped ESTABLISHED pairs".into());
    }
    if !problems.is_empty() {
        return Cell::fail(problems.join("; "));
    }
    let owned = rows.iter().filter(|r| r["pid"].is_u64()).count();
    Cell::ok(format!(
        "ok: {}/{} sockets and {owned} owners match /proc ({}; v4, v6, v4-mapped)",
        seen.len(),
        kernel.len(),
        states.into_iter().collect::<Vec<_>>().join(", ")
    ))
}

fn first_line(s: &str) -> &str {
    s.lines()
        .find(|l| !l.trim().is_empty())
        .unwrap_or("")
        .trim()
}

/// Findings with kind close_wait_buildup in a GET /v1/findings body.
fn close_wait_findings(body: &str) -> Vec<Value> {
    serde_json::from_str::<Value>(body)
        .ok()
        .and_then(|v| {
            v["findings"].as_array().map(|a| {
                a.iter()
                    .filter(|f| f["kind"] == "close_wait_buildup")
                    .cloned()
                    .collect()
            })
        })
        .unwrap_or_default()
}

/// The daemon saw the CLOSE_WAIT build-up on :7005 fire (API and log), saw it resolve once
/// the policy had killed the sockets, and shut down cleanly on SIGTERM.
pub fn daemon(log: &GuestLog) -> Cell {
    let firing = close_wait_findings(log.text("findings-firing"));
    let err = log.text("daemon.err");
    let mut problems = Vec::new();
    match firing.as_slice() {
        [f] if f["service_port"] == 7005 && f["count"] == 4 => {}
        other => problems.push(format!("GET /v1/findings while firing: {other:?}")),
    }
    if !close_wait_findings(log.text("findings-resolved")).is_empty()
        || log.text("findings-resolved").is_empty()
    {
        problems.push(format!("not resolved: {}", log.text("findings-resolved")));
    }
    let logged = |what: &str| {
        err.lines()
            .any(|l| l.contains(what) && l.contains("close_wait_buildup"))
    };
    if !logged("firing:") || !logged("resolved") {
        problems.push("the daemon log lacks the firing or resolved line".into());
    }
    if log.rc("daemon.err") != Some(0) {
        problems.push(format!(
            "exit status {:?} after SIGTERM",
            log.rc("daemon.err")
        ));
    }
    if problems.is_empty() {
        Cell::ok(
            "ok: fired (4 CLOSE_WAIT, port 7005), resolved after the kills, clean SIGTERM exit",
        )
    } else {
        Cell::fail(problems.join("; "))
    }
}

/// Decisions (audit or `reclaim` JSON lines) counted by result.
fn results(lines: &str) -> BTreeMap<String, usize> {
    let mut n = BTreeMap::new();
    for v in lines
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
    {
        if let Some(r) = v["result"].as_str() {
            *n.entry(r.to_string()).or_default() += 1;
        }
    }
    n
}

fn close_waits_to(view: &str, port: u16) -> usize {
    kernel_sockets(view)
        .iter()
        .filter(|s| s.state == "CLOSE_WAIT" && s.peer.port() == port)
        .count()
}

/// The enforce policy killed the 4 sockets through netlink SOCK_DESTROY.
pub fn netlink(log: &GuestLog) -> Cell {
    let killed = results(log.text("audit-netlink"))
        .get("killed")
        .copied()
        .unwrap_or(0);
    let left = close_waits_to(log.text("tcp-after-netlink"), 7005);
    let mechanism = log.text("healthz").contains("netlink-sock-destroy");
    if killed == 4 && left == 0 && mechanism {
        Cell::ok("ok: 4 killed (netlink-sock-destroy), none left in /proc/net/tcp")
    } else {
        Cell::fail(format!(
            "{killed} killed, {left} CLOSE_WAIT left, healthz: {}",
            first_line(log.text("healthz"))
        ))
    }
}

/// `mechanism = "bpf-iter"`: kills where the kernel has bpf_sock_destroy; elsewhere the
/// enforce policy runs as a dry run (exit 3) and says why.
pub fn bpf_iter(log: &GuestLog, has_kfunc: bool) -> Cell {
    let rc = log.rc("bpf-iter.out");
    let out = log.text("bpf-iter.out");
    let n = results(out);
    let left = close_waits_to(log.text("tcp-after-bpf-iter"), 7006);
    if has_kfunc {
        return if rc == Some(0) && n.get("killed") == Some(&2) && left == 0 {
            Cell::ok("ok: 2 killed (bpf-sock-destroy), none left")
        } else {
            Cell::fail(format!(
                "exit {rc:?}, results {n:?}, {left} left: {}",
                first_line(log.text("bpf-iter.err"))
            ))
        };
    }
    let modes: BTreeSet<String> = out
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter_map(|v| v["mode"].as_str().map(str::to_string))
        .collect();
    let why = modes.iter().next().cloned().unwrap_or_default();
    let clear = modes.len() == 1
        && why.contains("no destroy mechanism")
        && why.contains("bpf_sock_destroy");
    if rc == Some(3)
        && n.get("would-kill") == Some(&2)
        && !n.contains_key("killed")
        && left == 2
        && clear
    {
        let reason = why
            .split_once("mechanism: ")
            .map_or(why.as_str(), |(_, r)| r.strip_suffix(')').unwrap_or(r));
        Cell::ok(format!("degrades: dry-run, exit 3 (\"{reason}\")"))
    } else {
        Cell::fail(format!(
            "exit {rc:?}, results {n:?}, {left} left, modes {modes:?}"
        ))
    }
}

/// Below the minimum: `connreap snapshot` refuses with one line naming the kernel, and the
/// cell says what the refusal left pinned on bpffs and what the verifier said (`-v`).
///
/// The target is a `kernel too old: ...` line that names the missing feature, with
/// no pins left. Until the agent says "too old", its current one-line load error ("kernel
/// refused BPF program ...") passes and the pins are only reported; once it says "too old",
/// naming the feature and leaving no pins are required.
pub fn refusal(log: &GuestLog) -> Cell {
    let rc = log.rc("snapshot.out");
    let err = log.text("snapshot.err");
    let lines: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).collect();
    let msg = lines.first().copied().unwrap_or("");
    let pins: Vec<&str> = log
        .text("pins")
        .lines()
        .filter_map(|l| l.strip_prefix("/sys/fs/bpf/connreap/"))
        .filter_map(|l| l.split_once('/').map(|(_, name)| name))
        .collect();
    let pinned = if pins.is_empty() {
        "no pins left".to_string()
    } else {
        format!("maps left pinned: {}", pins.join(", "))
    };
    let verifier = log
        .text("snapshot-verbose.err")
        .split_once("verifier log:")
        .map(|(_, v)| first_line(v).to_string())
        .unwrap_or_default();
    let one_line = rc.is_some_and(|rc| rc != 0) && lines.len() == 1 && msg.contains("kernel");
    let names_feature = FEATURE_WORDS.iter().any(|w| msg.contains(w));
    let seen = format!("`{msg}`; -v: `{verifier}`; {pinned}");
    if one_line && msg.contains("too old") {
        if names_feature && pins.is_empty() {
            Cell::ok(format!("refused as expected: {seen}"))
        } else {
            Cell::fail(format!(
                "the refusal must name the feature and leave no pins: {seen}"
            ))
        }
    } else if one_line && msg.contains(CURRENT_REFUSAL) {
        Cell::ok(format!(
            "refused (generic load error, names no feature): {seen}"
        ))
    } else {
        Cell::fail(format!(
            "exit {rc:?}, expected one line naming the kernel: {err:?}"
        ))
    }
}

/// Words of which a "too old" refusal must contain one: the feature 5.10 lacks (64-bit BPF
/// atomics such as cmpxchg, which its verifier reports as `BPF_STX uses reserved fields`) or
/// the first kernel that has it.
const FEATURE_WORDS: &[&str] = &["cmpxchg", "atomic", "BPF_STX", "5.12"];

/// The agent's current, generic load error.
const CURRENT_REFUSAL: &str = "kernel refused BPF program";

/// No WARN/BUG/Oops, not tainted, the scenario ran to its end, lockdown as asked.
pub fn health(log: &GuestLog, lockdown: bool) -> Cell {
    let mut problems = Vec::new();
    if log.fact("done").is_none() {
        problems.push("the scenario did not finish".to_string());
    }
    match log.fact("tainted") {
        Some("0") => {}
        t => problems.push(format!("tainted {t:?}")),
    }
    if !log.text("dmesg-problems").trim().is_empty() {
        problems.push(format!("dmesg: {}", first_line(log.text("dmesg-problems"))));
    }
    if let Some(m) = log.fact("insmod_failed") {
        problems.push(format!("insmod {m} failed"));
    }
    if let Some(p) = log.fact("peer_not_ready") {
        problems.push(format!("test peer not ready: {p}"));
    }
    let mode = log.fact("lockdown").unwrap_or("");
    if lockdown != mode.contains("[integrity]") {
        problems.push(format!("lockdown: {mode}"));
    }
    if problems.is_empty() {
        Cell::ok(if lockdown {
            "ok (lockdown: integrity)"
        } else {
            "ok"
        })
    } else {
        Cell::fail(problems.join("; "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_facts_and_blocks_through_carriage_returns() {
        let log = GuestLog::parse(
            "boot noise\r\n@@fact release 6.1.0-57-cloud-amd64\r\n@@begin a.out\r\nx\r\n\r\ny\r\n\r\n@@end a.out rc=3\r\n",
        );
        assert_eq!(log.fact("release"), Some("6.1.0-57-cloud-amd64"));
        assert_eq!(log.rc("a.out"), Some(3));
        assert_eq!(log.text("a.out"), "x\n\ny");
    }

    #[test]
    fn reads_proc_net_tcp_and_tcp6() {
        let text = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:1B59 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1234 1 0000000000000000 100 0 0 10 0
  sl  local_address                         remote_address                        st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   1: 0000000000000000FFFF00000100007F:1B5C 0000000000000000FFFF00000100007F:D2A4 01 00000000:00000000 00:00000000 00000000     0        0 99 1 0000000000000000 20 4 30 10 -1
   2: 00000000000000000000000001000000:1B5B 00000000000000000000000001000000:A000 08 00000000:00000001 00:00000000 00000000     0        0 7 1";
        let s = kernel_sockets(text);
        assert_eq!(s.len(), 3);
        assert_eq!(s[0].local, "127.0.0.1:7001".parse().unwrap());
        assert_eq!(s[0].state, "LISTEN");
        assert_eq!(s[0].inode, 1234);
        assert_eq!(s[1].local, "[::ffff:127.0.0.1]:7004".parse().unwrap());
        assert!(is_mapped(&s[1].local));
        assert_eq!(s[2].local, "[::1]:7003".parse().unwrap());
        assert_eq!(s[2].state, "CLOSE_WAIT");
    }

    #[test]
    fn reads_socket_owners() {
        let o = fd_owners("12 3 socket:[99] connreap-testpe\n12 4 pipe:[5] x\n");
        assert_eq!(o[&99], vec![(12, 3, "connreap-testpe".to_string())]);
        assert_eq!(o.len(), 1);
    }

    fn refusal_log(msg: &str, pins: &str) -> GuestLog {
        GuestLog::parse(&format!(
            "@@begin snapshot.err\n{msg}\n@@end snapshot.err rc=1\n\
             @@begin snapshot.out\n\n@@end snapshot.out rc=1\n\
             @@begin pins\n/sys/fs/bpf\n{pins}\n@@end pins rc=0\n\
             @@begin snapshot-verbose.err\nx\nverifier log:\nBPF_STX uses reserved fields\n@@end snapshot-verbose.err rc=1\n"
        ))
    }

    #[test]
    fn refusal_today_passes_and_reports_pins() {
        let c = refusal(&refusal_log(
            "connreap: kernel refused BPF program connreap_set_state: Invalid argument (os error 22)",
            "/sys/fs/bpf/connreap\n/sys/fs/bpf/connreap/abc\n/sys/fs/bpf/connreap/abc/state",
        ));
        assert!(c.ok, "{}", c.text);
        assert!(c.text.contains("maps left pinned: state"), "{}", c.text);
        assert!(
            c.text.contains("-v: `BPF_STX uses reserved fields`"),
            "{}",
            c.text
        );
    }

    #[test]
    fn too_old_must_name_the_feature_and_leave_no_pins() {
        let good = "connreap: kernel too old: 5.10 lacks 64-bit BPF atomics (cmpxchg, Linux 5.12)";
        assert!(refusal(&refusal_log(good, "")).ok);
        assert!(!refusal(&refusal_log(good, "/sys/fs/bpf/connreap/abc/state")).ok);
        assert!(!refusal(&refusal_log("connreap: kernel too old", "")).ok);
        assert!(!refusal(&refusal_log("connreap: something else", "")).ok);
        assert!(!refusal(&refusal_log(&format!("{good}\nsecond line"), "")).ok);
    }
}
