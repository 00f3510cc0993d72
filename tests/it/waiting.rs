//! Duplicates that wait (`in_flight = { wait }`): they get the first
//! request's answer instead of a 409, on every backend and across
//! replicas; a released first attempt is taken over by exactly one of
//! them; a wait that runs out is a 409; and a 409's `Retry-After` follows
//! the route's observed latency.

use crate::support::cluster::Cluster;
use crate::support::services::{database_url, require_postgres};
use crate::support::{
    backend_tests, metric_value, timed_backend_tests, wait_for, Action, Backend, Proxy, Resp,
    Route, TestConfig, TestSchema, Upstream, ORDERS,
};
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

const BODY: &str = r#"{"item":"book","qty":1}"#;

// Two hundred connections at once queue in the kernel's accept backlog
// beyond what a paused clock can wait for (it jumps ahead while the kernel
// works): real time.
backend_tests!(two_hundred_waiters_get_the_replay_and_the_upstream_runs_once);
timed_backend_tests!(
    a_released_first_attempt_is_run_again_by_exactly_one_waiter,
    a_wait_that_runs_out_is_a_409,
    retry_after_follows_the_routes_observed_latency,
);

fn wait_route(path: &str, wait: &str) -> Route {
    let mut t = toml::Table::new();
    t.insert("wait".into(), wait.into());
    Route::post(path).set("in_flight", toml::Value::Table(t))
}

async fn join(sends: Vec<tokio::task::JoinHandle<Resp>>) -> Vec<Resp> {
    futures_util::future::join_all(sends)
        .await
        .into_iter()
        .map(|r| r.expect("request task"))
        .collect()
}

/// Every duplicate gets the first request's 201, replayed; the upstream
/// ran once.
fn assert_all_replays(first: &Resp, dups: &[Resp]) {
    assert_eq!(first.status(), 201, "{}", first.text());
    for r in dups {
        assert_eq!(r.status(), 201, "{}", r.text());
        assert!(r.replayed(), "{r:?}");
        assert_eq!(r.body, first.body);
    }
}

async fn two_hundred_waiters_get_the_replay_and_the_upstream_runs_once(backend: Backend) {
    let up = Upstream::start().await;
    let proxy = Proxy::builder(backend, up.addr)
        .routes(vec![wait_route(ORDERS, "10s")])
        .admin()
        .start()
        .await;
    up.push(Action::Delay(Duration::from_millis(1000)));
    let first = tokio::spawn(proxy.post(ORDERS).key("k").body(BODY).send());
    up.wait_hits(ORDERS, 1).await;
    let dups: Vec<_> = (0..200)
        .map(|_| tokio::spawn(proxy.post(ORDERS).key("k").body(BODY).send()))
        .collect();
    let waiting = || async {
        metric_value(
            &proxy.admin_get("/metrics").send().await.text(),
            "idemgate_waiters",
        )
    };
    wait_for("waiters in the gauge", || async {
        (waiting().await > 0).then_some(())
    })
    .await;
    let dups = join(dups).await;
    let first = first.await.expect("first");
    assert_all_replays(&first, &dups);
    assert_eq!(up.hits(ORDERS), 1, "the upstream ran once");
    assert_eq!(waiting().await, 0, "every waiter left the registry");
}

/// The first attempt is answered 503 (the key is released): one waiter
/// wins the claim through the store and runs it; the others wait for that
/// one and replay its 201.
async fn a_released_first_attempt_is_run_again_by_exactly_one_waiter(backend: Backend) {
    let up = Upstream::start().await;
    let proxy = Proxy::builder(backend, up.addr)
        .routes(vec![wait_route(ORDERS, "10s")])
        .start()
        .await;
    let path = "/orders?delay_ms=400";
    up.push(Action::Status(503));
    let first = tokio::spawn(proxy.post(path).key("k").body(BODY).send());
    up.wait_hits(ORDERS, 1).await;
    let dups = (0..50)
        .map(|_| tokio::spawn(proxy.post(path).key("k").body(BODY).send()))
        .collect();
    let dups = join(dups).await;
    let first = first.await.expect("first");
    assert_eq!(first.status(), 503, "{}", first.text());
    assert_eq!(up.hits(ORDERS), 2, "run once more, by one waiter");
    let ran: Vec<&Resp> = dups.iter().filter(|r| !r.replayed()).collect();
    assert_eq!(ran.len(), 1, "exactly one waiter executed");
    for r in &dups {
        assert_eq!(r.status(), 201, "{}", r.text());
        assert_eq!(r.body, ran[0].body);
    }
}

