//! Shard-key hashing and hash ranges.
//!
//! A key is hashed with its type's standard hash function (the one hash indexes use), giving an
//! int4. The int4 space is split into `shard_count` contiguous ranges; shard `i` owns
//! `[hash_min, hash_max]`. Range and lookup are computed by the same arithmetic, so a value
//! always lands inside the range recorded for its shard.

use pgrx::pg_sys;

use crate::error::RemusError;

const SPAN: i64 = 1 << 32;
const OFFSET: i64 = 1 << 31;

/// Which shard index a hash belongs to.
pub fn shard_index(hash: i32, shard_count: u32) -> u32 {
    (((hash as i64 + OFFSET) * shard_count as i64) / SPAN) as u32
}

/// `[hash_min, hash_max]` of every shard index, in order.
pub fn shard_ranges(shard_count: u32) -> Vec<(i32, i32)> {
    let n = shard_count as i64;
    // Smallest offset o with o * n / SPAN >= i is ceil(i * SPAN / n).
    let start = |i: i64| (i * SPAN + n - 1) / n;
    (0..n)
        .map(|i| {
            let lo = start(i) - OFFSET;
            let hi = start(i + 1) - 1 - OFFSET;
            (lo as i32, hi as i32)
        })
        .collect()
}

/// Hashes a datum of type `typid` with that type's standard hash function.
///
/// # Safety
/// `value` must be a valid datum of type `typid`.
pub unsafe fn hash_datum(
    value: pg_sys::Datum,
    typid: pg_sys::Oid,
    collation: pg_sys::Oid,
) -> Result<i32, RemusError> {
    // SAFETY: the caller upholds this function's `# Safety` contract, on which the pointer
    // and FFI operations below rely.
    unsafe {
        let tc = pg_sys::lookup_type_cache(typid, pg_sys::TYPECACHE_HASH_PROC_FINFO as i32);
        if tc.is_null() || (*tc).hash_proc_finfo.fn_oid == pg_sys::InvalidOid {
            return Err(RemusError::NoHashFunction {
                type_oid: typid.to_u32(),
            });
        }
        let collation = if collation == pg_sys::InvalidOid {
            pg_sys::DEFAULT_COLLATION_OID
        } else {
            collation
        };
        let d = pg_sys::FunctionCall1Coll(&mut (*tc).hash_proc_finfo, collation, value);
        Ok(d.value() as i32)
    }
}

pub fn type_has_hash(typid: pg_sys::Oid) -> bool {
    // SAFETY: lookup_type_cache accepts any type oid and errors on an unknown one.
    unsafe {
        let tc = pg_sys::lookup_type_cache(typid, pg_sys::TYPECACHE_HASH_PROC_FINFO as i32);
        !tc.is_null() && (*tc).hash_proc_finfo.fn_oid != pg_sys::InvalidOid
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_cover_the_int4_space_without_gaps() {
        for n in [1u32, 2, 3, 7, 32, 1000] {
            let r = shard_ranges(n);
            assert_eq!(r.len(), n as usize);
            assert_eq!(r[0].0, i32::MIN);
            assert_eq!(r[n as usize - 1].1, i32::MAX);
            for w in r.windows(2) {
                assert_eq!(w[0].1 as i64 + 1, w[1].0 as i64);
            }
        }
    }

    #[test]
    fn lookup_agrees_with_ranges() {
        for n in [1u32, 3, 32, 1000] {
            let r = shard_ranges(n);
            for (i, (lo, hi)) in r.iter().enumerate() {
                assert_eq!(shard_index(*lo, n), i as u32);
                assert_eq!(shard_index(*hi, n), i as u32);
            }
            for h in [i32::MIN, -1, 0, 1, 12345, i32::MAX] {
                let i = shard_index(h, n) as usize;
                assert!(r[i].0 <= h && h <= r[i].1);
            }
        }
    }
}
