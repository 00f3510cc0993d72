//! Hostile requests through the real server (issue 9): spellings, framings
//! and targets a client can use to slip past a protected route, leave the
//! upstream's base path or confuse the proxy. Well-formed ones go through
//! the test client; malformed ones are written byte for byte on a socket.

use crate::support::{bounded, Backend, H2Conn, Proxy, Req, Route, Upstream, ORDERS};
use http::Method;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

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

/// Pins: dot-segments were joined to the upstream's base path unresolved:
/// with `upstream = "http://host/base"`, `GET /../admin`, `/%2e%2e/admin`,
/// `/x/../../admin` and `GET http://api.example/../admin` reached the
/// upstream as `/base/../admin` and the like, which it resolves to `/admin`,
/// outside the base. They are resolved first (RFC 3986 §5.2.4), as nginx
/// does; a `..` past the root stops there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dot_segments_never_leave_the_upstream_base_path() {
    let up = Upstream::start().await;
    let proxy = Proxy::builder(Backend::Memory, up.addr)
        .set("server.upstream", format!("http://{}/base", up.addr))
        .start()
        .await;
    for (target, want) in [
        ("/../admin", "/base/admin"),
        ("/%2e%2e/admin", "/base/admin"),
        ("/%2E%2e/admin", "/base/admin"),
        ("/.%2E/admin", "/base/admin"),
        ("/x/../../admin", "/base/admin"),
        ("/x/..;/..;/admin", "/base/admin"),
        ("/./%2e/../admin/", "/base/admin/"),
        ("/..", "/base/"),
        ("http://api.example/../admin", "/base/admin"),
        ("http://api.example/x/%2e%2e/%2e%2e/admin", "/base/admin"),
        ("/a/./b/../c", "/base/a/c"),
        ("/a//../c", "/base/a/c"),
        ("/a/..x/c", "/base/a/..x/c"),
    ] {
        let resp = raw(
            proxy.addr,
            &format!("GET {target} HTTP/1.1\r\nhost: api.example\r\nconnection: close\r\n\r\n"),
        )
        .await;
        assert_eq!(resp.status, 200, "{target}: {}", resp.text());
        assert_eq!(up.last().path, want, "{target}");
    }
    // The query is the upstream's business: kept as sent.
    proxy.get("/x/../y?next=/../admin").send().await;
    assert_eq!(up.last().path, "/base/y");
    assert_eq!(up.last().query.as_deref(), Some("next=/../admin"));
    // A protected request: matched and forwarded as the same resource.
    let first = proxy
        .post("/x/../orders")
        .key("k-dots")
        .body("{}")
        .send()
        .await;
    assert!(first.status.is_success(), "{}", first.text());
    assert_eq!(up.last().path, "/base/orders");
    let retry = proxy.post("/orders").key("k-dots").body("{}").send().await;
    assert!(retry.replayed());
    assert_eq!(up.hits("/base/orders"), 1);
    bounded("shutdown", proxy.shutdown()).await;
}

