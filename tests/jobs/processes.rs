//! Workers in separate OS processes: this test binary run again with
//! `WORKER_ENV` set, each process a worker on the test's database. One is
//! SIGKILLed while inside a job (its handler blocks on an advisory lock the
//! test holds), and the job runs again elsewhere after its lease.

use std::io::Read;
use std::process::{Child, Command, Stdio};

use super::*;

/// Set in a worker process: the database URL to work on.
const WORKER_ENV: &str = "IDEM_JOBS_TEST_WORKER_DB";
/// Set in a worker process: the lease, in milliseconds.
const LEASE_ENV: &str = "IDEM_JOBS_TEST_WORKER_LEASE_MS";
/// The advisory lock a blocking job waits on while the test holds it.
const GATE: i64 = 0x6a6f_6273;

/// In a worker process: run a worker until stdin closes. Its handler
/// writes the effect with this process's name, then, for a blocking job,
/// waits on the gate, then takes a little time so that work spreads.
async fn act_as_worker(url: &str) {
    use diesel_async::RunQueryDsl;
    let lease: u64 = std::env::var(LEASE_ENV)
        .expect("lease")
        .parse()
        .expect("ms");
    let name = format!("proc-{}", std::process::id());
    let pool = pool(url);
    let me = name.clone();
    let worker = Worker::new(pool.clone())
        .name(&name)
        .batch_size(2)
        .poll_interval(Duration::from_millis(25))
        .lease(Duration::from_millis(lease))
        .handle(move |conn, job: &Compensate| {
            let me = me.clone();
            async move {
                record_effect(conn, &job.key, &me).await?;
                if job.block {
                    diesel::sql_query("SELECT pg_advisory_xact_lock_shared($1)")
                        .bind::<BigInt, _>(GATE)
                        .execute(conn)
                        .await?;
                }
                diesel::sql_query("SELECT pg_sleep(0.01)")
                    .execute(conn)
                    .await?;
                Ok::<_, AppError>(())
            }
            .scope_boxed()
        });
    let mut conn = pool.get().await.expect("conn");
    diesel::sql_query("INSERT INTO workers_ready VALUES ($1)")
        .bind::<Text, _>(&name)
        .execute(&mut conn)
        .await
        .expect("ready");
    drop(conn);
    let stdin_closed = async {
        let _ = tokio::task::spawn_blocking(|| std::io::stdin().read_to_end(&mut Vec::new())).await;
    };
    worker.run(stdin_closed).await.expect("worker");
}

/// Start `n` worker processes running `test` (this test's own path).
fn spawn_workers(n: usize, test: &str, url: &str, lease: Duration) -> Vec<Child> {
    let exe = std::env::current_exe().expect("the test binary");
    (0..n)
        .map(|_| {
            Command::new(&exe)
                .args(["--exact", test, "--nocapture", "--test-threads=1"])
                .env(WORKER_ENV, url)
                .env(LEASE_ENV, lease.as_millis().to_string())
                .stdin(Stdio::piped())
                .stdout(Stdio::null())
                .spawn()
                .expect("spawn a worker process")
        })
        .collect()
}

/// Close the workers' stdin and wait for each to exit cleanly.
fn stop_workers(workers: Vec<Child>) {
    for mut child in workers {
        drop(child.stdin.take());
        let status = child.wait().expect("wait");
        assert!(status.success(), "a worker process failed: {status}");
    }
}

async fn enqueue_all(env: &Env, jobs: Vec<Compensate>) {
    for job in jobs {
        assert!(decide(&env.pool, &job).await.expect("enqueue").is_new());
    }
}

/// `(key, count)` of keys whose effect is not there exactly once.
async fn not_once(env: &Env) -> Vec<(String, i64)> {
    env.client
        .query(
            "SELECT k.key, count(e.key) FROM (SELECT DISTINCT key FROM effects
                 UNION SELECT 'job-' || n FROM generate_series(0, 59) n) k
             LEFT JOIN effects e ON e.key = k.key GROUP BY k.key HAVING count(e.key) <> 1",
            &[],
        )
        .await
        .expect("effects")
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect()
}

