//! The relay's timing: the backoff after each failed publish, and the
//! horizon within which an event may be published again.

use std::time::Duration;

use super::publisher::Horizon;
#[cfg(doc)]
use super::Relay;

/// The wait after the `failures`-th failed publish of an event: `base`
/// doubled after each failure but the first, at most `max`.
pub(super) fn backoff_after(base: Duration, max: Duration, failures: u32) -> Duration {
    let factor = 2u32.saturating_pow(failures.saturating_sub(1));
    base.saturating_mul(factor).min(max)
}

/// The settings of a [`Relay`] that decide its [`Horizon`], with
/// [`Relay::new`]'s defaults: for a broker's window checked without a
/// relay at hand (`idem doctor`'s stream check).
///
/// ```
/// use std::time::Duration;
/// use idem_runtime::outbox::RelayTiming;
///
/// let mut timing = RelayTiming::default();
/// assert_eq!(timing.horizon().total(), Duration::from_millis(37_600));
/// timing.lease = Duration::from_secs(30); // a relay built with .lease(30 s)
/// assert_eq!(timing.horizon().total(), Duration::from_millis(52_600));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct RelayTiming {
    /// [`Relay::lease`]; default 15 s.
    pub lease: Duration,
    /// [`Relay::max_attempts`]; default 8.
    pub max_attempts: u32,
    /// [`Relay::backoff`]'s `base`; default 200 ms.
    pub backoff_base: Duration,
    /// [`Relay::backoff`]'s `max`; default 10 s.
    pub backoff_max: Duration,
}

impl Default for RelayTiming {
    fn default() -> Self {
        RelayTiming {
            lease: Duration::from_secs(15),
            max_attempts: 8,
            backoff_base: Duration::from_millis(200),
            backoff_max: Duration::from_secs(10),
        }
    }
}

impl RelayTiming {
    /// The relay's horizon, as [`Relay::horizon`] computes it: the lease
    /// plus the backoff after each failed attempt but the last (the values
    /// taken as the relay's setters take them).
    ///
    /// Computed in closed form with saturating arithmetic, so any settings
    /// (a billion attempts, backoffs of centuries) answer at once, at most
    /// `Duration::MAX`, instead of summing one wait per attempt.
    pub fn horizon(&self) -> Horizon {
        let max = self.backoff_max.max(self.backoff_base);
        Horizon {
            lease: self.lease,
            retry: retry_total(self.backoff_base, max, self.max_attempts.max(1) - 1),
        }
    }
}

/// The sum of [`backoff_after`] for failures `1..=failures`, saturating.
///
/// The factor doubles until it saturates at `u32::MAX` (from the 33rd
/// failure on), and each wait is capped at `max`: so the first 33 waits
/// are summed one by one, and every later wait equals the 33rd.
fn retry_total(base: Duration, max: Duration, failures: u32) -> Duration {
    const DOUBLING: u32 = 33;
    let mut total = Duration::ZERO;
    for n in 1..=failures.min(DOUBLING) {
        total = total.saturating_add(backoff_after(base, max, n));
    }
    if failures > DOUBLING {
        let rest = backoff_after(base, max, DOUBLING).saturating_mul(failures - DOUBLING);
        total = total.saturating_add(rest);
    }
    total
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The sum as it was first written: one wait per failure, checked.
    fn summed(t: &RelayTiming) -> Option<Duration> {
        let max = t.backoff_max.max(t.backoff_base);
        (1..t.max_attempts.max(1))
            .map(|n| backoff_after(t.backoff_base, max, n))
            .try_fold(Duration::ZERO, Duration::checked_add)
    }

    #[test]
    fn the_closed_form_equals_the_sum_of_each_wait() {
        let bases = [0, 1, 3, 200_000_000, 1_000_000_000];
        let maxes = [0, 1, 7, 10_000_000_000, 3_600_000_000_000, u64::MAX / 4];
        for attempts in (0..=70).chain([100, 1000, 5000]) {
            for base in bases {
                for max in maxes {
                    let t = RelayTiming {
                        lease: Duration::from_secs(15),
                        max_attempts: attempts,
                        backoff_base: Duration::from_nanos(base),
                        backoff_max: Duration::from_nanos(max),
                    };
                    let want = summed(&t).expect("small values do not overflow");
                    assert_eq!(t.horizon().retry, want, "{t:?}");
                }
            }
        }
        assert_eq!(
            RelayTiming::default().horizon().total(),
            Duration::from_millis(37_600)
        );
    }

    #[test]
    fn huge_settings_saturate_at_once() {
        let day = Duration::from_secs(86_400);
        let huge = RelayTiming {
            lease: Duration::MAX,
            max_attempts: u32::MAX,
            backoff_base: day * 99_999,
            backoff_max: Duration::MAX,
        };
        let started = std::time::Instant::now();
        assert_eq!(huge.horizon().retry, Duration::MAX);
        assert_eq!(huge.horizon().total(), Duration::MAX);
        let many = RelayTiming {
            max_attempts: u32::MAX,
            ..RelayTiming::default()
        };
        // 200 ms doubling to 10 s: 12.6 s over the first six, then 10 s each.
        let want = Duration::from_millis(12_600) + Duration::from_secs(10) * (u32::MAX - 7);
        assert_eq!(many.horizon().retry, want);
        assert!(
            started.elapsed() < Duration::from_secs(1),
            "{:?}",
            started.elapsed()
        );
    }
}
