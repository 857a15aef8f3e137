-- leasectl schema, version 2: what `leasectl relay` and `prune` need.

-- The relay skips every aggregate that has an event which is dead or not yet due (waiting out a
-- retry, or inserted with a future next_attempt_at), so that one failing aggregate never holds
-- up the others. Only such events have next_attempt_at later than created_at (both default to
-- the inserting transaction's now()): a handful of rows, so this index stays tiny and the check
-- is one probe.
CREATE INDEX outbox_held ON outbox (aggregate_type, aggregate_id)
    WHERE dead_at IS NOT NULL OR next_attempt_at > created_at;

-- The outbox is a queue: rows are inserted, then deleted once delivered. Vacuum it as soon as a
-- few thousand rows are dead instead of after 20% of the table, so it and its indexes stay
-- small. (The relay also vacuums it itself after heavy draining: autovacuum wakes up only once
-- a minute.)
ALTER TABLE outbox SET (
    autovacuum_vacuum_scale_factor = 0.0,
    autovacuum_vacuum_threshold = 5000,
    autovacuum_vacuum_cost_delay = 0
);

-- `leasectl prune --older-than` deletes runs by age.
CREATE INDEX runs_finished ON runs (finished_at);
