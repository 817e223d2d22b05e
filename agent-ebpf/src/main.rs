//! connreap's BPF programs. Built for `bpfel-unknown-none` by `cargo xtask build-ebpf`; on the
//! host this file compiles to an empty binary so `cargo check --workspace` never breaks.
#![cfg_attr(target_arch = "bpf", no_std, no_main)]
// Inline asm on BPF (the hand-encoded kfunc call in `programs::destroy`) is still unstable.
#![cfg_attr(target_arch = "bpf", feature(asm_experimental_arch))]

#[cfg(target_arch = "bpf")]
mod destroy;
#[cfg(target_arch = "bpf")]
mod netns_socks;
#[cfg(target_arch = "bpf")]
mod programs;
// The bench-only `hash` tracker keeps its own map: the table's writers are unused there.
#[cfg(all(target_arch = "bpf", tracker_variant = "sk-storage"))]
mod sk_storage;
#[cfg(target_arch = "bpf")]
#[cfg_attr(
    any(tracker_variant = "hash", tracker_variant = "sk-storage"),
    allow(dead_code)
)]
mod state;
#[cfg(target_arch = "bpf")]
mod sweep;
#[cfg(target_arch = "bpf")]
mod tracker;

#[cfg(not(target_arch = "bpf"))]
fn main() {}
