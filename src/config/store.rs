//! `[store]` and `[redis]`: where records are kept, and the Redis fast path
//! in front of PostgreSQL.

use super::raw::{RawRedis, RawStore};
use super::units::format_duration;
use super::{at_least_one, dur, env, mask_url, nonzero, Invalid};
use super::{
    DEFAULT_PG_CONNECT_TIMEOUT, DEFAULT_PG_POOL_SIZE, DEFAULT_PG_SCHEMA,
    DEFAULT_PG_STATEMENT_TIMEOUT, DEFAULT_REDIS_PREFIX, DEFAULT_REDIS_TIMEOUT, DEFAULT_SQLITE_PATH,
    DEFAULT_STORE_TIMEOUT, DEFAULT_SWEEP_BATCH, DEFAULT_SWEEP_INTERVAL,
};
use serde::Deserialize;
use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    Sqlite,
    Memory,
    Postgres,
}

impl Backend {
    pub fn as_str(self) -> &'static str {
        match self {
            Backend::Sqlite => "sqlite",
            Backend::Memory => "memory",
            Backend::Postgres => "postgres",
        }
    }
}

/// SQLite's `synchronous` pragma. `full` fsyncs every commit so a claim
/// survives power loss; `normal` survives process crashes only.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SqliteSync {
    Full,
    Normal,
}

/// How PostgreSQL migrations (and sweeps) keep replicas from colliding.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MigrationLock {
    /// One transaction under `pg_advisory_xact_lock` (PostgreSQL, and
    /// PgBouncer in transaction mode); sweeps take a try-lock so one
    /// replica sweeps at a time.
    Advisory,
    /// No advisory locks and no transaction around the DDL, for engines
    /// that lack them (CockroachDB, YugabyteDB): run `idemgate migrate`
    /// once before starting replicas; concurrent sweeps skip each other's
    /// rows (`SKIP LOCKED`).
    None,
}

impl MigrationLock {
    pub fn as_str(self) -> &'static str {
        match self {
            MigrationLock::Advisory => "advisory",
            MigrationLock::None => "none",
        }
    }
}

/// `Debug` masks the URL's password (see [`mask_url`]).
#[derive(Clone)]
pub struct StoreConfig {
    pub backend: Backend,
    pub path: PathBuf,
    pub synchronous: SqliteSync,
    pub url: Option<String>,
    /// PostgreSQL schema holding idemgate's tables (created if missing).
    pub schema: String,
    pub pool_size: usize,
    pub connect_timeout: Duration,
    pub statement_timeout: Duration,
    /// PostgreSQL only: see [`MigrationLock`].
    pub migration_lock: MigrationLock,
    pub timeout: Duration,
    pub sweep_interval: Duration,
    pub sweep_batch: u32,
}

/// `Debug` masks the URL's password (see [`mask_url`]).
#[derive(Clone)]
pub struct RedisConfig {
    pub url: String,
    pub timeout: Duration,
    pub prefix: String,
}

// === impl StoreConfig ===

impl TryFrom<RawStore> for StoreConfig {
    type Error = Invalid;

