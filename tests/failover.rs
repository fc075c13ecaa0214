//! `examples/failover`, short: one failover (the standby held 200 ms
//! behind, so commits wait for it, then the primary killed, the
//! synchronous standby promoted, the old primary rewound and back as
//! standby) and one kill of the JetStream stream's leader, with a few
//! hundred payments sent with duplicates, relayed and consumed through the
//! inbox. Counted on the final primary and in the stream: no acknowledged
//! payment lost, no effect twice, no event of a payment that does not
//! exist, no payment without its event applied.

#[path = "../examples/failover/count.rs"]
mod count;
#[path = "../examples/failover/payments.rs"]
mod payments;
#[path = "../examples/failover/scenario.rs"]
mod scenario;

use std::time::Duration;

use scenario::{Config, Mode};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_failover_and_one_leader_kill_lose_nothing_acknowledged_and_duplicate_nothing() {
    let cfg = Config {
        mode: Mode::Sync,
        seconds: 16,
        payments: 300,
        clients: 4,
        failovers: 1,
        leader_kills: 1,
        settle: 45,
        lag_ms: 200,
    };
    let report = tokio::time::timeout(Duration::from_secs(120), scenario::run(&cfg))
        .await
        .expect("the run ends within its bound");
    let line = report.line();
    println!("{line}");
    assert!(report.chaos_errors.is_empty(), "{:?}", report.chaos_errors);
    assert_eq!((report.failovers, report.leader_kills), (1, 1), "{line}");
    let f = &report.figures;
    assert_eq!(
        f.acknowledged, cfg.payments,
        "every key answered Ok: {line}"
    );
    assert_eq!(f.lost_acknowledged, 0, "{line}");
    assert_eq!(f.duplicate_effects, 0, "{line}");
    assert_eq!(f.ghost_events, 0, "{line}");
    assert_eq!(f.lost_events, 0, "{line}");
}
