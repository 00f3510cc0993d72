//! Reloading the config without a restart: SIGHUP, or with
//! `server.watch_config = true` a change of the file.
//!
//! The file is read and validated exactly as `check-config` and `serve`
//! do; a bad one is refused with the same message, logged and counted
//! (`idemgate_config_reloads_total{result="error"}`), and the running
//! config keeps serving. A good one replaces the proxy's per-config part
//! (routes, per-route settings, the upstream client: [`Proxy::reconfigured`])
//! in one atomic swap: a request holds the proxy it started on to its end,
//! later ones get the new one.
//!
//! Settings bound at start (listeners, the store and Redis, connection and
//! memory limits, shutdown timings, readiness, logging) keep their running
//! values; [`restart_only_changes`] names those that differ, for the log.

use crate::config::{Config, RedisConfig, StoreConfig};
use crate::metrics::Metrics;
use crate::proxy::Proxy;
use arc_swap::ArcSwap;
use std::path::PathBuf;
use std::sync::Arc;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

/// Where reloads come from: the file to read, and a signal per request.
pub struct ReloadSource {
    pub path: PathBuf,
    pub requests: mpsc::Receiver<()>,
}

/// How often a watched config file is read for changes: a ConfigMap update
/// takes up to a minute to reach the pod anyway.
pub const WATCH_INTERVAL: std::time::Duration = std::time::Duration::from_secs(2);

/// Reload requests: each SIGHUP and, with `watch`, each change of the
/// file's content (read every [`WATCH_INTERVAL`]). Several pending ones
/// coalesce into one. Installed at once, so a SIGHUP that arrives while
/// the server starts is a reload rather than the default (terminating the
/// process).
pub fn requests(path: &std::path::Path, watch: bool) -> std::io::Result<mpsc::Receiver<()>> {
    let (tx, rx) = mpsc::channel(1);
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        let mut hup = signal(SignalKind::hangup())?;
        let tx = tx.clone();
        tokio::spawn(async move {
            while hup.recv().await.is_some() {
                info!("SIGHUP received, reloading the config");
                if tx.try_send(()).is_err() && tx.is_closed() {
                    return;
                }
            }
        });
    }
    if watch {
        tokio::spawn(watch_file(path.to_path_buf(), tx));
    }
    Ok(rx)
}

/// Asks for a reload whenever the file's content differs from the last
/// one seen (content, not mtime: a Kubernetes ConfigMap swaps a symlink,
/// and an editor may keep the mtime's second).
async fn watch_file(path: PathBuf, tx: mpsc::Sender<()>) {
    let mut seen = tokio::fs::read(&path).await.ok();
    let mut tick = tokio::time::interval(WATCH_INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    loop {
        tick.tick().await;
        let now = tokio::fs::read(&path).await.ok();
        if now.is_some() && now != seen {
            info!(file = %path.display(), "config file changed, reloading");
            seen = now;
            if tx.try_send(()).is_err() && tx.is_closed() {
                return;
            }
        }
    }
}

/// Serves reload requests until `stop`. `running` is the config the
/// process started with (what restart-only settings are compared to).
pub(super) async fn reload_loop(
    mut source: ReloadSource,
    running: Config,
    current: Arc<ArcSwap<Proxy>>,
    metrics: Arc<Metrics>,
    stop: CancellationToken,
) {
    loop {
        tokio::select! {
            r = source.requests.recv() => if r.is_none() { return },
            _ = stop.cancelled() => return,
        }
        reload(&source.path, &running, &current, &metrics);
    }
}

/// One reload: read, validate, swap (or refuse and keep the old config).
pub(super) fn reload(
    path: &std::path::Path,
    running: &Config,
    current: &ArcSwap<Proxy>,
    metrics: &Metrics,
) -> bool {
    let now = unix_secs();
    let config = match Config::load(path) {
        Ok(c) => c,
        Err(e) => {
            // The words check-config and serve use for the same file.
            error!("config reload refused, the running config stays: invalid configuration: {e}");
            metrics.config_loaded(false, now);
            return false;
        }
    };
    for w in config.warnings() {
        warn!("{w}");
    }
    let kept = restart_only_changes(running, &config);
    if !kept.is_empty() {
        warn!(
            settings = %kept.join(", "),
            "config reloaded, but these settings only change on a restart: they keep their running values"
        );
    }
    // Upstream clients read their TLS files here: a missing or bad one
    // refuses the reload like a bad config.
    let next = match current.load().reconfigured(&config) {
        Ok(next) => next,
        Err(e) => {
            error!("config reload refused, the running config stays: {e}");
            metrics.config_loaded(false, now);
            return false;
        }
    };
    metrics.register_routes(config.routes.iter().map(|r| &r.label));
    current.store(Arc::new(next));
    metrics.config_loaded(true, now);
    info!(
        file = %path.display(),
        upstream = %config.server.upstream,
        routes = config.routes.iter().count(),
        "config reloaded"
    );
    true
}

pub(super) fn unix_secs() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or_default()
}

