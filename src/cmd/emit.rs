//! `leasectl emit`: one checked line appended to the running command's `$LEASECTL_EVENTS`
//! (see `run::events`). No database: leasectl stores the file's events with the run.

use std::io::{IsTerminal, Read, Write};

use anyhow::{Context, Result};

use crate::cli::EmitArgs;
use crate::exit::{usage, Exit};
use crate::run::events;

pub fn run(args: EmitArgs) -> Result<Exit> {
    let Some(path) = std::env::var_os(events::VAR).filter(|p| !p.is_empty()) else {
        return Err(usage(format!(
            "emit works only in a command run by `leasectl run` (${} is not set)",
            events::VAR
        )));
    };
    let text = match args.payload {
        Some(p) => p,
        None if std::io::stdin().is_terminal() => {
            return Err(usage(
                "no payload: give --payload JSON or pipe the JSON on stdin",
            ))
        }
        None => {
            let mut s = String::new();
            std::io::stdin()
                .read_to_string(&mut s)
                .context("cannot read the payload from stdin")?;
            s
        }
    };
    let payload: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| usage(format!("the payload is not JSON: {e}")))?;
    let mut event = serde_json::Map::new();
    event.insert("aggregate_type".into(), args.aggregate_type.into());
    event.insert("aggregate_id".into(), args.aggregate_id.into());
    event.insert("type".into(), args.event_type.into());
    event.insert("payload".into(), payload);
    events::check(&event).map_err(usage)?;
    let mut line = serde_json::to_vec(&event)?;
    line.push(b'\n');
    // Appended with one write on a file opened O_APPEND, so lines from several processes of
    // the command never interleave. Never created here: only leasectl run makes the file.
    let mut file = std::fs::OpenOptions::new()
        .append(true)
        .open(&path)
        .with_context(|| format!("cannot open ${} ({})", events::VAR, path.to_string_lossy()))?;
    file.write_all(&line)
        .with_context(|| format!("cannot write to ${}", events::VAR))?;
    Ok(Exit::Code(0))
}
