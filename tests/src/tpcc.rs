//! TPC-C on a pg_remus cluster: the schema (every table but `item` distributed by its warehouse
//! column and co-located with `warehouse`, `item` a reference table), a small loader that keeps
//! the spec's relationships, the five transactions written the way a plain PostgreSQL
//! implementation writes them (BenchBase's statements: no rewrites for the router), one worker
//! that runs them through one node over the simple, extended or prepared protocol, and the
//! consistency conditions 1 to 4 of clause 3.3.2.
//!
//! Kept apart from the tests so a TPC-C benchmark driver can reuse it: nothing here knows about
//! the test cluster, only about `postgres::Client`s.
//!
//! Departures from the spec, all of scale or of what pg_remus needs:
//! - the scale is tiny ([`Scale`]), and customer last names repeat every 10 customers (three
//!   customers per name) so Payment and OrderStatus by name find several and take the middle one;
//! - `history` has a surrogate `h_id uuid` and the primary key `(h_w_id, h_id)`: a distributed
//!   table needs a primary key containing its shard key (the pgbench tables get the same);
//! - remote supply warehouses in NewOrder are 10% per line, not 1%, so 2PC runs often.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use chrono::{NaiveDateTime, Utc};
use postgres::error::SqlState;
use postgres::types::{ToSql, Type};
use postgres::{Client, SimpleQueryMessage, Statement, ToStatement};
use rust_decimal::Decimal;

/// How many of each thing the loader makes.
#[derive(Clone, Copy, Debug)]
pub struct Scale {
    pub warehouses: i32,
    pub districts: i32,
    pub customers: i32,
    pub items: i32,
    /// Initial orders per district (one per customer, so equal to `customers`).
    pub orders: i32,
    /// Of the initial orders, how many (the last ones) are undelivered, in `new_order`.
    pub new_orders: i32,
}

impl Scale {
    /// 4 warehouses, 10 districts each, 30 customers and 30 orders per district (the last 9
    /// undelivered), 1,000 items.
    pub const SMALL: Scale = Scale {
        warehouses: 4,
        districts: 10,
        customers: 30,
        items: 1000,
        orders: 30,
        new_orders: 9,
    };
}

/// Shards of `warehouse` (and of every table co-located with it).
pub const SHARDS: i32 = 8;

/// The nine tables with the spec's columns and keys (clause 1.3), and the two secondary indexes
/// every implementation adds (customer by last name, orders by customer).
pub const SCHEMA: &str = "
CREATE TABLE warehouse (
  w_id int NOT NULL, w_name varchar(10), w_street_1 varchar(20), w_street_2 varchar(20),
  w_city varchar(20), w_state char(2), w_zip char(9), w_tax numeric(4,4), w_ytd numeric(12,2),
  PRIMARY KEY (w_id));
CREATE TABLE district (
  d_id int NOT NULL, d_w_id int NOT NULL, d_name varchar(10), d_street_1 varchar(20),
  d_street_2 varchar(20), d_city varchar(20), d_state char(2), d_zip char(9),
  d_tax numeric(4,4), d_ytd numeric(12,2), d_next_o_id int,
  PRIMARY KEY (d_w_id, d_id));
CREATE TABLE customer (
  c_id int NOT NULL, c_d_id int NOT NULL, c_w_id int NOT NULL, c_first varchar(16),
  c_middle char(2), c_last varchar(16), c_street_1 varchar(20), c_street_2 varchar(20),
  c_city varchar(20), c_state char(2), c_zip char(9), c_phone char(16), c_since timestamp,
  c_credit char(2), c_credit_lim numeric(12,2), c_discount numeric(4,4),
  c_balance numeric(12,2), c_ytd_payment numeric(12,2), c_payment_cnt int,
  c_delivery_cnt int, c_data varchar(500),
  PRIMARY KEY (c_w_id, c_d_id, c_id));
CREATE INDEX customer_by_name ON customer (c_w_id, c_d_id, c_last, c_first);
CREATE TABLE history (
  h_c_id int, h_c_d_id int, h_c_w_id int, h_d_id int, h_w_id int NOT NULL,
  h_date timestamp, h_amount numeric(6,2), h_data varchar(24),
  h_id uuid NOT NULL DEFAULT gen_random_uuid(),
  PRIMARY KEY (h_w_id, h_id));
CREATE TABLE new_order (
  no_o_id int NOT NULL, no_d_id int NOT NULL, no_w_id int NOT NULL,
  PRIMARY KEY (no_w_id, no_d_id, no_o_id));
CREATE TABLE orders (
  o_id int NOT NULL, o_d_id int NOT NULL, o_w_id int NOT NULL, o_c_id int,
  o_entry_d timestamp, o_carrier_id int, o_ol_cnt int, o_all_local int,
  PRIMARY KEY (o_w_id, o_d_id, o_id));
CREATE INDEX orders_by_customer ON orders (o_w_id, o_d_id, o_c_id, o_id);
CREATE TABLE order_line (
  ol_o_id int NOT NULL, ol_d_id int NOT NULL, ol_w_id int NOT NULL, ol_number int NOT NULL,
  ol_i_id int, ol_supply_w_id int, ol_delivery_d timestamp, ol_quantity int,
  ol_amount numeric(6,2), ol_dist_info char(24),
  PRIMARY KEY (ol_w_id, ol_d_id, ol_o_id, ol_number));
CREATE TABLE item (
  i_id int NOT NULL, i_im_id int, i_name varchar(24), i_price numeric(5,2),
  i_data varchar(50),
  PRIMARY KEY (i_id));
CREATE TABLE stock (
  s_i_id int NOT NULL, s_w_id int NOT NULL, s_quantity int,
  s_dist_01 char(24), s_dist_02 char(24), s_dist_03 char(24), s_dist_04 char(24),
  s_dist_05 char(24), s_dist_06 char(24), s_dist_07 char(24), s_dist_08 char(24),
  s_dist_09 char(24), s_dist_10 char(24), s_ytd int, s_order_cnt int, s_remote_cnt int,
  s_data varchar(50),
  PRIMARY KEY (s_w_id, s_i_id));
";

/// Creates the tables and distributes them: `warehouse` by `w_id` over [`SHARDS`] shards, the
/// other warehouse-keyed tables by their warehouse column co-located with it, `item` on every
/// node.
pub fn create_schema(db: &mut Client) -> Result<(), postgres::Error> {
    db.batch_execute(SCHEMA)?;
    db.batch_execute(&format!(
        "SELECT remus_create_distributed_table('warehouse', 'w_id', {SHARDS});"
    ))?;
    for (table, key) in [
        ("district", "d_w_id"),
        ("customer", "c_w_id"),
        ("history", "h_w_id"),
        ("new_order", "no_w_id"),
        ("orders", "o_w_id"),
        ("order_line", "ol_w_id"),
        ("stock", "s_w_id"),
    ] {
        db.batch_execute(&format!(
            "SELECT remus_create_distributed_table('{table}', '{key}', {SHARDS}, \
             colocate_with => 'warehouse');"
        ))?;
    }
    db.batch_execute("SELECT remus_create_reference_table('item');")
}

