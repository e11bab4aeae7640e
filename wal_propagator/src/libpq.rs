//! The crate's only contact with C: thin owning wrappers over the libpq calls that the
//! replication client and the snapshot copy need, and over `poll(2)`.
//!
//! Everything `unsafe` in the crate is in this file (the crate root denies `unsafe_code`
//! elsewhere). The wrappers do no waiting and no policy: the connection is put into non-blocking
//! mode by its user, every call here returns at once, and the waits (with their timeouts and
//! cancellation) are written in safe code in [`crate::session`].
//!
//! Ownership rules upheld here:
//! - a [`Conn`] owns its `PGconn` and calls `PQfinish` exactly once, in `Drop`;
//! - a [`PgResult`] owns its `PGresult` (`PQclear` in `Drop`);
//! - a [`CopyBuf`] owns a row buffer from `PQgetCopyData` (`PQfreemem` in `Drop`);
//! - a [`CancelHandle`] owns a `PGcancel` (`PQfreeCancel` in `Drop`);
//! - strings libpq returns that belong to a connection or result are copied before the next
//!   libpq call on that object.

use std::ffi::{CStr, CString};
use std::io;
use std::os::raw::{c_char, c_int, c_void};
use std::os::unix::io::RawFd;
use std::ptr::NonNull;

use pq_sys as pq;

/// Copies a C string owned by libpq; `None` for a null pointer.
///
/// SAFETY (callers): `p` is null or points to a NUL-terminated string that stays valid for the
/// duration of this call.
unsafe fn owned_string(p: *const c_char) -> Option<String> {
    if p.is_null() {
        None
    } else {
        // SAFETY: non-null and NUL-terminated per the caller's contract; copied at once.
        Some(unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
    }
}

fn cstring(what: &str, s: &str) -> Result<CString, String> {
    CString::new(s).map_err(|_| format!("{what} contains a NUL byte"))
}

/// Where a non-blocking connection attempt stands (`PQconnectPoll`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ConnectPoll {
    /// Wait until the socket is readable, then poll again.
    Reading,
    /// Wait until the socket is writable, then poll again.
    Writing,
    Ok,
    Failed,
}

/// Outcome of a non-blocking send (`PQputCopyData`, `PQputCopyEnd`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Put {
    Queued,
    /// libpq's buffer is full: wait until the socket is writable and retry.
    WouldBlock,
    Failed,
}

/// Outcome of `PQgetCopyData` in async mode.
pub(crate) enum CopyData {
    Row(CopyBuf),
    /// Nothing complete buffered: wait for the socket, `PQconsumeInput`, retry.
    WouldBlock,
    /// The COPY is over (or failed); its status comes from `PQgetResult`.
    Done,
    /// The connection failed; the message is in [`Conn::error_message`].
    Failed,
}

/// An open libpq connection.
pub(crate) struct Conn(NonNull<pq::PGconn>);

// SAFETY: a PGconn is not bound to the thread that created it; libpq only forbids using one
// connection from two threads at the same time. Every call that touches it goes through `&self`
// or `&mut self` of this non-`Sync` owner, so two threads can never use it at once.
unsafe impl Send for Conn {}

impl Conn {
    /// Starts a non-blocking connection attempt (`PQconnectStartParams`). With `expand_dbname`
    /// a `dbname` value that is a conninfo string or URI is expanded, and later parameters
    /// override what it sets.
    pub(crate) fn start(params: &[(&str, &str)], expand_dbname: bool) -> Result<Conn, String> {
        let keys = params
            .iter()
            .map(|(k, _)| cstring("connection parameter name", k))
            .collect::<Result<Vec<_>, _>>()?;
        let values = params
            .iter()
            .map(|(k, v)| cstring(k, v))
            .collect::<Result<Vec<_>, _>>()?;
        let mut kp: Vec<*const c_char> = keys.iter().map(|k| k.as_ptr()).collect();
        let mut vp: Vec<*const c_char> = values.iter().map(|v| v.as_ptr()).collect();
        kp.push(std::ptr::null());
        vp.push(std::ptr::null());
        // SAFETY: two NULL-terminated arrays of NUL-terminated strings, all of which outlive the
        // call (libpq copies what it keeps).
        let raw = unsafe {
            pq::PQconnectStartParams(kp.as_ptr(), vp.as_ptr(), c_int::from(expand_dbname))
        };
        let conn = Conn(NonNull::new(raw).ok_or_else(|| "libpq is out of memory".to_string())?);
        // SAFETY: live PGconn owned by `conn`.
        if unsafe { pq::PQstatus(conn.0.as_ptr()) } == pq::ConnStatusType::CONNECTION_BAD {
            return Err(conn.error_message());
        }
        Ok(conn)
    }