/// Pins: `Transfer-Encoding: gzip, chunked` was accepted (hyper decodes the
/// final `chunked` only) and the upstream got the raw gzip bytes as a plain
/// chunked body. A transfer-coding other than `chunked` is 501 (RFC 9112
/// section 6.1), protected route or not; `chunked` twice is malformed (400).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transfer_codings_other_than_chunked_get_501() {
    let up = Upstream::start().await;
    let proxy = Proxy::start(Backend::Memory, up.addr).await;
    let post = |path: &str, key: &str, te: &str| {
        format!(
            "POST {path} HTTP/1.1\r\nhost: x\r\n{key}{te}connection: close\r\n\r\n\
             5\r\nhello\r\n0\r\n\r\n"
        )
    };
    for (path, key) in [(ORDERS, "idempotency-key: k-te\r\n"), ("/other", "")] {
        for te in [
            "transfer-encoding: gzip, chunked\r\n",
            "transfer-encoding: GZIP,chunked\r\n",
            "transfer-encoding: x-custom;q=1, chunked\r\n",
            "transfer-encoding: gzip\r\ntransfer-encoding: chunked\r\n",
        ] {
            let resp = raw(proxy.addr, &post(path, key, te)).await;
            let problem = resp.assert_problem(501);
            assert_type(&problem, "transfer-coding-unsupported");
            // Refused at admission, before any key was read.
            assert_eq!(resp.header("cache-control"), Some("no-store"));
            assert_eq!(problem["safe_new_key"], true, "{problem}");
            assert!(problem.get("key_id").is_none(), "{problem}");
            // Refused before routing, yet a protected route's answer says so.
            let status = (path == ORDERS).then_some("transfer-coding-unsupported");
            assert_eq!(resp.header("idempotency-status"), status, "{path}");
        }
        let twice = "transfer-encoding: chunked, chunked\r\n";
        raw(proxy.addr, &post(path, key, twice))
            .await
            .assert_problem(400);
    }
    assert_eq!(up.total_hits(), 0, "nothing was forwarded");

    // A plain chunked body is still welcome, on both kinds of route.
    let chunked = "transfer-encoding: Chunked\r\n";
    for (path, key) in [(ORDERS, "idempotency-key: k-te\r\n"), ("/other", "")] {
        let resp = raw(proxy.addr, &post(path, key, chunked)).await;
        assert!(resp.status < 300, "{path}: {}", resp.text());
        assert_eq!(&up.last().body[..], b"hello");
    }
    bounded("shutdown", proxy.shutdown()).await;
}

/// Pins: `Content-Length` was never stored and replays recomputed it from
/// the stored body, which for a HEAD response or a 304 is empty: a replayed
/// HEAD lost the length its original carried, and so did a 304 replayed
/// over HTTP/2 (over HTTP/1.1 hyper sends no length on a 304 to a POST,
/// original or replay).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replayed_head_and_304_responses_keep_their_content_length() {
    let up = Upstream::start().await;
    let proxy = Proxy::builder(Backend::Memory, up.addr)
        .routes(vec![Route::post(ORDERS).set("methods", vec!["HEAD"])])
        .start()
        .await;
    let head = || proxy.request(Method::HEAD, ORDERS).key("k-head");
    let first = head().send().await;
    assert_eq!(first.status(), 200);
    assert!(first.body.is_empty());
    let length = first
        .header("content-length")
        .expect("the original carries the length of what a GET would get")
        .to_string();
    assert_ne!(length, "0");
    let replay = head().send().await;
    assert!(replay.replayed());
    assert_eq!(replay.header("content-length"), Some(length.as_str()));
    assert_eq!(up.total_hits(), 1);

    let up = RawUpstream::start(
        "HTTP/1.1 304 Not Modified\r\netag: \"v1\"\r\ncontent-length: 42\r\n\r\n",
    )
    .await;
    let proxy = Proxy::start(Backend::Memory, up.addr).await;
    let mut h2 = H2Conn::open(proxy.addr).await;
    let post = || proxy.post(ORDERS).key("k-304").body("{}");
    let first = h2.send(post()).await;
    assert_eq!(first.status(), 304);
    assert_eq!(first.header("content-length"), Some("42"));
    let replay = h2.send(post()).await;
    assert!(replay.replayed());
    assert_eq!(replay.status(), 304);
    assert_eq!(replay.header("etag"), Some("\"v1\""));
    assert_eq!(replay.header("content-length"), Some("42"));
    assert_eq!(up.hits.load(Ordering::SeqCst), 1);
}

