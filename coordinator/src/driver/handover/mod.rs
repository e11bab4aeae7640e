//! The handover phase: each mode stops or orders the source's writers its own way
//! ([`lock_abort`], [`wait_remaster`], [`remus`]), then all end in Tm, the ownership transfer
//! transaction defined here, followed by the checks and steps every mode shares.

use std::time::{Duration, Instant};

use tracing::{info, warn};

use remus_proto::names;

use super::{join, quote_literal, sql, DriverError, Run, VerificationFailed, NODE_WAIT};
use crate::failpoint;
use crate::migration::{Mode, Phase};
use crate::node_registry::NodeRecord;
use crate::plan::MigrationPlan;

pub(super) mod albatross;
pub(super) mod lock_abort;
pub(super) mod remus;
pub(super) mod wait_remaster;

impl Run {
    /// See [`super::DriverConfig::verify_handover`].
    pub(super) async fn verify(&self) -> Result<(), DriverError> {
        if !self.config.verify_handover {
            return Ok(());
        }
        let source = self.config.connector.connect(&self.plan.source).await?;
        let target = self.config.connector.connect(&self.plan.target).await?;
        for t in &self.plan.tables {
            let q = format!(
                "SELECT count(*), coalesce(md5(string_agg(h, '' ORDER BY h)), '')
                   FROM (SELECT md5(x::text) AS h FROM {} x) d",
                t.qualified()
            );
            let (s, d) = tokio::try_join!(source.query_one(&q, &[]), target.query_one(&q, &[]))
                .map_err(sql(&self.plan.source))?;
            let s: (i64, String) = (s.get(0), s.get(1));
            let d: (i64, String) = (d.get(0), d.get(1));
            if s != d {
                return Err(DriverError::Verification(Box::new(VerificationFailed {
                    table: t.qualified(),
                    source_node: self.plan.source.name.clone(),
                    source_rows: s.0,
                    source_digest: s.1,
                    target_node: self.plan.target.name.clone(),
                    target_rows: d.0,
                    target_digest: d.1,
                })));
            }
            info!(migration_id = self.id(), phase = "handover", table = %t.qualified(), rows = s.0, digest = %s.1, "handover verified");
        }
        Ok(())
    }

