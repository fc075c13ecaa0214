//! idem's own database objects, shipped as SQL migrations embedded in the crate.
//!
//! Call [`migrate`] once at start-up (every instance may call it; see below)
//! before using anything that relies on these objects, such as
//! [`install_version_guard`](crate::versioned::backstop::install_version_guard).
//! The SQL is also available through [`migrations`], for teams that would rather
//! copy it into their own migration tool.
//!
//! # How it runs
//!
//! - The migrations are applied in ascending [`Migration::version`] order, each
//!   in its own `READ COMMITTED` transaction together with the row that records
//!   it, so a migration is either applied and recorded, or neither.
//! - Every transaction first takes `pg_advisory_xact_lock(`[`ADVISORY_LOCK_KEY`]`)`,
//!   so processes that start at the same time queue up instead of racing: the
//!   first applies what is missing, the others find it recorded. Calling
//!   [`migrate`] again is a no-op that only verifies checksums.
//! - A recorded migration is never applied again. If its recorded checksum
//!   differs from the one embedded in this build, [`migrate`] stops with
//!   [`MigrateError::ChecksumMismatch`]: either the SQL of a released migration
//!   was edited or the bookkeeping row was, and a person must look at it.
//! - Objects are created unqualified, so they land in the first schema of the
//!   connection's `search_path` (usually `public`); run [`migrate`] with the
//!   same `search_path` the application uses.
//!
//! # Tables and columns
//!
//! `idem_schema_migrations`: one row per applied idem migration (created by
//! [`migrate`] itself, before migration 1).
//!
//! | column | type | meaning |
//! |---|---|---|
//! | `version` | `integer PRIMARY KEY` | [`Migration::version`]: the number in the file name, `0001_..` is 1 |
//! | `name` | `text NOT NULL` | [`Migration::name`]: the rest of the file name, e.g. `version_guard` |
//! | `checksum` | `text NOT NULL` | [`Migration::checksum`]: lowercase hex SHA-256 of the SQL as embedded (line endings normalised to `\n`) |
//! | `applied_at` | `timestamptz NOT NULL DEFAULT now()` | when the transaction that applied it started |
//!
//! # Migrations
//!
//! | version | name | creates |
//! |---|---|---|
//! | 1 | `version_guard` | the trigger function `idem_version_guard()` (no table), see [`backstop`](crate::versioned::backstop) |
//! | 2 | `idem_requests` | the table `idem_requests` (the records of `#[idempotent]`) and its index `idem_requests_expiry` |
//! | 3 | `idem_requests_owner` | the column `idem_requests.owner` (the external claim's token) |
//! | 4 | `idem_requests_scope_label` | the column `scope_label`: a short scope's readable form (`scope` becomes a hash) |
//! | 5 | `outbox` | the tables `idem_outbox` and `idem_outbox_keys` and a `NOTIFY` trigger, see [`outbox`](crate::outbox) |
//! | 6 | `inbox` | the table `idem_inbox` of messages a consumer has settled, see [`inbox`](crate::inbox) |
//! | 7 | `version_guard_identity` | replaces `idem_version_guard()` (identity columns, INSERT and DELETE); the table `idem_version_tombstones` and the function `idem_purge_version_tombstones(interval)`, see [`backstop`](crate::versioned::backstop#versions-never-repeat) |
//! | 8 | `jobs` | the table `idem_jobs` of delayed compensation jobs, see [`jobs`](crate::jobs) |
//! | 9 | `record_taken` | the function `idem_record_taken()`, which a local record's takeover of a live key raises (SQLSTATE IDR01) instead of writing nothing |
//! | 10 | `jobs_collapsed` | the columns `idem_jobs.collapsed` (enqueues collapsed into a job, so a run that ends with more than it began with leaves the job due again) and `idem_jobs.ladder_from` (where the ladder last started afresh; `attempts` is never reset), see [`jobs`](crate::jobs) |
//! | 11 | `transitions` | the table `idem_transitions`: the last `.transition(from, to)` of each row, which tells a repeated transition from another write, see [`Transitioned`](crate::versioned::Transitioned) |
//! | 12 | `cache_secret` | the table `idem_cache_secret`: the random secret the Redis replay cache seals its entries with (with the database's life), so that an entry written by someone who can only write to Redis, or left from before a restore, is refused |
//! | 13 | `transitions_bound` | the columns `idem_transitions.table_oid` (the table as the transition's statement resolved it) and `row_xid` (the id of the (sub)transaction that wrote the row version), the key `(table_oid, identity)`; `table_name` becomes null for new records (kept, and unique, for an earlier build's): a record is bound to its table and to the very write it made, see [`Transitioned`](crate::versioned::Transitioned) |
//! | 14 | `standby_holds` | the function `idem_standby_holds(target)`, which waits until every synchronous standby has flushed WAL up to `target`: with [`Replication::Synchronous`](crate::pool::Replication::Synchronous), a replay and a publish wait for it |
//! | 15 | `idem_requests_lean` | the enum types `idem_request_mode`, `idem_request_state` and `idem_request_outcome` (with assignment casts from `text`) for those columns of `idem_requests`, whose seven `CHECK` constraints it drops (their per-statement set-up was most of the record's cost); existing records are converted |
//! | 16 | `create_once_guard` | the function `idem_create_once_guard(table, columns)`, which `create_once`'s INSERT writes the version through: evaluated when PostgreSQL plans the statement, it raises (IDR03) unless the table has a unique index on exactly the tenant and key columns and no deferrable unique or exclusion constraint |
//!
//! Every object carries the same description as a `COMMENT ON`, so `\d+` and
//! `\df+` in psql explain it.

