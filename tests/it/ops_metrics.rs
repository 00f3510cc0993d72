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
