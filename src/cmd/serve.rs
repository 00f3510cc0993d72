//! `idemgate serve`: the proxy, until SIGTERM or SIGINT.

use crate::config::Config;
use crate::metrics::Metrics;
use crate::server;
use std::sync::Arc;

/// `idemgate serve`: binds, opens the store, runs until SIGTERM/SIGINT;
/// SIGHUP (or a change, with `server.watch_config`) reloads `path`.
pub async fn run(config: Config, path: std::path::PathBuf) -> anyhow::Result<()> {
    // Before any socket or file is opened: they count against it.
    let limit = match server::fd_limit::reconcile(&config) {
        Ok(plan) => {
            if plan.lowered() {
                tracing::warn!("{plan}");
            } else {
                tracing::info!("{plan}");
            }
            Some(plan.effective)
        }
        Err(e) => {
            tracing::warn!(error = %e, "cannot read or raise the file-descriptor limit (RLIMIT_NOFILE); max_connections is not checked against it");
            None
        }
    };
    // First, so an early SIGHUP reloads instead of killing the process.
    let hangups = server::reload::requests(&path, config.restart.server.watch_config)?;
    let listeners = server::Listeners::bind(&config).await?;
    let metrics = Arc::new(Metrics::new());
    let mut server = server::Server::open(config, metrics, listeners).await?;
    if let Some(limit) = limit {
        server = server.limit_connections(limit);
    }
    server
        .reload_on(hangups)
        .run(crate::shutdown::signal())
        .await
}
