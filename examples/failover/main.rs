//! idem through failovers: payments sent with duplicates to a service on a
//! PostgreSQL primary and standby, their outbox events relayed to a
//! three-node JetStream cluster and consumed through the inbox, while the
//! primary is killed and the standby promoted (the old primary rejoining as
//! standby) and the stream's leader is killed. Afterwards every key is sent
//! again, the relay and the consumer settle, and everything is counted.
//!
//! `cargo run --release --features nats --example failover -- [--async]
//! [--seconds S --payments N --clients N --failovers N --leader-kills N
//! --lag-ms L --settle S]` (defaults: synchronous standby, 40 s of sending,
//! 2000 payments, 8 clients, 3 failovers, 2 leader kills, a standby 200 ms
//! behind at each kill, at most 90 s to settle). Needs the PostgreSQL server binaries (with `pg_basebackup` and
//! `pg_rewind`) and `nats-server`; the pair and the cluster are throwaway
//! ones of `idem_testing` (`replica::ReplicaPair`, `nats_cluster::NatsCluster`).
//!
//! * **Service and clients** (tokio tasks of this process): `pay` is
//!   `#[idempotent]` + `#[retryable]`; it inserts a payment row, whose id the
//!   server draws, and emits `PaymentMade` with `idem::outbox::emit`, and
//!   answers the payment id. Its pool is built on the pair's multi-host URL
//!   (`target_session_attrs=read-write`), with `Replication::Synchronous` on
//!   a synchronous pair (the default) or `Replication::Single` on an
//!   asynchronous one (`--async`). Each client sends its share of the keys,
//!   paced over `--seconds`: every fourth key twice at once, every fifth
//!   key again five keys later. A call that fails (`CommitUnknown`, a lost
//!   connection, a deadline: a 503) is sent again with the same key after a
//!   bounded backoff, for up to 45 s. Every payment id a call returned `Ok`
//!   with is recorded here, in the client, since the database may lose it.
//! * **Relay**: `idem::outbox::Relay` with `NatsPublisher` on a client
//!   connected to all three servers, into an R3 file stream.
//! * **Consumer**: `idem::inbox::Inbox::run` on a durable pull consumer,
//!   applying each event as a row of `failover_effects` in the inbox's
//!   transaction (same database); started again when its loop stops or
//!   stalls.
//! * **Chaos**: the faults spread evenly over `--seconds`, alternating,
//!   each done before the next: a failover stops the primary's WAL sender
//!   (`SIGSTOP`) for `--lag-ms`, so that the standby is that far behind, as
//!   over a real network under load (on loopback it is microseconds behind,
//!   and a kill almost never finds a commit it lacks; `--lag-ms 0` leaves
//!   it so): commits of that moment are on the primary alone (`--async`) or
//!   wait for the standby (sync). Then `kill -9` of the primary,
//!   promotion of the standby and the old primary rewound (or recloned)
//!   and back as the standby; a leader kill is `kill -9` of the server
//!   leading the stream, then its restart and wait until every replica is
//!   current.
//! * **After**: the standby caught up, every key is sent once more (each
//!   must now be a replay, or run once if no call for it had succeeded),
//!   the relay and the consumer settle (every payment's event applied and
//!   no event unsent, or nothing moving for 15 s, or `--settle`), and then
//!   the count.
//!
//! The last line counts in PostgreSQL (the final primary) and the stream,
//! never from what idem, the relay or the consumer reported:
//!
//! `mode=sync|async failovers=N nats_leader_kills=M acknowledged=..
//! lost_acknowledged=.. duplicate_effects=.. ghost_events=.. lost_events=..`
//!
//! * `acknowledged`: keys a call returned `Ok` for (fresh or replay) at
//!   least once, as the clients recorded it.
//! * `lost_acknowledged`: acknowledged keys of which a payment id a client
//!   was answered is not a payment row on the final primary (its record
//!   and payment were lost; a later send ran the payment again under a new
//!   id).
//! * `duplicate_effects`: payment rows beyond one per key, plus consumer
//!   effect rows beyond one per payment (neither table has a unique
//!   constraint that would hide them).
//! * `ghost_events`: payments named by a message in the stream or by an
//!   effect the consumer applied that do not exist on the final primary.
//! * `lost_events`: payments on the final primary whose event is not in
//!   the stream, or whose effect the consumer never applied.
//!
//! Failovers and leader kills are those the chaos completed. With a
//! synchronous standby the four are 0, or the process exits with 1; with
//! `--async` they are what a failover costs, and the exit is 0 (1 only when
//! the chaos itself failed).

mod count;
mod payments;
mod scenario;

use scenario::{Config, Mode};

fn usage() -> ! {
    eprintln!(
        "usage: failover [--async] [--seconds S --payments N --clients N --failovers N \
         --leader-kills N --lag-ms L --settle S]"
    );
    std::process::exit(2)
}

fn parse_args(args: &[String]) -> Config {
    let mut cfg = Config {
        mode: Mode::Sync,
        seconds: 40,
        payments: 2000,
        clients: 8,
        failovers: 3,
        leader_kills: 2,
        settle: 90,
        lag_ms: 200,
    };
    let mut it = args.iter();
    while let Some(name) = it.next() {
        if name == "--async" {
            cfg.mode = Mode::Async;
            continue;
        }
        let value = it.next().unwrap_or_else(|| usage());
        let number = || value.parse::<u64>().unwrap_or_else(|_| usage());
        let count = || usize::try_from(number()).unwrap_or_else(|_| usage());
        match name.as_str() {
            "--seconds" => cfg.seconds = number(),
            "--payments" => cfg.payments = count(),
            "--clients" => cfg.clients = count(),
            "--failovers" => cfg.failovers = count(),
            "--leader-kills" => cfg.leader_kills = count(),
            "--settle" => cfg.settle = number(),
            "--lag-ms" => cfg.lag_ms = number(),
            _ => usage(),
        }
    }
    if cfg.payments == 0 || cfg.clients == 0 || cfg.seconds == 0 {
        usage();
    }
    cfg
}

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let cfg = parse_args(&args);
    let report = scenario::run(&cfg).await;
    for e in &report.chaos_errors {
        println!("chaos failed: {e}");
    }
    let f = &report.figures;
    let zeros = f.lost_acknowledged + f.duplicate_effects + f.ghost_events + f.lost_events == 0;
    let chaos_ok = report.chaos_errors.is_empty()
        && report.failovers == cfg.failovers
        && report.leader_kills == cfg.leader_kills;
    println!("{}", report.line());
    let ok = chaos_ok && (cfg.mode == Mode::Async || zeros);
    std::process::exit(if ok { 0 } else { 1 });
}
