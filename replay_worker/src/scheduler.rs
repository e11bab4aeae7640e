//! Dependency scheduling of whole source transactions.
//!
//! The destination must end up in the same state as the source. Two transactions that touch a
//! common row only commute if they are applied in source commit order, so such pairs are
//! serialized; everything else may run concurrently, which is where the replay throughput comes
//! from. Deciding this per row (rather than per relation) keeps hot tables parallel.
//!
//! Dependencies are found through a "last writer" index: every transaction only needs to wait for
//! the latest earlier transaction on each of its keys, because that one in turn could not have run
//! before *its* predecessors on the key committed. This keeps `submit` at O(keys) instead of
//! scanning everything pending, and a completion only touches the transactions that were waiting
//! on it.
//!
//! The index stores a 64-bit hash of each key instead of the key bytes. A collision can only add
//! a dependency that does not exist (two unrelated transactions are serialized), never drop one,
//! so it costs parallelism with negligible probability and never correctness; in exchange the
//! scheduler never copies primary-key bytes and can hand the whole transaction back by value.
//!
//! Transactions whose row set is unknown (TRUNCATE, or no keys at all) are barriers: they wait for
//! everything before them and everything after them waits for them.
//!
//! There is deliberately no per-transaction failure path. If a shadow transaction fails, the
//! worker stops, discards all scheduling state with [`DependencyScheduler::reset`] and restarts
//! streaming from the last fed-back LSN, which by construction only covers committed work.

use std::collections::hash_map::{DefaultHasher, Entry};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::hash::{BuildHasherDefault, Hash, Hasher};

use thiserror::Error;
use tracing::{debug, trace};

/// Identity of one row: the relation it lives in and its encoded primary key.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RowKey {
    /// Relation OID on the source.
    pub relid: u32,
    /// Primary-key bytes, encoded identically for every change of the same row.
    pub pk: Vec<u8>,
}

impl RowKey {
    pub fn new(relid: u32, pk: impl Into<Vec<u8>>) -> Self {
        Self {
            relid,
            pk: pk.into(),
        }
    }
}

/// One committed source transaction, as far as scheduling is concerned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TxnSpec {
    /// Position in source commit order; strictly increasing across submissions (gaps allowed).
    pub seq: u64,
    /// Commit LSN of the source transaction.
    pub commit_lsn: u64,
    /// End LSN of the commit record; this is what is fed back once the transaction is applied.
    pub end_lsn: u64,
    /// Rows written by the transaction. Duplicates are allowed.
    pub keys: Vec<RowKey>,
    /// The transaction's effect is not confined to `keys` (e.g. TRUNCATE); it conflicts with
    /// everything. A transaction without keys is treated the same way regardless of this flag.
    pub barrier: bool,
}

impl TxnSpec {
    pub fn new(seq: u64, commit_lsn: u64, end_lsn: u64, keys: Vec<RowKey>) -> Self {
        Self {
            seq,
            commit_lsn,
            end_lsn,
            keys,
            barrier: false,
        }
    }

    /// A transaction that conflicts with every other one.
    pub fn new_barrier(seq: u64, commit_lsn: u64, end_lsn: u64) -> Self {
        Self {
            seq,
            commit_lsn,
            end_lsn,
            keys: Vec::new(),
            barrier: true,
        }
    }

    /// Whether the scheduler serializes this transaction against everything.
    pub fn is_barrier(&self) -> bool {
        self.barrier || self.keys.is_empty()
    }
}

/// Why [`DependencyScheduler::submit`] refused a transaction.
#[derive(Debug, Error)]
pub enum SubmitError {
    /// `max_pending` transactions are submitted and not yet completed. The transaction is handed
    /// back unchanged; submit it again after a [`DependencyScheduler::complete`].
    #[error("replay scheduler full: {max_pending} transactions pending, cannot accept seq {}", txn.seq)]
    Full {
        txn: Box<TxnSpec>,
        max_pending: usize,
    },
    /// The sequence number does not follow the previous submission.
    #[error(
        "seq {seq} submitted after seq {last}: source commit order must be strictly increasing"
    )]
    OutOfOrder { seq: u64, last: u64 },
}

