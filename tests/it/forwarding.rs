//! Transparency: what passes through the proxy unprotected, and how.

use crate::support;
use crate::support::{Backend, H2Conn, Http1Conn, Proxy, Upstream, ORDERS};
use bytes::Bytes;
use http::{Method, Version};
use idemgate::metrics::Outcome;

async fn start() -> (Upstream, Proxy) {
    let up = Upstream::start().await;
    let proxy = Proxy::start(Backend::Memory, up.addr).await;
    (up, proxy)
}

#[tokio::test]
async fn unrouted_requests_pass_through_with_method_path_query_body_and_headers_intact() {
    let (up, proxy) = start().await;
    let r = proxy
        .request(Method::PUT, "/things/42?a=1&b=two%20words")
        .header("x-custom", "v1")
        .header("content-type", "text/plain")
        .header("authorization", "Bearer t")
        .key("passed-along")
        .body("hello upstream")
        .send()
        .await;
    assert_eq!(r.status(), 200);
    let seen = up.last();
    assert_eq!(seen.method, Method::PUT);
    assert_eq!(seen.path, "/things/42");
    assert_eq!(seen.query.as_deref(), Some("a=1&b=two%20words"));
    assert_eq!(seen.body, Bytes::from("hello upstream"));
    assert_eq!(seen.headers["x-custom"], "v1");
    assert_eq!(seen.headers["content-type"], "text/plain");
    assert_eq!(seen.headers["authorization"], "Bearer t");
    assert_eq!(seen.headers["idempotency-key"], "passed-along");
    assert_eq!(
        proxy
            .metrics
            .request_count("unrouted", Outcome::Passthrough),
        1
    );
}