    fn try_from(s: RawStore) -> Result<Self, Invalid> {
        let backend = s.backend.unwrap_or(Backend::Sqlite);
        let url = match backend {
            Backend::Postgres => {
                let u = s.url.map(|u| u.into_inner()).ok_or_else(|| {
                    Invalid::field(
                        "store.url",
                        "store.url is required for backend = \"postgres\" (or set IDEMGATE_STORE_URL)",
                    )
                })?;
                if !(u.starts_with("postgres://") || u.starts_with("postgresql://")) {
                    return Err(Invalid::field(
                        "store.url",
                        format!(
                            "store.url: expected a postgres://user@host:port/db URL, got {}",
                            mask_url(&u)
                        ),
                    ));
                }
                // libpq's TLS parameters and pgbouncer=true: checked here so
                // check-config names a bad one; files are read at start.
                crate::store::pg_connect::PgUrl::parse(&u)
                    .and_then(|url| url.pg_config().map(|_| ()))
                    .map_err(|e| format!("store.url: {e}"))?;
                Some(u)
            }
            Backend::Sqlite | Backend::Memory => {
                // Written in the file, a URL for another backend is a
                // mistake; from the environment alone (often set alike for
                // every deployment) it is ignored.
                if let Some(u) = s.url.filter(|u| u.span() != env::NOT_IN_FILE) {
                    return Err(Invalid::at(
                        u.span(),
                        "store.url only applies to backend = \"postgres\"",
                    ));
                }
                None
            }
        };
        // Named at the first such key the file sets.
        let sqlite_only = [
            ("store.path", s.path.is_some()),
            ("store.synchronous", s.synchronous.is_some()),
        ];
        if let Some((key, _)) = sqlite_only
            .iter()
            .find(|(_, set)| *set && backend != Backend::Sqlite)
        {
            return Err(Invalid::field(
                *key,
                "store.path and store.synchronous only apply to backend = \"sqlite\"",
            ));
        }
        let postgres_only = [
            ("store.pool_size", s.pool_size.is_some()),
            ("store.schema", s.schema.is_some()),
            ("store.connect_timeout", s.connect_timeout.is_some()),
            ("store.statement_timeout", s.statement_timeout.is_some()),
            ("store.migration_lock", s.migration_lock.is_some()),
        ];
        if let Some((key, _)) = postgres_only
            .iter()
            .find(|(_, set)| *set && backend != Backend::Postgres)
        {
            return Err(Invalid::field(*key, "store.pool_size, store.schema, store.connect_timeout, store.statement_timeout and store.migration_lock only apply to backend = \"postgres\""));
        }
        let pool_size = at_least_one(
            "store.pool_size",
            s.pool_size.unwrap_or(DEFAULT_PG_POOL_SIZE),
        )?;
        let sweep_batch = at_least_one(
            "store.sweep_batch",
            s.sweep_batch.unwrap_or(DEFAULT_SWEEP_BATCH),
        )?;
        let timeout = nonzero("store.timeout", dur(s.timeout, DEFAULT_STORE_TIMEOUT))?;
        let sweep_interval = nonzero(
            "store.sweep_interval",
            dur(s.sweep_interval, DEFAULT_SWEEP_INTERVAL),
        )?;
        let schema = s.schema.unwrap_or_else(|| DEFAULT_PG_SCHEMA.to_string());
        if schema.is_empty()
            || !schema
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
            || schema.as_bytes()[0].is_ascii_digit()
        {
            return Err(Invalid::field(
                "store.schema",
                format!(
                    "store.schema {schema:?}: use lower-case letters, digits and '_', not starting with a digit"
                ),
            ));
        }
        Ok(StoreConfig {
            backend,
            schema,
            path: s.path.unwrap_or_else(|| PathBuf::from(DEFAULT_SQLITE_PATH)),
            synchronous: s.synchronous.unwrap_or(SqliteSync::Full),
            url,
            pool_size,
            connect_timeout: dur(s.connect_timeout, DEFAULT_PG_CONNECT_TIMEOUT),
            statement_timeout: dur(s.statement_timeout, DEFAULT_PG_STATEMENT_TIMEOUT),
            migration_lock: s.migration_lock.unwrap_or(MigrationLock::Advisory),
            timeout,
            sweep_interval,
            sweep_batch,
        })
    }
}

/// One line, password masked.
impl fmt::Display for StoreConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("store      ")?;
        match self.backend {
            Backend::Sqlite => writeln!(
                f,
                "sqlite {} (synchronous = {})",
                self.path.display(),
                match self.synchronous {
                    SqliteSync::Full => "full",
                    SqliteSync::Normal => "normal",
                }
            ),
            Backend::Memory => writeln!(f, "memory (not durable: records are lost on restart)"),
            Backend::Postgres => writeln!(
                f,
                "postgres {} (pool {})",
                mask_url(self.url.as_deref().unwrap_or_default()),
                self.pool_size
            ),
        }
    }
}

/// As derived, but the URL's password masked: a `{config:?}` in a log or a
/// panic message must not carry it.
impl fmt::Debug for StoreConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StoreConfig")
            .field("backend", &self.backend)
            .field("path", &self.path)
            .field("synchronous", &self.synchronous)
            .field("url", &self.url.as_deref().map(mask_url))
            .field("schema", &self.schema)
            .field("pool_size", &self.pool_size)
            .field("connect_timeout", &self.connect_timeout)
            .field("statement_timeout", &self.statement_timeout)
            .field("migration_lock", &self.migration_lock)
            .field("timeout", &self.timeout)
            .field("sweep_interval", &self.sweep_interval)
            .field("sweep_batch", &self.sweep_batch)
            .finish()
    }
}

// === impl RedisConfig ===

impl TryFrom<RawRedis> for RedisConfig {
    type Error = Invalid;

    fn try_from(r: RawRedis) -> Result<Self, Invalid> {
        let url = r.url.ok_or_else(|| {
            Invalid::field(
                "redis.url",
                "redis.url is required when [redis] is present (or set IDEMGATE_REDIS_URL)",
            )
        })?;
        if !(url.starts_with("redis://")
            || url.starts_with("rediss://")
            || url.starts_with("unix://"))
        {
            return Err(Invalid::field(
                "redis.url",
                format!(
                    "redis.url: expected redis://host:port, got {}",
                    mask_url(&url)
                ),
            ));
        }
        let prefix = r.prefix.unwrap_or_else(|| DEFAULT_REDIS_PREFIX.to_string());
        if prefix.is_empty() || prefix.contains(char::is_whitespace) {
            return Err(Invalid::field(
                "redis.prefix",
                "redis.prefix must be non-empty and contain no spaces",
            ));
        }
        Ok(RedisConfig {
            url,
            timeout: dur(r.timeout, DEFAULT_REDIS_TIMEOUT),
            prefix,
        })
    }
}

/// As derived, but the URL's password masked.
impl fmt::Debug for RedisConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisConfig")
            .field("url", &mask_url(&self.url))
            .field("timeout", &self.timeout)
            .field("prefix", &self.prefix)
            .finish()
    }
}

/// One line, password masked.
impl fmt::Display for RedisConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "redis      {} (prefix {:?}, timeout {})",
            mask_url(&self.url),
            self.prefix,
            format_duration(self.timeout)
        )
    }
}