/// Why [`DependencyScheduler::complete`] refused a completion.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum CompleteError {
    /// No pending transaction has this seq (never submitted, already completed, or reset).
    #[error("seq {0} is not pending in the replay scheduler")]
    Unknown(u64),
    /// The transaction is pending but was never handed out by `next_ready`, so it cannot have run.
    #[error("seq {0} completed before it was handed out by the replay scheduler")]
    NotDispatched(u64),
}

type KeyHash = u64;
type FixedHasher = BuildHasherDefault<DefaultHasher>;

fn key_hash(key: &RowKey) -> KeyHash {
    // `DefaultHasher::new()` uses fixed keys, so scheduling decisions are reproducible.
    let mut h = DefaultHasher::new();
    key.hash(&mut h);
    h.finish()
}

#[derive(Debug)]
struct Node {
    /// `Some` until handed out by `next_ready`.
    txn: Option<TxnSpec>,
    /// Hashes of the keys this transaction may be the last writer of (empty for barriers).
    keys: Vec<KeyHash>,
    /// Number of not-yet-completed transactions this one waits for.
    blockers: usize,
    /// Transactions waiting for this one.
    dependents: Vec<u64>,
}

/// Hands out source transactions for concurrent replay while keeping every pair of transactions
/// that share a row in source commit order.
#[derive(Debug)]
pub struct DependencyScheduler {
    max_pending: usize,
    /// Submitted and not completed (waiting, ready, or in flight), by seq.
    nodes: BTreeMap<u64, Node>,
    /// Seqs whose dependencies have all completed and that were not handed out yet.
    ready: BTreeSet<u64>,
    /// Latest pending transaction writing each key (by key hash).
    last_writer: HashMap<KeyHash, u64, FixedHasher>,
    /// Latest pending barrier, which every later transaction must wait for.
    last_barrier: Option<u64>,
    last_seq: Option<u64>,
    in_flight: usize,
}

impl DependencyScheduler {
    /// A scheduler accepting at most `max_pending` submitted-but-not-completed transactions.
    ///
    /// # Panics
    /// If `max_pending` is zero, since nothing could ever be submitted.
    pub fn new(max_pending: usize) -> Self {
        assert!(
            max_pending > 0,
            "DependencyScheduler max_pending must be at least 1"
        );
        Self {
            max_pending,
            nodes: BTreeMap::new(),
            ready: BTreeSet::new(),
            last_writer: HashMap::default(),
            last_barrier: None,
            last_seq: None,
            in_flight: 0,
        }
    }

    /// Adds the next transaction in source commit order.
    pub fn submit(&mut self, txn: TxnSpec) -> Result<(), SubmitError> {
        if let Some(last) = self.last_seq {
            if txn.seq <= last {
                return Err(SubmitError::OutOfOrder { seq: txn.seq, last });
            }
        }
        if self.nodes.len() >= self.max_pending {
            return Err(SubmitError::Full {
                txn: Box::new(txn),
                max_pending: self.max_pending,
            });
        }
        let seq = txn.seq;
        self.last_seq = Some(seq);

        let (deps, keys) = if txn.is_barrier() {
            // Everything still pending precedes this barrier. Earlier writers need no further
            // tracking: anything after the barrier waits for it, and it waits for them.
            let deps: Vec<u64> = self.nodes.keys().copied().collect();
            self.last_writer.clear();
            self.last_barrier = Some(seq);
            debug!(seq, waits_for = deps.len(), "replay barrier submitted");
            (deps, Vec::new())
        } else {
            let mut keys: Vec<KeyHash> = txn.keys.iter().map(key_hash).collect();
            keys.sort_unstable();
            keys.dedup();
            let mut deps: Vec<u64> = Vec::with_capacity(keys.len() + 1);
            deps.extend(self.last_barrier);
            for &k in &keys {
                match self.last_writer.entry(k) {
                    Entry::Occupied(mut e) => deps.push(e.insert(seq)),
                    Entry::Vacant(e) => {
                        e.insert(seq);
                    }
                }
            }
            deps.sort_unstable();
            deps.dedup();
            (deps, keys)
        };

        for dep in &deps {
            self.nodes
                .get_mut(dep)
                .expect("dependency index points at a pending transaction")
                .dependents
                .push(seq);
        }
        if deps.is_empty() {
            self.ready.insert(seq);
        }
        trace!(seq, waits_for = deps.len(), "replay transaction submitted");
        self.nodes.insert(
            seq,
            Node {
                txn: Some(txn),
                keys,
                blockers: deps.len(),
                dependents: Vec::new(),
            },
        );
        Ok(())
    }

