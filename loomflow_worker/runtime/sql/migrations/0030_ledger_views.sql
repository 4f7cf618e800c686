-- The ledger's side of pruning, as two views. The runtime's prune (one set of
-- rules across the journal and the ledger) reads and deletes through them and
-- names neither ledger table: the ledger's columns and status words stay its
-- own, and a change to its tables keeps these two views' meaning.

-- Scopes with an unfinished request: they keep their journal and the signals
-- their runs may take.
CREATE OR REPLACE VIEW loomflow_worker_unfinished_scopes AS
    SELECT scope FROM runs WHERE loomflow_worker_unfinished(status);

-- Finished requests, what a prune may delete. A single-table view, so a DELETE
-- on it deletes the ledger's row (its attempts cascade) and FOR UPDATE locks it.
CREATE OR REPLACE VIEW loomflow_worker_finished_requests AS
    SELECT request_id, scope, enqueued_at, finished_at
      FROM runs WHERE loomflow_worker_finished(status);
