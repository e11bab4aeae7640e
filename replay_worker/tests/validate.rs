//! MOCC dual execution on the destination (`Validate` / `Resolve` and stream-committed shadows),
//! against real PostgreSQL 15 servers that each test starts itself (the throwaway servers of
//! `remus_test_support::pg`), with
//! `track_commit_timestamp` and prepared transactions enabled.

use std::time::Duration;

use remus_proto::v1::replay_worker_client::ReplayWorkerClient;
use remus_proto::v1::{
    apply_request, column_value, row_change, ApplyFinish, ApplyProgress, ApplyRequest, ApplyStart,
    ColumnValue, ResolveRequest, RowChange, ShadowTxn, ValidateReply, ValidateRequest,
};
use replay_worker::ReplayWorkerService;
use tokio::sync::mpsc;
use tokio_postgres::NoTls;
use tokio_stream::wrappers::{ReceiverStream, TcpListenerStream};
use tonic::transport::Channel;
use tonic::{Code, Streaming};

use remus_test_support::pg::PgServer;
use remus_test_support::ports::PortBlock;

/// The service's stream wait in these tests (production default 30 s).
const STREAM_WAIT: Duration = Duration::from_secs(3);
const START_LSN: u64 = 0x100_0000;
/// 2024-01-01 00:00:00 UTC, microseconds since 2000-01-01.
const T0_US: i64 = 757_382_400_000_000;

fn start_pg() -> PgServer {
    PgServer::start_with(
        "-c max_replication_slots=40 -c max_connections=60 -c track_commit_timestamp=on \
         -c max_prepared_transactions=20",
        "validate-pg-",
    )
}

async fn client(dst: &PgServer) -> tokio_postgres::Client {
    let (client, conn) = tokio_postgres::connect(&dst.conninfo(), NoTls)
        .await
        .expect("connect");
    tokio::spawn(async move {
        let _ = conn.await;
    });
    client
}

/// First column of the first row, as text ("" for NULL or no row).
async fn query_one(c: &tokio_postgres::Client, sql: &str) -> String {
    for m in c
        .simple_query(sql)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e:?}"))
    {
        if let tokio_postgres::SimpleQueryMessage::Row(r) = m {
            return r.get(0).unwrap_or("").to_string();
        }
    }
    String::new()
}

async fn dump(c: &tokio_postgres::Client) -> String {
    query_one(
        c,
        "SELECT coalesce(string_agg(id || ':' || v, ',' ORDER BY id), '') FROM a",
    )
    .await
}

async fn prepared(c: &tokio_postgres::Client) -> String {
    query_one(
        c,
        "SELECT coalesce(string_agg(gid, ',' ORDER BY gid), '') FROM pg_prepared_xacts",
    )
    .await
}

/// Commit time (µs since 2000-01-01) and origin name of row `id`'s latest version.
async fn version_of(c: &tokio_postgres::Client, id: i64) -> (String, String) {
    let ts = query_one(
        c,
        &format!(
            "SELECT (extract(epoch FROM pg_xact_commit_timestamp(xmin) - timestamptz '2000-01-01 00:00:00+00') \
             * 1000000)::bigint FROM a WHERE id = {id}"
        ),
    )
    .await;
    let origin = query_one(
        c,
        &format!(
            "SELECT coalesce(o.roname, 'roident ' || x.roident) FROM a t, pg_xact_commit_timestamp_origin(t.xmin) x \
             LEFT JOIN pg_replication_origin o ON o.roident = x.roident WHERE t.id = {id}"
        ),
    )
    .await;
    (ts, origin)
}

fn text(s: impl ToString) -> ColumnValue {
    ColumnValue {
        value: Some(column_value::Value::Text(s.to_string())),
    }
}

