-- A request Celery let expire (apply_async(expires=...)) before it started
-- ends "expired", a terminal status of its own.
ALTER TABLE runs DROP CONSTRAINT IF EXISTS runs_status_check;
ALTER TABLE runs ADD CONSTRAINT runs_status_check CHECK (
    status IN ('queued', 'running', 'succeeded', 'failed', 'cancelled', 'dead', 'expired'));
