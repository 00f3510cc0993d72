//! Route settings that decide what is stored and who shares a key:
//! `release_statuses` (which answers mean "not executed") and
//! `scope_headers` (the credential plus a tenant header), with the
//! regressions they pin, on every backend; and the `keys` commands naming
//! a scope of several headers.

use crate::support::{
    backend_tests, run_to_completion, Backend, Proxy, Route, TestConfig, Upstream, ORDERS,
};
use http::{Request, Response};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use idemgate::body::full;
use idemgate::metrics::Outcome;
use std::collections::VecDeque;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

backend_tests!(
    rate_limited_answer_releases_the_key_so_the_retry_executes,
    a_route_that_releases_only_5xx_stores_and_replays_a_429,
    a_tenant_header_in_scope_headers_keeps_tenants_of_one_api_key_apart,
    with_only_the_credential_as_scope_tenants_of_one_api_key_share_keys,
    an_unanswered_request_on_a_keep_route_is_never_sent_twice,
    a_query_without_a_key_passes_and_with_one_is_protected,
    a_refused_connection_releases_the_key_even_on_a_keep_route,
    strip_prefix_leaves_the_path_before_the_upstreams_base_path,
);

const BODY: &str = r#"{"item":"book","qty":1}"#;

/// Pins: an upstream `429 Retry-After: 1` was stored and replayed for the
/// whole ttl, so the request could never run under its key (issue 8,
/// defect 4). By default 408, 425, 429 and every 5xx release the key.
async fn rate_limited_answer_releases_the_key_so_the_retry_executes(backend: Backend) {
    let up = Scripted::start(vec![Answer {
        status: 429,
        headers: vec![("retry-after", "1")],
    }])
    .await;
    let proxy = Proxy::start(backend, up.addr).await;
    let limited = proxy.post(ORDERS).key("k-429").body(BODY).send().await;
    assert_eq!(limited.status(), 429);
    assert_eq!(limited.header("retry-after"), Some("1"), "passed on as is");
    assert_eq!(limited.text(), r#"{"hit":1}"#, "the upstream's own body");
    assert!(!limited.replayed());

    let retry = proxy.post(ORDERS).key("k-429").body(BODY).send().await;
    assert_eq!(retry.status(), 201, "the retry runs: {}", retry.text());
    assert!(!retry.replayed());
    assert_eq!(up.hits(), 2);
    let third = proxy.post(ORDERS).key("k-429").body(BODY).send().await;
    assert!(third.replayed());
    assert_eq!(third.body, retry.body);
    assert_eq!(up.hits(), 2, "the executed retry is stored");
    assert_eq!(proxy.count(Outcome::UpstreamError), 1);
}

/// `release_statuses = ["5xx"]` keeps the behaviour before the default
/// grew: a 429 is the request's outcome, stored and replayed.
async fn a_route_that_releases_only_5xx_stores_and_replays_a_429(backend: Backend) {
    let up = Scripted::start(vec![Answer {
        status: 429,
        headers: vec![("retry-after", "1")],
    }])
    .await;
    let proxy = Proxy::builder(backend, up.addr)
        .each_route("release_statuses", vec!["5xx"])
        .start()
        .await;
    let limited = proxy.post(ORDERS).key("k-429").body(BODY).send().await;
    assert_eq!(limited.status(), 429);
    let again = proxy.post(ORDERS).key("k-429").body(BODY).send().await;
    assert_eq!(again.status(), 429);
    assert!(again.replayed());
    assert_eq!(again.header("retry-after"), Some("1"));
    assert_eq!(again.body, limited.body);
    assert_eq!(up.hits(), 1);
}

const PLATFORM_KEY: &str = "Bearer sk_platform";

/// `POST /orders` scoped by `Authorization` and `Stripe-Account`.
fn tenant_scoped_orders() -> Route {
    Route::post(ORDERS).set("scope_headers", vec!["Authorization", "Stripe-Account"])
}

/// Pins: two connected accounts under one platform API key (the same
/// `Authorization`, a different `Stripe-Account`) sending the same key and
/// body: account B was served account A's response as a replay (issue 8,
/// defect 6). Each is its own execution with its own response.
async fn a_tenant_header_in_scope_headers_keeps_tenants_of_one_api_key_apart(backend: Backend) {
    let up = Upstream::start().await;
    let proxy = Proxy::builder(backend, up.addr)
        .routes(vec![tenant_scoped_orders()])
        .start()
        .await;
    let order = |account: Option<&str>| {
        let req = proxy
            .post(ORDERS)
            .header("authorization", PLATFORM_KEY)
            .key("k-tenant")
            .body(BODY);
        match account {
            Some(a) => req.header("stripe-account", a),
            None => req,
        }
    };
    let a = order(Some("acct_A")).send().await;
    let b = order(Some("acct_B")).send().await;
    let platform = order(None).send().await;
    for (resp, hit) in [(&a, 1), (&b, 2), (&platform, 3)] {
        assert_eq!(resp.status(), 201, "{}", resp.text());
        assert!(!resp.replayed(), "hit {hit} was replayed");
        assert_eq!(resp.json()["hits"], hit);
    }
    // Each retry replays its own tenant's response.
    for (account, first) in [("acct_A", &a), ("acct_B", &b)] {
        let again = order(Some(account)).send().await;
        assert!(again.replayed());
        assert_eq!(again.body, first.body, "{account}");
    }
    assert_eq!(up.hits(ORDERS), 3);
}

/// Why `scope_headers` exists: scoped by the credential alone, the second
/// tenant of one API key is served the first tenant's response.
async fn with_only_the_credential_as_scope_tenants_of_one_api_key_share_keys(backend: Backend) {
    let up = Upstream::start().await;
    let proxy = Proxy::start(backend, up.addr).await;
    let order = |account: &str| {
        proxy
            .post(ORDERS)
            .header("authorization", PLATFORM_KEY)
            .header("stripe-account", account)
            .key("k-tenant")
            .body(BODY)
    };
    let a = order("acct_A").send().await;
    assert_eq!(a.status(), 201);
    let b = order("acct_B").send().await;
    assert!(b.replayed(), "one scope: acct_B gets acct_A's response");
    assert_eq!(b.body, a.body);
    assert_eq!(up.hits(ORDERS), 1);
}

/// `keys show` and `keys delete` name a scope of several headers with
/// repeated `--scope-header NAME=VALUE`, as the proxy derives it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_commands_name_a_scope_of_several_headers() {
    let up = Upstream::start().await;
    let dir = tempfile::TempDir::new().unwrap();
    let db = dir.path().join("idemgate.db");
    let proxy = Proxy::builder(Backend::Sqlite, up.addr)
        .sqlite_file(&db)
        .routes(vec![tenant_scoped_orders()])
        .start()
        .await;
    let config = dir.path().join("idemgate.toml");
    TestConfig::new(up.addr)
        .set("store.backend", "sqlite")
        .set("store.path", db.display().to_string())
        .route(tenant_scoped_orders())
        .write(&config);
    let order = || {
        proxy
            .post(ORDERS)
            .header("authorization", PLATFORM_KEY)
            .header("stripe-account", "acct_B")
            .key("k-ops")
            .body(BODY)
    };
    assert_eq!(order().send().await.status(), 201);
    let keys = |command: &'static str, account: &'static str| {
        let config = config.to_str().unwrap().to_string();
        async move {
            let auth = format!("Authorization={PLATFORM_KEY}");
            let account = format!("Stripe-Account={account}");
            let args = [
                "keys",
                "--config",
                &config,
                command,
                "--scope-header",
                &account,
                "--scope-header",
                &auth,
                "k-ops",
            ];
            let run = run_to_completion(&args, &[]).await;
            // `show` exits 3 for a key with no record.
            let absent = command == "show" && run.stdout.starts_with("no record");
            let expected = if absent { 3 } else { 0 };
            assert_eq!(run.code, expected, "{}{}", run.stdout, run.stderr);
            run.stdout
        }
    };
    let shown = keys("show", "acct_B").await;
    assert!(shown.contains("state        completed"), "{shown}");
    assert!(!shown.contains("sk_platform"), "{shown}");
    let other = keys("show", "acct_A").await;
    assert!(other.starts_with("no record"), "{other}");
    let deleted = keys("delete", "acct_B").await;
    assert!(deleted.starts_with("deleted key id "), "{deleted}");
    let rerun = order().send().await;
    assert!(!rerun.replayed(), "the deleted key executes as new");
    assert_eq!(up.hits(ORDERS), 2);
}

