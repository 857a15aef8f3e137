//! `leasectl doctor`: inspects the deployment and prints one line per check ([`crate::doctor`]).
//! Exit 0 when no check failed, 1 when one did, 69 when the database is unreachable.

use std::time::Duration;

use anyhow::Result;

use crate::cli::{DbArgs, DoctorArgs};
use crate::doctor::{self, Check, Ctx, Options, Report};
use crate::exit::{usage, Exit};
use crate::relay::sink::SinkSpec;

/// How long one check's statements may take, unless `LEASECTL_STATEMENT_TIMEOUT` says otherwise.
const CHECK_DEADLINE: Duration = Duration::from_secs(10);

pub async fn run(db: &DbArgs, args: DoctorArgs) -> Result<Exit> {
    // Everything the flags can get wrong is a usage error before anything connects.
    let sink = match &args.sink {
        Some(s) => Some(SinkSpec::parse(s).map_err(|e| usage(format!("--sink: {e}")))?),
        None => None,
    };
    if let Some(ttl) = args.ttl {
        crate::config::times(ttl, args.heartbeat, args.kill_after)?;
    }
    if args.sink_timeout.is_zero() {
        return Err(usage("--sink-timeout must be longer than 0"));
    }
    let opts = Options {
        ttl: args.ttl,
        heartbeat: args.heartbeat,
        kill_after: args.kill_after,
        failover_time: args.failover_time,
        connections: args.connections,
        sink,
        sink_timeout: args.sink_timeout,
        check_deadline: super::statement_timeout()?.unwrap_or(CHECK_DEADLINE),
    };
    let settings = crate::db::Settings::new(db.database_url.as_deref())?;
    let mut report = Report::default();
    let mut deployment = None;
    match super::connect_to_inspect(db).await {
        Ok((conn, detected)) => {
            report.push(Check::ok(
                "connection",
                format!("connected to {}", settings.describe()),
            ));
            match Ctx::new(conn, detected, opts.clone()).await {
                Ok(ctx) => {
                    doctor::run_database_checks(&ctx, &mut report).await;
                    deployment = Some((ctx.database.clone(), ctx.db.schema.name().to_owned()));
                }
                Err(e) => unreachable(&mut report, e)?,
            }
        }
        Err(e) => unreachable(&mut report, e)?,
    }
    // An unreachable database is one failing line (and the sink, when asked for).
    if !report.unreachable {
        report.push(doctor::replication::failover(&opts));
    }
    if opts.sink.is_some() {
        super::extend_deadline(opts.sink_timeout);
        let deployment = deployment.as_ref().map(|(d, s)| (d.as_str(), s.as_str()));
        if let Some(c) = doctor::sink::check(&opts, deployment).await {
            report.push(c);
        }
    }
    if args.json {
        super::print_json(&report.json())?;
    } else {
        super::print(report.text().as_bytes())?;
    }
    Ok(report.exit())
}

/// The database could not be reached: one failing line (exit 69). An error of another kind (a
/// usage error in the connection settings, say) is returned as it is.
fn unreachable(report: &mut Report, e: anyhow::Error) -> Result<()> {
    if !doctor::unavailable(&e) {
        return Err(e);
    }
    report.unreachable = true;
    report.push(Check::fail(
        "connection",
        crate::fmt::one_line(&format!("{e:#}"), 400),
        "check the host, port, credentials and target_session_attrs (see `leasectl --help`, Connection)",
    ));
    Ok(())
}
