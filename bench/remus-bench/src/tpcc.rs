//! TPC-C: the tests' schema, loader and consistency conditions (`integration::tpcc`, run over
//! a blocking client), and the five transactions over tokio-postgres with per-transaction
//! timing. The statements are BenchBase's, as in the tests: the router takes them unchanged.
//!
//! Remote transactions: `remote_pct` percent of NewOrders take one line (of 5 to 15) from
//! another warehouse's stock, and `remote_pct` percent of Payments pay a customer of another
//! warehouse (the spec has 1% per line, about 10% of orders, and 15% of Payments).

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result};
use chrono::Utc;
use integration::tpcc::{last_name, Kind, Rng, Scale, NAMES};
use rust_decimal::Decimal;
use tokio_postgres::error::SqlState;
use tokio_postgres::types::ToSql;
use tokio_postgres::{Client, Row, Statement, Transaction};

use crate::run::{connect, Counters, RunCtx};
use crate::series::{class_of, Event, Outcome};

/// The tables in an order they can be dropped.
const TABLES: [&str; 9] = [
    "order_line",
    "new_order",
    "orders",
    "history",
    "customer",
    "district",
    "stock",
    "warehouse",
    "item",
];

/// The loader's shape for `warehouses` with `customers` customers (and as many initial orders)
/// per district, 30% of them undelivered.
pub fn scale(warehouses: i32, customers: i32, items: i32) -> Scale {
    Scale {
        warehouses,
        districts: 10,
        customers,
        items,
        orders: customers,
        new_orders: (customers * 3 / 10).max(1),
    }
}

/// Drops the tables, creates and distributes them over `shards` shards, fills them through
/// `conninfo` (a blocking client on its own thread).
pub async fn load(conninfo: String, s: Scale, shards: u32, seed: u64) -> Result<()> {
    blocking(move || {
        let mut db = postgres::Client::connect(&conninfo, postgres::NoTls)?;
        for t in TABLES {
            db.batch_execute(&format!("DROP TABLE IF EXISTS {t}"))
                .with_context(|| format!("dropping {t}"))?;
        }
        db.batch_execute(integration::tpcc::SCHEMA)?;
        db.batch_execute(&format!(
            "SELECT remus_create_distributed_table('warehouse', 'w_id', {shards})"
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
                "SELECT remus_create_distributed_table('{table}', '{key}', {shards}, \
                 colocate_with => 'warehouse')"
            ))?;
        }
        db.batch_execute("SELECT remus_create_reference_table('item')")?;
        integration::tpcc::load(&mut db, s, seed).context("TPC-C load")?;
        Ok(())
    })
    .await
}

/// The loaded scale, read back: warehouses 1..=W, districts and customers of warehouse 1.
pub async fn read_scale(db: &Client) -> Result<Scale> {
    let n = |sql: &'static str| async move {
        let v: i64 = db.query_one(sql, &[]).await.context(sql)?.get(0);
        anyhow::Ok(v as i32)
    };
    let w = n("SELECT count(*) FROM warehouse").await?;
    let d = n("SELECT count(*) FROM district WHERE d_w_id = 1").await?;
    let c = n("SELECT count(*) FROM customer WHERE c_w_id = 1 AND c_d_id = 1").await?;
    let i = n("SELECT count(*) FROM item").await?;
    anyhow::ensure!(
        w > 0 && d > 0 && c > 0 && i > 0,
        "TPC-C is not loaded (remus-bench load tpcc)"
    );
    Ok(Scale {
        districts: d,
        ..scale(w, c, i)
    })
}

/// Conditions 1 to 4 of clause 3.3.2 and the cross-warehouse sums (`integration::tpcc`),
/// read through `conninfo`: every divergence.
pub async fn violations(conninfo: String, s: Scale) -> Result<Vec<String>> {
    blocking(move || {
        let mut db = postgres::Client::connect(&conninfo, postgres::NoTls)?;
        let mut v = integration::tpcc::consistency_violations(&mut db, s);
        v.extend(integration::tpcc::cross_warehouse_violations(&mut db, s));
        Ok(v)
    })
    .await
}

/// Runs `f` on a thread of its own (the blocking `postgres` client runs its own runtime).
async fn blocking<T: Send + 'static>(f: impl FnOnce() -> Result<T> + Send + 'static) -> Result<T> {
    let (tx, rx) = tokio::sync::oneshot::channel();
    std::thread::spawn(move || {
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f))
            .unwrap_or_else(|p| Err(anyhow::anyhow!("panicked: {}", panic_text(&p))));
        let _ = tx.send(r);
    });
    rx.await.context("blocking task vanished")?
}

