//! Against real PostgreSQL 15 servers that each test starts itself (`remus_test_support::pg`),
//! stopped with `pg_ctl stop -m immediate` when the test ends.

use std::collections::BTreeSet;
use std::io::Write;
use std::process::{Child, Stdio};
use std::thread;
use std::time::{Duration, Instant, SystemTime};

use wal_propagator::{
    copy_tables, copy_tables_with, Assembled, AssemblerConfig, Change, CommittedTxn, CopyError,
    CopyOptions, Lsn, PgError, PgOutputMessage, ReplicationConnection, ReplicationError,
    ReplicationMessage, TableCopyError, TxnAssembler,
};

use remus_test_support::pg::PgServer;
use remus_test_support::ports::PortBlock;

fn start_pg() -> PgServer {
    PgServer::start_with(
        "-c max_replication_slots=8 -c max_connections=30",
        "walprop-pg-",
    )
}

fn start_two() -> (PgServer, PgServer) {
    let other = thread::spawn(start_pg);
    let first = start_pg();
    (first, other.join().expect("server start"))
}

fn text(v: Option<&wal_propagator::ColumnValue>) -> String {
    v.and_then(|v| v.as_text()).unwrap_or("<none>").to_string()
}

fn key_id(key: Option<Vec<(&wal_propagator::Column, &wal_propagator::ColumnValue)>>) -> i32 {
    let key = key.expect("a key");
    assert_eq!(key.len(), 1, "primary key is one column");
    assert_eq!(key[0].0.name, "id");
    key[0]
        .1
        .as_text()
        .expect("text key")
        .parse()
        .expect("integer key")
}

/// Polls `f` until it returns true or `timeout` passes.
fn eventually(timeout: Duration, mut f: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        if f() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        thread::sleep(Duration::from_millis(100));
    }
}

const SLOT: &str = "remus_test_slot";
const PUBLICATION: &str = "remus_test";

