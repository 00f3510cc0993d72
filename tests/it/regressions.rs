//! Regression tests that pin specific bugs, each named after what it pins.

use crate::support;
use crate::support::{Backend, Proxy, Upstream, ORDERS};
use idemgate::metrics::Outcome;

/// Pins: a route was matched on the raw path, so `/orders/`, `//orders`,
/// `/./orders` or `/%6Frders` reached an upstream that treats them as
/// `/orders` without any protection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn other_spellings_of_a_protected_path_are_still_protected() {
    let up = Upstream::start().await;
    let proxy = Proxy::start(Backend::Memory, up.addr).await;
    for spelling in [
        "/orders/",
        "//orders",
        "/./orders",
        "/x/../orders",
        "/%6Frders",
    ] {
        let resp = proxy.post(spelling).body("{}").send().await;
        resp.assert_problem(400);
    }
    assert_eq!(up.total_hits(), 0, "nothing may be forwarded without a key");
    // One key, two spellings of the same resource: the second is a replay.
    let first = proxy.post(ORDERS).key("k-spell").body("{}").send().await;
    assert_eq!(first.status(), 201);
    let second = proxy
        .post("/%6Frders")
        .key("k-spell")
        .body("{}")
        .send()
        .await;
    assert_eq!(second.status(), 201);
    assert!(second.replayed());
    assert_eq!(up.total_hits(), 1);
}

/// Pins: answering 413 without reading the rest of a large upload made the
/// client see a broken pipe (reset) instead of the 413, about 3 times in 10
/// for an 8 MiB body against a 1 KiB limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_oversized_uploads_get_their_413_not_a_reset() {
    let up = Upstream::start().await;
    let proxy = Proxy::builder(Backend::Memory, up.addr)
        .each_route("max_request_body", "1KiB")
        .start()
        .await;
    let big = vec![b'x'; 8 << 20];
    for i in 0..10 {
        let resp = proxy
            .post(ORDERS)
            .key(&format!("k-huge-{i}"))
            .body(big.clone())
            .try_send()
            .await
            .unwrap_or_else(|e| panic!("attempt {i}: the client saw {e} instead of a 413"));
        resp.assert_problem(413);
    }
    assert_eq!(up.total_hits(), 0);
    assert_eq!(proxy.count(Outcome::TooLarge), 10);
}

/// Pins: a claim that timed out could still commit afterwards, leaving the
/// key in flight with a token nobody held: the client's retry got 409 for a
/// whole lease although nothing was running.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_that_times_out_does_not_block_its_key_for_a_lease() {
    let up = Upstream::start().await;
    let dir = tempfile::TempDir::new().unwrap();
    let db = dir.path().join("idemgate.db");
    let proxy = Proxy::builder(Backend::Sqlite, up.addr)
        .sqlite_file(&db)
        .set("store.timeout", "300ms")
        .each_route("lease", "30s")
        .start()
        .await;
    // Another process holds the database's write lock for a while.
    let blocker = rusqlite::Connection::open(&db).unwrap();
    blocker.execute_batch("BEGIN IMMEDIATE").unwrap();
    let refused = proxy
        .post(ORDERS)
        .key("k-slow-claim")
        .body("{}")
        .send()
        .await;
    refused.assert_problem(503);
    blocker.execute_batch("COMMIT").unwrap();
    drop(blocker);
    // The late claim commits once the lock is gone, and is given back.
    let retry = support::wait_for("the key to be free again", || async {
        let r = proxy
            .post(ORDERS)
            .key("k-slow-claim")
            .body("{}")
            .send()
            .await;
        (!matches!(r.status(), 409 | 503)).then_some(r)
    })
    .await;
    assert_eq!(retry.status(), 201, "{}", retry.text());
    assert_eq!(up.hits(ORDERS), 1);
}

/// Pins: a client-sent `X-Forwarded-Host` reached the upstream, which could
/// build links to a host of the client's choosing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_forwarded_host_and_proto_are_overwritten_unless_trusted() {
    let up = Upstream::start().await;
    let proxy = Proxy::start(Backend::Memory, up.addr).await;
    proxy
        .get("/anything")
        .header("host", "api.example")
        .header("x-forwarded-host", "evil.example")
        .header("x-forwarded-proto", "https")
        .send()
        .await;
    let seen = up.last();
    assert_eq!(seen.headers["x-forwarded-host"], "api.example");
    assert_eq!(seen.headers["x-forwarded-proto"], "http");

    let trusting = Proxy::builder(Backend::Memory, up.addr)
        .set("server.trust_forwarded_headers", true)
        .start()
        .await;
    trusting
        .get("/anything")
        .header("x-forwarded-host", "shop.example")
        .header("x-forwarded-proto", "https")
        .send()
        .await;
    let seen = up.last();
    assert_eq!(seen.headers["x-forwarded-host"], "shop.example");
    assert_eq!(seen.headers["x-forwarded-proto"], "https");
}

/// Pins: a protected body trickled in slowly pinned its connection and
/// buffer with no time limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_protected_body_that_stalls_gets_408_and_is_not_forwarded() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let up = Upstream::start().await;
    let proxy = Proxy::builder(Backend::Memory, up.addr)
        .set("server.request_body_timeout", "300ms")
        .start()
        .await;
    let mut conn = tokio::net::TcpStream::connect(proxy.addr).await.unwrap();
    conn.write_all(
        b"POST /orders HTTP/1.1\r\nhost: x\r\nidempotency-key: k-stall\r\ncontent-length: 100\r\n\r\n0123456789",
    )
    .await
    .unwrap();
    let mut answer = Vec::new();
    support::bounded("the 408", conn.read_to_end(&mut answer))
        .await
        .unwrap();
    let text = String::from_utf8_lossy(&answer);
    assert!(text.starts_with("HTTP/1.1 408"), "{text}");
    assert!(text.contains("application/problem+json"), "{text}");
    assert_eq!(up.total_hits(), 0);
}

