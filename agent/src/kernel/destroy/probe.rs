//! The check each destroy mechanism passes at start: a loopback connection of our own is
//! destroyed, and its client must then read ECONNABORTED, as an application whose socket was
//! reclaimed would.
use std::{
    io::Read as _,
    net::{SocketAddr, TcpListener, TcpStream},
};

/// The probe pair could not be set up, or its socket survived the destroy.
#[derive(Debug, thiserror::Error)]
pub enum PairError {
    /// Setting up the pair (`step`: listener, connect, accept, ...).
    #[error("probe {step}")]
    Setup {
        step: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("probe socket survived the destroy (read gave {read:?})")]
    Survived { read: std::io::Result<usize> },
}

/// Run `kill(local, peer, client)` on a fresh loopback connection of our own and check that
/// the client then reads ECONNABORTED.
pub fn probe_pair<E: From<PairError>>(
    kill: impl FnOnce(SocketAddr, SocketAddr, &TcpStream) -> Result<(), E>,
) -> Result<(), E> {
    let setup = |step| move |source| PairError::Setup { step, source };
    let listener = TcpListener::bind("127.0.0.1:0").map_err(setup("listener"))?;
    let server_addr = listener.local_addr().map_err(setup("listener address"))?;
    let mut client = TcpStream::connect(server_addr).map_err(setup("connect"))?;
    let (_server, _) = listener.accept().map_err(setup("accept"))?;
    let local = client.local_addr().map_err(setup("client address"))?;
    kill(local, server_addr, &client)?;
    client
        .set_read_timeout(Some(std::time::Duration::from_secs(1)))
        .map_err(setup("read timeout"))?;
    let mut b = [0u8; 1];
    match client.read(&mut b) {
        Err(e) if e.raw_os_error() == Some(libc::ECONNABORTED) => Ok(()),
        read => Err(PairError::Survived { read }.into()),
    }
}
