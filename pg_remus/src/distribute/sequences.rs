//! Sequences of distributed tables: one disjoint range of each sequence per node (decision 0019).
//!
//! A `bigserial` column (or a bigint column whose default is `nextval('s'::regclass)` of a bigint
//! sequence) keeps its default on a distributed table, and a `bigint GENERATED {ALWAYS | BY
//! DEFAULT} AS IDENTITY` column its identity. The sequence exists on every node (the shell's
//! default names it; an identity is added to the other nodes' shells with its sequence, same
//! name, by `ALTER TABLE … ADD GENERATED … AS IDENTITY (SEQUENCE NAME …)`), and each node's copy
//! hands out only its node's range: slot `k` owns `[k·2^48, (k+1)·2^48 − 1]`. At distribution
//! the members sorted by name get slots 1, 2, … (the slot is recorded nowhere but in each copy's
//! MINVALUE / MAXVALUE); slot 0 keeps the values the sequence handed out before distribution,
//! so the originating node's sequence is restarted at its slot's start and never repeats a
//! value its rows already hold.
//!
//! A default is evaluated where the statement that needs it runs: the shard key's by the router
//! on the node the statement entered (`router::modify`, and COPY's own default filling in
//! `router::utility`), then routed with the value; any other column's on the shard's owner,
//! whose shard table (`LIKE shell INCLUDING ALL`) calls the owner's copy. Either way the value
//! comes from one node's range: unique in the cluster. Identity values, the key's or not, are
//! all drawn on the entry node from its shell's identity sequence (`with_identities_drawn` in
//! `router::modify`; COPY's `NextCopyFrom` evaluates the shell's identity there too) and routed
//! as constants with OVERRIDING SYSTEM VALUE: the shard tables are `LIKE shell INCLUDING ALL
//! EXCLUDING IDENTITY` (a sequence per shard table would repeat values), and an owner's
//! `nextval` would need USAGE on the sequence, which PostgreSQL's identity does not.
//!
//! Refused (0A000): sequence defaults and identities on columns that are not bigint (serial,
//! smallserial, int identities: 2^31 values cannot be split into useful ranges); sequences that
//! cannot be split (not bigint, counting down, shared with another column, belonging to another
//! column, already beyond slot 0); identity columns on reference tables (`distribute::mod`).

use pgrx::prelude::*;
use pgrx::spi::SpiClient;

use crate::error::RemusError;

/// Low bits of a node's range: slot `k` starts at `k << SLOT_BITS`.
pub(crate) const SLOT_BITS: u32 = 48;

/// Most slots (nodes at one distribution): slot 32767 is the last that fits in a bigint.
const MAX_SLOT: usize = (1 << (63 - SLOT_BITS)) - 1;

/// The kind of an identity column (`GENERATED ALWAYS` or `BY DEFAULT`).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Identity {
    Always,
    ByDefault,
}

/// A column whose default draws from a sequence the table alone uses.
pub(crate) struct SeqColumn {
    /// The column, quoted.
    column: String,
    /// The sequence, schema-qualified and quoted.
    sequence: String,
    /// Whether the sequence belongs to the column (`OWNED BY`, as `bigserial` makes it).
    owned: bool,
    /// An identity column's kind; its sequence is the identity's own.
    identity: Option<Identity>,
    /// The sequence's owner, quoted.
    owner: String,
    increment: i64,
    cache: i64,
    cycle: bool,
    /// The sequence's grants, as `GRANT` statements, to copy to the other nodes' copies.
    grants: Vec<String>,
}

impl SeqColumn {
    /// The sequence, schema-qualified and quoted.
    pub(crate) fn sequence_name(&self) -> &str {
        &self.sequence
    }
}

/// The table's sequence columns, or the refusal of one that cannot draw cluster-unique values.
pub(crate) fn inspect(
    client: &SpiClient<'_>,
    relid: pg_sys::Oid,
    table: &str,
) -> Result<Vec<SeqColumn>, RemusError> {
    columns(client, relid, table, false)
}

/// The sequence columns of a table distributed already (for a node that joins later,
/// `new_node`): this node's copy hands out its own slot's range and the shard tables' defaults
/// use it too, neither of which is a refusal.
pub(crate) fn inspect_distributed(
    client: &SpiClient<'_>,
    relid: pg_sys::Oid,
    table: &str,
) -> Result<Vec<SeqColumn>, RemusError> {
    columns(client, relid, table, true)
}

/// A column whose values a sequence hands out: (column, attnum, its sequence if it has exactly
/// one, the default's text, the identity kind).
type Candidate = (String, i16, Option<pg_sys::Oid>, String, Option<Identity>);

