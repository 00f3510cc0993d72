//! The store seam that keeps stored responses sealed at rest
//! (`IDEMGATE_STORE_ENCRYPTION_KEYS`, [`super::vault`]). [`Sealed`] wraps
//! the configured backend, Redis fast path included, so every copy of a
//! response (the SQL row, the SQLite file, the Redis value) holds only
//! ciphertext: a completion's headers and body are sealed into one value
//! kept as the body, under a header name no HTTP message can carry
//! ([`SEALED_HEADER`], whose value is the key id); every record read back
//! is opened before anyone sees it.
//!
//! A record that does not open (its key id no longer configured, or its
//! bytes tampered with or moved to another row) is never executed again:
//! it reads as executed-but-not-replayable (410), logged by `key.id` and
//! key id and counted. A record written before keys were set replays as
//! it was, unless `store.plaintext_responses = "refuse"`: then it is
//! unreadable too, so a plaintext response written into the store by
//! anyone but idemgate is never served (review F1).
//!
//! **Never a refusal while a readable copy exists**: a claim whose record
//! does not open asks again with [`Store::claim_authoritative`], so a
//! Redis copy under a removed key (or with altered bytes) gives way to
//! PostgreSQL's copy, which replaces it in Redis. Only a record whose
//! authoritative copy does not open is a 410. (Where the first answer came
//! from PostgreSQL already, that second claim reads it again: a cost only
//! unreadable records pay.)

use super::{
    Claim, ClaimOutcome, Completion, Fence, LeaseToken, Record, RecordState, Resolution, Span,
    Store, StoreError, StoredResponse, UnixMillis, Verdict,
};
use crate::config::PlaintextResponses;
use crate::idempotency::vault::{Binding, KeyRing, OpenError};
use crate::idempotency::RecordKey;
use crate::metrics::Metrics;
use async_trait::async_trait;
use bytes::Bytes;
use std::sync::Arc;
use std::time::Duration;
use tracing::{debug, error, warn};

/// The stored "header" that marks a sealed response: a pseudo-header name
/// (leading `:`), which no HTTP/1 field and no stored HTTP/2 field has.
pub const SEALED_HEADER: &str = ":idemgate-sealed";

pub struct Sealed {
    inner: Arc<dyn Store>,
    ring: Arc<KeyRing>,
    metrics: Arc<Metrics>,
    plaintext: PlaintextResponses,
    /// Which unreadable keys were logged lately (see [`LOG_EVERY`]).
    logged: Logged,
}

/// How often one key's unreadable record is logged at most: a client
/// retrying its 410 must not flood the log (review F10); the metric
/// counts every one.
const LOG_EVERY: Duration = Duration::from_secs(60);

/// Keys remembered as logged at most (about 100 bytes each); past it, a
/// key is logged at `debug` only until older ones age out.
const LOGGED_KEYS: usize = 1024;

/// The unreadable keys logged within the last [`LOG_EVERY`].
#[derive(Default)]
struct Logged(std::sync::Mutex<std::collections::HashMap<RecordKey, std::time::Instant>>);

impl Logged {
    /// Whether `key` is to be logged at `now`: not within [`LOG_EVERY`]
    /// of its last time, and room to remember it.
    fn first(&self, key: &RecordKey, now: std::time::Instant) -> bool {
        let mut seen = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let fresh = |at: &std::time::Instant| now.saturating_duration_since(*at) < LOG_EVERY;
        if seen.get(key).is_some_and(fresh) {
            return false;
        }
        if seen.len() >= LOGGED_KEYS && !seen.contains_key(key) {
            seen.retain(|_, at| fresh(at));
            if seen.len() >= LOGGED_KEYS {
                return false;
            }
        }
        seen.insert(*key, now);
        true
    }
}

impl Sealed {
    pub fn new(
        inner: Arc<dyn Store>,
        ring: Arc<KeyRing>,
        metrics: Arc<Metrics>,
        plaintext: PlaintextResponses,
    ) -> Self {
        Self {
            inner,
            ring,
            metrics,
            plaintext,
            logged: Logged::default(),
        }
    }

