//! The store contract: one body, run against every backend (memory, SQLite,
//! PostgreSQL, PostgreSQL behind the Redis fast path), plus the failure
//! behaviour of the networked backends (Redis killed and restarted,
//! PostgreSQL cut off by a relay and restored).
//!
//! Time is the real clock with short leases and ttls, because Redis expires
//! its copies on its own clock; every wait is bounded.

use crate::support;
use crate::support::services::{
    database_url, drop_schema, pg_store_config, redis_url, require_postgres, require_redis,
    unique_schema, PrivateRedis, RedisPrefix, TcpRelay,
};
use bytes::Bytes;
use idemgate::config::{RedisConfig, SqliteSync};
use idemgate::idempotency::{Fingerprint, RecordKey, Scope};
use idemgate::store::memory::MemoryStore;
use idemgate::store::postgres::PostgresStore;
use idemgate::store::redis::{FastPathCounters, RedisFastPath};
use idemgate::store::sqlite::SqliteStore;
use idemgate::store::{
    Claim, ClaimOutcome, Completion, Fence, FirstUse, LeaseToken, Record, RecordState, Span, Store,
    StoreError, StoredResponse, Verdict, RESOLVED_STATUS,
};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

const LEASE_MS: i64 = 10_000;
/// How far ahead `later` (see [`run_contract`]) is.
pub(crate) const LATER_MS: i64 = 5_000;

fn now_millis() -> i64 {
    idemgate::clock::Clock::system().now_millis()
}

/// How far a backend that judges time by its own clock (PostgreSQL) may
/// read "now" apart from the caller: the latency of one statement.
const SLACK_MS: i64 = 1_000;

fn assert_near(got: i64, want: i64, what: &str) {
    assert!((got - want).abs() <= SLACK_MS, "{what}: {got} vs {want}");
}

/// `got` is `want`, its times within [`SLACK_MS`].
fn assert_same_record(got: &Record, want: &Record) {
    assert_eq!(got.fingerprint, want.fingerprint);
    match (&got.state, &want.state) {
        (
            RecordState::InFlight { locked_until: got },
            RecordState::InFlight { locked_until: want },
        ) => assert_near(*got, *want, "locked_until"),
        (got, want) => assert_eq!(got, want),
    }
    assert_near(got.created_at, want.created_at, "created_at");
    assert_near(got.expires_at, want.expires_at, "expires_at");
    assert_eq!(got.first_use, want.first_use);
}

/// `ms` from now, by the caller's clock.
fn span(ms: i64) -> Span {
    Span {
        now: now_millis(),
        ms,
    }
}

/// A completion that keeps the claim's own expiry.
fn keep() -> Span {
    span(1)
}
const TTL_MS: i64 = 60_000;

// ===== helpers =====

fn record_key() -> RecordKey {
    RecordKey {
        scope: Scope(rand::random()),
        key: rand::random(),
    }
}

fn claim_for(key: RecordKey, lease_ms: i64, ttl_ms: i64) -> Claim {
    Claim {
        key,
        fingerprint: Fingerprint(rand::random()),
        token: LeaseToken::random(),
        now: now_millis(),
        lease_ms,
        ttl_ms,
        first_use: Some(FirstUse::new(
            "POST",
            &format!("/orders/{}", rand::random::<u32>()),
        )),
    }
}

/// A fresh claim on the same key (new token, same fingerprint, now).
fn again(c: &Claim) -> Claim {
    Claim {
        token: LeaseToken::random(),
        now: now_millis(),
        ..c.clone()
    }
}

fn response() -> StoredResponse {
    StoredResponse {
        status: 201,
        headers: vec![
            ("location".into(), Bytes::from_static(b"/orders/7")),
            ("set-cookie".into(), Bytes::from_static(b"a=1")),
            ("set-cookie".into(), Bytes::from_static(b"b=2")),
            ("x-bin".into(), Bytes::from_static(b"\xff\x00\x80")),
        ],
        body: Bytes::from_static(b"{\"id\":7}\x00\xff\xfe binary tail"),
    }
}

fn claimed(outcome: &ClaimOutcome) -> bool {
    matches!(outcome, ClaimOutcome::Claimed { .. })
}

fn existing(outcome: ClaimOutcome) -> Record {
    match outcome {
        ClaimOutcome::Existing(r) => r,
        other => panic!("expected an existing record, got {other:?}"),
    }
}

async fn sleep_ms(ms: u64) {
    tokio::time::sleep(Duration::from_millis(ms)).await;
}

// ===== the contract =====

/// `later` is the same store seen 5 s ahead (where the backend judges time
/// by its own clock, a handle whose clock is offset; otherwise `store`).
pub(crate) async fn run_contract(store: Arc<dyn Store>, later: Arc<dyn Store>) {
    // Sweep first: it is store-wide, so the other cases' records must not count.
    sweep_deletes_only_expired_and_respects_batch(&*store, &*later).await;
    new_key_claims(&*store).await;
    duplicate_claim_reports_in_flight(&*store).await;
    concurrent_claims_have_one_winner(store.clone()).await;
    takeover_after_lease_fences_old_holder(&*store).await;
    an_abandoned_claim_is_taken_over_only_by_the_same_request(&*store).await;
    complete_stores_exactly(&*store).await;
    release_frees_the_key(&*store).await;
    expired_record_is_claimable_again(&*store).await;
    first_use_is_kept_with_the_record(&*store).await;
    live_lease_outlives_the_ttl(&*store).await;
    unstored_completion(&*store).await;
    delete_removes_any_record(&*store).await;
    resolve_settles_only_live_outcome_unknown_records(&*store).await;
    scan_pages_live_completed_records_in_key_order(&*store).await;
    rewrite_is_a_compare_and_set(&*store).await;
    an_authoritative_claim_agrees_with_the_claim(&*store).await;
    store.ping().await.expect("ping");
}

async fn new_key_claims(store: &dyn Store) {
    let c = claim_for(record_key(), LEASE_MS, TTL_MS);
    assert_eq!(
        store.claim(&c).await.unwrap(),
        ClaimOutcome::Claimed { takeover: false }
    );
    let r = store.get(&c.key).await.unwrap().expect("claimed record");
    let want = Record {
        fingerprint: c.fingerprint,
        state: RecordState::InFlight {
            locked_until: c.locked_until(),
        },
        created_at: c.now,
        expires_at: c.expires_at(),
        first_use: c.first_use.clone(),
    };
    assert_same_record(&r, &want);
}

async fn duplicate_claim_reports_in_flight(store: &dyn Store) {
    let first = claim_for(record_key(), LEASE_MS, TTL_MS);
    assert!(claimed(&store.claim(&first).await.unwrap()));
    let mut second = again(&first);
    second.fingerprint = Fingerprint(rand::random());
    second.first_use = Some(FirstUse::new("PUT", "/elsewhere"));
    let r = existing(store.claim(&second).await.unwrap());
    // The record's fingerprint and first use are the holder's, so the
    // caller can 422 saying what the key was first used for.
    assert_eq!(r.fingerprint, first.fingerprint);
    assert_eq!(r.first_use, first.first_use);
    match r.state {
        // A cache may derive locked_until from its own ttl: allow clock slack.
        RecordState::InFlight { locked_until } => assert!(
            locked_until > second.now && locked_until <= first.locked_until() + 50,
            "locked_until {locked_until} vs {}",
            first.locked_until()
        ),
        other => panic!("expected in flight, got {other:?}"),
    }
}

async fn concurrent_claims_have_one_winner(store: Arc<dyn Store>) {
    let key = record_key();
    let base = claim_for(key, LEASE_MS, TTL_MS);
    let barrier = Arc::new(tokio::sync::Barrier::new(24));
    let tasks: Vec<_> = (0..24)
        .map(|_| {
            let (store, barrier, c) = (store.clone(), barrier.clone(), again(&base));
            tokio::spawn(async move {
                barrier.wait().await;
                store.claim(&c).await
            })
        })
        .collect();
    let mut winners = 0;
    for t in tasks {
        match t.await.unwrap().unwrap() {
            ClaimOutcome::Claimed { takeover } => {
                assert!(!takeover);
                winners += 1;
            }
            ClaimOutcome::Existing(r) => {
                assert!(matches!(r.state, RecordState::InFlight { .. }), "{r:?}");
                assert_eq!(r.fingerprint, base.fingerprint);
            }
        }
    }
    assert_eq!(winners, 1, "exactly one of 24 concurrent claims wins");
}

