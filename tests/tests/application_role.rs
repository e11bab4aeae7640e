//! An application role (LOGIN, not superuser) with ordinary GRANTs on distributed and reference
//! tables uses every routed form through any node, privileges checked as the calling role, and
//! gets 42501 where plain PostgreSQL would (issue 18, item 1 and its acceptance suite; DDL by the
//! owner role is not here yet).
//!
//! The cluster: 3 nodes, TPC-C-like tables co-located by warehouse (`warehouse`, `district`,
//! `customer`, `history`; `ledger`, `badge` and `event` for privileges short of all), `item` a
//! reference table; every shard n3 owned moved to n1, so n3 owns none (a true non-owner) and n1
//! and n2 own the rest. Roles belong to one PostgreSQL cluster: `app` (granted) and `outsider`
//! (LOGIN, nothing granted) are created on each node, then each GRANT is run on each node (also
//! right if a GRANT on distributed tables reaches every node by itself), as are the views and
//! functions. Each form runs through n1 (the owner of the warehouse it names, or a non-owner
//! for a warehouse of n2) and through n3, in the simple, extended and prepared (generic plan)
//! protocols, and its answer is compared with the superuser's for the same statement through
//! the same node and protocol (a write's: run by the superuser in a transaction rolled back,
//! RETURNING rows and the tables' contents, read through every node, compared after the role's
//! run commits). A suite checks every case and then lists every one that failed. The suites
//! take the role under test as a parameter: run with the superuser they pass (how the test
//! logic was checked), and the refusals' wording was checked on a plain PostgreSQL server.
//!
//! - `routed_forms_as_the_application_role`: single-shard SELECT / INSERT / UPDATE / DELETE /
//!   INSERT … ON CONFLICT DO UPDATE with RETURNING, SELECT … FOR UPDATE, a co-located join on the
//!   key, a join with the reference table, a subquery and a CTE within one shard group, INSERT …
//!   SELECT, UPDATE … FROM and DELETE … USING within the group, count / sum / GROUP BY / a join
//!   over every shard, ORDER BY … LIMIT over every shard, an UPDATE of every shard, two shard
//!   groups by key, reads and writes of the reference table, a transaction writing on two nodes
//!   (2PC) committed and rolled back, cursors, TRUNCATE, COPY FROM STDIN into the distributed and
//!   the reference table; that the statement runs as the role where it runs (`current_user` in
//!   the WHERE, the target list, RETURNING, on one shard group and over every shard); and that a
//!   view and a SECURITY DEFINER function of the superuser's, granted to the role, read with
//!   their owner's privileges (as on PostgreSQL).
//! - `refusals_are_42501_as_on_postgresql`: `outsider` on every one of those forms, a
//!   transaction, TRUNCATE, the views and COPY (the tables unchanged after); `app` with SELECT
//!   only on `ledger` writing it (single shard, every shard, ON CONFLICT, INSERT … SELECT, UPDATE
//!   … FROM, DELETE … USING, FOR UPDATE, TRUNCATE, COPY; after a granted write on another node
//!   in the same transaction, nothing commits); `app` with SELECT on some columns of `badge`
//!   reading another (target list, WHERE, ORDER BY, the whole row, a join, every shard, a
//!   SECURITY INVOKER function, also as a session's first statement) next to the reads it may
//!   do; a prepared statement refused once SELECT is revoked and running again once granted; a
//!   superuser's session after SET ROLE; `app` reading and writing `remus.shard_map`,
//!   `remus.nodes`, the other catalog tables and `remus.fanout`, and every `remus_shards.*`
//!   shard table on every node, by name; nothing of `remus` and `remus_shards` reachable by the
//!   catalog's privileges; no escalation on the owner: a function `app` may not EXECUTE, and
//!   `set_config` of `remus.migration_session`, `remus.forwarded`, `remus.forwarded_role`,
//!   `role` and `session_authorization` inside a routed statement, are refused through the
//!   non-owner too.
//! - `pgbench_as_the_application_role`: pgbench's TPC-B as `app` through n3 (owning none of the
//!   pgbench tables' shards) and through n1 at once: no failed transaction, and every balance
//!   equals its history.

use std::io::Write;
use std::process::Stdio;

use integration::consistency::assert_tpcb_consistent;
use integration::pgbench::{balances, finish, init_tpcb, prepared_everywhere};
use integration::protocol::{query, Protocol, Raw, PROTOCOLS};
use integration::roles::{connect_as, pgbench_as, Role};
use integration::shards::move_every_shard;
use postgres::Client;
use remus_test_support::cluster::TestCluster;

const SHARDS: i64 = 6;
const WAREHOUSES: i64 = 12;
const DISTRICTS: i64 = 4;
const CUSTOMERS: i64 = 10;
const HISTORY: i64 = 60;
const ITEMS: i64 = 20;

/// The node owning the warehouse a form names (for `near`), and the node owning none.
const OWNER: &str = "n1";
const NON_OWNER: &str = "n3";
const ENTRIES: [&str; 2] = [OWNER, NON_OWNER];

fn app() -> Role {
    Role::new("app", "app-Pw-8c1f")
}

fn outsider() -> Role {
    Role::new("outsider", "outsider-Pw-2e9a")
}

const SCHEMA: &str = "
    CREATE TABLE warehouse (w_id bigint PRIMARY KEY, w_name text NOT NULL, w_ytd bigint NOT NULL);
    CREATE TABLE district (d_w_id bigint, d_id bigint, d_name text NOT NULL,
        d_ytd bigint NOT NULL, d_next_o_id bigint NOT NULL, PRIMARY KEY (d_w_id, d_id));
    CREATE TABLE customer (c_w_id bigint, c_d_id bigint, c_id bigint, c_last text NOT NULL,
        c_balance bigint NOT NULL, c_item bigint NOT NULL, PRIMARY KEY (c_w_id, c_d_id, c_id));
    CREATE TABLE history (h_w_id bigint, h_id bigint, h_d_id bigint NOT NULL,
        h_c_id bigint NOT NULL, h_amount bigint NOT NULL, PRIMARY KEY (h_w_id, h_id));
    CREATE TABLE ledger (l_w_id bigint, l_id bigint, l_amount bigint NOT NULL,
        PRIMARY KEY (l_w_id, l_id));
    CREATE TABLE badge (b_w_id bigint, b_id bigint, b_label text NOT NULL, b_secret text NOT NULL,
        PRIMARY KEY (b_w_id, b_id));
    CREATE TABLE event (e_w_id bigint, e_id bigint, PRIMARY KEY (e_w_id, e_id));
    CREATE TABLE item (i_id bigint PRIMARY KEY, i_name text NOT NULL, i_price bigint NOT NULL);";

/// Distributes the tables of [`SCHEMA`], filled.
fn distribute() -> String {
    let mut sql = format!("SELECT remus_create_distributed_table('warehouse', 'w_id', {SHARDS});");
    for (table, key) in [
        ("district", "d_w_id"),
        ("customer", "c_w_id"),
        ("history", "h_w_id"),
        ("ledger", "l_w_id"),
        ("badge", "b_w_id"),
        ("event", "e_w_id"),
    ] {
        sql.push_str(&format!(
            "SELECT remus_create_distributed_table('{table}', '{key}', {SHARDS}, \
             colocate_with => 'warehouse');"
        ));
    }
    sql.push_str("SELECT remus_create_reference_table('item');");
    sql
}

/// The rows, as INSERTs into the plain tables of [`SCHEMA`].
fn rows() -> String {
    let mut warehouse = Vec::new();
    let mut district = Vec::new();
    let mut customer = Vec::new();
    let mut history = Vec::new();
    let mut ledger = Vec::new();
    let mut badge = Vec::new();
    for w in 1..=WAREHOUSES {
        warehouse.push(format!("({w}, 'w{w}', {})", 1000 * w));
        for d in 1..=DISTRICTS {
            district.push(format!("({w}, {d}, 'd{w}-{d}', {}, {})", 100 * d, 3000 + d));
            for c in 1..=CUSTOMERS {
                customer.push(format!(
                    "({w}, {d}, {c}, 'last{}', {}, {})",
                    (w * 7 + d * 3 + c) % 9,
                    (w * 13 + d * 7 + c * 11) % 100,
                    (w + d + c) % ITEMS + 1
                ));
            }
        }
        for h in 1..=HISTORY {
            history.push(format!(
                "({w}, {h}, {}, {}, {})",
                h % DISTRICTS + 1,
                h % CUSTOMERS + 1,
                (h * 7 + w) % 50
            ));
        }
        for l in 1..=5 {
            ledger.push(format!("({w}, {l}, {})", l * 10 + w));
            badge.push(format!("({w}, {l}, 'label{l}', 'secret{w}-{l}')"));
        }
    }
    let item: Vec<String> = (1..=ITEMS)
        .map(|i| format!("({i}, 'item{i}', {})", i * 3 % 17 + 1))
        .collect();
    [
        ("warehouse", warehouse),
        ("district", district),
        ("customer", customer),
        ("history", history),
        ("ledger", ledger),
        ("badge", badge),
        ("item", item),
    ]
    .iter()
    .map(|(t, v)| format!("INSERT INTO {t} VALUES {};", v.join(", ")))
    .collect()
}

