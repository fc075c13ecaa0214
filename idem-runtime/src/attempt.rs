//! What the retry loop tells the code running inside one attempt.
//!
//! The loop and the versioned reads never meet in user code: the body of a
//! `#[retryable]` function calls `Model::find(..).load(conn)` exactly as it would
//! outside a retry loop. The loop publishes its decisions in a task-local, and the
//! one place every versioned read goes through ([`crate::versioned::Find::load`])
//! reads them, so escalating a hot row to `SELECT ... FOR UPDATE` needs no change
//! in user code.

use std::any::TypeId;
use std::collections::hash_map::DefaultHasher;
use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use diesel_async::AsyncPgConnection;

/// Where an attempt's versioned writes report a version conflict, so the
/// loop knows the attempt lost a race whatever error its body returns.
#[derive(Debug, Clone, Default)]
pub(crate) struct ConflictSlot(Arc<AtomicBool>);

/// The versioned rows an attempt read, with the versions it read them at: a
/// stale write from one of them lost a race inside the attempt (replaying
/// reads the row again), while a stale write from a version given from
/// outside (an `If-Match`) fails the same way on every replay.
#[derive(Debug, Clone, Default)]
pub(crate) struct ReadSet(Arc<Mutex<Vec<(RowId, i64)>>>);

impl ConflictSlot {
    /// The conflict met since the last take, if any.
    pub(crate) fn take(&self) -> Option<crate::cause::RetryCause> {
        self.0
            .swap(false, Ordering::AcqRel)
            .then_some(crate::cause::RetryCause::Stale)
    }
}

/// What one attempt of a retry loop knows about itself.
#[derive(Debug, Clone)]
pub(crate) struct AttemptContext {
    /// Set by a versioned write that found a newer version.
    pub(crate) conflict: ConflictSlot,
    /// Versioned rows read in this attempt.
    pub(crate) reads: ReadSet,
    /// 1 for the first attempt.
    pub(crate) attempt: u32,
    /// Load versioned rows with `FOR UPDATE` in this attempt.
    pub(crate) lock_rows: bool,
    /// Under `on_conflict = lock`: how long a row that lost a version race
    /// stays hot, so that later calls lock it from their first attempt.
    pub(crate) hot_row_memory: Option<Duration>,
    /// What the outbox counts in this attempt; fresh per attempt, so a
    /// replayed attempt emits the same event ids again.
    pub(crate) emits: Arc<EmitState>,
}

/// The outbox's view of one attempt: how many events it emitted so far, and
/// the idempotent call it runs for, if any.
#[derive(Debug, Default)]
pub(crate) struct EmitState {
    ordinal: std::sync::atomic::AtomicU32,
    call: OnceLock<CallId>,
}

/// Which idempotent call an attempt runs for: the stored scope (hash), the
/// key, and the call's own random token. The token is what tells two
/// requests apart that reuse a key after its record expired; the attempts
/// of one call share it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct CallId {
    pub(crate) scope: String,
    pub(crate) key: String,
    pub(crate) token: [u8; 16],
}

/// Tell the current attempt which idempotent call it runs for: the outbox
/// derives its event ids from it. Called by `idempotency::Call::enter`, once
/// per attempt.
pub(crate) fn note_call(call: impl FnOnce() -> CallId) {
    let _ = ATTEMPT.try_with(|ctx| {
        let _ = ctx.emits.call.set(call());
    });
}

/// For an emit inside an attempt: its ordinal in the attempt (0 first), and
/// the idempotent call the attempt runs for. `None` outside an attempt.
pub(crate) fn next_emit() -> Option<(u32, Option<CallId>)> {
    ATTEMPT
        .try_with(|ctx| {
            let n = ctx.emits.ordinal.fetch_add(1, Ordering::AcqRel);
            (n, ctx.emits.call.get().cloned())
        })
        .ok()
}

tokio::task_local! {
    pub(crate) static ATTEMPT: AttemptContext;
}

/// One versioned row, as the hot-row memory knows it: the model and a hash of
/// the key (a collision only makes a cold row lock, which is always safe).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct RowId {
    model: TypeId,
    key: u64,
}

impl RowId {
    pub(crate) fn of<M: 'static, K: Hash>(key: &K) -> RowId {
        let mut hasher = DefaultHasher::new();
        key.hash(&mut hasher);
        RowId {
            model: TypeId::of::<M>(),
            key: hasher.finish(),
        }
    }
}

