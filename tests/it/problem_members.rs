//! What idemgate's own error answers say beyond RFC 9457's standard
//! members: `Cache-Control: no-store`, the `key_id` the logs name the key
//! by, and `safe_new_key` (whether the operation may be sent again under a
//! new key), and on a 422 when and for what the key was first used; and
//! that upstream answers, replayed or passed on, get none of it.

use crate::support::services::{
    database_url, drop_schema, postgres_addr, require_postgres, unique_schema, TcpRelay,
};
use crate::support::{
    backend_tests, bounded, database_url_via, free_port, run_to_completion, wait_for, Action,
    Backend, Proxy, Resp, Route, ServeProcess, TestConfig, Upstream, ORDERS,
};
use serde_json::Value;
use std::path::Path;
use std::time::{Duration, SystemTime};

backend_tests!(
    refused_keys_say_a_new_key_is_safe_and_name_no_key,
    conflicts_name_their_key_and_say_a_new_key_is_not_safe,
    an_unknown_outcome_names_its_key_and_says_how_to_learn_it,
    a_released_key_says_a_new_key_is_safe,
    upstream_answers_get_no_cache_control_added,
);

const BODY: &str = r#"{"item":"kettle","qty":1}"#;

/// Asserts a problem with `status`, `no-store` and `safe_new_key`.
fn problem(r: &Resp, status: u16, safe_new_key: bool) -> Value {
    let p = r.assert_problem(status);
    assert_eq!(r.header("cache-control"), Some("no-store"), "{r:?}");
    assert_eq!(p["safe_new_key"], safe_new_key, "{p}");
    p
}

/// The `key_id` member: the logs' 16 hex digits, never the raw key.
fn key_id(p: &Value, raw: &str) -> String {
    let id = p["key_id"]
        .as_str()
        .unwrap_or_else(|| panic!("no key_id: {p}"));
    assert!(
        id.len() == 16 && id.chars().all(|c| c.is_ascii_hexdigit()),
        "{p}"
    );
    assert!(!p.to_string().contains(raw), "the raw key in {p}");
    id.to_string()
}

async fn refused_keys_say_a_new_key_is_safe_and_name_no_key(backend: Backend) {
    let up = Upstream::start().await;
    let proxy = Proxy::start(backend, up.addr).await;
    let missing = proxy.post(ORDERS).body(BODY).send().await;
    let p = problem(&missing, 400, true);
    assert!(p.get("key_id").is_none(), "{p}");
    let invalid = proxy
        .post(ORDERS)
        .key("\"unterminated")
        .body(BODY)
        .send()
        .await;
    let p = problem(&invalid, 400, true);
    assert!(p.get("key_id").is_none(), "no key was parsed: {p}");
    assert_eq!(up.total_hits(), 0);
}

/// 409 and 422 name the same key id: both are about that key's first use.
async fn conflicts_name_their_key_and_say_a_new_key_is_not_safe(backend: Backend) {
    let up = Upstream::start().await;
    let proxy = Proxy::start(backend, up.addr).await;
    up.push(Action::Delay(Duration::from_millis(800)));
    let slow = tokio::spawn(proxy.post(ORDERS).key("k-busy-71").body(BODY).send());
    up.wait_hits(ORDERS, 1).await;
    let dup = proxy.post(ORDERS).key("k-busy-71").body(BODY).send().await;
    let in_flight = key_id(&problem(&dup, 409, false), "k-busy-71");
    assert_eq!(slow.await.unwrap().status(), 201);
    let other = proxy.post(ORDERS).key("k-busy-71").body("{}").send().await;
    let reused = key_id(&problem(&other, 422, false), "k-busy-71");
    assert_eq!(reused, in_flight, "one key, one id");
    assert_eq!(up.hits(ORDERS), 1);
}

async fn an_unknown_outcome_names_its_key_and_says_how_to_learn_it(backend: Backend) {
    let up = Upstream::start().await;
    let proxy = Proxy::builder(backend, up.addr)
        .set("server.upstream_timeout", "300ms")
        .routes(vec![Route::post(ORDERS).set("on_ambiguous", "keep")])
        .start()
        .await;
    let slow = "/orders?delay_ms=2000";
    let first = proxy.post(slow).key("k-unknown-42").body(BODY).send().await;
    let id = key_id(&problem(&first, 504, false), "k-unknown-42");
    let retry = proxy.post(slow).key("k-unknown-42").body(BODY).send().await;
    let p = problem(&retry, 424, false);
    assert_eq!(key_id(&p, "k-unknown-42"), id);
    let detail = p["detail"].as_str().unwrap();
    for hint in ["whether the operation happened", "idemgate keys resolve"] {
        assert!(detail.contains(hint), "{hint:?} not in {detail}");
    }
    assert_eq!(up.hits(ORDERS), 1);
}

