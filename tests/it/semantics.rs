//! The idempotency semantics, row by row, on every backend.

use crate::support::{
    backend_tests, timed_backend_tests, Action, Backend, Proxy, Upstream, ORDERS, UPSTREAM_DATE,
};
use bytes::Bytes;
use idemgate::metrics::Outcome;
use std::time::Duration;

backend_tests!(
    forwards_a_new_key_once_with_the_key_header,
    replays_completed_response_without_calling_upstream,
    quoted_and_bare_key_are_the_same_record,
    same_key_with_a_different_body_is_rejected_with_422,
    same_key_with_a_different_query_is_rejected_with_422,
    same_key_on_another_protected_path_is_rejected_with_422,
    missing_required_key_is_rejected_and_not_forwarded,
    missing_optional_key_is_forwarded_unprotected,
    invalid_keys_are_rejected_with_400_and_not_forwarded,
    clients_with_different_authorization_never_see_each_others_responses,
    client_error_responses_are_stored_and_replayed,
    server_error_releases_the_key_so_the_retry_executes,
    refused_upstream_gets_502_and_the_retry_executes_once_it_is_up,
    upstream_reset_gets_502_and_releases_the_key,
    upstream_reset_after_its_answer_keeps_the_key,
    concurrent_identical_requests_execute_upstream_once,
    oversized_request_body_is_rejected_with_413_and_not_forwarded,
    oversized_response_is_streamed_in_full_and_the_retry_gets_410,
    stored_headers_exclude_set_cookie_and_date_by_default,
    set_cookie_is_stored_when_the_route_includes_it,
    metrics_count_each_outcome,
);

// About time: on a paused clock where the proxy's clock judges leases.
timed_backend_tests!(
    duplicate_while_in_flight_gets_409_with_retry_after,
    upstream_timeout_gets_504_and_releases_the_key,
    lease_is_renewed_so_a_slow_request_is_never_executed_twice,
    key_older_than_ttl_executes_again,
);

const BODY: &str = r#"{"item":"book","qty":1}"#;

async fn forwards_a_new_key_once_with_the_key_header(backend: Backend) {
    let up = Upstream::start().await;
    let proxy = Proxy::start(backend, up.addr).await;
    let r = proxy.post(ORDERS).key("k-new").body(BODY).send().await;
    assert_eq!(r.status(), 201, "{}", r.text());
    assert_eq!(r.header("location"), Some("/orders/1"));
    assert!(!r.replayed());
    assert_eq!(r.json()["hits"], 1);
    assert_eq!(up.hits(ORDERS), 1);
    let seen = up.last();
    assert_eq!(seen.headers["idempotency-key"], "k-new");
    assert_eq!(seen.body, Bytes::from(BODY));
    assert_eq!(proxy.count(Outcome::Forwarded), 1);
}

async fn replays_completed_response_without_calling_upstream(backend: Backend) {
    let up = Upstream::start().await;
    let proxy = Proxy::start(backend, up.addr).await;
    let first = proxy
        .post("/orders?headers=1")
        .key("k-replay")
        .body(BODY)
        .send()
        .await;
    assert_eq!(first.status(), 201);
    for _ in 0..2 {
        let again = proxy
            .post("/orders?headers=1")
            .key("k-replay")
            .body(BODY)
            .send()
            .await;
        assert_eq!(again.status(), 201);
        assert!(again.replayed(), "{:?}", again.headers);
        assert_eq!(again.body, first.body, "byte for byte");
        assert_eq!(again.header("location"), first.header("location"));
        assert_eq!(again.header("content-type"), Some("application/json"));
        assert_eq!(again.header_all("x-multi"), ["a, b", "c"]);
        assert_eq!(again.header("x-after"), Some("z"));
        assert_eq!(
            again.header("content-length"),
            Some(first.body.len().to_string().as_str())
        );
    }
    assert_eq!(up.hits(ORDERS), 1);
    assert_eq!(proxy.count(Outcome::Replayed), 2);
}

