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
        assert!(dir.join("man/connreap-run.1").exists());
        assert!(!dir.join("man/connreap-generate-docs.1").exists());
        for f in ["connreap.bash", "_connreap", "connreap.fish"] {
            assert!(dir.join("completions").join(f).exists(), "{f}");
        }
        let _ = fs::remove_dir_all(&dir);
    }
}
