-- Fairness keys at rest, which a prune deletes (prune_fairness_keys). A key's row
-- in fairness_keys outlives its requests: a fleet serving a million users would keep
-- a million rows. A row is at rest when a look would take its key for one it never
-- saw: nothing withheld (no mark), no weight set, removed by command or stated by its
-- requests (a weight removed with `limits weight KEY --none` holds over the settings'
-- weight: its row remembers that), and a virtual time not ahead of the fleet's clock
-- (a key starts from greatest(its time, the clock), and the clock only goes forward; a
-- key ahead of it has had more than its share lately, which its row remembers). A key
-- that comes back gets a new row from the enqueue that withholds its request, as a new
-- key does.
--
-- `clock` is the fleet's virtual time, read once by the caller: a plain expression,
-- the function is planned as if spelt out, not called for each row. A prune reads the
-- table once every few minutes (the sweeper's retention): no index of its own, which
-- every look's writes to the table would keep up.
CREATE OR REPLACE FUNCTION loomflow_worker_fair_key_at_rest(f fairness_keys, clock FLOAT8)
RETURNS BOOLEAN LANGUAGE sql IMMUTABLE AS $$
    SELECT f.withheld_at IS NULL AND f.weight IS NULL AND f.call_weight IS NULL
       AND f.weight_source IS NULL AND f.vtime <= clock
$$;