/// Pins: `/readyz` kept answering 200 while a shutdown drained, so load
/// balancers kept sending traffic to a proxy that no longer accepted it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_fails_as_soon_as_a_graceful_shutdown_starts() {
    let up = Upstream::start().await;
    let mut proxy = Proxy::builder(Backend::Memory, up.addr)
        .admin()
        .start()
        .await;
    assert_eq!(proxy.admin_get("/readyz").send().await.status(), 200);
    up.push(support::Action::Delay(std::time::Duration::from_millis(
        1500,
    )));
    let slow = tokio::spawn(proxy.post(ORDERS).key("k-drain").body("{}").send());
    up.wait_hits(ORDERS, 1).await;
    proxy.signal_shutdown();
    support::wait_for("readiness to fail during the drain", || async {
        let r = proxy.admin_get("/readyz").try_send().await.ok()?;
        (r.status() == 503).then_some(())
    })
    .await;
    assert_eq!(
        slow.await.unwrap().status(),
        201,
        "the in-flight request finishes"
    );
    proxy.stopped().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn during_the_shutdown_delay_readiness_fails_but_requests_are_still_served() {
    let up = Upstream::start().await;
    let mut proxy = Proxy::builder(Backend::Memory, up.addr)
        .set("server.shutdown_delay", "2s")
        .admin()
        .start()
        .await;
    proxy.signal_shutdown();
    support::wait_for("readiness to fail", || async {
        let r = proxy.admin_get("/readyz").try_send().await.ok()?;
        (r.status() == 503).then_some(())
    })
    .await;
    let served = proxy.post(ORDERS).key("k-late").body("{}").send().await;
    assert_eq!(served.status(), 201, "{}", served.text());
    proxy.stopped().await;
}

/// Pins: a PostgreSQL call whose future was dropped mid-statement (the
/// store seam's deadline fired first) put its connection back in the pool
/// with the statement still running, so the next call queued behind a
/// statement nobody waited for. Such a connection now leaves the pool.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_postgres_call_cut_off_mid_statement_does_not_block_the_next_one() {
    use idemgate::idempotency::{Fingerprint, RecordKey, Scope};
    use idemgate::store::postgres::PostgresStore;
    use idemgate::store::{Claim, LeaseToken, Span, Store};
    use std::time::Duration;
    let url = support::services::database_url();
    support::services::require_postgres(&url).await;
    let schema = support::services::unique_schema("t");
    let mut config = support::services::pg_store_config(&url, &schema);
    config.pool_size = 1;
    config.timeout = Duration::from_secs(10);
    config.statement_timeout = Duration::from_secs(10);
    let store = PostgresStore::connect(&config).await.unwrap();
    let key = RecordKey {
        scope: Scope([7; 32]),
        key: [8; 32],
    };
    let claim = |token: u8| Claim {
        key,
        fingerprint: Fingerprint([1; 32]),
        token: LeaseToken([token; 16]),
        now: 1_000,
        lease_ms: 60_000,
        ttl_ms: 60_000,
        first_use: None,
    };
    store.claim(&claim(1)).await.unwrap();

    // Another session holds the record's row lock, so the next claim's
    // statement waits on it.
    let (locker, conn) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(conn);
    locker
        .batch_execute(&format!(
            "BEGIN; SELECT 1 FROM \"{schema}\".idempotency_records FOR UPDATE"
        ))
        .await
        .unwrap();
    // The holder's renewal is an UPDATE: it waits on the row lock.
    let renewal = store.renew(
        &key,
        &LeaseToken([1; 16]),
        Span {
            now: 1_000,
            ms: 60_000,
        },
    );
    let cut_off = tokio::time::timeout(Duration::from_millis(300), renewal).await;
    assert!(cut_off.is_err(), "the renewal should wait on the lock");

    let next = tokio::time::timeout(Duration::from_secs(2), store.ping()).await;
    locker.batch_execute("ROLLBACK").await.unwrap();
    drop(locker);
    support::services::drop_schema(&url, &schema).await;
    assert!(
        matches!(next, Ok(Ok(()))),
        "the next call queued behind the abandoned statement: {next:?}"
    );
}

/// Pins: `fingerprint = "json"` read numbers as doubles, so two amounts a
/// double cannot tell apart (`10.000000000000001`, `10.000000000000002`)
/// shared a fingerprint and the second transfer was served the first's
/// response. Payment code parses amounts as decimals: they are a 422 now,
/// and only spellings of one value (`10.50`, `1.05e1`) are the same body.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_fingerprints_tell_apart_amounts_a_double_cannot() {
    let up = Upstream::start().await;
    let proxy = Proxy::builder(Backend::Postgres, up.addr)
        .routes(vec![
            support::Route::post("/transfers").set("fingerprint", "json")
        ])
        .start()
        .await;
    let transfer = |key: &str, amount: &str| {
        proxy
            .post("/transfers")
            .key(key)
            .body(format!(r#"{{"to":"acct_1","amount":{amount}}}"#))
            .send()
    };
    assert_eq!(
        transfer("k-amount", "10.000000000000001").await.status(),
        200
    );
    transfer("k-amount", "10.000000000000002")
        .await
        .assert_problem(422);
    transfer("k-amount", "10").await.assert_problem(422);
    assert!(transfer("k-amount", "10.0000000000000010").await.replayed());
    assert_eq!(up.total_hits(), 1);

    assert_eq!(transfer("k-same", "10.50").await.status(), 200);
    assert!(transfer("k-same", "1.05e1").await.replayed());
    assert_eq!(up.total_hits(), 2);
}
