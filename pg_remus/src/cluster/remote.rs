//! Connections from this backend to other nodes, over libpq.
//!
//! One connection per (backend, node), kept for the backend's life. Every wait goes through
//! `WaitLatchOrSocket`, so a cancel request, a statement timeout or postmaster death interrupts
//! it instead of leaving the backend stuck in a blocking libpq call. Text protocol only: type
//! OIDs differ between nodes, text I/O does not.
//!
//! `unsafe` is confined to this module's libpq and latch calls.

use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::{CStr, CString};
use std::ptr::NonNull;

use pgrx::pg_sys;
use pq_sys as pq;
use remus_proto::sqlstate::SqlState;

use crate::error::RemusError;

/// Where a node listens; read from `remus.nodes`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeAddr {
    pub name: String,
    pub host: String,
    pub port: i32,
}

/// Result of one remote command: rows as text, and the affected-row count.
#[derive(Debug, Default)]
pub struct RemoteResult {
    pub rows: Vec<Vec<Option<String>>>,
    pub affected: u64,
}

pub struct RemoteConnection {
    conn: NonNull<pq::PGconn>,
    pub addr: NodeAddr,
    /// A remote transaction tied to the current local one is open.
    pub in_transaction: bool,
    /// The remote transaction wrote something, so it takes part in two-phase commit.
    pub modified: bool,
    /// The gid of a PREPARE TRANSACTION sent on this connection (set before it is sent, kept
    /// unless the participant refused it): what COMMIT/ROLLBACK PREPARED act on.
    pub prepared_gid: Option<String>,
    /// A protocol or network error left the connection unusable; it is dropped at transaction end.
    pub broken: bool,
    /// For a connection of one rare purpose (the drain fence), whether that purpose lasts: it
    /// is closed at the first transaction end where this says false, so it does not stay open
    /// in every backend that once needed it (review F19), yet a backend that fences one write
    /// after another while the purpose lasts connects once. None: an ordinary cached connection.
    pub needed_while: Option<fn() -> bool>,
    /// The command under way has been sent a cancel by [`Interrupts::Forward`].
    cancel_forwarded: bool,
    /// Statements prepared on this session, by text and parameter types: a routed statement
    /// with parameters (a prepared statement's, usually) is parsed and planned there once.
    prepared: HashMap<(String, Vec<u32>), CString>,
    /// The [`PREPARED_EPOCH`] `prepared` belongs to.
    prepared_epoch: u64,
    /// How many statement names this session has handed out (`remus_<n>`).
    prepared_names: u64,
    /// The role the peer session runs this backend's statements as (`remus.forwarded_role`
    /// there, see `cluster::forwarded_role`); None: the node user it authenticated as.
    role: Option<pg_sys::Oid>,
    /// What [`wait`](Self::wait) waits on, made at the first wait and kept while the socket
    /// stays the same: one round trip then costs no epoll set made and closed again.
    waits: Option<SocketWaits>,
}

/// A wait event set of this backend's latch, postmaster death and one connection's socket.
struct SocketWaits {
    set: NonNull<pg_sys::WaitEventSet>,
    socket: pg_sys::pgsocket,
    /// The socket's entry in `set`, and the events it waits for now.
    position: i32,
    events: u32,
}

impl SocketWaits {
    /// A set for `socket`, waiting for `events` on it.
    fn new(socket: pg_sys::pgsocket, events: u32) -> Self {
        // SAFETY: the set is made in TopMemoryContext (it lives as long as the connection,
        // across transactions) and freed by Drop; MyLatch is the backend's own latch.
        unsafe {
            let set = pg_sys::CreateWaitEventSet(pg_sys::TopMemoryContext, 3);
            pg_sys::AddWaitEventToSet(
                set,
                pg_sys::WL_LATCH_SET,
                pg_sys::PGINVALID_SOCKET,
                pg_sys::MyLatch,
                std::ptr::null_mut(),
            );
            pg_sys::AddWaitEventToSet(
                set,
                pg_sys::WL_EXIT_ON_PM_DEATH,
                pg_sys::PGINVALID_SOCKET,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
            );
            let position = pg_sys::AddWaitEventToSet(
                set,
                events,
                socket,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
            );
            SocketWaits {
                set: NonNull::new(set).expect("CreateWaitEventSet returns a set or raises"),
                socket,
                position,
                events,
            }
        }
    }

    /// Waits until the latch is set or `events` happen on the socket; returns what happened.
    fn wait(&mut self, events: u32) -> u32 {
        // SAFETY: the set is live (owned by self); ModifyWaitEvent changes the socket's entry
        // only; one WaitEvent is written by WaitEventSetWait.
        unsafe {
            if events != self.events {
                pg_sys::ModifyWaitEvent(
                    self.set.as_ptr(),
                    self.position,
                    events,
                    std::ptr::null_mut(),
                );
                self.events = events;
            }
            let mut occurred: pg_sys::WaitEvent = std::mem::zeroed();
            let n = pg_sys::WaitEventSetWait(
                self.set.as_ptr(),
                -1,
                &mut occurred,
                1,
                pg_sys::PG_WAIT_EXTENSION,
            );
            if n > 0 {
                occurred.events
            } else {
                0
            }
        }
    }
}

