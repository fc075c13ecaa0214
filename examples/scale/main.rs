//! Many processes, one PostgreSQL: N OS processes of a small idempotent and
//! retryable HTTP service share nothing but the database, and every request
//! reaches two of them at once under the same `Idempotency-Key`.
//!
//! `cargo run --release --example scale -- --processes N [--pgbouncer]`
//! (more: `--rounds R --requests K --concurrency C --hot-percent P
//! --pool-size S --pgbouncer-pool B`, and `--no-statement-cache`: direct, with
//! the pools set up as for transaction pooling, which separates what that
//! setting costs from PgBouncer's hop). PostgreSQL: `DATABASE_URL`, else
//! 127.0.0.1:5432, else a throwaway cluster; the run gets a fresh database,
//! dropped at the end.
//!
//! The example starts N copies of itself with `--serve` ([`service`]): each
//! has its own pool and nothing else in common with the others. With
//! `--pgbouncer` they reach the database through a throwaway PgBouncer in
//! transaction pooling mode (idem-testing's harness; the installed
//! `pgbouncer` program) with pools set up for it
//! (`Pooler::TransactionPooling`). The load ([`load`]) sends each logical
//! request to processes `i mod N` and `i+1 mod N` at once, `--hot-percent` of
//! them (default 20) to one hot account through `#[retryable(on_conflict =
//! lock)]`. Rounds with 1 process and with N alternate (`--rounds` of each,
//! default 3, after a warm-up), and the throughputs are medians.
//!
//! Then the database is counted ([`census`]): `effects` (rows),
//! `duplicate_effects` (rows beyond one per key), `lost` (keys the client saw
//! acknowledged with no row), and the hot account's books (balance and
//! version equal to what its effects add up to). The last line is
//! `processes=N via=direct|pgbouncer requests=.. effects=.. duplicate_effects=0
//! lost=0 throughput_1=.. throughput_N=..` (logical requests per second); the
//! run exits with 1 when anything is duplicated, lost, disagreeing or
//! unbalanced.

#[path = "../common/mod.rs"]
mod common;

mod census;
mod fleet;
mod load;
mod service;

use std::error::Error;

use diesel_async::{AsyncConnection, AsyncPgConnection};
use idem_testing::pgbouncer::{PgBouncer, PgBouncerSettings};
use idem_testing::TestDatabase;

use fleet::Fleet;
use load::Round;

/// The parent's settings.
#[derive(Debug, Clone)]
struct Args {
    processes: usize,
    pgbouncer: bool,
    no_statement_cache: bool,
    rounds: usize,
    requests: usize,
    concurrency: usize,
    hot_percent: usize,
    pool_size: usize,
    pgbouncer_pool: u32,
}

