//! Starting, killing and restarting the relay and consumer processes.

use std::collections::{HashMap, VecDeque};
use std::io::{BufRead, BufReader};
use std::os::unix::process::ExitStatusExt;
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use tokio::sync::mpsc;

use crate::check::Figures;
use crate::relay::Stall;
use crate::ChildArgs;

const SIGKILL: i32 = 9;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Role {
    Relay,
    Consumer,
}

/// A line a child printed on stdout.
pub struct Line {
    role: Role,
    slot: usize,
    generation: u64,
    text: String,
}

struct Proc {
    generation: u64,
    process: Child,
    /// Dropping it closes the child's stdin, which stops it cleanly.
    stdin: Option<ChildStdin>,
}

/// A relay killed while stalled in a round.
pub struct Kill {
    slot: usize,
    pid: u32,
    stall: Stall,
    event: String,
    at: Duration,
}

pub struct Supervisor {
    base: ChildArgs,
    /// Where the next relays stall; empty: they run clean.
    plan: VecDeque<(Stall, Duration)>,
    children: HashMap<(Role, usize), Proc>,
    next_generation: u64,
    tx: mpsc::UnboundedSender<Line>,
    pub lines: mpsc::UnboundedReceiver<Line>,
    started: Instant,
    pub relay_kills: Vec<Kill>,
    /// When the consumer is to die: the odd-numbered kills (1st, 3rd, ..)
    /// after a commit and before its ack, the others wherever it is.
    consumer_kill_times: Vec<Duration>,
    /// When it died, and the message it had committed and not acked.
    pub consumer_kills: Vec<(Duration, Option<String>)>,
    pub unexpected_exits: usize,
}

impl Supervisor {
    pub fn new(
        base: ChildArgs,
        plan: Vec<(Stall, Duration)>,
        consumer_kill_times: Vec<Duration>,
    ) -> Supervisor {
        let (tx, lines) = mpsc::unbounded_channel();
        Supervisor {
            base,
            plan: plan.into(),
            children: HashMap::new(),
            next_generation: 0,
            tx,
            lines,
            started: Instant::now(),
            relay_kills: Vec::new(),
            consumer_kill_times,
            consumer_kills: Vec::new(),
            unexpected_exits: 0,
        }
    }

    /// Start this binary again as a relay or the consumer in `slot`; its
    /// stdout is read line by line into [`Supervisor::lines`].
    pub fn spawn(&mut self, role: Role, slot: usize) {
        let next = self.consumer_kills.len();
        let stall = match role {
            Role::Relay => self.plan.pop_front(),
            Role::Consumer if next % 2 == 0 => self
                .consumer_kill_times
                .get(next)
                .map(|at| (Stall::Ack, *at)),
            Role::Consumer => None,
        };
        let exe = std::env::current_exe().expect("this binary's path");
        let mut command = Command::new(exe);
        command
            .arg(match role {
                Role::Relay => "--relay",
                Role::Consumer => "--consumer",
            })
            .args(["--database", &self.base.database])
            .args(["--nats", &self.base.nats])
            .args(["--stream", &self.base.stream]);
        if let Some((stall, at)) = stall {
            let after = at.saturating_sub(self.started.elapsed());
            command
                .args(["--stall", stall.name()])
                .args(["--stall-after-ms", &after.as_millis().to_string()]);
        }
        let mut process = command
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start a child process");
        let generation = self.next_generation;
        self.next_generation += 1;
        let stdout = process.stdout.take().expect("piped stdout");
        let tx = self.tx.clone();
        std::thread::spawn(move || {
            for text in BufReader::new(stdout).lines().map_while(Result::ok) {
                let _ = tx.send(Line {
                    role,
                    slot,
                    generation,
                    text,
                });
            }
        });
        let stdin = process.stdin.take();
        self.children.insert(
            (role, slot),
            Proc {
                generation,
                process,
                stdin,
            },
        );
    }

    /// SIGKILL the child in `(role, slot)` and reap it; true when it died
    /// of that signal.
    fn kill(&mut self, role: Role, slot: usize) -> (u32, bool) {
        let proc = self.children.get_mut(&(role, slot)).expect("a child");
        let pid = proc.process.id();
        // On Unix, Child::kill is kill(pid, SIGKILL): no handler runs, no
        // round finishes, the sockets just close.
        let _ = proc.process.kill();
        let status = proc.process.wait().expect("reap the child");
        (pid, status.signal() == Some(SIGKILL))
    }

