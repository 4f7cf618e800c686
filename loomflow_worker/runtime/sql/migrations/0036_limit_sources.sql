-- Where each concurrency limit and fairness weight came from, for the rule
-- that decides between them (loomflow_worker.execution.limits): `command`
-- (`loomflow-worker limits`, which holds until the command changes it) or
-- `settings` (LOOMFLOW_WORKER_LIMITS / FAIRNESS_WEIGHTS of a process, written
-- at a worker's start and at a process's first enqueue; the newest settings
-- win, never over a command, and say so), and who set it. A limit set before
-- this counts as settings: a worker's start replaced it then, as newer
-- settings do now.
ALTER TABLE concurrency_limits ADD COLUMN IF NOT EXISTS source TEXT NOT NULL DEFAULT 'settings';
ALTER TABLE concurrency_limits ADD COLUMN IF NOT EXISTS set_by TEXT;
ALTER TABLE fairness_keys ADD COLUMN IF NOT EXISTS weight_source TEXT;
ALTER TABLE fairness_keys ADD COLUMN IF NOT EXISTS weight_set_by TEXT;
