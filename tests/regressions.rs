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