impl Drop for SocketWaits {
    fn drop(&mut self) {
        // SAFETY: the set was made by CreateWaitEventSet and is freed once, here.
        unsafe { pg_sys::FreeWaitEventSet(self.set.as_ptr()) };
    }
}

/// Most statements kept prepared per connection; past it they are all deallocated.
const MAX_PREPARED: usize = 256;

/// What a wait for a participant does with this backend's own pending interrupts.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Interrupts {
    /// Service them: a cancel raises an ERROR out of the wait, and the transaction's abort
    /// callback then cancels the remote command.
    Service,
    /// Leave them pending: commit and abort processing, where an ERROR is not allowed.
    Hold,
    /// Forward a cancel to the participant and keep waiting for its answer.
    Forward,
}

thread_local! {
    // Backends are single-threaded; the map lives as long as the backend.
    static CONNECTIONS: RefCell<HashMap<String, RemoteConnection>> = RefCell::new(HashMap::new());
    /// Bumped when a distributed table's definition may have changed; a connection whose
    /// prepared statements are from an older epoch drops them before preparing again.
    static PREPARED_EPOCH: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// Forgets every statement this backend prepared on other nodes (a relcache invalidation of a
/// distributed table, e.g. after ALTER COLUMN … TYPE): PostgreSQL refuses to run a prepared
/// statement whose result type changed ("cached plan must not change result type"), so each
/// connection deallocates its statements before its next prepared one. Safe in a relcache
/// callback: it only bumps a counter.
pub(crate) fn forget_prepared_statements() {
    PREPARED_EPOCH.with(|e| e.set(e.get() + 1));
}

/// Runs `f` with the cached connection to `addr`, connecting first if needed.
///
/// The connection goes back into the cache even when `f` is left by an ERROR (a Rust panic
/// under pgrx): the abort callback must still find it to cancel what runs remotely.
pub fn with_connection<R>(
    addr: &NodeAddr,
    f: impl FnOnce(&mut RemoteConnection) -> Result<R, RemusError>,
) -> Result<R, RemusError> {
    struct CheckedOut(Option<RemoteConnection>);
    impl Drop for CheckedOut {
        fn drop(&mut self) {
            if let Some(c) = self.0.take() {
                CONNECTIONS.with(|m| m.borrow_mut().insert(c.addr.name.clone(), c));
            }
        }
    }
    let mut cached = CONNECTIONS.with(|c| c.borrow_mut().remove(&addr.name));
    if let Some(c) = cached.as_mut() {
        if c.addr == *addr && !c.broken && c.status_ok() && !c.settle_leftover() {
            c.broken = true;
        }
    }
    let conn = match cached {
        Some(c) if c.addr == *addr && !c.broken && c.status_ok() => c,
        // A connection still inside a transaction must not be silently replaced: its remote
        // work would be lost from the commit.
        Some(c) if c.in_transaction => {
            let node = c.addr.name.clone();
            CONNECTIONS.with(|m| m.borrow_mut().insert(node.clone(), c));
            return Err(RemusError::Connection {
                node,
                message: "connection lost inside the transaction".into(),
            });
        }
        _ => RemoteConnection::connect(addr)?,
    };
    let mut guard = CheckedOut(Some(conn));
    f(guard.0.as_mut().expect("checked out above"))
}

/// Runs `f` with the cached connections to every node of `addrs` (distinct nodes), all checked
/// out at once: for work that runs on several nodes concurrently.
pub fn with_connections<R>(
    addrs: &[NodeAddr],
    f: impl FnOnce(&mut [&mut RemoteConnection]) -> Result<R, RemusError>,
) -> Result<R, RemusError> {
    fn nest<R, F>(
        addrs: &[NodeAddr],
        held: &mut Vec<*mut RemoteConnection>,
        f: &mut Option<F>,
    ) -> Result<R, RemusError>
    where
        F: FnOnce(&mut [&mut RemoteConnection]) -> Result<R, RemusError>,
    {
        match addrs.split_first() {
            None => {
                // SAFETY: each pointer is a distinct connection checked out by an enclosing
                // `with_connection`, which keeps it alive (and unaliased) until it returns.
                let mut conns: Vec<&mut RemoteConnection> =
                    held.iter().map(|c| unsafe { &mut **c }).collect();
                let f = f.take().expect("called once");
                f(&mut conns)
            }
            Some((first, rest)) => with_connection(first, |c| {
                held.push(c as *mut RemoteConnection);
                let r = nest(rest, held, f);
                held.pop();
                r
            }),
        }
    }
    nest(addrs, &mut Vec::with_capacity(addrs.len()), &mut Some(f))
}

/// Runs `f` over every connection that has a remote transaction open.
pub fn for_each_in_transaction(mut f: impl FnMut(&mut RemoteConnection)) {
    CONNECTIONS.with(|c| {
        for conn in c.borrow_mut().values_mut().filter(|c| c.in_transaction) {
            f(conn);
        }
    });
}

/// The backend pid, on `node`, of this transaction's own session there, if it has one open:
/// what the drain fence must not wait for (a writer queued behind it waits for us).
pub fn in_transaction_backend_pid(node: &str) -> Option<i32> {
    CONNECTIONS.with(|c| {
        c.borrow()
            .get(node)
            .filter(|c| c.in_transaction)
            .map(|c| c.backend_pid())
    })
}

/// Has this backend a cached connection to `node` that is outside any remote transaction (so
/// a short transaction of its own can run there first)?
pub fn idle_connection_to(node: &str) -> bool {
    CONNECTIONS.with(|c| {
        c.borrow()
            .get(node)
            .is_some_and(|c| !c.in_transaction && !c.broken)
    })
}

pub fn any_in_transaction() -> bool {
    CONNECTIONS.with(|c| c.borrow().values().any(|c| c.in_transaction))
}

/// Clears per-transaction state and drops broken connections and those no longer needed
/// ([`RemoteConnection::needed_while`]).
pub fn end_of_transaction() {
    CONNECTIONS.with(|c| {
        let mut map = c.borrow_mut();
        map.retain(|_, conn| !conn.broken && conn.needed_while.is_none_or(|needed| needed()));
        for conn in map.values_mut() {
            conn.in_transaction = false;
            conn.modified = false;
            conn.prepared_gid = None;
        }
    });
}

fn cstring(s: &str) -> Result<CString, RemusError> {
    CString::new(s).map_err(|_| RemusError::NulByte {
        text: s.to_string(),
    })
}

impl RemoteConnection {
    fn connect(addr: &NodeAddr) -> Result<Self, RemusError> {
        // SAFETY: reserves one of the backend's external FD slots; released in Drop.
        if !unsafe { pg_sys::AcquireExternalFD() } {
            return Err(RemusError::Connection {
                node: addr.name.clone(),
                message: "too many open files in this backend".into(),
            });
        }
        let dbname = current_database();
        // Every node-to-node session authenticates as the node user; the calling role is set
        // on it afterwards ([`RemoteConnection::act_as_caller`]), so nodes need no credentials
        // of application roles.
        let user = node_user();
        let port = addr.port.to_string();
        // The peer must know it was reached by a node, not a client: it then executes locally
        // and never forwards again (no loops between nodes).
        let params: Vec<(&str, String)> = vec![
            ("host", addr.host.clone()),
            ("port", port),
            ("dbname", dbname),
            ("user", user),
            // A connection of its own for one purpose is cached as `<node>#<purpose>`; its
            // application_name says which, so the peer's pg_stat_activity tells them apart.
            (
                "application_name",
                match addr.name.split_once('#') {
                    Some((_, purpose)) => format!("pg_remus {purpose}"),
                    None => "pg_remus".into(),
                },
            ),
            // client_connection_check_interval: an entry backend that exits while its
            // statement runs here (its client was lost, or it was terminated) gets no chance to
            // cancel it (the connection is checked out, out of the abort callback's sight); the
            // peer notices the closed connection within a second and rolls back, instead of
            // running the statement to its end with its locks held.
            ("options", "-c remus.forwarded=on -c client_connection_check_interval=1000 -c standard_conforming_strings=on -c datestyle=ISO -c intervalstyle=postgres -c extra_float_digits=3".into()),
            ("client_encoding", "UTF8".into()),
            ("connect_timeout", "10".into()),
        ];
        let keys: Vec<CString> = params
            .iter()
            .map(|(k, _)| cstring(k))
            .collect::<Result<_, _>>()?;
        let vals: Vec<CString> = params
            .iter()
            .map(|(_, v)| cstring(v))
            .collect::<Result<_, _>>()?;
        let mut kp: Vec<*const i8> = keys.iter().map(|k| k.as_ptr()).collect();
        let mut vp: Vec<*const i8> = vals.iter().map(|v| v.as_ptr()).collect();
        kp.push(std::ptr::null());
        vp.push(std::ptr::null());
        // SAFETY: NUL-terminated arrays of C strings that outlive the call.
        let raw = unsafe { pq::PQconnectStartParams(kp.as_ptr(), vp.as_ptr(), 0) };
        let Some(conn) = NonNull::new(raw) else {
            // SAFETY: pairs the AcquireExternalFD above.
            unsafe { pg_sys::ReleaseExternalFD() };
            return Err(RemusError::Connection {
                node: addr.name.clone(),
                message: "out of memory".into(),
            });
        };
        let mut me = RemoteConnection {
            conn,
            addr: addr.clone(),
            in_transaction: false,
            modified: false,
            prepared_gid: None,
            broken: false,
            needed_while: None,
            cancel_forwarded: false,
            prepared: HashMap::new(),
            prepared_epoch: PREPARED_EPOCH.with(|e| e.get()),
            prepared_names: 0,
            role: None,
            waits: None,
        };
        // SAFETY: conn is a live PGconn owned by `me`.
        if unsafe { pq::PQstatus(me.conn.as_ptr()) } == pq::ConnStatusType::CONNECTION_BAD {
            return Err(me.connection_error());
        }
        loop {
            // SAFETY: as above.
            let poll = unsafe { pq::PQconnectPoll(me.conn.as_ptr()) };
            let event = match poll {
                pq::PostgresPollingStatusType::PGRES_POLLING_OK => break,
                pq::PostgresPollingStatusType::PGRES_POLLING_READING => pg_sys::WL_SOCKET_READABLE,
                pq::PostgresPollingStatusType::PGRES_POLLING_WRITING => pg_sys::WL_SOCKET_WRITEABLE,
                _ => return Err(me.connection_error()),
            };
            // While it connects, libpq may close its socket and open another (the next
            // address, a refused encryption), which can get the same number: a kept set would
            // no longer watch it. Each wait here makes its own.
            me.waits = None;
            me.wait(event as i32, Interrupts::Service);
        }
        // SAFETY: as above; non-blocking mode so sends never block outside our latch wait.
        unsafe { pq::PQsetnonblocking(me.conn.as_ptr(), 1) };
        Ok(me)
    }

    /// Makes the peer run what follows as the role running this statement here (the current
    /// user), as `cluster::forwarded_role` describes: privileges are checked, and functions
    /// run, as that role there too. A change of role is one statement outside any remote
    /// transaction, so only the first use by a role pays it; inside a remote transaction
    /// opened as another role it is refused (0A000), since the peer switches role per
    /// transaction.
    pub fn act_as_caller(&mut self) -> Result<(), RemusError> {
        let caller = caller_role();
        if self.role == caller {
            return Ok(());
        }
        if self.in_transaction {
            return Err(RemusError::Unsupported(
                "a transaction whose statements on another node run as different roles (SET ROLE or a SECURITY DEFINER function after that node joined the transaction)",
            ));
        }
        let sql = match caller {
            Some(role) => format!(
                "SET remus.forwarded_role = {}",
                crate::pg::sql::quote_literal(&role_name(role))
            ),
            None => "RESET remus.forwarded_role".to_string(),
        };
        self.exec(&sql)?;
        self.role = caller;
        Ok(())
    }

    /// Makes the peer run what follows as the node user this connection authenticated as
    /// (undoes [`Self::act_as_caller`]; the next routed statement sets the caller again).
    /// Outside a remote transaction only.
    pub fn act_as_node_user(&mut self) -> Result<(), RemusError> {
        if self.role.is_none() {
            return Ok(());
        }
        if self.in_transaction {
            return Err(RemusError::Unsupported(
                "a statement as the node user inside a remote transaction opened as another role",
            ));
        }
        self.exec("RESET remus.forwarded_role")?;
        self.role = None;
        Ok(())
    }

    /// The pid of the backend serving this connection on the peer.
    pub fn backend_pid(&self) -> i32 {
        // SAFETY: live PGconn.
        unsafe { pq::PQbackendPID(self.conn.as_ptr()) }
    }

    pub(crate) fn status_ok(&self) -> bool {
        // SAFETY: live PGconn.
        unsafe { pq::PQstatus(self.conn.as_ptr()) == pq::ConnStatusType::CONNECTION_OK }
    }

    fn error_message(&self) -> String {
        // SAFETY: PQerrorMessage returns a string owned by the connection, valid until the next
        // call on it; we copy it at once.
        unsafe {
            CStr::from_ptr(pq::PQerrorMessage(self.conn.as_ptr()))
                .to_string_lossy()
                .trim()
                .to_string()
        }
    }

    fn connection_error(&mut self) -> RemusError {
        self.broken = true;
        RemusError::Connection {
            node: self.addr.name.clone(),
            message: self.error_message(),
        }
    }

    /// Waits for `event` on the socket or the latch, treating this backend's pending interrupts
    /// as `interrupts` says.
    fn wait(&mut self, event: i32, interrupts: Interrupts) {
        // Checked on entry, not after the latch: callers wait in a loop until the participant
        // answers, so a cancel that woke this wait is forwarded by the next one.
        if interrupts == Interrupts::Forward {
            self.forward_pending_cancel();
        }
        // SAFETY: the socket belongs to our live PGconn (the set is made again for another
        // socket; `connect` drops it before each of its waits).
        let socket = unsafe { pq::PQsocket(self.conn.as_ptr()) };
        let events = event as u32;
        let waits = match self.waits.as_mut().filter(|w| w.socket == socket) {
            Some(w) => w,
            None => self.waits.insert(SocketWaits::new(socket, events)),
        };
        let rc = waits.wait(events);
        // SAFETY: MyLatch is the backend's own latch; interrupts are serviced as PostgreSQL's
        // own waits do.
        unsafe {
            if rc & pg_sys::WL_LATCH_SET != 0 {
                pg_sys::ResetLatch(pg_sys::MyLatch);
                if interrupts == Interrupts::Service {
                    pgrx::check_for_interrupts!();
                }
            }
        }
    }

    /// Sends the participant one cancel per command when a cancel, a statement_timeout or a
    /// terminate is pending here. The flags stay set: PostgreSQL services them later, or
    /// ignores a cancel that arrives once the statement is over.
    fn forward_pending_cancel(&mut self) {
        // SAFETY: reads this backend's own signal flags (set by its signal handlers).
        let pending = unsafe { pg_sys::QueryCancelPending != 0 || pg_sys::ProcDiePending != 0 };
        if pending && !self.cancel_forwarded {
            self.cancel_forwarded = true;
            self.send_cancel();
        }
    }

    /// Asks the participant's backend to cancel what it runs (a no-op when it runs nothing).
    fn send_cancel(&self) {
        // SAFETY: live PGconn; the PGcancel object is freed right after use.
        unsafe {
            let cancel = pq::PQgetCancel(self.conn.as_ptr());
            if !cancel.is_null() {
                let mut buf = [0i8; 256];
                pq::PQcancel(cancel, buf.as_mut_ptr(), buf.len() as i32);
                pq::PQfreeCancel(cancel);
            }
        }
    }

    /// Sends one command without waiting for its results ([`receive`](Self::receive) collects
    /// them), so that several participants run at once.
    pub fn send(&mut self, sql: &str) -> Result<(), RemusError> {
        self.send_inner(sql, Interrupts::Service)
    }

    /// The results of the command [`send`](Self::send) sent.
    pub fn receive(&mut self) -> Result<RemoteResult, RemusError> {
        self.collect(Interrupts::Service)
    }

    /// Sends one command (may hold several statements) and collects its results.
    pub fn exec(&mut self, sql: &str) -> Result<RemoteResult, RemusError> {
        self.exec_inner(sql, Interrupts::Service)
    }

    /// Like [`exec`](Self::exec), but does not service interrupts: for commit and abort
    /// processing, where PostgreSQL holds interrupts anyway and an ERROR is not allowed.
    pub fn exec_uninterruptible(&mut self, sql: &str) -> Result<RemoteResult, RemusError> {
        self.exec_inner(sql, Interrupts::Hold)
    }

    /// For a command whose outcome decides the local transaction's, like the COMMIT of a lone
    /// remote writer: a cancel, statement_timeout or terminate arriving meanwhile is forwarded
    /// to the participant instead of raising here, and the participant's answer is returned.
    /// Raising here would tell the client "canceled" for a transaction the participant may
    /// commit anyway, its COMMIT being already under way there.
    pub fn exec_forwarding_cancel(&mut self, sql: &str) -> Result<RemoteResult, RemusError> {
        self.exec_inner(sql, Interrupts::Forward)
    }

    fn exec_inner(
        &mut self,
        sql: &str,
        interrupts: Interrupts,
    ) -> Result<RemoteResult, RemusError> {
        self.send_inner(sql, interrupts)?;
        self.collect(interrupts)
    }

    fn send_inner(&mut self, sql: &str, interrupts: Interrupts) -> Result<(), RemusError> {
        let c = cstring(sql)?;
        self.cancel_forwarded = false;
        // SAFETY: live PGconn, NUL-terminated query.
        if unsafe { pq::PQsendQuery(self.conn.as_ptr(), c.as_ptr()) } == 0 {
            return Err(self.connection_error());
        }
        self.flush(interrupts)
    }

    /// One statement with `$n` parameters in text form. `types[i]` is a built-in type OID, or
    /// 0 to let the remote infer it (user types have different OIDs on every node).
    pub fn exec_params(
        &mut self,
        sql: &str,
        params: &[Option<String>],
        types: &[u32],
    ) -> Result<RemoteResult, RemusError> {
        self.exec_params_inner(&[], sql, params, types, Interrupts::Service)
    }

    /// [`exec_params`](Self::exec_params) after `opening`, statements without parameters (the
    /// remote transaction's BEGIN and savepoints), all in one flight: one round trip where
    /// sending them one after another would take one per statement. The result is the
    /// statement's; an error of any of them is the first error.
    pub fn exec_params_after(
        &mut self,
        opening: &[String],
        sql: &str,
        params: &[Option<String>],
        types: &[u32],
    ) -> Result<RemoteResult, RemusError> {
        self.exec_params_inner(opening, sql, params, types, Interrupts::Service)
    }

    /// `sql`, a statement without parameters, after `opening`, all in one pipelined flight
    /// (one round trip), each statement on its own (its text unchanged: a shard marker stays
    /// at the start of the statement's text) and none prepared. The result is `sql`'s plus any
    /// rows of the opening statements; an error of any of them is the first error.
    pub fn exec_after(
        &mut self,
        opening: &[String],
        sql: &str,
    ) -> Result<RemoteResult, RemusError> {
        let texts: Vec<CString> = opening
            .iter()
            .map(String::as_str)
            .chain(std::iter::once(sql))
            .map(cstring)
            .collect::<Result<_, _>>()?;
        let conn = self.conn.as_ptr();
        // SAFETY: live, idle PGconn (a connection is never left in pipeline mode: `collect`
        // leaves it); every text is NUL-terminated and outlives the calls; no parameters.
        let sent = unsafe {
            pq::PQenterPipelineMode(conn) == 1
                && texts.iter().all(|t| send_without_parameters(conn, t))
                && pq::PQpipelineSync(conn) == 1
        };
        if !sent {
            return Err(self.connection_error());
        }
        self.cancel_forwarded = false;
        self.flush(Interrupts::Service)?;
        self.collect(Interrupts::Service)
    }

    /// [`exec_params`](Self::exec_params) for a statement whose outcome is the local
    /// transaction's (an autocommit write sent as a transaction of its own): a cancel,
    /// statement_timeout or terminate arriving meanwhile is forwarded to the participant, as
    /// for [`exec_forwarding_cancel`](Self::exec_forwarding_cancel), and its answer returned,
    /// with whether a cancel was forwarded.
    pub fn exec_params_forwarding_cancel(
        &mut self,
        sql: &str,
        params: &[Option<String>],
        types: &[u32],
    ) -> Result<(RemoteResult, bool), RemusError> {
        let r = self.exec_params_inner(&[], sql, params, types, Interrupts::Forward)?;
        Ok((r, self.cancel_forwarded))
    }

    /// Runs `sql` as a statement prepared on this session, after `opening`. What the session
    /// has not prepared yet is prepared in the same flight: the opening statements, the
    /// statement's Parse and its Bind/Execute go out together in libpq's pipeline mode, ended by
    /// one Sync, so a new shape, or a remote transaction opened by a statement with parameters,
    /// costs no round trip of its own.
    fn exec_params_inner(
        &mut self,
        opening: &[String],
        sql: &str,
        params: &[Option<String>],
        types: &[u32],
        interrupts: Interrupts,
    ) -> Result<RemoteResult, RemusError> {
        if params.is_empty() && opening.is_empty() {
            return self.exec_inner(sql, interrupts);
        }
        self.forget_prepared_of_older_epoch()?;
        let key = (sql.to_string(), types.to_vec());
        let known = self.prepared.get(&key).cloned();
        if known.is_none() && self.prepared.len() >= MAX_PREPARED {
            self.exec("DEALLOCATE ALL")?;
            self.prepared.clear();
        }
        // Every C string is made before anything is sent: nothing between entering pipeline
        // mode and its Sync may return early but a broken connection.
        let opening: Vec<CString> = opening
            .iter()
            .map(|o| cstring(o))
            .collect::<Result<_, _>>()?;
        let text = cstring(sql)?;
        let values: Vec<Option<CString>> = params
            .iter()
            .map(|p| p.as_deref().map(cstring).transpose())
            .collect::<Result<_, _>>()?;
        let ptrs: Vec<*const i8> = values
            .iter()
            .map(|v| v.as_ref().map_or(std::ptr::null(), |v| v.as_ptr()))
            .collect();
        let oids: Vec<pq::Oid> = types.iter().map(|t| *t as pq::Oid).collect();
        let name = match &known {
            Some(name) => name.clone(),
            None => {
                // Never reused on this session, so a statement prepared in a flight whose
                // Execute failed (and so never recorded) cannot collide with a later one.
                self.prepared_names += 1;
                cstring(&format!("remus_{}", self.prepared_names))?
            }
        };
        let conn = self.conn.as_ptr();
        let pipelined = known.is_none() || !opening.is_empty();
        // SAFETY: live, idle PGconn (a connection is never left in pipeline mode: `collect`
        // leaves it); every pointer is to a NUL-terminated string or an array of
        // `params.len()` / `types.len()` entries that outlives the calls; text format.
        let sent = unsafe {
            (!pipelined || pq::PQenterPipelineMode(conn) == 1)
                && opening.iter().all(|o| send_without_parameters(conn, o))
                && (known.is_some()
                    || pq::PQsendPrepare(
                        conn,
                        name.as_ptr(),
                        text.as_ptr(),
                        oids.len() as i32,
                        oids.as_ptr(),
                    ) == 1)
                && pq::PQsendQueryPrepared(
                    conn,
                    name.as_ptr(),
                    params.len() as i32,
                    ptrs.as_ptr(),
                    std::ptr::null(),
                    std::ptr::null(),
                    0,
                ) == 1
                && (!pipelined || pq::PQpipelineSync(conn) == 1)
        };
        if !sent {
            return Err(self.connection_error());
        }
        self.cancel_forwarded = false;
        self.flush(interrupts)?;
        let r = self.collect(interrupts)?;
        if known.is_none() {
            self.prepared.insert(key, name);
        }
        Ok(r)
    }

    /// Prepared statements outlive transactions, so a rolled-back transaction keeps them; a
    /// definition change since they were prepared ([`PREPARED_EPOCH`]) drops them all.
    fn forget_prepared_of_older_epoch(&mut self) -> Result<(), RemusError> {
        let epoch = PREPARED_EPOCH.with(|e| e.get());
        if self.prepared_epoch != epoch {
            if !self.prepared.is_empty() {
                self.exec("DEALLOCATE ALL")?;
                self.prepared.clear();
            }
            self.prepared_epoch = epoch;
        }
        Ok(())
    }

    fn flush(&mut self, interrupts: Interrupts) -> Result<(), RemusError> {
        loop {
            // SAFETY: live PGconn.
            match unsafe { pq::PQflush(self.conn.as_ptr()) } {
                0 => return Ok(()),
                1 => self.wait(
                    (pg_sys::WL_SOCKET_WRITEABLE | pg_sys::WL_SOCKET_READABLE) as i32,
                    interrupts,
                ),
                _ => return Err(self.connection_error()),
            }
            // SAFETY: live PGconn; reading keeps the server from blocking on its own output.
            if unsafe { pq::PQconsumeInput(self.conn.as_ptr()) } == 0 {
                return Err(self.connection_error());
            }
        }
    }

    /// Collects the results of what was sent. In pipeline mode that is every statement of the
    /// flight up to its Sync (libpq ends each statement's results with a NULL; the Sync has a
    /// result of its own): their counts and rows added up (the opening statements have none)
    /// and the first error; the connection then leaves pipeline mode.
    fn collect(&mut self, interrupts: Interrupts) -> Result<RemoteResult, RemusError> {
        // SAFETY: live PGconn.
        let pipelined = unsafe { pq::PQpipelineStatus(self.conn.as_ptr()) }
            != pq::PGpipelineStatus::PQ_PIPELINE_OFF;
        let mut out = RemoteResult::default();
        let mut first_error: Option<RemusError> = None;
        // Within a flight a NULL ends one statement's results; two in a row: nothing is left.
        let mut ended_one = false;
        loop {
            // SAFETY: live PGconn.
            while unsafe { pq::PQisBusy(self.conn.as_ptr()) } != 0 {
                self.wait(pg_sys::WL_SOCKET_READABLE as i32, interrupts);
                // SAFETY: as above.
                if unsafe { pq::PQconsumeInput(self.conn.as_ptr()) } == 0 {
                    return Err(self.connection_error());
                }
            }
            // SAFETY: as above; each PGresult is cleared by `ResultGuard`.
            let res = unsafe { pq::PQgetResult(self.conn.as_ptr()) };
            let Some(res) = NonNull::new(res) else {
                if pipelined && !ended_one {
                    ended_one = true;
                    continue;
                }
                break;
            };
            ended_one = false;
            let res = ResultGuard(res);
            match res.status() {
                pq::ExecStatusType::PGRES_PIPELINE_SYNC => break,
                // Skipped by the server after an earlier statement's error, which is reported.
                pq::ExecStatusType::PGRES_PIPELINE_ABORTED => {}
                pq::ExecStatusType::PGRES_COMMAND_OK => out.affected += res.affected(),
                pq::ExecStatusType::PGRES_TUPLES_OK => {
                    out.affected += res.affected();
                    out.rows.extend(res.rows());
                }
                pq::ExecStatusType::PGRES_EMPTY_QUERY => {}
                _ => {
                    if first_error.is_none() {
                        first_error = Some(res.error(&self.addr.name));
                    }
                }
            }
        }
        if !self.status_ok() {
            return Err(first_error.unwrap_or_else(|| self.connection_error()));
        }
        // SAFETY: live PGconn whose flight has been read to its Sync.
        if pipelined && unsafe { pq::PQexitPipelineMode(self.conn.as_ptr()) } != 1 {
            let e = self.connection_error();
            return Err(first_error.unwrap_or(e));
        }
        match first_error {
            Some(e) => Err(e),
            None => Ok(out),
        }
    }

    /// Runs a `COPY … FROM STDIN` command and streams `data` (COPY text format) into it.
    pub fn copy_in(&mut self, sql: &str, data: &[u8]) -> Result<RemoteResult, RemusError> {
        let c = cstring(sql)?;
        // SAFETY: live PGconn, NUL-terminated query.
        if unsafe { pq::PQsendQuery(self.conn.as_ptr(), c.as_ptr()) } == 0 {
            return Err(self.connection_error());
        }
        self.flush(Interrupts::Service)?;
        loop {
            // SAFETY: live PGconn.
            while unsafe { pq::PQisBusy(self.conn.as_ptr()) } != 0 {
                self.wait(pg_sys::WL_SOCKET_READABLE as i32, Interrupts::Service);
                // SAFETY: as above.
                if unsafe { pq::PQconsumeInput(self.conn.as_ptr()) } == 0 {
                    return Err(self.connection_error());
                }
            }
            // SAFETY: as above; cleared by the guard.
            let res = unsafe { pq::PQgetResult(self.conn.as_ptr()) };
            let Some(res) = NonNull::new(res) else {
                return Err(self.connection_error());
            };
            let res = ResultGuard(res);
            match res.status() {
                pq::ExecStatusType::PGRES_COPY_IN => break,
                pq::ExecStatusType::PGRES_COMMAND_OK | pq::ExecStatusType::PGRES_TUPLES_OK => {
                    continue
                }
                _ => {
                    let e = res.error(&self.addr.name);
                    drop(res);
                    let _ = self.collect(Interrupts::Service);
                    return Err(e);
                }
            }
        }
        for chunk in data.chunks(64 * 1024) {
            loop {
                // SAFETY: live PGconn in COPY IN state; chunk is valid for its length.
                match unsafe {
                    pq::PQputCopyData(
                        self.conn.as_ptr(),
                        chunk.as_ptr() as *const i8,
                        chunk.len() as i32,
                    )
                } {
                    1 => break,
                    0 => self.wait(pg_sys::WL_SOCKET_WRITEABLE as i32, Interrupts::Service),
                    _ => return Err(self.connection_error()),
                }
            }
            self.flush(Interrupts::Service)?;
        }
        loop {
            // SAFETY: live PGconn in COPY IN state.
            match unsafe { pq::PQputCopyEnd(self.conn.as_ptr(), std::ptr::null()) } {
                1 => break,
                0 => self.wait(pg_sys::WL_SOCKET_WRITEABLE as i32, Interrupts::Service),
                _ => return Err(self.connection_error()),
            }
        }
        self.flush(Interrupts::Service)?;
        self.collect(Interrupts::Service)
    }

    /// Asks the remote backend to cancel what it is running, then drains its results.
    pub fn cancel_running(&mut self) {
        // SAFETY: live PGconn.
        let (active, pipelined) = unsafe {
            (
                pq::PQtransactionStatus(self.conn.as_ptr())
                    == pq::PGTransactionStatusType::PQTRANS_ACTIVE,
                pq::PQpipelineStatus(self.conn.as_ptr()) != pq::PGpipelineStatus::PQ_PIPELINE_OFF,
            )
        };
        // A flight left in pipeline mode by an ERROR raised here is read to its Sync (and the
        // connection taken out of pipeline mode) even when the peer has already answered it.
        if !active && !pipelined {
            return;
        }
        if active {
            self.send_cancel();
        }
        if self.collect(Interrupts::Hold).is_err() {
            self.broken = true;
        }
    }

    /// A connection outside any local transaction must be idle. One that is not was left by an
    /// ERROR raised here while it ran a command the abort path does not know of (an autocommit
    /// read, a BEGIN interrupted before it was recorded): its command is cancelled and drained,
    /// an open block rolled back. False: still not idle, do not use it.
    fn settle_leftover(&mut self) -> bool {
        if self.in_transaction {
            return true;
        }
        self.cancel_running();
        if !self.broken && !self.transaction_idle() {
            let _ = self.exec_uninterruptible("ROLLBACK");
        }
        !self.broken && self.transaction_idle()
    }

    pub fn transaction_idle(&self) -> bool {
        // SAFETY: live PGconn.
        unsafe {
            pq::PQtransactionStatus(self.conn.as_ptr()) == pq::PGTransactionStatusType::PQTRANS_IDLE
        }
    }
}

impl Drop for RemoteConnection {
    fn drop(&mut self) {
        // The wait set watches the socket PQfinish closes: freed first.
        self.waits = None;
        // SAFETY: we own the PGconn, and it holds one external FD slot.
        unsafe {
            pq::PQfinish(self.conn.as_ptr());
            pg_sys::ReleaseExternalFD();
        }
    }
}

struct ResultGuard(NonNull<pq::PGresult>);

impl ResultGuard {
    fn status(&self) -> pq::ExecStatusType {
        // SAFETY: live PGresult.
        unsafe { pq::PQresultStatus(self.0.as_ptr()) }
    }

    fn affected(&self) -> u64 {
        // SAFETY: live PGresult; PQcmdTuples returns "" when there is no count.
        unsafe { CStr::from_ptr(pq::PQcmdTuples(self.0.as_ptr())) }
            .to_str()
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(0)
    }

    fn rows(&self) -> Vec<Vec<Option<String>>> {
        let p = self.0.as_ptr();
        // SAFETY: indices are within PQntuples/PQnfields of a live PGresult.
        unsafe {
            let (n, f) = (pq::PQntuples(p), pq::PQnfields(p));
            (0..n)
                .map(|r| {
                    (0..f)
                        .map(|c| {
                            (pq::PQgetisnull(p, r, c) == 0).then(|| {
                                CStr::from_ptr(pq::PQgetvalue(p, r, c))
                                    .to_string_lossy()
                                    .into_owned()
                            })
                        })
                        .collect()
                })
                .collect()
        }
    }

    fn field(&self, code: u8) -> Option<String> {
        // SAFETY: live PGresult; a NULL means the field is absent.
        let v = unsafe { pq::PQresultErrorField(self.0.as_ptr(), code as i32) };
        // SAFETY: a non-NULL field is a NUL-terminated string owned by the live PGresult.
        (!v.is_null()).then(|| unsafe { CStr::from_ptr(v) }.to_string_lossy().into_owned())
    }

    fn error(&self, node: &str) -> RemusError {
        RemusError::Remote {
            node: node.to_string(),
            sqlstate: self
                .field(b'C')
                .unwrap_or_else(|| SqlState::INTERNAL_ERROR.code().into()),
            message: self.field(b'M').unwrap_or_else(|| "unknown error".into()),
            detail: self.field(b'D'),
            hint: self.field(b'H'),
        }
    }
}

impl Drop for ResultGuard {
    fn drop(&mut self) {
        // SAFETY: we own this PGresult.
        unsafe { pq::PQclear(self.0.as_ptr()) }
    }
}

fn current_database() -> String {
    // SAFETY: MyDatabaseId is set for any backend that runs SQL; the name is palloc'd.
    unsafe {
        let p = pg_sys::get_database_name(pg_sys::MyDatabaseId);
        if p.is_null() {
            "postgres".into()
        } else {
            CStr::from_ptr(p).to_string_lossy().into_owned()
        }
    }
}

fn role_name(role: pg_sys::Oid) -> String {
    // SAFETY: a syscache lookup inside a transaction; errors on a dropped role.
    unsafe {
        CStr::from_ptr(pg_sys::GetUserNameFromId(role, false))
            .to_string_lossy()
            .into_owned()
    }
}

/// The role node-to-node sessions authenticate as: the bootstrap superuser (`postgres` on a
/// cluster made by initdb as postgres), whose credentials every node has.
fn node_user() -> String {
    role_name(pg_sys::Oid::from(pg_sys::BOOTSTRAP_SUPERUSERID))
}

/// The role a peer must run this statement's work as: None for the node user itself.
fn caller_role() -> Option<pg_sys::Oid> {
    // SAFETY: reads a backend global.
    let user = unsafe { pg_sys::GetUserId() };
    (user != pg_sys::Oid::from(pg_sys::BOOTSTRAP_SUPERUSERID)).then_some(user)
}

/// Sends `text`, a statement without parameters, as the unnamed statement (in pipeline mode,
/// one of a flight). False when libpq refused it.
///
/// # Safety
/// `conn` must be a live PGconn.
unsafe fn send_without_parameters(conn: *mut pq::PGconn, text: &CString) -> bool {
    // SAFETY: the caller's live PGconn; `text` is NUL-terminated and outlives the call; no
    // parameter arrays.
    unsafe {
        pq::PQsendQueryParams(
            conn,
            text.as_ptr(),
            0,
            std::ptr::null(),
            std::ptr::null(),
            std::ptr::null(),
            std::ptr::null(),
            0,
        ) == 1
    }
}
