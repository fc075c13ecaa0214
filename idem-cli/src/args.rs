//! The command line, as clap parses it.

use std::time::Duration;

use clap::error::ErrorKind;
use clap::{Args, CommandFactory, Parser, Subcommand};

/// The operator's command line for a database idem uses.
#[derive(Debug, Parser)]
#[command(name = "idem", version, about, propagate_version = true)]
pub struct Cli {
    /// The database (postgres://user@host:port/db); defaults to $DATABASE_URL.
    #[arg(long, env = "DATABASE_URL", global = true, hide_env_values = true)]
    pub database_url: Option<String>,
    /// Print JSON instead of tables, for scripts.
    #[arg(long, global = true)]
    pub json: bool,
    #[command(subcommand)]
    pub command: Command,
}

impl Cli {
    /// What clap cannot say alone: `--stream`/`--subject` without a NATS
    /// server to ask. A usage error (exit 2), as clap's own.
    pub fn check(&self) -> Result<(), clap::Error> {
        if let Command::Doctor(d) = &self.command {
            let nats = d.nats_url.as_deref().is_some_and(|u| !u.trim().is_empty());
            if (d.stream.is_some() || d.subject.is_some()) && !nats {
                return Err(Cli::command().error(
                    ErrorKind::MissingRequiredArgument,
                    "--stream/--subject need --nats-url or NATS_URL",
                ));
            }
        }
        Ok(())
    }
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Apply idem's migrations; `migrate status` lists applied and pending.
    Migrate(MigrateArgs),
    /// One idempotency record: show or settle it.
    #[command(subcommand)]
    Key(KeyCmd),
    /// Outbox events: backlog, dead events, requeue, discard.
    #[command(subcommand)]
    Outbox(OutboxCmd),
    /// Compensation jobs: counts, dead jobs, requeue, discard.
    #[command(subcommand)]
    Jobs(JobsCmd),
    /// Inbox records: counts, dead letters, purge.
    #[command(subcommand)]
    Inbox(InboxCmd),
    /// Delete what retention allows.
    Purge(PurgeArgs),
    /// Check the server and the schema: each check ok, warn or fail.
    Doctor(DoctorArgs),
}

#[derive(Debug, Args)]
pub struct MigrateArgs {
    /// Print the embedded SQL instead of applying it (needs no database).
    #[arg(long)]
    pub print_sql: bool,
    #[command(subcommand)]
    pub action: Option<MigrateAction>,
}

#[derive(Debug, Subcommand)]
pub enum MigrateAction {
    /// Applied and pending migrations; exit 1 when any is pending or altered.
    Status,
}

#[derive(Debug, Args)]
pub struct KeyArgs {
    /// The scope value as JSON, as the function's `scope = ..` gives it
    /// (`[7]` for `(7_i64,)`); `null` for none.
    #[arg(long, default_value = "null", value_parser = json)]
    pub scope: serde_json::Value,
    /// The idempotency key.
    pub key: String,
}

#[derive(Debug, Subcommand)]
pub enum KeyCmd {
    /// State, outcome, fingerprint, age, expiry and owner of a key's record.
    Show {
        #[command(flatten)]
        key: KeyArgs,
        /// Also print the stored response (it may hold personal data).
        #[arg(long)]
        show_response: bool,
    },
    /// Decide an outcome-unknown (or stuck) record.
    Settle {
        #[command(flatten)]
        key: KeyArgs,
        /// The target did it: store this response (JSON) and replay it.
        #[arg(long, value_parser = json, conflicts_with = "released", required_unless_present = "released")]
        completed: Option<serde_json::Value>,
        /// The target did not: release the key, so a retry runs again.
        #[arg(long)]
        released: bool,
        /// Settle a claim whose lease still runs (its request may still be
        /// calling the target: a retry released now could run beside it).
        #[arg(long)]
        force: bool,
    },
}