#[tokio::test]
async fn another_method_on_a_protected_path_is_not_protected() {
    let (up, proxy) = start().await;
    for _ in 0..2 {
        let r = proxy.get("/orders?page=2").key("same").send().await;
        assert_eq!(r.status(), 200);
        assert!(!r.replayed());
    }
    assert_eq!(up.hits(ORDERS), 2);
    assert_eq!(up.last().method, Method::GET);
    assert_eq!(up.last().query.as_deref(), Some("page=2"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_bodies_stream_both_ways() {
    let (up, proxy) = start().await;
    let size = 5 * 1024 * 1024;
    let chunks: Vec<Bytes> = (0..80)
        .map(|_| Bytes::from(vec![b'u'; 64 * 1024]))
        .collect();
    let r = proxy
        .request(Method::PUT, "/upload")
        .chunked(chunks)
        .send()
        .await;
    assert_eq!(r.status(), 200);
    assert_eq!(up.last().body.len(), size);
    assert!(up.last().body.iter().all(|&b| b == b'u'));

    let down = proxy.get(&format!("/download?size={size}")).send().await;
    assert_eq!(down.status(), 200);
    assert_eq!(down.body.len(), size);
}

#[tokio::test]
async fn hop_by_hop_headers_are_stripped_both_ways() {
    let (up, proxy) = start().await;
    let r = proxy
        .get("/hop?hop=1")
        .header("connection", "keep-alive, x-client-hop")
        .header("x-client-hop", "secret")
        .header("keep-alive", "timeout=5")
        .header("proxy-authorization", "Basic Zm9vOmJhcg==")
        .header("proxy-connection", "keep-alive")
        .header("te", "trailers")
        .header("x-end-to-end", "kept")
        .send()
        .await;
    assert_eq!(r.status(), 200);
    let seen = up.last();
    for name in [
        "x-client-hop",
        "keep-alive",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "transfer-encoding",
    ] {
        assert!(
            !seen.headers.contains_key(name),
            "{name}: {:?}",
            seen.headers
        );
    }
    if let Some(c) = seen.headers.get("connection") {
        assert!(!c.to_str().unwrap().contains("x-client-hop"), "{c:?}");
    }
    assert_eq!(seen.headers["x-end-to-end"], "kept");
    assert!(r.header("x-upstream-hop").is_none(), "{:?}", r.headers);
    assert_eq!(r.header("x-upstream"), Some("test"));
}

#[tokio::test]
async fn forwarding_headers_are_added_and_host_is_the_upstreams() {
    let (up, proxy) = start().await;
    proxy
        .get("/where")
        .header("x-forwarded-for", "203.0.113.9")
        .send()
        .await;
    let seen = up.last();
    // Not behind a trusted proxy: the client's own chain is not believed.
    assert_eq!(seen.headers["x-forwarded-for"], "127.0.0.1");
    assert_eq!(seen.headers["x-forwarded-proto"], "http");
    assert_eq!(seen.headers["x-forwarded-host"], proxy.addr.to_string());
    assert_eq!(seen.headers["host"], up.addr.to_string());

    proxy.post(ORDERS).key("fwd").body("{}").send().await;
    let seen = up.last();
    assert_eq!(seen.headers["x-forwarded-for"], "127.0.0.1");
    assert_eq!(seen.headers["host"], up.addr.to_string());
    assert_eq!(seen.headers["idempotency-key"], "fwd");
}

#[tokio::test]
async fn upstream_status_and_headers_pass_back() {
    let (_up, proxy) = start().await;
    let r = proxy.get("/teapot?status=418&headers=1").send().await;
    assert_eq!(r.status(), 418);
    assert_eq!(r.header_all("x-multi"), ["a, b", "c"]);
    assert_eq!(r.header_all("set-cookie"), ["session=one", "theme=dark"]);
    assert_eq!(r.header("x-upstream"), Some("test"));
    assert_eq!(r.json()["path"], "/teapot");
}

#[tokio::test]
async fn h2c_prior_knowledge_requests_are_served() {
    let (up, proxy) = start().await;
    let mut h2 = H2Conn::open(proxy.addr).await;
    let r = h2.send(proxy.get("/h2?x=1")).await;
    assert_eq!(r.status(), 200);
    assert_eq!(r.version, Version::HTTP_2);
    let seen = up.last();
    assert_eq!(seen.version, Version::HTTP_11, "the upstream sees HTTP/1.1");
    assert_eq!(seen.query.as_deref(), Some("x=1"));
    assert_eq!(seen.headers["host"], up.addr.to_string());
    assert_eq!(seen.headers["x-forwarded-host"], proxy.addr.to_string());

    let first = h2.send(proxy.post(ORDERS).key("h2-key").body("{}")).await;
    assert_eq!(first.status(), 201);
    let again = h2.send(proxy.post(ORDERS).key("h2-key").body("{}")).await;
    assert!(again.replayed());
    assert_eq!(again.body, first.body);
    assert_eq!(up.hits(ORDERS), 1);
}

#[tokio::test]
async fn several_requests_share_one_kept_alive_connection() {
    let (up, proxy) = start().await;
    let mut conn = Http1Conn::open(proxy.addr).await;
    for i in 0..3 {
        let r = conn.send(proxy.get(&format!("/ka?i={i}"))).await;
        assert_eq!(r.status(), 200);
    }
    let first = conn.send(proxy.post(ORDERS).key("ka").body("{}")).await;
    assert_eq!(first.status(), 201);
    let again = conn.send(proxy.post(ORDERS).key("ka").body("{}")).await;
    assert!(again.replayed());
    // A refused protected request does not close the connection either.
    let missing = conn.send(proxy.post(ORDERS).body("{}")).await;
    missing.assert_problem(400);
    let last = conn.send(proxy.get("/ka?i=last")).await;
    assert_eq!(last.status(), 200);
    assert_eq!(up.total_hits(), 5);
    conn.close();
}

#[tokio::test]
async fn preserve_host_forwards_the_clients_host() {
    let up = Upstream::start().await;
    let proxy = Proxy::builder(Backend::Memory, up.addr)
        .set("server.preserve_host", true)
        .start()
        .await;
    proxy
        .get("/host")
        .header("host", "api.example")
        .send()
        .await;
    let seen = up.last();
    assert_eq!(seen.headers["host"], "api.example");
    assert_eq!(seen.headers["x-forwarded-host"], "api.example");
}

#[tokio::test]
async fn an_upstream_base_path_prefixes_every_request() {
    let up = Upstream::start().await;
    let proxy = Proxy::builder(Backend::Memory, up.addr)
        .set("server.upstream", format!("http://{}/api/", up.addr))
        .start()
        .await;
    let r = proxy.get("/things?x=1").send().await;
    assert_eq!(r.status(), 200);
    assert_eq!(up.last().path, "/api/things");
    assert_eq!(up.last().query.as_deref(), Some("x=1"));
    proxy.post(ORDERS).key("base").body("{}").send().await;
    assert_eq!(up.last().path, "/api/orders");
}

#[tokio::test]
async fn unprotected_requests_get_problem_responses_when_the_upstream_fails() {
    let refused = Proxy::start(Backend::Memory, Upstream::refusing_addr()).await;
    refused.get("/down").send().await.assert_problem(502);
    assert_eq!(
        refused
            .metrics
            .request_count("unrouted", Outcome::UpstreamError),
        1
    );

    let up = Upstream::start().await;
    let proxy = Proxy::builder(Backend::Memory, up.addr)
        .set("server.upstream_timeout", "300ms")
        .start()
        .await;
    up.push(support::Action::Delay(std::time::Duration::from_secs(3)));
    proxy.get("/slow").send().await.assert_problem(504);
    assert_eq!(proxy.get("/fast").send().await.status(), 200);
}
