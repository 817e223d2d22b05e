//! The BPF programs' rare-path messages: a state-table set full, the event ring full, kernel
//! offsets the loader did not set. The programs write them with aya-log-ebpf into `AYA_LOGS`
//! (pinned with the other shared maps, so every load of the object writes the same ring); this
//! reads them with aya-log and forwards them into connreap's tracing output under the target
//! `connreap::bpf`, so they reach the journal, the JSON logs and `RUST_LOG` filters like any
//! other line. The programs log a loss when a CPU's count of it passes a power of two, so a
//! lasting loss costs a few lines, not one per socket.
use std::{
    os::fd::{AsRawFd as _, RawFd},
    path::Path,
};

use aya::programs::ProgramInfo;
use aya_log::EbpfLogger;

use super::{Kernel, KernelError};

/// The programs' log ring, read into tracing.
pub struct BpfLog(EbpfLogger<Forward>);

impl Kernel {
    /// The log ring of the programs pinned with this process's tracker (found through the
    /// pinned flush program, which shares it with the tracker and the iterators).
    pub fn open_log(&self) -> Result<BpfLog, KernelError> {
        open(&self.pin_dir.join("flush"))
    }
}

fn open(program_pin: &Path) -> Result<BpfLog, KernelError> {
    let info = ProgramInfo::from_pin(program_pin).map_err(KernelError::LogProgram)?;
    EbpfLogger::init_from_id_with_logger(info.id(), Forward)
        .map(BpfLog)
        .map_err(KernelError::Log)
}

impl BpfLog {
    /// The ring's fd, to poll(2) for records.
    pub fn raw_fd(&self) -> RawFd {
        self.0.as_raw_fd()
    }

    /// Forward every record in the ring now.
    pub fn drain(&mut self) {
        self.0.flush();
    }
}

/// Hands aya-log's `log` records to tracing.
struct Forward;

impl log::Log for Forward {
    fn enabled(&self, _: &log::Metadata<'_>) -> bool {
        true
    }

    fn log(&self, r: &log::Record<'_>) {
        let module = r.target();
        let msg = r.args();
        match r.level() {
            log::Level::Error => tracing::error!(target: "connreap::bpf", module, "{msg}"),
            log::Level::Warn => tracing::warn!(target: "connreap::bpf", module, "{msg}"),
            log::Level::Info => tracing::info!(target: "connreap::bpf", module, "{msg}"),
            log::Level::Debug => tracing::debug!(target: "connreap::bpf", module, "{msg}"),
            log::Level::Trace => tracing::trace!(target: "connreap::bpf", module, "{msg}"),
        }
    }

    fn flush(&self) {}
}
