//! `leasectl output --target T [--run ID] [--stderr]`: a stored run's captured bytes, raw.

use anyhow::{Context, Result};
use tokio_postgres::types::Type;

use crate::cli::{DbArgs, OutputArgs};
use crate::exit::Exit;

pub async fn run(db: &DbArgs, args: OutputArgs) -> Result<Exit> {
    let db = super::connect(db).await?;
    let column = if args.stderr { "stderr" } else { "stdout" };
    // Without --run: the newest run that was not lost (a lost run's output is there for the
    // operator who asks for it by id, not for scripts).
    let sql = db.schema.sql(&format!(
        "SELECT {column} FROM {{s}}.runs
          WHERE target = $1 AND CASE WHEN $2::uuid IS NULL THEN outcome <> 'lost' ELSE id = $2 END
          ORDER BY finished_at DESC LIMIT 1"
    ));
    let rows = db
        .client
        .query_typed(&sql, &[(&args.target, Type::TEXT), (&args.run, Type::UUID)])
        .await
        .context("cannot read the run")?;
    let Some(row) = rows.first() else {
        match args.run {
            Some(id) => eprintln!("leasectl: no run {id} of '{}'", args.target),
            None => eprintln!("leasectl: no stored run of '{}'", args.target),
        }
        return Ok(Exit::Code(1));
    };
    let bytes: &[u8] = row.get(0);
    super::print(bytes)?;
    Ok(Exit::Code(0))
}
