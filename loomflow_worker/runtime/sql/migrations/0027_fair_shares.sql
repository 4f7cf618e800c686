-- Weighted fair shares. With the fair_queue limit set (a row of
-- concurrency_limits), at most that many requests wait in the broker at once:
-- an enqueue beyond it (or while others wait in line) records the request
-- held back, parked on "limit fair_queue" with no slots (waiting_slots '{}', so
-- nothing counts it as published), and loomflow_worker_fair_next publishes the
-- held requests as room frees, in proportion to their fairness keys' weights
-- (start-time fair queueing: each key's next request is tagged with the
-- key's virtual time plus 1/weight, and the smallest tags go first), each
-- key's own in priority, then acceptance order.
CREATE TABLE IF NOT EXISTS fairness_keys (
    fairness_key TEXT PRIMARY KEY,
    -- The key's weight as settings or `loomflow-worker limits weight` set it,
    -- and as its requests stated it (fairness_weight); 1 when neither did.
    weight FLOAT8 CHECK (weight > 0),
    call_weight FLOAT8 CHECK (call_weight > 0),
    -- The tag of the key's last published request.
    vtime FLOAT8 NOT NULL DEFAULT 0,
    updated_at TIMESTAMPTZ NOT NULL DEFAULT now()
);
-- The fleet's virtual time: the start tag of the last request published.
CREATE TABLE IF NOT EXISTS fair_clock (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    vtime FLOAT8 NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS runs_fair_held ON runs (fairness_key, priority_rank, enqueued_at)
    WHERE waiting_for = 'limit fair_queue' AND status = 'queued';
-- The requests whose message waits in a broker: published and not received
-- since, with no eta (those wait in a worker's memory), not held back.
CREATE INDEX IF NOT EXISTS runs_in_broker ON runs (seq)
    WHERE status = 'queued' AND waiting_slots IS NULL AND not_before IS NULL
      AND (received_at IS NULL OR dispatched_at > received_at);

-- Publish held requests while the broker has room under fair_queue (all of
-- them, a page at a time, once the limit is removed), by weighted fair shares.
-- One caller at a time (a transaction advisory lock; `wait` false: return
-- nothing when another caller is at it). The requests come back stamped
-- dispatched, no longer held, for the caller to publish.
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
    SELECT c.max_runs INTO depth FROM concurrency_limits c WHERE c.name = 'fair_queue';
    IF depth IS NULL THEN
        room := page;
    ELSE
        SELECT least(page, depth - count(*)) INTO room
          FROM (SELECT 1 FROM runs r
                 WHERE r.status = 'queued' AND r.waiting_slots IS NULL AND r.not_before IS NULL
                   AND (r.received_at IS NULL OR r.dispatched_at > r.received_at)
                 LIMIT depth) o;
    END IF;
    IF room <= 0 THEN
        RETURN;
    END IF;
    SELECT coalesce((SELECT f.vtime FROM fair_clock f WHERE f.id = 1), 0) INTO clock;
    RETURN QUERY
    WITH RECURSIVE keys AS (
        -- The keys with held requests, one index probe each.
        (SELECT r.fairness_key FROM runs r
          WHERE r.waiting_for = 'limit fair_queue' AND r.status = 'queued'
          ORDER BY r.fairness_key LIMIT 1)
        UNION ALL
        SELECT (SELECT r.fairness_key FROM runs r
                 WHERE r.waiting_for = 'limit fair_queue' AND r.status = 'queued'
                   AND r.fairness_key > k.fairness_key
                 ORDER BY r.fairness_key LIMIT 1)
          FROM keys k WHERE k.fairness_key IS NOT NULL
    ), active AS (
        SELECT k.fairness_key, greatest(coalesce(f.vtime, 0), clock) AS start,
               coalesce(f.weight, f.call_weight, 1) AS weight
          FROM keys k LEFT JOIN fairness_keys f ON f.fairness_key = k.fairness_key
         WHERE k.fairness_key IS NOT NULL
    ), firsts AS (
        -- Only a key among the `room` smallest first tags (and those tied with
        -- them) can get any of the room.
        SELECT x.fairness_key, x.start, x.weight
          FROM (SELECT a.*, rank() OVER (ORDER BY a.start + 1 / a.weight) AS place
                  FROM active a) x
         WHERE x.place <= room
    ), tagged AS (
        SELECT h.request_id, a.fairness_key, a.weight,
               a.start + (row_number() OVER (PARTITION BY a.fairness_key
                                             ORDER BY h.priority_rank, h.enqueued_at))
                         / a.weight AS tag,
               h.enqueued_at
          FROM firsts a CROSS JOIN LATERAL (
              SELECT r.request_id, r.priority_rank, r.enqueued_at FROM runs r
               WHERE r.waiting_for = 'limit fair_queue' AND r.status = 'queued'
                 AND r.fairness_key = a.fairness_key
               ORDER BY r.priority_rank, r.enqueued_at LIMIT room) h
    ), chosen AS (
        SELECT t.* FROM tagged t ORDER BY t.tag, t.enqueued_at LIMIT room
    ), marked AS (
        UPDATE runs u
           SET waiting_for = NULL, waiting_slots = NULL, dispatched_at = now()
          FROM chosen c
         WHERE u.request_id = c.request_id AND u.status = 'queued'
           AND u.waiting_for = 'limit fair_queue'
        RETURNING u.request_id, u.kind, u.session_id, u.user_id, u.agent, u.prompt,
                  u.metadata, u.not_before, u.options, u.routing
    ), tags AS (
        INSERT INTO fairness_keys AS f (fairness_key, vtime)
        SELECT c.fairness_key, max(c.tag) FROM chosen c GROUP BY c.fairness_key
        ON CONFLICT (fairness_key) DO UPDATE SET vtime = EXCLUDED.vtime
    ), advanced AS (
        INSERT INTO fair_clock AS f (id, vtime)
        SELECT 1, max(c.tag - 1 / c.weight) FROM chosen c HAVING count(*) > 0
        ON CONFLICT (id) DO UPDATE SET vtime = greatest(f.vtime, EXCLUDED.vtime)
    )
    SELECT m.request_id, m.kind, m.session_id, m.user_id, m.agent, m.prompt, m.metadata,
           m.not_before, m.options, m.routing FROM marked m;
END
$$;
