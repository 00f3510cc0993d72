//! The store interface: where claims, leases and stored responses live.
//!
//! Every backend gives the same guarantees (the contract suite in
//! `tests/it/store_contract.rs` runs one body against all of them):
//! - [`Store::claim`] is one atomic step: insert the key as in flight, or take
//!   over a record whose ttl ran out or whose lease ran out, or report the
//!   record that is there. The backend decides, never a read-then-write in
//!   the caller.
//! - [`Store::renew`], [`Store::complete`] and [`Store::release`] are fenced
//!   by the claim's [`LeaseToken`]: a holder that lost its claim gets
//!   [`Fence::Lost`] and changes nothing.
//! - Time is an argument (`now`, unix milliseconds), so every backend agrees
//!   with the proxy's clock and tests control it.
//! - Each backend reports how long a call may take ([`Store::call_bound`]);
//!   [`instrumented::Instrumented`] enforces it and times every call.
//!
//! This file holds the trait and its types. The backends are `memory`
//! (reference, not durable), `sqlite` (the embedded default), `postgres`
//! (shared) and `redis` (a fast path in front of PostgreSQL, never the
//! guard); `codec` and `sql` hold what they share, and `open` builds the
//! configured one from the config. `notify` is no store: PostgreSQL
//! `LISTEN`/`NOTIFY` that wakes waiting duplicates on other replicas.
//! `sealed` seals stored responses at rest on every backend
//! ([`crate::idempotency::vault`] holds the keys and the cipher), and
//! `rotate` moves stored records to the current key.

pub(crate) mod batch;
pub(crate) mod codec;
pub mod instrumented;
pub mod memory;
pub mod notify;
mod open;
pub mod pg_connect;
pub mod postgres;
pub mod redis;
pub mod rotate;
#[cfg(test)]
pub(crate) mod scripted;
pub mod sealed;
pub(crate) mod sql;
pub mod sqlite;

pub use crate::idempotency::record::{FirstUse, Record, RecordState, StoredResponse, UnixMillis};
pub use open::{check_connect, migrate, open, open_with_metrics};

use crate::idempotency::{Fingerprint, RecordKey};
use crate::net::errors::BoxError;
use async_trait::async_trait;
use std::borrow::Cow;
use std::fmt;
use std::time::Duration;

/// Random per-claim owner token; completion and release must present it.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct LeaseToken(pub [u8; 16]);

impl LeaseToken {
    pub fn random() -> Self {
        Self(rand::random())
    }
}

impl fmt::Debug for LeaseToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "LeaseToken({})", hex::encode(&self.0[..4]))
    }
}

/// A length of time from the caller's `now`.
///
/// Who judges time: a backend private to one process (memory, SQLite)
/// trusts the caller's clock, `now`. A backend shared by several processes
/// (PostgreSQL) measures every span from its own server clock and ignores
/// `now`, so replicas whose clocks disagree still agree on every lease and
/// expiry; the records it returns from a claim are shifted into the
/// caller's frame (`now`), so the caller can compare them with its clock.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Span {
    pub now: UnixMillis,
    pub ms: i64,
}

impl Span {
    pub fn end(&self) -> UnixMillis {
        self.now.saturating_add(self.ms)
    }
}

/// Everything a claim writes.
#[derive(Clone, Debug)]
pub struct Claim {
    pub key: RecordKey,
    pub fingerprint: Fingerprint,
    pub token: LeaseToken,
    /// The caller's clock (see [`Span`] for who judges time).
    pub now: UnixMillis,
    /// `locked_until = now + lease_ms`.
    pub lease_ms: i64,
    /// `expires_at = now + ttl_ms`.
    pub ttl_ms: i64,
    /// Kept with the record while this claim's request owns it (a takeover
    /// or a claim after expiry writes its own); read back as
    /// [`Record::first_use`].
    pub first_use: Option<FirstUse>,
}

impl Claim {
    pub fn locked_until(&self) -> UnixMillis {
        self.now + self.lease_ms
    }
    pub fn expires_at(&self) -> UnixMillis {
        self.now + self.ttl_ms
    }
}

