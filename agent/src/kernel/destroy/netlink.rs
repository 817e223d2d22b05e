//! netlink sock_diag: exact-socket lookup and SOCK_DESTROY (what `ss -K` does), over one
//! netlink socket for a whole batch of kills (a netlink socket belongs to the namespace of the
//! thread that made it: one per namespace's batch).
use std::net::{IpAddr, SocketAddr};

use netlink_packet_core::{
    NetlinkHeader, NetlinkMessage, NetlinkPayload, NLM_F_ACK, NLM_F_REQUEST,
};
use netlink_packet_sock_diag::{
    constants::{AF_INET, AF_INET6, IPPROTO_TCP},
    inet::{ExtensionFlags, InetRequest, SocketId, StateFlags},
    SockDiagDestroy, SockDiagMessage,
};
use netlink_sys::{protocols::NETLINK_SOCK_DIAG, Socket};

use super::probe::{probe_pair, PairError};

/// The kernel's "any cookie" value.
pub const NO_COOKIE: [u8; 8] = [0xff; 8];

#[derive(Debug, thiserror::Error)]
pub enum DiagError {
    #[error("netlink socket")]
    Socket(#[source] std::io::Error),
    /// The kernel's answer was an error code.
    #[error("kernel answered errno {}", .0.raw_os_error().unwrap_or_default())]
    Kernel(#[source] std::io::Error),
    #[error("cannot decode the netlink reply")]
    Decode(#[source] netlink_packet_core::DecodeError),
    #[error("netlink ACK without a socket")]
    AckWithoutSocket,
    /// A well-formed reply of an unexpected kind (its debug form).
    #[error("unexpected netlink reply: {0}")]
    Unexpected(String),
}

impl DiagError {
    pub fn errno(&self) -> Option<i32> {
        match self {
            DiagError::Kernel(e) => e.raw_os_error(),
            _ => None,
        }
    }
}

/// What sock_diag says about one socket.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DiagSocket {
    pub inode: u32,
    pub cookie: [u8; 8],
    pub state: u8,
}

fn request(local: SocketAddr, peer: SocketAddr, cookie: [u8; 8]) -> InetRequest {
    let family = if local.is_ipv4() { AF_INET } else { AF_INET6 };
    InetRequest {
        family,
        protocol: IPPROTO_TCP,
        extensions: ExtensionFlags::empty(),
        states: StateFlags::all(),
        socket_id: SocketId {
            source_port: local.port(),
            destination_port: peer.port(),
            source_address: local.ip(),
            destination_address: match (local.ip(), peer.ip()) {
                (IpAddr::V6(_), IpAddr::V4(v4)) => IpAddr::V6(v4.to_ipv6_mapped()),
                (_, ip) => ip,
            },
            interface_id: 0,
            cookie,
        },
    }
}

/// A sock_diag netlink socket of the calling thread's network namespace.
pub struct Netlink {
    sock: Socket,
}

fn kernel_error(code: i32) -> DiagError {
    DiagError::Kernel(std::io::Error::from_raw_os_error(code.abs()))
}

fn send<T>(sock: &Socket, mut msg: NetlinkMessage<T>) -> Result<(), DiagError>
where
    T: netlink_packet_core::NetlinkSerializable,
{
    msg.finalize();
    let mut buf = vec![0; msg.buffer_len()];
    msg.serialize(&mut buf);
    sock.send(&buf, 0).map_err(DiagError::Socket)?;
    Ok(())
}

impl Netlink {
    pub fn open() -> Result<Netlink, DiagError> {
        let mut sock = Socket::new(NETLINK_SOCK_DIAG).map_err(DiagError::Socket)?;
        sock.bind_auto().map_err(DiagError::Socket)?;
        sock.connect(&netlink_sys::SocketAddr::new(0, 0))
            .map_err(DiagError::Socket)?;
        Ok(Netlink { sock })
    }

    /// Send one request, and read and decode the kernel's one reply.
    fn ask<T>(&self, msg: NetlinkMessage<T>) -> Result<NetlinkPayload<SockDiagMessage>, DiagError>
    where
        T: netlink_packet_core::NetlinkSerializable,
    {
        send(&self.sock, msg)?;
        let mut buf = vec![0; 8192];
        let n = self
            .sock
            .recv(&mut &mut buf[..], 0)
            .map_err(DiagError::Socket)?;
        let reply =
            <NetlinkMessage<SockDiagMessage>>::deserialize(&buf[..n]).map_err(DiagError::Decode)?;
        Ok(reply.payload)
    }

    /// Look up the socket with exactly this 4-tuple (kernel-side exact match).
    pub fn lookup(
        &self,
        local: SocketAddr,
        peer: SocketAddr,
    ) -> Result<Option<DiagSocket>, DiagError> {
        let mut hdr = NetlinkHeader::default();
        hdr.flags = NLM_F_REQUEST;
        let msg = NetlinkMessage::new(
            hdr,
            SockDiagMessage::InetRequest(request(local, peer, NO_COOKIE)).into(),
        );
        match self.ask(msg)? {
            NetlinkPayload::InnerMessage(SockDiagMessage::InetResponse(r)) => {
                Ok(Some(DiagSocket {
                    inode: r.header.inode,
                    cookie: r.header.socket_id.cookie,
                    state: r.header.state,
                }))
            }
            NetlinkPayload::Error(e) => match e.code {
                Some(code) if code.get().abs() == libc::ENOENT => Ok(None),
                Some(code) => Err(kernel_error(code.get())),
                None => Err(DiagError::AckWithoutSocket),
            },
            other => Err(DiagError::Unexpected(format!("{other:?}"))),
        }
    }

    /// Destroy the socket with this 4-tuple and cookie. The kernel checks the cookie, so a socket
    /// that reused the 4-tuple is never hit.
    pub fn destroy(
        &self,
        local: SocketAddr,
        peer: SocketAddr,
        cookie: [u8; 8],
    ) -> Result<(), DiagError> {
        let mut hdr = NetlinkHeader::default();
        hdr.flags = NLM_F_REQUEST | NLM_F_ACK;
        let msg = NetlinkMessage::new(
            hdr,
            NetlinkPayload::from(SockDiagDestroy::new(SockDiagMessage::InetRequest(request(
                local, peer, cookie,
            )))),
        );
        match self.ask(msg)? {
            NetlinkPayload::Error(e) => match e.code {
                None => Ok(()),
                Some(code) => Err(kernel_error(code.get())),
            },
            other => Err(DiagError::Unexpected(format!("{other:?}"))),
        }
    }
}

pub const MECHANISM: &str = "netlink-sock-destroy";

/// Why netlink destroy failed its check on a loopback pair of our own.
#[derive(Debug, thiserror::Error)]
pub enum ProbeError {
    #[error(transparent)]
    Pair(#[from] PairError),
    #[error("sock_diag")]
    Open(#[source] DiagError),
    #[error("sock_diag lookup")]
    Lookup(#[source] DiagError),
    #[error("sock_diag lookup did not find the probe socket")]
    NotFound,
    #[error("netlink SOCK_DESTROY not supported (kernel built without CONFIG_INET_DIAG_DESTROY)")]
    Unsupported(#[source] DiagError),
    #[error("netlink SOCK_DESTROY failed")]
    Destroy(#[source] DiagError),
}

/// Check that destroy works here, on a loopback pair of our own.
pub fn probe() -> Result<(), ProbeError> {
    let nl = Netlink::open().map_err(ProbeError::Open)?;
    probe_pair(|local, server, _| {
        let found = nl
            .lookup(local, server)
            .map_err(ProbeError::Lookup)?
            .ok_or(ProbeError::NotFound)?;
        nl.destroy(local, server, found.cookie)
            .map_err(|e| match e.errno() {
                Some(libc::EOPNOTSUPP) => ProbeError::Unsupported(e),
                _ => ProbeError::Destroy(e),
            })
    })
}
