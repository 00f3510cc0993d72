//! The Redis master the fast path talks to, followed across failovers and
//! restarts, and its **epoch**: for Redis Sentinel (the master the
//! sentinels name, `sentinel.rs`) and for one node at a fixed address
//! (`redis.url`: a server, or a managed primary endpoint that moves to the
//! promoted replica).
//!
//! [`Follower`] keeps one connection and drops it on every
//! connection-level failure (the fast path reports them through
//! [`Follower::lost`]); the next use connects afresh (asking the sentinels
//! again, or the same address), until a master answers.
//!
//! The epoch is the master's `run_id` and `master_replid` (from `INFO`),
//! read on the connection right after it opened. Both change whenever the
//! data set may have lost writes: `run_id` on every restart, the
//! replication id on every promotion. A promoted replica that lagged
//! still holds copies the old master had replaced or deleted; the fast
//! path puts the epoch into its key names, so it never reads a copy
//! written under another master (those expire on their own TTLs).

use redis::aio::{ConnectionLike, MultiplexedConnection};
use redis::sentinel::SentinelClient;
use redis::{AsyncConnectionConfig, ErrorKind, RedisError, RedisResult};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// Pause between two attempts while no master answers (the sentinels have
/// not promoted one yet, the node is restarting): about what a sentinel's
/// `down-after-milliseconds` and election take at the least, and four
/// attempts a second at most.
const RETRY: Duration = Duration::from_millis(250);

/// The epoch's characters taken from each of `run_id` and `master_replid`
/// (40 hex digits each): 64 bits each tell two servers or promotions apart.
const EPOCH_PART: usize = 16;

/// Where a master connection comes from.
pub(crate) enum Source {
    /// Whatever master the sentinels name now.
    Sentinel(SentinelClient),
    /// The server at `redis.url`, whichever it is now.
    Node(redis::Client),
}

impl Source {
    /// A connection to the master, and (Sentinel) the address the
    /// sentinels named for it, which [`Follower::revalidate`] compares.
    async fn connect(
        &mut self,
        config: &AsyncConnectionConfig,
    ) -> RedisResult<(MultiplexedConnection, Option<String>)> {
        match self {
            Self::Sentinel(client) => {
                let master = client.async_get_client().await?;
                let addr = master.get_connection_info().addr().to_string();
                let conn = master
                    .get_multiplexed_async_connection_with_config(config)
                    .await?;
                Ok((conn, Some(addr)))
            }
            Self::Node(client) => Ok((
                client
                    .get_multiplexed_async_connection_with_config(config)
                    .await?,
                None,
            )),
        }
    }

    /// For logs.
    fn kind(&self) -> &'static str {
        match self {
            Self::Sentinel(_) => "redis sentinel",
            Self::Node(_) => "redis",
        }
    }
}

/// The current master of one [`Source`], as last found.
pub(crate) struct Follower {
    /// The connection attempts, one at a time (a sentinel client caches
    /// its sentinel connections and is `&mut`).
    source: tokio::sync::Mutex<Source>,
    kind: &'static str,
    current: std::sync::Mutex<Option<Master>>,
    /// Whether a background attempt is running (see [`Follower::pin`]).
    looking: AtomicBool,
    /// Whether the task re-validating the master runs (see
    /// [`Follower::revalidate`]).
    watching: AtomicBool,
    config: AsyncConnectionConfig,
    /// Bounds one attempt: (every sentinel asked,) the master connected
    /// and its `INFO` read.
    bound: Duration,
}

/// A connection to the master and the epoch it was opened in.
#[derive(Clone)]
pub(crate) struct Master {
    pub(crate) conn: MultiplexedConnection,
    /// The epoch; also names this very connection (a fresh `Arc` per
    /// connection), so a failure reported on it clears it and nothing
    /// found since ([`Follower::lost`]).
    pub(crate) epoch: Arc<str>,
    /// Under Sentinel, the address the sentinels named.
    addr: Option<String>,
}

