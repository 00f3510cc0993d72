//! The pool and one call on it: how a connection is opened (TLS, and
//! `synchronous_commit` raised where weak, [`super::durability`]), checked
//! out within the call's deadline, run as one unit (behind a pooler in a
//! transaction that sets the session options; rerun when PostgreSQL
//! aborted it for a serialization failure or deadlock) and settled back,
//! and how every failure maps to [`StoreError`].

use super::durability::{
    raise_commit_sql, CommitReport, ReplicationReport, COMMIT_REPORT, REPLICATION_REPORT,
    REQUIRE_SYNC_ON_CONNECT,
};
use crate::config::{MigrationLock, StoreConfig};
use crate::net::backoff::Backoff;
use crate::store::pg_connect::{MakeRustls, PgFailure, PgTarget};
use crate::store::sql::{Dialect, Statements};
use crate::store::StoreError;
use deadpool_postgres::{
    ClientWrapper, Manager, ManagerConfig, Object, Pool, PoolError, RecyclingMethod, Runtime,
    TimeoutType,
};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;
use tokio::sync::OnceCell;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_postgres::error::SqlState;
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::Row;

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
pub(super) const CALL_BOUND_MARGIN: Duration = Duration::from_millis(250);
const KEEPALIVE_IDLE: Duration = Duration::from_secs(30);

/// Everything one call needs; shared with the batching tasks.
pub(super) struct Core {
    pub(super) pool: Pool,
    /// Set once migrations are known to be current; until then every
    /// operation tries them first, so a proxy started while PostgreSQL was
    /// down creates its tables when the database comes back.
    pub(super) migrated: OnceCell<()>,
    pub(super) schema: String,
    /// Whole-call deadline: pool wait, connect and the statements together.
    pub(super) timeout: Duration,
    /// Statement texts, schema-qualified once at connect.
    pub(super) sql: Statements,
    /// Added to the server's clock in every statement: zero, except in
    /// tests that play time forward ([`PostgresStore::with_clock_offset`]).
    pub(super) clock_offset_ms: i64,
    /// Where the database is, for messages.
    pub(super) target: PgTarget,
    /// `pgbouncer=true`: the statement that opens every call's transaction
    /// and sets the session options in it (see the module docs).
    pub(super) pooled: Option<String>,
    pub(super) migration_lock: MigrationLock,
    /// The TLS version of the newest connection (`None`: plaintext).
    pub(super) last_tls: Arc<Mutex<Option<&'static str>>>,
    /// The operator has been told what `synchronous_commit` runs with.
    pub(super) commit_told: AtomicBool,
    /// `store.require_synchronous_replication`: claims wait for its word.
    pub(super) sync_gate: Option<SyncGate>,
}

/// How long a verdict on the primary's synchronous standbys stands: a
/// standby that drops out is noticed within this (its commits would wait
/// for it anyway), and a busy proxy asks once per period, not per claim.
const SYNC_CHECK_EVERY: Duration = Duration::from_secs(1);

/// When, and what was found.
type SyncVerdict = (Instant, Result<(), String>);

/// `store.require_synchronous_replication`: the latest verdict on whether
/// the primary has a synchronous standby, refreshed by the first claim
/// after it is [`SYNC_CHECK_EVERY`] old (one check at a time). A new
/// connection, which may be to another server after a failover, is checked
/// on its own when it opens ([`REQUIRE_SYNC_ON_CONNECT`]).
#[derive(Default)]
pub(super) struct SyncGate {
    last: tokio::sync::Mutex<Option<SyncVerdict>>,
    /// Whether claims are being refused now: each change is logged once.
    refusing: AtomicBool,
}

/// Opens the pool's connections: TLS as the URL says, recording which the
/// connection got; connected directly (no pooler), the session's
/// `synchronous_commit` is raised where weak before the pool hands it out.
struct Connector {
    tls: MakeRustls,
    /// `store.require_synchronous_replication`: a connection to a server
    /// without a synchronous standby is refused before any claim uses it.
    require_sync: bool,
    /// [`raise_commit_sql`] for a session, or `None` behind a pooler.
    session: Option<String>,
    last_tls: Arc<Mutex<Option<&'static str>>>,
    /// With several hosts in `store.url`: the host a new connection tries
    /// first, and how long each but the last one tried may take
    /// ([`connect_any`]).
    next_host: AtomicUsize,
    per_host: Duration,
}

