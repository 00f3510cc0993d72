//! The shared authoritative store: PostgreSQL through a deadpool pool.
//!
//! `PRIMARY KEY (scope, key)` is the guard. A claim is one autocommit
//! `INSERT ... ON CONFLICT ... DO UPDATE ... WHERE <expired or lease over>
//! RETURNING`: a concurrent claimer blocks on the first one's row lock for
//! the length of that tiny statement, then sees its row and gets no row
//! back, never a second claim. No transaction is ever held across calls.
//!
//! This module owns the schema (embedded, versioned migrations run under an
//! advisory lock), the pool (lazy: a proxy may start before the database and
//! heals by itself), and the mapping of every failure to [`StoreError`].
//! Claims commit durably: the upstream is only called after the claim is
//! on disk. Every session runs with `synchronous_commit` at least `on`: a
//! server, database, role or URL default of `off` (acknowledged before
//! the WAL is flushed: a server crash loses it) or `local` (a failover to
//! a synchronous standby loses it) is raised to `on` for idemgate's own
//! sessions, and anything stronger is kept ([`raised_commit`]). Each new
//! connection is raised once ([`Connector`]); behind PgBouncer each call's
//! transaction is. Start-up logs it once, and `check-config --connect`
//! says it ([`PostgresStore::probe`]).
//!
//! Connections are opened by [`super::pg_connect`] (TLS as libpq's
//! `sslmode` says). With `pgbouncer=true` in the URL a transaction-pooling
//! PgBouncer is in front, where one client's statements may run on a
//! different server connection each transaction: then no statement is
//! prepared by name (each is sent unnamed with its parameter types,
//! `query_typed`), and no session state is set at connect (PgBouncer
//! refuses the `options` startup parameter): every call runs in a
//! transaction that sets `statement_timeout`, the planner settings and
//! (where weaker) `synchronous_commit` with `SET LOCAL`. That costs one
//! more round trip per call (`BEGIN` is pipelined with the first
//! statement; `COMMIT` is not).
//!
//! A call that PostgreSQL aborts for a serialization failure or a deadlock
//! (SQLSTATE 40001, 40P01: a `SERIALIZABLE` default isolation, or a
//! distributed engine) changed nothing, so it is run again, a few times
//! with a short jittered pause ([`is_conflict`], [`CONFLICT_PAUSE`]),
//! within the call's deadline.

use super::batch::Batcher;
use super::codec::array_from;
use super::codec::RecordRow;
use super::pg_connect::{describe_transport, MakeRustls, PgTarget};
use super::sql::{Dialect, KeyParams, OwnerParams, Statements};
use super::{
    is_claimable, Claim, ClaimOutcome, Completion, Fence, LeaseToken, Record, RecordState, Span,
    Store, StoreError, UnixMillis,
};
use crate::config::{MigrationLock, StoreConfig};
use crate::idempotency::RecordKey;
use crate::idempotency::Scope;
use crate::net::backoff::Backoff;
use async_trait::async_trait;
use deadpool_postgres::{
    ClientWrapper, Manager, ManagerConfig, Object, Pool, PoolError, RecyclingMethod, Runtime,
    TimeoutType,
};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::Duration;
use tokio::sync::OnceCell;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_postgres::error::SqlState;
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::Row;

/// Ordered schema migrations (the text lives with the SQLite twin in
/// `store/sql.rs`); `{schema}` is replaced by the quoted schema name.
pub use super::sql::POSTGRES_MIGRATIONS as MIGRATIONS;

/// First key of the two-int advisory locks; the second is `hashtext(schema)`
/// so replicas sharing a database but not a schema do not serialize.
const MIGRATION_LOCK: i32 = 0x1de6_0001;
const SWEEP_LOCK: i32 = 0x1de6_0002;

/// A claim that loses a race with a release or sweep between its two
/// statements retries; more than this many losses in a row is pathological.
const CLAIM_ATTEMPTS: usize = 5;

/// Runs of one call that PostgreSQL aborted for a serialization failure or
/// deadlock ([`is_conflict`]): each run changed nothing, so running it
/// again is safe; more than a few in a row means heavy contention, which a
/// 503 reports better than a longer wait.
const CONFLICT_ATTEMPTS: u32 = 4;

/// The pauses before the reruns of a conflicted call: 5-10 ms, doubled each
/// time, jittered so that the calls that collided do not collide again.
const CONFLICT_PAUSE: Backoff = Backoff::new(Duration::from_millis(10), Duration::from_millis(640));

/// Detects a half-open connection (peer vanished without FIN) well before
/// the kernel's default of ~15 minutes of retransmissions.
const TCP_USER_TIMEOUT: Duration = Duration::from_secs(10);

/// Added to `store.timeout` for the call bound: this store enforces the
/// timeout itself (and takes a stuck connection out of the pool when it
/// fires), so its own deadline must fire first; the outer bound only catches
/// what is stuck beyond it.
const CALL_BOUND_MARGIN: Duration = Duration::from_millis(250);
const KEEPALIVE_IDLE: Duration = Duration::from_secs(30);

/// `synchronous_commit` values that acknowledge a commit before it is
/// durable: `off` before the WAL is flushed (a server crash loses it),
/// `local` before a synchronous standby has it (a failover loses it).
const WEAK_COMMIT: [&str; 2] = ["off", "local"];
/// What idemgate raises them to.
const DURABLE_COMMIT: &str = "on";

/// The `synchronous_commit` a session whose value is `effective` must run
/// with: `on` for a weak value ([`WEAK_COMMIT`]); `None` keeps it (`on`,
/// `remote_write`, `remote_apply`, and a value this version does not know:
/// never lowered). The statements that apply it ([`raise_commit_sql`])
/// test the same list on the server.
pub fn raised_commit(effective: &str) -> Option<&'static str> {
    WEAK_COMMIT.contains(&effective).then_some(DURABLE_COMMIT)
}

/// Raises the current session's (`transaction`: the current
/// transaction's) `synchronous_commit` to [`DURABLE_COMMIT`] when it is
/// weak, and does nothing otherwise: one statement, no round trip of its
/// own behind a pooler (it goes in the `BEGIN` batch).
fn raise_commit_sql(transaction: bool) -> String {
    let weak = WEAK_COMMIT
        .iter()
        .map(|v| format!("'{v}'"))
        .collect::<Vec<_>>()
        .join(", ");
    format!(
        "SELECT set_config('synchronous_commit', '{DURABLE_COMMIT}', {transaction}) \
         WHERE current_setting('synchronous_commit') IN ({weak})"
    )
}

