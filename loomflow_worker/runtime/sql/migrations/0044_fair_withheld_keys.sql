-- A fair look weighs the keys that have requests withheld for their turn as
-- fairness_keys lists them, not by a walk over the withheld requests: the walk
-- probed runs_fair_held once for every waiting key (about 5 µs a key: 13 ms a
-- look at 2,000 tenants, 105 ms at 20,000, under a lock every look takes).
--
-- `withheld_rank` and `withheld_at`, a key's mark: the priority and enqueue time of
-- the withheld request the key sends first (by priority, then age), NULL when none
-- is withheld. A request withheld sets them (a trigger on its insert, so that no
-- way of recording one can miss it); a look sets them again from runs for the keys
-- it is about to weigh, the clock's key and the keys it sent from, once it has
-- locked their rows (an enqueue that withholds one more meanwhile waits for it,
-- then sets them in its turn). A request withheld and then ended otherwise
-- (cancelled, expired) leaves its key's mark behind until a look reads it again.
ALTER TABLE fairness_keys ADD COLUMN IF NOT EXISTS withheld_rank SMALLINT,
                          ADD COLUMN IF NOT EXISTS withheld_at TIMESTAMPTZ;
CREATE INDEX IF NOT EXISTS fairness_keys_withheld ON fairness_keys (vtime)
    WHERE withheld_at IS NOT NULL;

CREATE OR REPLACE FUNCTION loomflow_worker_fair_withheld() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO fairness_keys AS f (fairness_key, withheld_rank, withheld_at)
    VALUES (NEW.fairness_key, NEW.priority_rank, NEW.enqueued_at)
    ON CONFLICT (fairness_key) DO UPDATE
       SET withheld_rank = EXCLUDED.withheld_rank, withheld_at = EXCLUDED.withheld_at
     WHERE f.withheld_at IS NULL
        OR (EXCLUDED.withheld_rank, EXCLUDED.withheld_at) < (f.withheld_rank, f.withheld_at);
    RETURN NULL;
END
$$;

DROP TRIGGER IF EXISTS runs_fair_withheld ON runs;
CREATE TRIGGER runs_fair_withheld AFTER INSERT ON runs FOR EACH ROW
    WHEN (NEW.waiting_for = 'limit fair_queue' AND NEW.status = 'queued'
          AND NEW.fairness_key IS NOT NULL)
    EXECUTE FUNCTION loomflow_worker_fair_withheld();
-- The requests withheld before this migration.
INSERT INTO fairness_keys AS f (fairness_key, withheld_rank, withheld_at)
SELECT DISTINCT ON (r.fairness_key) r.fairness_key, r.priority_rank, r.enqueued_at
  FROM runs r
 WHERE r.waiting_for = 'limit fair_queue' AND r.status = 'queued'
   AND r.fairness_key IS NOT NULL
 ORDER BY r.fairness_key, r.priority_rank, r.enqueued_at
ON CONFLICT (fairness_key) DO UPDATE
   SET withheld_rank = EXCLUDED.withheld_rank, withheld_at = EXCLUDED.withheld_at;

-- The marks of these keys read again from runs, once their rows are locked: an
-- enqueue withholding another request for one of them meanwhile waits for the
-- caller's end, then marks it in its turn (each statement here sees what was
-- committed before it began). How many marks were wrong (and are now right).
CREATE OR REPLACE FUNCTION loomflow_worker_fair_remark(keys TEXT[]) RETURNS INTEGER
LANGUAGE plpgsql AS $$
DECLARE
    changed INTEGER;
BEGIN
    PERFORM 1 FROM fairness_keys f WHERE f.fairness_key = ANY(keys)
      ORDER BY f.fairness_key FOR UPDATE;
    UPDATE fairness_keys f
       SET withheld_rank = h.priority_rank, withheld_at = h.enqueued_at
      FROM (SELECT k.fairness_key, r.priority_rank, r.enqueued_at
              FROM unnest(keys) AS k(fairness_key)
              LEFT JOIN LATERAL (
                  SELECT r.priority_rank, r.enqueued_at FROM runs r
                   WHERE r.waiting_for = 'limit fair_queue' AND r.status = 'queued'
                     AND r.fairness_key = k.fairness_key
                   ORDER BY r.priority_rank, r.enqueued_at LIMIT 1) r ON true) h
     WHERE f.fairness_key = h.fairness_key
       AND (f.withheld_rank, f.withheld_at) IS DISTINCT FROM (h.priority_rank, h.enqueued_at);
    GET DIAGNOSTICS changed = ROW_COUNT;
    RETURN changed;
END
$$;

CREATE OR REPLACE FUNCTION loomflow_worker_fair_next(wait BOOLEAN, page INTEGER)
RETURNS TABLE (request_id TEXT, kind TEXT, session_id TEXT, user_id TEXT, agent TEXT,
               prompt TEXT, metadata JSONB, not_before TIMESTAMPTZ, options JSONB,
               routing JSONB)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    depth INTEGER;
    room INTEGER;
    clock FLOAT8;
    weighed TEXT[];
    rounds INTEGER := 0;
