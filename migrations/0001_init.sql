-- leasectl schema, version 1.
--
-- Applied by `leasectl migrate` (and implicitly by every command) inside one transaction that
-- holds an advisory lock, with search_path set to the target schema, so names here are
-- unqualified. Forward-only: later changes go in 0002_….sql, never edits to this file.

-- One row per target, kept forever: `fence` must keep growing across release and takeover, so
-- releasing clears the token instead of deleting the row.
CREATE TABLE leases (
    target        text        PRIMARY KEY,
    -- Random per acquisition; NULL while the target is free. Every heartbeat, save and release
    -- matches on it, so a holder that was taken over touches 0 rows.
    token         uuid,
    -- Incremented by every acquisition; handed to the child as LEASECTL_FENCE.
    fence         bigint      NOT NULL,
    -- The holder's own TTL: a contender takes over only after *this* much silence.
    ttl_ms        bigint      NOT NULL CHECK (ttl_ms > 0),
    -- Database clock only; hosts' clocks are never compared.
    heartbeat_at  timestamptz NOT NULL,
    acquired_at   timestamptz NOT NULL,
    holder_host   text,
    holder_pid    integer,
    CHECK (char_length(target) BETWEEN 1 AND 200)
);

-- Every run that got the lease, including the ones that lost it (outcome 'lost').
CREATE TABLE runs (
    id                uuid        PRIMARY KEY,
    target            text        NOT NULL,
    fence             bigint      NOT NULL,
    token             uuid        NOT NULL,
    outcome           text        NOT NULL
                      CHECK (outcome IN ('completed', 'timed_out', 'interrupted', 'lost', 'exec_failed')),
    argv              text[]      NOT NULL,
    host              text        NOT NULL,
    pid               integer     NOT NULL,
    started_at        timestamptz NOT NULL,
    finished_at       timestamptz NOT NULL,
    -- NULL when a signal ended the child; then `signal` is set.
    exit_code         integer,
    signal            integer,
    stdout            bytea       NOT NULL,
    stderr            bytea       NOT NULL,
    stdout_truncated  boolean     NOT NULL,
    stderr_truncated  boolean     NOT NULL,
    -- Why the command could not start (exec_failed) or why the lease was lost.
    error             text
);
CREATE INDEX runs_target_finished ON runs (target, finished_at DESC);
CREATE INDEX runs_target_fence ON runs (target, fence);

-- The transactional outbox. Public interface: applications insert into the first four columns
-- (aggregate_type, aggregate_id, type, payload) inside their own transactions; every other
-- column has a default.
CREATE TABLE outbox (
    aggregate_type   text        NOT NULL,
    aggregate_id     text        NOT NULL,
    type             text        NOT NULL,
    payload          jsonb       NOT NULL,
    -- Stable id consumers deduplicate on (delivery is at-least-once).
    id               uuid        NOT NULL DEFAULT gen_random_uuid() UNIQUE,
    -- Insertion order; per-aggregate publication order follows it.
    seq              bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    created_at       timestamptz NOT NULL DEFAULT now(),
    -- Delivery bookkeeping for the relay.
    attempts         integer     NOT NULL DEFAULT 0,
    next_attempt_at  timestamptz NOT NULL DEFAULT now(),
    last_error       text,
    dead_at          timestamptz
);
CREATE INDEX outbox_aggregate_seq ON outbox (aggregate_type, aggregate_id, seq);

-- Wake relays as soon as events commit (NOTIFY is delivered at commit, and only then). One
-- notification per statement, not per row, so bulk inserts stay cheap; it is only a hint —
-- relays also poll. leasectl's own save sends the NOTIFY itself and sets
-- leasectl.outbox_notified for its transaction: the WHEN clause then skips the function, which
-- spares a short-lived connection the cost of loading PL/pgSQL (about 2 ms).
CREATE FUNCTION outbox_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify(TG_TABLE_SCHEMA || '.outbox', '');
    RETURN NULL;
END
$$;
CREATE TRIGGER outbox_notify AFTER INSERT ON outbox
    FOR EACH STATEMENT
    WHEN (current_setting('leasectl.outbox_notified', true) IS DISTINCT FROM 'on')
    EXECUTE FUNCTION outbox_notify();

-- RFC 3339 in UTC with microseconds, the one timestamp format leasectl publishes (event payloads,
-- --json output), independent of the session's TimeZone.
CREATE FUNCTION rfc3339(ts timestamptz) RETURNS text LANGUAGE sql IMMUTABLE STRICT AS $$
    SELECT to_char(ts AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"')
$$;
