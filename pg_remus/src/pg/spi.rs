//! The extension's own catalog queries (SPI), run as the bootstrap superuser.
//!
//! Application roles have no access to the `remus` schema (issue 18: its internals are not
//! reachable by them), yet routing reads the shard map and records 2PC decisions for them. So
//! every query of the extension's own text runs as the bootstrap superuser under a local user
//! id change (as a SECURITY DEFINER function would), restored when it returns or fails. Never
//! for text that holds a user's expression: that would run the user's code with superuser
//! rights (statements on shard tables keep the calling role, `router::local`).

use pgrx::pg_sys;
use pgrx::prelude::*;

/// Runs `f` as the bootstrap superuser, in a security-restricted operation (no temporary
/// objects, no SET ROLE), then restores the calling user and context, also when `f` is left by
/// an ERROR (a panic under pgrx).
pub fn as_extension_owner<R>(f: impl FnOnce() -> R) -> R {
    struct Restore(pg_sys::Oid, i32);
    impl Drop for Restore {
        fn drop(&mut self) {
            // SAFETY: puts back the values read below; plain assignments in the backend.
            unsafe { pg_sys::SetUserIdAndSecContext(self.0, self.1) }
        }
    }
    let mut user = pg_sys::InvalidOid;
    let mut context = 0;
    // SAFETY: reads two backend-global values into locals.
    unsafe { pg_sys::GetUserIdAndSecContext(&mut user, &mut context) };
    let _restore = Restore(user, context);
    // SAFETY: the bootstrap superuser always exists; the change is undone by `_restore` (and by
    // transaction abort, which restores the user id of the transaction's start).
    unsafe {
        pg_sys::SetUserIdAndSecContext(
            pg_sys::Oid::from(pg_sys::BOOTSTRAP_SUPERUSERID),
            context
                | pg_sys::SECURITY_LOCAL_USERID_CHANGE as i32
                | pg_sys::SECURITY_RESTRICTED_OPERATION as i32,
        )
    };
    f()
}

/// `Spi::connect` for the extension's own queries ([`as_extension_owner`]).
pub fn connect<R, F>(f: F) -> R
where
    F: FnOnce(&pgrx::spi::SpiClient<'_>) -> R,
{
    as_extension_owner(|| Spi::connect(f))
}

/// The one value of a read-only query (an aggregate, so there is always one row), read with the
/// active snapshot, as the extension owner. pgrx's `Spi::get_one*` run their query as a
/// mutating one, which assigns the transaction an xid: on the routing path that gave every
/// read-only transaction an xid (a commit record to flush, and a migration's slot creation
/// waiting for it to end).
pub fn read_one<'mcx, A: FromDatum + IntoDatum>(
    query: &str,
    args: &[pgrx::datum::DatumWithOid<'mcx>],
) -> Result<Option<A>, pgrx::spi::Error> {
    connect(|c| c.select(query, Some(1), args)?.first().get_one())
}
