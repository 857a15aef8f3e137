//! `leasectl release --target T --force`: break a lease (operator use).
//!
//! The holder's next heartbeat matches 0 rows, so it stops its command and exits 76; the fence
//! stays in the row, so the next acquisition is still numbered higher.

use anyhow::Result;

use crate::cli::{DbArgs, ReleaseArgs};
use crate::exit::Exit;
use crate::store::leases;

pub async fn run(db: &DbArgs, args: ReleaseArgs) -> Result<Exit> {
    let db = super::connect(db).await?;
    match leases::force_release(&db.client, &db.schema, &args.target).await? {
        Some(h) => {
            super::print(format!("released '{}' ({})\n", args.target, h.describe()).as_bytes())?
        }
        None => super::print(format!("'{}' was not held\n", args.target).as_bytes())?,
    }
    Ok(Exit::Code(0))
}
