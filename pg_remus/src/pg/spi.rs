//! Read-only SPI queries.

use pgrx::prelude::*;

/// The one value of a read-only query (an aggregate, so there is always one row), read with the
/// active snapshot. pgrx's `Spi::get_one*` run their query as a mutating one, which assigns the
/// transaction an xid: on the routing path that gave every read-only transaction an xid (a
/// commit record to flush, and a migration's slot creation waiting for it to end).
pub fn read_one<'mcx, A: FromDatum + IntoDatum>(
    query: &str,
    args: &[pgrx::datum::DatumWithOid<'mcx>],
) -> Result<Option<A>, pgrx::spi::Error> {
    Spi::connect(|c| c.select(query, Some(1), args)?.first().get_one())
}
