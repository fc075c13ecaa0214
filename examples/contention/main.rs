//! What a hot row costs each way of keeping a balance cache right: 50 concurrent
//! transfers, optimistic (versioned writes + retry), pessimistic (`SELECT ..
//! FOR UPDATE`) and adaptive (`#[retryable(on_conflict = lock)]`).
//!
//! `cargo run --release --example contention [-- --repeats N --svg PATH]`
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
//! also reported on stderr. The chart goes to `docs/contention.svg`.

#[path = "common/mod.rs"]
mod common;

use std::error::Error;
use std::fmt::Write as _;
use std::sync::Arc;
use std::time::{Duration, Instant};

use diesel::prelude::*;
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use idem::pool::{build_pool_with, PoolConfig};
use idem::{retryable, Pool, Versioned, VersionedChanges, VersionedError};
use tokio::sync::Barrier;

/// Concurrent writers per run.
const WRITERS: usize = 50;
/// Accounts: 100 for the low scenario's disjoint pairs; the hot one uses 1..=51.
const ACCOUNTS: i64 = 100;
const OPENING_BALANCE: i64 = 1_000;
const AMOUNT: i64 = 10;

diesel::table! {
    contention_accounts (id) {
        id -> Int8,
        balance -> Int8,
        version -> Int8,
    }
}

diesel::table! {
    contention_entries (id) {
        id -> Int8,
        transfer_id -> Int8,
        account_id -> Int8,
        amount -> Int8,
    }
}

const SCHEMA: &str = "
    DROP TABLE IF EXISTS contention_entries;
    DROP TABLE IF EXISTS contention_accounts;
    CREATE TABLE contention_accounts (
        id      bigint PRIMARY KEY,
        balance bigint NOT NULL CHECK (balance >= 0),
        version bigint NOT NULL DEFAULT 0 CHECK (version >= 0)
    );
    -- Append-only: the truth the balance cache is derived from.
    CREATE TABLE contention_entries (
        id          bigserial PRIMARY KEY,
        transfer_id bigint NOT NULL,
        account_id  bigint NOT NULL,
        amount      bigint NOT NULL
    );
";

/// Every account back at its opening balance, with the opening entry (transfer
/// 0) that explains it.
fn reset_sql() -> String {
    format!(
        "TRUNCATE contention_entries, contention_accounts RESTART IDENTITY;
         INSERT INTO contention_accounts (id, balance, version)
             SELECT g, {OPENING_BALANCE}, 0 FROM generate_series(1, {ACCOUNTS}) g;
         INSERT INTO contention_entries (transfer_id, account_id, amount)
             SELECT 0, g, {OPENING_BALANCE} FROM generate_series(1, {ACCOUNTS}) g;
         ANALYZE contention_accounts, contention_entries;"
    )
}

#[derive(Debug, Queryable, Selectable, Versioned)]
#[diesel(table_name = contention_accounts)]
#[versioned(tenant = none, key = id, version = version)]
struct Account {
    id: i64,
    balance: i64,
    version: i64,
}

#[derive(VersionedChanges)]
#[versioned(model = Account)]
#[diesel(table_name = contention_accounts)]
struct SetBalance {
    balance: i64,
}

#[derive(Insertable)]
#[diesel(table_name = contention_entries)]
struct NewEntry {
    transfer_id: i64,
    account_id: i64,
    amount: i64,
}

#[derive(Debug, Clone, Copy)]
struct Transfer {
    id: i64,
    from: i64,
    to: i64,
    amount: i64,
}

