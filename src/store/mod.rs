//! Every SQL statement leasectl sends to its tables, one module per table.
//!
//! * [`leases`]: acquire / heartbeat / release / force-release, the holder of a busy target,
//!   and the per-target overview `status` shows;
//! * [`runs`]: the fenced save that stores a run and its outbox event, the `lost` record,
//!   reuse look-ups, the listing and output of `runs` / `output`, and pruning;
//! * [`outbox`]: the relay's claim and restore, and the operator's list / retry / discard /
//!   backlog;
//! * [`waiters`]: the queue of `run --wait` callers: join, look (and renew), leave, list;
//! * [`health`]: expectations (`expect`), the facts the dead-man switch judges, and the
//!   incidents a relay opens and closes with their events.
//!
//! Rows are read by column name into small structs; callers never see a `Row`. The few
//! predicates that more than one statement needs are defined once here (`sql` splices them
//! into statement templates), so a change to what "expired" or "held" means cannot miss a copy.

pub mod health;
pub mod holder;
pub mod leases;
pub mod outbox;
pub mod runs;
pub mod waiters;

use crate::db::Schema;
use crate::fmt::ms;

/// A lease whose holder's own TTL ran out on the database clock (alias `l` for `leases`).
///
/// The cast is the one the server would add: there is no `int8 * interval`, and finding that
/// `float8 * interval` fits after an implicit cast means looking at every `*` operator, which a
/// fresh server process (every `run` has one) reads from the catalog first. Spelled out, the
/// operator is found by its exact types: about 0.05 ms less parsing of the acquisition.
const EXPIRED: &str = "(l.heartbeat_at + l.ttl_ms::float8 * interval '1 millisecond' < now())";

/// The place's last holder, from whom the lease was taken while its command may still have run
/// (`release --force`, `release --token` during a step, `--replace`), is still stopping it: it
/// has neither confirmed its stop nor passed its own deadline (alias `l` for `leases`; see
/// migrations/0011_stopping.sql). Nobody may start a command on the place meanwhile.
const STOPPING: &str = "(l.stopping_token IS NOT NULL AND l.stopping_until > now())";

/// Milliseconds until the stopping holder's deadline, never negative (alias `l` for `leases`).
const STOPPING_LEFT_MS: &str =
    "greatest(0, round(extract(epoch FROM l.stopping_until - now()) * 1000))::int8";

/// Milliseconds since the holder's last heartbeat, never negative (alias `l` for `leases`).
const HEARTBEAT_AGE_MS: &str =
    "greatest(0, round(extract(epoch FROM now() - l.heartbeat_at) * 1000))::int8";

/// Milliseconds since the holder acquired the lease, never negative (alias `l` for `leases`).
const RUNNING_MS: &str =
    "greatest(0, round(extract(epoch FROM now() - l.acquired_at) * 1000))::int8";

/// A waiter that counts: its own TTL has not run out on the database clock, and no later
/// `--queue latest` waiter superseded it (alias `w` for `waiters`). The only rows anyone waits
/// behind, counts or lists.
const LIVE_WAITER: &str = "(w.superseded_at IS NULL
      AND w.heartbeat_at + w.ttl_ms * interval '1 millisecond' >= now())";

/// The least fence this server may hand out: the first of its current timeline's block,
/// `(timeline - 1) × 2^40 + 1` ([`crate::fmt::FENCE_BLOCK`]). A promotion starts a new timeline, so every fence handed out after
/// it is greater than every fence of the timelines before — also when the promoted standby missed
/// acquisitions the old primary committed (asynchronous replication): downstream systems keep
/// comparing one integer. A server never promoted is on timeline 1, whose block starts at 1: its
/// fences are the plain per-target counter. The timeline is read off the name of the current WAL
/// file, which any role may call for. It is capped at 2^23 so the block never leaves `int8`; a
/// server past that (millions of promotions) keeps counting within its last block.
/// Where the server has no WAL of its own to name (see [`fence_floor`]) the floor is 1.
const FENCE_FLOOR: &str =
    "((least(('x' || left(pg_walfile_name(pg_current_wal_lsn()), 8))::bit(32)::int8,
              8388608) - 1) << 40) + 1";

