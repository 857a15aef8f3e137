-- leasectl schema, version 4: fair, visible queues (`run --wait`, `--queue`) and labels
-- (`--label`).

-- Callers waiting for a busy target (`run --wait`), one row each while they wait; the acquiring
-- statement deletes the row of the waiter it grants the lease to. The ticket,
-- drawn from the database at arrival, is the queue order: the acquiring statement lets a caller
-- take the lease only while no live `fifo`/`latest` waiter with an earlier ticket (any, for a
-- caller that is not queued) exists. A waiter heartbeats its row on its poll; one that stops
-- (killed, paused, cut off) is ignored once its own TTL ran out on the database clock, and its row
-- is deleted by the next arrival.
CREATE TABLE waiters (
    ticket        bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    target        text        NOT NULL,
    -- `fifo` and `latest` waiters keep their place; `unordered` ones are listed, but neither
    -- hold anyone up nor are held up by each other (only by the ordered ones).
    queue         text        NOT NULL CHECK (queue IN ('fifo', 'latest', 'unordered')),
    ttl_ms        bigint      NOT NULL CHECK (ttl_ms > 0),
    heartbeat_at  timestamptz NOT NULL,
    arrived_at    timestamptz NOT NULL,
    host          text        NOT NULL,
    pid           integer     NOT NULL,
    label         text,
    -- Set when a later `--queue latest` waiter superseded this one: who it was. A superseded
    -- waiter holds nobody up; it reads this at its next poll, says so and exits busy.
    superseded_at     timestamptz,
    superseded_host   text,
    superseded_pid    integer,
    superseded_label  text
);
CREATE INDEX waiters_target_ticket ON waiters (target, ticket);

-- Until when a live `fifo`/`latest` waiter of the target may exist: set by every waiter that
-- joins and renewed by waiters well before it runs out (each to its own TTL), recomputed from the
-- waiters left whenever one acquires or leaves. A caller that does not wait may take the lease
-- only after it, so the uncontended acquisition reads this row alone and never plans a query on
-- `waiters`.
ALTER TABLE leases ADD COLUMN queued_until timestamptz;

-- `run --label`: the holder's, and each run's (a commit SHA, a pipeline URL).
ALTER TABLE leases ADD COLUMN holder_label text;
ALTER TABLE runs ADD COLUMN label text;
