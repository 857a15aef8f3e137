-- leasectl schema, version 6: the relay's answers to issue 12 §5's fault-injection campaign.

-- An aggregate's key is indexed by a 64-bit hash of it, never by its text: a btree entry must fit
-- in about a third of a page (2,704 bytes), and outbox_held indexed (aggregate_type,
-- aggregate_id) as they were, so one refused event with a ~3 kB aggregate_id could not be put
-- back — the batch rolled back, and every relay crash-looped republishing it. A hash is 8 bytes
-- whatever the key; a collision only costs a recheck, since every lookup also compares the
-- columns themselves. The expression is `{agg_key}` in src/store/mod.rs and must stay
-- identical to it, or the planner will not use these indexes.
DROP INDEX outbox_held;
CREATE INDEX outbox_held ON outbox
    (hashtextextended(aggregate_id, hashtextextended(aggregate_type, 0)), seq)
    WHERE dead_at IS NOT NULL OR next_attempt_at > created_at;
