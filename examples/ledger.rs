//! A double-entry wallet ledger over HTTP: every transfer is idempotent under
//! its `Idempotency-Key`, retried when it loses a race, and written as
//! compare-and-sets of versioned accounts; the books always balance.
//!
//! ```sh
//! cargo run --example ledger                    # serve on 127.0.0.1:3000
//! cargo run --example ledger -- --port 8080     # another port
//! cargo run --example ledger -- --keep          # keep the ledger of the last run
//! cargo run --example ledger -- --admin-actions # let the admin page requeue and discard
//! cargo run --example ledger -- --reconcile     # recompute balances, report drift
//! cargo run --example ledger -- --reap          # purge expired keys, report held ones
//! ```
//!
//! PostgreSQL: `DATABASE_URL`, else 127.0.0.1:5432, else a throwaway cluster
//! from the installed server binaries (which lives as long as the process, so
//! `--reconcile` and `--reap` need one of the first two). The server starts
//! from empty `ledger_*` tables unless `--keep` is given, and every
//! `--reap-every` seconds (default 60) purges expired idempotency records.
//! Retention and lease: see `examples/ledger/app/admin.rs`.
//!
//! The endpoints are listed in `examples/ledger/app/api.rs`, the input
//! limits in `examples/ledger/app/limits.rs`. idem's admin page is mounted
//! at `/admin` (its URL is printed at start-up): loopback peers only, and
//! read-only unless `--admin-actions` is given.
//!
//! The log (`tracing` events, the ledger's and idem's) goes to stderr at
//! `info` and above; `RUST_LOG` overrides, e.g. `RUST_LOG=idem=debug,info`.
//! A 500 is logged there with its cause, never sent to the client.

#[path = "ledger/app/mod.rs"]
mod app;
#[path = "common/mod.rs"]
mod common;

use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::Duration;

use diesel_async::{AsyncConnection, AsyncPgConnection};
use idem::pool::{build_pool_with, PoolConfig};
use tracing_subscriber::EnvFilter;

const USAGE: &str =
    "usage: ledger [--port N] [--keep] [--reap-every SECONDS] [--admin-actions] | --reconcile | --reap";

enum Command {
    Serve {
        port: u16,
        keep: bool,
        reap_every: Duration,
        admin_actions: bool,
    },
    Reconcile,
    Reap,
}

fn command() -> Result<Command, String> {
    let mut args = std::env::args().skip(1);
    let (mut port, mut keep, mut reap_every, mut job) = (3000, false, 60, None);
    let mut admin_actions = false;
    while let Some(arg) = args.next() {
        let (name, inline) = match arg.split_once('=') {
            Some((name, value)) => (name.to_owned(), Some(value.to_owned())),
            None => (arg.clone(), None),
        };
        let mut value = |what: &str| {
            inline
                .clone()
                .or_else(|| args.next())
                .ok_or_else(|| format!("{name} needs {what}; {USAGE}"))
        };
        match name.as_str() {
            "--port" => {
                port = value("a port")?
                    .parse()
                    .map_err(|_| format!("--port needs a port number; {USAGE}"))?
            }
            "--reap-every" => {
                reap_every = value("seconds")?
                    .parse()
                    .ok()
                    .filter(|s| *s > 0)
                    .ok_or_else(|| format!("--reap-every needs a positive number; {USAGE}"))?
            }
            "--keep" => keep = true,
            "--admin-actions" => admin_actions = true,
            "--reconcile" => job = Some(Command::Reconcile),
            "--reap" => job = Some(Command::Reap),
            "-h" | "--help" => return Err(USAGE.to_owned()),
            _ => return Err(format!("unknown argument {arg:?}; {USAGE}")),
        }
    }
    Ok(job.unwrap_or(Command::Serve {
        port,
        keep,
        reap_every: Duration::from_secs(reap_every),
        admin_actions,
    }))
}

/// The log: stderr (stdout is the jobs' report), `RUST_LOG` or `info`.
fn install_log() {
    let filter = match std::env::var("RUST_LOG") {
        Ok(spec) => EnvFilter::try_new(&spec).unwrap_or_else(|e| {
            eprintln!("ledger: RUST_LOG={spec:?} is not a filter ({e}); logging at info");
            EnvFilter::new("info")
        }),
        Err(_) => EnvFilter::new("info"),
    };
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
}

