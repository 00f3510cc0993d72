//! Holding a key: the claim this process won ([`Lease`]) and the one set of
//! rules for the fenced writes that keep, finish or give up a claim.
//!
//! A successful claim returns a [`Lease`] that owns the record key and the
//! claim's token (pingora's cache `WritePermit` shape). Renewing goes
//! through it; [`Lease::complete`] and [`Lease::release`] consume it.
//!
//! Every write here is fenced by the token, and every one follows one rule:
//! **a write whose answer was lost may still have landed; only the token
//! decides.** [`interpret`] is that rule, pure and table-tested, and
//! [`Backoff`] the one retry schedule (doubling, with jitter so replicas
//! recovering from the same outage do not retry in lock-step); the
//! I/O around them is tested against a scripted store below.
//!
//! | write | until | then |
//! |---|---|---|
//! | renew | the request ends | a lost lease stops renewing |
//! | complete | [`QUICK`] attempts, then in the background for as long as the process lives ([`Backlog`]) | the key stays in flight meanwhile; renewed by the background task |
//! | release | [`QUICK`] attempts | the key is locked until its lease runs out |
//! | give back (a claim whose answer was lost) | the claim's lease would have run out | nothing left to free |

use crate::clock::{millis, Clock};
use crate::idempotency::{Fingerprint, FirstUse, RecordKey};
use crate::metrics::Metrics;
use crate::net::backoff::Backoff;
use crate::store::{
    Claim, ClaimOutcome, Completion, Fence, LeaseToken, Record, Span, Store, StoreError,
};
use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::task::TaskTracker;
use tracing::{debug, error, info, warn};

/// Renewing more often than this would only load the store.
const MIN_RENEW_INTERVAL: Duration = Duration::from_millis(100);
/// Completions waiting for the store, at most: each holds a response of up
/// to `max_response_body`, so this bounds their memory (256 x 1 MiB at the
/// defaults). Past it new protected requests get 503.
pub const MAX_PENDING_COMPLETIONS: usize = 256;

/// Completion and release before the client gets its answer: a few quick
/// tries (about 0.7 s in all), so a store blip costs the client little.
pub const QUICK: Backoff =
    Backoff::new(Duration::from_millis(100), Duration::from_millis(400)).attempts(4);
/// A completion still unrecorded after [`QUICK`], in the background.
const PERSIST_BACKOFF: Backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(2));
/// Giving back a claim whose answer was lost.
const GIVE_BACK_BACKOFF: Backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(5));

// ===== the rule (pure) =====

/// Which fenced write an answer belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Write {
    Renew,
    Complete,
    Release,
    /// A release after a claim whose answer was lost.
    GiveBack,
}

/// What a request's end did to its key: the answer a finished lease
/// ([`Lease::complete`], [`Lease::release`]) gives, for the client's detail.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeyFate {
    /// The request was not protected (no route, or no key where optional).
    Unprotected,
    /// Released: the retry runs again.
    Released,
    /// The store could not be told: retries get 409 until the lease runs out.
    Locked,
    /// The lease had run out and another request holds the key now.
    TakenOver,
    /// The upstream had already answered (status below 500) when the body
    /// failed: it executed, so the key stays completed and never runs again.
    Kept,
    /// Sent but unanswered on an `on_ambiguous = "keep"` route: recorded as
    /// outcome unknown; retries get 424 until an operator resolves it.
    Unknown,
}

/// What one attempt's answer means.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    /// Final: the write took effect (`Held`), or the token no longer owns
    /// the record and never will again (`Lost`).
    Done(Fence),
    /// No answer that counts yet; try again if the policy allows.
    Retry,
}