async fn takeover_after_lease_fences_old_holder(store: &dyn Store) {
    let old = claim_for(record_key(), 300, TTL_MS);
    assert!(claimed(&store.claim(&old).await.unwrap()));
    sleep_ms(450).await;
    // The same request retried (only it may take an abandoned claim over).
    let new = Claim {
        lease_ms: LEASE_MS,
        ..again(&old)
    };
    assert_eq!(
        store.claim(&new).await.unwrap(),
        ClaimOutcome::Claimed { takeover: true }
    );
    let done = Completion::Stored(response());
    assert_eq!(
        store
            .complete(&old.key, &old.token, &done, keep())
            .await
            .unwrap(),
        Fence::Lost
    );
    assert_eq!(
        store
            .renew(&old.key, &old.token, span(LEASE_MS))
            .await
            .unwrap(),
        Fence::Lost
    );
    assert_eq!(
        store.release(&old.key, &old.token).await.unwrap(),
        Fence::Lost
    );
    let r = store
        .get(&new.key)
        .await
        .unwrap()
        .expect("new holder's record");
    assert_eq!(r.fingerprint, new.fingerprint);
    match r.state {
        RecordState::InFlight { locked_until } => {
            assert_near(locked_until, new.locked_until(), "locked_until")
        }
        other => panic!("{other:?}"),
    }
    // The new holder's own fence still holds, and a duplicate still sees it.
    assert_eq!(
        store
            .renew(&new.key, &new.token, span(LEASE_MS + 1000))
            .await
            .unwrap(),
        Fence::Held
    );
    let dup = existing(store.claim(&again(&new)).await.unwrap());
    assert!(matches!(dup.state, RecordState::InFlight { .. }));
}

/// Pins: after a killed holder's lease ran out, the same key with a
/// different body was claimed and executed, and the genuine retry got 422.
async fn an_abandoned_claim_is_taken_over_only_by_the_same_request(store: &dyn Store) {
    let dead = claim_for(record_key(), 200, TTL_MS);
    assert!(claimed(&store.claim(&dead).await.unwrap()));
    sleep_ms(300).await;
    let other = Claim {
        fingerprint: Fingerprint([0xd1; 32]),
        ..again(&dead)
    };
    let found = existing(store.claim(&other).await.unwrap());
    assert_eq!(
        found.fingerprint, dead.fingerprint,
        "a different request is 422"
    );
    assert_eq!(found.first_use, dead.first_use);
    assert_eq!(
        store.claim(&again(&dead)).await.unwrap(),
        ClaimOutcome::Claimed { takeover: true },
        "the genuine retry takes the abandoned claim over"
    );
}

async fn complete_stores_exactly(store: &dyn Store) {
    let c = claim_for(record_key(), LEASE_MS, TTL_MS);
    assert!(claimed(&store.claim(&c).await.unwrap()));
    assert_eq!(
        store
            .renew(&c.key, &c.token, span(LEASE_MS + 500))
            .await
            .unwrap(),
        Fence::Held
    );
    let resp = response();
    assert_eq!(
        store
            .complete(&c.key, &c.token, &Completion::Stored(resp.clone()), keep())
            .await
            .unwrap(),
        Fence::Held
    );
    let want = Record {
        fingerprint: c.fingerprint,
        state: RecordState::Completed(resp),
        created_at: c.now,
        expires_at: c.expires_at(),
        first_use: c.first_use.clone(),
    };
    assert_same_record(&store.get(&c.key).await.unwrap().unwrap(), &want);
    // A retry sees the same record (from a cache, if there is one).
    for _ in 0..2 {
        let found = existing(store.claim(&again(&c)).await.unwrap());
        assert_same_record(&found, &want);
    }
    // Completed: the token no longer fences anything.
    assert_eq!(store.release(&c.key, &c.token).await.unwrap(), Fence::Lost);
    assert_same_record(&store.get(&c.key).await.unwrap().unwrap(), &want);
}

async fn release_frees_the_key(store: &dyn Store) {
    let c = claim_for(record_key(), LEASE_MS, TTL_MS);
    assert!(claimed(&store.claim(&c).await.unwrap()));
    assert_eq!(store.release(&c.key, &c.token).await.unwrap(), Fence::Held);
    assert_eq!(store.get(&c.key).await.unwrap(), None);
    assert_eq!(store.release(&c.key, &c.token).await.unwrap(), Fence::Lost);
    assert_eq!(
        store.claim(&again(&c)).await.unwrap(),
        ClaimOutcome::Claimed { takeover: false }
    );
}

async fn expired_record_is_claimable_again(store: &dyn Store) {
    let c = claim_for(record_key(), 200, 400);
    assert!(claimed(&store.claim(&c).await.unwrap()));
    assert_eq!(
        store
            .complete(&c.key, &c.token, &Completion::Stored(response()), keep())
            .await
            .unwrap(),
        Fence::Held
    );
    sleep_ms(550).await;
    let next = claim_for(c.key, LEASE_MS, TTL_MS);
    assert_eq!(
        store.claim(&next).await.unwrap(),
        ClaimOutcome::Claimed { takeover: false }
    );
    let r = store.get(&c.key).await.unwrap().unwrap();
    assert_eq!(r.fingerprint, next.fingerprint);
    assert_eq!(r.first_use, next.first_use, "the new claim's own first use");
    assert!(matches!(r.state, RecordState::InFlight { .. }));
}

/// What a claim keeps of its request comes back with the record, from
/// the store and from a cache alike; a claim that keeps none (as records
/// written before first uses) reads back none; a takeover keeps its own.
async fn first_use_is_kept_with_the_record(store: &dyn Store) {
    for first_use in [None, Some(FirstUse::new("DELETE", "/é/ü"))] {
        let c = Claim {
            first_use,
            ..claim_for(record_key(), LEASE_MS, TTL_MS)
        };
        assert!(claimed(&store.claim(&c).await.unwrap()));
        for completion in [
            Completion::Stored(response()),
            Completion::Unstored { status: 200 },
        ] {
            let c = Claim {
                key: record_key(),
                ..c.clone()
            };
            assert!(claimed(&store.claim(&c).await.unwrap()));
            let done = store.complete(&c.key, &c.token, &completion, keep());
            assert_eq!(done.await.unwrap(), Fence::Held);
            for _ in 0..2 {
                let found = existing(store.claim(&again(&c)).await.unwrap());
                assert_eq!(found.first_use, c.first_use, "{completion:?}");
            }
        }
        assert_eq!(
            store.get(&c.key).await.unwrap().unwrap().first_use,
            c.first_use
        );
        assert_eq!(store.release(&c.key, &c.token).await.unwrap(), Fence::Held);
    }
    let dead = claim_for(record_key(), 200, TTL_MS);
    assert!(claimed(&store.claim(&dead).await.unwrap()));
    sleep_ms(300).await;
    let retry = Claim {
        first_use: Some(FirstUse::new("POST", "/retried")),
        ..again(&dead)
    };
    assert_eq!(
        store.claim(&retry).await.unwrap(),
        ClaimOutcome::Claimed { takeover: true }
    );
    let r = store.get(&dead.key).await.unwrap().unwrap();
    assert_eq!(r.first_use, retry.first_use);
}