impl Follower {
    /// Follows `source`'s master, without connecting; each attempt is
    /// bounded by `bound`, each command by `timeout`.
    pub(crate) fn new(source: Source, timeout: Duration, bound: Duration) -> Self {
        let config = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(timeout))
            .set_response_timeout(Some(timeout));
        Self {
            kind: source.kind(),
            source: tokio::sync::Mutex::new(source),
            current: Default::default(),
            looking: Default::default(),
            watching: Default::default(),
            config,
            bound,
        }
    }

    /// For logs: "redis" or "redis sentinel".
    pub(crate) fn kind(&self) -> &'static str {
        self.kind
    }

    /// The current master, without waiting: `None` while none is known, and
    /// then an attempt starts in the background (the caller goes on without
    /// Redis, as during any outage).
    pub(crate) fn pin(self: &Arc<Self>) -> Option<Master> {
        if let Some(master) = super::lock(&self.current).clone() {
            return Some(master);
        }
        self.find_in_background();
        None
    }

    /// Connects until a master answers, unless an attempt is under way
    /// already.
    fn find_in_background(self: &Arc<Self>) {
        if self.looking.swap(true, Ordering::AcqRel) {
            return;
        }
        let me = self.clone();
        tokio::spawn(async move {
            while me.master().await.is_err() {
                tokio::time::sleep(RETRY).await;
            }
            me.looking.store(false, Ordering::Release);
        });
    }

    /// The current master, connecting if none is known.
    pub(crate) async fn master(self: &Arc<Self>) -> RedisResult<Master> {
        if let Some(master) = super::lock(&self.current).clone() {
            return Ok(master);
        }
        let mut source = self.source.lock().await;
        // Another caller may have found it while this one waited.
        if let Some(master) = super::lock(&self.current).clone() {
            return Ok(master);
        }
        let attempt = async {
            let (mut conn, addr) = source.connect(&self.config).await?;
            let epoch = epoch(&mut conn).await?;
            Ok::<_, RedisError>(Master {
                conn,
                epoch: epoch.into(),
                addr,
            })
        };
        let master = match tokio::time::timeout(self.bound, attempt).await {
            Ok(found) => found?,
            Err(_) => return Err(timed_out()),
        };
        let previous = super::lock(&self.current).replace(master.clone());
        drop(previous);
        tracing::info!(epoch = %master.epoch, "{}: connected to the master", self.kind);
        self.watch();
        Ok(master)
    }

    /// The fast path could not use the master it pinned (`failed`, its
    /// [`Master::epoch`]; `None` when no master answered at all): forget
    /// it and connect again at once, so the master promoted (or
    /// restarted) is known by the time the fast path's backoff ends. A
    /// master found after that pin (another failure's reconnect) is kept:
    /// a late failure on the old connection says nothing of it (review F8).
    pub(crate) fn lost(self: &Arc<Self>, failed: Option<&Arc<str>>) {
        let dropped = take_if_current(&mut super::lock(&self.current), failed, |m| &m.epoch);
        if dropped.is_some() || super::lock(&self.current).is_none() {
            self.find_in_background();
        }
    }

    /// Starts the task that calls [`Follower::revalidate`] every
    /// [`REVALIDATE`], once; it ends with the follower (the store).
    fn watch(self: &Arc<Self>) {
        if self.watching.swap(true, Ordering::AcqRel) {
            return;
        }
        let me = Arc::downgrade(self);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(REVALIDATE);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            tick.tick().await;
            loop {
                tick.tick().await;
                let Some(follower) = me.upgrade() else {
                    return;
                };
                follower.revalidate().await;
            }
        });
    }

    /// Asks whether the pinned master is still the one to use, and calls
    /// [`Follower::lost`] if not (review F4): a master cut off with this
    /// process from the sentinels' majority, or demoted while its
    /// connection stays up, would otherwise keep answering from copies
    /// the master promoted since no longer holds (deleted records among
    /// them) until a connection-level error. Under Sentinel the sentinels
    /// are asked again for the master's address (a sentinel that does not
    /// answer, or names a master not promoted yet, changes nothing: the
    /// next check asks again); on one node, the master's own role and
    /// epoch, on the pinned connection (a connection that does not answer
    /// is dropped too). Bounded by one attempt's bound.
    async fn revalidate(self: &Arc<Self>) {
        let Some(master) = super::lock(&self.current).clone() else {
            return;
        };
        let check = async {
            match &master.addr {
                Some(addr) => {
                    let mut source = self.source.lock().await;
                    let Source::Sentinel(client) = &mut *source else {
                        return Ok(None);
                    };
                    match client.async_get_client().await {
                        Ok(named) => {
                            let named = named.get_connection_info().addr().to_string();
                            Ok((named != *addr).then(|| format!("the sentinels name {named} now")))
                        }
                        Err(err) => {
                            tracing::debug!(error = %err, "{}: no sentinel confirmed the master", self.kind);
                            Ok(None)
                        }
                    }
                }
                None => match epoch(&mut master.conn.clone()).await {
                    Ok(now) if *now == *master.epoch => Ok(None),
                    Ok(now) => Ok(Some(format!("its epoch is {now} now"))),
                    Err(err) => Err(err),
                },
            }
        };
        let changed = match tokio::time::timeout(self.bound, check).await {
            Ok(Ok(None)) => return,
            Ok(Ok(Some(why))) => why,
            Ok(Err(err)) => err.to_string(),
            Err(_) => timed_out().to_string(),
        };
        // Only if it is still the one checked.
        let current = super::lock(&self.current)
            .as_ref()
            .is_some_and(|m| Arc::ptr_eq(&m.epoch, &master.epoch));
        if current {
            tracing::warn!(epoch = %master.epoch, why = %changed, "{}: the master is no longer the one to use; connecting again", self.kind);
            self.lost(Some(&master.epoch));
        }
    }
}

