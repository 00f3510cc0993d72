//! Reloading the config without a restart: SIGHUP, or with
//! `server.watch_config = true` a complete change of the file ([`judge`]
//! says which reads are complete; the watcher passes those bytes on).
//!
//! The file is read and validated exactly as `check-config` and `serve`
//! do, then checked again as it will run ([`as_reloaded`]: restart-only
//! settings at their running values); a bad one is refused with the same
//! message, logged and counted
//! (`idemgate_config_reloads_total{result="error"}`), and the running
//! config keeps serving. A good one replaces the proxy's per-config part
//! (routes, per-route settings, the upstream client: [`Proxy::reconfigured`])
//! in one atomic swap: a request holds the proxy it started on to its end,
//! later ones get the new one.
//!
//! Settings bound at start (listeners, the store and Redis, connection and
//! memory limits, shutdown timings, readiness, logging: [`Restart`]) keep
//! their running values; [`Restart::changes`] names those that differ.
//!
//! A reload also re-reads the listeners' certificate files
//! ([`TlsListener::refresh`]).
//!
//! [`Restart`]: crate::config::Restart
//! [`Restart::changes`]: crate::config::Restart::changes

use crate::config::Config;
use crate::metrics::Metrics;
use crate::net::tls_server::TlsListener;
use crate::proxy::Proxy;
use arc_swap::ArcSwap;
use std::path::PathBuf;
use std::sync::Arc;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, warn};

/// Where reloads come from: the file to read, and a request per reload.
pub struct ReloadSource {
    pub path: PathBuf,
    pub requests: mpsc::Receiver<ReloadRequest>,
    /// More requests into `requests`: the admin listener's `POST /-/reload`.
    pub trigger: mpsc::Sender<ReloadRequest>,
}

/// One reload request.
#[derive(Debug, PartialEq, Eq)]
pub enum ReloadRequest {
    /// SIGHUP: the file as it is when the reload reads it.
    Signal,
    /// The watcher: exactly these bytes, which it judged complete
    /// ([`judge`]); the file is not read again, it may be mid-write by now.
    Content(Vec<u8>),
    /// `POST /-/reload` (or `idemgate reload`): the file as it is, and the
    /// outcome told back (the refusal's message).
    Asked(Reply),
}

/// `POST /-/reload`: an [`ReloadRequest::Asked`] into the reloader's
/// queue, answered when it has run.
pub struct Trigger(pub mpsc::Sender<ReloadRequest>);

#[async_trait::async_trait]
impl crate::admin::Reload for Trigger {
    async fn reload(&self) -> Result<(), String> {
        let stopped = || "the reloader has stopped (shutting down)".to_string();
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.0
            .send(ReloadRequest::Asked(Reply(tx)))
            .await
            .map_err(|_| stopped())?;
        rx.await.map_err(|_| stopped())?
    }
}

/// Where an asked-for reload's outcome goes.
#[derive(Debug)]
pub struct Reply(pub tokio::sync::oneshot::Sender<Result<(), String>>);

/// Two replies are never the same request.
impl PartialEq for Reply {
    fn eq(&self, _: &Self) -> bool {
        false
    }
}
impl Eq for Reply {}

/// How often a watched config file is read for changes: a ConfigMap update
/// takes up to a minute to reach the pod anyway.
pub const WATCH_INTERVAL: std::time::Duration = std::time::Duration::from_secs(2);

