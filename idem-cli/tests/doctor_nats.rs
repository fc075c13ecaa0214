//! `idem doctor --nats-url`: the relay's JetStream stream's duplicate window
//! against the relay's republish horizon, on a real NATS server
//! (`NATS_URL`, else 127.0.0.1:4222 with JetStream, else a throwaway
//! `nats-server -js`). Each test makes streams of its own, under unique
//! names, and deletes them.

use std::time::Duration;

use async_nats::jetstream::{self, stream};
use idem::pool::build_pool;
use idem_testing::TestDatabase;

mod common;
use common::{idem, json};

/// `idem doctor --nats-url nats` and `args`.
fn doctor(url: &str, nats: &str, args: &[&str]) -> (i32, String, String) {
    let mut all = vec!["doctor", "--nats-url", nats];
    all.extend_from_slice(args);
    idem(url, &all)
}

/// The doctor's line for the NATS check, and its fix line when it has one.
fn nats_lines(out: &str) -> String {
    let mut lines = out.lines().skip_while(|l| !l.contains("nats stream"));
    let first = lines.next().unwrap_or_default().to_owned();
    match lines.next().filter(|l| l.contains("fix:")) {
        Some(fix) => format!("{first}\n{fix}"),
        None => first,
    }
}

/// The NATS check of `--json`'s report.
fn nats_check(out: &str) -> serde_json::Value {
    json(out)["checks"]
        .as_array()
        .and_then(|c| c.iter().find(|c| c["name"] == "nats stream"))
        .cloned()
        .unwrap_or_else(|| panic!("no nats stream check: {out}"))
}

/// A name no other test (nor an earlier run) uses.
fn unique(prefix: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_nanos();
    format!("{prefix}_{}_{nanos}", std::process::id())
}

async fn duplicate_window(js: &jetstream::Context, name: &str) -> Duration {
    js.get_stream(name)
        .await
        .expect("the stream")
        .cached_info()
        .config
        .duplicate_window
}

async fn set_duplicate_window(js: &jetstream::Context, name: &str, window: Duration) {
    let mut config = js
        .get_stream(name)
        .await
        .expect("the stream")
        .cached_info()
        .config
        .clone();
    config.duplicate_window = window;
    js.update_stream(&config).await.expect("updated");
    assert_eq!(
        duplicate_window(js, name).await,
        window,
        "the server took it"
    );
}

#[tokio::test]
async fn the_streams_duplicate_window_against_the_relays_horizon() {
    let db = TestDatabase::create().await.expect("a database");
    let pool = build_pool(db.url()).expect("pool");
    let mut conn = pool.get().await.expect("conn");
    idem::migrate(&mut conn).await.expect("migrated");
    drop(conn);
    let nats = tokio::task::spawn_blocking(idem_testing::nats::url)
        .await
        .expect("no panic")
        .expect("a NATS server with JetStream");
    let js = jetstream::new(async_nats::connect(&nats).await.expect("connect to NATS"));
    let name = unique("IDEM_DOCTOR");
    let subject = format!("{name}.events");
    js.create_stream(stream::Config {
        name: name.clone(),
        subjects: vec![format!("{name}.>")],
        duplicate_window: Duration::from_secs(10),
        storage: stream::StorageType::Memory,
        ..Default::default()
    })
    .await
    .expect("create the stream");

    // The checks run in a task of their own, so that the stream is deleted
    // whatever they find.
    let checks = tokio::spawn(checks(
        db.url().to_owned(),
        nats.clone(),
        js.clone(),
        name.clone(),
        subject,
    ))
    .await;
    js.delete_stream(&name).await.expect("the stream deleted");
    assert!(js.get_stream(&name).await.is_err(), "no stream left behind");
    if let Err(e) = checks {
        std::panic::resume_unwind(e.into_panic());
    }
}

