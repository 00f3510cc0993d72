//! Key rotation over the stored records (`IDEMGATE_STORE_ENCRYPTION_KEYS`):
//! what one stored response needs under the configured keys ([`plan`], pure),
//! the pass that rewrites every live one to the current key
//! ([`reencrypt`], `idemgate keys reencrypt`), and the count of records by
//! key id that `check-config --connect` prints ([`census`]).
//!
//! The pass pages through [`Store::scan_completed`] by primary key and
//! rewrites each record with [`Store::rewrite_response`], a compare-and-set
//! on the bytes it read: beside live traffic, a record completed, taken
//! over or deleted since the read is left as it now is (a proxy with the
//! same keys seals new completions under the current key already). A rerun
//! starts again and skips what is current, or continues from a cursor.

use super::sealed::{is_sealed, open_response, seal_response};
use super::{RecordState, Store, StoreError, StoredResponse, UnixMillis};
use crate::idempotency::vault::{KeyRing, OpenError};
use crate::idempotency::RecordKey;
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// What one stored response needs.
#[derive(Debug, PartialEq, Eq)]
pub enum Plan {
    /// Sealed under the current key already.
    Current,
    /// Sealed under another configured key, or never sealed: this is it
    /// sealed under the current key.
    Rewrite(StoredResponse),
    /// Sealed, but it opens under no configured key: left alone (it reads
    /// as 410 whatever is done).
    Unreadable(OpenError),
}

/// The key id a stored response is sealed under (the value of its one
/// header, [`super::sealed::SEALED_HEADER`]); `None` for a plaintext one.
pub fn sealed_under(resp: &StoredResponse) -> Option<String> {
    is_sealed(resp).then(|| String::from_utf8_lossy(&resp.headers[0].1).into_owned())
}

/// What the response stored at `key` needs under `ring`.
pub fn plan(ring: &KeyRing, key: &RecordKey, stored: &StoredResponse) -> Plan {
    if sealed_under(stored).as_deref() == Some(ring.current_id()) {
        return Plan::Current;
    }
    match open_response(ring, key, stored) {
        Ok(Some(opened)) => Plan::Rewrite(seal_response(ring, key, &opened)),
        Ok(None) => Plan::Rewrite(seal_response(ring, key, stored)),
        Err(e) => Plan::Unreadable(e),
    }
}

/// How a [`reencrypt`] pass went.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Tally {
    pub scanned: u64,
    pub current: u64,
    pub rewritten: u64,
    /// Read, then changed by live traffic before the rewrite: left as it is.
    pub changed: u64,
    /// Of `rewritten`, those whose Redis copy (the same response, under the
    /// old key) could not be removed, Redis not answering: left to expire.
    /// Nothing to do by hand: once the old key is removed such a copy does
    /// not open, and a proxy answers from the store's copy, which replaces
    /// it ([`super::sealed`]).
    pub copies_left: u64,
    /// `(key.id, why)` of each record no configured key opens.
    pub unreadable: Vec<(String, OpenError)>,
    /// The last key scanned: a rerun with it as the cursor continues after it.
    pub cursor: Option<RecordKey>,
}

/// Rewrites every live completed record after `after` that is not sealed
/// under `ring`'s current key, `batch` at a time; `progress` is told the
/// tally after each page.
pub async fn reencrypt(
    store: &dyn Store,
    ring: &KeyRing,
    batch: u32,
    after: Option<RecordKey>,
    now: impl Fn() -> UnixMillis,
    mut progress: impl FnMut(&Tally),
) -> Result<Tally, StoreError> {
    let mut tally = Tally {
        cursor: after,
        ..Tally::default()
    };
    loop {
        let page = store.scan_completed(tally.cursor, batch, now()).await?;
        let last_page = page.len() < batch as usize;
        for (key, record) in page {
            tally.scanned += 1;
            tally.cursor = Some(key);
            let RecordState::Completed(stored) = &record.state else {
                continue;
            };
            match plan(ring, &key, stored) {
                Plan::Current => tally.current += 1,
                Plan::Unreadable(e) => tally.unreadable.push((key.log_id(), e)),
                Plan::Rewrite(new) => match store.rewrite_response(&key, stored, &new).await {
                    Ok(true) => tally.rewritten += 1,
                    Ok(false) => tally.changed += 1,
                    Err(StoreError::StaleCopy { .. }) => {
                        tally.rewritten += 1;
                        tally.copies_left += 1;
                    }
                    Err(err) => return Err(err),
                },
            }
        }
        progress(&tally);
        if last_page {
            return Ok(tally);
        }
    }
}

