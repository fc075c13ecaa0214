//! idem's migrations, and the checks of a database's fitness for idem.

use std::time::Duration;

use diesel::sql_types::{BigInt, Bool, Double, Integer, Nullable, Text};
use diesel_async::RunQueryDsl;
use serde::Serialize;

use super::{ser_opt_secs, OperateError};
use crate::migrate::{self as migrations_mod, migrations};
use crate::pool::Pool;
use crate::versioned::backstop::VERSION_GUARD_TRIGGER;

/// The oldest server idem runs on (`CREATE OR REPLACE TRIGGER`, used by the
/// version guard, came with 14).
const MIN_SERVER: i32 = 140_000;

/// A migration as the database records it, or as [`migrate`] applied it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct AppliedMigration {
    /// Its number.
    pub version: i32,
    /// Its name.
    pub name: String,
    /// How long ago it was applied, when recorded (in JSON, seconds or null).
    #[serde(serialize_with = "ser_opt_secs")]
    pub applied_ago: Option<Duration>,
}

/// Which of this build's migrations a database has.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize)]
#[non_exhaustive]
pub struct MigrationStatus {
    /// Recorded with the checksum this build embeds.
    pub applied: Vec<AppliedMigration>,
    /// Embedded and not recorded: `idem migrate` applies them.
    pub pending: Vec<AppliedMigration>,
    /// Recorded with another checksum than the embedded one: a person must
    /// look ([`MigrateError::ChecksumMismatch`](crate::MigrateError::ChecksumMismatch)).
    pub mismatched: Vec<AppliedMigration>,
    /// Recorded versions this build does not know: a newer idem migrated.
    pub unknown: Vec<i32>,
}

impl MigrationStatus {
    /// Every embedded migration applied, none altered.
    pub fn is_current(&self) -> bool {
        self.pending.is_empty() && self.mismatched.is_empty()
    }
}

#[derive(diesel::QueryableByName)]
struct Exists {
    #[diesel(sql_type = Bool)]
    exists: bool,
}

#[derive(diesel::QueryableByName)]
struct RecordedRow {
    #[diesel(sql_type = Integer)]
    version: i32,
    #[diesel(sql_type = Text)]
    checksum: String,
    #[diesel(sql_type = Double)]
    ago: f64,
}

/// Compare `idem_schema_migrations` with the migrations of this build.
///
/// # Errors
///
/// No connection, or what PostgreSQL said.
pub async fn migration_status(pool: &Pool) -> Result<MigrationStatus, OperateError> {
    let mut conn = pool.get().await?;
    let table =
        diesel::sql_query("SELECT to_regclass('idem_schema_migrations') IS NOT NULL AS exists")
            .get_result::<Exists>(&mut conn)
            .await?;
    let recorded: Vec<RecordedRow> = if table.exists {
        diesel::sql_query(
            "SELECT version, checksum, extract(epoch FROM now() - applied_at)::float8 AS ago
             FROM idem_schema_migrations ORDER BY version",
        )
        .load(&mut conn)
        .await?
    } else {
        Vec::new()
    };
    let mut status = MigrationStatus::default();
    for m in migrations() {
        let row = recorded.iter().find(|r| r.version == m.version());
        let entry = AppliedMigration {
            version: m.version(),
            name: m.name().to_owned(),
            applied_ago: row.map(|r| super::secs(r.ago)),
        };
        match row {
            None => status.pending.push(entry),
            Some(r) if r.checksum != m.checksum() => status.mismatched.push(entry),
            Some(_) => status.applied.push(entry),
        }
    }
    status.unknown = recorded
        .iter()
        .filter(|r| !migrations().iter().any(|m| m.version() == r.version))
        .map(|r| r.version)
        .collect();
    Ok(status)
}

/// Apply the migrations the database lacks ([`crate::migrate::migrate`]);
/// returns the ones this call applied.
///
/// # Errors
///
/// As [`crate::migrate::migrate`], or no connection.
pub async fn migrate(pool: &Pool) -> Result<Vec<AppliedMigration>, OperateError> {
    let mut conn = pool.get().await?;
    let report = migrations_mod::migrate(&mut conn).await?;
    Ok(report
        .applied
        .iter()
        .map(|m| AppliedMigration {
            version: m.version(),
            name: m.name().to_owned(),
            applied_ago: Some(Duration::ZERO),
        })
        .collect())
}

/// A check's verdict.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum CheckState {
    /// Nothing to do.
    Ok,
    /// Works, but look at it.
    Warn,
    /// idem will not work as promised until fixed.
    Fail,
}

