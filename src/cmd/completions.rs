//! `leasectl completions SHELL`: shell completions generated from the clap definition.

use anyhow::Result;
use clap::CommandFactory;

use crate::cli::{Cli, CompletionsArgs};
use crate::exit::Exit;

pub fn run(args: CompletionsArgs) -> Result<Exit> {
    let mut buf = Vec::new();
    clap_complete::generate(args.shell, &mut Cli::command(), "leasectl", &mut buf);
    super::print(&buf)?;
    Ok(Exit::Code(0))
}