    /// Whether the next consumer kill is one at a set time, and it is due.
    pub fn timed_consumer_kill_due(&self) -> bool {
        let next = self.consumer_kills.len();
        next % 2 == 1
            && self
                .consumer_kill_times
                .get(next)
                .is_some_and(|at| self.started.elapsed() >= *at)
    }

    /// A relay said it stalled: check that its event is in flight (leased,
    /// not sent), kill it there and start another in its slot. The
    /// consumer said it stalled: check that the message is recorded, kill
    /// it before it acks.
    pub async fn on_line(&mut self, line: Line, client: &tokio_postgres::Client) {
        let current = self
            .children
            .get(&(line.role, line.slot))
            .is_some_and(|p| p.generation == line.generation);
        let stalled = line.text.strip_prefix("STALLED ").and_then(|rest| {
            let (stall, event) = rest.split_once(' ')?;
            Some((Stall::parse(stall)?, event.to_owned()))
        });
        let Some((stall, event)) = stalled.filter(|_| current) else {
            println!("{:?} {}: {}", line.role, line.slot, line.text);
            return;
        };
        if line.role == Role::Consumer {
            let recorded: Option<String> = client
                .query_opt(
                    "SELECT state FROM idem_inbox WHERE consumer = $1 AND msg_id = $2",
                    &[&crate::consumer::NAME, &event],
                )
                .await
                .expect("the inbox record")
                .map(|row| row.get(0));
            self.kill_consumer(Some(event), recorded.as_deref() == Some("done"));
            return;
        }
        let row = client
            .query_one(
                "SELECT state, key, seq, (lease_until > clock_timestamp()) AS leased
                 FROM idem_outbox WHERE id = $1::text::uuid",
                &[&event],
            )
            .await
            .expect("the stalled event's row");
        let (state, key, seq, leased): (String, String, i64, bool) =
            (row.get(0), row.get(1), row.get(2), row.get(3));
        let (pid, by_signal) = self.kill(Role::Relay, line.slot);
        let at = self.started.elapsed();
        println!(
            "relay kill {}: slot {} pid {pid} at {:.1} s, {}: event {key}#{seq} was {state}{}; {}",
            self.relay_kills.len() + 1,
            line.slot,
            at.as_secs_f64(),
            stall.moment(),
            if leased { ", leased" } else { ", NOT leased" },
            if by_signal {
                "died of SIGKILL"
            } else {
                "did NOT die of SIGKILL"
            },
        );
        if by_signal && state == "pending" && leased {
            self.relay_kills.push(Kill {
                slot: line.slot,
                pid,
                stall,
                event,
                at,
            });
        } else {
            // Not a kill in flight: it does not count.
            self.unexpected_exits += usize::from(!by_signal);
        }
        self.spawn(Role::Relay, line.slot);
    }

    /// Kill the consumer and start another: wherever it is (in a
    /// transaction, waiting for a message, ..) when `unacked` is None, else
    /// stalled with that message committed (`recorded`) and not acked.
    pub fn kill_consumer(&mut self, unacked: Option<String>, recorded: bool) {
        let (pid, by_signal) = self.kill(Role::Consumer, 0);
        let at = self.started.elapsed();
        let moment = match &unacked {
            Some(id) => format!(
                "{}: message {id} {}",
                Stall::Ack.moment(),
                if recorded {
                    "recorded done"
                } else {
                    "NOT recorded"
                }
            ),
            None => "wherever it was".to_owned(),
        };
        println!(
            "consumer kill {}: pid {pid} at {:.1} s, {moment}; {}",
            self.consumer_kills.len() + 1,
            at.as_secs_f64(),
            if by_signal {
                "died of SIGKILL"
            } else {
                "did NOT die of SIGKILL"
            }
        );
        self.unexpected_exits += usize::from(!by_signal || (unacked.is_some() && !recorded));
        self.consumer_kills.push((at, unacked));
        self.spawn(Role::Consumer, 0);
    }

