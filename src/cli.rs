//! The whole command-line interface: every subcommand's flags, help text and examples.
//!
//! Values are parsed and checked here (durations, targets, schema names) so a bad flag is a usage
//! error (exit 2) before anything connects; cross-flag rules live in [`crate::config`].

use std::ffi::OsString;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};

use crate::model::flags::{
    parse_byte_size, parse_duration, parse_label, parse_notice, parse_schema, parse_target,
    parse_wait, Wait,
};

const ABOUT: &str = "Run a command at most once at a time per target, with PostgreSQL as the only \
coordinator: a fenced heartbeat lease, a stored result and a transactional outbox event.";

const AFTER_HELP: &str = "\
Examples:
  leasectl run --target nightly-report -- ./report.sh
  leasectl run --target oauth --ttl 20s --wait=30s --reuse-within 5m -- ./refresh-token
  leasectl status
  leasectl doctor --ttl 2m --sink amqp://guest:guest@localhost/%2f
  leasectl runs --target nightly-report --limit 5
  leasectl relay --sink amqp://guest:guest@localhost/%2f

Connection: --database-url, else DATABASE_URL, else PGHOST/PGPORT/PGUSER/PGPASSWORD/PGDATABASE/
PGSSLMODE/PGTARGETSESSIONATTRS, else the local socket as the current user (what `psql` alone would
reach). Several hosts with target_session_attrs=read-write follow a failover (docs/OPERATIONS.md).

Exit codes: the child's code (128+N if signal N killed it); 2 usage; 65 the command's
$LEASECTL_EVENTS were refused; 69 database unavailable; 70 internal error; 75 busy; 76 lease lost; 77 the role lacks a privilege (or may not migrate);
78 schema newer than leasectl; 124 --timeout; 126/127 command not executable / not found;
128+N leasectl received signal N.";

/// `leasectl --version`: the package version and, when built from a git checkout, the commit
/// (build.rs), so a binary found on a host can be traced to its source.
pub const VERSION: &str = concat!(env!("CARGO_PKG_VERSION"), env!("BUILT_FROM_COMMIT"));

/// The command line with a negative value attached to its flag: `--ttl -5s` becomes
/// `--ttl=-5s`.
///
/// clap reads a word starting with `-` after a flag as another flag, and suggests `-- -5s`,
/// which would turn the value into the command. Attached, the value reaches the flag's own
/// parser, which says what the flag accepts. Only a word of the form `-<digit>…` right after a
/// long flag that takes a value is attached, and nothing after `--` (the command's words) is
/// touched, so `--ttl --heartbeat 1s` still says that --ttl lacks its value.
pub fn attach_negative_values(args: Vec<OsString>) -> Vec<OsString> {
    let negative = |a: &OsString| {
        let b = a.as_encoded_bytes();
        b.len() > 1 && b[0] == b'-' && b[1].is_ascii_digit()
    };
    let end = args.iter().position(|a| a == "--").unwrap_or(args.len());
    if !args[..end].iter().any(negative) {
        return args;
    }
    let takes_value = flags_taking_a_value();
    let mut out = Vec::with_capacity(args.len());
    let mut words = args.into_iter().enumerate().peekable();
    while let Some((i, a)) = words.next() {
        let flag = a
            .to_str()
            .and_then(|a| a.strip_prefix("--"))
            .filter(|f| i < end && takes_value.iter().any(|t| t == f));
        match (flag, words.peek()) {
            (Some(_), Some((j, next))) if *j < end && negative(next) => {
                let mut joined = a.clone();
                joined.push("=");
                joined.push(next);
                out.push(joined);
                words.next();
            }
            _ => out.push(a),
        }
    }
    out
}

/// The long flags, in any command, that take one value as the next word (not those, like
/// `--wait`, whose value must be attached with `=`).
fn flags_taking_a_value() -> Vec<String> {
    use clap::CommandFactory;
    fn walk(cmd: &clap::Command, out: &mut Vec<String>) {
        for arg in cmd.get_arguments() {
            let takes = arg.get_num_args().is_some_and(|n| n.min_values() > 0);
            if let (Some(long), true, false) = (arg.get_long(), takes, arg.is_require_equals_set())
            {
                out.push(long.to_owned());
            }
        }
        for sub in cmd.get_subcommands() {
            walk(sub, out);
        }
    }
    let mut cli = Cli::command();
    cli.build();
    let mut out = Vec::new();
    walk(&cli, &mut out);
    out
}

#[derive(Debug, Parser)]
#[command(name = "leasectl", version = VERSION, about = ABOUT, after_help = AFTER_HELP)]
#[command(propagate_version = true, max_term_width = 100)]
pub struct Cli {
    #[command(flatten)]
    pub db: DbArgs,

    #[command(subcommand)]
    pub command: Command,
}

/// The heading of the options every command takes (connection, schema, -v), listed after a
/// command's own.
const GLOBAL: &str = "Global options";

/// Connection options, accepted before or after the subcommand.
#[derive(Debug, Args, Clone)]
pub struct DbArgs {
    /// PostgreSQL URL or libpq "key=value" string [default: libpq environment, then local socket]
    #[arg(
        long,
        global = true,
        env = "DATABASE_URL",
        hide_env_values = true,
        value_name = "URL",
        help_heading = GLOBAL
    )]
    pub database_url: Option<String>,

    /// Schema holding leasectl's tables (letters, digits, underscore; at most 48 bytes)
    #[arg(long, global = true, default_value = "leasectl", value_parser = parse_schema, value_name = "NAME",
          help_heading = GLOBAL)]
    pub schema: String,

    /// Log lease transitions and retries to stderr
    #[arg(short, long, global = true, help_heading = GLOBAL)]
    pub verbose: bool,
}