    /// Whether `submit` would currently accept a transaction (ignoring ordering errors).
    pub fn has_capacity(&self) -> bool {
        self.nodes.len() < self.max_pending
    }

    /// Hands out a transaction that may be applied now: every earlier transaction sharing a key
    /// with it has completed. The lowest such seq is returned first, which lets the applied
    /// watermark advance as early as possible. Each transaction is returned at most once.
    /// The seq [`Self::next_ready`] would hand out next, without handing it out.
    pub fn peek_ready(&self) -> Option<u64> {
        self.ready.first().copied()
    }

    pub fn next_ready(&mut self) -> Option<TxnSpec> {
        let seq = self.ready.pop_first()?;
        let txn = self
            .nodes
            .get_mut(&seq)
            .and_then(|n| n.txn.take())
            .expect("ready transaction is pending and not yet handed out");
        self.in_flight += 1;
        trace!(seq, "replay transaction handed out");
        Some(txn)
    }

    /// Records that the shadow transaction for `seq` has committed, releasing its dependents.
    pub fn complete(&mut self, seq: u64) -> Result<(), CompleteError> {
        match self.nodes.get(&seq) {
            None => return Err(CompleteError::Unknown(seq)),
            Some(n) if n.txn.is_some() => return Err(CompleteError::NotDispatched(seq)),
            Some(_) => {}
        }
        let node = self.nodes.remove(&seq).expect("checked above");
        self.in_flight -= 1;

        for k in &node.keys {
            if let Entry::Occupied(e) = self.last_writer.entry(*k) {
                if *e.get() == seq {
                    e.remove();
                }
            }
        }
        if self.last_barrier == Some(seq) {
            self.last_barrier = None;
        }
        for dep in node.dependents {
            let d = self.nodes.get_mut(&dep).expect("dependent is pending");
            d.blockers -= 1;
            if d.blockers == 0 {
                self.ready.insert(dep);
            }
        }
        trace!(seq, "replay transaction completed");
        Ok(())
    }

    /// Drops all state, including the last submitted seq, so numbering may start over. Used when
    /// the worker restarts streaming from the fed-back LSN after a failure.
    pub fn reset(&mut self) {
        debug!(
            pending = self.nodes.len(),
            in_flight = self.in_flight,
            "replay scheduler reset"
        );
        self.nodes.clear();
        self.ready.clear();
        self.last_writer.clear();
        self.last_barrier = None;
        self.last_seq = None;
        self.in_flight = 0;
    }

    /// Submitted and not yet completed, including in-flight ones.
    pub fn pending(&self) -> usize {
        self.nodes.len()
    }

    /// Handed out by `next_ready` and not yet completed.
    pub fn in_flight(&self) -> usize {
        self.in_flight
    }

    /// Ready to be handed out by `next_ready` right now.
    pub fn ready_len(&self) -> usize {
        self.ready.len()
    }

    pub fn max_pending(&self) -> usize {
        self.max_pending
    }

