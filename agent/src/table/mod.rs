//! The socket table: kernel records (sockets + owners) merged into plain `Socket` values with
//! ages, idle times, owners and service ports. Pure functions only; no kernel access.
mod build;

use std::{
    fmt,
    net::{IpAddr, SocketAddr},
    str::FromStr,
    sync::Arc,
    time::Duration,
};

use connreap_ebpf::tcp_state;
use serde::{Serialize, Serializer};

use crate::containers::Container;

pub use build::{FirstSeen, Holders, TableBuilder};

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
    /// Every state, in the kernel's order.
    pub fn all() -> impl Iterator<Item = TcpState> {
        STATES.iter().map(|s| s.0)
    }
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

/// A TCP state name that is none of [`STATES`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown TCP state `{name}` (expected one of {})", expected_states())]
pub struct ParseStateError {
    pub name: String,
}

fn expected_states() -> String {
    let names: Vec<&str> = STATES.iter().map(|s| s.2).collect();
    names.join(", ")
}

impl FromStr for TcpState {
    type Err = ParseStateError;
    fn from_str(s: &str) -> Result<Self, ParseStateError> {
        let norm = s.trim().to_ascii_uppercase().replace('-', "_");
        let norm = match norm.as_str() {
            "ESTAB" => "ESTABLISHED".to_string(),
            _ => norm,
        };
        STATES
            .iter()
            .find(|st| st.2 == norm)
            .map(|st| st.0)
            .ok_or_else(|| ParseStateError { name: s.into() })
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

impl Direction {
    /// The JSON name.
    pub fn as_str(self) -> &'static str {
        match self {
            Direction::Listen => "listen",
            Direction::Inbound => "inbound",
            Direction::Outbound => "outbound",
        }
    }
}

/// The process owning sockets: one allocation per process, shared by all its sockets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Owner {
    pub pid: u32,
    pub comm: Arc<str>,
    /// systemd unit (or cgroup path) from /proc/<pid>/cgroup.
    pub unit: Option<Arc<str>>,
    /// The container it runs in, from the same cgroup path (see `containers`).
    pub container: Option<Arc<Container>>,
}

/// What a scan knows of a process besides its pid and command name: its systemd unit and
/// container.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ProcessFacts {
    pub unit: Option<Arc<str>>,
    pub container: Option<Arc<Container>>,
}

/// An IP address and port: what `SocketAddr` prints, in 20 bytes instead of 32 (no IPv6
/// flow info or scope id, which kernel socket records do not carry).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Endpoint {
    ip: IpAddr,
    port: u16,
}

impl Endpoint {
    pub fn new(ip: IpAddr, port: u16) -> Self {
        Endpoint { ip, port }
    }
    pub fn ip(&self) -> IpAddr {
        self.ip
    }
    pub fn port(&self) -> u16 {
        self.port
    }
}

impl From<SocketAddr> for Endpoint {
    fn from(a: SocketAddr) -> Self {
        Endpoint::new(a.ip(), a.port())
    }
}

impl From<Endpoint> for SocketAddr {
    fn from(e: Endpoint) -> Self {
        SocketAddr::new(e.ip, e.port)
    }
}

impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        SocketAddr::from(*self).fmt(f)
    }
}

impl FromStr for Endpoint {
    type Err = std::net::AddrParseError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        s.parse::<SocketAddr>().map(Endpoint::from)
    }
}

impl Endpoint {
    /// "a.b.c.d:port" into `buf` without core::fmt (the common case, hot in snapshot output);
    /// the length written. None for IPv6.
    fn v4_text(&self, buf: &mut [u8; 21]) -> Option<usize> {
        let IpAddr::V4(ip) = self.ip else {
            return None;
        };
        let mut n = 0;
        let mut put = |b: &[u8]| {
            buf[n..n + b.len()].copy_from_slice(b);
            n += b.len();
        };
        for (i, o) in ip.octets().into_iter().enumerate() {
            if i > 0 {
                put(b".");
            }
            put(itoa::Buffer::new().format(o).as_bytes());
        }
        put(b":");
        put(itoa::Buffer::new().format(self.port).as_bytes());
        Some(n)
    }

