//! `MigrationStore` against a real etcd: each test starts its own `etcd` (the throwaway etcd of
//! `remus_test_support::etcd`: reserved loopback ports, a temporary data directory), killed when
//! done.

use std::sync::Arc;

use coordinator::migration::{
    MigrationError, MigrationId, MigrationRecord, MigrationStore, Mode, Phase, Status, Transition,
};
use remus_test_support::etcd::Etcd;

const CLUSTER: &str = "test";

/// What these tests need of a throwaway etcd.
trait EtcdExt {
    async fn client(&self) -> etcd_client::Client;
    async fn store(&self) -> MigrationStore;
}

impl EtcdExt for Etcd {
    async fn client(&self) -> etcd_client::Client {
        etcd_client::Client::connect([self.endpoint()], None)
            .await
            .expect("connect to etcd")
    }

    async fn store(&self) -> MigrationStore {
        MigrationStore::new(self.client().await, CLUSTER)
    }
}

const REMUS_STEPS: [Phase; 7] = [
    Phase::Copy,
    Phase::Catchup,
    Phase::Barrier,
    Phase::Dual,
    Phase::Handover,
    Phase::Cleanup,
    Phase::Done,
];

const BASELINE_STEPS: [Phase; 5] = [
    Phase::Copy,
    Phase::Catchup,
    Phase::Handover,
    Phase::Cleanup,
    Phase::Done,
];

fn assert_illegal(result: Result<MigrationRecord, MigrationError>, expected: Transition) {
    match result {
        Err(MigrationError::IllegalTransition { requested, .. }) => assert_eq!(requested, expected),
        other => panic!("expected IllegalTransition for {expected}, got {other:?}"),
    }
}

#[tokio::test]
async fn create_get_list() {
    let etcd = Etcd::start();
    let store = etcd.store().await;
    assert!(store.list().await.unwrap().is_empty());

    let a = store
        .create(&[3, 1, 2], "n1", "n2", Mode::Remus)
        .await
        .unwrap();
    assert_eq!(a.id, MigrationId(1));
    assert_eq!(a.shard_ids, vec![1, 2, 3]);
    assert_eq!(
        (a.phase, a.status, a.mode),
        (Phase::Pending, Status::Running, Mode::Remus)
    );
    assert_eq!((a.source.as_str(), a.target.as_str()), ("n1", "n2"));
    assert_eq!(a.finished_at_ms, None);
    assert!(a.started_at_ms > 0);

    let b = store
        .create(&[10], "n2", "n3", Mode::LockAbort)
        .await
        .unwrap();
    assert_eq!(b.id, MigrationId(2));

    assert_eq!(store.get(a.id).await.unwrap(), a);
    assert_eq!(store.get(b.id).await.unwrap(), b);
    assert!(matches!(
        store.get(MigrationId(99)).await,
        Err(MigrationError::NotFound(MigrationId(99)))
    ));
    assert_eq!(store.list().await.unwrap(), vec![a.clone(), b.clone()]);
    assert_eq!(store.running().await.unwrap(), vec![a.clone(), b.clone()]);
    for shard in [1, 2, 3] {
        assert_eq!(store.lock_holder(shard).await.unwrap(), Some(a.id));
    }
    assert_eq!(store.lock_holder(10).await.unwrap(), Some(b.id));
    assert_eq!(store.lock_holder(4).await.unwrap(), None);

    // The documented key layout.
    let mut kv = etcd.client().await.kv_client();
    let raw = kv.get("/remus/test/migrations/1", None).await.unwrap();
    let json: serde_json::Value = serde_json::from_slice(raw.kvs()[0].value()).unwrap();
    assert_eq!(json["mode"], "remus");
    assert_eq!(json["phase"], "pending");
    let lock = kv.get("/remus/test/shard_locks/2", None).await.unwrap();
    assert_eq!(lock.kvs()[0].value(), b"1");
    let seq = kv.get("/remus/test/migration_seq", None).await.unwrap();
    assert_eq!(seq.kvs()[0].value(), b"2");

    // Ids sort numerically, not as strings: 10 after 9 after 2.
    for shard in 11..=18 {
        store
            .create(&[shard], "n1", "n2", Mode::WaitRemaster)
            .await
            .unwrap();
    }
    let ids: Vec<u64> = store.list().await.unwrap().iter().map(|r| r.id.0).collect();
    assert_eq!(ids, (1..=10).collect::<Vec<_>>());

    // Another cluster's namespace sees none of it.
    let other = MigrationStore::new(etcd.client().await, "other");
    assert!(other.list().await.unwrap().is_empty());
    assert_eq!(other.lock_holder(1).await.unwrap(), None);
}

