//! The lease rules: pure tables first, then the I/O paths against a
//! scripted store (tower's `mock` idea) on a paused clock, so every
//! ambiguous case is deterministic and takes no real time.

use super::*;
use crate::idempotency::Scope;
use crate::store::instrumented::Instrumented;
use crate::store::scripted::{Act, FlakyStore};
use crate::store::{RecordState, StoredResponse};
use std::sync::atomic::Ordering;

// ===== pure =====

#[test]
fn interpret_table() {
    use Fence::{Held, Lost};
    let err = || Err(StoreError::Timeout);
    let cases: [(Write, Result<Fence, StoreError>, bool, Step); 14] = [
        (Write::Renew, Ok(Held), false, Step::Done(Held)),
        (Write::Renew, Ok(Lost), false, Step::Done(Lost)),
        // A renewal that landed leaves the token: Lost is never "it landed".
        (Write::Renew, Ok(Lost), true, Step::Done(Lost)),
        (Write::Renew, err(), false, Step::Retry),
        (Write::Complete, Ok(Held), false, Step::Done(Held)),
        (Write::Complete, Ok(Lost), false, Step::Done(Lost)),
        (Write::Complete, Ok(Lost), true, Step::Done(Held)),
        (Write::Complete, err(), true, Step::Retry),
        (Write::Release, Ok(Held), true, Step::Done(Held)),
        (Write::Release, Ok(Lost), false, Step::Done(Lost)),
        (Write::Release, Ok(Lost), true, Step::Done(Held)),
        (Write::GiveBack, Ok(Held), false, Step::Done(Held)),
        // The lost claim may still commit: keep looking.
        (Write::GiveBack, Ok(Lost), false, Step::Retry),
        (Write::GiveBack, err(), true, Step::Retry),
    ];
    for (i, (write, answer, unanswered, want)) in cases.into_iter().enumerate() {
        assert_eq!(interpret(write, &answer, unanswered), want, "case {i}");
    }
}

#[test]
fn quick_is_four_tries_in_at_most_0_7_s() {
    let ms = Duration::from_millis;
    let waits: Vec<_> = (1..=4).map(|n| QUICK.next(n, ms(0), 1.0)).collect();
    assert_eq!(waits, [Some(ms(100)), Some(ms(200)), Some(ms(400)), None]);
}

// ===== I/O against a scripted store =====

const LEASE: Duration = Duration::from_secs(3);
const BOUND: Duration = Duration::from_secs(1);

struct Harness {
    store: Arc<FlakyStore>,
    metrics: Arc<Metrics>,
    leases: Arc<Leases>,
    tasks: TaskTracker,
}

fn harness() -> Harness {
    let store = Arc::new(FlakyStore::with_bound(BOUND));
    let metrics = Arc::new(Metrics::new());
    let tasks = TaskTracker::new();
    // Behind the same seam as production: every call bounded and timed.
    let instrumented = Instrumented::new(store.clone(), metrics.clone());
    let leases = Leases::new(
        Arc::new(instrumented),
        metrics.clone(),
        tasks.clone(),
        Clock::following_tokio(),
        2,
    );
    Harness {
        store,
        metrics,
        leases,
        tasks,
    }
}

fn key() -> RecordKey {
    RecordKey {
        scope: Scope([1; 32]),
        key: [2; 32],
    }
}

fn request(fp: u8) -> ClaimRequest {
    ClaimRequest {
        key: key(),
        fingerprint: Fingerprint([fp; 32]),
        lease: LEASE,
        ttl: Duration::from_secs(3_600),
        route: Arc::new("r".into()),
        first_use: None,
        holding: None,
    }
}

fn stored() -> Completion {
    Completion::Stored(StoredResponse {
        status: 201,
        headers: vec![],
        body: bytes::Bytes::from_static(b"done"),
    })
}

impl Harness {
    async fn hold(&self) -> Lease {
        match self.leases.acquire(request(1)).await.expect("claim") {
            Acquired::Held(lease) => lease,
            Acquired::Existing(r) => panic!("expected to hold the key, found {r:?}"),
        }
    }

    async fn state(&self) -> Option<RecordState> {
        self.store.get(&key()).await.unwrap().map(|r| r.state)
    }

    /// Whether another claimant now would find the key held.
    async fn held_by_someone(&self) -> bool {
        let now = self.leases.clock().now_millis();
        match self.store.get(&key()).await.unwrap() {
            Some(r) => !crate::store::is_claimable(&r, &r.fingerprint, now),
            None => false,
        }
    }

    async fn in_flight(&self) -> bool {
        matches!(self.state().await, Some(RecordState::InFlight { .. }))
    }

    fn lost_fences(&self) -> u64 {
        let text = self.metrics.encode();
        text.lines()
            .find(|l| l.starts_with("idemgate_lost_fences_total{") && l.contains("route=\"r\""))
            .and_then(|l| l.rsplit(' ').next())
            .map_or(0, |n| n.parse().unwrap())
    }
}

