//! The applied position: what the sync barrier and validations wait for, and what the durable
//! position fed back to the source's replication slot trails (`apply::durable`, decision 0018).
//!
//! Parallel replay commits shadow transactions out of source order, but the slot can only be told
//! a single LSN, and everything before that LSN is then gone from the source's point of view. So
//! the position must be the end of the longest *contiguous* prefix (in source commit order) of
//! transactions that have all committed on the destination; using the end of a transaction that
//! merely finished first would let the source discard WAL of earlier ones that are still
//! running, and a crash at that moment would lose them. Catch-up shadows commit asynchronously,
//! so the slot is told this position only once the destination has flushed past it.
//!
//! The sync barrier of a migration needs to wait until everything up to a given source LSN is
//! applied, from a different task than the apply loop; [`AppliedLsnWatcher`] publishes the
//! watermark over a watch channel for that.

use std::collections::VecDeque;

use thiserror::Error;
use tokio::sync::watch;
use tracing::trace;

/// Why the watermark refused a registration or completion.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum WatermarkError {
    #[error(
        "seq {seq} registered after seq {last}: source commit order must be strictly increasing"
    )]
    SeqOutOfOrder { seq: u64, last: u64 },
    /// The transaction does not end after everything already registered or applied; replaying it
    /// would apply it twice or out of order.
    #[error(
        "seq {seq} ends at LSN {end_lsn:#X}, not after {floor:#X} already registered or applied"
    )]
    LsnNotAfter { seq: u64, end_lsn: u64, floor: u64 },
    #[error("seq {0} is not registered with the applied watermark")]
    Unknown(u64),
    #[error("seq {0} completed twice")]
    AlreadyCompleted(u64),
}

/// The watermark was dropped (the apply loop ended) before the awaited LSN was reached.
#[derive(Debug, Error, PartialEq, Eq)]
#[error("applied watermark closed at LSN {applied:#X} before reaching {wanted:#X}")]
pub struct WatermarkClosed {
    pub applied: u64,
    pub wanted: u64,
}

#[derive(Debug)]
struct Slot {
    seq: u64,
    end_lsn: u64,
    done: bool,
}

/// Tracks which submitted transactions have committed and derives the LSN the source may forget.
#[derive(Debug)]
pub struct AppliedWatermark {
    /// Registered, not yet part of the applied prefix, in seq order.
    pending: VecDeque<Slot>,
    applied: u64,
    last_seq: Option<u64>,
    /// Highest end LSN registered or applied; new registrations must end after it.
    floor: u64,
    tx: watch::Sender<u64>,
}

impl AppliedWatermark {
    /// `start_lsn` is the position already durably applied, i.e. where streaming starts.
    pub fn new(start_lsn: u64) -> Self {
        Self {
            pending: VecDeque::new(),
            applied: start_lsn,
            last_seq: None,
            floor: start_lsn,
            tx: watch::Sender::new(start_lsn),
        }
    }

    /// Announces a transaction in source commit order, before it can complete. Transactions must
    /// be registered in the same order they are submitted to the scheduler.
    pub fn register(&mut self, seq: u64, end_lsn: u64) -> Result<(), WatermarkError> {
        if let Some(last) = self.last_seq {
            if seq <= last {
                return Err(WatermarkError::SeqOutOfOrder { seq, last });
            }
        }
        if end_lsn <= self.floor {
            return Err(WatermarkError::LsnNotAfter {
                seq,
                end_lsn,
                floor: self.floor,
            });
        }
        self.last_seq = Some(seq);
        self.floor = end_lsn;
        self.pending.push_back(Slot {
            seq,
            end_lsn,
            done: false,
        });
        Ok(())
    }

    /// Records that the shadow transaction for `seq` committed. Returns the new applied LSN if
    /// this completion extended the contiguous applied prefix.
    pub fn complete(&mut self, seq: u64) -> Result<Option<u64>, WatermarkError> {
        let idx = self
            .pending
            .binary_search_by_key(&seq, |s| s.seq)
            .map_err(|_| WatermarkError::Unknown(seq))?;
        let slot = &mut self.pending[idx];
        if slot.done {
            return Err(WatermarkError::AlreadyCompleted(seq));
        }
        slot.done = true;

        let mut advanced_to = None;
        while let Some(front) = self.pending.front() {
            if !front.done {
                break;
            }
            advanced_to = Some(front.end_lsn);
            self.pending.pop_front();
        }
        Ok(advanced_to.and_then(|lsn| self.advance(lsn)))
    }

