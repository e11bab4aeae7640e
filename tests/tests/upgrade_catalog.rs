//! Upgrade scripts are complete (issue 18 item 5, decision 0020): for every earlier release
//! whose install script is kept in `pg_remus/sql/pg_remus--<version>.sql`, a database created
//! at that version with the installed (current) library and updated by `ALTER EXTENSION
//! pg_remus UPDATE` has the catalog of a fresh `CREATE EXTENSION pg_remus` (the current
//! version, the workspace's): the lines of `tests/upgrade/catalog.sql` (functions with their
//! whole definitions, views, tables and columns, types, grants, comments, the schemas, the
//! roles) are the same in both databases.
//!
//! - `every_earlier_release_updates_to_a_fresh_catalog`: on a throwaway PostgreSQL 15 that
//!   preloads pg_remus, one database per earlier release and one fresh database. A
//!   difference fails with the lines only the updated database has (`-`) and those only the
//!   fresh one has (`+`): the statements missing from the upgrade script. Creating the earlier
//!   release's functions checks that the current library still exports every symbol they name:
//!   CREATE FUNCTION … LANGUAGE c loads the library and looks the symbol up (PostgreSQL's
//!   `fmgr_c_validator`, also inside an extension script, where `check_function_bodies` is
//!   off). A node restarted on the new library runs the old catalog until `ALTER EXTENSION …
//!   UPDATE`.
//! - `what_an_upgrade_script_forgets_is_reported`: the comparison itself, on two fresh
//!   databases one of which gets what an upgrade script typically forgets (a function added to
//!   the extension, a column, a grant, a changed function body): each shows in the difference.
//! - `the_installed_scripts_are_the_repositorys`: the upgrade scripts and earlier releases'
//!   scripts in PostgreSQL's extension directory are those of `pg_remus/sql` (else this test
//!   would check stale files: run `scripts/lib.sh`'s `install_extension`), and the control
//!   file's default version is the workspace's.
//!
//! Needs what every integration test needs: the extension built from this tree installed
//! (`scripts/setup.sh`, or `install_extension`). A few seconds.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use postgres::{Client, NoTls};
use remus_test_support::pg::PgServer;

const CATALOG_SQL: &str = include_str!("../upgrade/catalog.sql");
const CURRENT: &str = env!("CARGO_PKG_VERSION");

fn sql_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../pg_remus/sql")
}

/// The versions whose whole install script `pg_remus/sql` keeps: `pg_remus--<v>.sql`.
fn earlier_releases() -> Vec<String> {
    let mut versions: Vec<String> = std::fs::read_dir(sql_dir())
        .expect("read pg_remus/sql")
        .map(|e| {
            e.expect("directory entry")
                .file_name()
                .to_string_lossy()
                .into_owned()
        })
        .filter_map(|name| {
            let v = name.strip_prefix("pg_remus--")?.strip_suffix(".sql")?;
            (!v.contains("--")).then(|| v.to_string())
        })
        .collect();
    versions.sort();
    versions
}

/// PostgreSQL's extension directory (`pg_config --sharedir`/extension).
fn extension_dir() -> PathBuf {
    let out = Command::new("/usr/lib/postgresql/15/bin/pg_config")
        .arg("--sharedir")
        .output()
        .expect("run pg_config");
    assert!(out.status.success(), "pg_config --sharedir failed");
    Path::new(String::from_utf8_lossy(&out.stdout).trim()).join("extension")
}

fn server() -> PgServer {
    PgServer::start_with(
        "-c shared_preload_libraries=pg_remus -c track_commit_timestamp=on \
         -c max_prepared_transactions=20 -c remus.node_name=n1",
        "remus-upgrade-",
    )
}

fn connect(pg: &PgServer, db: &str) -> Client {
    Client::connect(&pg.conninfo_db(db), NoTls).unwrap_or_else(|e| panic!("connect to {db}: {e}"))
}

/// The catalog lines of `tests/upgrade/catalog.sql` in database `db`.
fn catalog(pg: &PgServer, db: &str) -> Vec<String> {
    connect(pg, db)
        .query(CATALOG_SQL, &[])
        .unwrap_or_else(|e| panic!("catalog.sql in {db}: {e}"))
        .iter()
        .map(|r| r.get::<_, String>(0))
        .collect()
}

/// Lines only in `updated` (`- `) and only in `fresh` (`+ `), in catalog order; empty when the
/// two are the same (as multisets).
fn difference(updated: &[String], fresh: &[String]) -> Vec<String> {
    let mut count: BTreeMap<&str, i64> = BTreeMap::new();
    for l in updated {
        *count.entry(l).or_default() += 1;
    }
    for l in fresh {
        *count.entry(l).or_default() -= 1;
    }
    let mut out = Vec::new();
    for (line, n) in count {
        let sign = if n > 0 { '-' } else { '+' };
        for _ in 0..n.abs() {
            out.push(format!("{sign} {line}"));
        }
    }
    out
}

