//! The embedded default store: one SQLite file (rusqlite, bundled), WAL mode.
//!
//! `PRIMARY KEY (scope, key)` is the guard and the claim is a single
//! `INSERT ... ON CONFLICT ... DO UPDATE ... WHERE <expired or lease over>
//! RETURNING` inside a `BEGIN IMMEDIATE` transaction, so two processes on
//! the same file (an old and a restarted proxy) still cannot both claim.
//! `synchronous = FULL` by default: a claim is on disk before the upstream
//! is called.

use super::codec::RecordRow;
use super::{
    Claim, ClaimOutcome, Completion, Fence, LeaseToken, Record, Store, StoreError, UnixMillis,
};
use crate::config::SqliteSync;
use crate::idempotency::RecordKey;
use async_trait::async_trait;
use rusqlite::{params, Connection, OptionalExtension, TransactionBehavior};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Ordered schema migrations; `PRAGMA user_version` records how many ran.
const MIGRATIONS: &[&str] = &[r#"
CREATE TABLE idempotency_records (
    scope        BLOB    NOT NULL,
    key          BLOB    NOT NULL,
    fingerprint  BLOB    NOT NULL,
    state        TEXT    NOT NULL CHECK (state IN ('in_flight', 'completed', 'unstored')),
    token        BLOB,
    locked_until INTEGER NOT NULL,
    created_at   INTEGER NOT NULL,
    expires_at   INTEGER NOT NULL,
    status       INTEGER,
    headers      BLOB,
    body         BLOB,
    takeover     INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (scope, key)
) WITHOUT ROWID;
CREATE INDEX idempotency_records_expires_at ON idempotency_records (expires_at);
"#];

/// How long a writer waits for another process's lock on the same file.
const BUSY_TIMEOUT: Duration = Duration::from_secs(5);

const CLAIM_SQL: &str = r#"
INSERT INTO idempotency_records
    (scope, key, fingerprint, state, token, locked_until, created_at, expires_at, takeover)
VALUES (?1, ?2, ?3, 'in_flight', ?4, ?5, ?6, ?7, 0)
ON CONFLICT (scope, key) DO UPDATE SET
    fingerprint  = excluded.fingerprint,
    state        = 'in_flight',
    token        = excluded.token,
    locked_until = excluded.locked_until,
    created_at   = excluded.created_at,
    expires_at   = excluded.expires_at,
    status       = NULL,
    headers      = NULL,
    body         = NULL,
    takeover     = (idempotency_records.state = 'in_flight')
WHERE (idempotency_records.state <> 'in_flight' AND idempotency_records.expires_at <= ?6)
   OR (idempotency_records.state = 'in_flight' AND idempotency_records.locked_until <= ?6)
RETURNING takeover
"#;

const SELECT_SQL: &str =
    "SELECT fingerprint, state, locked_until, created_at, expires_at, status, headers, body \
     FROM idempotency_records WHERE scope = ?1 AND key = ?2";

const OWNED: &str = "scope = ?1 AND key = ?2 AND token = ?3 AND state = 'in_flight'";

pub struct SqliteStore {
    conn: Arc<Mutex<Connection>>,
    path: PathBuf,
}

impl SqliteStore {
    /// Opens (creating the file and its directory if needed) and migrates.
    pub fn open(path: &Path, sync: SqliteSync) -> Result<Self, StoreError> {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|e| {
                StoreError::Unavailable(format!("cannot create {}: {e}", dir.display()))
            })?;
        }
        let conn = Connection::open(path)
            .map_err(|e| StoreError::Unavailable(format!("cannot open {}: {e}", path.display())))?;
        Self::init(conn, sync, path.to_path_buf())
    }

    fn init(mut conn: Connection, sync: SqliteSync, path: PathBuf) -> Result<Self, StoreError> {
        let e = |e: rusqlite::Error| StoreError::Unavailable(format!("{}: {e}", path.display()));
        conn.busy_timeout(BUSY_TIMEOUT).map_err(e)?;
        let mode: String = conn
            .query_row("PRAGMA journal_mode = WAL", [], |r| r.get(0))
            .map_err(e)?;
        if !mode.eq_ignore_ascii_case("wal") {
            tracing::warn!(journal_mode = %mode, "sqlite did not switch to WAL");
        }
        let sync_sql = match sync {
            SqliteSync::Full => "PRAGMA synchronous = FULL",
            SqliteSync::Normal => "PRAGMA synchronous = NORMAL",
        };
        conn.execute_batch(sync_sql).map_err(e)?;
        migrate(&mut conn).map_err(e)?;
        Ok(Self {
            conn: Arc::new(Mutex::new(conn)),
            path,
        })
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
        .map_err(|e| StoreError::Unavailable(format!("sqlite worker failed: {e}")))?
    }
}

fn migrate(conn: &mut Connection) -> rusqlite::Result<()> {
    let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
    let version: usize = tx.query_row("PRAGMA user_version", [], |r| r.get(0))?;
    for (i, sql) in MIGRATIONS.iter().enumerate().skip(version) {
        tx.execute_batch(sql)?;
        tx.execute_batch(&format!("PRAGMA user_version = {}", i + 1))?;
    }
    tx.commit()
}