use std::fmt;

use diesel::prelude::*;
use diesel::result::Error as DieselError;
use diesel::sql_types::BigInt;
use diesel_async::{AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use sha2::{Digest, Sha256};

/// The key of the transaction-level advisory lock every [`migrate`]
/// transaction holds: `0x6964_656d_5f6d_6967`, the ASCII bytes of `idem_mig`
/// (7594306392080345447).
///
/// Application code must not use this key for `pg_advisory_lock` or
/// `pg_advisory_xact_lock` on the same database, or it will wait on (and hold
/// up) idem's migrations.
pub const ADVISORY_LOCK_KEY: i64 = 0x6964_656d_5f6d_6967;

/// The name of the table that records applied migrations.
pub const MIGRATIONS_TABLE: &str = "idem_schema_migrations";

/// One embedded migration: a numbered SQL file from `idem-runtime/migrations/`.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Migration {
    version: i32,
    name: &'static str,
    sql: &'static str,
}

impl Migration {
    /// Its number: the order it is applied in, and its key in
    /// `idem_schema_migrations`.
    pub fn version(&self) -> i32 {
        self.version
    }

    /// A short name, for logs and for people reading `idem_schema_migrations`.
    pub fn name(&self) -> &'static str {
        self.name
    }

    /// The SQL, exactly as embedded; [`migrate`] runs it as one batch.
    pub fn sql(&self) -> &'static str {
        self.sql
    }

    /// The lowercase hex SHA-256 of [`sql`](Migration::sql), with `\r\n`
    /// normalised to `\n` so a Windows checkout of the same file agrees.
    ///
    /// ```
    /// let first = &idem_runtime::migrate::migrations()[0];
    /// assert_eq!(first.checksum().len(), 64);
    /// ```
    pub fn checksum(&self) -> String {
        let normalised = self.sql.replace("\r\n", "\n");
        let digest = Sha256::digest(normalised.as_bytes());
        crate::sql::to_hex(&digest)
    }
}

