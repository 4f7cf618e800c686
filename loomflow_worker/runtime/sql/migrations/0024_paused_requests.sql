-- A run that would wait long for its model key (its budget, or a pause its
-- provider asked for) gives its slot back: its request is queued again until
-- then. `waiting_for` says why (for `show`, `requests` and the console);
-- `booked_key` and `booked_at` keep the place its model call booked in that
-- key's schedule, which its next attempt takes instead of booking another.
ALTER TABLE runs ADD COLUMN IF NOT EXISTS waiting_for TEXT,
                 ADD COLUMN IF NOT EXISTS booked_key TEXT,
                 ADD COLUMN IF NOT EXISTS booked_at TIMESTAMPTZ;
