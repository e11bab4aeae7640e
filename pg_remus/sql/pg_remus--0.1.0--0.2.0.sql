-- pg_remus 0.1.0 -> 0.2.0, run by ALTER EXTENSION pg_remus UPDATE on a node that already
-- loads the 0.2.0 library (decision 0020, README "Upgrading").
--
-- The rule: every change to the SQL surface in the 0.2.0 development cycle (a function, view,
-- table, column, grant or comment added, changed or removed in pg_remus/src) adds its
-- statements here, in the order they must run, so that a 0.1.0 database updated by this file
-- ends up with exactly the catalog of a fresh CREATE EXTENSION pg_remus of 0.2.0. The
-- integration test upgrade_catalog fails with the difference when it does not.
--
-- Write it as the generated install script writes the same objects (pgrx's `cargo pgrx schema`
-- output for the function, `AS 'MODULE_PATHNAME', '<symbol>'` for a Rust function), and repeat
-- the grants of the install script's `finalize` block (pg_remus/src/api/privileges.rs) for what
-- it covers: a new function in schema remus gets REVOKE EXECUTE ... FROM PUBLIC, a new
-- administration function REVOKE from PUBLIC and GRANT to remus_admin.

\echo Use "ALTER EXTENSION pg_remus UPDATE" to load this file. \quit

-- 0.2.0 has not changed the SQL surface of 0.1.0 yet.
