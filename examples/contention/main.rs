//! What a hot row costs each way of keeping a balance cache right: 50 concurrent
//! transfers, optimistic (versioned writes + retry), pessimistic (`SELECT ..
//! FOR UPDATE`) and adaptive (`#[retryable(on_conflict = lock)]`).
//!
//! `cargo run --release --example contention [-- --repeats N] [--svg PATH | --update-docs]`
//!
//! Each transfer moves money between two accounts that cache their balance and
//! appends the ledger entry pair that is the truth behind the cache (seed 002's
//! double-entry ledger). Two scenarios:
//!
//! - `low`: 50 transfers over 50 disjoint account pairs: nobody collides;
//! - `hot`: 50 transfers out of one account, each into its own account.
//!
//! Three strategies, all run by the same retry loop (so a transaction costs
//! the same in each) with a budget that lets every writer commit:
//!
//! - `optimistic`: load both accounts, write both with `expect_version`; a
//!   `Stale` write replays the transaction;
//! - `pessimistic`: lock both rows with `SELECT .. FOR UPDATE`, in id order, then
//!   plain updates: nothing to replay;
//! - `adaptive`: the optimistic body under `on_conflict = lock`: after a
//!   conflict, the next attempts load the rows `FOR UPDATE`, and a row that
//!   lost a version race is remembered (`hot_row_memory`, 10 s) and locked from
//!   the first attempt of later calls;
//! - `adaptive_cold`: the same with `hot_row_memory_ms = 0`, so every burst is
//!   a first burst: 49 writers lose their optimistic first attempt.
//!
//! The 50 writers are released together by a barrier, each on its own pooled
//! connection. Every cell (scenario × strategy) runs `--repeats` times (default
//! 21), interleaved: each round runs all eight cells, in a round-robin order that
//! rotates per round so that each cell follows every other one equally often
//! (a Williams design), after one untimed warm-up round, so drift on a shared
//! machine and the aftermath of a hot run hit all cells alike. After every run the ledger is audited: each account's cached
//! balance equals the sum of its entries, money is conserved, and the versions
//! count exactly the committed writes.
//!
//! Output, one line per cell with the medians, then the targets of issue 3:
//! `scenario=hot strategy=adaptive writers=50 wall_ms=.. attempts=.. wasted=.. ok=50`
//! `hot_adaptive_vs_pessimistic=..` (target ≤ 1.1), `hot_adaptive_wasted=..`
//! (target ≤ 50), `low_adaptive_vs_optimistic=..` (target ≤ 1.05). Each run is
//! also reported on stderr. The chart goes to `target/contention.svg` (the
//! target directory this example was built in; the path is printed on
//! stderr), to `PATH` with `--svg PATH`, or to the tracked
//! `docs/contention.svg` with `--update-docs`, so that an ordinary run
//! leaves the checkout clean.

#[path = "../common/mod.rs"]
mod common;

mod cells;
mod chart;
mod schema;
mod transfer;

use std::error::Error;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use diesel::prelude::*;
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use idem::pool::{build_pool_with, PoolConfig};
use idem::{retryable, Pool, Versioned, VersionedChanges, VersionedError};
use tokio::sync::Barrier;

use cells::{median, run_cell, williams, Cell, Run, Scenario, Strategy, SCENARIOS, STRATEGIES};
use chart::chart;
use schema::SCHEMA;

/// Concurrent writers per run.
const WRITERS: usize = 50;
/// Accounts: 100 for the low scenario's disjoint pairs; the hot one uses 1..=51.
const ACCOUNTS: i64 = 100;
const OPENING_BALANCE: i64 = 1_000;
const AMOUNT: i64 = 10;

const USAGE: &str = "usage: contention [--repeats N] [--svg PATH | --update-docs]";

struct Args {
    repeats: usize,
    svg: PathBuf,
}

/// Where the chart goes by default: the target directory this example was
/// built in (`<target>/<profile>/examples/contention`), else `target/` of
/// the checkout; never a tracked file.
fn default_svg() -> PathBuf {
    let target = std::env::current_exe()
        .ok()
        .filter(|exe| {
            exe.parent()
                .and_then(|dir| dir.file_name())
                .is_some_and(|name| name == "examples")
        })
        .and_then(|exe| exe.ancestors().nth(3).map(PathBuf::from))
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("target"));
    target.join("contention.svg")
}