/// The answer to a claim.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ClaimOutcome {
    /// The caller now holds the key. `takeover` is true when it replaced an
    /// in-flight record whose holder's lease had run out.
    Claimed { takeover: bool },
    /// A live record is there; [`crate::idempotency::decide`] says what it means.
    Existing(Record),
}

/// How a fenced write went.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fence {
    /// The token still owned the record; the write happened.
    Held,
    /// Someone else owns the record now (or it is gone); nothing was written.
    Lost,
}

impl Fence {
    /// A fenced statement touches the one row its token owns, or none.
    pub fn from_rows(rows: u64) -> Self {
        if rows == 1 {
            Fence::Held
        } else {
            Fence::Lost
        }
    }
}

/// What a holder writes when the upstream has answered.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Completion {
    Stored(StoredResponse),
    Unstored {
        status: u16,
    },
    /// The upstream was sent the request but never answered, and the route
    /// keeps such keys (`on_ambiguous = "keep"`).
    Unknown,
}

/// The state a completion leaves its record in.
impl From<&Completion> for RecordState {
    fn from(completion: &Completion) -> Self {
        match completion {
            Completion::Stored(response) => RecordState::Completed(response.clone()),
            Completion::Unstored { status } => RecordState::Unstored { status: *status },
            Completion::Unknown => RecordState::Unknown,
        }
    }
}

/// A completion as the SQL backends write it: the `state`, `status`,
/// `headers` and `body` columns.
#[derive(Default)]
pub(crate) struct CompletionColumns<'a> {
    pub state: &'static str,
    pub status: Option<u16>,
    pub headers: Option<Vec<u8>>,
    pub body: Option<&'a [u8]>,
}

impl Completion {
    pub(crate) fn columns(&self) -> CompletionColumns<'_> {
        match self {
            Completion::Stored(response) => CompletionColumns {
                state: "completed",
                status: Some(response.status),
                headers: Some(codec::encode_headers(&response.headers)),
                body: Some(&response.body[..]),
            },
            Completion::Unstored { status } => CompletionColumns {
                state: "unstored",
                status: Some(*status),
                ..Default::default()
            },
            Completion::Unknown => CompletionColumns {
                state: "unknown",
                ..Default::default()
            },
        }
    }
}

/// An operator's verdict on an outcome-unknown record (`idemgate keys resolve`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// The upstream did not execute it: the record goes, and the next
    /// request with the key claims it fresh.
    NotApplied,
    /// The upstream executed it: the record becomes unstored with
    /// [`RESOLVED_STATUS`] (retries get 410, never run), and keeps `reason`.
    Applied { reason: String },
}

impl Verdict {
    /// As logs and metric labels name it.
    pub fn as_str(&self) -> &'static str {
        match self {
            Verdict::NotApplied => "not_applied",
            Verdict::Applied { .. } => "applied",
        }
    }
}

/// The status of a record an operator resolved as applied: no answer came,
/// so there is none to name.
pub const RESOLVED_STATUS: u16 = 0;

/// What a record resolved as applied keeps of its resolution.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Resolution {
    /// When (unix millis; a shared backend's own clock, see [`Span`]).
    pub at: UnixMillis,
    pub reason: String,
}

/// Why the store could not answer. Every variant means "unknown": the
/// proxy must not forward unguarded on any of them.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("store unavailable: {0}")]
    Unavailable(#[source] Unavailable),
    #[error("store unavailable: {0}")]
    Postgres(#[from] pg_connect::PgFailure),
    /// A certificate file the store's config names cannot be used.
    #[error("store unavailable: {0}")]
    Tls(#[from] crate::net::tls::TlsError),
    #[error("store timed out")]
    Timeout,
    #[error("store returned a corrupt record: {0}")]
    Corrupt(String),
    /// The store has fallen behind: this many completions are still
    /// waiting for it (see `lease::Backlog`), so no new work is taken.
    #[error("{pending} completions are waiting for the store")]
    Backlog { pending: usize },
    /// The record was deleted, but a cache in front of the store could not
    /// be told: it may still answer with the deleted response.
    #[error(
        "deleted in the store, but the Redis copy {name} could not be removed ({source}); \
             run the delete again once Redis answers, or DEL {name} in Redis"
    )]
    StaleCopy { name: String, source: BoxError },
}