fn columns(
    client: &SpiClient<'_>,
    relid: pg_sys::Oid,
    table: &str,
    distributed: bool,
) -> Result<Vec<SeqColumn>, RemusError> {
    let mut candidates: Vec<Candidate> = Vec::new();
    // Identity columns: their sequence belongs to them (an internal dependency), and their
    // default is PostgreSQL's, not a pg_attrdef row.
    let identities = client.select(
        "SELECT quote_ident(a.attname), format_type(a.atttypid, a.atttypmod),
                a.atttypid = 'pg_catalog.int8'::pg_catalog.regtype, a.attidentity::text,
                (SELECT dep.objid FROM pg_depend dep
                  WHERE dep.classid = 'pg_class'::regclass AND dep.refclassid = 'pg_class'::regclass
                    AND dep.refobjid = a.attrelid AND dep.refobjsubid = a.attnum
                    AND dep.deptype = 'i' LIMIT 1),
                a.attnum
           FROM pg_attribute a
          WHERE a.attrelid = $1 AND a.attnum > 0 AND NOT a.attisdropped AND a.attidentity <> ''
          ORDER BY a.attnum",
        None,
        &[relid.into()],
    )?;
    for r in identities {
        let column = r.get::<String>(1)?.unwrap_or_default();
        if r.get::<bool>(3)? != Some(true) {
            return Err(RemusError::IdentityColumnNotBigint {
                table: table.to_string(),
                column,
                type_name: r.get::<String>(2)?.unwrap_or_default(),
            });
        }
        let identity = match r.get::<String>(4)?.as_deref() {
            Some("a") => Identity::Always,
            _ => Identity::ByDefault,
        };
        let seq = r.get::<pg_sys::Oid>(5)?;
        let attnum = r.get::<i16>(6)?.unwrap_or_default();
        candidates.push((
            column,
            attnum,
            seq,
            "its identity sequence".to_string(),
            Some(identity),
        ));
    }
    // Every column whose default mentions nextval or depends on a sequence; with the sequences
    // it depends on (a plain `nextval('s'::regclass)` depends on exactly one).
    let rows = client.select(
        "SELECT quote_ident(a.attname), format_type(a.atttypid, a.atttypmod),
                a.atttypid = 'pg_catalog.int8'::pg_catalog.regtype, pg_get_expr(d.adbin, d.adrelid),
                s.seqs, s.seq, a.attnum
           FROM pg_attribute a
           JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
           CROSS JOIN LATERAL (
                SELECT count(*) AS seqs, min(dep.refobjid) AS seq
                  FROM pg_depend dep JOIN pg_class sc ON sc.oid = dep.refobjid AND sc.relkind = 'S'
                 WHERE dep.classid = 'pg_attrdef'::regclass AND dep.objid = d.oid
                   AND dep.refclassid = 'pg_class'::regclass) s
          WHERE a.attrelid = $1 AND a.attnum > 0 AND NOT a.attisdropped AND a.attgenerated = ''
            AND (s.seqs > 0 OR pg_get_expr(d.adbin, d.adrelid) LIKE '%nextval(%')
          ORDER BY a.attnum",
        None,
        &[relid.into()],
    )?;
    for r in rows {
        let column = r.get::<String>(1)?.unwrap_or_default();
        let type_name = r.get::<String>(2)?.unwrap_or_default();
        let bigint = r.get::<bool>(3)?.unwrap_or(false);
        let default = r.get::<String>(4)?.unwrap_or_default();
        let seqs = r.get::<i64>(5)?.unwrap_or(0);
        let seq = r.get::<pg_sys::Oid>(6)?;
        let attnum = r.get::<i16>(7)?.unwrap_or_default();
        if !bigint {
            return Err(RemusError::SequenceColumnNotBigint {
                table: table.to_string(),
                column,
                type_name,
            });
        }
        candidates.push((column, attnum, seq.filter(|_| seqs == 1), default, None));
    }
    let mut found = Vec::new();
    for (column, attnum, seq, default, identity) in candidates {
        let refuse = |sequence: &str, reason: &str| RemusError::SequenceNotSplittable {
            table: table.to_string(),
            column: column.clone(),
            sequence: sequence.to_string(),
            reason: reason.to_string(),
        };
        let Some(seq) = seq else {
            return Err(refuse(
                &default,
                match identity {
                    Some(_) => "its identity sequence was not found",
                    None => "its default is not nextval('sequence'::regclass) of one sequence",
                },
            ));
        };
        let s = client.select(
            "SELECT format('%I.%I', n.nspname, c.relname),
                    pg_get_expr(d.adbin, d.adrelid) = format('nextval(%L::regclass)', c.oid::regclass),
                    q.seqtypid = 'pg_catalog.int8'::pg_catalog.regtype, q.seqincrement, q.seqcache,
                    q.seqcycle, quote_ident(pg_get_userbyid(c.relowner)),
                    pg_sequence_last_value(c.oid),
                    (SELECT count(*) FROM pg_depend x
                      WHERE x.refobjid = c.oid AND x.refclassid = 'pg_class'::regclass
                        AND x.classid = 'pg_attrdef'::regclass),
                    EXISTS (SELECT 1 FROM pg_depend o
                             WHERE o.classid = 'pg_class'::regclass AND o.objid = c.oid
                               AND o.refclassid = 'pg_class'::regclass AND o.deptype = 'a'
                               AND o.refobjid = $2 AND o.refobjsubid = $3),
                    EXISTS (SELECT 1 FROM pg_depend o
                             WHERE o.classid = 'pg_class'::regclass AND o.objid = c.oid
                               AND o.refclassid = 'pg_class'::regclass AND o.deptype = 'a'
                               AND NOT (o.refobjid = $2 AND o.refobjsubid = $3))
               FROM pg_class c
               JOIN pg_namespace n ON n.oid = c.relnamespace
               JOIN pg_sequence q ON q.seqrelid = c.oid
               LEFT JOIN pg_attrdef d ON d.adrelid = $2 AND d.adnum = $3
              WHERE c.oid = $1",
            Some(1),
            &[seq.into(), relid.into(), attnum.into()],
        )?;
        if s.is_empty() {
            return Err(refuse(&default, "the sequence was not found"));
        }
        let s = s.first();
        let sequence = s.get::<String>(1)?.unwrap_or_default();
        if identity.is_none() && s.get::<bool>(2)? != Some(true) {
            return Err(refuse(
                &sequence,
                "the default is not exactly nextval('sequence'::regclass)",
            ));
        }
        if s.get::<bool>(3)? != Some(true) {
            return Err(refuse(
                &sequence,
                "it is not a bigint sequence (ALTER SEQUENCE … AS bigint first)",
            ));
        }
        let increment = s.get::<i64>(4)?.unwrap_or(1);
        if increment <= 0 {
            return Err(refuse(
                &sequence,
                "it counts down (INCREMENT BY must be positive)",
            ));
        }
        let cache = s.get::<i64>(5)?.unwrap_or(1);
        let cycle = s.get::<bool>(6)?.unwrap_or(false);
        let owner = s.get::<String>(7)?.unwrap_or_default();
        if let Some(last) = s.get::<i64>(8)?.filter(|_| !distributed) {
            if last >= 1i64 << SLOT_BITS {
                return Err(refuse(
                    &sequence,
                    &format!(
                        "it has reached {last}; values from 2^{SLOT_BITS} up are the nodes' ranges"
                    ),
                ));
            }
        }
        // Distributed, the shard tables' defaults (`LIKE … INCLUDING ALL`) use it too; an
        // identity sequence is used by no default of its own.
        let own_defaults = if identity.is_some() { 0 } else { 1 };
        if s.get::<i64>(9)?.unwrap_or(0) > own_defaults && !distributed {
            return Err(refuse(&sequence, "other columns' defaults use it too"));
        }
        let owned = s.get::<bool>(10)?.unwrap_or(false);
        if s.get::<bool>(11)? == Some(true) {
            return Err(refuse(&sequence, "it belongs to another column (OWNED BY)"));
        }
        let grants = client
            .select(
                "SELECT format('GRANT %s ON SEQUENCE %s TO %s%s', a.privilege_type, $2,
                               CASE a.grantee WHEN 0 THEN 'PUBLIC'
                                    ELSE quote_ident(pg_get_userbyid(a.grantee)) END,
                               CASE WHEN a.is_grantable THEN ' WITH GRANT OPTION' ELSE '' END)
                   FROM pg_class c CROSS JOIN LATERAL aclexplode(c.relacl) a
                  WHERE c.oid = $1 AND a.grantee <> c.relowner",
                None,
                &[seq.into(), sequence.as_str().into()],
            )?
            .map(|r| r.get::<String>(1).map(|v| v.unwrap_or_default()))
            .collect::<Result<Vec<_>, _>>()?;
        found.push(SeqColumn {
            column,
            sequence,
            owned,
            identity,
            owner,
            increment,
            cache,
            cycle,
            grants,
        });
    }
    Ok(found)
}

