-- False while a finished request's result is not in the Celery result backend
-- because its worker could not store it (the backend was down): the sweeper
-- stores it from the ledger once the backend is back.
ALTER TABLE runs ADD COLUMN IF NOT EXISTS result_stored BOOLEAN NOT NULL DEFAULT true;
CREATE INDEX IF NOT EXISTS runs_result_unstored ON runs (finished_at) WHERE NOT result_stored;
