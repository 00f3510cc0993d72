//! Copies that may be stale: the keys whose Redis write failed, which this
//! process no longer answers from Redis, and the healer that deletes them
//! once Redis answers again.

use super::{RedisConn, HEAL_INTERVAL};
use std::sync::Arc;
use std::time::Duration;

/// Stale keys tracked at most (about 150 bytes each); past it a stale copy
/// is left to expire on its own, with an error logged.
pub(super) const MAX_STALE: usize = 100_000;

/// Stale keys deleted per Redis call.
const HEAL_BATCH: usize = 500;

/// The Redis key names whose copies may be stale (see the module docs).
pub(super) type StaleSet = std::sync::Mutex<std::collections::HashSet<String>>;

/// Locks a std mutex of the fast path (no await happens while one is
/// held), poisoned or not.
pub(super) fn lock<T>(mutex: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}

/// Deletes the stale copies in `stale` (base names, see `Pinned::name`)
/// as soon as Redis answers, in batches, until none are left. Runs on its
/// own connection handle, so a proxy in [`BACKOFF`] still heals the moment
/// Redis is back; under Sentinel, on the master current at each batch.
pub(super) async fn heal(conn: RedisConn, prefix: String, stale: Arc<StaleSet>, timeout: Duration) {
    let names = || lock(&stale);
    loop {
        let batch: Vec<String> = names().iter().take(HEAL_BATCH).cloned().collect();
        if batch.is_empty() {
            return;
        }
        // The master pinned, for `lost` if its connection failed.
        let used = std::sync::Mutex::new(None);
        let delete = async {
            let pinned = conn.pin_waiting().await?;
            lock(&used).clone_from(&pinned.epoch);
            let named: Vec<String> = batch.iter().map(|b| pinned.name(b, &prefix)).collect();
            let cmd = redis::cmd("DEL").arg(&named).to_owned();
            cmd.query_async::<i64>(&mut pinned.conn.clone()).await
        };
        let deleted = tokio::time::timeout(timeout, delete).await;
        // A pinned connection that failed (or never answered) is dropped,
        // as the fast path drops it: else the healer would retry a dead
        // connection every HEAL_INTERVAL until a request noticed (review
        // F10). A master found since is kept (`Follower::lost`).
        let failed = match &deleted {
            Ok(Err(err)) => super::is_connection_error(err),
            Ok(Ok(_)) => false,
            Err(_) => true,
        };
        if failed {
            conn.lost(lock(&used).take().as_ref());
        }
        match deleted {
            Ok(Ok(_)) => {
                let mut stale = names();
                for name in &batch {
                    stale.remove(name);
                }
                if stale.is_empty() {
                    tracing::info!(
                        "stale redis copies removed; the fast path answers every key again"
                    );
                    return;
                }
            }
            _ => tokio::time::sleep(HEAL_INTERVAL).await,
        }
    }
}
