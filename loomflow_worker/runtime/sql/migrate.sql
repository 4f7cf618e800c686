-- The schema's own bookkeeping (runtime.migrate): the migrations in migrations/NNNN_name.sql
-- are applied in order, in one transaction under an advisory lock, and each version applied
-- is recorded in loomflow_worker_schema. The doctor (admin.doctor) reads the versions too.

-- name: migration_lock
-- Taken first by every process that migrates (MIGRATION_LOCK_KEY), a transaction-level lock:
-- a fleet starting at once applies each migration once, and the lock goes with the migrating
-- transaction's commit.
SELECT pg_advisory_xact_lock(%(key)s);

-- name: create_schema_table
-- The table of applied versions, one row per migration; IF NOT EXISTS, so every migrate but
-- a new database's first finds it there.
CREATE TABLE IF NOT EXISTS loomflow_worker_schema (
    version    INTEGER PRIMARY KEY,
    name       TEXT NOT NULL,
    applied_at TIMESTAMPTZ NOT NULL DEFAULT now()
);

-- name: schema_present
-- Whether the table of applied versions exists (to_regclass is NULL when not): migrate and
-- the doctor read schema_versions only then, so a database never migrated has nothing
-- applied (and the doctor reports it) rather than an error.
SELECT to_regclass('loomflow_worker_schema') IS NOT NULL;

-- name: schema_versions
-- The versions applied, ascending (its primary key): migrate applies the missing ones and
-- refuses a database newer than the package; the doctor reports them.
SELECT version FROM loomflow_worker_schema ORDER BY version;

-- name: record_version
-- One migration applied, recorded in the transaction that ran it: one that fails records
-- nothing and is tried again at the next start.
INSERT INTO loomflow_worker_schema (version, name) VALUES (%(version)s, %(name)s);
