-- Named parts of the two longest statements, the sweeper's orphans and the
-- ledger's start_request (sweeper.sql, ledger.sql): each statement reads as a
-- composition of these. Each is a view or a LANGUAGE sql function simple
-- enough for the planner to inline (not strict, not volatile, one SELECT), so
-- a statement built of them is planned as the one it replaces, on the same
-- indexes. Nothing stored changes.

-- Whether a live worker holds a request's message unstarted: it said so
-- (held_at) since the message was published, within `within` seconds.
CREATE OR REPLACE FUNCTION loomflow_worker_held(held_at TIMESTAMPTZ, dispatched_at TIMESTAMPTZ,
                                                within DOUBLE PRECISION) RETURNS BOOLEAN
LANGUAGE sql STABLE PARALLEL SAFE AS $$
    SELECT coalesce(held_at > dispatched_at AND held_at > now() - make_interval(secs => within),
                    false)
$$;
COMMENT ON FUNCTION loomflow_worker_held(TIMESTAMPTZ, TIMESTAMPTZ, DOUBLE PRECISION) IS
    'Whether a live worker holds the request''s message unstarted: it said so (held_at) '
    'since the message was published (dispatched_at), within `within` seconds.';

-- The messages the broker may hold: published and not received since (or
-- published again since, a handoff), due (not_before passed), held unstarted
-- by no live worker; with their age in their queue (the routing's, or
-- default_queue), since a broker hands out the oldest first.
CREATE OR REPLACE FUNCTION loomflow_worker_in_broker(default_queue TEXT,
                                                     held_within DOUBLE PRECISION)
RETURNS TABLE (request_id TEXT, seq BIGINT, dispatched_at TIMESTAMPTZ, queue TEXT, age BIGINT)
LANGUAGE sql STABLE PARALLEL SAFE AS $$
    SELECT request_id, seq, dispatched_at, coalesce(routing->>'queue', default_queue) AS queue,
           row_number() OVER (PARTITION BY coalesce(routing->>'queue', default_queue)
                              ORDER BY dispatched_at, seq) AS age
      FROM runs
     WHERE (status = 'queued' OR loomflow_worker_copy_out(status, swept_at, started_at))
       AND (received_at IS NULL OR dispatched_at > received_at)
       AND (not_before IS NULL OR not_before <= now())
       AND NOT loomflow_worker_held(held_at, dispatched_at, held_within)
$$;
COMMENT ON FUNCTION loomflow_worker_in_broker(TEXT, DOUBLE PRECISION) IS
    'The messages the broker may hold (published and not received since, due, held by no '
    'live worker), with their age in their queue (the routing''s, or default_queue).';

-- The oldest unfinished request of each scope (the one its scope runs next),
-- with what the sweeper needs to publish it again and to judge it (an
-- orphan's options are a queued request's only).
CREATE OR REPLACE VIEW loomflow_worker_scope_heads AS
    SELECT DISTINCT ON (scope) scope, seq, request_id, kind, session_id, user_id, agent, prompt, metadata,
           not_before, CASE WHEN status = 'queued' THEN options END AS options, routing, status,
           dispatched_at, swept_at, started_at, heartbeat_at, lock_key, held_at,
           waiting_for, waiting_slots, enqueued_at, priority_rank, waiting_signal,
           waiting_signal_session, received_at, fairness_key, waiting_budget
      FROM runs
     WHERE loomflow_worker_unfinished(status)
     ORDER BY scope, seq;
COMMENT ON VIEW loomflow_worker_scope_heads IS
    'The oldest unfinished request of each scope, the one its scope runs next.';

-- The advisory locks granted in this database, in the form a bigint key
-- takes (objsubid 1): the scopes' locks and the concurrency limits' slots.
CREATE OR REPLACE VIEW loomflow_worker_advisory_locks AS
    SELECT classid, objid FROM pg_locks
     WHERE locktype = 'advisory' AND granted AND objsubid = 1
       AND database = (SELECT oid FROM pg_database WHERE datname = current_database());
COMMENT ON VIEW loomflow_worker_advisory_locks IS
    'The advisory locks granted in this database on bigint keys (the scopes'' locks, the '
    'concurrency limits'' slots): a key k is held when classid = (k >> 32) and objid = the '
    'low 32 bits.';

-- The scope's epochs as the journal has them: the current run's, and the
-- last finished run's (a resume continues it).
CREATE OR REPLACE FUNCTION loomflow_worker_scope_epochs(of_scope TEXT)
RETURNS TABLE (current INTEGER, last INTEGER)
LANGUAGE sql STABLE PARALLEL SAFE AS $$
    SELECT max(loomflow_worker_epoch(value)) FILTER (WHERE step_name = '__run_epoch__'),
           max(loomflow_worker_epoch(value)) FILTER (WHERE step_name = '__last_run_epoch__')
      FROM journal_steps
     WHERE session_id = of_scope AND step_name IN ('__run_epoch__', '__last_run_epoch__')
$$;
COMMENT ON FUNCTION loomflow_worker_scope_epochs(TEXT) IS
    'The scope''s epochs as the journal has them: the current run''s and the last run''s.';

-- The worker of a request's attempt `att` while that attempt may still be
-- running (its lock connection ended but its worker lives and has not yet
-- stopped its step): until the attempt records how it ended, its worker stops
-- stamping its row in `workers` (dead, or stopped) for two of its heartbeat
-- intervals or a new process stamps it (`boot`: a container restarted in
-- place, under the same worker id), or the request's heartbeat (beat_at) is
-- older than the lease. A worker with no row: for two intervals of `every`.
CREATE OR REPLACE FUNCTION loomflow_worker_open_attempt(req TEXT, att INTEGER,
                                                        beat_at TIMESTAMPTZ,
                                                        lease DOUBLE PRECISION,
                                                        every DOUBLE PRECISION)
RETURNS TABLE (worker TEXT)
LANGUAGE sql STABLE PARALLEL SAFE AS $$
    SELECT a.worker
      FROM run_attempts a
      LEFT JOIN workers w ON w.worker = a.worker
     WHERE a.request_id = req AND a.attempt = att AND a.ended_at IS NULL
       AND beat_at > now() - make_interval(secs => lease)
       AND CASE WHEN w.worker IS NULL
                THEN beat_at > now() - make_interval(secs => 2 * every)
                ELSE w.stopped_at IS NULL AND w.boot IS NOT DISTINCT FROM a.boot
                     AND w.seen_at > now() - make_interval(secs => 2 * w.heartbeat_interval)
           END
$$;
COMMENT ON FUNCTION loomflow_worker_open_attempt(TEXT, INTEGER, TIMESTAMPTZ, DOUBLE PRECISION,
                                                 DOUBLE PRECISION) IS
    'The worker of a request''s attempt while that attempt may still be running: not ended, '
    'its worker alive (stamping its row, same boot) and the request''s heartbeat within the '
    'lease.';