async fn checks(url: String, nats: String, js: jetstream::Context, name: String, subject: String) {
    let url = url.as_str();
    let run = |extra: &[&str]| {
        let mut args = vec!["--stream", name.as_str()];
        args.extend_from_slice(extra);
        doctor(url, &nats, &args)
    };

    // Without a NATS URL the check is not run, and nothing is said of it.
    let (code, out, err) = idem(url, &["doctor"]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(!out.contains("nats"), "{out}");

    // A 10 s window against the default relay's 37.6 s: fail, exit 1,
    // naming the window to set.
    assert_eq!(duplicate_window(&js, &name).await, Duration::from_secs(10));
    let (code, out, err) = run(&[]);
    assert_eq!(code, 1, "{out}{err}");
    let line = nats_lines(&out);
    assert!(line.starts_with("FAIL  nats stream"), "{out}");
    assert!(
        line.contains("10s (duplicate_window), shorter than the relay's republish horizon of 37.6s (lease 15s + backoff 22.6s)"),
        "{line}"
    );
    assert!(
        line.contains(&format!(
            "fix: raise its duplicate_window to at least 38s (`nats stream edit {name} --dupe-window 38s`)"
        )),
        "{line}"
    );
    let (code, out, _) = run(&["--json"]);
    assert_eq!(code, 1, "{out}");
    let check = nats_check(&out);
    assert_eq!(check["state"], "fail", "{out}");
    assert!(
        check["fix"].as_str().is_some_and(|f| f.contains("38s")),
        "{out}"
    );

    // The fix as it says: 38 s is enough, exit 0.
    set_duplicate_window(&js, &name, Duration::from_secs(38)).await;
    let (code, out, err) = run(&[]);
    assert_eq!(code, 0, "{out}{err}");
    let line = nats_lines(&out);
    assert!(
        line.starts_with("ok    nats stream") && line.contains("38s (duplicate_window), at least"),
        "{out}"
    );

    // A relay with a longer lease (30 s: a 52.6 s horizon) needs more.
    let (code, out, _) = run(&["--relay-lease", "30s"]);
    assert_eq!(code, 1, "{out}");
    assert!(nats_lines(&out).contains("--dupe-window 53s"), "{out}");
    // And one with fewer attempts and a shorter backoff less:
    // 15 s + 100 + 200 + 300 ms.
    let (code, out, _) = run(&[
        "--relay-max-attempts",
        "4",
        "--relay-backoff-base",
        "100ms",
        "--relay-backoff-max",
        "300ms",
    ]);
    assert_eq!(code, 0, "{out}");
    assert!(nats_lines(&out).contains("horizon of 15.6s"), "{out}");

    // A long window (JetStream's default, 2 min), and the stream found by
    // the subject it captures.
    set_duplicate_window(&js, &name, Duration::from_secs(120)).await;
    let (code, out, err) = doctor(url, &nats, &["--subject", &subject]);
    assert_eq!(code, 0, "{out}{err}");
    let line = nats_lines(&out);
    assert!(
        line.starts_with("ok    nats stream")
            && line.contains(&format!(
                "{name} (captures {subject}) keeps message ids for 120s"
            )),
        "{out}"
    );

    // No stream of that name, no stream for that subject: fail.
    let (code, out, _) = doctor(url, &nats, &["--stream", &format!("{name}_NONE")]);
    assert_eq!(code, 1, "{out}");
    assert!(
        nats_lines(&out).contains(&format!("no stream named {name}_NONE")),
        "{out}"
    );
    let (code, out, _) = doctor(
        url,
        &nats,
        &["--subject", &format!("{}.none", name.to_lowercase())],
    );
    assert_eq!(code, 1, "{out}");
    assert!(
        nats_lines(&out).contains("no stream captures the subject"),
        "{out}"
    );

    // NATS given without a stream: a warning naming the options, exit 0.
    let (code, out, _) = doctor(url, &nats, &[]);
    assert_eq!(code, 0, "{out}");
    let line = nats_lines(&out);
    assert!(
        line.starts_with("warn  nats stream") && line.contains("--stream"),
        "{out}"
    );

    // NATS unreachable: fail (a relay started now would not start), exit 1,
    // every other check still printed.
    let (code, out, err) = doctor(url, "nats://127.0.0.1:1", &["--stream", &name]);
    assert_eq!(code, 1, "{out}{err}");
    let line = nats_lines(&out);
    assert!(
        line.starts_with("FAIL  nats stream") && line.contains("could not reach NATS"),
        "{out}"
    );
    assert!(out.contains("ok    migrations"), "{out}");
    // The window checked above is the stream's still.
    assert_eq!(duplicate_window(&js, &name).await, Duration::from_secs(120));
}