#[test]
fn snapshot_copy_then_stream_exactly_the_later_transactions() {
    let test_start = SystemTime::now();
    let (src, dst) = start_two();
    let schema = "CREATE TABLE t(id int PRIMARY KEY, v text);
                  CREATE TABLE t2(id int PRIMARY KEY, v text);";
    src.psql(&format!(
        "{schema}
         INSERT INTO t SELECT g, 'v' || g FROM generate_series(1, 10000) g;
         INSERT INTO t2 SELECT g, 'w' || g FROM generate_series(1, 500) g;
         CREATE PUBLICATION {PUBLICATION} FOR TABLE t;"
    ));
    dst.psql(schema);

    let mut conn = ReplicationConnection::connect(&src.conninfo()).expect("replication connection");
    let ident = conn.identify_system().expect("IDENTIFY_SYSTEM");
    assert_eq!(ident.dbname.as_deref(), Some("postgres"));
    assert!(ident.xlog_pos.is_valid());

    let snapshot = conn
        .create_slot_exporting_snapshot(SLOT)
        .expect("create slot");
    let consistent_point = snapshot.consistent_point();
    assert!(
        consistent_point >= ident.xlog_pos,
        "{consistent_point} < {}",
        ident.xlog_pos
    );
    assert!(!snapshot.snapshot_name().is_empty());
    assert_eq!(snapshot.slot().output_plugin, "pgoutput");
    assert_eq!(snapshot.slot().slot_name, SLOT);
    assert_eq!(src.slot_names(), SLOT);

    // Writes after the slot: four transactions of 25 inserts, an UPDATE and a DELETE on the
    // published table, and writes to the unpublished t2. Then an end marker for the stream.
    let mut later = String::new();
    for batch in 0..4 {
        let first = 10001 + batch * 25;
        later += &format!(
            "BEGIN; INSERT INTO t SELECT g, 'late' || g FROM generate_series({first}, {}) g; COMMIT;\n",
            first + 24
        );
    }
    later += "UPDATE t SET v = 'updated' WHERE id = 5;
              DELETE FROM t WHERE id = 6;
              INSERT INTO t2 VALUES (501, 'x');
              UPDATE t2 SET v = 'y' WHERE id = 1;
              SELECT pg_logical_emit_message(false, 'test_end', 'done');";
    src.psql(&later);
    assert_eq!(src.psql("SELECT count(*) FROM t"), "10099");

    let stats = copy_tables(
        &src.conninfo(),
        snapshot.snapshot_name(),
        &dst.conninfo(),
        &[
            ("public.t".to_string(), "public.t".to_string()),
            ("public.t2".to_string(), "public.t2".to_string()),
        ],
        2,
    )
    .expect("snapshot copy");
    let slot = snapshot.release();
    assert_eq!(slot.consistent_point, consistent_point);

    assert_eq!(stats.len(), 2);
    assert_eq!(
        (stats[0].table.as_str(), stats[0].rows),
        ("public.t", 10000)
    );
    assert_eq!((stats[1].table.as_str(), stats[1].rows), ("public.t2", 500));
    assert!(stats.iter().all(|s| s.bytes > 0));
    // The destination has exactly the snapshot's rows: none of the later writes.
    assert_eq!(
        dst.psql(
            "SELECT count(*), min(id), max(id), (SELECT v FROM t WHERE id = 5),
                    (SELECT count(*) FROM t WHERE id = 6) FROM t"
        ),
        "10000|1|10000|v5|1"
    );
    assert_eq!(
        dst.psql("SELECT count(*), max(id), (SELECT v FROM t2 WHERE id = 1) FROM t2"),
        "500|500|w1"
    );

    // Stream from the consistent point until the end marker.
    let mut stream = conn
        .start_streaming(SLOT, slot.consistent_point, PUBLICATION)
        .expect("START_REPLICATION");
    let mut assembler = TxnAssembler::new(AssemblerConfig::default());
    let mut txns: Vec<CommittedTxn> = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    'stream: loop {
        assert!(
            Instant::now() < deadline,
            "no end marker; got {} transactions",
            txns.len()
        );
        let Some(msg) = stream.recv(Duration::from_secs(1)).expect("recv") else {
            continue;
        };
        let ReplicationMessage::XLogData(x) = msg else {
            continue;
        };
        let decoded = PgOutputMessage::decode(x.data).expect("pgoutput message");
        match assembler.push(decoded).expect("assembler") {
            Some(Assembled::Txn(txn)) => txns.push(txn),
            Some(Assembled::Message(m)) if m.prefix == "test_end" => {
                assert_eq!(&m.content[..], b"done");
                break 'stream;
            }
            _ => {}
        }
    }

    // PG15 pgoutput suppresses transactions with nothing published (the t2 writes).
    assert_eq!(txns.len(), 6, "{txns:#?}");
    let now = SystemTime::now();
    let mut prev_commit = Lsn::INVALID;
    for txn in &txns {
        assert!(txn.commit_lsn > prev_commit, "commit order");
        prev_commit = txn.commit_lsn;
        assert!(txn.commit_lsn >= consistent_point);
        assert!(txn.end_lsn > txn.commit_lsn);
        assert_eq!(txn.begin_final_lsn, txn.commit_lsn);
        assert!(txn.origin.is_none());
        assert!(!txn.is_remus_marked(1));
        let ts = txn.commit_time().expect("commit timestamp");
        assert!(
            ts >= test_start - Duration::from_secs(5) && ts <= now + Duration::from_secs(5),
            "commit time {ts:?} outside the test run"
        );
        for change in &txn.changes {
            for rel in change.relations() {
                assert_eq!((rel.namespace.as_str(), rel.name.as_str()), ("public", "t"));
            }
        }
    }
    let mut inserted = BTreeSet::new();
    for (batch, txn) in txns[..4].iter().enumerate() {
        assert_eq!(txn.changes.len(), 25);
        for change in &txn.changes {
            let Change::Insert { new, .. } = change else {
                panic!("expected INSERT, got {change:?}");
            };
            let id: i32 = text(new.get(0)).parse().expect("id");
            assert!(
                (10001 + batch as i32 * 25..10026 + batch as i32 * 25).contains(&id),
                "id {id} in batch {batch}"
            );
            assert_eq!(text(new.get(1)), format!("late{id}"));
            assert!(inserted.insert(id), "id {id} twice");
        }
    }
    assert_eq!(inserted, (10001..=10100).collect::<BTreeSet<i32>>());
    match &txns[4].changes[..] {
        [change @ Change::Update { new, .. }] => {
            assert_eq!(key_id(change.old_key()), 5);
            assert_eq!(text(new.get(1)), "updated");
        }
        other => panic!("expected one UPDATE, got {other:?}"),
    }
    match &txns[5].changes[..] {
        [change @ Change::Delete { .. }] => assert_eq!(key_id(change.old_key()), 6),
        other => panic!("expected one DELETE, got {other:?}"),
    }

    // Feedback advances the slot's confirmed_flush_lsn.
    let confirmed = || -> Lsn {
        src.psql(&format!(
            "SELECT confirmed_flush_lsn FROM pg_replication_slots WHERE slot_name = '{SLOT}'"
        ))
        .parse()
        .expect("confirmed_flush_lsn")
    };
    let before = confirmed();
    let applied = txns.last().expect("transactions").end_lsn;
    assert!(
        before < applied,
        "slot already confirmed {before} before feedback"
    );
    stream
        .send_feedback(applied, applied, applied)
        .expect("feedback");
    assert_eq!(stream.feedback(), (applied, applied, applied));
    let mut seen = before;
    let advanced = eventually(Duration::from_secs(15), || {
        // Keep reading so keepalives are answered while we wait.
        stream.recv(Duration::from_millis(100)).expect("recv");
        seen = confirmed();
        seen >= applied
    });
    assert!(
        advanced,
        "confirmed_flush_lsn stayed at {seen}, expected {applied}"
    );
    assert!(seen > consistent_point);

    // Back to command mode; drop the slot.
    let mut conn = stream.stop().expect("stop streaming");
    conn.drop_slot(SLOT).expect("drop slot");
    assert_eq!(src.slot_names(), "");
    let again = conn.drop_slot(SLOT).expect_err("slot is gone");
    assert_eq!(again.sqlstate(), Some("42704"), "{again}");
}

