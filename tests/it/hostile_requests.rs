//! Hostile requests through the real server (issue 9): spellings, framings
//! and targets a client can use to slip past a protected route, leave the
//! upstream's base path or confuse the proxy. Well-formed ones go through
//! the test client; malformed ones are written byte for byte on a socket.

use crate::support::{bounded, Backend, Proxy, Route, Upstream, ORDERS};

/// Pins: `;` path parameters hid a protected path from route matching, so
/// `POST /orders;v=1` and `POST /orders;jsessionid=abc` were forwarded
/// unprotected and a retry with the same key executed again (servlet
/// containers, Spring and Python's `urlparse` route them to `/orders`).
/// The parameters are forwarded as sent, and stay in the fingerprint.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn path_parameters_do_not_hide_a_protected_route() {
    let up = Upstream::start().await;
    let proxy = Proxy::builder(Backend::Memory, up.addr)
        .routes(vec![
            Route::post(ORDERS),
            Route::post("/a/b"),
            Route::post("/payments/{id}/capture"),
        ])
        .start()
        .await;
    let spellings = [
        "/orders;v=1",
        "/orders;jsessionid=abc",
        "/orders/;x",
        "/;x/orders",
        "/a;x/b",
        "/a/b;",
        "/payments/p_1;v=2/capture",
    ];
    for (i, spelling) in spellings.into_iter().enumerate() {
        // Recognised as the protected route: without a key it is refused.
        proxy
            .post(spelling)
            .body("{}")
            .send()
            .await
            .assert_problem(400);
        let key = format!("k-param-{i}");
        let first = proxy.post(spelling).key(&key).body("{}").send().await;
        assert!(first.status.is_success(), "{spelling}: {}", first.text());
        assert!(!first.replayed(), "{spelling}");
        assert_eq!(up.last().path, spelling, "forwarded unchanged");
        let retry = proxy.post(spelling).key(&key).body("{}").send().await;
        assert!(retry.replayed(), "{spelling}: the retry is a replay");
        assert_eq!(retry.body, first.body);
    }
    assert_eq!(up.total_hits(), spellings.len(), "each ran once");

    // The parameters are part of the request, as its query is: one key on
    // `/orders` and on `/orders;v=1` is a reuse (422), never a replay of
    // another request's answer.
    let plain = proxy.post(ORDERS).key("k-same").body("{}").send().await;
    assert_eq!(plain.status(), 201);
    for other in ["/orders;v=1", "/orders;jsessionid=abc"] {
        proxy
            .post(other)
            .key("k-same")
            .body("{}")
            .send()
            .await
            .assert_problem(422);
    }
    assert_eq!(up.total_hits(), spellings.len() + 1);
    bounded("shutdown", proxy.shutdown()).await;
}