async fn quoted_and_bare_key_are_the_same_record(backend: Backend) {
    let up = Upstream::start().await;
    let proxy = Proxy::start(backend, up.addr).await;
    let first = proxy.post(ORDERS).key("\"abc\"").body(BODY).send().await;
    assert_eq!(first.status(), 201);
    let bare = proxy.post(ORDERS).key("abc").body(BODY).send().await;
    assert!(bare.replayed());
    assert_eq!(bare.body, first.body);
    assert_eq!(up.hits(ORDERS), 1);
}

async fn duplicate_while_in_flight_gets_409_with_retry_after(backend: Backend) {
    let up = Upstream::start().await;
    let proxy = Proxy::start(backend, up.addr).await;
    up.push(Action::Delay(Duration::from_millis(800)));
    let slow = tokio::spawn(proxy.post(ORDERS).key("k-busy").body(BODY).send());
    up.wait_hits(ORDERS, 1).await;
    let dup = proxy.post(ORDERS).key("k-busy").body(BODY).send().await;
    let problem = dup.assert_problem(409);
    let retry_after: u64 = dup
        .header("retry-after")
        .expect("Retry-After")
        .parse()
        .expect("seconds");
    assert!(retry_after >= 1);
    assert!(problem["type"].as_str().unwrap().contains("in-flight"));
    let first = slow.await.unwrap();
    assert_eq!(first.status(), 201);
    assert_eq!(up.hits(ORDERS), 1);
    assert_eq!(proxy.count(Outcome::Conflict), 1);
}