#[tokio::test(start_paused = true)]
async fn a_completion_whose_answer_was_lost_but_landed_is_kept() {
    let h = harness();
    let lease = h.hold().await;
    h.store.script("complete", &[Act::Lose]);
    assert_eq!(lease.complete(stored()).await, KeyFate::Kept);
    assert!(matches!(h.state().await, Some(RecordState::Completed(_))));
    assert_eq!(
        h.lost_fences(),
        0,
        "our own landed write is not a lost fence"
    );
}

#[tokio::test(start_paused = true)]
async fn a_completion_after_a_takeover_is_refused_and_counted() {
    let h = harness();
    let stale = h.hold().await;
    tokio::time::sleep(LEASE + Duration::from_millis(1)).await;
    let Acquired::Held(fresh) = h.leases.acquire(request(1)).await.unwrap() else {
        panic!("the lapsed lease should be taken over");
    };
    assert_eq!(stale.complete(stored()).await, KeyFate::TakenOver);
    assert_eq!(h.lost_fences(), 1);
    assert!(h.in_flight().await);
    assert_eq!(fresh.release().await, KeyFate::Released);
}

/// Pins consumer review L1 (2026-12-06): a completion whose first try went
/// unanswered and whose retry found the key taken over was reported as
/// recorded, so a message consumer would ack a delivery whose key another
/// delivery now holds (a stale ack). Only a confirmed write under our own
/// token counts as recorded; the redelivery finds the record and acks.
#[tokio::test(start_paused = true)]
async fn an_unanswered_completion_is_never_reported_recorded() {
    let h = harness();
    let stale = h.hold().await;
    tokio::time::sleep(LEASE + Duration::from_millis(1)).await;
    let Acquired::Held(fresh) = h.leases.acquire(request(1)).await.unwrap() else {
        panic!("the lapsed lease should be taken over");
    };
    h.store.script("complete", &[Act::Fail]);
    let done = stale.complete_reporting(stored()).await;
    assert!(!done.recorded, "{done:?}");
    assert_eq!(fresh.release().await, KeyFate::Released);

    let h = harness();
    let lease = h.hold().await;
    h.store.script("complete", &[Act::Lose]);
    let done = lease.complete_reporting(stored()).await;
    assert_eq!(done.fate, KeyFate::Kept);
    assert!(!done.recorded, "landed, but unconfirmed: {done:?}");

    let h = harness();
    let done = h.hold().await.complete_reporting(stored()).await;
    assert!(done.recorded, "{done:?}");
}

#[tokio::test(start_paused = true)]
async fn a_release_whose_answer_was_lost_but_landed_is_released() {
    let h = harness();
    let lease = h.hold().await;
    h.store.script("release", &[Act::Lose]);
    assert_eq!(lease.release().await, KeyFate::Released);
    assert_eq!(h.state().await, None);
    assert_eq!(h.lost_fences(), 0);
}

#[tokio::test(start_paused = true)]
async fn a_release_the_store_never_answers_leaves_the_key_locked() {
    let h = harness();
    let lease = h.hold().await;
    h.store.script("release", &[Act::Fail; 4]);
    assert_eq!(lease.release().await, KeyFate::Locked);
    assert!(h.held_by_someone().await, "locked until the lease runs out");
    tokio::time::sleep(LEASE).await;
    assert!(!h.held_by_someone().await, "then free for a retry");
}

#[tokio::test(start_paused = true)]
async fn a_completion_through_an_outage_lands_in_the_background_and_keeps_the_lease() {
    let h = harness();
    let lease = h.hold().await;
    // Longer than the quick attempts and than the lease itself.
    h.store.script("complete", &[Act::Fail; 12]);
    assert_eq!(lease.complete(stored()).await, KeyFate::Kept);
    assert!(h.in_flight().await);
    for _ in 0..8 {
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert!(
            h.held_by_someone().await,
            "the background task renews: no retry may take the key over"
        );
    }
    h.tasks.close();
    h.tasks.wait().await;
    assert!(matches!(h.state().await, Some(RecordState::Completed(_))));
    assert_eq!(h.lost_fences(), 0);
}

#[tokio::test(start_paused = true)]
async fn a_claim_whose_answer_was_lost_is_given_back_when_it_lands() {
    let h = harness();
    h.store.script(
        "claim",
        &[Act::LandLate(BOUND + Duration::from_millis(500))],
    );
    let started = tokio::time::Instant::now();
    let err = h.leases.acquire(request(1)).await.err().expect("timed out");
    assert!(matches!(err, StoreError::Timeout), "{err:?}");
    h.tasks.close();
    h.tasks.wait().await;
    let landed = h.store.late_landings.load(Ordering::SeqCst);
    assert_eq!(landed, 1, "the late claim landed");
    assert_eq!(h.state().await, None, "and was given back");
    assert!(
        tokio::time::Instant::now() < started + LEASE,
        "long before its lease would have run out"
    );
}

