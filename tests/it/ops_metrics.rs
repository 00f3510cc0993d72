//! Operations metrics under real traffic: upstream requests in flight per
//! upstream (held while the answer is still being read), open client
//! connections, and the Redis fast path's health gauge through the real
//! binary while a private redis-server is killed and restarted.

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

const REDIS_UP: &str = "idemgate_redis_up{kind=\"redis\"}";

/// `idemgate_redis_up` beside `idemgate_store_up`: 1 while the fast path
/// answers, 0 once its redis-server is killed (the store stays up, and so
/// does `/healthz/store`'s status), 1 again after a restart; the JSON
/// names the cause under `"redis"`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_up_follows_a_killed_redis_through_the_binary() {
    use crate::support::config::{Route, TestConfig};
    use crate::support::process::ServeProcess;
    use crate::support::services::{database_url, require_postgres, PrivateRedis, TestSchema};

    require_postgres(&database_url()).await;
    let mut redis = PrivateRedis::start();
    let schema = TestSchema::new();
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("idemgate.toml");
    let (listen, admin) = (crate::support::free_port(), crate::support::free_port());
    TestConfig::new(up.addr)
        .listen(listen, admin)
        .set("store.backend", "postgres")
        .set("store.url", database_url())
        .set("store.schema", schema.schema.as_str())
        .set("redis.url", redis.url())
        .set("redis.prefix", schema.prefix.as_str())
        .set("redis.timeout", "250ms")
        .route(Route::post(ORDERS))
        .write(&path);
    let gate = ServeProcess::start(&path, listen, admin, &[]).await;
    let health = |want_redis_up: bool| {
        let gate = &gate;
        async move {
            wait_for(
                &format!("/healthz/store to say redis up = {want_redis_up}"),
                || async {
                    let r = gate.admin_get("/healthz/store").send().await;
                    let json = r.json();
                    (json["redis"]["up"] == want_redis_up).then_some((r.status(), json))
                },
            )
            .await
        }
    };
    let redis_up = || async {
        let text = gate.admin_get("/metrics").send().await.text();
        text.lines()
            .find_map(|l| l.strip_prefix(REDIS_UP).map(|v| v.trim().to_string()))
    };

    let (status, json) = health(true).await;
    assert_eq!(status, 200, "{json}");
    assert_eq!(json["redis"]["kind"], "redis", "{json}");
    assert!(json["redis"]["last_error"].is_null(), "{json}");
    assert_eq!(redis_up().await.as_deref(), Some("1"));
    let first = gate.post(ORDERS).key("k-1").body("{}").send().await;
    assert_eq!(first.status(), 201, "{}", first.text());

    redis.kill();
    let (status, json) = health(false).await;
    assert_eq!(status, 200, "the store still answers: {json}");
    assert_eq!(json["up"], true, "{json}");
    let cause = json["redis"]["last_error"]["cause"]
        .as_str()
        .unwrap_or_default();
    assert!(!cause.is_empty(), "the cause is named: {json}");
    assert_eq!(redis_up().await.as_deref(), Some("0"));
    let text = gate.admin_get("/metrics").send().await.text();
    assert!(
        text.contains("idemgate_store_up{backend=\"postgres\"} 1"),
        "{text}"
    );
    // Served on PostgreSQL alone meanwhile.
    assert!(gate
        .post(ORDERS)
        .key("k-1")
        .body("{}")
        .send()
        .await
        .replayed());

    redis.restart();
    let (_, json) = health(true).await;
    assert!(
        json["redis"]["last_error"]["cause"].is_string(),
        "the last failure stays visible after recovery: {json}"
    );
    assert_eq!(redis_up().await.as_deref(), Some("1"));
    let log = gate.log();
    assert!(!log.contains("k-1"), "no raw key in the log: {log}");
}
