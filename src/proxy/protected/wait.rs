//! Duplicates that wait (`in_flight = { wait = ".." }`): a per-key registry
//! of the requests waiting for the answer of one already in flight, and
//! the wait loop ([`Proxy::wait_for_answer`]).
//!
//! Waiters hold no store connection while they wait. They wake when this
//! process finishes the key ([`Waiters::notify`], after the holder's
//! completion or release), when another replica does (PostgreSQL
//! `NOTIFY`, [`crate::store::notify`], [`Waiters::notify_id`]), or on a
//! bounded backoff timer (the backstop when a notification is lost);
//! either way the store decides what they get. Per key, one waiter at a time asks the store ([`WaitGuard::try_check`])
//! and shares a final answer with the others ([`WaitGuard::publish`]), so a
//! few hundred waiters cost the store what one does. Bounded: a limit per
//! key and in all; past either the request is refused (503). An entry
//! leaves the registry with its last waiter.

use super::prepare::ProtectedRequest;
use crate::config::{Backend, Config, StoreConfig};
use crate::error::ProxyError;
use crate::idempotency::{Record, RecordKey, RecordState};
use crate::lease::Acquired;
use crate::metrics::Metrics;
use crate::net::backoff::Backoff;
use crate::proxy::log::Served;
use crate::proxy::Proxy;
use crate::route::{InFlight, RouteTable};
use crate::store::notify::KeyNotifier;
use prometheus_client::metrics::gauge::Gauge;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

/// Waiters on one key, at most: enough for a burst of redeliveries or
/// double-clicks; more is a client in a loop.
pub const MAX_WAITERS_PER_KEY: usize = 1024;
/// Waiters in all, at most: each holds a connection, a task and a request
/// body, which `max_connections` and the body budget bound too.
pub const MAX_WAITERS_TOTAL: usize = 8192;
/// Timer-driven store checks for one key are at least this far apart,
/// however many wait on it (a notification always checks).
const MIN_POLL_INTERVAL: Duration = Duration::from_millis(200);

/// The registry; one per process.
pub struct Waiters {
    state: Mutex<State>,
    per_key: usize,
    total: usize,
    gauge: Gauge,
}

#[derive(Default)]
struct State {
    entries: HashMap<RecordKey, Arc<Entry>>,
    /// The entries' keys by log id, for notifications from other replicas.
    by_id: HashMap<String, RecordKey>,
    waiting: usize,
}

/// One key's waiters.
#[derive(Default)]
struct Entry {
    /// Guarded by the registry's mutex.
    count: std::sync::atomic::AtomicUsize,
    /// Bumped on every notification and publication.
    generation: watch::Sender<u64>,
    /// A final record some waiter read, for the others.
    published: Mutex<Option<Record>>,
    /// Held while one waiter asks the store.
    checking: tokio::sync::Mutex<Option<Instant>>,
}

impl Entry {
    /// Wakes the entry's waiters.
    fn bump(&self) {
        self.generation.send_modify(|g| *g += 1);
    }
}

/// Why a request may not wait.
#[derive(Debug, PartialEq, Eq)]
pub struct Full;

