//! `leasectl migrate`: apply pending migrations explicitly (every command does it implicitly).

use anyhow::Result;

use crate::cli::DbArgs;
use crate::db::SCHEMA_VERSION;
use crate::exit::Exit;

pub async fn run(db: &DbArgs) -> Result<Exit> {
    let db = super::connect(db).await?;
    super::print(
        format!(
            "schema \"{}\" is at version {SCHEMA_VERSION}\n",
            db.schema.name()
        )
        .as_bytes(),
    )?;
    Ok(Exit::Code(0))
}
