//! The Redis fast path in front of the authoritative store.
//!
//! Redis is a **hint**, never the guard: replication is asynchronous and
//! TTLs lapse on their own, so every claim that Redis does not answer
//! outright still goes to the inner store (PostgreSQL), whose primary key
//! decides. What Redis answers alone is a completed or unstored record
//! cached after the inner store recorded it (replay, or 422 on a
//! fingerprint mismatch, without a database trip). A lock held by another
//! claimant is only a hint: the inner store confirms it before any 409
//! (a copy can be stale: a completion whose Redis write was lost, or a
//! promoted replica that lagged), and replays instead if it has completed
//! the key.
//!
//! Writes follow the truth: a completion is cached only after the inner
//! store returned [`Fence::Held`], and a lock is removed whenever the inner
//! store says the claim is not ours.
//!
//! **A copy never outlives the record it copies** (the consistency rule):
//! - a claim the inner store granted while Redis held something else puts
//!   its own lock over it (whatever was there is stale: the inner store
//!   just said the key is free);
//! - a completion replaces whatever Redis holds for the key with the new
//!   copy, or removes it;
//! - where such a write to Redis fails (Redis down, stalled, in
//!   [`BACKOFF`]), the key is marked **stale**: this process stops
//!   answering it from Redis, and a background healer deletes the Redis
//!   copy as soon as Redis answers again (then the next claim caches the
//!   record afresh from the inner store);
//! - an operator's delete removes the inner record, then the Redis copy,
//!   and fails loudly if Redis could not be told ([`StoreError::StaleCopy`]).
//!
//! Another replica may still answer from a stale copy until the healer's
//! delete lands (it retries every [`HEAL_INTERVAL`]). Every Redis call is bounded by
//! `redis.timeout`; on a failure the fast path steps aside for
//! [`BACKOFF`] and the inner store answers alone, then it probes again, so
//! Redis coming back needs no restart.
//!
//! Key names are `{prefix}:{epoch}:{hex(scope)}:{hex(key)}` (in a Redis
//! Cluster `{prefix}:{hex(scope)}:{hex(key)}`): digests only, never a raw
//! credential or idempotency key.
//!
//! **After a failover or a restart** the master may hold copies the old
//! one had replaced or deleted (replication is asynchronous), or none.
//! On one node (`redis.url`, a server or a managed primary endpoint) and
//! under Sentinel the fast path never reads them: key names carry the
//! epoch of the master they were written to (`master.rs`), and every
//! operation pins one master and its names ([`RedisConn::pin`]). A stale
//! lock copy on a cluster shard is confirmed with the inner store as
//! above; an operator's `DEL` of a record copy there (delete, resolve,
//! rewrite) succeeds only once every replica of the shard has it
//! ([`RedisConn::replicated`]), so a replica promoted later holds no copy
//! PostgreSQL deleted (docs/book/src/deploy.md, "Redis failover").
//!
//! Redis is reached through [`RedisConn`] (`conn.rs`): one node, a Redis
//! Cluster (`redis.cluster`) or the master Redis Sentinel names
//! (`redis.sentinels`, `sentinel.rs`), over TLS when the URL says
//! `rediss://` (or `valkeys://`, or `redis.tls` with Sentinel), with the
//! certificates of `tls.rs`. The values it keeps
//! are laid out in `value.rs`, read by the Lua scripts of `scripts.rs`;
//! the stale copies and their healer are `stale.rs`.

mod conn;
mod master;
mod scripts;
mod sentinel;
mod stale;
mod tls;
mod value;

pub(crate) use conn::RedisConn;
pub use value::Cached;
pub(crate) use value::{decode, encode_lock, encode_record, with_first_use};

use scripts::{Locking, Scripts};
use stale::{heal, lock, StaleSet, MAX_STALE};

use super::{
    Claim, ClaimOutcome, Completion, Fence, LeaseToken, Record, RecordState, Resolution, Span,
    Store, StoreError, StoredResponse, UnixMillis, Verdict,
};
use crate::clock::Clock;
use crate::config::RedisConfig;
use crate::idempotency::{Fingerprint, RecordKey};
use crate::metrics::FastPathStats;
use async_trait::async_trait;
use redis::{ErrorKind, RedisError, ServerErrorKind, Value};
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// How long the fast path stays out of the way after a connection-level
/// failure, so a dead Redis costs one timeout per second, not one per request.
pub const BACKOFF: Duration = Duration::from_secs(1);

/// The longest a record's Redis copy lives (its `PX`), whatever the
/// record's ttl (review F9): copies are named per master epoch, and those
/// under a dead epoch (after a restart or a failover) are never read
/// again, yet would hold memory for the rest of their ttl (days for the
/// webhook presets), which under `maxmemory-policy noeviction` can fill
/// Redis. A record older than its copy is read from the inner store, as
/// any miss is, and cached again for at most as long. The value keeps
/// the record's own expiry: a copy never answers past it.
pub const MAX_COPY_MS: i64 = 3_600_000;

/// How often the healer retries deleting stale copies while Redis is away.
pub const HEAL_INTERVAL: Duration = Duration::from_millis(500);

/// Fast-path counters, for metrics.
#[derive(Debug, Default)]
pub struct FastPathCounters {
    /// Claims answered from Redis alone.
    pub hits: AtomicU64,
    /// Claims that went to the inner store because Redis had no answer.
    pub misses: AtomicU64,
    /// Redis calls that failed, timed out, or were bypassed during
    /// [`BACKOFF`]; the inner store answered alone.
    pub errors: AtomicU64,
}