/// What `app` and `outsider` are granted, on each node: SELECT, INSERT, UPDATE and DELETE on
/// the TPC-C-like tables (not TRUNCATE), everything on `event`, SELECT only on `ledger`, SELECT
/// on some columns of `badge`; nothing on `secret_fn`; views and functions of the superuser's
/// that read what `app` may not read itself, granted to `app` (as on one PostgreSQL, they read
/// with their owner's privileges, a SECURITY INVOKER function with the caller's). Run on each
/// node once the roles exist on every node (a GRANT on distributed tables may reach every node).
const GRANTS: &str = "
    GRANT SELECT, INSERT, UPDATE, DELETE ON warehouse, district, customer, history, item TO app;
    GRANT ALL ON event TO app;
    GRANT SELECT ON ledger TO app;
    GRANT SELECT (b_w_id, b_id, b_label) ON badge TO app;
    CREATE FUNCTION secret_fn(bigint) RETURNS bigint LANGUAGE plpgsql IMMUTABLE
      AS 'BEGIN RETURN $1; END';
    REVOKE EXECUTE ON FUNCTION secret_fn(bigint) FROM PUBLIC;
    CREATE VIEW badge_secrets AS SELECT b_w_id, b_id, b_secret FROM badge;
    GRANT SELECT ON badge_secrets TO app;
    CREATE FUNCTION badge_secret_definer(bigint, bigint) RETURNS text LANGUAGE plpgsql
      SECURITY DEFINER
      AS 'BEGIN RETURN (SELECT b_secret FROM badge WHERE b_w_id = $1 AND b_id = $2); END';
    CREATE FUNCTION badge_secret_invoker(bigint, bigint) RETURNS text LANGUAGE plpgsql
      AS 'BEGIN RETURN (SELECT b_secret FROM badge WHERE b_w_id = $1 AND b_id = $2); END';";

/// `app` and `outsider`, to create on each node (roles belong to one PostgreSQL cluster).
fn roles_sql() -> String {
    format!("{}; {};", app().create_sql(), outsider().create_sql())
}

/// Runs `sql` as the superuser on every node.
fn on_every_node(c: &TestCluster, sql: &str) {
    for node in c.node_names() {
        c.connect(&node)
            .unwrap()
            .batch_execute(sql)
            .unwrap_or_else(|e| panic!("on {node}: {}", describe(&e)));
    }
}

/// The cluster of this file's tables and roles; `near` is a warehouse n1 owns, `far` one n2 owns.
struct Fixture {
    c: TestCluster,
    near: i64,
    far: i64,
}

fn fixture() -> Fixture {
    let c = TestCluster::start(3).expect("cluster up");
    let mut n1 = c.connect("n1").unwrap();
    n1.batch_execute(SCHEMA).unwrap();
    n1.batch_execute(&rows()).unwrap();
    n1.batch_execute(&distribute()).unwrap();
    move_every_shard(&c, "n3", "n1", &["warehouse"]);
    let mut owned_by = |node: &str| -> i64 {
        n1.query_one(
            "SELECT min(w) FROM generate_series(1, $1::bigint) w
               JOIN remus_shards s ON s.shard_id = remus_shard_id_for('warehouse', w)
              WHERE s.node_name = $2",
            &[&WAREHOUSES, &node],
        )
        .unwrap()
        .get::<_, Option<i64>>(0)
        .unwrap_or_else(|| panic!("no warehouse on {node}"))
    };
    let (near, far) = (owned_by("n1"), owned_by("n2"));
    on_every_node(&c, &roles_sql());
    on_every_node(&c, GRANTS);
    Fixture { c, near, far }
}

/// One statement: what it is, its text, its parameters (`$n` = `params[n - 1]`), the statement
/// whose answer the superuser's run gives (the same unless it names the calling role), and the
/// tables it names (a refusal names one of them; a write's effect is compared on all).
struct Form {
    what: &'static str,
    sql: String,
    params: Vec<i64>,
    oracle: Option<String>,
    tables: &'static [&'static str],
}

fn form(what: &'static str, sql: &str, params: Vec<i64>, tables: &'static [&'static str]) -> Form {
    Form {
        what,
        sql: sql.to_string(),
        params,
        oracle: None,
        tables,
    }
}

impl Form {
    fn oracle(&self) -> &str {
        self.oracle.as_deref().unwrap_or(&self.sql)
    }
}

/// The read forms on warehouse `w` (`other` another warehouse), run by `role`.
fn reads(w: i64, other: i64, role: &str) -> Vec<Form> {
    vec![
        form(
            "single-shard SELECT",
            "SELECT c_id, c_last, c_balance FROM customer WHERE c_w_id = $1 AND c_d_id = $2
              ORDER BY c_id",
            vec![w, 2],
            &["customer"],
        ),
        form(
            "SELECT … FOR UPDATE",
            "SELECT d_id, d_name, d_next_o_id FROM district WHERE d_w_id = $1 AND d_id = $2
               FOR UPDATE",
            vec![w, 3],
            &["district"],
        ),
        form(
            "co-located join on the key",
            "SELECT c.c_d_id, c.c_id, c.c_last, d.d_name FROM customer c
               JOIN district d ON d.d_w_id = c.c_w_id AND d.d_id = c.c_d_id
              WHERE c.c_w_id = $1 AND c.c_balance > $2 ORDER BY 1, 2",
            vec![w, 60],
            &["customer", "district"],
        ),
        form(
            "join with the reference table",
            "SELECT c.c_id, i.i_name, i.i_price FROM customer c JOIN item i ON i.i_id = c.c_item
              WHERE c.c_w_id = $1 AND c.c_d_id = $2 ORDER BY c.c_id",
            vec![w, 1],
            &["customer", "item"],
        ),
        form(
            "subquery within the shard group",
            "SELECT c_d_id, c_id FROM customer WHERE c_w_id = $1
                AND c_balance > (SELECT avg(h_amount) FROM history WHERE h_w_id = $1)
              ORDER BY 1, 2",
            vec![w],
            &["customer", "history"],
        ),
        form(
            "CTE within the shard group",
            "WITH paid AS (SELECT h_d_id, h_c_id, sum(h_amount) AS s FROM history
                            WHERE h_w_id = $1 GROUP BY 1, 2)
             SELECT c.c_d_id, c.c_id, p.s FROM customer c
               JOIN paid p ON p.h_d_id = c.c_d_id AND p.h_c_id = c.c_id
              WHERE c.c_w_id = $1 AND p.s > $2::bigint ORDER BY 1, 2",
            vec![w, 20],
            &["customer", "history"],
        ),
        form(
            "count(*), sum, min and max over every shard",
            "SELECT count(*), sum(c_balance), min(c_last), max(c_id) FROM customer
              WHERE c_balance > $1",
            vec![w],
            &["customer"],
        ),
        form(
            "GROUP BY over every shard",
            "SELECT c_d_id, count(*), sum(c_balance) FROM customer WHERE c_id <> $1
              GROUP BY c_d_id ORDER BY c_d_id",
            vec![w],
            &["customer"],
        ),
        form(
            "ORDER BY … LIMIT over every shard",
            "SELECT c_w_id, c_d_id, c_id, c_balance FROM customer
              ORDER BY c_balance DESC, c_w_id, c_d_id, c_id LIMIT $1",
            vec![w + 3],
            &["customer"],
        ),
        form(
            "join over every shard",
            "SELECT d.d_id, count(*), sum(c.c_balance) FROM district d
               JOIN customer c ON c.c_w_id = d.d_w_id AND c.c_d_id = d.d_id
              WHERE c.c_balance > $1 GROUP BY d.d_id ORDER BY 1",
            vec![w],
            &["district", "customer"],
        ),
        form(
            "two shard groups by key",
            "SELECT w_id, w_name, w_ytd FROM warehouse WHERE w_id IN ($1, $2) ORDER BY w_id",
            vec![w, other],
            &["warehouse"],
        ),
        form(
            "read of the reference table",
            "SELECT i_id, i_name, i_price FROM item WHERE i_price > $1 ORDER BY i_id",
            vec![5],
            &["item"],
        ),
        // Where the statement runs, it runs as the calling role.
        Form {
            what: "current_user in the WHERE of one shard group",
            sql: format!(
                "SELECT w_id, w_name FROM warehouse WHERE w_id = $1 AND current_user = '{role}'"
            ),
            params: vec![w],
            oracle: Some("SELECT w_id, w_name FROM warehouse WHERE w_id = $1".into()),
            tables: &["warehouse"],
        },
        Form {
            what: "current_user in the target list of one shard group",
            sql: "SELECT w_id, current_user FROM warehouse WHERE w_id = $1".into(),
            params: vec![w],
            oracle: Some(format!(
                "SELECT w_id, '{role}'::name FROM warehouse WHERE w_id = $1"
            )),
            tables: &["warehouse"],
        },
        Form {
            what: "current_user in a co-located join",
            sql: format!(
                "SELECT c.c_id, d.d_name FROM customer c
                   JOIN district d ON d.d_w_id = c.c_w_id AND d.d_id = c.c_d_id
                  WHERE c.c_w_id = $1 AND c.c_d_id = 1 AND current_user = '{role}' ORDER BY 1"
            ),
            params: vec![w],
            oracle: Some(
                "SELECT c.c_id, d.d_name FROM customer c
                   JOIN district d ON d.d_w_id = c.c_w_id AND d.d_id = c.c_d_id
                  WHERE c.c_w_id = $1 AND c.c_d_id = 1 ORDER BY 1"
                    .into(),
            ),
            tables: &["customer", "district"],
        },
        Form {
            what: "current_user over every shard",
            sql: format!(
                "SELECT count(*) FROM customer WHERE c_balance > $1 AND current_user = '{role}'"
            ),
            params: vec![w],
            oracle: Some("SELECT count(*) FROM customer WHERE c_balance > $1".into()),
            tables: &["customer"],
        },
    ]
}

