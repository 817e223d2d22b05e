//! `cargo xtask dist`: the .deb. Builds the BPF object and the release agent, refuses a binary
//! without the object (plain `cargo build` embeds an empty placeholder), generates the man pages,
//! completions and the commented conffile under target/dist/, then packages with cargo-deb (the
//! `[package.metadata.deb]` of agent/Cargo.toml), installing cargo-deb first when it is missing.
use std::{
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{bail, Context, Result};

use crate::{agent_bin, root, run, setup};

/// The cargo-deb release the packaging metadata is written for.
const CARGO_DEB_VERSION: &str = "3.8.0";

/// Files the package must hold (checked on the built .deb).
pub const PACKAGED: &[&str] = &[
    "./usr/bin/connreap",
    "./usr/lib/systemd/system/connreap.service",
    "./etc/connreap/connreap.toml",
    "./usr/share/doc/connreap/README.md",
    "./usr/share/doc/connreap/BENCHMARKS.md",
    "./usr/share/doc/connreap/docs/install.md",
    "./usr/share/doc/connreap/docs/reclaim.md",
    "./usr/share/doc/connreap/copyright",
    "./usr/share/doc/connreap/examples/connreap.example.toml",
    "./usr/share/man/man1/connreap.1.gz",
    "./usr/share/man/man1/connreap-run.1.gz",
    "./usr/share/man/man5/connreap.toml.5.gz",
    "./usr/share/doc/connreap/changelog.Debian.gz",
    "./usr/share/lintian/overrides/connreap",
    "./usr/share/bash-completion/completions/connreap",
    "./usr/share/zsh/vendor-completions/_connreap",
    "./usr/share/fish/vendor_completions.d/connreap.fish",
];

pub const CONFFILE: &str = "/etc/connreap/connreap.toml";

fn dist_dir() -> PathBuf {
    root().join("target/dist")
}

/// Build everything and the .deb; returns its path.
pub fn build() -> Result<PathBuf> {
    crate::build_ebpf()?;
    let object_len = check_object(&crate::shipcheck::bpf_object())?;
    crate::build_agent_only()?;
    check_embedded(&agent_bin(), object_len)?;
    crate::shipcheck::embedded_object()?;

    let dist = dist_dir();
    if dist.exists() {
        fs::remove_dir_all(&dist).with_context(|| format!("cannot clear {}", dist.display()))?;
    }
    fs::create_dir_all(&dist)?;
    run(Command::new(agent_bin())
        .arg("generate-docs")
        .arg("--man")
        .arg(dist.join("man"))
        .arg("--completions")
        .arg(dist.join("completions")))?;
    let example = fs::read_to_string(root().join("connreap.example.toml"))?;
    fs::create_dir_all(dist.join("man5"))?;
    fs::write(
        dist.join("man5/connreap.toml.5"),
        config_man_page(&example, env!("CARGO_PKG_VERSION")),
    )?;
    let conffile = dist.join("connreap.toml");
    fs::write(&conffile, commented_conffile(&example))?;
    // The commented file must still be a valid config (the built-in defaults).
    run(Command::new(agent_bin()).arg("check-config").arg(&conffile))?;

    ensure_cargo_deb()?;
    let out = dist.join("deb");
    fs::create_dir_all(&out)?;
    run(crate::cargo()
        .args(["deb", "--package", "connreap", "--no-build", "--output"])
        .arg(&out)
        .env("PATH", setup::path_with_cargo_bin()))?;
    let deb = only_deb(&out)?;
    check_contents(&deb)?;
    eprintln!("xtask: built {}", deb.display());
    Ok(deb)
}

/// The BPF object's size; an error when it is missing, empty or not an ELF file.
fn check_object(path: &Path) -> Result<u64> {
    let bytes = fs::read(path)
        .with_context(|| format!("BPF object {} missing: refusing to package", path.display()))?;
    if bytes.is_empty() || !bytes.starts_with(b"\x7fELF") {
        bail!(
            "BPF object {} is empty or not ELF ({} bytes): refusing to package",
            path.display(),
            bytes.len()
        );
    }
    Ok(bytes.len() as u64)
}

/// The binary's `--version` must say it embeds exactly the object just built (not the empty
/// placeholder a plain `cargo build` embeds, nor an older object).
fn check_embedded(bin: &Path, object_len: u64) -> Result<()> {
    let out = Command::new(bin)
        .arg("--version")
        .output()
        .with_context(|| format!("cannot run {} --version", bin.display()))?;
    if !out.status.success() {
        bail!("{} --version failed: {}", bin.display(), out.status);
    }
    let text = String::from_utf8_lossy(&out.stdout);
    check_version_text(&text, object_len)
        .with_context(|| format!("{}: refusing to package", bin.display()))?;
    eprintln!("xtask: {}", text.lines().next().unwrap_or_default());
    Ok(())
}

fn check_version_text(text: &str, object_len: u64) -> Result<()> {
    let want = format!("BPF object: {object_len} bytes embedded");
    if !text.lines().any(|l| l.trim() == want) {
        bail!("the binary does not embed the BPF object just built ({want:?} expected; --version said {text:?})");
    }
    Ok(())
}

/// /etc/connreap/connreap.toml: connreap.example.toml with its header replaced and every key
/// commented out (see [`commented_keys`]).
pub fn commented_conffile(example: &str) -> String {
    String::from(
        "# connreap configuration (/etc/connreap/connreap.toml). Every key is commented out and\n\
         # shown with its built-in default: uncomment and change what you need, check with\n\
         #   connreap check-config /etc/connreap/connreap.toml\n\
         # then `systemctl restart connreap` (raise the unit's WatchdogSec with scan_interval:\n\
         # it must stay at least twice as long). The same settings, not commented out:\n\
         # /usr/share/doc/connreap/examples/connreap.example.toml.\n\n",
    ) + &commented_keys(example)
}

/// connreap.example.toml without its header (up to the first blank line, which talks about
/// copying the file) and with every key commented out. Table headers stay, so uncommenting a
/// key puts it in the right table.
pub fn commented_keys(example: &str) -> String {
    let body = example.split_once("\n\n").map_or(example, |(_, rest)| rest);
    let mut out = String::new();
    for line in body.lines() {
        let t = line.trim_start();
        if t.is_empty() || t.starts_with('#') || is_table_header(t) {
            out.push_str(line);
        } else {
            out.push_str("# ");
            out.push_str(line);
        }
        out.push('\n');
    }
    out
}

/// connreap.toml(5): what the file is, then every setting with its default and meaning, as
/// connreap.example.toml documents them (shown verbatim).
pub fn config_man_page(example: &str, version: &str) -> String {
    let body = example.split_once("\n\n").map_or(example, |(_, rest)| rest);
    let mut settings = String::new();
    for line in body.lines() {
        let line = line.replace('\\', "\\e").replace('-', "\\-");
        if line.starts_with('.') || line.starts_with('\'') {
            settings.push_str("\\&");
        }
        settings.push_str(&line);
        settings.push('\n');
    }
    format!(
        ".TH CONNREAP.TOML 5 \"\" \"connreap {version}\" \"File Formats\"\n\
         .SH NAME\n\
         connreap.toml \\- configuration of the connreap agent\n\
         .SH SYNOPSIS\n\
         \\fI/etc/connreap/connreap.toml\\fR\n\
         .SH DESCRIPTION\n\
         The configuration of \\fBconnreap\\fR(1), in TOML. Every key is optional and has a \
         built\\-in default; the packaged file has every key commented out. \
         \\fBconnreap check\\-config\\fR \\fIFILE\\fR validates a file and exits 78 naming \
         the file, line and key of an error; \\fBconnreap run\\fR refuses an invalid file \
         the same way. Durations are strings such as \"30s\", \"5m\", \"1h\".\n\
         .SH SETTINGS\n\
         Each table with its keys, their defaults (as values) and meaning (as comments):\n\
         .PP\n.nf\n{settings}.fi\n\
         .SH FILES\n\
         .TP\n\\fI/etc/connreap/connreap.toml\\fR\nThe configuration connreap reads by default.\n\
         .TP\n\\fI/usr/share/doc/connreap/examples/connreap.example.toml\\fR\n\
         The same settings, not commented out.\n\
         .SH \"SEE ALSO\"\n\\fBconnreap\\fR(1), \\fBconnreap\\-run\\fR(1), \
         \\fBconnreap\\-check\\-config\\fR(1)\n"
    )
}

fn is_table_header(line: &str) -> bool {
    line.starts_with('[') && !line.starts_with("[[") && line.trim_end().ends_with(']')
}

fn ensure_cargo_deb() -> Result<()> {
    let installed = crate::cargo()
        .args(["deb", "--version"])
        .env("PATH", setup::path_with_cargo_bin())
        .output()
        .is_ok_and(|o| o.status.success());
    if !installed {
        eprintln!("xtask: installing cargo-deb {CARGO_DEB_VERSION} (a minute or two)");
        run(crate::cargo().args([
            "install",
            "cargo-deb",
            "--locked",
            "--version",
            CARGO_DEB_VERSION,
        ]))?;
    }
    Ok(())
}

fn only_deb(dir: &Path) -> Result<PathBuf> {
    let debs: Vec<PathBuf> = fs::read_dir(dir)?
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "deb"))
        .collect();
    match debs.as_slice() {
        [one] => Ok(one.clone()),
        _ => bail!("expected one .deb in {}, found {debs:?}", dir.display()),
    }
}