impl FastPathStats for FastPathCounters {
    fn hits(&self) -> u64 {
        self.hits.load(Ordering::Relaxed)
    }
    fn misses(&self) -> u64 {
        self.misses.load(Ordering::Relaxed)
    }
    fn errors(&self) -> u64 {
        self.errors.load(Ordering::Relaxed)
    }
}

pub struct RedisFastPath {
    inner: Arc<dyn Store>,
    conn: RedisConn,
    prefix: String,
    timeout: Duration,
    counters: Arc<FastPathCounters>,
    /// Unix millis until which Redis is bypassed (see [`BACKOFF`]).
    down_until: AtomicI64,
    scripts: Scripts,
    /// Keys whose Redis copy may be stale (see the module docs), shared
    /// with the healer task.
    stale: Arc<StaleSet>,
    /// Turns absolute times (`expires_at`, `locked_until`) into the relative
    /// expiries Redis takes, and times the backoff.
    clock: Clock,
    /// Why the fast path last stepped aside (cause first, see `tls.rs`),
    /// until Redis answers again; shared with the start-up probe.
    health: Arc<Health>,
}

/// What the fast path last knew of Redis, for logs and `/readyz`.
#[derive(Debug, Default)]
struct Health {
    /// The last connection-level failure, cleared by the next answer.
    last_error: std::sync::Mutex<Option<String>>,
    /// Whether `last_error` is set, so an answer costs no lock.
    failing: AtomicBool,
    /// A cause the start-up probe found that later failures (timeouts)
    /// cannot show, kept in front of them until Redis answers.
    hint: std::sync::Mutex<Option<&'static str>>,
    /// Whether a node answered `MOVED`/`ASK` while `redis.cluster` is off
    /// (said once: the fix is in the config).
    told_moved: AtomicBool,
}

impl Health {
    /// Records a failure; returns it as logged (with the hint in front).
    fn failed(&self, error: String) -> String {
        let hint = *lock(&self.hint);
        let error = match hint {
            Some(hint) if !error.contains(hint) => format!("{hint} ({error})"),
            _ => error,
        };
        *lock(&self.last_error) = Some(error.clone());
        self.failing.store(true, Ordering::Relaxed);
        error
    }

    fn hint(&self, cause: &'static str) {
        *lock(&self.hint) = Some(cause);
    }

    fn answered(&self) {
        // A load first: the swap's write would contend on every answer.
        if self.failing.load(Ordering::Relaxed) && self.failing.swap(false, Ordering::Relaxed) {
            *lock(&self.last_error) = None;
            *lock(&self.hint) = None;
        }
    }

    fn get(&self) -> Option<String> {
        lock(&self.last_error).clone()
    }
}

/// Whether a Redis error means Redis cannot serve the fast path for now
/// (step aside for [`BACKOFF`], log once) rather than a server-side answer
/// to one command: the connection is gone, TLS or authentication failed,
/// or the cluster is redirecting or failing over. Logged per transition,
/// never per request.
pub(super) fn is_connection_error(err: &RedisError) -> bool {
    err.is_io_error()
        || err.is_connection_dropped()
        || err.is_timeout()
        || err.is_unrecoverable_error()
        || err.is_cluster_error()
        || matches!(
            err.kind(),
            ErrorKind::AuthenticationFailed
                | ErrorKind::InvalidClientConfig
                | ErrorKind::ClusterConnectionNotFound
                | ErrorKind::Server(ServerErrorKind::MasterDown | ServerErrorKind::ReadOnly)
        )
        // A master cut off from its replicas under `min-replicas-to-write`
        // (docs/book/src/deploy.md, "Redis failover"): not to be used.
        || err.code() == Some("NOREPLICAS")
}

impl RedisFastPath {
    /// Wraps `inner`. Connects lazily: Redis being down here, or refusing
    /// the TLS handshake, is not an error (the fast path stays out of the
    /// way until it answers; the start-up probe logs why). Only a malformed
    /// `redis.url` or an unreadable certificate file fails.
    pub async fn new(inner: Arc<dyn Store>, cfg: &RedisConfig) -> Result<Self, StoreError> {
        let conn = RedisConn::lazy(cfg)?;
        let health = Arc::new(Health::default());
        // Connect in the background so the first request does not pay for
        // it, and say at start-up why Redis cannot be used, if it cannot.
        tokio::spawn(probe(
            conn.clone(),
            cfg.timeout,
            health.clone(),
            plain_probe_of(cfg),
        ));
        Ok(Self {
            inner,
            conn,
            prefix: cfg.prefix.clone(),
            timeout: cfg.timeout,
            counters: Arc::new(FastPathCounters::default()),
            down_until: AtomicI64::new(0),
            scripts: Scripts::new(),
            clock: Clock::system(),
            stale: Default::default(),
            health,
        })
    }

    /// Why the fast path last stepped aside, until a Redis call succeeds
    /// again (for `/readyz`).
    pub fn status(&self) -> Option<String> {
        self.health.get()
    }

    /// The same fast path reading `clock` (the process's, possibly shifted
    /// in tests) instead of the system clock.
    pub fn with_clock(mut self, clock: Clock) -> Self {
        self.clock = clock;
        self
    }