/// The write forms on warehouse `w`, the `run`-th time each (0, 1, …: every run changes
/// something of its own), by `role`.
fn writes(w: i64, run: i64, role: &str) -> Vec<Form> {
    vec![
        form(
            "single-shard INSERT … RETURNING",
            "INSERT INTO history (h_w_id, h_id, h_d_id, h_c_id, h_amount)
             VALUES ($1, $2, 1, 2, 7) RETURNING h_w_id, h_id, h_amount",
            vec![w, 100_000 + run],
            &["history"],
        ),
        form(
            "single-shard UPDATE … RETURNING",
            "UPDATE customer SET c_balance = c_balance + $2
              WHERE c_w_id = $1 AND c_d_id = 1 AND c_id = 3 RETURNING c_id, c_balance",
            vec![w, run + 1],
            &["customer"],
        ),
        form(
            "single-shard DELETE … RETURNING",
            "DELETE FROM history WHERE h_w_id = $1 AND h_id = $2 RETURNING h_id, h_amount",
            vec![w, run + 1],
            &["history"],
        ),
        form(
            "INSERT … SELECT within the shard group",
            "INSERT INTO history (h_w_id, h_id, h_d_id, h_c_id, h_amount)
             SELECT c_w_id, $2::bigint * 1000 + c_id, c_d_id, c_id, c_balance FROM customer
              WHERE c_w_id = $1 AND c_d_id = 2 RETURNING h_id, h_amount",
            vec![w, run + 1],
            &["history", "customer"],
        ),
        form(
            "UPDATE … FROM within the shard group",
            "UPDATE district d SET d_ytd = d.d_ytd + c.c_balance FROM customer c
              WHERE d.d_w_id = $1 AND c.c_w_id = d.d_w_id AND c.c_d_id = d.d_id
                AND d.d_id = 2 AND c.c_id = $2
             RETURNING d.d_id, d.d_ytd, c.c_id",
            vec![w, run % CUSTOMERS + 1],
            &["district", "customer"],
        ),
        form(
            "DELETE … USING within the shard group",
            "DELETE FROM history h USING customer c
              WHERE h.h_w_id = $1 AND c.c_w_id = h.h_w_id AND c.c_d_id = h.h_d_id
                AND c.c_id = h.h_c_id AND h.h_id = $2
             RETURNING h.h_id, c.c_last",
            vec![w, 31 + run],
            &["history", "customer"],
        ),
        form(
            "single-shard INSERT … ON CONFLICT DO UPDATE … RETURNING",
            "INSERT INTO customer (c_w_id, c_d_id, c_id, c_last, c_balance, c_item)
             VALUES ($1, 3, $2, 'new', 0, 1)
             ON CONFLICT (c_w_id, c_d_id, c_id) DO UPDATE SET c_balance = customer.c_balance + 5
             RETURNING c_id, c_last, c_balance",
            vec![w, run % (CUSTOMERS + 2) + 1],
            &["customer"],
        ),
        form(
            "UPDATE of every shard",
            "UPDATE customer SET c_balance = c_balance + 1 WHERE c_d_id = 4 AND c_id = $1
             RETURNING c_w_id, c_balance",
            vec![run % CUSTOMERS + 1],
            &["customer"],
        ),
        form(
            "UPDATE of the reference table",
            "UPDATE item SET i_price = i_price + 1 WHERE i_id = $1 RETURNING i_id, i_price",
            vec![run % ITEMS + 1],
            &["item"],
        ),
        form(
            "INSERT into the reference table",
            "INSERT INTO item (i_id, i_name, i_price) VALUES ($1, 'added', 4) RETURNING i_id",
            vec![100 + run],
            &["item"],
        ),
        Form {
            what: "current_user in a single-shard UPDATE's WHERE and RETURNING",
            sql: format!(
                "UPDATE warehouse SET w_ytd = w_ytd + 1 WHERE w_id = $1 AND current_user = '{role}'
                 RETURNING w_id, w_ytd, current_user"
            ),
            params: vec![w],
            oracle: Some(format!(
                "UPDATE warehouse SET w_ytd = w_ytd + 1 WHERE w_id = $1
                 RETURNING w_id, w_ytd, '{role}'::name"
            )),
            tables: &["warehouse"],
        },
    ]
}

/// Reads through a view and a SECURITY DEFINER function of the superuser's granted to the role:
/// they read with their owner's privileges.
fn through_owned_objects(w: i64) -> Vec<Form> {
    vec![
        form(
            "a view over a column the role may not read, on one shard group",
            "SELECT b_id, b_secret FROM badge_secrets WHERE b_w_id = $1 ORDER BY b_id",
            vec![w],
            &["badge_secrets"],
        ),
        form(
            "a view over a column the role may not read, over every shard",
            "SELECT count(*), max(b_secret) FROM badge_secrets WHERE b_id > $1",
            vec![0],
            &["badge_secrets"],
        ),
        form(
            "a SECURITY DEFINER function reading a column the role may not read",
            "SELECT badge_secret_definer($1, 2)",
            vec![w],
            &["badge"],
        ),
    ]
}

/// A transaction writing `near` (on n1) and `far` (on n2): a 2PC from any entry. Its `run`-th
/// time.
fn two_node_transaction(near: i64, far: i64, run: i64) -> Vec<Form> {
    let amount = 10 + run;
    vec![
        form(
            "FOR UPDATE on the first node",
            "SELECT w_ytd FROM warehouse WHERE w_id = $1 FOR UPDATE",
            vec![near],
            &["warehouse"],
        ),
        form(
            "UPDATE on the first node",
            "UPDATE warehouse SET w_ytd = w_ytd + $2 WHERE w_id = $1 RETURNING w_id, w_ytd",
            vec![near, amount],
            &["warehouse"],
        ),
        form(
            "UPDATE on the second node",
            "UPDATE warehouse SET w_ytd = w_ytd - $2 WHERE w_id = $1 RETURNING w_id, w_ytd",
            vec![far, amount],
            &["warehouse"],
        ),
        form(
            "INSERT on the second node",
            "INSERT INTO history (h_w_id, h_id, h_d_id, h_c_id, h_amount)
             VALUES ($1, $2, 1, 1, $3) RETURNING h_id",
            vec![far, 300_000 + run, amount],
            &["history"],
        ),
        form(
            "read of both",
            "SELECT w_id, w_ytd FROM warehouse WHERE w_id IN ($1, $2) ORDER BY w_id",
            vec![near, far],
            &["warehouse"],
        ),
    ]
}

/// Every case's result, every failure listed at the end.
#[derive(Default)]
struct Report {
    passed: usize,
    failed: Vec<String>,
}

impl Report {
    fn case(&mut self, name: String, result: Result<(), String>) {
        match result {
            Ok(()) => self.passed += 1,
            Err(e) => {
                println!("FAILED {name}: {e}");
                self.failed.push(format!("{name}: {e}"));
            }
        }
    }

    fn finish(self, suite: &str) {
        println!(
            "{suite}: {} cases passed, {} failed",
            self.passed,
            self.failed.len()
        );
        assert!(self.passed + self.failed.len() > 0, "{suite}: no case ran");
        assert!(
            self.failed.is_empty(),
            "{suite}: {} of {} cases failed:\n{}",
            self.failed.len(),
            self.passed + self.failed.len(),
            self.failed.join("\n")
        );
    }
}

/// An error as a client sees it: SQLSTATE, message, detail.
fn describe(e: &postgres::Error) -> String {
    match e.as_db_error() {
        Some(db) => format!(
            "{} {}{}",
            db.code().code(),
            db.message(),
            db.detail().map(|d| format!(" ({d})")).unwrap_or_default()
        ),
        None => e.to_string(),
    }
}

type Rows = Vec<Vec<Raw>>;

fn run(db: &mut Client, protocol: Protocol, sql: &str, params: &[i64]) -> Result<Rows, String> {
    query(db, protocol, sql, params).map_err(|e| describe(&e))
}

/// A session of `role` on `node`, opened again after a failure closed it.
struct Session<'a> {
    c: &'a TestCluster,
    node: &'a str,
    role: Role,
    db: Option<Client>,
}

impl<'a> Session<'a> {
    fn new(c: &'a TestCluster, node: &'a str, role: &Role) -> Self {
        Session {
            c,
            node,
            role: role.clone(),
            db: None,
        }
    }

    fn db(&mut self) -> Result<&mut Client, String> {
        if self.db.as_ref().is_none_or(|db| db.is_closed()) {
            let mut db = connect_as(self.c, self.node, &self.role)
                .map_err(|e| format!("connecting as {}: {}", self.role.name, describe(&e)))?;
            let user: String = db
                .query_one("SELECT current_user::text", &[])
                .map_err(|e| describe(&e))?
                .get(0);
            assert_eq!(user, self.role.name, "the session's role");
            self.db = Some(db);
        }
        Ok(self.db.as_mut().unwrap())
    }