async fn sweep_deletes_only_expired_and_respects_batch(store: &dyn Store, later: &dyn Store) {
    // Sweep "in the future" instead of waiting: by `now` where the store
    // trusts the caller's clock, through `later` where it has its own.
    let future = now_millis() + LATER_MS;
    while later.sweep(future, 1000).await.unwrap() > 0 {}
    let mut doomed = Vec::new();
    for _ in 0..3 {
        let c = claim_for(record_key(), 100, 1000);
        assert!(claimed(&store.claim(&c).await.unwrap()));
        let done = Completion::Stored(response());
        assert_eq!(
            store
                .complete(&c.key, &c.token, &done, keep())
                .await
                .unwrap(),
            Fence::Held
        );
        doomed.push(c.key);
    }
    // In flight, ttl and lease both over by then.
    let dead = claim_for(record_key(), 500, 1000);
    assert!(claimed(&store.claim(&dead).await.unwrap()));
    doomed.push(dead.key);
    // In flight past its ttl, but its lease is still live then: never swept.
    let live_lease = claim_for(record_key(), 60_000, 1000);
    assert!(claimed(&store.claim(&live_lease).await.unwrap()));
    // Not expired.
    let fresh = claim_for(record_key(), LEASE_MS, TTL_MS);
    assert!(claimed(&store.claim(&fresh).await.unwrap()));

    assert_eq!(later.sweep(future, 3).await.unwrap(), 3);
    assert_eq!(later.sweep(future, 10).await.unwrap(), 1);
    assert_eq!(later.sweep(future, 10).await.unwrap(), 0);
    for k in &doomed {
        assert_eq!(store.get(k).await.unwrap(), None);
    }
    assert!(store.get(&live_lease.key).await.unwrap().is_some());
    assert!(store.get(&fresh.key).await.unwrap().is_some());
    assert_eq!(
        store
            .release(&live_lease.key, &live_lease.token)
            .await
            .unwrap(),
        Fence::Held
    );
}

/// Pins: a claim took over an in-flight record once its ttl had passed,
/// although its holder was alive and renewing, so the request ran twice.
async fn live_lease_outlives_the_ttl(store: &dyn Store) {
    let holder = claim_for(record_key(), 60_000, 50);
    assert!(claimed(&store.claim(&holder).await.unwrap()));
    sleep_ms(120).await;
    let retry = Claim {
        token: LeaseToken::random(),
        now: now_millis(),
        ..holder.clone()
    };
    match store.claim(&retry).await.unwrap() {
        ClaimOutcome::Existing(r) => {
            assert!(matches!(r.state, RecordState::InFlight { .. }), "{r:?}")
        }
        other => panic!("a live lease was taken over: {other:?}"),
    }
    let done = Completion::Stored(response());
    assert_eq!(
        store
            .complete(&holder.key, &holder.token, &done, span(60_000))
            .await
            .unwrap(),
        Fence::Held
    );
}

async fn unstored_completion(store: &dyn Store) {
    let c = claim_for(record_key(), LEASE_MS, TTL_MS);
    assert!(claimed(&store.claim(&c).await.unwrap()));
    let done = Completion::Unstored { status: 200 };
    assert_eq!(
        store
            .complete(&c.key, &c.token, &done, keep())
            .await
            .unwrap(),
        Fence::Held
    );
    let want = Record {
        fingerprint: c.fingerprint,
        state: RecordState::Unstored { status: 200 },
        created_at: c.now,
        expires_at: c.expires_at(),
        first_use: c.first_use.clone(),
    };
    assert_same_record(&store.get(&c.key).await.unwrap().unwrap(), &want);
    for _ in 0..2 {
        let found = existing(store.claim(&again(&c)).await.unwrap());
        assert_same_record(&found, &want);
    }
}

async fn delete_removes_any_record(store: &dyn Store) {
    let c = claim_for(record_key(), LEASE_MS, TTL_MS);
    assert!(claimed(&store.claim(&c).await.unwrap()));
    let done = Completion::Stored(response());
    store
        .complete(&c.key, &c.token, &done, keep())
        .await
        .unwrap();
    // Read it once so a cache holds it too.
    existing(store.claim(&again(&c)).await.unwrap());
    assert!(store.delete(&c.key).await.unwrap());
    assert_eq!(store.get(&c.key).await.unwrap(), None);
    assert!(!store.delete(&c.key).await.unwrap());
    assert_eq!(
        store.claim(&again(&c)).await.unwrap(),
        ClaimOutcome::Claimed { takeover: false }
    );
    // An in-flight record can be deleted too (operator repair).
    assert!(store.delete(&c.key).await.unwrap());
    assert_eq!(store.get(&c.key).await.unwrap(), None);
}

/// A record left outcome unknown (`on_ambiguous = "keep"`) under a new key.
async fn unknown_record(store: &dyn Store, lease_ms: i64, ttl_ms: i64) -> Claim {
    let c = claim_for(record_key(), lease_ms, ttl_ms);
    assert!(claimed(&store.claim(&c).await.unwrap()));
    let done = store.complete(&c.key, &c.token, &Completion::Unknown, keep());
    assert_eq!(done.await.unwrap(), Fence::Held);
    c
}

/// `keys resolve`: an outcome-unknown record is settled either way, in one
/// step; a completed or in-flight one is refused and left as it was; and
/// an expired one is as good as absent. Pins: an expired outcome-unknown
/// record (ttl over, not swept yet) was "resolved" (`keys resolve` said
/// retries get 410, but the next request ran as new).
async fn resolve_settles_only_live_outcome_unknown_records(store: &dyn Store) {
    let applied = Verdict::Applied {
        reason: "the ledger shows it once".into(),
    };
    let verdicts = [Verdict::NotApplied, applied.clone()];

    // Applied: unstored with no status, retries find it (410), the reason kept.
    let c = unknown_record(store, LEASE_MS, TTL_MS).await;
    assert!(store.resolve(&c.key, &applied, now_millis()).await.unwrap());
    let want = Record {
        fingerprint: c.fingerprint,
        state: RecordState::Unstored {
            status: RESOLVED_STATUS,
        },
        created_at: c.now,
        expires_at: c.expires_at(),
        first_use: c.first_use.clone(),
    };
    assert_same_record(&store.get(&c.key).await.unwrap().unwrap(), &want);
    let resolution = store.resolution(&c.key).await.unwrap().expect("kept");
    assert_eq!(resolution.reason, "the ledger shows it once");
    assert_near(resolution.at, now_millis(), "resolved at");
    for _ in 0..2 {
        assert_same_record(&existing(store.claim(&again(&c)).await.unwrap()), &want);
    }
    // Settled once: neither verdict changes it again.
    for verdict in &verdicts {
        assert!(!store.resolve(&c.key, verdict, now_millis()).await.unwrap());
        assert_same_record(&store.get(&c.key).await.unwrap().unwrap(), &want);
    }

    // Not applied: the record goes, and the same request claims it fresh.
    let c = unknown_record(store, LEASE_MS, TTL_MS).await;
    let not_applied = &Verdict::NotApplied;
    assert!(store
        .resolve(&c.key, not_applied, now_millis())
        .await
        .unwrap());
    assert_eq!(store.get(&c.key).await.unwrap(), None);
    assert_eq!(store.resolution(&c.key).await.unwrap(), None);
    assert!(!store
        .resolve(&c.key, not_applied, now_millis())
        .await
        .unwrap());
    assert_eq!(
        store.claim(&again(&c)).await.unwrap(),
        ClaimOutcome::Claimed { takeover: false }
    );
    assert!(!store.resolve(&c.key, &applied, now_millis()).await.unwrap());

    // Completed: refused either way, the replay unchanged.
    let c = claim_for(record_key(), LEASE_MS, TTL_MS);
    assert!(claimed(&store.claim(&c).await.unwrap()));
    let done = Completion::Stored(response());
    let completing = store.complete(&c.key, &c.token, &done, keep());
    assert_eq!(completing.await.unwrap(), Fence::Held);
    // Read it once so a cache holds it too.
    existing(store.claim(&again(&c)).await.unwrap());
    for verdict in &verdicts {
        assert!(!store.resolve(&c.key, verdict, now_millis()).await.unwrap());
        let found = existing(store.claim(&again(&c)).await.unwrap());
        assert_eq!(found.state, RecordState::Completed(response()));
        assert_eq!(store.resolution(&c.key).await.unwrap(), None);
    }

    // In flight: refused either way, and the holder still owns it.
    let c = claim_for(record_key(), LEASE_MS, TTL_MS);
    assert!(claimed(&store.claim(&c).await.unwrap()));
    for verdict in &verdicts {
        assert!(!store.resolve(&c.key, verdict, now_millis()).await.unwrap());
        let found = existing(store.claim(&again(&c)).await.unwrap());
        assert!(
            matches!(found.state, RecordState::InFlight { .. }),
            "{found:?}"
        );
    }
    let completing = store.complete(&c.key, &c.token, &done, keep());
    assert_eq!(completing.await.unwrap(), Fence::Held);

    // Expired (ttl over, not swept yet): nothing to resolve, and it stays
    // dead: the next request with the key runs as new, under either verdict.
    for verdict in &verdicts {
        let c = unknown_record(store, 100, 300).await;
        sleep_ms(450).await;
        assert!(
            !store.resolve(&c.key, verdict, now_millis()).await.unwrap(),
            "{verdict:?} settled an expired record"
        );
        assert_eq!(store.resolution(&c.key).await.unwrap(), None);
        assert_eq!(
            store.claim(&again(&c)).await.unwrap(),
            ClaimOutcome::Claimed { takeover: false },
            "{verdict:?}: the expired record came back to life"
        );
    }
}

