//! The waits the failover harnesses share: polling a probe until a bound,
//! and running blocking process work off the async runtime.

use std::future::Future;
use std::time::{Duration, Instant};

/// How often [`poll`] asks its probe again.
const POLL: Duration = Duration::from_millis(100);

/// Runs `f` on the blocking pool (it runs programs and waits for
/// processes); a panic in it resumes here.
pub(crate) async fn blocking<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    match tokio::task::spawn_blocking(f).await {
        Ok(value) => value,
        Err(join_error) => std::panic::resume_unwind(join_error.into_panic()),
    }
}

/// Calls `probe` until it returns `Ok(Some(_))` or `timeout` runs out; an
/// `Err` or `Ok(None)` is a "not yet". Past the bound, the last thing seen
/// (the last `Err`, or why the last probe did not finish).
pub(crate) async fn poll<T, F, Fut>(timeout: Duration, mut probe: F) -> Result<T, String>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<Option<T>, String>>,
{
    let deadline = Instant::now() + timeout;
    let mut last = String::from("nothing yet");
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, probe()).await {
            Ok(Ok(Some(value))) => return Ok(value),
            Ok(Ok(None)) => {}
            Ok(Err(seen)) => last = seen,
            Err(_) => last = "the last probe did not finish in time".into(),
        }
        if Instant::now() >= deadline {
            return Err(last);
        }
        tokio::time::sleep(POLL).await;
    }
}
