//! What can go wrong with a [`ReplicaPair`](super::ReplicaPair).

use std::path::PathBuf;
use std::process::ExitStatus;
use std::time::Duration;

use crate::HarnessError;

/// Why a [`ReplicaPair`](super::ReplicaPair) could not be started or could
/// not do what a test asked of it.
///
/// Like [`HarnessError`], the variants carry the evidence (a program's
/// stderr, the last thing observed while waiting, the tail of a server log),
/// because a failover test that fails here fails for a reason on the machine
/// or in the pair, not in the code under test.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ReplicaError {
    /// Finding the binaries, dropping privileges, a file operation, a
    /// connection or a statement failed, or an installed program ran past
    /// the harness's bound of two minutes and was killed
    /// ([`HarnessError::Timeout`]; see [`HarnessError`]).
    #[error(transparent)]
    Harness(#[from] HarnessError),

    /// One of the installed programs (`pg_ctl`, `pg_basebackup`,
    /// `pg_rewind`, `initdb`) exited unsuccessfully.
    #[error(
        "{program} failed ({status}) for {data_dir}: {stderr}\n--- server log (tail) ---\n{log}"
    )]
    Program {
        /// The program, e.g. `pg_basebackup`.
        program: String,
        /// Its exit status (or that of the privilege-dropping wrapper).
        status: ExitStatus,
        /// The data directory it worked on.
        data_dir: PathBuf,
        /// Everything it wrote to stderr.
        stderr: String,
        /// The end of the node's server log, often the real cause.
        log: String,
    },

    /// A bounded wait ran out.
    #[error("timed out after {after:?} waiting for {awaited}; last seen: {last}")]
    Wait {
        /// What was awaited, e.g. "node_b to stream from node_a".
        awaited: String,
        /// How long the pair waited.
        after: Duration,
        /// The last observation (a query result or an error), to tell a
        /// slow machine from a wedged pair.
        last: String,
    },

    /// The operation does not apply to the pair as it is now, e.g.
    /// promoting a standby that is not running.
    #[error("{operation}: {reason}")]
    WrongState {
        /// The operation that was asked for.
        operation: &'static str,
        /// Why it cannot be done now.
        reason: String,
    },
}