    pub fn counters(&self) -> Arc<FastPathCounters> {
        self.counters.clone()
    }

    /// The base name of `key`'s Redis copy (for tests and operators), as a
    /// cluster names it; on one node and under Sentinel the name sent
    /// carries the master's epoch after the prefix (`Pinned::name` in
    /// `conn.rs`, [`Self::redis_name`]). The stale set keeps these names,
    /// whatever the epoch.
    pub fn redis_key(&self, key: &RecordKey) -> String {
        // Written by hand: `format!` over two `hex::encode` strings was 5k
        // instructions a name, and a fresh key names its copy three times
        // (callgrind, bench/profile.sh MODE=fresh STORE=postgres+redis).
        let mut name =
            String::with_capacity(self.prefix.len() + 2 + 2 * (key.scope.0.len() + key.key.len()));
        name.push_str(&self.prefix);
        name.push(':');
        push_hex(&mut name, &key.scope.0);
        name.push(':');
        push_hex(&mut name, &key.key);
        name
    }

    /// The name `key`'s copy has on the Redis the fast path talks to now
    /// (with the master's epoch, if the names carry one), connecting if
    /// need be: for tests and operators.
    pub async fn redis_name(&self, key: &RecordKey) -> Result<String, StoreError> {
        let pinned = tokio::time::timeout(self.timeout * 4, self.conn.pin_waiting())
            .await
            .map_err(|_| StoreError::caused("redis", "no master answered in time"))?
            .map_err(|err| StoreError::caused("redis", err))?;
        Ok(pinned.name(&self.redis_key(key), &self.prefix))
    }

    /// Runs one Redis call under the timeout, on the master of epoch
    /// `pinned` (`None`: a cluster, or no master yet). `None` means "no
    /// answer": counted as an error, and a connection-level failure starts
    /// [`BACKOFF`] and drops that master (not one found since).
    async fn run<T, F>(&self, pinned: Option<&Arc<str>>, fut: F) -> Option<T>
    where
        F: Future<Output = redis::RedisResult<T>>,
    {
        let (message, conn_level) = match tokio::time::timeout(self.timeout, fut).await {
            Ok(Ok(v)) => {
                self.health.answered();
                return Some(v);
            }
            Ok(Err(err)) => {
                let conn_level = is_connection_error(&err);
                // A cluster client follows redirects itself; one that
                // surfaces (mid-failover) is just an outage.
                if err.redirect_node().is_some()
                    && matches!(self.conn, RedisConn::Node(_))
                    && !self.health.told_moved.swap(true, Ordering::Relaxed)
                {
                    tracing::error!(
                        "redis answered MOVED/ASK: redis.url is a Redis Cluster node; set redis.cluster = true (the fast path steps aside until then)"
                    );
                }
                (tls::describe(&err), conn_level)
            }
            Err(_) => ("timed out".to_string(), true),
        };
        self.counters.errors.fetch_add(1, Ordering::Relaxed);
        // Every failure, for debugging; the warnings below are per outage.
        tracing::debug!(error = %message, "redis fast path call failed");
        if conn_level {
            // Sentinel: ask the sentinels again (a failover, maybe).
            self.conn.lost(pinned);
            let until = self.clock.now_millis() + BACKOFF.as_millis() as i64;
            let prev = self.down_until.swap(until, Ordering::Relaxed);
            // Log the transition, not every request during an outage.
            let message = self.health.failed(message);
            if prev < self.clock.now_millis() - BACKOFF.as_millis() as i64 {
                tracing::warn!(error = %message, "redis fast path unavailable; using the store alone");
            }
        } else {
            tracing::warn!(error = %message, "redis fast path command failed");
        }
        None
    }

    /// False while in [`BACKOFF`]; such skips count as errors.
    fn enabled(&self) -> bool {
        let down = self.down_until.load(Ordering::Relaxed) > self.clock.now_millis();
        if down {
            self.counters.errors.fetch_add(1, Ordering::Relaxed);
        }
        !down
    }

    /// Where `key`'s copy is for one operation, if Redis can be asked now.
    /// One node with no connection (at start-up, or after the backoff that
    /// followed a lost one) connects in line, under the timeout and with
    /// the backoff of any Redis call, as a connection manager would;
    /// Sentinel does not wait for its lookup (`None`: counted as an error).
    async fn target(&self, key: &RecordKey) -> Option<Target> {
        let base = self.redis_key(key);
        let pinned = match self.conn.pin() {
            Some(pinned) => pinned,
            None if self.conn.connects_in_line() => self.run(None, self.conn.pin_waiting()).await?,
            None => {
                self.counters.errors.fetch_add(1, Ordering::Relaxed);
                return None;
            }
        };
        Some(Target {
            name: pinned.name(&base, &self.prefix),
            conn: pinned.conn,
            epoch: pinned.epoch,
            base,
        })
    }

    /// [`Self::target`] unless in [`BACKOFF`].
    async fn target_if_enabled(&self, key: &RecordKey) -> Option<Target> {
        if self.enabled() {
            self.target(key).await
        } else {
            None
        }
    }

