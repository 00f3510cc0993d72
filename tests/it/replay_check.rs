//! `replay_check` (issue 21): a stored answer is replayed only once the
//! upstream says the retry's credential is still good. On every backend
//! (the Redis fast path replays too), and through the real binary.

use crate::support::upstream::Action;
use crate::support::{
    backend_tests, free_port, Backend, Proxy, Route, ServeProcess, TestConfig, Upstream, ORDERS,
};
use idemgate::metrics::Outcome;

backend_tests!(
    a_replay_waits_for_the_check_and_a_refused_check_is_passed_on_without_executing,
    an_unanswered_check_is_a_503_never_a_replay_or_an_execution,
    a_passed_check_is_remembered_for_the_cache_time,
    a_duplicate_that_waited_is_checked_before_its_replay,
    a_check_that_times_out_is_a_503,
);

const BODY: &str = r#"{"item":"book","qty":1}"#;
const SESSION: &str = "/v1/session";

fn check(path: &str, upstream: Option<&str>) -> toml::Value {
    let mut t = toml::value::Table::new();
    t.insert("path".into(), path.into());
    if let Some(u) = upstream {
        t.insert("upstream".into(), u.into());
    }
    toml::Value::Table(t)
}

async fn a_replay_waits_for_the_check_and_a_refused_check_is_passed_on_without_executing(
    backend: Backend,
) {
    let up = Upstream::start().await;
    let proxy = Proxy::builder(backend, up.addr)
        .each_route("replay_check", check(SESSION, None))
        .start()
        .await;
    let send = || {
        proxy
            .post(ORDERS)
            .key("k-check")
            .header("authorization", "Bearer alice")
            .header("x-client-note", "not for the check")
            .body(BODY)
    };
    let first = send().send().await;
    assert_eq!(first.status(), 201);
    assert_eq!(up.hits(SESSION), 0, "a first request is not checked");

    let replay = send().send().await;
    assert!(replay.replayed(), "{}", replay.text());
    assert_eq!(replay.body, first.body);
    assert_eq!(replay.header("idempotency-status"), Some("replayed"));
    assert_eq!(up.hits(SESSION), 1);
    let asked = up
        .seen()
        .into_iter()
        .find(|s| s.path == SESSION)
        .expect("the check");
    assert_eq!(asked.method, http::Method::GET);
    assert_eq!(
        asked.headers["authorization"], "Bearer alice",
        "the credential"
    );
    assert!(asked.body.is_empty());
    for absent in ["x-client-note", "idempotency-key", "content-type"] {
        assert!(
            !asked.headers.contains_key(absent),
            "{absent} was sent to the check"
        );
    }

    // The credential is revoked: the check's own answer comes back.
    up.push(Action::Status(401));
    let refused = send().send().await;
    assert_eq!(refused.status(), 401, "{}", refused.text());
    assert!(!refused.replayed());
    assert_eq!(refused.header("idempotency-status"), Some("replay-denied"));
    assert_eq!(up.hits(ORDERS), 1, "never executed again");
    assert_eq!(proxy.count(Outcome::ReplayDenied), 1);
    assert_eq!(proxy.count(Outcome::Replayed), 1);
}

async fn an_unanswered_check_is_a_503_never_a_replay_or_an_execution(backend: Backend) {
    let up = Upstream::start().await;
    let proxy = Proxy::builder(backend, up.addr)
        .set(
            "upstreams.auth.url",
            format!("http://{}", Upstream::refusing_addr()),
        )
        .each_route("replay_check", check(SESSION, Some("auth")))
        .start()
        .await;
    let send = || proxy.post(ORDERS).key("k-down").body(BODY);
    assert_eq!(send().send().await.status(), 201);
    let retry = send().send().await;
    let p = retry.assert_problem(503);
    assert!(
        p["type"]
            .as_str()
            .unwrap()
            .ends_with("replay-check-unavailable"),
        "{p}"
    );
    assert_eq!(retry.header("retry-after"), Some("1"));
    assert_eq!(
        retry.header("idempotency-status"),
        Some("replay-check-unavailable")
    );
    assert_eq!(up.hits(ORDERS), 1, "not executed again");
    assert_eq!(proxy.count(Outcome::ReplayCheckFailed), 1);
}