    /// Moves the applied position to `lsn` when nothing registered is outstanding, so a slot
    /// whose stream carries no work for this shard still advances (and the source can recycle
    /// WAL). The caller must only pass a position all of whose transactions it has registered or
    /// deliberately skipped. Returns the new applied LSN if it moved.
    pub fn advance_idle(&mut self, lsn: u64) -> Option<u64> {
        if !self.pending.is_empty() {
            return None;
        }
        self.floor = self.floor.max(lsn);
        self.advance(lsn)
    }

    fn advance(&mut self, lsn: u64) -> Option<u64> {
        if lsn <= self.applied {
            return None;
        }
        self.applied = lsn;
        self.tx.send_replace(lsn);
        trace!(applied_lsn = lsn, "applied watermark advanced");
        Some(lsn)
    }

    /// End LSN of the last transaction of the contiguous applied prefix: the flush/apply position
    /// to report to the source.
    pub fn applied_lsn(&self) -> u64 {
        self.applied
    }

    /// Registered transactions not yet covered by the applied position.
    pub fn pending(&self) -> usize {
        self.pending.len()
    }

    /// Forgets outstanding transactions (they will be streamed again from `applied_lsn`) and
    /// allows seq numbering to start over. The applied position is kept: its transactions are
    /// committed.
    pub fn reset(&mut self) {
        self.pending.clear();
        self.last_seq = None;
        self.floor = self.applied;
    }

    /// A handle other tasks can use to observe or await the applied position.
    pub fn watcher(&self) -> AppliedLsnWatcher {
        AppliedLsnWatcher {
            rx: self.tx.subscribe(),
        }
    }
}

/// Read side of [`AppliedWatermark`], cheap to clone and usable from any task.
#[derive(Debug, Clone)]
pub struct AppliedLsnWatcher {
    rx: watch::Receiver<u64>,
}

impl AppliedLsnWatcher {
    pub fn applied_lsn(&self) -> u64 {
        *self.rx.borrow()
    }