BEGIN
    IF NOT EXISTS (SELECT 1 FROM runs r
                    WHERE r.waiting_for = 'limit fair_queue' AND r.status = 'queued') THEN
        RETURN;
    END IF;
    IF wait THEN
        PERFORM pg_advisory_xact_lock(7306574591403185253);
    ELSIF NOT pg_try_advisory_xact_lock(7306574591403185253) THEN
        RETURN;
    END IF;
    depth := loomflow_worker_fair_depth();
    IF depth IS NULL THEN
        room := page;
    ELSE
        SELECT least(page, depth - count(*)) INTO room
          FROM (SELECT 1 FROM runs r
                 WHERE r.status = 'queued' AND r.waiting_slots IS NULL AND r.not_before IS NULL
                   AND (r.received_at IS NULL OR dispatched_at > r.received_at)
                 LIMIT depth) o;
    END IF;
    IF room <= 0 THEN
        RETURN;
    END IF;
    SELECT coalesce((SELECT f.vtime FROM fair_clock f WHERE f.id = 1), 0) INTO clock;
    -- Only the `room` keys whose first requests come first (by first tag, then
    -- age, as `chosen` orders them) can get any of the room: each of another key's
    -- requests comes after all of their first requests. Their marks are read again
    -- from runs first, and the mark of the key with the least virtual time (the
    -- clock's): a key whose withheld requests ended otherwise (cancelled, expired)
    -- loses its mark or has it moved, and the keys are chosen again, twice as many
    -- each round, until a round finds every mark right. Weighing more keys than
    -- `room` changes nothing sent: the keys weighed are the first in order.
    LOOP
        rounds := rounds + 1;
        SELECT array_agg(x.fairness_key) INTO weighed
          FROM (SELECT f.fairness_key FROM fairness_keys f
                 WHERE f.withheld_at IS NOT NULL
                 ORDER BY greatest(f.vtime, clock) + 1 / coalesce(f.weight, f.call_weight, 1),
                          f.withheld_at, f.fairness_key
                 LIMIT room * (2 ^ (rounds - 1))::integer) x;
        IF weighed IS NULL THEN
            RETURN;
        END IF;
        EXIT WHEN loomflow_worker_fair_remark(
            weighed || ARRAY(SELECT f.fairness_key FROM fairness_keys f
                              WHERE f.withheld_at IS NOT NULL
                              ORDER BY f.vtime LIMIT 1)) = 0
            OR rounds >= 10;
    END LOOP;
    RETURN QUERY
    WITH active AS (
        -- The keys weighed, where each starts from.
        SELECT f.fairness_key, greatest(f.vtime, clock) AS start,
               coalesce(f.weight, f.call_weight, 1) AS weight
          FROM fairness_keys f
         WHERE f.fairness_key = ANY(weighed) AND f.withheld_at IS NOT NULL
    ), tagged AS (
        SELECT h.request_id, a.fairness_key, a.weight,
               a.start + (row_number() OVER (PARTITION BY a.fairness_key
                                             ORDER BY h.priority_rank, h.enqueued_at))
                         / a.weight AS tag,
               h.enqueued_at
          FROM active a CROSS JOIN LATERAL (
              SELECT r.request_id, r.priority_rank, r.enqueued_at FROM runs r
               WHERE r.waiting_for = 'limit fair_queue' AND r.status = 'queued'
                 AND r.fairness_key = a.fairness_key
               ORDER BY r.priority_rank, r.enqueued_at LIMIT room) h
    ), chosen AS (
        SELECT t.* FROM tagged t ORDER BY t.tag, t.enqueued_at LIMIT room
    ), marked AS (
        UPDATE runs u
           -- Its message now on its way, as a new request's: no handoff
           -- publishes it again until a worker takes it and parks it.
           SET waiting_for = NULL, waiting_slots = NULL, dispatched_at = now(),
               received_at = NULL
          FROM chosen c
         WHERE u.request_id = c.request_id AND u.status = 'queued'
           AND u.waiting_for = 'limit fair_queue'
        RETURNING u.request_id, u.kind, u.session_id, u.user_id, u.agent, u.prompt,
                  u.metadata, u.not_before, u.options, u.routing
    ), moved AS (
        -- The virtual time of each key that sent requests: its last one's tag.
        SELECT c.fairness_key, max(c.tag) AS vtime FROM chosen c GROUP BY c.fairness_key
    ), tags AS (
        -- Written for the keys that sent a request only: another's start,
        -- greatest(its time, the clock), is the same computed again next time,
        -- the clock only going forward.
        UPDATE fairness_keys f SET vtime = m.vtime
          FROM moved m WHERE f.fairness_key = m.fairness_key
    ), advanced AS (
        -- The clock: the least virtual time of a waiting key once these go (one
        -- that sent nothing starts from greatest(its time, the clock)), the other
        -- keys' read through fairness_keys_withheld; forward only.
        INSERT INTO fair_clock AS f (id, vtime)
        SELECT 1, x.vtime
          FROM (SELECT least((SELECT min(m.vtime) FROM moved m),
                             CASE WHEN o.vtime IS NOT NULL THEN greatest(clock, o.vtime) END)
                       AS vtime
                  FROM (SELECT min(k.vtime) AS vtime FROM fairness_keys k
                         WHERE k.withheld_at IS NOT NULL
                           AND k.fairness_key NOT IN (SELECT m.fairness_key FROM moved m)) o
               ) x
         WHERE x.vtime IS NOT NULL
        ON CONFLICT (id) DO UPDATE SET vtime = greatest(f.vtime, EXCLUDED.vtime)
    )
    SELECT m.request_id, m.kind, m.session_id, m.user_id, m.agent, m.prompt, m.metadata,
           m.not_before, m.options, m.routing FROM marked m;
    PERFORM loomflow_worker_fair_remark(weighed);
END
$$;