    /// Our lock in, or what another claim left there: one script, so a
    /// duplicate costs one round trip like a fresh key. `None` when Redis
    /// did not answer.
    async fn lock_or_peek(&self, at: &Target, claim: &Claim) -> Option<Locking> {
        let mut inv = self.scripts.lock_or_peek.prepare_invoke();
        inv.key(&at.name)
            .arg(encode_lock(claim))
            .arg(claim.lease_ms.max(1));
        let v: Value = self
            .run(at.epoch.as_ref(), inv.invoke_async(&mut at.conn.clone()))
            .await?;
        Some(match v {
            Value::Int(1) => Locking::Locked,
            Value::Array(mut parts) if parts.len() == 1 => match parts.pop() {
                Some(Value::BulkString(value)) if !value.is_empty() => Locking::Held(Some(value)),
                _ => Locking::Held(None),
            },
            // Not this script's answer: let the inner store decide.
            _ => Locking::Held(None),
        })
    }

    /// Removes our lock without waiting, for use while in [`BACKOFF`] (or
    /// while Sentinel knows no master): a lock left behind would answer
    /// retries with 409 for up to a lease after the inner store released
    /// or completed the key.
    fn unlock_in_background(&self, base: String, token: LeaseToken) {
        let conn = self.conn.clone();
        let script = self.scripts.unlock.clone();
        let (timeout, prefix) = (self.timeout, self.prefix.clone());
        tokio::spawn(async move {
            let unlock = async {
                let pinned = conn.pin_waiting().await?;
                let mut inv = script.prepare_invoke();
                inv.key(pinned.name(&base, &prefix)).arg(&token.0[..]);
                inv.invoke_async::<Option<i64>>(&mut pinned.conn.clone())
                    .await
            };
            let _ = tokio::time::timeout(timeout, unlock).await;
        });
    }

    /// Whether this process may answer `base` from Redis.
    fn trusted(&self, base: &str) -> bool {
        !lock(&self.stale).contains(base)
    }

    /// Marks `base`'s Redis copy as possibly stale: this process stops
    /// answering it from Redis, and the healer deletes it once Redis
    /// answers. One healer task runs while anything is marked.
    fn mark_stale(&self, base: String) {
        let start_healer = {
            let mut stale = lock(&self.stale);
            if stale.len() >= MAX_STALE {
                tracing::error!(
                    "too many possibly stale Redis copies to track; this one expires on its own"
                );
                return;
            }
            let was_empty = stale.is_empty();
            stale.insert(base);
            was_empty
        };
        if start_healer {
            tokio::spawn(heal(
                self.conn.clone(),
                self.prefix.clone(),
                self.stale.clone(),
                self.timeout,
            ));
        }
    }

    async fn unlock(&self, at: &Target, token: &LeaseToken) {
        let mut inv = self.scripts.unlock.prepare_invoke();
        inv.key(&at.name).arg(&token.0[..]);
        let _: Option<i64> = self
            .run(at.epoch.as_ref(), inv.invoke_async(&mut at.conn.clone()))
            .await;
    }

    /// Caches a completed/unstored record the inner store reported, only
    /// while `key`'s name still holds `seen`, what the claim found (or put)
    /// there before it asked the inner store: an operator's delete,
    /// resolve or rewrite updates PostgreSQL, then `DEL`s the name, so a
    /// name that changed since may mean the record just read is no longer
    /// PostgreSQL's, and a plain `SET` would bring it back for the rest of
    /// its life (review F3). Whatever is there then is newer than the
    /// read, or nothing: the next claim reads the inner store.
    async fn cache(&self, at: &Target, seen: &[u8], record: &Record) {
        let ttl = record.expires_at - self.clock.now_millis();
        let Some(value) = encode_record(record).filter(|_| ttl > 0) else {
            return;
        };
        let mut inv = self.scripts.cache.prepare_invoke();
        inv.key(&at.name)
            .arg(seen)
            .arg(value)
            .arg(ttl.min(MAX_COPY_MS));
        let _: Option<i64> = self
            .run(at.epoch.as_ref(), inv.invoke_async(&mut at.conn.clone()))
            .await;
    }

    /// Puts `record`'s copy over `seen` (what the name held before the
    /// inner store was asked, `None` if nothing) as [`Self::cache`] does,
    /// or (a record Redis never caches, or one expired by now) deletes
    /// whatever is there. False when Redis did not answer.
    async fn replace(&self, at: &Target, seen: Option<&[u8]>, record: &Record) -> bool {
        let ttl = record.expires_at - self.clock.now_millis();
        let written: Option<Value> = match (encode_record(record).filter(|_| ttl > 0), seen) {
            (Some(value), Some(seen)) => {
                let mut inv = self.scripts.cache.prepare_invoke();
                inv.key(&at.name)
                    .arg(seen)
                    .arg(value)
                    .arg(ttl.min(MAX_COPY_MS));
                self.run(at.epoch.as_ref(), inv.invoke_async(&mut at.conn.clone()))
                    .await
            }
            // Nothing there to replace: the next claim caches it.
            (Some(_), None) => Some(Value::Nil),
            (None, _) => {
                let cmd = redis::cmd("DEL").arg(&at.name).to_owned();
                self.run(at.epoch.as_ref(), cmd.query_async(&mut at.conn.clone()))
                    .await
            }
        };
        written.is_some()
    }