    fn seal(&self, key: &RecordKey, completion: &Completion) -> Completion {
        let Completion::Stored(resp) = completion else {
            return completion.clone();
        };
        Completion::Stored(seal_response(&self.ring, key, resp))
    }

    /// `record` as its request sees it: opened, or (when it cannot be)
    /// executed and not replayable.
    fn open(&self, key: &RecordKey, mut record: Record) -> Record {
        if let Err(e) = self.try_open(key, &mut record) {
            self.unreadable(key, &mut record, &e);
        }
        record
    }

    /// Opens `record` in place (one never sealed is left alone); when it
    /// does not open, leaves it as read and says why.
    fn try_open(&self, key: &RecordKey, record: &mut Record) -> Result<(), OpenError> {
        if let RecordState::Completed(resp) = &record.state {
            match open_response(&self.ring, key, resp)? {
                Some(opened) => record.state = RecordState::Completed(opened),
                None if self.plaintext == PlaintextResponses::Refuse => {
                    return Err(OpenError::Plaintext)
                }
                None => {}
            }
        }
        Ok(())
    }

    /// Makes `record`, which did not open, executed and not replayable:
    /// logged and counted.
    fn unreadable(&self, key: &RecordKey, record: &mut Record, e: &OpenError) {
        if self.logged.first(key, std::time::Instant::now()) {
            error!(key.id = %key.log_id(), error = %e,
                "a stored response could not be opened; its key is answered 410 and never executed again (logged once a minute per key)");
        } else {
            debug!(key.id = %key.log_id(), error = %e, "a stored response could not be opened");
        }
        self.metrics.sealed_unreadable(reason(e));
        if let RecordState::Completed(resp) = &record.state {
            record.state = RecordState::Unstored {
                status: resp.status,
            };
        }
    }

    /// Opens the record a claim found, in place, as [`Self::try_open`].
    fn try_open_outcome(
        &self,
        key: &RecordKey,
        outcome: &mut ClaimOutcome,
    ) -> Result<(), OpenError> {
        match outcome {
            ClaimOutcome::Existing(record) => self.try_open(key, record),
            _ => Ok(()),
        }
    }

    /// A claim's outcome as its request sees it, as [`Self::open`].
    fn open_outcome(&self, key: &RecordKey, mut outcome: ClaimOutcome) -> ClaimOutcome {
        match self.try_open_outcome(key, &mut outcome) {
            Ok(()) => outcome,
            Err(e) => self.refused(key, outcome, &e),
        }
    }

    /// A claim's outcome whose record did not open, as [`Self::unreadable`].
    fn refused(&self, key: &RecordKey, mut outcome: ClaimOutcome, e: &OpenError) -> ClaimOutcome {
        if let ClaimOutcome::Existing(record) = &mut outcome {
            self.unreadable(key, record, e);
        }
        outcome
    }
}

/// `resp` sealed for the record at `key`.
pub fn seal_response(ring: &KeyRing, key: &RecordKey, resp: &StoredResponse) -> StoredResponse {
    let headers = super::codec::encode_headers(&resp.headers);
    let binding = binding(key, resp.status);
    StoredResponse {
        status: resp.status,
        headers: vec![(
            SEALED_HEADER.to_string(),
            Bytes::copy_from_slice(ring.current_id().as_bytes()),
        )],
        body: Bytes::from(ring.seal(binding, &headers, &resp.body)),
    }
}

/// `resp` opened; `None` when it was never sealed (written before keys
/// were set).
pub fn open_response(
    ring: &KeyRing,
    key: &RecordKey,
    resp: &StoredResponse,
) -> Result<Option<StoredResponse>, OpenError> {
    if !is_sealed(resp) {
        return Ok(None);
    }
    let (headers, body) = ring.open(binding(key, resp.status), &resp.body)?;
    let headers = super::codec::decode_headers(&headers).map_err(|_| OpenError::Malformed)?;
    Ok(Some(StoredResponse {
        status: resp.status,
        headers,
        body,
    }))
}