fn panic_text(p: &Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<String>()
        .cloned()
        .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_default()
}

/// What a client's transactions did, beyond the series.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct TpccStats {
    /// Committed, by [`Kind::ALL`] order.
    pub committed: [u64; 5],
    /// NewOrders rolled back for their unused item (clause 2.4.2.3): successes, not failures.
    pub rolled_back: u64,
    pub remote_new_orders: u64,
    pub remote_payments: u64,
    /// Failures other than 40001 / 40P01, with the error.
    pub errors: Vec<String>,
}

impl TpccStats {
    pub fn add(&mut self, o: &TpccStats) {
        for (a, b) in self.committed.iter_mut().zip(o.committed) {
            *a += b;
        }
        self.rolled_back += o.rolled_back;
        self.remote_new_orders += o.remote_new_orders;
        self.remote_payments += o.remote_payments;
        self.errors.extend(o.errors.iter().cloned());
    }
}

/// Is this transaction remote? `pct` percent of them, with at least two warehouses.
pub fn remote(rng: &mut Rng, s: Scale, pct: u64) -> bool {
    s.warehouses > 1 && rng.percent(pct)
}

/// One client: the mix against its node until the run ends.
pub async fn client(
    ctx: Arc<RunCtx>,
    conninfo: String,
    s: Scale,
    remote_pct: u64,
    seed: u64,
    counters: Arc<Counters>,
) -> (Vec<Event>, TpccStats) {
    let mut rng = Rng::new(seed);
    let mut events = Vec::new();
    let mut stats = TpccStats::default();
    let mut db: Option<Client> = None;
    let mut prepared = HashMap::new();
    while !ctx.over() {
        let kind = Kind::pick(&mut rng);
        let w = rng.int(1, s.warehouses);
        let input = rng.next_u64();
        loop {
            if db.as_ref().is_none_or(Client::is_closed) {
                prepared.clear();
                db = connect(&ctx, &conninfo, &mut events).await;
                if db.is_none() {
                    break;
                }
            }
            let c = db.as_mut().expect("connected");
            let started = Instant::now();
            let r = once(c, &mut prepared, kind, s, w, input, remote_pct).await;
            let latency_us = started.elapsed().as_micros() as u64;
            let at_us = ctx.now_us();
            match r {
                Ok(o) => {
                    events.push(Event {
                        at_us,
                        latency_us,
                        outcome: Outcome::Commit,
                        units: 1,
                    });
                    counters.commits.fetch_add(1, Ordering::Relaxed);
                    if o.rolled_back {
                        stats.rolled_back += 1;
                    } else {
                        let k = Kind::ALL.iter().position(|x| *x == kind).expect("a kind");
                        stats.committed[k] += 1;
                        match kind {
                            Kind::NewOrder if o.remote => stats.remote_new_orders += 1,
                            Kind::Payment if o.remote => stats.remote_payments += 1,
                            _ => {}
                        }
                    }
                    break;
                }
                Err(e) => {
                    counters.aborts.fetch_add(1, Ordering::Relaxed);
                    let retry = matches!(
                        e.code(),
                        Some(c) if *c == SqlState::T_R_SERIALIZATION_FAILURE
                            || *c == SqlState::T_R_DEADLOCK_DETECTED
                    );
                    events.push(Event {
                        at_us,
                        latency_us,
                        outcome: if retry {
                            Outcome::Retried(class_of(&e))
                        } else {
                            Outcome::Failed(class_of(&e))
                        },
                        units: 0,
                    });
                    if !retry {
                        stats
                            .errors
                            .push(format!("{kind:?}: {}", crate::run::describe(&e)));
                        break;
                    }
                    if ctx.over() {
                        break;
                    }
                }
            }
        }
    }
    (events, stats)
}

#[derive(Default)]
struct TxOutcome {
    rolled_back: bool,
    remote: bool,
}

type Prepared = HashMap<&'static str, Statement>;

/// A transaction with its client's prepared statements.
struct Tx<'a> {
    tx: Transaction<'a>,
    prepared: &'a mut Prepared,
}

