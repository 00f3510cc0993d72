//! Building the configured store: Memory | SQLite | PostgreSQL, with the
//! Redis fast path in front of PostgreSQL when `[redis]` is set, all behind
//! [`Instrumented`]. The one place a [`Config`] becomes a [`Store`].

use super::instrumented::Instrumented;
use super::memory::MemoryStore;
use super::postgres::PostgresStore;
use super::redis::RedisFastPath;
use super::sealed::Sealed;
use super::sqlite::SqliteStore;
use super::{Store, StoreError};
use crate::clock::Clock;
use crate::config::{Backend, Config};
use crate::metrics::Metrics;
use std::sync::Arc;

/// Opens the backend the config names, with the Redis fast path in front
/// of PostgreSQL when `[redis]` is set, behind [`Instrumented`]: every call
/// is bounded by the backend's [`Store::call_bound`] and timed into
/// `metrics` (which also gets the fast path's counters).
/// Neither PostgreSQL nor Redis has to be up yet: both connect lazily and
/// recover by themselves.
pub async fn open_with_metrics(
    cfg: &Config,
    metrics: &Arc<Metrics>,
    clock: Clock,
) -> Result<Arc<dyn Store>, StoreError> {
    let mut backend = open_backend(cfg, metrics, clock).await?;
    if let Some(ring) = &cfg.store_keys {
        // Outside the Redis fast path: its copies are sealed too.
        backend = Arc::new(Sealed::new(
            backend,
            ring.clone(),
            metrics.clone(),
            cfg.restart.store.plaintext_responses,
        ));
    }
    Ok(Arc::new(Instrumented::new(backend, metrics.clone())))
}

/// [`open_with_metrics`] for callers that do not export metrics.
pub async fn open(cfg: &Config) -> Result<Arc<dyn Store>, StoreError> {
    open_with_metrics(cfg, &Arc::new(Metrics::new()), Clock::system()).await
}

/// Applies the PostgreSQL migrations (`idemgate migrate`); returns how many ran.
pub async fn migrate(cfg: &Config) -> Result<u32, StoreError> {
    PostgresStore::connect(&cfg.restart.store)
        .await?
        .migrate()
        .await
}

/// `check-config --connect`: connects to the configured store and runs one
/// trivial call; returns one line per store reached, or the first failure
/// with its cause. PostgreSQL: no migration; whether the connection is TLS
/// or plaintext, and the server's `synchronous_commit` and what idemgate's
/// sessions run with. SQLite: the file is opened as `serve` would (created
/// when missing).
pub async fn check_connect(cfg: &Config) -> Result<Vec<String>, String> {
    // The cause, without "store unavailable".
    let unavailable = |err: StoreError| match err {
        StoreError::Unavailable(cause) => cause.to_string(),
        StoreError::Postgres(failure) => failure.to_string(),
        other => other.to_string(),
    };
    match cfg.restart.store.backend {
        Backend::Memory => Ok(vec!["memory: nothing to connect to".into()]),
        Backend::Sqlite => {
            let path = cfg.restart.store.path.clone();
            let sync = cfg.restart.store.synchronous;
            let shown = path.display().to_string();
            let sqlite = tokio::task::spawn_blocking(move || SqliteStore::open(&path, sync))
                .await
                .map_err(|err| err.to_string())?
                .map_err(|err| format!("sqlite {shown}: {}", unavailable(err)))?;
            let mut reached = vec![format!("sqlite {shown}: ok")];
            reached.extend(census_line(cfg, &sqlite).await);
            Ok(reached)
        }
        Backend::Postgres => {
            let pg = PostgresStore::connect(&cfg.restart.store)
                .await
                .map_err(unavailable)?;
            let target = pg.describe_target();
            let probe = pg.probe().await.map_err(|err| match err {
                // The target names the endpoint already.
                StoreError::Postgres(f) if f.endpoint.is_some() => format!("{target}: {}", f.cause),
                other => format!("{target}: {}", unavailable(other)),
            })?;
            let commit = probe.commit.describe()?;
            let mut reached = vec![
                format!("{target}: ok, {}", probe.transport),
                format!("postgres {commit}"),
                format!("postgres {}", probe.replication.describe()),
            ];
            if cfg.restart.store.require_synchronous_replication {
                if let Err(why) = probe.replication.synchronous() {
                    return Err(format!(
                        "{target}: store.require_synchronous_replication = true, and protected requests would get 503: {why}"
                    ));
                }
            }
            // Redis is a hint (serve runs on PostgreSQL alone without it),
            // but an operator testing connections wants its cause too.
            if let Some(redis) = &cfg.restart.redis {
                let line = crate::store::redis::check_connection(redis)
                    .await
                    .map_err(|cause| {
                        format!("redis fast path (serve would run on PostgreSQL alone): {cause}")
                    })?;
                reached.push(line);
            }
            // The authority holds every record (Redis only copies of some).
            reached.extend(census_line(cfg, &pg).await);
            Ok(reached)
        }
    }
}

/// How many rows, and how long, `check-config --connect` reads to count
/// sealed records: enough for a small store, a sample of a large one.
const CENSUS_ROWS: u64 = 100_000;
const CENSUS_TIME: std::time::Duration = std::time::Duration::from_secs(5);

/// With encryption keys set: the live stored responses under each key id,
/// and under ids not configured (unreadable: 410), so an operator knows
/// whether `keys reencrypt` has finished before a key is removed. A scan
/// that fails (e.g. no table yet: `--connect` never migrates) says so.
async fn census_line(cfg: &Config, store: &dyn Store) -> Option<String> {
    let ring = cfg.store_keys.as_deref()?;
    let now = Clock::system().now_millis();
    let census = match super::rotate::census(store, now, CENSUS_ROWS, CENSUS_TIME).await {
        Ok(census) => census,
        Err(err) => return Some(format!("sealed records: not counted: {err}")),
    };
    Some(describe_census(ring, &census))
}