/// The commands. Each one's arguments are added to clap's command tree only when that command
/// is parsed, or when the whole tree is built (`--help` of the program, completions, man
/// pages): building every command's arguments to parse one of them was most of clap's share of
/// a start — `run -- true` 0.95–0.97 × and `--version` 0.91 × with it deferred
/// (docs/BENCHMARKS.md).
#[derive(Debug, Subcommand)]
#[command(defer = true)]
pub enum Command {
    /// Run COMMAND under a fenced heartbeat lease on TARGET
    #[command(after_help = RUN_HELP)]
    Run(Box<RunArgs>),
    /// Take a lease that outlives this process, for several steps (`run --token`); print its token
    #[command(after_help = ACQUIRE_HELP)]
    Acquire(AcquireArgs),
    /// Extend a lease taken by `acquire` (between steps nothing renews it)
    #[command(
        after_help = "Exit codes: 0 renewed; 76 the token no longer holds TARGET (it expired and was taken, \
was released or replaced); 69 database down or silent; 2 usage.\n\n\
Example:\n  leasectl renew --target deploy --token \"$LEASECTL_TOKEN\" --ttl 30m"
    )]
    Renew(RenewArgs),
    /// Show each target's lease, its last run and the outbox backlog
    #[command(
        after_help = "Examples:\n  leasectl status\n  leasectl status --target nightly-report --json"
    )]
    Status(StatusArgs),
    /// List the recorded runs of a target, newest first
    #[command(
        after_help = "Examples:\n  leasectl runs --target nightly-report\n  leasectl runs --target nightly-report --limit 1 --json"
    )]
    Runs(RunsArgs),
    /// Print the captured stdout (or stderr) of a stored run, byte for byte
    #[command(
        after_help = "By default the newest run that was not `lost`.\n\nExamples:\n  leasectl output --target oauth\n  leasectl output --target oauth --run 6f1c… --stderr"
    )]
    Output(OutputArgs),
    /// End a lease: one taken by `acquire` (--token), or break anyone's (--force)
    #[command(
        after_help = "The holder is told at once (NOTIFY on its lease channel): it checks its lease, stops its \
command (SIGTERM, then SIGKILL after its --kill-after), records the run as `lost` and exits 76. \
Behind a transaction-mode pooler, where it cannot LISTEN, it notices at its next heartbeat.\n\n\
release waits until the old holder has recorded its stop, or until its lease would have expired \
anyway (its TTL after its last heartbeat), and says which happened; --no-wait returns at once. \
Either way nobody else starts on the target before then: waiters, plain runs and --replace wait for \
that stop too (status shows the target as `stopping`). --token during a running step stops that \
step the same way.\n\n\
Examples:\n  leasectl release --target deploy --token \"$LEASECTL_TOKEN\"\n  leasectl release --target nightly-report --force"
    )]
    Release(ReleaseArgs),
    /// Say what is expected of a target: a successful run every DUR, runs no longer than DUR
    #[command(after_help = EXPECT_HELP)]
    Expect(ExpectArgs),
    /// Print one line per unhealthy watched target; exit 1 if there is any
    #[command(after_help = CHECK_HELP)]
    Check(CheckArgs),
    /// Publish outbox events to RabbitMQ, NATS JetStream, a webhook, a command or stdout
    #[command(after_help = RELAY_HELP)]
    Relay(RelayArgs),
    /// Inspect and repair undelivered outbox events
    #[command(subcommand, after_help = OUTBOX_HELP)]
    Outbox(OutboxCommand),
    /// Delete runs older than a given age (each target keeps its newest run)
    #[command(after_help = PRUNE_HELP)]
    Prune(PruneArgs),
    /// Apply pending schema migrations (every command also does this itself), or print grants
    #[command(after_help = MIGRATE_HELP)]
    Migrate(MigrateArgs),
    /// Inspect the deployment: one line per check (ok, warn or fail) with what to do; changes nothing
    #[command(after_help = DOCTOR_HELP)]
    Doctor(DoctorArgs),
    /// Append an outbox event to the running command's $LEASECTL_EVENTS (inside `leasectl run`)
    #[command(after_help = EMIT_HELP)]
    Emit(EmitArgs),
    /// Print shell completions
    #[command(
        after_help = "Examples:\n  leasectl completions bash > /etc/bash_completion.d/leasectl\n  leasectl completions zsh > ~/.zfunc/_leasectl"
    )]
    Completions(CompletionsArgs),
}

const RUN_HELP: &str = "\
At most one copy of COMMAND runs per TARGET across all hosts sharing the database. The child sees
LEASECTL_TARGET, LEASECTL_TOKEN, LEASECTL_FENCE (a number that grows with every acquisition, also across failovers),
LEASECTL_HOLDER_INDEX (0, or its place with --max-holders) and LEASECTL_EVENTS, a file for its
own outbox events (see `leasectl emit`). Its result, an outbox event and its own events are stored
only while the lease is still held.

Durations: 500ms, 30s, 2m, 1h, 1d.

With --slot SCHEDULE, at most one run per scheduled slot: the slot is the latest instant of the
schedule at or before the database's clock plus --slot-skew, so cron lines on several hosts (or a
manual run later that day) do the slot once; the others record a `skipped` run and exit 0 — at
once, also while the slot's run is still in progress, with or without --wait. A run of an earlier
slot still in progress is busy (75, or --wait). The child also sees LEASECTL_SLOT and
LEASECTL_SLOT_END (RFC 3339).