impl Tx<'_> {
    async fn stmt(&mut self, sql: &'static str) -> Result<Statement, tokio_postgres::Error> {
        if let Some(s) = self.prepared.get(sql) {
            return Ok(s.clone());
        }
        let s = self.tx.prepare(sql).await?;
        self.prepared.insert(sql, s.clone());
        Ok(s)
    }

    async fn query(
        &mut self,
        sql: &'static str,
        p: &[&(dyn ToSql + Sync)],
    ) -> Result<Vec<Row>, tokio_postgres::Error> {
        let s = self.stmt(sql).await?;
        self.tx.query(&s, p).await
    }

    async fn one(
        &mut self,
        sql: &'static str,
        p: &[&(dyn ToSql + Sync)],
    ) -> Result<Option<Row>, tokio_postgres::Error> {
        Ok(self.query(sql, p).await?.into_iter().next())
    }

    async fn exec(
        &mut self,
        sql: &'static str,
        p: &[&(dyn ToSql + Sync)],
    ) -> Result<u64, tokio_postgres::Error> {
        let s = self.stmt(sql).await?;
        self.tx.execute(&s, p).await
    }
}

async fn once(
    c: &mut Client,
    prepared: &mut Prepared,
    kind: Kind,
    s: Scale,
    w: i32,
    seed: u64,
    remote_pct: u64,
) -> Result<TxOutcome, tokio_postgres::Error> {
    let mut rng = Rng::new(seed);
    let mut t = Tx {
        tx: c.transaction().await?,
        prepared,
    };
    let (o, commit) = match kind {
        Kind::NewOrder => new_order(&mut t, &mut rng, s, w, remote_pct).await?,
        Kind::Payment => payment(&mut t, &mut rng, s, w, remote_pct).await?,
        Kind::OrderStatus => order_status(&mut t, &mut rng, s, w).await?,
        Kind::Delivery => delivery(&mut t, &mut rng, s, w).await?,
        Kind::StockLevel => stock_level(&mut t, &mut rng, s, w).await?,
    };
    if commit {
        t.tx.commit().await?;
    } else {
        t.tx.rollback().await?;
    }
    Ok(o)
}

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
const PAY_GET_WHSE: &str = "SELECT w_name FROM warehouse WHERE w_id = $1";
const PAY_UPDATE_DIST: &str =
    "UPDATE district SET d_ytd = d_ytd + $1 WHERE d_w_id = $2 AND d_id = $3";
const PAY_GET_DIST: &str = "SELECT d_name FROM district WHERE d_w_id = $1 AND d_id = $2";
const CUST_BY_ID: &str = "SELECT c_first, c_middle, c_last, c_credit, c_balance FROM customer WHERE c_w_id = $1 AND c_d_id = $2 AND c_id = $3";
const CUST_BY_NAME: &str =
    "SELECT c_id FROM customer WHERE c_w_id = $1 AND c_d_id = $2 AND c_last = $3 ORDER BY c_first";
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
const DLV_SUM_AMOUNT: &str =
    "SELECT sum(ol_amount) FROM order_line WHERE ol_o_id = $1 AND ol_d_id = $2 AND ol_w_id = $3";
const DLV_UPDATE_CUST: &str = "UPDATE customer SET c_balance = c_balance + $1, c_delivery_cnt = c_delivery_cnt + 1 WHERE c_w_id = $2 AND c_d_id = $3 AND c_id = $4";

const SL_GET_DIST: &str = "SELECT d_next_o_id FROM district WHERE d_w_id = $1 AND d_id = $2";
const SL_COUNT_STOCK: &str = "SELECT count(DISTINCT s_i_id) FROM order_line, stock WHERE ol_w_id = $1 AND ol_d_id = $2 AND ol_o_id < $3 AND ol_o_id >= $4 AND s_w_id = $1 AND s_i_id = ol_i_id AND s_quantity < $5";

type TxResult = Result<(TxOutcome, bool), tokio_postgres::Error>;

fn customer_id(rng: &mut Rng, s: Scale) -> i32 {
    rng.nurand(1023, 1, s.customers.into()) as i32
}

/// By last name (60%: the middle one of those with it, by first name) or by id.
async fn find_customer(
    t: &mut Tx<'_>,
    rng: &mut Rng,
    s: Scale,
    w: i32,
    d: i32,
) -> Result<i32, tokio_postgres::Error> {
    if rng.percent(60) {
        let last = last_name(rng.int(0, NAMES - 1));
        let rows = t.query(CUST_BY_NAME, &[&w, &d, &last]).await?;
        if !rows.is_empty() {
            return Ok(rows[(rows.len() - 1) / 2].get(0));
        }
    }
    Ok(customer_id(rng, s))
}

