//! Small helpers for talking to the coordinator over gRPC.

use std::time::Duration;

use anyhow::{anyhow, Result};
use remus_proto::v1::coordinator_client::CoordinatorClient;
use remus_proto::v1::{HealthRequest, HealthResponse};
use tonic::transport::{Channel, Endpoint};

/// How long one address may take to accept: a standby coordinator does not listen (refused at
/// once), a dead host should not hold up the next address for long.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

/// Connects to the first coordinator of `endpoints` (comma-separated, tried in order) that
/// accepts: only the leader listens (`crate::leader`).
pub async fn connect(endpoints: &str) -> Result<CoordinatorClient<Channel>> {
    let mut failures = Vec::new();
    for endpoint in endpoints
        .split(',')
        .map(str::trim)
        .filter(|e| !e.is_empty())
    {
        let attempt = async {
            Endpoint::from_shared(endpoint.to_string())?
                .connect_timeout(CONNECT_TIMEOUT)
                .connect()
                .await
        };
        match attempt.await {
            Ok(channel) => return Ok(CoordinatorClient::new(channel)),
            Err(e) => failures.push(format!("{endpoint}: {:#}", anyhow::Error::from(e))),
        }
    }
    Err(anyhow!(
        "connecting to the coordinator at {endpoints}: {}",
        if failures.is_empty() {
            "no address given".to_string()
        } else {
            failures.join("; ")
        }
    ))
}

pub async fn health(endpoint: &str) -> Result<HealthResponse> {
    let mut c = connect(endpoint).await?;
    Ok(c.health(HealthRequest {}).await?.into_inner())
}
