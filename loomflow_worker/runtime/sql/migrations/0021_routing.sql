-- Where a request's messages go: its queue (the name the broker counts, as
-- Celery's router resolved it at enqueue), and the exchange, routing key and
-- priority its caller asked for. Recorded at enqueue (or from the message,
-- for a request the ledger first sees in a worker); every message published
-- for it again (a handoff, the sweeper's) goes the same way. NULL: the
-- fleet's default queue (rows from before this column).
ALTER TABLE runs ADD COLUMN IF NOT EXISTS routing JSONB;
-- When a worker last said it holds the request's message without having
-- started it (received, then held for a rate limit or waiting for its
-- prefetch slot): such a message is in no queue the broker counts, and is not
-- lost while its worker keeps saying so.
ALTER TABLE runs ADD COLUMN IF NOT EXISTS held_at TIMESTAMPTZ;