/// What a backend could not do, and the cause when there is one: kept as
/// the source, so a decision asks for it by type (`net::errors::find`).
#[derive(Debug, thiserror::Error)]
#[error("{0}{cause}", cause = .1.as_ref().map(|c| format!(": {c}")).unwrap_or_default())]
pub struct Unavailable(Cow<'static, str>, #[source] Option<BoxError>);

impl StoreError {
    /// `what` failed, for no cause beyond it.
    pub fn unavailable(what: impl Into<Cow<'static, str>>) -> Self {
        Self::Unavailable(Unavailable(what.into(), None))
    }

    /// `what` failed because of `cause`.
    pub fn caused(what: impl Into<Cow<'static, str>>, cause: impl Into<BoxError>) -> Self {
        Self::Unavailable(Unavailable(what.into(), Some(cause.into())))
    }
}

/// The storage backend.
#[async_trait]
pub trait Store: Send + Sync + 'static {
    /// Atomically claims `claim.key`, or returns the live record there.
    async fn claim(&self, claim: &Claim) -> Result<ClaimOutcome, StoreError>;

    /// [`Store::claim`] again, answered by the authority alone, for a
    /// caller that could not use the record `claim` returned (a sealed
    /// response that did not open, see [`sealed::Sealed`]): a store that
    /// may answer claims from a copy (the Redis fast path) asks the store
    /// behind it, then makes its copy of the key agree with that answer
    /// (replaced, or dropped), so the next claim does not read the old
    /// copy. `None` from a store whose claims the authority answers
    /// already: there is nothing else to read.
    async fn claim_authoritative(&self, claim: &Claim) -> Result<Option<ClaimOutcome>, StoreError> {
        let _ = claim;
        Ok(None)
    }

    /// Extends the holder's lease to `lease.end()`.
    async fn renew(
        &self,
        key: &RecordKey,
        token: &LeaseToken,
        lease: Span,
    ) -> Result<Fence, StoreError>;

    /// Marks the holder's record completed. It expires when the claim's ttl
    /// runs out (the ttl counts from the claim), but not before
    /// `keep.end()`: a request that ran nearly as long as its ttl must
    /// still replay for a while afterwards.
    async fn complete(
        &self,
        key: &RecordKey,
        token: &LeaseToken,
        completion: &Completion,
        keep: Span,
    ) -> Result<Fence, StoreError>;

    /// Deletes the holder's in-flight record so a retry runs again.
    async fn release(&self, key: &RecordKey, token: &LeaseToken) -> Result<Fence, StoreError>;

    /// Reads a record, expired or not (for inspection).
    async fn get(&self, key: &RecordKey) -> Result<Option<Record>, StoreError>;

    /// Deletes a record whatever its state (operator repair). True if one was there.
    async fn delete(&self, key: &RecordKey) -> Result<bool, StoreError>;

    /// Settles an outcome-unknown record (operator repair) in one atomic
    /// step: only a record still in the `unknown` state and not expired at
    /// `now` changes, as [`Verdict`] says; `now` stamps the resolution (a
    /// shared backend uses its own clock for both). False, changing
    /// nothing, when no such record is there: an expired one is left for
    /// the next claim to take as new, never settled back to life.
    async fn resolve(
        &self,
        key: &RecordKey,
        verdict: &Verdict,
        now: UnixMillis,
    ) -> Result<bool, StoreError>;

    /// The resolution kept by a record resolved as applied, if it is one.
    async fn resolution(&self, key: &RecordKey) -> Result<Option<Resolution>, StoreError>;

    /// Deletes up to `batch` records whose ttl ran out before `now` (never a
    /// live lease; a shared backend judges by its own clock, see [`Span`]).
    /// Returns how many went.
    async fn sweep(&self, now: UnixMillis, batch: u32) -> Result<u64, StoreError>;

    /// Up to `limit` live (not expired at `now`) completed records with a
    /// stored response, in primary-key order ([`RecordKey`]'s `Ord`),
    /// starting after `after` (from the first when `None`): the pages of
    /// `idemgate keys reencrypt`. Responses as the backend holds them
    /// (sealed, under [`sealed::Sealed`] too): a rotation compares and
    /// rewrites stored bytes.
    async fn scan_completed(
        &self,
        after: Option<RecordKey>,
        limit: u32,
        now: UnixMillis,
    ) -> Result<Vec<(RecordKey, Record)>, StoreError>;

    /// Replaces the stored response of the completed record at `key` with
    /// `new`, in one atomic step, only while it still holds exactly `old`
    /// (status, headers and body, as stored): a compare-and-set, so a
    /// takeover, completion or delete that came after the read is never
    /// overwritten. True when it wrote. Nothing else in the record changes.
    async fn rewrite_response(
        &self,
        key: &RecordKey,
        old: &StoredResponse,
        new: &StoredResponse,
    ) -> Result<bool, StoreError>;

    /// Cheap liveness probe for readiness.
    async fn ping(&self) -> Result<(), StoreError>;

    /// The backend's name for logs and metrics.
    fn backend(&self) -> &'static str;

    /// How long any one call may take before the caller stops waiting and
    /// treats it as [`StoreError::Timeout`] ([`instrumented::Instrumented`]
    /// applies it). A backend that enforces `store.timeout` itself reports
    /// a little more, so its own deadline fires first and cleans up.
    fn call_bound(&self) -> Duration;

    /// What is down without making the store unready (the Redis fast path:
    /// PostgreSQL answers alone), with its cause, for `/readyz`; `None`
    /// when nothing is.
    fn degraded(&self) -> Option<String> {
        None
    }

    /// PINGs the Redis fast path for the health checks (`idemgate_redis_up`,
    /// `/healthz/store`): `None` without a `[redis]` section. Apart from
    /// [`Store::ping`], which asks the authority only.
    async fn ping_fast_path(&self) -> Option<FastPathPing> {
        None
    }
}

