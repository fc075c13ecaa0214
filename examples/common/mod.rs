//! Shared by the examples: where their database is.
//!
//! Each example keeps to tables named after itself (`quickstart_*`,
//! `bench_versioned_*`) and resets them at start, so it can share a database
//! with anything else.

use std::time::Duration;

use tokio_postgres::NoTls;

/// The conventional local server, tried when `DATABASE_URL` is not set.
const LOCAL_URL: &str = "postgres://postgres@127.0.0.1:5432/postgres";

/// The URL of a PostgreSQL server the example may create tables on.
///
/// `DATABASE_URL` if set; else a server on 127.0.0.1:5432 if one answers within
/// a second; else a throwaway cluster started from the installed PostgreSQL
/// server binaries, which lives as long as this process and is removed when it
/// exits. So a fresh machine needs nothing but those binaries.
pub async fn database_url() -> String {
    if let Ok(url) = std::env::var("DATABASE_URL") {
        if !url.is_empty() {
            return url;
        }
    }
    let local = tokio::time::timeout(
        Duration::from_secs(1),
        tokio_postgres::connect(LOCAL_URL, NoTls),
    )
    .await;
    if let Ok(Ok((client, connection))) = local {
        drop(client);
        // Dropping the client ends the connection task; drive it to a clean close.
        let _ = connection.await;
        return LOCAL_URL.to_owned();
    }
    eprintln!("no DATABASE_URL and no server on 127.0.0.1:5432: starting a throwaway cluster");
    // DATABASE_URL is unset here, so this starts idem-testing's per-process
    // cluster (initdb + pg_ctl, blocking), which is stopped and deleted at exit.
    let started = tokio::task::spawn_blocking(idem_testing::server_url).await;
    match started {
        Ok(Ok(url)) => url,
        // One line and exit 1, not a panic's backtrace: what to install or
        // set is the whole message.
        Ok(Err(e)) => {
            eprintln!("could not start a throwaway PostgreSQL cluster: {e}");
            std::process::exit(1);
        }
        Err(e) => {
            eprintln!("could not start a throwaway PostgreSQL cluster: {e}");
            std::process::exit(1);
        }
    }
}
