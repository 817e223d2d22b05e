//! `cargo xtask image`: the OCI image, built with no registry. The release binary is built and
//! stripped on the host; the base is made from Debian's packages (mmdebstrap, `podman import`);
//! the Containerfile's `prebuilt` target puts the two together (`podman build --pull=never`),
//! the same recipe that builds everything in containers where registries are reachable. The
//! base tarballs and imported images are kept (target/image, podman's storage) so reruns take
//! seconds. Installs podman, buildah, mmdebstrap and runc with apt when missing (root).
use std::{
    fs,
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

use anyhow::{bail, Context, Result};

use crate::{agent_bin, root, run};

/// The Debian release the bases are made from (the one the binary is built on).
const SUITE: &str = "bookworm";
/// The agent image's base: glibc and libgcc for the Rust binary, CA certificates for webhooks.
pub const BASE_IMAGE: &str = "localhost/connreap-base:bookworm";
const BASE_PACKAGES: &str = "ca-certificates,libgcc-s1";
/// Engine packages, by a file each installs.
const ENGINE_PACKAGES: &[(&str, &str)] = &[
    ("podman", "/usr/bin/podman"),
    ("buildah", "/usr/bin/buildah"),
    ("mmdebstrap", "/usr/bin/mmdebstrap"),
    ("runc", "/usr/sbin/runc"),
];

/// The image `cargo xtask image` tags, the one deploy/kubernetes/daemonset.yaml runs.
pub fn image_name() -> String {
    format!("localhost/connreap:{}", env!("CARGO_PKG_VERSION"))
}

pub fn cache_dir() -> PathBuf {
    root().join("target/image")
}

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// Install the container engine and mmdebstrap when any of them is missing.
pub fn ensure_engine() -> Result<()> {
    let missing: Vec<&str> = ENGINE_PACKAGES
        .iter()
        .filter(|(_, path)| !Path::new(path).exists())
        .map(|(pkg, _)| *pkg)
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    if !is_root() {
        bail!("{} missing: installing them needs root", missing.join(" "));
    }
    eprintln!(
        "xtask: installing {} with apt (the image)",
        missing.join(" ")
    );
    run(Command::new("apt-get").args(["update", "-qq"]))?;
    run(Command::new("apt-get")
        .args(["install", "-y", "-qq", "--no-install-recommends"])
        .args(&missing)
        .env("DEBIAN_FRONTEND", "noninteractive"))
}

fn podman() -> Command {
    Command::new("podman")
}

fn image_exists(name: &str) -> bool {
    podman()
        .args(["image", "exists", name])
        .status()
        .is_ok_and(|s| s.success())
}

/// `name` imported from a root filesystem mmdebstrap makes with `args` (the tarball cached as
/// target/image/`tarball`), unless podman already has it.
pub fn ensure_debian_image(name: &str, tarball: &str, args: &[&str]) -> Result<()> {
    if image_exists(name) {
        return Ok(());
    }
    let dir = cache_dir();
    fs::create_dir_all(&dir)?;
    let tar = dir.join(tarball);
    if !tar.exists() {
        // mmdebstrap picks the output format from the name: keep `.tar` at the end.
        let tmp = dir.join(format!("partial-{tarball}"));
        eprintln!("xtask: making {name} from Debian packages (mmdebstrap, under a minute)");
        run(Command::new("mmdebstrap")
            .args(["--quiet"])
            .args(args)
            .arg(SUITE)
            .arg(&tmp))?;
        fs::rename(&tmp, &tar)?;
    }
    run(podman()
        .args(["import", "--quiet", "--change", r#"CMD ["/bin/sh"]"#])
        .arg(&tar)
        .arg(name)
        .stdout(Stdio::null()))
}

/// The commit `connreap --version` reports ("connreap 0.1.0 (commit abc)").
fn binary_commit(bin: &Path) -> Result<String> {
    let out = Command::new(bin).arg("--version").output()?;
    let text = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() || !text.contains("bytes embedded") {
        bail!("{} does not embed the BPF object: {text}", bin.display());
    }
    text.split_once("(commit ")
        .and_then(|(_, rest)| rest.split_once(')'))
        .map(|(c, _)| c.to_string())
        .context("no commit in --version")
}

/// Where the source comes from: CONNREAP_SOURCE, else the git remote `origin`.
fn source_url() -> String {
    if let Ok(s) = std::env::var("CONNREAP_SOURCE") {
        return s;
    }
    Command::new("git")
        .args(["remote", "get-url", "origin"])
        .current_dir(root())
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "unknown".into())
}

fn strip(from: &Path, to: &Path) -> Result<()> {
    let llvm = Path::new("/usr/lib/llvm-22/bin/llvm-strip");
    let tool = if Command::new("strip").arg("--version").output().is_ok() {
        PathBuf::from("strip")
    } else {
        llvm.to_path_buf()
    };
    run(Command::new(tool).arg("-o").arg(to).arg(from))
}

/// Build (unless `no_build`) and strip the binary, make the base, build and tag the image;
/// returns its name.
pub fn build(no_build: bool) -> Result<String> {
    if !no_build {
        crate::build_agent()?;
    }
    let commit = binary_commit(&agent_bin())?;
    ensure_engine()?;
    ensure_debian_image(
        BASE_IMAGE,
        "agent-base.tar",
        &["--variant=essential", &format!("--include={BASE_PACKAGES}")],
    )?;
    let context = cache_dir().join("context");
    if context.exists() {
        fs::remove_dir_all(&context)?;
    }
    fs::create_dir_all(&context)?;
    strip(&agent_bin(), &context.join("connreap"))?;
    let name = image_name();
    let version = env!("CARGO_PKG_VERSION");
    run(podman()
        // No layer cache: buildah 1.28 reuses a cached LABEL layer whose build-arg changed.
        .args([
            "build",
            "--quiet",
            "--pull=never",
            "--no-cache",
            "--target",
            "prebuilt",
        ])
        .arg(format!("--build-arg=BASE={BASE_IMAGE}"))
        .arg(format!("--build-arg=CONNREAP_VERSION={version}"))
        .arg(format!("--build-arg=CONNREAP_COMMIT={commit}"))
        .arg(format!("--build-arg=CONNREAP_SOURCE={}", source_url()))
        .args(["--tag", &name, "--file"])
        .arg(root().join("Containerfile"))
        .arg(&context)
        .stdout(Stdio::null()))?;
    check_labels(&name, version, &commit)?;
    let size = podman()
        .args(["image", "inspect", "--format", "{{.Size}}", &name])
        .output()?;
    eprintln!(
        "xtask: built {name} (commit {commit}, {} MB)",
        String::from_utf8_lossy(&size.stdout)
            .trim()
            .parse::<u64>()
            .map_or(0, |b| b / 1_000_000)
    );
    Ok(name)
}

/// The image carries the OCI labels of this version and commit.
fn check_labels(name: &str, version: &str, commit: &str) -> Result<()> {
    let out = podman()
        .args(["image", "inspect", "--format", "{{json .Labels}}", name])
        .output()?;
    let labels: serde_json::Value =
        serde_json::from_slice(&out.stdout).with_context(|| format!("labels of {name}"))?;
    for (key, want) in [
        ("org.opencontainers.image.version", version),
        ("org.opencontainers.image.revision", commit),
    ] {
        if labels[key] != want {
            bail!("{name}: label {key} is {}, expected {want:?}", labels[key]);
        }
    }
    if labels["org.opencontainers.image.source"].as_str().is_none() {
        bail!("{name}: no org.opencontainers.image.source label: {labels}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The DaemonSet runs the image `cargo xtask image` tags (its init container too).
    #[test]
    fn the_daemonset_runs_the_image_xtask_builds() {
        let ds =
            fs::read_to_string(root().join("deploy/kubernetes/daemonset.yaml")).expect("daemonset");
        let images: Vec<&str> = ds
            .lines()
            .filter_map(|l| l.trim().strip_prefix("image: "))
            .collect();
        assert_eq!(images, [image_name(), image_name()], "{images:?}");
    }

    /// The Containerfile has the target `cargo xtask image` builds and takes its base as BASE.
    #[test]
    fn the_containerfile_has_the_prebuilt_target() {
        let cf = fs::read_to_string(root().join("Containerfile")).expect("Containerfile");
        assert!(cf.contains("\nARG BASE="), "{cf}");
        assert!(cf.contains("\nFROM ${BASE} AS runtime\n"), "{cf}");
        assert!(cf.contains("\nFROM runtime AS prebuilt\nCOPY connreap /usr/bin/connreap\n"));
    }
}
