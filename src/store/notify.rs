//! Cross-replica wake-ups for waiting duplicates (`in_flight = { wait }`):
//! PostgreSQL `LISTEN`/`NOTIFY` on one dedicated connection per process.
//!
//! A replica that finishes a key on a waiting route (completed, released,
//! or left to its lease) sends `NOTIFY` right after, with the key's log id
//! (a non-reversible digest prefix) as payload; every replica listening on
//! the schema's channel wakes its waiters on that id, which then ask the
//! store as usual. Only a hint: a notification lost to a reconnect, a full
//! queue or a collision of ids costs a waiter at most one backoff step of
//! its timer (the correctness backstop), never a wrong answer.
//!
//! The connection is not from the store's pool, so waiters never take a
//! pool slot; it reconnects with a capped backoff while PostgreSQL is away.
//! It is opened like the store's ([`PgTarget`]: TLS as `sslmode` says).
//! Behind a transaction pooler (`pgbouncer=true`) `LISTEN` cannot work (the
//! session is not kept), so notifications are off and waiters poll.

use super::pg_connect::{MakeRustls, PgTarget};
use crate::config::StoreConfig;
use crate::net::backoff::Backoff;
use sha2::{Digest, Sha256};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_postgres::AsyncMessage;
use tracing::{debug, info, warn};

/// Notifications queued for sending, at most; more are dropped (waiters
/// elsewhere then learn by their timer).
const QUEUE: usize = 1024;
/// Reconnecting while PostgreSQL is away.
const RECONNECT: Backoff = Backoff::new(Duration::from_millis(200), Duration::from_secs(5));

/// What a notification wakes: the waiters on a key's log id.
pub type OnNotify = Arc<dyn Fn(&str) + Send + Sync>;

/// The process's listener and sender; stops when dropped.
pub struct KeyNotifier {
    tx: mpsc::Sender<String>,
    task: JoinHandle<()>,
}

impl KeyNotifier {
    /// Starts listening on `cfg`'s schema channel; `on_notify` gets each
    /// payload (this process's own notifications included). Fails only on
    /// a missing or malformed `store.url`.
    pub fn spawn(cfg: &StoreConfig, on_notify: OnNotify) -> Result<Self, String> {
        let url = cfg.url.as_deref().ok_or("store.url is not set")?;
        let target = PgTarget::new(url).map_err(|e| format!("store.url: {e}"))?;
        let (tx, mut rx) = mpsc::channel(QUEUE);
        if target.url.pgbouncer {
            info!("key notifications are off behind a transaction pooler (LISTEN needs a session); waiting duplicates poll the store");
            let task = tokio::spawn(async move { while rx.recv().await.is_some() {} });
            return Ok(Self { tx, task });
        }
        let mut pg = target.config.clone();
        pg.connect_timeout(cfg.connect_timeout)
            .keepalives(true)
            .application_name("idemgate-notify");
        let task = tokio::spawn(run(pg, target, channel(&cfg.schema), rx, on_notify));
        Ok(Self { tx, task })
    }

    /// Tells every replica that `key_id` was finished here; never waits.
    pub fn publish(&self, key_id: String) {
        if self.tx.try_send(key_id).is_err() {
            debug!("notification queue full; waiters elsewhere fall back to their timer");
        }
    }
}

impl Drop for KeyNotifier {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// One channel per schema (replicas of one deployment share it), as an
/// identifier that needs no quoting and fits PostgreSQL's 63 bytes.
pub fn channel(schema: &str) -> String {
    let digest = Sha256::digest(schema.as_bytes());
    format!("idemgate_keys_{}", hex::encode(&digest[..8]))
}

/// Listens on `pg`, opened as `target` says (its TLS connector, and
/// messages that name the host and the cause), reconnecting while it fails.
async fn run(
    pg: tokio_postgres::Config,
    target: PgTarget,
    channel: String,
    mut rx: mpsc::Receiver<String>,
    on_notify: OnNotify,
) {
    let mut retries = RECONNECT.start();
    loop {
        let mut listening = false;
        match session(&pg, &target, &channel, &mut rx, &on_notify, &mut listening).await {
            Ok(()) => return,
            Err(e) => {
                // A session that got as far as listening starts the count again.
                if listening {
                    retries.reset();
                }
                let wait = retries.wait();
                let attempt = retries.failures();
                if attempt == 1 {
                    warn!(error = %e, "key notifications unavailable; waiters poll the store meanwhile");
                } else {
                    debug!(error = %e, attempt, "key notifications still unavailable");
                }
                tokio::time::sleep(wait).await;
            }
        }
    }
}

/// Notifications sent in one statement, at most.
const BATCH: usize = 256;

/// Listens and sends until the connection fails (`Err`) or the notifier
/// is dropped (`Ok`). What is queued goes out in batches: one round trip
/// for all the keys finished meanwhile.
async fn session(
    pg: &tokio_postgres::Config,
    target: &PgTarget,
    channel: &str,
    rx: &mut mpsc::Receiver<String>,
    on_notify: &OnNotify,
    listening: &mut bool,
) -> Result<(), String> {
    let tls: MakeRustls = target.tls.clone();
    let (client, mut conn) = pg
        .connect(tls)
        .await
        .map_err(|e| target.failure(e).to_string())?;
    let incoming = async {
        loop {
            match std::future::poll_fn(|cx| conn.poll_message(cx)).await {
                Some(Ok(AsyncMessage::Notification(n))) => on_notify(n.payload()),
                Some(Ok(_)) => {}
                Some(Err(e)) => return e.to_string(),
                None => return "the server closed the connection".to_string(),
            }
        }
    };
    let outgoing = async {
        client.batch_execute(&format!("LISTEN {channel}")).await?;
        *listening = true;
        info!("listening for key notifications");
        let mut ids = Vec::with_capacity(BATCH);
        while rx.recv_many(&mut ids, BATCH).await > 0 {
            client
                .execute(
                    "SELECT pg_notify($1, id) FROM unnest($2::text[]) AS id",
                    &[&channel, &ids],
                )
                .await?;
            ids.clear();
        }
        Ok::<(), tokio_postgres::Error>(())
    };
    tokio::select! {
        lost = incoming => Err(lost),
        sent = outgoing => sent.map_err(|e| e.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn channels_are_per_schema_plain_identifiers() {
        let a = channel("idemgate");
        assert_eq!(a, channel("idemgate"));
        assert_ne!(a, channel("other"));
        assert!(a.len() <= 63);
        assert!(a
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_'));
    }
}