async fn same_key_with_a_different_body_is_rejected_with_422(backend: Backend) {
    let up = Upstream::start().await;
    let proxy = Proxy::start(backend, up.addr).await;
    assert_eq!(
        proxy
            .post(ORDERS)
            .key("k-b")
            .body(BODY)
            .send()
            .await
            .status(),
        201
    );
    let other = proxy
        .post(ORDERS)
        .key("k-b")
        .body(r#"{"item":"pen"}"#)
        .send()
        .await;
    other.assert_problem(422);
    assert_eq!(up.hits(ORDERS), 1);
}

async fn same_key_with_a_different_query_is_rejected_with_422(backend: Backend) {
    let up = Upstream::start().await;
    let proxy = Proxy::start(backend, up.addr).await;
    assert_eq!(
        proxy
            .post("/orders?a=1")
            .key("k-q")
            .body(BODY)
            .send()
            .await
            .status(),
        201
    );
    proxy
        .post("/orders?a=2")
        .key("k-q")
        .body(BODY)
        .send()
        .await
        .assert_problem(422);
    assert_eq!(up.hits(ORDERS), 1);
}

async fn same_key_on_another_protected_path_is_rejected_with_422(backend: Backend) {
    let up = Upstream::start().await;
    let proxy = Proxy::start(backend, up.addr).await;
    assert_eq!(
        proxy
            .post(ORDERS)
            .key("k-p")
            .body(BODY)
            .send()
            .await
            .status(),
        201
    );
    proxy
        .post("/payments")
        .key("k-p")
        .body(BODY)
        .send()
        .await
        .assert_problem(422);
    assert_eq!(up.hits("/payments"), 0);
    assert_eq!(up.hits(ORDERS), 1);
}

async fn missing_required_key_is_rejected_and_not_forwarded(backend: Backend) {
    let up = Upstream::start().await;
    let proxy = Proxy::start(backend, up.addr).await;
    let r = proxy.post(ORDERS).body(BODY).send().await;
    let p = r.assert_problem(400);
    assert!(p["type"].as_str().unwrap().contains("key-missing"), "{p}");
    assert_eq!(up.total_hits(), 0);
    assert_eq!(proxy.count(Outcome::MissingKey), 1);
}

async fn missing_optional_key_is_forwarded_unprotected(backend: Backend) {
    let up = Upstream::start().await;
    let proxy = Proxy::builder(backend, up.addr)
        .each_route("require_key", false)
        .start()
        .await;
    for n in 1..=2 {
        let r = proxy.post(ORDERS).body(BODY).send().await;
        assert_eq!(r.status(), 201);
        assert!(!r.replayed());
        assert_eq!(r.json()["hits"], n);
    }
    assert_eq!(up.hits(ORDERS), 2);
    assert_eq!(proxy.count(Outcome::Passthrough), 2);
    // A key still protects the route.
    for _ in 0..2 {
        proxy.post(ORDERS).key("k-opt").body(BODY).send().await;
    }
    assert_eq!(up.hits(ORDERS), 3);
}

async fn invalid_keys_are_rejected_with_400_and_not_forwarded(backend: Backend) {
    let up = Upstream::start().await;
    let proxy = Proxy::start(backend, up.addr).await;
    let long = "k".repeat(256);
    let invalid: Vec<&[u8]> = vec![
        b"",
        b"\"\"",
        long.as_bytes(),
        b"tab\there",
        "caf\u{e9}".as_bytes(),
        b"\"unterminated",
    ];
    for key in &invalid {
        let r = proxy
            .post(ORDERS)
            .header_bytes("idempotency-key", key)
            .body(BODY)
            .send()
            .await;
        let p = r.assert_problem(400);
        assert!(p["type"].as_str().unwrap().contains("key-invalid"), "{p}");
    }
    let repeated = proxy
        .post(ORDERS)
        .key("one")
        .key("two")
        .body(BODY)
        .send()
        .await;
    repeated.assert_problem(400);
    assert_eq!(up.total_hits(), 0);
    assert_eq!(proxy.count(Outcome::InvalidKey), invalid.len() as u64 + 1);

    let longest = "k".repeat(255);
    let ok = proxy.post(ORDERS).key(&longest).body(BODY).send().await;
    assert_eq!(ok.status(), 201, "255 characters is allowed");
}

async fn clients_with_different_authorization_never_see_each_others_responses(backend: Backend) {
    let up = Upstream::start().await;
    let proxy = Proxy::start(backend, up.addr).await;
    let alice = |body: &'static str| {
        proxy
            .post(ORDERS)
            .key("shared")
            .header("authorization", "Bearer alice")
            .body(body)
    };
    let bob = |body: &'static str| {
        proxy
            .post(ORDERS)
            .key("shared")
            .header("authorization", "Bearer bob")
            .body(body)
    };
    let a = alice("from alice").send().await;
    let b = bob("from bob").send().await;
    assert_eq!(a.status(), 201);
    assert_eq!(b.status(), 201, "{}", b.text());
    assert_eq!(a.json()["received"], "from alice");
    assert_eq!(b.json()["received"], "from bob");
    let a2 = alice("from alice").send().await;
    let b2 = bob("from bob").send().await;
    assert!(a2.replayed() && b2.replayed());
    assert_eq!(a2.body, a.body);
    assert_eq!(b2.body, b.body);
    // No Authorization at all is a scope of its own.
    let anon = proxy
        .post(ORDERS)
        .key("shared")
        .body("anonymous")
        .send()
        .await;
    assert_eq!(anon.status(), 201);
    assert_eq!(up.hits(ORDERS), 3);
}

async fn client_error_responses_are_stored_and_replayed(backend: Backend) {
    let up = Upstream::start().await;
    let proxy = Proxy::start(backend, up.addr).await;
    up.push(Action::Status(404));
    let first = proxy.post(ORDERS).key("k-404").body(BODY).send().await;
    assert_eq!(first.status(), 404);
    let again = proxy.post(ORDERS).key("k-404").body(BODY).send().await;
    assert_eq!(again.status(), 404);
    assert!(again.replayed());
    assert_eq!(again.body, first.body);
    assert_eq!(up.hits(ORDERS), 1);
}

