//! `Idempotency-Status`: what idempotency did, on every answer to a
//! request that matched a protected route (one value per row of the
//! README's semantics table), and `ignored` on the answer to a request
//! whose key no route protected.

use crate::support::services::{database_url, postgres_addr, require_postgres, TcpRelay};
use crate::support::{
    backend_tests, bounded, database_url_via, free_port, Action, Backend, Proxy, Resp, Route,
    ServeProcess, TestConfig, Upstream, ORDERS,
};
use std::time::Duration;

backend_tests!(
    executed_replayed_and_refused_answers_say_which,
    released_and_unreachable_keys_say_so,
    unknown_and_unstored_outcomes_say_so,
    keys_no_route_protects_are_ignored,
);

const BODY: &str = r#"{"item":"kettle","qty":1}"#;

#[track_caller]
fn status_of(r: &Resp, want: &str) {
    assert_eq!(r.header("idempotency-status"), Some(want), "{r:?}");
}

async fn executed_replayed_and_refused_answers_say_which(backend: Backend) {
    let up = Upstream::start().await;
    let proxy = Proxy::builder(backend, up.addr)
        .routes(vec![
            Route::post(ORDERS).set("max_request_body", "1KiB"),
            Route::post("/notes").set("require_key", false),
        ])
        .start()
        .await;
    let first = proxy.post(ORDERS).key("k-st-1").body(BODY).send().await;
    assert_eq!(first.status(), 201);
    status_of(&first, "created");
    let replay = proxy.post(ORDERS).key("k-st-1").body(BODY).send().await;
    assert!(replay.replayed(), "Idempotent-Replayed stays: {replay:?}");
    status_of(&replay, "replayed");
    // A stored 4xx is the request's own outcome: created, then replayed.
    let four = "/orders?status=404";
    status_of(
        &proxy.post(four).key("k-st-4").body(BODY).send().await,
        "created",
    );
    status_of(
        &proxy.post(four).key("k-st-4").body(BODY).send().await,
        "replayed",
    );

    let reused = proxy.post(ORDERS).key("k-st-1").body("{}").send().await;
    reused.assert_problem(422);
    status_of(&reused, "key-reused");

    up.push(Action::Delay(Duration::from_millis(800)));
    let slow = tokio::spawn(proxy.post(ORDERS).key("k-st-busy").body(BODY).send());
    up.wait_hits(ORDERS, 3).await;
    let busy = proxy.post(ORDERS).key("k-st-busy").body(BODY).send().await;
    busy.assert_problem(409);
    status_of(&busy, "in-flight");
    status_of(&slow.await.expect("slow"), "created");

    let missing = proxy.post(ORDERS).body(BODY).send().await;
    missing.assert_problem(400);
    status_of(&missing, "key-missing");
    let invalid = proxy.post(ORDERS).key("\"open").body(BODY).send().await;
    invalid.assert_problem(400);
    status_of(&invalid, "key-invalid");
    let repeated = proxy
        .post(ORDERS)
        .key("k-st-scope")
        .header("authorization", "Bearer a")
        .header("authorization", "Bearer b")
        .body(BODY)
        .send()
        .await;
    repeated.assert_problem(400);
    status_of(&repeated, "scope-header-repeated");
    let big = proxy
        .post(ORDERS)
        .key("k-st-big")
        .body("x".repeat(2048))
        .send()
        .await;
    big.assert_problem(413);
    status_of(&big, "body-too-large");

    // A protected route where the key is optional: passed through unguarded.
    let unkeyed = proxy.post("/notes").body(BODY).send().await;
    assert!(unkeyed.status() < 300, "{unkeyed:?}");
    status_of(&unkeyed, "no-key");
    status_of(
        &proxy.post("/notes").key("k-st-n").body(BODY).send().await,
        "created",
    );
    assert_eq!(up.hits(ORDERS), 3, "refusals forwarded nothing");
}

async fn released_and_unreachable_keys_say_so(backend: Backend) {
    let up = Upstream::start().await;
    let proxy = Proxy::start(backend, up.addr).await;
    up.push(Action::Status(503));
    let released = proxy.post(ORDERS).key("k-st-rel").body(BODY).send().await;
    assert_eq!(released.status(), 503, "the upstream's answer as is");
    status_of(&released, "released");
    let again = proxy.post(ORDERS).key("k-st-rel").body(BODY).send().await;
    status_of(&again, "created");
    assert_eq!(up.hits(ORDERS), 2, "the released key ran again");

    let refused = Proxy::start(backend, Upstream::refusing_addr()).await;
    let r = refused.post(ORDERS).key("k-st-ref").body(BODY).send().await;
    r.assert_problem(502);
    status_of(&r, "upstream-failed");
}

