//! The cells (scenario × strategy), one timed and audited run of a cell, and
//! the order and medians of many runs.

use super::schema::{audit, reset_sql};
use super::transfer::{adaptive, adaptive_cold, optimistic, pessimistic, Transfer, TransferError};
use super::*;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Scenario {
    Low,
    Hot,
}

impl Scenario {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Scenario::Low => "low",
            Scenario::Hot => "hot",
        }
    }

    fn transfers(self) -> Vec<Transfer> {
        (0..WRITERS as i64)
            .map(|i| {
                let (from, to) = match self {
                    Scenario::Low => (2 * i + 1, 2 * i + 2),
                    Scenario::Hot => (1, i + 2),
                };
                Transfer {
                    id: i + 1,
                    from,
                    to,
                    amount: AMOUNT,
                }
            })
            .collect()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Strategy {
    Optimistic,
    Pessimistic,
    Adaptive,
    AdaptiveCold,
}

impl Strategy {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Strategy::Optimistic => "optimistic",
            Strategy::Pessimistic => "pessimistic",
            Strategy::Adaptive => "adaptive",
            Strategy::AdaptiveCold => "adaptive_cold",
        }
    }

    async fn transfer(self, pool: &Pool, t: Transfer) -> Result<u32, TransferError> {
        match self {
            Strategy::Optimistic => optimistic(pool, t).await,
            Strategy::Pessimistic => pessimistic(pool, t).await,
            Strategy::Adaptive => adaptive(pool, t).await,
            Strategy::AdaptiveCold => adaptive_cold(pool, t).await,
        }
    }
}

pub(crate) const SCENARIOS: [Scenario; 2] = [Scenario::Low, Scenario::Hot];
pub(crate) const STRATEGIES: [Strategy; 4] = [
    Strategy::Optimistic,
    Strategy::Pessimistic,
    Strategy::Adaptive,
    Strategy::AdaptiveCold,
];

/// One run of one cell.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Run {
    pub(crate) wall: Duration,
    pub(crate) attempts: u32,
    pub(crate) max_per_writer: u32,
    pub(crate) ok: usize,
}

/// The medians of one cell's runs.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Cell {
    pub(crate) scenario: Scenario,
    pub(crate) strategy: Strategy,
    pub(crate) wall_ms: f64,
    pub(crate) attempts: f64,
    pub(crate) ok: usize,
}

impl Cell {
    pub(crate) fn wasted(&self) -> f64 {
        self.attempts - WRITERS as f64
    }
}

pub(crate) async fn run_cell(
    pool: &Pool,
    admin: &mut AsyncPgConnection,
    scenario: Scenario,
    strategy: Strategy,
) -> Result<Run, Box<dyn Error>> {
    admin.batch_execute(&reset_sql()).await?;
    // Let the reset's writes settle before the clock starts.
    tokio::time::sleep(Duration::from_millis(50)).await;
    let barrier = Arc::new(Barrier::new(WRITERS + 1));
    let writers: Vec<_> = scenario
        .transfers()
        .into_iter()
        .map(|t| {
            let pool = pool.clone();
            let barrier = Arc::clone(&barrier);
            tokio::spawn(async move {
                barrier.wait().await;
                strategy.transfer(&pool, t).await
            })
        })
        .collect();
    barrier.wait().await;
    let started = Instant::now();
    let mut attempts = 0;
    let mut max_per_writer = 0;
    let mut ok = 0;
    let mut failures = Vec::new();
    for writer in writers {
        match writer.await? {
            Ok(n) => {
                ok += 1;
                attempts += n;
                max_per_writer = max_per_writer.max(n);
            }
            Err(e) => failures.push(e.to_string()),
        }
    }
    let wall = started.elapsed();
    if !failures.is_empty() {
        return Err(format!(
            "{} {}: {} writer(s) failed, first: {}",
            scenario.name(),
            strategy.name(),
            failures.len(),
            failures[0]
        )
        .into());
    }
    audit(admin, ok).await.map_err(|e| {
        format!(
            "{} {}: ledger audit failed: {e}",
            scenario.name(),
            strategy.name()
        )
    })?;
    Ok(Run {
        wall,
        attempts,
        max_per_writer,
        ok,
    })
}

/// The cell to run `k`-th in `round`: a Williams design, the round-robin
/// `0, 1, n-1, 2, n-2, ..` rotated by one per round. Over `n` rounds every cell
/// runs once in each position and follows every other cell exactly once, so
/// what one cell leaves behind (a hot run's dead tuples and WAL, say) weighs on
/// all the others alike instead of always on the same neighbour.
pub(crate) fn williams(n: usize, round: usize, k: usize) -> usize {
    let base = match k {
        0 => 0,
        k if k % 2 == 1 => k.div_ceil(2),
        k => n - k / 2,
    };
    (base + round) % n
}

pub(crate) fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    let n = xs.len();
    if n % 2 == 1 {
        xs[n / 2]
    } else {
        (xs[n / 2 - 1] + xs[n / 2]) / 2.0
    }
}