// ---------------------------------------------------------------------------------------------
// Values

/// A statement parameter. Money is an exact [`Decimal`] (cents, or ten-thousandths for rates).
#[derive(Clone, Debug)]
pub enum P {
    I(i32),
    D(Decimal),
    T(String),
    Ts(NaiveDateTime),
}

impl P {
    /// The parameter as an SQL literal, for the simple protocol.
    fn literal(&self) -> String {
        match self {
            P::I(v) => v.to_string(),
            P::D(v) => v.to_string(),
            P::T(v) => format!("'{}'", v.replace('\'', "''")),
            // Microseconds, truncated, as the binary form sends them.
            P::Ts(t) => format!("'{}'", t.format("%F %T%.6f")),
        }
    }

    fn sql(&self) -> &(dyn ToSql + Sync) {
        match self {
            P::I(v) => v,
            P::D(v) => v,
            P::T(v) => v,
            P::Ts(v) => v,
        }
    }
}

/// One result row, its columns as text (NULL as `None`), whichever protocol read it.
#[derive(Clone, Debug)]
pub struct Row(pub Vec<Option<String>>);

impl Row {
    pub fn text(&self, i: usize) -> &str {
        self.0[i].as_deref().unwrap_or("")
    }

    pub fn int(&self, i: usize) -> i64 {
        let t = self.0[i]
            .as_deref()
            .unwrap_or_else(|| panic!("column {i} is NULL"));
        t.parse()
            .unwrap_or_else(|_| panic!("column {i} is not an integer: {t}"))
    }

    pub fn dec(&self, i: usize) -> Decimal {
        let t = self.0[i]
            .as_deref()
            .unwrap_or_else(|| panic!("column {i} is NULL"));
        t.parse()
            .unwrap_or_else(|_| panic!("column {i} is not a decimal: {t}"))
    }

    pub fn is_null(&self, i: usize) -> bool {
        self.0[i].is_none()
    }

    fn from_binary(r: &postgres::Row) -> Row {
        Row((0..r.len())
            .map(|i| {
                let ty = r.columns()[i].type_();
                match *ty {
                    Type::INT2 => r.get::<_, Option<i16>>(i).map(|v| v.to_string()),
                    Type::INT4 => r.get::<_, Option<i32>>(i).map(|v| v.to_string()),
                    Type::INT8 => r.get::<_, Option<i64>>(i).map(|v| v.to_string()),
                    Type::NUMERIC => r.get::<_, Option<Decimal>>(i).map(|v| v.to_string()),
                    Type::TIMESTAMP => r.get::<_, Option<NaiveDateTime>>(i).map(|v| v.to_string()),
                    _ => r.get::<_, Option<String>>(i),
                }
            })
            .collect())
    }
}

// ---------------------------------------------------------------------------------------------
// Sessions and transactions

/// How a worker sends its statements.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Protocol {
    /// `simple_query` with the parameters written as literals.
    Simple,
    /// Unnamed statements with parameters (`query(sql, params)`: Parse/Bind/Execute each time).
    Extended,
    /// Named statements prepared once per session (`prepare`, then `query(&stmt, params)`).
    Prepared,
}

/// A statement that failed, and how.
#[derive(Debug)]
pub struct TxError {
    pub sql: String,
    pub err: postgres::Error,
}

impl TxError {
    /// Serialization failure or deadlock: the transaction may be run again.
    pub fn retryable(&self) -> bool {
        matches!(
            self.err.code(),
            Some(c) if *c == SqlState::T_R_SERIALIZATION_FAILURE
                || *c == SqlState::T_R_DEADLOCK_DETECTED
        )
    }
}

impl fmt::Display for TxError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.err.as_db_error() {
            Some(db) => write!(
                f,
                "{} {} (statement: {})",
                db.code().code(),
                db.message(),
                self.sql.split_whitespace().collect::<Vec<_>>().join(" ")
            ),
            None => write!(f, "{} (statement: {})", self.err, self.sql),
        }
    }
}

type TxResult<T> = Result<T, TxError>;

/// A client of one node and the statements it has prepared.
pub struct Session {
    client: Client,
    protocol: Protocol,
    prepared: HashMap<&'static str, Statement>,
}

impl Session {
    /// Sets `statement_timeout` so that a hang fails instead of blocking forever.
    pub fn new(mut client: Client, protocol: Protocol, statement_timeout: Duration) -> Self {
        client
            .batch_execute(&format!(
                "SET statement_timeout = {}",
                statement_timeout.as_millis()
            ))
            .expect("SET statement_timeout");
        Session {
            client,
            protocol,
            prepared: HashMap::new(),
        }
    }

    /// Runs `body` in one transaction (BEGIN ... COMMIT, or ROLLBACK if it says so or fails).
    fn in_transaction<T>(
        &mut self,
        body: impl FnOnce(&mut Tx<'_>) -> TxResult<(T, bool)>,
    ) -> TxResult<T> {
        let tx = self.client.transaction().map_err(|err| TxError {
            sql: "BEGIN".into(),
            err,
        })?;
        let mut t = Tx {
            tx,
            protocol: self.protocol,
            prepared: &mut self.prepared,
        };
        let (v, commit) = body(&mut t)?;
        let end = if commit {
            ("COMMIT", t.tx.commit())
        } else {
            ("ROLLBACK", t.tx.rollback())
        };
        end.1.map_err(|err| TxError {
            sql: end.0.into(),
            err,
        })?;
        Ok(v)
    }
}

/// An open transaction of a [`Session`].
pub struct Tx<'a> {
    tx: postgres::Transaction<'a>,
    protocol: Protocol,
    prepared: &'a mut HashMap<&'static str, Statement>,
}

