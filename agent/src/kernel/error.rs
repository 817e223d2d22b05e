//! What can go wrong in the kernel module. Each variant says what was being done and carries
//! the error it came from: print with `{:#}` through anyhow to get the whole chain.
use std::path::PathBuf;

use super::{offsets, BTF_PATH};

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
    #[error("loading the BPF object failed: the BPF object has no bpf_sock_destroy call to patch")]
    NoKfuncCall,
    /// The verifier (or the kernel before it) refused the program.
    #[error("kernel refused BPF program {program}")]
    Refused {
        program: &'static str,
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
    #[error("BPF map {0} missing from the object")]
    MissingMap(&'static str),
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
        } => KernelError::Refused {
            program,
            source: Refusal {
                errno: io_error,
                verifier_log: verbose.then(|| verifier_log.to_string()),
            },
        },
        source => KernelError::Program { program, source },
    }
}
