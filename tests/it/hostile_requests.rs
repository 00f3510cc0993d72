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
