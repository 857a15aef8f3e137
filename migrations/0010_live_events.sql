-- leasectl schema, version 10: a claim that costs the same however many dead events wait ahead
-- of the live ones (issue 12 §5.9).
--
-- A dead event stays in the outbox until an operator retries or discards it, and the relay's
-- claim reads the outbox in order from its oldest event: 300,000 dead events ahead of 1,000 live
-- ones made every claim walk through all of them (0.7 s a claim, against about 1 ms). These
-- indexes hold only the events that are not dead, so the claim's window starts at the oldest
-- live one and never reads a dead one. Their predicate is exactly the claim's
-- `o.dead_at IS NULL` (src/store/outbox.rs): the planner uses a partial index only for a query
-- whose WHERE implies it. The relay marks an event dead by putting it back (a delete and an
-- insert), so a dead event never enters them; `outbox retry` (an UPDATE) brings one back.
CREATE INDEX outbox_live ON outbox (seq) WHERE dead_at IS NULL;

-- The commit order's index (migration 0009) needs only live events as well: it becomes partial,
-- so `--order commit` skips dead events the same way and inserts pay for no more indexes than
-- before in that order.
DROP INDEX outbox_commit_order;
CREATE INDEX outbox_commit_order ON outbox (xid, seq) WHERE dead_at IS NULL;