/// A completed record at a fresh key, with `resp`.
async fn completed_with(store: &dyn Store, resp: &StoredResponse, ttl_ms: i64) -> Claim {
    let c = claim_for(record_key(), LEASE_MS, ttl_ms);
    assert!(claimed(&store.claim(&c).await.unwrap()));
    let done = Completion::Stored(resp.clone());
    assert_eq!(
        store
            .complete(&c.key, &c.token, &done, span(1))
            .await
            .unwrap(),
        Fence::Held
    );
    c
}

/// Every page from the first, `limit` at a time, until a short one.
async fn scan_all(store: &dyn Store, limit: u32) -> Vec<(RecordKey, Record)> {
    let mut all: Vec<(RecordKey, Record)> = Vec::new();
    loop {
        let after = all.last().map(|(key, _)| *key);
        let page = store
            .scan_completed(after, limit, now_millis())
            .await
            .unwrap();
        assert!(
            page.len() <= limit as usize,
            "a page holds at most its limit"
        );
        let short = page.len() < limit as usize;
        all.extend(page);
        if short {
            return all;
        }
    }
}

async fn scan_pages_live_completed_records_in_key_order(store: &dyn Store) {
    let completed = [
        completed_with(store, &response(), TTL_MS).await,
        completed_with(store, &response(), TTL_MS).await,
        completed_with(store, &response(), TTL_MS).await,
    ];
    let expired = completed_with(store, &response(), 200).await;
    let in_flight = claim_for(record_key(), LEASE_MS, TTL_MS);
    assert!(claimed(&store.claim(&in_flight).await.unwrap()));
    let unstored = claim_for(record_key(), LEASE_MS, TTL_MS);
    assert!(claimed(&store.claim(&unstored).await.unwrap()));
    let done = Completion::Unstored { status: 200 };
    store
        .complete(&unstored.key, &unstored.token, &done, keep())
        .await
        .unwrap();
    sleep_ms(400).await;

    let all = scan_all(store, 2).await;
    let keys: Vec<RecordKey> = all.iter().map(|(key, _)| *key).collect();
    assert!(
        keys.windows(2).all(|w| w[0] < w[1]),
        "pages follow each other in key order, no record twice"
    );
    for c in &completed {
        let (_, record) = all
            .iter()
            .find(|(key, _)| *key == c.key)
            .expect("every live completed record is scanned");
        assert_eq!(record.state, RecordState::Completed(response()));
        assert_eq!(record.fingerprint, c.fingerprint);
    }
    for (c, what) in [
        (&expired, "an expired one"),
        (&in_flight, "one in flight"),
        (&unstored, "an unstored one"),
    ] {
        assert!(!keys.contains(&c.key), "{what} is not scanned");
    }
    // From a cursor: only what comes after it.
    let after = completed.iter().map(|c| c.key).min().unwrap();
    let rest = store
        .scan_completed(Some(after), 1_000_000, now_millis())
        .await
        .unwrap();
    assert!(rest.iter().all(|(key, _)| *key > after));
    assert!(rest
        .iter()
        .any(|(key, _)| completed.iter().any(|c| c.key == *key) && *key != after));
}

async fn rewrite_is_a_compare_and_set(store: &dyn Store) {
    let old = response();
    let new = StoredResponse {
        headers: vec![("x-rewritten".into(), Bytes::from_static(b"1"))],
        body: Bytes::from_static(b"rewritten \x00\xff"),
        ..response()
    };
    let c = completed_with(store, &old, TTL_MS).await;
    // Cached by a fast path in front, if there is one.
    existing(store.claim(&again(&c)).await.unwrap());
    let before = store.get(&c.key).await.unwrap().unwrap();

    // A stale `old` (the record changed since it was read): nothing changes.
    let stale = StoredResponse {
        body: Bytes::from_static(b"what was read before"),
        ..old.clone()
    };
    assert!(!store.rewrite_response(&c.key, &stale, &new).await.unwrap());
    let stale_status = StoredResponse {
        status: 200,
        ..old.clone()
    };
    assert!(!store
        .rewrite_response(&c.key, &stale_status, &new)
        .await
        .unwrap());
    assert_same_record(&store.get(&c.key).await.unwrap().unwrap(), &before);

    // The bytes still there: rewritten, the rest of the record kept; a
    // retry replays the new response (no cached copy answers the old one).
    assert!(store.rewrite_response(&c.key, &old, &new).await.unwrap());
    let want = Record {
        state: RecordState::Completed(new.clone()),
        ..before.clone()
    };
    assert_same_record(&store.get(&c.key).await.unwrap().unwrap(), &want);
    for _ in 0..2 {
        assert_same_record(&existing(store.claim(&again(&c)).await.unwrap()), &want);
    }
    // Twice with the same `old`: the second finds `new` and writes nothing.
    assert!(!store.rewrite_response(&c.key, &old, &new).await.unwrap());

    // Not a completed record, or none: nothing to rewrite.
    let in_flight = claim_for(record_key(), LEASE_MS, TTL_MS);
    assert!(claimed(&store.claim(&in_flight).await.unwrap()));
    assert!(!store
        .rewrite_response(&in_flight.key, &old, &new)
        .await
        .unwrap());
    assert!(matches!(
        store.get(&in_flight.key).await.unwrap().unwrap().state,
        RecordState::InFlight { .. }
    ));
    let gone = completed_with(store, &old, TTL_MS).await;
    assert!(store.delete(&gone.key).await.unwrap());
    assert!(!store.rewrite_response(&gone.key, &old, &new).await.unwrap());
    assert!(store.get(&gone.key).await.unwrap().is_none());
}

/// `claim_authoritative` answers as `claim` does (where the store reads
/// no copies, it says so with `None`), and a claim after it agrees: a
/// completed record is the same record, a free key granted stays held.
async fn an_authoritative_claim_agrees_with_the_claim(store: &dyn Store) {
    let c = completed_with(store, &response(), TTL_MS).await;
    let seen = existing(store.claim(&again(&c)).await.unwrap());
    if let Some(outcome) = store.claim_authoritative(&again(&c)).await.unwrap() {
        assert_same_record(&existing(outcome), &seen);
    }
    assert_same_record(&existing(store.claim(&again(&c)).await.unwrap()), &seen);

    let free = claim_for(record_key(), LEASE_MS, TTL_MS);
    if let Some(outcome) = store.claim_authoritative(&free).await.unwrap() {
        assert!(claimed(&outcome), "{outcome:?}");
        let held = existing(store.claim(&again(&free)).await.unwrap());
        assert!(
            matches!(held.state, RecordState::InFlight { .. }),
            "{held:?}"
        );
        assert_eq!(
            store.release(&free.key, &free.token).await.unwrap(),
            Fence::Held
        );
    }
}