With --wait, waiters queue: they take the lease in arrival order (--queue fifo), and a caller
without --wait finds the target busy while anyone queues for it (no queue jumping). With
--queue latest, a new waiter supersedes every older one (they exit 75, naming who superseded
them). Without a terminal, a waiter says every --wait-notice where it stands and who holds the
target; `leasectl status` lists the waiters.

With --max-holders N, up to N callers hold TARGET at once, each in its own place (the child sees
LEASECTL_HOLDER_INDEX, 0…N−1); fences still increase with every acquisition. A caller with
another N is a usage error while any place is held.

With --replace, a live holder is told to stop (its run is recorded `preempted`, it exits 76) and
COMMAND starts only once it has stopped, or its lease would have expired anyway: no overlap. Any
lease taken from a holder whose command still runs (--replace, release --force) is free for
nobody until that holder has stopped or its deadline passed: waiters and plain runs wait too.

With --token TOKEN (from `leasectl acquire`), COMMAND runs as one step under that lease: renewed
while it runs, stored with the same fenced save, and the lease kept for the next step; 76 if the
token no longer holds TARGET (or it expired). Steps run one at a time: while another step runs,
75 at once, or with --wait[=DUR] wait for it.

--wait=DUR limits the whole wait, from the start (connecting included): one attempt is always
made (connecting gets 2s at least), and the exit (75) comes within DUR + 0.5s, or 2.5s for a DUR
under 2s.

Examples:
  leasectl run --target nightly-report -- ./report.sh --full
  leasectl run --target nightly --slot '0 2 * * *' --slot-tz Europe/Berlin -- ./nightly.sh
  leasectl run --target deploy --wait=10m --timeout 30m -- make deploy
  leasectl run --target deploy --wait --queue latest --label \"${GITHUB_SHA:-local}\" -- make deploy
  leasectl run --target licence-pool --max-holders 6 --wait -- ./build
  leasectl run --target preview-42 --replace --label \"${GITHUB_SHA:-local}\" -- ./deploy-preview
  leasectl run --target deploy --token \"$LEASECTL_TOKEN\" -- ./migrate
  TOKEN=$(leasectl run --target oauth --ttl 20s --wait=30s --reuse-within 5m -- ./refresh-token)

Exit codes: the child's (128+N if killed by signal N); 75 busy (or --wait ran out; with --token:
another step runs); 76 lease lost, replaced or (with --token) no longer held (or ran out before the start); 124 --timeout; 126/127 not executable / not found; 128+N leasectl got signal N;
2 usage; 65 $LEASECTL_EVENTS refused (run stored without them); 69 database down or silent;
70 internal error; 77 the role lacks a privilege.";

#[derive(Debug, Args)]
pub struct RunArgs {
    #[command(flatten)]
    pub lease: LeaseArgs,

    /// Renewal interval, at least 10ms and TTL/1000 [default: TTL/4]
    #[arg(long, value_parser = parse_duration, value_name = "DUR")]
    pub heartbeat: Option<Duration>,

    /// Run as a step under a lease taken by `acquire` (its TOKEN): renew it while the command
    /// runs, store the run with the same fenced save, keep the lease afterwards; 76 if the
    /// token no longer holds TARGET, 75 while another step runs (--wait waits for it)
    #[arg(long, value_name = "TOKEN", value_parser = crate::model::flags::parse_token,
          conflicts_with_all = ["ttl", "heartbeat", "queue", "replace", "max_holders", "label",
                                "reuse_within", "slot"])]
    pub token: Option<uuid::Uuid>,

    /// Reuse the stored stdout of a successful run that finished less than DUR ago
    #[arg(long, value_parser = parse_duration, value_name = "DUR")]
    pub reuse_within: Option<Duration>,

    /// Stop the command after DUR and exit 124
    #[arg(long, value_parser = parse_duration, value_name = "DUR")]
    pub timeout: Option<Duration>,

    /// Grace between SIGTERM and SIGKILL when the command must stop [default: min(10s, TTL/10)]
    #[arg(long, value_parser = parse_duration, value_name = "DUR")]
    pub kill_after: Option<Duration>,

    /// Type of the outbox event stored with the result
    #[arg(long, default_value = "leasectl.run.finished", value_name = "TYPE")]
    pub event_type: String,

    /// Store the result without an outbox event
    #[arg(long, conflicts_with = "event_type")]
    pub no_event: bool,

    /// Capture the command's output without echoing it
    #[arg(short, long)]
    pub quiet: bool,

    /// Bytes of stdout and of stderr stored per run (e.g. 64KiB, 1MiB); the rest still streams
    #[arg(long, value_parser = parse_byte_size, default_value = "1MiB", value_name = "BYTES")]
    pub capture_limit: usize,

    /// Bytes the command may write to $LEASECTL_EVENTS (its own outbox events); more stores
    /// the run without any of them and exits 65
    #[arg(long, value_parser = parse_byte_size, default_value = "10MiB", value_name = "BYTES")]
    pub events_limit: usize,
    /// Run at most once per slot of this cron schedule (5 fields or @hourly, @daily, @weekly,
    /// @monthly, @yearly, @annually): a caller whose slot any host already did, or is doing,
    /// records a skip and exits 0
    #[arg(long, value_parser = crate::model::slot::parse_expr, value_name = "SCHEDULE",
          conflicts_with = "reuse_within")]
    pub slot: Option<String>,

    /// Time zone of --slot's schedule (IANA name, e.g. Europe/Berlin, from the system's time
    /// zone database: /usr/share/zoneinfo, or $TZDIR) [default: UTC]
    #[arg(long, value_parser = parse_zone, value_name = "ZONE", requires = "slot")]
    pub slot_tz: Option<String>,

    /// How early a caller may fire and still belong to the coming slot [default: 1m, or a
    /// quarter of the schedule's shortest interval if less]
    #[arg(long, value_parser = parse_duration, value_name = "DUR", requires = "slot")]
    pub slot_skew: Option<Duration>,

    /// Only a run that exited 0 does its slot: after a failure the next caller runs again
    #[arg(long, requires = "slot")]
    pub until_success: bool,

    /// Exit code of a caller that finds its slot already done, or being done
    #[arg(long, default_value_t = 0, value_name = "N", requires = "slot",
          value_parser = crate::model::flags::parse_exit_code)]
    pub done_exit_code: u8,

    /// The command and its arguments, after `--`
    #[arg(last = true, required = true, value_name = "COMMAND")]
    pub command: Vec<OsString>,
}

