//! Leader election among coordinators of one cluster (decision 0010).
//!
//! Several `remus-coordinator` processes may run against the same etcd; one of them, the
//! leader, serves the gRPC API and drives migrations, the others wait. Each process takes an
//! etcd lease (`--lease-ttl-secs`), keeps it alive, and campaigns with etcd's election API under
//! `/remus/<cluster>/coordinator_leader` with that lease; etcd makes the campaign of the oldest
//! live lease the leader. A standby does not listen on its gRPC port at all, so a client given
//! several addresses (`remus.coordinator_address`, `remusctl`) is refused at once by a standby
//! and goes on to the next address.
//!
//! When the leader's lease lapses (the process died: kill -9, or it cannot reach etcd), etcd
//! deletes its election key at the lease's end and the oldest standby's campaign returns: it
//! resumes its predecessor's migrations (`resume::resume_all`: past the Tm decision they
//! complete, before it they roll back) and then serves.
//!
//! A leader that cannot renew its lease must stop driving migrations before etcd can elect
//! another: the keeper counts the lease's end from the moment it *sent* the last renewal that
//! etcd acknowledged, which is never later than the moment etcd counts from, and when that end
//! comes without a newer acknowledgement the process replaces itself (`exec` of its own binary
//! with its own arguments, same PID): every driver task, propagator thread and connection dies
//! with the old image, and the new one campaigns again as a standby. So at any instant at most
//! one process drives migrations, up to the residue documented in decision 0010 (an etcd write
//! already on the wire when the old image ends; the migration store's compare-and-swap on each
//! record's revision refuses it once the new leader has written the record).

use std::os::unix::process::CommandExt;
use std::time::Duration;

use etcd_client::Client;
use tokio::time::{timeout, Instant};
use tracing::{error, info, warn};

/// Logged once by a coordinator that starts as a standby; `remusctl cluster up` waits for it
/// (a standby has no port to probe).
pub const STANDBY_LINE: &str = "coordinator is standby, waiting for the leadership";

/// Logged by a coordinator that has won the leadership, before it resumes and serves.
pub const LEADER_LINE: &str = "coordinator is the leader";

/// The election's name (a key prefix) in etcd for cluster `cluster`.
pub fn election_name(cluster: &str) -> String {
    format!("/remus/{cluster}/coordinator_leader")
}

/// How often the lease is renewed: five times per TTL, so that four renewals in a row can be
/// lost (or late on a loaded machine) before the leadership is given up.
fn renew_interval(ttl: Duration) -> Duration {
    (ttl / 5).max(Duration::from_millis(100))
}