/// Pins: a scope header sent twice was digested with both values, so an
/// upstream gateway that appends identity headers (or a client adding its
/// own beside the one a gateway injects) could make the proxy and the
/// upstream disagree about whose key it is. It is refused (400) before the
/// body is read. `Cookie` is the exception: HTTP/2 splits it into fields
/// that are joined (RFC 9113 section 8.2.3), for the scope as upstream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repeated_scope_header_is_refused() {
    let up = Upstream::start().await;
    let proxy = Proxy::builder(Backend::Memory, up.addr)
        .routes(vec![
            Route::post(ORDERS).set("scope_headers", vec!["Authorization", "X-Tenant-Id"]),
            Route::post("/payments").set("scope_headers", vec!["Cookie"]),
        ])
        .start()
        .await;
    for (repeated, fields) in [
        (
            "authorization",
            [("authorization", "Bearer a"), ("authorization", "Bearer b")],
        ),
        (
            "x-tenant-id",
            [("x-tenant-id", "t1"), ("x-tenant-id", "t2")],
        ),
    ] {
        let mut req = proxy.post(ORDERS).key("k-rep").body("{}");
        for (name, value) in fields {
            req = req.header(name, value);
        }
        let problem = req.send().await.assert_problem(400);
        assert_type(&problem, "scope-header-repeated");
        assert!(
            problem["detail"].as_str().unwrap().contains(repeated),
            "{problem}"
        );
    }
    assert_eq!(up.total_hits(), 0, "nothing was forwarded");
    let once = proxy
        .post(ORDERS)
        .key("k-rep")
        .header("authorization", "Bearer a")
        .header("x-tenant-id", "t1")
        .body("{}")
        .send()
        .await;
    assert_eq!(once.status(), 201, "{}", once.text());

    // Split cookies over HTTP/2 are one scope with the joined field.
    let mut h2 = H2Conn::open(proxy.addr).await;
    let split = proxy
        .post("/payments")
        .key("k-cookie")
        .header("cookie", "a=1")
        .header("cookie", "b=2")
        .body("{}");
    let first = h2.send(split).await;
    assert_eq!(first.status(), 200, "{}", first.text());
    let joined = proxy
        .post("/payments")
        .key("k-cookie")
        .header("cookie", "a=1; b=2")
        .body("{}");
    assert!(joined.send().await.replayed());
    assert_eq!(up.total_hits(), 2);
}

/// Pins: request targets that are neither origin-form nor absolute-form
/// were forwarded (`POST orders` reached the upstream as `POST /`, `POST *`
/// as `POST *`), and so were HTTP/2 requests whose `host` named another
/// host than their `:authority` (RFC 9113 section 8.3.1), or requests with
/// two `Host` fields (RFC 9112 section 3.2). Each is 400 now, on any route.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_targets_and_conflicting_hosts_get_400() {
    let up = Upstream::start().await;
    let proxy = Proxy::start(Backend::Memory, up.addr).await;
    for (method, target) in [
        ("POST", "orders"),
        ("POST", "*"),
        ("OPTIONS", "*"),
        ("POST", "api.example:443"),
        ("CONNECT", "api.example:443"),
    ] {
        let resp = raw(
            proxy.addr,
            &format!(
                "{method} {target} HTTP/1.1\r\nhost: api.example\r\nidempotency-key: k-target\r\n\
                 content-length: 2\r\nconnection: close\r\n\r\n{{}}"
            ),
        )
        .await;
        let problem = resp.assert_problem(400);
        assert_type(&problem, "request-invalid");
    }
    let two_hosts = "GET /other HTTP/1.1\r\nhost: a.example\r\nhost: b.example\r\n\
                     connection: close\r\n\r\n";
    raw(proxy.addr, two_hosts).await.assert_problem(400);

    let mut h2 = H2Conn::open(proxy.addr).await;
    let at = |url: &str, host: &str| {
        Req::new(Method::POST, url.to_string())
            .header("host", host)
            .key("k-h2")
            .body("{}")
    };
    h2.send(at("http://a.example/orders", "b.example"))
        .await
        .assert_problem(400);
    h2.send(at("http://a.example/other", "a.example:8080"))
        .await
        .assert_problem(400);
    assert_eq!(up.total_hits(), 0, "nothing was forwarded");
    // Agreeing (host names are case-insensitive): served.
    let agreed = h2.send(at("http://a.example/orders", "A.example")).await;
    assert_eq!(agreed.status(), 201, "{}", agreed.text());

    // HTTP/1.1 absolute-form: the target's authority wins over `Host`
    // (RFC 9112 section 3.2.2), so the upstream hears of that one.
    let absolute =
        "GET http://a.example/x HTTP/1.1\r\nhost: b.example\r\nconnection: close\r\n\r\n";
    assert_eq!(raw(proxy.addr, absolute).await.status, 200);
    assert_eq!(up.last().path, "/x");
    assert_eq!(up.last().headers["x-forwarded-host"], "a.example");
}