#[tokio::test(start_paused = true)]
async fn keep_alive_holds_the_key_past_its_lease_through_failed_renewals() {
    let h = harness();
    let lease = h.hold().await;
    let keeper = tokio::spawn(lease.keep_alive());
    h.store.script("renew", &[Act::Fail, Act::Fail, Act::Fail]);
    for _ in 0..10 {
        tokio::time::sleep(LEASE / 2).await;
        assert!(h.held_by_someone().await);
    }
    assert!(matches!(
        h.leases.acquire(request(1)).await.unwrap(),
        Acquired::Existing(_)
    ));
    keeper.abort();
    assert_eq!(lease.complete(stored()).await, KeyFate::Kept);
}

/// Pins: a completion that could not be written was retried for 60 s and
/// then dropped, after which a retry past the lease ran the upstream again.
#[tokio::test(start_paused = true)]
async fn a_received_answer_keeps_being_recorded_for_as_long_as_the_store_is_down() {
    let h = harness();
    let lease = h.hold().await;
    // About five minutes of failures at the backoff's 2 s cap.
    h.store.script("complete", &[Act::Fail; 160]);
    assert_eq!(lease.complete(stored()).await, KeyFate::Kept);
    assert_eq!(h.leases.backlog().len(), 1);
    assert_eq!(h.metrics.pending_completions().get(), 1);
    tokio::time::sleep(Duration::from_secs(120)).await;
    assert!(h.held_by_someone().await, "still held, still renewed");
    h.tasks.close();
    h.tasks.wait().await;
    assert!(matches!(h.state().await, Some(RecordState::Completed(_))));
    assert_eq!(h.leases.backlog().len(), 0);
    assert_eq!(h.metrics.pending_completions().get(), 0);
}

#[tokio::test(start_paused = true)]
async fn a_full_backlog_refuses_new_claims_until_it_drains() {
    let h = harness();
    h.store.script("complete", &[Act::Fail; 14]);
    for fp in [1, 2] {
        let other = ClaimRequest {
            key: RecordKey {
                scope: Scope([fp; 32]),
                key: [fp; 32],
            },
            ..request(fp)
        };
        let Ok(Acquired::Held(lease)) = h.leases.acquire(other).await else {
            panic!("claim {fp}");
        };
        assert_eq!(lease.complete(stored()).await, KeyFate::Kept);
    }
    assert_eq!(h.leases.backlog().len(), 2, "the harness allows two");
    let refused = h.leases.acquire(request(1)).await.err();
    assert!(
        matches!(refused, Some(StoreError::Backlog { pending: 2 })),
        "{refused:?}"
    );
    h.tasks.close();
    h.tasks.wait().await;
    assert!(matches!(
        h.leases.acquire(request(1)).await,
        Ok(Acquired::Held(_))
    ));
}

/// Pins consumer review L2's seam: a JetStream consumer sent `+WPI` on a
/// timer whether or not the claim was still its own. [`Holding`] says
/// so: ours once claimed and while renewals succeed; not once they have
/// failed for a whole lease (another claimant may take the key over), and
/// not once a renewal found the token gone (an operator deleted the key),
/// for good.
#[tokio::test(start_paused = true)]
async fn holding_says_whether_the_claim_is_still_ours() {
    let h = harness();
    let holding = Arc::new(Holding::default());
    assert!(!holding.is_ours(), "not before the claim");
    let claim = ClaimRequest {
        holding: Some(holding.clone()),
        ..request(1)
    };
    let Acquired::Held(lease) = h.leases.acquire(claim).await.unwrap() else {
        panic!("claim");
    };
    assert!(holding.is_ours());
    let keeper = tokio::spawn(lease.keep_alive());
    for _ in 0..6 {
        tokio::time::sleep(LEASE / 2).await;
        assert!(holding.is_ours(), "renewed");
    }
    // Renewals failing for longer than a lease.
    h.store.script("renew", &[Act::Fail; 40]);
    tokio::time::sleep(LEASE + LEASE / 2).await;
    assert!(!holding.is_ours(), "unconfirmed for a whole lease");
    while h.store.remaining("renew") > 0 {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tokio::time::sleep(LEASE / 2).await;
    assert!(holding.is_ours(), "renewed again, nobody took it");
    // Deleted under it: the next renewal finds the token gone.
    assert!(h.store.delete(&key()).await.unwrap());
    tokio::time::sleep(LEASE / 2).await;
    assert!(!holding.is_ours(), "lost");
    keeper.abort();
    assert_eq!(lease.complete(stored()).await, KeyFate::TakenOver);
    assert!(!holding.is_ours(), "lost for good");
}