impl Tx<'_> {
    /// Runs `sql` with `params` ($1, $2, ...): its rows (when `want_rows`), and the rows it
    /// returned or affected.
    fn run(
        &mut self,
        sql: &'static str,
        params: &[P],
        want_rows: bool,
    ) -> TxResult<(Vec<Row>, u64)> {
        let fail = |err| TxError {
            sql: sql.to_string(),
            err,
        };
        let refs: Vec<&(dyn ToSql + Sync)> = params.iter().map(P::sql).collect();
        match self.protocol {
            Protocol::Simple => {
                let mut rows = Vec::new();
                let mut affected = 0;
                for m in self
                    .tx
                    .simple_query(&with_literals(sql, params))
                    .map_err(fail)?
                {
                    match m {
                        SimpleQueryMessage::Row(r) => rows.push(Row((0..r.len())
                            .map(|i| r.get(i).map(str::to_string))
                            .collect())),
                        SimpleQueryMessage::CommandComplete(n) => affected = n,
                        _ => {}
                    }
                }
                Ok((rows, affected))
            }
            Protocol::Extended => exec(&mut self.tx, sql, &refs, want_rows).map_err(fail),
            Protocol::Prepared => {
                let stmt = match self.prepared.get(sql) {
                    Some(s) => s.clone(),
                    None => {
                        let s = self.tx.prepare(sql).map_err(fail)?;
                        self.prepared.insert(sql, s.clone());
                        s
                    }
                };
                exec(&mut self.tx, &stmt, &refs, want_rows).map_err(fail)
            }
        }
    }

    fn query(&mut self, sql: &'static str, params: &[P]) -> TxResult<Vec<Row>> {
        self.run(sql, params, true).map(|(rows, _)| rows)
    }

    fn one(&mut self, sql: &'static str, params: &[P]) -> TxResult<Option<Row>> {
        self.query(sql, params).map(|rows| rows.into_iter().next())
    }

    /// Runs a statement that returns no rows (INSERT, UPDATE, DELETE): the rows it affected.
    fn execute(&mut self, sql: &'static str, params: &[P]) -> TxResult<u64> {
        self.run(sql, params, false).map(|(_, n)| n)
    }
}

/// Runs `q` over the extended protocol: its rows (when `want_rows`) and how many rows it
/// returned or affected.
fn exec<T: ?Sized + ToStatement>(
    tx: &mut postgres::Transaction<'_>,
    q: &T,
    params: &[&(dyn ToSql + Sync)],
    want_rows: bool,
) -> Result<(Vec<Row>, u64), postgres::Error> {
    if want_rows {
        let rows = tx.query(q, params)?;
        Ok((
            rows.iter().map(Row::from_binary).collect(),
            rows.len() as u64,
        ))
    } else {
        Ok((Vec::new(), tx.execute(q, params)?))
    }
}

/// `sql` with each `$n` replaced by the literal of `params[n - 1]`.
fn with_literals(sql: &str, params: &[P]) -> String {
    let mut out = String::with_capacity(sql.len() + 16 * params.len());
    let mut chars = sql.chars().peekable();
    while let Some(ch) = chars.next() {
        if ch != '$' {
            out.push(ch);
            continue;
        }
        let mut n = String::new();
        while let Some(d) = chars.peek().filter(|d| d.is_ascii_digit()) {
            n.push(*d);
            chars.next();
        }
        let i: usize = n.parse().expect("$ without a parameter number");
        out.push_str(&params[i - 1].literal());
    }
    out
}

// ---------------------------------------------------------------------------------------------
// Random input (clause 2 and 4.3)

/// splitmix64: deterministic per seed, so a retried transaction gets the same input.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `lo..=hi`.
    pub fn range(&mut self, lo: i64, hi: i64) -> i64 {
        lo + (self.next_u64() % (hi - lo + 1) as u64) as i64
    }

    pub fn int(&mut self, lo: i32, hi: i32) -> i32 {
        self.range(lo.into(), hi.into()) as i32
    }

    /// True with probability `pct` percent.
    pub fn percent(&mut self, pct: u64) -> bool {
        self.next_u64() % 100 < pct
    }

    /// NURand(A, x, y) of clause 2.1.6 (C fixed at 0).
    pub fn nurand(&mut self, a: i64, x: i64, y: i64) -> i64 {
        ((self.range(0, a) | self.range(x, y)) % (y - x + 1)) + x
    }

    /// A random alphanumeric string of `lo..=hi` characters.
    pub fn astring(&mut self, lo: i64, hi: i64) -> String {
        const CH: &[u8] = b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
        let n = self.range(lo, hi);
        (0..n)
            .map(|_| CH[self.range(0, CH.len() as i64 - 1) as usize] as char)
            .collect()
    }

    /// A warehouse other than `w` (of `1..=warehouses`, at least 2).
    pub fn other_warehouse(&mut self, w: i32, warehouses: i32) -> i32 {
        let o = self.int(1, warehouses - 1);
        if o >= w {
            o + 1
        } else {
            o
        }
    }
}

/// C_LAST of clause 4.3.2.3: three syllables by the digits of `n` (0..=999).
pub fn last_name(n: i32) -> String {
    const S: [&str; 10] = [
        "BAR", "OUGHT", "ABLE", "PRI", "PRES", "ESE", "ANTI", "CALLY", "ATION", "EING",
    ];
    let n = n as usize;
    format!("{}{}{}", S[n / 100 % 10], S[n / 10 % 10], S[n % 10])
}

/// Distinct last names per district: customer `c` is called `last_name((c - 1) % NAMES)`.
pub const NAMES: i32 = 10;

// ---------------------------------------------------------------------------------------------
// Loading