#[tokio::main]
async fn main() -> ExitCode {
    install_log();
    let command = match command() {
        Ok(command) => command,
        Err(message) => {
            eprintln!("{message}");
            return ExitCode::from(2);
        }
    };
    match run(command).await {
        Ok(code) => code,
        Err(e) => {
            eprintln!("ledger: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn run(command: Command) -> Result<ExitCode, Box<dyn std::error::Error>> {
    let url = common::database_url().await;
    let mut conn = AsyncPgConnection::establish(&url).await?;
    idem::migrate(&mut conn).await?;
    let keep = !matches!(command, Command::Serve { keep: false, .. });
    app::schema::setup(&mut conn, !keep).await?;
    match command {
        Command::Reconcile => {
            let report = app::admin::reconcile(&mut conn).await?;
            println!(
                "accounts={} entries={} debits={} credits={} unbalanced_movements={} drifted_accounts={}",
                report.accounts,
                report.entries,
                report.debits,
                report.credits,
                report.unbalanced_movements,
                report.drift.len()
            );
            for d in &report.drift {
                println!(
                    "drift: account {} (tenant {}, {}) caches {} but its entries sum to {} (off by {})",
                    d.account_id,
                    d.tenant_id,
                    d.kind,
                    d.cached,
                    d.from_entries,
                    i128::from(d.cached) - d.from_entries
                );
            }
            if report.is_clean() {
                println!("ledger is consistent: nothing to fix");
                Ok(ExitCode::SUCCESS)
            } else {
                println!("drift found; nothing was changed: correct it with reviewed movements");
                Ok(ExitCode::FAILURE)
            }
        }
        Command::Reap => {
            let reaped = app::admin::reap(&mut conn).await?;
            print_reaped(&reaped, true);
            Ok(ExitCode::SUCCESS)
        }
        Command::Serve {
            port,
            reap_every,
            admin_actions,
            ..
        } => {
            drop(conn);
            let pool = build_pool_with(
                &url,
                &PoolConfig {
                    max_size: 16,
                    wait_timeout: Duration::from_secs(10),
                    ..Default::default()
                },
            )?;
            let listener = tokio::net::TcpListener::bind(("127.0.0.1", port)).await?;
            let addr = listener.local_addr()?;
            println!(
                "ledger listening on http://{addr} (reaper every {}s; Ctrl-C to stop)",
                reap_every.as_secs()
            );
            println!(
                "admin page on http://{addr}/admin ({})",
                if admin_actions {
                    "requeue and discard enabled"
                } else {
                    "read-only; --admin-actions to requeue and discard"
                }
            );
            tokio::spawn(reaper(url, reap_every));
            // The peer address: the admin page answers loopback peers only.
            let app = app::api::router_with_admin(pool, admin_actions);
            axum::serve(
                listener,
                app.into_make_service_with_connect_info::<SocketAddr>(),
            )
            .with_graceful_shutdown(async {
                let _ = tokio::signal::ctrl_c().await;
            })
            .await?;
            Ok(ExitCode::SUCCESS)
        }
    }
}

/// The server's reaper: `--reap` on a timer, quiet unless it finds something.
async fn reaper(url: String, every: Duration) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let reaped = match AsyncPgConnection::establish(&url).await {
            Ok(mut conn) => app::admin::reap(&mut conn).await,
            Err(e) => {
                tracing::warn!(error = %e, "reaper: could not connect; trying again next tick");
                continue;
            }
        };
        match reaped {
            Ok(reaped) => print_reaped(&reaped, false),
            Err(e) => tracing::error!(error = %e, "reaper: the purge failed"),
        }
    }
}

fn print_reaped(reaped: &app::admin::Reaped, always: bool) {
    let p = reaped.purge;
    if always || p.deleted > 0 || p.marked_unknown > 0 || !reaped.held.is_empty() {
        println!(
            "reaper: idem_requests: deleted {} expired completed record(s), marked {} in-progress record(s) past their lease outcome unknown, {} of unknown outcome held until settled; ledger keys held: {}",
            p.deleted,
            p.marked_unknown,
            p.unknown,
            reaped.held.len()
        );
    }
    for held in &reaped.held {
        println!(
            "reaper: held key {:?} in scope {} ({}, {} since {})",
            held.key, held.scope, held.operation, held.state, held.since
        );
    }
}
