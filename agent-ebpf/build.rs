//! Selects a bench-only build of the tracker: `CONNREAP_TRACKER_VARIANT=<variant>` sets
//! `cfg(tracker_variant = "<variant>")` (the variants: tracker.rs, and what each measures: the
//! bench's probe_parts.rs). Only `cargo xtask bench --probe-parts` sets it, in a target
//! directory of its own (target/bench-variants): a variant asked for in any other target
//! directory fails the build, so it can never reach the object agent/build.rs embeds
//! (target/bpfel-unknown-none/release). Without the variable nothing is set: the shipped build.
use std::{env, path::Path};

const VARIANTS: [&str; 8] = [
    "count-only",
    "no-map",
    "no-ring",
    "unbatched",
    "ktime",
    "hash",
    "batch32",
    "sk-storage",
];
/// The name of the only target directory a variant may be built in.
const VARIANTS_DIR: &str = "bench-variants";

fn main() {
    let values: Vec<String> = VARIANTS.iter().map(|v| format!("\"{v}\"")).collect();
    println!(
        "cargo::rustc-check-cfg=cfg(tracker_variant, values({}))",
        values.join(", ")
    );
    println!("cargo::rerun-if-env-changed=CONNREAP_TRACKER_VARIANT");
    let Some(variant) = env::var("CONNREAP_TRACKER_VARIANT")
        .ok()
        .filter(|v| !v.is_empty())
    else {
        return;
    };
    assert!(
        VARIANTS.contains(&variant.as_str()),
        "CONNREAP_TRACKER_VARIANT={variant}: not a tracker variant ({})",
        VARIANTS.join(", ")
    );
    let out = env::var("OUT_DIR").expect("cargo sets OUT_DIR");
    assert!(
        Path::new(&out)
            .components()
            .any(|c| c.as_os_str() == VARIANTS_DIR),
        "CONNREAP_TRACKER_VARIANT={variant} outside a target directory named {VARIANTS_DIR} \
         (OUT_DIR {out}): bench-only trackers are built only there, never next to the shipped \
         object"
    );
    println!("cargo::rustc-cfg=tracker_variant=\"{variant}\"");
}