/// Connects to etcd, waiting for it as long as it takes: a coordinator that replaced itself
/// because etcd was down must come back once etcd does, not exit.
pub async fn connect_etcd(endpoint: &str) -> Client {
    let mut logged = false;
    loop {
        match Client::connect([endpoint], None).await {
            Ok(mut c) => match timeout(Duration::from_secs(2), c.status()).await {
                Ok(Ok(_)) => return c,
                Ok(Err(e)) if !logged => {
                    warn!(etcd = endpoint, error = %e, "etcd does not answer; waiting for it");
                    logged = true;
                }
                Err(_) if !logged => {
                    warn!(etcd = endpoint, "etcd does not answer; waiting for it");
                    logged = true;
                }
                _ => {}
            },
            Err(e) if !logged => {
                warn!(etcd = endpoint, error = %e, "cannot connect to etcd; waiting for it");
                logged = true;
            }
            Err(_) => {}
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Takes a lease of `ttl`, keeps it alive (see the module doc: losing it replaces the process)
/// and campaigns with it; returns once this process is the leader. `value` names this
/// coordinator in the election (its gRPC address), for operators reading etcd.
pub async fn become_leader(mut etcd: Client, cluster: &str, value: &str, ttl: Duration) -> i64 {
    let ttl_secs = ttl.as_secs().max(1) as i64;
    let lease = loop {
        let sent = Instant::now();
        match timeout(Duration::from_secs(5), etcd.lease_grant(ttl_secs, None)).await {
            Ok(Ok(l)) => break (l.id(), sent + Duration::from_secs(l.ttl().max(0) as u64)),
            Ok(Err(e)) => warn!(error = %e, "cannot take an etcd lease; trying again"),
            Err(_) => warn!("etcd did not grant a lease in time; trying again"),
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    let (lease_id, valid_until) = lease;
    tokio::spawn(keep_alive(etcd.clone(), lease_id, valid_until, ttl));
    let name = election_name(cluster);
    // Only to say so in the log: the campaign below is what decides.
    if let Ok(Ok(current)) = timeout(Duration::from_secs(2), etcd.leader(name.as_str())).await {
        if let Some(kv) = current.kv() {
            if kv.lease() != lease_id {
                info!(
                    leader = %String::from_utf8_lossy(kv.value()),
                    election = %name,
                    "{STANDBY_LINE}"
                );
            }
        }
    }
    loop {
        // Blocks until every older campaign's key is gone (its lease ended).
        match etcd.campaign(name.as_str(), value, lease_id).await {
            Ok(resp) => {
                let key = resp
                    .leader()
                    .map(|k| String::from_utf8_lossy(k.key()).into_owned())
                    .unwrap_or_default();
                info!(election = %name, key = %key, lease = lease_id, "{LEADER_LINE}");
                return lease_id;
            }
            Err(e) => {
                // etcd restarting, or the connection broke: campaign again with the same lease
                // (the keeper replaces the process if the lease itself is gone).
                warn!(error = %e, election = %name, "campaign interrupted; campaigning again");
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        }
    }
}

/// Renews the lease every `renew_interval(ttl)` until it cannot be kept: then the process is
/// replaced (standby or leader alike; a standby whose lease lapsed lost its place in the
/// election and simply campaigns again).
async fn keep_alive(mut etcd: Client, lease_id: i64, mut valid_until: Instant, ttl: Duration) {
    let every = renew_interval(ttl);
    let mut stream = None;
    loop {
        if Instant::now() >= valid_until {
            replace_process(
                lease_id,
                "the etcd lease could not be renewed before it ended",
            );
        }
        if stream.is_none() {
            match timeout(every, etcd.lease_keep_alive(lease_id)).await {
                Ok(Ok(s)) => stream = Some(s),
                Ok(Err(e)) => warn!(lease = lease_id, error = %e, "lease keep-alive stream failed"),
                Err(_) => warn!(
                    lease = lease_id,
                    "lease keep-alive stream not opened in time"
                ),
            }
        }
        if let Some((keeper, responses)) = stream.as_mut() {
            let sent = Instant::now();
            let renewed = async {
                keeper.keep_alive().await?;
                responses.message().await
            };
            match timeout(every, renewed).await {
                Ok(Ok(Some(r))) if r.ttl() > 0 => {
                    valid_until = sent + Duration::from_secs(r.ttl() as u64);
                }
                Ok(Ok(Some(_))) => {
                    replace_process(lease_id, "etcd says the lease has ended");
                }
                Ok(Ok(None)) | Ok(Err(_)) => {
                    warn!(
                        lease = lease_id,
                        "lease keep-alive stream ended; reopening it"
                    );
                    stream = None;
                }
                Err(_) => warn!(lease = lease_id, "lease renewal not acknowledged in time"),
            }
        }
        tokio::time::sleep_until((Instant::now() + every).min(valid_until)).await;
    }
}

/// Ends this process image at once and starts the same binary with the same arguments in its
/// place (same PID, so whatever supervises it by PID still does).
fn replace_process(lease_id: i64, why: &str) -> ! {
    error!(
        lease = lease_id,
        reason = why,
        "leadership lost or unsure: stopping every migration of this process now and starting again as a standby"
    );
    let mut args = std::env::args_os();
    let argv0 = args.next().unwrap_or_else(|| "remus-coordinator".into());
    // /proc/self/exe still names this binary if its file was replaced by a rebuild.
    let err = std::process::Command::new("/proc/self/exe")
        .arg0(argv0)
        .args(args)
        .exec();
    error!(error = %err, "cannot start the coordinator again; exiting");
    std::process::exit(70)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renewals_are_five_per_ttl() {
        assert_eq!(
            renew_interval(Duration::from_secs(5)),
            Duration::from_secs(1)
        );
        assert_eq!(
            renew_interval(Duration::from_millis(200)),
            Duration::from_millis(100)
        );
    }

    #[test]
    fn election_is_per_cluster() {
        assert_eq!(election_name("local"), "/remus/local/coordinator_leader");
    }
}