/// Fills the tables through `db` with COPY FROM STDIN, deterministically from `seed`, so that
/// conditions 1 to 4 hold: w_ytd = sum(d_ytd), d_next_o_id = orders + 1, the last
/// `new_orders` orders of each district undelivered and in `new_order`, o_ol_cnt order lines
/// per order.
pub fn load(db: &mut Client, scale: Scale, seed: u64) -> Result<(), postgres::Error> {
    let mut rng = Rng::new(seed);
    let since = "2024-01-01 00:00:00";
    let s = scale;
    let mut copy = |table: &str, rows: Vec<String>| -> Result<(), postgres::Error> {
        let mut w = db.copy_in(&format!("COPY {table} FROM STDIN"))?;
        w.write_all(rows.join("").as_bytes())
            .expect("writing COPY data");
        w.finish().map(|_| ())
    };
    let data = |rng: &mut Rng, lo, hi| {
        let mut d = rng.astring(lo, hi);
        if rng.percent(10) {
            let at = rng.range(0, d.len() as i64 - 8) as usize;
            d.replace_range(at..at + 8, "ORIGINAL");
        }
        d
    };

    let items = (1..=s.items)
        .map(|i| {
            let (im, name, price) = (
                rng.range(1, 10_000),
                rng.astring(14, 24),
                Decimal::new(rng.range(100, 10_000), 2),
            );
            format!("{i}\t{im}\t{name}\t{price}\t{}\n", data(&mut rng, 26, 50))
        })
        .collect();
    copy("item", items)?;

    let d_ytd = Decimal::new(3_000_000, 2);
    let warehouses = (1..=s.warehouses)
        .map(|w| {
            format!(
                "{w}\tW{w}\t{}\t{}\t{}\tCA\t123411111\t{}\t{}\n",
                rng.astring(10, 20),
                rng.astring(10, 20),
                rng.astring(10, 20),
                Decimal::new(rng.range(0, 2000), 4),
                d_ytd * Decimal::from(s.districts)
            )
        })
        .collect();
    copy("warehouse", warehouses)?;

    let mut stock = Vec::new();
    let mut district = Vec::new();
    let mut customer = Vec::new();
    let mut history = Vec::new();
    let mut orders = Vec::new();
    let mut order_line = Vec::new();
    let mut new_order = Vec::new();
    for w in 1..=s.warehouses {
        for i in 1..=s.items {
            let dists: Vec<String> = (0..10).map(|_| rng.astring(24, 24)).collect();
            stock.push(format!(
                "{i}\t{w}\t{}\t{}\t0\t0\t0\t{}\n",
                rng.range(10, 100),
                dists.join("\t"),
                data(&mut rng, 26, 50)
            ));
        }
        for d in 1..=s.districts {
            district.push(format!(
                "{d}\t{w}\tD{d}\t{}\t{}\t{}\tCA\t123411111\t{}\t{d_ytd}\t{}\n",
                rng.astring(10, 20),
                rng.astring(10, 20),
                rng.astring(10, 20),
                Decimal::new(rng.range(0, 2000), 4),
                s.orders + 1
            ));
            for c in 1..=s.customers {
                let credit = if rng.percent(10) { "BC" } else { "GC" };
                customer.push(format!(
                    "{c}\t{d}\t{w}\t{}\tOE\t{}\t{}\t{}\t{}\tCA\t123411111\t{}\t{since}\t{credit}\t50000.00\t{}\t-10.00\t10.00\t1\t0\t{}\n",
                    rng.astring(8, 16),
                    last_name((c - 1) % NAMES),
                    rng.astring(10, 20),
                    rng.astring(10, 20),
                    rng.astring(10, 20),
                    rng.range(1_000_000_000, 9_999_999_999),
                    Decimal::new(rng.range(0, 5000), 4),
                    rng.astring(300, 500)
                ));
                history.push(format!(
                    "{c}\t{d}\t{w}\t{d}\t{w}\t{since}\t10.00\t{}\n",
                    rng.astring(12, 24)
                ));
            }
            // o_c_id: a permutation of the customers.
            let mut perm: Vec<i32> = (1..=s.customers).collect();
            for k in (1..perm.len()).rev() {
                perm.swap(k, rng.range(0, k as i64) as usize);
            }
            for o in 1..=s.orders {
                let delivered = o <= s.orders - s.new_orders;
                let ol_cnt = rng.range(5, 15);
                let carrier = if delivered {
                    rng.range(1, 10).to_string()
                } else {
                    "\\N".into()
                };
                orders.push(format!(
                    "{o}\t{d}\t{w}\t{}\t{since}\t{carrier}\t{ol_cnt}\t1\n",
                    perm[o as usize - 1]
                ));
                for n in 1..=ol_cnt {
                    let (delivery, amount) = if delivered {
                        (since.to_string(), Decimal::ZERO)
                    } else {
                        ("\\N".into(), Decimal::new(rng.range(1, 999_999), 2))
                    };
                    order_line.push(format!(
                        "{o}\t{d}\t{w}\t{n}\t{}\t{w}\t{delivery}\t5\t{amount}\t{}\n",
                        rng.range(1, s.items.into()),
                        rng.astring(24, 24)
                    ));
                }
                if !delivered {
                    new_order.push(format!("{o}\t{d}\t{w}\n"));
                }
            }
        }
    }
    copy("stock", stock)?;
    copy("district", district)?;
    copy("customer", customer)?;
    copy(
        "history (h_c_id, h_c_d_id, h_c_w_id, h_d_id, h_w_id, h_date, h_amount, h_data)",
        history,
    )?;
    copy("orders", orders)?;
    copy("order_line", order_line)?;
    copy("new_order", new_order)
}

// ---------------------------------------------------------------------------------------------
// The five transactions (clause 2), with BenchBase's statements

const NO_GET_CUST: &str =
    "SELECT c_discount, c_last, c_credit FROM customer WHERE c_w_id = $1 AND c_d_id = $2 AND c_id = $3";
const NO_GET_WHSE: &str = "SELECT w_tax FROM warehouse WHERE w_id = $1";
const NO_GET_DIST: &str =
    "SELECT d_next_o_id, d_tax FROM district WHERE d_w_id = $1 AND d_id = $2 FOR UPDATE";
const NO_UPDATE_DIST: &str =
    "UPDATE district SET d_next_o_id = d_next_o_id + 1 WHERE d_w_id = $1 AND d_id = $2";
const NO_INSERT_ORDER: &str = "INSERT INTO orders (o_id, o_d_id, o_w_id, o_c_id, o_entry_d, o_ol_cnt, o_all_local) VALUES ($1, $2, $3, $4, $5, $6, $7)";
const NO_INSERT_NEW_ORDER: &str =
    "INSERT INTO new_order (no_o_id, no_d_id, no_w_id) VALUES ($1, $2, $3)";
const NO_GET_ITEM: &str = "SELECT i_price, i_name, i_data FROM item WHERE i_id = $1";
const NO_GET_STOCK: &str = "SELECT s_quantity, s_data, s_dist_01, s_dist_02, s_dist_03, s_dist_04, s_dist_05, s_dist_06, s_dist_07, s_dist_08, s_dist_09, s_dist_10 FROM stock WHERE s_i_id = $1 AND s_w_id = $2 FOR UPDATE";
const NO_UPDATE_STOCK: &str = "UPDATE stock SET s_quantity = $1, s_ytd = s_ytd + $2, s_order_cnt = s_order_cnt + 1, s_remote_cnt = s_remote_cnt + $3 WHERE s_i_id = $4 AND s_w_id = $5";
const NO_INSERT_ORDER_LINE: &str = "INSERT INTO order_line (ol_o_id, ol_d_id, ol_w_id, ol_number, ol_i_id, ol_supply_w_id, ol_quantity, ol_amount, ol_dist_info) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)";

const PAY_UPDATE_WHSE: &str = "UPDATE warehouse SET w_ytd = w_ytd + $1 WHERE w_id = $2";
const PAY_GET_WHSE: &str =
    "SELECT w_street_1, w_street_2, w_city, w_state, w_zip, w_name FROM warehouse WHERE w_id = $1";
const PAY_UPDATE_DIST: &str =
    "UPDATE district SET d_ytd = d_ytd + $1 WHERE d_w_id = $2 AND d_id = $3";
const PAY_GET_DIST: &str = "SELECT d_street_1, d_street_2, d_city, d_state, d_zip, d_name FROM district WHERE d_w_id = $1 AND d_id = $2";
const CUST_BY_ID: &str = "SELECT c_first, c_middle, c_last, c_street_1, c_street_2, c_city, c_state, c_zip, c_phone, c_credit, c_credit_lim, c_discount, c_balance, c_ytd_payment, c_payment_cnt, c_since FROM customer WHERE c_w_id = $1 AND c_d_id = $2 AND c_id = $3";
const CUST_BY_NAME: &str = "SELECT c_first, c_middle, c_id, c_street_1, c_street_2, c_city, c_state, c_zip, c_phone, c_credit, c_credit_lim, c_discount, c_balance, c_ytd_payment, c_payment_cnt, c_since FROM customer WHERE c_w_id = $1 AND c_d_id = $2 AND c_last = $3 ORDER BY c_first";
const PAY_GET_CUST_CDATA: &str =
    "SELECT c_data FROM customer WHERE c_w_id = $1 AND c_d_id = $2 AND c_id = $3";
