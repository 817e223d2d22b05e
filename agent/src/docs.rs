//! What the package ships about the command line: `connreap --version` (with the commit and the
//! embedded BPF object, both from build.rs), and the hidden `connreap generate-docs`, which
//! writes the man pages and shell completions from the clap definitions (`cargo xtask dist`).
use std::{
    fs,
    path::{Path, PathBuf},
};

use anyhow::Context as _;
use clap_complete::Shell;

/// `connreap -V`: the version and the commit it was built from.
pub const VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (commit ",
    env!("CONNREAP_COMMIT"),
    ")"
);

/// `connreap --version`: also what BPF object is embedded (`cargo xtask dist` checks it).
pub const LONG_VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (commit ",
    env!("CONNREAP_COMMIT"),
    ")\nBPF object: ",
    env!("CONNREAP_BPF_OBJECT")
);

/// The shells whose completions the package ships.
const SHELLS: [Shell; 3] = [Shell::Bash, Shell::Zsh, Shell::Fish];

#[derive(clap::Args)]
pub struct Args {
    /// Write connreap.1 and one page per subcommand (connreap-run.1, ...) here.
    #[arg(long)]
    man: Option<PathBuf>,
    /// Write connreap.bash, _connreap (zsh) and connreap.fish here.
    #[arg(long)]
    completions: Option<PathBuf>,
}

/// Generate what `args` asks for from `cmd` (the full `connreap` command).
pub fn generate(cmd: clap::Command, args: &Args) -> anyhow::Result<()> {
    if let Some(dir) = &args.man {
        create(dir)?;
        clap_mangen::generate_to(cmd.clone(), dir)
            .with_context(|| format!("cannot write man pages to {}", dir.display()))?;
        append_common_sections(dir)?;
    }
    if let Some(dir) = &args.completions {
        create(dir)?;
        let mut cmd = cmd;
        for shell in SHELLS {
            clap_complete::generate_to(shell, &mut cmd, "connreap", dir).with_context(|| {
                format!("cannot write {shell} completions to {}", dir.display())
            })?;
        }
    }
    Ok(())
}

/// What every page says besides the command line: exit codes, environment, files (roff).
const COMMON_SECTIONS: &str = r#".SH "EXIT STATUS"
.TP
\fB0\fR
Success.
.TP
\fB1\fR
A runtime failure (the message on stderr says which), e.g. not root, the BPF object cannot be loaded.
.TP
\fB2\fR
Bad command-line input: an unknown option, a filter that does not parse (\fB\-\-sport 0\fR, \fB\-\-state bogus\fR), \fBconnreap reclaim \-\-policy\fR naming no configured policy.
.TP
\fB3\fR
\fBconnreap reclaim\fR: an enforce policy ran as a dry run (no way to destroy sockets, or the audit log not writable): nothing was closed.
.TP
\fB75\fR
\fBconnreap reclaim\fR: another connreap holds the host's reclaim lock; \fBconnreap unpin\fR: another process uses the pinned state tracker.
.TP
\fB78\fR
The configuration is invalid (file, line and key on stderr), or the systemd watchdog interval is shorter than twice agent.scan_interval. systemd does not restart the unit on 78.
.SH ENVIRONMENT
.TP
\fBCONNREAP_PIN_ROOT\fR
Where the state tracker is pinned on the BPF filesystem, instead of /sys/fs/bpf/connreap.
.TP
\fBCONNREAP_LOCK_DIR\fR
Where connreap.load.lock and connreap.reclaim.lock live, instead of /run/lock.
.TP
\fBRUST_LOG\fR
Log filter (tracing's EnvFilter syntax, e.g. \fBconnreap=debug\fR); overrides the level \fB\-\-verbose\fR sets.
.SH FILES
.TP
\fI/etc/connreap/connreap.toml\fR
The configuration (see \fBconnreap.toml\fR(5)); built-in defaults when it is absent.
.TP
\fI/var/lib/connreap/audit.jsonl\fR
The audit log: one JSON line per reclaim decision (reclaim.audit_log).
.TP
\fI/sys/fs/bpf/connreap/\fR
The pinned state tracker: socket ages survive a restart of the agent.
.TP
\fI/run/lock/connreap.load.lock\fR, \fI/run/lock/connreap.reclaim.lock\fR
One load at a time, one reclaimer per host.
.TP
\fI/usr/share/doc/connreap/examples/connreap.example.toml\fR
Every setting with its default and meaning.
.SH "SEE ALSO"
\fBconnreap.toml\fR(5), \fBconnreap\-run\fR(1), \fBss\fR(8)
"#;

/// Append [`COMMON_SECTIONS`] to every page clap_mangen wrote in `dir`.
fn append_common_sections(dir: &Path) -> anyhow::Result<()> {
    for entry in fs::read_dir(dir)? {
        let path = entry?.path();
        if path.extension().is_some_and(|e| e == "1") {
            let mut page = fs::read_to_string(&path)
                .with_context(|| format!("cannot read {}", path.display()))?;
            page.push_str(COMMON_SECTIONS);
            fs::write(&path, page).with_context(|| format!("cannot write {}", path.display()))?;
        }
    }
    Ok(())
}

fn create(dir: &Path) -> anyhow::Result<()> {
    fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn version_names_the_commit_and_the_object() {
        assert!(VERSION.starts_with(env!("CARGO_PKG_VERSION")));
        assert!(VERSION.contains("(commit "));
        assert!(LONG_VERSION.contains("\nBPF object: "));
    }

    #[test]
    fn generates_man_pages_and_completions() {
        let dir = std::env::temp_dir().join(format!("connreap-docs-{}", std::process::id()));
        let cmd = clap::Command::new("connreap")
            .version(VERSION)
            .about("test")
            .subcommand(clap::Command::new("run").about("Run the agent"))
            .subcommand(clap::Command::new("generate-docs").hide(true));
        let args = Args {
            man: Some(dir.join("man")),
            completions: Some(dir.join("completions")),
        };
        generate(cmd, &args).expect("generate");
        let man = fs::read_to_string(dir.join("man/connreap.1")).expect("connreap.1");
        assert!(man.contains(".TH connreap 1"), "{man}");
        for section in [".SH \"EXIT STATUS\"", ".SH ENVIRONMENT", ".SH FILES"] {
            assert!(man.contains(section), "{section}: {man}");
        }
        for var in ["CONNREAP_PIN_ROOT", "CONNREAP_LOCK_DIR", "RUST_LOG"] {
            assert!(man.contains(var), "{var}");
        }
        assert!(dir.join("man/connreap-run.1").exists());
        assert!(!dir.join("man/connreap-generate-docs.1").exists());
        for f in ["connreap.bash", "_connreap", "connreap.fish"] {
            assert!(dir.join("completions").join(f).exists(), "{f}");
        }
        let _ = fs::remove_dir_all(&dir);
    }
}