/// The settings a reload cannot apply that differ between `old` and `new`,
/// by their config names.
pub fn restart_only_changes(old: &Config, new: &Config) -> Vec<&'static str> {
    let (o, n) = (&old.server, &new.server);
    let mut out = Vec::new();
    let mut check = |name: &'static str, differs: bool| {
        if differs {
            out.push(name);
        }
    };
    check("server.listen", o.listen != n.listen);
    check(
        "server.max_connections",
        o.max_connections != n.max_connections,
    );
    check(
        "server.header_read_timeout",
        o.header_read_timeout != n.header_read_timeout,
    );
    check("server.idle_timeout", o.idle_timeout != n.idle_timeout);
    check(
        "server.max_buffered_body_bytes",
        o.max_buffered_body_bytes != n.max_buffered_body_bytes,
    );
    check(
        "server.h2_max_concurrent_streams",
        o.h2_max_concurrent_streams != n.h2_max_concurrent_streams,
    );
    check(
        "server.shutdown_grace",
        o.shutdown_grace != n.shutdown_grace,
    );
    check(
        "server.shutdown_delay",
        o.shutdown_delay != n.shutdown_delay,
    );
    check("server.readiness", o.readiness != n.readiness);
    check("server.watch_config", o.watch_config != n.watch_config);
    check(
        "admin.listen",
        old.admin.as_ref().map(|a| a.listen) != new.admin.as_ref().map(|a| a.listen),
    );
    check("store", store_key(&old.store) != store_key(&new.store));
    check(
        "redis",
        old.redis.as_ref().map(redis_key) != new.redis.as_ref().map(redis_key),
    );
    check(
        "log",
        (old.log.format, &old.log.level) != (new.log.format, &new.log.level),
    );
    check("tracing", old.tracing != new.tracing);
    out
}

/// Every `[store]` setting, for comparison (the URL unmasked: a new
/// password is a change too; never printed).
fn store_key(s: &StoreConfig) -> impl PartialEq + '_ {
    (
        (s.backend, &s.path, s.synchronous, &s.url, &s.schema),
        (s.pool_size, s.connect_timeout, s.statement_timeout),
        (s.timeout, s.sweep_interval, s.sweep_batch, s.migration_lock),
    )
}

fn redis_key(r: &RedisConfig) -> impl PartialEq + '_ {
    (
        (&r.url, r.timeout, &r.prefix, r.cluster),
        (&r.ca_file, &r.cert_file, &r.key_file),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(extra: &str) -> Config {
        let text = format!(
            "[server]\nupstream = \"http://127.0.0.1:3000\"\n{extra}\n[[route]]\nmethods = [\"POST\"]\npath = \"/o\"\n"
        );
        Config::parse(&text, "t.toml").unwrap()
    }

    /// Routes, the upstream and per-request settings reload; listeners,
    /// the store and limits bound at start are named as kept.
    #[test]
    fn names_the_settings_only_a_restart_changes() {
        let base = config("");
        let cases: &[(&str, &[&str])] = &[
            ("", &[]),
            ("upstream_timeout = \"5s\"\npreserve_host = true", &[]),
            ("request_body_timeout = \"1s\"", &[]),
            ("listen = \"127.0.0.1:9999\"", &["server.listen"]),
            (
                "max_connections = 5\nreadiness = \"store\"",
                &["server.max_connections", "server.readiness"],
            ),
            ("[store]\nbackend = \"memory\"", &["store"]),
            ("[admin]\nlisten = \"127.0.0.1:9901\"", &["admin.listen"]),
            ("[log]\nlevel = \"debug\"", &["log"]),
        ];
        for (extra, want) in cases {
            assert_eq!(
                restart_only_changes(&base, &config(extra)),
                *want,
                "{extra}"
            );
        }
    }

    /// Regression: `store.migration_lock` and the Redis TLS and cluster
    /// settings were accepted on reload and silently kept.
    #[test]
    fn names_the_postgres_and_redis_settings_only_a_restart_changes() {
        let pg = "[store]\nbackend = \"postgres\"\nurl = \"postgres://u@h/db\"\n";
        let redis = "[redis]\nurl = \"rediss://r:6379\"\n";
        let base = config(&format!("{pg}{redis}"));
        for (store_extra, redis_extra, want) in [
            ("migration_lock = \"none\"\n", "", "store"),
            ("", "cluster = true\n", "redis"),
            ("", "ca_file = \"/etc/ca.pem\"\n", "redis"),
        ] {
            let changed = config(&format!("{pg}{store_extra}{redis}{redis_extra}"));
            assert_eq!(
                restart_only_changes(&base, &changed),
                [want],
                "{store_extra}{redis_extra}"
            );
        }
    }
}
