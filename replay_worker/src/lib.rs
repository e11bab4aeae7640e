//! The destination-side replay worker of a Remus shard migration.
//!
//! Remus moves a shard by streaming the source's committed transactions to the destination and
//! applying each as one shadow transaction. Applying them one at a time cannot keep up with a
//! source that commits from many backends concurrently, so the worker applies independent
//! transactions in parallel and only orders the ones that touch a common row. That ordering
//! decision is kept here, free of any database code, so it can be tested exhaustively:
//! [`DependencyScheduler`] decides *what may run*, [`AppliedWatermark`] decides *what the source
//! may forget* once things ran out of order.
//!
//! Both are driven by the same caller in the same order: every transaction is submitted to the
//! scheduler and registered with the watermark, and every committed shadow transaction is
//! completed in both.
//!
//! On top of that core, [`apply`] runs the shadow transactions against the destination over
//! parallel sessions with replication origins ([`ShadowApplier`]), and [`service`] exposes one
//! applier per migration as the `ReplayWorker.Apply` gRPC call ([`serve`] starts it in-process;
//! the `remus-replay-worker` binary is the standalone server).

pub mod apply;
pub mod progress;
pub mod scheduler;
pub mod service;
pub mod validate;

pub use apply::{ApplyConfig, ApplyError, ShadowApplier, DEFAULT_PARALLELISM};
pub use progress::{AppliedLsnWatcher, AppliedWatermark, WatermarkClosed, WatermarkError};
pub use scheduler::{CompleteError, DependencyScheduler, RowKey, SubmitError, TxnSpec};
pub use service::{serve, ReplayWorkerService};

#[cfg(test)]
mod simulation {
    //! Random workloads driven through scheduler and watermark together, checked against a
    //! brute-force model of the ordering rule.

    use super::*;
    use std::collections::{BTreeMap, HashSet};

    struct XorShift(u64);

    impl XorShift {
        fn new(seed: u64) -> Self {
            // Never zero, or xorshift gets stuck.
            Self(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
        }
        fn next(&mut self) -> u64 {
            let mut x = self.0;
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            self.0 = x;
            x
        }
        fn below(&mut self, n: u64) -> u64 {
            self.next() % n
        }
        fn chance(&mut self, percent: u64) -> bool {
            self.below(100) < percent
        }
    }

    fn conflicts(a: &TxnSpec, b: &TxnSpec) -> bool {
        a.is_barrier() || b.is_barrier() || a.keys.iter().any(|k| b.keys.contains(k))
    }

    fn workload(rng: &mut XorShift, n: usize, relations: u64, rows: u64) -> Vec<TxnSpec> {
        let mut seq = 0;
        let mut lsn = 0x100_0000;
        (0..n)
            .map(|_| {
                seq += 1 + rng.below(3);
                lsn += 1 + rng.below(0x200);
                let commit_lsn = lsn;
                lsn += 1 + rng.below(0x20);
                let nkeys = rng.below(5) as usize;
                let keys = (0..nkeys)
                    .map(|_| {
                        let pk = rng.below(rows).to_be_bytes().to_vec();
                        RowKey::new(1 + rng.below(relations) as u32, pk)
                    })
                    .collect();
                let mut t = TxnSpec::new(seq, commit_lsn, lsn, keys);
                t.barrier = rng.chance(2);
                t
            })
            .collect()
    }