#[test]
fn copy_errors_are_typed_and_name_the_table() {
    let pg = start_pg();
    pg.psql(
        "CREATE TABLE t(id int PRIMARY KEY, v text);
         INSERT INTO t SELECT g, 'v' || g FROM generate_series(1, 100) g;
         CREATE DATABASE dest;",
    );
    pg.psql_db("dest", "CREATE TABLE t(id int PRIMARY KEY, v text);");
    let (src, dest) = (pg.conninfo(), pg.conninfo_db("dest"));
    let pair = |s: &str, d: &str| (s.to_string(), d.to_string());

    let mut conn = ReplicationConnection::connect(&src).expect("replication connection");
    assert!(matches!(
        conn.create_slot_exporting_snapshot("Bad-Name"),
        Err(ReplicationError::InvalidName { .. })
    ));
    let snapshot = conn
        .create_slot_exporting_snapshot("copy_errors")
        .expect("create slot");

    // A snapshot name the server does not know.
    let err = copy_tables(
        &src,
        "00000003-0000FFFF-1",
        &dest,
        &[pair("public.t", "public.t")],
        1,
    )
    .expect_err("bad snapshot");
    match &err {
        CopyError::Table {
            source_table,
            error: TableCopyError::Source(PgError::Server { error, .. }),
            ..
        } => {
            assert_eq!(source_table, "public.t");
            assert_eq!(error.sqlstate, "22023", "{err}");
            assert!(error.message.contains("snapshot"), "{err}");
        }
        other => panic!("unexpected error {other:?}"),
    }

    // A missing source table fails the whole call, naming it, and commits nothing.
    let err = copy_tables(
        &src,
        snapshot.snapshot_name(),
        &dest,
        &[
            pair("public.t", "public.t"),
            pair("public.missing", "public.t"),
        ],
        2,
    )
    .expect_err("missing source table");
    assert_eq!(err.table(), Some("public.missing"), "{err}");
    assert!(
        matches!(
            &err,
            CopyError::Table {
                error: TableCopyError::Source(_),
                ..
            }
        ),
        "{err:?}"
    );
    assert_eq!(err.sqlstate(), Some("42P01"), "{err}");
    assert_eq!(pg.psql_db("dest", "SELECT count(*) FROM t"), "0");

    // A missing destination table.
    let err = copy_tables(
        &src,
        snapshot.snapshot_name(),
        &dest,
        &[pair("public.t", "public.nope")],
        1,
    )
    .expect_err("missing destination table");
    match &err {
        CopyError::Table {
            source_table,
            dest_table,
            error: TableCopyError::Destination(e),
        } => {
            assert_eq!(
                (source_table.as_str(), dest_table.as_str()),
                ("public.t", "public.nope")
            );
            assert_eq!(e.sqlstate(), Some("42P01"), "{err}");
        }
        other => panic!("unexpected error {other:?}"),
    }
    assert_eq!(pg.psql_db("dest", "SELECT count(*) FROM t"), "0");

    // The exported snapshot is still valid while the guard is held: a good copy works (small
    // chunks, so rows are forwarded in many pieces; setup SQL runs in the destination
    // transaction).
    let options = CopyOptions {
        chunk_bytes: 512,
        dest_setup_sql: Some("SET LOCAL synchronous_commit = off".into()),
        ..CopyOptions::default()
    };
    let stats = copy_tables_with(
        &src,
        snapshot.snapshot_name(),
        &dest,
        &[pair("public.t", "public.t")],
        1,
        &options,
    )
    .expect("good copy");
    assert_eq!(stats[0].rows, 100);
    assert!(stats[0].bytes > 512);
    assert_eq!(
        pg.psql_db(
            "dest",
            "SELECT count(*), sum(id), count(*) FILTER (WHERE v = 'v' || id) FROM t"
        ),
        "100|5050|100"
    );

    // Once released and the connection used again, the snapshot is gone.
    let name = snapshot.snapshot_name().to_string();
    snapshot.release();
    conn.identify_system().expect("IDENTIFY_SYSTEM");
    let err = copy_tables(&src, &name, &dest, &[pair("public.t", "public.t")], 1)
        .expect_err("snapshot no longer exported");
    assert_eq!(err.sqlstate(), Some("22023"), "{err}");
    conn.drop_slot("copy_errors").expect("drop slot");
    assert_eq!(pg.slot_names(), "");
}