    /// `sql` in `protocol`: PostgreSQL's answer, or why no session could be opened.
    fn exec(
        &mut self,
        protocol: Protocol,
        sql: &str,
        params: &[i64],
    ) -> Result<Result<Rows, postgres::Error>, String> {
        Ok(query(self.db()?, protocol, sql, params))
    }

    fn run(&mut self, protocol: Protocol, sql: &str, params: &[i64]) -> Result<Rows, String> {
        self.exec(protocol, sql, params)?.map_err(|e| describe(&e))
    }

    /// `BEGIN`, `steps`, then `end` (COMMIT or ROLLBACK): each step's rows. After a failed
    /// step the transaction is rolled back.
    fn transaction(
        &mut self,
        protocol: Protocol,
        steps: &[Form],
        end: &str,
    ) -> Result<Vec<Rows>, String> {
        let db = self.db()?;
        db.batch_execute("BEGIN").map_err(|e| describe(&e))?;
        let mut out = Vec::new();
        for step in steps {
            match run(db, protocol, &step.sql, &step.params) {
                Ok(rows) => out.push(rows),
                Err(e) => {
                    let _ = db.batch_execute("ROLLBACK");
                    return Err(format!("{}: {e}", step.what));
                }
            }
        }
        db.batch_execute(end)
            .map_err(|e| format!("{end}: {}", describe(&e)))?;
        Ok(out)
    }
}

/// `table`'s rows as one text, read as the superuser through `db`.
fn contents(db: &mut Client, table: &str) -> String {
    db.query_one(
        &format!("SELECT coalesce(string_agg(t::text, ';' ORDER BY t::text), '') FROM {table} t"),
        &[],
    )
    .unwrap_or_else(|e| panic!("contents of {table}: {}", describe(&e)))
    .get(0)
}

/// `tables`' contents read through every node; an error if a node reads other rows than
/// `expected` (or than n1, when `expected` is None). Returns n1's.
fn contents_everywhere(
    c: &TestCluster,
    tables: &[&str],
    expected: Option<&[String]>,
) -> Result<Vec<String>, String> {
    let mut first: Option<Vec<String>> = expected.map(<[String]>::to_vec);
    for node in c.node_names() {
        let mut db = c.connect(&node).unwrap();
        let got: Vec<String> = tables.iter().map(|t| contents(&mut db, t)).collect();
        match &first {
            None => first = Some(got),
            Some(want) => {
                for ((t, g), w) in tables.iter().zip(&got).zip(want) {
                    if g != w {
                        return Err(format!(
                            "{t} read through {node} is not as expected:\n  got  {g}\n  want {w}"
                        ));
                    }
                }
            }
        }
    }
    Ok(first.unwrap())
}

/// The prepared transactions left on every node: none once a statement or transaction ended.
fn no_prepared(c: &TestCluster) -> Result<(), String> {
    match prepared_everywhere(c) {
        0 => Ok(()),
        n => Err(format!("{n} prepared transactions left")),
    }
}

/// What a statement returned, for a message: rows of values, a value as text when it is
/// printable (the simple protocol's, a binary text), else in hex; at most 200 characters.
trait Summary {
    fn summary(&self) -> String;
}

impl Summary for Rows {
    fn summary(&self) -> String {
        let value = |v: &Raw| match &v.0 {
            None => "NULL".to_string(),
            Some(b) if b.iter().all(|c| c.is_ascii_graphic() || *c == b' ') => {
                String::from_utf8_lossy(b).into_owned()
            }
            Some(b) => format!(
                "0x{}",
                b.iter().map(|c| format!("{c:02x}")).collect::<String>()
            ),
        };
        let mut text = format!(
            "{} rows: {}",
            self.len(),
            self.iter()
                .map(|r| format!("({})", r.iter().map(value).collect::<Vec<_>>().join(", ")))
                .collect::<Vec<_>>()
                .join(" ")
        );
        if text.len() > 200 {
            let cut = (0..=200).rev().find(|&i| text.is_char_boundary(i)).unwrap();
            text.truncate(cut);
            text.push('…');
        }
        text
    }
}

impl Summary for u64 {
    fn summary(&self) -> String {
        format!("{self} rows")
    }
}

fn check_rows(mut got: Rows, mut want: Rows, sort: bool) -> Result<(), String> {
    if want.is_empty() {
        return Err("the superuser's answer is empty: nothing to compare".into());
    }
    if sort {
        // RETURNING's order is the scan's.
        got.sort_by_key(|r| format!("{r:?}"));
        want.sort_by_key(|r| format!("{r:?}"));
    }
    if got == want {
        Ok(())
    } else {
        Err(format!(
            "not the superuser's answer: got {}, want {}",
            got.summary(),
            want.summary()
        ))
    }
}

/// One read as `role` through `entry` against the superuser's through the same node.
fn read_case(
    role: &mut Session,
    su: &mut Client,
    protocol: Protocol,
    f: &Form,
) -> Result<(), String> {
    let want = run(su, protocol, f.oracle(), &f.params)
        .map_err(|e| format!("the superuser's run: {e}"))?;
    let got = role.run(protocol, &f.sql, &f.params)?;
    check_rows(got, want, false)
}

/// One write as `role`: its RETURNING rows and the tables' contents after it (read through
/// every node) against the superuser's same statement in a transaction rolled back.
fn write_case(
    c: &TestCluster,
    role: &mut Session,
    su: &mut Client,
    protocol: Protocol,
    f: &Form,
) -> Result<(), String> {
    su.batch_execute("BEGIN").unwrap();
    let want = run(su, protocol, f.oracle(), &f.params).map(|want| {
        let after: Vec<String> = f.tables.iter().map(|t| contents(su, t)).collect();
        (want, after)
    });
    su.batch_execute("ROLLBACK").unwrap();
    let (want, after) = want.map_err(|e| format!("the superuser's run: {e}"))?;
    let got = role.run(protocol, &f.sql, &f.params);
    let got_after = contents_everywhere(c, f.tables, Some(&after));
    check_rows(got?, want, true)?;
    got_after?;
    no_prepared(c)
}

