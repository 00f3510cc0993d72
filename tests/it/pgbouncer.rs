//! Behind PgBouncer in transaction pooling mode (a private one, in front of
//! the shared PostgreSQL, with fewer server connections than the proxy
//! has): with `pgbouncer=true` in the URL every store call works (the store
//! contract, protected traffic, migrations, sweeps); without it the proxy
//! says to add it, whether PgBouncer refuses the startup options or (when
//! configured to ignore them) the named statements get lost between
//! server connections.

use crate::store_contract::{run_contract, LATER_MS};
use crate::support::pg_cluster::exercise;
use crate::support::pgbouncer::PrivatePgBouncer;
use crate::support::services::{database_url, drop_schema, pg_store_config, unique_schema};
use crate::support::{run_on_config_text, Backend, Proxy, TestConfig, Upstream};
use idemgate::store::postgres::PostgresStore;
use std::sync::Arc;

async fn store(url: &str, schema: &str, offset_ms: i64) -> Arc<PostgresStore> {
    Arc::new(
        PostgresStore::connect(&pg_store_config(url, schema))
            .await
            .expect("postgres store")
            .with_clock_offset(offset_ms),
    )
}

/// `check-config --connect` (or another command) on `url`.
async fn run(args: &[&str], url: &str, schema: &str) -> (i32, String) {
    let text = TestConfig::new("127.0.0.1:9".parse().unwrap())
        .set("store.backend", "postgres")
        .set("store.url", url)
        .set("store.schema", schema)
        .render();
    let (run, _) = run_on_config_text(args, &text, &[]).await;
    (run.code, format!("{}{}", run.stdout, run.stderr))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_store_contract_holds_through_pgbouncer_in_transaction_mode() {
    let bouncer = PrivatePgBouncer::start();
    let url = bouncer.url("pgbouncer=true");
    let schema = unique_schema("t");
    let later = store(&url, &schema, LATER_MS).await;
    run_contract(store(&url, &schema, 0).await, later).await;
    drop_schema(&database_url(), &schema).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn protected_traffic_and_migrations_work_through_pgbouncer() {
    let bouncer = PrivatePgBouncer::start();
    let url = bouncer.url("pgbouncer=true");
    let schema = unique_schema("t");
    // `idemgate migrate` through the pooler, then again: nothing left to do.
    let (code, out) = run(&["migrate"], &url, &schema).await;
    assert_eq!(code, 0, "{out}");
    let all = idemgate::store::postgres::MIGRATIONS.len();
    assert!(
        out.contains(&format!("{all} migration(s) applied now")),
        "{out}"
    );
    let (code, out) = run(&["migrate"], &url, &schema).await;
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("0 migration(s) applied now"), "{out}");
    drop_schema(&database_url(), &schema).await;

    let up = Upstream::start().await;
    let proxy = Proxy::builder(Backend::Postgres, up.addr)
        .store_url(&url)
        .set("store.pool_size", 8)
        .set("server.readiness", "store")
        .admin()
        .start()
        .await;
    exercise(&proxy, &up, "bouncer").await;
    // More requests at once than PgBouncer has server connections.
    let sends = (0..24).map(|i| {
        proxy
            .post(crate::support::ORDERS)
            .key(&format!("burst-{i}"))
            .body("x")
            .send()
    });
    for r in futures_util::future::join_all(sends).await {
        assert_eq!(r.status(), 201, "{}", r.text());
    }
    let ready = proxy.admin_get("/readyz").send().await;
    assert_eq!(ready.status(), 200, "{}", ready.text());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_pgbouncer_true_the_proxy_says_to_add_it() {
    let bouncer = PrivatePgBouncer::start();
    let schema = unique_schema("t");
    let (code, out) = run(&["check-config", "--connect"], &bouncer.url(""), &schema).await;
    assert_ne!(code, 0, "{out}");
    assert!(out.contains("unsupported startup parameter"), "{out}");
    assert!(out.contains("add pgbouncer=true"), "{out}");

    let up = Upstream::start().await;
    let proxy = Proxy::builder(Backend::Postgres, up.addr)
        .store_url(&bouncer.url(""))
        .set("server.readiness", "store")
        .admin()
        .start()
        .await;
    let health = proxy.admin_get("/healthz/store").send().await;
    assert!(
        health.text().contains("add pgbouncer=true"),
        "{}",
        health.text()
    );
    let ready = proxy.admin_get("/readyz").send().await;
    assert_eq!(ready.status(), 503);
    assert!(
        ready.text().contains("add pgbouncer=true"),
        "{}",
        ready.text()
    );
    let (code, out) = run(
        &["check-config", "--connect"],
        &bouncer.url("pgbouncer=true"),
        &schema,
    )
    .await;
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("pgbouncer=true): ok"), "{out}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sslmode_require_against_a_server_without_tls_says_so() {
    // This PgBouncer offers no TLS to its clients.
    let bouncer = PrivatePgBouncer::start();
    let (code, out) = run(
        &["check-config", "--connect"],
        &bouncer.url("pgbouncer=true&sslmode=require"),
        "unused",
    )
    .await;
    assert_ne!(code, 0, "{out}");
    assert!(out.contains("does not support TLS"), "{out}");
    // prefer (the default) falls back to plain TCP.
    let (code, out) = run(
        &["check-config", "--connect"],
        &bouncer.url("pgbouncer=true"),
        "unused",
    )
    .await;
    assert_eq!(code, 0, "{out}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn prepared_statements_lost_between_server_connections_say_to_add_pgbouncer_true() {
    use idemgate::idempotency::{Fingerprint, RecordKey, Scope};
    use idemgate::store::{Claim, LeaseToken, Store};
    // Startup options accepted (and dropped): what fails now is the named
    // statement prepared on one server connection and run on another.
    let bouncer = PrivatePgBouncer::start_ignoring_options();
    let schema = unique_schema("t");
    let store = store(&bouncer.url(""), &schema, 0).await;
    store
        .migrate()
        .await
        .expect("migrations use no named statements");
    let mut seen = None;
    for _ in 0..50 {
        let claims = (0..16).map(|_| {
            let store = store.clone();
            let claim = Claim {
                key: RecordKey {
                    scope: Scope(rand::random()),
                    key: rand::random(),
                },
                fingerprint: Fingerprint(rand::random()),
                token: LeaseToken::random(),
                now: idemgate::clock::Clock::system().now_millis(),
                lease_ms: 10_000,
                ttl_ms: 60_000,
                first_use: Some(idemgate::store::FirstUse::new("POST", "/orders")),
            };
            tokio::spawn(async move { store.claim(&claim).await })
        });
        let failed = futures_util::future::join_all(claims)
            .await
            .into_iter()
            .filter_map(|r| r.expect("claim task").err())
            .map(|e| e.to_string())
            .find(|e| e.contains("prepared statement"));
        if let Some(err) = failed {
            seen = Some(err);
            break;
        }
    }
    let err = seen.expect("named statements break behind a transaction pooler");
    assert!(err.contains("add pgbouncer=true"), "{err}");
    drop_schema(&database_url(), &schema).await;
}

/// Waiting duplicates behind a transaction pooler: LISTEN cannot work
/// there, so the notifier stays off and waiters poll the store; each still
/// gets the first request's answer, and the upstream runs once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiting_duplicates_get_the_replay_through_pgbouncer() {
    use crate::support::{Action, Route, ORDERS};
    use std::time::Duration;
    let bouncer = PrivatePgBouncer::start();
    let up = Upstream::start().await;
    let mut wait = toml::Table::new();
    wait.insert("wait".into(), "10s".into());
    let proxy = Proxy::builder(Backend::Postgres, up.addr)
        .store_url(&bouncer.url("pgbouncer=true"))
        .routes(vec![
            Route::post(ORDERS).set("in_flight", toml::Value::Table(wait))
        ])
        .start()
        .await;
    up.push(Action::Delay(Duration::from_millis(500)));
    let first = tokio::spawn(proxy.post(ORDERS).key("w").body("x").send());
    up.wait_hits(ORDERS, 1).await;
    let dups: Vec<_> = (0..20)
        .map(|_| tokio::spawn(proxy.post(ORDERS).key("w").body("x").send()))
        .collect();
    let first = first.await.expect("first");
    assert_eq!(first.status(), 201, "{}", first.text());
    for dup in futures_util::future::join_all(dups).await {
        let dup = dup.expect("duplicate");
        assert_eq!(dup.status(), 201, "{}", dup.text());
        assert!(dup.replayed());
    }
    assert_eq!(up.hits(ORDERS), 1, "the upstream ran once");
}
