//! The socket table: kernel records (sockets + owners) merged into plain `Socket` values with
//! ages, idle times, owners and service ports. Pure functions only; no kernel access.
use std::{
    collections::{HashMap, HashSet},
    fmt,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    str::FromStr,
    sync::Arc,
    time::Duration,
};

use connreap_ebpf::{sock_flags, tcp_state, OwnerRecord, SockRecord, AF_INET};
use serde::{Serialize, Serializer};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum TcpState {
    Established,
    SynSent,
    SynRecv,
    FinWait1,
    FinWait2,
    TimeWait,
    Close,
    CloseWait,
    LastAck,
    Listen,
    Closing,
    NewSynRecv,
}

const STATES: [(TcpState, u8, &str); 12] = [
    (TcpState::Established, tcp_state::ESTABLISHED, "ESTABLISHED"),
    (TcpState::SynSent, tcp_state::SYN_SENT, "SYN_SENT"),
    (TcpState::SynRecv, tcp_state::SYN_RECV, "SYN_RECV"),
    (TcpState::FinWait1, tcp_state::FIN_WAIT1, "FIN_WAIT1"),
    (TcpState::FinWait2, tcp_state::FIN_WAIT2, "FIN_WAIT2"),
    (TcpState::TimeWait, tcp_state::TIME_WAIT, "TIME_WAIT"),
    (TcpState::Close, tcp_state::CLOSE, "CLOSE"),
    (TcpState::CloseWait, tcp_state::CLOSE_WAIT, "CLOSE_WAIT"),
    (TcpState::LastAck, tcp_state::LAST_ACK, "LAST_ACK"),
    (TcpState::Listen, tcp_state::LISTEN, "LISTEN"),
    (TcpState::Closing, tcp_state::CLOSING, "CLOSING"),
    (
        TcpState::NewSynRecv,
        tcp_state::NEW_SYN_RECV,
        "NEW_SYN_RECV",
    ),
];

impl TcpState {
    pub fn from_kernel(v: u8) -> Option<Self> {
        STATES.iter().find(|s| s.1 == v).map(|s| s.0)
    }
    pub fn as_str(self) -> &'static str {
        STATES
            .iter()
            .find(|s| s.0 == self)
            .map(|s| s.2)
            .unwrap_or("UNKNOWN")
    }
}

impl fmt::Display for TcpState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for TcpState {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let norm = s.trim().to_ascii_uppercase().replace('-', "_");
        let norm = match norm.as_str() {
            "ESTAB" => "ESTABLISHED".to_string(),
            _ => norm,
        };
        STATES
            .iter()
            .find(|st| st.2 == norm)
            .map(|st| st.0)
            .ok_or_else(|| {
                let names: Vec<&str> = STATES.iter().map(|s| s.2).collect();
                format!(
                    "unknown TCP state `{s}` (expected one of {})",
                    names.join(", ")
                )
            })
    }
}

