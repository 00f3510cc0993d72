//! idemgate: an idempotency reverse proxy. It sits in front of an unmodified
//! HTTP API and makes the configured routes safe to retry: a repeated
//! request with the same `Idempotency-Key` gets the stored response instead
//! of a second execution.
//!
//! # Layout
//! - [`config`]: the TOML file, parsed strictly into typed settings.
//! - [`route`]: path patterns and the protected-route table.
//! - [`idempotency`]: the protocol as pure functions: key parsing, scope,
//!   fingerprint, and the decision from a stored record.
//! - [`store`]: the storage trait and its backends (memory, SQLite, ...).
//! - [`proxy`]: the request path: protected requests, forwarding, headers.
//! - [`problem`]: RFC 9457 responses, the one error-to-response mapping.
//! - [`server`]: listeners, connection limits, sweeper, graceful shutdown.
//! - [`admin`], [`metrics`], [`telemetry`]: health, Prometheus, logs.
//! - [`keys`]: the `keys` commands that inspect and repair records.
//! - [`demo`]: a small orders API to try idemgate against.

pub mod admin;
pub mod body;
pub mod cli;
pub mod clock;
pub mod config;
pub mod demo;
pub mod error;
pub mod idempotency;
pub mod keys;
pub mod lease;
pub mod metrics;
pub mod problem;
pub mod proxy;
pub mod route;
pub mod server;
pub mod shutdown;
pub mod store;
pub mod telemetry;

use anyhow::Context;
use config::Config;
use std::sync::Arc;

/// `idemgate serve`: opens the store, binds, runs until SIGTERM/SIGINT.
pub async fn run(config: Config) -> anyhow::Result<()> {
    let metrics = Arc::new(metrics::Metrics::new());
    let store = store::open_with_metrics(&config, &metrics)
        .await
        .context("cannot open the store")?;
    let listeners = server::Listeners::bind(&config).await?;
    server::serve(config, store, metrics, listeners, shutdown::signal()).await
}

/// `idemgate demo`: the demo orders API on an ephemeral port, the proxy in
/// front of it on `listen`, SQLite at `db`.
pub async fn run_demo(listen: std::net::SocketAddr, db: std::path::PathBuf) -> anyhow::Result<()> {
    // The demo API keeps its orders in memory, so the demo's keys start
    // fresh too: an old run's keys would replay orders the API forgot.
    // Only a file named as a demo store is ever reset.
    let is_demo_file = db
        .file_name()
        .and_then(|n| n.to_str())
        .is_some_and(|n| n.contains("demo"));
    if !is_demo_file {
        anyhow::bail!(
            "demo resets its store at start; give --db a file whose name contains \"demo\" (not {})",
            db.display()
        );
    }
    for suffix in ["", "-wal", "-shm"] {
        let mut f = db.clone().into_os_string();
        f.push(suffix);
        match std::fs::remove_file(&f) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => anyhow::bail!("cannot reset the demo store {}: {e}", db.display()),
        }
    }
    let api = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let api_addr = api.local_addr()?;
    tokio::spawn(demo::serve_orders_api(api));
    let text = demo::demo_config(listen, api_addr, &db);
    let config = Config::parse(&text, "<demo>")?;
    let metrics = Arc::new(metrics::Metrics::new());
    let store = store::open_with_metrics(&config, &metrics)
        .await
        .context("cannot open the store")?;
    let listeners = server::Listeners::bind(&config).await?;
    println!("{}", demo::walkthrough(listeners.proxy.local_addr()?));
    server::serve(config, store, metrics, listeners, shutdown::signal()).await
}

/// `idemgate demo-upstream`: only the demo orders API.
pub async fn run_demo_upstream(listen: std::net::SocketAddr) -> anyhow::Result<()> {
    let api = tokio::net::TcpListener::bind(listen)
        .await
        .with_context(|| format!("cannot listen on {listen}"))?;
    tracing::info!(addr = %listen, "demo orders API listening");
    tokio::select! {
        _ = demo::serve_orders_api(api) => {}
        _ = shutdown::signal() => {}
    }
    Ok(())
}

/// What `idemgate keys` was asked to do.
pub enum KeysAction {
    Show(idempotency::RecordKey),
    Delete(idempotency::RecordKey),
    PurgeExpired,
}

/// `idemgate keys ...` against the configured store.
pub async fn run_keys(config: Config, action: KeysAction) -> anyhow::Result<()> {
    if config.store.backend == config::Backend::Memory {
        anyhow::bail!(
            "the memory store lives inside the proxy process; nothing outside it can inspect its keys"
        );
    }
    let store = store::open(&config)
        .await
        .context("cannot open the store")?;
    match action {
        KeysAction::Show(key) => {
            print!(
                "{}",
                keys::show(store.as_ref(), &key, &clock::Clock::system()).await?
            );
        }
        KeysAction::Delete(key) => {
            if store.delete(&key).await? {
                println!("deleted key id {}", key.log_id());
            } else {
                println!("no record for key id {}", key.log_id());
            }
        }
        KeysAction::PurgeExpired => {
            let n = keys::purge_expired(
                store.as_ref(),
                config.store.sweep_batch,
                &clock::Clock::system(),
            )
            .await?;
            println!("deleted {n} expired records");
        }
    }
    Ok(())
}

/// `idemgate migrate`: applies the PostgreSQL migrations.
pub async fn run_migrate(config: Config) -> anyhow::Result<()> {
    if config.store.backend != config::Backend::Postgres {
        println!(
            "store.backend = \"{}\": its schema is created when it is opened; nothing to migrate",
            config.store.backend.as_str()
        );
        return Ok(());
    }
    let applied = store::migrate(&config).await?;
    println!(
        "schema {:?} is current ({applied} migration(s) applied now)",
        config.store.schema
    );
    Ok(())
}
