//! Embeds the BPF object built by `cargo xtask build-ebpf`. When it has not been built, an empty
//! placeholder is embedded and the binary says so at run time, so a plain `cargo build` or
//! `cargo clippy` never fails cryptically.
use std::{env, fs, path::PathBuf};

fn main() {
    let manifest = PathBuf::from(env::var("CARGO_MANIFEST_DIR").expect("cargo sets this"));
    let target_dir = env::var("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|_| manifest.join("../target"));
    let object = target_dir.join("bpfel-unknown-none/release/connreap-ebpf");
    let out = PathBuf::from(env::var("OUT_DIR").expect("cargo sets this")).join("connreap-ebpf.o");
    println!("cargo:rerun-if-changed={}", object.display());
    println!("cargo:rerun-if-env-changed=CARGO_TARGET_DIR");
    match fs::read(&object) {
        Ok(bytes) => fs::write(&out, bytes).expect("write OUT_DIR"),
        Err(_) => {
            println!(
                "cargo:warning=BPF object {} not built: run `cargo xtask build` (the binary will refuse to start)",
                object.display()
            );
            fs::write(&out, []).expect("write OUT_DIR");
        }
    }
}
