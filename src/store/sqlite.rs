//! The embedded default store: one SQLite file (rusqlite, bundled), WAL mode.
//!
//! `PRIMARY KEY (scope, key)` is the guard and the claim is a single
//! `INSERT ... ON CONFLICT ... DO UPDATE ... WHERE <expired or lease over>
//! RETURNING` inside a `BEGIN IMMEDIATE` transaction, so two processes on
//! the same file (an old and a restarted proxy) still cannot both claim.
//! `synchronous = FULL` by default: a claim is on disk before the upstream
//! is called.

use super::batch::{Batcher, Completing};
use super::codec::RecordRow;
use super::sql::{Dialect, KeyParams, OwnerParams, Statements, SQLITE_MIGRATIONS};
use super::{
    Claim, ClaimOutcome, Completion, Fence, LeaseToken, Record, Resolution, Span, Store,
    StoreError, StoredResponse, UnixMillis, Verdict, RESOLVED_STATUS,
};
use crate::config::{SqliteSync, DEFAULT_STORE_TIMEOUT};
use crate::idempotency::RecordKey;
use async_trait::async_trait;
use rusqlite::{params, Connection, OptionalExtension, TransactionBehavior};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, Mutex, OnceLock};
use std::time::Duration;

/// How long a writer waits for another process's lock on the same file.
const BUSY_TIMEOUT: Duration = Duration::from_secs(5);

/// The table's statements, in SQLite's dialect.
static SQL: LazyLock<Statements> =
    LazyLock::new(|| Statements::new(Dialect::Sqlite, "idempotency_records"));

pub struct SqliteStore {
    conn: Arc<Mutex<Connection>>,
    /// Claims and completions, coalesced: each batch is one transaction,
    /// so one commit (one fsync with `synchronous = FULL`) serves them all.
    writes: OnceLock<Batcher<Queued, Result<Written, StoreError>>>,
    /// Numbers the queued writes (they never need separating by record:
    /// a batch runs them one after another).
    next_write: AtomicU64,
    path: PathBuf,
    /// `store.timeout`, the call bound: SQLite has no deadline of its own
    /// (a statement waits up to [`BUSY_TIMEOUT`] for another process's lock).
    timeout: Duration,
}