    /// After the inner store answered a claim: make Redis agree with it.
    /// `locked` says whether our lock went into Redis; `seen` is what the
    /// name held before the inner store was asked (our lock, if `locked`;
    /// `None` if nothing), over which alone a record is cached.
    async fn follow(
        &self,
        at: &Target,
        claim: &Claim,
        (locked, seen): (bool, Option<&[u8]>),
        outcome: &ClaimOutcome,
    ) {
        match outcome {
            ClaimOutcome::Claimed { .. } if locked => {}
            // Granted while Redis holds something else: that is stale.
            ClaimOutcome::Claimed { .. } => self.overwrite_with_lock(at, claim).await,
            ClaimOutcome::Existing(
                record @ Record {
                    state: RecordState::Completed(_) | RecordState::Unstored { .. },
                    ..
                },
            ) => {
                if let Some(seen) = seen {
                    self.cache(at, seen, record).await;
                }
            }
            ClaimOutcome::Existing(_) if locked => self.unlock(at, &claim.token).await,
            ClaimOutcome::Existing(_) => {}
        }
    }

    /// The inner store alone decides (Redis did not answer, or this key's
    /// copy may be stale); a claim it grants marks the key stale, since
    /// Redis may hold an older copy nobody could check.
    async fn claim_bypassing(&self, base: &str, claim: &Claim) -> Result<ClaimOutcome, StoreError> {
        let outcome = self.inner.claim(claim).await?;
        if matches!(outcome, ClaimOutcome::Claimed { .. }) {
            self.mark_stale(base.to_string());
        }
        Ok(outcome)
    }

    /// Puts our lock over whatever Redis holds, or marks the key stale.
    async fn overwrite_with_lock(&self, at: &Target, claim: &Claim) {
        let lock = (&at.name, encode_lock(claim), "PX", claim.lease_ms.max(1));
        let cmd = redis::cmd("SET").arg(lock).to_owned();
        let written: Option<Value> = self
            .run(at.epoch.as_ref(), cmd.query_async(&mut at.conn.clone()))
            .await;
        if written.is_none() {
            self.mark_stale(at.base.clone());
        }
    }

    /// Removes the Redis copy of `key` after the inner store changed or
    /// deleted the record; [`StoreError::StaleCopy`] when Redis cannot be
    /// told, so the operator knows a replica could still answer from it.
    async fn drop_copy(&self, key: &RecordKey) -> Result<(), StoreError> {
        let base = self.redis_key(key);
        // The name the operator must `DEL` if this fails: with the epoch of
        // the master known now (a copy under another master's is never
        // read), the base name if none is.
        let known = self.conn.pin();
        let name = known
            .as_ref()
            .map_or_else(|| base.clone(), |p| p.name(&base, &self.prefix));
        let removed = tokio::time::timeout(self.timeout, async {
            let pinned = match known {
                Some(pinned) => pinned,
                None => self.conn.pin_waiting().await?,
            };
            let named = pinned.name(&base, &self.prefix);
            let cmd = redis::cmd("DEL").arg(&named).to_owned();
            cmd.query_async::<i64>(&mut pinned.conn.clone()).await?;
            // A cluster shard's replicas must have the DEL too: their
            // copies carry no epoch (RedisConn::replicated).
            pinned
                .conn
                .replicated(&named, self.timeout / 2)
                .await
                .map_err(crate::net::errors::BoxError::from)
        })
        .await;
        let source = match removed {
            Ok(Ok(())) => return Ok(()),
            Ok(Err(err)) => err,
            Err(_) => "redis did not answer in time".into(),
        };
        Err(StoreError::StaleCopy { name, source })
    }

    /// Answers a claim from what Redis holds, if it can: a completed or
    /// unstored record. A lock held by another claimant is never answered
    /// alone: after a failover, or a completion whose
    /// Redis write was lost, it may be a stale copy of a key PostgreSQL
    /// has completed, and a 409 for it would be wrong.
    fn answer(claim: &Claim, value: &[u8]) -> Option<ClaimOutcome> {
        match decode(value).ok()? {
            Cached::Record(record) if record.expires_at > claim.now => {
                Some(ClaimOutcome::Existing(record))
            }
            Cached::Record(_) | Cached::Lock { .. } => None,
        }
    }
}

/// One key's Redis copy for one operation: its name on the pinned
/// connection (carrying the master's epoch under Sentinel), and its base
/// name, which the stale set and operators use.
struct Target {
    conn: RedisConn,
    /// The pinned master's epoch (its identity, see `master.rs`).
    epoch: Option<Arc<str>>,
    name: String,
    base: String,
}

#[async_trait]
impl Store for RedisFastPath {
    async fn claim(&self, claim: &Claim) -> Result<ClaimOutcome, StoreError> {
        let base = self.redis_key(&claim.key);
        if !self.enabled() || !self.trusted(&base) {
            return self.claim_bypassing(&base, claim).await;
        }
        let Some(at) = self.target(&claim.key).await else {
            return self.claim_bypassing(&base, claim).await;
        };
        let (locked, seen) = match self.lock_or_peek(&at, claim).await {
            // No answer: the inner store decides alone.
            None => return self.claim_bypassing(&base, claim).await,
            Some(Locking::Locked) => (true, Some(encode_lock(claim))),
            Some(Locking::Held(Some(value))) => {
                if let Some(outcome) = Self::answer(claim, &value) {
                    self.counters.hits.fetch_add(1, Ordering::Relaxed);
                    return Ok(outcome);
                }
                // Another claimant's lock is confirmed below: the inner
                // store's in-flight record is the 409; a record it
                // completed is replayed (and cached over the stale lock,
                // if it is still there); a key it holds free is claimed
                // (our lock put over it).
                (false, Some(value))
            }
            // Expired in between.
            Some(Locking::Held(None)) => (false, None),
        };
        self.counters.misses.fetch_add(1, Ordering::Relaxed);
        // Redis is never the only guard: a lock we just set still goes to
        // the inner store, whose answer wins.
        match self.inner.claim(claim).await {
            Ok(outcome) => {
                self.follow(&at, claim, (locked, seen.as_deref()), &outcome)
                    .await;
                Ok(outcome)
            }
            Err(err) => {
                if locked {
                    // The claim is unknown; a lock left behind would 409
                    // the client's retry for a whole lease.
                    self.unlock(&at, &claim.token).await;
                }
                Err(err)
            }
        }
    }

