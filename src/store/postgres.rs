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
//! a synchronous standby loses it) or `remote_write` (the standby has not
//! flushed it) is raised to `on` for idemgate's own
//! sessions, and anything stronger is kept ([`raised_commit`]). Each new
//! connection is raised once (`pool::Connector`); behind PgBouncer each call's
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
//! with a short jittered pause, within the call's deadline ([`pool`]).
//!
//! Files: [`pool`] (connections and one call), [`migrate`] (the schema),
//! [`batch`] (group commit), [`durability`] (`synchronous_commit`); this
//! file is the [`Store`] the rest of idemgate sees.

mod batch;
mod durability;
mod migrate;
mod pool;

pub use durability::{raised_commit, CommitReport, Probe};

use super::batch::{Batcher, Completing};
use super::pg_connect::describe_transport;
use super::sql::{KeyParams, OwnerParams};
use super::{
    Claim, ClaimOutcome, Completion, Fence, LeaseToken, Record, Resolution, Span, Store,
    StoreError, StoredResponse, UnixMillis, Verdict, RESOLVED_STATUS,
};
use crate::config::{MigrationLock, StoreConfig};
use crate::idempotency::RecordKey;
use async_trait::async_trait;
use batch::{batcher_gone, decode_row};
use deadpool_postgres::ClientWrapper;
use pool::{Core, Param, CALL_BOUND_MARGIN};
use std::sync::{Arc, OnceLock, PoisonError};
use std::time::Duration;
use tokio_postgres::types::Type;

/// Ordered schema migrations (the text lives with the SQLite twin in
/// `store/sql.rs`); `{schema}` is replaced by the quoted schema name.
pub use super::sql::POSTGRES_MIGRATIONS as MIGRATIONS;

/// The sweeper's advisory lock, beside `migrate`'s (same second key).
const SWEEP_LOCK: i32 = 0x1de6_0002;

/// The PostgreSQL store: the connection pool and statements ([`Core`]),
/// with claims and completions coalesced into multi-row statements when
/// requests arrive together ([`super::batch`]).
pub struct PostgresStore {
    core: Arc<Core>,
    claims: OnceLock<Batcher<Claim, Result<ClaimOutcome, StoreError>>>,
    completions: OnceLock<Batcher<Completing, Result<Fence, StoreError>>>,
}

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
        let replication = core.replication_report(deadline).await?;
        Ok(Probe {
            transport: describe_transport(tls, core.target.url.sslmode),
            commit,
            replication,
        })
    }

    /// Where the database is (`host:port`) and the TLS mode, for messages.
    pub fn describe_target(&self) -> String {
        let url = &self.core.target.url;
        let pgbouncer = if url.pgbouncer {
            ", pgbouncer=true"
        } else {
            ""
        };
        format!(
            "postgres at {} (sslmode={}{pgbouncer})",
            self.core.target.endpoint,
            url.sslmode.as_str()
        )
    }

    /// Applies pending migrations; returns how many ran now (0 when current).
    /// Safe to run from several replicas at once: one transaction under
    /// `pg_advisory_xact_lock`, so the others wait and then find it done.
    pub async fn migrate(&self) -> Result<u32, StoreError> {
        self.core.migrate().await
    }
}

#[async_trait]
impl Store for PostgresStore {
    async fn claim(&self, claim: &Claim) -> Result<ClaimOutcome, StoreError> {
        self.core.require_sync().await?;
        (self.claims().call(claim.clone()).await).unwrap_or_else(|| Err(batcher_gone()))
    }

