//! The demo: a tiny in-process orders API to put idemgate in front of.
//!
//! - `POST /orders` creates an order (201, `Location`, JSON body with a
//!   fresh id, so a second execution is visible as a new id).
//! - `?slow=SECONDS` (at most 60) delays the answer, to try a retry while
//!   the first request is in flight.
//! - `?fail=1` answers 503; `?fail_once=1` answers 503 the first time it
//!   sees an `Idempotency-Key` (idemgate forwards it) and succeeds after, to
//!   see the key released and the retry run again.
//! - `GET /orders` lists what was created, i.e. how often the upstream ran.

use crate::body::{full, ProxyBody};
use crate::config::Config;
use crate::metrics::Metrics;
use crate::net::listen;
use crate::{server, shutdown};
use anyhow::Context;
use http::{header, HeaderValue, Method, Request, Response, StatusCode};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::net::TcpListener;
use tokio_util::task::TaskTracker;

/// The demo API's request body cap.
const MAX_DEMO_BODY: usize = 64 * 1024;
const MAX_DEMO_DELAY_SECS: u64 = 60;
/// Connections the demo API serves at once: plenty for a walkthrough.
const DEMO_MAX_CONNECTIONS: usize = 256;

#[derive(Default)]
struct Orders {
    created: Mutex<Vec<serde_json::Value>>,
    /// Keys that already had their one `fail_once` failure.
    failed_once: Mutex<std::collections::HashSet<Vec<u8>>>,
}

/// Serves the demo orders API on `listener` until the task is dropped.
pub async fn serve_orders_api(listener: TcpListener) {
    let orders = Arc::new(Orders::default());
    let builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
    let open = TaskTracker::new();
    let never = std::future::pending();
    listen::serve(
        "demo",
        listener,
        DEMO_MAX_CONNECTIONS,
        &open,
        never,
        |stream, _| {
            let orders = orders.clone();
            let svc = service_fn(move |req| {
                let orders = orders.clone();
                async move { Ok::<_, Infallible>(handle(&orders, req).await) }
            });
            let conn = builder
                .serve_connection(TokioIo::new(stream), svc)
                .into_owned();
            async move {
                let _ = conn.await;
            }
        },
    )
    .await;
}

async fn handle(orders: &Orders, req: Request<Incoming>) -> Response<ProxyBody> {
    let query = req.uri().query().unwrap_or("").to_string();
    let param = |name: &str| {
        query
            .split('&')
            .filter_map(|kv| kv.split_once('='))
            .find(|(k, _)| *k == name)
            .map(|(_, v)| v.to_string())
    };
    match (req.method().clone(), req.uri().path()) {
        (Method::POST, "/orders") => {
            if let Some(secs) = param("slow").and_then(|s| s.parse::<u64>().ok()) {
                tokio::time::sleep(Duration::from_secs(secs.min(MAX_DEMO_DELAY_SECS))).await;
            }
            let fail_once = param("fail_once").is_some() && {
                let key = req
                    .headers()
                    .get("idempotency-key")
                    .map(|v| v.as_bytes().to_vec())
                    .unwrap_or_default();
                orders
                    .failed_once
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .insert(key)
            };
            if param("fail").is_some() || fail_once {
                return refusal(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "the demo API failed on purpose",
                );
            }
            let body = match req.into_body().collect().await {
                Ok(b) => b.to_bytes(),
                Err(_) => return refusal(StatusCode::BAD_REQUEST, "unreadable body"),
            };
            if body.len() > MAX_DEMO_BODY {
                return refusal(StatusCode::PAYLOAD_TOO_LARGE, "too large");
            }
            let Ok(input) = serde_json::from_slice::<serde_json::Value>(&body) else {
                return refusal(
                    StatusCode::BAD_REQUEST,
                    "the body must be JSON, e.g. {\"item\":\"book\",\"qty\":1}",
                );
            };
            let mut created = orders.created.lock().unwrap_or_else(|p| p.into_inner());
            let id = format!("ord_{}", created.len() + 1);
            let order = serde_json::json!({"id": id, "order": input, "status": "created"});
            created.push(order.clone());
            json(StatusCode::CREATED, order, Some(&format!("/orders/{id}")))
        }
        (Method::GET, "/orders") => {
            let created = orders
                .created
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .clone();
            json(
                StatusCode::OK,
                serde_json::json!({"count": created.len(), "orders": created}),
                None,
            )
        }
        _ => refusal(StatusCode::NOT_FOUND, "not found"),
    }
}

/// `{"error": message}`.
fn refusal(status: StatusCode, message: &str) -> Response<ProxyBody> {
    json(status, serde_json::json!({ "error": message }), None)
}

fn json(
    status: StatusCode,
    body: serde_json::Value,
    location: Option<&str>,
) -> Response<ProxyBody> {
    let mut resp = Response::new(full(format!("{body}\n")));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    if let Some(loc) = location.and_then(|l| HeaderValue::from_str(l).ok()) {
        resp.headers_mut().insert(header::LOCATION, loc);
    }
    resp
}

/// The demo proxy's config, in front of the demo API at `upstream`, its
/// store at `db` (as the file names it: a relative path is read from the
/// config file's directory).
pub fn demo_config(
    listen: std::net::SocketAddr,
    upstream: std::net::SocketAddr,
    db: &std::path::Path,
) -> String {
    format!(
        r#"[server]
listen = "{listen}"
upstream = "http://{upstream}"

[store]
backend = "sqlite"
path = {db:?}
sweep_interval = "10s"

[defaults]
ttl = "1h"
lease = "10s"

[[route]]
methods = ["POST"]
path = "/orders"
require_key = true
scope_header = "Authorization"
"#,
        db = db.display().to_string()
    )
}

