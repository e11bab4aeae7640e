//! Fault injection built into the migration driver: named places in a migration's run that a
//! test (or an operator reproducing a problem) can make the driver stop at.
//!
//! A failpoint is armed by a file named after it in the coordinator's failpoint directory
//! (`--failpoint-dir`; `remusctl cluster up` passes `DIR/failpoints`). Its content is the action;
//! `pause`: the driver writes `<name>.reached` (holding the migration id) next to it and stops
//! there until the file is removed; `error`: the step the failpoint names fails as if etcd had
//! not answered (see each failpoint), and `<name>.reached` is written each time it does. Files, not an environment
//! variable: several clusters run side by side in one test process, each with its own
//! directory, and a failpoint must be armed and released while the coordinator runs.
//!
//! Unarmed, a failpoint costs one `stat` of a path; without a directory, nothing.

use std::fs;
use std::path::{Path, PathBuf};
use std::time::Duration;

use tracing::{info, warn};

/// How often a paused driver looks whether its failpoint was released.
const POLL: Duration = Duration::from_millis(20);

/// Remus: the sync barrier is set and dual execution has begun; Tm is not prepared yet.
pub const DUAL_STARTED: &str = "dual.started";

/// Tm is prepared on every node and decided (the record is in `cleanup`); no node has
/// committed it yet.
pub const HANDOVER_DECIDED: &str = "handover.decided";

/// The copy's snapshot is exported (the slot exists) and no row has been copied yet.
/// Names start with the phase they are in (the log lines say it as `phase`).
pub const COPY_SNAPSHOT_EXPORTED: &str = "copy.snapshot_exported";

/// `error`: the Tm decision (the record's move to `cleanup`) is written to etcd, but the driver
/// is told the write failed, as when etcd's answer is lost in a leader election.
pub const HANDOVER_DECISION_UNACKNOWLEDGED: &str = "handover.decision_unacknowledged";

/// `error`: after a failed decision write, reading the record back fails too (etcd still
/// unreachable), so the driver cannot tell whether the decision was written.
pub const HANDOVER_DECISION_UNREADABLE: &str = "handover.decision_unreadable";

/// `error`: a migration's end (succeeded, rolled back, failed) is not written to etcd; the
/// record stays `running` in the phase it reached, as when etcd is down at the end.
pub const END_UNRECORDED: &str = "end.unrecorded";

/// `delay <ms>`: the propagator waits this long after shipping each source transaction to the
/// replay worker, so the target replays slower than the source writes (a test of the catch-up's
/// convergence limit, decision 0022). Read again every 500 ms while the stream runs.
pub const CATCHUP_SLOW_REPLAY: &str = "catchup.slow_replay";

/// `delay <ms>`: squall's background pullers pause this long between two pulls instead of the
/// paper's 200 ms (a test of the reactive pull: a target transaction that needs the shard cuts
/// the pause short). Read again before every pause.
pub const SQUALL_SLOW_PULL: &str = "squall.slow_pull";

/// The failpoints of one coordinator.
#[derive(Clone, Debug, Default)]
pub struct Failpoints {
    dir: Option<PathBuf>,
}

#[derive(Debug, PartialEq, Eq)]
enum Action {
    Pause,
    Error,
    Delay(Duration),
}

impl Failpoints {
    /// No failpoint can be armed.
    pub fn disabled() -> Self {
        Failpoints { dir: None }
    }

    /// Failpoints armed by files in `dir` (which need not exist yet).
    pub fn in_dir(dir: impl Into<PathBuf>) -> Self {
        Failpoints {
            dir: Some(dir.into()),
        }
    }

    fn armed(&self, name: &str) -> Option<(PathBuf, Action)> {
        let path = self.dir.as_deref()?.join(name);
        let text = fs::read_to_string(&path).ok()?;
        match text.trim() {
            "pause" => Some((path, Action::Pause)),
            "error" => Some((path, Action::Error)),
            other if other.starts_with("delay ") => match other["delay ".len()..].trim().parse() {
                Ok(ms) => Some((path, Action::Delay(Duration::from_millis(ms)))),
                Err(_) => {
                    warn!(
                        failpoint = name,
                        action = other,
                        "delay without milliseconds ignored"
                    );
                    None
                }
            },
            other => {
                // A typo must not pass silently as "not armed" in a test that relies on it.
                warn!(
                    failpoint = name,
                    action = other,
                    "unknown failpoint action ignored (known: pause, error, delay <ms>)"
                );
                None
            }
        }
    }

    /// Stops the calling thread while `name` is armed with `pause`. For the driver's blocking
    /// sections (the copy runs on a blocking thread).
    pub fn pause_blocking(&self, name: &str, migration_id: u64) {
        if let Some((path, Action::Pause)) = self.armed(name) {
            announce(&path, name, migration_id);
            while path.exists() {
                std::thread::sleep(POLL);
            }
            released(&path, name, migration_id);
        }
    }

    /// Waits while `name` is armed with `pause`, without holding a runtime thread.
    pub async fn pause(&self, name: &str, migration_id: u64) {
        if let Some((path, Action::Pause)) = self.armed(name) {
            announce(&path, name, migration_id);
            while path.exists() {
                tokio::time::sleep(POLL).await;
            }
            released(&path, name, migration_id);
        }
    }