const ACQUIRE_HELP: &str = "\
Takes TARGET's lease as `run` would (same --ttl, --wait, --queue, --replace, --label,
--max-holders, --busy-exit-code) and prints it: LEASECTL_TARGET, LEASECTL_TOKEN, LEASECTL_FENCE
and LEASECTL_HOLDER_INDEX. Nothing renews it after acquire exits: each `run --token` step renews
it while its command runs (and stores its run with the same fenced save, keeping the lease), and
between steps it lives for its TTL from the last renewal — `renew` extends it. `release --token`
ends it; a crashed pipeline's lease expires by TTL.

Formats: sh (export lines for eval), env (NAME=value lines, e.g. >> \"$GITHUB_ENV\"), json.

Exit codes: 0 acquired; 75 busy (--busy-exit-code); 69 database down or silent; 2 usage;
128+N got signal N while waiting.

Examples:
  eval \"$(leasectl acquire --target deploy --ttl 30m --wait=10m)\"
  leasectl run --target deploy --token \"$LEASECTL_TOKEN\" -- ./migrate
  leasectl run --target deploy --token \"$LEASECTL_TOKEN\" -- ./rollout
  leasectl release --target deploy --token \"$LEASECTL_TOKEN\"

  leasectl acquire --target deploy --ttl 30m --wait --format env >> \"$GITHUB_ENV\"";

#[derive(Debug, Args)]
pub struct AcquireArgs {
    #[command(flatten)]
    pub lease: LeaseArgs,

    /// How to print the lease
    #[arg(long, value_enum, default_value = "sh", value_name = "FORMAT")]
    pub format: AcquireFormat,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum AcquireFormat {
    /// `export NAME='value'` lines, for eval
    Sh,
    /// `NAME=value` lines, for $GITHUB_ENV or a dotenv file
    Env,
    /// One JSON object
    Json,
}

#[derive(Debug, Args)]
pub struct RenewArgs {
    /// The target the lease is on
    #[arg(long, value_parser = parse_target, value_name = "TARGET")]
    pub target: String,
    /// The token `acquire` printed
    #[arg(long, value_name = "TOKEN", value_parser = crate::model::flags::parse_token)]
    pub token: uuid::Uuid,
    /// From now on, the lease expires when not renewed for this long [default: its TTL]
    #[arg(long, value_parser = parse_duration, value_name = "DUR")]
    pub ttl: Option<Duration>,
}

// How a lease is taken: the flags `run` and `acquire` share. (A plain comment, not a doc
// comment: clap makes a flattened struct's doc comment the `about` of each command it is
// flattened into, and with the subcommands' arguments added only when a command is parsed
// (`defer`), that would replace `run`'s and `acquire`'s own.)
#[derive(Debug, Args)]
pub struct LeaseArgs {
    /// What to hold the lease on: 1–200 characters, no control characters
    #[arg(long, value_parser = parse_target, value_name = "TARGET")]
    pub target: String,

    /// The lease expires when not renewed for this long (database clock)
    #[arg(long, value_parser = parse_duration, default_value = "2m", value_name = "DUR")]
    pub ttl: Duration,

    /// When busy, wait for the lease (forever, or up to DUR) instead of exiting 75
    #[arg(long, value_parser = parse_wait, num_args = 0..=1, require_equals = true,
          default_missing_value = "forever", value_name = "DUR")]
    pub wait: Option<Wait>,

    /// How waiters take turns: fifo (arrival order), latest (a new waiter supersedes every
    /// older one, which exits busy) or unordered (whoever asks first after a release)
    #[arg(
        long,
        value_enum,
        default_value = "fifo",
        value_name = "MODE",
        requires = "wait"
    )]
    pub queue: crate::model::order::QueueMode,

    /// While waiting, say where we are in the queue every DUR (0: never) [default: 30s]
    #[arg(long, value_parser = parse_notice, value_name = "DUR", requires = "wait")]
    pub wait_notice: Option<Duration>,

    /// Shown with this caller wherever holders and waiters are (busy lines, status, runs):
    /// a commit SHA, a pipeline URL; at most 200 characters, no control characters
    #[arg(long, value_parser = parse_label, value_name = "TEXT")]
    pub label: Option<String>,

    /// Up to N holders at once, each in its own place (LEASECTL_HOLDER_INDEX 0…N−1); the N of
    /// the first holder stands until none is left
    #[arg(long, default_value_t = 1, value_name = "N",
          value_parser = clap::value_parser!(i32).range(1..=crate::model::flags::MAX_HOLDERS as i64))]
    pub max_holders: i32,

    /// Take the lease even from a live holder (the oldest, with --max-holders): it is told to
    /// stop, records its run `preempted` and exits 76; ours starts only once it has stopped
    #[arg(long, conflicts_with = "wait")]
    pub replace: bool,

    /// Exit code when another holder has the lease
    #[arg(long, default_value_t = 75, value_name = "N",
          value_parser = crate::model::flags::parse_exit_code)]
    pub busy_exit_code: u8,
}