impl SqliteStore {
    /// Opens (creating the file and its directory if needed) and migrates,
    /// with the default `store.timeout` (see [`SqliteStore::with_timeout`]).
    pub fn open(path: &Path, sync: SqliteSync) -> Result<Self, StoreError> {
        if let Some(dir) = path.parent().filter(|dir| !dir.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|err| {
                StoreError::caused(format!("cannot create {}", dir.display()), err)
            })?;
        }
        let conn = Connection::open(path)
            .map_err(|err| StoreError::caused(format!("cannot open {}", path.display()), err))?;
        Self::init(conn, sync, path.to_path_buf())
    }

    fn init(mut conn: Connection, sync: SqliteSync, path: PathBuf) -> Result<Self, StoreError> {
        let unavailable = |err| StoreError::caused(path.display().to_string(), err);
        conn.busy_timeout(BUSY_TIMEOUT).map_err(unavailable)?;
        let mode: String = conn
            .query_row("PRAGMA journal_mode = WAL", [], |row| row.get(0))
            .map_err(unavailable)?;
        if !mode.eq_ignore_ascii_case("wal") {
            tracing::warn!(journal_mode = %mode, "sqlite did not switch to WAL");
        }
        let sync_sql = match sync {
            SqliteSync::Full => "PRAGMA synchronous = FULL",
            SqliteSync::Normal => "PRAGMA synchronous = NORMAL",
        };
        conn.execute_batch(sync_sql).map_err(unavailable)?;
        migrate(&mut conn).map_err(unavailable)?;
        Ok(Self {
            conn: Arc::new(Mutex::new(conn)),
            writes: OnceLock::new(),
            next_write: AtomicU64::new(0),
            path,
            timeout: DEFAULT_STORE_TIMEOUT,
        })
    }

    /// The same store, bounded by the configured `store.timeout`.
    pub fn with_timeout(self, timeout: Duration) -> Self {
        Self { timeout, ..self }
    }

    /// Queues a claim or completion for the next batch.
    async fn write(&self, op: WriteOp) -> Result<Written, StoreError> {
        let writes = self.writes.get_or_init(|| {
            let conn = self.conn.clone();
            // One writer: SQLite serializes write transactions anyway.
            Batcher::start(
                1,
                WRITE_BATCH_MAX,
                |queued: &Queued| queued.seq,
                move |ops| {
                    let conn = conn.clone();
                    async move {
                        let count = ops.len();
                        tokio::task::spawn_blocking(move || {
                            let mut guard = conn.lock().unwrap_or_else(|p| p.into_inner());
                            write_batch(&mut guard, ops)
                        })
                        .await
                        .unwrap_or_else(|err| all_failed(count, "sqlite worker failed", err))
                    }
                },
            )
        });
        let seq = self.next_write.fetch_add(1, Ordering::Relaxed);
        writes
            .call(Queued { seq, op })
            .await
            .unwrap_or_else(|| Err(StoreError::unavailable("sqlite: the writer has stopped")))
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Runs `f` on the connection off the async runtime.
    async fn call<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut Connection) -> Result<T, StoreError> + Send + 'static,
    ) -> Result<T, StoreError> {
        let conn = self.conn.clone();
        tokio::task::spawn_blocking(move || {
            let mut guard = conn.lock().unwrap_or_else(|p| p.into_inner());
            f(&mut guard)
        })
        .await
        .map_err(worker_failed)?
    }
}

fn migrate(conn: &mut Connection) -> rusqlite::Result<()> {
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
    let version: usize = tx.query_row("PRAGMA user_version", [], |row| row.get(0))?;
    for (i, sql) in SQLITE_MIGRATIONS.iter().enumerate().skip(version) {
        tx.execute_batch(sql)?;
        tx.execute_batch(&format!("PRAGMA user_version = {}", i + 1))?;
    }
    tx.commit()
}

fn db_err(err: rusqlite::Error) -> StoreError {
    StoreError::caused("sqlite", err)
}

/// Runs `sql` as a cached statement; returns how many rows it changed.
fn execute(conn: &Connection, sql: &str, params: impl rusqlite::Params) -> Result<u64, StoreError> {
    let n = conn
        .prepare_cached(sql)
        .map_err(db_err)?
        .execute(params)
        .map_err(db_err)?;
    Ok(n as u64)
}

/// A blocking task that panicked or was cancelled.
pub(super) fn worker_failed(err: tokio::task::JoinError) -> StoreError {
    StoreError::caused("sqlite worker failed", err)
}

/// `count` answers, all failed with `what` for the one `cause`.
fn all_failed<T>(
    count: usize,
    what: &'static str,
    cause: impl std::error::Error + Send + Sync + 'static,
) -> Vec<Result<T, StoreError>> {
    let cause: Arc<dyn std::error::Error + Send + Sync> = Arc::new(cause);
    (0..count)
        .map(|_| Err(StoreError::caused(what, cause.clone())))
        .collect()
}

/// The record columns starting at column `at`.
fn record_row(row: &rusqlite::Row<'_>, at: usize) -> rusqlite::Result<RecordRow> {
    Ok(RecordRow {
        fingerprint: row.get(at)?,
        state: row.get(at + 1)?,
        locked_until: row.get(at + 2)?,
        created_at: row.get(at + 3)?,
        expires_at: row.get(at + 4)?,
        status: row.get(at + 5)?,
        headers: row.get(at + 6)?,
        body: row.get(at + 7)?,
        first_method: row.get(at + 8)?,
        first_path: row.get(at + 9)?,
    })
}

