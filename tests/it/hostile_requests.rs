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

// ===== raw sockets =====

/// A response as read off a raw socket.
struct RawResp {
    status: u16,
    body: Vec<u8>,
}

impl RawResp {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

/// Writes `request` byte for byte on a fresh connection and reads the
/// answer until the proxy closes the connection (so requests say
/// `connection: close`).
async fn raw(addr: std::net::SocketAddr, request: &str) -> RawResp {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    bounded(&format!("raw {request:?}"), async {
        let mut conn = tokio::net::TcpStream::connect(addr).await.expect("connect");
        conn.write_all(request.as_bytes()).await.expect("write");
        let mut bytes = Vec::new();
        // A reset after the answer is fine: what arrived is the answer.
        let _ = conn.read_to_end(&mut bytes).await;
        let split = bytes
            .windows(4)
            .position(|w| w == b"\r\n\r\n")
            .unwrap_or_else(|| panic!("no response head: {:?}", String::from_utf8_lossy(&bytes)));
        let head = String::from_utf8_lossy(&bytes[..split]).into_owned();
        let status = head
            .split(' ')
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("bad status line: {head}"));
        RawResp {
            status,
            body: bytes[split + 4..].to_vec(),
        }
    })
    .await
}