/// [`FENCE_FLOOR`], or `1` when `LEASECTL_FENCE_TIMELINE=off`: for PostgreSQL-compatible
/// services that implement neither `pg_current_wal_lsn()` nor `pg_walfile_name()` (they fail every
/// acquisition otherwise). Fences then grow by the counter alone, which a lossy failover can
/// repeat. Mixing both settings is safe: either way a fence is more than the one before.
fn fence_floor() -> &'static str {
    static FLOOR: std::sync::OnceLock<&'static str> = std::sync::OnceLock::new();
    FLOOR.get_or_init(
        || match std::env::var("LEASECTL_FENCE_TIMELINE").as_deref() {
            Ok("off") => "1",
            _ => FENCE_FLOOR,
        },
    )
}

/// Whether this process's fences carry the server's timeline (`LEASECTL_FENCE_TIMELINE` is not
/// `off`): what `doctor` reports.
pub fn fences_carry_the_timeline() -> bool {
    fence_floor() != "1"
}

/// A live ordered waiter of the target may exist (alias `l` for place 0 of `leases`; see
/// `leases.queued_until` in migrations/0004_queue.sql).
/// False, not NULL, when `queued_until` is NULL (no waiter ever).
const QUEUED: &str = "(l.queued_until IS NOT NULL AND l.queued_until > now())";

/// When the last live ordered waiter of `l.target` other than ticket `$TICKET` runs out: what
/// `leases.queued_until` becomes when a waiter acquires or leaves.
const QUEUED_UNTIL: &str = "(SELECT max(w.heartbeat_at + w.ttl_ms * interval '1 millisecond')
       FROM {s}.waiters w
      WHERE w.target = l.target AND w.queue <> 'unordered' AND {live_waiter}
        AND w.ticket IS DISTINCT FROM $TICKET)";

/// An outbox event that holds up its aggregate — dead, or not to be tried before
/// `next_attempt_at` — as far as an index can tell: it is **exactly** the predicate of the
/// partial index `outbox_held` (migrations/0002_relay.sql), which the planner uses only for a
/// query whose WHERE implies it. Unqualified, so it applies to the innermost `outbox` in scope.
/// Whether such an event is still waiting is [`HELD_NOW`].
const HELD: &str = "(dead_at IS NOT NULL OR next_attempt_at > created_at)";

/// Of the [`HELD`] events, those still holding their aggregate up now.
const HELD_NOW: &str = "(dead_at IS NOT NULL OR next_attempt_at > now())";

/// An outbox event's aggregate as indexes see it: a 64-bit hash of `(aggregate_type,
/// aggregate_id)`, 8 bytes whatever the key's length (a btree entry must fit in 2,704 bytes).
/// **Exactly** the expression of the indexes of migrations/0006_relay_faults.sql; a lookup
/// compares it and then the columns themselves (a collision costs a recheck, nothing else).
/// `{agg_key:b}` is it for alias `b`, `{agg_key:o}` for alias `o`.
const AGG_KEY: &str = "hashtextextended(A.aggregate_id, hashtextextended(A.aggregate_type, 0))";

/// No event of the aggregate of the outbox event with alias `A` is [`HELD`] and [`HELD_NOW`]:
/// one probe of `outbox_held` by the aggregate's hashed key ([`AGG_KEY`]) for each row it is
/// asked of, whatever the number of held events (a `NOT IN` over the held events would read
/// every dead one on every claim). `OFFSET 0` keeps the probe a subplan
/// evaluated per row: without it the planner pulls a correlated `NOT EXISTS` up into an anti
/// join, or turns it into a hashed lookup, both of which read every held row. The first test,
/// evaluated once per statement (an init plan: `OR` evaluates its arms in order), spares the
/// probes while `outbox_held` holds no event at all, the usual case. `{not_held:o}` is it for
/// alias `o`, `{not_held:p}` for alias `p`.
const NOT_HELD: &str = "(NOT EXISTS (SELECT 1 FROM {s}.outbox b WHERE {held})
        OR NOT EXISTS (SELECT 1 FROM {s}.outbox b
                        WHERE {held} AND {agg_key:b} = {agg_key:A}
                          AND b.aggregate_type = A.aggregate_type AND b.aggregate_id = A.aggregate_id
                          AND {held_now}
                       OFFSET 0))";