/// One health check of the Redis fast path: which kind of Redis was asked
/// (`"redis"`, `"redis cluster"`, `"redis sentinel"`) and whether it answered.
#[derive(Clone, Debug)]
pub struct FastPathPing {
    pub kind: &'static str,
    pub result: Result<(), String>,
}

// === the two record rules every backend implements ===

/// Whether a claim for `fingerprint` at `now` replaces `record`: an
/// in-flight record only once its lease ran out (its ttl alone never ends a
/// live execution), and then only by the same request (another request
/// under the key is a 422 whether the holder is alive or dead) unless the
/// record's ttl ran out too; any other record once its ttl ran out. Every
/// backend's claim implements this; the SQL twin is `store::sql::claimable`.
pub fn is_claimable(record: &Record, fingerprint: &Fingerprint, now: UnixMillis) -> bool {
    let expired = record.expires_at <= now;
    match record.state {
        RecordState::InFlight { locked_until } => {
            locked_until <= now && (record.fingerprint == *fingerprint || expired)
        }
        _ => expired,
    }
}

/// Whether a sweep at `now` deletes `record`: expired, and not an in-flight
/// record whose lease is still live. The SQL twin is `store::sql::sweepable`.
pub fn is_sweepable(record: &Record, now: UnixMillis) -> bool {
    record.expires_at <= now
        && !matches!(record.state, RecordState::InFlight { locked_until } if locked_until > now)
}

/// A claim with fixed, recognizable bytes, for unit tests.
#[cfg(test)]
pub(crate) fn sample_claim() -> Claim {
    Claim {
        key: RecordKey {
            scope: crate::idempotency::Scope([1; 32]),
            key: [2; 32],
        },
        fingerprint: Fingerprint([3; 32]),
        token: LeaseToken([4; 16]),
        now: 1_000,
        lease_ms: 30_000,
        ttl_ms: 86_400_000,
        first_use: Some(FirstUse::new("POST", "/payments")),
    }
}