/// Whether a stored response is a sealed one.
pub fn is_sealed(resp: &StoredResponse) -> bool {
    matches!(resp.headers.as_slice(), [(name, _)] if name == SEALED_HEADER)
}

fn binding(key: &RecordKey, status: u16) -> Binding<'_> {
    Binding {
        scope: &key.scope.0,
        key: &key.key,
        status,
    }
}

fn reason(e: &OpenError) -> &'static str {
    match e {
        OpenError::UnknownKey(_) => "unknown_key",
        OpenError::Malformed => "malformed",
        OpenError::Forged(_) => "forged",
        OpenError::Plaintext => "plaintext",
    }
}

#[async_trait]
impl Store for Sealed {
    /// A record that does not open is claimed again from the authority
    /// (see the module docs): a 410 only when its copy does not open either.
    async fn claim(&self, claim: &Claim) -> Result<ClaimOutcome, StoreError> {
        let key = &claim.key;
        let mut outcome = self.inner.claim(claim).await?;
        let Err(e) = self.try_open_outcome(key, &mut outcome) else {
            return Ok(outcome);
        };
        let Some(mut again) = self.inner.claim_authoritative(claim).await? else {
            return Ok(self.refused(key, outcome, &e));
        };
        match self.try_open_outcome(key, &mut again) {
            Ok(()) => {
                warn!(key.id = %key.log_id(), error = %e,
                    "a fast-path copy of a stored response did not open; answered from the store's own copy, which replaces it");
                Ok(again)
            }
            Err(e) => Ok(self.refused(key, again, &e)),
        }
    }

    async fn claim_authoritative(&self, claim: &Claim) -> Result<Option<ClaimOutcome>, StoreError> {
        let again = self.inner.claim_authoritative(claim).await?;
        Ok(again.map(|outcome| self.open_outcome(&claim.key, outcome)))
    }

    async fn renew(
        &self,
        key: &RecordKey,
        token: &LeaseToken,
        lease: Span,
    ) -> Result<Fence, StoreError> {
        self.inner.renew(key, token, lease).await
    }

    async fn complete(
        &self,
        key: &RecordKey,
        token: &LeaseToken,
        completion: &Completion,
        keep: Span,
    ) -> Result<Fence, StoreError> {
        let sealed = self.seal(key, completion);
        self.inner.complete(key, token, &sealed, keep).await
    }

    async fn release(&self, key: &RecordKey, token: &LeaseToken) -> Result<Fence, StoreError> {
        self.inner.release(key, token).await
    }

    async fn get(&self, key: &RecordKey) -> Result<Option<Record>, StoreError> {
        Ok(self.inner.get(key).await?.map(|r| self.open(key, r)))
    }

    async fn delete(&self, key: &RecordKey) -> Result<bool, StoreError> {
        self.inner.delete(key).await
    }

    async fn resolve(
        &self,
        key: &RecordKey,
        verdict: &Verdict,
        now: UnixMillis,
    ) -> Result<bool, StoreError> {
        self.inner.resolve(key, verdict, now).await
    }

    async fn resolution(&self, key: &RecordKey) -> Result<Option<Resolution>, StoreError> {
        self.inner.resolution(key).await
    }

    async fn sweep(&self, now: UnixMillis, batch: u32) -> Result<u64, StoreError> {
        self.inner.sweep(now, batch).await
    }

    /// Records as stored, not opened: a key rotation (`keys reencrypt`)
    /// reads the sealed bytes to compare and set them.
    async fn scan_completed(
        &self,
        after: Option<RecordKey>,
        limit: u32,
        now: UnixMillis,
    ) -> Result<Vec<(RecordKey, Record)>, StoreError> {
        self.inner.scan_completed(after, limit, now).await
    }