    pub(crate) fn connect_poll(&mut self) -> ConnectPoll {
        // SAFETY: live PGconn owned by self.
        match unsafe { pq::PQconnectPoll(self.0.as_ptr()) } {
            pq::PostgresPollingStatusType::PGRES_POLLING_OK => ConnectPoll::Ok,
            pq::PostgresPollingStatusType::PGRES_POLLING_READING => ConnectPoll::Reading,
            pq::PostgresPollingStatusType::PGRES_POLLING_WRITING => ConnectPoll::Writing,
            _ => ConnectPoll::Failed,
        }
    }

    /// The connection's socket, if it has one.
    pub(crate) fn socket(&self) -> Option<RawFd> {
        // SAFETY: live PGconn.
        let fd = unsafe { pq::PQsocket(self.0.as_ptr()) };
        (fd >= 0).then_some(fd)
    }

    /// libpq's last error message on this connection.
    pub(crate) fn error_message(&self) -> String {
        // SAFETY: the message belongs to the connection and stays valid until the next libpq
        // call on it; `owned_string` copies it right away.
        unsafe { owned_string(pq::PQerrorMessage(self.0.as_ptr())) }
            .map(|s| s.trim().to_string())
            .unwrap_or_default()
    }

    pub(crate) fn set_nonblocking(&mut self) -> Result<(), String> {
        // SAFETY: live PGconn.
        if unsafe { pq::PQsetnonblocking(self.0.as_ptr(), 1) } == 0 {
            Ok(())
        } else {
            Err(self.error_message())
        }
    }

    /// Queues a simple-protocol query (`PQsendQuery`); flush it with [`Conn::flush`].
    pub(crate) fn send_query(&mut self, sql: &CStr) -> bool {
        // SAFETY: live PGconn; NUL-terminated query that outlives the call.
        unsafe { pq::PQsendQuery(self.0.as_ptr(), sql.as_ptr()) == 1 }
    }

    /// `Ok(true)`: everything queued has been sent; `Ok(false)`: data remains (wait until the
    /// socket is writable, or readable and then consume input, and flush again).
    pub(crate) fn flush(&mut self) -> Result<bool, ()> {
        // SAFETY: live PGconn.
        match unsafe { pq::PQflush(self.0.as_ptr()) } {
            0 => Ok(true),
            1 => Ok(false),
            _ => Err(()),
        }
    }

    /// Reads whatever the socket has into libpq's buffer (`PQconsumeInput`). False on failure.
    pub(crate) fn consume_input(&mut self) -> bool {
        // SAFETY: live PGconn.
        unsafe { pq::PQconsumeInput(self.0.as_ptr()) == 1 }
    }

    pub(crate) fn is_busy(&mut self) -> bool {
        // SAFETY: live PGconn.
        unsafe { pq::PQisBusy(self.0.as_ptr()) == 1 }
    }

    /// Next result of the current command; only call it when [`Conn::is_busy`] is false, so it
    /// does not block.
    pub(crate) fn get_result(&mut self) -> Option<PgResult> {
        // SAFETY: live PGconn; the returned result is owned by the caller (freed by PgResult).
        NonNull::new(unsafe { pq::PQgetResult(self.0.as_ptr()) }).map(PgResult)
    }

    pub(crate) fn get_copy_data(&mut self) -> CopyData {
        let mut buf: *mut c_char = std::ptr::null_mut();
        // SAFETY: live PGconn; `buf` is a valid out-pointer. async = 1, so the call never
        // blocks. On a positive return libpq hands us a malloc'd buffer of that many bytes,
        // which CopyBuf frees with PQfreemem.
        let n = unsafe { pq::PQgetCopyData(self.0.as_ptr(), &mut buf, 1) };
        match n {
            0 => CopyData::WouldBlock,
            -1 => CopyData::Done,
            n if n > 0 => match NonNull::new(buf) {
                Some(ptr) => CopyData::Row(CopyBuf {
                    ptr,
                    len: n as usize,
                }),
                None => CopyData::Failed,
            },
            _ => CopyData::Failed,
        }
    }

    pub(crate) fn put_copy_data(&mut self, data: &[u8]) -> Put {
        let Ok(len) = c_int::try_from(data.len()) else {
            return Put::Failed;
        };
        // SAFETY: live PGconn; `data` is valid for `len` bytes and libpq copies it before
        // returning.
        match unsafe { pq::PQputCopyData(self.0.as_ptr(), data.as_ptr().cast(), len) } {
            1 => Put::Queued,
            0 => Put::WouldBlock,
            _ => Put::Failed,
        }
    }

