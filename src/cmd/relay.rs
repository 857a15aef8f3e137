//! `leasectl relay --sink SINK`: see [`crate::relay`].

use anyhow::Result;

use crate::cli::{DbArgs, RelayArgs, RelayFormat};
use crate::exit::{usage, Exit};
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
    let metrics = match args.metrics {
        Some(addr) => Metrics::serve(addr, &cfg.sink.describe()).await?,
        None => Metrics::off(),
    };
    let db = super::connect(db).await?;
    relay::run(db, cfg, metrics).await
}