fn rc(kind: row_change::Kind) -> RowChange {
    RowChange {
        kind: kind as i32,
        schema: "public".into(),
        table: "a".into(),
        columns: vec!["id".into(), "v".into()],
        key: vec![true, false],
        ..RowChange::default()
    }
}
fn ins(id: i64, v: &str) -> RowChange {
    RowChange {
        new_values: vec![text(id), text(v)],
        ..rc(row_change::Kind::Insert)
    }
}
fn upd(id: i64, v: &str) -> RowChange {
    RowChange {
        new_values: vec![text(id), text(v)],
        ..rc(row_change::Kind::Update)
    }
}
fn del(id: i64) -> RowChange {
    RowChange {
        old_values: vec![
            text(id),
            ColumnValue {
                value: Some(column_value::Value::Null(true)),
            },
        ],
        ..rc(row_change::Kind::Delete)
    }
}

/// The `i`-th transaction (from 0) of a test stream.
fn stxn(i: u64, changes: Vec<RowChange>) -> ShadowTxn {
    let commit_lsn = START_LSN + (i + 1) * 0x100;
    ShadowTxn {
        xid: 1000 + i as u32,
        commit_lsn,
        end_lsn: commit_lsn + 0x30,
        commit_time_us: T0_US + i as i64 * 1_000,
        changes,
        shadow_gid: String::new(),
    }
}

fn gid(migration_id: u64, xid: u64) -> String {
    format!("remus:{migration_id}:{xid}")
}

async fn start_service() -> ReplayWorkerClient<Channel> {
    let port = PortBlock::reserve().keep_for_process();
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", port))
        .await
        .unwrap();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(
                ReplayWorkerService::new()
                    .with_stream_wait(STREAM_WAIT)
                    .into_server(),
            )
            .serve_with_incoming(TcpListenerStream::new(listener)),
    );
    ReplayWorkerClient::connect(format!("http://127.0.0.1:{port}"))
        .await
        .unwrap()
}

/// A running Apply call the test feeds by hand.
struct ApplyCall {
    tx: mpsc::Sender<ApplyRequest>,
    progress: Streaming<ApplyProgress>,
    applied: u64,
}

impl ApplyCall {
    async fn start(
        client: &ReplayWorkerClient<Channel>,
        dst: &PgServer,
        migration_id: u64,
    ) -> ApplyCall {
        let (tx, rx) = mpsc::channel(64);
        tx.send(ApplyRequest {
            msg: Some(apply_request::Msg::Start(ApplyStart {
                migration_id,
                destination_conninfo: dst.conninfo(),
                parallelism: 2,
                start_lsn: START_LSN,
                // As the coordinator asks in Remus mode: every test validates with sessions
                // opened ahead in the pool, and its finish closes them.
                validation_sessions: 3,
            })),
        })
        .await
        .unwrap();
        // The call is registered for Validate/Resolve before its response headers are sent.
        let progress = client
            .clone()
            .apply(ReceiverStream::new(rx))
            .await
            .expect("apply call")
            .into_inner();
        ApplyCall {
            tx,
            progress,
            applied: START_LSN,
        }
    }

    async fn send(&self, txn: ShadowTxn) {
        self.tx
            .send(ApplyRequest {
                msg: Some(apply_request::Msg::Txn(txn)),
            })
            .await
            .unwrap();
    }

    /// Waits until the call reports an applied position >= `lsn`.
    async fn applied(&mut self, lsn: u64) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        while self.applied < lsn {
            let msg = tokio::time::timeout_at(deadline, self.progress.message())
                .await
                .unwrap_or_else(|_| {
                    panic!(
                        "applied position stuck at {:#X}, waiting for {lsn:#X}",
                        self.applied
                    )
                });
            self.applied = msg
                .expect("apply call failed")
                .expect("apply call ended")
                .applied_lsn;
        }
    }

    async fn finish(mut self) {
        self.tx
            .send(ApplyRequest {
                msg: Some(apply_request::Msg::Finish(ApplyFinish {})),
            })
            .await
            .unwrap();
        while let Some(p) = self.progress.message().await.expect("finish") {
            self.applied = p.applied_lsn;
        }
    }
}

