-- The Celery binding's own statements outside the sweeper (tasks.application).

-- name: mark_interrupted
-- A worker shutting down (a deploy): its attempts still running end
-- "interrupted", so their next attempt does not count a crash.
UPDATE run_attempts SET outcome = 'interrupted'
 WHERE starts_with(worker, %(node)s) AND ended_at IS NULL AND outcome IS NULL;