    async fn renew(
        &self,
        key: &RecordKey,
        token: &LeaseToken,
        lease: Span,
    ) -> Result<Fence, StoreError> {
        let core = &*self.core;
        let owner = OwnerParams::new(key, token);
        core.write(
            &core.sql.renew,
            &[
                (&owner.scope, Type::BYTEA),
                (&owner.key, Type::BYTEA),
                (&owner.token, Type::BYTEA),
                (&core.clock_offset_ms, Type::INT8),
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
        let completing = Completing {
            key: *key,
            token: *token,
            completion: completion.clone(),
            keep,
        };
        (self.completions().call(completing).await).unwrap_or_else(|| Err(batcher_gone()))
    }

    async fn release(&self, key: &RecordKey, token: &LeaseToken) -> Result<Fence, StoreError> {
        let core = &*self.core;
        let owner = OwnerParams::new(key, token);
        core.write(
            &core.sql.release,
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
        let core = &*self.core;
        let key = KeyParams::new(key);
        let rows = core
            .read(
                &core.sql.select,
                &[(&key.scope, Type::BYTEA), (&key.key, Type::BYTEA)],
            )
            .await?;
        rows.first().map(|row| decode_row(row, 0)).transpose()
    }

    async fn delete(&self, key: &RecordKey) -> Result<bool, StoreError> {
        let core = &*self.core;
        let key = KeyParams::new(key);
        core.write(
            &core.sql.delete,
            &[(&key.scope, Type::BYTEA), (&key.key, Type::BYTEA)],
        )
        .await
        .map(|n| n > 0)
    }

    async fn resolve(
        &self,
        key: &RecordKey,
        verdict: &Verdict,
        _now: UnixMillis,
    ) -> Result<bool, StoreError> {
        let core = &*self.core;
        let key = KeyParams::new(key);
        let scope: Param = (&key.scope, Type::BYTEA);
        let key: Param = (&key.key, Type::BYTEA);
        let changed = match verdict {
            Verdict::NotApplied => {
                let now: Param = (&core.clock_offset_ms, Type::INT8);
                core.write(&core.sql.resolve_not_applied, &[scope, key, now])
                    .await
            }
            Verdict::Applied { reason } => {
                let status = i32::from(RESOLVED_STATUS);
                core.write(
                    &core.sql.resolve_applied,
                    &[
                        scope,
                        key,
                        (&status, Type::INT4),
                        (&core.clock_offset_ms, Type::INT8),
                        (reason, Type::TEXT),
                    ],
                )
                .await
            }
        };
        changed.map(|n| n > 0)
    }

    async fn resolution(&self, key: &RecordKey) -> Result<Option<Resolution>, StoreError> {
        let core = &*self.core;
        let key = KeyParams::new(key);
        let rows = core
            .read(
                &core.sql.resolution,
                &[(&key.scope, Type::BYTEA), (&key.key, Type::BYTEA)],
            )
            .await?;
        let corrupt =
            |err: tokio_postgres::Error| StoreError::Corrupt(format!("postgres row: {err}"));
        rows.first()
            .map(|row| {
                Ok(Resolution {
                    at: row.try_get(0).map_err(corrupt)?,
                    reason: row.try_get(1).map_err(corrupt)?,
                })
            })
            .transpose()
    }

    async fn sweep(&self, _now: UnixMillis, batch: u32) -> Result<u64, StoreError> {
        let core = &*self.core;
        let deadline = core.deadline();
        let client = core.checkout(deadline).await?;
        let locked = core.migration_lock == MigrationLock::Advisory;
        let on: &ClientWrapper = &client;
        let batch = &i64::from(batch);
        let res = tokio::time::timeout_at(
            deadline,
            core.unit(on, locked, || async move {
                // One sweeper at a time across replicas; the others skip this
                // round instead of queueing behind it.
                if locked {
                    let got: bool = on
                        .query_typed(
                            "SELECT pg_try_advisory_xact_lock($1, hashtext($2))",
                            &[(&SWEEP_LOCK, Type::INT4), (&core.schema, Type::TEXT)],
                        )
                        .await?
                        .first()
                        .is_some_and(|row| row.get(0));
                    if !got {
                        return Ok(0);
                    }
                }
                core.execute(
                    on,
                    &core.sql.sweep,
                    &[(&core.clock_offset_ms, Type::INT8), (batch, Type::INT8)],
                )
                .await
            }),
        )
        .await;
        core.settle(client, res)
    }

    async fn scan_completed(
        &self,
        after: Option<RecordKey>,
        limit: u32,
        _now: UnixMillis,
    ) -> Result<Vec<(RecordKey, Record)>, StoreError> {
        let core = &*self.core;
        let (scope, key) = match &after {
            Some(after) => (&after.scope.0[..], &after.key[..]),
            None => (&[][..], &[][..]),
        };
        let limit = i64::from(limit);
        let rows = core
            .read(
                &core.sql.scan_completed,
                &[
                    (&scope, Type::BYTEA),
                    (&key, Type::BYTEA),
                    (&core.clock_offset_ms, Type::INT8),
                    (&limit, Type::INT8),
                ],
            )
            .await?;
        let corrupt =
            |err: tokio_postgres::Error| StoreError::Corrupt(format!("postgres row: {err}"));
        rows.iter()
            .map(|row| {
                let scope: Vec<u8> = row.try_get(0).map_err(corrupt)?;
                let key: Vec<u8> = row.try_get(1).map_err(corrupt)?;
                Ok((
                    super::codec::record_key_from(&scope, &key)?,
                    decode_row(row, 2)?,
                ))
            })
            .collect()
    }

    async fn rewrite_response(
        &self,
        key: &RecordKey,
        old: &StoredResponse,
        new: &StoredResponse,
    ) -> Result<bool, StoreError> {
        let core = &*self.core;
        let key = KeyParams::new(key);
        let (old_status, new_status) = (i32::from(old.status), i32::from(new.status));
        let old_headers = super::codec::encode_headers(&old.headers);
        let new_headers = super::codec::encode_headers(&new.headers);
        let (old_body, new_body) = (&old.body[..], &new.body[..]);
        core.write(
            &core.sql.rewrite_response,
            &[
                (&key.scope, Type::BYTEA),
                (&key.key, Type::BYTEA),
                (&old_status, Type::INT4),
                (&old_headers, Type::BYTEA),
                (&old_body, Type::BYTEA),
                (&new_status, Type::INT4),
                (&new_headers, Type::BYTEA),
                (&new_body, Type::BYTEA),
            ],
        )
        .await
        .map(|n| n == 1)
    }

    async fn ping(&self) -> Result<(), StoreError> {
        let core = &*self.core;
        let deadline = core.deadline();
        let client = core.checkout(deadline).await?;
        let res = tokio::time::timeout_at(deadline, client.simple_query("SELECT 1")).await;
        core.settle(client, res)?;
        // Healthy only while claims would be taken.
        core.require_sync().await
    }

    fn backend(&self) -> &'static str {
        "postgres"
    }

    fn call_bound(&self) -> Duration {
        self.core.timeout + CALL_BOUND_MARGIN
    }
}