async fn validate(
    client: &ReplayWorkerClient<Channel>,
    migration_id: u64,
    gid: &str,
    wait_lsn: u64,
    changes: Vec<RowChange>,
    lock_timeout_ms: u32,
) -> Result<ValidateReply, tonic::Status> {
    client
        .clone()
        .validate(tokio_stream::iter([ValidateRequest {
            migration_id,
            gid: gid.into(),
            wait_lsn,
            changes,
            lock_timeout_ms,
        }]))
        .await
        .map(|r| r.into_inner())
}

async fn resolve(
    client: &ReplayWorkerClient<Channel>,
    migration_id: u64,
    gid: &str,
    commit: bool,
    commit_time_us: i64,
) -> Result<bool, tonic::Status> {
    client
        .clone()
        .resolve(ResolveRequest {
            migration_id,
            gid: gid.into(),
            commit,
            commit_time_us,
            commit_lsn: 0x2_0000_0000,
        })
        .await
        .map(|r| r.into_inner().found)
}

async fn setup(dst: &PgServer) -> tokio_postgres::Client {
    let c = client(dst).await;
    c.batch_execute("CREATE TABLE a (id int PRIMARY KEY, v text NOT NULL)")
        .await
        .unwrap();
    c
}

/// A destination with table `a`, a service, and an Apply call for migration `m` that has
/// applied one stream transaction inserting `rows` (id, 'stream'); returns its end LSN.
struct Fixture {
    dst: PgServer,
    c: tokio_postgres::Client,
    svc: ReplayWorkerClient<Channel>,
    call: ApplyCall,
    end0: u64,
}