const PAY_UPDATE_CUST_BAL_CDATA: &str = "UPDATE customer SET c_balance = c_balance - $1, c_ytd_payment = c_ytd_payment + $1, c_payment_cnt = c_payment_cnt + 1, c_data = $2 WHERE c_w_id = $3 AND c_d_id = $4 AND c_id = $5";
const PAY_UPDATE_CUST_BAL: &str = "UPDATE customer SET c_balance = c_balance - $1, c_ytd_payment = c_ytd_payment + $1, c_payment_cnt = c_payment_cnt + 1 WHERE c_w_id = $2 AND c_d_id = $3 AND c_id = $4";
const PAY_INSERT_HIST: &str = "INSERT INTO history (h_c_d_id, h_c_w_id, h_c_id, h_d_id, h_w_id, h_date, h_amount, h_data) VALUES ($1, $2, $3, $4, $5, $6, $7, $8)";

const OS_GET_NEWEST_ORDER: &str = "SELECT o_id, o_carrier_id, o_entry_d FROM orders WHERE o_w_id = $1 AND o_d_id = $2 AND o_c_id = $3 ORDER BY o_id DESC LIMIT 1";
const OS_GET_ORDER_LINES: &str = "SELECT ol_i_id, ol_supply_w_id, ol_quantity, ol_amount, ol_delivery_d FROM order_line WHERE ol_o_id = $1 AND ol_d_id = $2 AND ol_w_id = $3";

const DLV_GET_ORDER_ID: &str = "SELECT no_o_id FROM new_order WHERE no_d_id = $1 AND no_w_id = $2 ORDER BY no_o_id ASC LIMIT 1";
const DLV_DELETE_NEW_ORDER: &str =
    "DELETE FROM new_order WHERE no_o_id = $1 AND no_d_id = $2 AND no_w_id = $3";
const DLV_GET_CUST_ID: &str =
    "SELECT o_c_id FROM orders WHERE o_id = $1 AND o_d_id = $2 AND o_w_id = $3";
const DLV_UPDATE_CARRIER: &str =
    "UPDATE orders SET o_carrier_id = $1 WHERE o_id = $2 AND o_d_id = $3 AND o_w_id = $4";
const DLV_UPDATE_DELIVERY_DATE: &str =
    "UPDATE order_line SET ol_delivery_d = $1 WHERE ol_o_id = $2 AND ol_d_id = $3 AND ol_w_id = $4";
const DLV_SUM_AMOUNT: &str = "SELECT sum(ol_amount) AS ol_total FROM order_line WHERE ol_o_id = $1 AND ol_d_id = $2 AND ol_w_id = $3";
const DLV_UPDATE_CUST: &str = "UPDATE customer SET c_balance = c_balance + $1, c_delivery_cnt = c_delivery_cnt + 1 WHERE c_w_id = $2 AND c_d_id = $3 AND c_id = $4";

const SL_GET_DIST: &str = "SELECT d_next_o_id FROM district WHERE d_w_id = $1 AND d_id = $2";
const SL_COUNT_STOCK: &str = "SELECT count(DISTINCT s_i_id) AS stock_count FROM order_line, stock WHERE ol_w_id = $1 AND ol_d_id = $2 AND ol_o_id < $3 AND ol_o_id >= $4 AND s_w_id = $1 AND s_i_id = ol_i_id AND s_quantity < $5";

/// The five transaction types, in the order of [`Stats::committed`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    NewOrder,
    Payment,
    OrderStatus,
    Delivery,
    StockLevel,
}

impl Kind {
    pub const ALL: [Kind; 5] = [
        Kind::NewOrder,
        Kind::Payment,
        Kind::OrderStatus,
        Kind::Delivery,
        Kind::StockLevel,
    ];

    /// The mix 45/43/4/4/4.
    pub fn pick(rng: &mut Rng) -> Kind {
        match rng.range(0, 99) {
            0..=44 => Kind::NewOrder,
            45..=87 => Kind::Payment,
            88..=91 => Kind::OrderStatus,
            92..=95 => Kind::Delivery,
            _ => Kind::StockLevel,
        }
    }
}

/// What one transaction did, beyond committing.
#[derive(Debug, Default)]
struct Outcome {
    /// A NewOrder with an unused item, rolled back (clause 2.4.2.3).
    rolled_back: bool,
    /// A NewOrder with a line supplied by another warehouse, or a Payment of a customer of
    /// another warehouse.
    remote: bool,
    /// Districts a Delivery found no undelivered order for (or whose oldest another Delivery
    /// took first).
    skipped: u64,
}

fn customer_id(rng: &mut Rng, scale: Scale) -> i32 {
    rng.nurand(1023, 1, scale.customers.into()) as i32
}

/// The customer a Payment or OrderStatus is for: by last name (60%), the middle one of those
/// with that name sorted by first name, else by id. Its id.
fn find_customer(
    t: &mut Tx<'_>,
    rng: &mut Rng,
    scale: Scale,
    w: i32,
    d: i32,
) -> TxResult<Option<i32>> {
    if rng.percent(60) {
        let last = last_name(rng.int(0, NAMES - 1));
        let rows = t.query(CUST_BY_NAME, &[P::I(w), P::I(d), P::T(last)])?;
        if rows.is_empty() {
            return Ok(None);
        }
        let mut i = rows.len() / 2;
        if rows.len() % 2 == 0 {
            i -= 1;
        }
        Ok(Some(rows[i].int(2) as i32))
    } else {
        let c = customer_id(rng, scale);
        Ok(t.one(CUST_BY_ID, &[P::I(w), P::I(d), P::I(c)])?.map(|_| c))
    }
}