/// The one rule for a fenced write's answer. `unanswered` says an earlier
/// attempt of the same write got no answer, so it may have landed.
pub fn interpret(write: Write, answer: &Result<Fence, StoreError>, unanswered: bool) -> Step {
    match (write, answer) {
        (_, Err(_)) => Step::Retry,
        (_, Ok(Fence::Held)) => Step::Done(Fence::Held),
        // The claim whose answer was lost may still commit after this
        // release found nothing: keep looking.
        (Write::GiveBack, Ok(Fence::Lost)) => Step::Retry,
        // Completing or releasing ends the token's ownership, so an earlier
        // attempt that landed makes this one find nothing.
        (Write::Complete | Write::Release, Ok(Fence::Lost)) if unanswered => {
            Step::Done(Fence::Held)
        }
        // A renewal leaves the token in place: Lost is always lost.
        (Write::Renew | Write::Complete | Write::Release, Ok(Fence::Lost)) => {
            Step::Done(Fence::Lost)
        }
    }
}

// ===== holding keys =====

/// What every lease of this process shares.
pub struct Leases {
    /// The instrumented store: every call is already bounded and timed.
    store: Arc<dyn Store>,
    metrics: Arc<Metrics>,
    /// Background writes (give-backs, completions through an outage) run
    /// here, so a graceful shutdown waits for them.
    tasks: TaskTracker,
    clock: Clock,
    /// Completions the store has not taken yet.
    backlog: Arc<Backlog>,
}

/// Completions the store has not taken yet: an upstream answer that was
/// received means the request executed, so it keeps being recorded while
/// the process lives (forgetting it would let a retry run the request
/// again). Bounded: past `limit`, new protected work is refused.
pub struct Backlog {
    /// The key ids (for logs) of the completions waiting, by entry number.
    waiting: std::sync::Mutex<std::collections::HashMap<u64, String>>,
    next: std::sync::atomic::AtomicU64,
    limit: usize,
    metrics: Arc<Metrics>,
}

/// One waiting completion; leaves the backlog when dropped.
struct Waiting {
    backlog: Arc<Backlog>,
    entry: u64,
}