async fn fixture(m: u64, rows: std::ops::RangeInclusive<i64>) -> Fixture {
    let dst = start_pg();
    let c = setup(&dst).await;
    let svc = start_service().await;
    let mut call = ApplyCall::start(&svc, &dst, m).await;
    let t0 = stxn(0, rows.map(|i| ins(i, "stream")).collect());
    let end0 = t0.end_lsn;
    call.send(t0).await;
    call.applied(end0).await;
    Fixture {
        dst,
        c,
        svc,
        call,
        end0,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn validated_shadow_is_prepared_then_committed_with_the_source_time_and_a_remus_origin() {
    let m = 501;
    let Fixture {
        dst: _dst,
        c,
        svc,
        call,
        end0,
    } = fixture(m, 1..=2).await;

    // Rows last written by the stream apply are the shadow's to change: no conflict.
    let g = gid(m, 7001);
    let reply = validate(
        &svc,
        m,
        &g,
        end0,
        vec![upd(1, "shadow"), del(2), ins(3, "new")],
        0,
    )
    .await
    .unwrap();
    assert!(reply.ok, "unexpected conflict: {}", reply.conflict);
    assert_eq!(prepared(&c).await, g);
    assert_eq!(
        dump(&c).await,
        "1:stream,2:stream",
        "nothing visible before the commit"
    );

    let commit_time = T0_US + 123_456_789;
    assert!(resolve(&svc, m, &g, true, commit_time).await.unwrap());
    assert_eq!(prepared(&c).await, "");
    assert_eq!(dump(&c).await, "1:shadow,3:new");
    for id in [1, 3] {
        let (ts, origin) = version_of(&c, id).await;
        assert_eq!(
            ts,
            commit_time.to_string(),
            "row {id} carries the source commit time"
        );
        assert!(
            origin.starts_with(&format!("remus_m{m}_v")),
            "row {id} origin {origin}"
        );
    }

    // Each resolution carries its own source time (the pooled session's origin xact setup is
    // redone and reset for every commit).
    let g2 = gid(m, 7002);
    assert!(
        validate(&svc, m, &g2, end0, vec![upd(3, "again")], 0)
            .await
            .unwrap()
            .ok
    );
    assert!(resolve(&svc, m, &g2, true, commit_time + 5).await.unwrap());
    assert_eq!(version_of(&c, 3).await.0, (commit_time + 5).to_string());

    // Already resolved, or never prepared: found=false, not an error.
    assert!(!resolve(&svc, m, &g, true, commit_time).await.unwrap());
    assert!(!resolve(&svc, m, &gid(m, 424242), false, 0).await.unwrap());
    // A gid of another migration is refused.
    let err = resolve(&svc, m, &gid(m + 1, 1), false, 0)
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");

    call.finish().await;
    assert_eq!(
        query_one(
            &c,
            &format!("SELECT count(*) FROM pg_replication_origin WHERE roname LIKE 'remus_m{m}_%'")
        )
        .await,
        "0",
        "finish drops the apply and validation origins"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn conflicts_refuse_the_shadow_and_leave_nothing_prepared() {
    let m = 502;
    let Fixture {
        dst,
        c,
        svc,
        call,
        end0,
    } = fixture(m, 1..=5).await;

    // Latest version written by a plain destination transaction.
    c.batch_execute("UPDATE a SET v = 'local' WHERE id = 1")
        .await
        .unwrap();
    let r = validate(
        &svc,
        m,
        &gid(m, 1),
        end0,
        vec![upd(4, "ok first"), upd(1, "shadow")],
        0,
    )
    .await
    .unwrap();
    assert!(!r.ok);
    assert!(
        r.conflict
            .contains("changed by a transaction on the destination"),
        "{}",
        r.conflict
    );
    assert_eq!(prepared(&c).await, "");
    assert_eq!(
        query_one(&c, "SELECT v FROM a WHERE id = 4").await,
        "stream",
        "rolled back entirely"
    );

    // Missing row for UPDATE and DELETE.
    let r = validate(&svc, m, &gid(m, 2), end0, vec![upd(99, "x")], 0)
        .await
        .unwrap();
    assert!(
        !r.ok && r.conflict.contains("missing on the destination"),
        "{}",
        r.conflict
    );
    let r = validate(&svc, m, &gid(m, 3), end0, vec![del(98)], 0)
        .await
        .unwrap();
    assert!(
        !r.ok && r.conflict.contains("missing on the destination"),
        "{}",
        r.conflict
    );

    // INSERT of an existing key.
    let r = validate(&svc, m, &gid(m, 4), end0, vec![ins(2, "dup")], 0)
        .await
        .unwrap();
    assert!(
        !r.ok && r.conflict.contains("already exists"),
        "{}",
        r.conflict
    );

    // A destination transaction that updates the row while the shadow waits for its lock: the
    // check sees the version it committed, not the one the shadow first found.
    let local = client(&dst).await;
    local
        .batch_execute("BEGIN; UPDATE a SET v = 'concurrent' WHERE id = 3")
        .await
        .unwrap();
    let waiting = tokio::spawn({
        let svc = svc.clone();
        async move { validate(&svc, m, &gid(m, 5), end0, vec![upd(3, "shadow")], 10_000).await }
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!waiting.is_finished(), "the shadow waits for the row lock");
    local.batch_execute("COMMIT").await.unwrap();
    let r = waiting.await.unwrap().unwrap();
    assert!(
        !r.ok
            && r.conflict
                .contains("changed by a transaction on the destination"),
        "{}",
        r.conflict
    );
    assert_eq!(
        query_one(&c, "SELECT v FROM a WHERE id = 3").await,
        "concurrent"
    );

    // A lock held past lock_timeout.
    local
        .batch_execute("BEGIN; SELECT * FROM a WHERE id = 5 FOR UPDATE")
        .await
        .unwrap();
    let r = validate(&svc, m, &gid(m, 6), end0, vec![upd(5, "shadow")], 200)
        .await
        .unwrap();
    assert!(!r.ok && r.conflict.contains("lock"), "{}", r.conflict);
    local.batch_execute("ROLLBACK").await.unwrap();
    assert_eq!(prepared(&c).await, "");

    // TRUNCATE cannot be validated.
    let truncate = RowChange {
        kind: row_change::Kind::Truncate as i32,
        truncate_tables: vec!["\"public\".\"a\"".into()],
        ..RowChange::default()
    };
    let err = validate(&svc, m, &gid(m, 7), end0, vec![truncate], 0)
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");

    // Resolve(rollback) of a prepared shadow.
    let g = gid(m, 8);
    assert!(
        validate(&svc, m, &g, end0, vec![upd(5, "shadow")], 0)
            .await
            .unwrap()
            .ok
    );
    assert_eq!(prepared(&c).await, g);
    assert!(resolve(&svc, m, &g, false, 0).await.unwrap());
    assert_eq!(prepared(&c).await, "");
    assert_eq!(
        query_one(&c, "SELECT v FROM a WHERE id = 5").await,
        "stream"
    );

    assert_eq!(
        dump(&c).await,
        "1:local,2:stream,3:concurrent,4:stream,5:stream"
    );
    call.finish().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_stream_commits_a_validated_shadow_and_advances() {
    let m = 503;
    let Fixture {
        dst: _dst,
        c,
        svc,
        mut call,
        end0,
    } = fixture(m, 1..=2).await;

    // Validated, not resolved: the stream's copy of the source transaction commits it.
    let g1 = gid(m, 1001);
    assert!(
        validate(&svc, m, &g1, end0, vec![upd(1, "shadow")], 0)
            .await
            .unwrap()
            .ok
    );
    let t1 = ShadowTxn {
        shadow_gid: g1.clone(),
        ..stxn(1, vec![upd(1, "shadow")])
    };
    let (end1, time1) = (t1.end_lsn, t1.commit_time_us);
    // A later source transaction on the same row: scheduled after the shadow's commit.
    let t2 = stxn(2, vec![upd(1, "after"), upd(2, "after")]);
    let end2 = t2.end_lsn;
    call.send(t1).await;
    call.applied(end1).await;
    assert_eq!(prepared(&c).await, "");
    assert_eq!(
        query_one(&c, "SELECT v FROM a WHERE id = 1").await,
        "shadow"
    );
    let (ts, origin) = version_of(&c, 1).await;
    assert_eq!(ts, time1.to_string());
    assert!(
        origin.starts_with(&format!("remus_m{m}_w")),
        "committed by an apply session: {origin}"
    );
    call.send(t2).await;
    call.applied(end2).await;
    assert_eq!(dump(&c).await, "1:after,2:after");

    // Resolved first (the source's post-commit call won the race): the stream's copy is a no-op
    // that still counts as applied.
    let g3 = gid(m, 1003);
    assert!(
        validate(&svc, m, &g3, end2, vec![ins(3, "shadow")], 0)
            .await
            .unwrap()
            .ok
    );
    let t3 = ShadowTxn {
        shadow_gid: g3.clone(),
        ..stxn(3, vec![ins(3, "shadow")])
    };
    let (end3, time3) = (t3.end_lsn, t3.commit_time_us);
    assert!(resolve(&svc, m, &g3, true, time3).await.unwrap());
    call.send(t3).await;
    call.applied(end3).await;
    assert_eq!(dump(&c).await, "1:after,2:after,3:shadow");
    assert_eq!(version_of(&c, 3).await.0, time3.to_string());
    assert_eq!(prepared(&c).await, "");

    call.finish().await;
    assert_eq!(call_applied_after_finish(&c, m).await, "0");
}

async fn call_applied_after_finish(c: &tokio_postgres::Client, m: u64) -> String {
    query_one(
        c,
        &format!("SELECT count(*) FROM pg_replication_origin WHERE roname LIKE 'remus_m{m}_%'"),
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn validate_waits_for_the_stream_and_needs_a_running_apply_call() {
    let dst = start_pg();
    let c = setup(&dst).await;
    let svc = start_service().await;
    let m = 504;

    // No Apply call for the migration.
    let err = validate(&svc, m, &gid(m, 1), 0, vec![ins(1, "x")], 0)
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    let err = resolve(&svc, m, &gid(m, 1), true, 0).await.unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");

    let mut call = ApplyCall::start(&svc, &dst, m).await;
    // Answers only once the stream has applied everything up to wait_lsn.
    let t0 = stxn(0, vec![ins(1, "stream")]);
    let end0 = t0.end_lsn;
    let waiting = tokio::spawn({
        let svc = svc.clone();
        async move { validate(&svc, m, &gid(m, 2), end0, vec![upd(1, "shadow")], 0).await }
    });
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert!(
        !waiting.is_finished(),
        "validation ran before the stream reached wait_lsn"
    );
    call.send(t0).await;
    let r = waiting.await.unwrap().unwrap();
    assert!(r.ok, "{}", r.conflict);
    assert!(resolve(&svc, m, &gid(m, 2), true, T0_US).await.unwrap());
    call.applied(end0).await;
    assert_eq!(dump(&c).await, "1:shadow");

    // The stream does not get there in time.
    let err = validate(&svc, m, &gid(m, 3), end0 + 0x1000, vec![upd(1, "late")], 0)
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::DeadlineExceeded, "{err:?}");

    // The Apply call ends (request stream closed without finish) while a validation waits.
    let waiting = tokio::spawn({
        let svc = svc.clone();
        async move { validate(&svc, m, &gid(m, 4), end0 + 0x1000, vec![upd(1, "late")], 0).await }
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    drop(call.tx);
    let err = waiting.await.unwrap().unwrap_err();
    assert_eq!(err.code(), Code::Unavailable, "{err:?}");
    assert_eq!(prepared(&c).await, "");

    // Unregistered once the call has ended.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let err = validate(&svc, m, &gid(m, 5), 0, vec![upd(1, "x")], 0)
            .await
            .unwrap_err();
        if err.code() == Code::FailedPrecondition {
            break;
        }
        assert_eq!(err.code(), Code::Unavailable, "{err:?}");
        assert!(tokio::time::Instant::now() < deadline, "still registered");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(dump(&c).await, "1:shadow");
}

/// An Apply call that asks for validation sessions ahead (`validation_sessions`, Remus mode)
/// has them open on the destination, each on an origin of its own, before any validation
/// arrives; a validation then takes one of them (no new session); the call's finish closes
/// them and drops their origins.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn validation_sessions_are_opened_ahead_and_closed_at_finish() {
    let m = 561;
    let Fixture {
        dst: _dst,
        c,
        svc,
        call,
        end0,
    } = fixture(m, 1..=2).await;
    let sessions = format!(
        "SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE 'remus-validate m{m} %'"
    );
    wait_for_answer(
        &c,
        &sessions,
        "3",
        "the three sessions asked for were not opened ahead",
    )
    .await;
    let g = gid(m, 7101);
    // A position the stream has passed, as the barrier's sync point is (decision 0036).
    let verdict = validate(&svc, m, &g, end0, vec![upd(1, "validated")], 0)
        .await
        .unwrap();
    assert!(verdict.ok, "{verdict:?}");
    assert!(resolve(&svc, m, &g, true, 0).await.unwrap());
    assert_eq!(
        query_one(&c, &sessions).await,
        "3",
        "no session opened on demand"
    );
    call.finish().await;
    // A closed session's backend exits a moment after its connection.
    wait_for_answer(&c, &sessions, "0", "finish closes them").await;
    assert_eq!(
        query_one(
            &c,
            &format!("SELECT count(*) FROM pg_replication_origin WHERE roname LIKE 'remus_m{m}_%'")
        )
        .await,
        "0",
        "finish drops their origins"
    );
}

/// Polls `sql` until it answers `want`; fails with `what` after a minute.
async fn wait_for_answer(c: &tokio_postgres::Client, sql: &str, want: &str, what: &str) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while query_one(c, sql).await != want {
        assert!(tokio::time::Instant::now() < deadline, "{what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