async fn a_wait_that_runs_out_is_a_409(backend: Backend) {
    let up = Upstream::start().await;
    let proxy = Proxy::builder(backend, up.addr)
        .routes(vec![wait_route(ORDERS, "300ms")])
        .start()
        .await;
    up.push(Action::Delay(Duration::from_millis(2000)));
    let first = tokio::spawn(proxy.post(ORDERS).key("k").body(BODY).send());
    up.wait_hits(ORDERS, 1).await;
    let started = Instant::now();
    let dups = (0..5)
        .map(|_| tokio::spawn(proxy.post(ORDERS).key("k").body(BODY).send()))
        .collect();
    for r in join(dups).await {
        r.assert_problem(409);
        let secs: u64 = r
            .header("retry-after")
            .expect("retry-after")
            .parse()
            .unwrap();
        assert!((1..=30).contains(&secs), "{secs}");
    }
    let waited = started.elapsed();
    assert!(waited >= Duration::from_millis(300), "{waited:?}");
    let first = first.await.expect("first");
    assert_eq!(first.status(), 201);
    assert!(proxy
        .post(ORDERS)
        .key("k")
        .body(BODY)
        .send()
        .await
        .replayed());
    assert_eq!(up.hits(ORDERS), 1);
}

/// `in_flight = "reject"` (the default) answers 409 at once. On a fresh
/// proxy, before any execution was seen, it says 1 (not the 30 s left on
/// the lease, which an SDK honouring it would sleep through); once the
/// route's requests are seen to take ~1.5 s, it says 2.
async fn retry_after_follows_the_routes_observed_latency(backend: Backend) {
    let up = Upstream::start().await;
    let proxy = Proxy::builder(backend, up.addr).start().await;
    let path = "/orders?delay_ms=1500";
    let retry_after = |r: &Resp| -> u64 {
        r.assert_problem(409);
        r.header("retry-after")
            .expect("retry-after")
            .parse()
            .unwrap()
    };
    let slow = tokio::spawn(proxy.post(path).key("k0").body(BODY).send());
    up.wait_hits(ORDERS, 1).await;
    let unknown = retry_after(&proxy.post(path).key("k0").body(BODY).send().await);
    assert_eq!(
        unknown, 1,
        "about a second, never the lease's remaining time"
    );
    assert_eq!(slow.await.expect("k0").status(), 201);

    let slow = tokio::spawn(proxy.post(path).key("k1").body(BODY).send());
    up.wait_hits(ORDERS, 2).await;
    let known = retry_after(&proxy.post(path).key("k1").body(BODY).send().await);
    assert_eq!(known, 2, "about one execution");
    assert_eq!(slow.await.expect("k1").status(), 201);
}

// ===== across replicas =====

/// Two replicas on one PostgreSQL schema (and Redis prefix), a small
/// store pool each, duplicates waiting up to 10 s.
async fn pair(up: &Upstream, redis: bool) -> Cluster {
    // Info, to see the notification listener start; not the access log.
    let env = || vec![("RUST_LOG", "info,idemgate::access=warn".to_string())];
    Cluster::start(2, up, redis, wait_route(ORDERS, "10s"), 4, |_| env()).await
}