fn read_record(conn: &Connection, key: &RecordKey) -> Result<Option<Record>, StoreError> {
    let key = KeyParams::new(key);
    conn.prepare_cached(&SQL.select)
        .map_err(db_err)?
        .query_row(params![key.scope, key.key], |row| record_row(row, 0))
        .optional()
        .map_err(db_err)?
        .map(RecordRow::into_record)
        .transpose()
}

/// Writes per transaction, at most.
const WRITE_BATCH_MAX: usize = 128;

/// A write waiting for the next batch.
struct Queued {
    seq: u64,
    op: WriteOp,
}

enum WriteOp {
    Claim(Claim),
    Complete(Completing),
}

enum Written {
    Claim(ClaimOutcome),
    Complete(Fence),
}

/// Runs `ops` in one `BEGIN IMMEDIATE` transaction, each in a savepoint of
/// its own (a failing write is rolled back alone and answered with its
/// error); one commit makes them all durable, or none.
fn write_batch(conn: &mut Connection, ops: Vec<Queued>) -> Vec<Result<Written, StoreError>> {
    let count = ops.len();
    let mut tx = match conn.transaction_with_behavior(TransactionBehavior::Immediate) {
        Ok(tx) => tx,
        Err(err) => return all_failed(count, "sqlite", err),
    };
    let mut answers = Vec::with_capacity(count);
    for queued in ops {
        let savepoint = match tx.savepoint() {
            Ok(savepoint) => savepoint,
            Err(err) => return all_failed(count, "sqlite", err),
        };
        let answer = match &queued.op {
            WriteOp::Claim(claim) => claim_in(&savepoint, claim).map(Written::Claim),
            WriteOp::Complete(c) => complete_in(&savepoint, c).map(Written::Complete),
        };
        if answer.is_ok() {
            if let Err(err) = savepoint.commit() {
                return all_failed(count, "sqlite", err);
            }
        }
        // Dropped without commit: rolled back to before this write.
        answers.push(answer);
    }
    match tx.commit() {
        Ok(()) => answers,
        Err(err) => all_failed(count, "sqlite", err),
    }
}

/// One claim inside the caller's transaction.
fn claim_in(conn: &Connection, claim: &Claim) -> Result<ClaimOutcome, StoreError> {
    let key = KeyParams::new(&claim.key);
    let claimed: Option<bool> = conn
        .prepare_cached(&SQL.claim)
        .map_err(db_err)?
        .query_row(
            params![
                key.scope,
                key.key,
                &claim.fingerprint.0[..],
                &claim.token.0[..],
                claim.lease_ms,
                claim.now,
                claim.ttl_ms,
                claim.first_use.as_ref().map(|f| &f.method),
                claim.first_use.as_ref().map(|f| &f.path),
            ],
            |row| row.get(0),
        )
        .optional()
        .map_err(db_err)?;
    Ok(match claimed {
        Some(takeover) => ClaimOutcome::Claimed { takeover },
        None => ClaimOutcome::Existing(read_record(conn, &claim.key)?.ok_or_else(|| {
            StoreError::Corrupt("conflicting record vanished inside a transaction".into())
        })?),
    })
}

/// One fenced completion inside the caller's transaction.
fn complete_in(conn: &Connection, c: &Completing) -> Result<Fence, StoreError> {
    let owner = OwnerParams::new(&c.key, &c.token);
    let columns = c.completion.columns();
    let params = params![
        owner.scope,
        owner.key,
        owner.token,
        columns.state,
        columns.status,
        columns.headers,
        columns.body,
        c.keep.now,
        c.keep.ms
    ];
    execute(conn, &SQL.complete, params).map(Fence::from_rows)
}

#[async_trait]
impl Store for SqliteStore {
    async fn claim(&self, claim: &Claim) -> Result<ClaimOutcome, StoreError> {
        match self.write(WriteOp::Claim(claim.clone())).await? {
            Written::Claim(outcome) => Ok(outcome),
            Written::Complete(_) => {
                Err(StoreError::Corrupt("sqlite writer mixed up answers".into()))
            }
        }
    }

