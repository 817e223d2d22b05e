//! `connreap unpin` (remove the pinned state tracker) and `connreap mount-bpffs` (the
//! DaemonSet's init container): the pin root's two commands.
use std::process::ExitCode;

use super::EX_TEMPFAIL;
use crate::kernel;

pub(super) fn unpin(force: bool) -> anyhow::Result<ExitCode> {
    match kernel::unpin_all(force) {
        Err(e @ kernel::KernelError::PinsInUse { .. }) => {
            eprintln!("connreap: {e}");
            Ok(ExitCode::from(EX_TEMPFAIL))
        }
        Err(e) => Err(e.into()),
        Ok(removed) => {
            eprintln!(
                "{}",
                if removed {
                    "state tracker unpinned"
                } else {
                    "nothing pinned"
                }
            );
            Ok(ExitCode::SUCCESS)
        }
    }
}

pub(super) fn mount_bpffs() -> anyhow::Result<()> {
    let mounted = kernel::mount_bpffs()?;
    eprintln!(
        "{}",
        if mounted {
            "mounted bpffs at /sys/fs/bpf"
        } else {
            "bpffs already mounted at /sys/fs/bpf"
        }
    );
    Ok(())
}