    fn run(seed: u64, n: usize, max_pending: usize, relations: u64, rows: u64) {
        let mut rng = XorShift::new(seed);
        let txns = workload(&mut rng, n, relations, rows);
        let by_seq: BTreeMap<u64, &TxnSpec> = txns.iter().map(|t| (t.seq, t)).collect();

        let mut sched = DependencyScheduler::new(max_pending);
        let mut wm = AppliedWatermark::new(0x100_0000);
        let watcher = wm.watcher();

        let mut next_submit = 0; // index into txns
        let mut incomplete: BTreeMap<u64, &TxnSpec> = BTreeMap::new(); // model: submitted, not done
        let mut handed_out: HashSet<u64> = HashSet::new();
        let mut running: Vec<u64> = Vec::new();
        let mut completed = vec![false; n];
        let mut prefix = 0; // model: txns[..prefix] all completed
        let mut last_applied = wm.applied_lsn();
        let mut steps = 0;

        while prefix < n {
            steps += 1;
            assert!(steps < 100 * n, "seed {seed}: no progress");
            match rng.below(3) {
                0 => {
                    for _ in 0..=rng.below(8) {
                        let Some(t) = txns.get(next_submit) else {
                            break;
                        };
                        match sched.submit(t.clone()) {
                            Ok(()) => {
                                wm.register(t.seq, t.end_lsn).unwrap();
                                incomplete.insert(t.seq, t);
                                next_submit += 1;
                            }
                            Err(SubmitError::Full { txn, .. }) => {
                                assert_eq!(*txn, *t);
                                assert_eq!(sched.pending(), max_pending);
                                assert_eq!(incomplete.len(), max_pending);
                                break;
                            }
                            Err(e) => panic!("seed {seed}: {e}"),
                        }
                    }
                }
                1 => {
                    for _ in 0..=rng.below(8) {
                        let Some(t) = sched.next_ready() else { break };
                        assert_eq!(by_seq.get(&t.seq).copied(), Some(&t), "handed out intact");
                        assert!(handed_out.insert(t.seq), "seed {seed}: seq {} twice", t.seq);
                        for (&earlier, other) in incomplete.range(..t.seq) {
                            assert!(
                                !conflicts(other, &t),
                                "seed {seed}: seq {} handed out while conflicting seq {earlier} \
                                 is not complete",
                                t.seq
                            );
                        }
                        running.push(t.seq);
                    }
                }
                _ => {
                    for _ in 0..=rng.below(4) {
                        if running.is_empty() {
                            break;
                        }
                        let seq = running.swap_remove(rng.below(running.len() as u64) as usize);
                        sched.complete(seq).unwrap();
                        let advanced = wm.complete(seq).unwrap();
                        incomplete.remove(&seq);
                        let idx = txns.binary_search_by_key(&seq, |t| t.seq).unwrap();
                        completed[idx] = true;
                        while prefix < n && completed[prefix] {
                            prefix += 1;
                        }
                        let applied = wm.applied_lsn();
                        assert!(applied >= last_applied, "seed {seed}: watermark went back");
                        assert_eq!(advanced.is_some(), applied > last_applied);
                        let expected = if prefix == 0 {
                            0x100_0000
                        } else {
                            txns[prefix - 1].end_lsn
                        };
                        assert_eq!(
                            applied, expected,
                            "seed {seed}: watermark != contiguous prefix"
                        );
                        assert_eq!(watcher.applied_lsn(), applied);
                        last_applied = applied;
                    }
                }
            }

            // The scheduler must be exactly as permissive as the rule: anything submitted, not yet
            // handed out, and without an incomplete earlier conflict is ready (so nothing is
            // over-serialized and nothing can deadlock).
            let model_ready = incomplete
                .values()
                .filter(|t| !handed_out.contains(&t.seq))
                .filter(|t| !incomplete.range(..t.seq).any(|(_, o)| conflicts(o, t)))
                .count();
            assert_eq!(
                sched.ready_len(),
                model_ready,
                "seed {seed}: ready set differs from model"
            );
            assert_eq!(sched.in_flight(), running.len());
            assert_eq!(sched.pending(), incomplete.len());
            assert_eq!(wm.pending(), next_submit - prefix);
        }

        assert_eq!(
            handed_out.len(),
            n,
            "seed {seed}: every transaction handed out once"
        );
        assert!(sched.is_idle());
        assert_eq!(sched.next_ready(), None);
        assert_eq!(wm.pending(), 0);
        assert_eq!(wm.applied_lsn(), txns.last().unwrap().end_lsn);
    }

    #[test]
    fn random_workloads_respect_key_order_and_watermark_prefix() {
        for seed in 1..=40 {
            // Alternate between heavy contention and mostly independent transactions.
            let (relations, rows) = if seed % 2 == 0 { (2, 6) } else { (4, 500) };
            let max_pending = [1, 4, 32][seed as usize % 3];
            run(seed, 600, max_pending, relations, rows);
        }
    }

    #[test]
    fn xorshift_is_not_degenerate() {
        let mut rng = XorShift::new(0);
        let draws: HashSet<u64> = (0..1000).map(|_| rng.below(1000)).collect();
        assert!(draws.len() > 500);
    }
}
