-- leasectl schema, version 12: the slot a `run --slot` holder is doing, kept on its lease row so
-- that a contender of the same slot records a skip instead of finding the target busy; how such
-- a skip is told from one recorded after the slot was done; and since when a target's schedule
-- watches it (`expect --clear` now forgets a schedule too, and a later `run --slot` stores it
-- again).

ALTER TABLE leases
    -- Written by a `run --slot` holder when it checks its slot under the lease and finds it not
    -- done yet (the statement that would otherwise record its skip). They describe a run in
    -- progress only while `slot_fence` equals `fence`: a later acquisition has a higher fence and
    -- never inherits them, so nothing needs to clear them. After that they still name the last
    -- run that took on a slot, which a contender of the same slot looks up by its id (did it do
    -- the slot?). NULL until a `--slot` run held the row.
    ADD COLUMN slot_fence     bigint,
    -- The slot (on the database clock) and the next instant of its schedule.
    ADD COLUMN slot           timestamptz,
    ADD COLUMN slot_end       timestamptz,
    -- The schedule and zone (NULL: UTC) exactly as the holder's `--slot` / `--slot-tz` gave them:
    -- only a contender with the same ones is doing the same slots.
    ADD COLUMN slot_schedule  text,
    ADD COLUMN slot_tz        text,
    -- The id the holder's run will be stored with, whatever its outcome: what a contender's
    -- skip names in `runs.done_by`.
    ADD COLUMN slot_run       uuid;

-- For a `skipped` run: true when the run named by `done_by` was still running when the skip was
-- recorded (its outcome was not known yet), false when that run had already done the slot.
ALTER TABLE runs ADD COLUMN done_by_running boolean NOT NULL DEFAULT false;

-- When the target's current schedule was stored: by the `run --slot` that first stored it, that
-- changed it, or that stored it again after `expect --clear` forgot it. A slot that ended before
-- then is never missed. NULL without a schedule.
ALTER TABLE expectations ADD COLUMN schedule_since timestamptz;
-- Until now the health check took the earlier of the row's last change and the first slot any
-- run of the target was in: that, for the schedules already stored.
UPDATE expectations e
   SET schedule_since = least(e.updated_at, (SELECT min(r.slot) FROM runs r
                                              WHERE r.target = e.target AND r.slot IS NOT NULL))
 WHERE e.schedule IS NOT NULL;
