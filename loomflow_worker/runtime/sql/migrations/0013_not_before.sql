-- When a request may start (Celery's countdown or eta, or a retry's backoff;
-- NULL: at once): the sweeper never takes its message for lost before then,
-- and every message published again for it carries it as its eta.
ALTER TABLE runs ADD COLUMN IF NOT EXISTS not_before TIMESTAMPTZ;
-- What the request's message carried besides its arguments (chain, callbacks,
-- errbacks, chord and group membership, headers, priority, time limits), as
-- Celery's own retry rebuilds it: recorded when a worker parks the request
-- (acking its message), and carried by the message published for it when its
-- turn comes (a handoff, or the sweeper's).
ALTER TABLE runs ADD COLUMN IF NOT EXISTS options JSONB;