impl Waiters {
    /// At most `per_key` waiters on a key and `total` in all, their number
    /// reported on `gauge` (idemgate_waiters).
    pub fn new(per_key: usize, total: usize, gauge: Gauge) -> Self {
        Self {
            state: Mutex::default(),
            per_key,
            total,
            gauge,
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A std mutex: no await happens while it is held.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Starts waiting on `key`, unless the limits are reached.
    pub fn enter(self: &Arc<Self>, key: RecordKey) -> Result<WaitGuard, Full> {
        use std::sync::atomic::Ordering::Relaxed;
        let mut state = self.lock();
        if state.waiting >= self.total {
            return Err(Full);
        }
        if !state.entries.contains_key(&key) {
            state.by_id.insert(key.log_id(), key);
        }
        let entry = state.entries.entry(key).or_default().clone();
        if entry.count.load(Relaxed) >= self.per_key {
            return Err(Full);
        }
        entry.count.fetch_add(1, Relaxed);
        state.waiting += 1;
        self.gauge.inc();
        let changed = entry.generation.subscribe();
        Ok(WaitGuard {
            waiters: self.clone(),
            key,
            entry,
            changed,
        })
    }

    /// Wakes `key`'s waiters: this process completed or released it.
    pub fn notify(&self, key: &RecordKey) {
        let entry = self.lock().entries.get(key).cloned();
        entry.inspect(|e| e.bump());
    }

    /// Wakes the waiters on the key with this log id: another replica
    /// finished it (`store::notify`).
    pub fn notify_id(&self, key_id: &str) {
        let entry = {
            let state = self.lock();
            state
                .by_id
                .get(key_id)
                .and_then(|key| state.entries.get(key))
                .cloned()
        };
        entry.inspect(|e| e.bump());
    }

    /// How many wait, in all.
    #[cfg(test)]
    fn waiting(&self) -> usize {
        self.lock().waiting
    }

    /// How many keys have waiters.
    #[cfg(test)]
    fn keys(&self) -> usize {
        self.lock().entries.len()
    }
}

/// What waiting duplicates need, process-wide: the registry (one per
/// process, so a request finishing on one config generation wakes the
/// duplicates waiting on another) and what else ends their wait.
#[derive(Clone)]
pub struct Waiting {
    waiters: Arc<Waiters>,
    /// Wakes waiters on other replicas (PostgreSQL with a waiting route).
    notifier: Option<Arc<KeyNotifier>>,
    /// The store the process runs on (restart-only): what a notifier
    /// started on a later reload must listen to.
    store: Arc<StoreConfig>,
    /// Cancelled when the server closes its connections (the drain's
    /// phase 3): duplicates still waiting answer 409 then.
    draining: CancellationToken,
}

impl Waiting {
    /// An empty registry, and the notifier where `config` can use one.
    pub fn new(config: &Config, metrics: &Metrics, draining: CancellationToken) -> Self {
        let gauge = metrics.waiters().clone();
        Self {
            waiters: Arc::new(Waiters::new(MAX_WAITERS_PER_KEY, MAX_WAITERS_TOTAL, gauge)),
            notifier: None,
            store: Arc::new(config.restart.store.clone()),
            draining,
        }
        .reconfigured(&config.routes)
    }

    /// This, on a reloaded config's `routes`: the cross-replica notifier
    /// starts on the first config where it can help, a PostgreSQL store
    /// (shared by replicas) and a route whose duplicates wait. Elsewhere
    /// the process's own notifications reach every waiter there is.
    pub fn reconfigured(&self, routes: &RouteTable) -> Self {
        let mut next = self.clone();
        let waits = routes
            .iter()
            .any(|r| matches!(r.in_flight, InFlight::Wait(_)));
        if next.notifier.is_some() || self.store.backend != Backend::Postgres || !waits {
            return next;
        }
        let waiters = self.waiters.clone();
        match KeyNotifier::spawn(&self.store, Arc::new(move |id| waiters.notify_id(id))) {
            Ok(notifier) => next.notifier = Some(Arc::new(notifier)),
            Err(e) => warn!(error = %e, "key notifications off; waiters poll the store"),
        }
        next
    }

    /// Wakes this process's waiters on `key`, and on a route whose
    /// duplicates wait (`waits`) other replicas' too: its request finished.
    pub(super) fn finished(&self, key: &RecordKey, waits: bool) {
        self.waiters.notify(key);
        if let (true, Some(notifier)) = (waits, &self.notifier) {
            notifier.publish(key.log_id());
        }
    }
}

/// One waiting request; leaves the registry when dropped.
pub struct WaitGuard {
    waiters: Arc<Waiters>,
    key: RecordKey,
    entry: Arc<Entry>,
    changed: watch::Receiver<u64>,
}

/// Permission to ask the store for the key; see [`WaitGuard::try_check`].
pub struct Check<'a> {
    _held: tokio::sync::MutexGuard<'a, Option<Instant>>,
}

impl WaitGuard {
    /// Resolves at the next notification or publication since the last
    /// one this waiter saw (none is missed between two calls).
    pub async fn changed(&mut self) {
        // The sender lives in the entry this guard holds: never closed.
        let _ = self.changed.changed().await;
    }