async fn a_released_key_says_a_new_key_is_safe(backend: Backend) {
    let proxy = Proxy::start(backend, Upstream::refusing_addr()).await;
    let r = proxy
        .post(ORDERS)
        .key("k-refused-9")
        .body(BODY)
        .send()
        .await;
    let p = problem(&r, 502, true);
    key_id(&p, "k-refused-9");
}

/// An upstream's own answers are its own: a stored one replayed, an error
/// passed on (on a protected route and off one) carry no `Cache-Control`
/// but what the upstream sent, which here is none.
async fn upstream_answers_get_no_cache_control_added(backend: Backend) {
    let up = Upstream::start().await;
    let proxy = Proxy::start(backend, up.addr).await;
    let first = proxy.post(ORDERS).key("k-cc").body(BODY).send().await;
    assert_eq!(first.status(), 201);
    let replay = proxy.post(ORDERS).key("k-cc").body(BODY).send().await;
    assert!(replay.replayed());
    up.push(Action::Status(503));
    let released = proxy.post(ORDERS).key("k-cc-5xx").body(BODY).send().await;
    assert_eq!(released.status(), 503);
    assert_eq!(released.header("content-type"), Some("application/json"));
    let unrouted = proxy.get("/catalog?status=500").send().await;
    assert_eq!(unrouted.status(), 500);
    for r in [&first, &replay, &released, &unrouted] {
        assert_eq!(r.header("cache-control"), None, "{r:?}");
    }
}

/// The store cut: 503, nothing forwarded, so a new key is safe; the key
/// was parsed, so it is named.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_store_cut_the_503_says_a_new_key_is_safe() {
    require_postgres(&database_url()).await;
    let relay = TcpRelay::start(postgres_addr()).await;
    let up = Upstream::start().await;
    let proxy = Proxy::builder(Backend::Postgres, up.addr)
        .store_url(&database_url_via(relay.addr()))
        .start()
        .await;
    relay.cut();
    let r = bounded(
        "a protected request with the store cut",
        proxy.post(ORDERS).key("k-cut-store").body(BODY).send(),
    )
    .await;
    let p = problem(&r, 503, true);
    assert!(
        p["type"]
            .as_str()
            .is_some_and(|t| t.ends_with("#problem-store-unavailable")),
        "{p}"
    );
    key_id(&p, "k-cut-store");
    assert_eq!(up.total_hits(), 0);
}

/// The real binary: the problem's `key_id` is the access log's `key.id`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_key_id_is_the_one_the_access_log_names() {
    let up = Upstream::start().await;
    let dir = tempfile::TempDir::new().expect("tempdir");
    let (listen, admin) = (free_port(), free_port());
    let config = dir.path().join("idemgate.toml");
    TestConfig::new(up.addr)
        .listen(listen, admin)
        .set("store.backend", "sqlite")
        .set("store.path", dir.path().join("p.db").display().to_string())
        .set("log.format", "json")
        .route(Route::post(ORDERS))
        .write(&config);
    let gate = ServeProcess::start_with(&config, listen, admin, &[], |cmd| {
        cmd.env_remove("RUST_LOG");
    })
    .await;
    let key = "k-logged-5f0e";
    assert_eq!(
        gate.post(ORDERS).key(key).body(BODY).send().await.status(),
        201
    );
    let reused = gate.post(ORDERS).key(key).body("{}").send().await;
    let id = key_id(&problem(&reused, 422, false), key);
    let logged = wait_for("the 422's access log line", || async {
        gate.log()
            .lines()
            .filter(|l| l.contains("idemgate::access"))
            .map(|l| serde_json::from_str::<Value>(l).expect("a JSON line"))
            .find(|l| l["status"] == 422)
    })
    .await;
    assert_eq!(logged["key.id"], id.as_str(), "{logged}");
}

// ===== a reused key's first use =====

/// The route both clients send to, besides [`ORDERS`].
const PAYMENTS: &str = "/payments";