    /// Resolves once the applied position is at least `lsn`, returning that position.
    pub async fn wait_for(&self, lsn: u64) -> Result<u64, WatermarkClosed> {
        let mut rx = self.rx.clone();
        let reached = rx
            .wait_for(|applied| *applied >= lsn)
            .await
            .map(|applied| *applied);
        reached.map_err(|_| WatermarkClosed {
            applied: *rx.borrow(),
            wanted: lsn,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn with(seqs: &[(u64, u64)]) -> AppliedWatermark {
        let mut w = AppliedWatermark::new(0);
        for &(seq, end) in seqs {
            w.register(seq, end).unwrap();
        }
        w
    }

    #[test]
    fn in_order_completion_advances_each_time() {
        let mut w = with(&[(1, 10), (2, 20), (3, 30)]);
        assert_eq!(w.applied_lsn(), 0);
        assert_eq!(w.complete(1), Ok(Some(10)));
        assert_eq!(w.complete(2), Ok(Some(20)));
        assert_eq!(w.complete(3), Ok(Some(30)));
        assert_eq!(w.applied_lsn(), 30);
        assert_eq!(w.pending(), 0);
    }

    #[test]
    fn out_of_order_completion_only_advances_over_a_contiguous_prefix() {
        let mut w = with(&[(1, 10), (2, 20), (3, 30), (4, 40), (5, 50)]);
        assert_eq!(w.complete(3), Ok(None));
        assert_eq!(w.complete(5), Ok(None));
        assert_eq!(w.applied_lsn(), 0);
        assert_eq!(w.complete(2), Ok(None));
        assert_eq!(w.applied_lsn(), 0, "seq 1 is still running");
        assert_eq!(w.complete(1), Ok(Some(30)));
        assert_eq!(w.pending(), 2);
        assert_eq!(w.complete(4), Ok(Some(50)));
        assert_eq!(w.pending(), 0);
    }

    #[test]
    fn seq_gaps_do_not_stall_the_prefix() {
        let mut w = with(&[(2, 20), (7, 70), (8, 80)]);
        assert_eq!(w.complete(7), Ok(None));
        assert_eq!(w.complete(2), Ok(Some(70)));
    }

    #[test]
    fn start_lsn_is_the_initial_position() {
        let mut w = AppliedWatermark::new(500);
        assert_eq!(w.applied_lsn(), 500);
        assert_eq!(
            w.register(1, 500),
            Err(WatermarkError::LsnNotAfter {
                seq: 1,
                end_lsn: 500,
                floor: 500
            })
        );
        w.register(1, 510).unwrap();
        assert_eq!(w.complete(1), Ok(Some(510)));
    }

    #[test]
    fn register_rejects_bad_order() {
        let mut w = with(&[(5, 50)]);
        assert_eq!(
            w.register(5, 60),
            Err(WatermarkError::SeqOutOfOrder { seq: 5, last: 5 })
        );
        assert_eq!(
            w.register(4, 60),
            Err(WatermarkError::SeqOutOfOrder { seq: 4, last: 5 })
        );
        assert_eq!(
            w.register(6, 40),
            Err(WatermarkError::LsnNotAfter {
                seq: 6,
                end_lsn: 40,
                floor: 50
            })
        );
        assert_eq!(w.pending(), 1);
        w.register(6, 60).unwrap();
    }

    #[test]
    fn complete_rejects_unknown_and_repeated() {
        let mut w = with(&[(1, 10), (2, 20)]);
        assert_eq!(w.complete(9), Err(WatermarkError::Unknown(9)));
        assert_eq!(w.complete(2), Ok(None));
        assert_eq!(w.complete(2), Err(WatermarkError::AlreadyCompleted(2)));
        assert_eq!(w.complete(1), Ok(Some(20)));
        // Once folded into the applied prefix, it is no longer known.
        assert_eq!(w.complete(1), Err(WatermarkError::Unknown(1)));
        assert_eq!(w.applied_lsn(), 20);
    }

    #[test]
    fn advance_idle_only_moves_when_nothing_is_outstanding() {
        let mut w = with(&[(1, 10)]);
        assert_eq!(w.advance_idle(100), None);
        assert_eq!(w.applied_lsn(), 0);
        assert_eq!(w.complete(1), Ok(Some(10)));
        assert_eq!(w.advance_idle(100), Some(100));
        assert_eq!(w.advance_idle(90), None, "never backwards");
        assert_eq!(w.applied_lsn(), 100);
        assert_eq!(
            w.register(2, 95),
            Err(WatermarkError::LsnNotAfter {
                seq: 2,
                end_lsn: 95,
                floor: 100
            })
        );
        w.register(2, 120).unwrap();
        assert_eq!(w.complete(2), Ok(Some(120)));
    }

    #[test]
    fn reset_keeps_the_applied_position_and_drops_outstanding_work() {
        let mut w = with(&[(1, 10), (2, 20), (3, 30)]);
        assert_eq!(w.complete(1), Ok(Some(10)));
        assert_eq!(w.complete(3), Ok(None));
        w.reset();
        assert_eq!(w.applied_lsn(), 10);
        assert_eq!(w.pending(), 0);
        assert_eq!(w.complete(3), Err(WatermarkError::Unknown(3)));
        // Restream from LSN 10 with fresh numbering.
        w.register(1, 20).unwrap();
        assert_eq!(w.complete(1), Ok(Some(20)));
    }

    #[test]
    fn watcher_sees_the_current_position() {
        let mut w = with(&[(1, 10)]);
        let watcher = w.watcher();
        assert_eq!(watcher.applied_lsn(), 0);
        w.complete(1).unwrap();
        assert_eq!(watcher.applied_lsn(), 10);
        assert_eq!(watcher.clone().applied_lsn(), 10);
    }

    #[tokio::test(flavor = "current_thread")]
    async fn wait_for_resolves_only_once_the_lsn_is_applied() {
        let mut w = with(&[(1, 10), (2, 20), (3, 30)]);
        let watcher = w.watcher();
        assert_eq!(watcher.wait_for(0).await, Ok(0));

        let waiter = tokio::spawn({
            let watcher = watcher.clone();
            async move { watcher.wait_for(20).await }
        });
        tokio::task::yield_now().await;
        assert_eq!(w.complete(2), Ok(None));
        tokio::task::yield_now().await;
        assert!(!waiter.is_finished(), "seq 1 still outstanding");
        assert_eq!(w.complete(1), Ok(Some(20)));
        let got = tokio::time::timeout(Duration::from_secs(5), waiter)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(got, Ok(20));

        // Overshooting the target also satisfies it.
        let waiter = tokio::spawn({
            let watcher = watcher.clone();
            async move { watcher.wait_for(25).await }
        });
        tokio::task::yield_now().await;
        assert!(!waiter.is_finished());
        w.complete(3).unwrap();
        let got = tokio::time::timeout(Duration::from_secs(5), waiter)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(got, Ok(30));
    }

    #[tokio::test(flavor = "current_thread")]
    async fn wait_for_fails_when_the_watermark_is_dropped() {
        let mut w = with(&[(1, 10), (2, 20)]);
        let watcher = w.watcher();
        w.complete(1).unwrap();
        let waiter = tokio::spawn(async move { watcher.wait_for(20).await });
        tokio::task::yield_now().await;
        drop(w);
        let got = tokio::time::timeout(Duration::from_secs(5), waiter)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(
            got,
            Err(WatermarkClosed {
                applied: 10,
                wanted: 20
            })
        );
    }
}