const EMIT_HELP: &str = "\
For a command running under `leasectl run`: appends one line to the file named by
$LEASECTL_EVENTS, checked, so shell jobs need no JSON quoting. leasectl inserts the file's events
in the same transaction that stores the run's result, after the run's own event and in file
order: they exist if and only if the run was stored by the lease's current holder (a run that
lost its lease stores none; its `lost` record keeps them). A malformed line written by other
means, more than --events-limit bytes, or anything but a regular file left at that path (a FIFO,
a symbolic link, a directory; never opened in a way that could block) stores the run without any
of them and exits 65.
Outside `leasectl run` it is a usage error (exit 2).

Examples:
  leasectl emit --aggregate-type invoice --aggregate-id \"$ID\" --type invoice.sent --payload '{\"total\": 42}'
  jq -n --arg f \"$FILE\" '{file: $f}' | leasectl emit --aggregate-type export --aggregate-id daily --type export.ready";
/// An IANA zone name for `--slot-tz`, as the zone database spells it (it is stored with the
/// schedule).
fn parse_zone(s: &str) -> Result<String, String> {
    crate::model::slot::zone_name(s)
}

const RELAY_HELP: &str = "\
Publishes pending outbox events — leasectl's own and those applications insert in their own
transactions — at least once, in creation order per aggregate, then deletes them. Several relays
may run at once. A refused event is retried with backoff (1s doubling to 5m) and is dead after
--max-attempts; only later events of its own aggregate wait for it. An unreachable sink costs no
attempts: the relay backs off and tries again. With --order commit an event is published only once
every transaction older than its own has ended, in transaction order: no event of an aggregate
can then commit behind one already published, but any open transaction holds delivery back.

It is also the dead-man switch: before its batches (at most once a second; --once: once) it
judges the health of watched targets (see `leasectl expect`) and inserts one
leasectl.target.<missed|overdue|failing|too_long> event when an incident starts and one
leasectl.target.recovered when it ends, exactly once however many relays run.

Sinks:
  stdout                         one JSON object per line
  exec:COMMAND                   sh -c COMMAND per event, event JSON on stdin; exit 0 = delivered
  amqp://user:pw@host/vhost[?exchange=NAME&properties=full]
                                 RabbitMQ topic exchange (default leasectl.DATABASE.SCHEMA, named
                                 when the relay starts), routing key = type, persistent,
                                 mandatory, publisher confirms, message_id = event id;
                                 properties=full adds type, app_id and aggregate headers
  nats://host:4222[?subject=PREFIX&stream=NAME]
                                 JetStream PREFIX.TYPE (default leasectl, stream LEASECTL),
                                 Nats-Msg-Id = event id
  http(s)://host/path            POST with Idempotency-Key = event id; 2xx = delivered

No answer within --timeout is the event's refusal only if the sink answered other deliveries
meanwhile; a sink that answers nobody is down and charges nothing. It ends the relay's wait, not
the request: a proxy or a network path that held it may still deliver it later, after newer
events of its aggregate; such a late copy is of an event the consumer has, so deduplicate on the
event id (Idempotency-Key, message_id, Nats-Msg-Id).

An event is published only while its batch's transaction is known to be open: the claim sets the
transaction's idle_in_transaction_session_timeout (11s, plus --timeout for exec: and webhooks;
a shorter one of the role or database is kept), and past 10s since its last answered statement
the relay confirms it with a round trip before publishing more, leaving the rest unpublished if it
ended; that deadline is looked at again where each event leaves (a webhook request's body as it
is written, exec:'s start, a broker publication). Every statement must be answered within 10s (LEASECTL_STATEMENT_TIMEOUT; VACUUM 60s), else
the relay warns, drops the connection and reconnects; --once exits 69 within 15s of a database
gone silent.

--format cloudevents publishes CloudEvents 1.0: a structured JSON event on stdout and exec:'s
stdin; binary mode (the payload as body) with ce-* headers over HTTP and NATS and cloudEvents:*
headers over AMQP.

Examples:
  leasectl relay --sink amqp://guest:guest@localhost/%2f
  leasectl relay --sink 'nats://localhost:4222?subject=orders'
  leasectl relay --sink https://hooks.example.com/leasectl --timeout 10s
  leasectl relay --once --sink 'exec:./deliver.sh'     # from cron: drain what is due, exit
  leasectl relay --once --sink stdout | jq .type        # look (stdout deletes what it printed,
                                                        # read or not: exec: confirms each event)
  leasectl relay --sink exec:./deliver.sh --metrics 127.0.0.1:9464   # Prometheus scrapes /metrics
  leasectl relay --sink https://hooks.example.com/ --format cloudevents --source /orders

Exit codes: 0 done (--once) or stopped by SIGINT/SIGTERM after the batch in hand; 1 --once, but
events went dead during the pass; 2 usage (also: --metrics cannot listen on ADDR); 69 database
unreachable or silent past a statement's deadline, a batch's transaction ended, or the sink
unreachable with --once (or stdout closed); 70 internal; 77 the role lacks a privilege.";

const EXPECT_HELP: &str = "\
A target is watched when it has an expectation or a schedule (stored by `run --slot`; `status`
says which). Each `expect` replaces the previous expectation whole; the schedule stays. --clear
forgets both: the target is no longer watched until a later `run --slot` stores its schedule
again, which then watches from that run on (no earlier slot counts as missed). Health is judged
on the database clock: `status` shows it, `check` exits 1 on a problem, and a running `relay`
turns each problem into one leasectl.target.<missed|overdue|failing|too_long> event and its end
into one leasectl.target.recovered event.

