-- leasectl schema, version 7: the outbox trigger notifies only while a relay sleeps on LISTEN.
--
-- pg_notify takes a database-wide lock at commit (the notification queue's) and holds it until
-- the commit record is flushed, so every notifying transaction commits alone: with a NOTIFY on
-- every insert, eight autocommit writers managed less than half the inserts of the same writers
-- without it. A relay that is working needs no NOTIFY — it claims again until the outbox is
-- empty — so the trigger now sends one only while some relay is idle and listening.
--
-- The mark is an advisory lock keyed on this table (classid 1818583411, "leas" in ASCII; objid the
-- table's OID, fixed in the trigger when it is created): an idle relay holds it exclusively
-- for its session. The trigger's WHEN clause probes it with pg_try_advisory_xact_lock_shared:
--   * the probe fails  → a relay holds the mark (or is queued for it): NOTIFY;
--   * the probe succeeds → no relay is idle: no NOTIFY, and this transaction holds the shared
--     lock until it ends. A relay going idle takes the mark with a *blocking* request, which
--     waits for every such transaction to commit or roll back, then claims once more before it
--     sleeps — so it sees every event whose transaction skipped the NOTIFY. No wake-up is lost:
--     each event either notifies a relay that holds the mark, or is seen by the claim that a
--     relay makes after taking it (see src/relay/wake.rs).
-- A crashed relay's session lock goes with its backend; a relay cut off without its backend
-- noticing leaves a stale mark until TCP keepalive ends the session, which only costs NOTIFYs.
-- Advisory locks need no grants. The probe is evaluated only when the first condition holds:
-- leasectl's own save sets leasectl.outbox_notified and sends its NOTIFY itself.
DROP TRIGGER outbox_notify ON outbox;
CREATE TRIGGER outbox_notify AFTER INSERT ON outbox
    FOR EACH STATEMENT
    WHEN (current_setting('leasectl.outbox_notified', true) IS DISTINCT FROM 'on'
          AND NOT pg_try_advisory_xact_lock_shared(1818583411, 'outbox'::regclass::oid::integer))
    EXECUTE FUNCTION outbox_notify();
