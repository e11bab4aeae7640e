//! gRPC from a backend: the coordinator (`api::migrate`) and the replay workers that validate
//! and resolve dual-execution commits (`migration::dual`).
//!
//! `remus.coordinator_address` may list several coordinators, comma-separated; only the leader
//! listens (decision 0010), so [`connect_coordinator`] takes the first that accepts, in order.
//!
//! The clients run on a current-thread tokio runtime owned by the backend. Every wait is sliced
//! so that interrupts (cancel, statement_timeout, terminate) are served within 100 ms, outside
//! the runtime.

use std::cell::RefCell;
use std::collections::HashMap;
use std::future::Future;
use std::time::Duration;

use pgrx::prelude::*;
use remus_proto::v1::coordinator_client::CoordinatorClient;
use remus_proto::v1::replay_worker_client::ReplayWorkerClient;

use crate::error::RemusError;

const SLICE: Duration = Duration::from_millis(100);

/// How long one coordinator address may take to accept: a standby refuses at once, but a dead
/// host must not hold up the next address for long.
const COORDINATOR_CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

thread_local! {
    static RUNTIME: std::cell::OnceCell<tokio::runtime::Runtime> = const { std::cell::OnceCell::new() };
    static CLIENTS: RefCell<HashMap<String, ReplayWorkerClient<tonic::transport::Channel>>> = RefCell::new(HashMap::new());
}

/// Runs `fut` to completion on the backend's runtime, serving interrupts between slices.
/// Meanwhile the backend shows wait event `Extension` in `pg_stat_activity`: a source COMMIT
/// waiting for its validation or its shadow's commit on the destination is a wait, not work.
pub(crate) fn block_on<F: Future>(fut: F) -> Result<F::Output, RemusError> {
    let _waiting = ReportedWait::extension();
    RUNTIME.with(|cell| {
        let rt = match cell.get() {
            Some(rt) => rt,
            None => {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .map_err(|e| RemusError::GrpcRuntime {
                        reason: e.to_string(),
                    })?;
                let _ = cell.set(rt);
                cell.get().expect("just set")
            }
        };
        let mut fut = std::pin::pin!(fut);
        loop {
            match rt.block_on(async { tokio::time::timeout(SLICE, &mut fut).await }) {
                Ok(v) => return Ok(v),
                Err(_) => {
                    // Outside the runtime: an ERROR raised here unwinds only our own frames.
                    check_for_interrupts!();
                }
            }
        }
    })
}

/// This backend's wait event while alive (PostgreSQL 15 offers extensions only the one
/// `Extension`). What `pgstat_report_wait_start` / `_end` do, which are inline in C; an ERROR
/// meanwhile resets it too (the abort path ends any reported wait).
struct ReportedWait;

impl ReportedWait {
    fn extension() -> Self {
        // SAFETY: `my_wait_event_info` points at this backend's own slot (its PGPROC's, or a
        // local one before it has a PGPROC); a plain store, as the C inline does.
        unsafe { *pg_sys::my_wait_event_info = pg_sys::PG_WAIT_EXTENSION };
        ReportedWait
    }
}

impl Drop for ReportedWait {
    fn drop(&mut self) {
        // SAFETY: as in `extension`.
        unsafe { *pg_sys::my_wait_event_info = 0 };
    }
}

/// A client of the replay worker at `endpoint`, made once per backend and endpoint.
pub(crate) fn client_for(
    endpoint: &str,
) -> Result<ReplayWorkerClient<tonic::transport::Channel>, RemusError> {
    if let Some(c) = CLIENTS.with(|c| c.borrow().get(endpoint).cloned()) {
        return Ok(c);
    }
    let channel = tonic::transport::Endpoint::from_shared(endpoint.to_string())
        .map_err(|e| RemusError::BadReplayWorkerEndpoint {
            endpoint: endpoint.to_string(),
            reason: e.to_string(),
        })?
        .connect_timeout(Duration::from_secs(5))
        .connect_lazy();
    let client = ReplayWorkerClient::new(channel)
        .max_decoding_message_size(256 * 1024 * 1024)
        .max_encoding_message_size(256 * 1024 * 1024);
    CLIENTS.with(|c| c.borrow_mut().insert(endpoint.to_string(), client.clone()));
    Ok(client)
}

/// Drops the cached client of `endpoint` (after a failed call), so the next call reconnects.
pub(crate) fn forget_client(endpoint: &str) {
    CLIENTS.with(|c| c.borrow_mut().remove(endpoint));
}

/// The addresses of a `remus.coordinator_address` value, in order: comma-separated, blanks
/// around each ignored, empty entries skipped.
pub(crate) fn coordinator_addresses(setting: &str) -> Vec<&str> {
    setting
        .split(',')
        .map(str::trim)
        .filter(|a| !a.is_empty())
        .collect()
}

/// A client of the first coordinator of `setting` (see [`coordinator_addresses`]) that
/// accepts a connection: the leader. A malformed address is a configuration error at once; when
/// none accepts, the error names each address with its reason.
pub(crate) async fn connect_coordinator(
    setting: &str,
) -> Result<CoordinatorClient<tonic::transport::Channel>, RemusError> {
    let mut failures = Vec::new();
    for address in coordinator_addresses(setting) {
        let endpoint = tonic::transport::Endpoint::from_shared(address.to_string())
            .map_err(|e| RemusError::BadCoordinatorAddress {
                address: address.to_string(),
                reason: e.to_string(),
            })?
            .connect_timeout(COORDINATOR_CONNECT_TIMEOUT);
        match endpoint.connect().await {
            Ok(channel) => return Ok(CoordinatorClient::new(channel)),
            Err(e) => failures.push(format!("{address}: {e}")),
        }
    }
    Err(RemusError::CoordinatorUnreachable {
        address: setting.to_string(),
        reason: if failures.is_empty() {
            "no address given".to_string()
        } else {
            failures.join("; ")
        },
    })
}

#[cfg(test)]
mod tests {
    use super::coordinator_addresses;

    #[test]
    fn coordinator_addresses_are_a_comma_separated_list() {
        assert_eq!(
            coordinator_addresses("http://127.0.0.1:6102"),
            vec!["http://127.0.0.1:6102"]
        );
        assert_eq!(
            coordinator_addresses(" http://a:1 , http://b:2,, "),
            vec!["http://a:1", "http://b:2"]
        );
        assert!(coordinator_addresses(" , ").is_empty());
    }
}