--grace applies to --every and to the schedule's slots [default: a tenth of the interval, at
most 1h].

Examples:
  leasectl expect --target nightly-report --every 1d --grace 2h
  leasectl expect --target deploy --max-duration 30m
  leasectl expect --target nightly-report --clear

Exit codes: 0 stored; 2 usage; 69 database unavailable; 70 internal; 77 the role lacks a privilege.";

#[derive(Debug, Args)]
#[command(group(clap::ArgGroup::new("what").required(true).multiple(true)
    .args(["every", "grace", "max_duration", "clear"])))]
pub struct ExpectArgs {
    /// The target to watch
    #[arg(long, value_parser = parse_target, value_name = "TARGET")]
    pub target: String,
    /// A successful run (exit 0) at least this often, else it is overdue
    #[arg(long, value_parser = parse_expected_duration, value_name = "DUR")]
    pub every: Option<Duration>,
    /// How late a run may be before it counts as overdue or its slot as missed
    #[arg(long, value_parser = parse_duration, value_name = "DUR")]
    pub grace: Option<Duration>,
    /// A holder running longer than this is "too long"
    #[arg(long, value_parser = parse_expected_duration, value_name = "DUR")]
    pub max_duration: Option<Duration>,
    /// Stop watching the target: forget the expectation and the schedule stored by `run --slot`
    /// (the next `run --slot` stores it again)
    #[arg(long, conflicts_with_all = ["every", "grace", "max_duration"])]
    pub clear: bool,
}

/// A duration for `--every` / `--max-duration`: at least a millisecond (the database stores
/// milliseconds, and "every 0s" means nothing).
fn parse_expected_duration(s: &str) -> Result<Duration, String> {
    let d = parse_duration(s)?;
    if d < Duration::from_millis(1) {
        return Err(format!("'{s}' is too short (at least 1ms)"));
    }
    Ok(d)
}

const CHECK_HELP: &str = "\
For monitoring (Nagios and the like) and for `&&` in scripts. Prints one line per unhealthy
watched target — its health (missed, overdue, failing, too long), since when (database clock)
and why — and nothing when all are ok. A --target that is not watched is reported as such.

Examples:
  leasectl check
  leasectl check --target nightly-report && echo fine

Exit codes: 0 every watched target (or each one named) is ok; 1 one is not, or is not watched;
2 usage; 69 database unavailable; 70 internal; 77 the role lacks a privilege.";

#[derive(Debug, Args)]
pub struct CheckArgs {
    /// Only these targets (repeatable) [default: every watched target]
    #[arg(long, value_parser = parse_target, value_name = "TARGET")]
    pub target: Vec<String>,
}

const MIGRATE_HELP: &str = "\
Run it as the role that owns the schema (or may create it). Other roles need not own anything:
--print-grants prints the SQL that lets one use every command; the owner applies it. Such a role
cannot create or upgrade the schema: after upgrading leasectl, the owner runs `migrate` first.

Examples:
  leasectl --database-url postgres://owner@db/app migrate
  leasectl migrate --print-grants app | psql -v ON_ERROR_STOP=1 postgres://owner@db/app

Exit codes: 0 done; 2 usage; 69 database unavailable; 70 internal error; 77 the role may not
create or upgrade the schema; 78 schema newer than leasectl.";

#[derive(Debug, Args)]
pub struct MigrateArgs {
    /// Print the SQL (GRANTs) that lets ROLE use the schema without owning it; no connection
    #[arg(long, value_name = "ROLE", value_parser = parse_role)]
    pub print_grants: Option<String>,
}

/// A role name for `--print-grants`: quoted in the SQL, so any text PostgreSQL accepts as a
/// name, except `public` (quoted or not, GRANT reads it as every role).
fn parse_role(s: &str) -> Result<String, String> {
    if s.is_empty() || s.len() > 63 || s.chars().any(char::is_control) {
        return Err(format!(
            "'{s}' is not a role name (1–63 bytes, no control characters)"
        ));
    }
    if s == "public" {
        return Err("'public' would grant to every role; name one role".to_owned());
    }
    Ok(s.to_owned())
}

const DOCTOR_HELP: &str = "\
Looks at the database (and with --sink the sink) the other commands would use, and prints one
line per check: `ok`, `warn` or `fail`, the name of the check, what it found and, for warn and
fail, what to do. It only looks: no migration, no row written (its reads run in read-only
transactions), nothing published. What the role cannot see (other roles' sessions, the standbys'
sync_state without pg_monitor) is a warning that says so, never an ok.