fn new_order(t: &mut Tx<'_>, rng: &mut Rng, scale: Scale, w: i32) -> TxResult<(Outcome, bool)> {
    let d = rng.int(1, scale.districts);
    let c = customer_id(rng, scale);
    let n = rng.int(5, 15);
    // (supply warehouse, item, quantity), sorted by (supply warehouse, item): one global lock
    // order on stock. The unused item of a rolled-back order stays the last line.
    let mut lines: Vec<(i32, i32, i32)> = (0..n)
        .map(|_| {
            let supply = if scale.warehouses > 1 && rng.percent(10) {
                rng.other_warehouse(w, scale.warehouses)
            } else {
                w
            };
            let i = rng.nurand(255, 1, scale.items.into()) as i32;
            (supply, i, rng.int(1, 10))
        })
        .collect();
    lines.sort();
    if rng.percent(1) {
        lines.last_mut().expect("5 lines at least").1 = scale.items + 1;
    }
    let all_local = lines.iter().all(|l| l.0 == w);

    let cust = t
        .one(NO_GET_CUST, &[P::I(w), P::I(d), P::I(c)])?
        .expect("customer exists");
    let discount = cust.dec(0);
    let w_tax = t.one(NO_GET_WHSE, &[P::I(w)])?.expect("warehouse").dec(0);
    let dist = t
        .one(NO_GET_DIST, &[P::I(w), P::I(d)])?
        .expect("district exists");
    let (o, d_tax) = (dist.int(0) as i32, dist.dec(1));
    t.execute(NO_UPDATE_DIST, &[P::I(w), P::I(d)])?;
    let now = Utc::now().naive_utc();
    t.execute(
        NO_INSERT_ORDER,
        &[
            P::I(o),
            P::I(d),
            P::I(w),
            P::I(c),
            P::Ts(now),
            P::I(n),
            P::I(all_local.into()),
        ],
    )?;
    t.execute(NO_INSERT_NEW_ORDER, &[P::I(o), P::I(d), P::I(w)])?;
    let mut total = Decimal::ZERO;
    for (k, &(supply, i, qty)) in lines.iter().enumerate() {
        let Some(item) = t.one(NO_GET_ITEM, &[P::I(i)])? else {
            // "Item number is not valid": the whole order rolls back.
            return Ok((
                Outcome {
                    rolled_back: true,
                    ..Outcome::default()
                },
                false,
            ));
        };
        let price = item.dec(0);
        let stock = t
            .one(NO_GET_STOCK, &[P::I(i), P::I(supply)])?
            .expect("stock row exists");
        let s_qty = stock.int(0) as i32;
        let new_qty = if s_qty - qty >= 10 {
            s_qty - qty
        } else {
            s_qty - qty + 91
        };
        t.execute(
            NO_UPDATE_STOCK,
            &[
                P::I(new_qty),
                P::I(qty),
                P::I((supply != w).into()),
                P::I(i),
                P::I(supply),
            ],
        )?;
        let amount = price * Decimal::from(qty);
        total += amount;
        t.execute(
            NO_INSERT_ORDER_LINE,
            &[
                P::I(o),
                P::I(d),
                P::I(w),
                P::I(k as i32 + 1),
                P::I(i),
                P::I(supply),
                P::I(qty),
                P::D(amount),
                P::T(stock.text(1 + d as usize).to_string()),
            ],
        )?;
    }
    // total * (1 - discount) * (1 + w_tax + d_tax): shown to the terminal, not stored.
    let _ = (total, discount, w_tax, d_tax);
    Ok((
        Outcome {
            remote: !all_local,
            ..Outcome::default()
        },
        true,
    ))
}

fn payment(t: &mut Tx<'_>, rng: &mut Rng, scale: Scale, w: i32) -> TxResult<(Outcome, bool)> {
    let d = rng.int(1, scale.districts);
    let (c_w, c_d) = if scale.warehouses > 1 && rng.percent(15) {
        (
            rng.other_warehouse(w, scale.warehouses),
            rng.int(1, scale.districts),
        )
    } else {
        (w, d)
    };
    let amount = Decimal::new(rng.range(100, 500_000), 2);
    t.execute(PAY_UPDATE_WHSE, &[P::D(amount), P::I(w)])?;
    let whse = t.one(PAY_GET_WHSE, &[P::I(w)])?.expect("warehouse exists");
    t.execute(PAY_UPDATE_DIST, &[P::D(amount), P::I(w), P::I(d)])?;
    let dist = t
        .one(PAY_GET_DIST, &[P::I(w), P::I(d)])?
        .expect("district exists");
    let c = find_customer(t, rng, scale, c_w, c_d)?.expect("customer exists");
    let credit = t
        .one(CUST_BY_ID, &[P::I(c_w), P::I(c_d), P::I(c)])?
        .expect("customer exists")
        .text(9)
        .to_string();
    if credit == "BC" {
        let data = t
            .one(PAY_GET_CUST_CDATA, &[P::I(c_w), P::I(c_d), P::I(c)])?
            .expect("customer exists")
            .text(0)
            .to_string();
        let mut data = format!("{c} {c_d} {c_w} {d} {w} {amount} | {data}");
        data.truncate(500);
        t.execute(
            PAY_UPDATE_CUST_BAL_CDATA,
            &[P::D(amount), P::T(data), P::I(c_w), P::I(c_d), P::I(c)],
        )?;
    } else {
        t.execute(
            PAY_UPDATE_CUST_BAL,
            &[P::D(amount), P::I(c_w), P::I(c_d), P::I(c)],
        )?;
    }
    let h_data = format!("{}    {}", whse.text(5), dist.text(5));
    t.execute(
        PAY_INSERT_HIST,
        &[
            P::I(c_d),
            P::I(c_w),
            P::I(c),
            P::I(d),
            P::I(w),
            P::Ts(Utc::now().naive_utc()),
            P::D(amount),
            P::T(h_data),
        ],
    )?;
    Ok((
        Outcome {
            remote: c_w != w,
            ..Outcome::default()
        },
        true,
    ))
}

fn order_status(t: &mut Tx<'_>, rng: &mut Rng, scale: Scale, w: i32) -> TxResult<(Outcome, bool)> {
    let d = rng.int(1, scale.districts);
    let c = find_customer(t, rng, scale, w, d)?.expect("customer exists");
    if let Some(o) = t.one(OS_GET_NEWEST_ORDER, &[P::I(w), P::I(d), P::I(c)])? {
        let lines = t.query(
            OS_GET_ORDER_LINES,
            &[P::I(o.int(0) as i32), P::I(d), P::I(w)],
        )?;
        assert!(!lines.is_empty(), "order {w}/{d}/{} has no lines", o.int(0));
    }
    Ok((Outcome::default(), true))
}

fn delivery(t: &mut Tx<'_>, rng: &mut Rng, scale: Scale, w: i32) -> TxResult<(Outcome, bool)> {
    let carrier = rng.int(1, 10);
    let now = Utc::now().naive_utc();
    let mut skipped = 0;
    for d in 1..=scale.districts {
        let Some(no) = t.one(DLV_GET_ORDER_ID, &[P::I(d), P::I(w)])? else {
            skipped += 1;
            continue;
        };
        let o = no.int(0) as i32;
        if t.execute(DLV_DELETE_NEW_ORDER, &[P::I(o), P::I(d), P::I(w)])? == 0 {
            // Another Delivery took it between our read and our delete.
            skipped += 1;
            continue;
        }
        let c = t
            .one(DLV_GET_CUST_ID, &[P::I(o), P::I(d), P::I(w)])?
            .expect("the order of a new_order row exists")
            .int(0) as i32;
        t.execute(
            DLV_UPDATE_CARRIER,
            &[P::I(carrier), P::I(o), P::I(d), P::I(w)],
        )?;
        t.execute(
            DLV_UPDATE_DELIVERY_DATE,
            &[P::Ts(now), P::I(o), P::I(d), P::I(w)],
        )?;
        let sum = t
            .one(DLV_SUM_AMOUNT, &[P::I(o), P::I(d), P::I(w)])?
            .expect("one row");
        assert!(!sum.is_null(0), "order {w}/{d}/{o} has no lines");
        t.execute(
            DLV_UPDATE_CUST,
            &[P::D(sum.dec(0)), P::I(w), P::I(d), P::I(c)],
        )?;
    }
    Ok((
        Outcome {
            skipped,
            ..Outcome::default()
        },
        true,
    ))
}

