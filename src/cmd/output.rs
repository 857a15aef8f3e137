//! `leasectl output --target T [--run ID] [--stderr]`: a stored run's captured bytes, raw.

use anyhow::Result;

use crate::cli::{DbArgs, OutputArgs};
use crate::exit::Exit;
use crate::store::runs::{self, Stream};

pub async fn run(db: &DbArgs, args: OutputArgs) -> Result<Exit> {
    let db = super::connect(db).await?;
    let stream = if args.stderr {
        Stream::Stderr
    } else {
        Stream::Stdout
    };
    let bytes = runs::output(&db.client, &db.schema, &args.target, args.run, stream).await?;
    let Some(bytes) = bytes else {
        match args.run {
            Some(id) => crate::say!("no run {id} of '{}'", args.target),
            None => crate::say!("no stored run of '{}'", args.target),
        }
        return Ok(Exit::Code(1));
    };
    super::print(&bytes)?;
    Ok(Exit::Code(0))
}