    /// Tm: one transaction per node moves the shards in the map, prepared everywhere; the
    /// decision is the record's move to `cleanup` in etcd; then committed on the target first
    /// (so any node that sees the new owner finds it already committed there), then on every
    /// other node at once, the source among them. Read-through covers every node while the map
    /// is in flux.
    pub(super) async fn tm(&mut self) -> Result<(), DriverError> {
        let id = self.id();
        let order = self.tm_order();
        let ids = join(&self.plan.shard_ids);
        let target = quote_literal(&self.plan.target.name);
        // Every node's Tm session is open before the first PREPARE: from it until each node's
        // COMMIT PREPARED, statements on the moved shards there wait (in doubt), and a new
        // connection to a loaded node costs tens of milliseconds. They are the driver's kept
        // sessions ([`Run::session`]), so cleanup's drain and registration steps find them open.
        let opened = self.sessions_of(&order).await?;
        // Requirement 4: while Tm is in doubt, statements on the moved shards on these nodes
        // wait (remus.in_doubt_wait_timeout); an operator sees why. Written before the first
        // PREPARE (Remus mode: with the phase change to handover), so that no etcd write lies
        // inside the in-doubt window and the note is there if this coordinator stops once the
        // nodes are prepared; the decision clears it.
        if !self.state.tm_noted {
            self.reporter.waiting_on(Some(self.tm_note())).await;
        }
        let started = Instant::now();
        if self.plan.mode == Mode::Remus && !self.state.drain_switched {
            self.switch_drain_source().await?;
        }
        let switched_ms = started.elapsed().as_millis() as u64;
        // The target's map row is taken first (its UPDATE, not yet prepared), then every node
        // prepares at once. The row first: were it held (another session locks it), no node
        // would be in doubt meanwhile, as when every node prepared in turn; while the target's
        // UPDATE is open and not prepared, statements there still route by the old map, which
        // is right until the decision. Then all at once: each PREPARE waits for its node's WAL
        // flush, and a node's in-doubt window lasts from its PREPARE until the last one's.
        self.state.read_through = true;
        self.state.tm_prepared = true;
        let gid = |node: &NodeRecord| quote_literal(&names::tm_gid(id, &node.name));
        let change = format!(
            "BEGIN;
             SELECT remus.begin_read_through({id});
             UPDATE remus.shard_map SET node_name = {target} WHERE shard_id IN ({ids});"
        );
        // The target (first in `order`) ran its change already; the others run theirs here.
        let batches: Vec<String> = order
            .iter()
            .enumerate()
            .map(|(i, node)| {
                let prepare = format!("PREPARE TRANSACTION {};", gid(node));
                if i == 0 {
                    prepare
                } else {
                    format!("{change}\n {prepare}")
                }
            })
            .collect();
        if let (Some(node), Some(c)) = (order.first(), opened.first()) {
            self.prepare_tm_on(node, c, &change).await?;
        }
        let prepared = futures_util::future::join_all(
            order
                .iter()
                .zip(&opened)
                .zip(&batches)
                .map(|((node, c), b)| self.prepare_tm_on(node, c, b)),
        )
        .await;
        prepared.into_iter().collect::<Result<Vec<_>, _>>()?;
        let prepared_ms = started.elapsed().as_millis() as u64;
        let sessions: Vec<(NodeRecord, std::sync::Arc<tokio_postgres::Client>)> =
            order.iter().cloned().zip(opened).collect();
        self.config
            .failpoints
            .pause(failpoint::HANDOVER_TM_PREPARED, id)
            .await;
        // A stream that has already failed is known before the decision: roll back rather
        // than hand over to a target that stopped receiving the source's commits. (One that
        // fails after it is recovered in `cleanup`.)
        if let Some(p) = &self.state.propagator {
            p.check()?;
        }
        // The decision.
        self.reporter.advance(Phase::Cleanup).await?;
        self.state.tm_decided = true;
        self.config
            .failpoints
            .pause(failpoint::HANDOVER_DECIDED, id)
            .await;
        let decided_ms = started.elapsed().as_millis() as u64;
        let started_commits = Instant::now();
        // The target first: a node that sees the new owner then finds it committed there.
        // Every other node, the source among them, at once: each COMMIT PREPARED waits for its
        // node's WAL flush, and a node's statements on the moved shards wait in doubt until its
        // own commit, so committing them one after another (5-33 ms under the anchors' E1)
        // held the last node's clients for the sum of the others' flushes. Nothing orders them
        // among themselves: each routes by its own map, and the target already owns the shards.
        let (first, rest) = sessions.split_first().expect("Tm has a target");
        let target_at = self.commit_tm_on(&first.0, &first.1).await?;
        let rest_at =
            futures_util::future::join_all(rest.iter().map(|(node, c)| self.commit_tm_on(node, c)))
                .await;
        self.state
            .tm_committed_at
            .push((first.0.clone(), target_at));
        for ((node, _), at) in rest.iter().zip(rest_at) {
            self.state.tm_committed_at.push((node.clone(), at?));
        }
        info!(
            migration_id = id,
            phase = "handover",
            switched_ms,
            prepared_ms,
            decided_ms,
            committed_ms = started_commits.elapsed().as_millis() as u64,
            "Tm steps timed"
        );
        // On every node at once (until it ends there, every statement reads the map with its
        // own snapshot). Per migration and idempotent (F13): a retry cannot end another
        // migration's.
        let end_read_through = format!("SELECT remus.end_read_through({id})::text, NULL::text");
        futures_util::future::join_all(
            sessions
                .iter()
                .map(|(node, c)| self.after_decision(node, c, &end_read_through)),
        )
        .await
        .into_iter()
        .collect::<Result<Vec<_>, _>>()?;
        self.state.read_through = false;
        info!(
            migration_id = id,
            phase = "handover",
            "Tm committed on every node"
        );
        Ok(())
    }

    /// Runs `node`'s Tm batch (BEGIN … PREPARE TRANSACTION, or a part of it) on its session `c`.
    async fn prepare_tm_on(
        &self,
        node: &NodeRecord,
        c: &std::sync::Arc<tokio_postgres::Client>,
        batch: &str,
    ) -> Result<(), DriverError> {
        c.batch_execute(batch).await.map_err(|e| {
            // The batch may have stopped inside its transaction block.
            self.forget_session(node, c);
            sql(node)(e)
        })
    }

    /// COMMIT PREPARED of `node`'s Tm, decided, on its Tm session `c`, with the node's map
    /// generation bump pipelined behind it: one round trip. (Two messages: COMMIT PREPARED
    /// cannot share a query string with another statement.) Retried until it commits. Returns
    /// when Tm counts as committed there (text timestamptz; empty if the node did not say).
    async fn commit_tm_on(
        &self,
        node: &NodeRecord,
        c: &tokio_postgres::Client,
    ) -> Result<String, DriverError> {
        let id = self.id();
        let gid = names::tm_gid(id, &node.name);
        let commit = format!("COMMIT PREPARED {}", quote_literal(&gid));
        let (committed, bumped) = tokio::join!(
            c.batch_execute(&commit),
            c.simple_query(BUMP_MAP_GENERATION)
        );
        let at = match (committed, bumped) {
            (Ok(()), Ok(messages)) => messages.iter().find_map(|m| match m {
                tokio_postgres::SimpleQueryMessage::Row(r) => r.get(1).map(str::to_string),
                _ => None,
            }),
            (committed, _) => {
                if let Err(e) = committed {
                    warn!(migration_id = id, phase = "handover", node = %node.name, error = %e, "COMMIT PREPARED of Tm failed; retrying");
                    self.commit_tm_retrying(node, &gid).await?;
                }
                // Committed; the bump failed (or ran before a failed commit): again, on this
                // session or a new one.
                self.after_decision(node, c, BUMP_MAP_GENERATION).await?
            }
        };
        Ok(at.unwrap_or_default())
    }

