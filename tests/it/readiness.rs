//! Readiness that does not cascade: with the default `server.readiness =
//! "serving"`, `/readyz` stays 200 while PostgreSQL is cut off (every
//! replica shares it: failing readiness would empty the Service), and the
//! store's health is reported on its own (`/healthz/store`,
//! `idemgate_store_up`). `readiness = "store"` keeps the old behaviour.
//! PostgreSQL is cut through a TCP relay; the shared server keeps running.

use crate::support::services::{postgres_addr, require_postgres, TcpRelay};
use crate::support::{database_url_via, wait_for, Backend, Proxy, Upstream, ORDERS};

const BODY: &str = r#"{"item":"book","qty":1}"#;
const STORE_UP: &str = "idemgate_store_up{backend=\"postgres\"}";

async fn proxy_behind_relay(relay: &TcpRelay, up: &Upstream, readiness: Option<&str>) -> Proxy {
    let mut builder = Proxy::builder(Backend::Postgres, up.addr)
        .store_url(&database_url_via(relay.addr()))
        .admin();
    if let Some(mode) = readiness {
        builder = builder.set("server.readiness", mode);
    }
    builder.start().await
}

/// Waits until `/healthz/store` answers `status`; returns its JSON.
async fn store_health(proxy: &Proxy, status: u16) -> serde_json::Value {
    wait_for(&format!("/healthz/store to answer {status}"), || async {
        let r = proxy.admin_get("/healthz/store").send().await;
        (r.status() == status).then(|| r.json())
    })
    .await
}

fn gauge(proxy: &Proxy, series: &str) -> Option<String> {
    proxy
        .metrics
        .encode()
        .lines()
        .find_map(|l| l.strip_prefix(series).map(|v| v.trim().to_string()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_stays_ready_while_the_store_is_down_and_the_store_is_reported_apart() {
    require_postgres(&crate::support::services::database_url()).await;
    let relay = TcpRelay::start(postgres_addr()).await;
    let up = Upstream::start().await;
    let proxy = proxy_behind_relay(&relay, &up, None).await;
    let first = proxy.post(ORDERS).key("k-1").body(BODY).send().await;
    assert_eq!(first.status(), 201, "{}", first.text());
    let healthy = store_health(&proxy, 200).await;
    assert_eq!(healthy["backend"], "postgres", "{healthy}");
    assert_eq!(healthy["up"], true, "{healthy}");
    assert!(healthy["last_error"].is_null(), "{healthy}");
    assert_eq!(gauge(&proxy, STORE_UP).as_deref(), Some("1"));

    relay.cut();
    let down = store_health(&proxy, 503).await;
    assert_eq!(down["up"], false, "{down}");
    let cause = down["last_error"]["cause"].as_str().unwrap_or_default();
    assert!(!cause.is_empty(), "the cause is named: {down}");
    assert!(down["last_error"]["at"].as_i64().unwrap_or(0) > 0, "{down}");
    assert_eq!(gauge(&proxy, STORE_UP).as_deref(), Some("0"));
    let ready = proxy.admin_get("/readyz").send().await;
    assert_eq!(
        ready.status(),
        200,
        "serving readiness ignores the store: {}",
        ready.text()
    );
    // What it is ready for: traffic that needs no store.
    let pass = proxy.get("/catalog").send().await;
    assert_eq!(pass.status(), 200, "{}", pass.text());

    relay.restore();
    let back = store_health(&proxy, 200).await;
    assert_eq!(back["up"], true, "{back}");
    assert!(
        back["last_error"]["cause"].is_string(),
        "the last failure stays visible after recovery: {back}"
    );
    assert_eq!(gauge(&proxy, STORE_UP).as_deref(), Some("1"));
    assert!(proxy
        .post(ORDERS)
        .key("k-1")
        .body(BODY)
        .send()
        .await
        .replayed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_store_fails_readyz_while_the_store_is_down() {
    require_postgres(&crate::support::services::database_url()).await;
    let relay = TcpRelay::start(postgres_addr()).await;
    let up = Upstream::start().await;
    let proxy = proxy_behind_relay(&relay, &up, Some("store")).await;
    let ready = |want: u16| {
        let proxy = &proxy;
        async move {
            wait_for(&format!("/readyz to answer {want}"), || async {
                let r = proxy.admin_get("/readyz").send().await;
                (r.status() == want).then_some(r)
            })
            .await
        }
    };
    ready(200).await;
    relay.cut();
    let down = ready(503).await;
    assert!(down.text().starts_with("not ready: "), "{}", down.text());
    assert_eq!(gauge(&proxy, STORE_UP).as_deref(), Some("0"));
    relay.restore();
    ready(200).await;
}

/// `server.readiness` is strict: only the two documented values.
#[test]
fn readiness_accepts_only_serving_or_store() {
    let base = "[server]\nupstream = \"http://127.0.0.1:3000\"\n";
    for ok in ["serving", "store"] {
        let text = format!("{base}readiness = \"{ok}\"\n");
        assert!(idemgate::config::Config::parse(&text, "t.toml").is_ok());
    }
    let text = format!("{base}readiness = \"always\"\n");
    let err = idemgate::config::Config::parse(&text, "t.toml")
        .unwrap_err()
        .to_string();
    assert!(err.contains("line 3") && err.contains("always"), "{err}");
}

/// `readiness = "upstream"`: a sidecar is not ready until its app listens.
/// Nothing on the upstream port: 503 naming it; the app starts (any HTTP
/// answer to `readiness_path`, even a 404): 200.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_upstream_waits_for_the_app_to_listen() {
    let port = crate::support::free_port();
    let proxy = Proxy::builder(Backend::Memory, port)
        .admin()
        .set("server.readiness", "upstream")
        .set("server.readiness_path", "/health?status=404")
        .start()
        .await;
    let r = proxy.admin_get("/readyz").send().await;
    assert_eq!(r.status(), 503, "{}", r.text());
    assert!(
        r.text().contains("the upstream does not answer yet"),
        "{}",
        r.text()
    );
    let listener = tokio::net::TcpListener::bind(port)
        .await
        .expect("bind the app's port");
    let app = Upstream::start_on(listener).await;
    let ready = proxy.admin_get("/readyz").send().await;
    assert_eq!(ready.status(), 200, "{}", ready.text());
    assert_eq!(app.hits("/health"), 1, "the probe asked readiness_path");
}