/// The walkthrough the demo prints; `config` is where the demo wrote its
/// config, for the `keys` commands.
pub fn walkthrough(proxy: std::net::SocketAddr, config: &std::path::Path) -> String {
    let u = format!("http://{proxy}");
    let c = config.display();
    format!(
        r#"
idemgate demo: proxy on {u}, in front of a demo orders API.

1. Create an order (new key: forwarded, stored, 201, Idempotency-Status: created):
   curl -i -X POST {u}/orders -H 'Authorization: Bearer demo' -H 'Idempotency-Key: order-1' -H 'Content-Type: application/json' -d '{{"item":"book","qty":1}}'
2. Retry it (same key, same body: replayed, Idempotency-Status: replayed, same order id):
   curl -i -X POST {u}/orders -H 'Authorization: Bearer demo' -H 'Idempotency-Key: order-1' -H 'Content-Type: application/json' -d '{{"item":"book","qty":1}}'
3. Change the body under the same key (422, Idempotency-Status: key-reused):
   curl -i -X POST {u}/orders -H 'Authorization: Bearer demo' -H 'Idempotency-Key: order-1' -H 'Content-Type: application/json' -d '{{"item":"pen","qty":9}}'
4. Start a slow request, and retry it while it runs (409 with Retry-After, Idempotency-Status: in-flight):
   curl -s -X POST '{u}/orders?slow=5' -H 'Authorization: Bearer demo' -H 'Idempotency-Key: order-2' -d '{{"item":"lamp"}}' &
   sleep 1; curl -i -X POST '{u}/orders?slow=5' -H 'Authorization: Bearer demo' -H 'Idempotency-Key: order-2' -d '{{"item":"lamp"}}'
5. An upstream failure (503, Idempotency-Status: released) frees the key; the retry runs again and succeeds:
   curl -i -X POST '{u}/orders?fail_once=1' -H 'Authorization: Bearer demo' -H 'Idempotency-Key: order-3' -d '{{"item":"mug"}}'
   curl -i -X POST '{u}/orders?fail_once=1' -H 'Authorization: Bearer demo' -H 'Idempotency-Key: order-3' -d '{{"item":"mug"}}'
6. Forget the key (400, Idempotency-Status: key-missing):
   curl -i -X POST {u}/orders -H 'Authorization: Bearer demo' -d '{{"item":"book"}}'
7. See how many orders the API really created:
   curl -s {u}/orders
8. Inspect and repair keys in the demo's store (idemgate is target/release/idemgate,
   or on your PATH after `cargo install --path .`):
   idemgate keys --config {c} show --scope-header-value 'Bearer demo' order-1
   idemgate keys --config {c} delete --scope-header-value 'Bearer demo' order-1

Ctrl-C stops the demo.
"#
    )
}

/// `idemgate demo`: the demo orders API on an ephemeral port, the proxy in
/// front of it on `listen`, SQLite at `db`.
pub async fn run(listen: std::net::SocketAddr, db: std::path::PathBuf) -> anyhow::Result<()> {
    // The demo API keeps its orders in memory, so the demo's keys start
    // fresh too: an old run's keys would replay orders the API forgot.
    // Only a file named as a demo store is ever reset.
    let is_demo_file = db
        .file_name()
        .and_then(|n| n.to_str())
        .is_some_and(|n| n.contains("demo"));
    if !is_demo_file {
        anyhow::bail!(
            "demo resets its store at start; give --db a file whose name contains \"demo\" (not {})",
            db.display()
        );
    }
    for suffix in ["", "-wal", "-shm"] {
        let mut f = db.clone().into_os_string();
        f.push(suffix);
        match std::fs::remove_file(&f) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => anyhow::bail!("cannot reset the demo store {}: {e}", db.display()),
        }
    }
    let api = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let api_addr = api.local_addr()?;
    tokio::spawn(serve_orders_api(api));
    // Written beside the store so `idemgate keys --config` (and a SIGHUP
    // reload) read the demo's own settings, not config/idemgate.toml; it
    // names the store by its file name, read from the config's directory.
    let config_path = db.with_extension("toml");
    let file_name = std::path::Path::new(db.file_name().unwrap_or_default());
    let text = demo_config(listen, api_addr, file_name);
    let config = Config::parse_file(&text, &config_path, &Default::default())?;
    if let Some(dir) = config_path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    }
    std::fs::write(&config_path, &text)
        .with_context(|| format!("cannot write {}", config_path.display()))?;
    let hangups = server::reload::requests(&config_path, false)?;
    let listeners = server::Listeners::bind(&config).await?;
    let addr = listeners.proxy.local_addr()?;
    let metrics = Arc::new(Metrics::new());
    let server = server::Server::open(config, metrics, listeners).await?;
    outln!("{}", walkthrough(addr, &config_path));
    server.reload_on(hangups).run(shutdown::signal()).await
}

/// `idemgate demo-upstream`: only the demo orders API.
pub async fn run_upstream(listen: std::net::SocketAddr) -> anyhow::Result<()> {
    let api = tokio::net::TcpListener::bind(listen)
        .await
        .with_context(|| format!("cannot listen on {listen}"))?;
    tracing::info!(addr = %listen, "demo orders API listening");
    tokio::select! {
        _ = serve_orders_api(api) => {}
        _ = shutdown::signal() => {}
    }
    Ok(())
}