    /// Append what Display prints (no character of it needs escaping in JSON).
    pub fn write_text(&self, out: &mut Vec<u8>) {
        let mut buf = [0u8; 21];
        match self.v4_text(&mut buf) {
            Some(n) => out.extend_from_slice(&buf[..n]),
            None => {
                use std::io::Write as _;
                // Writing to a Vec cannot fail.
                let _ = write!(out, "{self}");
            }
        }
    }
}

impl Serialize for Endpoint {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut buf = [0u8; 21];
        match self.v4_text(&mut buf) {
            Some(n) => s.serialize_str(std::str::from_utf8(&buf[..n]).unwrap_or_default()),
            None => s.collect_str(self),
        }
    }
}

/// A namespace's TCP keepalive sysctls (`net.ipv4.tcp_keepalive_*`): a socket with
/// SO_KEEPALIVE and no per-socket override is probed after `time_secs` idle, then every
/// `intvl_secs`, and reset after `probes` unanswered probes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Keepalive {
    pub time_secs: u64,
    pub intvl_secs: u64,
    pub probes: u64,
}

impl Default for Keepalive {
    /// Linux's defaults.
    fn default() -> Self {
        Keepalive {
            time_secs: 7200,
            intvl_secs: 75,
            probes: 9,
        }
    }
}

impl Keepalive {
    /// Idle time after which the kernel has given up on a peer that answers no probe.
    pub fn reap_after(&self) -> Duration {
        Duration::from_secs(
            self.time_secs
                .saturating_add(self.intvl_secs.saturating_mul(self.probes)),
        )
    }
}

/// The network namespace a socket lives in.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default)]
pub struct Netns {
    /// The namespace's inode (0: not known, in tests and fixtures).
    pub inode: u32,
    /// Its name under `/run/netns` or `/run/docker/netns`, if it has one.
    pub name: Option<Box<str>>,
    /// connreap's own namespace (the host's, when connreap runs on the host).
    pub own: bool,
    /// Its keepalive sysctls, when they were read (None: Linux's defaults are assumed).
    pub keepalive: Option<Keepalive>,
}

impl Netns {
    /// The namespace of tests and fixtures: connreap's own, inode unknown.
    pub fn unknown() -> Arc<Netns> {
        static OWN: std::sync::LazyLock<Arc<Netns>> = std::sync::LazyLock::new(|| {
            Arc::new(Netns {
                inode: 0,
                name: None,
                own: true,
                keepalive: None,
            })
        });
        OWN.clone()
    }

    /// What to call it: its name, "host" for connreap's own, else its inode.
    pub fn label(&self) -> String {
        match (&self.name, self.own) {
            (Some(n), _) => n.to_string(),
            (None, true) => "host".to_string(),
            (None, false) => self.inode.to_string(),
        }
    }

    /// Whether `wanted` (a name, an inode, "host", or "all") names this namespace.
    pub fn matches(&self, wanted: &str) -> bool {
        wanted == "all"
            || (wanted == "host" && self.own)
            || self.name.as_deref() == Some(wanted)
            || wanted
                .parse::<u32>()
                .is_ok_and(|i| i == self.inode && i != 0)
    }
}

/// Marks an absent millisecond figure in [`Socket`].
const NO_MS: u64 = u64::MAX;

