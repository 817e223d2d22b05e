//! `cargo xtask bench`: placeholder until the benchmark issue lands.
use anyhow::{bail, Result};

#[derive(clap::Args)]
pub struct BenchArgs {}

pub fn run(_args: BenchArgs) -> Result<()> {
    bail!("benchmarks are not implemented yet")
}