/// The value the session started with (the server's, database's, role's
/// or the URL's `options`) and the one it runs with now.
const COMMIT_REPORT: &str = "SELECT reset_val, current_setting('synchronous_commit') \
     FROM pg_settings WHERE name = 'synchronous_commit'";

/// `synchronous_commit` as a session of this store saw it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CommitReport {
    /// What the session started with.
    pub server: String,
    /// What idemgate's statements commit with.
    pub session: String,
}

impl CommitReport {
    /// Whether idemgate raised it.
    pub fn raised(&self) -> bool {
        self.server != self.session
    }

    /// One sentence for `check-config --connect`; `Err` when the session
    /// still runs weaker than `on` (it could not be raised).
    pub fn describe(&self) -> Result<String, String> {
        let Self { server, session } = self;
        if raised_commit(session).is_some() {
            return Err(format!(
                "postgres: synchronous_commit is {session} in idemgate's sessions and could not be raised to {DURABLE_COMMIT}: claims would not survive a server crash"
            ));
        }
        Ok(if self.raised() {
            format!(
                "synchronous_commit is {server} (the server's, database's, role's or store.url's); raised to {session} for idemgate's sessions, so a claim is on disk before the upstream is called"
            )
        } else {
            format!("synchronous_commit is {server}: kept")
        })
    }
}

/// What `check-config --connect` learned from one connection.
#[derive(Clone, Debug)]
pub struct Probe {
    /// TLS (which version) or plaintext (why).
    pub transport: String,
    pub commit: CommitReport,
}

/// The PostgreSQL store: the connection pool and statements ([`Core`]),
/// with claims and completions coalesced into multi-row statements when
/// requests arrive together ([`super::batch`]).
pub struct PostgresStore {
    core: Arc<Core>,
    claims: OnceLock<Batcher<Claim, Result<ClaimOutcome, StoreError>>>,
    completions: OnceLock<Batcher<Completing, Result<Fence, StoreError>>>,
}

/// How many batches of each kind run at once: enough to keep a few
/// connections busy, few enough that calls queue up and coalesce.
const BATCH_LANES: usize = 4;
/// Rows per statement, at most.
const BATCH_MAX: usize = 64;

/// One completion waiting for a batch.
struct Completing {
    key: RecordKey,
    token: LeaseToken,
    completion: Completion,
    keep: Span,
}

/// Everything one call needs; shared with the batching tasks.
struct Core {
    pool: Pool,
    /// Set once migrations are known to be current; until then every
    /// operation tries them first, so a proxy started while PostgreSQL was
    /// down creates its tables when the database comes back.
    migrated: OnceCell<()>,
    schema: String,
    /// Whole-call deadline: pool wait, connect and the statements together.
    timeout: Duration,
    /// Statement texts, schema-qualified once at connect.
    sql: Statements,
    /// Added to the server's clock in every statement: zero, except in
    /// tests that play time forward ([`PostgresStore::with_clock_offset`]).
    clock_offset_ms: i64,
    /// Where the database is, for messages.
    target: PgTarget,
    /// `pgbouncer=true`: the statement that opens every call's transaction
    /// and sets the session options in it (see the module docs).
    pooled: Option<String>,
    migration_lock: MigrationLock,
    /// The TLS version of the newest connection (`None`: plaintext).
    last_tls: Arc<Mutex<Option<&'static str>>>,
    /// The operator has been told what `synchronous_commit` runs with.
    commit_told: AtomicBool,
}

/// Opens the pool's connections: TLS as the URL says, recording which the
/// connection got; connected directly (no pooler), the session's
/// `synchronous_commit` is raised where weak before the pool hands it out.
struct Connector {
    tls: MakeRustls,
    /// [`raise_commit_sql`] for a session, or `None` behind a pooler.
    session: Option<String>,
    last_tls: Arc<Mutex<Option<&'static str>>>,
}

type Connected = Result<(tokio_postgres::Client, JoinHandle<()>), tokio_postgres::Error>;

impl deadpool_postgres::Connect for Connector {
    fn connect(
        &self,
        pg: &tokio_postgres::Config,
    ) -> Pin<Box<dyn Future<Output = Connected> + Send + '_>> {
        let (tls, seen) = self.tls.recording();
        let pg = pg.clone();
        Box::pin(async move {
            let (client, connection) = pg.connect(tls).await?;
            // As deadpool's own connector does.
            let task = tokio::spawn(async move {
                if let Err(e) = connection.await {
                    tracing::warn!(target: "deadpool.postgres", "Connection error: {}", e);
                }
            });
            if let Some(sql) = &self.session {
                if let Err(err) = client.batch_execute(sql).await {
                    task.abort();
                    return Err(err);
                }
            }
            *self.last_tls.lock().unwrap_or_else(PoisonError::into_inner) = seen.get().copied();
            Ok((client, task))
        })
    }
}

/// One statement parameter with its type: the type is what an unnamed
/// statement (behind a pooler) is parsed with.
type Param<'a> = (&'a (dyn ToSql + Sync), Type);

impl PostgresStore {
    /// Builds the pool without connecting: PostgreSQL being down at start is
    /// not an error, operations fail with [`StoreError`] until it answers.
    /// Only a missing or malformed `store.url`, or a certificate file it
    /// names that cannot be read, fails here.
    pub async fn connect(cfg: &StoreConfig) -> Result<Self, StoreError> {
        Ok(Self {
            core: Arc::new(Core::connect(cfg).await?),
            claims: OnceLock::new(),
            completions: OnceLock::new(),
        })
    }

    /// Tests only: this handle sees the server's clock `ms` ahead, e.g. to
    /// sweep or claim "later" without waiting. Call it before any claim.
    pub fn with_clock_offset(mut self, ms: i64) -> Self {
        if let Some(core) = Arc::get_mut(&mut self.core) {
            core.clock_offset_ms = ms;
        }
        self
    }

    /// The schema this store lives in.
    pub fn schema(&self) -> &str {
        &self.core.schema
    }

