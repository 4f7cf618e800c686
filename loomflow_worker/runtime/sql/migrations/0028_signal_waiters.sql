-- The requests parked waiting for a signal, by the session and name they
-- wait on: a signal's sender finds them (signal_waiters) and publishes them
-- at once, rather than leaving them to the sweeper's next sweep.
CREATE INDEX IF NOT EXISTS runs_signal_waiting ON runs (waiting_signal_session, waiting_signal)
    WHERE waiting_signal IS NOT NULL;
