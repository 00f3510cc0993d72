//! Regression tests that pin specific bugs, each named after what it pins.

mod support;

use idemgate::metrics::Outcome;
use support::{Backend, Proxy, Upstream, ORDERS};

/// Pins: a route was matched on the raw path, so `/orders/`, `//orders`,
/// `/./orders` or `/%6Frders` reached an upstream that treats them as
/// `/orders` without any protection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn other_spellings_of_a_protected_path_are_still_protected() {
    let up = Upstream::start().await;
    let proxy = Proxy::start(Backend::Memory, up.addr, &[]).await;
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
    let proxy = Proxy::start(Backend::Memory, up.addr, &["max_request_body = \"1KiB\""]).await;
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
        .store("timeout = \"300ms\"")
        .route("lease = \"30s\"")
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
        (r.status() != 409).then_some(r)
    })
    .await;
    assert_eq!(retry.status(), 201, "{}", retry.text());
    assert_eq!(up.hits(ORDERS), 1);
}
