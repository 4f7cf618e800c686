-- The run console (loomflow_worker.console) reads the ledger newest first, by
-- seq, under each filter it offers; each filter has an index that yields its
-- requests in that order, so a page costs a short backward index scan however
-- many requests the ledger holds. By session: runs_session (0003).
CREATE INDEX IF NOT EXISTS runs_status_seq ON runs (status, seq);
CREATE INDEX IF NOT EXISTS runs_user_seq ON runs (user_id, seq);
CREATE INDEX IF NOT EXISTS runs_agent_seq ON runs (agent, seq);
-- A time window ("enqueued in the last hour", "before 14:02").
CREATE INDEX IF NOT EXISTS runs_enqueued ON runs (enqueued_at);
-- The fleet page: attempts started lately (which processes ran what, which
-- died), and the requests the sweeper dispatched again, latest first.
CREATE INDEX IF NOT EXISTS run_attempts_started ON run_attempts (started_at);
CREATE INDEX IF NOT EXISTS runs_swept ON runs (swept_at) WHERE swept_at IS NOT NULL;
