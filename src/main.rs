//! The talos-upgrade-controller binary. Subcommands are added as the controller grows: `run` (the
//! controller), `crd` (print the CustomResourceDefinition) and `talos-sim` (the Talos node simulator).

use clap::Parser;

#[derive(Debug, Parser)]
#[command(version, about)]
struct Cli {}

fn main() -> anyhow::Result<()> {
    let _cli = Cli::parse();
    Ok(())
}