    /// Connects and reads `synchronous_commit` as a call sees it, without
    /// migrating (`check-config --connect`); the error names the cause.
    /// The transport is the newest connection's: on this fresh store, the
    /// one the probe used.
    pub async fn probe(&self) -> Result<Probe, StoreError> {
        let core = &self.core;
        let deadline = core.deadline();
        let client = core.connection(deadline).await?;
        let commit = core.settle_commit_report(client, deadline).await?;
        let tls = *core.last_tls.lock().unwrap_or_else(PoisonError::into_inner);
        Ok(Probe {
            transport: describe_transport(tls, core.target.url.sslmode),
            commit,
        })
    }

    /// `host:port` of the database (every host the URL names).
    pub fn endpoint(&self) -> &str {
        &self.core.target.endpoint
    }

    /// Where the database is (`host:port`) and the TLS mode, for messages.
    pub fn describe_target(&self) -> String {
        let url = &self.core.target.url;
        format!(
            "postgres at {} (sslmode={}{})",
            self.core.target.endpoint,
            url.sslmode.as_str(),
            if url.pgbouncer {
                ", pgbouncer=true"
            } else {
                ""
            }
        )
    }

    /// Applies pending migrations; returns how many ran now (0 when current).
    /// Safe to run from several replicas at once: one transaction under
    /// `pg_advisory_xact_lock`, so the others wait and then find it done.
    pub async fn migrate(&self) -> Result<u32, StoreError> {
        self.core.migrate().await
    }

    fn claims(&self) -> &Batcher<Claim, Result<ClaimOutcome, StoreError>> {
        self.claims.get_or_init(|| {
            let core = self.core.clone();
            let key = |claim: &Claim| claim.key;
            Batcher::start(BATCH_LANES, BATCH_MAX, key, move |claims| {
                let core = core.clone();
                async move { core.claim_many(claims).await }
            })
        })
    }

    fn completions(&self) -> &Batcher<Completing, Result<Fence, StoreError>> {
        self.completions.get_or_init(|| {
            let core = self.core.clone();
            let key = |completing: &Completing| completing.key;
            Batcher::start(BATCH_LANES, BATCH_MAX, key, move |completions| {
                let core = core.clone();
                async move { core.complete_many(completions).await }
            })
        })
    }
}

fn batcher_gone() -> StoreError {
    StoreError::Unavailable("postgres: the batching task has stopped".into())
}

/// `"name"` with embedded quotes doubled (config already restricts the
/// charset; this keeps the SQL correct regardless).
fn quote_ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

impl Core {
    /// Builds the pool without connecting: PostgreSQL being down at start is
    /// not an error, operations fail with [`StoreError`] until it answers.
    /// Only a missing or malformed `store.url`, or a certificate file it
    /// names that cannot be read, fails here.
    pub async fn connect(cfg: &StoreConfig) -> Result<Self, StoreError> {
        let url = cfg
            .url
            .as_deref()
            .ok_or_else(|| StoreError::Unavailable("store.url is not set".into()))?;
        let target = PgTarget::new(url)
            .map_err(|err| StoreError::Unavailable(format!("store.url: {err}")))?;
        let mut pg = target.config.clone();
        // Every statement here looks records up by primary key. A table that
        // grew since it was last analyzed (a new deployment's first minutes,
        // autoanalyze runs once a minute) made the planner scan it for the
        // batched claims, each batch slower than the last; these make it
        // keep to the index.
        let settings = [
            (
                "statement_timeout",
                cfg.statement_timeout.as_millis().max(1).to_string(),
            ),
            ("enable_seqscan", "off".to_string()),
            ("enable_hashjoin", "off".to_string()),
            ("enable_mergejoin", "off".to_string()),
        ];
        let pooled = if target.url.pgbouncer {
            // PgBouncer refuses the `options` startup parameter: set them
            // per transaction instead.
            let mut begin = String::from("BEGIN");
            for (name, value) in &settings {
                begin.push_str(&format!("; SET LOCAL {name} = {value}"));
            }
            begin.push_str("; ");
            begin.push_str(&raise_commit_sql(true));
            Some(begin)
        } else {
            let session = settings
                .iter()
                .map(|(name, value)| format!("-c {name}={value}"))
                .collect::<Vec<_>>()
                .join(" ");
            let options = match pg.get_options() {
                Some(o) if !o.trim().is_empty() => format!("{o} {session}"),
                _ => session,
            };
            pg.options(options);
            None
        };
        pg.connect_timeout(cfg.connect_timeout)
            .keepalives(true)
            .keepalives_idle(KEEPALIVE_IDLE)
            .tcp_user_timeout(TCP_USER_TIMEOUT);
        if pg.get_application_name().is_none() {
            pg.application_name("idemgate");
        }
        let last_tls = Arc::new(Mutex::new(None));
        let connector = Connector {
            tls: target.tls.clone(),
            // A URL's own `options=-c synchronous_commit=off` is applied at
            // startup, so this sees (and raises) it too.
            session: pooled.is_none().then(|| raise_commit_sql(false)),
            last_tls: last_tls.clone(),
        };
        let manager = Manager::from_connect(
            pg,
            connector,
            // Fast: only `is_closed()` on checkout, so a claim stays one round
            // trip; a connection that dies mid-call is discarded by `settle`.
            ManagerConfig {
                recycling_method: RecyclingMethod::Fast,
            },
        );
        let pool = Pool::builder(manager)
            .max_size(cfg.pool_size)
            .runtime(Runtime::Tokio1)
            // Bounded so a dead database answers within seconds, not after
            // TCP's own timeouts.
            .wait_timeout(Some(cfg.timeout))
            .create_timeout(Some(cfg.connect_timeout))
            .recycle_timeout(Some(cfg.connect_timeout))
            .build()
            .map_err(|err| StoreError::Unavailable(format!("cannot build postgres pool: {err}")))?;
        let table = format!("{}.idempotency_records", quote_ident(&cfg.schema));
        Ok(Self {
            pool,
            migrated: OnceCell::new(),
            schema: cfg.schema.clone(),
            timeout: cfg.timeout,
            sql: Statements::new(Dialect::Postgres, &table),
            clock_offset_ms: 0,
            target,
            pooled,
            migration_lock: cfg.migration_lock,
            last_tls,
            commit_told: AtomicBool::new(false),
        })
    }

    async fn migrate(&self) -> Result<u32, StoreError> {
        let applied = self.run_migrations().await?;
        let _ = self.migrated.set(());
        Ok(applied)
    }

