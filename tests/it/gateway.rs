//! Gateway mode: named upstreams (`[upstreams.NAME]`), each with its own
//! URL, base path and timeouts, chosen per route; everything else goes to
//! `[server] upstream` as before. HTTPS upstreams are `upstream_tls.rs`'s;
//! WebSocket and HTTP/2 passing through are here too, at the end.

use crate::support::{run_on_config_text, Action, Backend, Proxy, Route, Upstream};
use http::Method;
use std::time::Duration;

/// Two upstreams: the default (`[server] upstream`) and `orders`, which
/// has a base path and a short timeout.
async fn two_upstreams() -> (Upstream, Upstream, Proxy) {
    let default = Upstream::start().await;
    let orders = Upstream::start().await;
    let proxy = Proxy::builder(Backend::Memory, default.addr)
        .set("upstreams.orders.url", format!("http://{}/v1", orders.addr))
        .set("upstreams.orders.timeout", "500ms")
        .set("upstreams.orders.connect_timeout", "1s")
        .set("upstreams.orders.pool_max_idle", 2)
        .routes(vec![
            Route::post("/orders").set("upstream", "orders"),
            Route::post("/payments"),
            // Unprotected traffic is routed by a route that needs no key.
            Route::post("/catalog/*")
                .set("methods", vec!["GET"])
                .set("require_key", false)
                .set("upstream", "orders"),
        ])
        .start()
        .await;
    (default, orders, proxy)
}

#[tokio::test]
async fn routes_send_to_their_named_upstream_and_everything_else_to_the_default() {
    let (default, orders, proxy) = two_upstreams().await;

    let first = proxy.post("/orders").key("g-1").body("{}").send().await;
    // The test upstream's 201 is for /orders itself; /v1/orders gets 200.
    assert_eq!(first.status(), 200);
    let seen = orders.last();
    assert_eq!(seen.path, "/v1/orders", "the named upstream's base path");
    assert_eq!(seen.headers["host"], orders.addr.to_string());
    let replay = proxy.post("/orders").key("g-1").body("{}").send().await;
    assert!(
        replay.replayed(),
        "protection works the same on a named upstream"
    );
    assert_eq!(orders.hits("/v1/orders"), 1);

    assert_eq!(
        proxy.post("/payments").key("g-2").send().await.status(),
        200
    );
    assert_eq!(default.hits("/payments"), 1);
    assert_eq!(proxy.get("/elsewhere").send().await.status(), 200);
    assert_eq!(default.hits("/elsewhere"), 1, "unrouted: the default");

    let catalog = proxy.get("/catalog/items?page=2").send().await;
    assert_eq!(catalog.status(), 200);
    assert_eq!(orders.last().path, "/v1/catalog/items");
    assert_eq!(orders.last().query.as_deref(), Some("page=2"));
    assert_eq!(default.total_hits(), 2, "nothing else reached the default");
}

#[tokio::test]
async fn each_upstream_has_its_own_timeout() {
    let (default, orders, proxy) = two_upstreams().await;
    orders.push(Action::Delay(Duration::from_secs(2)));
    let slow_named = proxy.get("/catalog/slow").send().await;
    slow_named.assert_problem(504);

    // The default's timeout is its own (the harness default, not 500ms).
    default.push(Action::Delay(Duration::from_millis(900)));
    let slow_default = proxy.get("/slow").send().await;
    assert_eq!(slow_default.status(), 200);
}

#[tokio::test]
async fn an_unreachable_named_upstream_is_a_502_and_the_default_still_serves() {
    let default = Upstream::start().await;
    let proxy = Proxy::builder(Backend::Memory, default.addr)
        .set(
            "upstreams.gone.url",
            format!("http://{}", Upstream::refusing_addr()),
        )
        .routes(vec![Route::post("/orders").set("upstream", "gone")])
        .start()
        .await;
    let r = proxy.post("/orders").key("g-3").send().await;
    r.assert_problem(502);
    assert_eq!(proxy.get("/other").send().await.status(), 200);
    // Nothing was sent, so the key was released: the retry runs again.
    let again = proxy.post("/orders").key("g-3").send().await;
    again.assert_problem(502);
    assert!(!again.replayed());
}

