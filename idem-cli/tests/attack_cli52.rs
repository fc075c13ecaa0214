//! Hostile pass (helper, session 52) on b9e2a9b: `idem jobs requeue --all`
//! exits 1 when it left a dead job dead beside a live one. Tried with
//! nothing dead, `--kind`, `--limit`, `--json`, two dead jobs of one kind
//! and key (reachable: an enqueue beside a dead job, which dies too), and
//! concurrent requeues. Each counts what `idem_jobs` holds after.

use tokio_postgres::Client;

mod common;
use common::{count, idem, json, migrated};

/// How many jobs are due, and how many dead.
async fn states(client: &Client) -> (i64, i64) {
    let due = count(client, "SELECT count(*) FROM idem_jobs WHERE state = 'due'").await;
    (
        due,
        count(
            client,
            "SELECT count(*) FROM idem_jobs WHERE state = 'dead'",
        )
        .await,
    )
}

/// A dead job of `kind` and `key`, failed `ago` seconds ago.
async fn dead(client: &Client, kind: &str, key: &str, ago: i32) {
    client
        .execute(
            "INSERT INTO idem_jobs (kind, key, payload, state, last_error, failed_at)
             VALUES ($1, $2, '{}', 'dead', 'no', now() - $3::int4 * interval '1 second')",
            &[&kind, &key, &ago],
        )
        .await
        .expect("a dead job");
}

async fn live(client: &Client, kind: &str, key: &str) {
    client
        .execute(
            "INSERT INTO idem_jobs (kind, key, payload) VALUES ($1, $2, '{}')",
            &[&kind, &key],
        )
        .await
        .expect("a live job");
}

#[tokio::test]
async fn attack52_requeue_all_exit_codes_by_kind_limit_and_json() {
    let (db, client) = migrated().await;
    let url = db.url();
    // Nothing dead: done, exit 0, JSON an empty list.
    let (code, out, err) = idem(url, &["jobs", "requeue", "--all"]);
    assert_eq!(
        (code, out.as_str()),
        (0, "requeued 0 of 0 dead job(s)\n"),
        "{err}"
    );
    let (code, out, _) = idem(url, &["--json", "jobs", "requeue", "--all"]);
    assert_eq!((code, json(&out)), (0, serde_json::json!([])));
    // A dead refund beside a live one (oldest), and a dead mail alone.
    dead(&client, "refund", "a", 30).await;
    live(&client, "refund", "a").await;
    dead(&client, "mail", "m", 10).await;
    // --kind of another kind: nothing left dead, exit 0.
    let (code, out, _) = idem(url, &["jobs", "requeue", "--all", "--kind", "nope"]);
    assert_eq!((code, out.as_str()), (0, "requeued 0 of 0 dead job(s)\n"));
    // --limit 1 reaches only the oldest, left dead: exit 1, mail untouched.
    let (code, out, _) = idem(url, &["--json", "jobs", "requeue", "--all", "--limit", "1"]);
    assert_eq!(code, 1, "{out}");
    assert_eq!(json(&out).as_array().map(Vec::len), Some(1), "{out}");
    assert_eq!(
        count(
            &client,
            "SELECT count(*) FROM idem_jobs WHERE state = 'dead'"
        )
        .await,
        2
    );
    // --limit 0 is refused by the parser (exit 2), nothing changes.
    let (code, _, _) = idem(url, &["jobs", "requeue", "--all", "--limit", "0"]);
    assert_eq!(code, 2);
    // --kind mail: requeued, exit 0; --kind refund: left dead, exit 1.
    let (code, out, _) = idem(url, &["jobs", "requeue", "--all", "--kind", "mail"]);
    assert_eq!((code, out.as_str()), (0, "requeued 1 of 1 dead job(s)\n"));
    let (code, out, _) = idem(url, &["jobs", "requeue", "--all", "--kind", "refund"]);
    assert_eq!(code, 1, "{out}");
    assert_eq!(
        count(
            &client,
            "SELECT count(*) FROM idem_jobs WHERE state = 'dead' AND kind = 'refund'"
        )
        .await,
        1
    );
    assert_eq!(
        count(
            &client,
            "SELECT count(*) FROM idem_jobs WHERE state = 'due' AND kind = 'mail'"
        )
        .await,
        1
    );
}

/// Two dead jobs of one kind and key, none live (an enqueue beside the
/// first dead one, which died too): `--all` requeues the oldest, and the
/// second, now beside it, is left dead: exit 1, one due, one dead.
#[tokio::test]
async fn attack52_two_dead_of_one_key_requeue_one_and_exit_1() {
    let (db, client) = migrated().await;
    let url = db.url();
    dead(&client, "refund", "k", 60).await;
    dead(&client, "refund", "k", 5).await;
    let (code, out, err) = idem(url, &["jobs", "requeue", "--all"]);
    assert_eq!(code, 1, "{out}{err}");
    assert_eq!(
        out,
        "requeued 1 of 2 dead job(s); 1 left dead: a live job of its kind and key exists\n"
    );
    assert_eq!(states(&client).await, (1, 1), "due, dead");
}

/// Four `requeue --all` at once over 30 dead jobs of distinct keys and 5
/// pairs of one key: every job requeued once in all, no process fails
/// (exit 2), and exit 1 only from one that left a dead job beside a live
/// one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attack52_concurrent_requeues_requeue_each_job_once() {
    let (db, client) = migrated().await;
    let url = db.url().to_owned();
    for i in 0..30 {
        dead(&client, "refund", &format!("k{i}"), 100 - i).await;
    }
    for i in 0..5 {
        dead(&client, "pair", &format!("p{i}"), 50).await;
        dead(&client, "pair", &format!("p{i}"), 40).await;
    }
    let runs: Vec<_> = (0..4)
        .map(|_| {
            let url = url.clone();
            std::thread::spawn(move || idem(&url, &["--json", "jobs", "requeue", "--all"]))
        })
        .collect();
    let mut due = 0;
    let mut left = 0;
    for run in runs {
        let (code, out, err) = run.join().unwrap();
        assert!(code == 0 || code == 1, "exit {code}: {out}{err}");
        let results = json(&out);
        let results = results.as_array().expect("a list");
        let of = |what: &str| results.iter().filter(|r| r["result"] == what).count();
        due += of("due");
        left += of("live_exists");
        assert_eq!(code == 1, of("live_exists") > 0, "{out}");
    }
    assert_eq!(due, 35, "each job made due once in all");
    assert!(
        left >= 5,
        "each pair's second left dead at least once: {left}"
    );
    assert_eq!(states(&client).await, (35, 5), "due, dead");
}