    /// The inner store answers, as on a miss; its answer then replaces
    /// whatever Redis holds for the key (the copy the caller could not
    /// use): a completed or unstored record is cached over it, a claim the
    /// inner store granted puts our lock over it, and anything else drops
    /// it. Where Redis cannot be told, the key is marked stale, so this
    /// process stops reading the copy and the healer deletes it. The copy
    /// is read first and a record cached only over it (as a claim caches
    /// one only over its lock): an operator's delete in between wins. Round
    /// trips: that read, the claim's and one Redis write, within
    /// [`Self::call_bound`] with the read that found the copy.
    async fn claim_authoritative(&self, claim: &Claim) -> Result<Option<ClaimOutcome>, StoreError> {
        let base = self.redis_key(&claim.key);
        // What the name holds, read before the inner store is: a record is
        // cached over that alone (see `cache`). Not read from Redis when
        // marked stale: the healer deletes the copy.
        if !self.trusted(&base) {
            let outcome = self.inner.claim(claim).await?;
            self.counters.misses.fetch_add(1, Ordering::Relaxed);
            return Ok(Some(outcome));
        }
        let seen = match self.target_if_enabled(&claim.key).await {
            Some(at) => {
                let get = redis::cmd("GET").arg(&at.name).to_owned();
                let read: Option<Option<Vec<u8>>> = self
                    .run(at.epoch.as_ref(), get.query_async(&mut at.conn.clone()))
                    .await;
                read.map(|seen| (at, seen))
            }
            None => None,
        };
        let outcome = self.inner.claim(claim).await?;
        self.counters.misses.fetch_add(1, Ordering::Relaxed);
        let Some((at, seen)) = seen else {
            self.mark_stale(base);
            return Ok(Some(outcome));
        };
        match &outcome {
            ClaimOutcome::Claimed { .. } => self.overwrite_with_lock(&at, claim).await,
            ClaimOutcome::Existing(record) => {
                if !self.replace(&at, seen.as_deref(), record).await {
                    self.mark_stale(base);
                }
            }
        }
        Ok(Some(outcome))
    }

    async fn renew(
        &self,
        key: &RecordKey,
        token: &LeaseToken,
        lease: Span,
    ) -> Result<Fence, StoreError> {
        let fence = self.inner.renew(key, token, lease).await?;
        match (self.target_if_enabled(key).await, fence) {
            (Some(at), Fence::Held) => {
                let mut inv = self.scripts.extend.prepare_invoke();
                inv.key(&at.name).arg(&token.0[..]).arg(lease.ms.max(1));
                let _: Option<i64> = self
                    .run(at.epoch.as_ref(), inv.invoke_async(&mut at.conn.clone()))
                    .await;
            }
            (Some(at), Fence::Lost) => self.unlock(&at, token).await,
            (None, Fence::Lost) => self.unlock_in_background(self.redis_key(key), *token),
            // Our lock (if Redis still has it) lapses early; the inner
            // store still guards the key.
            (None, Fence::Held) => {}
        }
        Ok(fence)
    }

    async fn complete(
        &self,
        key: &RecordKey,
        token: &LeaseToken,
        completion: &Completion,
        keep: Span,
    ) -> Result<Fence, StoreError> {
        // The inner store records it first: Redis never knows more than it.
        let fence = self.inner.complete(key, token, completion, keep).await?;
        let Some(at) = self.target_if_enabled(key).await else {
            // Redis may hold anything older; it must not answer this key
            // until that is gone.
            let base = self.redis_key(key);
            if fence == Fence::Held {
                self.mark_stale(base);
            } else {
                self.unlock_in_background(base, *token);
            }
            return Ok(fence);
        };
        if fence == Fence::Lost {
            self.unlock(&at, token).await;
            return Ok(fence);
        }
        let record = Record {
            // Placeholders: the script takes all four from our lock.
            fingerprint: Fingerprint([0; 32]),
            state: RecordState::from(completion),
            created_at: 0,
            expires_at: 0,
            first_use: None,
        };
        if let Some(value) = encode_record(&record) {
            let tagged = [with_first_use(value[0])];
            let mut inv = self.scripts.complete.prepare_invoke();
            inv.key(&at.name)
                .arg(&token.0[..])
                .arg(value)
                .arg(keep.now)
                .arg(keep.ms)
                .arg(&tagged[..])
                .arg(MAX_COPY_MS);
            let written: Option<i64> = self
                .run(at.epoch.as_ref(), inv.invoke_async(&mut at.conn.clone()))
                .await;
            if written.is_none() {
                self.mark_stale(at.base);
            }
        } else {
            // Not cached (outcome unknown): the inner store answers the key.
            self.unlock(&at, token).await;
        }
        Ok(fence)
    }

