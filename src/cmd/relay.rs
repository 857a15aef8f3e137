//! `leasectl relay --sink SINK`: see [`crate::relay`].

use anyhow::Result;

use crate::cli::{DbArgs, RelayArgs, RelayFormat};
use crate::exit::{usage, Exit, Failure};
use crate::relay::metrics::Metrics;
use crate::relay::sink::{format, Format, SinkSpec};
use crate::relay::{self, RelayConfig};

pub async fn run(db: &DbArgs, args: RelayArgs) -> Result<Exit> {
    let sink = SinkSpec::parse(&args.sink).map_err(|e| usage(format!("--sink: {e}")))?;
    if args.source.is_some() && args.format != RelayFormat::CloudEvents {
        return Err(usage(
            "--source is the CloudEvents source: it needs --format cloudevents",
        ));
    }
    let cfg = RelayConfig {
        sink,
        batch: args.batch,
        once: args.once,
        poll: args.poll,
        max_attempts: args.max_attempts,
        timeout: args.timeout,
        parallel: args.parallel.map(usize::from),
        format: match args.format {
            RelayFormat::Json => Format::Json,
            RelayFormat::CloudEvents => Format::CloudEvents {
                source: args
                    .source
                    .unwrap_or_else(|| format::default_source(&db.schema)),
            },
        },
        order: args.order,
        batch_bytes: i64::try_from(args.batch_bytes).unwrap_or(i64::MAX),
        statement_deadline: super::statement_timeout()?
            .unwrap_or(crate::relay::liveness::STATEMENT_DEADLINE),
    };
    // Before connecting: a port that is taken is the operator's to fix, whatever the database.
    let bound = match args.metrics {
        Some(addr) => Some(Metrics::bind(addr).await?),
        None => None,
    };
    let db = super::connect(db).await?;
    let mut cfg = cfg;
    if cfg.sink.needs_deployment() {
        // The database's own name, whichever host or pooler alias reached it.
        let named = db.client.query_typed_one("SELECT current_database()", &[]);
        let row = tokio::time::timeout(cfg.statement_deadline, named)
            .await
            .map_err(|_| {
                Failure::Unavailable(format!(
                    "the database did not answer within {}",
                    crate::fmt::duration(cfg.statement_deadline)
                ))
            })??;
        let database: String = row.get(0);
        for notice in cfg.sink.for_deployment(&database, db.schema.name()) {
            crate::say!("notice: {notice}");
        }
    }
    let metrics = match bound {
        Some(bound) => bound.serve(&cfg.sink.describe()),
        None => Metrics::off(),
    };
    relay::run(db, cfg, metrics).await
}