fn stock_level(t: &mut Tx<'_>, rng: &mut Rng, scale: Scale, w: i32) -> TxResult<(Outcome, bool)> {
    let d = rng.int(1, scale.districts);
    let threshold = rng.int(10, 20);
    let next = t
        .one(SL_GET_DIST, &[P::I(w), P::I(d)])?
        .expect("district exists")
        .int(0) as i32;
    t.one(
        SL_COUNT_STOCK,
        &[
            P::I(w),
            P::I(d),
            P::I(next),
            P::I(next - 20),
            P::I(threshold),
        ],
    )?
    .expect("one row");
    Ok((Outcome::default(), true))
}

// ---------------------------------------------------------------------------------------------
// Workers

/// What a worker did.
#[derive(Debug, Default, Clone)]
pub struct Stats {
    /// Committed transactions, by [`Kind::ALL`] order.
    pub committed: [u64; 5],
    /// NewOrders rolled back for their unused item.
    pub rolled_back: u64,
    /// Committed NewOrders with a remote supply warehouse, Payments of a remote customer.
    pub remote_new_orders: u64,
    pub remote_payments: u64,
    /// Runs that ended in 40001 or 40P01 and were run again, by SQLSTATE.
    pub retries: BTreeMap<String, u64>,
    /// Districts Deliveries skipped.
    pub skipped_deliveries: u64,
    /// Transactions that failed otherwise: the error and the statement.
    pub errors: Vec<String>,
}

impl Stats {
    pub fn add(&mut self, o: &Stats) {
        for (a, b) in self.committed.iter_mut().zip(o.committed) {
            *a += b;
        }
        self.rolled_back += o.rolled_back;
        self.remote_new_orders += o.remote_new_orders;
        self.remote_payments += o.remote_payments;
        for (k, v) in &o.retries {
            *self.retries.entry(k.clone()).or_default() += v;
        }
        self.skipped_deliveries += o.skipped_deliveries;
        self.errors.extend(o.errors.iter().cloned());
    }

    pub fn total_committed(&self) -> u64 {
        self.committed.iter().sum()
    }

    pub fn total_retries(&self) -> u64 {
        self.retries.values().sum()
    }
}

impl fmt::Display for Stats {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let [no, pay, os, dlv, sl] = self.committed;
        write!(
            f,
            "committed {} (NewOrder {no} of which {} remote, Payment {pay} of which {} remote, OrderStatus {os}, Delivery {dlv}, StockLevel {sl}), NewOrders rolled back {}, delivery districts skipped {}, retries {:?}, errors {}",
            self.total_committed(),
            self.remote_new_orders,
            self.remote_payments,
            self.rolled_back,
            self.skipped_deliveries,
            self.retries,
            self.errors.len()
        )
    }
}

/// Runs one transaction of `kind` for home warehouse `w` from `seed`.
fn run_once(
    session: &mut Session,
    kind: Kind,
    scale: Scale,
    w: i32,
    seed: u64,
) -> TxResult<Outcome> {
    let mut rng = Rng::new(seed);
    session.in_transaction(|t| match kind {
        Kind::NewOrder => new_order(t, &mut rng, scale, w),
        Kind::Payment => payment(t, &mut rng, scale, w),
        Kind::OrderStatus => order_status(t, &mut rng, scale, w),
        Kind::Delivery => delivery(t, &mut rng, scale, w),
        Kind::StockLevel => stock_level(t, &mut rng, scale, w),
    })
}

/// Runs `txns` transactions of the mix through `session`, each for a random home warehouse,
/// each in its own BEGIN ... COMMIT. A run that fails with 40001 or 40P01 is run again with the
/// same input (at most 100 times); any other failure is recorded in [`Stats::errors`] and the
/// worker goes on. `done` counts finished transactions (shared by all workers of a run).
pub fn run_worker(
    mut session: Session,
    scale: Scale,
    txns: u64,
    seed: u64,
    done: Arc<AtomicU64>,
) -> Stats {
    let mut rng = Rng::new(seed);
    let mut stats = Stats::default();
    for _ in 0..txns {
        let kind = Kind::pick(&mut rng);
        let w = rng.int(1, scale.warehouses);
        let input = rng.next_u64();
        let mut tries = 0;
        loop {
            match run_once(&mut session, kind, scale, w, input) {
                Ok(o) => {
                    if o.rolled_back {
                        stats.rolled_back += 1;
                    } else {
                        let k = Kind::ALL.iter().position(|x| *x == kind).unwrap();
                        stats.committed[k] += 1;
                        match kind {
                            Kind::NewOrder if o.remote => stats.remote_new_orders += 1,
                            Kind::Payment if o.remote => stats.remote_payments += 1,
                            _ => {}
                        }
                        stats.skipped_deliveries += o.skipped;
                    }
                    break;
                }
                Err(e) if e.retryable() && tries < 100 => {
                    tries += 1;
                    let code = e
                        .err
                        .code()
                        .map(|c| c.code().to_string())
                        .unwrap_or_default();
                    *stats.retries.entry(code).or_default() += 1;
                }
                Err(e) => {
                    stats.errors.push(format!("{kind:?}: {e}"));
                    break;
                }
            }
        }
        done.fetch_add(1, Ordering::Relaxed);
    }
    stats
}

// ---------------------------------------------------------------------------------------------
// Consistency (clause 3.3.2)

/// Rows of `sql` keyed by their first `key_cols` integer columns, the rest as rows.
fn keyed(db: &mut Client, sql: &str, key_cols: usize) -> BTreeMap<Vec<i64>, Row> {
    db.query(sql, &[])
        .unwrap_or_else(|e| panic!("{sql}: {e}"))
        .iter()
        .map(Row::from_binary)
        .map(|r| ((0..key_cols).map(|i| r.int(i)).collect(), r))
        .collect()
}

