//! Destroying sockets: netlink SOCK_DESTROY (`netlink`), the bpf_sock_destroy fallback for
//! kernels without it (`bpf`), and the check each passes at start (`probe`). The mechanism is
//! chosen once, at start, by [`Destroyer::choose`].
pub mod bpf;
pub mod netlink;
mod probe;

use crate::config::DestroyMechanism;
use bpf::BpfDestroyer;

/// A destroy mechanism's own error (netlink or the BPF fallback) with its whole chain.
type Cause = anyhow::Error;

/// Why no destroy mechanism could be set up. Shown in each dry-run decision's `mode`, so the
/// message carries the causes' whole chain (`{:#}`).
#[derive(Debug, thiserror::Error)]
pub enum MechanismError {
    #[error("{0:#}")]
    Netlink(Cause),
    #[error("bpf_sock_destroy fallback: {0:#}")]
    Bpf(Cause),
    #[error("{netlink:#}; bpf_sock_destroy fallback: {fallback:#}")]
    Neither { netlink: Cause, fallback: Cause },
}

/// How a socket gets destroyed.
pub enum Destroyer {
    /// netlink SOCK_DESTROY, by 4-tuple and cookie (what `ss -K` does).
    Netlink,
    /// The bpf_sock_destroy kfunc from an iter/tcp program, by inode and kernel address.
    Bpf(BpfDestroyer),
}

impl Destroyer {
    pub fn name(&self) -> &'static str {
        match self {
            Destroyer::Netlink => netlink::MECHANISM,
            Destroyer::Bpf(_) => bpf::MECHANISM,
        }
    }

    /// The configured mechanism, checked on a loopback pair of our own; `load_bpf` loads the
    /// fallback's program (only called when the fallback is wanted or needed).
    pub fn choose(
        wanted: DestroyMechanism,
        load_bpf: impl FnOnce() -> Result<BpfDestroyer, super::KernelError>,
    ) -> Result<Destroyer, MechanismError> {
        let bpf = || -> Result<Destroyer, Cause> {
            let mut d = load_bpf()?;
            d.probe()?;
            Ok(Destroyer::Bpf(d))
        };
        match wanted {
            DestroyMechanism::Netlink => netlink::probe()
                .map(|()| Destroyer::Netlink)
                .map_err(|e| MechanismError::Netlink(e.into())),
            DestroyMechanism::BpfIter => bpf().map_err(MechanismError::Bpf),
            DestroyMechanism::Auto => {
                match netlink::probe() {
                    Ok(()) => Ok(Destroyer::Netlink),
                    Err(netlink) => {
                        let netlink: Cause = netlink.into();
                        tracing::warn!(reason = format!("{netlink:#}"), "netlink socket destroy unavailable; trying the bpf_sock_destroy fallback");
                        bpf().map_err(|fallback| MechanismError::Neither { netlink, fallback })
                    }
                }
            }
        }
    }
}
