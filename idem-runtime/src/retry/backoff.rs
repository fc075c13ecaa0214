//! Exponential backoff with full jitter (AWS architecture blog's "full jitter":
//! sleep a uniformly random time between zero and the exponential bound), so
//! that writers that collided once do not collide again in lockstep.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::Duration;

/// The upper bound of the sleep after failed attempt number `attempt` (1-based):
/// `min(cap, base * 2^(attempt-1))`.
pub(crate) fn ceiling(base: Duration, cap: Duration, attempt: u32) -> Duration {
    let factor = 1u32
        .checked_shl(attempt.saturating_sub(1))
        .unwrap_or(u32::MAX);
    base.saturating_mul(factor).min(cap)
}

/// A uniformly random duration in `[0, ceiling]`.
pub(crate) fn full_jitter(ceiling: Duration) -> Duration {
    let nanos = ceiling.as_nanos().min(u64::MAX as u128) as u64;
    if nanos == 0 {
        return Duration::ZERO;
    }
    Duration::from_nanos(next_random() % (nanos + 1))
}

// Jitter needs spread, not unpredictability: a splitmix64 sequence shared by
// all callers and seeded once from the clock keeps a random-number crate out.
static COUNTER: AtomicU64 = AtomicU64::new(0);
static SEED: OnceLock<u64> = OnceLock::new();

fn next_random() -> u64 {
    let seed = *SEED.get_or_init(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0x9E37_79B9, |d| d.as_nanos() as u64)
    });
    let mut z = seed.wrapping_add(COUNTER.fetch_add(0x9E37_79B9_7F4A_7C15, Ordering::Relaxed));
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ceiling_doubles_up_to_the_cap() {
        let base = Duration::from_millis(10);
        let cap = Duration::from_millis(150);
        let ceilings: Vec<u128> = (1..=7).map(|a| ceiling(base, cap, a).as_millis()).collect();
        assert_eq!(ceilings, vec![10, 20, 40, 80, 150, 150, 150]);
        assert_eq!(ceiling(base, cap, 200), cap);
    }

    #[test]
    fn jitter_stays_within_the_ceiling_and_spreads() {
        let c = Duration::from_millis(150);
        let samples: Vec<Duration> = (0..10_000).map(|_| full_jitter(c)).collect();
        assert!(samples.iter().all(|s| *s <= c));
        let low = samples.iter().filter(|s| **s < c / 4).count();
        let high = samples.iter().filter(|s| **s > c * 3 / 4).count();
        // Uniform: about a quarter in each outer band.
        assert!((2000..3000).contains(&low), "{low}");
        assert!((2000..3000).contains(&high), "{high}");
        assert_eq!(full_jitter(Duration::ZERO), Duration::ZERO);
    }
}