async fn server_error_releases_the_key_so_the_retry_executes(backend: Backend) {
    let up = Upstream::start().await;
    let proxy = Proxy::start(backend, up.addr).await;
    up.push(Action::Status(503));
    let failed = proxy.post(ORDERS).key("k-5xx").body(BODY).send().await;
    assert_eq!(failed.status(), 503);
    assert_eq!(
        failed.header("content-type"),
        Some("application/json"),
        "the upstream's own 5xx is passed on"
    );
    assert!(!failed.replayed());
    let retry = proxy.post(ORDERS).key("k-5xx").body(BODY).send().await;
    assert_eq!(retry.status(), 201);
    assert!(!retry.replayed());
    let third = proxy.post(ORDERS).key("k-5xx").body(BODY).send().await;
    assert!(third.replayed());
    assert_eq!(third.body, retry.body);
    assert_eq!(up.hits(ORDERS), 2);
    assert_eq!(proxy.count(Outcome::UpstreamError), 1);
}

async fn refused_upstream_gets_502_and_the_retry_executes_once_it_is_up(backend: Backend) {
    let addr = Upstream::refusing_addr();
    let proxy = Proxy::start(backend, addr).await;
    let r = proxy.post(ORDERS).key("k-refused").body(BODY).send().await;
    let p = r.assert_problem(502);
    assert!(p["detail"].as_str().unwrap().contains("released"), "{p}");
    let up = Upstream::start_at(addr).await;
    let retry = proxy.post(ORDERS).key("k-refused").body(BODY).send().await;
    assert_eq!(retry.status(), 201, "{}", retry.text());
    assert!(!retry.replayed());
    assert_eq!(up.hits(ORDERS), 1);
}

async fn upstream_timeout_gets_504_and_releases_the_key(backend: Backend) {
    let up = Upstream::start().await;
    let proxy = Proxy::builder(backend, up.addr)
        .set("server.upstream_timeout", "300ms")
        .start()
        .await;
    up.push(Action::Delay(Duration::from_secs(3)));
    let r = proxy.post(ORDERS).key("k-slow").body(BODY).send().await;
    r.assert_problem(504);
    let retry = proxy.post(ORDERS).key("k-slow").body(BODY).send().await;
    assert_eq!(retry.status(), 201);
    assert_eq!(up.hits(ORDERS), 2);
}

async fn upstream_reset_gets_502_and_releases_the_key(backend: Backend) {
    let up = Upstream::start().await;
    let proxy = Proxy::start(backend, up.addr).await;
    up.push(Action::ResetBeforeResponse);
    proxy
        .post(ORDERS)
        .key("k-reset")
        .body(BODY)
        .send()
        .await
        .assert_problem(502);
    let retry = proxy.post(ORDERS).key("k-reset").body(BODY).send().await;
    assert_eq!(retry.status(), 201);
    assert_eq!(up.hits(ORDERS), 2);
}

/// Pins: a reset after the upstream's 201 head released the key, so the
/// client's retry created a second order.
async fn upstream_reset_after_its_answer_keeps_the_key(backend: Backend) {
    let up = Upstream::start().await;
    let proxy = Proxy::start(backend, up.addr).await;
    up.push(Action::ResetMidBody);
    let first = proxy.post(ORDERS).key("k-cut").body(BODY).send().await;
    let problem = first.assert_problem(502);
    assert!(
        problem["detail"]
            .as_str()
            .unwrap()
            .contains("will not run it again"),
        "{problem}"
    );
    let retry = proxy.post(ORDERS).key("k-cut").body(BODY).send().await;
    retry.assert_problem(410);
    assert_eq!(up.hits(ORDERS), 1, "the upstream must not run twice");
}

async fn concurrent_identical_requests_execute_upstream_once(backend: Backend) {
    let up = Upstream::start().await;
    let proxy = Proxy::start(backend, up.addr).await;
    up.push(Action::Delay(Duration::from_millis(200)));
    let sends: Vec<_> = (0..24)
        .map(|_| tokio::spawn(proxy.post(ORDERS).key("k-race").body(BODY).send()))
        .collect();
    let mut ok = Vec::new();
    for s in sends {
        let r = s.await.unwrap();
        match r.status() {
            201 => ok.push(r),
            409 => {
                r.assert_problem(409);
            }
            other => panic!("unexpected {other}: {}", r.text()),
        }
    }
    assert!(!ok.is_empty());
    assert_eq!(ok.iter().filter(|r| !r.replayed()).count(), 1);
    assert!(ok.iter().all(|r| r.body == ok[0].body));
    assert_eq!(up.hits(ORDERS), 1);
}

