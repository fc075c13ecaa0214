//! What the retry loop tells the code running inside one attempt.
//!
//! The loop and the versioned reads never meet in user code: the body of a
//! `#[retryable]` function calls `Model::find(..).load(conn)` exactly as it would
//! outside a retry loop. The loop publishes its decisions in a task-local, and the
//! one place every versioned read goes through ([`crate::versioned::Find::load`])
//! reads them, so escalating a hot row to `SELECT ... FOR UPDATE` needs no change
//! in user code.

use std::cell::Cell;

/// What one attempt of a retry loop knows about itself.
#[derive(Debug, Clone)]
pub(crate) struct AttemptContext {
    /// 1 for the first attempt.
    pub(crate) attempt: u32,
    /// Load versioned rows with `FOR UPDATE` in this attempt.
    pub(crate) lock_rows: bool,
    /// Set by a versioned write that came back `Stale` in this attempt.
    pub(crate) saw_stale: Cell<bool>,
}

tokio::task_local! {
    pub(crate) static ATTEMPT: AttemptContext;
}

/// True when the current task runs inside an attempt that asked for row locks.
pub(crate) fn lock_rows() -> bool {
    ATTEMPT.try_with(|ctx| ctx.lock_rows).unwrap_or(false)
}

/// True when the current task runs inside an attempt of a retry loop.
pub(crate) fn inside_attempt() -> bool {
    ATTEMPT.try_with(|_| ()).is_ok()
}

/// Remember, for the retry loop, that a versioned write lost to a newer version.
pub(crate) fn note_stale() {
    let _ = ATTEMPT.try_with(|ctx| ctx.saw_stale.set(true));
}

/// The attempt number (1-based) of the attempt the current task runs in, if any.
///
/// Useful in logs and in tests that want to show how many attempts a call took.
pub fn current_attempt() -> Option<u32> {
    ATTEMPT.try_with(|ctx| ctx.attempt).ok()
}