/// One check of [`doctor`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct Check {
    /// What was checked, one word or two.
    pub name: String,
    /// The verdict.
    pub state: CheckState,
    /// What was found.
    pub detail: String,
    /// How to fix it, in one line (for warn and fail).
    pub fix: Option<String>,
}

impl Check {
    pub(super) fn new(name: &str, state: CheckState, detail: String, fix: Option<&str>) -> Check {
        Check {
            name: name.to_owned(),
            state,
            detail,
            fix: fix.map(str::to_owned),
        }
    }
}

/// What [`doctor`] should know beyond the database.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DoctorOptions {
    /// The pool size of each instance that will connect (their sum is
    /// checked against `max_connections`); empty to skip that comparison.
    pub pool_sizes: Vec<u32>,
    /// The ports the database URL names (one per host of a multi-host
    /// URL; empty when it names none), to tell whether something (a pooler
    /// such as PgBouncer, a proxy) sits between it and the server: none of
    /// them is the server's port.
    pub url_ports: Vec<u16>,
}

#[derive(diesel::QueryableByName)]
struct Server {
    #[diesel(sql_type = Integer)]
    num: i32,
    #[diesel(sql_type = Text)]
    version: String,
    #[diesel(sql_type = Integer)]
    max_connections: i32,
    #[diesel(sql_type = Integer)]
    reserved: i32,
    #[diesel(sql_type = BigInt)]
    in_use: i64,
    #[diesel(sql_type = Nullable<Integer>)]
    port: Option<i32>,
    #[diesel(sql_type = Text)]
    standby_names: String,
    #[diesel(sql_type = Text)]
    synchronous_commit: String,
    #[diesel(sql_type = BigInt)]
    standbys: i64,
    #[diesel(sql_type = BigInt)]
    sync_standbys: i64,
}

#[derive(diesel::QueryableByName)]
struct Unguarded {
    #[diesel(sql_type = Text)]
    name: String,
    #[diesel(sql_type = Bool)]
    guarded: bool,
}

#[derive(diesel::QueryableByName)]
struct Backlog {
    #[diesel(sql_type = BigInt)]
    unknown: i64,
    #[diesel(sql_type = BigInt)]
    dead_events: i64,
    #[diesel(sql_type = BigInt)]
    dead_jobs: i64,
    #[diesel(sql_type = BigInt)]
    dead_letters: i64,
}

