//! One module per subcommand: each takes its parsed arguments and returns an [`Exit`].

pub mod check;
pub mod completions;
pub mod doctor;
pub mod emit;
pub mod expect;
pub mod migrate;
pub mod outbox;
pub mod output;
pub mod prune;
pub mod relay;
pub mod release;
pub mod renew;
pub mod run;
pub mod runs;
pub mod status;

use anyhow::Result;

use crate::cli::{Cli, Command, DbArgs};
use crate::db::deadline::{self, one_shot};
pub use crate::db::deadline::{extend_deadline, statement_timeout};
use crate::db::migrate::grants;
use crate::db::{Db, Schema};
use crate::exit::Exit;
pub use crate::out::{print, print_json};

/// Runs the parsed command line.
pub async fn dispatch(cli: Cli) -> Result<Exit> {
    let db = &cli.db;
    let outcome = match cli.command {
        // These two watch the database with deadlines of their own.
        Command::Run(a) => run::run(db, *a).await,
        Command::Acquire(a) => crate::run::acquire(db, a).await,
        Command::Renew(a) => one_shot(renew::run(db, a)).await,
        Command::Relay(a) => relay::run(db, a).await,
        Command::Status(a) => one_shot(status::run(db, a)).await,
        Command::Runs(a) => one_shot(runs::run(db, a)).await,
        Command::Output(a) => one_shot(output::run(db, a)).await,
        Command::Release(a) => one_shot(release::run(db, a)).await,
        Command::Expect(a) => one_shot(expect::run(db, a)).await,
        Command::Check(a) => one_shot(check::run(db, a)).await,
        Command::Outbox(a) => one_shot(outbox::run(db, a)).await,
        Command::Prune(a) => one_shot(prune::run(db, a)).await,
        Command::Migrate(a) => one_shot(migrate::run(db, a)).await,
        Command::Doctor(a) => one_shot(doctor::run(db, a)).await,
        Command::Emit(a) => emit::run(a),
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

/// Connects with the shared database options and brings the schema up to date, under the
/// deadline [`deadline::connect`] arms.
pub async fn connect(db: &DbArgs) -> Result<Db> {
    deadline::connect(db.database_url.as_deref(), &db.schema).await
}

/// Connects as [`connect`] does, without touching the schema (see [`deadline::connect_to_inspect`]).
pub async fn connect_to_inspect(db: &DbArgs) -> Result<(Db, crate::db::Detected)> {
    deadline::connect_to_inspect(db.database_url.as_deref(), &db.schema).await
}