    async fn run_migrations(&self) -> Result<u32, StoreError> {
        let client = InUse(Some(self.pool.get().await.map_err(|e| self.pool_err(e))?));
        // Migrations run rarely: unnamed statements in every mode, so the
        // one code path works behind a pooler too.
        let locked = self.migration_lock == MigrationLock::Advisory;
        let on: &ClientWrapper = &client;
        let res = self.unit(on, locked, || self.migrate_on(on, locked)).await;
        let applied = self.settle(client, Ok(res))?;
        if applied > 0 {
            tracing::info!(schema = %self.schema, applied, "postgres migrations applied");
        }
        self.tell_commit().await;
        Ok(applied)
    }

    /// [`COMMIT_REPORT`] on `client` as one call, and the connection settled.
    async fn settle_commit_report(
        &self,
        client: InUse,
        deadline: Instant,
    ) -> Result<CommitReport, StoreError> {
        let on: &ClientWrapper = &client;
        let res = tokio::time::timeout_at(
            deadline,
            self.unit(on, false, || async move {
                let rows = self.query(on, COMMIT_REPORT, &[]).await?;
                Ok(rows.first().map(|row| CommitReport {
                    server: row.get(0),
                    session: row.get(1),
                }))
            }),
        )
        .await;
        self.settle(client, res)?
            .ok_or_else(|| StoreError::Corrupt("pg_settings has no synchronous_commit".into()))
    }

    /// Once per store (a process has one), when the database first answers:
    /// a warning naming the server's `synchronous_commit` where idemgate
    /// raised it, an error where it could not.
    async fn tell_commit(&self) {
        if self.commit_told.swap(true, Ordering::Relaxed) {
            return;
        }
        let deadline = self.deadline();
        let report = match self.connection(deadline).await {
            Ok(client) => self.settle_commit_report(client, deadline).await,
            Err(err) => Err(err),
        };
        match report {
            Ok(report) => match report.describe() {
                Err(problem) => tracing::error!("{problem}"),
                Ok(_) if report.raised() => tracing::warn!(
                    server = %report.server,
                    session = %report.session,
                    "postgres synchronous_commit is {} (the server's, database's, role's or store.url's): idemgate raised it to {} for its own sessions, so claims and stored responses survive a server crash",
                    report.server,
                    report.session
                ),
                Ok(_) => {}
            },
            Err(err) => {
                // Untold: a later migration run tries again. The raise
                // itself does not depend on this.
                self.commit_told.store(false, Ordering::Relaxed);
                tracing::debug!(error = %err, "could not read synchronous_commit");
            }
        }
    }

    /// The migrations, inside [`Core::unit`]'s transaction when `locked`
    /// (then under the advisory lock, so replicas wait for each other);
    /// without it each statement commits on its own.
    async fn migrate_on(
        &self,
        client: &ClientWrapper,
        locked: bool,
    ) -> Result<u32, tokio_postgres::Error> {
        let schema = quote_ident(&self.schema);
        if locked {
            client
                .query_typed(
                    "SELECT pg_advisory_xact_lock($1, hashtext($2))",
                    &[(&MIGRATION_LOCK, Type::INT4), (&self.schema, Type::TEXT)],
                )
                .await?;
        }
        // Checked first: CREATE SCHEMA IF NOT EXISTS still needs the CREATE
        // privilege, which a role given a ready-made schema may lack.
        let exists = !client
            .query_typed(
                "SELECT 1 FROM pg_namespace WHERE nspname = $1",
                &[(&self.schema, Type::TEXT)],
            )
            .await?
            .is_empty();
        if !exists {
            client
                .batch_execute(&format!("CREATE SCHEMA IF NOT EXISTS {schema}"))
                .await?;
        }
        client
            .batch_execute(&format!(
                "CREATE TABLE IF NOT EXISTS {schema}.idemgate_migrations (\
                   version int PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT now())"
            ))
            .await?;
        let current: i32 = client
            .query_typed(
                &format!("SELECT coalesce(max(version), 0) FROM {schema}.idemgate_migrations"),
                &[],
            )
            .await?
            .first()
            .map(|row| row.get(0))
            .unwrap_or(0);
        let mut applied = 0;
        for (i, sql) in MIGRATIONS.iter().enumerate() {
            let version = i as i32 + 1;
            if version <= current {
                continue;
            }
            client
                .batch_execute(&sql.replace("{schema}", &schema))
                .await?;
            client
                .execute_typed(
                    &format!(
                        "INSERT INTO {schema}.idemgate_migrations (version, applied_at) VALUES ($1, now())"
                    ),
                    &[(&version, Type::INT4)],
                )
                .await?;
            applied += 1;
        }
        Ok(applied)
    }

    /// Migrates (once per process) and checks a connection out, all before
    /// `deadline`.
    async fn checkout(&self, deadline: Instant) -> Result<InUse, StoreError> {
        let ready = async {
            self.migrated
                .get_or_try_init(|| async { self.run_migrations().await.map(|_| ()) })
                .await
        };
        tokio::time::timeout_at(deadline, ready)
            .await
            .map_err(|_| StoreError::Timeout)??;
        self.connection(deadline).await
    }

    /// A pooled connection, before `deadline`.
    async fn connection(&self, deadline: Instant) -> Result<InUse, StoreError> {
        let object = tokio::time::timeout_at(deadline, self.pool.get())
            .await
            .map_err(|_| StoreError::Timeout)?
            .map_err(|e| self.pool_err(e))?;
        Ok(InUse(Some(object)))
    }

    fn deadline(&self) -> Instant {
        Instant::now() + self.timeout
    }