type Connected = Result<(tokio_postgres::Client, JoinHandle<()>), tokio_postgres::Error>;

/// One config per host of a multi-host `store.url`, each naming only that
/// host (with its port and `hostaddr`), everything else as in `pg`; empty
/// for one host.
fn per_host(pg: &tokio_postgres::Config) -> Vec<tokio_postgres::Config> {
    use tokio_postgres::config::Host;
    let hosts = pg.get_hosts();
    if hosts.len() < 2 {
        return Vec::new();
    }
    let ports = pg.get_ports();
    hosts
        .iter()
        .enumerate()
        .map(|(i, host)| {
            let mut one = tokio_postgres::Config::new();
            if let Some(user) = pg.get_user() {
                one.user(user);
            }
            if let Some(password) = pg.get_password() {
                one.password(password);
            }
            if let Some(dbname) = pg.get_dbname() {
                one.dbname(dbname);
            }
            if let Some(options) = pg.get_options() {
                one.options(options);
            }
            if let Some(name) = pg.get_application_name() {
                one.application_name(name);
            }
            match host {
                Host::Tcp(h) => one.host(h),
                #[cfg(unix)]
                Host::Unix(path) => one.host_path(path),
            };
            if let Some(addr) = pg.get_hostaddrs().get(i) {
                one.hostaddr(*addr);
            }
            one.port(ports.get(i).or(ports.first()).copied().unwrap_or(5432));
            if let Some(t) = pg.get_connect_timeout() {
                one.connect_timeout(*t);
            }
            if let Some(t) = pg.get_tcp_user_timeout() {
                one.tcp_user_timeout(*t);
            }
            one.keepalives(pg.get_keepalives())
                .keepalives_idle(pg.get_keepalives_idle());
            if let Some(interval) = pg.get_keepalives_interval() {
                one.keepalives_interval(interval);
            }
            if let Some(retries) = pg.get_keepalives_retries() {
                one.keepalives_retries(retries);
            }
            one.ssl_mode(pg.get_ssl_mode())
                .ssl_negotiation(pg.get_ssl_negotiation())
                .target_session_attrs(pg.get_target_session_attrs())
                .channel_binding(pg.get_channel_binding());
            one
        })
        .collect()
}

/// Moves [`Connector::next_host`] past host `from` when dropped armed:
/// that host failed, stalled past its bound, or the call gave up on it
/// (its deadline), so the next connection starts at the one after it.
struct MoveOn<'a> {
    next: &'a AtomicUsize,
    from: usize,
    hosts: usize,
    armed: bool,
}

impl Drop for MoveOn<'_> {
    fn drop(&mut self) {
        if self.armed {
            let after = (self.from + 1) % self.hosts;
            let _ =
                self.next
                    .compare_exchange(self.from, after, Ordering::Relaxed, Ordering::Relaxed);
        }
    }
}

/// Connects to one host of `pg` that accepts writes. With one host, as
/// tokio-postgres does. With several, host by host from
/// [`Connector::next_host`] (the last one that worked), each but the last
/// one tried bounded by `per_host` (connecting, TLS, start-up and the
/// read-write check: tokio-postgres bounds only the TCP connect, so a
/// host that accepts and then says nothing, or drops packets, would
/// otherwise use up the pool's whole `create_timeout` and the next host
/// would never be tried); the last one by the pool's `create_timeout`.
/// The error is the one of the last host in `store.url` that answered
/// with one, as tokio-postgres reports.
async fn connect_any<T>(
    pg: &tokio_postgres::Config,
    tls: T,
    next: &AtomicUsize,
    per_host_bound: Duration,
) -> Result<
    (
        tokio_postgres::Client,
        tokio_postgres::Connection<tokio_postgres::Socket, T::Stream>,
    ),
    tokio_postgres::Error,
