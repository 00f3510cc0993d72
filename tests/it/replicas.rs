//! Several replicas: real `idemgate serve` processes sharing one PostgreSQL
//! schema (and, where said, one Redis prefix), in front of one upstream.

use crate::support;
use crate::support::cluster::Cluster;
use crate::support::{wait_for, Action, Resp, Route, ServeProcess, Upstream, ORDERS};
use std::time::Duration;

const BODY: &str = r#"{"item":"book","qty":1}"#;

/// `n` replicas serving `POST /orders` with a 3 s lease.
async fn cluster(n: usize, up: &Upstream, redis: bool) -> Cluster {
    Cluster::start(n, up, redis, lease_route("3s"), 8, |_| Vec::new()).await
}

fn lease_route(lease: &str) -> Route {
    Route::post(ORDERS).set("lease", lease)
}

async fn metrics_of(p: &ServeProcess) -> String {
    p.admin_get("/metrics").send().await.text()
}

// ===== duplicates spread over replicas =====

async fn concurrent_duplicates_over_replicas_execute_once(redis: bool) {
    let up = Upstream::start().await;
    let cluster = cluster(3, &up, redis).await;
    // The first request to arrive is slow, so the others overlap it.
    up.push(Action::Delay(Duration::from_millis(500)));
    let sends = (0..45).map(|i| tokio::spawn(cluster.order(i, "k-storm", BODY).send()));
    let answers: Vec<Resp> = futures_util::future::join_all(sends)
        .await
        .into_iter()
        .map(|r| r.expect("request task"))
        .collect();

    assert_eq!(up.hits(ORDERS), 1, "the upstream ran exactly once");
    let ok: Vec<&Resp> = answers.iter().filter(|r| r.status.is_success()).collect();
    for r in &answers {
        if !r.status.is_success() {
            r.assert_problem(409);
            assert!(r.header("retry-after").is_some(), "{r:?}");
        }
    }
    assert!(!ok.is_empty());
    for r in &ok {
        assert_eq!(r.status(), 201);
        assert_eq!(r.body, ok[0].body, "every 2xx body is identical");
    }
    assert_eq!(
        ok.iter().filter(|r| !r.replayed()).count(),
        1,
        "one answer is the execution, the other 2xx are replays"
    );
    assert_eq!(ok[0].json()["hits"], 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_identical_requests_over_three_replicas_reach_the_upstream_once() {
    concurrent_duplicates_over_replicas_execute_once(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_identical_requests_over_three_replicas_with_redis_reach_the_upstream_once() {
    concurrent_duplicates_over_replicas_execute_once(true).await;
}

// ===== replay on another replica =====

async fn stored_on_one_replica_replays_on_another(redis: bool) {
    let up = Upstream::start().await;
    let cluster = cluster(2, &up, redis).await;
    let first = cluster.order(0, "k-cross", BODY).send().await;
    assert_eq!(first.status(), 201, "{}", first.text());
    assert!(!first.replayed());
    for _ in 0..2 {
        let again = cluster.order(1, "k-cross", BODY).send().await;
        assert_eq!(again.status(), 201, "{}", again.text());
        assert!(again.replayed(), "{:?}", again.headers);
        assert_eq!(again.body, first.body, "byte for byte");
        assert_eq!(again.header("location"), first.header("location"));
    }
    assert_eq!(up.hits(ORDERS), 1);
    if redis {
        // The second replay on replica 1 came from Redis: the first cached
        // the record (or replica 0 did on completion).
        let m = metrics_of(&cluster.replicas[1]).await;
        assert!(
            support::metric_value(&m, "idemgate_redis_fast_path_hits_total") >= 1,
            "{m}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_stored_through_one_replica_replays_byte_identical_on_another() {
    stored_on_one_replica_replays_on_another(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_stored_through_one_replica_replays_byte_identical_on_another_with_redis() {
    stored_on_one_replica_replays_on_another(true).await;
}

// ===== a replica killed mid-request =====

async fn killed_replica_claim_is_taken_over_elsewhere_after_the_lease(redis: bool) {
    let up = Upstream::start().await;
    let mut cluster = cluster(2, &up, redis).await;
    up.push(Action::Delay(Duration::from_secs(30)));
    let doomed = tokio::spawn(cluster.order(0, "k-killed", BODY).try_send());
    up.wait_hits(ORDERS, 1).await;
    cluster.replicas[0].kill();
    assert!(
        doomed.await.expect("request task").is_err(),
        "the client sees the killed replica hang up"
    );

    // Well within the 3 s lease: the dead holder still blocks the key.
    let early = cluster.order(1, "k-killed", BODY).send().await;
    early.assert_problem(409);
    assert!(early.header("retry-after").is_some());
    assert_eq!(up.hits(ORDERS), 1);

    let taken = wait_for("the killed replica's lease to run out", || async {
        let r = cluster.order(1, "k-killed", BODY).send().await;
        (r.status() != 409).then_some(r)
    })
    .await;
    assert_eq!(taken.status(), 201, "{}", taken.text());
    assert!(!taken.replayed());
    assert_eq!(up.hits(ORDERS), 2, "executed once more, by the takeover");
    let replay = cluster.order(1, "k-killed", BODY).send().await;
    assert!(replay.replayed());
    assert_eq!(replay.body, taken.body);
    assert_eq!(up.hits(ORDERS), 2);

    let m = metrics_of(&cluster.replicas[1]).await;
    assert!(
        m.contains("idemgate_lease_takeovers_total{route=\"/orders\"} 1"),
        "{m}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_replicas_key_gets_409_on_another_until_its_lease_runs_out_then_is_taken_over() {
    killed_replica_claim_is_taken_over_elsewhere_after_the_lease(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_replicas_key_gets_409_on_another_until_its_lease_runs_out_then_is_taken_over_with_redis(
) {
    killed_replica_claim_is_taken_over_elsewhere_after_the_lease(true).await;
}

// ===== fingerprint mismatch across replicas =====

async fn different_request_on_another_replica_is_422(redis: bool) {
    let up = Upstream::start().await;
    let cluster = cluster(2, &up, redis).await;
    let first = cluster.order(0, "k-fp", BODY).send().await;
    assert_eq!(first.status(), 201);
    for _ in 0..2 {
        let other = cluster
            .order(1, "k-fp", r#"{"item":"pen","qty":9}"#)
            .send()
            .await;
        let problem = other.assert_problem(422);
        assert!(
            problem["type"]
                .as_str()
                .unwrap_or_default()
                .ends_with("#problem-key-reused"),
            "{problem}"
        );
    }
    assert_eq!(up.hits(ORDERS), 1);
    // The original request still replays there.
    let again = cluster.order(1, "k-fp", BODY).send().await;
    assert!(again.replayed());
    assert_eq!(again.body, first.body);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_key_with_a_different_body_through_another_replica_is_rejected_with_422() {
    different_request_on_another_replica_is_422(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_key_with_a_different_body_through_another_replica_with_redis_is_rejected_with_422(
) {
    different_request_on_another_replica_is_422(true).await;
}

// ===== clocks that disagree =====

/// Pins: leases followed each replica's own wall clock. With a 1 s lease and
/// replica 1's clock 3 s ahead, a request still running (and renewing) on
/// replica 0 was taken over by replica 1 and the upstream ran twice.
async fn replicas_whose_clocks_disagree_never_run_a_live_key_twice(redis: bool) {
    let up = Upstream::start().await;
    let cluster = Cluster::start(2, &up, redis, lease_route("1s"), 8, |i| {
        let offset = if i == 1 { "3000" } else { "0" };
        vec![("IDEMGATE_TEST_CLOCK_OFFSET_MS", offset.to_string())]
    })
    .await;
    up.push(Action::Delay(Duration::from_secs(3)));
    let first = tokio::spawn(cluster.order(0, "k-skew", BODY).send());
    up.wait_hits(ORDERS, 1).await;
    for _ in 0..5 {
        tokio::time::sleep(Duration::from_millis(400)).await;
        let dup = cluster.order(1, "k-skew", BODY).send().await;
        dup.assert_problem(409);
    }
    let first = first.await.expect("request task");
    assert_eq!(first.status(), 201, "{}", first.text());
    assert_eq!(up.hits(ORDERS), 1, "the live key ran once");
    let replay = cluster.order(1, "k-skew", BODY).send().await;
    assert!(replay.replayed(), "{:?}", replay.headers);
    assert_eq!(replay.body, first.body);
    assert_eq!(up.hits(ORDERS), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_whose_clocks_disagree_by_more_than_a_lease_never_run_a_live_key_twice() {
    replicas_whose_clocks_disagree_never_run_a_live_key_twice(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_whose_clocks_disagree_by_more_than_a_lease_never_run_a_live_key_twice_with_redis()
{
    replicas_whose_clocks_disagree_never_run_a_live_key_twice(true).await;
}