/// 200 duplicates split over two replicas (a small store pool each) all
/// get the replay while the first runs on one of them; the waiters on the
/// other replica learn of the answer through the store.
async fn waiters_on_two_replicas_get_the_replay(redis: bool) {
    let up = Upstream::start().await;
    let pair = pair(&up, redis).await;
    up.push(Action::Delay(Duration::from_millis(1000)));
    let first = tokio::spawn(pair.order(0, "k", BODY).send());
    up.wait_hits(ORDERS, 1).await;
    let dups = (0..200)
        .map(|i| tokio::spawn(pair.order(i, "k", BODY).send()))
        .collect();
    let dups = join(dups).await;
    let first = first.await.expect("first");
    assert_all_replays(&first, &dups);
    assert_eq!(up.hits(ORDERS), 1, "the upstream ran once");
    for replica in &pair.replicas {
        let log = replica.log();
        assert!(
            log.contains("listening for key notifications"),
            "each replica listens for the others' notifications: {log}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hundred_waiters_on_two_postgres_replicas_get_the_replay() {
    waiters_on_two_replicas_get_the_replay(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hundred_waiters_on_two_postgres_replicas_with_redis_get_the_replay() {
    waiters_on_two_replicas_get_the_replay(true).await;
}

/// On another replica, a released first attempt is also taken over by
/// exactly one waiter (the store decides which).
async fn a_release_on_one_replica_is_taken_over_by_one_waiter_on_either(redis: bool) {
    let up = Upstream::start().await;
    let pair = pair(&up, redis).await;
    up.push(Action::Status(503));
    let order = |i: usize| {
        pair.replicas[i % 2]
            .post("/orders?delay_ms=400")
            .key("k")
            .body(BODY.to_string())
    };
    let first = tokio::spawn(order(0).send());
    up.wait_hits(ORDERS, 1).await;
    let dups = join((0..40).map(|i| tokio::spawn(order(i).send())).collect()).await;
    assert_eq!(first.await.expect("first").status(), 503);
    assert_eq!(up.hits(ORDERS), 2);
    assert_eq!(dups.iter().filter(|r| !r.replayed()).count(), 1);
    assert!(dups.iter().all(|r| r.status() == 201));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_on_one_postgres_replica_is_taken_over_by_exactly_one_waiter() {
    a_release_on_one_replica_is_taken_over_by_one_waiter_on_either(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_on_one_postgres_replica_with_redis_is_taken_over_by_exactly_one_waiter() {
    a_release_on_one_replica_is_taken_over_by_one_waiter_on_either(true).await;
}

// ===== cross-replica notifications =====

/// `store::notify`: what one process publishes reaches every process
/// listening on the same schema's channel (itself included), and none on
/// another schema's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn key_notifications_reach_every_listener_on_the_schema() {
    use idemgate::store::notify::KeyNotifier;
    use std::sync::Mutex;
    let db = database_url();
    require_postgres(&db).await;
    let up = Upstream::start().await;
    let store_of = |schema: &str| {
        TestConfig::new(up.addr)
            .set("store.backend", "postgres")
            .set("store.url", db.as_str())
            .set("store.schema", schema)
            .parse()
            .restart
            .store
    };
    let (same, other) = (TestSchema::new(), TestSchema::new());
    let seen: Vec<Arc<Mutex<Vec<String>>>> = (0..3).map(|_| Arc::default()).collect();
    let notifiers: Vec<KeyNotifier> = seen
        .iter()
        .zip([&same, &same, &other])
        .map(|(log, schema)| {
            let log = log.clone();
            KeyNotifier::spawn(
                &store_of(&schema.schema),
                Arc::new(move |id: &str| log.lock().unwrap().push(id.to_string())),
            )
            .expect("a notifier")
        })
        .collect();
    // LISTEN takes effect asynchronously: publish until both have it.
    wait_for("the notification on both listeners", || {
        notifiers[0].publish("abc123".into());
        let seen = seen.clone();
        async move {
            tokio::time::sleep(Duration::from_millis(50)).await;
            let got = |i: usize| seen[i].lock().unwrap().contains(&"abc123".to_string());
            (got(0) && got(1)).then_some(())
        }
    })
    .await;
    // A burst goes out in batches; every id arrives.
    let burst: Vec<String> = (0..600).map(|i| format!("id-{i}")).collect();
    for id in &burst {
        notifiers[0].publish(id.clone());
    }
    crate::support::wait_until("the whole burst on the other listener", || {
        let got = seen[1].lock().unwrap();
        burst.iter().all(|id| got.contains(id))
    })
    .await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        seen[2].lock().unwrap().is_empty(),
        "another schema's channel"
    );
}

/// Regression: duplicates still waiting when the server drained held their
/// connections until their own wait ran out (up to 5 minutes), past the
/// grace period. Now they answer 409 when draining starts (a client retries
/// on another replica); the first request still finishes and is stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiting_duplicates_answer_409_when_the_server_drains() {
    let up = Upstream::start().await;
    let mut proxy = Proxy::builder(Backend::Sqlite, up.addr)
        .routes(vec![wait_route(ORDERS, "60s")])
        .set("server.shutdown_delay", "0s")
        .set("server.shutdown_grace", "10s")
        .admin()
        .start()
        .await;
    up.push(Action::Delay(Duration::from_millis(1500)));
    let first = tokio::spawn(proxy.post(ORDERS).key("k").body(BODY).send());
    up.wait_hits(ORDERS, 1).await;
    let dup = tokio::spawn(proxy.post(ORDERS).key("k").body(BODY).send());
    wait_for("the duplicate to wait", || async {
        let text = proxy.admin_get("/metrics").send().await.text();
        (metric_value(&text, "idemgate_waiters") == 1).then_some(())
    })
    .await;
    proxy.signal_shutdown();
    // Before the fix: the replay, once the first finished (1.5 s).
    dup.await.expect("duplicate").assert_problem(409);
    assert_eq!(first.await.expect("first").status(), 201);
    proxy.stopped().await;
    assert_eq!(up.hits(ORDERS), 1);
}
