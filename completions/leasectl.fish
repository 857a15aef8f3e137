# Print an optspec for argparse to handle cmd's options that are independent of any subcommand.
function __fish_leasectl_global_optspecs
    string join \n database-url= schema= v/verbose h/help V/version
end

function __fish_leasectl_needs_command
    # Figure out if the current invocation already has a command.
    set -l cmd (commandline -opc)
    set -e cmd[1]
    argparse -s (__fish_leasectl_global_optspecs) -- $cmd 2>/dev/null
    or return
    if set -q argv[1]
        # Also print the command, so this can be used to figure out what it is.
        echo $argv[1]
        return 1
    end
    return 0
end

function __fish_leasectl_using_subcommand
    set -l cmd (__fish_leasectl_needs_command)
    test -z "$cmd"
    and return 1
    contains -- $cmd[1] $argv
end

complete -c leasectl -n "__fish_leasectl_needs_command" -l database-url -d 'PostgreSQL URL or libpq "key=value" string [default: libpq environment, then local socket]' -r
complete -c leasectl -n "__fish_leasectl_needs_command" -l schema -d 'Schema holding leasectl\'s tables (letters, digits, underscore; at most 48 bytes)' -r
complete -c leasectl -n "__fish_leasectl_needs_command" -s v -l verbose -d 'Log lease transitions and retries to stderr'
complete -c leasectl -n "__fish_leasectl_needs_command" -s h -l help -d 'Print help'
complete -c leasectl -n "__fish_leasectl_needs_command" -s V -l version -d 'Print version'
complete -c leasectl -n "__fish_leasectl_needs_command" -f -a "run" -d 'Run COMMAND under a fenced heartbeat lease on TARGET'
complete -c leasectl -n "__fish_leasectl_needs_command" -f -a "acquire" -d 'Take a lease that outlives this process, for several steps (`run --token`); print its token'
complete -c leasectl -n "__fish_leasectl_needs_command" -f -a "renew" -d 'Extend a lease taken by `acquire` (between steps nothing renews it)'
complete -c leasectl -n "__fish_leasectl_needs_command" -f -a "status" -d 'Show each target\'s lease, its last run and the outbox backlog'
complete -c leasectl -n "__fish_leasectl_needs_command" -f -a "runs" -d 'List the recorded runs of a target, newest first'
complete -c leasectl -n "__fish_leasectl_needs_command" -f -a "output" -d 'Print the captured stdout (or stderr) of a stored run, byte for byte'
complete -c leasectl -n "__fish_leasectl_needs_command" -f -a "release" -d 'End a lease: one taken by `acquire` (--token), or break anyone\'s (--force)'
complete -c leasectl -n "__fish_leasectl_needs_command" -f -a "expect" -d 'Say what is expected of a target: a successful run every DUR, runs no longer than DUR'
complete -c leasectl -n "__fish_leasectl_needs_command" -f -a "check" -d 'Print one line per unhealthy watched target; exit 1 if there is any'
complete -c leasectl -n "__fish_leasectl_needs_command" -f -a "relay" -d 'Publish outbox events to RabbitMQ, NATS JetStream, a webhook, a command or stdout'
complete -c leasectl -n "__fish_leasectl_needs_command" -f -a "outbox" -d 'Inspect and repair undelivered outbox events'
complete -c leasectl -n "__fish_leasectl_needs_command" -f -a "prune" -d 'Delete runs older than a given age (each target keeps its newest run)'
complete -c leasectl -n "__fish_leasectl_needs_command" -f -a "migrate" -d 'Apply pending schema migrations (every command also does this itself), or print grants'
complete -c leasectl -n "__fish_leasectl_needs_command" -f -a "doctor" -d 'Inspect the deployment: one line per check (ok, warn or fail) with what to do; changes nothing'
complete -c leasectl -n "__fish_leasectl_needs_command" -f -a "emit" -d 'Append an outbox event to the running command\'s $LEASECTL_EVENTS (inside `leasectl run`)'
complete -c leasectl -n "__fish_leasectl_needs_command" -f -a "completions" -d 'Print shell completions'
complete -c leasectl -n "__fish_leasectl_needs_command" -f -a "help" -d 'Print this message or the help of the given subcommand(s)'
complete -c leasectl -n "__fish_leasectl_using_subcommand run" -l database-url -d 'PostgreSQL URL or libpq "key=value" string [default: libpq environment, then local socket]' -r
complete -c leasectl -n "__fish_leasectl_using_subcommand run" -l schema -d 'Schema holding leasectl\'s tables (letters, digits, underscore; at most 48 bytes)' -r
complete -c leasectl -n "__fish_leasectl_using_subcommand run" -l target -d 'What to hold the lease on: 1–200 characters, no control characters' -r
complete -c leasectl -n "__fish_leasectl_using_subcommand run" -l ttl -d 'The lease expires when not renewed for this long (database clock)' -r
complete -c leasectl -n "__fish_leasectl_using_subcommand run" -l wait -d 'When busy, wait for the lease (forever, or up to DUR) instead of exiting 75' -r
complete -c leasectl -n "__fish_leasectl_using_subcommand run" -l queue -d 'How waiters take turns: fifo (arrival order), latest (a new waiter supersedes every older one, which exits busy) or unordered (whoever asks first after a release)' -r -f -a "fifo\t''
latest\t''
unordered\t''"
complete -c leasectl -n "__fish_leasectl_using_subcommand run" -l wait-notice -d 'While waiting, say where we are in the queue every DUR (0: never) [default: 30s]' -r
complete -c leasectl -n "__fish_leasectl_using_subcommand run" -l label -d 'Shown with this caller wherever holders and waiters are (busy lines, status, runs): a commit SHA, a pipeline URL; at most 200 characters, no control characters' -r
complete -c leasectl -n "__fish_leasectl_using_subcommand run" -l max-holders -d 'Up to N holders at once, each in its own place (LEASECTL_HOLDER_INDEX 0…N−1); the N of the first holder stands until none is left' -r
complete -c leasectl -n "__fish_leasectl_using_subcommand run" -l busy-exit-code -d 'Exit code when another holder has the lease' -r
complete -c leasectl -n "__fish_leasectl_using_subcommand run" -l heartbeat -d 'Renewal interval, at least 10ms and TTL/1000 [default: TTL/4]' -r
complete -c leasectl -n "__fish_leasectl_using_subcommand run" -l token -d 'Run as a step under a lease taken by `acquire` (its TOKEN): renew it while the command runs, store the run with the same fenced save, keep the lease afterwards; 76 if the token no longer holds TARGET, 75 while another step runs (--wait waits for it)' -r
complete -c leasectl -n "__fish_leasectl_using_subcommand run" -l reuse-within -d 'Reuse the stored stdout of a successful run that finished less than DUR ago' -r
complete -c leasectl -n "__fish_leasectl_using_subcommand run" -l timeout -d 'Stop the command after DUR and exit 124' -r
complete -c leasectl -n "__fish_leasectl_using_subcommand run" -l kill-after -d 'Grace between SIGTERM and SIGKILL when the command must stop [default: min(10s, TTL/10)]' -r
complete -c leasectl -n "__fish_leasectl_using_subcommand run" -l event-type -d 'Type of the outbox event stored with the result' -r
complete -c leasectl -n "__fish_leasectl_using_subcommand run" -l capture-limit -d 'Bytes of stdout and of stderr stored per run (e.g. 64KiB, 1MiB); the rest still streams' -r
complete -c leasectl -n "__fish_leasectl_using_subcommand run" -l events-limit -d 'Bytes the command may write to $LEASECTL_EVENTS (its own outbox events); more stores the run without any of them and exits 65' -r
complete -c leasectl -n "__fish_leasectl_using_subcommand run" -l slot -d 'Run at most once per slot of this cron schedule (5 fields or @hourly, @daily, @weekly, @monthly, @yearly, @annually): a caller whose slot any host already did, or is doing, records a skip and exits 0' -r
complete -c leasectl -n "__fish_leasectl_using_subcommand run" -l slot-tz -d 'Time zone of --slot\'s schedule (IANA name, e.g. Europe/Berlin, from the system\'s time zone database: /usr/share/zoneinfo, or $TZDIR) [default: UTC]' -r
complete -c leasectl -n "__fish_leasectl_using_subcommand run" -l slot-skew -d 'How early a caller may fire and still belong to the coming slot [default: 1m, or a quarter of the schedule\'s shortest interval if less]' -r
complete -c leasectl -n "__fish_leasectl_using_subcommand run" -l done-exit-code -d 'Exit code of a caller that finds its slot already done, or being done' -r
complete -c leasectl -n "__fish_leasectl_using_subcommand run" -s v -l verbose -d 'Log lease transitions and retries to stderr'
complete -c leasectl -n "__fish_leasectl_using_subcommand run" -l replace -d 'Take the lease even from a live holder (the oldest, with --max-holders): it is told to stop, records its run `preempted` and exits 76; ours starts only once it has stopped'
complete -c leasectl -n "__fish_leasectl_using_subcommand run" -l no-event -d 'Store the result without an outbox event'
complete -c leasectl -n "__fish_leasectl_using_subcommand run" -s q -l quiet -d 'Capture the command\'s output without echoing it'
complete -c leasectl -n "__fish_leasectl_using_subcommand run" -l until-success -d 'Only a run that exited 0 does its slot: after a failure the next caller runs again'
complete -c leasectl -n "__fish_leasectl_using_subcommand run" -s h -l help -d 'Print help'
complete -c leasectl -n "__fish_leasectl_using_subcommand run" -s V -l version -d 'Print version'
complete -c leasectl -n "__fish_leasectl_using_subcommand acquire" -l database-url -d 'PostgreSQL URL or libpq "key=value" string [default: libpq environment, then local socket]' -r
complete -c leasectl -n "__fish_leasectl_using_subcommand acquire" -l schema -d 'Schema holding leasectl\'s tables (letters, digits, underscore; at most 48 bytes)' -r
complete -c leasectl -n "__fish_leasectl_using_subcommand acquire" -l target -d 'What to hold the lease on: 1–200 characters, no control characters' -r
complete -c leasectl -n "__fish_leasectl_using_subcommand acquire" -l ttl -d 'The lease expires when not renewed for this long (database clock)' -r
complete -c leasectl -n "__fish_leasectl_using_subcommand acquire" -l wait -d 'When busy, wait for the lease (forever, or up to DUR) instead of exiting 75' -r
complete -c leasectl -n "__fish_leasectl_using_subcommand acquire" -l queue -d 'How waiters take turns: fifo (arrival order), latest (a new waiter supersedes every older one, which exits busy) or unordered (whoever asks first after a release)' -r -f -a "fifo\t''
latest\t''
unordered\t''"
complete -c leasectl -n "__fish_leasectl_using_subcommand acquire" -l wait-notice -d 'While waiting, say where we are in the queue every DUR (0: never) [default: 30s]' -r
complete -c leasectl -n "__fish_leasectl_using_subcommand acquire" -l label -d 'Shown with this caller wherever holders and waiters are (busy lines, status, runs): a commit SHA, a pipeline URL; at most 200 characters, no control characters' -r
complete -c leasectl -n "__fish_leasectl_using_subcommand acquire" -l max-holders -d 'Up to N holders at once, each in its own place (LEASECTL_HOLDER_INDEX 0…N−1); the N of the first holder stands until none is left' -r
complete -c leasectl -n "__fish_leasectl_using_subcommand acquire" -l busy-exit-code -d 'Exit code when another holder has the lease' -r
complete -c leasectl -n "__fish_leasectl_using_subcommand acquire" -l format -d 'How to print the lease' -r -f -a "sh\t'`export NAME=\'value\'` lines, for eval'
env\t'`NAME=value` lines, for $GITHUB_ENV or a dotenv file'
json\t'One JSON object'"
complete -c leasectl -n "__fish_leasectl_using_subcommand acquire" -s v -l verbose -d 'Log lease transitions and retries to stderr'
complete -c leasectl -n "__fish_leasectl_using_subcommand acquire" -l replace -d 'Take the lease even from a live holder (the oldest, with --max-holders): it is told to stop, records its run `preempted` and exits 76; ours starts only once it has stopped'
complete -c leasectl -n "__fish_leasectl_using_subcommand acquire" -s h -l help -d 'Print help (see more with \'--help\')'
complete -c leasectl -n "__fish_leasectl_using_subcommand acquire" -s V -l version -d 'Print version'
complete -c leasectl -n "__fish_leasectl_using_subcommand renew" -l database-url -d 'PostgreSQL URL or libpq "key=value" string [default: libpq environment, then local socket]' -r
complete -c leasectl -n "__fish_leasectl_using_subcommand renew" -l schema -d 'Schema holding leasectl\'s tables (letters, digits, underscore; at most 48 bytes)' -r
complete -c leasectl -n "__fish_leasectl_using_subcommand renew" -l target -d 'The target the lease is on' -r
complete -c leasectl -n "__fish_leasectl_using_subcommand renew" -l token -d 'The token `acquire` printed' -r
complete -c leasectl -n "__fish_leasectl_using_subcommand renew" -l ttl -d 'From now on, the lease expires when not renewed for this long [default: its TTL]' -r
complete -c leasectl -n "__fish_leasectl_using_subcommand renew" -s v -l verbose -d 'Log lease transitions and retries to stderr'
complete -c leasectl -n "__fish_leasectl_using_subcommand renew" -s h -l help -d 'Print help'
complete -c leasectl -n "__fish_leasectl_using_subcommand renew" -s V -l version -d 'Print version'
complete -c leasectl -n "__fish_leasectl_using_subcommand status" -l database-url -d 'PostgreSQL URL or libpq "key=value" string [default: libpq environment, then local socket]' -r
complete -c leasectl -n "__fish_leasectl_using_subcommand status" -l schema -d 'Schema holding leasectl\'s tables (letters, digits, underscore; at most 48 bytes)' -r
complete -c leasectl -n "__fish_leasectl_using_subcommand status" -l target -d 'Only this target' -r
complete -c leasectl -n "__fish_leasectl_using_subcommand status" -s v -l verbose -d 'Log lease transitions and retries to stderr'
complete -c leasectl -n "__fish_leasectl_using_subcommand status" -l json -d 'One JSON document instead of a table'
complete -c leasectl -n "__fish_leasectl_using_subcommand status" -s h -l help -d 'Print help'
complete -c leasectl -n "__fish_leasectl_using_subcommand status" -s V -l version -d 'Print version'
complete -c leasectl -n "__fish_leasectl_using_subcommand runs" -l database-url -d 'PostgreSQL URL or libpq "key=value" string [default: libpq environment, then local socket]' -r
complete -c leasectl -n "__fish_leasectl_using_subcommand runs" -l schema -d 'Schema holding leasectl\'s tables (letters, digits, underscore; at most 48 bytes)' -r
complete -c leasectl -n "__fish_leasectl_using_subcommand runs" -l target -d 'The target whose runs to list' -r
complete -c leasectl -n "__fish_leasectl_using_subcommand runs" -l limit -d 'At most N runs' -r
complete -c leasectl -n "__fish_leasectl_using_subcommand runs" -s v -l verbose -d 'Log lease transitions and retries to stderr'
complete -c leasectl -n "__fish_leasectl_using_subcommand runs" -l json -d 'One JSON document instead of a table'
complete -c leasectl -n "__fish_leasectl_using_subcommand runs" -s h -l help -d 'Print help'
complete -c leasectl -n "__fish_leasectl_using_subcommand runs" -s V -l version -d 'Print version'
complete -c leasectl -n "__fish_leasectl_using_subcommand output" -l database-url -d 'PostgreSQL URL or libpq "key=value" string [default: libpq environment, then local socket]' -r
complete -c leasectl -n "__fish_leasectl_using_subcommand output" -l schema -d 'Schema holding leasectl\'s tables (letters, digits, underscore; at most 48 bytes)' -r
complete -c leasectl -n "__fish_leasectl_using_subcommand output" -l target -d 'The target whose stored output to print' -r
complete -c leasectl -n "__fish_leasectl_using_subcommand output" -l run -d 'This run instead of the newest one that was not lost' -r
complete -c leasectl -n "__fish_leasectl_using_subcommand output" -s v -l verbose -d 'Log lease transitions and retries to stderr'
complete -c leasectl -n "__fish_leasectl_using_subcommand output" -l stderr -d 'Print captured stderr instead of stdout'
complete -c leasectl -n "__fish_leasectl_using_subcommand output" -s h -l help -d 'Print help'
complete -c leasectl -n "__fish_leasectl_using_subcommand output" -s V -l version -d 'Print version'
complete -c leasectl -n "__fish_leasectl_using_subcommand release" -l database-url -d 'PostgreSQL URL or libpq "key=value" string [default: libpq environment, then local socket]' -r
complete -c leasectl -n "__fish_leasectl_using_subcommand release" -l schema -d 'Schema holding leasectl\'s tables (letters, digits, underscore; at most 48 bytes)' -r
complete -c leasectl -n "__fish_leasectl_using_subcommand release" -l target -d 'The target whose lease to end' -r
complete -c leasectl -n "__fish_leasectl_using_subcommand release" -l token -d 'End the lease this token holds (printed by `acquire`); exit 76 if it no longer does' -r
complete -c leasectl -n "__fish_leasectl_using_subcommand release" -s v -l verbose -d 'Log lease transitions and retries to stderr'
complete -c leasectl -n "__fish_leasectl_using_subcommand release" -l force -d 'Break the lease whoever holds it: its holder stops (operator use)'
complete -c leasectl -n "__fish_leasectl_using_subcommand release" -l no-wait -d 'Return once the lease is broken, without waiting for a holder whose command still runs (a --force\'d holder, or a step running under --token) to stop'
complete -c leasectl -n "__fish_leasectl_using_subcommand release" -s h -l help -d 'Print help'
complete -c leasectl -n "__fish_leasectl_using_subcommand release" -s V -l version -d 'Print version'
complete -c leasectl -n "__fish_leasectl_using_subcommand expect" -l database-url -d 'PostgreSQL URL or libpq "key=value" string [default: libpq environment, then local socket]' -r
complete -c leasectl -n "__fish_leasectl_using_subcommand expect" -l schema -d 'Schema holding leasectl\'s tables (letters, digits, underscore; at most 48 bytes)' -r
complete -c leasectl -n "__fish_leasectl_using_subcommand expect" -l target -d 'The target to watch' -r
complete -c leasectl -n "__fish_leasectl_using_subcommand expect" -l every -d 'A successful run (exit 0) at least this often, else it is overdue' -r
complete -c leasectl -n "__fish_leasectl_using_subcommand expect" -l grace -d 'How late a run may be before it counts as overdue or its slot as missed' -r
complete -c leasectl -n "__fish_leasectl_using_subcommand expect" -l max-duration -d 'A holder running longer than this is "too long"' -r
complete -c leasectl -n "__fish_leasectl_using_subcommand expect" -s v -l verbose -d 'Log lease transitions and retries to stderr'
complete -c leasectl -n "__fish_leasectl_using_subcommand expect" -l clear -d 'Stop watching the target: forget the expectation and the schedule stored by `run --slot` (the next `run --slot` stores it again)'
complete -c leasectl -n "__fish_leasectl_using_subcommand expect" -s h -l help -d 'Print help'
complete -c leasectl -n "__fish_leasectl_using_subcommand expect" -s V -l version -d 'Print version'
complete -c leasectl -n "__fish_leasectl_using_subcommand check" -l database-url -d 'PostgreSQL URL or libpq "key=value" string [default: libpq environment, then local socket]' -r
complete -c leasectl -n "__fish_leasectl_using_subcommand check" -l schema -d 'Schema holding leasectl\'s tables (letters, digits, underscore; at most 48 bytes)' -r
complete -c leasectl -n "__fish_leasectl_using_subcommand check" -l target -d 'Only these targets (repeatable) [default: every watched target]' -r
complete -c leasectl -n "__fish_leasectl_using_subcommand check" -s v -l verbose -d 'Log lease transitions and retries to stderr'
complete -c leasectl -n "__fish_leasectl_using_subcommand check" -s h -l help -d 'Print help'
complete -c leasectl -n "__fish_leasectl_using_subcommand check" -s V -l version -d 'Print version'
complete -c leasectl -n "__fish_leasectl_using_subcommand relay" -l database-url -d 'PostgreSQL URL or libpq "key=value" string [default: libpq environment, then local socket]' -r
complete -c leasectl -n "__fish_leasectl_using_subcommand relay" -l schema -d 'Schema holding leasectl\'s tables (letters, digits, underscore; at most 48 bytes)' -r
complete -c leasectl -n "__fish_leasectl_using_subcommand relay" -l sink -d 'Where to publish: stdout, exec:COMMAND, amqp://…, nats://…, http(s)://…' -r
complete -c leasectl -n "__fish_leasectl_using_subcommand relay" -l batch -d 'Events claimed per transaction' -r
complete -c leasectl -n "__fish_leasectl_using_subcommand relay" -l poll -d 'Fallback poll interval; new events wake the relay at once through NOTIFY' -r
complete -c leasectl -n "__fish_leasectl_using_subcommand relay" -l max-attempts -d 'Refusals before an event is dead (retries back off 1s, 2s, 4s … up to 5m)' -r
complete -c leasectl -n "__fish_leasectl_using_subcommand relay" -l timeout -d 'How long one delivery may take: HTTP response, broker confirm, command run' -r
complete -c leasectl -n "__fish_leasectl_using_subcommand relay" -l parallel -d 'Aggregates published at once within a batch [default: 64; amqp, nats: 1024; exec: 4; stdout: 1]' -r
complete -c leasectl -n "__fish_leasectl_using_subcommand relay" -l order -d 'Order of an aggregate\'s events: insert (by seq, at once) or commit (only once every older transaction has ended; see the README)' -r
complete -c leasectl -n "__fish_leasectl_using_subcommand relay" -l batch-bytes -d 'Payload bytes in flight (e.g. 4MiB), shared by the batch in hand and the next one claimed meanwhile; an event larger than that goes alone' -r
complete -c leasectl -n "__fish_leasectl_using_subcommand relay" -l metrics -d 'Serve Prometheus metrics at http://ADDR/metrics (e.g. 127.0.0.1:9464)' -r
complete -c leasectl -n "__fish_leasectl_using_subcommand relay" -l format -d 'What to publish: json (leasectl\'s event object) or cloudevents (CloudEvents 1.0: structured JSON for stdout and exec:, binary mode with ce-*/cloudEvents:* headers for http, amqp and nats)' -r -f -a "json\t'`{"id","aggregate_type","aggregate_id","type","payload","created_at"}`'
cloudevents\t'CloudEvents 1.0'"
complete -c leasectl -n "__fish_leasectl_using_subcommand relay" -l source -d 'The CloudEvents source attribute, a URI-reference [default: leasectl://SCHEMA]' -r
complete -c leasectl -n "__fish_leasectl_using_subcommand relay" -s v -l verbose -d 'Log lease transitions and retries to stderr'
complete -c leasectl -n "__fish_leasectl_using_subcommand relay" -l once -d 'Deliver what is due now, then exit (for cron); events waiting out a retry are left'
complete -c leasectl -n "__fish_leasectl_using_subcommand relay" -s h -l help -d 'Print help (see more with \'--help\')'
complete -c leasectl -n "__fish_leasectl_using_subcommand relay" -s V -l version -d 'Print version'
complete -c leasectl -n "__fish_leasectl_using_subcommand outbox; and not __fish_seen_subcommand_from list retry discard help" -l database-url -d 'PostgreSQL URL or libpq "key=value" string [default: libpq environment, then local socket]' -r
complete -c leasectl -n "__fish_leasectl_using_subcommand outbox; and not __fish_seen_subcommand_from list retry discard help" -l schema -d 'Schema holding leasectl\'s tables (letters, digits, underscore; at most 48 bytes)' -r
complete -c leasectl -n "__fish_leasectl_using_subcommand outbox; and not __fish_seen_subcommand_from list retry discard help" -s v -l verbose -d 'Log lease transitions and retries to stderr'
complete -c leasectl -n "__fish_leasectl_using_subcommand outbox; and not __fish_seen_subcommand_from list retry discard help" -s h -l help -d 'Print help'
complete -c leasectl -n "__fish_leasectl_using_subcommand outbox; and not __fish_seen_subcommand_from list retry discard help" -s V -l version -d 'Print version'
complete -c leasectl -n "__fish_leasectl_using_subcommand outbox; and not __fish_seen_subcommand_from list retry discard help" -f -a "list" -d 'List undelivered events, oldest first, with their state and last error'
complete -c leasectl -n "__fish_leasectl_using_subcommand outbox; and not __fish_seen_subcommand_from list retry discard help" -f -a "retry" -d 'Make an event (or every dead one) due now, with a fresh attempt budget'
complete -c leasectl -n "__fish_leasectl_using_subcommand outbox; and not __fish_seen_subcommand_from list retry discard help" -f -a "discard" -d 'Delete a dead event, printing it as JSON on stdout so it is not lost'
complete -c leasectl -n "__fish_leasectl_using_subcommand outbox; and not __fish_seen_subcommand_from list retry discard help" -f -a "help" -d 'Print this message or the help of the given subcommand(s)'
complete -c leasectl -n "__fish_leasectl_using_subcommand outbox; and __fish_seen_subcommand_from list" -l limit -d 'At most N events' -r
complete -c leasectl -n "__fish_leasectl_using_subcommand outbox; and __fish_seen_subcommand_from list" -l database-url -d 'PostgreSQL URL or libpq "key=value" string [default: libpq environment, then local socket]' -r
complete -c leasectl -n "__fish_leasectl_using_subcommand outbox; and __fish_seen_subcommand_from list" -l schema -d 'Schema holding leasectl\'s tables (letters, digits, underscore; at most 48 bytes)' -r
complete -c leasectl -n "__fish_leasectl_using_subcommand outbox; and __fish_seen_subcommand_from list" -l dead -d 'Only dead events'
complete -c leasectl -n "__fish_leasectl_using_subcommand outbox; and __fish_seen_subcommand_from list" -l json -d 'One JSON document instead of a table'
complete -c leasectl -n "__fish_leasectl_using_subcommand outbox; and __fish_seen_subcommand_from list" -s v -l verbose -d 'Log lease transitions and retries to stderr'
complete -c leasectl -n "__fish_leasectl_using_subcommand outbox; and __fish_seen_subcommand_from list" -s h -l help -d 'Print help'
complete -c leasectl -n "__fish_leasectl_using_subcommand outbox; and __fish_seen_subcommand_from list" -s V -l version -d 'Print version'
complete -c leasectl -n "__fish_leasectl_using_subcommand outbox; and __fish_seen_subcommand_from retry" -l database-url -d 'PostgreSQL URL or libpq "key=value" string [default: libpq environment, then local socket]' -r
complete -c leasectl -n "__fish_leasectl_using_subcommand outbox; and __fish_seen_subcommand_from retry" -l schema -d 'Schema holding leasectl\'s tables (letters, digits, underscore; at most 48 bytes)' -r
complete -c leasectl -n "__fish_leasectl_using_subcommand outbox; and __fish_seen_subcommand_from retry" -l all-dead -d 'Every dead event'
complete -c leasectl -n "__fish_leasectl_using_subcommand outbox; and __fish_seen_subcommand_from retry" -s v -l verbose -d 'Log lease transitions and retries to stderr'
complete -c leasectl -n "__fish_leasectl_using_subcommand outbox; and __fish_seen_subcommand_from retry" -s h -l help -d 'Print help'
complete -c leasectl -n "__fish_leasectl_using_subcommand outbox; and __fish_seen_subcommand_from retry" -s V -l version -d 'Print version'
complete -c leasectl -n "__fish_leasectl_using_subcommand outbox; and __fish_seen_subcommand_from discard" -l database-url -d 'PostgreSQL URL or libpq "key=value" string [default: libpq environment, then local socket]' -r
complete -c leasectl -n "__fish_leasectl_using_subcommand outbox; and __fish_seen_subcommand_from discard" -l schema -d 'Schema holding leasectl\'s tables (letters, digits, underscore; at most 48 bytes)' -r
complete -c leasectl -n "__fish_leasectl_using_subcommand outbox; and __fish_seen_subcommand_from discard" -l force -d 'Discard it even though it is not dead (it is then never published)'
complete -c leasectl -n "__fish_leasectl_using_subcommand outbox; and __fish_seen_subcommand_from discard" -s v -l verbose -d 'Log lease transitions and retries to stderr'
complete -c leasectl -n "__fish_leasectl_using_subcommand outbox; and __fish_seen_subcommand_from discard" -s h -l help -d 'Print help'
complete -c leasectl -n "__fish_leasectl_using_subcommand outbox; and __fish_seen_subcommand_from discard" -s V -l version -d 'Print version'
complete -c leasectl -n "__fish_leasectl_using_subcommand outbox; and __fish_seen_subcommand_from help" -f -a "list" -d 'List undelivered events, oldest first, with their state and last error'
complete -c leasectl -n "__fish_leasectl_using_subcommand outbox; and __fish_seen_subcommand_from help" -f -a "retry" -d 'Make an event (or every dead one) due now, with a fresh attempt budget'
complete -c leasectl -n "__fish_leasectl_using_subcommand outbox; and __fish_seen_subcommand_from help" -f -a "discard" -d 'Delete a dead event, printing it as JSON on stdout so it is not lost'
complete -c leasectl -n "__fish_leasectl_using_subcommand outbox; and __fish_seen_subcommand_from help" -f -a "help" -d 'Print this message or the help of the given subcommand(s)'
complete -c leasectl -n "__fish_leasectl_using_subcommand prune" -l database-url -d 'PostgreSQL URL or libpq "key=value" string [default: libpq environment, then local socket]' -r
complete -c leasectl -n "__fish_leasectl_using_subcommand prune" -l schema -d 'Schema holding leasectl\'s tables (letters, digits, underscore; at most 48 bytes)' -r
complete -c leasectl -n "__fish_leasectl_using_subcommand prune" -l older-than -d 'Delete runs that finished more than DUR ago' -r
complete -c leasectl -n "__fish_leasectl_using_subcommand prune" -s v -l verbose -d 'Log lease transitions and retries to stderr'
complete -c leasectl -n "__fish_leasectl_using_subcommand prune" -l dry-run -d 'Only count what would be deleted'
complete -c leasectl -n "__fish_leasectl_using_subcommand prune" -s h -l help -d 'Print help'
complete -c leasectl -n "__fish_leasectl_using_subcommand prune" -s V -l version -d 'Print version'
complete -c leasectl -n "__fish_leasectl_using_subcommand migrate" -l database-url -d 'PostgreSQL URL or libpq "key=value" string [default: libpq environment, then local socket]' -r
complete -c leasectl -n "__fish_leasectl_using_subcommand migrate" -l schema -d 'Schema holding leasectl\'s tables (letters, digits, underscore; at most 48 bytes)' -r
complete -c leasectl -n "__fish_leasectl_using_subcommand migrate" -l print-grants -d 'Print the SQL (GRANTs) that lets ROLE use the schema without owning it; no connection' -r
complete -c leasectl -n "__fish_leasectl_using_subcommand migrate" -s v -l verbose -d 'Log lease transitions and retries to stderr'
complete -c leasectl -n "__fish_leasectl_using_subcommand migrate" -s h -l help -d 'Print help'
complete -c leasectl -n "__fish_leasectl_using_subcommand migrate" -s V -l version -d 'Print version'
complete -c leasectl -n "__fish_leasectl_using_subcommand doctor" -l database-url -d 'PostgreSQL URL or libpq "key=value" string [default: libpq environment, then local socket]' -r
complete -c leasectl -n "__fish_leasectl_using_subcommand doctor" -l schema -d 'Schema holding leasectl\'s tables (letters, digits, underscore; at most 48 bytes)' -r
complete -c leasectl -n "__fish_leasectl_using_subcommand doctor" -l ttl -d 'The --ttl your jobs run with, to check against the failover time [default: run\'s 2m]' -r
complete -c leasectl -n "__fish_leasectl_using_subcommand doctor" -l heartbeat -d 'The --heartbeat your jobs run with [default: TTL/4]' -r
complete -c leasectl -n "__fish_leasectl_using_subcommand doctor" -l kill-after -d 'The --kill-after your jobs run with [default: the smaller of 10s and TTL/10]' -r
complete -c leasectl -n "__fish_leasectl_using_subcommand doctor" -l failover-time -d 'How long a failover of your database takes, from the primary\'s loss to a writable new one [default: 30s, a typical automatic failover]' -r
complete -c leasectl -n "__fish_leasectl_using_subcommand doctor" -l connections -d 'Connections your holders, waiters and relays open at their peak (a holder or waiter 1, a relay 2), to check max_connections\' headroom' -r
complete -c leasectl -n "__fish_leasectl_using_subcommand doctor" -l sink -d 'A relay\'s --sink to reach (connect, TLS, log in, look up the exchange or stream); nothing is published' -r
complete -c leasectl -n "__fish_leasectl_using_subcommand doctor" -l sink-timeout -d 'How long the sink may take to answer' -r
complete -c leasectl -n "__fish_leasectl_using_subcommand doctor" -s v -l verbose -d 'Log lease transitions and retries to stderr'
complete -c leasectl -n "__fish_leasectl_using_subcommand doctor" -l json -d 'One JSON document instead of lines'
complete -c leasectl -n "__fish_leasectl_using_subcommand doctor" -s h -l help -d 'Print help'
complete -c leasectl -n "__fish_leasectl_using_subcommand doctor" -s V -l version -d 'Print version'
complete -c leasectl -n "__fish_leasectl_using_subcommand emit" -l database-url -d 'PostgreSQL URL or libpq "key=value" string [default: libpq environment, then local socket]' -r
complete -c leasectl -n "__fish_leasectl_using_subcommand emit" -l schema -d 'Schema holding leasectl\'s tables (letters, digits, underscore; at most 48 bytes)' -r
complete -c leasectl -n "__fish_leasectl_using_subcommand emit" -l aggregate-type -d 'The event\'s aggregate type (e.g. invoice)' -r
complete -c leasectl -n "__fish_leasectl_using_subcommand emit" -l aggregate-id -d 'The event\'s aggregate id; events of one aggregate are published in order' -r
complete -c leasectl -n "__fish_leasectl_using_subcommand emit" -l type -d 'The event type (e.g. invoice.sent)' -r
complete -c leasectl -n "__fish_leasectl_using_subcommand emit" -l payload -d 'The payload, a JSON value; without it, read from stdin' -r
complete -c leasectl -n "__fish_leasectl_using_subcommand emit" -s v -l verbose -d 'Log lease transitions and retries to stderr'
complete -c leasectl -n "__fish_leasectl_using_subcommand emit" -s h -l help -d 'Print help'
complete -c leasectl -n "__fish_leasectl_using_subcommand emit" -s V -l version -d 'Print version'
complete -c leasectl -n "__fish_leasectl_using_subcommand completions" -l database-url -d 'PostgreSQL URL or libpq "key=value" string [default: libpq environment, then local socket]' -r
complete -c leasectl -n "__fish_leasectl_using_subcommand completions" -l schema -d 'Schema holding leasectl\'s tables (letters, digits, underscore; at most 48 bytes)' -r
complete -c leasectl -n "__fish_leasectl_using_subcommand completions" -s v -l verbose -d 'Log lease transitions and retries to stderr'
complete -c leasectl -n "__fish_leasectl_using_subcommand completions" -s h -l help -d 'Print help'
complete -c leasectl -n "__fish_leasectl_using_subcommand completions" -s V -l version -d 'Print version'
complete -c leasectl -n "__fish_leasectl_using_subcommand help; and not __fish_seen_subcommand_from run acquire renew status runs output release expect check relay outbox prune migrate doctor emit completions help" -f -a "run" -d 'Run COMMAND under a fenced heartbeat lease on TARGET'
complete -c leasectl -n "__fish_leasectl_using_subcommand help; and not __fish_seen_subcommand_from run acquire renew status runs output release expect check relay outbox prune migrate doctor emit completions help" -f -a "acquire" -d 'Take a lease that outlives this process, for several steps (`run --token`); print its token'
complete -c leasectl -n "__fish_leasectl_using_subcommand help; and not __fish_seen_subcommand_from run acquire renew status runs output release expect check relay outbox prune migrate doctor emit completions help" -f -a "renew" -d 'Extend a lease taken by `acquire` (between steps nothing renews it)'
complete -c leasectl -n "__fish_leasectl_using_subcommand help; and not __fish_seen_subcommand_from run acquire renew status runs output release expect check relay outbox prune migrate doctor emit completions help" -f -a "status" -d 'Show each target\'s lease, its last run and the outbox backlog'
complete -c leasectl -n "__fish_leasectl_using_subcommand help; and not __fish_seen_subcommand_from run acquire renew status runs output release expect check relay outbox prune migrate doctor emit completions help" -f -a "runs" -d 'List the recorded runs of a target, newest first'
complete -c leasectl -n "__fish_leasectl_using_subcommand help; and not __fish_seen_subcommand_from run acquire renew status runs output release expect check relay outbox prune migrate doctor emit completions help" -f -a "output" -d 'Print the captured stdout (or stderr) of a stored run, byte for byte'
complete -c leasectl -n "__fish_leasectl_using_subcommand help; and not __fish_seen_subcommand_from run acquire renew status runs output release expect check relay outbox prune migrate doctor emit completions help" -f -a "release" -d 'End a lease: one taken by `acquire` (--token), or break anyone\'s (--force)'
complete -c leasectl -n "__fish_leasectl_using_subcommand help; and not __fish_seen_subcommand_from run acquire renew status runs output release expect check relay outbox prune migrate doctor emit completions help" -f -a "expect" -d 'Say what is expected of a target: a successful run every DUR, runs no longer than DUR'
complete -c leasectl -n "__fish_leasectl_using_subcommand help; and not __fish_seen_subcommand_from run acquire renew status runs output release expect check relay outbox prune migrate doctor emit completions help" -f -a "check" -d 'Print one line per unhealthy watched target; exit 1 if there is any'
complete -c leasectl -n "__fish_leasectl_using_subcommand help; and not __fish_seen_subcommand_from run acquire renew status runs output release expect check relay outbox prune migrate doctor emit completions help" -f -a "relay" -d 'Publish outbox events to RabbitMQ, NATS JetStream, a webhook, a command or stdout'
complete -c leasectl -n "__fish_leasectl_using_subcommand help; and not __fish_seen_subcommand_from run acquire renew status runs output release expect check relay outbox prune migrate doctor emit completions help" -f -a "outbox" -d 'Inspect and repair undelivered outbox events'
complete -c leasectl -n "__fish_leasectl_using_subcommand help; and not __fish_seen_subcommand_from run acquire renew status runs output release expect check relay outbox prune migrate doctor emit completions help" -f -a "prune" -d 'Delete runs older than a given age (each target keeps its newest run)'
complete -c leasectl -n "__fish_leasectl_using_subcommand help; and not __fish_seen_subcommand_from run acquire renew status runs output release expect check relay outbox prune migrate doctor emit completions help" -f -a "migrate" -d 'Apply pending schema migrations (every command also does this itself), or print grants'
complete -c leasectl -n "__fish_leasectl_using_subcommand help; and not __fish_seen_subcommand_from run acquire renew status runs output release expect check relay outbox prune migrate doctor emit completions help" -f -a "doctor" -d 'Inspect the deployment: one line per check (ok, warn or fail) with what to do; changes nothing'
complete -c leasectl -n "__fish_leasectl_using_subcommand help; and not __fish_seen_subcommand_from run acquire renew status runs output release expect check relay outbox prune migrate doctor emit completions help" -f -a "emit" -d 'Append an outbox event to the running command\'s $LEASECTL_EVENTS (inside `leasectl run`)'
complete -c leasectl -n "__fish_leasectl_using_subcommand help; and not __fish_seen_subcommand_from run acquire renew status runs output release expect check relay outbox prune migrate doctor emit completions help" -f -a "completions" -d 'Print shell completions'
complete -c leasectl -n "__fish_leasectl_using_subcommand help; and not __fish_seen_subcommand_from run acquire renew status runs output release expect check relay outbox prune migrate doctor emit completions help" -f -a "help" -d 'Print this message or the help of the given subcommand(s)'
complete -c leasectl -n "__fish_leasectl_using_subcommand help; and __fish_seen_subcommand_from outbox" -f -a "list" -d 'List undelivered events, oldest first, with their state and last error'
complete -c leasectl -n "__fish_leasectl_using_subcommand help; and __fish_seen_subcommand_from outbox" -f -a "retry" -d 'Make an event (or every dead one) due now, with a fresh attempt budget'
complete -c leasectl -n "__fish_leasectl_using_subcommand help; and __fish_seen_subcommand_from outbox" -f -a "discard" -d 'Delete a dead event, printing it as JSON on stdout so it is not lost'