Checks: server (version), primary (not a standby), pooler (and its mode), schema (migrations and
their checksums), privileges (what the role lacks of `migrate --print-grants`, and what it holds
beyond them), replication (standbys, and whether this role's commits wait for a synchronous one),
statement_timeout, idle_in_transaction_session_timeout, max_connections, notify_queue, clock (this
host's against the database's), outbox (backlog, dead events), xmin_horizon (who holds it back),
failover (whether --ttl outlasts --failover-time), and sink (with --sink).

--json prints {\"ok\": BOOL, \"checks\": [{\"name\", \"status\", \"detail\", \"fix\"}]}: ok is false when a
check failed or the database is unreachable; fix is null for an ok check.

Examples:
  leasectl doctor
  leasectl doctor --ttl 30s --failover-time 20s
  leasectl doctor --sink https://hooks.example.com/leasectl --json | jq '.checks[] | select(.status != \"ok\")'

Exit codes: 0 no check failed (warnings allowed); 1 a check failed; 2 usage; 69 the database is
unreachable, refused the connection or stopped answering.";

#[derive(Debug, Args)]
pub struct DoctorArgs {
    /// One JSON document instead of lines
    #[arg(long)]
    pub json: bool,
    /// The --ttl your jobs run with, to check against the failover time [default: run's 2m]
    #[arg(long, value_parser = parse_duration, value_name = "DUR")]
    pub ttl: Option<Duration>,
    /// The --heartbeat your jobs run with [default: TTL/4]
    #[arg(long, value_parser = parse_duration, value_name = "DUR", requires = "ttl")]
    pub heartbeat: Option<Duration>,
    /// The --kill-after your jobs run with [default: the smaller of 10s and TTL/10]
    #[arg(long, value_parser = parse_duration, value_name = "DUR", requires = "ttl")]
    pub kill_after: Option<Duration>,
    /// How long a failover of your database takes, from the primary's loss to a writable new one
    /// [default: 30s, a typical automatic failover]
    #[arg(long, value_parser = parse_duration, value_name = "DUR")]
    pub failover_time: Option<Duration>,
    /// Connections your holders, waiters and relays open at their peak (a holder or waiter 1,
    /// a relay 2), to check max_connections' headroom
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    pub connections: Option<u32>,
    /// A relay's --sink to reach (connect, TLS, log in, look up the exchange or stream); nothing
    /// is published
    // Parsed in `cmd::doctor`, not by clap: clap's error would repeat the value, password and all.
    #[arg(long, value_name = "SINK")]
    pub sink: Option<String>,
    /// How long the sink may take to answer
    #[arg(long, value_parser = parse_duration, default_value = "10s", value_name = "DUR")]
    pub sink_timeout: Duration,
}

const OUTBOX_HELP: &str = "\
Examples:
  leasectl outbox list
  leasectl outbox list --dead --json
  leasectl outbox retry 0b6c5c2e-4f7e-4a8f-9d47-2a1f0e4c9b11
  leasectl outbox retry --all-dead
  leasectl outbox discard 0b6c5c2e-4f7e-4a8f-9d47-2a1f0e4c9b11 > discarded.json";

const PRUNE_HELP: &str = "\
Delivered events are deleted by the relay as it goes, so the outbox needs no pruning; dead
events stay until `outbox retry` or `outbox discard`.

Examples:
  leasectl prune --older-than 30d
  leasectl prune --older-than 7d --dry-run";

#[derive(Debug, Args)]
pub struct RelayArgs {
    /// Where to publish: stdout, exec:COMMAND, amqp://…, nats://…, http(s)://…
    // Parsed in `cmd::relay`, not by clap: clap's error would repeat the value, password and all.
    #[arg(long, value_name = "SINK")]
    pub sink: String,
    /// Events claimed per transaction
    #[arg(long, default_value_t = 100, value_name = "N", value_parser = clap::value_parser!(i64).range(1..=10_000))]
    pub batch: i64,
    /// Deliver what is due now, then exit (for cron); events waiting out a retry are left
    #[arg(long)]
    pub once: bool,
    /// Fallback poll interval; new events wake the relay at once through NOTIFY
    #[arg(long, value_parser = parse_poll, default_value = "5s", value_name = "DUR")]
    pub poll: Duration,
    /// Refusals before an event is dead (retries back off 1s, 2s, 4s … up to 5m)
    #[arg(long, default_value_t = 10, value_name = "N", value_parser = clap::value_parser!(i32).range(1..=1000))]
    pub max_attempts: i32,
    /// How long one delivery may take: HTTP response, broker confirm, command run
    #[arg(long, value_parser = parse_duration, default_value = "30s", value_name = "DUR")]
    pub timeout: Duration,
    /// Aggregates published at once within a batch [default: 64; amqp, nats: 1024; exec: 4; stdout: 1]
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u16).range(1..=1024))]
    pub parallel: Option<u16>,

    /// Order of an aggregate's events: insert (by seq, at once) or commit (only once every
    /// older transaction has ended; see the README)
    #[arg(long, value_parser = parse_order, default_value = "insert", value_name = "ORDER")]
    pub order: crate::model::order::Order,
    /// Payload bytes in flight (e.g. 4MiB), shared by the batch in hand and the next one claimed
    /// meanwhile; an event larger than that goes alone
    #[arg(long, value_parser = parse_byte_size, default_value = "16MiB", value_name = "BYTES")]
    pub batch_bytes: usize,

    /// Serve Prometheus metrics at http://ADDR/metrics (e.g. 127.0.0.1:9464)
    #[arg(long, value_name = "ADDR")]
    pub metrics: Option<std::net::SocketAddr>,

    /// What to publish: json (leasectl's event object) or cloudevents (CloudEvents 1.0:
    /// structured JSON for stdout and exec:, binary mode with ce-*/cloudEvents:* headers for
    /// http, amqp and nats)
    #[arg(long, value_enum, default_value = "json", value_name = "FORMAT")]
    pub format: RelayFormat,
    /// The CloudEvents source attribute, a URI-reference [default: leasectl://SCHEMA]
    #[arg(long, value_parser = crate::relay::sink::format::parse_source, value_name = "URI")]
    pub source: Option<String>,
}

/// `relay --format`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum RelayFormat {
    /// `{"id","aggregate_type","aggregate_id","type","payload","created_at"}`
    Json,
    /// CloudEvents 1.0
    #[value(name = "cloudevents")]
    CloudEvents,
}