// ===== an upstream with scripted answers =====

/// One answer of a [`Scripted`] upstream.
struct Answer {
    status: u16,
    headers: Vec<(&'static str, &'static str)>,
}

/// An upstream that answers with its queued [`Answer`]s, then `201`, each
/// with the body `{"hit":N}`; it counts the requests it received. The
/// shared test upstream cannot send arbitrary response headers
/// (`Retry-After`).
struct Scripted {
    addr: SocketAddr,
    hits: Arc<AtomicUsize>,
    task: JoinHandle<()>,
}

impl Scripted {
    async fn start(answers: Vec<Answer>) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let queue = Arc::new(Mutex::new(VecDeque::from(answers)));
        let hits = Arc::new(AtomicUsize::new(0));
        let counted = hits.clone();
        let task = tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let (queue, hits) = (queue.clone(), counted.clone());
                let svc = service_fn(move |req: Request<Incoming>| {
                    let (queue, hits) = (queue.clone(), hits.clone());
                    async move {
                        // Read the request whole before answering, as an API would.
                        let _ = req.into_body().collect().await;
                        let n = hits.fetch_add(1, Ordering::SeqCst) + 1;
                        let answer = queue.lock().unwrap().pop_front();
                        let answer = answer.unwrap_or(Answer {
                            status: 201,
                            headers: Vec::new(),
                        });
                        let mut resp = Response::builder().status(answer.status);
                        for (name, value) in answer.headers {
                            resp = resp.header(name, value);
                        }
                        Ok::<_, Infallible>(resp.body(full(format!(r#"{{"hit":{n}}}"#))).unwrap())
                    }
                });
                tokio::spawn(async move {
                    let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                        .serve_connection(TokioIo::new(stream), svc)
                        .await;
                });
            }
        });
        Self { addr, hits, task }
    }