async fn lease_is_renewed_so_a_slow_request_is_never_executed_twice(backend: Backend) {
    let up = Upstream::start().await;
    let proxy = Proxy::builder(backend, up.addr)
        .each_route("lease", "300ms")
        .start()
        .await;
    up.push(Action::Delay(Duration::from_millis(1500)));
    let slow = tokio::spawn(proxy.post(ORDERS).key("k-lease").body(BODY).send());
    up.wait_hits(ORDERS, 1).await;
    // Several lease lengths pass while the upstream works.
    let mut conflicts = 0;
    while !slow.is_finished() {
        let dup = proxy.post(ORDERS).key("k-lease").body(BODY).send().await;
        if slow.is_finished() && dup.status() == 201 {
            assert!(dup.replayed());
            break;
        }
        dup.assert_problem(409);
        conflicts += 1;
        tokio::time::sleep(Duration::from_millis(150)).await;
    }
    assert!(conflicts >= 3, "only {conflicts} duplicates were sent");
    let first = slow.await.unwrap();
    assert_eq!(first.status(), 201);
    let after = proxy.post(ORDERS).key("k-lease").body(BODY).send().await;
    assert!(after.replayed());
    assert_eq!(up.hits(ORDERS), 1);
}

async fn key_older_than_ttl_executes_again(backend: Backend) {
    let up = Upstream::start().await;
    let proxy = Proxy::builder(backend, up.addr)
        .each_route("ttl", "1s")
        .each_route("lease", "300ms")
        .start()
        .await;
    let first = proxy.post(ORDERS).key("k-ttl").body(BODY).send().await;
    assert_eq!(first.status(), 201);
    assert!(proxy
        .post(ORDERS)
        .key("k-ttl")
        .body(BODY)
        .send()
        .await
        .replayed());
    // This test is about time passing.
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let later = proxy.post(ORDERS).key("k-ttl").body(BODY).send().await;
    assert_eq!(later.status(), 201);
    assert!(!later.replayed());
    assert_eq!(later.json()["hits"], 2);
    assert_eq!(up.hits(ORDERS), 2);
}

async fn oversized_request_body_is_rejected_with_413_and_not_forwarded(backend: Backend) {
    let up = Upstream::start().await;
    let proxy = Proxy::builder(backend, up.addr)
        .each_route("max_request_body", "1KiB")
        .start()
        .await;
    let big = vec![b'x'; 1025];
    proxy
        .post(ORDERS)
        .key("k-big")
        .body(big.clone())
        .send()
        .await
        .assert_problem(413);
    let chunks = vec![Bytes::from(vec![b'y'; 600]), Bytes::from(vec![b'y'; 600])];
    proxy
        .post(ORDERS)
        .key("k-big-chunked")
        .chunked(chunks)
        .send()
        .await
        .assert_problem(413);
    assert_eq!(up.total_hits(), 0);
    assert_eq!(proxy.count(Outcome::TooLarge), 2);
    // Exactly the limit is fine, and the key was not burnt by the 413.
    let fits = proxy
        .post(ORDERS)
        .key("k-big")
        .body(vec![b'x'; 1024])
        .send()
        .await;
    assert_eq!(fits.status(), 201);
    // A chunked body within the limit reaches the upstream with a length.
    let chunks = vec![Bytes::from(vec![b'z'; 500]), Bytes::from(vec![b'z'; 500])];
    let ok = proxy
        .post(ORDERS)
        .key("k-chunked-ok")
        .chunked(chunks)
        .send()
        .await;
    assert_eq!(ok.status(), 201);
    let seen = up.last();
    assert_eq!(seen.headers["content-length"], "1000");
    assert!(!seen.headers.contains_key("transfer-encoding"));
    assert_eq!(seen.body.len(), 1000);
}

