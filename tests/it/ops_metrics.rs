//! Operations metrics under real traffic: upstream requests in flight per
//! upstream (held while the answer is still being read), and open client
//! connections.

use crate::support::{wait_for, Backend, Http1Conn, Proxy, Upstream, ORDERS};

const IN_FLIGHT: &str = "idemgate_upstream_in_flight{upstream=\"default\"}";

fn sample(proxy: &Proxy, series: &str) -> Option<i64> {
    proxy
        .metrics
        .encode()
        .lines()
        .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
}

async fn until(proxy: &Proxy, series: &str, want: i64) {
    wait_for(&format!("{series} to be {want}"), || async {
        (sample(proxy, series) == Some(want)).then_some(())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_requests_in_flight_and_open_connections_are_gauged() {
    let up = Upstream::start().await;
    let proxy = Proxy::start(Backend::Memory, up.addr).await;

    // Unprotected and protected requests, each slow upstream.
    let slow_get = tokio::spawn(proxy.get("/catalog?delay_ms=700").send());
    let slow_post = tokio::spawn(
        proxy
            .post(&format!("{ORDERS}?delay_ms=700"))
            .key("k-slow")
            .body("{}")
            .send(),
    );
    until(&proxy, IN_FLIGHT, 2).await;
    assert_eq!(slow_get.await.unwrap().status(), 200);
    assert_eq!(slow_post.await.unwrap().status(), 201);
    until(&proxy, IN_FLIGHT, 0).await;

    let mut conns = Vec::new();
    for _ in 0..3 {
        let mut c = Http1Conn::open(proxy.addr).await;
        assert_eq!(c.send(proxy.get("/catalog")).await.status(), 200);
        conns.push(c);
    }
    until(&proxy, "idemgate_open_connections", 3).await;
    for c in conns {
        c.close();
    }
    until(&proxy, "idemgate_open_connections", 0).await;
}

/// Every request served is timed, unrouted ones and refusals included,
/// with bounded labels: an invented method is `other`, never its name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_request_served_is_in_the_duration_histogram() {
    let up = Upstream::start().await;
    let proxy = Proxy::start(Backend::Memory, up.addr).await;
    assert_eq!(proxy.get("/catalog").send().await.status(), 200);
    let body = "{\"item\":\"mug\"}";
    assert_eq!(
        proxy
            .post(ORDERS)
            .key("k-h")
            .body(body)
            .send()
            .await
            .status(),
        201
    );
    assert!(proxy
        .post(ORDERS)
        .key("k-h")
        .body(body)
        .send()
        .await
        .replayed());
    proxy
        .post(ORDERS)
        .body(body)
        .send()
        .await
        .assert_problem(400);
    let brew = http::Method::from_bytes(b"BREW").unwrap();
    proxy.request(brew, "/pot").send().await;
    let count = |labels: &str| format!("idemgate_request_duration_seconds_count{{{labels}}}");
    for (labels, want) in [
        (
            r#"route="unrouted",method="GET",status_class="2xx",outcome="passthrough""#,
            1,
        ),
        (
            r#"route="/orders",method="POST",status_class="2xx",outcome="forwarded""#,
            1,
        ),
        (
            r#"route="/orders",method="POST",status_class="2xx",outcome="replayed""#,
            1,
        ),
        (
            r#"route="/orders",method="POST",status_class="4xx",outcome="missing_key""#,
            1,
        ),
    ] {
        until(&proxy, &count(labels), want).await;
    }
    let text = proxy.metrics.encode();
    assert!(!text.contains("BREW"), "a client's method became a label");
    assert!(
        text.contains(r#"route="unrouted",method="other""#),
        "{text}"
    );
}
