//! `leasectl migrate`: apply pending migrations explicitly (every command does it implicitly),
//! or print the grants that let another role use the schema (`--print-grants`, no connection).

use anyhow::Result;

use crate::cli::{DbArgs, MigrateArgs};
use crate::db::migrate::grants;
use crate::db::{Schema, SCHEMA_VERSION};
use crate::exit::Exit;

pub async fn run(db: &DbArgs, args: MigrateArgs) -> Result<Exit> {
    if let Some(role) = args.print_grants {
        super::print(grants::script(&Schema::new(&db.schema), &role).as_bytes())?;
        return Ok(Exit::Code(0));
    }
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