#[test]
fn every_earlier_release_updates_to_a_fresh_catalog() {
    let releases = earlier_releases();
    assert!(
        !releases.is_empty(),
        "pg_remus/sql keeps no earlier release's install script (pg_remus--<version>.sql)"
    );
    let pg = server();
    let mut admin = connect(&pg, "postgres");
    admin.batch_execute("CREATE DATABASE fresh").unwrap();
    connect(&pg, "fresh")
        .batch_execute("CREATE EXTENSION pg_remus")
        .expect("CREATE EXTENSION pg_remus (the current version)");
    let fresh = catalog(&pg, "fresh");
    assert!(
        fresh
            .iter()
            .any(|l| l.starts_with(&format!("extension pg_remus version={CURRENT} "))),
        "a fresh CREATE EXTENSION is not version {CURRENT}: {:?}",
        fresh.iter().find(|l| l.starts_with("extension "))
    );

    let mut failures = Vec::new();
    for from in &releases {
        let db = format!("from_{}", from.replace(['.', '-'], "_"));
        admin
            .batch_execute(&format!("CREATE DATABASE {db}"))
            .unwrap();
        let mut c = connect(&pg, &db);
        if let Err(e) = c.batch_execute(&format!("CREATE EXTENSION pg_remus VERSION '{from}'")) {
            panic!(
                "CREATE EXTENSION pg_remus VERSION '{from}' with the current library failed: {e:?}\n\
                 A function of {from} whose symbol the library no longer exports fails like this: \
                 a node restarted on the new library runs {from}'s catalog until ALTER EXTENSION \
                 pg_remus UPDATE, so the library must keep exporting it (decision 0020)."
            );
        }
        if let Err(e) = c.batch_execute("ALTER EXTENSION pg_remus UPDATE") {
            panic!("ALTER EXTENSION pg_remus UPDATE from {from} failed: {e:?}");
        }
        let updated = catalog(&pg, &db);
        let diff = difference(&updated, &fresh);
        if !diff.is_empty() {
            failures.push(format!(
                "{from} updated to {CURRENT} differs from a fresh {CURRENT} \
                 (- only the updated database, + only the fresh one):\n{}",
                diff.join("\n")
            ));
        }
    }
    assert!(
        failures.is_empty(),
        "the upgrade scripts (pg_remus/sql/pg_remus--<from>--<to>.sql) are incomplete; \
         add the missing statements to the current one (decision 0020):\n\n{}",
        failures.join("\n\n")
    );
}

/// The comparison itself: what an upgrade script typically forgets shows as a difference.
#[test]
fn what_an_upgrade_script_forgets_is_reported() {
    let pg = server();
    let mut admin = connect(&pg, "postgres");
    for db in ["plain", "changed"] {
        admin
            .batch_execute(&format!("CREATE DATABASE {db}"))
            .unwrap();
        connect(&pg, db)
            .batch_execute("CREATE EXTENSION pg_remus")
            .unwrap();
    }
    // As if the install script had these and the upgrade script did not.
    connect(&pg, "changed")
        .batch_execute(
            "CREATE FUNCTION remus.added_later(x int) RETURNS int LANGUAGE sql AS 'SELECT x';
             ALTER EXTENSION pg_remus ADD FUNCTION remus.added_later(int);
             ALTER TABLE remus.nodes ADD COLUMN zone text;
             GRANT SELECT ON remus_nodes TO PUBLIC;
             CREATE OR REPLACE FUNCTION remus.shell_guard() RETURNS trigger LANGUAGE plpgsql
                 AS $$ BEGIN RETURN NULL; END $$;",
        )
        .unwrap();
    let diff = difference(&catalog(&pg, "plain"), &catalog(&pg, "changed"));
    let text = diff.join("\n");
    for expected in [
        "+ member function remus.added_later(integer)",
        "+ column remus.nodes.zone type=text",
        "+ relation remus.nodes columns in order: name, host, port, added_at, zone",
        "+ relation remus_nodes kind=v",
        "+ function remus.shell_guard() line",
    ] {
        assert!(
            diff.iter().any(|l| l.starts_with(expected)),
            "the difference should list {expected:?}:\n{text}"
        );
    }
    assert!(
        diff.iter().all(|l| !l.starts_with("  ")),
        "every line is signed:\n{text}"
    );
}

#[test]
fn the_installed_scripts_are_the_repositorys() {
    let ext = extension_dir();
    let control = std::fs::read_to_string(ext.join("pg_remus.control")).expect("pg_remus.control");
    assert!(
        control.contains(&format!("default_version = '{CURRENT}'")),
        "the installed pg_remus.control is not version {CURRENT} (run install_extension):\n{control}"
    );
    for entry in std::fs::read_dir(sql_dir()).expect("read pg_remus/sql") {
        let path = entry.expect("directory entry").path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        if !name.starts_with("pg_remus--") || !name.ends_with(".sql") {
            continue;
        }
        let ours = std::fs::read_to_string(&path).unwrap();
        let installed = std::fs::read_to_string(ext.join(&name)).unwrap_or_else(|e| {
            panic!(
                "{name} is not installed in {} ({e}): run install_extension",
                ext.display()
            )
        });
        assert_eq!(
            installed, ours,
            "the installed {name} is not pg_remus/sql's (run install_extension)"
        );
    }
}