#[derive(Debug, thiserror::Error)]
enum TransferError {
    #[error(transparent)]
    Versioned(#[from] VersionedError),
    #[error(transparent)]
    Db(#[from] diesel::result::Error),
    #[error(transparent)]
    Idem(#[from] idem::Error),
    #[error("insufficient funds in account {0}")]
    InsufficientFunds(i64),
}

/// The attempt this body runs in: the last one is the writer's attempt count.
fn attempt_number() -> u32 {
    idem::attempt::current_attempt().unwrap_or(1)
}

/// The debit and the credit of a transfer: the truth behind both caches.
async fn append_entries(conn: &mut AsyncPgConnection, t: Transfer) -> Result<(), TransferError> {
    diesel::insert_into(contention_entries::table)
        .values(&[
            NewEntry {
                transfer_id: t.id,
                account_id: t.from,
                amount: -t.amount,
            },
            NewEntry {
                transfer_id: t.id,
                account_id: t.to,
                amount: t.amount,
            },
        ])
        .execute(conn)
        .await?;
    Ok(())
}

/// The optimistic and adaptive body: read both accounts (in id order), write
/// both back with the version each was read at, append the entries. Under
/// `on_conflict = lock` the same two loads become `SELECT .. FOR UPDATE` after a
/// conflict, without a change here.
async fn transfer_versioned(
    conn: &mut AsyncPgConnection,
    t: Transfer,
) -> Result<u32, TransferError> {
    let (lo, hi) = (t.from.min(t.to), t.from.max(t.to));
    let lo = Account::find(lo).load(conn).await?;
    let hi = Account::find(hi).load(conn).await?;
    let delta = |account: &Account| {
        if account.id == t.from {
            -t.amount
        } else {
            t.amount
        }
    };
    for account in [&lo, &hi] {
        let balance = account.balance + delta(account);
        if balance < 0 {
            return Err(TransferError::InsufficientFunds(account.id));
        }
        Account::update(account.id)
            .expect_version(account.version)
            .set(&SetBalance { balance })
            .execute(conn)
            .await?;
    }
    append_entries(conn, t).await?;
    Ok(attempt_number())
}

#[retryable(max = 200, deadline_ms = 60000)]
async fn optimistic(conn: &mut AsyncPgConnection, t: Transfer) -> Result<u32, TransferError> {
    transfer_versioned(conn, t).await
}

#[retryable(max = 200, deadline_ms = 60000, on_conflict = lock)]
async fn adaptive(conn: &mut AsyncPgConnection, t: Transfer) -> Result<u32, TransferError> {
    transfer_versioned(conn, t).await
}

/// `adaptive` without the memory of hot rows: every burst starts optimistic,
/// so this is what the first burst on a row costs.
#[retryable(max = 200, deadline_ms = 60000, on_conflict = lock, hot_row_memory_ms = 0)]
async fn adaptive_cold(conn: &mut AsyncPgConnection, t: Transfer) -> Result<u32, TransferError> {
    transfer_versioned(conn, t).await
}

/// Lock both rows in id order (so two transfers cannot deadlock), then write
/// them with plain updates: no other writer can have changed them.
#[retryable(max = 200, deadline_ms = 60000)]
async fn pessimistic(conn: &mut AsyncPgConnection, t: Transfer) -> Result<u32, TransferError> {
    use contention_accounts::dsl::{balance, contention_accounts as accounts, version};
    let (lo, hi) = (t.from.min(t.to), t.from.max(t.to));
    let mut locked = Vec::with_capacity(2);
    for id in [lo, hi] {
        let account: Account = accounts
            .find(id)
            .select(Account::as_select())
            .for_update()
            .get_result(conn)
            .await?;
        locked.push(account);
    }
    for account in locked {
        let delta = if account.id == t.from {
            -t.amount
        } else {
            t.amount
        };
        let new_balance = account.balance + delta;
        if new_balance < 0 {
            return Err(TransferError::InsufficientFunds(account.id));
        }
        diesel::update(accounts.find(account.id))
            .set((balance.eq(new_balance), version.eq(version + 1)))
            .execute(conn)
            .await?;
    }
    append_entries(conn, t).await?;
    Ok(attempt_number())
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Scenario {
    Low,
    Hot,
}

impl Scenario {
    fn name(self) -> &'static str {
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
enum Strategy {
    Optimistic,
    Pessimistic,
    Adaptive,
    AdaptiveCold,
}

impl Strategy {
    fn name(self) -> &'static str {
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

const SCENARIOS: [Scenario; 2] = [Scenario::Low, Scenario::Hot];
const STRATEGIES: [Strategy; 4] = [
    Strategy::Optimistic,
    Strategy::Pessimistic,
    Strategy::Adaptive,
    Strategy::AdaptiveCold,
];

/// One run of one cell.
#[derive(Debug, Clone, Copy)]
struct Run {
    wall: Duration,
    attempts: u32,
    max_per_writer: u32,
    ok: usize,
}

/// The medians of one cell's runs.
#[derive(Debug, Clone, Copy)]
struct Cell {
    scenario: Scenario,
    strategy: Strategy,
    wall_ms: f64,
    attempts: f64,
    ok: usize,
}

impl Cell {
    fn wasted(&self) -> f64 {
        self.attempts - WRITERS as f64
    }
}

async fn run_cell(
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

/// The ledger after `committed` transfers: every cache equals its entries,
/// money is conserved, and each transfer bumped exactly two versions.
async fn audit(admin: &mut AsyncPgConnection, committed: usize) -> Result<(), Box<dyn Error>> {
    let accounts: Vec<(i64, i64, i64)> = contention_accounts::table
        .select((
            contention_accounts::id,
            contention_accounts::balance,
            contention_accounts::version,
        ))
        .order(contention_accounts::id)
        .load(admin)
        .await?;
    let entries: Vec<(i64, i64)> = contention_entries::table
        .select((contention_entries::account_id, contention_entries::amount))
        .load(admin)
        .await?;
    let mut sums = vec![0_i64; ACCOUNTS as usize + 1];
    for (account, amount) in &entries {
        sums[*account as usize] += amount;
    }
    for (id, balance, _) in &accounts {
        if *balance != sums[*id as usize] {
            return Err(format!(
                "account {id}: cached balance {balance} != sum of entries {}",
                sums[*id as usize]
            )
            .into());
        }
    }
    let total: i64 = accounts.iter().map(|a| a.1).sum();
    let versions: i64 = accounts.iter().map(|a| a.2).sum();
    let expected_entries = ACCOUNTS as usize + 2 * committed;
    if total != ACCOUNTS * OPENING_BALANCE
        || versions != 2 * committed as i64
        || entries.len() != expected_entries
    {
        return Err(format!(
            "total {total} (want {}), versions {versions} (want {}), entries {} (want {expected_entries})",
            ACCOUNTS * OPENING_BALANCE,
            2 * committed,
            entries.len()
        )
        .into());
    }
    Ok(())
}

/// The cell to run `k`-th in `round`: a Williams design, the round-robin
/// `0, 1, n-1, 2, n-2, ..` rotated by one per round. Over `n` rounds every cell
/// runs once in each position and follows every other cell exactly once, so
/// what one cell leaves behind (a hot run's dead tuples and WAL, say) weighs on
/// all the others alike instead of always on the same neighbour.
fn williams(n: usize, round: usize, k: usize) -> usize {
    let base = match k {
        0 => 0,
        k if k % 2 == 1 => k.div_ceil(2),
        k => n - k / 2,
    };
    (base + round) % n
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    let n = xs.len();
    if n % 2 == 1 {
        xs[n / 2]
    } else {
        (xs[n / 2 - 1] + xs[n / 2]) / 2.0
    }
}

struct Args {
    repeats: usize,
    svg: String,
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        repeats: 21,
        svg: concat!(env!("CARGO_MANIFEST_DIR"), "/docs/contention.svg").to_owned(),
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut value = || it.next().ok_or(format!("{arg} needs a value"));
        match arg.as_str() {
            "--repeats" => {
                args.repeats = value()?
                    .parse()
                    .ok()
                    .filter(|n| *n > 0)
                    .ok_or("--repeats takes a whole number above 0")?;
            }
            "--svg" => args.svg = value()?,
            other => {
                return Err(format!(
                    "unknown argument {other}; usage: contention [--repeats N] [--svg PATH]"
                ))
            }
        }
    }
    Ok(args)
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

    if let Some(dir) = std::path::Path::new(&args.svg).parent() {
        if !dir.as_os_str().is_empty() {
            std::fs::create_dir_all(dir)?;
        }
    }
    std::fs::write(&args.svg, chart(&summary, args.repeats))?;
    eprintln!("chart written to {}", args.svg);
    Ok(())
}

// ---------------------------------------------------------------------------
// The chart: two panels of grouped bars, hand-written SVG.

const COLORS: [&str; 4] = ["#4e79a7", "#e15759", "#59a14f", "#f28e2b"];
const WIDTH: f64 = 1200.0;
const HEIGHT: f64 = 500.0;

/// A round axis maximum and tick step for values up to `max`.
fn axis(max: f64) -> (f64, f64) {
    let max = if max > 0.0 { max } else { 1.0 };
    let raw = max / 5.0;
    let magnitude = 10_f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 2.5, 5.0, 10.0]
        .iter()
        .map(|m| m * magnitude)
        .find(|s| *s >= raw)
        .unwrap_or(10.0 * magnitude);
    ((max / step).ceil() * step, step)
}

fn label(v: f64) -> String {
    if v.fract().abs() < 1e-9 || v >= 100.0 {
        format!("{v:.0}")
    } else {
        format!("{v:.1}")
    }
}

fn panel(
    svg: &mut String,
    x0: f64,
    title: &str,
    y_label: &str,
    cells: &[Cell],
    value: impl Fn(&Cell) -> f64,
) {
    let (left, right, top, bottom) = (x0 + 70.0, x0 + 450.0, 90.0, 400.0);
    let (axis_max, step) = axis(cells.iter().map(&value).fold(0.0, f64::max));
    let y = |v: f64| bottom - (v / axis_max) * (bottom - top);
    let _ = writeln!(
        svg,
        r#"<text x="{:.1}" y="70" text-anchor="middle" font-size="17" font-weight="bold">{title}</text>"#,
        (left + right) / 2.0
    );
    // Grid and y ticks.
    let mut tick = 0.0;
    while tick <= axis_max + step / 2.0 {
        let ty = y(tick);
        let _ = writeln!(
            svg,
            r##"<line x1="{left}" y1="{ty:.1}" x2="{right}" y2="{ty:.1}" stroke="#ddd"/><text x="{:.1}" y="{:.1}" text-anchor="end" font-size="13">{}</text>"##,
            left - 8.0,
            ty + 4.5,
            label(tick)
        );
        tick += step;
    }
    let _ = writeln!(
        svg,
        r#"<text transform="translate({:.1},{:.1}) rotate(-90)" text-anchor="middle" font-size="14">{y_label}</text>"#,
        x0 + 20.0,
        (top + bottom) / 2.0
    );
    // Bars, grouped by scenario.
    let group_width = (right - left) / SCENARIOS.len() as f64;
    let bar = 36.0;
    let gap = 10.0;
    for (g, scenario) in SCENARIOS.iter().enumerate() {
        let center = left + group_width * (g as f64 + 0.5);
        let n = STRATEGIES.len() as f64;
        let first = center - (n * bar + (n - 1.0) * gap) / 2.0;
        for (s, strategy) in STRATEGIES.iter().enumerate() {
            let Some(cell) = cells
                .iter()
                .find(|c| c.scenario == *scenario && c.strategy == *strategy)
            else {
                continue;
            };
            let v = value(cell);
            let bx = first + s as f64 * (bar + gap);
            let by = y(v);
            let _ = writeln!(
                svg,
                r#"<rect x="{bx:.1}" y="{by:.1}" width="{bar}" height="{:.1}" fill="{}"/><text x="{:.1}" y="{:.1}" text-anchor="middle" font-size="13">{}</text>"#,
                (bottom - by).max(0.0),
                COLORS[s],
                bx + bar / 2.0,
                by - 6.0,
                label(v)
            );
        }
        let caption = match scenario {
            Scenario::Low => "low: 50 disjoint pairs",
            Scenario::Hot => "hot: 50 from one account",
        };
        let _ = writeln!(
            svg,
            r#"<text x="{center:.1}" y="{:.1}" text-anchor="middle" font-size="14">{caption}</text>"#,
            bottom + 24.0
        );
    }
    let _ = writeln!(
        svg,
        r##"<line x1="{left}" y1="{bottom}" x2="{right}" y2="{bottom}" stroke="#333"/><line x1="{left}" y1="{top}" x2="{left}" y2="{bottom}" stroke="#333"/>"##
    );
}

fn chart(cells: &[Cell], repeats: usize) -> String {
    let mut svg = String::new();
    let _ = writeln!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" font-family="Helvetica, Arial, sans-serif">"#
    );
    let _ = writeln!(
        svg,
        r#"<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/><text x="{:.1}" y="32" text-anchor="middle" font-size="20" font-weight="bold">{WRITERS} concurrent transfers on PostgreSQL (median of {repeats} runs)</text>"#,
        WIDTH / 2.0
    );
    panel(
        &mut svg,
        0.0,
        "Wall time",
        "milliseconds (lower is better)",
        cells,
        |c| c.wall_ms,
    );
    panel(
        &mut svg,
        WIDTH / 2.0,
        "Wasted attempts",
        "attempts beyond one per writer",
        cells,
        Cell::wasted,
    );
    // Legend.
    let legend_y = HEIGHT - 40.0;
    let captions = [
        "optimistic (versioned + retry)",
        "pessimistic (FOR UPDATE)",
        "adaptive (on_conflict = lock)",
        "adaptive, first burst (no hot-row memory)",
    ];
    // About 7.5 px per character at 14 px, plus the swatch and a gap.
    let item_width = |caption: &str| 22.0 + 7.5 * caption.len() as f64 + 36.0;
    let total: f64 = captions.iter().map(|c| item_width(c)).sum::<f64>() - 36.0;
    let mut lx = (WIDTH - total) / 2.0;
    for (color, caption) in COLORS.iter().zip(captions) {
        let _ = writeln!(
            svg,
            r#"<rect x="{lx:.1}" y="{:.1}" width="16" height="16" fill="{color}"/><text x="{:.1}" y="{:.1}" font-size="14">{caption}</text>"#,
            legend_y - 13.0,
            lx + 22.0,
            legend_y
        );
        lx += item_width(caption);
    }
    svg.push_str("</svg>\n");
    svg
}
