//! `leasectl prune --older-than DUR`: delete old runs.

use anyhow::Result;

use crate::cli::{DbArgs, PruneArgs};
use crate::exit::Exit;
use crate::fmt;
use crate::store::runs;

pub async fn run(db: &DbArgs, args: PruneArgs) -> Result<Exit> {
    let db = super::connect(db).await?;
    let n = runs::prune(&db.client, &db.schema, args.older_than, args.dry_run).await?;
    let verb = if args.dry_run {
        "would delete"
    } else {
        "deleted"
    };
    crate::say!(
        "{verb} {n} run{} older than {} (each target keeps its newest run)",
        if n == 1 { "" } else { "s" },
        fmt::duration(args.older_than)
    );
    Ok(Exit::Code(0))
}