impl Serialize for TcpState {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

impl<'de> serde::Deserialize<'de> for TcpState {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// Which side of the connection this host's socket is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Direction {
    Listen,
    /// Accepted on a local listener: the service port is the local port.
    Inbound,
    /// Dialled out: the service port is the peer port.
    Outbound,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Owner {
    pub pid: u32,
    /// Shared by every socket of the process (one allocation per process, not per socket).
    pub comm: Arc<str>,
    pub fd: u32,
    /// systemd unit (or cgroup path) from /proc/<pid>/cgroup.
    pub unit: Option<Arc<str>>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Socket {
    /// Kernel socket address: identity while the socket lives.
    #[serde(skip)]
    pub skaddr: u64,
    pub inode: u64,
    /// The kernel's socket cookie; null until something asked the kernel for it.
    #[serde(serialize_with = "nonzero")]
    pub cookie: u64,
    pub local: SocketAddr,
    pub peer: SocketAddr,
    pub state: TcpState,
    /// Time in the current state: exact when `age_exact`, otherwise a lower bound.
    #[serde(rename = "age_secs", serialize_with = "secs")]
    pub age: Duration,
    pub age_exact: bool,
    /// Time since data was last sent or received (None for TIME_WAIT / request sockets).
    #[serde(rename = "idle_secs", serialize_with = "opt_secs")]
    pub idle: Option<Duration>,
    #[serde(rename = "last_recv_secs", serialize_with = "opt_secs")]
    pub last_recv: Option<Duration>,
    #[serde(rename = "last_send_secs", serialize_with = "opt_secs")]
    pub last_send: Option<Duration>,
    pub rx_queue: u32,
    pub tx_queue: u32,
    pub uid: u32,
    pub direction: Direction,
    pub service_port: u16,
    #[serde(flatten)]
    pub owner: Option<Owner>,
    /// Other processes holding the same socket (e.g. after fork).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub shared_with: Vec<u32>,
}

fn nonzero<S: Serializer>(v: &u64, s: S) -> Result<S::Ok, S::Error> {
    match v {
        0 => s.serialize_none(),
        v => s.serialize_u64(*v),
    }
}

fn secs<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_f64((d.as_secs_f64() * 1000.0).round() / 1000.0)
}

fn opt_secs<S: Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
    match d {
        Some(d) => secs(d, s),
        None => s.serialize_none(),
    }
}

impl Socket {
    pub fn pid(&self) -> Option<u32> {
        self.owner.as_ref().map(|o| o.pid)
    }
    pub fn comm(&self) -> &str {
        self.owner.as_ref().map(|o| &*o.comm).unwrap_or("?")
    }
    pub fn unit(&self) -> Option<String> {
        self.owner
            .as_ref()
            .and_then(|o| o.unit.as_deref().map(String::from))
    }
    pub fn queues_empty(&self) -> bool {
        self.rx_queue == 0 && self.tx_queue == 0
    }
}

/// Remembers when the agent first saw each socket, for lower bounds on ages it cannot know.
#[derive(Debug, Default)]
pub struct FirstSeen {
    seen: HashMap<(u64, u64), u64>,
}

impl FirstSeen {
    /// Record `now_ns` for new sockets, forget vanished ones; returns first-seen per socket.
    pub fn update(&mut self, socks: &[SockRecord]) {
        let mut next = HashMap::with_capacity(socks.len());
        for s in socks {
            let key = (s.skaddr, s.inode);
            let t = self.seen.get(&key).copied().unwrap_or(s.now_ns);
            next.insert(key, t);
        }
        self.seen = next;
    }
    pub fn get(&self, s: &SockRecord) -> u64 {
        self.seen
            .get(&(s.skaddr, s.inode))
            .copied()
            .unwrap_or(s.now_ns)
    }
}

fn addr(family: u16, raw: &[u8; 16], port: u16) -> SocketAddr {
    let ip = if family == AF_INET {
        IpAddr::V4(Ipv4Addr::new(raw[0], raw[1], raw[2], raw[3]))
    } else {
        IpAddr::V6(Ipv6Addr::from(*raw))
    };
    SocketAddr::new(ip, port)
}

fn comm_str(raw: &[u8; 16]) -> String {
    let end = raw.iter().position(|b| *b == 0).unwrap_or(raw.len());
    String::from_utf8_lossy(&raw[..end]).into_owned()
}

/// IPv4-mapped IPv6 and plain IPv4 name the same endpoint (JVMs open AF_INET6 sockets).
pub fn canon(a: SocketAddr) -> SocketAddr {
    SocketAddr::new(a.ip().to_canonical(), a.port())
}

/// Facts about the host (or network namespace) needed to interpret kernel records.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostInfo {
    /// Ticks per second of the kernel's jiffies clock (CONFIG_HZ).
    pub hz: u32,
    /// net.ipv4.ip_local_port_range of the namespace: used only to guess the service side of
    /// sockets with no local listener.
    pub ephemeral: std::ops::RangeInclusive<u16>,
}

