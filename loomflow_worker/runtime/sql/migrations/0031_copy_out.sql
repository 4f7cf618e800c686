-- A running request whose worker died has a copy out: the sweeper published
-- its message again since its last attempt started, and no attempt started
-- from it yet. The sweeper counts that copy among its queue's messages, and a
-- worker holding it received but unstarted says so (see sweeper.sql, orphans).
CREATE OR REPLACE FUNCTION loomflow_worker_copy_out(status TEXT, swept_at TIMESTAMPTZ,
                                                    started_at TIMESTAMPTZ) RETURNS BOOLEAN
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT status = 'running' AND swept_at >= started_at
$$;