async fn unknown_and_unstored_outcomes_say_so(backend: Backend) {
    let up = Upstream::start().await;
    let proxy = Proxy::builder(backend, up.addr)
        .set("server.upstream_timeout", "300ms")
        .routes(vec![
            Route::post(ORDERS).set("on_ambiguous", "keep"),
            Route::post("/payments").set("max_response_body", "1KiB"),
        ])
        .start()
        .await;
    let slow = "/orders?delay_ms=2000";
    let first = proxy.post(slow).key("k-st-unk").body(BODY).send().await;
    first.assert_problem(504);
    status_of(&first, "upstream-timeout");
    let retry = proxy.post(slow).key("k-st-unk").body(BODY).send().await;
    retry.assert_problem(424);
    status_of(&retry, "outcome-unknown");

    let large = "/payments?size=4096";
    let whole = proxy.post(large).key("k-st-big").body(BODY).send().await;
    assert_eq!(whole.body.len(), 4096, "the client gets it in full");
    status_of(&whole, "unstored");
    let gone = proxy.post(large).key("k-st-big").body(BODY).send().await;
    gone.assert_problem(410);
    status_of(&gone, "response-not-stored");

    // The head arrived, then the body broke off: executed, kept, unstored.
    let broken = "/payments?reset=body";
    let cut = proxy.post(broken).key("k-st-cut").body(BODY).send().await;
    cut.assert_problem(502);
    status_of(&cut, "upstream-failed");
    let after = proxy.post(broken).key("k-st-cut").body(BODY).send().await;
    after.assert_problem(410);
    status_of(&after, "response-not-stored");
}

/// A key on a request no route protects did nothing, and its answer says
/// so; one without a key gets no header.
async fn keys_no_route_protects_are_ignored(backend: Backend) {
    let up = Upstream::start().await;
    let proxy = Proxy::builder(backend, up.addr)
        .routes(vec![
            Route::post(ORDERS),
            Route::post("/refunds").set("key_header", "X-Request-Key"),
        ])
        .start()
        .await;
    let unrouted = proxy
        .post("/catalog")
        .key("k-st-ign")
        .body(BODY)
        .send()
        .await;
    assert!(unrouted.status() < 300, "{unrouted:?}");
    status_of(&unrouted, "ignored");
    // Another route's key header counts too; a method the route does not
    // protect is unrouted.
    let custom = proxy
        .post("/catalog")
        .header("x-request-key", "k")
        .send()
        .await;
    status_of(&custom, "ignored");
    let get = proxy.get(ORDERS).key("k-st-get").send().await;
    status_of(&get, "ignored");
    // An unrouted error answer is the upstream's: still ignored.
    let failed = proxy.get("/catalog?status=500").key("k").send().await;
    assert_eq!(failed.status(), 500);
    status_of(&failed, "ignored");
    let plain = proxy.get("/catalog").send().await;
    assert_eq!(plain.header("idempotency-status"), None, "{plain:?}");
}

/// The store cut: `store-unavailable`, or `unguarded` where the route
/// forwards anyway.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_outage_says_unavailable_or_unguarded() {
    require_postgres(&database_url()).await;
    let relay = TcpRelay::start(postgres_addr()).await;
    let up = Upstream::start().await;
    let proxy = Proxy::builder(Backend::Postgres, up.addr)
        .store_url(&database_url_via(relay.addr()))
        .routes(vec![
            Route::post(ORDERS),
            Route::post("/payments").set("on_store_error", "forward"),
        ])
        .start()
        .await;
    relay.cut();
    let refused = bounded(
        "a protected request with the store cut",
        proxy.post(ORDERS).key("k-st-cut").body(BODY).send(),
    )
    .await;
    refused.assert_problem(503);
    status_of(&refused, "store-unavailable");
    let forwarded = bounded(
        "an on_store_error = forward request with the store cut",
        proxy.post("/payments").key("k-st-fwd").body(BODY).send(),
    )
    .await;
    assert!(forwarded.status() < 300, "{forwarded:?}");
    status_of(&forwarded, "unguarded");
    assert_eq!(up.total_hits(), 1);
}

/// The real binary, on its embedded default store.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_says_created_replayed_and_ignored() {
    let up = Upstream::start().await;
    let dir = tempfile::TempDir::new().expect("tempdir");
    let (listen, admin) = (free_port(), free_port());
    let config = dir.path().join("idemgate.toml");
    TestConfig::new(up.addr)
        .listen(listen, admin)
        .set("store.backend", "sqlite")
        .set("store.path", dir.path().join("s.db").display().to_string())
        .route(Route::post(ORDERS))
        .write(&config);
    let gate = ServeProcess::start(&config, listen, admin, &[]).await;
    status_of(
        &gate.post(ORDERS).key("k-bin").body(BODY).send().await,
        "created",
    );
    status_of(
        &gate.post(ORDERS).key("k-bin").body(BODY).send().await,
        "replayed",
    );
    status_of(
        &gate.post("/catalog").key("k-bin").body(BODY).send().await,
        "ignored",
    );
}