// ===== framing (RFC 9112 §6) =====
//
// Each case below is a protected request whose framing is hostile. None may
// reach the upstream unguarded or leave a record behind: after each, the
// same key with a well-formed request is a fresh execution (never a replay
// of a partial answer, never a 409 for a claim nobody holds).

/// A protected POST of `body` on a fresh connection, head fields as given.
fn protected_post(key: &str, fields: &str, body: &str) -> String {
    format!(
        "POST {ORDERS} HTTP/1.1\r\nhost: x\r\nidempotency-key: {key}\r\n{fields}\
         connection: close\r\n\r\n{body}"
    )
}

/// Asserts that `key` is free: a well-formed request with it executes once
/// (201, not a replay), and its retry is a replay of that.
async fn assert_key_is_free(proxy: &Proxy, up: &Upstream, key: &str) {
    let before = up.total_hits();
    let fresh = proxy.post(ORDERS).key(key).body("{}").send().await;
    assert_eq!(fresh.status(), 201, "{key}: {}", fresh.text());
    assert!(!fresh.replayed(), "{key}: nothing was stored for it");
    assert_eq!(up.total_hits(), before + 1, "{key}: executed once");
    let retry = proxy.post(ORDERS).key(key).body("{}").send().await;
    assert!(retry.replayed(), "{key}");
    assert_eq!(retry.body, fresh.body, "{key}");
    assert_eq!(up.total_hits(), before + 1, "{key}");
}

/// `Content-Length` beside `Transfer-Encoding: chunked` (the request
/// smuggling shape, RFC 9112 §6.3): the chunked framing alone counts (hyper
/// drops the length), the upstream gets the decoded body with its own
/// length, and the connection is closed after the answer, so bytes past the
/// chunked body (here a second request, which a length-reading hop would
/// have taken as part of the first) are never read as a request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn content_length_beside_chunked_is_read_as_chunked_and_closes() {
    let up = Upstream::start().await;
    let proxy = Proxy::start(Backend::Memory, up.addr).await;
    let smuggled = "POST /orders HTTP/1.1\r\nhost: x\r\nidempotency-key: k-smuggled\r\n\
                    content-length: 2\r\n\r\n{}";
    let chunked = format!("5\r\nhello\r\n0\r\n\r\n{smuggled}");
    for (i, fields) in [
        "content-length: 4\r\ntransfer-encoding: chunked\r\n",
        "transfer-encoding: chunked\r\ncontent-length: 4\r\n",
        "content-length: 200\r\ntransfer-encoding: chunked\r\n",
    ]
    .into_iter()
    .enumerate()
    {
        let key = format!("k-clte-{i}");
        let request = format!(
            "POST {ORDERS} HTTP/1.1\r\nhost: x\r\nidempotency-key: {key}\r\n{fields}\r\n{chunked}"
        );
        let resp = raw(proxy.addr, &request).await;
        assert_eq!(resp.status, 201, "{fields:?}: {}", resp.text());
        assert!(
            !String::from_utf8_lossy(&resp.body).contains("HTTP/1.1"),
            "{fields:?}: one answer, then the connection closed: {}",
            resp.text()
        );
        let seen = up.last();
        assert_eq!(&seen.body[..], b"hello", "{fields:?}");
        assert_eq!(seen.headers["content-length"], "5", "{fields:?}");
        assert!(
            !seen.headers.contains_key("transfer-encoding"),
            "{fields:?}"
        );
        let retry = proxy.post(ORDERS).key(&key).body("hello").send().await;
        assert!(
            retry.replayed(),
            "{fields:?}: the same request, stored whole"
        );
    }
    assert_eq!(up.total_hits(), 3, "the smuggled request never ran");
    assert_key_is_free(&proxy, &up, "k-smuggled").await;
}

