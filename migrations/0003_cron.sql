-- leasectl schema, version 3: cron slots (`run --slot`), the dead-man switch (`expect`, health,
-- incidents) and the job's own events (`LEASECTL_EVENTS`).

-- Runs in a schedule slot, and the callers that found their slot already done.
ALTER TABLE runs
    -- The scheduled instant the run belongs to and the next one (`run --slot`), on the
    -- database clock; NULL for runs without --slot.
    ADD COLUMN slot      timestamptz,
    ADD COLUMN slot_end  timestamptz,
    -- For a `skipped` run: the run that had already done the slot.
    ADD COLUMN done_by   uuid,
    -- The lines the command wrote to $LEASECTL_EVENTS, kept with a `lost` run (or a run whose
    -- events were refused) for the operator; NULL otherwise.
    ADD COLUMN events    bytea;
ALTER TABLE runs DROP CONSTRAINT runs_outcome_check;
ALTER TABLE runs ADD CONSTRAINT runs_outcome_check
    CHECK (outcome IN ('completed', 'timed_out', 'interrupted', 'lost', 'exec_failed', 'skipped'));
-- "Was this slot done?" is asked under the lease on every --slot run.
CREATE INDEX runs_target_slot ON runs (target, slot) WHERE slot IS NOT NULL;

-- What is expected of a target, for the dead-man switch: the schedule of its latest `run --slot`
-- and the expectation set by `leasectl expect`. A target may be expected before it ever ran.
CREATE TABLE expectations (
    target           text        PRIMARY KEY CHECK (char_length(target) BETWEEN 1 AND 200),
    -- A 5-field cron expression or @hourly/@daily/@weekly/@monthly, and its IANA zone (NULL: UTC).
    schedule         text,
    schedule_tz      text,
    -- `expect --every`: a successful run at least this often.
    every_ms         bigint      CHECK (every_ms > 0),
    -- How late a slot's run or an --every run may be before it counts as missed / overdue.
    grace_ms         bigint      CHECK (grace_ms >= 0),
    -- `expect --max-duration`: a holder running longer is "too long".
    max_duration_ms  bigint      CHECK (max_duration_ms > 0),
    updated_at       timestamptz NOT NULL DEFAULT now()
);

-- Open health incidents, one per target and kind. A relay that opens one (INSERT … ON CONFLICT DO
-- NOTHING) inserts its outbox event in the same transaction, and the one that closes it (DELETE …
-- RETURNING) inserts the `recovered` event, so several relays announce each incident once.
CREATE TABLE incidents (
    target     text        NOT NULL,
    kind       text        NOT NULL CHECK (kind IN ('missed', 'overdue', 'failing', 'too_long')),
    opened_at  timestamptz NOT NULL DEFAULT now(),
    -- What it is about (the missed slot, the failed run, the long-running holder), as in its event.
    detail     jsonb       NOT NULL DEFAULT '{}',
    PRIMARY KEY (target, kind)
);