/// Check the server and the schema: server version, migrations, version
/// guards on tables with a `version` column, `max_connections` against the
/// pool sizes given, a pooler in between, synchronous replication, and
/// what waits for an operator. Each check says ok, warn or fail, with the
/// fix in one line. The NATS stream's check is `check_stream` (feature
/// `nats`), apart since it needs no database: `idem doctor` appends it.
///
/// # Errors
///
/// Only when no connection could be had or the server's settings could not
/// be read; a failed check is a [`CheckState::Fail`], not an error.
pub async fn doctor(pool: &Pool, options: &DoctorOptions) -> Result<Vec<Check>, OperateError> {
    use CheckState::{Fail, Ok as Good, Warn};
    let mut checks = Vec::new();
    let s: Server = {
        let mut conn = pool.get().await?;
        diesel::sql_query(
            "SELECT current_setting('server_version_num')::int AS num,
                    current_setting('server_version') AS version,
                    current_setting('max_connections')::int AS max_connections,
                    current_setting('superuser_reserved_connections')::int AS reserved,
                    (SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend') AS in_use,
                    inet_server_port() AS port,
                    current_setting('synchronous_standby_names') AS standby_names,
                    current_setting('synchronous_commit') AS synchronous_commit,
                    (SELECT count(*) FROM pg_stat_replication) AS standbys,
                    (SELECT count(*) FROM pg_stat_replication
                      WHERE sync_state IN ('sync', 'quorum')) AS sync_standbys",
        )
        .get_result(&mut conn)
        .await?
    };

    checks.push(if s.num >= MIN_SERVER {
        Check::new("server", Good, format!("PostgreSQL {}", s.version), None)
    } else {
        Check::new(
            "server",
            Fail,
            format!("PostgreSQL {}, older than 14", s.version),
            Some("upgrade the server to PostgreSQL 14 or later"),
        )
    });

    let status = migration_status(pool).await;
    let current = matches!(&status, Ok(st) if st.is_current());
    checks.push(match status {
        Err(e) => Check::new(
            "migrations",
            Fail,
            format!("could not read them: {e}"),
            None,
        ),
        Ok(st) if !st.mismatched.is_empty() => Check::new(
            "migrations",
            Fail,
            format!("recorded with another checksum: {}", names(&st.mismatched)),
            Some("find out whether the migration or its row in idem_schema_migrations was edited"),
        ),
        Ok(st) if !st.pending.is_empty() => Check::new(
            "migrations",
            Fail,
            format!(
                "{} of {} missing: {}",
                st.pending.len(),
                migrations().len(),
                names(&st.pending)
            ),
            Some("run `idem migrate` (or idem::migrate at start-up)"),
        ),
        Ok(st) if !st.unknown.is_empty() => Check::new(
            "migrations",
            Warn,
            format!(
                "all {} applied; versions {:?} come from a newer idem",
                st.applied.len(),
                st.unknown
            ),
            Some("upgrade this build of idem to the one that migrated the database"),
        ),
        Ok(st) => Check::new(
            "migrations",
            Good,
            format!("all {} applied", st.applied.len()),
            None,
        ),
    });

    checks.push(version_guards(pool).await);

    let available = i64::from(s.max_connections - s.reserved);
    let wanted: i64 = options.pool_sizes.iter().map(|&n| i64::from(n)).sum();
    let base = format!(
        "max_connections {} ({} reserved), {} client connections open",
        s.max_connections, s.reserved, s.in_use
    );
    checks.push(if options.pool_sizes.is_empty() {
        Check::new("connections", Good, format!("{base}; no pool sizes given (--pool-size)"), None)
    } else if wanted > available {
        Check::new(
            "connections",
            Fail,
            format!("{base}; the pools given want {wanted}, more than the {available} available"),
            Some("raise max_connections, shrink the pools, or put PgBouncer (transaction pooling) in front"),
        )
    } else if wanted * 5 > available * 4 {
        Check::new(
            "connections",
            Warn,
            format!("{base}; the pools given want {wanted} of {available}, over 80%"),
            Some("leave room for migrations, psql and monitoring: raise max_connections or shrink the pools"),
        )
    } else {
        Check::new("connections", Good, format!("{base}; the pools given want {wanted} of {available}"), None)
    });

    checks.push(pooler(&options.url_ports, s.port));

    let names_set = !s.standby_names.trim().is_empty();
    checks.push(if names_set && s.sync_standbys == 0 {
        Check::new(
            "replication",
            Fail,
            format!("synchronous_standby_names = '{}' but no synchronous standby is connected: commits wait", s.standby_names),
            Some("bring the standby back, or clear synchronous_standby_names (and use Replication::Single)"),
        )
    } else if names_set {
        Check::new(
            "replication",
            Good,
            format!(
                "{} synchronous standby(s) of {} (synchronous_standby_names = '{}', synchronous_commit = {})",
                s.sync_standbys, s.standbys, s.standby_names, s.synchronous_commit
            ),
            None,
        )
    } else if s.standbys > 0 {
        Check::new(
            "replication",
            Warn,
            format!("{} asynchronous standby(s): a failover may lose acknowledged commits", s.standbys),
            Some("set synchronous_standby_names and build the pool with Replication::Synchronous (docs/replication.md)"),
        )
    } else {
        Check::new(
            "replication",
            Good,
            "no standby: a single server (Replication::Single)".into(),
            None,
        )
    });

    if current {
        checks.push(backlog(pool).await);
    }
    Ok(checks)
}

/// Whether a pooler sits between: the URL's ports against the server's
/// (`inet_server_port()`, none over a Unix socket). A multi-host URL is
/// direct when any of its ports is the server's: the host connected to
/// is not known here, and a failover list names the same port for each.
fn pooler(url_ports: &[u16], server: Option<i32>) -> Check {
    let named = |ports: &[u16]| {
        ports
            .iter()
            .map(u16::to_string)
            .collect::<Vec<_>>()
            .join(", ")
    };
    match server {
        None => Check::new(
            "pooler",
            CheckState::Ok,
            "connected over a Unix socket: direct".into(),
            None,
        ),
        Some(server) if !url_ports.is_empty() && !url_ports.iter().any(|&p| i32::from(p) == server) => {
            Check::new(
                "pooler",
                CheckState::Warn,
                format!(
                    "the URL names port{} {}, the server listens on {server}: a pooler (PgBouncer?) or proxy sits between",
                    if url_ports.len() > 1 { "s" } else { "" },
                    named(url_ports)
                ),
                Some("behind PgBouncer in transaction mode build the pool with Pooler::TransactionPooling; run migrations on a direct URL"),
            )
        }
        Some(_) => Check::new(
            "pooler",
            CheckState::Ok,
            "direct to the server (the ports agree)".into(),
            None,
        ),
    }
}

fn names(ms: &[AppliedMigration]) -> String {
    ms.iter()
        .map(|m| format!("{} {}", m.version, m.name))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Tables (not idem's own) with a `version` column, and whether the version
/// guard's trigger is on them; tables with the trigger under another
/// column name count as guarded.
async fn version_guards(pool: &Pool) -> Check {
    let rows: Result<Vec<Unguarded>, OperateError> = async {
        let mut conn = pool.get().await?;
        Ok(diesel::sql_query(
            "SELECT format('%I.%I', n.nspname, c.relname) AS name,
                    EXISTS (SELECT 1 FROM pg_trigger t WHERE t.tgrelid = c.oid AND t.tgname = $1) AS guarded
             FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
             WHERE c.relkind IN ('r', 'p')
               AND n.nspname NOT IN ('pg_catalog', 'information_schema')
               AND n.nspname NOT LIKE 'pg\\_%'
               AND c.relname NOT LIKE 'idem\\_%'
               AND (EXISTS (SELECT 1 FROM pg_attribute a WHERE a.attrelid = c.oid
                              AND a.attname = 'version' AND NOT a.attisdropped)
                    OR EXISTS (SELECT 1 FROM pg_trigger t WHERE t.tgrelid = c.oid AND t.tgname = $1))
             ORDER BY 1",
        )
        .bind::<Text, _>(VERSION_GUARD_TRIGGER)
        .load(&mut conn)
        .await?)
    }
    .await;
    match rows {
        Err(e) => Check::new(
            "version guards",
            CheckState::Fail,
            format!("could not read the tables: {e}"),
            None,
        ),
        Ok(rows) if rows.is_empty() => Check::new(
            "version guards",
            CheckState::Ok,
            "no table with a version column".into(),
            None,
        ),
        Ok(rows) => {
            let bare: Vec<&str> = rows
                .iter()
                .filter(|r| !r.guarded)
                .map(|r| r.name.as_str())
                .collect();
            let guarded = rows.len() - bare.len();
            if bare.is_empty() {
                Check::new(
                    "version guards",
                    CheckState::Ok,
                    format!("on all {guarded} versioned table(s)"),
                    None,
                )
            } else {
                Check::new(
                    "version guards",
                    CheckState::Warn,
                    format!("{guarded} guarded; without the trigger: {}", bare.join(", ")),
                    Some("call install_version_guard::<Model>() (or install_version_guard_on) for each"),
                )
            }
        }
    }
}

/// What waits for an operator: unknown records, dead events, jobs, letters.
async fn backlog(pool: &Pool) -> Check {
    let row: Result<Backlog, OperateError> = async {
        let mut conn = pool.get().await?;
        Ok(diesel::sql_query(
            "SELECT (SELECT count(*) FROM idem_requests WHERE state = 'unknown') AS unknown,
                    (SELECT count(*) FROM idem_outbox WHERE state = 'dead') AS dead_events,
                    (SELECT count(*) FROM idem_jobs WHERE state = 'dead') AS dead_jobs,
                    (SELECT count(*) FROM idem_inbox WHERE state = 'dead') AS dead_letters",
        )
        .get_result(&mut conn)
        .await?)
    }
    .await;
    match row {
        Err(e) => Check::new(
            "backlog",
            CheckState::Fail,
            format!("could not count: {e}"),
            None,
        ),
        Ok(b) => {
            let detail = format!(
                "{} outcome-unknown record(s), {} dead event(s), {} dead job(s), {} dead letter(s)",
                b.unknown, b.dead_events, b.dead_jobs, b.dead_letters
            );
            if b.unknown + b.dead_events + b.dead_jobs + b.dead_letters == 0 {
                Check::new("backlog", CheckState::Ok, detail, None)
            } else {
                Check::new(
                    "backlog",
                    CheckState::Warn,
                    detail,
                    Some("see `idem key settle`, `idem outbox dead`, `idem jobs dead`, `idem inbox dead`"),
                )
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn any_port_of_a_multi_host_url_that_is_the_servers_is_direct() {
        let direct = |ports: &[u16], server| pooler(ports, server).state == CheckState::Ok;
        assert!(direct(&[5432], Some(5432)));
        assert!(direct(&[1, 5432], Some(5432)), "postgres://h:1,h:5432/db");
        assert!(direct(&[], Some(5432)), "no port named");
        assert!(direct(&[6432], None), "a Unix socket");
        assert!(!direct(&[6432], Some(5432)));
        let two = pooler(&[6432, 6433], Some(5432));
        assert_eq!(two.state, CheckState::Warn);
        assert!(two.detail.contains("ports 6432, 6433"), "{}", two.detail);
    }
}
