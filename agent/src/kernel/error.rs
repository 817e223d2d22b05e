//! What can go wrong in the kernel module. Each variant says what was being done and carries
//! the error it came from: print with `{:#}` through anyhow to get the whole chain.
use std::path::PathBuf;

use super::{offsets, too_old, BTF_PATH};

/// Why the kernel side could not be loaded or used.
#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    #[error("connreap must run as root (it loads BPF programs); try: sudo connreap ...")]
    NotRoot,
    #[error("this binary has no BPF object embedded: build it with `cargo xtask build`")]
    NotBuilt,
    #[error("kernel BTF not found at {BTF_PATH}: connreap needs a kernel built with CONFIG_DEBUG_INFO_BTF=y")]
    NoBtf,
    #[error(transparent)]
    Offsets(#[from] offsets::OffsetError),
    #[error("cannot mount {fs} at {path}")]
    Mount {
        fs: &'static str,
        path: &'static str,
        #[source]
        source: std::io::Error,
    },
    /// The pin root is unusable; nothing was created or removed.
    #[error("pin root {} (CONNREAP_PIN_ROOT) refused: {why}", root.display())]
    PinRoot { root: PathBuf, why: String },
    /// `connreap unpin` without `--force`: another process holds the pinned objects.
    #[error(
        "refusing to unpin: {users} use{} the state tracker pinned under {} (another connreap \
         running with this pin root); stop it first, or run `connreap unpin --force` to reset \
         its tracker anyway", if .users.contains(", ") { "" } else { "s" }, root.display()
    )]
    PinsInUse { root: PathBuf, users: String },
    #[error("cannot prepare pin directory {}", path.display())]
    PinDir {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot pin {}", path.display())]
    Pin {
        path: PathBuf,
        #[source]
        source: aya::pin::PinError,
    },
    #[error("loading the BPF object failed")]
    Object(#[source] aya::EbpfError),
    #[error("loading the BPF object failed: cannot read the kernel BTF")]
    KernelBtf(#[source] aya::BtfError),
    #[error("loading the BPF object failed: program {0} missing from the object")]
    MissingProgram(&'static str),
    #[error("loading the BPF object failed: program {0} has an unexpected type")]
    ProgramType(&'static str),
    #[error("loading the BPF object failed: the BPF object has no {0} call to patch")]
    NoKfuncCall(&'static str),
    /// The verifier (or the kernel before it) refused the program.
    #[error("kernel refused BPF program {program}")]
    Refused {
        program: &'static str,
        #[source]
        source: Refusal,
    },
    /// The verifier refused the program because the kernel lacks a feature it uses.
    #[error("{diagnosis}; BPF program {program} was refused")]
    TooOld {
        program: &'static str,
        diagnosis: Box<too_old::TooOld>,
        #[source]
        source: Refusal,
    },
    /// Any other failure to load, attach or open a program.
    #[error("kernel refused BPF program {program}")]
    Program {
        program: &'static str,
        #[source]
        source: aya::programs::ProgramError,
    },
    #[error("running the {what} iterator failed")]
    Iterate {
        what: &'static str,
        #[source]
        source: IterError,
    },
    #[error("cannot list the host's network namespaces")]
    Netns(#[source] super::netns::NetnsError),
    #[error(transparent)]
    FindNetns(super::netns::FindError),
    #[error("BPF map {0} missing from the object")]
    MissingMap(&'static str),
    #[error("cannot find the pinned program whose log ring to read")]
    LogProgram(#[source] aya::programs::ProgramError),
    #[error("this kernel does not run the sweep over the state table")]
    NoSweep,
    #[error("sweeping the state table failed")]
    Sweep(#[from] super::sweep::SweepError),
    #[error("sk-storage pass: {0}")]
    SkPass(String),
    #[error("cannot read the BPF programs' log ring")]
    Log(#[source] aya_log::Error),
    #[error("BPF map {name} cannot be used")]
    Map {
        name: &'static str,
        #[source]
        source: aya::maps::MapError,
    },
    #[error("cannot read the online CPUs from {path}")]
    OnlineCpus {
        path: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("running {program} on CPU {cpu}")]
    Run {
        program: &'static str,
        cpu: u32,
        #[source]
        source: aya::programs::ProgramError,
    },
}

/// What the kernel said when it refused to load a program: the errno and, with `-v`, the
/// verifier log (never dumped by default: it can be thousands of lines).
#[derive(Debug, thiserror::Error)]
#[error("{errno}{}", match verifier_log {
    Some(log) => format!("\nverifier log:\n{log}"),
    None => " (run with -v for the verifier log)".to_string(),
})]
pub struct Refusal {
    /// The load syscall's error (shown in this message rather than as a further cause, so the
    /// verifier log stays last).
    pub errno: std::io::Error,
    pub verifier_log: Option<String>,
}

/// How running an iterator (or the destroy iterator's request map) failed.
#[derive(Debug, thiserror::Error)]
pub enum IterError {
    #[error(transparent)]
    Program(#[from] aya::programs::ProgramError),
    #[error(transparent)]
    Link(#[from] aya::programs::links::LinkError),
    #[error(transparent)]
    Read(#[from] std::io::Error),
    #[error(transparent)]
    Map(#[from] aya::maps::MapError),
    #[error("the owner dump's thread panicked")]
    Panicked,
}

impl KernelError {
    pub(super) fn iterate(what: &'static str) -> impl Fn(IterError) -> KernelError {
        move |source| KernelError::Iterate { what, source }
    }

    pub(super) fn pin(path: &std::path::Path) -> impl Fn(aya::pin::PinError) -> KernelError + '_ {
        move |source| KernelError::Pin {
            path: path.to_path_buf(),
            source,
        }
    }

    pub(super) fn map(name: &'static str) -> impl Fn(aya::maps::MapError) -> KernelError {
        move |source| KernelError::Map { name, source }
    }
}

/// A program load error: the errno and, with `-v`, the verifier log (never dumped by default).
pub(super) fn program_error(
    verbose: bool,
    program: &'static str,
    e: aya::programs::ProgramError,
) -> KernelError {
    match e {
        aya::programs::ProgramError::LoadError {
            io_error,
            verifier_log,
        } => {
            let log = verifier_log.to_string();
            let diagnosis = too_old::diagnose(&log, &too_old::running_release());
            let source = Refusal {
                errno: io_error,
                verifier_log: verbose.then_some(log),
            };
            match diagnosis {
                Some(diagnosis) => KernelError::TooOld {
                    program,
                    diagnosis: Box::new(diagnosis),
                    source,
                },
                None => KernelError::Refused { program, source },
            }
        }
        source => KernelError::Program { program, source },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What `connreap snapshot` prints when Linux 5.10 refuses the tracker (checked on Debian
    /// 11's 5.10.262 under QEMU): one line saying the kernel is too old, the missing feature and
    /// the release that has it.
    #[test]
    fn too_old_is_one_line_naming_the_feature_and_release() {
        let log = "BPF_STX uses reserved fields\nverification time 226 usec\n";
        let e = KernelError::TooOld {
            program: "connreap_set_state",
            diagnosis: Box::new(too_old::diagnose(log, "5.10.0-46-cloud-amd64").unwrap()),
            source: Refusal {
                errno: std::io::Error::from_raw_os_error(libc::EINVAL),
                verifier_log: None,
            },
        };
        let line = format!("{:#}", anyhow::Error::new(e));
        assert!(!line.contains('\n'), "{line}");
        assert!(
            line.starts_with("kernel too old: Linux 5.10.0-46-cloud-amd64 lacks 64-bit atomic compare-and-exchange"),
            "{line}"
        );
        assert!(
            line.contains("(Linux 5.12+); connreap needs Linux 5.12 or newer"),
            "{line}"
        );
        assert!(
            line.contains("BPF program connreap_set_state was refused: "),
            "{line}"
        );
        assert!(line.contains("run with -v for the verifier log"), "{line}");
    }
}