    async fn renew(
        &self,
        key: &RecordKey,
        token: &LeaseToken,
        lease: Span,
    ) -> Result<Fence, StoreError> {
        let (key, token) = (*key, *token);
        self.call(move |conn| {
            let owner = OwnerParams::new(&key, &token);
            let params = params![owner.scope, owner.key, owner.token, lease.now, lease.ms];
            execute(conn, &SQL.renew, params).map(Fence::from_rows)
        })
        .await
    }

    async fn complete(
        &self,
        key: &RecordKey,
        token: &LeaseToken,
        completion: &Completion,
        keep: Span,
    ) -> Result<Fence, StoreError> {
        let op = WriteOp::Complete(Completing {
            key: *key,
            token: *token,
            completion: completion.clone(),
            keep,
        });
        match self.write(op).await? {
            Written::Complete(fence) => Ok(fence),
            Written::Claim(_) => Err(StoreError::Corrupt("sqlite writer mixed up answers".into())),
        }
    }

    async fn release(&self, key: &RecordKey, token: &LeaseToken) -> Result<Fence, StoreError> {
        let (key, token) = (*key, *token);
        self.call(move |conn| {
            let owner = OwnerParams::new(&key, &token);
            let params = params![owner.scope, owner.key, owner.token];
            execute(conn, &SQL.release, params).map(Fence::from_rows)
        })
        .await
    }

    async fn get(&self, key: &RecordKey) -> Result<Option<Record>, StoreError> {
        let key = *key;
        self.call(move |conn| read_record(conn, &key)).await
    }

    async fn delete(&self, key: &RecordKey) -> Result<bool, StoreError> {
        let key = *key;
        self.call(move |conn| {
            let key = KeyParams::new(&key);
            execute(conn, &SQL.delete, params![key.scope, key.key]).map(|n| n > 0)
        })
        .await
    }

    async fn resolve(
        &self,
        key: &RecordKey,
        verdict: &Verdict,
        now: UnixMillis,
    ) -> Result<bool, StoreError> {
        let (key, verdict) = (*key, verdict.clone());
        self.call(move |conn| {
            let key = KeyParams::new(&key);
            let changed = match &verdict {
                Verdict::NotApplied => {
                    let params = params![key.scope, key.key, now];
                    execute(conn, &SQL.resolve_not_applied, params)?
                }
                Verdict::Applied { reason } => execute(
                    conn,
                    &SQL.resolve_applied,
                    params![key.scope, key.key, RESOLVED_STATUS, now, reason],
                )?,
            };
            Ok(changed > 0)
        })
        .await
    }

    async fn resolution(&self, key: &RecordKey) -> Result<Option<Resolution>, StoreError> {
        let key = *key;
        self.call(move |conn| {
            let key = KeyParams::new(&key);
            conn.prepare_cached(&SQL.resolution)
                .map_err(db_err)?
                .query_row(params![key.scope, key.key], |row| {
                    Ok(Resolution {
                        at: row.get(0)?,
                        reason: row.get(1)?,
                    })
                })
                .optional()
                .map_err(db_err)
        })
        .await
    }

    async fn sweep(&self, now: UnixMillis, batch: u32) -> Result<u64, StoreError> {
        self.call(move |conn| execute(conn, &SQL.sweep, params![now, batch]))
            .await
    }

