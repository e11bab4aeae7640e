//! Who may call what: every GRANT and REVOKE of the extension, in one place (decision 0016).
//!
//! - The functions that change the cluster (distribute a table, add or remove a node, migrate
//!   shards, resolve in-doubt transactions by hand) are for superusers and members of the
//!   `remus_admin` role, which the script creates (NOLOGIN) unless the PostgreSQL cluster has
//!   it already (roles are shared by every database). How each then gets the rights its work
//!   needs: the conversions run as their caller, who must own the table, and do the work as the
//!   bootstrap superuser (`distribute::caller`); adding, removing nodes, recovery and shard
//!   sizes and activating a node added later are SECURITY DEFINER with a pinned search_path (they take no object of the
//!   caller's); a migration needs nothing of the caller's (the coordinator does the work).
//! - `remus_run_on_node` (any SQL on any node, by the cluster's own connection) stays
//!   superuser-only: its body checks that too, whatever the grants.
//! - Nothing in schema `remus` can be executed by PUBLIC (its functions are the migration
//!   machinery's and the conversions' internals; the machinery connects as a superuser), except
//!   `remus.fanout`: the router's rewritten aggregate calls it as the calling role, which
//!   cannot name it itself. Nobody but a superuser has USAGE on `remus`: `remus_admin` executes
//!   the conversions' inner functions through SQL-standard bodies and `remus.list_migrations`
//!   through its view, neither of which names the schema at run time.
//! - Read-only: `remus_local_node`, `remus_shard_id_for` and `remus_shard_size` stay PUBLIC;
//!   the views `remus_nodes`, `remus_shards` and `remus_migrations` are for `remus_admin`
//!   (`remus_migrations` asks the coordinator on every read).
//!
//! Runs last (`finalize`), when every function exists; `ALL ROUTINES IN SCHEMA remus` then
//! covers each one. An upgrade script that adds a function must state its privileges too.

pgrx::extension_sql!(
    r#"
DO $$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_catalog.pg_roles WHERE rolname = 'remus_admin') THEN
        CREATE ROLE remus_admin NOLOGIN;
    END IF;
END
$$;
COMMENT ON ROLE remus_admin IS 'pg_remus: may distribute tables it owns, add and remove nodes, migrate shards';

-- The cluster's administration: superusers, and members of remus_admin.
DO $$
DECLARE
    f pg_catalog.regprocedure;
BEGIN
    FOREACH f IN ARRAY ARRAY[
        'remus_create_distributed_table(regclass, text, int, regclass)',
        'remus_create_reference_table(regclass)',
        'remus_add_node(text, text, int)',
        'remus_activate_node(text)',
        'remus_remove_node(text)',
        'remus_migrate_shard(bigint, text, text)',
        'remus_migrate_shards(bigint[], text, text)',
        'remus_recover_prepared()'
    ]::pg_catalog.regprocedure[] LOOP
        EXECUTE pg_catalog.format('REVOKE EXECUTE ON FUNCTION %s FROM PUBLIC', f);
        EXECUTE pg_catalog.format('GRANT EXECUTE ON FUNCTION %s TO remus_admin', f);
    END LOOP;
END
$$;
-- Defined in twophase/recovery.rs: like remus_add_node, it runs as the extension's owner
-- (it commits or rolls back the cluster's own prepared transactions on every node).
ALTER FUNCTION remus_recover_prepared() SECURITY DEFINER SET search_path = pg_catalog, pg_temp;

-- Arbitrary SQL on another node: superusers only.
REVOKE EXECUTE ON FUNCTION remus_run_on_node(text, text) FROM PUBLIC;

-- The internals. remus_admin may execute the two its conversions call (each checks that its
-- caller owns the table) and the one its view reads, without USAGE on the schema: it cannot
-- name them (nor remus.fanout, which runs any SQL it is given on every node).
REVOKE EXECUTE ON ALL ROUTINES IN SCHEMA remus FROM PUBLIC;
GRANT EXECUTE ON FUNCTION remus.fanout(regclass, text) TO PUBLIC;
GRANT EXECUTE ON FUNCTION
    remus.create_distributed_table(oid, text, int, oid),
    remus.create_reference_table(oid),
    remus.list_migrations()
  TO remus_admin;
GRANT SELECT ON remus_nodes, remus_shards, remus_migrations TO remus_admin;
"#,
    name = "privileges",
    finalize
);