/// The range of slot `slot` (1-based): `[slot·2^48, (slot+1)·2^48 − 1]`.
fn range(slot: usize) -> (i64, i64) {
    let lo = (slot as i64) << SLOT_BITS;
    let hi = if slot >= MAX_SLOT {
        i64::MAX
    } else {
        (((slot + 1) as i64) << SLOT_BITS) - 1
    };
    (lo, hi)
}

/// Each node's slot at this distribution: its position among the members sorted by name, plus
/// one (`nodes` is `all_nodes()`, already in that order).
pub(crate) fn slot_of(
    nodes: &[crate::cluster::remote::NodeAddr],
    node: &str,
) -> Result<usize, RemusError> {
    let mut names: Vec<&str> = nodes.iter().map(|n| n.name.as_str()).collect();
    names.sort_unstable();
    let slot = names
        .iter()
        .position(|n| *n == node)
        .map(|i| i + 1)
        .ok_or_else(|| RemusError::UnknownNode {
            node: node.to_string(),
        })?;
    if slot > MAX_SLOT {
        return Err(RemusError::Unsupported(
            "sequences on distributed tables with more than 32767 nodes",
        ));
    }
    Ok(slot)
}

/// For another node, run before its shell's DDL: the sequences of `seqs` that are not an
/// identity's (those come with the identity, [`after_shell`]), each restricted to `slot`'s
/// range, with their owner and grants.
pub(crate) fn before_shell(seqs: &[SeqColumn], slot: usize) -> String {
    let (lo, hi) = range(slot);
    let mut sql = String::new();
    for s in seqs.iter().filter(|s| s.identity.is_none()) {
        sql.push_str(&format!(
            "CREATE SEQUENCE {} AS bigint INCREMENT BY {} MINVALUE {lo} MAXVALUE {hi} START WITH {lo} CACHE {} {};\n\
             ALTER SEQUENCE {} OWNER TO {};\n",
            s.sequence,
            s.increment,
            s.cache,
            if s.cycle { "CYCLE" } else { "NO CYCLE" },
            s.sequence,
            s.owner
        ));
        sql.push_str(&grants(s));
    }
    sql
}

