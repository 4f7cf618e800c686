-- Concurrency limits shared by the fleet: at most max_runs requests in flight
-- per limit: "per_key" (each fairness key, by default the request's user,
-- apart), "agent:NAME" (an agent's runs), or a name agents share
-- (register_agent(limits=[...])). A run holds one of its limit's slots (an
-- advisory lock on its lock connection) while it runs; a request whose limit
-- is full parks, saying which in waiting_for, with the slots it waits for in
-- waiting_slots, and is published again when a slot frees (by the run that
-- frees it, or by the sweeper).
CREATE TABLE IF NOT EXISTS concurrency_limits (
    name TEXT PRIMARY KEY CHECK (octet_length(name) BETWEEN 1 AND 72),
    max_runs INTEGER NOT NULL CHECK (max_runs > 0),
    updated_at TIMESTAMPTZ NOT NULL DEFAULT now()
);
ALTER TABLE runs ADD COLUMN IF NOT EXISTS waiting_slots BIGINT[];
-- The order requests waiting on one limit are published in: their Celery
-- priority as their broker orders it (lowest rank first: Redis's 0 first,
-- RabbitMQ's highest first), then the order they were accepted in.
ALTER TABLE runs ADD COLUMN IF NOT EXISTS priority_rank SMALLINT NOT NULL DEFAULT 0;
CREATE INDEX IF NOT EXISTS runs_waiting_for ON runs (waiting_for, priority_rank, enqueued_at)
    WHERE waiting_slots IS NOT NULL;
-- A request's fairness key (its user, or its session when it has none), and
-- the requests of a key that are out: published, running, or waiting for
-- their session (not held back on the key's limit), which an enqueue counts.
ALTER TABLE runs ADD COLUMN IF NOT EXISTS fairness_key TEXT;
CREATE INDEX IF NOT EXISTS runs_fairness_open ON runs (fairness_key)
    WHERE loomflow_worker_unfinished(status) AND waiting_slots IS NULL;
