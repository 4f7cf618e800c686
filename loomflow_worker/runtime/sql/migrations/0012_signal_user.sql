-- Signals are scoped like journals, per (session, user): a signal sent to a
-- user reaches only that user's waiters; one sent with no user (loomflow's
-- session-only signal(session_id, ...)) reaches a waiter of any user on the
-- session.
ALTER TABLE signals ADD COLUMN IF NOT EXISTS user_id TEXT;