impl fmt::Debug for Migration {
    // The SQL is long and says nothing a log line needs.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Migration")
            .field("version", &self.version)
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

/// Ascending by version, without gaps; a released entry never changes.
static MIGRATIONS: &[Migration] = &[
    Migration {
        version: 1,
        name: "version_guard",
        sql: include_str!("../migrations/0001_version_guard.sql"),
    },
    Migration {
        version: 2,
        name: "idem_requests",
        sql: include_str!("../migrations/0002_idem_requests.sql"),
    },
    Migration {
        version: 3,
        name: "idem_requests_owner",
        sql: include_str!("../migrations/0003_idem_requests_owner.sql"),
    },
    Migration {
        version: 4,
        name: "idem_requests_scope_label",
        sql: include_str!("../migrations/0004_idem_requests_scope_label.sql"),
    },
    Migration {
        version: 5,
        name: "outbox",
        sql: include_str!("../migrations/0005_outbox.sql"),
    },
    Migration {
        version: 6,
        name: "inbox",
        sql: include_str!("../migrations/0006_inbox.sql"),
    },
    Migration {
        version: 7,
        name: "version_guard_identity",
        sql: include_str!("../migrations/0007_version_guard_identity.sql"),
    },
    Migration {
        version: 8,
        name: "jobs",
        sql: include_str!("../migrations/0008_jobs.sql"),
    },
    Migration {
        version: 9,
        name: "record_taken",
        sql: include_str!("../migrations/0009_record_taken.sql"),
    },
    Migration {
        version: 10,
        name: "jobs_collapsed",
        sql: include_str!("../migrations/0010_jobs_collapsed.sql"),
    },
    Migration {
        version: 11,
        name: "transitions",
        sql: include_str!("../migrations/0011_transitions.sql"),
    },
    Migration {
        version: 12,
        name: "cache_secret",
        sql: include_str!("../migrations/0012_cache_secret.sql"),
    },
    Migration {
        version: 13,
        name: "transitions_bound",
        sql: include_str!("../migrations/0013_transitions_bound.sql"),
    },
    Migration {
        version: 14,
        name: "standby_holds",
        sql: include_str!("../migrations/0014_standby_holds.sql"),
    },
    Migration {
        version: 15,
        name: "idem_requests_lean",
        sql: include_str!("../migrations/0015_idem_requests_lean.sql"),
    },
    Migration {
        version: 16,
        name: "create_once_guard",
        sql: include_str!("../migrations/0016_create_once_guard.sql"),
    },
    Migration {
        version: 17,
        name: "create_once_guard_current",
        sql: include_str!("../migrations/0017_create_once_guard_current.sql"),
    },
    Migration {
        version: 18,
        name: "guard_hardened",
        sql: include_str!("../migrations/0018_guard_hardened.sql"),
    },
];

/// The migrations embedded in this build, in the order [`migrate`] applies them.
///
/// ```
/// let all = idem_runtime::migrate::migrations();
/// assert_eq!(all[0].version(), 1);
/// assert!(all[0].sql().contains("idem_version_guard"));
/// ```
pub fn migrations() -> &'static [Migration] {
    MIGRATIONS
}

/// Every embedded migration as one SQL script, for a team that applies
/// SQL with its own tools (`psql -f`): in one transaction, under
/// [`ADVISORY_LOCK_KEY`], it creates `idem_schema_migrations` as [`migrate`]
/// does, runs each migration and records it with its version, name and
/// checksum, so that afterwards [`migrate`] applies nothing and
/// `idem migrate status` is current. A database where any migration is
/// recorded already is refused (the script raises and nothing changes):
/// bring it up to date with [`migrate`].
///
/// ```
/// let script = idem_runtime::migrate::script();
/// assert!(script.starts_with("-- idem's migrations"));
/// assert!(script.contains("INSERT INTO idem_schema_migrations"));
/// assert!(script.trim_end().ends_with("COMMIT;"));
/// ```
pub fn script() -> String {
    use fmt::Write as _;
    let last = MIGRATIONS.last().map_or(0, |m| m.version);
    let mut s = format!(
        "-- idem's migrations 1 to {last}, as `idem migrate` applies them, in one transaction,\n\
         -- recorded in {MIGRATIONS_TABLE} (so that idem::migrate applies nothing afterwards).\n\
         -- For a database without idem's migrations: `psql -v ON_ERROR_STOP=1 -f this.sql`.\n\
         BEGIN;\n\
         DO $idem_lock$ BEGIN PERFORM pg_advisory_xact_lock({ADVISORY_LOCK_KEY}); END $idem_lock$;\n\
         {}\n\
         DO $idem_script$\n\
         BEGIN\n    \
             IF EXISTS (SELECT 1 FROM {MIGRATIONS_TABLE}) THEN\n        \
                 RAISE EXCEPTION 'idem: this database already records idem migrations in {MIGRATIONS_TABLE}: run idem migrate (or idem::migrate) to apply what it lacks; nothing was changed';\n    \
             END IF;\n\
         END\n\
         $idem_script$;\n",
        BOOTSTRAP_SQL.trim()
    );
    for m in MIGRATIONS {
        let _ = write!(
            s,
            "\n-- idem migration {} ({})\n{}\n\
             INSERT INTO {MIGRATIONS_TABLE} (version, name, checksum) VALUES ({}, '{}', '{}');\n",
            m.version,
            m.name,
            m.sql.trim_end(),
            m.version,
            m.name,
            m.checksum()
        );
    }
    s.push_str("\nCOMMIT;\n");
    s
}