#[tokio::test]
async fn check_config_names_the_file_line_and_field_of_an_unknown_upstream() {
    const TEXT: &str = r#"[server]
upstream = "http://127.0.0.1:3000"

[upstreams.orders]
url = "http://127.0.0.1:3001"

[[route]]
methods = ["POST"]
path = "/orders"
upstream = "ordres"
"#;
    let (run, file) = run_on_config_text(&["check-config"], TEXT, &[]).await;
    assert_eq!(run.code, 64, "{run:?}");
    assert!(
        run.stderr.contains(&format!(
            "{file}: line 10: route #1: upstream = \"ordres\" names no [upstreams.ordres] section (defined: orders)"
        )),
        "{}",
        run.stderr
    );

    let good = TEXT.replace("ordres", "orders");
    let (run, _) = run_on_config_text(&["check-config"], &good, &[]).await;
    assert_eq!(run.code, 0, "{run:?}");
    assert!(
        run.stdout
            .contains("upstream   orders: http://127.0.0.1:3001/"),
        "{}",
        run.stdout
    );
}

#[tokio::test]
async fn methods_other_than_the_route_s_still_go_to_the_default() {
    let (default, orders, proxy) = two_upstreams().await;
    // GET /orders matches no route (the route is POST): unrouted.
    assert_eq!(
        proxy.request(Method::GET, "/orders").send().await.status(),
        200
    );
    assert_eq!(default.hits("/orders"), 1);
    assert_eq!(orders.total_hits(), 0);
}

// ===== WebSocket (HTTP/1.1 Upgrade) =====

mod websocket {
    use crate::support::ws_upstream::{
        accept_key, encode, header, read_frame, read_head, WsUpstream, CLOSE, TEXT,
    };
    use crate::support::{bounded, metric_value, wait_until, Backend, Proxy, Route};
    use std::net::SocketAddr;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;

    const KEY: &str = "dGhlIHNhbXBsZSBub25jZQ==";
    const MASK: Option<[u8; 4]> = Some([1, 2, 3, 4]);

    /// Opens a connection to the proxy and sends a WebSocket handshake for
    /// `path`; returns the connection and the response head.
    async fn handshake(proxy: SocketAddr, path: &str, extra: &str) -> (TcpStream, String) {
        let mut s = TcpStream::connect(proxy)
            .await
            .expect("connect to the proxy");
        let req = format!(
            "GET {path} HTTP/1.1\r\nhost: {proxy}\r\nupgrade: websocket\r\nconnection: Upgrade\r\nsec-websocket-key: {KEY}\r\nsec-websocket-version: 13\r\n{extra}\r\n"
        );
        s.write_all(req.as_bytes())
            .await
            .expect("send the handshake");
        let head = bounded("the handshake's answer", read_head(&mut s))
            .await
            .expect("a response head");
        (s, head)
    }

    async fn echo(s: &mut TcpStream, text: &[u8]) -> Vec<u8> {
        s.write_all(&encode(TEXT, text, MASK))
            .await
            .expect("send a frame");
        let (opcode, payload) = bounded("the echo", read_frame(s)).await.expect("a frame");
        assert_eq!(opcode, TEXT);
        payload
    }

