-- leasectl schema, version 2: what `leasectl relay` and `prune` need.

-- The relay skips every aggregate whose oldest event is waiting out a retry or is dead, so that
-- one failing aggregate never holds up the others. Only events that have failed at least once
-- have attempts > 0: a handful of rows, so this index stays tiny and the check is one probe.
CREATE INDEX outbox_failed ON outbox (aggregate_type, aggregate_id) WHERE attempts > 0;

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