/// Reload requests: each SIGHUP and, with `watch`, each complete change of
/// the file (read every [`WATCH_INTERVAL`], judged by [`judge`]). Pending
/// ones coalesce: one waits at most. Installed at once, so a SIGHUP that
/// arrives while the server starts is a reload rather than the default
/// (terminating the process).
pub fn requests(path: &std::path::Path, watch: bool) -> std::io::Result<ReloadSource> {
    let (tx, rx) = mpsc::channel(1);
    let trigger = tx.clone();
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        let mut hup = signal(SignalKind::hangup())?;
        let tx = tx.clone();
        tokio::spawn(async move {
            while hup.recv().await.is_some() {
                info!("SIGHUP received, reloading the config");
                if tx.try_send(ReloadRequest::Signal).is_err() && tx.is_closed() {
                    return;
                }
            }
        });
    }
    if watch {
        let path = path.to_path_buf();
        tokio::spawn(watch_file(move || read_snapshot(path.clone()), tx));
    }
    Ok(ReloadSource {
        path: path.to_path_buf(),
        requests: rx,
        trigger,
    })
}

/// One read of the watched file: its bytes and which file they came from.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Snapshot {
    /// Device and inode of the file read (through any symlinks); `None`
    /// where the platform has none.
    pub identity: Option<(u64, u64)>,
    pub content: Vec<u8>,
}

/// What the watcher does with a read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// The content applied last: nothing to do.
    Unchanged,
    /// Changed in place and not yet seen the same a read earlier: it may
    /// be mid-write (a valid prefix, such as the file cut after a complete
    /// route, would parse). Read again next interval.
    Wait,
    /// Apply it: it stayed the same across a whole interval, or it is
    /// another file (an atomic rename, `mv tmp idemgate.toml`, or a
    /// Kubernetes ConfigMap's symlink swap), written whole before it took
    /// the name.
    Apply,
}

/// Judges a read of the watched file, `now`, given the content last
/// applied (or read at start) and the read before this one when it was a
/// change still waiting (`pending`). Content, not mtime, says whether it
/// changed (an editor may keep the mtime's second); the file's identity
/// says whether it was replaced whole.
pub fn judge(applied: &Snapshot, pending: Option<&Snapshot>, now: &Snapshot) -> Verdict {
    if now.content == applied.content {
        return Verdict::Unchanged;
    }
    // Known on both sides: a file whose first read failed proves nothing.
    let replaced =
        now.identity.is_some() && applied.identity.is_some() && now.identity != applied.identity;
    let stable = pending.is_some_and(|p| p.content == now.content);
    if replaced || stable {
        Verdict::Apply
    } else {
        Verdict::Wait
    }
}

/// Reads the file and the identity of what was read from one open handle,
/// so both are of the same file even across a rename; `None` when it
/// cannot be read (a ConfigMap swap in progress: try next time).
async fn read_snapshot(path: PathBuf) -> Option<Snapshot> {
    use tokio::io::AsyncReadExt;
    let mut file = tokio::fs::File::open(&path).await.ok()?;
    let meta = file.metadata().await.ok()?;
    let mut content = Vec::new();
    file.read_to_end(&mut content).await.ok()?;
    Some(Snapshot {
        identity: identity(&meta),
        content,
    })
}

#[cfg(unix)]
fn identity(meta: &std::fs::Metadata) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    Some((meta.dev(), meta.ino()))
}

#[cfg(not(unix))]
fn identity(_: &std::fs::Metadata) -> Option<(u64, u64)> {
    None
}