#[tokio::test]
async fn invalid_create_requests_write_nothing() {
    let etcd = Etcd::start();
    let store = etcd.store().await;
    for (shards, source, target) in [
        (&[][..], "n1", "n2"),
        (&[1, 1][..], "n1", "n2"),
        (&[0][..], "n1", "n2"),
        (&[1][..], "n1", "n1"),
        (&[1][..], "bad-name", "n2"),
    ] {
        let r = store.create(shards, source, target, Mode::Remus).await;
        assert!(
            matches!(r, Err(MigrationError::Invalid(_))),
            "{shards:?}: {r:?}"
        );
    }
    assert!(store.list().await.unwrap().is_empty());
    assert_eq!(store.lock_holder(1).await.unwrap(), None);
}

#[tokio::test]
async fn overlapping_shards_are_busy_and_nothing_is_written() {
    let etcd = Etcd::start();
    let store = etcd.store().await;
    let a = store
        .create(&[1, 2], "n1", "n2", Mode::Remus)
        .await
        .unwrap();

    match store.create(&[3, 2, 4], "n1", "n3", Mode::LockAbort).await {
        Err(MigrationError::ShardBusy {
            shard_id,
            migration,
        }) => {
            assert_eq!((shard_id, migration), (2, a.id));
        }
        other => panic!("expected ShardBusy, got {other:?}"),
    }
    // The lowest busy shard is the one named.
    match store.create(&[2, 1], "n1", "n3", Mode::Remus).await {
        Err(e @ MigrationError::ShardBusy { .. }) => {
            assert_eq!(
                e.to_string(),
                "shard 1 is already being migrated by migration 1"
            );
        }
        other => panic!("expected ShardBusy, got {other:?}"),
    }

    // No partial write: no record, no locks on the free shards, no id consumed.
    assert_eq!(store.list().await.unwrap(), vec![a.clone()]);
    assert_eq!(store.lock_holder(3).await.unwrap(), None);
    assert_eq!(store.lock_holder(4).await.unwrap(), None);
    assert_eq!(store.lock_holder(2).await.unwrap(), Some(a.id));
    let b = store
        .create(&[3, 4], "n1", "n3", Mode::LockAbort)
        .await
        .unwrap();
    assert_eq!(b.id, MigrationId(2));
}

