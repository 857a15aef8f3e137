//! `leasectl run`: the run path lives in [`crate::run`].

use anyhow::Result;

use crate::cli::{DbArgs, RunArgs};
use crate::exit::Exit;

pub async fn run(db: &DbArgs, args: RunArgs) -> Result<Exit> {
    crate::run::run(db, args).await
}
