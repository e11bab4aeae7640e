//! Small helpers for talking to the coordinator over gRPC.

use anyhow::{Context, Result};
use remus_proto::v1::coordinator_client::CoordinatorClient;
use remus_proto::v1::{HealthRequest, HealthResponse};
use tonic::transport::Channel;

pub async fn connect(endpoint: &str) -> Result<CoordinatorClient<Channel>> {
    CoordinatorClient::connect(endpoint.to_string())
        .await
        .with_context(|| format!("connecting to the coordinator at {endpoint}"))
}

pub async fn health(endpoint: &str) -> Result<HealthResponse> {
    let mut c = connect(endpoint).await?;
    Ok(c.health(HealthRequest {}).await?.into_inner())
}