    async fn release(&self, key: &RecordKey, token: &LeaseToken) -> Result<Fence, StoreError> {
        let fence = self.inner.release(key, token).await?;
        match self.target_if_enabled(key).await {
            Some(at) => self.unlock(&at, token).await,
            None => self.unlock_in_background(self.redis_key(key), *token),
        }
        Ok(fence)
    }

    async fn get(&self, key: &RecordKey) -> Result<Option<Record>, StoreError> {
        self.inner.get(key).await
    }

    /// Deletes the record, then its Redis copy; if Redis cannot be told,
    /// fails with [`StoreError::StaleCopy`] so the operator knows a replica
    /// could still replay the deleted response.
    async fn delete(&self, key: &RecordKey) -> Result<bool, StoreError> {
        let deleted = self.inner.delete(key).await?;
        self.drop_copy(key).await?;
        Ok(deleted)
    }

    /// Resolves the record in the inner store, then removes its Redis copy
    /// as [`Store::delete`] does: whatever Redis held for an outcome-unknown
    /// key (a lock left behind) must not answer for the settled record.
    async fn resolve(
        &self,
        key: &RecordKey,
        verdict: &Verdict,
        now: UnixMillis,
    ) -> Result<bool, StoreError> {
        let resolved = self.inner.resolve(key, verdict, now).await?;
        if resolved {
            self.drop_copy(key).await?;
        }
        Ok(resolved)
    }

    async fn resolution(&self, key: &RecordKey) -> Result<Option<Resolution>, StoreError> {
        self.inner.resolution(key).await
    }

    async fn sweep(&self, now: UnixMillis, batch: u32) -> Result<u64, StoreError> {
        // Redis expires its own copies (PX); only the inner store needs sweeping.
        self.inner.sweep(now, batch).await
    }

    async fn scan_completed(
        &self,
        after: Option<RecordKey>,
        limit: u32,
        now: UnixMillis,
    ) -> Result<Vec<(RecordKey, Record)>, StoreError> {
        // The authority holds every record; Redis only some copies.
        self.inner.scan_completed(after, limit, now).await
    }

    /// Rewrites the record in the inner store, then removes its Redis copy
    /// as [`Store::delete`] does: the copy still holds the old bytes (after
    /// a key rotation, sealed under a key about to be removed), and must
    /// never be the one a claim reads. [`StoreError::StaleCopy`] when
    /// Redis could not be told (the record is rewritten all the same).
    async fn rewrite_response(
        &self,
        key: &RecordKey,
        old: &StoredResponse,
        new: &StoredResponse,
    ) -> Result<bool, StoreError> {
        let rewritten = self.inner.rewrite_response(key, old, new).await?;
        if rewritten {
            self.drop_copy(key).await?;
        }
        Ok(rewritten)
    }

    async fn ping(&self) -> Result<(), StoreError> {
        // Readiness reflects the authority, not the hint.
        self.inner.ping().await
    }

    fn backend(&self) -> &'static str {
        self.inner.backend()
    }

    /// The inner store's bound plus the Redis round trips a claim can make
    /// around it (the lock-or-read script, then caching, overwriting or
    /// unlocking), each within `redis.timeout`, and one to spare: a slow
    /// Redis must never cut a claim off mid-statement.
    fn call_bound(&self) -> Duration {
        self.inner.call_bound() + self.timeout * 3
    }

    /// A PING of its own, outside the data path: it neither starts nor
    /// ends the backoff (requests find that out themselves), but an answer
    /// clears the cause `/readyz` shows, as any answer does.
    async fn ping_fast_path(&self) -> Option<crate::store::FastPathPing> {
        let result = ping_once(self.conn.clone(), self.timeout, None)
            .await
            .map_err(|(error, _)| error);
        if result.is_ok() {
            self.health.answered();
        }
        Some(crate::store::FastPathPing {
            kind: self.conn.kind(),
            result,
        })
    }

    fn degraded(&self) -> Option<String> {
        self.status().map(|cause| {
            format!(
                "{} fast path unavailable (the store answers alone): {cause}",
                self.conn.kind()
            )
        })
    }
}

/// Connects to the Redis `cfg` names and PINGs it once, for
/// `check-config --connect`: `Ok` with what answered, or the failure with
/// its cause first (certificate not trusted, host name mismatch, server
/// does not speak TLS, client certificate required, ...).
pub async fn check_connection(cfg: &RedisConfig) -> Result<String, String> {
    let conn = RedisConn::lazy(cfg).map_err(|e| e.to_string())?;
    let kind = conn.kind();
    ping_once(conn, cfg.timeout, plain_probe_of(cfg))
        .await
        .map(|()| format!("{kind} at {} answered", cfg.shown_address()))
        .map_err(|(error, _)| error)
}

/// Where to try a plain-text PING when a TLS connection gets no answer.
fn plain_probe_of(cfg: &RedisConfig) -> Option<(String, u16)> {
    cfg.is_tls().then(|| tls::plain_address(cfg)).flatten()
}

