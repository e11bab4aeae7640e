//! Conversion of an assembled [`CommittedTxn`] into the `ShadowTxn` message of the
//! `ReplayWorker` protocol.
//!
//! The replay worker runs elsewhere and has none of the session state of the replication stream
//! (no relation cache, no OIDs), so every change is shipped self-describing: qualified table
//! name, all column names, which columns form the key, and the old/new values in pgoutput's text
//! representation. The destination coerces the text to its own column types, which keeps the
//! wire format independent of type OIDs (that differ between nodes for extension types).
//!
//! Values are shipped as text because the propagator never asks pgoutput for the `binary`
//! option; a binary value (which would need the sender's type knowledge) cannot occur and is
//! converted lossily should it ever appear. Databases are UTF-8 (proto strings are UTF-8).

use std::sync::Arc;

use remus_proto::v1::{column_value, row_change, ColumnValue as PbValue, RowChange, ShadowTxn};

use crate::assembler::{Change, CommittedTxn};
use crate::pgoutput::{ColumnValue, OldTuple, Relation, TupleData};
use crate::snapshot_copy::qualified_name;

/// pgoutput sends an empty namespace for `pg_catalog`.
fn schema_of(rel: &Relation) -> &str {
    if rel.namespace.is_empty() {
        "pg_catalog"
    } else {
        &rel.namespace
    }
}

fn value(v: &ColumnValue) -> PbValue {
    let value = match v {
        ColumnValue::Null => column_value::Value::Null(true),
        ColumnValue::UnchangedToast => column_value::Value::UnchangedToast(true),
        ColumnValue::Text(b) | ColumnValue::Binary(b) => {
            debug_assert!(
                matches!(v, ColumnValue::Text(_)),
                "binary pgoutput values are never requested"
            );
            column_value::Value::Text(String::from_utf8_lossy(b).into_owned())
        }
    };
    PbValue { value: Some(value) }
}

fn values(t: &TupleData) -> Vec<PbValue> {
    t.columns.iter().map(value).collect()
}

fn row_change(
    kind: row_change::Kind,
    rel: &Arc<Relation>,
    old: Option<&OldTuple>,
    new: Option<&TupleData>,
) -> RowChange {
    RowChange {
        kind: kind as i32,
        schema: schema_of(rel).to_string(),
        table: rel.name.clone(),
        columns: rel.columns.iter().map(|c| c.name.clone()).collect(),
        key: rel.columns.iter().map(|c| c.is_key()).collect(),
        old_values: old.map_or_else(Vec::new, |o| values(o.tuple())),
        new_values: new.map_or_else(Vec::new, values),
        truncate_tables: Vec::new(),
    }
}