/// Expands a statement template: the shared predicates `{expired}`, `{stopping}`,
/// `{stopping_left_ms}`, `{heartbeat_age_ms}`,
/// `{running_ms}`, `{queued}`, `{queued_until}` (with `$TICKET` to replace by the caller),
/// `{live_waiter}`, `{not_held:o}` / `{not_held:p}`, `{held}`, `{held_now}`, `{agg_key:b}` /
/// `{agg_key:o}` / `{agg_key:p}`, `{fence_floor}`, and `{s}` as the quoted schema.
///
/// One pass over the template, expanding a predicate's own placeholders as it goes: a chain of
/// `str::replace`, one scan and one copy of the whole statement per name, was a tenth of a plain
/// `run`'s instructions. A `{…}` it does not know (a JSON or array literal) stays as written.
fn sql(schema: &Schema, template: &str) -> String {
    let mut out = String::with_capacity(template.len() + template.len() / 2);
    expand(schema, template, &mut out);
    out
}

/// Appends `text` to `out`, its placeholders expanded (see [`sql`]).
fn expand(schema: &Schema, text: &str, out: &mut String) {
    let mut rest = text;
    while let Some(open) = rest.find('{') {
        out.push_str(&rest[..open]);
        let after = &rest[open + 1..];
        let Some(close) = after.find('}') else {
            rest = &rest[open..];
            break;
        };
        let name = &after[..close];
        if name == "s" {
            // Not expanded further: the schema's name is the user's.
            out.push_str(&schema.sql("{s}"));
        } else if let Some(predicate) = predicate(name) {
            expand(schema, &predicate, out);
        } else {
            out.push('{');
            rest = after;
            continue;
        }
        rest = &after[close + 1..];
    }
    out.push_str(rest);
}

/// The text of the shared predicate `{name}`, itself perhaps with placeholders.
fn predicate(name: &str) -> Option<std::borrow::Cow<'static, str>> {
    use std::borrow::Cow::{Borrowed, Owned};
    let not_held = |alias: &str| {
        Owned(
            NOT_HELD
                .replace("A.", &format!("{alias}."))
                .replace("{agg_key:A}", &format!("{{agg_key:{alias}}}")),
        )
    };
    Some(match name {
        "expired" => Borrowed(EXPIRED),
        "stopping" => Borrowed(STOPPING),
        "stopping_left_ms" => Borrowed(STOPPING_LEFT_MS),
        "heartbeat_age_ms" => Borrowed(HEARTBEAT_AGE_MS),
        "running_ms" => Borrowed(RUNNING_MS),
        "queued" => Borrowed(QUEUED),
        "queued_until" => Borrowed(QUEUED_UNTIL),
        "live_waiter" => Borrowed(LIVE_WAITER),
        "held" => Borrowed(HELD),
        "held_now" => Borrowed(HELD_NOW),
        "fence_floor" => Borrowed(fence_floor()),
        "not_held:o" => not_held("o"),
        "not_held:p" => not_held("p"),
        "agg_key:b" => Owned(AGG_KEY.replace("A.", "b.")),
        "agg_key:o" => Owned(AGG_KEY.replace("A.", "o.")),
        "agg_key:p" => Owned(AGG_KEY.replace("A.", "p.")),
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn templates_expand_every_shared_predicate_and_leave_other_braces_alone() {
        let schema = Schema::new("a{expired}b");
        let text = sql(
            &schema,
            "SELECT '{}'::jsonb, '{1,2}'::int[], {s}.t WHERE {expired} AND {not_held:o} \
             AND {queued_until} AND {unknown} {",
        );
        assert!(
            text.contains("'{}'::jsonb, '{1,2}'::int[], \"a{expired}b\".t WHERE"),
            "{text}"
        );
        assert!(
            text.contains(EXPIRED) && text.contains("{unknown} {"),
            "{text}"
        );
        // Nested: the predicates' own placeholders and aliases.
        for part in [
            HELD,
            HELD_NOW,
            LIVE_WAITER,
            "hashtextextended(o.aggregate_id",
        ] {
            assert!(text.contains(part), "{part} in {text}");
        }
        for left in ["{held", "{agg_key", "{live_waiter}", "{s}", "A."] {
            assert!(!text.contains(left), "{left} in {text}");
        }
        assert_eq!(text.matches("\"a{expired}b\".outbox").count(), 2, "{text}");
    }
}