// ===== backends =====

async fn postgres(schema: &str) -> Arc<PostgresStore> {
    postgres_at(schema, 0).await
}

/// A handle on `schema` whose server clock reads `offset_ms` ahead.
async fn postgres_at(schema: &str, offset_ms: i64) -> Arc<PostgresStore> {
    let url = database_url();
    require_postgres(&url).await;
    Arc::new(
        PostgresStore::connect(&pg_store_config(&url, schema))
            .await
            .expect("postgres store")
            .with_clock_offset(offset_ms),
    )
}

fn redis_config(url: String, prefix: &str) -> RedisConfig {
    RedisConfig {
        url,
        timeout: Duration::from_millis(250),
        prefix: prefix.to_string(),
        cluster: false,
        ca_file: None,
        cert_file: None,
        key_file: None,
        sentinel: None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn contract_memory() {
    let store = Arc::new(MemoryStore::new());
    run_contract(store.clone(), store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn contract_sqlite() {
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::open(&dir.path().join("idemgate.db"), SqliteSync::Full).unwrap();
    let store = Arc::new(store);
    run_contract(store.clone(), store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn contract_postgres() {
    let schema = unique_schema("t");
    let later = postgres_at(&schema, LATER_MS).await;
    run_contract(postgres(&schema).await, later).await;
    drop_schema(&database_url(), &schema).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn contract_postgres_redis() {
    let schema = unique_schema("t");
    let _keys = RedisPrefix(schema.clone());
    let url = redis_url();
    require_redis(&url);
    let pg: Arc<dyn Store> = postgres(&schema).await;
    let fast = RedisFastPath::new(pg, &redis_config(url, &schema))
        .await
        .unwrap();
    let counters = fast.counters();
    run_contract(Arc::new(fast), postgres_at(&schema, LATER_MS).await).await;
    assert!(counters.hits.load(Ordering::Relaxed) > 0);
    assert_eq!(counters.errors.load(Ordering::Relaxed), 0);
    drop_schema(&database_url(), &schema).await;
}

// ===== Redis fast path =====

fn snapshot(c: &FastPathCounters) -> (u64, u64, u64) {
    (
        c.hits.load(Ordering::Relaxed),
        c.misses.load(Ordering::Relaxed),
        c.errors.load(Ordering::Relaxed),
    )
}

/// Claims and completes a fresh key; returns the claim.
async fn complete_one(store: &dyn Store) -> Claim {
    let c = claim_for(record_key(), LEASE_MS, TTL_MS);
    assert!(claimed(&store.claim(&c).await.unwrap()));
    let done = Completion::Stored(response());
    assert_eq!(
        store
            .complete(&c.key, &c.token, &done, keep())
            .await
            .unwrap(),
        Fence::Held
    );
    c
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_answers_completed_keys_and_postgres_answers_the_rest() {
    let schema = unique_schema("t");
    let _keys = RedisPrefix(schema.clone());
    let url = redis_url();
    require_redis(&url);
    let pg = postgres(&schema).await;
    let fast = RedisFastPath::new(pg.clone(), &redis_config(url.clone(), &schema))
        .await
        .unwrap();
    let counters = fast.counters();

    // Completed through the fast path: the retry is a Redis hit.
    let c = complete_one(&fast).await;
    let (h0, m0, _) = snapshot(&counters);
    let r = existing(fast.claim(&again(&c)).await.unwrap());
    assert!(matches!(r.state, RecordState::Completed(_)));
    assert_eq!(snapshot(&counters).0, h0 + 1);

    // Redis lost it (flush): PostgreSQL answers, and Redis learns it again.
    let client = redis::Client::open(url.as_str()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let _: i64 = redis::cmd("DEL")
        .arg(fast.redis_name(&c.key).await.unwrap())
        .query_async(&mut conn)
        .await
        .unwrap();
    // Answered from PostgreSQL (its times by its own clock).
    assert_same_record(&existing(fast.claim(&again(&c)).await.unwrap()), &r);
    let (h1, m1, _) = snapshot(&counters);
    assert_eq!((h1, m1), (h0 + 1, m0 + 1));
    assert_same_record(&existing(fast.claim(&again(&c)).await.unwrap()), &r);
    assert_eq!(snapshot(&counters).0, h1 + 1, "cached again after the miss");

    // Stored while Redis never saw it (straight into PostgreSQL).
    let direct = complete_one(&*pg).await;
    let from_pg = existing(fast.claim(&again(&direct)).await.unwrap());
    assert_same_record(&from_pg, &pg.get(&direct.key).await.unwrap().unwrap());

    // A fingerprint mismatch is still reported from Redis (the caller 422s).
    let mut other = again(&c);
    other.fingerprint = Fingerprint(rand::random());
    assert_eq!(
        existing(fast.claim(&other).await.unwrap()).fingerprint,
        c.fingerprint
    );

    // Values are keyed by digests only.
    let name = fast.redis_key(&c.key);
    assert!(name.starts_with(&format!("{schema}:")));
    assert_eq!(name.len(), schema.len() + 1 + 64 + 1 + 64);
    // On the node, with the master's epoch (32 characters) after the prefix.
    let live = fast.redis_name(&c.key).await.unwrap();
    assert_eq!(live.len(), name.len() + 32 + 1, "{live}");
    assert!(live.ends_with(&name[schema.len()..]), "{live}");
    assert_eq!(snapshot(&counters).2, 0);
    drop_schema(&database_url(), &schema).await;
}

fn body_of(record: &Record) -> Bytes {
    match &record.state {
        RecordState::Completed(response) => response.body.clone(),
        other => panic!("not completed: {other:?}"),
    }
}

fn completion_with(body: &'static str) -> Completion {
    Completion::Stored(StoredResponse {
        status: 201,
        headers: vec![],
        body: Bytes::from_static(body.as_bytes()),
    })
}

/// A Redis copy the caller could not use (here: older than the record,
/// which changed in PostgreSQL behind the fast path's back) is answered
/// by a claim, as a hint is; `claim_authoritative` answers PostgreSQL's
/// record and puts it in Redis over the copy, where the next claim finds
/// it. PostgreSQL alone reads no copy: `None`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_authoritative_claim_replaces_the_redis_copy() {
    let schema = unique_schema("t");
    let _keys = RedisPrefix(schema.clone());
    let url = redis_url();
    require_redis(&url);
    let pg = postgres(&schema).await;
    let fast = RedisFastPath::new(pg.clone(), &redis_config(url, &schema))
        .await
        .unwrap();
    let counters = fast.counters();
    let c = complete_one(&fast).await;
    let cached = existing(fast.claim(&again(&c)).await.unwrap());
    assert_eq!(body_of(&cached), response().body);
    let newer = StoredResponse {
        body: Bytes::from_static(b"what PostgreSQL holds now"),
        ..response()
    };
    assert!(pg
        .rewrite_response(&c.key, &response(), &newer)
        .await
        .unwrap());
    let hint = existing(fast.claim(&again(&c)).await.unwrap());
    assert_eq!(body_of(&hint), response().body, "the copy answers alone");

    let authority = fast.claim_authoritative(&again(&c)).await.unwrap();
    assert_eq!(
        body_of(&existing(authority.expect("a fast path re-reads"))),
        newer.body
    );
    let (hits, _, _) = snapshot(&counters);
    assert_eq!(
        body_of(&existing(fast.claim(&again(&c)).await.unwrap())),
        newer.body
    );
    assert_eq!(snapshot(&counters).0, hits + 1, "from the replaced copy");
    assert_eq!(pg.claim_authoritative(&again(&c)).await.unwrap(), None);
    assert_eq!(snapshot(&counters).2, 0);
    drop_schema(&database_url(), &schema).await;
}

/// Pins: with Redis stalled, deleting a key reported success; a retry ran
/// again (a new response in PostgreSQL), and once Redis came back retries
/// were served the old response from Redis for the rest of the ttl.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_never_replays_what_postgres_no_longer_holds() {
    let schema = unique_schema("t");
    let redis = PrivateRedis::start();
    let pg = postgres(&schema).await;
    let fast = RedisFastPath::new(pg.clone(), &redis_config(redis.url(), "st"))
        .await
        .unwrap();
    let counters = fast.counters();
    let c = claim_for(record_key(), LEASE_MS, TTL_MS);
    assert!(claimed(&fast.claim(&c).await.unwrap()));
    let first = completion_with("first execution");
    assert_eq!(
        fast.complete(&c.key, &c.token, &first, keep())
            .await
            .unwrap(),
        Fence::Held
    );
    let hits = snapshot(&counters).0;
    let cached = existing(fast.claim(&again(&c)).await.unwrap());
    assert_eq!(body_of(&cached), "first execution");
    assert_eq!(snapshot(&counters).0, hits + 1, "served from Redis");

    let live_name = fast.redis_name(&c.key).await.unwrap();
    redis.pause();
    let deleted = fast.delete(&c.key).await;
    assert!(
        matches!(&deleted, Err(StoreError::StaleCopy { name, .. }) if *name == live_name),
        "a delete Redis did not hear of must not report success, and must name the key to DEL ({live_name}): {deleted:?}"
    );
    assert_eq!(pg.get(&c.key).await.unwrap(), None, "deleted in PostgreSQL");
    // The retry runs again, decided by PostgreSQL alone.
    let retry = again(&c);
    assert!(claimed(&fast.claim(&retry).await.unwrap()));
    let second = completion_with("second execution");
    assert_eq!(
        fast.complete(&retry.key, &retry.token, &second, keep())
            .await
            .unwrap(),
        Fence::Held
    );
    redis.resume();

    // From the moment Redis is back, and for good: only the new response.
    let deadline = Instant::now() + Duration::from_secs(4);
    while Instant::now() < deadline {
        let found = existing(fast.claim(&again(&c)).await.unwrap());
        assert_eq!(body_of(&found), "second execution");
        sleep_ms(50).await;
    }
    let hits = snapshot(&counters).0;
    assert_eq!(
        body_of(&existing(fast.claim(&again(&c)).await.unwrap())),
        "second execution"
    );
    assert_eq!(snapshot(&counters).0, hits + 1, "and Redis serves it again");
    drop_schema(&database_url(), &schema).await;
}

/// PostgreSQL behind the fast path, where an operator's `keys delete`
/// lands between the next claim's read and the fast path's caching of
/// what it read: the record goes from PostgreSQL, then its Redis name is
/// `DEL`eted (as the CLI does), right after the claim read it.
struct DeletedAfterRead {
    pg: Arc<PostgresStore>,
    /// The Redis name to `DEL` and where, once.
    armed: std::sync::Mutex<Option<(String, String)>>,
}

#[async_trait::async_trait]
impl Store for DeletedAfterRead {
    async fn claim(&self, claim: &Claim) -> Result<ClaimOutcome, StoreError> {
        let outcome = self.pg.claim(claim).await?;
        let armed = self.armed.lock().unwrap().take();
        if let Some((name, url)) = armed {
            assert!(self.pg.delete(&claim.key).await.unwrap(), "deleted");
            let client = redis::Client::open(url.as_str()).unwrap();
            let mut conn = client.get_multiplexed_async_connection().await.unwrap();
            let _: i64 = redis::cmd("DEL")
                .arg(&name)
                .query_async(&mut conn)
                .await
                .unwrap();
        }
        Ok(outcome)
    }
    async fn renew(
        &self,
        key: &RecordKey,
        token: &LeaseToken,
        lease: Span,
    ) -> Result<Fence, StoreError> {
        self.pg.renew(key, token, lease).await
    }
    async fn complete(
        &self,
        key: &RecordKey,
        token: &LeaseToken,
        completion: &Completion,
        keep: Span,
    ) -> Result<Fence, StoreError> {
        self.pg.complete(key, token, completion, keep).await
    }
    async fn release(&self, key: &RecordKey, token: &LeaseToken) -> Result<Fence, StoreError> {
        self.pg.release(key, token).await
    }
    async fn get(&self, key: &RecordKey) -> Result<Option<Record>, StoreError> {
        self.pg.get(key).await
    }
    async fn delete(&self, key: &RecordKey) -> Result<bool, StoreError> {
        self.pg.delete(key).await
    }
    async fn resolve(
        &self,
        key: &RecordKey,
        verdict: &Verdict,
        now: i64,
    ) -> Result<bool, StoreError> {
        self.pg.resolve(key, verdict, now).await
    }
    async fn resolution(
        &self,
        key: &RecordKey,
    ) -> Result<Option<idemgate::store::Resolution>, StoreError> {
        self.pg.resolution(key).await
    }
    async fn sweep(&self, now: i64, batch: u32) -> Result<u64, StoreError> {
        self.pg.sweep(now, batch).await
    }
    async fn scan_completed(
        &self,
        after: Option<RecordKey>,
        limit: u32,
        now: i64,
    ) -> Result<Vec<(RecordKey, Record)>, StoreError> {
        self.pg.scan_completed(after, limit, now).await
    }
    async fn rewrite_response(
        &self,
        key: &RecordKey,
        old: &StoredResponse,
        new: &StoredResponse,
    ) -> Result<bool, StoreError> {
        self.pg.rewrite_response(key, old, new).await
    }
    async fn ping(&self) -> Result<(), StoreError> {
        self.pg.ping().await
    }
    fn backend(&self) -> &'static str {
        self.pg.backend()
    }
    fn call_bound(&self) -> Duration {
        self.pg.call_bound()
    }
}

/// Review F3 (issue 20: the fast path must never answer with a record
/// PostgreSQL no longer holds). Pins: a claim put its lock in Redis,
/// read a completed record from PostgreSQL, an operator's `keys delete`
/// then deleted it and `DEL`eted the Redis name (our lock with it), and
/// the claim's plain `SET` cached the deleted record back for the rest of
/// its ttl, so retries replayed it from Redis. The same for
/// `claim_authoritative`, which replaced the copy it could not use.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delete_between_a_claims_read_and_its_caching_wins() {
    let schema = unique_schema("t");
    let _keys = RedisPrefix(schema.clone());
    let url = redis_url();
    require_redis(&url);
    let pg = postgres(&schema).await;
    let hooked = Arc::new(DeletedAfterRead {
        pg: pg.clone(),
        armed: Default::default(),
    });
    let fast = RedisFastPath::new(hooked.clone(), &redis_config(url.clone(), &schema))
        .await
        .unwrap();
    let client = redis::Client::open(url.as_str()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();

    // Completed in PostgreSQL only: the claim locks in Redis, reads it.
    let direct = complete_one(&*pg).await;
    // And one whose copy the caller could not use: re-read and replaced.
    let cached = complete_one(&fast).await;
    for (what, c) in [("claim", &direct), ("claim_authoritative", &cached)] {
        let name = fast.redis_name(&c.key).await.unwrap();
        *hooked.armed.lock().unwrap() = Some((name.clone(), url.clone()));
        let read = match what {
            "claim" => fast.claim(&again(c)).await.unwrap(),
            _ => fast.claim_authoritative(&again(c)).await.unwrap().unwrap(),
        };
        assert!(
            matches!(existing(read).state, RecordState::Completed(_)),
            "{what}"
        );
        assert_eq!(pg.get(&c.key).await.unwrap(), None, "{what}: deleted");
        let left: Option<Vec<u8>> = redis::cmd("GET")
            .arg(&name)
            .query_async(&mut conn)
            .await
            .unwrap();
        assert_eq!(left, None, "{what}: the deleted record was cached back");
        // The retry is a new request, never a replay of the deleted record.
        let retry = again(c);
        assert!(claimed(&fast.claim(&retry).await.unwrap()), "{what}");
        assert_eq!(
            fast.release(&retry.key, &retry.token).await.unwrap(),
            Fence::Held
        );
    }
    drop_schema(&database_url(), &schema).await;
}

/// Review F9: a record's Redis copy lived as long as the record (days for
/// the webhook presets), and copies under a dead epoch are never read
/// again, so under `noeviction` Redis could fill. A copy now lives
/// `MAX_COPY_MS` at most, whether written by a completion or cached by a
/// claim; past that the record is read from PostgreSQL (and cached again).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_copy_lives_an_hour_at_most() {
    use idemgate::store::redis::MAX_COPY_MS;
    let schema = unique_schema("t");
    let _keys = RedisPrefix(schema.clone());
    let url = redis_url();
    require_redis(&url);
    let pg = postgres(&schema).await;
    let fast = RedisFastPath::new(pg.clone(), &redis_config(url.clone(), &schema))
        .await
        .unwrap();
    let client = redis::Client::open(url.as_str()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let day = 86_400_000;
    let c = claim_for(record_key(), LEASE_MS, day);
    assert!(claimed(&fast.claim(&c).await.unwrap()));
    let done = Completion::Stored(response());
    assert_eq!(
        fast.complete(&c.key, &c.token, &done, keep())
            .await
            .unwrap(),
        Fence::Held
    );
    let name = fast.redis_name(&c.key).await.unwrap();
    let pttl = |conn: &mut redis::aio::MultiplexedConnection| {
        let name = name.clone();
        let mut conn = conn.clone();
        async move {
            redis::cmd("PTTL")
                .arg(&name)
                .query_async::<i64>(&mut conn)
                .await
                .unwrap()
        }
    };
    let completed = pttl(&mut conn).await;
    assert!(
        completed > 0 && completed <= MAX_COPY_MS,
        "the completion's copy lives {completed} ms"
    );
    // Cached again by a claim that read it from PostgreSQL.
    let _: i64 = redis::cmd("DEL")
        .arg(&name)
        .query_async(&mut conn)
        .await
        .unwrap();
    let r = existing(fast.claim(&again(&c)).await.unwrap());
    assert!(
        r.expires_at > now_millis() + day - 60_000,
        "the record keeps its ttl"
    );
    let cached = pttl(&mut conn).await;
    assert!(
        cached > 0 && cached <= MAX_COPY_MS,
        "the claim's copy lives {cached} ms"
    );
    // The copy answers alone, with the record's own expiry.
    let hit = existing(fast.claim(&again(&c)).await.unwrap());
    assert_eq!(hit.expires_at, r.expires_at);
    drop_schema(&database_url(), &schema).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_outage_falls_back_to_postgres_and_recovers() {
    let schema = unique_schema("t");
    let mut redis = PrivateRedis::start();
    let pg = postgres(&schema).await;
    let fast = RedisFastPath::new(pg.clone(), &redis_config(redis.url(), "rt"))
        .await
        .unwrap();
    let counters = fast.counters();

    let c = complete_one(&fast).await;
    existing(fast.claim(&again(&c)).await.unwrap());
    assert_eq!(snapshot(&counters).0, 1, "hit while Redis is up");

    redis.kill();
    let errors_before = snapshot(&counters).2;
    for _ in 0..5 {
        let started = Instant::now();
        let k = claim_for(record_key(), LEASE_MS, TTL_MS);
        assert!(claimed(&fast.claim(&k).await.unwrap()));
        let done = Completion::Stored(response());
        assert_eq!(
            fast.complete(&k.key, &k.token, &done, keep())
                .await
                .unwrap(),
            Fence::Held
        );
        let r = existing(fast.claim(&again(&c)).await.unwrap());
        assert!(matches!(r.state, RecordState::Completed(_)));
        let took = started.elapsed();
        assert!(
            took < Duration::from_millis(1500),
            "three calls took {took:?} with Redis down"
        );
    }
    assert!(snapshot(&counters).2 > errors_before, "errors counted");

    redis.restart();
    // Redis restarted empty: the next claims refill it and then hit.
    let hits_before = snapshot(&counters).0;
    let deadline = Instant::now() + Duration::from_secs(10);
    while snapshot(&counters).0 == hits_before {
        assert!(Instant::now() < deadline, "fast path did not resume");
        existing(fast.claim(&again(&c)).await.unwrap());
        sleep_ms(100).await;
    }
    drop_schema(&database_url(), &schema).await;
}

/// Review F4, on one node (`redis.url`): the server behind an open
/// connection was promoted anew (`REPLICAOF` another, then `NO ONE`: a
/// new `master_replid`, its data replaced), and the fast path kept using
/// it under the old epoch (reading copies named for the data set it had
/// before) until a connection-level error, which never came. The pinned
/// master's epoch is read again once a second: the fast path moves to
/// the new epoch within a couple of seconds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_promoted_anew_behind_an_open_connection_is_left_within_seconds() {
    let a = PrivateRedis::start();
    let b = PrivateRedis::start();
    let fast = RedisFastPath::new(Arc::new(MemoryStore::new()), &redis_config(a.url(), "ep"))
        .await
        .unwrap();
    let key = record_key();
    let old = fast.redis_name(&key).await.unwrap();
    let epoch = |name: &str| name.split(':').nth(1).unwrap().to_string();
    let client = redis::Client::open(a.url()).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    let b_port = b.url().rsplit(':').next().unwrap().to_string();
    for args in [vec!["127.0.0.1", b_port.as_str()], vec!["NO", "ONE"]] {
        let _: redis::Value = redis::cmd("REPLICAOF")
            .arg(&args)
            .query_async(&mut conn)
            .await
            .unwrap();
    }
    let moved = Instant::now();
    loop {
        if let Ok(now) = fast.redis_name(&key).await {
            if epoch(&now) != epoch(&old) {
                break;
            }
        }
        assert!(
            moved.elapsed() < Duration::from_secs(4),
            "the fast path still uses the epoch of a data set the server no longer has ({old})"
        );
        sleep_ms(50).await;
    }
    eprintln!("on the new epoch after {:?}", moved.elapsed());
}

#[tokio::test]
async fn redis_down_at_start_is_not_an_error() {
    let schema = unique_schema("t");
    let mut redis = PrivateRedis::start();
    redis.kill();
    let pg = postgres(&schema).await;
    let fast = RedisFastPath::new(pg, &redis_config(redis.url(), "rd"))
        .await
        .unwrap();
    let c = complete_one(&fast).await;
    existing(fast.claim(&again(&c)).await.unwrap());
    assert!(snapshot(&fast.counters()).2 > 0);
    assert!(RedisFastPath::new(
        Arc::new(MemoryStore::new()),
        &redis_config("not a url".into(), "x")
    )
    .await
    .is_err());
    drop_schema(&database_url(), &schema).await;
}

// ===== PostgreSQL failure and migrations =====

async fn until_ok<T>(what: &str, mut f: impl AsyncFnMut() -> Result<T, StoreError>) -> T {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        match f().await {
            Ok(v) => return v,
            Err(e) => assert!(Instant::now() < deadline, "{what} did not recover: {e}"),
        }
        sleep_ms(100).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_cut_fails_fast_and_recovers() {
    require_postgres(&database_url()).await;
    let relay = TcpRelay::start(support::services::postgres_addr()).await;
    let schema = unique_schema("t");
    let store = PostgresStore::connect(&pg_store_config(
        &support::services::database_url_via(relay.addr()),
        &schema,
    ))
    .await
    .unwrap();
    let c = complete_one(&store).await;
    let before = store.get(&c.key).await.unwrap();

    relay.cut();
    for _ in 0..3 {
        let started = Instant::now();
        let res = store
            .claim(&claim_for(record_key(), LEASE_MS, TTL_MS))
            .await;
        assert!(res.is_err(), "claim while cut: {res:?}");
        let res = store.get(&c.key).await;
        assert!(res.is_err(), "get while cut: {res:?}");
        assert!(store.ping().await.is_err());
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "calls while cut took {:?}",
            started.elapsed()
        );
    }

    relay.restore();
    let after = until_ok("get after restore", async || store.get(&c.key).await).await;
    assert_eq!(after, before, "records survive the outage");
    let fresh = claim_for(record_key(), LEASE_MS, TTL_MS);
    assert!(claimed(&store.claim(&fresh).await.unwrap()));
    drop_schema(&database_url(), &schema).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_down_at_start_heals_and_migrates() {
    require_postgres(&database_url()).await;
    let relay = TcpRelay::start(support::services::postgres_addr()).await;
    relay.cut();
    let schema = unique_schema("t");
    let store = PostgresStore::connect(&pg_store_config(
        &support::services::database_url_via(relay.addr()),
        &schema,
    ))
    .await
    .expect("connect does not need the database");
    let c = claim_for(record_key(), LEASE_MS, TTL_MS);
    let started = Instant::now();
    assert!(store.claim(&c).await.is_err());
    assert!(started.elapsed() < Duration::from_secs(10));
    relay.restore();
    let outcome = until_ok("claim after start", async || store.claim(&c).await).await;
    assert!(claimed(&outcome));
    assert_eq!(store.migrate().await.unwrap(), 0, "already current");
    drop_schema(&database_url(), &schema).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_migrations_are_idempotent_and_safe_concurrently() {
    let schema = unique_schema("t");
    let stores: Vec<_> = futures_util::future::join_all((0..4).map(|_| postgres(&schema))).await;
    let applied: Vec<u32> = futures_util::future::join_all(stores.iter().map(|s| s.migrate()))
        .await
        .into_iter()
        .map(|r| r.expect("migrate"))
        .collect();
    assert_eq!(
        applied.iter().sum::<u32>(),
        idemgate::store::postgres::MIGRATIONS.len() as u32,
        "each migration ran exactly once: {applied:?}"
    );
    for s in &stores {
        assert_eq!(s.migrate().await.unwrap(), 0);
    }
    drop_schema(&database_url(), &schema).await;
}

/// A schema migrated by an older release (the first migration only) keeps
/// its records and gains the `unknown` state and resolutions on the next
/// start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_upgrades_an_older_schema_in_place() {
    let url = database_url();
    require_postgres(&url).await;
    let schema = unique_schema("t");
    let (client, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    let quoted = format!("\"{schema}\"");
    let first = idemgate::store::postgres::MIGRATIONS[0].replace("{schema}", &quoted);
    client
        .batch_execute(&format!(
            "CREATE SCHEMA {quoted}; {first}; \
             CREATE TABLE {quoted}.idemgate_migrations (version int PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT now()); \
             INSERT INTO {quoted}.idemgate_migrations (version) VALUES (1); \
             INSERT INTO {quoted}.idempotency_records (scope, key, fingerprint, state, locked_until, created_at, expires_at, status) \
               VALUES ('\\x01', '\\x02', '\\x03', 'unstored', 0, 5, 9999999999999, 200);"
        ))
        .await
        .unwrap();
    let store = postgres(&schema).await;
    assert_eq!(
        store.migrate().await.unwrap(),
        idemgate::store::postgres::MIGRATIONS.len() as u32 - 1,
        "the later migrations ran"
    );
    let rows: i64 = client
        .query_one(
            &format!("SELECT count(*) FROM {quoted}.idempotency_records"),
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(rows, 1, "the old record is kept");
    let c = claim_for(record_key(), LEASE_MS, TTL_MS);
    assert!(claimed(&store.claim(&c).await.unwrap()));
    assert_eq!(
        store
            .complete(&c.key, &c.token, &Completion::Unknown, keep())
            .await
            .unwrap(),
        Fence::Held
    );
    assert_eq!(
        store.get(&c.key).await.unwrap().unwrap().state,
        RecordState::Unknown
    );
    let applied = idemgate::store::Verdict::Applied {
        reason: "checked".into(),
    };
    assert!(store.resolve(&c.key, &applied, 0).await.unwrap());
    let resolution = store.resolution(&c.key).await.unwrap().expect("kept");
    assert_eq!(resolution.reason, "checked");
    drop(client);
    drop_schema(&url, &schema).await;
}

/// A replay must not write: the claim that finds a completed record takes
/// no row lock (which would stamp the row's `xmax` and cost a WAL flush).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_on_postgres_takes_no_row_lock() {
    let schema = unique_schema("t");
    let store = postgres(&schema).await;
    let c = complete_one(&*store).await;
    let (client, conn) = tokio_postgres::connect(&database_url(), tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    let xmax = || async {
        let row = client
            .query_one(
                &format!("SELECT xmax::text FROM \"{schema}\".idempotency_records"),
                &[],
            )
            .await
            .unwrap();
        row.get::<_, String>(0)
    };
    let before = xmax().await;
    for _ in 0..3 {
        let found = existing(store.claim(&again(&c)).await.unwrap());
        assert!(matches!(found.state, RecordState::Completed(_)));
    }
    assert_eq!(xmax().await, before, "the replays locked the row");
    drop(client);
    drop_schema(&database_url(), &schema).await;
}

/// Group commit keeps per-key atomicity and fencing: many concurrent claims
/// and completions coalesce into multi-row statements, yet every distinct
/// key is claimed once, duplicates of one key have one winner, and a stale
/// token in a batch is refused while its neighbours complete.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn batched_claims_and_completions_keep_per_key_atomicity_and_fencing() {
    let schema = unique_schema("t");
    batched_writes_keep_atomicity_and_fencing(postgres(&schema).await).await;
    drop_schema(&database_url(), &schema).await;
}

/// The same on SQLite, whose writes share one transaction per batch.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn batched_sqlite_writes_keep_per_key_atomicity_and_fencing() {
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::open(&dir.path().join("batch.db"), SqliteSync::Full).unwrap();
    batched_writes_keep_atomicity_and_fencing(Arc::new(store)).await;
}

async fn batched_writes_keep_atomicity_and_fencing(store: Arc<dyn Store>) {
    let distinct: Vec<Claim> = (0..48)
        .map(|_| claim_for(record_key(), LEASE_MS, TTL_MS))
        .collect();
    let contested = claim_for(record_key(), LEASE_MS, TTL_MS);
    let mut calls = Vec::new();
    for c in distinct
        .iter()
        .cloned()
        .chain((0..16).map(|_| again(&contested)))
    {
        let store = store.clone();
        calls.push(tokio::spawn(async move {
            (c.clone(), store.claim(&c).await.unwrap())
        }));
    }
    let mut winners = Vec::new();
    let mut contested_wins = 0;
    for call in calls {
        let (c, outcome) = call.await.unwrap();
        if c.key == contested.key {
            if claimed(&outcome) {
                contested_wins += 1;
                winners.push(c);
            } else {
                assert!(matches!(
                    existing(outcome).state,
                    RecordState::InFlight { .. }
                ));
            }
        } else {
            assert_eq!(outcome, ClaimOutcome::Claimed { takeover: false });
            winners.push(c);
        }
    }
    assert_eq!(contested_wins, 1, "one winner for the contested key");
    // Complete them all at once, plus a stale token for one of the keys.
    let stale = Claim {
        token: LeaseToken::random(),
        ..winners[0].clone()
    };
    let mut completions = Vec::new();
    for c in winners.iter().cloned().chain([stale]) {
        let store = store.clone();
        completions.push(tokio::spawn(async move {
            let done = Completion::Stored(response());
            (
                c.token,
                store
                    .complete(&c.key, &c.token, &done, keep())
                    .await
                    .unwrap(),
            )
        }));
    }
    let mut held = 0;
    for call in completions {
        let (token, fence) = call.await.unwrap();
        if winners.iter().any(|w| w.token == token) {
            assert_eq!(fence, Fence::Held);
            held += 1;
        } else {
            assert_eq!(fence, Fence::Lost, "the stale token is fenced off");
        }
    }
    assert_eq!(held, winners.len());
    for c in &winners {
        let r = store.get(&c.key).await.unwrap().unwrap();
        assert!(matches!(r.state, RecordState::Completed(_)));
    }
}