/// One socket of the table. Kept compact (the daemon holds one per socket of the namespace):
/// process facts are shared through `owner`, addresses are [`Endpoint`]s.
#[derive(Debug, Clone, PartialEq)]
pub struct Socket {
    /// Kernel socket address: identity while the socket lives.
    pub skaddr: u64,
    pub inode: u64,
    /// The kernel's socket cookie; 0 until something asked the kernel for it.
    pub cookie: u64,
    /// Time in the current state in ms (`age()`): a u64 of ms, not a 16-byte `Duration`, keeps
    /// the row small (the daemon holds one per socket).
    age_ms: u64,
    last_recv_ms: u64,
    last_send_ms: u64,
    pub owner: Option<Arc<Owner>>,
    /// Other processes holding the same socket (e.g. after fork).
    pub shared_with: Box<[u32]>,
    pub local: Endpoint,
    pub peer: Endpoint,
    pub rx_queue: u32,
    pub tx_queue: u32,
    pub uid: u32,
    /// The owner's file descriptor (0 without an owner).
    pub fd: u32,
    pub service_port: u16,
    pub state: TcpState,
    pub direction: Direction,
    pub age_exact: bool,
    /// TCP keepalive is on (`SO_KEEPALIVE`): a peer that vanished is found out eventually.
    pub keepalive: bool,
    /// The network namespace it lives in (shared by all its sockets).
    pub netns: Arc<Netns>,
}

fn opt_ms(ms: u64) -> Option<Duration> {
    (ms != NO_MS).then(|| Duration::from_millis(ms))
}

impl Socket {
    /// A socket with no owner, no timers and a zero age (tests and fixtures fill in the rest).
    #[cfg(test)]
    pub fn new(local: Endpoint, peer: Endpoint, state: TcpState) -> Self {
        Self::in_netns(local, peer, state, Netns::unknown())
    }

    /// [`Socket::new`] in `netns` (the table builder: no placeholder namespace to take and
    /// drop again per row).
    pub fn in_netns(local: Endpoint, peer: Endpoint, state: TcpState, netns: Arc<Netns>) -> Self {
        Socket {
            skaddr: 0,
            inode: 0,
            cookie: 0,
            age_ms: 0,
            last_recv_ms: NO_MS,
            last_send_ms: NO_MS,
            owner: None,
            shared_with: Box::default(),
            local,
            peer,
            rx_queue: 0,
            tx_queue: 0,
            uid: 0,
            fd: 0,
            service_port: 0,
            state,
            direction: Direction::Outbound,
            age_exact: true,
            keepalive: false,
            netns,
        }
    }
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
    /// The container the owner runs in, if it runs in one.
    pub fn container(&self) -> Option<&Container> {
        self.owner.as_ref().and_then(|o| o.container.as_deref())
    }
    /// The id of the container the owner runs in, if it runs in one.
    pub fn container_id(&self) -> Option<&str> {
        self.container().map(|c| c.id.as_str())
    }
    /// Time in the current state: exact when `age_exact`, otherwise a lower bound (whole ms).
    pub fn age(&self) -> Duration {
        Duration::from_millis(self.age_ms)
    }
    pub fn set_age(&mut self, age: Duration) {
        self.age_ms = u64::try_from(age.as_millis()).unwrap_or(u64::MAX);
    }
    pub fn queues_empty(&self) -> bool {
        self.rx_queue == 0 && self.tx_queue == 0
    }
    /// Time since data was last received.
    pub fn last_recv(&self) -> Option<Duration> {
        opt_ms(self.last_recv_ms)
    }
    /// Time since data was last sent.
    pub fn last_send(&self) -> Option<Duration> {
        opt_ms(self.last_send_ms)
    }
    /// Time since data was last sent or received (None for TIME_WAIT / request sockets). Not
    /// a field of its own: derived, it cannot disagree with the two times, and the row (one
    /// per socket in the daemon) is 16 bytes smaller.
    pub fn idle(&self) -> Option<Duration> {
        opt_ms(self.last_recv_ms.min(self.last_send_ms))
    }
    /// Set the times since data was last received and sent (tests and fixtures; the table
    /// builder sets the fields itself), and so the idle time.
    #[cfg(test)]
    pub fn set_last_io(&mut self, recv: Option<Duration>, send: Option<Duration>) {
        let ms = |d: Option<Duration>| d.map_or(NO_MS, |d| d.as_millis() as u64);
        self.last_recv_ms = ms(recv);
        self.last_send_ms = ms(send);
    }
    /// Set the idle time (tests and fixtures): data last received and sent that long ago.
    #[cfg(test)]
    pub fn set_idle(&mut self, idle: Option<Duration>) {
        self.set_last_io(idle, idle);
    }
}