    /// `old` and `new` as stored (sealed by the caller, see
    /// [`seal_response`]): passed through unchanged.
    async fn rewrite_response(
        &self,
        key: &RecordKey,
        old: &StoredResponse,
        new: &StoredResponse,
    ) -> Result<bool, StoreError> {
        self.inner.rewrite_response(key, old, new).await
    }

    async fn ping(&self) -> Result<(), StoreError> {
        self.inner.ping().await
    }

    fn backend(&self) -> &'static str {
        self.inner.backend()
    }

    fn call_bound(&self) -> Duration {
        self.inner.call_bound()
    }

    fn degraded(&self) -> Option<String> {
        self.inner.degraded()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Review F10: a client retrying the 410 of an unreadable record
    /// logged an error on every claim. Logged once per key per
    /// [`LOG_EVERY`], in bounded memory.
    #[test]
    fn an_unreadable_key_is_logged_once_a_minute_in_bounded_memory() {
        let logged = Logged::default();
        let t0 = std::time::Instant::now();
        let key = |n: u32| RecordKey {
            scope: crate::idempotency::Scope([0; 32]),
            key: {
                let mut k = [0; 32];
                k[..4].copy_from_slice(&n.to_be_bytes());
                k
            },
        };
        assert!(logged.first(&key(0), t0));
        for s in 1..60 {
            let at = t0 + Duration::from_secs(s);
            assert!(!logged.first(&key(0), at), "again after {s} s");
        }
        assert!(
            logged.first(&key(0), t0 + LOG_EVERY),
            "once the minute is over"
        );
        // Other keys are their own; past the bound, none is remembered
        // (nor logged) until older ones age out.
        for n in 1..LOGGED_KEYS as u32 {
            assert!(logged.first(&key(n), t0 + LOG_EVERY));
        }
        assert!(!logged.first(&key(u32::MAX), t0 + LOG_EVERY));
        assert_eq!(logged.0.lock().unwrap().len(), LOGGED_KEYS);
        assert!(logged.first(&key(u32::MAX), t0 + LOG_EVERY * 2));
        assert!(logged.0.lock().unwrap().len() <= LOGGED_KEYS);
    }
    use crate::idempotency::Scope;
    use crate::store::memory::MemoryStore;
    use crate::store::sample_claim;

    fn ring(list: &[(&str, u8)]) -> Arc<KeyRing> {
        Arc::new(crate::idempotency::vault::test_ring(list))
    }

    fn response() -> StoredResponse {
        StoredResponse {
            status: 201,
            headers: vec![("location".into(), Bytes::from_static(b"/orders/1"))],
            body: Bytes::from_static(b"{\"card\":\"4242424242424242\"}"),
        }
    }

    #[tokio::test]
    async fn a_completion_is_stored_sealed_and_read_back_opened() {
        let backend: Arc<dyn Store> = Arc::new(MemoryStore::new());
        let metrics = Arc::new(Metrics::new());
        let sealed = Sealed::new(
            backend.clone(),
            ring(&[("k1", 1)]),
            metrics.clone(),
            PlaintextResponses::Replay,
        );
        let c = sample_claim();
        assert!(matches!(
            sealed.claim(&c).await.unwrap(),
            ClaimOutcome::Claimed { .. }
        ));
        let done = Completion::Stored(response());
        let fence = sealed
            .complete(
                &c.key,
                &c.token,
                &done,
                Span {
                    now: c.now,
                    ms: 1000,
                },
            )
            .await
            .unwrap();
        assert_eq!(fence, Fence::Held);
        // What the backend holds: ciphertext under the marker, no byte of the body.
        let raw = backend.get(&c.key).await.unwrap().unwrap();
        let RecordState::Completed(stored) = &raw.state else {
            panic!("{raw:?}")
        };
        assert!(is_sealed(stored));
        assert_eq!(stored.headers[0].1, "k1");
        assert!(!stored.body.windows(4).any(|w| w == b"4242"));
        // What the request sees.
        let seen = sealed.get(&c.key).await.unwrap().unwrap();
        assert_eq!(seen.state, RecordState::Completed(response()));
        let retry = Claim {
            token: LeaseToken([7; 16]),
            now: c.now + 1,
            ..sample_claim()
        };
        let ClaimOutcome::Existing(again) = sealed.claim(&retry).await.unwrap() else {
            panic!("a second claim finds the record")
        };
        assert_eq!(again.state, RecordState::Completed(response()));
    }

    /// Claims answered from a copy, as the Redis fast path answers them,
    /// and from the authority when asked again; nothing else is called.
    struct WithCopy {
        copy: MemoryStore,
        authority: MemoryStore,
    }

    #[async_trait]
    impl Store for WithCopy {
        async fn claim(&self, claim: &Claim) -> Result<ClaimOutcome, StoreError> {
            self.copy.claim(claim).await
        }
        async fn claim_authoritative(
            &self,
            claim: &Claim,
        ) -> Result<Option<ClaimOutcome>, StoreError> {
            self.authority.claim(claim).await.map(Some)
        }
        async fn renew(&self, _: &RecordKey, _: &LeaseToken, _: Span) -> Result<Fence, StoreError> {
            unreachable!()
        }
        async fn complete(
            &self,
            _: &RecordKey,
            _: &LeaseToken,
            _: &Completion,
            _: Span,
        ) -> Result<Fence, StoreError> {
            unreachable!()
        }
        async fn release(&self, _: &RecordKey, _: &LeaseToken) -> Result<Fence, StoreError> {
            unreachable!()
        }
        async fn get(&self, _: &RecordKey) -> Result<Option<Record>, StoreError> {
            unreachable!()
        }
        async fn delete(&self, _: &RecordKey) -> Result<bool, StoreError> {
            unreachable!()
        }
        async fn resolve(
            &self,
            _: &RecordKey,
            _: &Verdict,
            _: UnixMillis,
        ) -> Result<bool, StoreError> {
            unreachable!()
        }
        async fn resolution(&self, _: &RecordKey) -> Result<Option<Resolution>, StoreError> {
            unreachable!()
        }
        async fn sweep(&self, _: UnixMillis, _: u32) -> Result<u64, StoreError> {
            unreachable!()
        }
        async fn scan_completed(
            &self,
            _: Option<RecordKey>,
            _: u32,
            _: UnixMillis,
        ) -> Result<Vec<(RecordKey, Record)>, StoreError> {
            unreachable!()
        }
        async fn rewrite_response(
            &self,
            _: &RecordKey,
            _: &StoredResponse,
            _: &StoredResponse,
        ) -> Result<bool, StoreError> {
            unreachable!()
        }
        async fn ping(&self) -> Result<(), StoreError> {
            unreachable!()
        }
        fn backend(&self) -> &'static str {
            "with-copy"
        }
        fn call_bound(&self) -> Duration {
            Duration::from_secs(1)
        }
    }

    /// Completes `c` in `store` with `resp` as stored.
    async fn stored(store: &MemoryStore, c: &Claim, resp: StoredResponse) {
        assert!(matches!(
            store.claim(c).await.unwrap(),
            ClaimOutcome::Claimed { .. }
        ));
        let keep = Span { now: c.now, ms: 1 };
        let done = Completion::Stored(resp);
        store.complete(&c.key, &c.token, &done, keep).await.unwrap();
    }

    /// A copy that does not open (under a removed key, or altered) gives
    /// way to the authority's, which replays; only when the authority's
    /// does not open either is the key unreadable, counted once.
    #[tokio::test]
    async fn a_copy_that_does_not_open_gives_way_to_the_authoritys() {
        let c = sample_claim();
        let retry = Claim {
            token: LeaseToken([7; 16]),
            now: c.now + 1,
            ..sample_claim()
        };
        let (old, new) = (ring(&[("old", 1)]), ring(&[("new", 2)]));
        let under_new = seal_response(&new, &c.key, &response());
        let mut altered = under_new.clone();
        let mut body = altered.body.to_vec();
        body[20] ^= 1;
        altered.body = Bytes::from(body);
        // (copy, authority's) -> state seen, unreadable counted
        let cases = [
            (
                seal_response(&old, &c.key, &response()),
                under_new.clone(),
                RecordState::Completed(response()),
                0,
            ),
            (
                altered.clone(),
                under_new.clone(),
                RecordState::Completed(response()),
                0,
            ),
            (
                altered.clone(),
                altered.clone(),
                RecordState::Unstored { status: 201 },
                1,
            ),
        ];
        for (i, (copy, authority, want, counted)) in cases.into_iter().enumerate() {
            let both = WithCopy {
                copy: MemoryStore::new(),
                authority: MemoryStore::new(),
            };
            stored(&both.copy, &c, copy).await;
            stored(&both.authority, &c, authority).await;
            let metrics = Arc::new(Metrics::new());
            let sealed = Sealed::new(
                Arc::new(both),
                new.clone(),
                metrics.clone(),
                PlaintextResponses::Replay,
            );
            let ClaimOutcome::Existing(seen) = sealed.claim(&retry).await.unwrap() else {
                panic!("case {i}: a retry finds the record")
            };
            assert_eq!(seen.state, want, "case {i}");
            let text = metrics.encode();
            let total: u64 = text
                .lines()
                .filter(|l| l.starts_with("idemgate_sealed_unreadable_total{"))
                .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
                .sum();
            assert_eq!(total, counted, "case {i}: {text}");
        }
    }

    #[test]
    fn what_does_not_open_is_not_replayable_and_a_plain_record_is_left_alone() {
        let metrics = Arc::new(Metrics::new());
        let key = sample_claim().key;
        let other = RecordKey {
            scope: Scope([9; 32]),
            ..key
        };
        let sealed = seal_response(&ring(&[("old", 1)]), &key, &response());
        let store = |list: &[(&str, u8)]| {
            let replay = PlaintextResponses::Replay;
            Sealed::new(
                Arc::new(MemoryStore::new()),
                ring(list),
                metrics.clone(),
                replay,
            )
        };
        // Pins review finding F1 (2026-12-06): with keys set, a plaintext
        // record written into the store by anyone was replayed as it was.
        let strict = Sealed::new(
            Arc::new(MemoryStore::new()),
            ring(&[("old", 1)]),
            metrics.clone(),
            PlaintextResponses::Refuse,
        );
        let record = |resp: StoredResponse| Record {
            fingerprint: sample_claim().fingerprint,
            state: RecordState::Completed(resp),
            created_at: 1_000,
            expires_at: 90_000_000,
            first_use: None,
        };
        let unstored = RecordState::Unstored { status: 201 };
        // (store's keys, record key, response) -> state seen
        let cases = [
            (
                store(&[("new", 2), ("old", 1)]),
                key,
                sealed.clone(),
                RecordState::Completed(response()),
            ),
            (store(&[("new", 2)]), key, sealed.clone(), unstored.clone()),
            (store(&[("old", 9)]), key, sealed.clone(), unstored.clone()),
            (
                store(&[("old", 1)]),
                other,
                sealed.clone(),
                unstored.clone(),
            ),
            (
                store(&[("old", 1)]),
                key,
                response(),
                RecordState::Completed(response()),
            ),
            (strict, key, response(), unstored.clone()),
        ];
        for (i, (s, k, resp, want)) in cases.into_iter().enumerate() {
            assert_eq!(s.open(&k, record(resp)).state, want, "case {i}");
        }
        let text = metrics.encode();
        assert!(
            text.contains("idemgate_sealed_unreadable_total{reason=\"unknown_key\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("idemgate_sealed_unreadable_total{reason=\"forged\"} 2"),
            "{text}"
        );
        assert!(
            text.contains("idemgate_sealed_unreadable_total{reason=\"plaintext\"} 1"),
            "{text}"
        );
    }
}