/// Live sealed records by key id, as `check-config --connect` reports them.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Census {
    /// Key id -> records sealed under it.
    pub by_key: BTreeMap<String, u64>,
    /// Records stored before keys were set.
    pub plaintext: u64,
    /// False when the scan stopped at its row or time bound.
    pub complete: bool,
    pub scanned: u64,
}

/// Counts live completed records by the key id they are sealed under, up
/// to `max_rows` rows or `max_time`, whichever comes first.
pub async fn census(
    store: &dyn Store,
    now: UnixMillis,
    max_rows: u64,
    max_time: Duration,
) -> Result<Census, StoreError> {
    const PAGE: u32 = 1000;
    let started = Instant::now();
    let mut census = Census::default();
    let mut cursor = None;
    loop {
        if census.scanned >= max_rows || started.elapsed() >= max_time {
            return Ok(census);
        }
        let limit = PAGE.min(u32::try_from(max_rows - census.scanned).unwrap_or(PAGE));
        let page = store.scan_completed(cursor, limit, now).await?;
        let last_page = page.len() < limit as usize;
        for (key, record) in page {
            census.scanned += 1;
            cursor = Some(key);
            if let RecordState::Completed(stored) = &record.state {
                match sealed_under(stored) {
                    Some(id) => *census.by_key.entry(id).or_default() += 1,
                    None => census.plaintext += 1,
                }
            }
        }
        if last_page {
            census.complete = true;
            return Ok(census);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::idempotency::Scope;
    use crate::store::memory::MemoryStore;
    use crate::store::{Claim, Completion, FirstUse, LeaseToken, Span};
    use bytes::Bytes;

    fn ring(list: &[(&str, u8)]) -> KeyRing {
        crate::idempotency::vault::test_ring(list)
    }

    fn response(n: u8) -> StoredResponse {
        StoredResponse {
            status: 201,
            headers: vec![("location".into(), Bytes::from(format!("/orders/{n}")))],
            body: Bytes::from(format!("{{\"order\":{n}}}")),
        }
    }

    fn key(n: u8) -> RecordKey {
        RecordKey {
            scope: Scope([1; 32]),
            key: [n; 32],
        }
    }

    /// `plan` for each kind of stored response; a rewrite opens under the
    /// new key alone to the response that was stored.
    #[test]
    fn each_stored_response_gets_what_it_needs() {
        let (old, new, both) = (
            ring(&[("old", 1)]),
            ring(&[("new", 2)]),
            ring(&[("new", 2), ("old", 1)]),
        );
        let k = key(1);
        let plain = response(1);
        let under_old = seal_response(&old, &k, &plain);
        let under_new = seal_response(&new, &k, &plain);
        let moved = seal_response(&old, &key(2), &plain);
        // (stored, ring) -> Some(rewrite) | None (current) | Err(unreadable)
        let cases: [(&StoredResponse, &KeyRing, Result<bool, OpenError>); 5] = [
            (&under_new, &both, Ok(false)),
            (&under_old, &both, Ok(true)),
            (&plain, &both, Ok(true)),
            (&under_old, &new, Err(OpenError::UnknownKey("old".into()))),
            (&moved, &both, Err(OpenError::Forged("old".into()))),
        ];
        for (i, (stored, ring, want)) in cases.into_iter().enumerate() {
            match (plan(ring, &k, stored), want) {
                (Plan::Current, Ok(false)) => {}
                (Plan::Rewrite(sealed), Ok(true)) => {
                    assert_eq!(sealed_under(&sealed).as_deref(), Some("new"), "case {i}");
                    let opened = open_response(&new, &k, &sealed).unwrap();
                    assert_eq!(opened, Some(plain.clone()), "case {i}");
                }
                (Plan::Unreadable(e), Err(want)) => assert_eq!(e, want, "case {i}"),
                (got, want) => panic!("case {i}: {got:?}, wanted {want:?}"),
            }
        }
    }

    async fn complete(store: &MemoryStore, k: RecordKey, resp: StoredResponse) {
        let claim = Claim {
            key: k,
            fingerprint: crate::idempotency::Fingerprint([3; 32]),
            token: LeaseToken([k.key[0]; 16]),
            now: 1_000,
            lease_ms: 30_000,
            ttl_ms: 86_400_000,
            first_use: Some(FirstUse::new("POST", "/orders")),
        };
        store.claim(&claim).await.unwrap();
        let keep = Span { now: 1_000, ms: 1 };
        let done = Completion::Stored(resp);
        store.complete(&k, &claim.token, &done, keep).await.unwrap();
    }

    fn stored(record: Option<crate::store::Record>) -> StoredResponse {
        match record.map(|r| r.state) {
            Some(RecordState::Completed(resp)) => resp,
            other => panic!("{other:?}"),
        }
    }

    /// Records under the old key, plaintext and one under a removed key:
    /// after the pass (pages of 2) every readable one is under the new key
    /// and opens to what was stored; the unreadable one is reported and
    /// left alone; a second pass finds nothing to do; the census agrees.
    #[tokio::test]
    async fn a_pass_moves_every_readable_record_to_the_current_key() {
        let store = MemoryStore::new();
        let (old, gone) = (ring(&[("old", 1)]), ring(&[("gone", 9)]));
        let both = ring(&[("new", 2), ("old", 1)]);
        for n in 1..=4 {
            complete(&store, key(n), seal_response(&old, &key(n), &response(n))).await;
        }
        complete(&store, key(5), response(5)).await;
        let lost = seal_response(&gone, &key(6), &response(6));
        complete(&store, key(6), lost.clone()).await;

        let census_before = census(&store, 2_000, 100, Duration::from_secs(5)).await;
        let census_before = census_before.unwrap();
        assert_eq!(
            census_before.by_key,
            BTreeMap::from([("gone".into(), 1), ("old".into(), 4)])
        );
        assert_eq!((census_before.plaintext, census_before.complete), (1, true));

        let mut pages = 0;
        let tally = reencrypt(&store, &both, 2, None, || 2_000, |_| pages += 1)
            .await
            .unwrap();
        assert_eq!(pages, 4, "three full pages of 2, then an empty one");
        assert_eq!(
            (tally.scanned, tally.rewritten, tally.current, tally.changed),
            (6, 5, 0, 0)
        );
        assert_eq!(
            tally.unreadable,
            vec![(key(6).log_id(), OpenError::UnknownKey("gone".into()))]
        );
        let new_only = ring(&[("new", 2)]);
        for n in 1..=5 {
            let resp = stored(store.get(&key(n)).await.unwrap());
            assert_eq!(
                open_response(&new_only, &key(n), &resp).unwrap(),
                Some(response(n))
            );
        }
        assert_eq!(stored(store.get(&key(6)).await.unwrap()), lost);

        let again = reencrypt(&store, &both, 500, None, || 2_000, |_| {})
            .await
            .unwrap();
        assert_eq!((again.current, again.rewritten), (5, 0));
        // From a cursor: only what comes after it.
        let rest = reencrypt(&store, &both, 500, Some(key(4)), || 2_000, |_| {})
            .await
            .unwrap();
        assert_eq!(rest.scanned, 2);

        let bounded = census(&store, 2_000, 1, Duration::from_secs(5)).await;
        assert!(!bounded.unwrap().complete, "stopped at its row bound");
    }
}