#[derive(Debug, Subcommand)]
pub enum OutboxCommand {
    /// List undelivered events, oldest first, with their state and last error
    #[command(
        after_help = "States: pending, retrying (waiting out a backoff), scheduled (inserted for later),\nblocked (behind a dead or not yet due event of its aggregate), dead.\n\nExamples:\n  leasectl outbox list\n  leasectl outbox list --dead --json | jq -r '.events[].id'"
    )]
    List(OutboxListArgs),
    /// Make an event (or every dead one) due now, with a fresh attempt budget
    #[command(
        after_help = "Exits 1 when no such event is in the outbox.\n\nExamples:\n  leasectl outbox retry 0b6c5c2e-4f7e-4a8f-9d47-2a1f0e4c9b11\n  leasectl outbox retry --all-dead"
    )]
    Retry(OutboxRetryArgs),
    /// Delete a dead event, printing it as JSON on stdout so it is not lost
    #[command(
        after_help = "Exits 1 when no such event is in the outbox, or it is not dead and --force is missing.\n\nExample:\n  leasectl outbox discard 0b6c5c2e-4f7e-4a8f-9d47-2a1f0e4c9b11 >> discarded.jsonl"
    )]
    Discard(OutboxDiscardArgs),
}

#[derive(Debug, Args)]
pub struct OutboxListArgs {
    /// Only dead events
    #[arg(long)]
    pub dead: bool,
    /// At most N events
    #[arg(long, default_value_t = 100, value_name = "N", value_parser = clap::value_parser!(i64).range(1..))]
    pub limit: i64,
    /// One JSON document instead of a table
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct OutboxRetryArgs {
    /// The event's id
    #[arg(
        value_name = "ID",
        required_unless_present = "all_dead",
        conflicts_with = "all_dead"
    )]
    pub id: Option<uuid::Uuid>,
    /// Every dead event
    #[arg(long)]
    pub all_dead: bool,
}

#[derive(Debug, Args)]
pub struct OutboxDiscardArgs {
    /// The event's id
    #[arg(value_name = "ID")]
    pub id: uuid::Uuid,
    /// Discard it even though it is not dead (it is then never published)
    #[arg(long)]
    pub force: bool,
}

#[derive(Debug, Args)]
pub struct PruneArgs {
    /// Delete runs that finished more than DUR ago
    #[arg(long, value_parser = parse_duration, value_name = "DUR", required = true)]
    pub older_than: Duration,
    /// Only count what would be deleted
    #[arg(long)]
    pub dry_run: bool,
}

fn parse_order(s: &str) -> Result<crate::model::order::Order, String> {
    match s {
        "insert" => Ok(crate::model::order::Order::Insert),
        "commit" => Ok(crate::model::order::Order::Commit),
        _ => Err(format!("'{s}' is not an order (insert or commit)")),
    }
}

fn parse_poll(s: &str) -> Result<Duration, String> {
    let d = parse_duration(s)?;
    if d < Duration::from_millis(10) {
        return Err(format!(
            "'{s}' is too short for a poll interval (at least 10ms)"
        ));
    }
    Ok(d)
}

#[derive(Debug, Args)]
pub struct StatusArgs {
    /// Only this target
    #[arg(long, value_parser = parse_target, value_name = "TARGET")]
    pub target: Option<String>,
    /// One JSON document instead of a table
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct RunsArgs {
    /// The target whose runs to list
    #[arg(long, value_parser = parse_target, value_name = "TARGET")]
    pub target: String,
    /// At most N runs
    #[arg(long, default_value_t = 20, value_name = "N", value_parser = clap::value_parser!(i64).range(1..))]
    pub limit: i64,
    /// One JSON document instead of a table
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct OutputArgs {
    /// The target whose stored output to print
    #[arg(long, value_parser = parse_target, value_name = "TARGET")]
    pub target: String,
    /// This run instead of the newest one that was not lost
    #[arg(long, value_name = "ID")]
    pub run: Option<uuid::Uuid>,
    /// Print captured stderr instead of stdout
    #[arg(long)]
    pub stderr: bool,
}

#[derive(Debug, Args)]
#[command(group(clap::ArgGroup::new("how").required(true).args(["force", "token"])))]
pub struct ReleaseArgs {
    /// The target whose lease to end
    #[arg(long, value_parser = parse_target, value_name = "TARGET")]
    pub target: String,
    /// Break the lease whoever holds it: its holder stops (operator use)
    #[arg(long)]
    pub force: bool,
    /// End the lease this token holds (printed by `acquire`); exit 76 if it no longer does
    #[arg(long, value_name = "TOKEN", value_parser = crate::model::flags::parse_token)]
    pub token: Option<uuid::Uuid>,
    /// Return once the lease is broken, without waiting for a holder whose command still runs
    /// (a --force'd holder, or a step running under --token) to stop
    #[arg(long)]
    pub no_wait: bool,
}

#[derive(Debug, Args)]
pub struct EmitArgs {
    /// The event's aggregate type (e.g. invoice)
    #[arg(long, value_name = "TYPE")]
    pub aggregate_type: String,
    /// The event's aggregate id; events of one aggregate are published in order
    #[arg(long, value_name = "ID")]
    pub aggregate_id: String,
    /// The event type (e.g. invoice.sent)
    #[arg(long = "type", value_name = "TYPE")]
    pub event_type: String,
    /// The payload, a JSON value; without it, read from stdin
    #[arg(long, value_name = "JSON")]
    pub payload: Option<String>,
}

#[derive(Debug, Args)]
pub struct CompletionsArgs {
    #[arg(value_enum)]
    pub shell: clap_complete::Shell,
}