fn routed_forms_run_as(role_of: fn(&TestCluster) -> Role) {
    let Fixture { c, near, far } = fixture();
    let role = role_of(&c);
    let mut report = Report::default();
    let keys = [(near, far, "w on n1"), (far, near, "w on n2")];

    for entry in ENTRIES {
        let mut su = c.connect(entry).unwrap();
        let mut session = Session::new(&c, entry, &role);
        for protocol in PROTOCOLS {
            for (w, other, owner) in keys {
                for f in reads(w, other, &role.name)
                    .into_iter()
                    .chain(through_owned_objects(w))
                {
                    let name = format!("{} ({owner}) via {entry}, {protocol:?}", f.what);
                    report.case(name, read_case(&mut session, &mut su, protocol, &f));
                }
            }
        }
    }

    let mut runs = 0;
    for entry in ENTRIES {
        let mut su = c.connect(entry).unwrap();
        let mut session = Session::new(&c, entry, &role);
        for protocol in PROTOCOLS {
            for (w, _, owner) in keys {
                for f in writes(w, runs, &role.name) {
                    let name = format!("{} ({owner}) via {entry}, {protocol:?}", f.what);
                    report.case(name, write_case(&c, &mut session, &mut su, protocol, &f));
                }
                runs += 1;
            }
        }
        // TRUNCATE of a table the role has every privilege on.
        let values: Vec<String> = (1..=WAREHOUSES)
            .flat_map(|w| (1..=3).map(move |e| format!("({w}, {e})")))
            .collect();
        su.batch_execute(&format!("INSERT INTO event VALUES {}", values.join(", ")))
            .unwrap();
        let result = session
            .run(Protocol::Simple, "TRUNCATE event", &[])
            .and_then(|_| contents_everywhere(&c, &["event"], Some(&[String::new()])))
            .and_then(|_| no_prepared(&c));
        report.case(format!("TRUNCATE via {entry}"), result);
        // Cursors over one shard group and over every shard, in a transaction.
        let fetch = |sql: &str| form("FETCH", sql, vec![], &["customer"]);
        let steps = [
            fetch(&format!(
                "DECLARE one CURSOR FOR SELECT c_id, c_balance FROM customer
                  WHERE c_w_id = {near} AND c_d_id = 1 ORDER BY c_id"
            )),
            fetch("FETCH 4 FROM one"),
            fetch("FETCH 4 FROM one"),
            fetch(
                "DECLARE every CURSOR FOR SELECT c_w_id, c_d_id, c_id, c_last FROM customer
                  ORDER BY c_w_id, c_d_id, c_id",
            ),
            fetch("FETCH 5 FROM every"),
            fetch("FETCH 5 FROM every"),
        ];
        su.batch_execute("BEGIN").unwrap();
        let want: Vec<Rows> = steps
            .iter()
            .map(|s| run(&mut su, Protocol::Simple, &s.sql, &s.params).unwrap())
            .collect();
        su.batch_execute("ROLLBACK").unwrap();
        let result = session
            .transaction(Protocol::Simple, &steps, "COMMIT")
            .and_then(|got| {
                for ((step, g), w) in steps.iter().zip(got).zip(want) {
                    if step.sql.starts_with("FETCH") {
                        check_rows(g, w, false).map_err(|e| format!("{}: {e}", step.sql))?;
                    }
                }
                Ok(())
            });
        report.case(format!("cursors via {entry}"), result);
    }

    // A transaction over two nodes, committed (a 2PC) and rolled back.
    let mut runs = 0;
    for entry in ENTRIES {
        let mut su = c.connect(entry).unwrap();
        let mut session = Session::new(&c, entry, &role);
        for protocol in PROTOCOLS {
            for end in ["COMMIT", "ROLLBACK"] {
                let steps = two_node_transaction(near, far, runs);
                runs += 1;
                let name =
                    format!("transaction on n1 and n2 ending in {end} via {entry}, {protocol:?}");
                let tables = &["warehouse", "history"];
                let before = contents_everywhere(&c, tables, None).unwrap();
                su.batch_execute("BEGIN").unwrap();
                let want: Result<Vec<Rows>, String> = steps
                    .iter()
                    .map(|s| run(&mut su, protocol, &s.sql, &s.params))
                    .collect();
                let after: Vec<String> = tables.iter().map(|t| contents(&mut su, t)).collect();
                su.batch_execute("ROLLBACK").unwrap();
                let want = want.unwrap_or_else(|e| panic!("{name}, the superuser's run: {e}"));
                let result = session.transaction(protocol, &steps, end).and_then(|got| {
                    for ((step, g), w) in steps.iter().zip(got).zip(want) {
                        check_rows(g, w, false).map_err(|e| format!("{}: {e}", step.what))?;
                    }
                    let expected = if end == "COMMIT" { &after } else { &before };
                    contents_everywhere(&c, tables, Some(expected))?;
                    no_prepared(&c)
                });
                report.case(name, result);
            }
        }
    }

    // COPY FROM STDIN into the distributed table (rows for every warehouse: both owners) and
    // into the reference table (every copy).
    for (i, entry) in ENTRIES.iter().enumerate() {
        let base = 200_000 + 100 * i as i64;
        let mut data = String::new();
        let mut expected = Vec::new();
        for w in 1..=WAREHOUSES {
            for k in 0..3 {
                let (h, d, cust, amount) = (base + k, k + 1, k + 2, w * 10 + k);
                data.push_str(&format!("{w}\t{h}\t{d}\t{cust}\t{amount}\n"));
                expected.push(format!("({w},{h},{d},{cust},{amount})"));
            }
        }
        expected.sort();
        let rows = expected.len() as u64;
        let result = copy_in(
            &c,
            entry,
            &role,
            "COPY history (h_w_id, h_id, h_d_id, h_c_id, h_amount) FROM STDIN",
            &data,
        )
        .and_then(|n| {
            if n != rows {
                return Err(format!("COPY reported {n} rows, not {rows}"));
            }
            let mut db = c.connect("n2").unwrap();
            let got: String = db
                .query_one(
                    "SELECT coalesce(string_agg(t::text, ';' ORDER BY t::text), '')
                       FROM history t WHERE h_id BETWEEN $1 AND $1 + 99",
                    &[&base],
                )
                .unwrap()
                .get(0);
            let want = expected.join(";");
            if got == want {
                no_prepared(&c)
            } else {
                Err(format!("after COPY: got {got}, want {want}"))
            }
        });
        report.case(format!("COPY into history via {entry}"), result);

        let id = 500 + i as i64;
        let result = copy_in(
            &c,
            entry,
            &role,
            "COPY item FROM STDIN",
            &format!("{id}\tcopied\t{}\n", 9 + i),
        )
        .and_then(|n| {
            if n != 1 {
                return Err(format!("COPY reported {n} rows, not 1"));
            }
            for node in c.node_names() {
                let got: Vec<(String, i64)> = c
                    .connect(&node)
                    .unwrap()
                    .query("SELECT i_name, i_price FROM item WHERE i_id = $1", &[&id])
                    .unwrap()
                    .iter()
                    .map(|r| (r.get(0), r.get(1)))
                    .collect();
                if got != [("copied".to_string(), 9 + i as i64)] {
                    return Err(format!("item {id} read through {node}: {got:?}"));
                }
            }
            no_prepared(&c)
        });
        report.case(format!("COPY into item via {entry}"), result);
    }
    report.finish(&format!("routed forms as {}", role.name));
}

/// `COPY … FROM STDIN` of `data` as `role` through `node`, on a connection of its own (after
/// a refused COPY the client's protocol state is not reused): PostgreSQL's answer, the rows
/// COPY reports, or why it could not be sent.
fn copy_in_raw(
    c: &TestCluster,
    node: &str,
    role: &Role,
    sql: &str,
    data: &str,
) -> Result<Result<u64, postgres::Error>, String> {
    let mut db = connect_as(c, node, role).map_err(|e| describe(&e))?;
    let mut w = match db.copy_in(sql) {
        Ok(w) => w,
        Err(e) => return Ok(Err(e)),
    };
    w.write_all(data.as_bytes())
        .map_err(|e| format!("writing COPY data: {e}"))?;
    Ok(w.finish())
}

fn copy_in(c: &TestCluster, node: &str, role: &Role, sql: &str, data: &str) -> Result<u64, String> {
    copy_in_raw(c, node, role, sql, data)?.map_err(|e| describe(&e))
}