/// A session that holds an xid until its stdin is closed.
struct OpenTransaction(Child);

impl Drop for OpenTransaction {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn waits_time_out_and_can_be_cancelled() {
    let pg = start_pg();
    pg.psql(&format!(
        "CREATE TABLE t(id int PRIMARY KEY); CREATE PUBLICATION {PUBLICATION} FOR TABLE t;"
    ));

    // Nothing listens on this port: a typed connect error, not a hang.
    let closed = PortBlock::reserve();
    match ReplicationConnection::connect(&format!(
        "host=127.0.0.1 port={} user=postgres dbname=postgres",
        closed.base()
    )) {
        Err(ReplicationError::Pg(PgError::Connect { .. })) => {}
        Err(other) => panic!("unexpected error {other:?}"),
        Ok(_) => panic!("connected to a closed port"),
    }

    // Slot creation waits for a transaction that holds an xid; the command timeout ends the
    // wait, and the server abandons the slot.
    let mut holder = pg.psql_cmd("postgres");
    let mut holder = OpenTransaction(
        holder
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("psql"),
    );
    let mut stdin = holder.0.stdin.take().expect("stdin");
    stdin
        .write_all(b"BEGIN; INSERT INTO t VALUES (1);\n")
        .expect("write");
    stdin.flush().expect("flush");
    assert!(
        eventually(Duration::from_secs(10), || {
            pg.psql("SELECT count(*) FROM pg_stat_activity WHERE state = 'idle in transaction' AND backend_xid IS NOT NULL") == "1"
        }),
        "the holding transaction did not start"
    );
    let mut conn = ReplicationConnection::connect(&pg.conninfo()).expect("connect");
    conn.set_command_timeout(Duration::from_secs(1));
    let started = Instant::now();
    match conn.create_slot_exporting_snapshot("blocked") {
        Err(ReplicationError::Pg(PgError::Timeout { after, .. })) => {
            assert_eq!(after, Duration::from_secs(1))
        }
        Err(other) => panic!("unexpected error {other:?}"),
        Ok(_) => panic!("slot created despite the open transaction"),
    }
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    assert!(matches!(
        conn.identify_system(),
        Err(ReplicationError::Pg(PgError::Broken))
    ));
    drop(conn);
    assert!(
        eventually(Duration::from_secs(10), || pg.slot_names().is_empty()),
        "cancelled slot creation left {}",
        pg.slot_names()
    );
    drop(stdin);
    drop(holder);

