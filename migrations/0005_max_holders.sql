-- leasectl schema, version 5: several holders of one target (`run --max-holders N`).
--
-- A target's row of place 0 stays what it was: the single holder's lease (N = 1), and in every
-- case the target's fence counter — every acquisition, of any place, takes its fence from it
-- (`fence + 1`), so fences strictly increase per target across places. With N > 1 the holders
-- are places 1…N (LEASECTL_HOLDER_INDEX = place − 1), one row each, kept forever like place 0;
-- place 0 then holds no token and only counts.
ALTER TABLE leases
    ADD COLUMN place integer NOT NULL DEFAULT 0 CHECK (place >= 0),
    -- On place 0: the N of the holders in force (set by the first holder; it stands until no
    -- place is held). The single-holder acquisition takes place 0 only while it is 1.
    ADD COLUMN max_holders integer NOT NULL DEFAULT 1 CHECK (max_holders >= 1);
ALTER TABLE leases DROP CONSTRAINT leases_pkey;
ALTER TABLE leases ADD PRIMARY KEY (target, place);
-- Heartbeats, saves and releases find a holder by (target, token).
CREATE INDEX leases_token ON leases (token) WHERE token IS NOT NULL;
