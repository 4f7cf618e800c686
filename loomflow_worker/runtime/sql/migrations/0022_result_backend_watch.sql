-- What the sweeper's leader knows of the result backend, to tell when it lost
-- results it held (a Redis restarted without persistence or from an older
-- snapshot, flushed, failed over to a replica behind, or evicting keys): the
-- mark it last left there (a moment on the database's clock) under a key named
-- by `token` (this ledger's own, so fleets sharing a Redis keep apart), and
-- how many keys the server said it had evicted. While it re-checks the results
-- that should still be there, how far it got: the finished requests after
-- (recheck_at, recheck_seq) up to recheck_until are left.
CREATE TABLE IF NOT EXISTS result_backend_watch (
    id            INTEGER PRIMARY KEY CHECK (id = 1),
    token         TEXT NOT NULL DEFAULT md5(random()::text || clock_timestamp()::text),
    mark          DOUBLE PRECISION,
    evicted       BIGINT,
    recheck_at    TIMESTAMPTZ,
    recheck_seq   BIGINT,
    recheck_until TIMESTAMPTZ
);
INSERT INTO result_backend_watch (id) VALUES (1) ON CONFLICT (id) DO NOTHING;

-- The finished requests whose result is wanted, in the order they finished:
-- what a re-check walks.
CREATE INDEX IF NOT EXISTS runs_finished ON runs (finished_at, seq)
    WHERE finished_at IS NOT NULL AND NOT ignore_result;
