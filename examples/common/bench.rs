//! What the latency benchmarks share: their arguments and their percentiles.

use std::time::Duration;

/// `[--iterations N] [--warmup N] [--concurrency N] [--shuffle]` (also
/// `--name=N`).
pub struct Args {
    pub iterations: usize,
    pub warmup: usize,
    /// Callers at once (benchmarks that run several; the others refuse it).
    pub concurrency: usize,
    /// Each iteration's contenders in a random order rather than a rotating
    /// cycle (bench_idempotent; the others ignore it).
    #[allow(dead_code)]
    pub shuffle: bool,
}

pub fn parse_args() -> Args {
    let mut args = Args {
        iterations: 2000,
        warmup: 200,
        concurrency: 1,
        shuffle: false,
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        if arg == "--shuffle" {
            args.shuffle = true;
            continue;
        }
        let (name, inline) = match arg.split_once('=') {
            Some((name, value)) => (name.to_owned(), Some(value.to_owned())),
            None => (arg, None),
        };
        let slot = match name.as_str() {
            "--iterations" => &mut args.iterations,
            "--warmup" => &mut args.warmup,
            "--concurrency" => &mut args.concurrency,
            other => panic!(
                "unknown argument {other:?}; usage: [--iterations N] [--warmup N] [--concurrency N] [--shuffle]"
            ),
        };
        let value = inline.or_else(|| it.next());
        *slot = value
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("{name} needs a number"));
    }
    assert!(args.iterations > 0, "--iterations must be positive");
    assert!(args.concurrency > 0, "--concurrency must be positive");
    args
}

/// Nearest-rank percentile of sorted samples, in µs.
pub fn percentile_us(sorted: &[Duration], p: f64) -> f64 {
    let rank = ((p * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1].as_secs_f64() * 1e6
}