    /// A child that exited on its own is a failure of the run; start
    /// another so the run can still finish and say what else went wrong.
    pub fn respawn_exited(&mut self) {
        let exited: Vec<((Role, usize), ExitStatus)> = self
            .children
            .iter_mut()
            .filter_map(|(at, p)| p.process.try_wait().ok().flatten().map(|s| (*at, s)))
            .collect();
        for ((role, slot), status) in exited {
            eprintln!("{role:?} {slot} exited by itself: {status}");
            self.unexpected_exits += 1;
            self.spawn(role, slot);
        }
    }

    /// Close every child's stdin and wait for it to finish its round; kill
    /// one that takes more than 15 s.
    pub fn stop_all(&mut self) {
        for proc in self.children.values_mut() {
            proc.stdin.take();
        }
        let deadline = Instant::now() + Duration::from_secs(15);
        for ((role, slot), proc) in &mut self.children {
            loop {
                match proc.process.try_wait() {
                    Ok(Some(status)) if status.success() => break,
                    Ok(Some(status)) => {
                        eprintln!("{role:?} {slot} stopped badly: {status}");
                        self.unexpected_exits += 1;
                        break;
                    }
                    _ if Instant::now() > deadline => {
                        eprintln!("{role:?} {slot} did not stop; killed");
                        let _ = proc.process.kill();
                        let _ = proc.process.wait();
                        self.unexpected_exits += 1;
                        break;
                    }
                    _ => std::thread::sleep(Duration::from_millis(20)),
                }
            }
        }
        // The stdout readers end with their pipes; print what is left.
        while let Ok(line) = self.lines.try_recv() {
            println!("{:?} {}: {}", line.role, line.slot, line.text);
        }
    }

    /// What became of each event a relay was killed on: sent by another
    /// relay, stored once, applied once. False when one was not.
    pub async fn report_kills(&self, client: &tokio_postgres::Client, figures: &Figures) -> bool {
        let mut ok = true;
        let mut by_moment: HashMap<&str, usize> = HashMap::new();
        for kill in &self.relay_kills {
            *by_moment.entry(kill.stall.name()).or_default() += 1;
            let row = client
                .query_one(
                    "SELECT o.state, (SELECT count(*) FROM chaos_applied a
                         WHERE 'order-' || a.order_id = o.key AND a.step = o.seq)
                     FROM idem_outbox o WHERE o.id = $1::text::uuid",
                    &[&kill.event],
                )
                .await
                .expect("the killed event's row");
            let (state, applied): (String, i64) = (row.get(0), row.get(1));
            let stored = figures.stored_copies(&kill.event);
            let fine = state == "sent" && stored == 1 && applied == 1;
            ok &= fine;
            if !fine {
                println!(
                    "relay kill at {:.1} s (slot {}, pid {}): event {} ended {state}, stored {stored}×, applied {applied}×",
                    kill.at.as_secs_f64(),
                    kill.slot,
                    kill.pid,
                    kill.event
                );
            }
        }
        for (at, id) in &self.consumer_kills {
            let Some(id) = id else { continue };
            // Recorded at its first delivery, and applied once although
            // JetStream delivered it again after the kill.
            let row = client
                .query_one(
                    "SELECT i.deliveries, (SELECT count(*) FROM idem_outbox o JOIN chaos_applied a
                         ON 'order-' || a.order_id = o.key AND a.step = o.seq
                         WHERE o.id::text = i.msg_id)
                     FROM idem_inbox i WHERE i.consumer = $1 AND i.msg_id = $2",
                    &[&crate::consumer::NAME, id],
                )
                .await
                .expect("the unacked message's record");
            let (deliveries, applied): (i64, i64) = (row.get(0), row.get(1));
            let fine = deliveries == 1 && applied == 1;
            ok &= fine;
            println!(
                "consumer kill at {:.1} s before the ack of {id}: recorded at delivery {deliveries}, applied {applied}×{}",
                at.as_secs_f64(),
                if fine { " (its redelivery was skipped by the inbox)" } else { "" }
            );
        }
        let mut moments: Vec<_> = by_moment.into_iter().collect();
        moments.sort();
        println!(
            "relay kills by moment: {moments:?}; each killed event was then sent by another relay, stored once and applied once: {ok}"
        );
        ok
    }
}