    /// A final record another waiter read.
    pub fn published(&self) -> Option<Record> {
        self.entry
            .published
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Shares a final record with the key's other waiters.
    pub fn publish(&self, record: Record) {
        *self
            .entry
            .published
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = Some(record);
        self.entry.bump();
    }

    /// The right to ask the store now, if no other waiter on this key is
    /// asking and (for a timer wake-up, `notified = false`) none asked in
    /// the last [`MIN_POLL_INTERVAL`].
    pub fn try_check(&self, notified: bool) -> Option<Check<'_>> {
        let mut guard = self.entry.checking.try_lock().ok()?;
        let now = Instant::now();
        if !notified && guard.is_some_and(|last| now - last < MIN_POLL_INTERVAL) {
            return None;
        }
        *guard = Some(now);
        Some(Check { _held: guard })
    }
}

impl Drop for WaitGuard {
    fn drop(&mut self) {
        use std::sync::atomic::Ordering::Relaxed;
        let mut state = self.waiters.lock();
        state.waiting -= 1;
        self.waiters.gauge.dec();
        if self.entry.count.fetch_sub(1, Relaxed) == 1 {
            state.entries.remove(&self.key);
            state.by_id.remove(&self.key.log_id());
        }
    }
}

impl Check<'_> {
    /// Done asking (dropping does the same).
    pub fn done(self) {}
}

/// A waiting duplicate's timer (the backstop when no notification comes,
/// e.g. the holder is another replica): doubling from 50 ms to 1 s, with
/// jitter so a crowd of waiters spreads out.
const WAIT_POLL: Backoff = Backoff::new(Duration::from_millis(50), Duration::from_secs(1));