fn db_err(e: rusqlite::Error) -> StoreError {
    StoreError::Unavailable(format!("sqlite: {e}"))
}

fn read_record(conn: &Connection, key: &RecordKey) -> Result<Option<Record>, StoreError> {
    conn.prepare_cached(SELECT_SQL)
        .map_err(db_err)?
        .query_row(params![&key.scope.0[..], &key.key[..]], |r| {
            Ok(RecordRow {
                fingerprint: r.get(0)?,
                state: r.get(1)?,
                locked_until: r.get(2)?,
                created_at: r.get(3)?,
                expires_at: r.get(4)?,
                status: r.get(5)?,
                headers: r.get(6)?,
                body: r.get(7)?,
            })
        })
        .optional()
        .map_err(db_err)?
        .map(RecordRow::into_record)
        .transpose()
}

#[async_trait]
impl Store for SqliteStore {
    async fn claim(&self, c: &Claim) -> Result<ClaimOutcome, StoreError> {
        let c = c.clone();
        self.call(move |conn| {
            let tx = conn
                .transaction_with_behavior(TransactionBehavior::Immediate)
                .map_err(db_err)?;
            let claimed: Option<bool> = tx
                .prepare_cached(CLAIM_SQL)
                .map_err(db_err)?
                .query_row(
                    params![
                        &c.key.scope.0[..],
                        &c.key.key[..],
                        &c.fingerprint.0[..],
                        &c.token.0[..],
                        c.locked_until(),
                        c.now,
                        c.expires_at(),
                    ],
                    |r| r.get(0),
                )
                .optional()
                .map_err(db_err)?;
            let outcome = match claimed {
                Some(takeover) => ClaimOutcome::Claimed { takeover },
                None => ClaimOutcome::Existing(read_record(&tx, &c.key)?.ok_or_else(|| {
                    StoreError::Corrupt("conflicting record vanished inside a transaction".into())
                })?),
            };
            tx.commit().map_err(db_err)?;
            Ok(outcome)
        })
        .await
    }

    async fn renew(
        &self,
        key: &RecordKey,
        token: &LeaseToken,
        locked_until: UnixMillis,
    ) -> Result<Fence, StoreError> {
        let (key, token) = (*key, *token);
        self.call(move |conn| {
            let n = conn
                .prepare_cached(&format!(
                    "UPDATE idempotency_records SET locked_until = ?4 WHERE {OWNED}"
                ))
                .map_err(db_err)?
                .execute(params![
                    &key.scope.0[..],
                    &key.key[..],
                    &token.0[..],
                    locked_until
                ])
                .map_err(db_err)?;
            Ok(Fence::from_rows(n as u64))
        })
        .await
    }

    async fn complete(
        &self,
        key: &RecordKey,
        token: &LeaseToken,
        completion: &Completion,
        expires_at: UnixMillis,
    ) -> Result<Fence, StoreError> {
        let (key, token, completion) = (*key, *token, completion.clone());
        self.call(move |conn| {
            let columns = completion.columns();
            let n = conn
                .prepare_cached(&format!(
                    "UPDATE idempotency_records SET state = ?4, status = ?5, headers = ?6, body = ?7, \
                     token = NULL, locked_until = 0, expires_at = ?8 WHERE {OWNED}"
                ))
                .map_err(db_err)?
                .execute(params![
                    &key.scope.0[..],
                    &key.key[..],
                    &token.0[..],
                    columns.state,
                    columns.status,
                    columns.headers,
                    columns.body,
                    expires_at
                ])
                .map_err(db_err)?;
            Ok(Fence::from_rows(n as u64))
        })
        .await
    }

    async fn release(&self, key: &RecordKey, token: &LeaseToken) -> Result<Fence, StoreError> {
        let (key, token) = (*key, *token);
        self.call(move |conn| {
            let n = conn
                .prepare_cached(&format!("DELETE FROM idempotency_records WHERE {OWNED}"))
                .map_err(db_err)?
                .execute(params![&key.scope.0[..], &key.key[..], &token.0[..]])
                .map_err(db_err)?;
            Ok(Fence::from_rows(n as u64))
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
            let n = conn
                .execute(
                    "DELETE FROM idempotency_records WHERE scope = ?1 AND key = ?2",
                    params![&key.scope.0[..], &key.key[..]],
                )
                .map_err(db_err)?;
            Ok(n > 0)
        })
        .await
    }

    async fn sweep(&self, now: UnixMillis, batch: u32) -> Result<u64, StoreError> {
        self.call(move |conn| {
            let n = conn
                .prepare_cached(
                    "DELETE FROM idempotency_records WHERE (scope, key) IN ( \
                       SELECT scope, key FROM idempotency_records \
                       WHERE expires_at <= ?1 AND NOT (state = 'in_flight' AND locked_until > ?1) \
                       ORDER BY expires_at LIMIT ?2)",
                )
                .map_err(db_err)?
                .execute(params![now, batch])
                .map_err(db_err)?;
            Ok(n as u64)
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
}