/// Two `Content-Length` fields that disagree, or one listing two lengths,
/// leave the body's end unknown (RFC 9112 §6.3): hyper answers 400 before
/// the request reaches idemgate. Two equal lengths are one length.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conflicting_content_lengths_get_400() {
    let up = Upstream::start().await;
    let proxy = Proxy::start(Backend::Memory, up.addr).await;
    for fields in [
        "content-length: 2\r\ncontent-length: 5\r\n",
        "content-length: 5\r\ncontent-length: 2\r\n",
        "content-length: 2, 5\r\n",
        "content-length: +2\r\n",
        "content-length: -1\r\n",
    ] {
        let resp = raw(proxy.addr, &protected_post("k-cl", fields, "{}abc")).await;
        assert_eq!(resp.status, 400, "{fields:?}: {}", resp.text());
    }
    assert_eq!(up.total_hits(), 0, "nothing was forwarded");
    assert_key_is_free(&proxy, &up, "k-cl").await;
    let same_twice = "content-length: 2\r\ncontent-length: 2\r\n";
    let resp = raw(proxy.addr, &protected_post("k-cl-same", same_twice, "{}")).await;
    assert_eq!(resp.status, 201, "{}", resp.text());
    assert_eq!(&up.last().body[..], b"{}");
}

/// obs-fold (a header line continued on the next with leading whitespace,
/// RFC 9112 §5.2) is refused with 400, in any field, the key's included:
/// a folded value is read differently by different hops.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn obs_fold_gets_400() {
    let up = Upstream::start().await;
    let proxy = Proxy::start(Backend::Memory, up.addr).await;
    for request in [
        protected_post("k-fold", "x-note: a\r\n b\r\ncontent-length: 2\r\n", "{}"),
        protected_post("k-fold", "x-note: a\r\n\tb\r\ncontent-length: 2\r\n", "{}"),
        format!(
            "POST {ORDERS} HTTP/1.1\r\nhost: x\r\nidempotency-key: k-fold\r\n -other\r\n\
             content-length: 2\r\nconnection: close\r\n\r\n{{}}"
        ),
        protected_post(
            "k-fold",
            "authorization: Bearer a\r\n b\r\ncontent-length: 2\r\n",
            "{}",
        ),
    ] {
        let resp = raw(proxy.addr, &request).await;
        assert_eq!(resp.status, 400, "{request:?}: {}", resp.text());
    }
    assert_eq!(up.total_hits(), 0, "nothing was forwarded");
    assert_key_is_free(&proxy, &up, "k-fold").await;
}

/// A body shorter than its `Content-Length`: a client that then stalls
/// gets 408 at `request_body_timeout`; one that closes its sending side
/// gets 400 (the body cannot be read whole); one that hangs up has nothing
/// forwarded. Each way the key stays free: nothing is claimed for a body
/// never read whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_shorter_than_its_length_is_never_forwarded() {
    let up = Upstream::start().await;
    let proxy = Proxy::builder(Backend::Memory, up.addr)
        .set("server.request_body_timeout", "500ms")
        .start()
        .await;
    // 14 of the 100 bytes it declares, on a fresh connection.
    let short = |key: &'static str| async move {
        let mut conn = TcpStream::connect(proxy.addr).await.expect("connect");
        let request = format!(
            "POST {ORDERS} HTTP/1.1\r\nhost: x\r\nidempotency-key: {key}\r\n\
             content-length: 100\r\n\r\n{{\"only\":\"part\""
        );
        conn.write_all(request.as_bytes()).await.expect("write");
        conn
    };
    let answer = |mut conn: TcpStream| async move {
        let mut bytes = Vec::new();
        let _ = bounded("an answer", conn.read_to_end(&mut bytes)).await;
        String::from_utf8_lossy(&bytes).into_owned()
    };

    // Stalls: 408 problem+json, then the connection closes.
    let text = answer(short("k-short-stall").await).await;
    assert!(text.starts_with("HTTP/1.1 408"), "{text}");
    assert!(text.contains("#problem-body-timeout"), "{text}");
    assert!(text.contains("idempotency-status: body-timeout"), "{text}");

    // Closes its sending side: the body can never be complete (400).
    let mut half = short("k-short-half").await;
    half.shutdown().await.expect("shutdown");
    let text = answer(half).await;
    assert!(text.starts_with("HTTP/1.1 400"), "{text}");
    assert!(text.contains("#problem-body-unreadable"), "{text}");

    // Hangs up entirely.
    drop(short("k-short-gone").await);

    // Past the body timeout, so nothing is still pending for any of them.
    tokio::time::sleep(std::time::Duration::from_millis(800)).await;
    assert_eq!(up.total_hits(), 0, "nothing was forwarded");
    for key in ["k-short-stall", "k-short-half", "k-short-gone"] {
        assert_key_is_free(&proxy, &up, key).await;
    }
}