/// The `ShadowTxn` for one committed source transaction of the stream of migration
/// `migration_id`, changes in source order.
///
/// A transaction pg_remus validated through MOCC for this migration (marked by a transactional
/// logical message with the prefix [`MESSAGE_PREFIX`](remus_proto::names::MESSAGE_PREFIX) whose
/// content is one of this migration's shadow gids, see [`CommittedTxn::is_remus_marked`]) is
/// still shipped, with `shadow_gid` set to that gid: the replay worker then commits the prepared
/// shadow named by it instead of applying the changes again, and the changes still order
/// dependent transactions. A `remus` message of another migration from the same source (PG 15
/// sends it to every slot) does not name a shadow of this migration: the transaction is shipped
/// without a gid and its changes are applied. Other logical messages are not part of the shadow
/// transaction.
pub fn shadow_txn(txn: &CommittedTxn, migration_id: u64) -> ShadowTxn {
    use row_change::Kind;
    let changes = txn
        .changes
        .iter()
        .map(|change| match change {
            Change::Insert { relation, new } => row_change(Kind::Insert, relation, None, Some(new)),
            Change::Update { relation, old, new } => {
                row_change(Kind::Update, relation, old.as_ref(), Some(new))
            }
            Change::Delete { relation, old } => row_change(Kind::Delete, relation, Some(old), None),
            Change::Truncate { relations, .. } => RowChange {
                kind: Kind::Truncate as i32,
                truncate_tables: relations
                    .iter()
                    .map(|r| qualified_name(schema_of(r), &r.name))
                    .collect(),
                ..RowChange::default()
            },
        })
        .collect();
    ShadowTxn {
        xid: txn.xid,
        commit_lsn: txn.commit_lsn.0,
        end_lsn: txn.end_lsn.0,
        commit_time_us: txn.commit_time_us,
        changes,
        shadow_gid: txn
            .shadow_gid(migration_id)
            .map(str::to_owned)
            .unwrap_or_default(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::assembler::TxnMessage;
    use crate::pgoutput::{Column, Lsn, ReplicaIdentity};
    use bytes::Bytes;
    use remus_proto::names::MESSAGE_PREFIX;

    fn rel(namespace: &str, name: &str) -> Arc<Relation> {
        let col = |name: &str, key: bool| Column {
            flags: if key { Column::KEY } else { 0 },
            name: name.into(),
            type_oid: 23,
            type_modifier: -1,
        };
        Arc::new(Relation {
            oid: 16384,
            namespace: namespace.into(),
            name: name.into(),
            replica_identity: ReplicaIdentity::Default,
            columns: vec![col("id", true), col("v", false), col("blob", false)],
        })
    }

    fn text(s: &str) -> ColumnValue {
        ColumnValue::Text(Bytes::copy_from_slice(s.as_bytes()))
    }

    fn pb_text(s: &str) -> PbValue {
        PbValue {
            value: Some(column_value::Value::Text(s.into())),
        }
    }

    fn pb_null() -> PbValue {
        PbValue {
            value: Some(column_value::Value::Null(true)),
        }
    }

    fn txn(changes: Vec<Change>) -> CommittedTxn {
        CommittedTxn {
            xid: 742,
            begin_final_lsn: Lsn(0x16B_3748),
            commit_lsn: Lsn(0x16B_3748),
            end_lsn: Lsn(0x16B_3778),
            commit_time_us: 812_345_678_901_234,
            origin: None,
            changes,
            messages: Vec::new(),
        }
    }

    #[test]
    fn header_fields_are_copied() {
        let s = shadow_txn(&txn(Vec::new()), 7);
        assert_eq!(s.xid, 742);
        assert_eq!(s.commit_lsn, 0x16B_3748);
        assert_eq!(s.end_lsn, 0x16B_3778);
        assert_eq!(s.commit_time_us, 812_345_678_901_234);
        assert!(s.changes.is_empty());
        assert!(
            s.shadow_gid.is_empty(),
            "an unmarked transaction names no shadow"
        );
    }

    fn message(prefix: &str, content: &str) -> TxnMessage {
        TxnMessage {
            after_changes: 1,
            lsn: Lsn(0x16B_3760),
            prefix: prefix.into(),
            content: Bytes::copy_from_slice(content.as_bytes()),
        }
    }

    #[test]
    fn a_remus_marked_transaction_names_its_prepared_shadow_and_keeps_its_changes() {
        let r = rel("app", "accounts");
        let mut t = txn(vec![Change::Insert {
            relation: r,
            new: TupleData::new(vec![text("1"), text("a"), ColumnValue::Null]),
        }]);
        t.messages = vec![
            message("other_ext", "not a gid"),
            message(MESSAGE_PREFIX, "remus:7:123456789"),
        ];
        assert!(t.is_remus_marked(7));
        let s = shadow_txn(&t, 7);
        assert_eq!(s.shadow_gid, "remus:7:123456789");
        assert_eq!(
            s.changes.len(),
            1,
            "the changes still order dependent transactions"
        );

        // A message with another prefix does not mark the transaction.
        t.messages = vec![message("remusx", "remus:7:1")];
        assert!(!t.is_remus_marked(7));
        assert_eq!(shadow_txn(&t, 7).shadow_gid, "");
    }

    fn teller_update() -> Change {
        Change::Update {
            relation: rel("public", "pgbench_tellers"),
            old: None,
            new: TupleData::new(vec![text("40"), text("-17"), ColumnValue::Null]),
        }
    }

    /// Finding F1: PG 15 sends the `remus` message migration 7's validation wrote to every slot
    /// on the source, so migration 8's stream sees it too. It names no shadow of migration 8:
    /// the transaction is shipped without a gid, so the replay worker applies its changes.
    #[test]
    fn another_migrations_remus_message_names_no_shadow_and_the_changes_are_applied() {
        let mut t = txn(vec![teller_update()]);
        t.messages = vec![message(MESSAGE_PREFIX, "remus:7:1")];
        let s = shadow_txn(&t, 8);
        assert_eq!(
            s.shadow_gid, "",
            "migration 7's gid is not migration 8's shadow"
        );
        let [c] = &s.changes[..] else {
            panic!("the change is shipped: {:?}", s.changes)
        };
        assert_eq!(c.kind(), row_change::Kind::Update);
        assert_eq!(c.table, "pgbench_tellers");
        assert_eq!(c.new_values, [pb_text("40"), pb_text("-17"), pb_null()]);
        // Exactly what the same transaction without any message ships.
        assert_eq!(s, shadow_txn(&txn(vec![teller_update()]), 8));

        // For migration 7 itself it names the prepared shadow.
        assert_eq!(shadow_txn(&t, 7).shadow_gid, "remus:7:1");
        assert_eq!(shadow_txn(&t, 7).changes, s.changes);
    }

    /// A transaction validated for two migrations carries both messages; each stream ships its
    /// own gid, not the first one.
    #[test]
    fn each_migration_ships_its_own_gid_not_the_first() {
        let mut t = txn(vec![teller_update()]);
        t.messages = vec![
            message(MESSAGE_PREFIX, "remus:7:1"),
            message("other_ext", "remus:8:2"),
            message(MESSAGE_PREFIX, "remus:8:1"),
        ];
        assert_eq!(shadow_txn(&t, 8).shadow_gid, "remus:8:1");
        assert_eq!(shadow_txn(&t, 7).shadow_gid, "remus:7:1");
        assert_eq!(shadow_txn(&t, 9).shadow_gid, "");
        assert_eq!(shadow_txn(&t, 9).changes.len(), 1);
    }

    #[test]
    fn insert_update_delete_carry_columns_keys_and_values() {
        let r = rel("app", "accounts");
        let t = txn(vec![
            Change::Insert {
                relation: r.clone(),
                new: TupleData::new(vec![text("1"), text("it's"), ColumnValue::Null]),
            },
            Change::Update {
                relation: r.clone(),
                old: None,
                new: TupleData::new(vec![text("1"), text("x"), ColumnValue::UnchangedToast]),
            },
            Change::Update {
                relation: r.clone(),
                old: Some(OldTuple::Key(TupleData::new(vec![
                    text("1"),
                    ColumnValue::Null,
                    ColumnValue::Null,
                ]))),
                new: TupleData::new(vec![text("2"), text("x"), ColumnValue::UnchangedToast]),
            },
            Change::Delete {
                relation: r,
                old: OldTuple::Key(TupleData::new(vec![
                    text("2"),
                    ColumnValue::Null,
                    ColumnValue::Null,
                ])),
            },
        ]);
        let s = shadow_txn(&t, 7);
        assert_eq!(s.changes.len(), 4);
        for c in &s.changes {
            assert_eq!(c.schema, "app");
            assert_eq!(c.table, "accounts");
            assert_eq!(c.columns, ["id", "v", "blob"]);
            assert_eq!(c.key, [true, false, false]);
            assert!(c.truncate_tables.is_empty());
        }
        let [ins, upd, upd_key, del] = &s.changes[..] else {
            unreachable!()
        };
        assert_eq!(ins.kind(), row_change::Kind::Insert);
        assert!(ins.old_values.is_empty());
        assert_eq!(ins.new_values, [pb_text("1"), pb_text("it's"), pb_null()]);

        assert_eq!(upd.kind(), row_change::Kind::Update);
        assert!(upd.old_values.is_empty(), "key unchanged: no old tuple");
        assert_eq!(
            upd.new_values[2].value,
            Some(column_value::Value::UnchangedToast(true))
        );

        assert_eq!(upd_key.old_values, [pb_text("1"), pb_null(), pb_null()]);
        assert_eq!(upd_key.new_values[0], pb_text("2"));

        assert_eq!(del.kind(), row_change::Kind::Delete);
        assert_eq!(del.old_values, [pb_text("2"), pb_null(), pb_null()]);
        assert!(del.new_values.is_empty());
    }

    #[test]
    fn truncate_lists_quoted_qualified_names() {
        let t = txn(vec![Change::Truncate {
            relations: vec![
                rel("public", "a"),
                rel("My \"Schema\"", "b.c"),
                rel("", "x"),
            ],
            options: 0,
        }]);
        let s = shadow_txn(&t, 7);
        let [c] = &s.changes[..] else { unreachable!() };
        assert_eq!(c.kind(), row_change::Kind::Truncate);
        assert_eq!(
            c.truncate_tables,
            [
                "\"public\".\"a\"",
                "\"My \"\"Schema\"\"\".\"b.c\"",
                "\"pg_catalog\".\"x\""
            ]
        );
        assert!(c.columns.is_empty() && c.new_values.is_empty() && c.old_values.is_empty());
    }
}
