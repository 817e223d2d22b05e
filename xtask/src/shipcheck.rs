//! Checks of what ships, run by `cargo xtask test` and `cargo xtask ship-check`:
//! - `security`: `systemd-analyze security --offline=true` exposure of systemd/connreap.service
//!   at most [`MAX_EXPOSURE`];
//! - `manifests`: deploy/kubernetes validated against the Kubernetes schemas (kubernetes-validate
//!   from PyPI, strict) and the PodMonitor and PrometheusRule against prometheus-operator's
//!   (npm), tools installed under target/xtask-tools; both agree with the shipped rules
//!   (module `monitoring`);
//! - `deb`: the .deb installed with dpkg, used, reinstalled, removed and purged (module `debtest`);
//! - [`embedded_object`] (with every `cargo xtask test` and `dist`): the release binary embeds,
//!   byte for byte, the BPF object of a fresh plain build, and no bench-only tracker.
use std::{
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{bail, Context, Result};

use crate::{root, run};

/// The unit's exposure score must stay at or below this (systemd's scale: 0 safe, 10 unsafe).
pub const MAX_EXPOSURE: f64 = 3.0;

/// The validators, pinned: their schemas ship inside the packages (no schema download).
const KUBERNETES_VALIDATE: &str = "kubernetes-validate==1.37.0";
const NPM_PACKAGES: &[&str] = &["@kubernetes-models/prometheus-operator@6.0.0", "yaml@2.9.1"];
/// The oldest and newest Kubernetes the manifests are validated for (`appArmorProfile` in the
/// securityContext needs 1.30).
const KUBERNETES_VERSIONS: &[&str] = &["1.30.0", "1.37.0"];

/// The script that validates the PodMonitor and the PrometheusRule (run with node from the npm
/// tools directory).
const MONITORING_CHECK: &str = include_str!("monitoring_check.mjs");

#[derive(clap::Args)]
pub struct Args {
    /// The unit's `systemd-analyze security` exposure.
    #[arg(long)]
    security: bool,
    /// deploy/kubernetes against the schemas.
    #[arg(long)]
    manifests: bool,
    /// Build the .deb, then install, use, reinstall, remove and purge it (root, Debian).
    #[arg(long)]
    deb: bool,
}

pub fn check(args: Args) -> Result<()> {
    let all = !(args.security || args.manifests || args.deb);
    if all || args.security {
        security()?;
    }
    if all || args.manifests {
        manifests()?;
    }
    if all || args.deb {
        crate::debtest::run(&crate::dist::build()?)?;
    }
    Ok(())
}

/// The plain build of agent-ebpf that agent/build.rs embeds.
pub fn bpf_object() -> PathBuf {
    root().join(format!(
        "target/{}/release/connreap-ebpf",
        crate::BPF_TARGET
    ))
}

/// The release binary (target/release/connreap) must carry the BPF object just built by
/// `build_ebpf` (a plain build: no tracker variant, see agent-ebpf's build.rs) byte for byte,
/// and that object must differ from the bench-only tracker last built under
/// target/bench-variants. Run after `build_ebpf` and the release build.
pub fn embedded_object() -> Result<()> {
    let object =
        fs::read(bpf_object()).with_context(|| format!("read {}", bpf_object().display()))?;
    let bin = fs::read(crate::agent_bin())
        .with_context(|| format!("read {}", crate::agent_bin().display()))?;
    let variant = root().join(format!(
        "target/bench-variants/{}/release/connreap-ebpf",
        crate::BPF_TARGET
    ));
    let variant = fs::read(variant).ok();
    check_embedded(&bin, &object, variant.as_deref()).with_context(|| {
        format!(
            "{} and {}",
            crate::agent_bin().display(),
            bpf_object().display()
        )
    })?;
    eprintln!(
        "xtask: the release binary embeds the plain BPF object ({} bytes)",
        object.len()
    );
    Ok(())
}

fn check_embedded(bin: &[u8], object: &[u8], variant: Option<&[u8]>) -> Result<()> {
    if object.is_empty() {
        bail!("the BPF object is empty");
    }
    if variant == Some(object) {
        bail!("the BPF object is a bench-only tracker variant");
    }
    if !bin.windows(object.len()).any(|w| w == object) {
        bail!("the binary does not embed the BPF object just built, byte for byte");
    }
    Ok(())
}

fn tools_dir() -> PathBuf {
    root().join("target/xtask-tools")
}

pub fn kubernetes_dir() -> PathBuf {
    root().join("deploy/kubernetes")
}

/// The "Overall exposure level" of `unit`, as systemd-analyze prints it.
pub fn exposure(unit: &Path) -> Result<f64> {
    let out = Command::new("systemd-analyze")
        .args(["security", "--offline=true", "--no-pager"])
        .arg(unit)
        .output()
        .context("cannot run systemd-analyze")?;
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    parse_exposure(&text).with_context(|| {
        format!("no \"Overall exposure level\" line from systemd-analyze security:\n{text}")
    })
}

fn parse_exposure(text: &str) -> Option<f64> {
    let line = text
        .lines()
        .find(|l| l.contains("Overall exposure level for"))?;
    line.rsplit_once(": ")?
        .1
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// systemd/connreap.service scores at most [`MAX_EXPOSURE`].
pub fn security() -> Result<()> {
    if Command::new("systemd-analyze")
        .arg("--version")
        .output()
        .is_err()
    {
        eprintln!("xtask: systemd-analyze not found; skipping the unit's security score");
        return Ok(());
    }
    let unit = root().join("systemd/connreap.service");
    let score = exposure(&unit)?;
    if score > MAX_EXPOSURE {
        bail!(
            "systemd-analyze security --offline=true {}: exposure {score} > {MAX_EXPOSURE}",
            unit.display()
        );
    }
    eprintln!("xtask: systemd/connreap.service exposure {score} (at most {MAX_EXPOSURE})");
    Ok(())
}

/// Install (once) kubernetes-validate in a venv and the npm validator; return the venv.
fn ensure_validators() -> Result<(PathBuf, PathBuf)> {
    let venv = tools_dir().join("venv");
    let validate = venv.join("bin/kubernetes-validate");
    if !validate.exists() {
        eprintln!(
            "xtask: installing {KUBERNETES_VALIDATE} into {}",
            venv.display()
        );
        run(Command::new("python3").args(["-m", "venv"]).arg(&venv))?;
        run(Command::new(venv.join("bin/pip"))
            .args(["install", "--quiet", "--disable-pip-version-check"])
            .arg(KUBERNETES_VALIDATE))?;
    }
    let npm = tools_dir().join("npm");
    let marker = npm.join("node_modules/@kubernetes-models/prometheus-operator/package.json");
    if !marker.exists() || !npm.join("node_modules/yaml/package.json").exists() {
        eprintln!(
            "xtask: installing {} into {}",
            NPM_PACKAGES.join(" "),
            npm.display()
        );
        fs::create_dir_all(&npm)?;
        fs::write(
            npm.join("package.json"),
            "{\"private\": true, \"type\": \"module\"}\n",
        )?;
        run(Command::new("npm")
            .current_dir(&npm)
            .args([
                "install",
                "--no-audit",
                "--no-fund",
                "--silent",
                "--save-exact",
            ])
            .args(NPM_PACKAGES))?;
    }
    fs::write(npm.join("monitoring_check.mjs"), MONITORING_CHECK)?;
    Ok((validate, npm))
}

/// Every manifest under deploy/kubernetes is valid for each of [`KUBERNETES_VERSIONS`]
/// (strict: unknown fields are errors), the PodMonitor and PrometheusRule for
/// prometheus-operator and in step with the shipped rules, and the ConfigMap's config is the
/// default one.
pub fn manifests() -> Result<()> {
    let dir = kubernetes_dir();
    let mut core = Vec::new();
    let mut operator = Vec::new();
    for e in fs::read_dir(&dir).with_context(|| format!("cannot list {}", dir.display()))? {
        let p = e?.path();
        if p.extension().is_some_and(|x| x == "yaml") {
            let text = fs::read_to_string(&p)?;
            if text.contains("kind: PodMonitor") || text.contains("kind: PrometheusRule") {
                operator.push(p);
            } else {
                core.push(p);
            }
        }
    }
    core.sort();
    operator.sort();
    if core.is_empty() || operator.len() != 2 {
        bail!(
            "{}: expected manifests, a PodMonitor and a PrometheusRule",
            dir.display()
        );
    }
    check_configmap(&fs::read_to_string(dir.join("configmap.yaml"))?)?;
    check_mount_propagation(&fs::read_to_string(dir.join("daemonset.yaml"))?)?;
    crate::monitoring::check_prometheus_rule()?;
    crate::monitoring::check_job()?;
    let (validate, npm) = ensure_validators()?;
    for v in KUBERNETES_VERSIONS {
        run(Command::new(&validate)
            .args(["--strict", "--quiet", "--kubernetes-version", v])
            .args(&core))?;
    }
    run(Command::new("node")
        .current_dir(&npm)
        .arg("monitoring_check.mjs")
        .args(&operator))?;
    eprintln!(
        "xtask: {} manifests valid for Kubernetes {} (strict), PodMonitor and PrometheusRule valid",
        core.len(),
        KUBERNETES_VERSIONS.join(" and "),
    );
    Ok(())
}

/// The API server refuses `mountPropagation: Bidirectional` in a container that is not
/// privileged (the schemas do not say so): every container of the pod template that asks for
/// it must be privileged.
fn check_mount_propagation(daemonset: &str) -> Result<()> {
    let mut blocks: Vec<String> = Vec::new();
    let mut section = "";
    for line in daemonset.lines() {
        if let Some(key) = line.strip_prefix("      ").filter(|l| !l.starts_with(' ')) {
            section = key.trim_end_matches(':');
            continue;
        }
        if !matches!(section, "containers" | "initContainers") {
            continue;
        }
        if line.starts_with("        - ") {
            blocks.push(String::new());
        }
        if let Some(b) = blocks.last_mut() {
            b.push_str(line);
            b.push('\n');
        }
    }
    for b in &blocks {
        if b.contains("mountPropagation: Bidirectional") && !b.contains("privileged: true") {
            bail!(
                "daemonset.yaml: a container that is not privileged asks for Bidirectional mount propagation (the API server refuses it):\n{b}"
            );
        }
    }
    if blocks.len() < 2 {
        bail!("daemonset.yaml: expected an init container and a container");
    }
    Ok(())
}

/// The config the DaemonSet runs: the packaged defaults (every key commented) with the API
/// token file from the Secret.
pub fn kubernetes_config(example: &str) -> String {
    let keys = crate::dist::commented_keys(example).replacen(
        "# token_file = \"\"",
        "token_file = \"/etc/connreap-token/token\"",
        1,
    );
    String::from(
        "# connreap configuration (/etc/connreap/connreap.toml in the pod). Every key but\n\
         # api.token_file is commented out and shown with its built-in default: uncomment and\n\
         # change what you need, then `kubectl -n connreap rollout restart daemonset/connreap`.\n\n",
    ) + &keys
}

/// configmap.yaml's `connreap.toml: |` block equals [`kubernetes_config`].
fn check_configmap(yaml: &str) -> Result<()> {
    let example = fs::read_to_string(root().join("connreap.example.toml"))?;
    let want = kubernetes_config(&example);
    let got = configmap_block(yaml).context("configmap.yaml has no `connreap.toml: |` block")?;
    if got != want {
        bail!(
            "deploy/kubernetes/configmap.yaml is not the default config; its connreap.toml must be:\n{}",
            want.lines()
                .map(|l| if l.is_empty() { String::new() } else { format!("    {l}") })
                .collect::<Vec<_>>()
                .join("\n")
        );
    }
    Ok(())
}

/// `yaml` with the literal block under `  connreap.toml: |` replaced by `config`.
#[cfg(test)]
fn with_config_block(yaml: &str, config: &str) -> Option<String> {
    const KEY: &str = "  connreap.toml: |\n";
    let start = yaml.find(KEY)? + KEY.len();
    let mut end = start;
    for line in yaml[start..].split_inclusive('\n') {
        if !(line.starts_with("    ") || line.trim().is_empty()) {
            break;
        }
        end += line.len();
    }
    let block: String = config
        .lines()
        .map(|l| {
            if l.is_empty() {
                "\n".to_string()
            } else {
                format!("    {l}\n")
            }
        })
        .collect();
    Some(format!("{}{block}{}", &yaml[..start], &yaml[end..]))
}

/// The literal block under `  connreap.toml: |`, de-indented by 4.
fn configmap_block(yaml: &str) -> Option<String> {
    let start = yaml.find("  connreap.toml: |\n")? + "  connreap.toml: |\n".len();
    let mut out = String::new();
    for line in yaml[start..].lines() {
        if let Some(l) = line.strip_prefix("    ") {
            out.push_str(l);
        } else if line.trim().is_empty() {
            // blank lines inside the block
        } else {
            break;
        }
        out.push('\n');
    }
    // A literal block keeps one final newline ("clip").
    Some(out.trim_end_matches('\n').to_string() + "\n")
}

#[cfg(test)]
mod tests {
    #[test]
    fn embedded_object_checked_byte_for_byte() {
        let object = b"\x7fELF plain tracker";
        let mut bin = b"header ".to_vec();
        bin.extend_from_slice(object);
        bin.extend_from_slice(b" trailer");
        assert!(super::check_embedded(&bin, object, None).is_ok());
        assert!(super::check_embedded(&bin, object, Some(b"other")).is_ok());
        // One byte off, a variant, nothing built: each fails.
        assert!(super::check_embedded(&bin, b"\x7fELF plain trackeR", None).is_err());
        assert!(super::check_embedded(&bin, object, Some(object)).is_err());
        assert!(super::check_embedded(&bin, b"", None).is_err());
    }

    use super::*;

    #[test]
    fn parses_the_overall_exposure_line() {
        let text = "  NAME  DESCRIPTION  EXPOSURE\n✗ PrivateNetwork=  ...  0.5\n\n\
                    → Overall exposure level for connreap.service: 2.7 OK 🙂\n";
        assert_eq!(parse_exposure(text), Some(2.7));
        assert_eq!(parse_exposure("nothing"), None);
    }

    #[test]
    fn the_unit_scores_at_most_the_target() {
        if Command::new("systemd-analyze")
            .arg("--version")
            .output()
            .is_err()
        {
            return;
        }
        let score = exposure(&root().join("systemd/connreap.service")).expect("score");
        assert!(score <= MAX_EXPOSURE, "{score}");
    }

    /// With UPDATE_EXPECT set, rewrites the ConfigMap's config from connreap.example.toml
    /// (itself generated by `UPDATE_EXPECT=1 cargo test -p connreap config`).
    #[test]
    fn the_configmap_holds_the_default_config() {
        let path = kubernetes_dir().join("configmap.yaml");
        let mut yaml = fs::read_to_string(&path).expect("configmap");
        if std::env::var_os("UPDATE_EXPECT").is_some() {
            let example =
                fs::read_to_string(root().join("connreap.example.toml")).expect("example");
            yaml = with_config_block(&yaml, &kubernetes_config(&example)).expect("a block");
            fs::write(&path, &yaml).expect("write configmap.yaml");
        }
        check_configmap(&yaml)
            .expect("in sync (regenerate: UPDATE_EXPECT=1 cargo test -p xtask configmap)");
    }

    #[test]
    fn bidirectional_propagation_only_in_privileged_containers() {
        let ds = fs::read_to_string(kubernetes_dir().join("daemonset.yaml")).expect("daemonset");
        check_mount_propagation(&ds).expect("the shipped DaemonSet");
        let agent_bidirectional = ds.replacen(
            "              mountPropagation: HostToContainer",
            "              mountPropagation: Bidirectional",
            1,
        );
        assert_ne!(agent_bidirectional, ds);
        assert!(check_mount_propagation(&agent_bidirectional).is_err());
    }

    #[test]
    fn reads_a_literal_block() {
        let yaml = "data:\n  connreap.toml: |\n    [agent]\n\n    # x = 1\nkind: X\n";
        assert_eq!(
            configmap_block(yaml).as_deref(),
            Some("[agent]\n\n# x = 1\n")
        );
    }
}
