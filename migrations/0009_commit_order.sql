-- leasectl schema, version 9: what `leasectl relay --order commit` needs.
--
-- Each event records the transaction that inserted it. `seq` is taken at insert, so when two
-- transactions insert events of one aggregate and the one with the lower `seq` commits later,
-- a relay ordering by `seq` can publish the later event first. A relay with `--order commit`
-- publishes only events whose transaction is older than every transaction still in progress
-- (`xid < pg_snapshot_xmin(pg_current_snapshot())`), ordered by `(xid, seq)`: no transaction that
-- commits later can have an id below that horizon, so nothing can ever arrive ahead of what was
-- already published.
--
-- The column is not part of the public interface: its default fills it for every insert that
-- names only the four contract columns. pg_current_xact_id() is the top-level transaction's id
-- (also inside a savepoint), which an INSERT assigns anyway. Rows from before this migration get
-- 0 in place (a constant default needs no table rewrite; a volatile one would have rewritten the
-- table and stamped them all with this transaction's id): older than any horizon, so delivered
-- first, as they would have been. The default is set in a second step for the same reason.
ALTER TABLE outbox ADD COLUMN xid xid8 NOT NULL DEFAULT '0';
ALTER TABLE outbox ALTER COLUMN xid SET DEFAULT pg_current_xact_id();

-- The commit-order claim reads the outbox in (xid, seq) order, and stops where the horizon
-- starts: events of transactions still in progress sort after every deliverable one. Without
-- it the claim would sort the whole table on every batch.
CREATE INDEX outbox_commit_order ON outbox (xid, seq);
