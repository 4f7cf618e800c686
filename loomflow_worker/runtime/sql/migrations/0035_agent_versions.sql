-- Agent versions (see loomflow_worker.execution.versions).
--
-- A request is pinned to the version of its agent that its first attempt ran
-- (runs.agent_version, set by start_request): a later attempt starts only on a
-- worker of that version. A worker of another version that receives it sends
-- it on to the version's own queue and leaves it queued, waiting for that
-- version since version_wait_since (cleared when an attempt starts). Each
-- attempt records the version it ran.
ALTER TABLE runs ADD COLUMN IF NOT EXISTS agent_version TEXT;
ALTER TABLE runs ADD COLUMN IF NOT EXISTS version_wait_since TIMESTAMPTZ;
ALTER TABLE run_attempts ADD COLUMN IF NOT EXISTS agent_version TEXT;
-- No index of its own: what reads requests by version (versions, the waiting
-- gauge, loomflow_worker_version_demand) reads only unfinished ones, a few
-- thousand at most, found through runs_status; an index here would cost every
-- start and finish an entry.

-- The fleet's agents: each worker process's row per agent it serves, with the
-- version it built and what enqueuing needs of it (fairness key, shared
-- limits, time limit, model key). A worker is alive while its row in
-- `workers` is stamped; its agents go with that row.
CREATE TABLE IF NOT EXISTS worker_agents (
    worker TEXT NOT NULL,
    agent TEXT NOT NULL,
    version TEXT NOT NULL,
    declared BOOLEAN NOT NULL DEFAULT false,
    fairness_key TEXT,
    limits TEXT[] NOT NULL DEFAULT '{}',
    time_limit DOUBLE PRECISION,
    model_key TEXT,
    built_at TIMESTAMPTZ NOT NULL DEFAULT now(),
    PRIMARY KEY (worker, agent)
);
CREATE INDEX IF NOT EXISTS worker_agents_version ON worker_agents (agent, version);

-- A request moved to another version on purpose (`loomflow-worker upgrade`, or
-- its agent's on_version_gone policy): from, to, when and by whom.
CREATE TABLE IF NOT EXISTS run_upgrades (
    request_id TEXT NOT NULL REFERENCES runs (request_id) ON DELETE CASCADE,
    at TIMESTAMPTZ NOT NULL DEFAULT clock_timestamp(),
    from_version TEXT,
    to_version TEXT NOT NULL,
    by TEXT NOT NULL,
    PRIMARY KEY (request_id, at)
);

-- What the workers of one release still owe: unfinished requests pinned to a
-- version of an agent that a worker whose host name starts with `host_prefix`
-- (a Deployment's pods: its name) built, and that no live worker of another
-- host name serves. An autoscaler keeps that release running (or starts it
-- again) while this is above zero, and lets it scale to zero after
-- (deploy/k8s). A version whose workers were all forgotten (a day unseen)
-- counts nowhere: see `loomflow-worker versions`.
CREATE OR REPLACE FUNCTION loomflow_worker_version_demand(host_prefix TEXT) RETURNS bigint
LANGUAGE sql STABLE AS $$
    WITH mine AS (
        SELECT DISTINCT a.agent, a.version
          FROM worker_agents a JOIN workers w USING (worker)
         WHERE starts_with(w.hostname, host_prefix)
    ), served_elsewhere AS (
        SELECT DISTINCT a.agent, a.version
          FROM worker_agents a JOIN workers w USING (worker)
         WHERE NOT starts_with(w.hostname, host_prefix) AND w.stopped_at IS NULL
           AND w.seen_at > now() - make_interval(secs => 2 * w.heartbeat_interval)
    )
    SELECT count(*)
      FROM runs r JOIN mine m ON m.agent = r.agent AND m.version = r.agent_version
     WHERE r.status IN ('queued', 'running') AND r.agent_version IS NOT NULL
       AND NOT EXISTS (SELECT 1 FROM served_elsewhere s
                        WHERE s.agent = r.agent AND s.version = r.agent_version)
$$;

-- The routing of a request sent to the queue of `version` of its agent: its
-- queue's name (`default_queue` when its routing names none) followed by
-- `suffix`, its priority kept, the version under `version` and its routing
-- before under `base` (which an attempt that starts takes back). A routing
-- that already names a version is made again from its base.
CREATE OR REPLACE FUNCTION loomflow_worker_version_routing(
    routing JSONB, default_queue TEXT, suffix TEXT, version TEXT) RETURNS jsonb
LANGUAGE sql IMMUTABLE AS $$
    WITH b AS (
        SELECT CASE WHEN routing ? 'version' THEN routing -> 'base' ELSE routing END AS base
    )
    SELECT jsonb_strip_nulls(jsonb_build_object(
               'queue', coalesce(b.base ->> 'queue', default_queue) || suffix,
               'priority', b.base -> 'priority', 'version', version, 'base', b.base))
      FROM b
$$;