async fn a_passed_check_is_remembered_for_the_cache_time(backend: Backend) {
    let up = Upstream::start().await;
    let proxy = Proxy::builder(backend, up.addr)
        .each_route("replay_check", check(SESSION, None))
        .each_route("replay_check_cache", "30s")
        .start()
        .await;
    let send = |who: &str| {
        proxy
            .post(ORDERS)
            .key("k-cache")
            .header("authorization", &format!("Bearer {who}"))
            .body(BODY)
    };
    assert_eq!(send("alice").send().await.status(), 201);
    for _ in 0..3 {
        assert!(send("alice").send().await.replayed());
    }
    assert_eq!(up.hits(SESSION), 1, "one check for three replays");
    // Another credential is another scope: its own key, its own check.
    assert_eq!(send("bob").send().await.status(), 201);
    assert!(send("bob").send().await.replayed());
    assert_eq!(up.hits(SESSION), 2);
}

/// A check slower than the upstream timeout: 503, nothing replayed or run.
async fn a_check_that_times_out_is_a_503(backend: Backend) {
    let up = Upstream::start().await;
    let proxy = Proxy::builder(backend, up.addr)
        .set("server.upstream_timeout", "300ms")
        .each_route("replay_check", check(SESSION, None))
        .start()
        .await;
    let send = || proxy.post(ORDERS).key("k-slow-check").body(BODY);
    assert_eq!(send().send().await.status(), 201);
    up.push(Action::Delay(std::time::Duration::from_millis(1500)));
    let retry = send().send().await;
    let p = retry.assert_problem(503);
    assert!(
        p["type"]
            .as_str()
            .unwrap()
            .ends_with("replay-check-unavailable"),
        "{p}"
    );
    assert_eq!(up.hits(ORDERS), 1, "not executed again");
    assert_eq!(proxy.count(Outcome::ReplayCheckFailed), 1);
}

/// `in_flight = { wait }`: a duplicate that waited for the first request's
/// answer is checked like any other replay.
async fn a_duplicate_that_waited_is_checked_before_its_replay(backend: Backend) {
    let up = Upstream::start().await;
    let mut wait = toml::Table::new();
    wait.insert("wait".into(), "10s".into());
    let proxy = Proxy::builder(backend, up.addr)
        .each_route("in_flight", toml::Value::Table(wait))
        .each_route("replay_check", check(SESSION, None))
        .start()
        .await;
    // The first request is slow; the next upstream request (the check) says no.
    up.push(Action::Delay(std::time::Duration::from_millis(500)));
    up.push(Action::Status(401));
    let first = tokio::spawn(proxy.post(ORDERS).key("k-wait").body(BODY).send());
    up.wait_hits(ORDERS, 1).await;
    let dup = proxy.post(ORDERS).key("k-wait").body(BODY).send().await;
    let first = first.await.expect("first");
    assert_eq!(first.status(), 201, "{}", first.text());
    assert_eq!(dup.status(), 401, "{}", dup.text());
    assert_eq!(dup.header("idempotency-status"), Some("replay-denied"));
    assert_eq!((up.hits(ORDERS), up.hits(SESSION)), (1, 1));
}

/// The same through `idemgate serve`: the config as a user writes it, a
/// revoked credential's retry gets the upstream's 401 and runs nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_checks_before_replaying() {
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let (listen, admin) = (free_port(), free_port());
    let path = dir.path().join("idemgate.toml");
    TestConfig::new(up.addr)
        .listen(listen, admin)
        .set("store.backend", "sqlite")
        .set("store.path", dir.path().join("s.db").to_str().unwrap())
        .route(Route::post(ORDERS).set("replay_check", check(SESSION, None)))
        .write(&path);
    let proc = ServeProcess::start(&path, listen, admin, &[]).await;
    let send = || {
        proc.post(ORDERS)
            .key("k-bin")
            .header("authorization", "Bearer carol")
            .body(BODY)
    };
    assert_eq!(send().send().await.status(), 201);
    assert!(send().send().await.replayed());
    up.push(Action::Status(403));
    let refused = send().send().await;
    assert_eq!(refused.status(), 403);
    assert_eq!(refused.header("idempotency-status"), Some("replay-denied"));
    assert_eq!(up.hits(ORDERS), 1);
    assert_eq!(up.hits(SESSION), 2);
}
