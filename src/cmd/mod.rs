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
use crate::heap::{on_heap, OnHeap};
pub use crate::out::{print, print_json};

/// Runs the parsed command line.
pub async fn dispatch(cli: Cli) -> Result<Exit> {
    let db = &cli.db;
    // Each command's future is built on the heap: together in this frame they would make it
    // as big as the biggest of them, whichever command runs (see `crate::heap`).
    let command: OnHeap<Result<Exit>> = match cli.command {
        // These two watch the database with deadlines of their own.
        Command::Run(a) => on_heap(|| run::run(db, *a)),
        Command::Acquire(a) => on_heap(|| crate::run::acquire(db, a)),
        Command::Renew(a) => on_heap(|| one_shot(renew::run(db, a))),
        Command::Relay(a) => on_heap(|| relay::run(db, a)),
        Command::Status(a) => on_heap(|| one_shot(status::run(db, a))),
        Command::Runs(a) => on_heap(|| one_shot(runs::run(db, a))),
        Command::Output(a) => on_heap(|| one_shot(output::run(db, a))),
        Command::Release(a) => on_heap(|| one_shot(release::run(db, a))),
        Command::Expect(a) => on_heap(|| one_shot(expect::run(db, a))),
        Command::Check(a) => on_heap(|| one_shot(check::run(db, a))),
        Command::Outbox(a) => on_heap(|| one_shot(outbox::run(db, a))),
        Command::Prune(a) => on_heap(|| one_shot(prune::run(db, a))),
        Command::Migrate(a) => on_heap(|| one_shot(migrate::run(db, a))),
        Command::Doctor(a) => on_heap(|| one_shot(doctor::run(db, a))),
        Command::Emit(a) => Box::pin(std::future::ready(emit::run(a))),
        Command::Completions(a) => Box::pin(std::future::ready(completions::run(a))),
    };
    let outcome = command.await;
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
