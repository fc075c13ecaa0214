//! Whether the synchronous standby holds what idem is about to show.
//!
//! With [`Replication::Synchronous`](crate::pool::Replication::Synchronous)
//! a commit is acknowledged once the standby holds it, but a commit whose
//! wait for the standby was cancelled (by an operator, or because its
//! client left while `client_connection_check_interval` was on) is visible
//! on the primary alone, and a failover erases it. So before a stored
//! outcome is replayed, idem waits
//! until every synchronous standby has flushed WAL up to the server's own
//! flush position, which is at or past the commit of anything the caller
//! can see (a synchronous commit flushes its record before it waits for the
//! standby, and before anyone sees it). Not the insert position: on an idle
//! server it can stay ahead of anything ever flushed (a page header), and
//! the wait would never end. The wait runs on the server (`idem_standby_holds`,
//! migration 14), bounded by the statement timeout: the call's deadline.
//!
//! The outbox relay needs no such wait: its claim of an event is a commit of
//! its own, which returns only once the standby holds it, and with it
//! everything committed before, the event's transaction included (idem
//! never cancels the relay's statements).

use diesel::QueryResult;
use diesel_async::{AsyncPgConnection, RunQueryDsl};

const WAIT_SQL: &str = "SELECT idem_standby_holds(pg_current_wal_flush_lsn())";

/// Wait, inside the caller's transaction and under its statement timeout,
/// until the synchronous standby holds everything committed so far.
pub(crate) async fn wait_held(conn: &mut AsyncPgConnection) -> QueryResult<()> {
    diesel::sql_query(WAIT_SQL).execute(conn).await.map(drop)
}
