//! Embeds the BPF object built by `cargo xtask build-ebpf`. When it has not been built, an empty
//! placeholder is embedded and the binary says so at run time, so a plain `cargo build` or
//! `cargo clippy` never fails cryptically (`cargo xtask dist` refuses to package such a binary).
//!
//! Also provides, for `connreap --version`: `CONNREAP_COMMIT` (the commit built from: the
//! variable of that name when set, e.g. in a container build without `.git`, else
//! `git rev-parse`, else "unknown") and `CONNREAP_BPF_OBJECT` (what was embedded).
use std::{
    env, fs,
    path::{Path, PathBuf},
    process::Command,
};

fn main() {
    let manifest = PathBuf::from(env::var("CARGO_MANIFEST_DIR").expect("cargo sets this"));
    let target_dir = env::var("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|_| manifest.join("../target"));
    let object = target_dir.join("bpfel-unknown-none/release/connreap-ebpf");
    let out = PathBuf::from(env::var("OUT_DIR").expect("cargo sets this")).join("connreap-ebpf.o");
    println!("cargo:rerun-if-changed={}", object.display());
    println!("cargo:rerun-if-env-changed=CARGO_TARGET_DIR");
    let embedded = match fs::read(&object) {
        Ok(bytes) => {
            fs::write(&out, &bytes).expect("write OUT_DIR");
            bytes.len()
        }
        Err(_) => {
            println!(
                "cargo:warning=BPF object {} not built: run `cargo xtask build` (the binary will refuse to start)",
                object.display()
            );
            fs::write(&out, []).expect("write OUT_DIR");
            0
        }
    };
    let described = if embedded == 0 {
        "missing (an empty placeholder: build with `cargo xtask build`)".to_string()
    } else {
        format!("{embedded} bytes embedded")
    };
    println!("cargo:rustc-env=CONNREAP_BPF_OBJECT={described}");
    println!("cargo:rustc-env=CONNREAP_COMMIT={}", commit(&manifest));
}

/// The commit the binary is built from, and the files whose change means another commit.
fn commit(manifest: &Path) -> String {
    println!("cargo:rerun-if-env-changed=CONNREAP_COMMIT");
    if let Some(c) = env::var("CONNREAP_COMMIT").ok().filter(|c| !c.is_empty()) {
        return c;
    }
    let git = |args: &[&str]| -> Option<String> {
        let out = Command::new("git")
            .args(args)
            .current_dir(manifest)
            .output()
            .ok()?;
        let s = String::from_utf8(out.stdout).ok()?.trim().to_string();
        (out.status.success() && !s.is_empty()).then_some(s)
    };
    let Some(hash) = git(&["rev-parse", "--short=12", "HEAD"]) else {
        return "unknown".into();
    };
    // HEAD, the branch it points to, and packed refs (only those that exist: a missing path
    // would make cargo rerun this script on every build).
    let mut watched = vec!["HEAD".to_string(), "packed-refs".to_string()];
    if let Some(branch) = git(&["symbolic-ref", "-q", "HEAD"]) {
        watched.push(branch);
    }
    for w in watched {
        if let Some(path) = git(&["rev-parse", "--git-path", &w]) {
            let path = manifest.join(path);
            if path.exists() {
                println!("cargo:rerun-if-changed={}", path.display());
            }
        }
    }
    hash
}