>
where
    T: tokio_postgres::tls::MakeTlsConnect<tokio_postgres::Socket> + Clone,
{
    let hosts = per_host(pg);
    if hosts.is_empty() {
        return pg.connect(tls).await;
    }
    let n = hosts.len();
    let start = next.load(Ordering::Relaxed) % n;
    let mut failed: Option<(usize, tokio_postgres::Error)> = None;
    for k in 0..n {
        let i = (start + k) % n;
        let mut moving = MoveOn {
            next,
            from: i,
            hosts: n,
            armed: true,
        };
        let attempt = hosts[i].connect(tls.clone());
        let outcome = if k + 1 < n {
            tokio::time::timeout(per_host_bound, attempt).await.ok()
        } else {
            Some(attempt.await)
        };
        match outcome {
            Some(Ok(connected)) => {
                moving.armed = false;
                next.store(i, Ordering::Relaxed);
                return Ok(connected);
            }
            Some(Err(err)) if failed.as_ref().is_none_or(|(j, _)| i > *j) => {
                failed = Some((i, err));
            }
            Some(Err(_)) | None => {}
        }
    }
    match failed {
        Some((_, err)) => Err(err),
        // The last host tried has no bound of its own: it answered.
        None => unreachable!("the last host tried ran to an answer"),
    }
}

impl deadpool_postgres::Connect for Connector {
    fn connect(
        &self,
        pg: &tokio_postgres::Config,
    ) -> Pin<Box<dyn Future<Output = Connected> + Send + '_>> {
        let (tls, seen) = self.tls.recording();
        let pg = pg.clone();
        Box::pin(async move {
            let (client, connection) =
                connect_any(&pg, tls, &self.next_host, self.per_host).await?;
            // As deadpool's own connector does.
            let task = tokio::spawn(async move {
                if let Err(e) = connection.await {
                    tracing::warn!(target: "deadpool.postgres", "Connection error: {}", e);
                }
            });
            let checks = [
                self.session.as_deref(),
                self.require_sync.then_some(REQUIRE_SYNC_ON_CONNECT),
            ];
            for sql in checks.into_iter().flatten() {
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
pub(super) type Param<'a> = (&'a (dyn ToSql + Sync), Type);

/// `"name"` with embedded quotes doubled (config already restricts the
/// charset; this keeps the SQL correct regardless).
pub(super) fn quote_ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

impl Core {
    /// Builds the pool without connecting: PostgreSQL being down at start is
    /// not an error, operations fail with [`StoreError`] until it answers.
    /// Only a missing or malformed `store.url`, or a certificate file it
    /// names that cannot be read, fails here.
    pub(super) async fn connect(cfg: &StoreConfig) -> Result<Self, StoreError> {
        let url = cfg
            .url
            .as_deref()
            .ok_or_else(|| StoreError::unavailable("store.url is not set"))?;
        let target = PgTarget::new(url)
            .map_err(|err| StoreError::unavailable(format!("store.url: {err}")))?;
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
            let set: String = settings
                .iter()
                .map(|(name, value)| format!("; SET LOCAL {name} = {value}"))
                .collect();
            Some(format!("BEGIN{set}; {}", raise_commit_sql(true)))
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
            require_sync: cfg.require_synchronous_replication,
            // A URL's own `options=-c synchronous_commit=off` is applied at
            // startup, so this sees (and raises) it too.
            session: pooled.is_none().then(|| raise_commit_sql(false)),
            last_tls: last_tls.clone(),
            next_host: AtomicUsize::new(0),
            per_host: cfg.connect_timeout,
        };
        // Each host but the last one tried gets `connect_timeout`
        // (connect_any), the last one the rest.
        let hosts = u32::try_from(pg.get_hosts().len().max(1)).unwrap_or(u32::MAX);
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
            .create_timeout(Some(cfg.connect_timeout.saturating_mul(hosts)))
            .recycle_timeout(Some(cfg.connect_timeout))
            .build()
            .map_err(|err| StoreError::caused("cannot build postgres pool", err))?;
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
            sync_gate: cfg.require_synchronous_replication.then(SyncGate::default),
        })
    }