    /// Ends a COPY FROM STDIN or the client side of a CopyBoth stream (`PQputCopyEnd`).
    pub(crate) fn put_copy_end(&mut self) -> Put {
        // SAFETY: live PGconn; a null error message means "end normally".
        match unsafe { pq::PQputCopyEnd(self.0.as_ptr(), std::ptr::null()) } {
            1 => Put::Queued,
            0 => Put::WouldBlock,
            _ => Put::Failed,
        }
    }

    /// Quotes `s` as an SQL string literal for this connection's encoding and settings.
    pub(crate) fn escape_literal(&mut self, s: &str) -> Result<String, String> {
        // SAFETY: live PGconn; `s` is valid for `s.len()` bytes (libpq would stop at a NUL;
        // callers reject those). The returned buffer is freed with PQfreemem after being
        // copied.
        unsafe {
            let p = pq::PQescapeLiteral(self.0.as_ptr(), s.as_ptr().cast(), s.len());
            if p.is_null() {
                return Err(self.error_message());
            }
            let out = owned_string(p).unwrap_or_default();
            pq::PQfreemem(p.cast::<c_void>());
            Ok(out)
        }
    }

    /// A handle that can ask the server to cancel the running command, from any thread.
    pub(crate) fn cancel_handle(&self) -> Option<CancelHandle> {
        // SAFETY: live PGconn; the PGcancel is independent of it and owned by the handle.
        NonNull::new(unsafe { pq::PQgetCancel(self.0.as_ptr()) }).map(CancelHandle)
    }
}

impl Drop for Conn {
    fn drop(&mut self) {
        // SAFETY: we own the PGconn and this is the only place it is finished.
        unsafe { pq::PQfinish(self.0.as_ptr()) }
    }
}

/// Status of a [`PgResult`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ResultStatus {
    EmptyQuery,
    CommandOk,
    TuplesOk,
    CopyOut,
    CopyIn,
    CopyBoth,
    /// The server's answer could not be understood, or libpq failed.
    BadResponse,
    /// An error: from the server if it carries a SQLSTATE, from libpq otherwise.
    FatalError,
    Other,
}

/// A command's result.
pub(crate) struct PgResult(NonNull<pq::PGresult>);

impl PgResult {
    pub(crate) fn status(&self) -> ResultStatus {
        use pq::ExecStatusType as E;
        // SAFETY: live PGresult owned by self.
        match unsafe { pq::PQresultStatus(self.0.as_ptr()) } {
            E::PGRES_EMPTY_QUERY => ResultStatus::EmptyQuery,
            E::PGRES_COMMAND_OK => ResultStatus::CommandOk,
            E::PGRES_TUPLES_OK => ResultStatus::TuplesOk,
            E::PGRES_COPY_OUT => ResultStatus::CopyOut,
            E::PGRES_COPY_IN => ResultStatus::CopyIn,
            E::PGRES_COPY_BOTH => ResultStatus::CopyBoth,
            E::PGRES_BAD_RESPONSE => ResultStatus::BadResponse,
            E::PGRES_FATAL_ERROR => ResultStatus::FatalError,
            _ => ResultStatus::Other,
        }
    }

    /// libpq's name of the status (`PGRES_COMMAND_OK`, ...), for messages.
    pub(crate) fn status_name(&self) -> String {
        // SAFETY: live PGresult; PQresStatus returns a static string.
        unsafe { owned_string(pq::PQresStatus(pq::PQresultStatus(self.0.as_ptr()))) }
            .unwrap_or_default()
    }

    /// One field of an error result (`PG_DIAG_*` code), if present.
    pub(crate) fn error_field(&self, code: u8) -> Option<String> {
        // SAFETY: live PGresult; the field string belongs to it and is copied at once.
        unsafe { owned_string(pq::PQresultErrorField(self.0.as_ptr(), c_int::from(code))) }
    }

    /// The whole error message libpq composed for this result.
    pub(crate) fn error_message(&self) -> String {
        // SAFETY: live PGresult; the string belongs to it and is copied at once.
        unsafe { owned_string(pq::PQresultErrorMessage(self.0.as_ptr())) }
            .map(|s| s.trim().to_string())
            .unwrap_or_default()
    }

    pub(crate) fn ntuples(&self) -> usize {
        // SAFETY: live PGresult.
        usize::try_from(unsafe { pq::PQntuples(self.0.as_ptr()) }).unwrap_or(0)
    }

    pub(crate) fn nfields(&self) -> usize {
        // SAFETY: live PGresult.
        usize::try_from(unsafe { pq::PQnfields(self.0.as_ptr()) }).unwrap_or(0)
    }

