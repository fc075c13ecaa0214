//! The PgBouncer harness against a real server and the installed PgBouncer:
//! it forwards fresh test databases, pools by transaction, sets untranslated
//! messages on its server connections, and is gone after drop.

use std::net::TcpStream;
use std::time::Duration;

use idem_testing::pgbouncer::{PgBouncer, PgBouncerSettings};
use idem_testing::{server_url, HarnessError, TestDatabase};

/// Start one, or say why the machine cannot (no `pgbouncer` installed; CI
/// installs it) and let the test pass.
async fn start() -> Option<PgBouncer> {
    // One server connection per database: what transaction pooling shares
    // is then visible, whatever order PgBouncer picks idle ones in.
    let settings = PgBouncerSettings {
        pool_size: 1,
        ..PgBouncerSettings::default()
    };
    let started =
        tokio::task::spawn_blocking(move || PgBouncer::start_with(&server_url()?, &settings))
            .await
            .unwrap();
    match started {
        Ok(bouncer) => Some(bouncer),
        Err(e @ HarnessError::NoPgBouncer { .. }) => {
            eprintln!("skipped: {e}");
            None
        }
        Err(e) => panic!("{e}"),
    }
}

#[tokio::test]
async fn a_fresh_database_is_reachable_and_pooled_by_transaction() {
    let Some(bouncer) = start().await else { return };
    let db = TestDatabase::create().await.unwrap();
    let url = bouncer.url_for(db.url()).unwrap();
    assert!(url.contains(&format!(":{}/", bouncer.port())), "{url}");
    let a = idem_testing::connect(&url).await.unwrap();
    let b = idem_testing::connect(&url).await.unwrap();
    let name: String = a
        .query_one("SELECT current_database()", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(name, db.name());
    // The server connection's messages are untranslated (connect_query).
    let lc: String = a.query_one("SHOW lc_messages", &[]).await.unwrap().get(0);
    assert_eq!(lc, "C");
    // Transaction pooling: two connected clients share the one server
    // connection (session pooling would keep `b` waiting while `a` is
    // connected).
    let pid = |row: tokio_postgres::Row| row.get::<_, i32>(0);
    let first = pid(a.query_one("SELECT pg_backend_pid()", &[]).await.unwrap());
    let second = pid(b.query_one("SELECT pg_backend_pid()", &[]).await.unwrap());
    assert_eq!(first, second, "one server connection serves both clients");
    // A transaction keeps its server connection to itself: `b` waits for
    // its end.
    a.batch_execute("BEGIN").await.unwrap();
    let in_tx = pid(a.query_one("SELECT pg_backend_pid()", &[]).await.unwrap());
    assert_eq!(in_tx, first);
    {
        let waiting = b.query_one("SELECT pg_backend_pid()", &[]);
        tokio::pin!(waiting);
        assert!(
            tokio::time::timeout(Duration::from_millis(300), &mut waiting)
                .await
                .is_err(),
            "b ran while a's transaction held the server connection"
        );
        a.batch_execute("COMMIT").await.unwrap();
        assert_eq!(pid(waiting.await.unwrap()), first);
    }

    // Closing its server connections lets the database's backends exit.
    let direct = idem_testing::connect(db.url()).await.unwrap();
    let backends = || async {
        direct
            .query_one(
                "SELECT count(*) FROM pg_stat_activity \
                 WHERE datname = current_database() AND pid <> pg_backend_pid()",
                &[],
            )
            .await
            .unwrap()
            .get::<_, i64>(0)
    };
    assert_eq!(backends().await, 1);
    drop((a, b));
    bouncer.close_server_connections(db.name()).await.unwrap();
    let until = std::time::Instant::now() + Duration::from_secs(10);
    while backends().await > 0 {
        assert!(std::time::Instant::now() < until, "the backends stayed");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test]
async fn dropping_stops_it_and_removes_its_directory() {
    let Some(bouncer) = start().await else { return };
    let (port, dir) = (bouncer.port(), bouncer.dir().to_path_buf());
    assert!(dir.join("pgbouncer.ini").is_file());
    assert!(bouncer.log().contains("listening on"));
    drop(bouncer);
    assert!(!dir.exists(), "{} is still there", dir.display());
    assert!(
        TcpStream::connect_timeout(&([127, 0, 0, 1], port).into(), Duration::from_secs(1)).is_err(),
        "something still listens on {port}"
    );
}