#[derive(Debug, Args)]
pub struct PageArgs {
    /// At most this many rows (1 to 500).
    #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(i64).range(1..=500))]
    pub limit: i64,
    /// Skip this many rows first.
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(i64).range(0..))]
    pub offset: i64,
}

#[derive(Debug, Subcommand)]
pub enum OutboxCmd {
    /// Pending and dead counts, and the oldest pending event's age.
    Stats,
    /// Dead events, oldest first.
    Dead {
        /// Only this key's.
        #[arg(long)]
        key: Option<String>,
        #[command(flatten)]
        page: PageArgs,
    },
    /// Put one dead event (by id), or many (--all), back in line.
    Requeue {
        /// The event's id.
        #[arg(required_unless_present = "all", conflicts_with = "all", value_parser = event_id)]
        id: Option<String>,
        /// Every dead event (of --key), oldest first, at most --limit.
        #[arg(long)]
        all: bool,
        /// With --all: only this key's.
        #[arg(long, requires = "all")]
        key: Option<String>,
        /// With --all: at most this many (1 to 10000).
        #[arg(long, default_value_t = 100, requires = "all",
              value_parser = clap::value_parser!(i64).range(1..=10_000))]
        limit: i64,
    },
    /// Delete one dead event: it is never published, its key moves on.
    Discard {
        /// The event's id.
        #[arg(value_parser = event_id)]
        id: String,
    },
}

#[derive(Debug, Subcommand)]
pub enum JobsCmd {
    /// Due, running and dead counts, and the longest overdue wait.
    Stats,
    /// Dead jobs, oldest failure first; payloads hidden (their size shown).
    Dead {
        /// Only this kind.
        #[arg(long)]
        kind: Option<String>,
        /// Also print each job's payload (it may hold personal data).
        #[arg(long)]
        show_payload: bool,
        #[command(flatten)]
        page: PageArgs,
    },
    /// Make one dead job (by id), or many (--all), due again.
    Requeue {
        /// The job's id.
        #[arg(required_unless_present = "all", conflicts_with = "all")]
        id: Option<i64>,
        /// Every dead job (of --kind), oldest first, at most --limit.
        #[arg(long)]
        all: bool,
        /// With --all: only this kind.
        #[arg(long, requires = "all")]
        kind: Option<String>,
        /// With --all: at most this many (1 to 10000).
        #[arg(long, default_value_t = 100, requires = "all",
              value_parser = clap::value_parser!(i64).range(1..=10_000))]
        limit: i64,
    },
    /// Delete one dead job: its compensation will not run.
    Discard {
        /// The job's id.
        id: i64,
    },
}

#[derive(Debug, Subcommand)]
pub enum InboxCmd {
    /// Done and dead counts per consumer.
    Stats,
    /// A consumer's dead letters, oldest first (requeue them from the
    /// consumer's code: the effect is there).
    Dead {
        /// The consumer's name.
        #[arg(long)]
        consumer: String,
        #[command(flatten)]
        page: PageArgs,
    },
    /// Delete a consumer's done records older than --older-than.
    Purge {
        /// The consumer's name.
        #[arg(long)]
        consumer: String,
        /// Records settled longer ago than this (`7d`, `12h`, `30m`, `45s`);
        /// longer than any message can still be redelivered.
        #[arg(long, value_parser = duration)]
        older_than: Duration,
        /// Rows per statement (at least 1).
        #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(i64).range(1..))]
        batch: i64,
    },
}

#[derive(Debug, Args)]
pub struct PurgeArgs {
    /// Completed records past their retention (and expired leases, marked
    /// outcome unknown). Required: it names what is purged.
    #[arg(long, required = true)]
    pub expired: bool,
    /// Also outbox events sent longer ago than this (`1h`, `7d`).
    #[arg(long, value_parser = duration)]
    pub outbox_sent_older_than: Option<Duration>,
    /// Rows per statement (at least 1).
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(i64).range(1..))]
    pub batch: i64,
}