async fn new_order(t: &mut Tx<'_>, rng: &mut Rng, s: Scale, w: i32, remote_pct: u64) -> TxResult {
    let d = rng.int(1, s.districts);
    let c = customer_id(rng, s);
    let n = rng.int(5, 15);
    let is_remote = remote(rng, s, remote_pct);
    let remote_line = rng.int(0, n - 1);
    let mut lines: Vec<(i32, i32, i32)> = (0..n)
        .map(|k| {
            let supply = if is_remote && k == remote_line {
                rng.other_warehouse(w, s.warehouses)
            } else {
                w
            };
            (
                supply,
                rng.nurand(255, 1, s.items.into()) as i32,
                rng.int(1, 10),
            )
        })
        .collect();
    // One lock order on stock; the unused item of a rolled-back order stays the last line.
    lines.sort();
    let rollback = rng.percent(1);
    if rollback {
        lines.last_mut().expect("5 lines at least").1 = s.items + 1;
    }
    let all_local = i32::from(lines.iter().all(|l| l.0 == w));
    t.one(NO_GET_CUST, &[&w, &d, &c]).await?;
    t.one(NO_GET_WHSE, &[&w]).await?;
    let dist = t
        .one(NO_GET_DIST, &[&w, &d])
        .await?
        .expect("district exists");
    let o: i32 = dist.get(0);
    t.exec(NO_UPDATE_DIST, &[&w, &d]).await?;
    let now = Utc::now().naive_utc();
    t.exec(NO_INSERT_ORDER, &[&o, &d, &w, &c, &now, &n, &all_local])
        .await?;
    t.exec(NO_INSERT_NEW_ORDER, &[&o, &d, &w]).await?;
    for (k, &(supply, i, qty)) in lines.iter().enumerate() {
        let Some(item) = t.one(NO_GET_ITEM, &[&i]).await? else {
            return Ok((
                TxOutcome {
                    rolled_back: true,
                    ..TxOutcome::default()
                },
                false,
            ));
        };
        let price: Decimal = item.get(0);
        let stock = t
            .one(NO_GET_STOCK, &[&i, &supply])
            .await?
            .expect("stock row exists");
        let s_qty: i32 = stock.get(0);
        let new_qty = if s_qty - qty >= 10 {
            s_qty - qty
        } else {
            s_qty - qty + 91
        };
        let remote_line = i32::from(supply != w);
        t.exec(
            NO_UPDATE_STOCK,
            &[&new_qty, &qty, &remote_line, &i, &supply],
        )
        .await?;
        let amount = price * Decimal::from(qty);
        let number = k as i32 + 1;
        let dist_info: String = stock.get(1 + d as usize);
        t.exec(
            NO_INSERT_ORDER_LINE,
            &[&o, &d, &w, &number, &i, &supply, &qty, &amount, &dist_info],
        )
        .await?;
    }
    Ok((
        TxOutcome {
            remote: all_local == 0,
            ..TxOutcome::default()
        },
        true,
    ))
}

async fn payment(t: &mut Tx<'_>, rng: &mut Rng, s: Scale, w: i32, remote_pct: u64) -> TxResult {
    let d = rng.int(1, s.districts);
    let is_remote = remote(rng, s, remote_pct);
    let (c_w, c_d) = if is_remote {
        (
            rng.other_warehouse(w, s.warehouses),
            rng.int(1, s.districts),
        )
    } else {
        (w, d)
    };
    let amount = Decimal::new(rng.range(100, 500_000), 2);
    t.exec(PAY_UPDATE_WHSE, &[&amount, &w]).await?;
    let w_name: String = t.one(PAY_GET_WHSE, &[&w]).await?.expect("warehouse").get(0);
    t.exec(PAY_UPDATE_DIST, &[&amount, &w, &d]).await?;
    let d_name: String = t
        .one(PAY_GET_DIST, &[&w, &d])
        .await?
        .expect("district")
        .get(0);
    let c = find_customer(t, rng, s, c_w, c_d).await?;
    let credit: String = t
        .one(CUST_BY_ID, &[&c_w, &c_d, &c])
        .await?
        .expect("customer exists")
        .get(3);
    if credit == "BC" {
        let data: String = t
            .one(PAY_GET_CUST_CDATA, &[&c_w, &c_d, &c])
            .await?
            .expect("customer exists")
            .get(0);
        let mut data = format!("{c} {c_d} {c_w} {d} {w} {amount} | {data}");
        data.truncate(500);
        t.exec(PAY_UPDATE_CUST_BAL_CDATA, &[&amount, &data, &c_w, &c_d, &c])
            .await?;
    } else {
        t.exec(PAY_UPDATE_CUST_BAL, &[&amount, &c_w, &c_d, &c])
            .await?;
    }
    let h_data = format!("{w_name}    {d_name}");
    let now = Utc::now().naive_utc();
    t.exec(
        PAY_INSERT_HIST,
        &[&c_d, &c_w, &c, &d, &w, &now, &amount, &h_data],
    )
    .await?;
    Ok((
        TxOutcome {
            remote: c_w != w,
            ..TxOutcome::default()
        },
        true,
    ))
}