#[tokio::test]
async fn remus_and_baseline_paths_advance_to_done() {
    let etcd = Etcd::start();
    let store = etcd.store().await;

    let cases = [
        (Mode::Remus, &REMUS_STEPS[..], 1),
        (Mode::LockAbort, &BASELINE_STEPS[..], 2),
        (Mode::WaitRemaster, &BASELINE_STEPS[..], 3),
    ];
    for (mode, steps, shard) in cases {
        let created = store.create(&[shard], "n1", "n2", mode).await.unwrap();
        let mut previous = Phase::Pending;
        for (i, step) in steps.iter().enumerate() {
            let r = store
                .advance(created.id, *step, |r| {
                    r.rows_copied += 100;
                    r.txns_replayed += 1;
                    if *step == Phase::Catchup {
                        r.waiting_on = Some("slot creation waits for xid 1234".into());
                    }
                })
                .await
                .unwrap_or_else(|e| panic!("{mode}: {previous} -> {step}: {e}"));
            assert_eq!(r.phase, *step);
            assert_eq!(r.rows_copied, 100 * (i as u64 + 1));
            assert!(
                r.phase_ms.contains_key(previous.as_str()),
                "{mode}: {:?}",
                r.phase_ms
            );
            assert_eq!(store.get(created.id).await.unwrap(), r);
            if *step == Phase::Catchup {
                assert_eq!(
                    r.waiting_on.as_deref(),
                    Some("slot creation waits for xid 1234")
                );
            } else {
                assert_eq!(r.waiting_on, None, "a phase change clears waiting_on");
            }
            if *step == Phase::Done {
                assert_eq!(r.status, Status::Succeeded);
                assert!(r.finished_at_ms.is_some());
                assert_eq!(
                    store.lock_holder(shard).await.unwrap(),
                    None,
                    "success releases the lock"
                );
            } else {
                assert_eq!(r.status, Status::Running);
                assert_eq!(store.lock_holder(shard).await.unwrap(), Some(created.id));
            }
            previous = *step;
        }
        let done = store.get(created.id).await.unwrap();
        let expected_phases: Vec<&str> = std::iter::once(Phase::Pending)
            .chain(steps[..steps.len() - 1].iter().copied())
            .map(Phase::as_str)
            .collect();
        let mut recorded: Vec<&str> = done.phase_ms.keys().map(String::as_str).collect();
        let mut expected_sorted = expected_phases.clone();
        recorded.sort_unstable();
        expected_sorted.sort_unstable();
        assert_eq!(
            recorded, expected_sorted,
            "{mode}: one entry per finished phase"
        );
    }
    assert!(store.running().await.unwrap().is_empty());
}

#[tokio::test]
async fn illegal_transitions_are_refused_and_change_nothing() {
    let etcd = Etcd::start();
    let store = etcd.store().await;
    let remus = store.create(&[1], "n1", "n2", Mode::Remus).await.unwrap();
    let base = store
        .create(&[2], "n1", "n2", Mode::LockAbort)
        .await
        .unwrap();

    // Skipping ahead, standing still.
    assert_illegal(
        store.advance(remus.id, Phase::Catchup, |_| {}).await,
        Transition::Advance(Phase::Catchup),
    );
    assert_illegal(
        store.advance(remus.id, Phase::Pending, |_| {}).await,
        Transition::Advance(Phase::Pending),
    );
    assert_eq!(store.get(remus.id).await.unwrap(), remus);

    for id in [remus.id, base.id] {
        store.advance(id, Phase::Copy, |_| {}).await.unwrap();
        store.advance(id, Phase::Catchup, |_| {}).await.unwrap();
    }
    // Remus may not skip the barrier; the baselines have none.
    assert_illegal(
        store.advance(remus.id, Phase::Handover, |_| {}).await,
        Transition::Advance(Phase::Handover),
    );
    assert_illegal(
        store.advance(base.id, Phase::Barrier, |_| {}).await,
        Transition::Advance(Phase::Barrier),
    );
    // Going back.
    assert_illegal(
        store.advance(base.id, Phase::Copy, |_| {}).await,
        Transition::Advance(Phase::Copy),
    );
    // Succeeding before cleanup, or "finishing" as running.
    assert_illegal(
        store.finish(base.id, Status::Succeeded, None).await,
        Transition::Finish(Status::Succeeded),
    );
    assert_illegal(
        store.finish(base.id, Status::Running, None).await,
        Transition::Finish(Status::Running),
    );
    // An update may not move the phase behind the store's back.
    let r = store.update(base.id, |r| r.phase = Phase::Done).await;
    assert!(matches!(r, Err(MigrationError::Invalid(_))), "{r:?}");
    let r = store
        .advance(base.id, Phase::Handover, |r| r.status = Status::Failed)
        .await;
    assert!(matches!(r, Err(MigrationError::Invalid(_))), "{r:?}");

    let base_now = store.get(base.id).await.unwrap();
    assert_eq!(
        (base_now.phase, base_now.status),
        (Phase::Catchup, Status::Running)
    );
    assert_eq!(store.get(remus.id).await.unwrap().phase, Phase::Catchup);
    assert!(matches!(
        store.advance(MigrationId(42), Phase::Copy, |_| {}).await,
        Err(MigrationError::NotFound(MigrationId(42)))
    ));
}

