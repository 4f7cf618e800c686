-- The demo's own database (`loomflow-worker demo` on a server it did not start). The name is
-- composed in by psycopg.sql, as an identifier: these two are formatted, so they hold no
-- braces but their placeholder.

-- name: create_database
-- A database for one demo; its name is an identifier psycopg composes in.
CREATE DATABASE {}

-- name: drop_database
-- The demo's database at its end, whoever is still connected.
DROP DATABASE IF EXISTS {} WITH (FORCE)