/// For another node, run after its shell's DDL (which gave the shell its owner): the sequences
/// that belong to their column belong to the shell's column there too (dropped with it); an
/// identity column becomes one, its sequence (same name, owned by the table's owner as
/// PostgreSQL makes it) restricted to `slot`'s range, with its grants.
pub(crate) fn after_shell(seqs: &[SeqColumn], table: &str, slot: usize) -> String {
    let (lo, hi) = range(slot);
    let mut sql = String::new();
    for s in seqs {
        match s.identity {
            Some(kind) => {
                sql.push_str(&format!(
                    "ALTER TABLE {table} ALTER COLUMN {} ADD GENERATED {} AS IDENTITY \
                     (SEQUENCE NAME {} INCREMENT BY {} MINVALUE {lo} MAXVALUE {hi} START WITH {lo} CACHE {} {});\n",
                    s.column,
                    match kind {
                        Identity::Always => "ALWAYS",
                        Identity::ByDefault => "BY DEFAULT",
                    },
                    s.sequence,
                    s.increment,
                    s.cache,
                    if s.cycle { "CYCLE" } else { "NO CYCLE" },
                ));
                sql.push_str(&grants(s));
            }
            None if s.owned => sql.push_str(&format!(
                "ALTER SEQUENCE {} OWNED BY {table}.{};\n",
                s.sequence, s.column
            )),
            None => {}
        }
    }
    sql
}

/// The sequence's grants, as statements.
fn grants(s: &SeqColumn) -> String {
    s.grants.iter().map(|g| format!("{g};\n")).collect()
}

/// For this node: its sequences restricted to `slot`'s range, restarted at its start (the
/// values handed out so far are all below it, in slot 0).
pub(crate) fn restrict_local(seqs: &[SeqColumn], slot: usize) -> String {
    let (lo, hi) = range(slot);
    seqs.iter()
        .map(|s| {
            format!(
                "ALTER SEQUENCE {} MINVALUE {lo} MAXVALUE {hi} START WITH {lo} RESTART WITH {lo};\n",
                s.sequence
            )
        })
        .collect()
}

#[cfg(test)]
mod tests {
    #[test]
    fn ranges_are_disjoint_and_above_slot_zero() {
        let (lo1, hi1) = super::range(1);
        let (lo2, hi2) = super::range(2);
        assert_eq!(lo1, 1 << 48);
        assert_eq!(hi1 + 1, lo2);
        assert!(hi2 > lo2);
        assert_eq!(super::range(super::MAX_SLOT).1, i64::MAX);
        assert!(super::range(super::MAX_SLOT).0 > super::range(super::MAX_SLOT - 1).1);
    }
}