#[tokio::test]
async fn finish_releases_locks_for_a_new_migration() {
    let etcd = Etcd::start();
    let store = etcd.store().await;
    let a = store
        .create(&[5, 6], "n1", "n2", Mode::Remus)
        .await
        .unwrap();
    store.advance(a.id, Phase::Copy, |_| {}).await.unwrap();
    store
        .update(a.id, |r| {
            r.waiting_on = Some("copy waits for a lock on shard 5".into())
        })
        .await
        .unwrap();

    let failed = store
        .finish(a.id, Status::Failed, Some("target n2 unreachable".into()))
        .await
        .unwrap();
    assert_eq!(failed.status, Status::Failed);
    assert_eq!(
        failed.phase,
        Phase::Copy,
        "a failed migration keeps the phase it failed in"
    );
    assert_eq!(failed.error.as_deref(), Some("target n2 unreachable"));
    assert_eq!(
        failed.waiting_on.as_deref(),
        Some("copy waits for a lock on shard 5")
    );
    assert!(failed.finished_at_ms.is_some());
    assert!(failed.phase_ms.contains_key("copy"));
    assert_eq!(store.get(a.id).await.unwrap(), failed);
    assert_eq!(store.lock_holder(5).await.unwrap(), None);
    assert_eq!(store.lock_holder(6).await.unwrap(), None);
    assert!(store.running().await.unwrap().is_empty());

    let b = store
        .create(&[6, 7], "n1", "n3", Mode::WaitRemaster)
        .await
        .unwrap();
    assert_eq!(store.lock_holder(6).await.unwrap(), Some(b.id));

    // Rolling back from a later phase releases the locks just the same.
    store.advance(b.id, Phase::Copy, |_| {}).await.unwrap();
    store.advance(b.id, Phase::Catchup, |_| {}).await.unwrap();
    store.advance(b.id, Phase::Handover, |_| {}).await.unwrap();
    let rolled = store
        .finish(b.id, Status::RolledBack, Some("handover timed out".into()))
        .await
        .unwrap();
    assert_eq!(
        (rolled.phase, rolled.status),
        (Phase::Handover, Status::RolledBack)
    );
    assert_eq!(store.lock_holder(6).await.unwrap(), None);
    assert_eq!(store.lock_holder(7).await.unwrap(), None);

    // finish(Succeeded) from Cleanup is the same as advancing to Done.
    let c = store
        .create(&[6], "n1", "n2", Mode::LockAbort)
        .await
        .unwrap();
    for step in &BASELINE_STEPS[..BASELINE_STEPS.len() - 1] {
        store.advance(c.id, *step, |_| {}).await.unwrap();
    }
    assert!(matches!(
        store
            .finish(c.id, Status::Succeeded, Some("oops".into()))
            .await,
        Err(MigrationError::Invalid(_))
    ));
    let ok = store.finish(c.id, Status::Succeeded, None).await.unwrap();
    assert_eq!((ok.phase, ok.status), (Phase::Done, Status::Succeeded));
    assert_eq!(store.lock_holder(6).await.unwrap(), None);
    assert_eq!(
        store
            .list()
            .await
            .unwrap()
            .iter()
            .map(|r| r.status)
            .collect::<Vec<_>>(),
        vec![Status::Failed, Status::RolledBack, Status::Succeeded]
    );
}

