-- leasectl schema, version 8: leases across CI steps (`acquire`, `run --token`, `renew`,
-- `release --token`) and cancel-in-progress (`--replace`).
ALTER TABLE leases
    -- The token of the holder that a `--replace` took this place from. That holder, finding its
    -- token gone, records its run as `preempted` (not `lost`) and names its replacement.
    ADD COLUMN preempted_token uuid,
    -- Equal to `token` while the holder runs no command: a lease taken by `acquire`, between its
    -- `run --token` steps. A replacement or a forced release need not wait for an idle holder to
    -- stop — there is nothing to stop. Any new token makes the place busy again by itself.
    ADD COLUMN idle_token uuid;

-- A run stopped by `--replace`: outcome `preempted` (no outbox event, output kept), and the fence
-- of the holder that replaced it.
ALTER TABLE runs ADD COLUMN preempted_by bigint;
ALTER TABLE runs DROP CONSTRAINT runs_outcome_check;
ALTER TABLE runs ADD CONSTRAINT runs_outcome_check
    CHECK (outcome IN ('completed', 'timed_out', 'interrupted', 'lost', 'exec_failed', 'skipped',
                       'preempted'));