/// A chunked body (no length to refuse up front) that grows past the
/// route's `max_request_body` is cut off at the limit: 413 problem+json,
/// nothing forwarded, the key free.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chunked_body_over_the_limit_gets_413() {
    let up = Upstream::start().await;
    let proxy = Proxy::builder(Backend::Memory, up.addr)
        .each_route("max_request_body", "1KiB")
        .start()
        .await;
    let chunk = format!("258\r\n{}\r\n", "x".repeat(600));
    let body = format!("{chunk}{chunk}{chunk}0\r\n\r\n");
    let request = protected_post("k-big", "transfer-encoding: chunked\r\n", &body);
    let problem = raw(proxy.addr, &request).await.assert_problem(413);
    assert_type(&problem, "body-too-large");
    assert_eq!(up.total_hits(), 0, "nothing was forwarded");
    assert_key_is_free(&proxy, &up, "k-big").await;

    // At the limit exactly: served.
    let chunk = format!("200\r\n{}\r\n", "x".repeat(512));
    let body = format!("{chunk}{chunk}0\r\n\r\n");
    let request = protected_post("k-at-limit", "transfer-encoding: chunked\r\n", &body);
    let resp = raw(proxy.addr, &request).await;
    assert_eq!(resp.status, 201, "{}", resp.text());
    assert_eq!(up.last().body.len(), 1024);
}

/// Asserts a problem's `type` is the README's `#problem-{slug}`.
fn assert_type(problem: &serde_json::Value, slug: &str) {
    let ty = problem["type"].as_str().unwrap_or_default();
    assert!(ty.ends_with(&format!("#problem-{slug}")), "{problem}");
}

// ===== raw sockets =====

/// A response as read off a raw socket.
struct RawResp {
    status: u16,
    /// The header section, field names lowercased.
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl RawResp {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    /// Asserts an RFC 9457 problem with `status`; returns its JSON.
    fn assert_problem(&self, status: u16) -> serde_json::Value {
        assert_eq!(self.status, status, "body: {}", self.text());
        assert_eq!(
            self.header("content-type"),
            Some("application/problem+json")
        );
        let json: serde_json::Value = serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", self.text()));
        assert_eq!(json["status"], status, "{json}");
        json
    }

    fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

/// Writes `request` byte for byte on a fresh connection and reads the
/// answer until the proxy closes the connection (so requests say
/// `connection: close`).
async fn raw(addr: SocketAddr, request: &str) -> RawResp {
    bounded(&format!("raw {request:?}"), async {
        let mut conn = TcpStream::connect(addr).await.expect("connect");
        conn.write_all(request.as_bytes()).await.expect("write");
        let mut bytes = Vec::new();
        // A reset after the answer is fine: what arrived is the answer.
        let _ = conn.read_to_end(&mut bytes).await;
        let split = bytes
            .windows(4)
            .position(|w| w == b"\r\n\r\n")
            .unwrap_or_else(|| panic!("no response head: {:?}", String::from_utf8_lossy(&bytes)));
        let head = String::from_utf8_lossy(&bytes[..split]).into_owned();
        let mut lines = head.split("\r\n");
        let status = lines
            .next()
            .and_then(|l| l.split(' ').nth(1))
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("bad status line: {head}"));
        let headers = lines
            .filter_map(|l| l.split_once(':'))
            .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_string()))
            .collect();
        RawResp {
            status,
            headers,
            body: bytes[split + 4..].to_vec(),
        }
    })
    .await
}