    fn hits(&self) -> usize {
        self.hits.load(Ordering::SeqCst)
    }
}

impl Drop for Scripted {
    fn drop(&mut self) {
        self.task.abort();
    }
}

// ===== ambiguous outcomes =====

/// `on_ambiguous = "keep"`: a request sent upstream and never answered may
/// have executed, so its key is kept as outcome unknown: the client gets a
/// 504 saying so, and every retry gets 424 without reaching the upstream.
async fn an_unanswered_request_on_a_keep_route_is_never_sent_twice(backend: Backend) {
    let up = Upstream::start().await;
    let proxy = Proxy::builder(backend, up.addr)
        .set("server.upstream_timeout", "300ms")
        .routes(vec![Route::post(ORDERS).set("on_ambiguous", "keep")])
        .start()
        .await;
    let slow = "/orders?delay_ms=2000";
    let first = proxy.post(slow).key("k-unknown").body(BODY).send().await;
    let problem = first.assert_problem(504);
    let detail = problem["detail"].as_str().unwrap_or_default();
    assert!(detail.contains("outcome"), "{detail}");
    for _ in 0..2 {
        let retry = proxy.post(slow).key("k-unknown").body(BODY).send().await;
        let problem = retry.assert_problem(424);
        assert!(
            problem["type"]
                .as_str()
                .is_some_and(|t| t.ends_with("#problem-outcome-unknown")),
            "{problem}"
        );
    }
    assert_eq!(up.hits(ORDERS), 1, "never sent again");
    assert_eq!(proxy.count(Outcome::OutcomeUnknown), 2);
    // A different request under the key is still a 422.
    let other = proxy.post(slow).key("k-unknown").body("{}").send().await;
    other.assert_problem(422);
}

/// A refused connection sent nothing, so even a keep route releases the key.
async fn a_refused_connection_releases_the_key_even_on_a_keep_route(backend: Backend) {
    let proxy = Proxy::builder(backend, Upstream::refusing_addr())
        .routes(vec![Route::post(ORDERS).set("on_ambiguous", "keep")])
        .start()
        .await;
    for _ in 0..2 {
        let refused = proxy.post(ORDERS).key("k-refused").body(BODY).send().await;
        let problem = refused.assert_problem(502);
        let detail = problem["detail"].as_str().unwrap_or_default();
        assert!(detail.contains("released"), "{detail}");
    }
}