impl Default for HostInfo {
    fn default() -> Self {
        // Linux defaults.
        HostInfo {
            hz: 250,
            ephemeral: 32768..=60999,
        }
    }
}

/// Parse /proc/sys/net/ipv4/ip_local_port_range ("32768\t60999").
pub fn parse_port_range(text: &str) -> Option<std::ops::RangeInclusive<u16>> {
    let mut it = text.split_whitespace().map(|v| v.parse::<u16>());
    match (it.next(), it.next()) {
        (Some(Ok(a)), Some(Ok(b))) if a <= b => Some(a..=b),
        _ => None,
    }
}

/// Service port and direction for a non-listening socket.
pub fn classify(
    local: u16,
    peer: u16,
    listening: &HashSet<u16>,
    ephemeral: &std::ops::RangeInclusive<u16>,
) -> (Direction, u16) {
    if listening.contains(&local) {
        (Direction::Inbound, local)
    } else if listening.contains(&peer) || ephemeral.contains(&local) && !ephemeral.contains(&peer)
    {
        (Direction::Outbound, peer)
    } else if (ephemeral.contains(&peer) && !ephemeral.contains(&local)) || local < peer {
        (Direction::Inbound, local)
    } else {
        (Direction::Outbound, peer)
    }
}

/// Build the table. `unit_of` maps a pid to its systemd unit.
pub fn build(
    socks: &[SockRecord],
    owners: &[OwnerRecord],
    host: &HostInfo,
    first_seen: &FirstSeen,
    unit_of: &mut dyn FnMut(u32) -> Option<String>,
) -> Vec<Socket> {
    // Holders of each socket: one sorted copy and an index of ranges (no per-socket Vec).
    let mut sorted: Vec<&OwnerRecord> = owners.iter().collect();
    sorted.sort_unstable_by_key(|o| (o.skaddr, o.tgid, o.fd));
    sorted.dedup_by_key(|o| (o.skaddr, o.tgid));
    let mut by_sk: HashMap<u64, (usize, usize)> = HashMap::with_capacity(sorted.len());
    for (i, o) in sorted.iter().enumerate() {
        by_sk.entry(o.skaddr).or_insert((i, i)).1 = i + 1;
    }
    let listening: HashSet<u16> = socks
        .iter()
        .filter(|s| s.state == tcp_state::LISTEN)
        .map(|s| s.sport)
        .collect();
    let jiffies = |j: u32| Duration::from_millis(j as u64 * 1000 / host.hz.max(1) as u64);
    // Per process: comm and unit, allocated once.
    let mut procs: HashMap<u32, (Arc<str>, Option<Arc<str>>)> = HashMap::new();

    socks
        .iter()
        .filter_map(|s| {
            let state = TcpState::from_kernel(s.state)?;
            let full = s.flags & sock_flags::FULL != 0;
            let (last_recv, last_send) = if full && state != TcpState::Listen {
                (
                    Some(jiffies(s.last_rcv_jiffies)),
                    Some(jiffies(s.last_snd_jiffies)),
                )
            } else {
                (None, None)
            };
            let (age, age_exact) = if s.flags & sock_flags::SINCE_KNOWN != 0 {
                (
                    Duration::from_nanos(s.now_ns.saturating_sub(s.state_since_ns)),
                    true,
                )
            } else {
                let mut bound = Duration::from_nanos(s.now_ns.saturating_sub(first_seen.get(s)));
                // In CLOSE_WAIT the peer's FIN (an ACK) arrived when the state was entered, and
                // the peer can only ACK since: time since the last ACK bounds the age from below.
                if state == TcpState::CloseWait && full {
                    bound = bound.max(jiffies(s.last_ack_jiffies));
                }
                (bound, false)
            };
            let (direction, service_port) = if state == TcpState::Listen {
                (Direction::Listen, s.sport)
            } else {
                classify(s.sport, s.dport, &listening, &host.ephemeral)
            };
            let holders: &[&OwnerRecord] = by_sk
                .get(&s.skaddr)
                .map(|&(a, b)| &sorted[a..b])
                .unwrap_or(&[]);
            let owner = holders.first().map(|o| {
                let (comm, unit) = procs
                    .entry(o.tgid)
                    .or_insert_with(|| (comm_str(&o.comm).into(), unit_of(o.tgid).map(Arc::from)))
                    .clone();
                Owner {
                    pid: o.tgid,
                    comm,
                    fd: o.fd,
                    unit,
                }
            });
            Some(Socket {
                skaddr: s.skaddr,
                inode: s.inode,
                cookie: s.cookie,
                local: addr(s.family, &s.saddr, s.sport),
                peer: addr(s.family, &s.daddr, s.dport),
                state,
                age,
                age_exact,
                idle: last_recv.zip(last_send).map(|(r, w)| r.min(w)),
                last_recv,
                last_send,
                rx_queue: s.rx_queue,
                tx_queue: s.tx_queue,
                uid: s.uid,
                direction,
                service_port,
                owner,
                shared_with: holders.iter().skip(1).map(|o| o.tgid).collect(),
            })
        })
        .collect()
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
    use connreap_ebpf::AF_INET6;

    fn rec(skaddr: u64, state: u8, sport: u16, dport: u16) -> SockRecord {
        let mut r = SockRecord {
            skaddr,
            inode: skaddr + 1000,
            family: AF_INET,
            state,
            sport,
            dport,
            flags: sock_flags::FULL,
            now_ns: 100_000_000_000,
            ..Default::default()
        };
        r.saddr[..4].copy_from_slice(&[127, 0, 0, 1]);
        r.daddr[..4].copy_from_slice(&[127, 0, 0, 1]);
        r
    }

    fn owner(skaddr: u64, tgid: u32, comm: &str) -> OwnerRecord {
        let mut c = [0u8; 16];
        c[..comm.len()].copy_from_slice(comm.as_bytes());
        OwnerRecord {
            skaddr,
            tgid,
            fd: 3,
            comm: c,
        }
    }

    #[test]
    fn merges_owner_age_idle_and_service_port() {
        let mut listen = rec(1, tcp_state::LISTEN, 8080, 0);
        listen.flags = sock_flags::FULL;
        let mut accepted = rec(2, tcp_state::CLOSE_WAIT, 8080, 40000);
        accepted.flags |= sock_flags::SINCE_KNOWN;
        accepted.state_since_ns = 40_000_000_000;
        accepted.last_rcv_jiffies = 2500; // 10 s at HZ=250
        accepted.last_snd_jiffies = 500; // 2 s
        let client = rec(3, tcp_state::FIN_WAIT2, 40000, 8080);
        let owners = [
            owner(2, 77, "java"),
            owner(2, 99, "java"),
            owner(1, 77, "java"),
        ];
        let mut fs = FirstSeen::default();
        fs.update(&[listen, accepted, client]);
        let t = build(
            &[listen, accepted, client],
            &owners,
            &HostInfo::default(),
            &fs,
            &mut |_| Some("gw.service".into()),
        );
        let cw = t.iter().find(|s| s.state == TcpState::CloseWait).unwrap();
        assert_eq!(cw.age, Duration::from_secs(60));
        assert!(cw.age_exact);
        assert_eq!(cw.idle, Some(Duration::from_secs(2)));
        assert_eq!(cw.direction, Direction::Inbound);
        assert_eq!(cw.service_port, 8080);
        let o = cw.owner.as_ref().unwrap();
        assert_eq!(
            (o.pid, &*o.comm, o.unit.as_deref()),
            (77, "java", Some("gw.service"))
        );
        assert_eq!(cw.shared_with, vec![99]);
        let fw = t.iter().find(|s| s.state == TcpState::FinWait2).unwrap();
        assert_eq!((fw.direction, fw.service_port), (Direction::Outbound, 8080));
        assert!(fw.owner.is_none());
        assert!(!fw.age_exact);
    }

    #[test]
    fn unknown_close_wait_age_is_bounded_by_last_ack() {
        let mut cw = rec(5, tcp_state::CLOSE_WAIT, 45000, 80);
        cw.last_ack_jiffies = 3000; // 12 s at 250 Hz
        let mut fs = FirstSeen::default();
        fs.update(&[cw]);
        let t = build(&[cw], &[], &HostInfo::default(), &fs, &mut |_| None);
        assert_eq!(t[0].age, Duration::from_secs(12));
        assert!(!t[0].age_exact);
        assert_eq!(
            (t[0].direction, t[0].service_port),
            (Direction::Outbound, 80)
        );
    }

    #[test]
    fn first_seen_bound_grows_across_scans() {
        let mut s = rec(9, tcp_state::ESTABLISHED, 45000, 443);
        let mut fs = FirstSeen::default();
        fs.update(&[s]);
        s.now_ns += 5_000_000_000;
        fs.update(&[s]);
        let t = build(&[s], &[], &HostInfo::default(), &fs, &mut |_| None);
        assert_eq!(t[0].age, Duration::from_secs(5));
    }

    #[test]
    fn decodes_ipv6_and_mapped_addresses() {
        let mut s = rec(4, tcp_state::ESTABLISHED, 45000, 8080);
        s.family = AF_INET6;
        s.saddr = Ipv6Addr::LOCALHOST.octets();
        s.daddr = Ipv4Addr::new(10, 0, 16, 36).to_ipv6_mapped().octets();
        let t = build(
            &[s],
            &[],
            &HostInfo::default(),
            &FirstSeen::default(),
            &mut |_| None,
        );
        assert_eq!(t[0].local.to_string(), "[::1]:45000");
        assert_eq!(t[0].peer.to_string(), "[::ffff:10.0.16.36]:8080");
    }

    #[test]
    fn time_wait_has_no_idle() {
        let mut s = rec(6, tcp_state::TIME_WAIT, 45000, 80);
        s.flags = 0;
        let t = build(
            &[s],
            &[],
            &HostInfo::default(),
            &FirstSeen::default(),
            &mut |_| None,
        );
        assert_eq!(t[0].idle, None);
    }

    #[test]
    fn parses_states_and_units() {
        assert_eq!("close-wait".parse::<TcpState>(), Ok(TcpState::CloseWait));
        assert_eq!("estab".parse::<TcpState>(), Ok(TcpState::Established));
        assert!("nope"
            .parse::<TcpState>()
            .unwrap_err()
            .contains("CLOSE_WAIT"));
        assert_eq!(
            unit_from_cgroup("0::/system.slice/nginx.service\n").as_deref(),
            Some("nginx.service")
        );
        assert_eq!(unit_from_cgroup("0::/\n"), None);
        assert_eq!(
            unit_from_cgroup("0::/mygroup\n").as_deref(),
            Some("/mygroup")
        );
    }

    #[test]
    fn classify_guesses_service_side_without_listener() {
        let none = HashSet::new();
        let eph = HostInfo::default().ephemeral;
        assert_eq!(classify(50000, 80, &none, &eph), (Direction::Outbound, 80));
        assert_eq!(classify(22, 50000, &none, &eph), (Direction::Inbound, 22));
        // A namespace with a low ephemeral range: the client's port 20000 is ephemeral there.
        let low = parse_port_range("10000\t20000\n").unwrap();
        assert_eq!(
            classify(20000, 30000, &none, &low),
            (Direction::Outbound, 30000)
        );
        assert_eq!(parse_port_range("garbage"), None);
    }
}