/// Conditions 1 to 4 of clause 3.3.2, read through `db`: every divergence, naming the
/// warehouse or district and the numbers. Empty when they hold.
///
/// 1. W_YTD = sum(D_YTD) per warehouse.
/// 2. D_NEXT_O_ID - 1 = max(O_ID) = max(NO_O_ID) per district.
/// 3. max(NO_O_ID) - min(NO_O_ID) + 1 = the number of NEW-ORDER rows per district.
/// 4. sum(O_OL_CNT) = the number of ORDER-LINE rows per district.
///
/// A district whose new_order rows have all been delivered has no max(NO_O_ID): conditions 2
/// and 3 are then checked on ORDERS alone.
pub fn consistency_violations(db: &mut Client, scale: Scale) -> Vec<String> {
    let mut out = Vec::new();
    let w_ytd = keyed(db, "SELECT w_id, w_ytd FROM warehouse", 1);
    let d_ytd = keyed(
        db,
        "SELECT d_w_id, sum(d_ytd) FROM district GROUP BY d_w_id",
        1,
    );
    let dist = keyed(db, "SELECT d_w_id, d_id, d_next_o_id FROM district", 2);
    let ord = keyed(
        db,
        "SELECT o_w_id, o_d_id, max(o_id), sum(o_ol_cnt), count(*) FROM orders GROUP BY o_w_id, o_d_id",
        2,
    );
    let no = keyed(
        db,
        "SELECT no_w_id, no_d_id, max(no_o_id), min(no_o_id), count(*) FROM new_order GROUP BY no_w_id, no_d_id",
        2,
    );
    let ol = keyed(
        db,
        "SELECT ol_w_id, ol_d_id, count(*) FROM order_line GROUP BY ol_w_id, ol_d_id",
        2,
    );
    for w in 1..=i64::from(scale.warehouses) {
        let a = w_ytd.get(&vec![w]).map(|r| r.dec(1));
        let b = d_ytd.get(&vec![w]).map(|r| r.dec(1));
        if a.is_none() || a != b {
            out.push(format!(
                "condition 1, warehouse {w}: w_ytd {a:?} but sum(d_ytd) {b:?}"
            ));
        }
        for d in 1..=i64::from(scale.districts) {
            let k = vec![w, d];
            let Some(next) = dist.get(&k).map(|r| r.int(2)) else {
                out.push(format!("district {w}/{d} missing"));
                continue;
            };
            let Some(o) = ord.get(&k) else {
                out.push(format!("district {w}/{d} has no orders"));
                continue;
            };
            let max_o = o.int(2);
            if next - 1 != max_o {
                out.push(format!(
                    "condition 2, district {w}/{d}: d_next_o_id - 1 = {} but max(o_id) = {max_o}",
                    next - 1
                ));
            }
            if let Some(n) = no.get(&k) {
                let (max_no, min_no, count) = (n.int(2), n.int(3), n.int(4));
                if max_no != max_o {
                    out.push(format!(
                        "condition 2, district {w}/{d}: max(o_id) = {max_o} but max(no_o_id) = {max_no}"
                    ));
                }
                if max_no - min_no + 1 != count {
                    out.push(format!(
                        "condition 3, district {w}/{d}: max(no_o_id) - min(no_o_id) + 1 = {} but {count} new_order rows",
                        max_no - min_no + 1
                    ));
                }
            }
            let lines = ol.get(&k).map(|r| r.int(2)).unwrap_or(0);
            if o.int(3) != lines {
                out.push(format!(
                    "condition 4, district {w}/{d}: sum(o_ol_cnt) = {} but {lines} order_line rows",
                    o.int(3)
                ));
            }
        }
    }
    out
}

/// Beyond conditions 1 to 4, what makes a cross-warehouse transaction's halves all-or-nothing
/// visible, read through `db`: every Payment's amount is both in some customer's
/// c_ytd_payment and in history (sum(c_ytd_payment) = sum(h_amount), the loader giving each
/// customer 10.00 and one history row of 10.00), and every line of every NewOrder since the
/// load (o_id above `scale.orders`) is in its supply warehouse's stock (sum(s_ytd) =
/// sum(ol_quantity), sum(s_order_cnt) = their count, sum(s_remote_cnt) = those supplied by
/// another warehouse). Every divergence, with the numbers.
pub fn cross_warehouse_violations(db: &mut Client, scale: Scale) -> Vec<String> {
    let mut one = |sql: &str| -> Row {
        let rows = db.query(sql, &[]).unwrap_or_else(|e| panic!("{sql}: {e}"));
        Row::from_binary(&rows[0])
    };
    let pay = one(
        "SELECT (SELECT sum(c_ytd_payment) FROM customer), (SELECT sum(h_amount) FROM history)",
    );
    let stock = one("SELECT sum(s_ytd), sum(s_order_cnt), sum(s_remote_cnt) FROM stock");
    let lines = one(&format!(
        "SELECT coalesce(sum(ol_quantity), 0), count(*) FROM order_line WHERE ol_o_id > {}",
        scale.orders
    ));
    let remote = one(&format!(
        "SELECT count(*) FROM order_line WHERE ol_o_id > {} AND ol_supply_w_id <> ol_w_id",
        scale.orders
    ));
    let mut out = Vec::new();
    if pay.dec(0) != pay.dec(1) {
        out.push(format!(
            "sum(c_ytd_payment) = {} but sum(h_amount) = {}",
            pay.dec(0),
            pay.dec(1)
        ));
    }
    for (what, a, b) in [
        (
            "sum(s_ytd) vs sum(ol_quantity) of new lines",
            stock.int(0),
            lines.int(0),
        ),
        ("sum(s_order_cnt) vs new lines", stock.int(1), lines.int(1)),
        (
            "sum(s_remote_cnt) vs new remote lines",
            stock.int(2),
            remote.int(0),
        ),
    ] {
        if a != b {
            out.push(format!("{what}: {a} but {b}"));
        }
    }
    out
}

/// Panics (naming every divergence) unless conditions 1 to 4 and
/// [`cross_warehouse_violations`]' sums hold, read through `db`.
pub fn assert_consistent(db: &mut Client, scale: Scale, what: &str) {
    let mut v = consistency_violations(db, scale);
    v.extend(cross_warehouse_violations(db, scale));
    assert!(
        v.is_empty(),
        "{what}: TPC-C consistency violated:\n{}",
        v.join("\n")
    );
}

/// Rows of `orders`, through `db`.
pub fn order_count(db: &mut Client) -> i64 {
    db.query_one("SELECT count(*) FROM orders", &[])
        .expect("count orders")
        .get(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn literals_replace_every_parameter_by_its_number() {
        let sql = "UPDATE t SET a = $1, b = $10, e = $3 WHERE c = $2 AND d = $1";
        let mut params: Vec<P> = (1..=10).map(P::I).collect();
        params[1] = P::T("O'Neil".into());
        params[0] = P::D(Decimal::new(-12_3400, 4));
        params[2] = P::Ts(
            chrono::NaiveDate::from_ymd_opt(2000, 2, 29)
                .and_then(|d| d.and_hms_nano_opt(1, 2, 3, 4_005_006))
                .unwrap(),
        );
        assert_eq!(
            with_literals(sql, &params),
            "UPDATE t SET a = -12.3400, b = 10, e = '2000-02-29 01:02:03.004005' \
             WHERE c = 'O''Neil' AND d = -12.3400"
        );
    }
}