    // With the transaction gone creation succeeds; a quiet stream times out with Ok(None)
    // and the cancel token stops a long recv from another thread.
    let mut conn = ReplicationConnection::connect(&pg.conninfo()).expect("connect");
    let slot = conn
        .create_slot_exporting_snapshot("quiet")
        .expect("create slot")
        .release();
    let mut stream = conn
        .start_streaming("quiet", slot.consistent_point, PUBLICATION)
        .expect("START_REPLICATION");
    let mut quiet = false;
    for _ in 0..10 {
        let t = Instant::now();
        if stream
            .recv(Duration::from_millis(300))
            .expect("recv")
            .is_none()
        {
            assert!(t.elapsed() >= Duration::from_millis(300));
            quiet = true;
            break;
        }
    }
    assert!(quiet, "the stream never went quiet");
    let token = stream.cancel_token();
    let canceller = thread::spawn(move || {
        thread::sleep(Duration::from_millis(300));
        token.cancel();
    });
    let t = Instant::now();
    let err = loop {
        match stream.recv(Duration::from_secs(60)) {
            Ok(_) => continue,
            Err(e) => break e,
        }
    };
    canceller.join().expect("canceller");
    assert!(
        matches!(err, ReplicationError::Pg(PgError::Cancelled { .. })),
        "{err:?}"
    );
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    drop(stream);