/// How often [`Follower::revalidate`] checks the master.
pub(crate) const REVALIDATE: Duration = Duration::from_secs(1);

fn timed_out() -> RedisError {
    RedisError::from(std::io::Error::new(
        std::io::ErrorKind::TimedOut,
        "no master answered in time",
    ))
}

/// Takes what `slot` holds if it is the one `failed` names (by identity:
/// the same `Arc`), leaving anything else, or anything found since, in
/// place. `None` names none.
fn take_if_current<T>(
    slot: &mut Option<T>,
    failed: Option<&Arc<str>>,
    epoch: impl Fn(&T) -> &Arc<str>,
) -> Option<T> {
    let failed = failed?;
    if slot.as_ref().is_some_and(|t| Arc::ptr_eq(epoch(t), failed)) {
        slot.take()
    } else {
        None
    }
}

/// The epoch of the server `conn` is connected to, which must be a master
/// (the sentinels may lag behind a demotion; a managed endpoint may still
/// point at a replica).
async fn epoch(conn: &mut MultiplexedConnection) -> RedisResult<String> {
    let (server, replication): (String, String) = redis::pipe()
        .cmd("INFO")
        .arg("server")
        .cmd("INFO")
        .arg("replication")
        .query_async(conn)
        .await?;
    let field = |text: &str, name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
            .map(|v| v.trim().to_string())
    };
    let not_master = || {
        RedisError::from((
            ErrorKind::Server(redis::ServerErrorKind::ReadOnly),
            "the server is not a master (a replica, or not promoted yet)",
        ))
    };
    if field(&replication, "role").as_deref() != Some("master") {
        return Err(not_master());
    }
    match (
        field(&server, "run_id"),
        field(&replication, "master_replid"),
    ) {
        (Some(run_id), Some(replid)) => Ok(epoch_of(&run_id, &replid)),
        _ => Err(not_master()),
    }
}

