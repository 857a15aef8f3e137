//! `leasectl check [--target T]…`: one line per unhealthy watched target, exit 1 if any.

use anyhow::Result;

use crate::cli::{CheckArgs, DbArgs};
use crate::exit::Exit;
use crate::fmt;
use crate::health;
use crate::store;

pub async fn run(db: &DbArgs, args: CheckArgs) -> Result<Exit> {
    let db = super::connect(db).await?;
    let named = (!args.target.is_empty()).then_some(args.target.as_slice());
    let watched = store::health::watched(&db.client, &db.schema, named).await?;
    let mut out = String::new();
    let mut unhealthy = 0;
    for w in &watched {
        let a = health::assess(w);
        if let Some(e) = &a.schedule_error {
            crate::warn!("{}: its stored schedule is ignored: {e}", w.target);
        }
        if let Some(p) = a.problems.first() {
            unhealthy += 1;
            let age = w.now.duration_since(p.since).unwrap_or_default();
            out.push_str(&format!(
                "{}: {} since {} ({} ago): {}\n",
                w.target,
                p.kind.label(),
                fmt::rfc3339(p.since),
                fmt::duration(age),
                p.text
            ));
        }
    }
    for t in &args.target {
        if !watched.iter().any(|w| &w.target == t) {
            unhealthy += 1;
            out.push_str(&format!(
                "{t}: not watched (no `leasectl expect` and no `run --slot` schedule)\n"
            ));
        }
    }
    super::print(out.as_bytes())?;
    if unhealthy == 0 {
        crate::info!("{} watched target(s), all ok", watched.len());
    }
    Ok(Exit::Code(u8::from(unhealthy > 0)))
}
