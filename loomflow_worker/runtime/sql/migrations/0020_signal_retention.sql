-- Signals are bounded and pruned per scope, the journal's key of a
-- (session, user): a send drops the oldest undelivered signals of its scope
-- past SIGNALS_PER_SCOPE, and prune / RETENTION delete old ones. The scope is
-- loomflow's journal_scope(session_id, user_id), computed by Postgres so a
-- row sent by any release gets it.
CREATE OR REPLACE FUNCTION loomflow_worker_scope(session_id TEXT, user_id TEXT) RETURNS TEXT
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT CASE
        WHEN user_id IS NOT NULL
            THEN 'user:' || length(user_id) || ':' || user_id || ':' || session_id
        WHEN starts_with(session_id, 'user:') OR starts_with(session_id, 'anon:')
            THEN 'anon:' || session_id
        ELSE session_id
    END
$$;

ALTER TABLE signals ADD COLUMN IF NOT EXISTS scope TEXT
    GENERATED ALWAYS AS (loomflow_worker_scope(session_id, user_id)) STORED;

-- The bound at send (a scope's signals, newest first) and the prune by age.
CREATE INDEX IF NOT EXISTS signals_scope ON signals (scope, id);
CREATE INDEX IF NOT EXISTS signals_created ON signals (created_at);

-- Whether an unfinished request may still take a signal, so a prune keeps it:
-- one of its scope, or, for a signal sent to no user, one of its session.
CREATE OR REPLACE FUNCTION loomflow_worker_signal_awaited(
    scope TEXT, session_id TEXT, user_id TEXT
) RETURNS BOOLEAN LANGUAGE sql STABLE PARALLEL SAFE AS $$
    SELECT EXISTS (SELECT 1 FROM runs r WHERE r.scope = $1
                      AND loomflow_worker_unfinished(r.status))
        OR ($3 IS NULL AND EXISTS (SELECT 1 FROM runs r WHERE r.session_id = $2
                                      AND loomflow_worker_unfinished(r.status)))
$$;