    /// One statement that returns a row count, as one call.
    async fn write(&self, sql: &str, params: &[Param<'_>]) -> Result<u64, StoreError> {
        let deadline = self.deadline();
        let client = self.checkout(deadline).await?;
        let res = tokio::time::timeout_at(
            deadline,
            self.unit(&client, false, || self.execute(&client, sql, params)),
        )
        .await;
        self.settle(client, res)
    }

    /// One statement that returns rows, as one call.
    async fn read(&self, sql: &str, params: &[Param<'_>]) -> Result<Vec<Row>, StoreError> {
        let deadline = self.deadline();
        let client = self.checkout(deadline).await?;
        let res = tokio::time::timeout_at(
            deadline,
            self.unit(&client, false, || self.query(&client, sql, params)),
        )
        .await;
        self.settle(client, res)
    }

    /// One statement, for its rows: prepared once per connection and
    /// cached, or behind a pooler sent unnamed with its parameter types.
    async fn query(
        &self,
        client: &ClientWrapper,
        sql: &str,
        params: &[Param<'_>],
    ) -> Result<Vec<Row>, tokio_postgres::Error> {
        if self.pooled.is_some() {
            return client.query_typed(sql, params).await;
        }
        let stmt = client.prepare_cached(sql).await?;
        let values: Vec<&(dyn ToSql + Sync)> = params.iter().map(|(v, _)| *v).collect();
        client.query(&stmt, &values).await
    }

    /// [`Core::query`] for a row count.
    async fn execute(
        &self,
        client: &ClientWrapper,
        sql: &str,
        params: &[Param<'_>],
    ) -> Result<u64, tokio_postgres::Error> {
        if self.pooled.is_some() {
            return client.execute_typed(sql, params).await;
        }
        let stmt = client.prepare_cached(sql).await?;
        let values: Vec<&(dyn ToSql + Sync)> = params.iter().map(|(v, _)| *v).collect();
        client.execute(&stmt, &values).await
    }

    /// Runs `body` on `client` as one unit: behind a pooler (or when
    /// `transaction`) inside a transaction (behind a pooler one that sets
    /// the session options first); run again when PostgreSQL aborted it
    /// for a serialization failure or deadlock, which changed nothing.
    async fn unit<T, F>(
        &self,
        client: &ClientWrapper,
        transaction: bool,
        body: impl Fn() -> F,
    ) -> Result<T, tokio_postgres::Error>
    where
        F: std::future::Future<Output = Result<T, tokio_postgres::Error>>,
    {
        let begin = match &self.pooled {
            Some(begin) => Some(begin.as_str()),
            None if transaction => Some("BEGIN"),
            None => None,
        };
        let mut attempt = 1;
        loop {
            let res = match begin {
                None => body().await,
                Some(begin) => {
                    // `BEGIN` goes out back to back with the body's first
                    // statement (tokio-postgres sends requests in the order
                    // they are first polled, without waiting for answers):
                    // one round trip for both. Should `BEGIN` fail, the
                    // statement fails too (an aborted transaction or a dead
                    // connection), and the connection is never handed back
                    // inside a transaction.
                    let (began, res) = tokio::join!(biased; client.batch_execute(begin), body());
                    let end = if began.is_ok() && res.is_ok() {
                        "COMMIT"
                    } else {
                        "ROLLBACK"
                    };
                    let ended = client.batch_execute(end).await;
                    match (began, res, ended) {
                        (Err(e), _, _) | (Ok(()), Err(e), _) | (Ok(()), Ok(_), Err(e)) => Err(e),
                        (Ok(()), Ok(v), Ok(())) => Ok(v),
                    }
                }
            };
            match res {
                Err(err) if attempt < CONFLICT_ATTEMPTS && is_conflict(&err) => {
                    tracing::debug!(error = %self.pg_err(err), attempt, "postgres aborted a call; running it again");
                    tokio::time::sleep(CONFLICT_PAUSE.delay(attempt, rand::random())).await;
                    attempt += 1;
                }
                other => return other,
            }
        }
    }

    /// Ends a call: an answered call's connection goes back to the pool; a
    /// timed-out one may be wedged mid-statement, so it is dropped (see
    /// [`InUse`]).
    fn settle<T>(
        &self,
        mut client: InUse,
        res: Result<Result<T, tokio_postgres::Error>, tokio::time::error::Elapsed>,
    ) -> Result<T, StoreError> {
        let answered = res.is_ok();
        if answered {
            drop(client.0.take());
        }
        match res {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(err)) => Err(self.pg_err(err)),
            Err(_) => Err(StoreError::Timeout),
        }
    }

    fn pg_err(&self, err: tokio_postgres::Error) -> StoreError {
        if err.code() == Some(&SqlState::QUERY_CANCELED) {
            // statement_timeout fired.
            return StoreError::Timeout;
        }
        StoreError::Unavailable(self.target.describe(&err))
    }

    fn pool_err(&self, err: PoolError) -> StoreError {
        match err {
            // Nothing was sent: the call certainly did nothing.
            PoolError::Timeout(TimeoutType::Create) => StoreError::Unavailable(format!(
                "postgres at {}: connecting timed out",
                self.target.endpoint
            )),
            PoolError::Timeout(_) => StoreError::Timeout,
            PoolError::Backend(err) => self.pg_err(err),
            other => StoreError::Unavailable(format!("postgres pool: {other}")),
        }
    }
}

/// A serialization failure or a deadlock: PostgreSQL aborted the statement
/// (or transaction), so it changed nothing and may run again.
fn is_conflict(err: &tokio_postgres::Error) -> bool {
    is_conflict_code(err.code())
}

fn is_conflict_code(code: Option<&SqlState>) -> bool {
    code == Some(&SqlState::T_R_SERIALIZATION_FAILURE)
        || code == Some(&SqlState::T_R_DEADLOCK_DETECTED)
}

/// A pooled connection in the middle of one call. Only [`settle`] puts it
/// back in the pool; dropped any other way (the call timed out, or the
/// caller's own deadline dropped the call's future) its connection may still
/// be running a statement, so it leaves the pool instead: the next call must
/// not queue behind a statement nobody waits for.
struct InUse(Option<Object>);

impl std::ops::Deref for InUse {
    type Target = Object;
    fn deref(&self) -> &Object {
        self.0.as_ref().expect("present until dropped")
    }
}

impl std::ops::DerefMut for InUse {
    fn deref_mut(&mut self) -> &mut Object {
        self.0.as_mut().expect("present until dropped")
    }
}

impl Drop for InUse {
    fn drop(&mut self) {
        if let Some(object) = self.0.take() {
            drop(Object::take(object));
        }
    }
}

/// `record` with its times moved by `by` milliseconds (from the server's
/// frame into the caller's; see [`super::Span`]).
fn shifted(mut record: Record, by: i64) -> Record {
    if let RecordState::InFlight { locked_until } = &mut record.state {
        *locked_until += by;
    }
    record.created_at += by;
    record.expires_at += by;
    record
}

fn decode_row(row: &tokio_postgres::Row) -> Result<Record, StoreError> {
    decode_row_at(row, 0)
}

/// The record columns starting at column `at`.
fn decode_row_at(row: &tokio_postgres::Row, at: usize) -> Result<Record, StoreError> {
    let corrupt = |err: tokio_postgres::Error| StoreError::Corrupt(format!("postgres row: {err}"));
    RecordRow {
        fingerprint: row.try_get(at).map_err(corrupt)?,
        state: row.try_get(at + 1).map_err(corrupt)?,
        locked_until: row.try_get(at + 2).map_err(corrupt)?,
        created_at: row.try_get(at + 3).map_err(corrupt)?,
        expires_at: row.try_get(at + 4).map_err(corrupt)?,
        status: row
            .try_get::<_, Option<i32>>(at + 5)
            .map_err(corrupt)?
            .map(i64::from),
        headers: row.try_get(at + 6).map_err(corrupt)?,
        body: row.try_get(at + 7).map_err(corrupt)?,
    }
    .into_record()
}

impl Core {
    /// Claims many keys (distinct) in one statement; each answer is what
    /// [`Store::claim`] would give. A statement that fails without timing
    /// out changed nothing, so its keys are claimed one by one (one bad row
    /// cannot fail its neighbours); one that timed out may still commit,
    /// so every key gets the timeout (and is given back by its caller).
    async fn claim_many(&self, claims: Vec<Claim>) -> Vec<Result<ClaimOutcome, StoreError>> {
        if let [claim] = claims.as_slice() {
            return vec![self.claim(claim).await];
        }
        let answers = match self.claim_batch(&claims).await {
            Ok(answers) => answers,
            Err(StoreError::Timeout) => {
                return claims.iter().map(|_| Err(StoreError::Timeout)).collect()
            }
            Err(err) => {
                tracing::debug!(error = %err, rows = claims.len(), "batched claim failed; claiming one by one");
                claims.iter().map(|_| None).collect()
            }
        };
        let mut out = Vec::with_capacity(claims.len());
        for (claim, answer) in claims.iter().zip(answers) {
            out.push(match answer {
                Some(answer) => answer,
                // Changed under the batch's snapshot: settle it alone.
                None => self.claim(claim).await,
            });
        }
        out
    }

    /// The claim's statements on `client`: one round trip in the common
    /// cases, more when it races with a release or sweep.
    async fn claim_on(
        &self,
        client: &ClientWrapper,
        claim: &Claim,
    ) -> Result<Result<ClaimOutcome, StoreError>, tokio_postgres::Error> {
        let key = KeyParams::new(&claim.key);
        let fingerprint = &claim.fingerprint.0[..];
        let token = &claim.token.0[..];
        let params: [Param<'_>; 7] = [
            (&key.scope, Type::BYTEA),
            (&key.key, Type::BYTEA),
            (&fingerprint, Type::BYTEA),
            (&token, Type::BYTEA),
            (&claim.lease_ms, Type::INT8),
            (&self.clock_offset_ms, Type::INT8),
            (&claim.ttl_ms, Type::INT8),
        ];
        // One round trip in the common cases: it claims, or it finds a
        // live record and writes nothing (a replay takes no row lock).
        let rows = self.query(client, &self.sql.claim_or_read, &params).await?;
        let Some(row) = rows.first() else {
            return Ok(Err(StoreError::Corrupt("the claim answered no row".into())));
        };
        if let Some(takeover) = row.get::<_, Option<bool>>(0) {
            return Ok(Ok(ClaimOutcome::Claimed { takeover }));
        }
        if row.get::<_, Option<Vec<u8>>>(2).is_some() {
            let server_now: i64 = row.get(1);
            match decode_row_at(row, 2).map(|r| shifted(r, claim.now - server_now)) {
                Ok(record) if !is_claimable(&record, &claim.fingerprint, claim.now) => {
                    return Ok(Ok(ClaimOutcome::Existing(record)))
                }
                Ok(_) => {}
                Err(err) => return Ok(Err(err)),
            }
        }
        // A concurrent claim, release or sweep changed the record between
        // this statement's snapshot and its insert: settle it the long way.
        for _ in 0..CLAIM_ATTEMPTS {
            let rows = self.query(client, &self.sql.claim, &params).await?;
            if let Some(row) = rows.first() {
                return Ok(Ok(ClaimOutcome::Claimed {
                    takeover: row.get(0),
                }));
            }
            // A live record is there. This SELECT is a new snapshot, so it
            // sees the row the claim conflicted with, unless that was
            // released or swept in between: then claim again. It may also
            // have changed in between: a record that is claimable by now
            // is claimed again rather than reported as live.
            let rows = self
                .query(
                    client,
                    &self.sql.select_at,
                    &[
                        (&key.scope, Type::BYTEA),
                        (&key.key, Type::BYTEA),
                        (&self.clock_offset_ms, Type::INT8),
                    ],
                )
                .await?;
            if let Some(row) = rows.first() {
                let server_now: i64 = row.get(8);
                let record = decode_row(row).map(|r| shifted(r, claim.now - server_now));
                match record {
                    Ok(record) if is_claimable(&record, &claim.fingerprint, claim.now) => continue,
                    Ok(record) => return Ok(Ok(ClaimOutcome::Existing(record))),
                    Err(err) => return Ok(Err(err)),
                }
            }
        }
        Ok(Err(StoreError::Unavailable(format!(
            "claim raced with concurrent deletes {CLAIM_ATTEMPTS} times"
        ))))
    }

    /// One multi-row claim; `None` for a key the statement could not settle.
    async fn claim_batch(
        &self,
        claims: &[Claim],
    ) -> Result<Vec<Option<Result<ClaimOutcome, StoreError>>>, StoreError> {
        let scopes: Vec<&[u8]> = claims.iter().map(|c| &c.key.scope.0[..]).collect();
        let keys: Vec<&[u8]> = claims.iter().map(|c| &c.key.key[..]).collect();
        let fingerprints: Vec<&[u8]> = claims.iter().map(|c| &c.fingerprint.0[..]).collect();
        let tokens: Vec<&[u8]> = claims.iter().map(|c| &c.token.0[..]).collect();
        let leases: Vec<i64> = claims.iter().map(|c| c.lease_ms).collect();
        let ttls: Vec<i64> = claims.iter().map(|c| c.ttl_ms).collect();
        let rows = self
            .read(
                &self.sql.claim_many,
                &[
                    (&scopes, Type::BYTEA_ARRAY),
                    (&keys, Type::BYTEA_ARRAY),
                    (&fingerprints, Type::BYTEA_ARRAY),
                    (&tokens, Type::BYTEA_ARRAY),
                    (&leases, Type::INT8_ARRAY),
                    (&ttls, Type::INT8_ARRAY),
                    (&self.clock_offset_ms, Type::INT8),
                ],
            )
            .await?;
        if rows.len() != claims.len() {
            return Err(StoreError::Corrupt(format!(
                "a batched claim of {} keys answered {} rows",
                claims.len(),
                rows.len()
            )));
        }
        Ok(rows
            .iter()
            .zip(claims)
            .map(|(row, claim)| {
                if let Some(takeover) = row.get::<_, Option<bool>>(1) {
                    return Some(Ok(ClaimOutcome::Claimed { takeover }));
                }
                row.get::<_, Option<Vec<u8>>>(3)?;
                let server_now: i64 = row.get(2);
                match decode_row_at(row, 3).map(|r| shifted(r, claim.now - server_now)) {
                    Ok(record) if !is_claimable(&record, &claim.fingerprint, claim.now) => {
                        Some(Ok(ClaimOutcome::Existing(record)))
                    }
                    Ok(_) => None,
                    Err(err) => Some(Err(err)),
                }
            })
            .collect())
    }

    /// Completes many holders (distinct keys) in one statement, fenced per
    /// row; failures as for [`Core::claim_many`].
    async fn complete_many(&self, items: Vec<Completing>) -> Vec<Result<Fence, StoreError>> {
        if let [one] = items.as_slice() {
            return vec![
                self.complete(&one.key, &one.token, &one.completion, one.keep)
                    .await,
            ];
        }
        match self.complete_batch(&items).await {
            Ok(held) => items
                .iter()
                .map(|c| {
                    Ok(if held.contains(&c.key) {
                        Fence::Held
                    } else {
                        Fence::Lost
                    })
                })
                .collect(),
            Err(StoreError::Timeout) => items.iter().map(|_| Err(StoreError::Timeout)).collect(),
            Err(err) => {
                tracing::debug!(error = %err, rows = items.len(), "batched completion failed; completing one by one");
                let mut out = Vec::with_capacity(items.len());
                for c in &items {
                    out.push(self.complete(&c.key, &c.token, &c.completion, c.keep).await);
                }
                out
            }
        }
    }

    /// The keys whose fence held.
    async fn complete_batch(
        &self,
        items: &[Completing],
    ) -> Result<std::collections::HashSet<RecordKey>, StoreError> {
        let columns: Vec<_> = items.iter().map(|c| c.completion.columns()).collect();
        let scopes: Vec<&[u8]> = items.iter().map(|c| &c.key.scope.0[..]).collect();
        let keys: Vec<&[u8]> = items.iter().map(|c| &c.key.key[..]).collect();
        let tokens: Vec<&[u8]> = items.iter().map(|c| &c.token.0[..]).collect();
        let states: Vec<&str> = columns.iter().map(|c| c.state).collect();
        let statuses: Vec<Option<i32>> = columns.iter().map(|c| c.status.map(i32::from)).collect();
        let headers: Vec<Option<&[u8]>> = columns.iter().map(|c| c.headers.as_deref()).collect();
        let bodies: Vec<Option<&[u8]>> = columns.iter().map(|c| c.body).collect();
        let keeps: Vec<i64> = items.iter().map(|c| c.keep.ms).collect();
        let rows = self
            .read(
                &self.sql.complete_many,
                &[
                    (&scopes, Type::BYTEA_ARRAY),
                    (&keys, Type::BYTEA_ARRAY),
                    (&tokens, Type::BYTEA_ARRAY),
                    (&states, Type::TEXT_ARRAY),
                    (&statuses, Type::INT4_ARRAY),
                    (&headers, Type::BYTEA_ARRAY),
                    (&bodies, Type::BYTEA_ARRAY),
                    (&keeps, Type::INT8_ARRAY),
                    (&self.clock_offset_ms, Type::INT8),
                ],
            )
            .await?;
        rows.iter()
            .map(|row| {
                let scope: &[u8] = row.get(0);
                let key: &[u8] = row.get(1);
                Ok(RecordKey {
                    scope: Scope(array_from(scope, "scope")?),
                    key: array_from(key, "key")?,
                })
            })
            .collect()
    }
}

#[async_trait]
impl Store for PostgresStore {
    async fn claim(&self, claim: &Claim) -> Result<ClaimOutcome, StoreError> {
        (self.claims().call(claim.clone()).await).unwrap_or_else(|| Err(batcher_gone()))
    }

    async fn renew(
        &self,
        key: &RecordKey,
        token: &LeaseToken,
        lease: Span,
    ) -> Result<Fence, StoreError> {
        self.core.renew(key, token, lease).await
    }

    async fn complete(
        &self,
        key: &RecordKey,
        token: &LeaseToken,
        completion: &Completion,
        keep: Span,
    ) -> Result<Fence, StoreError> {
        let completing = Completing {
            key: *key,
            token: *token,
            completion: completion.clone(),
            keep,
        };
        (self.completions().call(completing).await).unwrap_or_else(|| Err(batcher_gone()))
    }

    async fn release(&self, key: &RecordKey, token: &LeaseToken) -> Result<Fence, StoreError> {
        self.core.release(key, token).await
    }

    async fn get(&self, key: &RecordKey) -> Result<Option<Record>, StoreError> {
        self.core.get(key).await
    }

    async fn delete(&self, key: &RecordKey) -> Result<bool, StoreError> {
        self.core.delete(key).await
    }

    async fn sweep(&self, now: UnixMillis, batch: u32) -> Result<u64, StoreError> {
        self.core.sweep(now, batch).await
    }

    async fn ping(&self) -> Result<(), StoreError> {
        self.core.ping().await
    }

    fn backend(&self) -> &'static str {
        self.core.backend()
    }

    fn call_bound(&self) -> Duration {
        self.core.call_bound()
    }
}

#[async_trait]
impl Store for Core {
    async fn claim(&self, claim: &Claim) -> Result<ClaimOutcome, StoreError> {
        let deadline = self.deadline();
        let client = self.checkout(deadline).await?;
        let res = tokio::time::timeout_at(
            deadline,
            self.unit(&client, false, || self.claim_on(&client, claim)),
        )
        .await;
        self.settle(client, res)?
    }

    async fn renew(
        &self,
        key: &RecordKey,
        token: &LeaseToken,
        lease: Span,
    ) -> Result<Fence, StoreError> {
        let owner = OwnerParams::new(key, token);
        self.write(
            &self.sql.renew,
            &[
                (&owner.scope, Type::BYTEA),
                (&owner.key, Type::BYTEA),
                (&owner.token, Type::BYTEA),
                (&self.clock_offset_ms, Type::INT8),
                (&lease.ms, Type::INT8),
            ],
        )
        .await
        .map(Fence::from_rows)
    }

    async fn complete(
        &self,
        key: &RecordKey,
        token: &LeaseToken,
        completion: &Completion,
        keep: Span,
    ) -> Result<Fence, StoreError> {
        let owner = OwnerParams::new(key, token);
        let columns = completion.columns();
        let status = columns.status.map(i32::from);
        self.write(
            &self.sql.complete,
            &[
                (&owner.scope, Type::BYTEA),
                (&owner.key, Type::BYTEA),
                (&owner.token, Type::BYTEA),
                (&columns.state, Type::TEXT),
                (&status, Type::INT4),
                (&columns.headers, Type::BYTEA),
                (&columns.body, Type::BYTEA),
                (&self.clock_offset_ms, Type::INT8),
                (&keep.ms, Type::INT8),
            ],
        )
        .await
        .map(Fence::from_rows)
    }

    async fn release(&self, key: &RecordKey, token: &LeaseToken) -> Result<Fence, StoreError> {
        let owner = OwnerParams::new(key, token);
        self.write(
            &self.sql.release,
            &[
                (&owner.scope, Type::BYTEA),
                (&owner.key, Type::BYTEA),
                (&owner.token, Type::BYTEA),
            ],
        )
        .await
        .map(Fence::from_rows)
    }

    async fn get(&self, key: &RecordKey) -> Result<Option<Record>, StoreError> {
        let key = KeyParams::new(key);
        let rows = self
            .read(
                &self.sql.select,
                &[(&key.scope, Type::BYTEA), (&key.key, Type::BYTEA)],
            )
            .await?;
        rows.first().map(decode_row).transpose()
    }

    async fn delete(&self, key: &RecordKey) -> Result<bool, StoreError> {
        let key = KeyParams::new(key);
        self.write(
            &self.sql.delete,
            &[(&key.scope, Type::BYTEA), (&key.key, Type::BYTEA)],
        )
        .await
        .map(|n| n > 0)
    }

    /// Sweeps by the server's clock; `now` (the caller's) is not used.
    async fn sweep(&self, _now: UnixMillis, batch: u32) -> Result<u64, StoreError> {
        let deadline = self.deadline();
        let client = self.checkout(deadline).await?;
        let batch = i64::from(batch);
        let locked = self.migration_lock == MigrationLock::Advisory;
        let on: &ClientWrapper = &client;
        let batch = &batch;
        let res = tokio::time::timeout_at(
            deadline,
            self.unit(on, locked, || async move {
                // One sweeper at a time across replicas; the others skip this
                // round instead of queueing behind it.
                if locked {
                    let got: bool = on
                        .query_typed(
                            "SELECT pg_try_advisory_xact_lock($1, hashtext($2))",
                            &[(&SWEEP_LOCK, Type::INT4), (&self.schema, Type::TEXT)],
                        )
                        .await?
                        .first()
                        .is_some_and(|row| row.get(0));
                    if !got {
                        return Ok(0);
                    }
                }
                self.execute(
                    on,
                    &self.sql.sweep,
                    &[(&self.clock_offset_ms, Type::INT8), (batch, Type::INT8)],
                )
                .await
            }),
        )
        .await;
        self.settle(client, res)
    }

    async fn ping(&self) -> Result<(), StoreError> {
        let deadline = self.deadline();
        let client = self.checkout(deadline).await?;
        let res = tokio::time::timeout_at(deadline, client.simple_query("SELECT 1")).await;
        self.settle(client, res).map(|_| ())
    }

    fn backend(&self) -> &'static str {
        "postgres"
    }

    fn call_bound(&self) -> Duration {
        self.timeout + CALL_BOUND_MARGIN
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_serialization_failures_and_deadlocks_are_run_again() {
        let cases = [
            (Some(SqlState::T_R_SERIALIZATION_FAILURE), true),
            (Some(SqlState::T_R_DEADLOCK_DETECTED), true),
            // A statement_timeout may have hit a write that then committed
            // nothing, but the caller treats it as a timeout (ambiguous).
            (Some(SqlState::QUERY_CANCELED), false),
            (Some(SqlState::UNIQUE_VIOLATION), false),
            (Some(SqlState::LOCK_NOT_AVAILABLE), false),
            (Some(SqlState::ADMIN_SHUTDOWN), false),
            (None, false),
        ];
        for (code, rerun) in cases {
            assert_eq!(is_conflict_code(code.as_ref()), rerun, "{code:?}");
        }
    }

    #[test]
    fn synchronous_commit_is_raised_to_on_where_weaker_and_never_lowered() {
        for (effective, runs_with) in [
            ("off", Some("on")),
            ("local", Some("on")),
            ("remote_write", None),
            ("on", None),
            ("remote_apply", None),
            // A value a newer server may add: kept rather than guessed at.
            ("remote_flush", None),
        ] {
            assert_eq!(raised_commit(effective), runs_with, "{effective}");
        }
        // The server applies the same list.
        for sql in [raise_commit_sql(false), raise_commit_sql(true)] {
            assert!(sql.ends_with("IN ('off', 'local')"), "{sql}");
        }
        assert!(raise_commit_sql(true).contains("'on', true)"));
        assert!(raise_commit_sql(false).contains("'on', false)"));
    }

    #[test]
    fn the_commit_report_says_what_the_server_has_and_what_idemgate_runs_with() {
        let report = |server: &str, session: &str| CommitReport {
            server: server.into(),
            session: session.into(),
        };
        let raised = report("off", "on").describe().unwrap();
        assert!(
            raised.starts_with("synchronous_commit is off (the server's")
                && raised.contains("raised to on"),
            "{raised}"
        );
        assert_eq!(
            report("remote_apply", "remote_apply").describe().unwrap(),
            "synchronous_commit is remote_apply: kept"
        );
        let stuck = report("local", "local").describe().unwrap_err();
        assert!(stuck.contains("could not be raised"), "{stuck}");
    }

    #[test]
    fn conflict_reruns_fit_well_inside_a_store_timeout() {
        let most = |a| CONFLICT_PAUSE.delay(a, 1.0);
        let total: Duration = (1..CONFLICT_ATTEMPTS).map(most).sum();
        assert_eq!(CONFLICT_PAUSE.delay(1, 0.0), Duration::from_millis(5));
        assert!(total < Duration::from_millis(100), "{total:?}");
    }
}