/// An upstream that answers every request with the same bytes: for answers
/// hyper would not send, such as a 304 to a POST with a `Content-Length`.
struct RawUpstream {
    addr: SocketAddr,
    hits: Arc<AtomicUsize>,
    task: JoinHandle<()>,
}

impl RawUpstream {
    async fn start(answer: &'static str) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let hits = Arc::new(AtomicUsize::new(0));
        let counter = hits.clone();
        let task = tokio::spawn(async move {
            while let Ok((conn, _)) = listener.accept().await {
                tokio::spawn(answer_each_request(conn, answer, counter.clone()));
            }
        });
        Self { addr, hits, task }
    }
}

impl Drop for RawUpstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Reads requests (head, then a `Content-Length` body) off `conn` and
/// writes `answer` after each, until the peer hangs up.
async fn answer_each_request(mut conn: TcpStream, answer: &str, hits: Arc<AtomicUsize>) {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        let end = loop {
            if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                break i + 4;
            }
            match conn.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        };
        let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
        let length: usize = head
            .lines()
            .find_map(|l| l.strip_prefix("content-length:"))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0);
        while buf.len() < end + length {
            match conn.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        }
        buf.drain(..end + length);
        hits.fetch_add(1, Ordering::SeqCst);
        if conn.write_all(answer.as_bytes()).await.is_err() {
            return;
        }
    }
}

/// Pins: with `Host` among the scope headers, the scope read the `Host`
/// field while forwarding used the target's authority. Over h2c,
/// `:authority: globex.example` (no `host` field) after
/// `:authority: acme.example` with the same key and body was served acme's
/// stored invoice; over HTTP/1.1, `POST http://acme.example/invoices` with
/// `Host: globex.example` ran on acme and was recorded under globex. The
/// host a request is forwarded for is the one its scope names now.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_scope_follows_the_authority_the_request_is_forwarded_to() {
    let up = Upstream::start().await;
    let proxy = Proxy::builder(Backend::Postgres, up.addr)
        .set("server.preserve_host", true)
        .routes(vec![
            Route::post("/invoices").set("scope_headers", vec!["Authorization", "Host"])
        ])
        .start()
        .await;
    let hosts_seen = || {
        up.seen()
            .iter()
            .map(|s| s.headers["host"].to_str().unwrap().to_string())
            .collect::<Vec<_>>()
    };

    let mut h2 = H2Conn::open(proxy.addr).await;
    let invoice = |authority: &str| {
        Req::new(Method::POST, format!("http://{authority}/invoices"))
            .header("authorization", "Bearer platform")
            .key("k-tenant-h2")
            .body(r#"{"amount":100}"#)
    };
    let acme = h2.send(invoice("acme.example")).await;
    assert_eq!(acme.status(), 200, "{}", acme.text());
    let globex = h2.send(invoice("globex.example")).await;
    assert!(!globex.replayed(), "globex was served acme's response");
    assert_eq!(hosts_seen(), ["acme.example", "globex.example"]);
    assert!(h2.send(invoice("acme.example")).await.replayed());
    assert!(h2.send(invoice("globex.example")).await.replayed());
    assert_eq!(up.total_hits(), 2);

    // HTTP/1.1 absolute-form: the target's authority is the host.
    let absolute = "POST http://acme.example/invoices HTTP/1.1\r\nhost: globex.example\r\n\
                    authorization: Bearer platform\r\nidempotency-key: k-tenant-h1\r\n\
                    content-length: 2\r\nconnection: close\r\n\r\n{}";
    assert_eq!(raw(proxy.addr, absolute).await.status, 200);
    assert_eq!(hosts_seen()[2], "acme.example");
    let origin = |host: &str| {
        proxy
            .post("/invoices")
            .header("host", host)
            .header("authorization", "Bearer platform")
            .key("k-tenant-h1")
            .body("{}")
            .send()
    };
    assert!(
        origin("acme.example").await.replayed(),
        "recorded under acme"
    );
    assert!(
        !origin("globex.example").await.replayed(),
        "globex never ran it"
    );
    assert_eq!(hosts_seen()[3], "globex.example");
    assert_eq!(up.total_hits(), 4);
}
