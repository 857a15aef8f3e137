//! One module per subcommand: each takes its parsed arguments and returns an [`Exit`].

pub mod completions;
pub mod migrate;
pub mod outbox;
pub mod output;
pub mod prune;
pub mod relay;
pub mod release;
pub mod run;
pub mod runs;
pub mod status;

use anyhow::Result;

use crate::cli::{Cli, Command, DbArgs};
use crate::db::migrate::grants;
use crate::db::{Db, Schema, Settings};
use crate::exit::Exit;

/// Runs the parsed command line.
pub async fn dispatch(cli: Cli) -> Result<Exit> {
    let db = &cli.db;
    let outcome = match cli.command {
        Command::Run(a) => run::run(db, a).await,
        Command::Status(a) => status::run(db, a).await,
        Command::Runs(a) => runs::run(db, a).await,
        Command::Output(a) => output::run(db, a).await,
        Command::Release(a) => release::run(db, a).await,
        Command::Relay(a) => relay::run(db, a).await,
        Command::Outbox(a) => outbox::run(db, a).await,
        Command::Prune(a) => prune::run(db, a).await,
        Command::Migrate(a) => migrate::run(db, a).await,
        Command::Completions(a) => completions::run(a),
    };
    // The one place a "permission denied" becomes a line naming the privilege (exit 77).
    match outcome {
        Err(e) => {
            Err(grants::explain(db.database_url.as_deref(), &Schema::new(&db.schema), e).await)
        }
        done => done,
    }
}

/// Connects with the shared database options and brings the schema up to date.
pub async fn connect(db: &DbArgs) -> Result<Db> {
    let settings = Settings::new(db.database_url.as_deref())?;
    Db::connect(settings, Schema::new(&db.schema)).await
}

/// Writes to stdout, treating a closed pipe (`leasectl … | head`) as success.
pub fn print(bytes: &[u8]) -> Result<()> {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    match out.write_all(bytes).and_then(|_| out.flush()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => {
            Err(anyhow::Error::new(e).context("cannot write to stdout"))
        }
        _ => Ok(()),
    }
}

/// Pretty JSON and a newline on stdout.
pub fn print_json(value: &serde_json::Value) -> Result<()> {
    let mut s = serde_json::to_string_pretty(value)?;
    s.push('\n');
    print(s.as_bytes())
}
