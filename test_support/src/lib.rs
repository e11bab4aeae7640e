//! Harnesses for pg_remus tests, shared by every crate's test suite (a dev-dependency, or a
//! dependency of the `integration` crate):
//!
//! - [`ports`]: blocks of loopback ports below the ephemeral range, reserved for as long as a
//!   test needs them, also against other test processes running at the same time;
//! - [`pg`]: throwaway PostgreSQL 15 servers;
//! - `etcd` (feature `etcd`): a throwaway etcd;
//! - `cluster` (feature `cluster`): a whole local cluster started with the real `remusctl`;
//! - [`sqlstate`] and [`wait_until`]/[`wait_for`], the helpers tests kept copying.

use std::time::{Duration, Instant};

#[cfg(feature = "cluster")]
pub mod cluster;
#[cfg(feature = "etcd")]
pub mod etcd;
pub mod pg;
pub mod ports;

/// The SQLSTATE of a server error, or a text that names the error when there is none (a
/// connection error), so that comparing it with an expected code fails with the cause.
pub fn sqlstate(e: &postgres::Error) -> String {
    e.code()
        .map(|c| c.code().to_string())
        .unwrap_or_else(|| format!("no SQLSTATE: {e:?}"))
}

/// Polls `probe` every `every` until it returns `Some`, and returns that. When `limit` has
/// passed since the first probe and the latest probe returned `None`, the test fails with
/// `timeout()` (computed only then, so it can carry logs read at that moment).
pub fn wait_for<T>(
    limit: Duration,
    every: Duration,
    mut probe: impl FnMut() -> Option<T>,
    timeout: impl FnOnce() -> String,
) -> T {
    let started = Instant::now();
    loop {
        if let Some(v) = probe() {
            return v;
        }
        assert!(started.elapsed() < limit, "{}", timeout());
        std::thread::sleep(every);
    }
}

/// [`wait_for`] a condition: polls `cond` every `every` until it holds; fails the test with
/// `timeout()` once `limit` has passed.
pub fn wait_until(
    limit: Duration,
    every: Duration,
    mut cond: impl FnMut() -> bool,
    timeout: impl FnOnce() -> String,
) {
    wait_for(limit, every, || cond().then_some(()), timeout)
}
