//! Work for when the test process exits: the servers a process shares live
//! in statics, which are never dropped, so without this they would outlive
//! the test binary.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Mutex, Once, PoisonError};

type Hook = Box<dyn FnOnce() + Send>;

/// The hooks registered so far, in order.
static HOOKS: Mutex<Vec<Hook>> = Mutex::new(Vec::new());

/// Run `hook` when the process exits (its `main` returns or it calls
/// `exit`). Hooks run last registered first, as atexit(3) runs its
/// functions: a server started in front of another stops before it.
pub(crate) fn at_exit(hook: impl FnOnce() + Send + 'static) {
    static REGISTERED: Once = Once::new();
    REGISTERED.call_once(|| {
        // SAFETY: registers a plain extern "C" fn; libc keeps no other state for it.
        unsafe {
            libc::atexit(run_hooks);
        }
    });
    lock().push(Box::new(hook));
}

/// Run `stop` on `owned` when the process exits, if it is still alive then:
/// a server its owner never dropped (kept in a `static` to share it between
/// a binary's tests) would otherwise outlive the process. `stop` must do
/// nothing to one already stopped.
pub(crate) fn stop_at_exit<T: Send + Sync + 'static>(owned: &Arc<T>, stop: fn(&T)) {
    let owned = Arc::downgrade(owned);
    at_exit(move || {
        if let Some(owned) = owned.upgrade() {
            stop(&owned);
        }
    });
}

// A panic elsewhere while the lock was held leaves the list as valid as
// before; the servers must still be shut down.
fn lock() -> std::sync::MutexGuard<'static, Vec<Hook>> {
    HOOKS.lock().unwrap_or_else(PoisonError::into_inner)
}

extern "C" fn run_hooks() {
    // Taken out of the lock, so a hook may take it.
    let hooks = std::mem::take(&mut *lock());
    for hook in hooks.into_iter().rev() {
        // Unwinding out of an extern "C" fn aborts; a failed cleanup must
        // not turn a passing run into a crash, nor keep the other hooks
        // from running. Nothing is looked at after a hook that panicked.
        let _ = catch_unwind(AssertUnwindSafe(hook));
    }
}
