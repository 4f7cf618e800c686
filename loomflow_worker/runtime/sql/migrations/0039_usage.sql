-- What each request's model calls used and cost. A request's totals are kept
-- on its row, split into executed (the provider billed them) and replayed
-- (answered from the journal after a crash or a retry: not billed again);
-- each attempt's own, with the tokens by model key, in run_attempts.usage
-- (NULL: the attempt ended without recording it, e.g. its process was killed;
-- its journaled calls count in the request's executed totals all the same,
-- through the next attempt's replay). Written with the attempt's end, never
-- a statement per model call. cost is in US dollars; price_unknown says some
-- call's model has no known price (its tokens count, its cost does not).
ALTER TABLE runs ADD COLUMN IF NOT EXISTS model_calls INTEGER NOT NULL DEFAULT 0;
ALTER TABLE runs ADD COLUMN IF NOT EXISTS input_tokens BIGINT NOT NULL DEFAULT 0;
ALTER TABLE runs ADD COLUMN IF NOT EXISTS output_tokens BIGINT NOT NULL DEFAULT 0;
ALTER TABLE runs ADD COLUMN IF NOT EXISTS cache_read_tokens BIGINT NOT NULL DEFAULT 0;
ALTER TABLE runs ADD COLUMN IF NOT EXISTS cache_write_tokens BIGINT NOT NULL DEFAULT 0;
ALTER TABLE runs ADD COLUMN IF NOT EXISTS cost NUMERIC(20, 10) NOT NULL DEFAULT 0;
ALTER TABLE runs ADD COLUMN IF NOT EXISTS price_unknown BOOLEAN NOT NULL DEFAULT false;
ALTER TABLE runs ADD COLUMN IF NOT EXISTS replayed_calls INTEGER NOT NULL DEFAULT 0;
ALTER TABLE runs ADD COLUMN IF NOT EXISTS replayed_tokens BIGINT NOT NULL DEFAULT 0;
ALTER TABLE runs ADD COLUMN IF NOT EXISTS replayed_cost NUMERIC(20, 10) NOT NULL DEFAULT 0;
ALTER TABLE run_attempts ADD COLUMN IF NOT EXISTS usage JSONB;

-- `loomflow-worker usage` and the console's usage page: the requests that
-- called a model, by time, with every column the report sums, so a report of
-- a window is an index-only scan of that window, whatever the ledger holds.
CREATE INDEX IF NOT EXISTS runs_usage ON runs (enqueued_at)
    INCLUDE (agent, fairness_key, user_id, model_calls, input_tokens, output_tokens,
             cache_read_tokens, cache_write_tokens, cost, price_unknown, replayed_calls,
             replayed_tokens, replayed_cost)
    WHERE model_calls > 0 OR replayed_calls > 0;
-- `requests --sort cost`: the costliest first.
CREATE INDEX IF NOT EXISTS runs_cost ON runs (cost DESC, seq DESC) WHERE cost > 0;