fn jobs(n: usize) -> Vec<Compensate> {
    (0..n)
        .map(|i| Compensate::new(&format!("job-{i}")))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_worker_processes_run_every_job_once() {
    if let Ok(url) = std::env::var(WORKER_ENV) {
        return act_as_worker(&url).await;
    }
    let env = env().await;
    let workers = spawn_workers(
        3,
        "processes::three_worker_processes_run_every_job_once",
        env.db.url(),
        Duration::from_secs(30),
    );
    env.until("SELECT count(*) FROM workers_ready", 3).await;
    enqueue_all(&env, jobs(60)).await;
    env.until("SELECT count(*) FROM idem_jobs", 0).await;
    stop_workers(workers);

    assert_eq!(not_once(&env).await, []);
    assert_eq!(env.scalar("SELECT count(*) FROM effects").await, 60);
    let busy = env
        .scalar("SELECT count(DISTINCT worker) FROM effects")
        .await;
    assert!(busy >= 2, "only {busy} of 3 processes ran jobs");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_process_killed_mid_job_leaves_it_to_another_after_its_lease() {
    if let Ok(url) = std::env::var(WORKER_ENV) {
        return act_as_worker(&url).await;
    }
    let env = env().await;
    // The gate is closed: a blocking job's run waits inside its transaction.
    env.client
        .execute("SELECT pg_advisory_lock($1)", &[&GATE])
        .await
        .expect("close the gate");
    let mut all = jobs(60);
    all[0].block = true;
    enqueue_all(&env, all).await;
    let lease = Duration::from_secs(3);
    let mut workers = spawn_workers(
        3,
        "processes::a_worker_process_killed_mid_job_leaves_it_to_another_after_its_lease",
        env.db.url(),
        lease,
    );

    // Some process's run of job-0 waits at the gate: its effect is written,
    // not committed.
    env.until(
        // This database's only: pg_locks is the whole server's, and other
        // tests (of this run, or of another) wait on advisory locks too.
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted \
         AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
        1,
    )
    .await;
    let held = env
        .client
        .query_one(
            "SELECT locked_by, locked_until::text, attempts FROM idem_jobs WHERE key = 'job-0'",
            &[],
        )
        .await
        .expect("job-0 is claimed");
    let (holder, locked_until, attempts): (String, String, i32) =
        (held.get(0), held.get(1), held.get(2));
    assert_eq!(attempts, 1);
    let pid: u32 = holder
        .strip_prefix("proc-")
        .and_then(|p| p.parse().ok())
        .expect("a worker process's name");
    let index = workers
        .iter()
        .position(|c| c.id() == pid)
        .expect("one of ours");
    let mut victim = workers.remove(index);
    victim.kill().expect("SIGKILL");
    let status = victim.wait().expect("reaped");
    assert!(!status.success(), "{status}");

    // Killed mid-job: nothing of its run committed, the job is still held.
    assert_eq!(env.effects("job-0").await, 0);
    assert_eq!(
        env.scalar("SELECT count(*) FROM idem_jobs WHERE key = 'job-0' AND state = 'running'")
            .await,
        1
    );
    // Open the gate: the dead process's backend finds its client gone and
    // rolls back; the job waits for its lease, then another process runs it.
    env.client
        .execute("SELECT pg_advisory_unlock($1)", &[&GATE])
        .await
        .expect("open the gate");
    env.until("SELECT count(*) FROM idem_jobs", 0).await;
    stop_workers(workers);

    assert_eq!(not_once(&env).await, []);
    assert_eq!(env.scalar("SELECT count(*) FROM effects").await, 60);
    let rerun = env
        .client
        .query_one(
            "SELECT worker, at >= $1::text::timestamptz FROM effects WHERE key = 'job-0'",
            &[&locked_until],
        )
        .await
        .expect("job-0's effect");
    let (worker, after_lease): (String, bool) = (rerun.get(0), rerun.get(1));
    assert_ne!(worker, holder, "run again by another process");
    assert!(
        after_lease,
        "run again only after the lease ({locked_until})"
    );
}
