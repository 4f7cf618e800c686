-- Whether the sweeper made sure a finished request's result reached the
-- Celery result backend (a worker can die between its commit and storing it).
ALTER TABLE runs ADD COLUMN IF NOT EXISTS result_checked BOOLEAN NOT NULL DEFAULT false;
CREATE INDEX IF NOT EXISTS runs_unchecked ON runs (finished_at) WHERE NOT result_checked;
