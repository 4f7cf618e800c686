-- A run that waits long for a signal gives its slot back: its request is
-- queued again with the signal's name and session here, and the sweeper
-- publishes it once such a signal waits in that session's mailbox for it.
ALTER TABLE runs ADD COLUMN IF NOT EXISTS waiting_signal TEXT,
                 ADD COLUMN IF NOT EXISTS waiting_signal_session TEXT;