/// Reads the file every [`WATCH_INTERVAL`] (tokio time) and asks for a
/// reload of each content [`judge`] says to apply, passing those bytes.
/// A content is asked for once, valid or not (a bad one is refused and
/// logged once, not every interval); when a request is already pending it
/// is asked for again at the next read.
async fn watch_file<R, F>(mut read: R, tx: mpsc::Sender<ReloadRequest>)
where
    R: FnMut() -> F,
    F: std::future::Future<Output = Option<Snapshot>>,
{
    let mut applied = read().await.unwrap_or_default();
    let mut pending: Option<Snapshot> = None;
    let mut tick = tokio::time::interval(WATCH_INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    loop {
        tick.tick().await;
        let Some(now) = read().await else { continue };
        match judge(&applied, pending.as_ref(), &now) {
            Verdict::Unchanged => {
                // The same content under another inode (a rename of an
                // identical file): that is the file from now on.
                applied.identity = now.identity;
                pending = None;
            }
            Verdict::Wait => {
                debug!("config file changed, waiting one interval to see it complete");
                pending = Some(now);
            }
            Verdict::Apply => match tx.try_send(ReloadRequest::Content(now.content.clone())) {
                Ok(()) => {
                    info!("config file changed, reloading");
                    applied = now;
                    pending = None;
                }
                Err(mpsc::error::TrySendError::Full(_)) => pending = Some(now),
                Err(mpsc::error::TrySendError::Closed(_)) => return,
            },
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
    certificates: Vec<Arc<TlsListener>>,
    stop: CancellationToken,
) {
    loop {
        let request = tokio::select! {
            r = source.requests.recv() => r,
            _ = stop.cancelled() => None,
        };
        let Some(request) = request else { return };
        let (request, reply) = match request {
            ReloadRequest::Asked(reply) => (ReloadRequest::Signal, Some(reply)),
            other => (other, None),
        };
        let outcome = reload(&source.path, request, &running, &current, &metrics);
        // A reload also re-reads the listeners' certificates at once (their
        // watcher would within a second); a bad pair keeps the old one and
        // is logged, and does not refuse the config.
        for tls in &certificates {
            tls.refresh(true);
        }
        if let Some(Reply(tx)) = reply {
            let _ = tx.send(outcome);
        }
    }
}

/// One reload: read the file (or take the watcher's content), validate
/// the config as it will run, swap (or refuse and keep the old config,
/// returning why).
pub(super) fn reload(
    path: &std::path::Path,
    request: ReloadRequest,
    running: &Config,
    current: &ArcSwap<Proxy>,
    metrics: &Metrics,
) -> Result<(), String> {
    let now = unix_secs();
    let refuse = |message: String| {
        error!("config reload refused, the running config stays: {message}");
        metrics.config_loaded(false, now);
        Err(message)
    };
    let loaded = match request {
        ReloadRequest::Content(bytes) => Ok(bytes),
        ReloadRequest::Signal | ReloadRequest::Asked(_) => Config::read(path),
    }
    .and_then(|bytes| Ok((Config::load_bytes(path, bytes.clone())?, bytes)));
    let (file_config, text) = match loaded {
        Ok(c) => c,
        // The words check-config and serve use for the same file.
        Err(e) => return refuse(format!("invalid configuration: {e}")),
    };
    for w in file_config.warnings() {
        warn!("{w}");
    }
    let kept = running.restart.changes(&file_config.restart).join(", ");
    // What will run: the restart-only settings at their running values.
    // Checked as a whole, so no route needs more than the running budget.
    let config = as_reloaded(running, file_config);
    let text = String::from_utf8_lossy(&text);
    if let Err(e) = config.check_composed(&text, &path.display().to_string()) {
        // The file alone passed the same checks: a kept setting made it fail.
        return refuse(format!(
            "invalid configuration: {e} (with the running values of the settings only a restart changes: {kept})"
        ));
    }
    if !kept.is_empty() {
        warn!(
            settings = %kept,
            "config reloaded, but these settings only change on a restart: they keep their running values"
        );
    }
    // Upstream clients read their TLS files here: a missing or bad one
    // refuses the reload like a bad config.
    let next = match current.load().reconfigured(&config) {
        Ok(next) => next,
        Err(e) => return refuse(e.to_string()),
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
    Ok(())
}

pub(super) fn unix_secs() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or_default()
}

/// `new` as a reload runs it: what only a restart changes (`Restart`)
/// at its running values, the rest from `new`.
pub fn as_reloaded(running: &Config, new: Config) -> Config {
    // Every field named: a new one must be placed here or in `Restart`.
    let Config {
        scope_secret,
        store_keys: _,
        server,
        upstreams,
        routes,
        restart: _,
    } = new;
    Config {
        scope_secret,
        // The store was opened with them: a restart changes them.
        store_keys: running.store_keys.clone(),
        server,
        upstreams,
        routes,
        restart: running.restart.clone(),
    }
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
            (
                "tls_cert_file = \"c.pem\"\ntls_key_file = \"k.pem\"",
                &["server.tls_*"],
            ),
        ];
        for (extra, want) in cases {
            assert_eq!(
                base.restart.changes(&config(extra).restart),
                *want,
                "{extra}"
            );
        }
    }

    /// Regression: a reload was validated as the file alone, so raising
    /// `max_buffered_body_bytes` (restart-only) with a route's
    /// `max_request_body` was accepted and the route ran past the running
    /// budget. What a reload runs keeps every restart-only setting, and
    /// the cross-section checks see that, naming the file's line.
    #[test]
    fn a_reload_runs_and_is_checked_with_the_running_restart_only_settings() {
        let running = config("max_buffered_body_bytes = \"8MiB\"\nmax_connections = 5");
        let changes = [
            "max_buffered_body_bytes = \"64MiB\"\nmax_connections = 7\nlisten = \"127.0.0.1:9\"\nreadiness = \"store\"\nwatch_config = true",
            "header_read_timeout = \"1s\"\nidle_timeout = \"2s\"\nh2_max_concurrent_streams = 3\nshutdown_grace = \"3s\"\nshutdown_delay = \"1s\"",
            "[store]\nbackend = \"postgres\"\nurl = \"postgres://u@h/db\"\n[redis]\nurl = \"redis://r:6379\"",
            "[admin]\nlisten = \"127.0.0.1:9901\"\n[log]\nlevel = \"debug\"",
        ];
        for extra in changes {
            let new = config(&format!("upstream_timeout = \"5s\"\n{extra}"));
            assert!(!running.restart.changes(&new.restart).is_empty(), "{extra}");
            let effective = as_reloaded(&running, new);
            let kept = running.restart.changes(&effective.restart);
            assert_eq!(kept, Vec::<String>::new(), "{extra}");
            assert_eq!(
                effective.server.upstream_timeout,
                std::time::Duration::from_secs(5),
                "reloadable settings come from the new file"
            );
        }
        let text = "[server]\nupstream = \"http://127.0.0.1:3000\"\nmax_buffered_body_bytes = \"64MiB\"\n[[route]]\nmethods = [\"POST\"]\npath = \"/o\"\nmax_request_body = \"16MiB\"\n";
        let new = Config::parse(text, "new.toml").expect("valid on its own");
        let err = as_reloaded(&running, new)
            .check_composed(text, "new.toml")
            .unwrap_err()
            .to_string();
        for needle in [
            "new.toml: line 7",
            "max_request_body (16MiB)",
            "server.max_buffered_body_bytes (8MiB)",
        ] {
            assert!(err.contains(needle), "{err:?} lacks {needle:?}");
        }
    }

    fn snap(inode: u64, content: &str) -> Snapshot {
        Snapshot {
            identity: Some((1, inode)),
            content: content.as_bytes().to_vec(),
        }
    }

    /// A change in place applies once it read the same an interval later;
    /// another file (a rename) applies at once; the applied content again
    /// is nothing to do.
    #[test]
    fn judge_table() {
        use Verdict::{Apply, Unchanged, Wait};
        let applied = snap(7, "full");
        let cases: &[(Option<Snapshot>, Snapshot, Verdict)] = &[
            (None, snap(7, "full"), Unchanged),
            (Some(snap(7, "half")), snap(7, "full"), Unchanged),
            // Renamed over with the same content: nothing to reload.
            (None, snap(8, "full"), Unchanged),
            // In place: first seen, then seen again.
            (None, snap(7, "half"), Wait),
            (Some(snap(7, "half")), snap(7, "half"), Apply),
            // Still being written: a new prefix waits again.
            (Some(snap(7, "ha")), snap(7, "half"), Wait),
            (Some(snap(7, "new")), snap(7, "newer"), Wait),
            // Another file (mv tmp idemgate.toml, a ConfigMap swap).
            (None, snap(8, "new"), Apply),
            (Some(snap(7, "half")), snap(8, "new"), Apply),
            // No identity (not unix): only stability counts.
            (
                None,
                Snapshot {
                    identity: None,
                    content: b"new".to_vec(),
                },
                Wait,
            ),
        ];
        for (pending, now, want) in cases {
            assert_eq!(
                judge(&applied, pending.as_ref(), now),
                *want,
                "pending {pending:?}, now {now:?}"
            );
        }
        // The watcher's first read failed: no identity to compare with.
        let unknown = Snapshot::default();
        assert_eq!(judge(&unknown, None, &snap(8, "new")), Wait);
        let seen = snap(8, "new");
        assert_eq!(judge(&unknown, Some(&seen), &seen), Apply);
    }

    /// The watcher on tokio's paused clock, over a file in memory: an
    /// in-place rewrite in two writes 1.9 s apart never sends its first
    /// half; the whole file is sent once it stayed the same a full
    /// interval; a rename is sent at the next read; the bytes sent are
    /// those judged, whatever the file holds by the time they are applied.
    #[tokio::test(start_paused = true)]
    async fn the_watcher_sends_only_content_that_stayed_the_same_or_was_renamed_in() {
        use std::sync::Mutex;
        use tokio::time::{sleep, Duration, Instant};
        let file = Arc::new(Mutex::new(snap(1, "v1")));
        let reader = {
            let file = file.clone();
            move || {
                let now = file.lock().unwrap().clone();
                async move { Some(now) }
            }
        };
        let (tx, mut rx) = mpsc::channel(1);
        let start = Instant::now();
        tokio::spawn(watch_file(reader, tx));
        let write = |inode, content: &str| *file.lock().unwrap() = snap(inode, content);
        let at = |s: f64| sleep(start + Duration::from_secs_f64(s) - Instant::now());
        let next = |rx: &mut mpsc::Receiver<ReloadRequest>| match rx.try_recv() {
            Ok(ReloadRequest::Content(c)) => Some(String::from_utf8(c).unwrap()),
            Ok(ReloadRequest::Signal | ReloadRequest::Asked(_)) => {
                panic!("the watcher sends content")
            }
            Err(_) => None,
        };
        // Reads at 0 (the start), 2, 4, 6, ...
        at(2.5).await;
        write(1, "v2-half");
        at(4.4).await; // read at 4: the half, first seen
        write(1, "v2-half+rest");
        at(6.5).await; // read at 6: changed again
        assert_eq!(next(&mut rx), None, "the half is never sent");
        at(8.5).await; // read at 8: the same as at 6
        assert_eq!(next(&mut rx).as_deref(), Some("v2-half+rest"));
        at(12.5).await;
        assert_eq!(next(&mut rx), None, "sent once");
        write(2, "v3"); // mv tmp idemgate.toml
        at(14.1).await; // read at 14
        assert_eq!(next(&mut rx).as_deref(), Some("v3"), "a rename at once");
        // A write that keeps changing every read is never sent.
        for (i, t) in [14.5, 16.5, 18.5, 20.5].into_iter().enumerate() {
            at(t).await;
            write(2, &format!("v4-part{i}"));
        }
        at(21.9).await;
        assert_eq!(next(&mut rx), None);
        at(24.1).await; // read at 22 first saw part3, at 24 again
        assert_eq!(next(&mut rx).as_deref(), Some("v4-part3"));
        // A reload still pending: the next content waits for its turn.
        write(3, "v5");
        at(26.1).await;
        write(4, "v6");
        at(28.1).await;
        assert_eq!(next(&mut rx).as_deref(), Some("v5"));
        at(30.1).await;
        assert_eq!(next(&mut rx).as_deref(), Some("v6"), "asked for again");
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
            let changes = base.restart.changes(&changed.restart);
            assert_eq!(changes, [want], "{store_extra}{redis_extra}");
        }
    }
}
