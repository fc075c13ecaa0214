//! The chaos of a run: the primary killed and the standby promoted (the old
//! primary rewound back), the stream's leader killed and restarted, spaced
//! over the run.

use super::*;

#[derive(Debug, Clone, Copy)]
pub(super) enum Fault {
    Failover,
    LeaderKill,
}

/// The faults in the order they come: alternating, failovers first.
pub(super) fn plan(failovers: usize, leader_kills: usize) -> Vec<Fault> {
    let mut faults = Vec::new();
    let (mut f, mut l) = (failovers, leader_kills);
    while f + l > 0 {
        if f > 0 {
            faults.push(Fault::Failover);
            f -= 1;
        }
        if l > 0 {
            faults.push(Fault::LeaderKill);
            l -= 1;
        }
    }
    faults
}

#[derive(Default)]
pub(super) struct ChaosDone {
    pub(super) failovers: usize,
    pub(super) leader_kills: usize,
    pub(super) errors: Vec<String>,
}

/// The faults spread evenly over `span`, each run to its end before the next.
pub(super) async fn chaos(
    pair: Arc<ReplicaPair>,
    cluster: Arc<NatsCluster>,
    faults: Vec<Fault>,
    span: Duration,
    lag: Duration,
    start: Instant,
) -> ChaosDone {
    let mut done = ChaosDone::default();
    let total = u32::try_from(faults.len()).unwrap_or(u32::MAX);
    for (k, fault) in (1..).zip(faults) {
        tokio::time::sleep_until((start + span * k / (total + 1)).into()).await;
        let at = start.elapsed().as_secs_f64();
        match fault {
            Fault::Failover => {
                let killed = pair.primary_name();
                let cycle = async {
                    if !lag.is_zero() {
                        hold_back_standby(&pair, lag).await?;
                    }
                    pair.kill_primary().await?;
                    let killed_at = Instant::now();
                    pair.promote_standby().await?;
                    let promoted_after = killed_at.elapsed();
                    let rejoin = pair.rejoin_old_primary().await?;
                    Ok::<_, replica::ReplicaError>((promoted_after, rejoin, killed_at.elapsed()))
                };
                match cycle.await {
                    Ok((promoted, rejoin, all)) => {
                        done.failovers += 1;
                        println!(
                            "t={at:.1}s failover {}: killed {killed}, promoted {} after {:.1} s, \
                             old primary back as standby ({rejoin:?}) after {:.1} s",
                            done.failovers,
                            pair.primary_name(),
                            promoted.as_secs_f64(),
                            all.as_secs_f64()
                        );
                    }
                    Err(e) => {
                        eprintln!("t={at:.1}s failover failed: {e}");
                        done.errors.push(format!("failover: {e}"));
                        return done;
                    }
                }
            }
            Fault::LeaderKill => {
                let cycle = async {
                    let killed = cluster.kill_leader(STREAM).await?;
                    let killed_at = Instant::now();
                    let leader = cluster.wait_stream_leader(STREAM, WAIT).await?;
                    let elected = killed_at.elapsed();
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    cluster.restart(&killed).await?;
                    cluster.wait_stream_current(STREAM, WAIT).await?;
                    Ok::<_, idem_testing::nats_cluster::NatsClusterError>((
                        killed,
                        leader,
                        elected,
                        killed_at.elapsed(),
                    ))
                };
                match cycle.await {
                    Ok((killed, leader, elected, all)) => {
                        done.leader_kills += 1;
                        println!(
                            "t={at:.1}s stream leader kill {}: killed {killed}, new leader {leader} \
                             after {:.1} s, {killed} restarted and current after {:.1} s",
                            done.leader_kills,
                            elected.as_secs_f64(),
                            all.as_secs_f64()
                        );
                    }
                    Err(e) => {
                        eprintln!("t={at:.1}s stream leader kill failed: {e}");
                        done.errors.push(format!("leader kill: {e}"));
                        return done;
                    }
                }
            }
        }
    }
    done
}

/// Stops the primary's WAL sender (`SIGSTOP`) and waits `lag`: commits
/// made meanwhile are on the primary alone (asynchronous standby) or wait
/// for the standby (synchronous), as with a standby that far behind. The
/// kill of the primary that follows ends the stopped sender too.
pub(super) async fn hold_back_standby(
    pair: &ReplicaPair,
    lag: Duration,
) -> Result<(), replica::ReplicaError> {
    let client = idem_testing::connect(&pair.primary_url()).await?;
    let sender: i32 = client
        .query_one(
            "SELECT pid FROM pg_stat_replication WHERE application_name = $1",
            &[&pair.standby_name()],
        )
        .await
        .map_err(|e| replica::ReplicaError::WrongState {
            operation: "find the WAL sender",
            reason: e.to_string(),
        })?
        .get(0);
    drop(client);
    let stopped = std::process::Command::new("kill")
        .args(["-STOP", &sender.to_string()])
        .status()
        .is_ok_and(|s| s.success());
    if !stopped {
        return Err(replica::ReplicaError::WrongState {
            operation: "stop the WAL sender",
            reason: format!("kill -STOP {sender} failed"),
        });
    }
    tokio::time::sleep(lag).await;
    Ok(())
}