    /// Migrates (once per process) and checks a connection out, all before
    /// `deadline`.
    pub(super) async fn checkout(&self, deadline: Instant) -> Result<InUse, StoreError> {
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

    pub(super) async fn connection(&self, deadline: Instant) -> Result<InUse, StoreError> {
        let object = tokio::time::timeout_at(deadline, self.pool.get())
            .await
            .map_err(|_| StoreError::Timeout)?
            .map_err(|e| self.pool_err(e))?;
        Ok(InUse(Some(object)))
    }

    pub(super) fn deadline(&self) -> Instant {
        Instant::now() + self.timeout
    }

    /// One statement that returns a row count, as one call.
    pub(super) async fn write(&self, sql: &str, params: &[Param<'_>]) -> Result<u64, StoreError> {
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
    pub(super) async fn read(
        &self,
        sql: &str,
        params: &[Param<'_>],
    ) -> Result<Vec<Row>, StoreError> {
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
    pub(super) async fn query(
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
    pub(super) async fn execute(
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
    pub(super) async fn unit<T, F>(
        &self,
        client: &ClientWrapper,
        transaction: bool,
        body: impl Fn() -> F,
    ) -> Result<T, tokio_postgres::Error>
    where
        F: std::future::Future<Output = Result<T, tokio_postgres::Error>>,
    {
        let begin = self.pooled.as_deref().or(transaction.then_some("BEGIN"));
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
                Err(err) if attempt < CONFLICT_ATTEMPTS && is_conflict(err.code()) => {
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
    pub(super) fn settle<T>(
        &self,
        mut client: InUse,
        res: Result<Result<T, tokio_postgres::Error>, tokio::time::error::Elapsed>,
    ) -> Result<T, StoreError> {
        match &res {
            // Its server went into recovery, or is shutting down (a
            // failover is under way): this connection will never write
            // again, and neither will the idle ones opened beside it, so
            // they all leave the pool and the next call connects afresh
            // (to whichever host accepts writes now).
            Ok(Err(err)) if is_gone_read_only(err.code()) => {
                self.pool.retain(|_, _| false);
            }
            Ok(_) => drop(client.0.take()),
            Err(_) => {}
        }
        match res {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(err)) => Err(self.pg_err(err)),
            Err(_) => Err(StoreError::Timeout),
        }
    }

    pub(super) fn pg_err(&self, err: tokio_postgres::Error) -> StoreError {
        if err.code() == Some(&SqlState::QUERY_CANCELED) {
            // statement_timeout fired.
            return StoreError::Timeout;
        }
        if err.code() == Some(&SqlState::RAISE_EXCEPTION) {
            self.unsynchronized();
        }
        StoreError::Postgres(self.target.failure(err))
    }

    pub(super) fn pool_err(&self, err: PoolError) -> StoreError {
        match err {
            // Nothing was sent: the call certainly did nothing.
            PoolError::Timeout(TimeoutType::Create) => PgFailure {
                endpoint: Some(self.target.endpoint.clone()),
                cause: "connecting timed out".into(),
                source: None,
            }
            .into(),
            PoolError::Timeout(_) => StoreError::Timeout,
            PoolError::Backend(err) => self.pg_err(err),
            other => StoreError::caused("postgres pool", other),
        }
    }
}

/// The server answered that it cannot write, now or ever on this
/// connection: it is a standby (25006, a read-only transaction) or it is
/// going down (57P01 admin shutdown, 57P02 crash shutdown, 57P03 cannot
/// connect now: starting up or in recovery).
fn is_gone_read_only(code: Option<&SqlState>) -> bool {
    [
        SqlState::READ_ONLY_SQL_TRANSACTION,
        SqlState::ADMIN_SHUTDOWN,
        SqlState::CRASH_SHUTDOWN,
        SqlState::CANNOT_CONNECT_NOW,
    ]
    .iter()
    .any(|c| code == Some(c))
}

/// A serialization failure or a deadlock: PostgreSQL aborted the statement
/// (or transaction), so it changed nothing and may run again.
fn is_conflict(code: Option<&SqlState>) -> bool {
    code == Some(&SqlState::T_R_SERIALIZATION_FAILURE)
        || code == Some(&SqlState::T_R_DEADLOCK_DETECTED)
}

/// A pooled connection in the middle of one call. Only [`settle`] puts it
/// back in the pool; dropped any other way (the call timed out, or the
/// caller's own deadline dropped the call's future) its connection may still
/// be running a statement, so it leaves the pool instead: the next call must
/// not queue behind a statement nobody waits for.
pub(super) struct InUse(pub(super) Option<Object>);

impl std::ops::Deref for InUse {
    type Target = Object;
    fn deref(&self) -> &Object {
        self.0.as_ref().expect("present until dropped")
    }
}

impl Drop for InUse {
    fn drop(&mut self) {
        if let Some(object) = self.0.take() {
            drop(Object::take(object));
        }
    }
}

impl Core {
    /// [`COMMIT_REPORT`] on `client` as one call, and the connection settled.
    pub(super) async fn settle_commit_report(
        &self,
        client: InUse,
        deadline: Instant,
    ) -> Result<CommitReport, StoreError> {
        let decode = |row: &Row| CommitReport {
            server: row.get(0),
            session: row.get(1),
        };
        let missing = "pg_settings has no synchronous_commit";
        self.one_row(client, deadline, COMMIT_REPORT, decode, missing)
            .await
    }

    /// [`REPLICATION_REPORT`] as one call on a pooled connection.
    pub(super) async fn replication_report(
        &self,
        deadline: Instant,
    ) -> Result<ReplicationReport, StoreError> {
        let client = self.connection(deadline).await?;
        let decode = |row: &Row| ReplicationReport {
            standby_names: row.get(0),
            streaming: row.get(1),
            synchronous: row.get(2),
            hidden: row.get(3),
        };
        let missing = "pg_stat_replication gave no row";
        self.one_row(client, deadline, REPLICATION_REPORT, decode, missing)
            .await
    }

    /// `sql` (no parameters) on `client` as one call, its first row
    /// decoded, the connection settled; no row is [`StoreError::Corrupt`].
    async fn one_row<T>(
        &self,
        client: InUse,
        deadline: Instant,
        sql: &str,
        decode: impl Fn(&Row) -> T,
        missing: &'static str,
    ) -> Result<T, StoreError> {
        let on: &ClientWrapper = &client;
        let decode = &decode;
        let res = tokio::time::timeout_at(
            deadline,
            self.unit(on, false, || async move {
                let rows = self.query(on, sql, &[]).await?;
                Ok(rows.first().map(decode))
            }),
        )
        .await;
        self.settle(client, res)?
            .ok_or_else(|| StoreError::Corrupt(missing.into()))
    }

    /// A new connection found no synchronous standby (a failover): said
    /// once, and the gate's verdict dropped so the next claim asks again.
    fn unsynchronized(&self) {
        let Some(gate) = &self.sync_gate else {
            return;
        };
        if !gate.refusing.swap(true, Ordering::Relaxed) {
            tracing::error!("store.require_synchronous_replication: refusing protected requests (503): the primary has no synchronous standby (synchronous_standby_names, pg_stat_replication)");
        }
        if let Ok(mut last) = gate.last.try_lock() {
            *last = None;
        }
    }

    /// With `store.require_synchronous_replication`, refuses (503) while the
    /// primary has no synchronous standby; otherwise nothing.
    pub(super) async fn require_sync(&self) -> Result<(), StoreError> {
        let Some(gate) = &self.sync_gate else {
            return Ok(());
        };
        let mut last = gate.last.lock().await;
        let verdict = match &*last {
            Some((at, verdict)) if at.elapsed() < SYNC_CHECK_EVERY => verdict.clone(),
            _ => {
                let verdict = match self.replication_report(self.deadline()).await {
                    Ok(report) => report.synchronous().map(|_| ()),
                    // A new connection refused by REQUIRE_SYNC_ON_CONNECT.
                    Err(StoreError::Postgres(f))
                        if f.source.as_ref().and_then(|e| e.code())
                            == Some(&SqlState::RAISE_EXCEPTION) =>
                    {
                        Err("the primary has no synchronous standby (synchronous_standby_names, pg_stat_replication)".to_string())
                    }
                    Err(err) => return Err(err),
                };
                let refusing = verdict.is_err();
                if gate.refusing.swap(refusing, Ordering::Relaxed) != refusing {
                    match &verdict {
                        Err(why) => tracing::error!(
                            "store.require_synchronous_replication: refusing protected requests (503): {why}"
                        ),
                        Ok(()) => tracing::warn!(
                            "store.require_synchronous_replication: a synchronous standby is back; claiming again"
                        ),
                    }
                }
                *last = Some((Instant::now(), verdict.clone()));
                verdict
            }
        };
        verdict.map_err(|why| {
            StoreError::unavailable(format!("store.require_synchronous_replication: {why}"))
        })
    }

    /// Once per store (a process has one), when the database first answers:
    /// a warning naming the server's `synchronous_commit` where idemgate
    /// raised it, an error where it could not.
    pub(super) async fn tell_commit(&self) {
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
                return;
            }
        }
        match self.replication_report(self.deadline()).await {
            Ok(report) => match report.synchronous() {
                Ok(good) => tracing::info!("postgres replication: {good}"),
                Err(bad) => tracing::warn!("postgres replication: {bad}"),
            },
            Err(err) => tracing::debug!(error = %err, "could not read pg_stat_replication"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_multi_host_url_gives_one_config_per_host_with_everything_else_kept() {
        let pg: tokio_postgres::Config =
            "postgres://u:pw@db-a:5433,db-b/app?sslmode=require&application_name=x&options=-c%20a%3Db&connect_timeout=3"
                .parse()
                .unwrap();
        let one = per_host(&pg);
        assert_eq!(one.len(), 2);
        for (c, (host, port)) in one.iter().zip([("db-a", 5433), ("db-b", 5432)]) {
            assert_eq!(
                c.get_hosts(),
                &[tokio_postgres::config::Host::Tcp(host.into())]
            );
            assert_eq!(c.get_ports(), &[port]);
            assert_eq!(c.get_user(), Some("u"));
            assert_eq!(c.get_password(), Some(&b"pw"[..]));
            assert_eq!(c.get_dbname(), Some("app"));
            assert_eq!(c.get_application_name(), Some("x"));
            assert_eq!(c.get_options(), Some("-c a=b"));
            assert_eq!(c.get_ssl_mode(), pg.get_ssl_mode());
            assert_eq!(c.get_connect_timeout(), Some(&Duration::from_secs(3)));
        }
        let single: tokio_postgres::Config = "postgres://u@db-a/app".parse().unwrap();
        assert!(per_host(&single).is_empty());
    }

    /// A first host that accepts and then says nothing no longer uses up
    /// the whole connection attempt: it gets `per_host`, the next host is
    /// tried, and the next connection starts past the silent one.
    #[tokio::test]
    async fn a_silent_host_is_left_after_its_bound_and_the_next_one_tried() {
        let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let silent_port = silent.local_addr().unwrap().port();
        let held = tokio::spawn(async move {
            let mut kept = Vec::new();
            while let Ok((socket, _)) = silent.accept().await {
                kept.push(socket);
            }
        });
        // A port nothing listens on: refused at once.
        let refused = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let refused_port = refused.local_addr().unwrap().port();
        drop(refused);
        let pg: tokio_postgres::Config = format!(
            "postgres://u@127.0.0.1:{silent_port},127.0.0.1:{refused_port}/app?sslmode=disable"
        )
        .parse()
        .unwrap();
        let next = AtomicUsize::new(0);
        let started = std::time::Instant::now();
        let got = tokio::time::timeout(
            Duration::from_secs(5),
            connect_any(
                &pg,
                tokio_postgres::NoTls,
                &next,
                Duration::from_millis(200),
            ),
        )
        .await
        .expect("bounded by the silent host's bound, not hung on it");
        assert!(got.is_err(), "nothing accepts writes");
        assert!(started.elapsed() < Duration::from_secs(2));
        // Both failed: the pointer moved past each, back to the first.
        assert_eq!(next.load(Ordering::Relaxed), 0);
        // Started at the second host, the silent one comes last: unbounded
        // here (the pool's create_timeout bounds it), so it hangs.
        next.store(1, Ordering::Relaxed);
        let last = tokio::time::timeout(
            Duration::from_millis(500),
            connect_any(
                &pg,
                tokio_postgres::NoTls,
                &next,
                Duration::from_millis(200),
            ),
        )
        .await;
        assert!(last.is_err(), "the last host tried has no bound of its own");
        held.abort();
    }

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
            assert_eq!(is_conflict(code.as_ref()), rerun, "{code:?}");
        }
    }

    #[test]
    fn connections_to_a_server_that_cannot_write_leave_the_pool() {
        let cases = [
            (Some(SqlState::READ_ONLY_SQL_TRANSACTION), true),
            (Some(SqlState::ADMIN_SHUTDOWN), true),
            (Some(SqlState::CRASH_SHUTDOWN), true),
            (Some(SqlState::CANNOT_CONNECT_NOW), true),
            (Some(SqlState::UNIQUE_VIOLATION), false),
            (Some(SqlState::QUERY_CANCELED), false),
            (None, false),
        ];
        for (code, gone) in cases {
            assert_eq!(is_gone_read_only(code.as_ref()), gone, "{code:?}");
        }
    }

    #[test]
    fn conflict_reruns_fit_well_inside_a_store_timeout() {
        let most = |a| CONFLICT_PAUSE.delay(a, 1.0);
        let total: Duration = (1..CONFLICT_ATTEMPTS).map(most).sum();
        assert_eq!(CONFLICT_PAUSE.delay(1, 0.0), Duration::from_millis(5));
        assert!(total < Duration::from_millis(100), "{total:?}");
    }
}