/// `run_id` and `master_replid`, shortened (see [`EPOCH_PART`]).
fn epoch_of(run_id: &str, replid: &str) -> String {
    let part = |s: &str| s.chars().take(EPOCH_PART).collect::<String>();
    format!("{}{}", part(run_id), part(replid))
}

/// A connection-like that sends each command to the current master,
/// connecting first if none is known (for the start-up probe, the healer
/// and `check-config --connect`; claims pin one master instead).
#[derive(Clone)]
pub(crate) struct Following(pub(crate) Arc<Follower>);

impl Following {
    async fn conn(&self) -> RedisResult<Master> {
        self.0.master().await
    }

    fn after(&self, used: Option<&Arc<str>>, result: &RedisResult<impl Sized>) {
        if let Err(err) = result {
            if super::is_connection_error(err) {
                self.0.lost(used);
            }
        }
    }
}

impl ConnectionLike for Following {
    fn req_packed_command<'a>(
        &'a mut self,
        cmd: &'a redis::Cmd,
    ) -> redis::RedisFuture<'a, redis::Value> {
        Box::pin(async move {
            let (used, result) = match self.conn().await {
                Ok(mut m) => (Some(m.epoch), m.conn.req_packed_command(cmd).await),
                Err(err) => (None, Err(err)),
            };
            self.after(used.as_ref(), &result);
            result
        })
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> redis::RedisFuture<'a, Vec<redis::Value>> {
        Box::pin(async move {
            let (used, result) = match self.conn().await {
                Ok(mut m) => (
                    Some(m.epoch),
                    m.conn.req_packed_commands(pipeline, offset, count).await,
                ),
                Err(err) => (None, Err(err)),
            };
            self.after(used.as_ref(), &result);
            result
        })
    }

    fn get_db(&self) -> i64 {
        0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_epoch_changes_with_a_restart_or_a_promotion() {
        let run = "0123456789abcdef0123456789abcdef01234567";
        let other_run = "f123456789abcdef0123456789abcdef01234567";
        let replid = "aaaaaaaaaaaaaaaabbbbbbbbbbbbbbbbcccccccc";
        let promoted = "baaaaaaaaaaaaaaabbbbbbbbbbbbbbbbcccccccc";
        let e = epoch_of(run, replid);
        assert_eq!(e.len(), 2 * EPOCH_PART);
        assert_eq!(e, epoch_of(run, replid));
        assert_ne!(e, epoch_of(other_run, replid), "restart");
        assert_ne!(e, epoch_of(run, promoted), "promotion");
    }

    /// Review F8: a failure reported on a pinned master clears that master
    /// only, never one found after it (whose connection is fine), nor one
    /// of the same epoch on another connection; a failure with no master
    /// pinned clears nothing.
    #[test]
    fn a_late_failure_clears_only_the_master_it_was_pinned_to() {
        let e = |s: &str| -> Arc<str> { Arc::from(s) };
        let (m1, m2) = (e("epoch-1"), e("epoch-2"));
        let first = Some(m1.clone());
        let mut slot = first.clone();
        assert_eq!(take_if_current(&mut slot, Some(&m1), |m| m), first);
        assert_eq!(slot, None, "the failed master is dropped");

        // M2 was found after the pin on M1 failed; M1's late failure.
        let mut slot = Some(m2.clone());
        assert_eq!(take_if_current(&mut slot, Some(&m1), |m| m), None);
        assert_eq!(slot, Some(m2.clone()), "the master found since is kept");
        // The same epoch, another connection (a reconnect to one server).
        let again = e("epoch-2");
        assert_eq!(take_if_current(&mut slot, Some(&again), |m| m), None);
        assert_eq!(take_if_current(&mut slot, None, |m| m), None);
        assert_eq!(slot, Some(m2.clone()));
        let mut empty: Option<Arc<str>> = None;
        assert_eq!(take_if_current(&mut empty, Some(&m2), |m| m), None);
    }
}
