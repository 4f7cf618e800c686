-- The integer a journal value holds when it is loomflow's tagged-JSON
-- encoding of a plain integer ("LJ1" then digits), else NULL. Lets a run
-- read its epoch and load its namespace in one query, and advance the
-- epoch with one forward-only upsert.
CREATE OR REPLACE FUNCTION loomflow_worker_epoch(value BYTEA) RETURNS INTEGER
LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE AS $$
    SELECT CASE
        WHEN substring(value FROM 1 FOR 3) = '\x4c4a31'::bytea
         AND length(value) BETWEEN 4 AND 12
         AND encode(substring(value FROM 4), 'escape') ~ '^[0-9]+$'
        THEN encode(substring(value FROM 4), 'escape')::integer
    END
$$;
