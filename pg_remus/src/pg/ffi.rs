//! C functions that pgrx does not bind, declared by hand from their headers.

use pgrx::pg_sys;

/// `SIGINT` (signal.h): what `pg_cancel_backend()` sends.
pub(crate) const SIGINT: i32 = 2;

extern "C" {
    /// POSIX kill(2) (signal.h).
    pub(crate) fn kill(pid: i32, sig: i32) -> i32;

    /// replication/message.h: writes a logical decoding message into WAL.
    pub(crate) fn LogLogicalMessage(
        prefix: *const std::os::raw::c_char,
        message: *const std::os::raw::c_char,
        size: usize,
        transactional: bool,
    ) -> pg_sys::XLogRecPtr;
}