fn parse_args() -> Result<Args, String> {
    let (mut repeats, mut svg, mut update_docs) = (21, None, false);
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut value = || it.next().ok_or(format!("{arg} needs a value"));
        match arg.as_str() {
            "--repeats" => {
                repeats = value()?
                    .parse()
                    .ok()
                    .filter(|n| *n > 0)
                    .ok_or("--repeats takes a whole number above 0")?;
            }
            "--svg" => svg = Some(PathBuf::from(value()?)),
            "--update-docs" => update_docs = true,
            other => return Err(format!("unknown argument {other}; {USAGE}")),
        }
    }
    let svg = match (svg, update_docs) {
        (Some(_), true) => {
            return Err(format!(
                "--svg and --update-docs exclude each other; {USAGE}"
            ))
        }
        (Some(path), false) => path,
        (None, true) => Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/contention.svg"),
        (None, false) => default_svg(),
    };
    Ok(Args { repeats, svg })
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn Error>> {
    let args = parse_args()?;
    let url = common::database_url().await;
    let mut admin = AsyncPgConnection::establish(&url).await?;
    admin.batch_execute(SCHEMA).await?;

    // All 50 writers can hold a connection at once: a writer waits for a row,
    // never for the pool. 50 + the admin connection stay under 55.
    let pool = build_pool_with(
        &url,
        &PoolConfig {
            max_size: WRITERS,
            wait_timeout: Duration::from_secs(30),
            ..Default::default()
        },
    )?;
    // Open every connection before anything is timed.
    let mut held = Vec::with_capacity(WRITERS);
    for _ in 0..WRITERS {
        held.push(pool.get().await?);
    }
    drop(held);

    let cells: Vec<(Scenario, Strategy)> = SCENARIOS
        .iter()
        .flat_map(|sc| STRATEGIES.iter().map(move |st| (*sc, *st)))
        .collect();
    let mut runs: Vec<Vec<Run>> = vec![Vec::new(); cells.len()];
    // Round 0 is the untimed warm-up (statement caches, buffers).
    for round in 0..=args.repeats {
        for k in 0..cells.len() {
            let i = williams(cells.len(), round, k);
            let (scenario, strategy) = cells[i];
            let run = run_cell(&pool, &mut admin, scenario, strategy).await?;
            eprintln!(
                "{} repeat={round} scenario={} strategy={} wall_ms={:.1} attempts={} max_per_writer={} ok={}",
                if round == 0 { "warmup" } else { "run" },
                scenario.name(),
                strategy.name(),
                run.wall.as_secs_f64() * 1e3,
                run.attempts,
                run.max_per_writer,
                run.ok
            );
            if round > 0 {
                runs[i].push(run);
            }
        }
    }

    let summary: Vec<Cell> = cells
        .iter()
        .zip(&runs)
        .map(|(&(scenario, strategy), runs)| Cell {
            scenario,
            strategy,
            wall_ms: median(runs.iter().map(|r| r.wall.as_secs_f64() * 1e3).collect()),
            attempts: median(runs.iter().map(|r| f64::from(r.attempts)).collect()),
            ok: runs.iter().map(|r| r.ok).min().unwrap_or(0),
        })
        .collect();
    for c in &summary {
        println!(
            "scenario={} strategy={} writers={WRITERS} wall_ms={:.1} attempts={} wasted={} ok={}",
            c.scenario.name(),
            c.strategy.name(),
            c.wall_ms,
            c.attempts,
            c.wasted(),
            c.ok
        );
    }
    let get = |sc: Scenario, st: Strategy| {
        summary
            .iter()
            .find(|c| c.scenario == sc && c.strategy == st)
            .copied()
            .expect("every cell ran")
    };
    let hot_ratio = get(Scenario::Hot, Strategy::Adaptive).wall_ms
        / get(Scenario::Hot, Strategy::Pessimistic).wall_ms;
    let hot_wasted = get(Scenario::Hot, Strategy::Adaptive).wasted();
    let low_ratio = get(Scenario::Low, Strategy::Adaptive).wall_ms
        / get(Scenario::Low, Strategy::Optimistic).wall_ms;
    let verdict = |met: bool| if met { "met" } else { "MISSED" };
    println!(
        "hot_adaptive_vs_pessimistic={hot_ratio:.3} target<=1.1 {}",
        verdict(hot_ratio <= 1.1)
    );
    println!(
        "hot_adaptive_wasted={hot_wasted} target<=50 {}",
        verdict(hot_wasted <= 50.0)
    );
    println!(
        "low_adaptive_vs_optimistic={low_ratio:.3} target<=1.05 {}",
        verdict(low_ratio <= 1.05)
    );

    if let Some(dir) = args.svg.parent() {
        if !dir.as_os_str().is_empty() {
            std::fs::create_dir_all(dir)?;
        }
    }
    std::fs::write(&args.svg, chart(&summary, args.repeats))?;
    eprintln!("chart written to {}", args.svg.display());
    Ok(())
}