/// One end of a connection as integers: its namespace and both endpoints, IPv4 held as
/// IPv4-mapped IPv6 so both forms of an address are one key (as [`canon`] makes them). The
/// detectors find a socket's other end on this host by this key: hashing and comparing five
/// words instead of two `SocketAddr`s made canonical per socket (a fifth of the daemon's CPU
/// per scan at 100k idle sockets, in the stuck-pair and idle detectors).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ConnKey {
    local: u128,
    peer: u128,
    /// Namespace inode << 32 | local port << 16 | peer port.
    ns_ports: u64,
}

impl ConnKey {
    fn new(netns: u32, local: Endpoint, peer: Endpoint) -> ConnKey {
        let bits = |ip: IpAddr| match ip {
            IpAddr::V4(v4) => v4.to_ipv6_mapped().to_bits(),
            IpAddr::V6(v6) => v6.to_bits(),
        };
        ConnKey {
            local: bits(local.ip),
            peer: bits(peer.ip),
            ns_ports: (u64::from(netns) << 32)
                | (u64::from(local.port) << 16)
                | u64::from(peer.port),
        }
    }

    /// The socket's own view: (namespace, local, peer).
    pub fn of(s: &Socket) -> ConnKey {
        ConnKey::new(s.netns.inode, s.local, s.peer)
    }

    /// What the other end of its connection has as [`ConnKey::of`], if it is in the same
    /// namespace: (namespace, peer, local).
    pub fn other_end(s: &Socket) -> ConnKey {
        ConnKey::new(s.netns.inode, s.peer, s.local)
    }
}

/// IPv4-mapped IPv6 and plain IPv4 name the same endpoint (JVMs open AF_INET6 sockets).
pub fn canon(a: impl Into<SocketAddr>) -> SocketAddr {
    let a = a.into();
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

/// A set of ports as a bitmap (8 KiB): looked up twice per row of a scan, where hashing cost
/// more than the rest of the classification.
#[derive(Clone)]
pub struct PortSet(Box<[u64; 1024]>);

impl Default for PortSet {
    fn default() -> Self {
        PortSet(Box::new([0; 1024]))
    }
}

impl fmt::Debug for PortSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_set()
            .entries((0..=u16::MAX).filter(|&p| self.contains(p)))
            .finish()
    }
}

impl PortSet {
    pub fn insert(&mut self, port: u16) {
        self.0[usize::from(port >> 6)] |= 1 << (port & 63);
    }
    pub fn contains(&self, port: u16) -> bool {
        self.0[usize::from(port >> 6)] & (1 << (port & 63)) != 0
    }
}