/// A 422's first-use members: method, path and a time within `window`;
/// the detail says the same. Returns `first_used_at`.
fn first_use(p: &Value, method: &str, path: &str, window: (SystemTime, SystemTime)) -> String {
    assert_eq!(p["first_method"], method, "{p}");
    assert_eq!(p["first_path"], path, "{p}");
    let at = p["first_used_at"].as_str().unwrap_or_else(|| panic!("{p}"));
    let parsed = humantime::parse_rfc3339(at).unwrap_or_else(|e| panic!("{at}: {e}"));
    // Whole seconds: the window's start rounds down to one.
    let (from, to) = window;
    assert!(
        parsed + Duration::from_secs(1) > from && parsed <= to,
        "{at} outside the test"
    );
    assert!(
        at.ends_with('Z') && !at.contains('.'),
        "RFC 3339 UTC, seconds: {at}"
    );
    let detail = p["detail"].as_str().unwrap();
    let want =
        format!("this key was first used for {method} {path} at {at} with a different request");
    assert_eq!(detail, want, "{p}");
    at.to_string()
}

/// Through the real binary: a 422 says when and for what the key was first
/// used (the method, the path without its query), as members and in its
/// detail, and `keys show` prints it. The same key sent by another client
/// (another value of the route's scope header) is a new key there: it runs,
/// and its own 422 later names its own first use, never the other's.
async fn a_reused_key_names_its_first_use_in_its_scope_only(
    store: impl FnOnce(TestConfig, &Path) -> TestConfig,
) {
    let up = Upstream::start().await;
    let dir = tempfile::TempDir::new().expect("tempdir");
    let (listen, admin) = (free_port(), free_port());
    let config = dir.path().join("idemgate.toml");
    let base = TestConfig::new(up.addr)
        .listen(listen, admin)
        .route(Route::post(ORDERS))
        .route(Route::post(PAYMENTS));
    store(base, dir.path()).write(&config);
    let gate = ServeProcess::start(&config, listen, admin, &[]).await;
    let (alice, mallory) = ("Bearer alice-7c1", "Bearer mallory-2d9");
    let send = |who: &str, path: &str, body: &'static str| {
        gate.post(path)
            .header("authorization", who)
            .key("k-first-use-3a")
            .body(body)
    };

    let before = SystemTime::now();
    let first = send(alice, "/orders?coupon=c-secret-41", BODY).send().await;
    assert_eq!(first.status(), 201, "{}", first.text());
    let window = (before, SystemTime::now());
    let reused = send(alice, ORDERS, "{}").send().await;
    let p = problem(&reused, 422, false);
    let at = first_use(&p, "POST", ORDERS, window);
    key_id(&p, "k-first-use-3a");
    for leak in ["c-secret-41", "coupon", "kettle", "alice"] {
        assert!(!p.to_string().contains(leak), "{leak} in {p}");
    }

    // Another client, the same key: a new key in its scope, run as such.
    let theirs = send(mallory, PAYMENTS, "{}").send().await;
    assert_eq!(theirs.status(), 200, "{}", theirs.text());
    assert!(!theirs.replayed(), "another scope's response was replayed");
    for name in ["first_used_at", "first_method", "first_path"] {
        assert!(!theirs.text().contains(name), "{}", theirs.text());
    }
    assert_eq!(up.hits(PAYMENTS), 1);
    let window = (window.1, SystemTime::now());
    // Its own reuse names its own first use; the first client's is unchanged.
    let p = problem(&send(mallory, ORDERS, BODY).send().await, 422, false);
    first_use(&p, "POST", PAYMENTS, window);
    let p = problem(&send(alice, PAYMENTS, "{}").send().await, 422, false);
    assert_eq!(first_use(&p, "POST", ORDERS, (before, window.1)), at);
    assert_eq!(up.hits(ORDERS), 1, "no reuse reached the upstream");

    let cfg = config.to_str().expect("utf-8 path");
    let args = [
        "keys",
        "--config",
        cfg,
        "show",
        "--scope-header-value",
        alice,
    ];
    let shown = run_to_completion(&[&args[..], &["k-first-use-3a"]].concat(), &[]).await;
    assert_eq!(shown.code, 0, "{}", shown.stderr);
    assert!(
        shown.stdout.contains("\nfirst use    POST /orders\n"),
        "{}",
        shown.stdout
    );
    assert!(!shown.stdout.contains("c-secret-41"), "{}", shown.stdout);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reused_key_names_its_first_use_on_sqlite() {
    a_reused_key_names_its_first_use_in_its_scope_only(|c, dir| {
        c.set("store.backend", "sqlite")
            .set("store.path", dir.join("first.db").display().to_string())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reused_key_names_its_first_use_on_postgres() {
    let url = database_url();
    require_postgres(&url).await;
    let schema = unique_schema("first_use");
    a_reused_key_names_its_first_use_in_its_scope_only(|c, _| {
        c.set("store.backend", "postgres")
            .set("store.url", url.as_str())
            .set("store.schema", schema.as_str())
            .set("store.pool_size", 4)
            .set("store.timeout", "2s")
    })
    .await;
    drop_schema(&url, &schema).await;
}