    /// The delay `name` is armed with (`delay <ms>`), if any.
    pub fn delay(&self, name: &str) -> Option<Duration> {
        match self.armed(name) {
            Some((_, Action::Delay(d))) => Some(d),
            _ => None,
        }
    }

    /// True when `name` is armed with `error`: the caller then fails the step the failpoint
    /// names. The reached marker stays, so that a test sees the failure happened.
    pub fn fails(&self, name: &str, migration_id: u64) -> bool {
        match self.armed(name) {
            Some((path, Action::Error)) => {
                warn!(
                    migration_id,
                    phase = phase_of(name),
                    failpoint = name,
                    "failing at failpoint"
                );
                let _ = fs::write(reached_marker(&path), migration_id.to_string());
                true
            }
            _ => false,
        }
    }
}

fn reached_marker(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(".reached");
    path.with_file_name(name)
}

/// The phase a failpoint is in: its name up to the first dot.
fn phase_of(name: &str) -> &str {
    name.split('.').next().unwrap_or(name)
}

fn announce(path: &Path, name: &str, migration_id: u64) {
    info!(
        migration_id,
        phase = phase_of(name),
        failpoint = name,
        "paused at failpoint; remove {} to go on",
        path.display()
    );
    if let Err(e) = fs::write(reached_marker(path), migration_id.to_string()) {
        warn!(migration_id, phase = phase_of(name), failpoint = name, error = %e, "could not write the failpoint's reached marker");
    }
}

fn released(path: &Path, name: &str, migration_id: u64) {
    let _ = fs::remove_file(reached_marker(path));
    info!(
        migration_id,
        phase = phase_of(name),
        failpoint = name,
        "failpoint released"
    );
}

/// Catch-up: the stream runs and one catch-up round has been applied on the target; the sync
/// barrier is not set yet.
pub const CATCHUP_RUNNING: &str = "catchup.running";

/// Remus: the source is in sync mode (`remus.sync_barrier` returned) and the target has not
/// yet been waited for up to the barrier; dual execution has not been announced.
pub const BARRIER_SET: &str = "barrier.set";

/// Tm is prepared on every node and not decided yet (the record is still in `handover`).
pub const HANDOVER_TM_PREPARED: &str = "handover.tm_prepared";

/// albatross: the shards are suspended on every node and the transactions in flight on them
/// have drained; the last delta and Tm are still to come.
pub const HANDOVER_ALBATROSS_DRAINED: &str = "handover.albatross_drained";

/// Tm is committed on every node and cleanup has not begun its drain yet.
pub const CLEANUP_STARTED: &str = "cleanup.started";

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    #[test]
    fn unarmed_and_disabled_failpoints_do_not_stop() {
        let dir = tempfile::tempdir().unwrap();
        Failpoints::disabled().pause_blocking("x", 1);
        Failpoints::in_dir(dir.path()).pause_blocking("x", 1);
        Failpoints::in_dir(dir.path().join("missing")).pause_blocking("x", 1);
        assert!(!dir.path().join("x.reached").exists());
    }

    #[test]
    fn an_unknown_action_is_not_a_pause() {
        let dir = tempfile::tempdir().unwrap();
        fs::write(dir.path().join("x"), "sleep").unwrap();
        Failpoints::in_dir(dir.path()).pause_blocking("x", 1);
        assert!(!dir.path().join("x.reached").exists());
    }

    #[test]
    fn a_pause_holds_until_released_and_says_where_it_is() {
        let dir = tempfile::tempdir().unwrap();
        let armed = dir.path().join("copy.snapshot_exported");
        fs::write(&armed, "pause\n").unwrap();
        let fp = Failpoints::in_dir(dir.path());
        let paused = std::thread::spawn(move || fp.pause_blocking("copy.snapshot_exported", 42));
        let marker = dir.path().join("copy.snapshot_exported.reached");
        let started = Instant::now();
        while !marker.exists() {
            assert!(started.elapsed() < Duration::from_secs(10), "never reached");
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(fs::read_to_string(&marker).unwrap(), "42");
        std::thread::sleep(Duration::from_millis(100));
        assert!(!paused.is_finished(), "went on while armed");
        fs::remove_file(&armed).unwrap();
        paused.join().unwrap();
        assert!(!marker.exists(), "the marker outlived the pause");
    }

    #[tokio::test]
    async fn the_async_pause_holds_until_released() {
        let dir = tempfile::tempdir().unwrap();
        let armed = dir.path().join("p");
        fs::write(&armed, "pause").unwrap();
        let fp = Failpoints::in_dir(dir.path());
        let paused = tokio::spawn(async move { fp.pause("p", 7).await });
        let marker = dir.path().join("p.reached");
        while !marker.exists() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert!(!paused.is_finished());
        fs::remove_file(&armed).unwrap();
        tokio::time::timeout(Duration::from_secs(10), paused)
            .await
            .unwrap()
            .unwrap();
    }
}