    #[tokio::test]
    async fn a_websocket_passes_through_an_unprotected_path_as_a_tunnel() {
        let ws = WsUpstream::start().await;
        let proxy = Proxy::start(Backend::Memory, ws.addr).await;
        let (mut s, head) = handshake(proxy.addr, "/chat?room=1", "").await;
        assert!(head.starts_with("HTTP/1.1 101"), "{head}");
        assert_eq!(
            header(&head, "sec-websocket-accept"),
            Some(accept_key(KEY).as_str())
        );
        assert!(header(&head, "upgrade")
            .unwrap()
            .eq_ignore_ascii_case("websocket"));

        // The upstream saw the upgrade, not a plain GET.
        let seen = &ws.heads()[0];
        assert!(seen.starts_with("GET /chat?room=1 HTTP/1.1"), "{seen}");
        assert_eq!(header(seen, "upgrade"), Some("websocket"));
        assert!(header(seen, "connection")
            .unwrap()
            .eq_ignore_ascii_case("upgrade"));
        assert_eq!(header(seen, "sec-websocket-key"), Some(KEY));

        // Frames both ways, small and large (past one read buffer).
        assert_eq!(echo(&mut s, b"hello").await, b"echo: hello");
        let big = vec![b'x'; 100_000];
        let back = echo(&mut s, &big).await;
        assert_eq!(back.len(), 6 + big.len());
        assert_eq!(echo(&mut s, b"again").await, b"echo: again");

        // A close goes through and the tunnel ends.
        s.write_all(&encode(CLOSE, b"", MASK)).await.unwrap();
        let (opcode, _) = bounded("the close", read_frame(&mut s)).await.unwrap();
        assert_eq!(opcode, CLOSE);
        let mut rest = Vec::new();
        let n = bounded("the tunnel to close", s.read_to_end(&mut rest))
            .await
            .unwrap();
        assert_eq!(n, 0);
    }

    #[tokio::test]
    async fn a_websocket_reaches_a_named_upstream_through_a_route_without_a_key() {
        let default = crate::support::Upstream::start().await;
        let ws = WsUpstream::start().await;
        let proxy = Proxy::builder(Backend::Memory, default.addr)
            .set("upstreams.live.url", format!("http://{}", ws.addr))
            .routes(vec![Route::post("/live/*")
                .set("methods", vec!["GET"])
                .set("require_key", false)
                .set("upstream", "live")])
            .start()
            .await;
        let (mut s, head) = handshake(proxy.addr, "/live/feed", "").await;
        assert!(head.starts_with("HTTP/1.1 101"), "{head}");
        assert_eq!(echo(&mut s, b"tick").await, b"echo: tick");
        assert_eq!(default.total_hits(), 0);
    }

    /// An upstream that does not switch answers as usual, and the tunnel
    /// slot taken for the upgrade is given back.
    #[tokio::test]
    async fn an_upstream_that_refuses_the_upgrade_answers_as_usual() {
        let ws = WsUpstream::start().await;
        let proxy = Proxy::builder(Backend::Memory, ws.addr)
            .set("server.max_connections", 1)
            .start()
            .await;
        for _ in 0..2 {
            // No Sec-WebSocket-Key: the echo upstream answers 400.
            let mut s = TcpStream::connect(proxy.addr).await.unwrap();
            let req = format!(
                "GET /chat HTTP/1.1\r\nhost: {}\r\nupgrade: websocket\r\nconnection: upgrade\r\n\r\n",
                proxy.addr
            );
            s.write_all(req.as_bytes()).await.unwrap();
            let head = bounded("the answer", read_head(&mut s)).await.unwrap();
            assert!(head.starts_with("HTTP/1.1 400"), "{head}");
        }
        let text = proxy.metrics.encode();
        assert_eq!(
            metric_value(&text, "idemgate_tunnels_refused_total"),
            0,
            "{text}"
        );
        assert_eq!(metric_value(&text, "idemgate_tunnels_open"), 0, "{text}");
    }