fn parse_args(args: &[String]) -> Result<Args, String> {
    let mut parsed = Args {
        processes: 4,
        pgbouncer: false,
        no_statement_cache: false,
        rounds: 5,
        requests: 1000,
        concurrency: 16,
        hot_percent: 20,
        pool_size: 8,
        pgbouncer_pool: 16,
    };
    let mut args = args.iter();
    while let Some(arg) = args.next() {
        let mut value = || -> Result<usize, String> {
            args.next()
                .and_then(|v| v.parse().ok())
                .filter(|n| *n > 0)
                .ok_or_else(|| format!("{arg} needs a positive number"))
        };
        match arg.as_str() {
            "--pgbouncer" => parsed.pgbouncer = true,
            "--no-statement-cache" => parsed.no_statement_cache = true,
            "--processes" => parsed.processes = value()?,
            "--rounds" => parsed.rounds = value()?,
            "--requests" => parsed.requests = value()?,
            "--concurrency" => parsed.concurrency = value()?,
            "--hot-percent" => parsed.hot_percent = value()?.min(100),
            "--pool-size" => parsed.pool_size = value()?,
            "--pgbouncer-pool" => parsed.pgbouncer_pool = value()? as u32,
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    Ok(parsed)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn Error>> {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    if argv.iter().any(|a| a == "--serve") {
        return service::serve(fleet::serve_args(&argv)?).await;
    }
    let args = parse_args(&argv)?;
    let server_url = common::database_url().await;
    let db = TestDatabase::create_on(&server_url).await?;
    service::setup(&mut AsyncPgConnection::establish(db.url()).await?).await?;
    let bouncer = if args.pgbouncer {
        let settings = PgBouncerSettings {
            pool_size: args.pgbouncer_pool,
            ..PgBouncerSettings::default()
        };
        let url = server_url.clone();
        Some(tokio::task::spawn_blocking(move || PgBouncer::start_with(&url, &settings)).await??)
    } else {
        None
    };
    let url = match &bouncer {
        Some(bouncer) => bouncer.url_for(db.url())?,
        None => db.url().to_owned(),
    };
    let via = if args.pgbouncer {
        "pgbouncer"
    } else {
        "direct"
    };
    // Behind PgBouncer the pools must be set up for transaction pooling.
    let transaction_pooling = args.pgbouncer || args.no_statement_cache;
    println!(
        "database={} processes={} via={via} pooler={} pool_size={} per process{}",
        db.name(),
        args.processes,
        if transaction_pooling {
            "TransactionPooling"
        } else {
            "Direct"
        },
        args.pool_size,
        match &bouncer {
            Some(_) => format!(", pgbouncer pool_size={}", args.pgbouncer_pool),
            None => String::new(),
        }
    );
    let fleet = Fleet::start(args.processes, &url, transaction_pooling, args.pool_size)?;
    let result = drive(&args, &fleet, &server_url, &db).await;
    fleet.stop();
    let totals = result?;
    let census = census::take(db.url(), &totals.acknowledged).await?;
    report(&args, via, &totals, &census);
    drop(bouncer);
    drop(db);
    let clean = census.duplicate_effects == 0
        && census.lost == 0
        && totals.disagreeing == 0
        && census.hot_books_balance();
    if !clean {
        std::process::exit(1);
    }
    Ok(())
}

/// What all rounds add up to.
#[derive(Debug, Default)]
struct Totals {
    requests: usize,
    acknowledged: Vec<String>,
    failed: usize,
    disagreeing: usize,
    throughput_1: Vec<f64>,
    throughput_n: Vec<f64>,
    wasted_warm_up: i64,
    wasted_1: i64,
    wasted_n: i64,
    server_connections: i64,
}

async fn drive(
    args: &Args,
    fleet: &Fleet,
    admin_url: &str,
    db: &TestDatabase,
) -> Result<Totals, Box<dyn Error>> {
    let mut totals = Totals::default();
    let warm_up = Round {
        label: "warm".into(),
        ports: fleet.ports.clone(),
        requests: args.concurrency * 8,
        concurrency: args.concurrency,
        hot_percent: args.hot_percent,
    };
    // The first contact with the hot row: each process learns it on its own.
    totals.wasted_warm_up = run_round(&warm_up, fleet, &mut totals).await?.1;
    for round in 0..args.rounds {
        // Alternating which goes first, so drift hits both alike.
        let order = match args.processes {
            1 => vec![1],
            n if round % 2 == 0 => vec![1, n],
            n => vec![n, 1],
        };
        for processes in order {
            let spec = Round {
                label: format!("r{round}-p{processes}"),
                ports: fleet.ports[..processes].to_vec(),
                requests: args.requests,
                concurrency: args.concurrency,
                hot_percent: args.hot_percent,
            };
            let (throughput, wasted) = run_round(&spec, fleet, &mut totals).await?;
            if processes == 1 {
                totals.throughput_1.push(throughput);
                totals.wasted_1 += wasted;
            } else {
                totals.throughput_n.push(throughput);
                totals.wasted_n += wasted;
            }
            if processes == args.processes {
                // Every process's pool has been busy now.
                totals.server_connections =
                    census::server_connections(admin_url, db.name()).await?;
            }
        }
    }
    Ok(totals)
}

/// Run one round; its throughput and the body runs it threw away (runs
/// beyond one per request: lost races, retries).
async fn run_round(
    spec: &Round,
    fleet: &Fleet,
    totals: &mut Totals,
) -> Result<(f64, i64), Box<dyn Error>> {
    let before = load::stats(&fleet.ports).await?;
    let outcome = load::run(spec).await;
    let after = load::stats(&fleet.ports).await?;
    let runs = (after.pay_runs + after.hot_runs) - (before.pay_runs + before.hot_runs);
    let wasted = runs as i64 - outcome.acknowledged.len() as i64;
    let throughput = outcome.throughput(spec.requests);
    println!(
        "round={} processes={} requests={} secs={:.2} throughput={throughput:.0} failed_sends={} wasted_runs={wasted}",
        spec.label,
        spec.ports.len(),
        spec.requests,
        outcome.elapsed.as_secs_f64(),
        outcome.failed,
    );
    for failure in &outcome.failures {
        eprintln!("  failed: {failure}");
    }
    totals.requests += spec.requests;
    totals.failed += outcome.failed;
    totals.disagreeing += outcome.disagreeing;
    totals.acknowledged.extend(outcome.acknowledged);
    Ok((throughput, wasted))
}

fn median(values: &[f64]) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    match sorted.len() {
        0 => 0.0,
        n if n % 2 == 1 => sorted[n / 2],
        n => (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0,
    }
}

fn report(args: &Args, via: &str, totals: &Totals, census: &census::Census) {
    let t1 = median(&totals.throughput_1);
    // With one process, its rounds are both.
    let tn = match args.processes {
        1 => t1,
        _ => median(&totals.throughput_n),
    };
    println!(
        "acknowledged={} failed_sends={} disagreeing_answers={}",
        totals.acknowledged.len(),
        totals.failed,
        totals.disagreeing
    );
    println!(
        "hot_account balance={} version={} hot_effects={} sum={} books_balance={}",
        census.hot_balance,
        census.hot_version,
        census.hot_effects,
        census.hot_effects_sum,
        census.hot_books_balance()
    );
    println!(
        "wasted_runs_warm_up={} wasted_runs_1={} wasted_runs_N={} server_connections_during_N={} throughput_N/throughput_1={:.2}",
        totals.wasted_warm_up,
        totals.wasted_1,
        totals.wasted_n,
        totals.server_connections,
        tn / t1
    );
    println!(
        "processes={} via={via} requests={} effects={} duplicate_effects={} lost={} throughput_1={t1:.0} throughput_N={tn:.0}",
        args.processes, totals.requests, census.effects, census.duplicate_effects, census.lost
    );
}
