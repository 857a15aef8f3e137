//! The `leasectl` binary: parse, run, map the outcome to an exit code, print any error once.

use std::process::ExitCode;

use clap::error::ErrorKind;
use clap::Parser;
use leasectl::cli::Cli;
use leasectl::exit::Exit;

fn main() -> ExitCode {
    // A leasectl started as a command's watchdog does only that, and never returns from here.
    leasectl::process::watchdog::serve_if_asked();
    let args = leasectl::cli::attach_negative_values(std::env::args_os().collect());
    let cli = match Cli::try_parse_from(args) {
        Ok(cli) => cli,
        Err(e) => return clap_error(e),
    };
    leasectl::log::set_verbose(cli.db.verbose);
    // One thread is enough (the work is waiting on a socket and a child) and keeps a holding
    // leasectl small. It also matters for PR_SET_PDEATHSIG: the child is forked from this
    // thread, which lives exactly as long as the run.
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            leasectl::say!("cannot start the runtime: {e}");
            return ExitCode::from(Exit::INTERNAL);
        }
    };
    // A panic is a bug, but it must still end as one line and exit 70, and unwinding must
    // run the drops that kill a running command's process group (the watchdog, seeing its
    // pipe close without a stand-down, kills it too).
    std::panic::set_hook(Box::new(|info| {
        let what = info
            .payload()
            .downcast_ref::<&str>()
            .map(|s| (*s).to_owned())
            .or_else(|| info.payload().downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "panic".into());
        let at = info
            .location()
            .map_or(String::new(), |l| format!(" at {}:{}", l.file(), l.line()));
        leasectl::say!("internal error: {}{at}, please report", one_line(&what));
    }));
    let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        runtime.block_on(leasectl::heap::on_heap(|| leasectl::cmd::dispatch(cli)))
    }));
    let exit = match outcome {
        Ok(Ok(exit)) => exit,
        Ok(Err(err)) => {
            leasectl::say!("{}", one_line(&format!("{err:#}")));
            Exit::from_error(&err)
        }
        Err(_) => Exit::Internal,
    };
    // Do not wait for blocking-pool threads (stdin readers and the like).
    runtime.shutdown_background();
    ExitCode::from(exit.code())
}

/// Usage errors as one line (clap's own text, without the usage block), exit 2;
/// `--help` and `--version` as clap prints them, exit 0.
fn clap_error(e: clap::Error) -> ExitCode {
    match e.kind() {
        ErrorKind::DisplayHelp
        | ErrorKind::DisplayVersion
        | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand => {
            let _ = e.print();
            let code = if e.kind() == ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand {
                Exit::USAGE
            } else {
                0
            };
            ExitCode::from(code)
        }
        _ => {
            let text = e.render().to_string();
            let body = text.split("\nUsage:").next().unwrap_or(&text);
            let body = body.split("\nFor more information").next().unwrap_or(body);
            let body = body.trim().trim_start_matches("error:").trim();
            // clap's "to pass '-5' as a value, use '-- -5'" would make the value the command's
            // first word; the hint below says what to write instead.
            let body: String = body
                .lines()
                .filter(|l| !l.trim_start().starts_with("tip: to pass"))
                .collect::<Vec<_>>()
                .join("\n");
            let body = body.as_str();
            match typo_hint(&e, &std::env::args().collect::<Vec<_>>()) {
                Some(hint) => leasectl::say!("{}; {hint} (see --help)", one_line(body)),
                None => leasectl::say!("{} (see --help)", one_line(body)),
            }
            ExitCode::from(Exit::USAGE)
        }
    }
}

/// A hint for the two slips people make most with `run`: forgetting the `--` before the
/// command (`run --target x echo hi`), and giving `--wait` its limit as a separate word
/// (`--wait 10m`; it is optional, so it must be attached: `--wait=10m`).
fn typo_hint(e: &clap::Error, args: &[String]) -> Option<String> {
    use clap::error::{ContextKind, ContextValue};
    if e.kind() != ErrorKind::UnknownArgument || !args.iter().any(|a| a == "run") {
        return None;
    }
    let Some(ContextValue::String(bad)) = e.get(ContextKind::InvalidArg) else {
        return None;
    };
    // A word clap split into short flags (`-5s`) is named by its first one (`-5`).
    let at = args
        .iter()
        .position(|a| a == bad || (bad.starts_with('-') && a.starts_with(bad.as_str())))?;
    let bad = &args[at];
    if at > 0 && args[at - 1] == "--wait" {
        return Some(format!(
            "write --wait={bad}: --wait takes its limit after '=' (alone it waits forever)"
        ));
    }
    if !args.iter().any(|a| a == "--") {
        return Some(
            "the command must follow --, e.g. leasectl run --target x -- echo hi".to_owned(),
        );
    }
    None
}

/// Folds a possibly multi-line message (PostgreSQL DETAIL/HINT, clap lists) into one line.
fn one_line(s: &str) -> String {
    let mut out = String::new();
    for line in s.split('\n').map(str::trim).filter(|l| !l.is_empty()) {
        if !out.is_empty() {
            out.push_str(if out.ends_with(':') { " " } else { "; " });
        }
        out.push_str(line);
    }
    out
}