/// How PostgreSQL words a refusal (42501).
#[derive(Clone, Copy, Debug)]
enum Denied {
    /// `permission denied for table <t>`, one of these tables (also for a column privilege).
    Table(&'static [&'static str]),
    /// `permission denied for view <v>`.
    View(&'static str),
    /// `permission denied for function <f>`.
    Function(&'static str),
    /// A setting the role may not set: its name in the message.
    Setting(&'static str),
    /// Any 42501 (what is refused is an internal object).
    Any,
}

/// A refusal as plain PostgreSQL gives it: SQLSTATE 42501, worded as [`Denied`] says.
fn expect_denied<T: Summary>(
    result: Result<Result<T, postgres::Error>, String>,
    denied: Denied,
) -> Result<(), String> {
    let e = match result? {
        Ok(v) => return Err(format!("succeeded ({}), expected 42501", v.summary())),
        Err(e) => e,
    };
    let Some(db) = e.as_db_error() else {
        return Err(format!("expected 42501, got {}", describe(&e)));
    };
    if db.code().code() != "42501" {
        return Err(format!("expected 42501, got {}", describe(&e)));
    }
    let m = db.message();
    let worded = match denied {
        Denied::Table(tables) => tables
            .iter()
            .any(|t| m == format!("permission denied for table {t}")),
        Denied::View(v) => m == format!("permission denied for view {v}"),
        Denied::Function(f) => m == format!("permission denied for function {f}"),
        Denied::Setting(name) => m.contains(name),
        Denied::Any => true,
    };
    if worded {
        Ok(())
    } else {
        Err(format!(
            "42501, but not PostgreSQL's refusal ({denied:?}): {m}"
        ))
    }
}

/// Whether `sql` writes (a refused write must leave its tables as they were).
fn is_write(sql: &str) -> bool {
    let s = sql.trim_start().to_ascii_uppercase();
    ["INSERT", "UPDATE", "DELETE", "TRUNCATE"]
        .iter()
        .any(|w| s.starts_with(w))
}

/// Refused forms of `app` on warehouse `w`: writes of `ledger` (granted SELECT only), other
/// columns of `badge` (granted SELECT on some), `secret_fn` (no EXECUTE), and settings a
/// superuser's session would take (no escalation on the statement's owner).
fn denied_to_app(w: i64) -> Vec<(Form, Denied)> {
    const LEDGER: Denied = Denied::Table(&["ledger"]);
    const BADGE: Denied = Denied::Table(&["badge"]);
    const FUNCTION: Denied = Denied::Function("secret_fn");
    let ledger = |what, sql: &str, params| (form(what, sql, params, &["ledger"]), LEDGER);
    let badge = |what, sql: &str, params| (form(what, sql, params, &["badge"]), BADGE);
    let mut out = vec![
        ledger(
            "ledger (SELECT only): single-shard UPDATE",
            "UPDATE ledger SET l_amount = l_amount + 1 WHERE l_w_id = $1 AND l_id = 1
             RETURNING l_amount",
            vec![w],
        ),
        ledger(
            "ledger (SELECT only): single-shard INSERT",
            "INSERT INTO ledger (l_w_id, l_id, l_amount) VALUES ($1, $2, 5)",
            vec![w, 900],
        ),
        ledger(
            "ledger (SELECT only): single-shard DELETE",
            "DELETE FROM ledger WHERE l_w_id = $1 AND l_id = 2 RETURNING l_id",
            vec![w],
        ),
        ledger(
            "ledger (SELECT only): INSERT … ON CONFLICT DO UPDATE",
            "INSERT INTO ledger VALUES ($1, 1, 0)
             ON CONFLICT (l_w_id, l_id) DO UPDATE SET l_amount = 0",
            vec![w],
        ),
        ledger(
            "ledger (SELECT only): UPDATE of every shard",
            "UPDATE ledger SET l_amount = 0 WHERE l_id = $1",
            vec![1],
        ),
        ledger(
            "ledger (SELECT only): DELETE of every shard",
            "DELETE FROM ledger WHERE l_amount > $1",
            vec![0],
        ),
        (
            form(
                "ledger (SELECT only): INSERT … SELECT within the shard group",
                "INSERT INTO ledger (l_w_id, l_id, l_amount)
                 SELECT c_w_id, 1000 + c_id, c_balance FROM customer WHERE c_w_id = $1 AND c_d_id = 1",
                vec![w],
                &["ledger", "customer"],
            ),
            LEDGER,
        ),
        (
            form(
                "ledger (SELECT only): UPDATE … FROM within the shard group",
                "UPDATE ledger l SET l_amount = c.c_balance FROM customer c
                  WHERE l.l_w_id = $1 AND c.c_w_id = l.l_w_id AND c.c_d_id = 1 AND c.c_id = l.l_id",
                vec![w],
                &["ledger", "customer"],
            ),
            LEDGER,
        ),
        (
            form(
                "ledger (SELECT only): DELETE … USING within the shard group",
                "DELETE FROM ledger l USING customer c
                  WHERE l.l_w_id = $1 AND c.c_w_id = l.l_w_id AND c.c_d_id = 1 AND c.c_id = l.l_id",
                vec![w],
                &["ledger", "customer"],
            ),
            LEDGER,
        ),
        ledger(
            "ledger (SELECT only): SELECT … FOR UPDATE",
            "SELECT l_id FROM ledger WHERE l_w_id = $1 ORDER BY l_id FOR UPDATE",
            vec![w],
        ),
        badge(
            "badge (some columns): another column on one shard group",
            "SELECT b_secret FROM badge WHERE b_w_id = $1",
            vec![w],
        ),
        badge(
            "badge (some columns): SELECT *",
            "SELECT * FROM badge WHERE b_w_id = $1 AND b_id = $2",
            vec![w, 1],
        ),
        badge(
            "badge (some columns): the whole row",
            "SELECT b FROM badge b WHERE b_w_id = $1",
            vec![w],
        ),
        badge(
            "badge (some columns): another column in the WHERE",
            "SELECT b_id FROM badge WHERE b_w_id = $1 AND b_secret LIKE 'secret%'",
            vec![w],
        ),
        badge(
            "badge (some columns): another column in the ORDER BY",
            "SELECT b_label FROM badge WHERE b_w_id = $1 ORDER BY b_secret",
            vec![w],
        ),
        (
            form(
                "badge (some columns): another column in a co-located join",
                "SELECT c.c_id, b.b_secret FROM customer c
                   JOIN badge b ON b.b_w_id = c.c_w_id AND b.b_id = c.c_id
                  WHERE c.c_w_id = $1 AND c.c_d_id = 1",
                vec![w],
                &["customer", "badge"],
            ),
            BADGE,
        ),
        badge(
            "badge (some columns): another column aggregated over every shard",
            "SELECT count(b_secret) FROM badge WHERE b_id > $1",
            vec![0],
        ),
        badge(
            "badge (some columns): another column in ORDER BY … LIMIT over every shard",
            "SELECT b_w_id, b_secret FROM badge ORDER BY b_w_id, b_id LIMIT $1",
            vec![5],
        ),
        badge(
            "badge (some columns): another column in a filter over every shard",
            "SELECT b_id FROM badge WHERE b_secret = 'x' AND b_id > $1",
            vec![0],
        ),
        (
            form("TRUNCATE without the privilege", "TRUNCATE customer", vec![], &["customer"]),
            Denied::Table(&["customer"]),
        ),
        ledger("ledger (SELECT only): TRUNCATE", "TRUNCATE ledger", vec![]),
        (
            form(
                "a SECURITY INVOKER function reading a column the role may not read",
                "SELECT badge_secret_invoker($1, 2)",
                vec![w],
                &["badge"],
            ),
            BADGE,
        ),
        (
            form(
                "secret_fn (no EXECUTE) in the WHERE of one shard group",
                "SELECT w_id FROM warehouse WHERE w_id = $1 AND secret_fn(w_id) = w_id",
                vec![w],
                &["warehouse"],
            ),
            FUNCTION,
        ),
        (
            form(
                "secret_fn (no EXECUTE) in the target list of one shard group",
                "SELECT secret_fn(w_ytd) FROM warehouse WHERE w_id = $1",
                vec![w],
                &["warehouse"],
            ),
            FUNCTION,
        ),
        (
            form(
                "secret_fn (no EXECUTE) in a co-located join",
                "SELECT c.c_id FROM customer c
                   JOIN district d ON d.d_w_id = c.c_w_id AND d.d_id = c.c_d_id
                  WHERE c.c_w_id = $1 AND secret_fn(d.d_id) = 1",
                vec![w],
                &["customer", "district"],
            ),
            FUNCTION,
        ),
        (
            form(
                "secret_fn (no EXECUTE) over every shard",
                "SELECT count(*) FROM customer WHERE secret_fn(c_id) > $1",
                vec![0],
                &["customer"],
            ),
            FUNCTION,
        ),
        (
            form(
                "secret_fn (no EXECUTE) in a single-shard UPDATE",
                "UPDATE warehouse SET w_ytd = secret_fn(w_ytd) WHERE w_id = $1",
                vec![w],
                &["warehouse"],
            ),
            FUNCTION,
        ),
        (
            form(
                "secret_fn (no EXECUTE) in a single-shard INSERT",
                "INSERT INTO history (h_w_id, h_id, h_d_id, h_c_id, h_amount)
                 VALUES ($1, 700000, 1, 1, secret_fn(5))",
                vec![w],
                &["history"],
            ),
            FUNCTION,
        ),
        (
            form(
                "secret_fn (no EXECUTE) in a single-shard DELETE",
                "DELETE FROM history WHERE h_w_id = $1 AND h_id = secret_fn(1)",
                vec![w],
                &["history"],
            ),
            FUNCTION,
        ),
    ];
    // Settings a statement running on the owner must not take there: the machinery's own
    // (superuser only) and the role itself.
    for (setting, value, denied) in [
        (
            "remus.migration_session",
            "on",
            Denied::Setting("remus.migration_session"),
        ),
        ("remus.forwarded", "off", Denied::Setting("remus.forwarded")),
        (
            "remus.forwarded_role",
            "postgres",
            Denied::Setting("remus.forwarded_role"),
        ),
        ("role", "postgres", Denied::Any),
        ("session_authorization", "postgres", Denied::Any),
    ] {
        let call = format!("set_config('{setting}', '{value}', true)");
        out.push((
            Form {
                what: "set_config in the WHERE of one shard group",
                sql: format!("SELECT w_id FROM warehouse WHERE w_id = $1 AND {call} IS NOT NULL"),
                params: vec![w],
                oracle: None,
                tables: &["warehouse"],
            },
            denied,
        ));
        out.push((
            Form {
                what: "set_config in a single-shard UPDATE",
                sql: format!(
                    "UPDATE warehouse SET w_name = {call} WHERE w_id = $1 RETURNING w_name"
                ),
                params: vec![w],
                oracle: None,
                tables: &["warehouse"],
            },
            denied,
        ));
    }
    out.push((
        form(
            "set_config over every shard",
            "SELECT count(*) FROM customer
              WHERE set_config('remus.migration_session', 'on', true) IS NOT NULL AND c_id > $1",
            vec![0],
            &["customer"],
        ),
        Denied::Setting("remus.migration_session"),
    ));
    out
}

/// What `app` may read of `ledger` and `badge`: the superuser's answers.
fn allowed_to_app(w: i64) -> Vec<Form> {
    vec![
        form(
            "ledger (SELECT only): SELECT",
            "SELECT l_id, l_amount FROM ledger WHERE l_w_id = $1 ORDER BY l_id",
            vec![w],
            &["ledger"],
        ),
        form(
            "badge (some columns): the granted columns",
            "SELECT b_id, b_label FROM badge WHERE b_w_id = $1 ORDER BY b_id",
            vec![w],
            &["badge"],
        ),
        form(
            "badge (some columns): count(*)",
            "SELECT count(*) FROM badge WHERE b_w_id = $1",
            vec![w],
            &["badge"],
        ),
        form(
            "badge (some columns): the granted columns over every shard",
            "SELECT b_w_id, b_label FROM badge ORDER BY b_w_id, b_id LIMIT $1",
            vec![w + 3],
            &["badge"],
        ),
        form(
            "badge (some columns): GROUP BY a granted column over every shard",
            "SELECT b_label, count(*) FROM badge WHERE b_id <> $1 GROUP BY b_label ORDER BY 1",
            vec![w],
            &["badge"],
        ),
    ]
}

/// `tables` read through each node as the superuser, node by node (node-local tables differ
/// between nodes).
fn per_node(c: &TestCluster, tables: &[&str]) -> Vec<String> {
    c.node_names()
        .iter()
        .flat_map(|n| {
            let mut db = c.connect(n).unwrap();
            tables
                .iter()
                .map(|t| format!("{n} {t}: {}", contents(&mut db, t)))
                .collect::<Vec<_>>()
        })
        .collect()
}

fn unchanged(before: &[String], after: &[String]) -> Result<(), String> {
    match before.iter().zip(after).find(|(b, a)| b != a) {
        None => Ok(()),
        Some((b, a)) => Err(format!(
            "changed by the refused statement:\n  before {b}\n  after  {a}"
        )),
    }
}

/// A refused form as `session`'s role; a refused write leaves its tables as they were.
fn denied_case(
    c: &TestCluster,
    session: &mut Session,
    protocol: Protocol,
    f: &Form,
    denied: Denied,
) -> Result<(), String> {
    let write = is_write(&f.sql);
    let before = if write {
        Some(contents_everywhere(c, f.tables, None)?)
    } else {
        None
    };
    let result = expect_denied(session.exec(protocol, &f.sql, &f.params), denied);
    if let Some(before) = before {
        contents_everywhere(c, f.tables, Some(&before))?;
    }
    result?;
    no_prepared(c)
}

/// In a transaction of `session`: `granted` (each must succeed), then `refused` (refused as
/// `denied`), then `end` (COMMIT or ROLLBACK). Every table they name is as before, read through
/// every node, and nothing is left prepared.
fn refused_in_transaction(
    c: &TestCluster,
    session: &mut Session,
    protocol: Protocol,
    granted: &[Form],
    refused: &Form,
    denied: Denied,
    end: &str,
) -> Result<(), String> {
    let tables: Vec<&str> = granted
        .iter()
        .chain([refused])
        .flat_map(|f| f.tables.iter().copied())
        .collect();
    let before = contents_everywhere(c, &tables, None)?;
    let result = session.db().and_then(|db| {
        db.batch_execute("BEGIN").map_err(|e| describe(&e))?;
        for f in granted {
            if let Err(e) = query(db, protocol, &f.sql, &f.params) {
                let _ = db.batch_execute("ROLLBACK");
                return Err(format!("{}: {}", f.what, describe(&e)));
            }
        }
        let r = expect_denied(
            Ok(query(db, protocol, &refused.sql, &refused.params)),
            denied,
        );
        db.batch_execute(end)
            .map_err(|e| format!("{end}: {}", describe(&e)))?;
        r
    });
    result?;
    contents_everywhere(c, &tables, Some(&before))?;
    no_prepared(c)
}

/// The catalog tables of `remus` and what a role must not do with them.
const CATALOG: &[&str] = &[
    "SELECT * FROM remus.shard_map",
    "SELECT * FROM remus.nodes",
    "SELECT * FROM remus.shards",
    "SELECT * FROM remus.distributed_tables",
    "SELECT * FROM remus.commit_decisions",
    "SELECT * FROM remus.fanout('customer'::regclass, 'SELECT count(*) FROM customer') AS t(n bigint)",
    "UPDATE remus.shard_map SET node_name = node_name",
    "DELETE FROM remus.shard_map",
    "INSERT INTO remus.nodes (name, host, port) VALUES ('intruder', '127.0.0.1', 5432)",
    "UPDATE remus.nodes SET port = port",
    "DELETE FROM remus.commit_decisions",
    "TRUNCATE remus.shard_map",
];

/// What of `remus` and `remus_shards` `role` can reach on `db` (USAGE on the schema and a
/// privilege on the object): nothing.
fn reachable_internals(db: &mut Client, role: &str) -> Vec<String> {
    db.query(
        "SELECT c.oid::regclass::text || ' ' || p
           FROM pg_class c
          CROSS JOIN unnest(ARRAY['SELECT', 'INSERT', 'UPDATE', 'DELETE', 'TRUNCATE']) p
          WHERE c.relnamespace IN ('remus'::regnamespace, 'remus_shards'::regnamespace)
            AND c.relkind IN ('r', 'p', 'v', 'm', 'f')
            AND has_schema_privilege($1, c.relnamespace, 'USAGE')
            AND has_table_privilege($1, c.oid, p)
         UNION ALL
         SELECT c.oid::regclass::text || ' USAGE'
           FROM pg_class c
          WHERE c.relnamespace IN ('remus'::regnamespace, 'remus_shards'::regnamespace)
            AND c.relkind = 'S'
            AND has_schema_privilege($1, c.relnamespace, 'USAGE')
            AND has_sequence_privilege($1, c.oid, 'USAGE')
         UNION ALL
         SELECT f.oid::regprocedure::text || ' EXECUTE'
           FROM pg_proc f
          WHERE f.pronamespace = 'remus'::regnamespace
            AND f.prorettype <> 'trigger'::regtype
            AND has_schema_privilege($1, f.pronamespace, 'USAGE')
            AND has_function_privilege($1, f.oid, 'EXECUTE')
          ORDER BY 1",
        &[&role],
    )
    .unwrap()
    .iter()
    .map(|r| r.get(0))
    .collect()
}

fn refusals(role_of_app: fn(&TestCluster) -> Role) {
    let Fixture { c, near, far } = fixture();
    let app = role_of_app(&c);
    let mut report = Report::default();
    let keys = [(near, far, "w on n1"), (far, near, "w on n2")];

    // `outsider`, granted nothing: every routed form, a transaction, COPY.
    let mut runs = 0;
    for entry in ENTRIES {
        let mut session = Session::new(&c, entry, &outsider());
        for protocol in PROTOCOLS {
            for (w, other, owner) in keys {
                let tables = reads(w, other, "outsider")
                    .into_iter()
                    .chain(writes(w, runs, "outsider"))
                    .chain([form("TRUNCATE", "TRUNCATE customer", vec![], &["customer"])])
                    .map(|f| {
                        let denied = Denied::Table(f.tables);
                        (f, denied)
                    });
                // The views refuse as views; the SECURITY DEFINER function is anyone's to call.
                let views = through_owned_objects(w)
                    .into_iter()
                    .filter(|f| f.tables[0] != "badge")
                    .map(|f| {
                        let denied = Denied::View(f.tables[0]);
                        (f, denied)
                    });
                runs += 1;
                for (f, denied) in tables.chain(views) {
                    let name = format!("outsider: {} ({owner}) via {entry}, {protocol:?}", f.what);
                    report.case(name, denied_case(&c, &mut session, protocol, &f, denied));
                }
            }
            let steps = two_node_transaction(near, far, 0);
            let result = refused_in_transaction(
                &c,
                &mut session,
                protocol,
                &[],
                &steps[1],
                Denied::Table(&["warehouse"]),
                "ROLLBACK",
            );
            report.case(
                format!("outsider: a transaction's first write via {entry}, {protocol:?}"),
                result,
            );
        }
        for (table, denied, sql, data) in [
            (
                "history",
                Denied::Table(&["history"]),
                "COPY history (h_w_id, h_id, h_d_id, h_c_id, h_amount) FROM STDIN",
                format!("{near}\t800000\t1\t1\t1\n{far}\t800001\t1\t1\t1\n"),
            ),
            (
                "item",
                Denied::Table(&["item"]),
                "COPY item FROM STDIN",
                "800\tnot\t1\n".to_string(),
            ),
        ] {
            let tables = [table];
            let before = contents_everywhere(&c, &tables, None).unwrap();
            let result = expect_denied(copy_in_raw(&c, entry, &outsider(), sql, &data), denied)
                .and_then(|()| contents_everywhere(&c, &tables, Some(&before)).map(drop));
            report.case(format!("outsider: COPY into {table} via {entry}"), result);
        }
    }

    // `app`: what it was not granted, what it may do of the same tables, and no escalation.
    for entry in ENTRIES {
        let mut su = c.connect(entry).unwrap();
        let mut session = Session::new(&c, entry, &app);
        for protocol in PROTOCOLS {
            for (w, _, owner) in keys {
                for f in allowed_to_app(w) {
                    let name = format!("app: {} ({owner}) via {entry}, {protocol:?}", f.what);
                    report.case(name, read_case(&mut session, &mut su, protocol, &f));
                }
                for (f, denied) in denied_to_app(w) {
                    let name = format!("app: {} ({owner}) via {entry}, {protocol:?}", f.what);
                    report.case(name, denied_case(&c, &mut session, protocol, &f, denied));
                }
            }
            // A refused write in a transaction that already wrote on another node: nothing of
            // it commits.
            let granted = form(
                "UPDATE on n1",
                "UPDATE customer SET c_balance = c_balance + 1
                  WHERE c_w_id = $1 AND c_d_id = 1 AND c_id = 1",
                vec![near],
                &["customer"],
            );
            let refused = form(
                "UPDATE on n2",
                "UPDATE ledger SET l_amount = 0 WHERE l_w_id = $1",
                vec![far],
                &["ledger"],
            );
            let result = refused_in_transaction(
                &c,
                &mut session,
                protocol,
                &[granted],
                &refused,
                Denied::Table(&["ledger"]),
                "COMMIT",
            );
            report.case(
                format!(
                    "app: a refused write after a granted one on another node, committed, via {entry}, {protocol:?}"
                ),
                result,
            );
        }
        let tables = ["ledger"];
        let before = contents_everywhere(&c, &tables, None).unwrap();
        let result = expect_denied(
            copy_in_raw(
                &c,
                entry,
                &app,
                "COPY ledger FROM STDIN",
                &format!("{near}\t901\t1\n{far}\t901\t1\n"),
            ),
            Denied::Table(&["ledger"]),
        )
        .and_then(|()| contents_everywhere(&c, &tables, Some(&before)).map(drop));
        report.case(
            format!("app: COPY into ledger (SELECT only) via {entry}"),
            result,
        );
    }

    // A privilege revoked after a statement was prepared (its generic plan cached): refused at
    // the next execution, as PostgreSQL checks privileges at every execution; granted again,
    // the statement runs again.
    for entry in ENTRIES {
        let result = (|| -> Result<(), String> {
            let mut db = connect_as(&c, entry, &app).map_err(|e| describe(&e))?;
            db.batch_execute("SET plan_cache_mode = force_generic_plan")
                .map_err(|e| describe(&e))?;
            let stmt = db
                .prepare("SELECT l_id FROM ledger WHERE l_w_id = $1 ORDER BY l_id")
                .map_err(|e| describe(&e))?;
            for w in [near, far] {
                let rows = db.query(&stmt, &[&w]).map_err(|e| describe(&e))?;
                if rows.is_empty() {
                    return Err(format!("no rows of ledger for {w} before the REVOKE"));
                }
            }
            on_every_node(&c, "REVOKE SELECT ON ledger FROM app");
            let refused: Result<(), String> = [near, far].iter().try_for_each(|w| {
                expect_denied(
                    Ok(db.query(&stmt, &[w]).map(|r| r.len() as u64)),
                    Denied::Table(&["ledger"]),
                )
                .map_err(|e| format!("w = {w} after the REVOKE: {e}"))
            });
            on_every_node(&c, "GRANT SELECT ON ledger TO app");
            refused?;
            for w in [near, far] {
                let rows = db.query(&stmt, &[&w]).map_err(|e| describe(&e))?;
                if rows.is_empty() {
                    return Err(format!("no rows of ledger for {w} after the GRANT"));
                }
            }
            Ok(())
        })();
        report.case(
            format!("app: a prepared SELECT after REVOKE and GRANT via {entry}"),
            result,
        );
    }

    // A SECURITY INVOKER function's statement (its key a PL/pgSQL parameter) reads with the
    // caller's privileges from its first call in a session on.
    for entry in ENTRIES {
        for (w, _, owner) in keys {
            let result = connect_as(&c, entry, &app)
                .map_err(|e| describe(&e))
                .and_then(|mut db| {
                    expect_denied(
                        Ok(query(
                            &mut db,
                            Protocol::Simple,
                            "SELECT badge_secret_invoker($1, 2)",
                            &[w],
                        )),
                        Denied::Table(&["badge"]),
                    )
                });
            report.case(
                format!(
                    "app: a SECURITY INVOKER function reading a column the role may not read, \
                     the session's first statement ({owner}) via {entry}"
                ),
                result,
            );
        }
    }

    // A superuser's session that SET ROLE: its routed statements run as that role.
    for entry in ENTRIES {
        let mut su = c.connect(entry).unwrap();
        for protocol in PROTOCOLS {
            let w = near;
            su.batch_execute("SET ROLE outsider").unwrap();
            let f = &reads(w, far, "outsider")[0];
            let result = expect_denied(
                Ok(query(&mut su, protocol, &f.sql, &f.params)),
                Denied::Table(f.tables),
            );
            su.batch_execute("RESET ROLE").unwrap();
            report.case(
                format!("SET ROLE outsider: {} via {entry}, {protocol:?}", f.what),
                result,
            );
            for f in reads(w, far, "app")
                .into_iter()
                .filter(|f| f.what.starts_with("current_user"))
            {
                let want = run(&mut su, protocol, f.oracle(), &f.params).unwrap();
                su.batch_execute("SET ROLE app").unwrap();
                let got = run(&mut su, protocol, &f.sql, &f.params);
                su.batch_execute("RESET ROLE").unwrap();
                report.case(
                    format!("SET ROLE app: {} via {entry}, {protocol:?}", f.what),
                    got.and_then(|got| check_rows(got, want, false)),
                );
            }
        }
    }

    // The catalog and the shard tables, by name, on every node.
    let catalog_tables = [
        "remus.shard_map",
        "remus.nodes",
        "remus.shards",
        "remus.distributed_tables",
    ];
    for node in c.node_names() {
        let mut session = Session::new(&c, &node, &app);
        let before = per_node(&c, &catalog_tables);
        for protocol in PROTOCOLS {
            for sql in CATALOG {
                report.case(
                    format!("app: {sql} on {node}, {protocol:?}"),
                    expect_denied(session.exec(protocol, sql, &[]), Denied::Any),
                );
            }
        }
        report.case(
            format!("app: the catalog on every node after app's statements on {node}"),
            unchanged(&before, &per_node(&c, &catalog_tables)),
        );
        let mut su = c.connect(&node).unwrap();
        let shard_tables: Vec<(String, String)> = su
            .query(
                "SELECT format('remus_shards.%I', c.relname), a.attname::text
                   FROM pg_class c JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum = 1
                  WHERE c.relnamespace = 'remus_shards'::regnamespace AND c.relkind = 'r'
                  ORDER BY 1",
                &[],
            )
            .unwrap()
            .iter()
            .map(|r| (r.get(0), r.get(1)))
            .collect();
        assert!(!shard_tables.is_empty(), "{node} holds shard tables");
        let counts = |su: &mut Client| -> Vec<String> {
            shard_tables
                .iter()
                .map(|(t, _)| {
                    let n: i64 = su
                        .query_one(&format!("SELECT count(*) FROM {t}"), &[])
                        .unwrap()
                        .get(0);
                    format!("{t}: {n} rows")
                })
                .collect()
        };
        let before = counts(&mut su);
        for (table, column) in &shard_tables {
            for protocol in PROTOCOLS {
                let sql = format!("SELECT * FROM {table}");
                report.case(
                    format!("app: {sql} on {node}, {protocol:?}"),
                    expect_denied(session.exec(protocol, &sql, &[]), Denied::Any),
                );
            }
            for sql in [
                format!("UPDATE {table} SET {column} = {column}"),
                format!("DELETE FROM {table}"),
                format!("INSERT INTO {table} DEFAULT VALUES"),
                format!("TRUNCATE {table}"),
            ] {
                report.case(
                    format!("app: {sql} on {node}"),
                    expect_denied(session.exec(Protocol::Simple, &sql, &[]), Denied::Any),
                );
            }
            report.case(
                format!("app: COPY {table} FROM STDIN on {node}"),
                expect_denied(
                    copy_in_raw(&c, &node, &app, &format!("COPY {table} FROM STDIN"), ""),
                    Denied::Any,
                ),
            );
        }
        report.case(
            format!("app: the shard tables of {node} after app's statements"),
            unchanged(&before, &counts(&mut su)),
        );
        let reachable = reachable_internals(&mut su, &app.name);
        report.case(
            format!("app: nothing of remus and remus_shards reachable on {node}"),
            if reachable.is_empty() {
                Ok(())
            } else {
                Err(format!("reachable: {}", reachable.join(", ")))
            },
        );
    }
    report.finish("refusals");
}

/// pgbench's TPC-B as `role` (granted on the pgbench tables on every node) through n3, which
/// owns none of their shards, and through n1 at once, `-t` transactions per client: no failed
/// transaction, and every balance equals its history.
fn pgbench_run_as(role_of: fn(&TestCluster) -> Role) {
    const CLIENTS: u64 = 4;
    const TRANSACTIONS: u64 = 100;
    let c = TestCluster::start(3).expect("cluster up");
    init_tpcb(&c, 2);
    move_every_shard(
        &c,
        "n3",
        "n1",
        &["pgbench_accounts", "pgbench_branches", "pgbench_tellers"],
    );
    on_every_node(&c, &app().create_sql());
    on_every_node(
        &c,
        "GRANT SELECT, INSERT, UPDATE, DELETE
            ON pgbench_accounts, pgbench_branches, pgbench_tellers, pgbench_history TO app",
    );
    let role = role_of(&c);
    let (clients, transactions) = (CLIENTS.to_string(), TRANSACTIONS.to_string());
    let args = [
        "-n",
        "-c",
        &clients,
        "-j",
        "2",
        "-t",
        &transactions,
        "--max-tries=1",
    ];
    let runs: Vec<_> = [NON_OWNER, OWNER]
        .iter()
        .map(|node| {
            let child = pgbench_as(&c, node, &role, &args)
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap();
            (node, child)
        })
        .collect();
    let each = CLIENTS * TRANSACTIONS;
    for (node, child) in runs {
        let r = finish(child);
        println!("pgbench as {} via {node}:\n{}", role.name, r.output);
        assert_eq!(
            r.failed, 0,
            "pgbench as {} via {node}: {}",
            role.name, r.output
        );
        assert_eq!(
            r.aborted_clients, 0,
            "pgbench as {} via {node}: {}",
            role.name, r.output
        );
        assert!(
            r.output.contains(&format!(
                "number of transactions actually processed: {each}/{each}"
            )),
            "pgbench as {} via {node}: {}",
            role.name,
            r.output
        );
    }
    let (a, b, t, h) = balances(&c, NON_OWNER);
    assert_eq!((a, b, t), (h, h, h), "balances diverge");
    assert_tpcb_consistent(&c, "n2", 2 * each, "pgbench as the application role");
    assert_eq!(prepared_everywhere(&c), 0, "prepared transactions left");
}

#[test]
fn routed_forms_as_the_application_role() {
    routed_forms_run_as(|_| app());
}

#[test]
fn refusals_are_42501_as_on_postgresql() {
    refusals(|_| app());
}

#[test]
fn pgbench_as_the_application_role() {
    pgbench_run_as(|_| app());
}