    async fn scan_completed(
        &self,
        after: Option<RecordKey>,
        limit: u32,
        now: UnixMillis,
    ) -> Result<Vec<(RecordKey, Record)>, StoreError> {
        self.call(move |conn| {
            let (scope, key) = match &after {
                Some(after) => (&after.scope.0[..], &after.key[..]),
                None => (&[][..], &[][..]),
            };
            let mut stmt = conn.prepare_cached(&SQL.scan_completed).map_err(db_err)?;
            let rows = stmt
                .query_map(params![scope, key, now, limit], |row| {
                    Ok((
                        row.get::<_, Vec<u8>>(0)?,
                        row.get::<_, Vec<u8>>(1)?,
                        record_row(row, 2)?,
                    ))
                })
                .map_err(db_err)?;
            let mut page = Vec::new();
            for row in rows {
                let (scope, key, record) = row.map_err(db_err)?;
                page.push((
                    super::codec::record_key_from(&scope, &key)?,
                    record.into_record()?,
                ));
            }
            Ok(page)
        })
        .await
    }

    async fn rewrite_response(
        &self,
        key: &RecordKey,
        old: &StoredResponse,
        new: &StoredResponse,
    ) -> Result<bool, StoreError> {
        let (key, old, new) = (*key, old.clone(), new.clone());
        self.call(move |conn| {
            let key = KeyParams::new(&key);
            let params = params![
                key.scope,
                key.key,
                old.status,
                super::codec::encode_headers(&old.headers),
                &old.body[..],
                new.status,
                super::codec::encode_headers(&new.headers),
                &new.body[..],
            ];
            execute(conn, &SQL.rewrite_response, params).map(|n| n == 1)
        })
        .await
    }

    async fn ping(&self) -> Result<(), StoreError> {
        self.call(|conn| conn.query_row("SELECT 1", [], |_| Ok(())).map_err(db_err))
            .await
    }

    fn backend(&self) -> &'static str {
        "sqlite"
    }

    fn call_bound(&self) -> Duration {
        self.timeout
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::{sample_claim, Completion, RecordState, Span};

    /// A database written by the first schema keeps its records when the
    /// later ones (the `unknown` state, resolutions, first uses) are
    /// applied on open; the old record has no first use.
    #[tokio::test]
    async fn an_older_database_is_migrated_with_its_records() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("old.db");
        {
            let conn = Connection::open(&path).unwrap();
            conn.execute_batch(SQLITE_MIGRATIONS[0]).unwrap();
            conn.execute_batch("PRAGMA user_version = 1").unwrap();
            conn.execute(
                "INSERT INTO idempotency_records \
                 (scope, key, fingerprint, state, token, locked_until, created_at, expires_at, status) \
                 VALUES (?1, ?2, ?3, 'unstored', NULL, 0, 5, 9999999999999, 200)",
                params![[1u8; 32], [2u8; 32], [3u8; 32]],
            )
            .unwrap();
        }
        let store = SqliteStore::open(&path, SqliteSync::Full).unwrap();
        let old = RecordKey {
            scope: crate::idempotency::Scope([1; 32]),
            key: [2; 32],
        };
        let record = store.get(&old).await.unwrap().expect("kept");
        assert_eq!(record.state, RecordState::Unstored { status: 200 });
        assert_eq!(record.created_at, 5);
        assert_eq!(record.first_use, None);

        let mut claim = sample_claim();
        claim.key.key = [9; 32];
        claim.now = 1_000;
        assert!(matches!(
            store.claim(&claim).await.unwrap(),
            ClaimOutcome::Claimed { .. }
        ));
        let keep = Span { now: 1_000, ms: 1 };
        let fence = store
            .complete(&claim.key, &claim.token, &Completion::Unknown, keep)
            .await
            .unwrap();
        assert_eq!(fence, Fence::Held);
        let unknown = store.get(&claim.key).await.unwrap().unwrap();
        assert_eq!(unknown.state, RecordState::Unknown);
        assert_eq!(unknown.first_use, sample_claim().first_use);
        let conn = store.conn.lock().unwrap();
        let version: usize = conn
            .query_row("PRAGMA user_version", [], |row| row.get(0))
            .unwrap();
        assert_eq!(version, SQLITE_MIGRATIONS.len());
    }
}