/// One PING within a few timeouts (a cluster connects to every node and
/// loads the slot map first). The error comes with the cause found by a
/// plain-text PING, if that is what answered.
async fn ping_once(
    mut conn: RedisConn,
    timeout: Duration,
    plain_probe: Option<(String, u16)>,
) -> Result<(), (String, Option<&'static str>)> {
    let bound = timeout * 4;
    let ping = redis::cmd("PING");
    let error = match tokio::time::timeout(bound, ping.query_async::<Value>(&mut conn)).await {
        Ok(Ok(_)) => return Ok(()),
        Ok(Err(err)) => tls::describe(&err),
        Err(_) => format!("no answer within {}ms", bound.as_millis()),
    };
    // A plain server never answers a TLS handshake (it waits for a line):
    // ask it a plain-text PING to tell that from a dead or slow server.
    match plain_probe {
        Some((host, port)) if tls::answers_plain_ping(&host, port, timeout).await => {
            let cause = tls::NOT_TLS;
            Err((
                format!("{cause} ({host}:{port} answered a plain-text PING; {error})"),
                Some(cause),
            ))
        }
        _ => Err((error, None)),
    }
}

/// The start-up connection attempt: logs that the fast path is up, or why
/// it is not (the cause first: an untrusted certificate, a host name
/// mismatch, a plain server behind `rediss://`...). Either way requests
/// are served; without Redis the inner store answers alone.
async fn probe(
    conn: RedisConn,
    timeout: Duration,
    health: Arc<Health>,
    plain_probe: Option<(String, u16)>,
) {
    let kind = conn.kind();
    match ping_once(conn, timeout, plain_probe).await {
        Ok(()) => tracing::info!("{kind} fast path connected"),
        Err((error, hint)) => {
            if let Some(cause) = hint {
                health.hint(cause);
            }
            tracing::warn!(
                error = %error,
                "{kind} fast path unavailable at start-up; using the store alone until it answers"
            );
            health.failed(error);
        }
    }
}

/// Lowercase hex of `bytes`, appended to `out` (as `hex::encode` spells it).
fn push_hex(out: &mut String, bytes: &[u8]) {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    for &b in bytes {
        out.push(char::from(DIGITS[usize::from(b >> 4)]));
        out.push(char::from(DIGITS[usize::from(b & 0x0f)]));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::sample_claim;

    /// Copies in Redis keep their names across this version: the
    /// hand-written hex spells what `hex::encode` spelled.
    #[test]
    fn push_hex_spells_what_hex_encode_spells() {
        let bytes: Vec<u8> = (0..=255).collect();
        let mut out = String::from("p:");
        push_hex(&mut out, &bytes);
        assert_eq!(out, format!("p:{}", hex::encode(&bytes)));
    }

    /// What Redis answers alone: a live record, never a lock (another
    /// claim's lock may be stale after a failover: the inner store
    /// confirms it before any 409), and nothing expired.
    #[test]
    fn redis_answers_a_live_record_alone_and_never_a_lock() {
        let claim = sample_claim();
        let other = Claim {
            token: LeaseToken([7; 16]),
            ..claim.clone()
        };
        let record = |expires_at| Record {
            fingerprint: claim.fingerprint,
            state: RecordState::Unstored { status: 200 },
            created_at: claim.now,
            expires_at,
            first_use: None,
        };
        let live = record(claim.now + 1);
        for (what, value, answered) in [
            (
                "live record",
                encode_record(&live).unwrap(),
                Some(live.clone()),
            ),
            (
                "expired record",
                encode_record(&record(claim.now)).unwrap(),
                None,
            ),
            ("another claim's lock", encode_lock(&other), None),
            ("our own lock", encode_lock(&claim), None),
            ("garbage", b"x".to_vec(), None),
        ] {
            let got = RedisFastPath::answer(&claim, &value);
            let want = answered.map(ClaimOutcome::Existing);
            assert_eq!(got, want, "{what}");
        }
    }

    /// Which failures make the fast path step aside (logged once per
    /// outage) rather than warn per command: redirects and cluster
    /// failover among them, so a cluster never logs one line per request.
    #[test]
    fn connection_level_failures_include_redirects_and_failover() {
        let server = |reply: &[u8]| {
            redis::parse_redis_value(reply)
                .and_then(|v| v.extract_error())
                .expect_err("an error reply")
        };
        for (err, conn_level) in [
            (server(b"-MOVED 3999 127.0.0.1:6381\r\n"), true),
            (server(b"-ASK 3999 127.0.0.1:6381\r\n"), true),
            (server(b"-CLUSTERDOWN The cluster is down\r\n"), true),
            (
                server(b"-TRYAGAIN Multiple keys request during rehashing\r\n"),
                true,
            ),
            (
                server(b"-READONLY You can't write against a read only replica.\r\n"),
                true,
            ),
            (
                server(b"-NOREPLICAS Not enough good replicas to write.\r\n"),
                true,
            ),
            (server(b"-ERR wrong number of arguments\r\n"), false),
            (server(b"-NOSCRIPT No matching script\r\n"), false),
            (
                RedisError::from(std::io::Error::from(std::io::ErrorKind::ConnectionRefused)),
                true,
            ),
            (
                RedisError::from((ErrorKind::AuthenticationFailed, "bad password")),
                true,
            ),
        ] {
            assert_eq!(is_connection_error(&err), conn_level, "{err}");
        }
    }
}
