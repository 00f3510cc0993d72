//! Building the configured store: Memory | SQLite | PostgreSQL, with the
//! Redis fast path in front of PostgreSQL when `[redis]` is set. The one
//! place a [`Config`] becomes a [`Store`].

use super::memory::MemoryStore;
use super::postgres::PostgresStore;
use super::redis::RedisFastPath;
use super::sqlite::SqliteStore;
use super::{Store, StoreError};
use crate::config::{Backend, Config};
use crate::metrics::Metrics;
use std::sync::Arc;

/// Opens the backend the config names, with the Redis fast path in front
/// of PostgreSQL when `[redis]` is set (its counters go to `metrics`).
/// Neither PostgreSQL nor Redis has to be up yet: both connect lazily and
/// recover by themselves.
pub async fn open_with_metrics(
    cfg: &Config,
    metrics: &Metrics,
) -> Result<Arc<dyn Store>, StoreError> {
    let store: Arc<dyn Store> = match cfg.store.backend {
        Backend::Memory => Arc::new(MemoryStore::new()),
        Backend::Sqlite => {
            let path = cfg.store.path.clone();
            let sync = cfg.store.synchronous;
            Arc::new(
                tokio::task::spawn_blocking(move || SqliteStore::open(&path, sync))
                    .await
                    .map_err(|err| StoreError::Unavailable(err.to_string()))??,
            )
        }
        Backend::Postgres => {
            let pg = PostgresStore::connect(&cfg.store).await?;
            // Migrate now when the database answers; otherwise the first
            // store call does it, so a proxy started before its database
            // heals by itself.
            match pg.migrate().await {
                Ok(0) => {}
                Ok(n) => tracing::info!(applied = n, schema = pg.schema(), "applied migrations"),
                Err(err) => {
                    tracing::warn!(error = %err, "postgres not ready at start-up; will retry on first use")
                }
            }
            let pg: Arc<dyn Store> = Arc::new(pg);
            match &cfg.redis {
                None => pg,
                Some(redis_cfg) => {
                    let fast = RedisFastPath::new(pg, redis_cfg).await?;
                    metrics.attach_fast_path(fast.counters());
                    Arc::new(fast)
                }
            }
        }
    };
    Ok(store)
}

/// [`open_with_metrics`] for callers that do not export metrics.
pub async fn open(cfg: &Config) -> Result<Arc<dyn Store>, StoreError> {
    open_with_metrics(cfg, &Metrics::new()).await
}

/// Applies the PostgreSQL migrations (`idemgate migrate`); returns how many ran.
pub async fn migrate(cfg: &Config) -> Result<u32, StoreError> {
    PostgresStore::connect(&cfg.store).await?.migrate().await
}
