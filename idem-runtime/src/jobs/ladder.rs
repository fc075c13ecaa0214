//! How long a failed job waits before its next run.

use std::time::Duration;

/// The waits after a job's failed runs: after the n-th failure the job is
/// due again after step n; the failure after the last step parks it as
/// dead. A job therefore runs at most `steps().len() + 1` times before it
/// dies (a run whose worker died counts as a run, its lease as its wait).
///
/// The default waits 5 s, 30 s, then 2 min. Demos and tests shrink it
/// with [`Ladder::new`] or [`Ladder::scaled`]; the steps are counted in
/// database time (`now()`).
///
/// ```
/// use std::time::Duration;
/// use idem_runtime::jobs::Ladder;
///
/// let ladder = Ladder::default();
/// assert_eq!(ladder.after_failure(1), Some(Duration::from_secs(5)));
/// assert_eq!(ladder.after_failure(3), Some(Duration::from_secs(120)));
/// assert_eq!(ladder.after_failure(4), None, "dead");
/// assert_eq!(ladder.scaled(0.01).steps()[0], Duration::from_millis(50));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ladder {
    steps: Vec<Duration>,
}

impl Ladder {
    /// The default steps: 5 s, 30 s, 2 min.
    pub const DEFAULT_STEPS: [Duration; 3] = [
        Duration::from_secs(5),
        Duration::from_secs(30),
        Duration::from_secs(120),
    ];

    /// A ladder of these steps, in order. No steps: the first failure
    /// parks the job.
    pub fn new(steps: impl Into<Vec<Duration>>) -> Ladder {
        Ladder {
            steps: steps.into(),
        }
    }

    /// The steps, in order.
    pub fn steps(&self) -> &[Duration] {
        &self.steps
    }

    /// Every step multiplied by `factor` (for demos and tests: `0.01` turns
    /// 5 s, 30 s, 2 min into 50 ms, 300 ms, 1.2 s). A negative or NaN factor
    /// counts as 0; a step too long for a `Duration` is
    /// [`Duration::MAX`], which the queue stores as a thousand years, as
    /// any step past that.
    pub fn scaled(&self, factor: f64) -> Ladder {
        let factor = if factor.is_finite() && factor > 0.0 {
            factor
        } else {
            0.0
        };
        Ladder {
            steps: self
                .steps
                .iter()
                .map(|s| {
                    Duration::try_from_secs_f64(s.as_secs_f64() * factor).unwrap_or(Duration::MAX)
                })
                .collect(),
        }
    }

    /// The wait after the `failures`-th failed run (1 for the first), or
    /// `None` when the job dies of it.
    pub fn after_failure(&self, failures: u32) -> Option<Duration> {
        let n = usize::try_from(failures.checked_sub(1)?).ok()?;
        self.steps.get(n).copied()
    }
}

impl Default for Ladder {
    fn default() -> Self {
        Ladder::new(Ladder::DEFAULT_STEPS)
    }
}