    /// HTTP/2 has no Upgrade (RFC 9113 §8.6): an h2 upstream gets a plain
    /// request.
    #[tokio::test]
    async fn an_upgrade_to_an_h2_upstream_becomes_a_plain_request() {
        let up = crate::support::h2_upstream::H2Upstream::start().await;
        let proxy = Proxy::builder(Backend::Memory, up.addr)
            .set("server.upstream_protocol", "h2")
            .start()
            .await;
        let (_s, head) = handshake(proxy.addr, "/chat", "").await;
        assert!(head.starts_with("HTTP/1.1 200"), "{head}");
        let seen = &up.seen()[0];
        assert!(!seen.headers.contains_key("upgrade"), "{:?}", seen.headers);
        assert!(
            !seen.headers.contains_key("connection"),
            "{:?}",
            seen.headers
        );
    }

    #[tokio::test]
    async fn tunnels_are_bounded_by_max_connections_and_counted() {
        let ws = WsUpstream::start().await;
        let proxy = Proxy::builder(Backend::Memory, ws.addr)
            .set("server.max_connections", 1)
            .start()
            .await;
        let (mut first, head) = handshake(proxy.addr, "/a", "").await;
        assert!(head.starts_with("HTTP/1.1 101"), "{head}");
        assert_eq!(echo(&mut first, b"one").await, b"echo: one");
        let metrics = || proxy.metrics.encode();
        assert_eq!(metric_value(&metrics(), "idemgate_tunnels_open"), 1);

        // The upgraded connection left the connection limit, so a second
        // client is served, but the tunnel limit is reached: 503.
        let (second, head) = handshake(proxy.addr, "/b", "").await;
        assert!(head.starts_with("HTTP/1.1 503"), "{head}");
        assert!(
            head.to_ascii_lowercase().contains("retry-after: 1"),
            "{head}"
        );
        assert_eq!(
            metric_value(&metrics(), "idemgate_tunnels_refused_total"),
            1
        );
        assert_eq!(ws.heads().len(), 1, "the refused upgrade was not forwarded");
        // It holds the one connection slot while open.
        drop(second);

        first.write_all(&encode(CLOSE, b"", MASK)).await.unwrap();
        let mut rest = Vec::new();
        let _ = bounded("the upstream's close", first.read_to_end(&mut rest)).await;
        // Half-closed until the client closes too (a tunnel passes
        // half-closes on, as TCP does).
        drop(first);
        wait_until("the tunnel to be counted closed", || {
            metric_value(&metrics(), "idemgate_tunnels_open") == 0
        })
        .await;
        let text = metrics();
        assert!(
            text.contains("idemgate_tunnel_bytes_total{direction=\"to_upstream\"}"),
            "{text}"
        );
        let (_third, head) = handshake(proxy.addr, "/c", "").await;
        assert!(
            head.starts_with("HTTP/1.1 101"),
            "a slot is free again: {head}"
        );
    }

    #[tokio::test]
    async fn an_upgrade_on_a_protected_route_is_refused_and_never_forwarded() {
        let ws = WsUpstream::start().await;
        let proxy = Proxy::builder(Backend::Memory, ws.addr)
            .routes(vec![
                Route::post("/ws").set("methods", vec!["GET"]),
                Route::post("/optional")
                    .set("methods", vec!["GET"])
                    .set("require_key", false),
            ])
            .start()
            .await;
        for (path, extra) in [
            ("/ws", ""),
            ("/ws", "idempotency-key: k1\r\n"),
            // Optional keys: a request that carries one is protected.
            ("/optional", "idempotency-key: k2\r\n"),
        ] {
            let (mut s, head) = handshake(proxy.addr, path, extra).await;
            assert!(head.starts_with("HTTP/1.1 400"), "{path}: {head}");
            assert_eq!(
                header(&head, "content-type"),
                Some("application/problem+json")
            );
            let len: usize = header(&head, "content-length").unwrap().parse().unwrap();
            let mut body = vec![0u8; len];
            s.read_exact(&mut body).await.unwrap();
            let problem: serde_json::Value = serde_json::from_slice(&body).unwrap();
            assert!(
                problem["type"]
                    .as_str()
                    .unwrap()
                    .ends_with("#problem-upgrade-refused"),
                "{problem}"
            );
        }
        assert!(ws.heads().is_empty(), "nothing reached the upstream");
        // Without a key on the optional route, the upgrade passes.
        let (_s, head) = handshake(proxy.addr, "/optional", "").await;
        assert!(head.starts_with("HTTP/1.1 101"), "{head}");
    }
}