    /// COMMIT PREPARED of `node`'s Tm once its first attempt failed: decided, so a node that
    /// does not answer is retried (a fresh session each time) until it commits; giving up here
    /// would leave the map split.
    async fn commit_tm_retrying(&self, node: &NodeRecord, gid: &str) -> Result<(), DriverError> {
        let started = Instant::now();
        let mut attempt = 0u32;
        loop {
            tokio::time::sleep(Duration::from_millis(100)).await;
            attempt += 1;
            let r = async {
                let c = self.config.connector.connect(node).await?;
                finish_tm_if_prepared(&c, node, gid, "COMMIT PREPARED").await
            }
            .await;
            match r {
                Ok(()) => return Ok(()),
                Err(_) if attempt < 600 || started.elapsed() < NODE_WAIT => {}
                Err(e) => return Err(e),
            }
        }
    }

    /// The driver's kept session ([`Run::session`]) of each node of `nodes`, in that order.
    pub(super) async fn sessions_of(
        &self,
        nodes: &[NodeRecord],
    ) -> Result<Vec<std::sync::Arc<tokio_postgres::Client>>, DriverError> {
        let mut opened = Vec::with_capacity(nodes.len());
        for node in nodes {
            opened.push(self.session(node).await?);
        }
        Ok(opened)
    }

    /// Tm's in-doubt note for `waiting_on`.
    pub(super) fn tm_note(&self) -> String {
        let names: Vec<String> = self.tm_order().into_iter().map(|n| n.name).collect();
        format!(
            "the ownership change (Tm) is being prepared or is prepared on {} and not yet decided: statements on shards {} there wait for the decision (remus.in_doubt_wait_timeout)",
            names.join(", "),
            join(&self.plan.shard_ids)
        )
    }

    pub(super) fn tm_order(&self) -> Vec<NodeRecord> {
        tm_order(&self.plan)
    }

    /// Runs `query` (two text columns; the second is returned) on `node` after the Tm decision:
    /// on the Tm session, else, if that session or the node went away (a restart also clears
    /// the node's read-through and map cache state, so running it again is harmless), on a new
    /// one once the node answers.
    async fn after_decision(
        &self,
        node: &NodeRecord,
        session: &tokio_postgres::Client,
        query: &str,
    ) -> Result<Option<String>, DriverError> {
        let mut result = session.query_one(query, &[]).await;
        let started = Instant::now();
        loop {
            match result {
                Ok(row) => return Ok(row.get(1)),
                Err(e) if started.elapsed() >= NODE_WAIT => return Err(sql(node)(e)),
                Err(e) => {
                    warn!(migration_id = self.id(), phase = "handover", node = %node.name, error = %e, "step after the Tm decision failed; retrying");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    let c = self.connect_patiently(node, false).await?;
                    result = c.query_one(query, &[]).await;
                }
            }
        }
    }
}

/// After a node's COMMIT PREPARED of Tm: its map generation bump, with the time Tm counts as
/// committed there (two text columns, for [`Run::after_decision`] and the pipelined first try).
const BUMP_MAP_GENERATION: &str =
    "SELECT remus.bump_map_generation()::text, clock_timestamp()::text";

/// Runs `verb` (COMMIT PREPARED or ROLLBACK PREPARED) on a node's Tm transaction if it is still
/// prepared there: every caller may be a retry after the first attempt got through.
pub(super) async fn finish_tm_if_prepared(
    c: &tokio_postgres::Client,
    node: &NodeRecord,
    gid: &str,
    verb: &str,
) -> Result<(), DriverError> {
    let prepared = !c
        .query("SELECT 1 FROM pg_prepared_xacts WHERE gid = $1", &[&gid])
        .await
        .map_err(sql(node))?
        .is_empty();
    if prepared {
        c.batch_execute(&format!("{verb} {}", quote_literal(gid)))
            .await
            .map_err(sql(node))?;
    }
    Ok(())
}
/// The order of Tm's sessions: the target first (its map row is taken, and its Tm committed,
/// before any other node's, so any node that sees the new owner finds it committed there), every
/// other node, the source last (they prepare, and then commit, at once).
fn tm_order(plan: &MigrationPlan) -> Vec<NodeRecord> {
    let mut order = vec![plan.target.clone()];
    order.extend(
        plan.nodes
            .iter()
            .filter(|n| n.name != plan.target.name && n.name != plan.source.name)
            .cloned(),
    );
    order.push(plan.source.clone());
    order
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(name: &str) -> NodeRecord {
        NodeRecord {
            name: name.into(),
            host: "127.0.0.1".into(),
            port: 5432,
        }
    }

    #[test]
    fn tm_goes_to_the_target_first_and_the_source_last() {
        let plan = MigrationPlan {
            mode: Mode::Remus,
            shard_ids: vec![1],
            tables: vec![],
            source: node("n2"),
            target: node("n4"),
            nodes: ["n1", "n2", "n3", "n4"].map(node).to_vec(),
            requested_by: None,
        };
        let order: Vec<String> = tm_order(&plan).into_iter().map(|n| n.name).collect();
        assert_eq!(order, ["n4", "n1", "n3", "n2"]);
    }
}
