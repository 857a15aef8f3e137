-- leasectl schema, version 11: a lease taken from a holder whose command may still run is not
-- free until that holder has stopped.
--
-- `release --force`, `release --token` while a step runs and `--replace` take a lease away from a
-- holder that is still running its command. That holder learns it at once (NOTIFY) or at its next
-- heartbeat, stops its command — SIGTERM, then SIGKILL after its own --kill-after — and records
-- its run `lost` or `preempted`. Until then two commands of the target could run at once if the
-- place were free. So the row keeps the fact "its last holder is stopping": whoever acquires the
-- place next — a plain run, a waiter, a step, the next `--replace` — waits until the old holder
-- confirmed its stop (its lost or preempted record clears the fact and wakes waiters) or until the
-- old holder's own deadline has passed, whichever comes first: its last heartbeat plus its TTL on
-- the database clock, by which it has killed its command even if it never learned of the release.
-- The fact belongs to the row, not to whoever took the lease: it outlives a replacer that dies,
-- pauses or is replaced in turn before the old holder stopped.
ALTER TABLE leases
    -- The token of the holder that is stopping; NULL once it confirmed (or never was).
    ADD COLUMN stopping_token uuid,
    -- Its deadline: its last heartbeat + its TTL. The fact lapses by itself after it.
    ADD COLUMN stopping_until timestamptz,
    -- Who it is, for the messages of those who wait for it, and its fence.
    ADD COLUMN stopping_host  text,
    ADD COLUMN stopping_pid   integer,
    ADD COLUMN stopping_fence bigint;