    /// No transaction is pending.
    pub fn is_idle(&self) -> bool {
        self.nodes.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn k(relid: u32, pk: &str) -> RowKey {
        RowKey::new(relid, pk.as_bytes())
    }

    fn txn(seq: u64, keys: &[RowKey]) -> TxnSpec {
        TxnSpec::new(seq, seq * 100, seq * 100 + 10, keys.to_vec())
    }

    fn drain(s: &mut DependencyScheduler) -> Vec<u64> {
        std::iter::from_fn(|| s.next_ready())
            .map(|t| t.seq)
            .collect()
    }

    #[test]
    fn disjoint_transactions_are_all_ready_at_once() {
        let mut s = DependencyScheduler::new(16);
        for seq in 1..=5 {
            s.submit(txn(
                seq,
                &[k(1, &format!("r{seq}")), k(2, &format!("r{seq}"))],
            ))
            .unwrap();
        }
        assert_eq!(s.ready_len(), 5);
        assert_eq!(drain(&mut s), vec![1, 2, 3, 4, 5]);
        assert_eq!(s.in_flight(), 5);
        assert_eq!(s.pending(), 5);
        for seq in [3, 1, 5, 2, 4] {
            s.complete(seq).unwrap();
        }
        assert!(s.is_idle());
        assert_eq!(s.in_flight(), 0);
    }

    #[test]
    fn same_pk_in_different_relations_does_not_conflict() {
        let mut s = DependencyScheduler::new(16);
        s.submit(txn(1, &[k(1, "a")])).unwrap();
        s.submit(txn(2, &[k(2, "a")])).unwrap();
        assert_eq!(drain(&mut s), vec![1, 2]);
    }

    #[test]
    fn chain_on_one_key_runs_in_seq_order() {
        let mut s = DependencyScheduler::new(16);
        for seq in 1..=4 {
            s.submit(txn(seq, &[k(1, "hot")])).unwrap();
        }
        for seq in 1..=4 {
            assert_eq!(drain(&mut s), vec![seq]);
            assert_eq!(s.next_ready(), None);
            s.complete(seq).unwrap();
        }
        assert!(s.is_idle());
    }

    #[test]
    fn handout_does_not_release_dependents_only_completion_does() {
        let mut s = DependencyScheduler::new(16);
        s.submit(txn(1, &[k(1, "a")])).unwrap();
        s.submit(txn(2, &[k(1, "a")])).unwrap();
        assert_eq!(drain(&mut s), vec![1]);
        assert_eq!(drain(&mut s), Vec::<u64>::new());
        s.complete(1).unwrap();
        assert_eq!(drain(&mut s), vec![2]);
    }

    #[test]
    fn transitive_wait_through_a_shared_middle_transaction() {
        // T3 shares nothing with T1 but waits for T2, which waits for T1.
        let mut s = DependencyScheduler::new(16);
        s.submit(txn(1, &[k(1, "a")])).unwrap();
        s.submit(txn(2, &[k(1, "a"), k(1, "b")])).unwrap();
        s.submit(txn(3, &[k(1, "b")])).unwrap();
        assert_eq!(drain(&mut s), vec![1]);
        s.complete(1).unwrap();
        assert_eq!(drain(&mut s), vec![2]);
        s.complete(2).unwrap();
        assert_eq!(drain(&mut s), vec![3]);
    }

    #[test]
    fn diamond_waits_for_both_parents() {
        // T1 writes a, T2 writes b, T3 writes a and b, T4 writes a.
        let mut s = DependencyScheduler::new(16);
        s.submit(txn(1, &[k(1, "a")])).unwrap();
        s.submit(txn(2, &[k(1, "b")])).unwrap();
        s.submit(txn(3, &[k(1, "a"), k(1, "b")])).unwrap();
        s.submit(txn(4, &[k(1, "a")])).unwrap();
        assert_eq!(drain(&mut s), vec![1, 2]);
        s.complete(2).unwrap();
        assert_eq!(
            drain(&mut s),
            Vec::<u64>::new(),
            "T3 must still wait for T1"
        );
        s.complete(1).unwrap();
        assert_eq!(drain(&mut s), vec![3]);
        s.complete(3).unwrap();
        assert_eq!(drain(&mut s), vec![4]);
    }

    #[test]
    fn duplicate_keys_within_a_transaction_count_once() {
        let mut s = DependencyScheduler::new(16);
        s.submit(txn(1, &[k(1, "a"), k(1, "a")])).unwrap();
        s.submit(txn(2, &[k(1, "a"), k(1, "a"), k(1, "a")]))
            .unwrap();
        assert_eq!(drain(&mut s), vec![1]);
        s.complete(1).unwrap();
        // A double-counted dependency would leave T2 blocked forever.
        assert_eq!(drain(&mut s), vec![2]);
        s.complete(2).unwrap();
        assert!(s.is_idle());
    }

    #[test]
    fn barrier_waits_for_everything_before_and_blocks_everything_after() {
        let mut s = DependencyScheduler::new(16);
        s.submit(txn(1, &[k(1, "a")])).unwrap();
        s.submit(txn(2, &[k(1, "b")])).unwrap();
        s.submit(TxnSpec::new_barrier(3, 300, 310)).unwrap();
        s.submit(txn(4, &[k(1, "c")])).unwrap();
        s.submit(txn(5, &[k(2, "d")])).unwrap();
        assert_eq!(drain(&mut s), vec![1, 2]);
        s.complete(1).unwrap();
        assert_eq!(drain(&mut s), Vec::<u64>::new());
        s.complete(2).unwrap();
        assert_eq!(drain(&mut s), vec![3]);
        s.complete(3).unwrap();
        assert_eq!(drain(&mut s), vec![4, 5]);
    }

    #[test]
    fn keyless_transaction_is_a_barrier_even_without_the_flag() {
        let t = txn(2, &[]);
        assert!(!t.barrier);
        assert!(t.is_barrier());
        let mut s = DependencyScheduler::new(16);
        s.submit(txn(1, &[k(1, "a")])).unwrap();
        s.submit(t).unwrap();
        s.submit(txn(3, &[k(9, "z")])).unwrap();
        assert_eq!(drain(&mut s), vec![1]);
        s.complete(1).unwrap();
        assert_eq!(drain(&mut s), vec![2]);
        s.complete(2).unwrap();
        assert_eq!(drain(&mut s), vec![3]);
    }

    #[test]
    fn flagged_barrier_with_keys_still_conflicts_with_everything() {
        let mut s = DependencyScheduler::new(16);
        s.submit(txn(1, &[k(1, "a")])).unwrap();
        let mut truncate = txn(2, &[k(5, "x")]);
        truncate.barrier = true;
        s.submit(truncate).unwrap();
        s.submit(txn(3, &[k(7, "y")])).unwrap();
        assert_eq!(drain(&mut s), vec![1]);
        s.complete(1).unwrap();
        assert_eq!(drain(&mut s), vec![2]);
        s.complete(2).unwrap();
        assert_eq!(drain(&mut s), vec![3]);
    }

    #[test]
    fn barrier_on_idle_scheduler_is_immediately_ready() {
        let mut s = DependencyScheduler::new(16);
        s.submit(TxnSpec::new_barrier(1, 100, 110)).unwrap();
        s.submit(TxnSpec::new_barrier(2, 200, 210)).unwrap();
        assert_eq!(drain(&mut s), vec![1]);
        s.complete(1).unwrap();
        assert_eq!(drain(&mut s), vec![2]);
    }

    #[test]
    fn writer_after_completed_barrier_only_waits_for_post_barrier_writers() {
        let mut s = DependencyScheduler::new(16);
        s.submit(txn(1, &[k(1, "a")])).unwrap();
        s.submit(TxnSpec::new_barrier(2, 200, 210)).unwrap();
        s.submit(txn(3, &[k(1, "a")])).unwrap();
        s.submit(txn(4, &[k(1, "a")])).unwrap();
        s.submit(txn(5, &[k(1, "b")])).unwrap();
        for seq in [1, 2] {
            assert_eq!(drain(&mut s), vec![seq]);
            s.complete(seq).unwrap();
        }
        assert_eq!(drain(&mut s), vec![3, 5]);
        s.complete(5).unwrap();
        assert_eq!(drain(&mut s), Vec::<u64>::new());
        s.complete(3).unwrap();
        assert_eq!(drain(&mut s), vec![4]);
    }

    #[test]
    fn completed_writer_leaves_no_dependency_behind() {
        let mut s = DependencyScheduler::new(16);
        s.submit(txn(1, &[k(1, "a")])).unwrap();
        assert_eq!(drain(&mut s), vec![1]);
        s.complete(1).unwrap();
        s.submit(txn(2, &[k(1, "a")])).unwrap();
        assert_eq!(drain(&mut s), vec![2]);
        assert!(s.last_writer.len() == 1);
        s.complete(2).unwrap();
        assert!(
            s.last_writer.is_empty(),
            "key index must not grow with completed work"
        );
        assert!(s.nodes.is_empty());
    }

    #[test]
    fn submit_returns_full_and_hands_the_transaction_back() {
        let mut s = DependencyScheduler::new(2);
        s.submit(txn(1, &[k(1, "a")])).unwrap();
        s.submit(txn(2, &[k(1, "b")])).unwrap();
        assert!(!s.has_capacity());
        let rejected = txn(3, &[k(1, "c")]);
        match s.submit(rejected.clone()) {
            Err(SubmitError::Full { txn, max_pending }) => {
                assert_eq!(*txn, rejected);
                assert_eq!(max_pending, 2);
            }
            other => panic!("expected Full, got {other:?}"),
        }
        // In-flight transactions still count against the limit.
        assert_eq!(drain(&mut s), vec![1, 2]);
        assert!(matches!(
            s.submit(rejected.clone()),
            Err(SubmitError::Full { .. })
        ));
        s.complete(2).unwrap();
        assert!(s.has_capacity());
        s.submit(rejected).unwrap();
        assert_eq!(drain(&mut s), vec![3]);
    }

    #[test]
    fn submit_rejects_non_increasing_seq() {
        let mut s = DependencyScheduler::new(4);
        s.submit(txn(5, &[k(1, "a")])).unwrap();
        assert!(matches!(
            s.submit(txn(5, &[k(1, "b")])),
            Err(SubmitError::OutOfOrder { seq: 5, last: 5 })
        ));
        assert!(matches!(
            s.submit(txn(3, &[k(1, "b")])),
            Err(SubmitError::OutOfOrder { seq: 3, last: 5 })
        ));
        // Gaps are fine.
        s.submit(txn(9, &[k(1, "b")])).unwrap();
        assert_eq!(s.pending(), 2);
    }

    #[test]
    fn complete_rejects_unknown_undispatched_and_repeated() {
        let mut s = DependencyScheduler::new(4);
        s.submit(txn(1, &[k(1, "a")])).unwrap();
        assert_eq!(s.complete(7), Err(CompleteError::Unknown(7)));
        assert_eq!(s.complete(1), Err(CompleteError::NotDispatched(1)));
        assert_eq!(drain(&mut s), vec![1]);
        s.complete(1).unwrap();
        assert_eq!(s.complete(1), Err(CompleteError::Unknown(1)));
        assert_eq!(s.in_flight(), 0);
    }

    #[test]
    fn next_ready_returns_the_full_transaction() {
        let mut s = DependencyScheduler::new(4);
        let t = TxnSpec::new(1, 0x1000, 0x1040, vec![k(3, "pk"), k(4, "pk2")]);
        s.submit(t.clone()).unwrap();
        assert_eq!(s.next_ready(), Some(t));
        assert_eq!(s.next_ready(), None);
    }

    #[test]
    fn reset_drops_everything_and_allows_renumbering() {
        let mut s = DependencyScheduler::new(2);
        s.submit(txn(10, &[k(1, "a")])).unwrap();
        s.submit(txn(11, &[k(1, "a")])).unwrap();
        assert_eq!(drain(&mut s), vec![10]);
        s.reset();
        assert!(s.is_idle());
        assert_eq!(s.in_flight(), 0);
        assert_eq!(s.ready_len(), 0);
        assert_eq!(s.complete(10), Err(CompleteError::Unknown(10)));
        // Restarted stream: same seqs again, and the old in-flight key no longer blocks.
        s.submit(txn(10, &[k(1, "a")])).unwrap();
        s.submit(txn(11, &[k(1, "b")])).unwrap();
        assert_eq!(drain(&mut s), vec![10, 11]);
    }

    #[test]
    #[should_panic(expected = "max_pending")]
    fn zero_capacity_is_rejected() {
        let _ = DependencyScheduler::new(0);
    }
}
