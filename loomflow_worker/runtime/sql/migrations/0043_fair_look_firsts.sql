-- A look for the requests whose fair turn came weighs the `room` tenants whose first
-- requests come first, not every tenant tied with them: with 3,000 tenants at the
-- clock (each a first request), it read every one's requests to keep the oldest 32.
-- The walk over the keys returns when each key's first request was enqueued (from the
-- same index probe), and the keys are ordered by first tag, then that age, as the
-- requests chosen are.
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
    depth := loomflow_worker_fair_depth();
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
        -- The keys with held requests, one index probe each, with when the
        -- request each sends first (by priority, then age) was enqueued.
        (SELECT r.fairness_key, r.enqueued_at AS first_at FROM runs r
          WHERE r.waiting_for = 'limit fair_queue' AND r.status = 'queued'
          ORDER BY r.fairness_key, r.priority_rank, r.enqueued_at LIMIT 1)
        UNION ALL
        SELECT n.fairness_key, n.first_at
          FROM keys k CROSS JOIN LATERAL (
               SELECT r.fairness_key, r.enqueued_at AS first_at FROM runs r
                WHERE r.waiting_for = 'limit fair_queue' AND r.status = 'queued'
                  AND r.fairness_key > k.fairness_key
                ORDER BY r.fairness_key, r.priority_rank, r.enqueued_at LIMIT 1) n
    ), active AS (
        SELECT k.fairness_key, k.first_at, greatest(coalesce(f.vtime, 0), clock) AS start,
               coalesce(f.weight, f.call_weight, 1) AS weight
          FROM keys k LEFT JOIN fairness_keys f ON f.fairness_key = k.fairness_key
         WHERE k.fairness_key IS NOT NULL
    ), firsts AS (
        -- Only the `room` keys whose first requests come first (by first tag,
        -- then age, as `chosen` orders them) can get any of the room: each of
        -- another key's requests comes after all of their first requests. Keys
        -- tied on their first tag (every tenant at the clock) are not all
        -- weighed: their oldest first requests go first.
        SELECT x.fairness_key, x.start, x.weight
          FROM (SELECT a.*, row_number() OVER (ORDER BY a.start + 1 / a.weight, a.first_at,
                                                        a.fairness_key) AS place
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
           -- Its message now on its way, as a new request's: no handoff
           -- publishes it again until a worker takes it and parks it.
           SET waiting_for = NULL, waiting_slots = NULL, dispatched_at = now(),
               received_at = NULL
          FROM chosen c
         WHERE u.request_id = c.request_id AND u.status = 'queued'
           AND u.waiting_for = 'limit fair_queue'
        RETURNING u.request_id, u.kind, u.session_id, u.user_id, u.agent, u.prompt,
                  u.metadata, u.not_before, u.options, u.routing
    ), after AS (
        -- Each waiting key's virtual time once these go: the tag of its last
        -- chosen request, else where it starts from now.
        SELECT a.fairness_key, coalesce(max(c.tag), a.start) AS vtime, count(c.tag) > 0 AS moved
          FROM active a LEFT JOIN chosen c ON c.fairness_key = a.fairness_key
         GROUP BY a.fairness_key, a.start
    ), tags AS (
        -- Written for the keys that sent a request only: another's start,
        -- greatest(its time, the clock), is the same computed again next time,
        -- the clock only going forward.
        INSERT INTO fairness_keys AS f (fairness_key, vtime)
        SELECT t.fairness_key, t.vtime FROM after t WHERE t.moved
        ON CONFLICT (fairness_key) DO UPDATE SET vtime = EXCLUDED.vtime
    ), advanced AS (
        INSERT INTO fair_clock AS f (id, vtime)
        SELECT 1, min(t.vtime) FROM after t HAVING count(*) > 0
        ON CONFLICT (id) DO UPDATE SET vtime = greatest(f.vtime, EXCLUDED.vtime)
    )
    SELECT m.request_id, m.kind, m.session_id, m.user_id, m.agent, m.prompt, m.metadata,
           m.not_before, m.options, m.routing FROM marked m;
END
$$;