async fn order_status(t: &mut Tx<'_>, rng: &mut Rng, s: Scale, w: i32) -> TxResult {
    let d = rng.int(1, s.districts);
    let c = find_customer(t, rng, s, w, d).await?;
    if let Some(o) = t.one(OS_GET_NEWEST_ORDER, &[&w, &d, &c]).await? {
        let o: i32 = o.get(0);
        t.query(OS_GET_ORDER_LINES, &[&o, &d, &w]).await?;
    }
    Ok((TxOutcome::default(), true))
}

async fn delivery(t: &mut Tx<'_>, rng: &mut Rng, s: Scale, w: i32) -> TxResult {
    let carrier = rng.int(1, 10);
    let now = Utc::now().naive_utc();
    for d in 1..=s.districts {
        let Some(no) = t.one(DLV_GET_ORDER_ID, &[&d, &w]).await? else {
            continue;
        };
        let o: i32 = no.get(0);
        if t.exec(DLV_DELETE_NEW_ORDER, &[&o, &d, &w]).await? == 0 {
            continue; // another Delivery took it
        }
        let c: i32 = t
            .one(DLV_GET_CUST_ID, &[&o, &d, &w])
            .await?
            .expect("the order of a new_order row exists")
            .get(0);
        t.exec(DLV_UPDATE_CARRIER, &[&carrier, &o, &d, &w]).await?;
        t.exec(DLV_UPDATE_DELIVERY_DATE, &[&now, &o, &d, &w])
            .await?;
        let sum: Option<Decimal> = t
            .one(DLV_SUM_AMOUNT, &[&o, &d, &w])
            .await?
            .expect("one row")
            .get(0);
        let sum = sum.unwrap_or(Decimal::ZERO);
        t.exec(DLV_UPDATE_CUST, &[&sum, &w, &d, &c]).await?;
    }
    Ok((TxOutcome::default(), true))
}

async fn stock_level(t: &mut Tx<'_>, rng: &mut Rng, s: Scale, w: i32) -> TxResult {
    let d = rng.int(1, s.districts);
    let threshold = rng.int(10, 20);
    let next: i32 = t
        .one(SL_GET_DIST, &[&w, &d])
        .await?
        .expect("district exists")
        .get(0);
    let low = next - 20;
    t.one(SL_COUNT_STOCK, &[&w, &d, &next, &low, &threshold])
        .await?;
    Ok((TxOutcome::default(), true))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_mix_is_45_43_4_4_4() {
        let mut rng = Rng::new(7);
        let mut n = [0u32; 5];
        let total = 100_000;
        for _ in 0..total {
            let k = Kind::pick(&mut rng);
            n[Kind::ALL.iter().position(|x| *x == k).unwrap()] += 1;
        }
        let pct: Vec<f64> = n
            .iter()
            .map(|&v| f64::from(v) * 100.0 / total as f64)
            .collect();
        for (got, want) in pct.iter().zip([45.0, 43.0, 4.0, 4.0, 4.0]) {
            assert!((got - want).abs() < 0.7, "{pct:?}");
        }
    }

    #[test]
    fn about_ten_percent_are_remote_and_none_with_one_warehouse() {
        let mut rng = Rng::new(8);
        let s = scale(4, 30, 1000);
        let r = (0..100_000).filter(|_| remote(&mut rng, s, 10)).count();
        assert!((9_500..10_500).contains(&r), "{r}");
        let one = scale(1, 30, 1000);
        assert!(!(0..1000).any(|_| remote(&mut rng, one, 10)));
        // The other warehouse is never the home one, and all others are reached.
        let mut seen = [false; 5];
        for _ in 0..1000 {
            let o = rng.other_warehouse(2, 4);
            assert!((1..=4).contains(&o) && o != 2);
            seen[o as usize] = true;
        }
        assert!(seen[1] && seen[3] && seen[4]);
    }

    #[test]
    fn the_loader_scale_keeps_thirty_percent_undelivered() {
        let s = scale(2, 30, 1000);
        assert_eq!((s.orders, s.new_orders, s.districts), (30, 9, 10));
        assert_eq!(scale(1, 1, 10).new_orders, 1);
    }
}
