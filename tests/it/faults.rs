//! Faults in the services behind the proxy: Redis killed and restarted,
//! PostgreSQL cut off through a relay, Redis missing at start-up. The
//! shared servers are never stopped: Redis faults use a private
//! `redis-server`, PostgreSQL faults a TCP relay in front of it.

use crate::support;
use crate::support::services::{postgres_addr, require_postgres, PrivateRedis, TcpRelay};
use crate::support::{
    database_url_via, wait_for, Action, Backend, Proxy, Resp, Route, Upstream, ORDERS,
};
use std::future::Future;
use std::time::Duration;

const BODY: &str = r#"{"item":"book","qty":1}"#;

/// A generous "it returned" bound: store.timeout is 2 s, redis.timeout
/// 250 ms. Not a performance number.
const ANSWERED_WITHIN: Duration = Duration::from_secs(5);

async fn answered<T>(what: &str, fut: impl Future<Output = T>) -> T {
    tokio::time::timeout(ANSWERED_WITHIN, fut)
        .await
        .unwrap_or_else(|_| panic!("{what} was not answered within {ANSWERED_WITHIN:?}"))
}

/// Sends `n` identical requests at once; the first to reach the upstream is
/// slow so the others overlap it. Returns the answers.
async fn storm(proxy: &Proxy, up: &Upstream, key: &str, n: usize) -> Vec<Resp> {
    up.push(Action::Delay(Duration::from_millis(400)));
    let sends = (0..n).map(|_| tokio::spawn(proxy.post(ORDERS).key(key).body(BODY).send()));
    let answers = answered(
        "a burst of duplicates",
        futures_util::future::join_all(sends),
    )
    .await;
    answers
        .into_iter()
        .map(|r| r.expect("request task"))
        .collect()
}

/// Every answer is the one execution, a replay of it, or a 409.
fn assert_ran_once(answers: &[Resp]) {
    let ok: Vec<&Resp> = answers.iter().filter(|r| r.status() == 201).collect();
    assert_eq!(
        ok.iter().filter(|r| !r.replayed()).count(),
        1,
        "{answers:?}"
    );
    for r in answers {
        if r.status() != 201 {
            r.assert_problem(409);
        }
        assert!(
            r.status() != 201 || r.body == ok[0].body,
            "every 2xx body is identical: {answers:?}"
        );
    }
}