/// The census as one line.
fn describe_census(ring: &crate::idempotency::vault::KeyRing, c: &super::rotate::Census) -> String {
    let (configured, unknown): (Vec<_>, Vec<_>) =
        c.by_key.iter().partition(|(id, _)| ring.knows(id));
    let list = |ids: &[(&String, &u64)]| {
        ids.iter()
            .map(|(id, n)| {
                let current = if id.as_str() == ring.current_id() {
                    " (current)"
                } else {
                    ""
                };
                format!("{id}{current} {n}")
            })
            .collect::<Vec<_>>()
            .join(", ")
    };
    let under_unknown: u64 = unknown.iter().map(|(_, n)| **n).sum();
    let scope = if c.complete {
        format!("all {} live stored responses", c.scanned)
    } else {
        format!(
            "the first {} live stored responses (stopped early at {CENSUS_ROWS} rows or {}s; there are more)",
            c.scanned,
            CENSUS_TIME.as_secs()
        )
    };
    format!(
        "sealed records in {scope}: by configured key id: {}; under key ids not configured (410): {under_unknown}{}; not sealed: {}",
        if configured.is_empty() { "none".to_string() } else { list(&configured) },
        if unknown.is_empty() { String::new() } else { format!(" ({})", list(&unknown)) },
        c.plaintext
    )
}

/// The backend alone, not yet instrumented.
async fn open_backend(
    cfg: &Config,
    metrics: &Metrics,
    clock: Clock,
) -> Result<Arc<dyn Store>, StoreError> {
    let store: Arc<dyn Store> = match cfg.restart.store.backend {
        Backend::Memory => Arc::new(MemoryStore::new().with_timeout(cfg.restart.store.timeout)),
        Backend::Sqlite => {
            let path = cfg.restart.store.path.clone();
            let sync = cfg.restart.store.synchronous;
            let sqlite = tokio::task::spawn_blocking(move || SqliteStore::open(&path, sync))
                .await
                .map_err(super::sqlite::worker_failed)??;
            Arc::new(sqlite.with_timeout(cfg.restart.store.timeout))
        }
        Backend::Postgres => {
            let pg = PostgresStore::connect(&cfg.restart.store).await?;
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
            match &cfg.restart.redis {
                None => pg,
                Some(redis_cfg) => {
                    let fast = RedisFastPath::new(pg, redis_cfg).await?.with_clock(clock);
                    metrics.attach_fast_path(fast.counters());
                    Arc::new(fast)
                }
            }
        }
    };
    Ok(store)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    async fn bound_of(store_section: &str, extra: &str) -> Duration {
        let text = format!(
            "[server]\nupstream = \"http://127.0.0.1:9\"\n\n[store]\ntimeout = \"300ms\"\n{store_section}\n{extra}"
        );
        let config = Config::parse(&text, "test.toml").expect("test config parses");
        open(&config).await.expect("opens").call_bound()
    }

    #[test]
    fn the_census_names_each_key_id_and_what_no_key_opens() {
        let ring = crate::idempotency::vault::test_ring(&[("new", 2), ("old", 1)]);
        let census = |by: &[(&str, u64)], plaintext, complete| super::super::rotate::Census {
            by_key: by.iter().map(|(id, n)| (id.to_string(), *n)).collect(),
            plaintext,
            complete,
            scanned: by.iter().map(|(_, n)| n).sum::<u64>() + plaintext,
        };
        let cases = [
            (
                census(&[("new", 3), ("old", 2), ("gone", 1)], 4, true),
                "sealed records in all 10 live stored responses: by configured key id: new (current) 3, old 2; \
                 under key ids not configured (410): 1 (gone 1); not sealed: 4",
            ),
            (
                census(&[], 0, true),
                "sealed records in all 0 live stored responses: by configured key id: none; \
                 under key ids not configured (410): 0; not sealed: 0",
            ),
            (
                census(&[("new", 5)], 0, false),
                "sealed records in the first 5 live stored responses (stopped early at 100000 rows or 5s; \
                 there are more): by configured key id: new (current) 5; \
                 under key ids not configured (410): 0; not sealed: 0",
            ),
        ];
        for (c, want) in cases {
            assert_eq!(describe_census(&ring, &c), want);
        }
    }

    /// The bounds the proxy applied before the backends reported their own:
    /// PostgreSQL enforces `store.timeout` itself and gets a 250 ms margin;
    /// Redis in front adds two of its round trips.
    #[tokio::test]
    async fn each_backend_reports_its_call_bound() {
        let dir = tempfile::tempdir().unwrap();
        let ms = Duration::from_millis;
        assert_eq!(bound_of("backend = \"memory\"", "").await, ms(300));
        let sqlite = format!(
            "backend = \"sqlite\"\npath = {:?}",
            dir.path().join("bound.db").display().to_string()
        );
        assert_eq!(bound_of(&sqlite, "").await, ms(300));
        // Nothing listens on port 1: both connect lazily, so opening works.
        let postgres = "backend = \"postgres\"\nurl = \"postgres://idemgate@127.0.0.1:1/idemgate\"";
        assert_eq!(bound_of(postgres, "").await, ms(550));
        let redis = "[redis]\nurl = \"redis://127.0.0.1:1\"\ntimeout = \"100ms\"";
        // Two Redis calls can surround the claim, and one to spare (the
        // proxy's old bound allowed two while a claim could make three, so
        // a slow Redis could cut a claim off mid-statement).
        assert_eq!(bound_of(postgres, redis).await, ms(850));
    }
}
