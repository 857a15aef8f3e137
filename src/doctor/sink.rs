//! `sink`: `--sink URL` reached the way the relay would reach it, without publishing anything
//! ([`crate::relay::sink::SinkSpec::probe`]).

use super::{Check, Options};
use crate::relay::sink::Probed;

/// Probes the sink; `deployment` is the database and schema when the database could be asked.
pub async fn check(opts: &Options, deployment: Option<(&str, &str)>) -> Option<Check> {
    let spec = opts.sink.as_ref()?;
    Some(match spec.probe(opts.sink_timeout, deployment).await {
        Probed::Ok(detail) => Check::ok("sink", detail),
        Probed::Warn(detail, fix) => Check::warn("sink", detail, fix),
        Probed::Fail(detail, fix) => Check::fail("sink", detail, fix),
    })
}
