//! Several copy sessions per large shard (issue 17 item 3): with `REMUS_COPY_SPLIT_MB=1`
//! (inherited through `remusctl cluster up`) a shard table of several MiB is copied by the
//! coordinator's four copy sessions in four block ranges under the slot's one snapshot, while a
//! writer updates, inserts and deletes its rows through the node that does not own it. After
//! the remus move, the new owner serves exactly the rows the writer's record says (every
//! statement committed, none refused), and the shard table there has its primary key again.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Once};
use std::thread;
use std::time::Duration;

use integration::shards::{owners, owners_everywhere};
use remus_test_support::cluster::TestCluster;

const ROWS: i64 = 40_000;

fn cluster() -> TestCluster {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| std::env::set_var("REMUS_COPY_SPLIT_MB", "1"));
    TestCluster::start(2).unwrap()
}

/// What the writer did to `big`: each row's counter; rows it deleted are absent.
type Model = BTreeMap<i64, i64>;

/// Autocommit UPDATEs of random rows, with an INSERT of a new row and a DELETE of an old one
/// every tenth statement, through `node`, until `stop`. Every statement must commit.
fn writer(c: &TestCluster, node: &str, stop: Arc<AtomicBool>) -> thread::JoinHandle<Model> {
    let mut db = c.connect(node).unwrap();
    thread::spawn(move || {
        let mut model: Model = (1..=ROWS).map(|id| (id, 0)).collect();
        let (mut i, mut next_id) = (0i64, ROWS + 1);
        while !stop.load(Ordering::Acquire) {
            i += 1;
            let id = (i * 7919) % ROWS + 1;
            if i % 10 == 0 {
                db.execute("INSERT INTO big (id, pad) VALUES ($1, 'new')", &[&next_id])
                    .unwrap_or_else(|e| panic!("insert {next_id}: {e:?}"));
                model.insert(next_id, 0);
                next_id += 1;
                let gone = (i * 104_729) % ROWS + 1;
                db.execute("DELETE FROM big WHERE id = $1", &[&gone])
                    .unwrap_or_else(|e| panic!("delete {gone}: {e:?}"));
                model.remove(&gone);
            } else {
                db.execute("UPDATE big SET n = n + 1 WHERE id = $1", &[&id])
                    .unwrap_or_else(|e| panic!("update {id}: {e:?}"));
                if let Some(n) = model.get_mut(&id) {
                    *n += 1;
                }
            }
        }
        model
    })
}

#[test]
fn a_large_shard_is_copied_by_several_sessions_while_it_is_written() {
    let c = cluster();
    let mut n1 = c.connect("n1").unwrap();
    n1.batch_execute(&format!(
        "CREATE TABLE big (id bigint PRIMARY KEY, n bigint NOT NULL DEFAULT 0, pad text NOT NULL);
         CREATE INDEX big_n ON big (n);
         INSERT INTO big (id, pad) SELECT g, repeat(md5(g::text), 4) FROM generate_series(1, {ROWS}) g;
         SELECT remus_create_distributed_table('big', 'id', shard_count => 1);"
    ))
    .unwrap();
    let (shard, source) = owners(&c, "big").remove(0);
    let target = if source == "n1" { "n2" } else { "n1" };
    let size: i64 = n1
        .query_one(
            "SELECT size_bytes FROM remus_shards WHERE shard_id = $1",
            &[&shard],
        )
        .unwrap()
        .get(0);
    assert!(
        size > 4 << 20,
        "shard {shard} is {size} bytes: too small to be split in four"
    );

    let stop = Arc::new(AtomicBool::new(false));
    let writing = writer(&c, target, stop.clone());
    thread::sleep(Duration::from_millis(300));
    let row = n1
        .query_one(
            "SELECT migration_id, status, aborted_by_migration, rows_copied
               FROM remus_migrate_shard($1, $2, 'remus')",
            &[&shard, &target],
        )
        .unwrap_or_else(|e| panic!("moving shard {shard}: {e:?}\n{}", c.daemon_logs(40)));
    let (id, status, aborted, copied): (i64, String, i64, i64) =
        (row.get(0), row.get(1), row.get(2), row.get(3));
    assert_eq!(
        (status.as_str(), aborted),
        ("succeeded", 0),
        "migration {id}"
    );
    assert!(copied >= ROWS * 9 / 10, "{copied} rows copied");
    thread::sleep(Duration::from_millis(300));
    stop.store(true, Ordering::Release);
    let model = writing
        .join()
        .expect("the writer committed every statement");

    assert_eq!(owners_everywhere(&c, shard), vec![target, target]);
    let logs = c.daemon_logs(100_000);
    let copied_line = logs
        .lines()
        .find(|l| l.contains("snapshot copied") && l.contains(&format!("migration_id={id}")))
        .unwrap_or_else(|| panic!("no copy line for migration {id}\n{logs}"));
    assert!(copied_line.contains("parts=4"), "{copied_line}");

    let served: Model = n1
        .query("SELECT id, n FROM big ORDER BY id", &[])
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(served.len(), model.len());
    assert!(
        served == model,
        "the new owner's rows differ from the writer's record"
    );

    let mut on_target = c.connect(target).unwrap();
    on_target
        .batch_execute("SET remus.migration_session = on")
        .unwrap();
    let indexes: String = on_target
        .query_one(
            &format!(
                "SELECT string_agg(pg_get_indexdef(indexrelid) || ' ' || indisvalid, '; ' ORDER BY 1)
                   FROM pg_index WHERE indrelid = 'remus_shards.big_{shard}'::regclass"
            ),
            &[],
        )
        .unwrap()
        .get(0);
    assert_eq!(indexes.matches(" true").count(), 2, "{indexes}");
    assert!(
        indexes.contains("UNIQUE INDEX") && indexes.contains("(n)"),
        "{indexes}"
    );
    // The write-set capture trigger, added after the rows (not during the copy), is there and
    // fires for every session: the next migration of this shard captures its writes.
    let capture: Vec<String> = on_target
        .query(
            &format!(
                "SELECT tgenabled::text FROM pg_trigger
                  WHERE tgrelid = 'remus_shards.big_{shard}'::regclass AND tgname = 'remus_capture'"
            ),
            &[],
        )
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(capture, vec!["A".to_string()]);
}
