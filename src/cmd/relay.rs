//! `leasectl relay --sink SINK`: see [`crate::relay`].

use anyhow::Result;

use crate::cli::{DbArgs, RelayArgs};
use crate::exit::{usage, Exit};
use crate::relay::sink::SinkSpec;
use crate::relay::{self, RelayConfig};

pub async fn run(db: &DbArgs, args: RelayArgs) -> Result<Exit> {
    let sink = SinkSpec::parse(&args.sink).map_err(|e| usage(format!("--sink: {e}")))?;
    let cfg = RelayConfig {
        sink,
        batch: args.batch,
        once: args.once,
        poll: args.poll,
        max_attempts: args.max_attempts,
        timeout: args.timeout,
        parallel: args.parallel.map(usize::from),
    };
    let db = super::connect(db).await?;
    relay::run(db, cfg).await
}