/// Service port and direction for a non-listening socket.
pub fn classify(
    local: u16,
    peer: u16,
    listening: &PortSet,
    ephemeral: &std::ops::RangeInclusive<u16>,
) -> (Direction, u16) {
    if listening.contains(local) {
        (Direction::Inbound, local)
    } else if listening.contains(peer) || ephemeral.contains(&local) && !ephemeral.contains(&peer) {
        (Direction::Outbound, peer)
    } else if (ephemeral.contains(&peer) && !ephemeral.contains(&local)) || local < peer {
        (Direction::Inbound, local)
    } else {
        (Direction::Outbound, peer)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Both ends of a connection meet on one key; IPv4 and IPv4-mapped IPv6 are one address;
    /// ports, direction and namespace tell connections apart.
    #[test]
    fn connection_keys_pair_both_ends() {
        let ep = |s: &str| s.parse::<Endpoint>().unwrap();
        let at = |ns: u32, l: &str, p: &str| {
            let mut s = Socket::new(ep(l), ep(p), TcpState::Established);
            s.netns = Arc::new(Netns {
                inode: ns,
                name: None,
                own: true,
                keepalive: None,
            });
            s
        };
        let client = at(7, "127.0.0.1:40000", "127.0.0.1:8080");
        let server = at(7, "[::ffff:127.0.0.1]:8080", "[::ffff:127.0.0.1]:40000");
        assert_eq!(ConnKey::other_end(&client), ConnKey::of(&server));
        assert_eq!(ConnKey::other_end(&server), ConnKey::of(&client));
        assert_ne!(ConnKey::of(&client), ConnKey::of(&server));
        let elsewhere = at(8, "127.0.0.1:8080", "127.0.0.1:40000");
        assert_ne!(ConnKey::other_end(&client), ConnKey::of(&elsewhere));
        let other_port = at(7, "127.0.0.1:8080", "127.0.0.1:40001");
        assert_ne!(ConnKey::other_end(&client), ConnKey::of(&other_port));
        let v6 = at(7, "[::1]:8080", "[::1]:40000");
        assert_ne!(ConnKey::of(&v6), ConnKey::of(&server));
    }

    #[test]
    fn endpoints_serialize_as_socket_addresses() {
        for a in [
            "0.0.0.0:0",
            "1.2.3.4:5",
            "127.0.0.1:8080",
            "255.255.255.255:65535",
            "10.0.16.36:443",
            "[::1]:45000",
            "[::ffff:10.0.16.36]:8080",
        ] {
            let sa: SocketAddr = a.parse().unwrap();
            let e = Endpoint::from(sa);
            assert_eq!(serde_json::to_string(&e).unwrap(), format!("\"{sa}\""));
            assert_eq!(e.to_string(), a);
        }
    }

    #[test]
    fn parses_states() {
        assert_eq!("close-wait".parse::<TcpState>(), Ok(TcpState::CloseWait));
        assert_eq!("estab".parse::<TcpState>(), Ok(TcpState::Established));
        assert!("nope"
            .parse::<TcpState>()
            .unwrap_err()
            .to_string()
            .contains("`nope` (expected one of ESTABLISHED, SYN_SENT"));
    }

    #[test]
    fn classify_guesses_service_side_without_listener() {
        let none = PortSet::default();
        let eph = HostInfo::default().ephemeral;
        assert_eq!(classify(50000, 80, &none, &eph), (Direction::Outbound, 80));
        assert_eq!(classify(22, 50000, &none, &eph), (Direction::Inbound, 22));
        // A namespace with a low ephemeral range: the client's port 20000 is ephemeral there.
        let low = 10000..=20000;
        assert_eq!(
            classify(20000, 30000, &none, &low),
            (Direction::Outbound, 30000)
        );
        let mut listening = PortSet::default();
        listening.insert(50000);
        assert_eq!(
            classify(50000, 80, &listening, &eph),
            (Direction::Inbound, 50000)
        );
    }

    #[test]
    fn port_set_holds_every_port() {
        let mut set = PortSet::default();
        for p in [0, 1, 63, 64, 8080, u16::MAX] {
            assert!(!set.contains(p));
            set.insert(p);
            assert!(set.contains(p));
        }
        assert!(!set.contains(65));
        assert_eq!(format!("{set:?}"), "{0, 1, 63, 64, 8080, 65535}");
    }
}
#[cfg(test)]
mod size_tests {
    /// The daemon holds a row per socket (100k rows at 144 bytes: 14.4 MB); a field that
    /// grows it shows here first. Ages and idle times are ms integers for this (a `Duration`
    /// is 16 bytes), and the idle time is derived from the last receive and send.
    #[test]
    fn a_socket_row_stays_at_most_144_bytes() {
        assert!(
            std::mem::size_of::<super::Socket>() <= 144,
            "Socket is {} bytes",
            std::mem::size_of::<super::Socket>()
        );
    }
}