impl Proxy {
    /// `in_flight = { wait }`: waits for the first request's answer, up
    /// to `wait`, then replays it. Woken by this process's notifications
    /// and by a backoff timer (the holder may be another replica); each
    /// time, one waiter per key claims again through the store, which
    /// decides: a final record is shared with the others, a released key
    /// is won by exactly one claim, which executes (the rest keep waiting
    /// for it). When the wait runs out: 409.
    pub(super) async fn wait_for_answer(
        &self,
        req: ProtectedRequest,
        wait: Duration,
        first: Record,
    ) -> Result<Served, ProxyError> {
        let deadline = Instant::now() + wait;
        let mut last = first;
        let Ok(mut guard) = self.services.waiting.waiters.enter(req.record_key) else {
            let retry_after_secs = match self.answer(last, &req) {
                Err(ProxyError::InFlight { retry_after_secs }) => retry_after_secs,
                _ => 1,
            };
            return Err(ProxyError::TooManyWaiters { retry_after_secs });
        };
        let mut polls: u32 = 0;
        loop {
            let notified = tokio::select! {
                () = guard.changed() => true,
                () = tokio::time::sleep(WAIT_POLL.delay(polls + 1, rand::random())) => {
                    polls = polls.saturating_add(1);
                    false
                }
                () = tokio::time::sleep_until(deadline) => return self.answer(last, &req),
                // Shutting down: a 409 now (retry on another replica), not
                // a connection cut at the end of the grace period.
                () = self.services.waiting.draining.cancelled() => return self.answer(last, &req),
            };
            // Only an answer of the execution this waiter is waiting for (or
            // a later one): one published before an operator's delete and a
            // new execution of the key is not.
            if let Some(record) = guard
                .published()
                .filter(|r| r.created_at >= last.created_at)
            {
                return self.answer(record, &req);
            }
            let Some(check) = guard.try_check(notified) else {
                continue;
            };
            match self.services.leases.acquire(self.claim_of(&req)).await {
                Ok(Acquired::Held(lease)) => {
                    check.done();
                    drop(guard);
                    return self.execute_and_notify(req, lease).await;
                }
                Ok(Acquired::Existing(record)) => {
                    check.done();
                    // Still running: wait on. A different request that took a
                    // released key over is answered now (422), as on arrival.
                    let running = matches!(record.state, RecordState::InFlight { .. });
                    if running && record.fingerprint == req.fingerprint {
                        last = record;
                        continue;
                    }
                    if !running {
                        guard.publish(record.clone());
                    }
                    return self.answer(record, &req);
                }
                // The wait is bounded anyway: keep waiting, and answer 409
                // from the last record seen if the store stays away.
                Err(e) => {
                    check.done();
                    debug!(error = %e, "store check while waiting failed");
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::idempotency::{IdempotencyKey, Scope};

    /// Whether `g` is woken within `within`.
    async fn woken(g: &mut WaitGuard, within: Duration) -> bool {
        tokio::time::timeout(within, g.changed()).await.is_ok()
    }

    fn key(k: &str) -> RecordKey {
        RecordKey::new(
            Scope::from_header_value(None),
            &IdempotencyKey::parse(k.as_bytes()).unwrap(),
        )
    }

    #[test]
    fn limits_per_key_and_in_all_and_entries_leave_with_their_last_waiter() {
        let w = Arc::new(Waiters::new(2, 3, Gauge::default()));
        let a1 = w.enter(key("a")).unwrap();
        let a2 = w.enter(key("a")).unwrap();
        assert_eq!(w.enter(key("a")).err(), Some(Full));
        let b1 = w.enter(key("b")).unwrap();
        assert_eq!(w.enter(key("c")).err(), Some(Full));
        assert_eq!((w.waiting(), w.keys()), (3, 2));
        drop(a1);
        assert_eq!((w.waiting(), w.keys()), (2, 2));
        drop(a2);
        drop(b1);
        assert_eq!((w.waiting(), w.keys()), (0, 0));
        assert!(w.lock().by_id.is_empty());
        // Room again.
        let _c = w.enter(key("c")).unwrap();
    }

    #[tokio::test]
    async fn a_notification_before_the_wait_is_not_missed() {
        let w = Arc::new(Waiters::new(8, 8, Gauge::default()));
        let mut g = w.enter(key("a")).unwrap();
        w.notify(&key("b"));
        w.notify(&key("a"));
        assert!(woken(&mut g, Duration::from_secs(5)).await);
        // Seen: the next wait blocks until the next notification.
        assert!(!woken(&mut g, Duration::from_millis(50)).await);
    }

    #[tokio::test]
    async fn a_notification_by_log_id_wakes_that_keys_waiters() {
        let w = Arc::new(Waiters::new(8, 8, Gauge::default()));
        let mut a = w.enter(key("a")).unwrap();
        let mut b = w.enter(key("b")).unwrap();
        w.notify_id(&key("a").log_id());
        w.notify_id("no such key");
        assert!(woken(&mut a, Duration::from_secs(5)).await);
        assert!(!woken(&mut b, Duration::from_millis(50)).await);
    }

    #[tokio::test]
    async fn one_waiter_checks_at_a_time_and_publishes_for_the_others() {
        let w = Arc::new(Waiters::new(8, 8, Gauge::default()));
        let a = w.enter(key("a")).unwrap();
        let mut b = w.enter(key("a")).unwrap();
        let check = a.try_check(true).expect("first");
        assert!(b.try_check(true).is_none(), "a is checking");
        check.done();
        // A timer wake-up right after a check does not ask again...
        assert!(b.try_check(false).is_none());
        // ...a notification does.
        assert!(b.try_check(true).is_some());
        let record = Record {
            fingerprint: crate::idempotency::Fingerprint([0; 32]),
            state: RecordState::Unknown,
            created_at: 0,
            expires_at: 0,
            first_use: None,
        };
        a.publish(record.clone());
        // Woken by the publication.
        assert!(woken(&mut b, Duration::from_secs(5)).await);
        assert_eq!(b.published(), Some(record));
    }
}