impl Backlog {
    fn enter(self: &Arc<Self>, key_id: String) -> Waiting {
        let entry = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.lock().insert(entry, key_id);
        self.metrics.pending_completions().inc();
        Waiting {
            backlog: self.clone(),
            entry,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, std::collections::HashMap<u64, String>> {
        // A std mutex: no await happens while it is held.
        self.waiting.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn len(&self) -> usize {
        self.lock().len()
    }

    pub fn key_ids(&self) -> Vec<String> {
        self.lock().values().cloned().collect()
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        self.backlog.lock().remove(&self.entry);
        self.backlog.metrics.pending_completions().dec();
    }
}

/// What [`Lease::complete_reporting`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Completed {
    pub fate: KeyFate,
    /// The store confirmed the completion under this lease's token.
    pub recorded: bool,
}

/// What a claim asks for.
pub struct ClaimRequest {
    pub key: RecordKey,
    pub fingerprint: Fingerprint,
    /// How long a dead holder blocks the key.
    pub lease: Duration,
    /// How long a completed key replays, from the claim.
    pub ttl: Duration,
    /// The route's label, for metrics and logs.
    pub route: Arc<String>,
    /// What the claim keeps of its request, for a later 422.
    pub first_use: Option<FirstUse>,
    /// Told whether the claim is still ours, when someone asks.
    pub holding: Option<Arc<Holding>>,
}

/// Whether a claim is still this process's, as its claim and renewals
/// last said: for work beside the request that must stop once it is not
/// (a JetStream consumer's `+WPI` keeps the broker from redelivering, so
/// it is sent only while the lease is ours). Lost is final: a token never
/// owns its record again.
#[derive(Debug, Default)]
pub struct Holding(std::sync::Mutex<Hold>);

#[derive(Clone, Copy, Debug, Default)]
enum Hold {
    #[default]
    Unclaimed,
    /// Ours until then: a lease length after the claim or renewal that
    /// last succeeded was sent (the store counted from then or later).
    Until(tokio::time::Instant),
    /// A write found the token no longer owns the record (taken over, or
    /// deleted by an operator).
    Lost,
}

impl Holding {
    /// Won, and neither lost nor run out since the last good renewal.
    pub fn is_ours(&self) -> bool {
        matches!(*self.lock(), Hold::Until(t) if tokio::time::Instant::now() < t)
    }

    fn held(&self, asked: tokio::time::Instant, length: Duration) {
        let mut hold = self.lock();
        if !matches!(*hold, Hold::Lost) {
            *hold = Hold::Until(asked + length);
        }
    }

    fn lost(&self) {
        *self.lock() = Hold::Lost;
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Hold> {
        // A std mutex: no await happens while it is held.
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The answer to a claim.
pub enum Acquired {
    /// This process holds the key now.
    Held(Lease),
    /// A live record is there; `idempotency::decide` says what it means.
    Existing(Record),
}

impl Leases {
    pub fn new(
        store: Arc<dyn Store>,
        metrics: Arc<Metrics>,
        tasks: TaskTracker,
        clock: Clock,
        max_pending: usize,
    ) -> Arc<Self> {
        Arc::new(Self {
            backlog: Arc::new(Backlog {
                waiting: Default::default(),
                next: Default::default(),
                limit: max_pending,
                metrics: metrics.clone(),
            }),
            store,
            metrics,
            tasks,
            clock,
        })
    }

    pub fn backlog(&self) -> &Backlog {
        &self.backlog
    }

    pub fn clock(&self) -> &Clock {
        &self.clock
    }

    /// Claims a key: one atomic store step. A claim whose answer was lost
    /// may still commit, so it is given back in the background.
    pub async fn acquire(self: &Arc<Self>, req: ClaimRequest) -> Result<Acquired, StoreError> {
        let pending = self.backlog.len();
        if pending >= self.backlog.limit {
            return Err(StoreError::Backlog { pending });
        }
        let claim = Claim {
            key: req.key,
            fingerprint: req.fingerprint,
            token: LeaseToken::random(),
            now: self.clock.now_millis(),
            lease_ms: millis(req.lease),
            ttl_ms: millis(req.ttl),
            first_use: req.first_use,
        };
        let asked = tokio::time::Instant::now();
        let answer = self.store.claim(&claim).await;
        let fenced = Fenced {
            leases: self.clone(),
            key: claim.key,
            token: claim.token,
            length: req.lease,
            route: req.route,
            holding: req.holding,
        };
        match answer {
            Ok(ClaimOutcome::Existing(record)) => Ok(Acquired::Existing(record)),
            Ok(ClaimOutcome::Claimed { takeover }) => {
                if takeover {
                    self.metrics.takeover(&fenced.route);
                    info!(key.id = %claim.key.log_id(), route = %fenced.route, "took over a claim whose lease ran out");
                }
                fenced.held(asked);
                Ok(Acquired::Held(Lease {
                    fenced,
                    finished: false,
                }))
            }
            Err(e) => {
                if matches!(e, StoreError::Timeout) {
                    self.tasks.spawn(fenced.give_back());
                }
                Err(e)
            }
        }
    }
}

/// A claim this process holds. [`Lease::complete`] or [`Lease::release`]
/// consume it; whatever they leave in doubt is settled in the background,
/// fenced by the token.
pub struct Lease {
    fenced: Fenced,
    /// Set by `complete`/`release`; a lease dropped without either is a bug
    /// (the key stays in flight until its lease runs out).
    finished: bool,
}

/// The owned parts of a lease, for the tasks that outlive the request.
#[derive(Clone)]
struct Fenced {
    leases: Arc<Leases>,
    key: RecordKey,
    token: LeaseToken,
    /// The route's lease length.
    length: Duration,
    route: Arc<String>,
    holding: Option<Arc<Holding>>,
}

impl Lease {
    /// The key's short non-reversible id, for logs.
    pub fn log_id(&self) -> String {
        self.fenced.key.log_id()
    }

    /// Renews the lease every third of its length, for as long as the
    /// returned future is polled; it never finishes. Owned, so it can run
    /// beside [`Lease::complete`].
    pub fn keep_alive(&self) -> impl Future<Output = Infallible> + Send + 'static {
        self.fenced.clone().keep_alive()
    }

    /// Records the upstream's answer. A few quick attempts happen before
    /// the client gets its response; if the store is still down they go on
    /// in the background, renewing the lease, so a retry meanwhile gets 409
    /// rather than a second execution.
    pub async fn complete(self, completion: Completion) -> KeyFate {
        self.complete_reporting(completion).await.fate
    }

    /// [`Lease::complete`], saying also whether the store took the
    /// completion before this returned (`recorded`), or it is still being
    /// retried in the background. A message consumer acks only a recorded
    /// one: the broker forgets the message on ack.
    pub async fn complete_reporting(mut self, completion: Completion) -> Completed {
        self.finished = true;
        let fenced = self.fenced.clone();
        let mut unanswered = false;
        let answer = drive(Write::Complete, QUICK, &mut unanswered, || {
            fenced.complete_once(&completion)
        })
        .await;
        match answer {
            Some(fence) => Completed {
                fate: fenced.completed(fence, unanswered),
                // A write whose answer was lost may be ours or a takeover's:
                // only one confirmed under our token counts (a consumer acks it).
                recorded: fence == Fence::Held && !unanswered,
            },
            None => {
                warn!(key.id = %fenced.key.log_id(),
                    "could not record completion yet; retrying in the background");
                // Counted before this returns, so no new work slips past a
                // full backlog.
                let waiting = fenced.leases.backlog.enter(fenced.key.log_id());
                let tasks = fenced.leases.tasks.clone();
                tasks.spawn(fenced.persist(completion, waiting));
                Completed {
                    fate: KeyFate::Kept,
                    recorded: false,
                }
            }
        }
    }

    /// Deletes the record so a retry runs again.
    pub async fn release(mut self) -> KeyFate {
        self.finished = true;
        let fenced = &self.fenced;
        match drive(Write::Release, QUICK, &mut false, || fenced.release_once()).await {
            Some(Fence::Held) => KeyFate::Released,
            Some(Fence::Lost) => {
                fenced.leases.metrics.lost_fence(&fenced.route);
                warn!(key.id = %fenced.key.log_id(), "release refused: the claim had been taken over");
                KeyFate::TakenOver
            }
            None => {
                error!(key.id = %fenced.key.log_id(),
                    "could not release key; a retry gets 409 until the lease runs out");
                KeyFate::Locked
            }
        }
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        if !self.finished {
            error!(key.id = %self.fenced.key.log_id(),
                "a lease ended without completing or releasing; the key stays in flight until the lease runs out");
        }
    }
}

/// Runs `attempt` until [`interpret`] says its answer is final (`Some`) or
/// `policy` gives up (`None`). `unanswered` is set once an attempt fails.
async fn drive<F, Fut>(
    write: Write,
    policy: Backoff,
    unanswered: &mut bool,
    mut attempt: F,
) -> Option<Fence>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<Fence, StoreError>>,
{
    let mut retries = policy.start();
    loop {
        let answer = attempt().await;
        if let Step::Done(fence) = interpret(write, &answer, *unanswered) {
            return Some(fence);
        }
        let wait = retries.retry();
        if let Err(e) = &answer {
            *unanswered = true;
            let attempt = retries.failures();
            warn!(write = ?write, attempt, error = %e, "store write failed; retrying");
        }
        tokio::time::sleep(wait?).await;
    }
}

impl Fenced {
    async fn renew_once(&self) -> Result<Fence, StoreError> {
        let store = &self.leases.store;
        store.renew(&self.key, &self.token, self.span()).await
    }

    async fn complete_once(&self, completion: &Completion) -> Result<Fence, StoreError> {
        // The ttl counts from the claim, but a request that ran nearly as
        // long as its ttl must still replay for at least a lease afterwards.
        let store = &self.leases.store;
        store
            .complete(&self.key, &self.token, completion, self.span())
            .await
    }

    /// A claim or renewal sent at `asked` took effect.
    fn held(&self, asked: tokio::time::Instant) {
        if let Some(h) = &self.holding {
            h.held(asked, self.length);
        }
    }

    fn lost(&self) {
        if let Some(h) = &self.holding {
            h.lost();
        }
    }

    /// One lease length from now.
    fn span(&self) -> Span {
        Span {
            now: self.leases.clock.now_millis(),
            ms: millis(self.length),
        }
    }

    async fn release_once(&self) -> Result<Fence, StoreError> {
        let store = &self.leases.store;
        store.release(&self.key, &self.token).await
    }

    /// What a final completion answer means for the key.
    fn completed(&self, fence: Fence, unanswered: bool) -> KeyFate {
        match fence {
            Fence::Held => {
                if unanswered {
                    debug!(key.id = %self.key.log_id(), "completion recorded by an earlier attempt, or taken over");
                }
                KeyFate::Kept
            }
            Fence::Lost => {
                self.lost();
                self.leases.metrics.lost_fence(&self.route);
                warn!(key.id = %self.key.log_id(), route = %self.route,
                    "completion refused: the lease ran out and another request took the key over");
                KeyFate::TakenOver
            }
        }
    }

    async fn keep_alive(self) -> Infallible {
        let every = (self.length / 3).max(MIN_RENEW_INTERVAL);
        let mut retries =
            Backoff::new(MIN_RENEW_INTERVAL, (every / 2).max(MIN_RENEW_INTERVAL)).start();
        let mut wait = every;
        loop {
            tokio::time::sleep(wait).await;
            let asked = tokio::time::Instant::now();
            // Each renewal must give up in time for another try within the
            // lease, whatever the store's own bound (its latency is still
            // recorded: `Instrumented` records calls that are cancelled).
            let answer = tokio::time::timeout(every, self.renew_once())
                .await
                .unwrap_or(Err(StoreError::Timeout));
            match interpret(Write::Renew, &answer, false) {
                Step::Done(Fence::Held) => {
                    self.held(asked);
                    retries.reset();
                    wait = every;
                }
                Step::Done(Fence::Lost) => {
                    self.lost();
                    // The completion will be refused too; it is counted there.
                    debug!(key.id = %self.key.log_id(), "lease lost");
                    return std::future::pending().await;
                }
                Step::Retry => {
                    if let Err(e) = &answer {
                        warn!(key.id = %self.key.log_id(), error = %e, "lease renewal failed; retrying");
                    }
                    wait = retries.wait();
                }
            }
        }
    }

    /// Keeps trying to record `completion` until the store takes it (or the
    /// lease turns out lost), renewing the lease before each try: nothing
    /// else renews it now, and without it a retry could take the key over
    /// and run the request again. Counted in the [`Backlog`] meanwhile.
    async fn persist(self, completion: Completion, _waiting: Waiting) {
        // The quick attempts went unanswered: any of them may have landed.
        let unanswered = true;
        let mut retries = PERSIST_BACKOFF.start();
        loop {
            tokio::time::sleep(retries.wait()).await;
            let renewed = self.renew_once().await;
            let answer = self.complete_once(&completion).await;
            match (renewed, interpret(Write::Complete, &answer, unanswered)) {
                (_, Step::Done(fence)) => {
                    if fence == Fence::Held {
                        info!(key.id = %self.key.log_id(), "completion recorded after a store outage");
                    }
                    self.completed(fence, unanswered);
                    return;
                }
                // Taken over, or an earlier attempt did land: this try could
                // not say which, and the lease is gone either way.
                (Ok(Fence::Lost), Step::Retry) => {
                    error!(key.id = %self.key.log_id(),
                        "the lease was lost while its completion waited for the store; a retry may run the request again");
                    return;
                }
                (_, Step::Retry) => {}
            }
        }
    }

    /// A fenced release of a claim whose answer was lost, retried until the
    /// claim's lease would have run out anyway.
    async fn give_back(self) {
        let policy = GIVE_BACK_BACKOFF.within(self.length);
        let given = drive(Write::GiveBack, policy, &mut false, || self.release_once()).await;
        if given.is_some() {
            debug!(key.id = %self.key.log_id(), "gave back a claim whose answer was lost");
        }
    }
}

#[cfg(test)]
mod tests;
