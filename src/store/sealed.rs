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
//! it was.

use super::{
    Claim, ClaimOutcome, Completion, Fence, LeaseToken, Record, RecordState, Resolution, Span,
    Store, StoreError, StoredResponse, UnixMillis, Verdict,
};
use crate::idempotency::vault::{Binding, KeyRing, OpenError};
use crate::idempotency::RecordKey;
use crate::metrics::Metrics;
use async_trait::async_trait;
use bytes::Bytes;
use std::sync::Arc;
use std::time::Duration;
use tracing::error;

/// The stored "header" that marks a sealed response: a pseudo-header name
/// (leading `:`), which no HTTP/1 field and no stored HTTP/2 field has.
pub const SEALED_HEADER: &str = ":idemgate-sealed";

pub struct Sealed {
    inner: Arc<dyn Store>,
    ring: Arc<KeyRing>,
    metrics: Arc<Metrics>,
}

impl Sealed {
    pub fn new(inner: Arc<dyn Store>, ring: Arc<KeyRing>, metrics: Arc<Metrics>) -> Self {
        Self {
            inner,
            ring,
            metrics,
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
        if let RecordState::Completed(resp) = &record.state {
            match open_response(&self.ring, key, resp) {
                Ok(Some(opened)) => record.state = RecordState::Completed(opened),
                Ok(None) => {}
                Err(e) => {
                    error!(key.id = %key.log_id(), error = %e,
                        "a stored response could not be opened; its key is answered 410 and never executed again");
                    self.metrics.sealed_unreadable(reason(&e));
                    record.state = RecordState::Unstored {
                        status: resp.status,
                    };
                }
            }
        }
        record
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
    }
}

#[async_trait]
impl Store for Sealed {
    async fn claim(&self, claim: &Claim) -> Result<ClaimOutcome, StoreError> {
        Ok(match self.inner.claim(claim).await? {
            ClaimOutcome::Existing(record) => ClaimOutcome::Existing(self.open(&claim.key, record)),
            claimed => claimed,
        })
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
        let sealed = Sealed::new(backend.clone(), ring(&[("k1", 1)]), metrics.clone());
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
            Sealed::new(Arc::new(MemoryStore::new()), ring(list), metrics.clone())
        };
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
    }
}