#[tokio::test]
async fn finish_never_releases_a_lock_held_by_another_migration() {
    let etcd = Etcd::start();
    let store = etcd.store().await;
    let a = store
        .create(&[8, 9], "n1", "n2", Mode::Remus)
        .await
        .unwrap();
    // Simulate an operator handing shard 9 to migration 77 by hand.
    let mut kv = etcd.client().await.kv_client();
    kv.put(store.lock_key(9), "77", None).await.unwrap();
    store.finish(a.id, Status::Failed, None).await.unwrap();
    assert_eq!(store.lock_holder(8).await.unwrap(), None);
    assert_eq!(store.lock_holder(9).await.unwrap(), Some(MigrationId(77)));
}

#[tokio::test]
async fn terminal_records_are_immutable() {
    let etcd = Etcd::start();
    let store = etcd.store().await;
    let a = store.create(&[1], "n1", "n2", Mode::Remus).await.unwrap();
    store.advance(a.id, Phase::Copy, |_| {}).await.unwrap();
    let failed = store
        .finish(a.id, Status::Failed, Some("boom".into()))
        .await
        .unwrap();

    let b = store
        .create(&[2], "n1", "n2", Mode::LockAbort)
        .await
        .unwrap();
    for step in BASELINE_STEPS {
        store.advance(b.id, step, |_| {}).await.unwrap();
    }
    let succeeded = store.get(b.id).await.unwrap();
    assert_eq!(succeeded.status, Status::Succeeded);

    for (record, next) in [(&failed, Phase::Catchup), (&succeeded, Phase::Pending)] {
        let id = record.id;
        assert_illegal(
            store.advance(id, next, |_| {}).await,
            Transition::Advance(next),
        );
        for status in Status::ALL {
            assert_illegal(
                store.finish(id, *status, None).await,
                Transition::Finish(*status),
            );
        }
        assert_illegal(
            store.update(id, |r| r.rows_copied += 1).await,
            Transition::Update,
        );
        assert_eq!(
            &store.get(id).await.unwrap(),
            record,
            "terminal record {id} changed"
        );
    }
    // Still terminal: no lock came back.
    assert_eq!(store.lock_holder(1).await.unwrap(), None);
    assert_eq!(store.lock_holder(2).await.unwrap(), None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_advance_exactly_one_wins_each_step() {
    let etcd = Etcd::start();
    // Two independent clients, as two coordinator replicas would have.
    let s1 = Arc::new(etcd.store().await);
    let s2 = Arc::new(etcd.store().await);
    let id = s1
        .create(&[1, 2, 3], "n1", "n2", Mode::Remus)
        .await
        .unwrap()
        .id;

    for (i, step) in REMUS_STEPS.iter().enumerate() {
        let step = *step;
        let barrier = Arc::new(tokio::sync::Barrier::new(2));
        let tasks: Vec<_> = [s1.clone(), s2.clone()]
            .into_iter()
            .enumerate()
            .map(|(who, store)| {
                let barrier = barrier.clone();
                tokio::spawn(async move {
                    barrier.wait().await;
                    let r = store
                        .advance(id, step, |r| {
                            r.txns_replayed += 1;
                            r.bytes_copied = r.bytes_copied * 10 + who as u64 + 1;
                        })
                        .await;
                    (who, r)
                })
            })
            .collect();
        let mut winners = Vec::new();
        for t in tasks {
            let (who, r) = t.await.unwrap();
            match r {
                Ok(rec) => winners.push((who, rec)),
                Err(MigrationError::IllegalTransition {
                    phase, requested, ..
                }) => {
                    assert_eq!(requested, Transition::Advance(step));
                    assert_eq!(phase, step, "the loser saw the winner's step");
                }
                Err(e) => panic!("step {step}: unexpected error {e}"),
            }
        }
        assert_eq!(winners.len(), 1, "step {step}: exactly one advance wins");
        let stored = s1.get(id).await.unwrap();
        assert_eq!(stored, winners[0].1, "the stored record is the winner's");
        assert_eq!(stored.phase, step);
        assert_eq!(
            stored.txns_replayed,
            i as u64 + 1,
            "each step's update applied exactly once"
        );
    }
    let done = s2.get(id).await.unwrap();
    assert_eq!(done.status, Status::Succeeded);
    for shard in [1, 2, 3] {
        assert_eq!(s2.lock_holder(shard).await.unwrap(), None);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_updates_lose_nothing() {
    let etcd = Etcd::start();
    let store = etcd.store().await;
    let id = store
        .create(&[1], "n1", "n2", Mode::Remus)
        .await
        .unwrap()
        .id;
    store.advance(id, Phase::Copy, |_| {}).await.unwrap();

    const WRITERS: u64 = 4;
    const EACH: u64 = 25;
    let mut tasks = Vec::new();
    for w in 0..WRITERS {
        // Each writer with its own client and connection.
        let store = etcd.store().await;
        tasks.push(tokio::spawn(async move {
            for _ in 0..EACH {
                store
                    .update(id, |r| {
                        r.rows_copied += 1;
                        r.bytes_copied += 1 << (8 * w);
                    })
                    .await?;
            }
            Ok::<_, MigrationError>(())
        }));
    }
    for t in tasks {
        t.await.unwrap().unwrap();
    }
    let r = store.get(id).await.unwrap();
    assert_eq!(r.rows_copied, WRITERS * EACH);
    let per_writer: Vec<u64> = (0..WRITERS)
        .map(|w| (r.bytes_copied >> (8 * w)) & 0xff)
        .collect();
    assert_eq!(per_writer, vec![EACH; WRITERS as usize]);
    assert_eq!((r.phase, r.status), (Phase::Copy, Status::Running));
}

#[tokio::test]
async fn concurrent_creates_get_distinct_ids_and_one_shard_owner() {
    let etcd = Etcd::start();
    let mut tasks = Vec::new();
    for i in 0..6i64 {
        let store = etcd.store().await;
        // Tasks 0..3 compete for shard 1; 3..6 take shards of their own.
        let shard = if i < 3 { 1 } else { 100 + i };
        tasks.push(tokio::spawn(async move {
            store.create(&[shard], "n1", "n2", Mode::Remus).await
        }));
    }
    let mut created = Vec::new();
    let mut busy = 0;
    for t in tasks {
        match t.await.unwrap() {
            Ok(r) => created.push(r),
            Err(MigrationError::ShardBusy { shard_id: 1, .. }) => busy += 1,
            Err(e) => panic!("unexpected error {e}"),
        }
    }
    assert_eq!((created.len(), busy), (4, 2));
    let mut ids: Vec<u64> = created.iter().map(|r| r.id.0).collect();
    ids.sort_unstable();
    assert_eq!(ids, vec![1, 2, 3, 4], "ids are distinct and gap-free");
    let store = etcd.store().await;
    let owner = created.iter().find(|r| r.shard_ids == [1]).unwrap().id;
    assert_eq!(store.lock_holder(1).await.unwrap(), Some(owner));
    assert_eq!(store.list().await.unwrap().len(), 4);
}

#[tokio::test]
async fn corrupt_values_are_typed_errors() {
    let etcd = Etcd::start();
    let store = etcd.store().await;
    let a = store.create(&[1], "n1", "n2", Mode::Remus).await.unwrap();
    let mut kv = etcd.client().await.kv_client();

    kv.put(store.record_key(a.id), "{not json", None)
        .await
        .unwrap();
    assert!(matches!(
        store.get(a.id).await,
        Err(MigrationError::Corrupt { .. })
    ));
    assert!(matches!(
        store.list().await,
        Err(MigrationError::Corrupt { .. })
    ));
    assert!(matches!(
        store.advance(a.id, Phase::Copy, |_| {}).await,
        Err(MigrationError::Corrupt { .. })
    ));
    assert!(matches!(
        store.finish(a.id, Status::Failed, None).await,
        Err(MigrationError::Corrupt { .. })
    ));

    kv.put(store.lock_key(2), "banana", None).await.unwrap();
    assert!(matches!(
        store.lock_holder(2).await,
        Err(MigrationError::CorruptValue { .. })
    ));
    assert!(matches!(
        store.create(&[2], "n1", "n2", Mode::Remus).await,
        Err(MigrationError::CorruptValue { .. })
    ));

    kv.put(store.seq_key(), "-3", None).await.unwrap();
    assert!(matches!(
        store.create(&[3], "n1", "n2", Mode::Remus).await,
        Err(MigrationError::CorruptValue { .. })
    ));
}

#[tokio::test]
async fn grpc_list_migrations_mirrors_the_records() {
    use coordinator::node_registry::NodeRegistry;
    use coordinator::service::CoordinatorService;
    use remus_proto::v1::coordinator_server::Coordinator;
    use remus_proto::v1::ListMigrationsRequest;

    let etcd = Etcd::start();
    let client = etcd.client().await;
    let service = CoordinatorService {
        cluster: CLUSTER.into(),
        etcd_endpoint: etcd.endpoint().to_string(),
        nodes: NodeRegistry::new(client.clone(), CLUSTER),
        migrations: MigrationStore::new(client.clone(), CLUSTER),
        etcd: client,
        driver: std::sync::Arc::new(coordinator::driver::DriverConfig {
            connector: coordinator::node_conn::NodeConnector::from_pgpass(None, "postgres")
                .unwrap(),
            replay_endpoint: "http://127.0.0.1:1".into(),
            apply_parallelism: 1,
            copy_sessions: 1,
            copy_split_bytes: 0,
            lock_grace: std::time::Duration::from_secs(1),
            gate_timeout: std::time::Duration::from_secs(1),
            verify_handover: false,
            catchup_converge_limit: std::time::Duration::from_secs(300),
            albatross_max_rounds: 10,
            failpoints: coordinator::failpoint::Failpoints::disabled(),
        }),
        runtime: coordinator::service::MigrationRuntime(tokio::runtime::Handle::current()),
        resuming: coordinator::resume::Resuming::default(),
    };
    let store = &service.migrations;
    let a = store
        .create(&[4, 2], "n1", "n2", Mode::WaitRemaster)
        .await
        .unwrap();
    store
        .advance(a.id, Phase::Copy, |r| r.rows_copied = 42)
        .await
        .unwrap();
    let a = store
        .update(a.id, |r| {
            r.waiting_on = Some("slot creation waits for xid 1234".into())
        })
        .await
        .unwrap();
    let b = store.create(&[7], "n2", "n3", Mode::Remus).await.unwrap();
    let b = store
        .finish(b.id, Status::RolledBack, Some("boom".into()))
        .await
        .unwrap();

    let list = service
        .list_migrations(tonic::Request::new(ListMigrationsRequest {}))
        .await
        .unwrap()
        .into_inner()
        .migrations;
    assert_eq!(list.len(), 2);
    let (ma, mb) = (&list[0], &list[1]);
    assert_eq!((ma.id, ma.shard_ids.as_slice()), (a.id.0, &[2i64, 4][..]));
    assert_eq!((ma.source.as_str(), ma.target.as_str()), ("n1", "n2"));
    assert_eq!(
        (ma.mode.as_str(), ma.phase.as_str(), ma.status.as_str()),
        ("wait_remaster", "copy", "running")
    );
    assert_eq!(ma.rows_copied, 42);
    assert_eq!(
        ma.waiting_on.as_deref(),
        Some("slot creation waits for xid 1234")
    );
    assert_eq!(ma.finished_at_ms, None);
    assert_eq!(ma.error, None);
    assert_eq!(ma.phase_ms.get("pending"), a.phase_ms.get("pending"));
    assert_eq!(ma.started_at_ms, a.started_at_ms);
    assert_eq!(
        (mb.mode.as_str(), mb.phase.as_str(), mb.status.as_str()),
        ("remus", "pending", "rolled_back")
    );
    assert_eq!(mb.error.as_deref(), Some("boom"));
    assert_eq!(mb.finished_at_ms, b.finished_at_ms);
}