    /// A text-format value; `None` if NULL or out of range.
    pub(crate) fn value(&self, row: usize, col: usize) -> Option<String> {
        if row >= self.ntuples() || col >= self.nfields() {
            return None;
        }
        let (r, c) = (c_int::try_from(row).ok()?, c_int::try_from(col).ok()?);
        // SAFETY: live PGresult, indexes checked against its dimensions above; the value
        // belongs to the result and is copied at once.
        unsafe {
            if pq::PQgetisnull(self.0.as_ptr(), r, c) == 1 {
                return None;
            }
            owned_string(pq::PQgetvalue(self.0.as_ptr(), r, c))
        }
    }

    /// The command tag, e.g. `COPY 10000` or `COMMIT`.
    pub(crate) fn cmd_status(&self) -> String {
        // SAFETY: live PGresult; the tag belongs to it and is copied at once.
        unsafe { owned_string(pq::PQcmdStatus(self.0.as_ptr())) }.unwrap_or_default()
    }

    /// Rows affected (or copied) by the command, if its tag carries a count.
    pub(crate) fn cmd_tuples(&self) -> Option<u64> {
        // SAFETY: live PGresult; the string belongs to it and is copied at once.
        unsafe { owned_string(pq::PQcmdTuples(self.0.as_ptr())) }?
            .parse()
            .ok()
    }
}

impl Drop for PgResult {
    fn drop(&mut self) {
        // SAFETY: we own the PGresult and this is the only place it is cleared.
        unsafe { pq::PQclear(self.0.as_ptr()) }
    }
}

/// One CopyData payload, in a buffer allocated by libpq.
pub(crate) struct CopyBuf {
    ptr: NonNull<c_char>,
    len: usize,
}

// SAFETY: the buffer is plain heap memory handed over to us by libpq, unrelated to the
// connection it came from; it is only read through shared references and freed once.
unsafe impl Send for CopyBuf {}
// SAFETY: see above; shared access is read-only.
unsafe impl Sync for CopyBuf {}

impl AsRef<[u8]> for CopyBuf {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: libpq returned `len` initialized bytes at `ptr`, which stay allocated until
        // Drop.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().cast::<u8>(), self.len) }
    }
}

impl std::ops::Deref for CopyBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        self.as_ref()
    }
}

impl Drop for CopyBuf {
    fn drop(&mut self) {
        // SAFETY: the buffer came from PQgetCopyData and is freed only here.
        unsafe { pq::PQfreemem(self.ptr.as_ptr().cast::<c_void>()) }
    }
}

/// Asks a server to cancel the command a connection is running (`PQcancel`).
pub(crate) struct CancelHandle(NonNull<pq::PGcancel>);

// SAFETY: libpq documents PQcancel as safe to call from another thread (even a signal handler);
// the PGcancel object holds only the address and the cancel key.
unsafe impl Send for CancelHandle {}

impl CancelHandle {
    /// Sends the cancel request. This opens a new connection to the server and may block for
    /// as long as that takes, so call it off the thread that must stay responsive.
    pub(crate) fn send(&self) -> Result<(), String> {
        let mut errbuf = [0 as c_char; 256];
        // SAFETY: live PGcancel; errbuf is writable for its length and libpq NUL-terminates it.
        let ok = unsafe {
            pq::PQcancel(self.0.as_ptr(), errbuf.as_mut_ptr(), errbuf.len() as c_int) == 1
        };
        if ok {
            Ok(())
        } else {
            // SAFETY: libpq wrote a NUL-terminated message into errbuf.
            Err(unsafe { owned_string(errbuf.as_ptr()) }.unwrap_or_default())
        }
    }
}

impl Drop for CancelHandle {
    fn drop(&mut self) {
        // SAFETY: we own the PGcancel and free it only here.
        unsafe { pq::PQfreeCancel(self.0.as_ptr()) }
    }
}

/// Readiness of a socket after [`poll_socket`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Ready {
    /// Readable, or closed / in error (reading will tell which).
    pub(crate) readable: bool,
    pub(crate) writable: bool,
}

impl Ready {
    pub(crate) fn any(self) -> bool {
        self.readable || self.writable
    }
}

/// Waits up to `timeout_ms` for `fd` to become readable and/or writable (`poll(2)`).
pub(crate) fn poll_socket(
    fd: RawFd,
    read: bool,
    write: bool,
    timeout_ms: c_int,
) -> io::Result<Ready> {
    let mut events = 0;
    if read {
        events |= libc::POLLIN;
    }
    if write {
        events |= libc::POLLOUT;
    }
    let mut pfd = libc::pollfd {
        fd,
        events,
        revents: 0,
    };
    // SAFETY: one valid pollfd, nfds = 1.
    let n = unsafe { libc::poll(&mut pfd, 1, timeout_ms) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    let r = pfd.revents;
    Ok(Ready {
        readable: r & (libc::POLLIN | libc::POLLHUP | libc::POLLERR | libc::POLLNVAL) != 0,
        writable: r & libc::POLLOUT != 0,
    })
}