/// Rows that lost a version race recently, and when. Bounded: when full, old
/// entries go, and if none is old, all go (forgetting a hot row costs one more
/// optimistic round, never correctness).
fn hot_rows() -> &'static Mutex<HashMap<RowId, Instant>> {
    static HOT: OnceLock<Mutex<HashMap<RowId, Instant>>> = OnceLock::new();
    HOT.get_or_init(Default::default)
}
const HOT_ROWS_CAPACITY: usize = 4096;

/// Whether the current attempt should read the row of model `M` with `key`
/// `FOR UPDATE`: after a conflict in this call, or, under `on_conflict =
/// lock`, when the row lost a version race within the policy's memory. The
/// key is hashed only in that last case, off the path of plain reads.
pub(crate) fn lock_row<M: 'static, K: Hash>(key: &K) -> bool {
    ATTEMPT
        .try_with(|ctx| {
            ctx.lock_rows
                || ctx.hot_row_memory.is_some_and(|memory| {
                    let row = RowId::of::<M, K>(key);
                    let hot = hot_rows().lock().unwrap_or_else(|p| p.into_inner());
                    hot.get(&row).is_some_and(|at| at.elapsed() < memory)
                })
        })
        .unwrap_or(false)
}

/// Tell the current attempt that a write to `row` from version `expected`
/// found a newer one: a race lost inside the attempt when the attempt read
/// the row at that version. Remember the row as hot when the attempt runs
/// under `on_conflict = lock`.
pub(crate) fn note_stale(row: RowId, expected: i64) {
    let Ok(Some(memory)) = ATTEMPT.try_with(|ctx| {
        let read_here = ctx
            .reads
            .0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .contains(&(row, expected));
        if read_here {
            ctx.conflict.0.store(true, Ordering::Release);
        }
        ctx.hot_row_memory
    }) else {
        return;
    };
    let mut hot = hot_rows().lock().unwrap_or_else(|p| p.into_inner());
    if hot.len() >= HOT_ROWS_CAPACITY && !hot.contains_key(&row) {
        hot.retain(|_, at| at.elapsed() < memory);
        if hot.len() >= HOT_ROWS_CAPACITY {
            hot.clear();
        }
    }
    hot.insert(row, Instant::now());
}

/// Tell the retry loop that the current attempt lost a race with another
/// writer, so that it is replayed (within the budget) whatever error the
/// body then returns. Versioned writes do this by themselves when they find
/// a newer version; call it from a check of your own (a hand-written
/// compare-and-set that matched no row, say). Outside an attempt it does
/// nothing.
///
/// ```
/// // Outside a retry loop there is nothing to tell.
/// idem_runtime::attempt::lost_race();
/// ```
pub fn lost_race() {
    let _ = ATTEMPT.try_with(|ctx| ctx.conflict.0.store(true, Ordering::Release));
}

/// The row of model `M` with `key`, when the current task runs in an
/// attempt (the key is hashed only then).
pub(crate) fn row_in_attempt<M: 'static, K: Hash>(key: &K) -> Option<RowId> {
    inside_attempt().then(|| RowId::of::<M, K>(key))
}

/// Note that the current attempt read `row` at `version`.
pub(crate) fn note_read(row: RowId, version: i64) {
    let _ = ATTEMPT.try_with(|ctx| {
        ctx.reads
            .0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push((row, version));
    });
}

/// True when the current task runs inside an attempt of a retry loop.
pub(crate) fn inside_attempt() -> bool {
    ATTEMPT.try_with(|_| ()).is_ok()
}

/// Whether `conn` is in a transaction diesel-async counts. The connection
/// an attempt lends its body always is; one the body opened itself and left
/// in autocommit is not, and a row written there would commit at once,
/// whatever became of the attempt. (One in a transaction of the body's own
/// cannot be told from the attempt's without a look at the session, which
/// this leaves alone.)
pub(crate) fn in_transaction(conn: &mut AsyncPgConnection) -> bool {
    use diesel_async::{AnsiTransactionManager, TransactionManager};
    matches!(
        <AnsiTransactionManager as TransactionManager<AsyncPgConnection>>::transaction_manager_status_mut(conn)
            .transaction_depth(),
        Ok(Some(_))
    )
}

/// The attempt number (1-based) of the attempt the current task runs in, if any.
///
/// Useful in logs and in tests that want to show how many attempts a call took.
pub fn current_attempt() -> Option<u32> {
    ATTEMPT.try_with(|ctx| ctx.attempt).ok()
}