async fn oversized_response_is_streamed_in_full_and_the_retry_gets_410(backend: Backend) {
    let up = Upstream::start().await;
    let proxy = Proxy::builder(backend, up.addr)
        .each_route("max_response_body", "4KiB")
        .start()
        .await;
    let size = 200_000;
    let path = format!("/orders?size={size}");
    let first = proxy.post(&path).key("k-huge").body(BODY).send().await;
    assert_eq!(first.status(), 201);
    assert_eq!(first.body.len(), size);
    assert!(first.body.iter().all(|&b| b == b'x'));
    let retry = proxy.post(&path).key("k-huge").body(BODY).send().await;
    let p = retry.assert_problem(410);
    assert!(p["type"].as_str().unwrap().contains("response-not-stored"));
    assert_eq!(up.hits(ORDERS), 1);
    assert_eq!(proxy.count(Outcome::NotReplayable), 1);
    // Below the limit the same route stores and replays.
    let small = "/orders?size=4096";
    proxy.post(small).key("k-small").body(BODY).send().await;
    let r = proxy.post(small).key("k-small").body(BODY).send().await;
    assert!(r.replayed());
    assert_eq!(r.body.len(), 4096);
}

async fn stored_headers_exclude_set_cookie_and_date_by_default(backend: Backend) {
    let up = Upstream::start().await;
    let proxy = Proxy::start(backend, up.addr).await;
    let path = "/orders?headers=1";
    let first = proxy.post(path).key("k-cookie").body(BODY).send().await;
    assert_eq!(
        first.header_all("set-cookie"),
        ["session=one", "theme=dark"]
    );
    assert_eq!(first.header("date"), Some(UPSTREAM_DATE));
    let replay = proxy.post(path).key("k-cookie").body(BODY).send().await;
    assert!(replay.replayed());
    assert!(replay.header_all("set-cookie").is_empty(), "{replay:?}");
    assert_ne!(replay.header("date"), Some(UPSTREAM_DATE));
    assert_eq!(replay.header_all("x-multi"), ["a, b", "c"]);
}

async fn set_cookie_is_stored_when_the_route_includes_it(backend: Backend) {
    let up = Upstream::start().await;
    let proxy = Proxy::builder(backend, up.addr)
        .each_route("include_response_headers", vec!["set-cookie"])
        .start()
        .await;
    let path = "/orders?headers=1";
    proxy.post(path).key("k-cookie2").body(BODY).send().await;
    let replay = proxy.post(path).key("k-cookie2").body(BODY).send().await;
    assert!(replay.replayed());
    assert_eq!(
        replay.header_all("set-cookie"),
        ["session=one", "theme=dark"]
    );
    assert_ne!(replay.header("date"), Some(UPSTREAM_DATE));
}

async fn metrics_count_each_outcome(backend: Backend) {
    let up = Upstream::start().await;
    let proxy = Proxy::start(backend, up.addr).await;
    proxy.post(ORDERS).key("m").body(BODY).send().await;
    proxy.post(ORDERS).key("m").body(BODY).send().await;
    proxy.post(ORDERS).key("m").body(BODY).send().await;
    proxy.post(ORDERS).key("m").body("other").send().await;
    proxy.post(ORDERS).body(BODY).send().await;
    proxy.post(ORDERS).key("").body(BODY).send().await;
    up.push(Action::Status(500));
    proxy.post(ORDERS).key("m2").body(BODY).send().await;
    proxy.get("/elsewhere").send().await;
    assert_eq!(proxy.count(Outcome::Forwarded), 1);
    assert_eq!(proxy.count(Outcome::Replayed), 2);
    assert_eq!(proxy.count(Outcome::Mismatch), 1);
    assert_eq!(proxy.count(Outcome::MissingKey), 1);
    assert_eq!(proxy.count(Outcome::InvalidKey), 1);
    assert_eq!(proxy.count(Outcome::UpstreamError), 1);
    assert_eq!(proxy.count(Outcome::Conflict), 0);
    assert_eq!(
        proxy
            .metrics
            .request_count("unrouted", Outcome::Passthrough),
        1
    );
    let text = proxy.metrics.encode();
    assert!(
        text.contains(r#"idemgate_requests_total{route="/orders",outcome="replayed"} 2"#),
        "{text}"
    );
}