#[derive(Debug, Args)]
pub struct DoctorArgs {
    /// The pool size of each instance that connects (repeat it); their sum
    /// is checked against max_connections.
    #[arg(long = "pool-size")]
    pub pool_sizes: Vec<u32>,
    /// The NATS server the relay publishes to (defaults to $NATS_URL): its
    /// stream's duplicate window is checked against the relay's horizon.
    /// Without it that check is not run.
    #[arg(long, env = "NATS_URL", hide_env_values = true)]
    pub nats_url: Option<String>,
    /// The relay's stream, as given to NatsPublisher::new.
    #[arg(long, conflicts_with = "subject")]
    pub stream: Option<String>,
    /// Or a subject the relay publishes on (its prefix included): the
    /// stream that captures it is checked.
    #[arg(long)]
    pub subject: Option<String>,
    /// The relay's lease, when not the default 15s (Relay::lease); at
    /// most 7d.
    #[arg(long, value_parser = relay_duration)]
    pub relay_lease: Option<Duration>,
    /// The relay's attempts per event, when not the default 8
    /// (Relay::max_attempts); 1 to 10000.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=MAX_RELAY_ATTEMPTS))]
    pub relay_max_attempts: Option<u32>,
    /// The relay's first backoff, when not the default 200ms
    /// (Relay::backoff's base); at most 7d.
    #[arg(long, value_parser = relay_duration)]
    pub relay_backoff_base: Option<Duration>,
    /// The relay's longest backoff, when not the default 10s
    /// (Relay::backoff's max); at most 7d.
    #[arg(long, value_parser = relay_duration)]
    pub relay_backoff_max: Option<Duration>,
}

/// The most attempts `--relay-max-attempts` takes: far beyond any relay's
/// (the default is 8), and small enough that nothing overflows.
const MAX_RELAY_ATTEMPTS: i64 = 10_000;

/// The longest `--relay-*` duration: a week, far beyond any relay's lease
/// or backoff (the defaults are 15 s and 10 s).
const MAX_RELAY_DURATION: Duration = Duration::from_secs(7 * 86_400);

/// A relay's lease or backoff: a [`duration`] of at most a week.
fn relay_duration(s: &str) -> Result<Duration, String> {
    let d = duration(s)?;
    if d > MAX_RELAY_DURATION {
        return Err(format!(
            "{s:?} is longer than any relay's setting idem checks (at most 7d)"
        ));
    }
    Ok(d)
}

/// An outbox event's id: a UUID, as `outbox dead` lists it.
fn event_id(s: &str) -> Result<String, String> {
    uuid::Uuid::parse_str(s)
        .map(|_| s.to_owned())
        .map_err(|e| format!("{s:?} is not an event id (a UUID): {e}"))
}

fn json(s: &str) -> Result<serde_json::Value, String> {
    serde_json::from_str(s).map_err(|e| format!("not JSON: {e}"))
}

/// `200ms`, `45s`, `30m`, `12h`, `7d`, or bare seconds.
fn duration(s: &str) -> Result<Duration, String> {
    let (n, unit) = match s.find(|c: char| !c.is_ascii_digit()) {
        Some(i) => s.split_at(i),
        None => (s, "s"),
    };
    let n: u64 = n
        .parse()
        .map_err(|_| format!("{s:?} is not a duration like 45s, 30m, 12h, 7d"))?;
    let unit_ms: u64 = match unit {
        "ms" => 1,
        "s" => 1000,
        "m" => 60_000,
        "h" => 3_600_000,
        "d" => 86_400_000,
        _ => return Err(format!("{s:?}: the unit is ms, s, m, h or d")),
    };
    // Checked: a wrapped product would purge far newer rows than asked.
    n.checked_mul(unit_ms)
        .filter(|ms| ms / 1000 <= i64::MAX as u64 / 1000)
        .map(Duration::from_millis)
        .ok_or_else(|| format!("{s:?} is longer than any retention idem can use"))
}