/// What one call of [`migrate`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct MigrationReport {
    /// The migrations this call applied, in order.
    pub applied: Vec<Migration>,
    /// The embedded migrations that were already recorded, with a matching
    /// checksum, and so were left alone.
    pub already_applied: Vec<Migration>,
    /// Versions recorded in `idem_schema_migrations` that this build does not
    /// know: a newer idem migrated this database. Left alone; reported so that
    /// a deployment can notice it runs older code than its schema.
    pub unknown: Vec<i32>,
}

/// Why [`migrate`] stopped. Migrations applied before the failing one stay
/// applied and recorded.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MigrateError {
    /// A recorded migration's checksum is not the one embedded in this build.
    /// Nothing is applied again: a person has to find out whether the SQL of a
    /// released migration was edited or the bookkeeping row was.
    #[error("idem migration {version} ({name}) is recorded with checksum {recorded}, but this build embeds checksum {embedded}; it is not applied again: find out whether the migration or the row in idem_schema_migrations was edited")]
    ChecksumMismatch {
        /// The migration's version.
        version: i32,
        /// The migration's name, as embedded.
        name: &'static str,
        /// The checksum in `idem_schema_migrations`.
        recorded: String,
        /// The checksum of the embedded SQL.
        embedded: String,
    },
    /// The SQL of a migration failed; its transaction was rolled back and it is
    /// not recorded. Usually missing privileges (`CREATE` on the schema).
    #[error("idem migration {version} ({name}) failed and was rolled back: {source}")]
    Apply {
        /// The migration's version.
        version: i32,
        /// The migration's name.
        name: &'static str,
        /// What PostgreSQL said.
        #[source]
        source: DieselError,
    },
    /// The bookkeeping failed: the connection broke, the lock could not be
    /// taken, or [`migrate`] was called inside a transaction.
    #[error("database error while running idem's migrations: {0}")]
    Database(#[from] DieselError),
}

/// The bookkeeping table as diesel sees it; private, since `table!` makes
/// everything it declares public.
mod schema {
    diesel::table! {
        /// See the module documentation of `migrate`.
        idem_schema_migrations (version) {
            version -> Int4,
            name -> Text,
            checksum -> Text,
            applied_at -> Timestamptz,
        }
    }
}
use schema::idem_schema_migrations;

/// Serialises every transaction of [`migrate`] across processes.
const LOCK_SQL: &str = "SELECT pg_advisory_xact_lock($1)";

/// Creates `idem_schema_migrations` with its comments, once. Runs under the
/// advisory lock, so two processes never both see it missing.
const BOOTSTRAP_SQL: &str = r#"
DO $idem_bootstrap$
BEGIN
    IF to_regclass('idem_schema_migrations') IS NULL THEN
        CREATE TABLE idem_schema_migrations (
            version integer PRIMARY KEY,
            name text NOT NULL,
            checksum text NOT NULL,
            applied_at timestamptz NOT NULL DEFAULT now()
        );
        COMMENT ON TABLE idem_schema_migrations IS
            'One row per applied idem migration (idem_runtime::migrate). Written only by migrate(), under pg_advisory_xact_lock(7594306392080345447).';
        COMMENT ON COLUMN idem_schema_migrations.version IS
            'The migration number (file 0001_.. is 1); migrations are applied in ascending order.';
        COMMENT ON COLUMN idem_schema_migrations.name IS
            'The migration name (the rest of the file name), for people.';
        COMMENT ON COLUMN idem_schema_migrations.checksum IS
            'Lowercase hex SHA-256 of the migration SQL as applied; a build embedding different SQL for this version refuses to run.';
        COMMENT ON COLUMN idem_schema_migrations.applied_at IS
            'Start of the transaction that applied the migration.';
    END IF;
END
$idem_bootstrap$;
"#;

/// A row of `idem_schema_migrations`.
struct Recorded {
    version: i32,
    checksum: String,
}