// ===== Redis =====

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_redis_killed_mid_run_duplicates_still_run_once_and_stored_keys_replay_without_stalling(
) {
    let mut redis = PrivateRedis::start();
    let up = Upstream::start().await;
    let proxy = Proxy::builder(Backend::PostgresRedis, up.addr)
        .redis_url(&redis.url())
        .start()
        .await;
    let stored = proxy.post(ORDERS).key("k-before").body(BODY).send().await;
    assert_eq!(stored.status(), 201, "{}", stored.text());
    let replay = proxy.post(ORDERS).key("k-before").body(BODY).send().await;
    assert!(replay.replayed());
    assert!(proxy.fast_path_hits() >= 1, "{}", proxy.metrics.encode());

    // A request is in flight when Redis dies.
    up.push(Action::Delay(Duration::from_millis(800)));
    let in_flight = tokio::spawn(proxy.post(ORDERS).key("k-during").body(BODY).send());
    up.wait_hits(ORDERS, 2).await;
    redis.kill();
    let dup = answered(
        "a duplicate of the in-flight request",
        proxy.post(ORDERS).key("k-during").body(BODY).send(),
    )
    .await;
    dup.assert_problem(409);
    let first = answered("the in-flight request", in_flight)
        .await
        .expect("request task");
    assert_eq!(first.status(), 201, "{}", first.text());
    assert!(!first.replayed());
    assert_eq!(up.hits(ORDERS), 2);

    // Stored keys replay from PostgreSQL, old and new.
    for (key, original) in [("k-before", &stored), ("k-during", &first)] {
        let r = answered(
            "a replay with Redis down",
            proxy.post(ORDERS).key(key).body(BODY).send(),
        )
        .await;
        assert_eq!(r.status(), 201, "{}", r.text());
        assert!(r.replayed());
        assert_eq!(r.body, original.body);
    }

    // A burst of duplicates on a new key still runs once.
    let answers = storm(&proxy, &up, "k-storm", 12).await;
    assert_ran_once(&answers);
    assert_eq!(up.hits(ORDERS), 3);
    assert!(proxy.fast_path_errors() > 0, "{}", proxy.metrics.encode());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_redis_restarts_the_fast_path_resumes_without_restarting_the_proxy() {
    let mut redis = PrivateRedis::start();
    let up = Upstream::start().await;
    let proxy = Proxy::builder(Backend::PostgresRedis, up.addr)
        .redis_url(&redis.url())
        .start()
        .await;
    let stored = proxy.post(ORDERS).key("k-resume").body(BODY).send().await;
    assert_eq!(stored.status(), 201);

    redis.kill();
    for _ in 0..3 {
        let r = answered(
            "a replay with Redis down",
            proxy.post(ORDERS).key("k-resume").body(BODY).send(),
        )
        .await;
        assert!(r.replayed());
    }
    let errors_while_down = proxy.fast_path_errors();
    assert!(errors_while_down > 0, "{}", proxy.metrics.encode());

    // An empty Redis on the same port: the first replay refills it from
    // PostgreSQL, later ones are fast-path hits again.
    redis.restart();
    let hits_before = proxy.fast_path_hits();
    wait_for("fast-path hits to increase after the restart", || async {
        let r = answered(
            "a replay after the restart",
            proxy.post(ORDERS).key("k-resume").body(BODY).send(),
        )
        .await;
        assert!(r.replayed(), "{r:?}");
        assert_eq!(r.body, stored.body);
        (proxy.fast_path_hits() > hits_before).then_some(())
    })
    .await;
    // And a new key is still guarded once (Redis lock + PostgreSQL claim).
    let answers = storm(&proxy, &up, "k-after", 8).await;
    assert_ran_once(&answers);
    assert_eq!(up.hits(ORDERS), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_redis_down_at_start_requests_work_on_postgres_alone() {
    let closed = Upstream::refusing_addr();
    let up = Upstream::start().await;
    let proxy = Proxy::builder(Backend::PostgresRedis, up.addr)
        .redis_url(&format!("redis://{closed}"))
        .start()
        .await;
    let first = answered(
        "a new key",
        proxy.post(ORDERS).key("k-alone").body(BODY).send(),
    )
    .await;
    assert_eq!(first.status(), 201, "{}", first.text());
    let replay = answered(
        "a replay",
        proxy.post(ORDERS).key("k-alone").body(BODY).send(),
    )
    .await;
    assert!(replay.replayed());
    assert_eq!(replay.body, first.body);
    let other = answered(
        "a different body",
        proxy.post(ORDERS).key("k-alone").body("{}").send(),
    )
    .await;
    other.assert_problem(422);
    let answers = storm(&proxy, &up, "k-alone-storm", 8).await;
    assert_ran_once(&answers);
    assert_eq!(up.hits(ORDERS), 2);
    assert_eq!(proxy.fast_path_hits(), 0);
    assert!(proxy.fast_path_errors() > 0, "{}", proxy.metrics.encode());
}

// ===== PostgreSQL =====

async fn postgres_cut_rejects_protected_requests_and_recovers(backend: Backend) {
    require_postgres(&support::services::database_url()).await;
    let relay = TcpRelay::start(postgres_addr()).await;
    let up = Upstream::start().await;
    let proxy = Proxy::builder(backend, up.addr)
        .store_url(&database_url_via(relay.addr()))
        .routes(vec![
            Route::post(ORDERS),
            Route::post("/webhooks").set("on_store_error", "forward"),
        ])
        // The store-following readiness; the default is in readiness.rs.
        .set("server.readiness", "store")
        .admin()
        .start()
        .await;
    let old = proxy.post(ORDERS).key("k-old").body(BODY).send().await;
    assert_eq!(old.status(), 201, "{}", old.text());
    assert_eq!(proxy.admin_get("/readyz").send().await.status(), 200);

    relay.cut();
    let hits = up.hits(ORDERS);
    for key in ["k-new", "k-new", "k-other"] {
        let r = answered(
            "a protected request with PostgreSQL cut",
            proxy.post(ORDERS).key(key).body(BODY).send(),
        )
        .await;
        let problem = r.assert_problem(503);
        assert!(
            problem["type"]
                .as_str()
                .unwrap_or_default()
                .ends_with("#problem-store-unavailable"),
            "{problem}"
        );
        assert!(r.header("retry-after").is_some(), "{r:?}");
    }
    assert_eq!(up.hits(ORDERS), hits, "nothing was forwarded unguarded");

    // Unprotected traffic keeps flowing.
    let pass = answered("an unprotected request", proxy.get("/catalog").send()).await;
    assert_eq!(pass.status(), 200);
    assert_eq!(up.hits("/catalog"), 1);
    // A route that chose availability is forwarded, unguarded.
    let hook = answered(
        "an on_store_error = \"forward\" request",
        proxy.post("/webhooks").key("k-hook").body(BODY).send(),
    )
    .await;
    assert_eq!(hook.status(), 200, "{}", hook.text());
    assert!(!hook.replayed());
    assert_eq!(up.hits("/webhooks"), 1);

    let ready = answered("/readyz while cut", proxy.admin_get("/readyz").send()).await;
    assert_eq!(ready.status(), 503, "{}", ready.text());

    relay.restore();
    wait_for("/readyz to answer 200 after the restore", || async {
        let r = proxy.admin_get("/readyz").send().await;
        (r.status() == 200).then_some(())
    })
    .await;
    // Recovered by itself: old keys replay, new keys run once.
    let replay = proxy.post(ORDERS).key("k-old").body(BODY).send().await;
    assert_eq!(replay.status(), 201, "{}", replay.text());
    assert!(replay.replayed());
    assert_eq!(replay.body, old.body);
    let fresh = proxy.post(ORDERS).key("k-new").body(BODY).send().await;
    assert_eq!(fresh.status(), 201, "{}", fresh.text());
    assert!(!fresh.replayed());
    let again = proxy.post(ORDERS).key("k-new").body(BODY).send().await;
    assert!(again.replayed());
    assert_eq!(up.hits(ORDERS), hits + 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_postgres_cut_protected_requests_get_503_and_nothing_is_forwarded_until_it_is_restored(
) {
    postgres_cut_rejects_protected_requests_and_recovers(Backend::Postgres).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_postgres_cut_behind_redis_new_keys_get_503_and_nothing_is_forwarded_until_it_is_restored(
) {
    postgres_cut_rejects_protected_requests_and_recovers(Backend::PostgresRedis).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_redis_frozen_requests_are_answered_by_postgres_and_no_reply_goes_to_the_wrong_key() {
    let redis = PrivateRedis::start();
    let up = Upstream::start().await;
    let proxy = Proxy::builder(Backend::PostgresRedis, up.addr)
        .redis_url(&redis.url())
        .start()
        .await;
    let a = proxy.post("/orders?v=a").key("k-a").body(BODY).send().await;
    let b = proxy.post("/orders?v=b").key("k-b").body(BODY).send().await;
    assert_eq!((a.status(), b.status()), (201, 201));
    assert_ne!(a.body, b.body);

    // Connections stay open, nothing answers: every Redis call times out.
    redis.pause();
    for _ in 0..3 {
        let r = answered(
            "a replay with Redis frozen",
            proxy.post("/orders?v=a").key("k-a").body(BODY).send(),
        )
        .await;
        assert!(r.replayed());
        assert_eq!(r.body, a.body);
    }
    let fresh = answered(
        "a new key with Redis frozen",
        proxy.post(ORDERS).key("k-frozen").body(BODY).send(),
    )
    .await;
    assert_eq!(fresh.status(), 201, "{}", fresh.text());
    assert!(proxy.fast_path_errors() > 0);

    // Thawed, Redis delivers the replies the proxy gave up on; none of them
    // may be taken for the answer to a later call.
    redis.resume();
    let hits_before = proxy.fast_path_hits();
    wait_for("the fast path to answer again after the thaw", || async {
        let rb = proxy.post("/orders?v=b").key("k-b").body(BODY).send().await;
        assert!(rb.replayed(), "{rb:?}");
        assert_eq!(rb.body, b.body, "k-b replays its own response");
        let ra = proxy.post("/orders?v=a").key("k-a").body(BODY).send().await;
        assert!(ra.replayed(), "{ra:?}");
        assert_eq!(ra.body, a.body, "k-a replays its own response");
        (proxy.fast_path_hits() > hits_before + 1).then_some(())
    })
    .await;
    let again = proxy.post(ORDERS).key("k-frozen").body(BODY).send().await;
    assert!(again.replayed());
    assert_eq!(again.body, fresh.body);
    assert_eq!(up.hits(ORDERS), 3);
}

async fn postgres_blip_during_the_upstream_call_still_records_the_response(backend: Backend) {
    require_postgres(&support::services::database_url()).await;
    let relay = TcpRelay::start(postgres_addr()).await;
    let up = Upstream::start().await;
    let proxy = Proxy::builder(backend, up.addr)
        .store_url(&database_url_via(relay.addr()))
        .start()
        .await;
    up.push(Action::Delay(Duration::from_millis(800)));
    let pending = tokio::spawn(proxy.post(ORDERS).key("k-blip").body(BODY).send());
    up.wait_hits(ORDERS, 1).await;
    // Claimed and forwarded; PostgreSQL goes away before the completion.
    relay.cut();
    support::wait_until("the upstream to answer", || up.completed(ORDERS) == 1).await;
    // Let the first attempt to record the completion fail, then come back
    // within the proxy's completion retries.
    tokio::time::sleep(Duration::from_millis(300)).await;
    relay.restore();
    let first = pending.await.expect("request task");
    assert_eq!(first.status(), 201, "{}", first.text());
    assert!(!first.replayed());
    let retry = proxy.post(ORDERS).key("k-blip").body(BODY).send().await;
    assert_eq!(retry.status(), 201, "{}", retry.text());
    assert!(
        retry.replayed(),
        "the completion was recorded after the blip"
    );
    assert_eq!(retry.body, first.body);
    assert_eq!(up.hits(ORDERS), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_postgres_blip_while_the_upstream_runs_still_records_the_response_for_the_retry() {
    postgres_blip_during_the_upstream_call_still_records_the_response(Backend::Postgres).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_postgres_blip_while_the_upstream_runs_behind_redis_still_records_the_response_for_the_retry(
) {
    postgres_blip_during_the_upstream_call_still_records_the_response(Backend::PostgresRedis).await;
}

/// Pins: with PostgreSQL down for longer than the proxy's quick completion
/// retries, the response was never recorded; once the lease ran out, the
/// client's retry would have run the request a second time.
async fn postgres_outage_longer_than_the_quick_retries_still_records_the_response(
    backend: Backend,
) {
    require_postgres(&support::services::database_url()).await;
    let relay = TcpRelay::start(postgres_addr()).await;
    let up = Upstream::start().await;
    let proxy = Proxy::builder(backend, up.addr)
        .store_url(&database_url_via(relay.addr()))
        .set("store.timeout", "300ms")
        .start()
        .await;
    up.push(Action::Delay(Duration::from_millis(500)));
    let pending = tokio::spawn(proxy.post(ORDERS).key("k-outage").body(BODY).send());
    up.wait_hits(ORDERS, 1).await;
    relay.cut();
    // The client gets its response although nothing could be recorded yet.
    let first = answered("the first response", pending)
        .await
        .expect("request task");
    assert_eq!(first.status(), 201, "{}", first.text());
    relay.restore();
    let retry = support::wait_for("the completion to be recorded late", || async {
        let r = proxy.post(ORDERS).key("k-outage").body(BODY).send().await;
        match r.status() {
            409 | 503 => None,
            _ => Some(r),
        }
    })
    .await;
    assert!(retry.replayed(), "{}", retry.text());
    assert_eq!(retry.body, first.body);
    assert_eq!(up.hits(ORDERS), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_postgres_outage_longer_than_the_quick_retries_still_records_the_response_for_the_retry()
{
    postgres_outage_longer_than_the_quick_retries_still_records_the_response(Backend::Postgres)
        .await;
}