    // DROP_REPLICATION_SLOT ... WAIT copes with the old walsender still exiting.
    let mut conn = ReplicationConnection::connect(&pg.conninfo()).expect("connect");
    conn.drop_slot("quiet").expect("drop slot");
    assert_eq!(pg.slot_names(), "");
}

/// A table of several `split_bytes` is copied in block ranges by several sessions under one
/// snapshot: exactly the snapshot's rows arrive (not the updates, deletes and inserts committed
/// after it, which put row versions in new blocks), generated and dropped columns are handled
/// as `COPY <table>` handles them, and the indexes dropped before the rows are all there again
/// afterwards. A small table in the same call is copied whole.
#[test]
fn a_large_table_is_copied_in_block_ranges_by_several_sessions() {
    let pg = start_pg();
    let schema = "CREATE TABLE big(id int PRIMARY KEY, gone int, pad text NOT NULL,
                      doubled int GENERATED ALWAYS AS (id * 2) STORED, v text UNIQUE);
                  ALTER TABLE big DROP COLUMN gone;
                  CREATE INDEX big_doubled ON big (doubled);
                  CREATE TABLE small(id int PRIMARY KEY, v text);";
    pg.psql(&format!(
        "{schema}
         INSERT INTO big (id, pad, v) SELECT g, repeat(md5(g::text), 4), 'v' || g
           FROM generate_series(1, 30000) g;
         INSERT INTO small SELECT g, 'w' || g FROM generate_series(1, 50) g;
         CREATE DATABASE dest;"
    ));
    // The destination's `big` has no dropped column: binary COPY carries the live,
    // non-generated columns only.
    pg.psql_db(
        "dest",
        "CREATE TABLE big(id int PRIMARY KEY, pad text NOT NULL,
             doubled int GENERATED ALWAYS AS (id * 2) STORED, v text UNIQUE);
         CREATE INDEX big_doubled ON big (doubled);
         CREATE TABLE small(id int PRIMARY KEY, v text);",
    );
    let digest = "SELECT count(*), sum(id), md5(string_agg(id || pad || v || doubled, ',' ORDER BY id)) FROM big";
    let indexes = "SELECT string_agg(indexrelid::regclass || ' ' || indisvalid, ', ' ORDER BY 1)
                     FROM pg_index WHERE indrelid = 'big'::regclass";
    let at_snapshot = pg.psql(digest);
    let dest_indexes = pg.psql_db("dest", indexes);
    assert_eq!(dest_indexes.matches("true").count(), 3, "{dest_indexes}");
    let size: u64 = pg
        .psql("SELECT pg_relation_size('big')")
        .parse()
        .expect("size");
    assert!(size > 3 * 1024 * 1024, "big is {size} bytes");

    let (src, dest) = (pg.conninfo(), pg.conninfo_db("dest"));
    let mut conn = ReplicationConnection::connect(&src).expect("replication connection");
    let snapshot = conn
        .create_slot_exporting_snapshot("split_copy")
        .expect("create slot");
    pg.psql(
        "UPDATE big SET pad = 'later' WHERE id % 3 = 0;
         DELETE FROM big WHERE id % 7 = 0;
         INSERT INTO big (id, pad, v) SELECT g, 'new', 'v' || g FROM generate_series(30001, 31000) g;",
    );
    assert_ne!(pg.psql(digest), at_snapshot);

    let options = CopyOptions {
        split_bytes: 1024 * 1024,
        ..CopyOptions::default()
    };
    let pairs = [
        ("public.big".to_string(), "public.big".to_string()),
        ("public.small".to_string(), "public.small".to_string()),
    ];
    let stats = copy_tables_with(&src, snapshot.snapshot_name(), &dest, &pairs, 3, &options)
        .expect("split copy");
    snapshot.release();
    conn.drop_slot("split_copy").expect("drop slot");

    assert_eq!((stats[0].rows, stats[0].parts), (30000, 3), "{stats:?}");
    assert_eq!((stats[1].rows, stats[1].parts), (50, 1), "{stats:?}");
    assert_eq!(pg.psql_db("dest", digest), at_snapshot);
    assert_eq!(pg.psql_db("dest", indexes), dest_indexes);
    assert_eq!(
        pg.psql_db(
            "dest",
            "SELECT count(*) FROM pg_constraint WHERE conrelid = 'big'::regclass AND contype IN ('p', 'u')"
        ),
        "2"
    );
    assert_eq!(
        pg.psql_db("dest", "SELECT count(*), sum(id) FROM small"),
        "50|1275"
    );
    // The rebuilt unique index is enforced.
    assert!(pg
        .psql_cmd("dest")
        .arg("-c")
        .arg("INSERT INTO big (id, pad, v) VALUES (99999, 'x', 'v1')")
        .output()
        .map(|o| !o.status.success())
        .expect("psql"));
}