/// Every file of [`PACKAGED`] is in the .deb and the conffile is marked as one.
fn check_contents(deb: &Path) -> Result<()> {
    let out = Command::new("dpkg-deb")
        .arg("--contents")
        .arg(deb)
        .output()?;
    let listing = String::from_utf8_lossy(&out.stdout);
    let paths: Vec<&str> = listing
        .lines()
        .filter_map(|l| l.split_whitespace().nth(5))
        .collect();
    let missing: Vec<&&str> = PACKAGED.iter().filter(|p| !paths.contains(p)).collect();
    if !out.status.success() || !missing.is_empty() {
        bail!("{} lacks {missing:?}:\n{listing}", deb.display());
    }
    let conffiles = Command::new("dpkg-deb")
        .arg("--info")
        .arg(deb)
        .arg("conffiles")
        .output()?;
    if !String::from_utf8_lossy(&conffiles.stdout)
        .lines()
        .any(|l| l.trim() == CONFFILE)
    {
        bail!("{} does not mark {CONFFILE} as a conffile", deb.display());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conffile_comments_every_key_of_the_example() {
        let example = fs::read_to_string(root().join("connreap.example.toml")).expect("example");
        let conf = commented_conffile(&example);
        for line in conf.lines() {
            let t = line.trim();
            assert!(
                t.is_empty() || t.starts_with('#') || is_table_header(t),
                "uncommented line: {line}"
            );
        }
        // Every key line of the example is there, commented.
        for line in example
            .lines()
            .filter(|l| l.contains(" = ") && !l.starts_with('#'))
        {
            assert!(conf.contains(&format!("# {line}")), "{line}");
        }
        assert!(conf.contains("\n[agent]\n"));
        assert!(conf.contains("\n# listen = \"127.0.0.1:9477\"\n"));
        assert!(!conf.contains("Copy to /etc/connreap"));
    }

    #[test]
    fn the_config_man_page_holds_every_key() {
        let example = fs::read_to_string(root().join("connreap.example.toml")).expect("example");
        let page = config_man_page(&example, "0.1.0");
        assert!(page.starts_with(".TH CONNREAP.TOML 5 "), "{page}");
        assert!(page.contains("\n.SH SETTINGS\n"));
        assert!(page.contains("\n.SH FILES\n"));
        assert!(page.contains("\nlisten = \"127.0.0.1:9477\"\n"), "{page}");
        // Inside .nf no line may start a roff request.
        let settings = page.split(".nf\n").nth(1).expect("nf");
        let settings = settings.split("\n.fi\n").next().expect("fi");
        assert!(settings
            .lines()
            .all(|l| !l.starts_with('.') && !l.starts_with('\'')));
        // Every hyphen is escaped (a minus sign, as in the keys' values).
        assert!(!settings.replace("\\-", "").contains('-'));
    }

    #[test]
    fn refuses_an_empty_or_foreign_object() {
        let dir = std::env::temp_dir().join(format!("xtask-dist-{}", std::process::id()));
        fs::create_dir_all(&dir).expect("dir");
        let p = dir.join("obj");
        fs::write(&p, b"").expect("write");
        assert!(check_object(&p).is_err());
        fs::write(&p, b"not elf").expect("write");
        assert!(check_object(&p).is_err());
        fs::write(&p, b"\x7fELF\x02\x01").expect("write");
        assert_eq!(check_object(&p).expect("elf"), 6);
        assert!(check_object(&dir.join("none")).is_err());
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn refuses_a_binary_without_the_object() {
        let version = |object: &str| format!("connreap 0.1.0 (commit abc)\nBPF object: {object}\n");
        let placeholder = version("missing (an empty placeholder: build with `cargo xtask build`)");
        assert!(check_version_text(&placeholder, 6).is_err());
        assert!(check_version_text(&version("5 bytes embedded"), 6).is_err());
        assert!(check_version_text(&version("16 bytes embedded"), 6).is_err());
        check_version_text(&version("6 bytes embedded"), 6).expect("embeds the object");
    }
}