/// Apply idem's embedded migrations that this database lacks.
///
/// Safe to call on every start of every instance: concurrent calls serialise
/// on [`ADVISORY_LOCK_KEY`], and a second call applies nothing. Must not be
/// called inside a transaction, since every migration commits on its own. See
/// the [module documentation](self) for what is created.
///
/// ```no_run
/// use diesel_async::{AsyncConnection, AsyncPgConnection};
///
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let mut conn = AsyncPgConnection::establish("postgres://localhost/app").await?;
/// let report = idem_runtime::migrate::migrate(&mut conn).await?;
/// for m in &report.applied {
///     println!("applied idem migration {} ({})", m.version(), m.name());
/// }
/// # Ok(())
/// # }
/// ```
///
/// # Errors
///
/// [`MigrateError::ChecksumMismatch`] when a recorded migration differs from
/// the embedded one, [`MigrateError::Apply`] when a migration's SQL fails, and
/// [`MigrateError::Database`] for everything else.
pub async fn migrate(conn: &mut AsyncPgConnection) -> Result<MigrationReport, MigrateError> {
    let recorded = conn
        .build_transaction()
        .read_committed()
        .run(async |conn| {
            lock(conn).await?;
            conn.batch_execute(BOOTSTRAP_SQL).await?;
            load_recorded(conn).await
        })
        .await?;

    let mut report = MigrationReport::default();
    for row in &recorded {
        match MIGRATIONS.iter().find(|m| m.version == row.version) {
            Some(m) => verify(m, row)?,
            None => {
                tracing::warn!(
                    version = row.version,
                    "idem_schema_migrations records a migration this build does not know; a newer idem migrated this database"
                );
                report.unknown.push(row.version);
            }
        }
    }

    for m in MIGRATIONS {
        if recorded.iter().any(|row| row.version == m.version) {
            report.already_applied.push(*m);
            continue;
        }
        let applied_now = conn
            .build_transaction()
            .read_committed()
            .run(async |conn| apply_unless_recorded(conn, m).await)
            .await?;
        if applied_now {
            tracing::info!(version = m.version, name = m.name, "applied idem migration");
            report.applied.push(*m);
        } else {
            report.already_applied.push(*m);
        }
    }
    Ok(report)
}

/// Inside a transaction: apply `m` and record it, unless another process did
/// so since the bootstrap read. Returns whether it was applied here.
async fn apply_unless_recorded(
    conn: &mut AsyncPgConnection,
    m: &'static Migration,
) -> Result<bool, MigrateError> {
    use idem_schema_migrations::dsl;

    lock(conn).await?;
    let row = dsl::idem_schema_migrations
        .filter(dsl::version.eq(m.version))
        .select((dsl::version, dsl::checksum))
        .get_result::<(i32, String)>(conn)
        .await
        .optional()?;
    if let Some((version, checksum)) = row {
        verify(m, &Recorded { version, checksum })?;
        return Ok(false);
    }
    conn.batch_execute(m.sql)
        .await
        .map_err(|source| MigrateError::Apply {
            version: m.version,
            name: m.name,
            source,
        })?;
    diesel::insert_into(dsl::idem_schema_migrations)
        .values((
            dsl::version.eq(m.version),
            dsl::name.eq(m.name),
            dsl::checksum.eq(m.checksum()),
        ))
        .execute(conn)
        .await?;
    Ok(true)
}

async fn lock(conn: &mut AsyncPgConnection) -> Result<(), DieselError> {
    diesel::sql_query(LOCK_SQL)
        .bind::<BigInt, _>(ADVISORY_LOCK_KEY)
        .execute(conn)
        .await
        .map(|_| ())
}

async fn load_recorded(conn: &mut AsyncPgConnection) -> Result<Vec<Recorded>, MigrateError> {
    use idem_schema_migrations::dsl;

    let rows = dsl::idem_schema_migrations
        .select((dsl::version, dsl::checksum))
        .order(dsl::version)
        .load::<(i32, String)>(conn)
        .await?;
    Ok(rows
        .into_iter()
        .map(|(version, checksum)| Recorded { version, checksum })
        .collect())
}

fn verify(m: &'static Migration, row: &Recorded) -> Result<(), MigrateError> {
    let embedded = m.checksum();
    if row.checksum == embedded {
        Ok(())
    } else {
        Err(MigrateError::ChecksumMismatch {
            version: m.version,
            name: m.name,
            recorded: row.checksum.clone(),
            embedded,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_ascend_from_one_without_gaps() {
        for (i, m) in MIGRATIONS.iter().enumerate() {
            assert_eq!(m.version as usize, i + 1, "{m:?}");
        }
    }

    #[test]
    fn checksum_is_hex_sha256_and_ignores_crlf() {
        let lf = Migration {
            version: 1,
            name: "x",
            sql: "SELECT 1;\nSELECT 2;\n",
        };
        let crlf = Migration {
            sql: "SELECT 1;\r\nSELECT 2;\r\n",
            ..lf
        };
        assert_eq!(lf.checksum(), crlf.checksum());
        assert_eq!(
            Migration { sql: "", ..lf }.checksum(),
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
    }
}