// ===== HTTP/2 upstreams (gRPC-shaped) =====

mod h2 {
    use crate::support::h2_upstream::H2Upstream;
    use crate::support::{bounded, Backend, Proxy, Route};
    use bytes::Bytes;
    use http::{HeaderMap, Request, Version};
    use http_body_util::{BodyExt, Full};
    use hyper_util::rt::{TokioExecutor, TokioIo};
    use std::net::SocketAddr;
    use tokio::net::TcpStream;

    /// A gRPC-style call over h2c to the proxy: (status, body, trailers).
    async fn call(proxy: SocketAddr, path: &str) -> (u16, Bytes, Option<HeaderMap>) {
        bounded("a gRPC-style call", async {
            let stream = TcpStream::connect(proxy).await.expect("connect");
            let (mut sender, conn) =
                hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(stream))
                    .await
                    .expect("h2 handshake");
            tokio::spawn(conn);
            let req = Request::post(format!("http://{proxy}{path}"))
                .version(Version::HTTP_2)
                .header("content-type", "application/grpc")
                .header("te", "trailers")
                .body(Full::new(Bytes::from_static(b"\0\0\0\0\x02hi")))
                .unwrap();
            let resp = sender.send_request(req).await.expect("h2 send");
            let status = resp.status().as_u16();
            let collected = resp.into_body().collect().await.expect("the body");
            let trailers = collected.trailers().cloned();
            (status, collected.to_bytes(), trailers)
        })
        .await
    }

    #[tokio::test]
    async fn an_h2c_upstream_gets_http2_and_its_trailers_reach_the_client() {
        let up = H2Upstream::start().await;
        let proxy = Proxy::builder(Backend::Memory, up.addr)
            .set("server.upstream_protocol", "h2")
            .start()
            .await;
        let (status, body, trailers) = call(proxy.addr, "/echo.Echo/Say").await;
        assert_eq!(status, 200);
        assert_eq!(&body[..], b"reply:\0\0\0\0\x02hi");
        let trailers = trailers.expect("trailers arrived");
        assert_eq!(trailers["grpc-status"], "0");
        assert_eq!(trailers["grpc-message"], "ok");

        let seen = &up.seen()[0];
        assert_eq!(seen.version, Version::HTTP_2, "prior knowledge h2c");
        assert_eq!(seen.path, "/echo.Echo/Say");
        assert_eq!(seen.headers["te"], "trailers", "gRPC servers require it");
        assert_eq!(seen.headers["content-type"], "application/grpc");
        assert_eq!(&seen.body[..], b"\0\0\0\0\x02hi");
    }

    #[tokio::test]
    async fn a_named_h2_upstream_serves_its_route_and_http1_stays_the_default() {
        let default = crate::support::Upstream::start().await;
        let grpc = H2Upstream::start().await;
        let proxy = Proxy::builder(Backend::Memory, default.addr)
            .set("upstreams.grpc.url", format!("http://{}", grpc.addr))
            .set("upstreams.grpc.protocol", "h2")
            .routes(vec![Route::post("/echo.Echo/*")
                .set("require_key", false)
                .set("upstream", "grpc")])
            .start()
            .await;
        let (status, _, trailers) = call(proxy.addr, "/echo.Echo/Say").await;
        assert_eq!(status, 200);
        assert_eq!(trailers.expect("trailers")["grpc-status"], "0");
        assert_eq!(grpc.seen().len(), 1);

        // Everything else: the default upstream, over HTTP/1.1.
        let r = proxy.get("/plain").send().await;
        assert_eq!(r.status(), 200);
        assert_eq!(default.last().version, Version::HTTP_11);
    }
}