/// QUERY (RFC 10008) on a route that lists it beside POST: never refused
/// for lacking a key (it is safe), protected when it carries one; a POST
/// without a key is still refused.
async fn a_query_without_a_key_passes_and_with_one_is_protected(backend: Backend) {
    let up = Upstream::start().await;
    let proxy = Proxy::builder(backend, up.addr)
        .routes(vec![
            Route::post(ORDERS).set("methods", vec!["POST", "QUERY"])
        ])
        .start()
        .await;
    let query = || {
        proxy
            .request(http::Method::from_bytes(b"QUERY").unwrap(), ORDERS)
            .header("content-type", "application/json")
            .body(r#"{"status":"open"}"#)
    };
    let bare = query().send().await;
    assert_eq!(bare.status(), 200, "{}", bare.text());
    assert!(!bare.replayed());
    let first = query().key("q-1").send().await;
    let again = query().key("q-1").send().await;
    assert_eq!(first.status(), 200, "{}", first.text());
    assert!(again.replayed(), "{again:?}");
    assert_eq!(
        up.hits(ORDERS),
        2,
        "the keyless QUERY and the first keyed one"
    );
    proxy
        .post(ORDERS)
        .body("{}")
        .send()
        .await
        .assert_problem(400);
    assert_eq!(up.hits(ORDERS), 2);
}

/// `strip_prefix = "/api"` on `/api/*` (Traefik's StripPrefix): the
/// upstream, at base path `/base`, sees `/base/orders`, after the
/// dot-segments were resolved; protection and replay are the route's;
/// other routes' paths are left as they are.
async fn strip_prefix_leaves_the_path_before_the_upstreams_base_path(backend: Backend) {
    let up = Upstream::start().await;
    let proxy = Proxy::builder(backend, up.addr)
        .set("server.upstream", format!("http://{}/base", up.addr))
        .routes(vec![
            Route::post("/api/*").set("strip_prefix", "/api"),
            Route::post(ORDERS),
        ])
        .start()
        .await;
    let first = proxy
        .post("/api/orders?x=1")
        .key("k-sp")
        .body(BODY)
        .send()
        .await;
    assert_eq!(
        first.header("idempotency-status"),
        Some("created"),
        "{first:?}"
    );
    let seen = up.last();
    assert_eq!(seen.path, "/base/orders");
    assert_eq!(seen.query.as_deref(), Some("x=1"));
    let again = proxy
        .post("/api/../api/orders?x=1")
        .key("k-sp")
        .body(BODY)
        .send()
        .await;
    assert!(again.replayed(), "{again:?}");
    assert_eq!(up.hits("/base/orders"), 1);
    // Unprotected requests on the route lose the prefix too.
    proxy.get("/api/catalog").send().await;
    assert_eq!(
        up.last().path,
        "/base/api/catalog",
        "a GET matches no route"
    );
    proxy.post(ORDERS).key("k-o").body(BODY).send().await;
    assert_eq!(up.last().path, "/base/orders");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_strip_prefix_that_does_not_fit_its_route_is_a_config_error() {
    let up = Upstream::start().await;
    for (route, defaults, says) in [
        (
            "[[route]]\nmethods = [\"POST\"]\npath = \"/api/orders\"\nstrip_prefix = \"/v2\"\n",
            "",
            "strip_prefix \"/v2\": is not a literal prefix of the route's path \"/api/orders\"",
        ),
        (
            "[[route]]\nmethods = [\"POST\"]\npath = \"/api/{id}\"\nstrip_prefix = \"/api/x\"\n",
            "",
            "is not a literal prefix",
        ),
        (
            "",
            "[defaults]\nstrip_prefix = \"/api\"\n",
            "belongs in a [[route]]",
        ),
    ] {
        let text = format!("{}{defaults}{route}", TestConfig::new(up.addr).render());
        let (run, _) = crate::support::run_on_config_text(&["check-config"], &text, &[]).await;
        assert_eq!(run.code, 64, "{run:?}");
        assert!(run.stderr.contains(says), "{says}\nnot in\n{}", run.stderr);
    }
}
