//! The Redis fast path over TLS, against a private `redis-server
//! --tls-port` with a CA and certificates the test generates: protected
//! traffic gets fast-path hits through it; a certificate the proxy cannot
//! trust, a host name mismatch, a plain server behind `rediss://` and a
//! missing client certificate are each named by their cause (in `/readyz`
//! and the log) while PostgreSQL answers alone; `valkeys://` is an alias.

use crate::support::fast_path::config_on_postgres;
use crate::support::redis_tls::{ClientAuth, TlsRedis, SERVER_NAME};
use crate::support::services::{database_url, require_postgres, PrivateRedis, TestSchema};
use crate::support::{
    run_on_config_text, wait_for, Backend, Proxy, Route, ServeProcess, TestConfig, Upstream, ORDERS,
};

const BODY: &str = r#"{"item":"book"}"#;

/// A proxy on PostgreSQL with the fast path at `url`, `[redis]` settings
/// `sets` over the defaults, and the admin listener. `redis.timeout` is
/// generous: a TLS handshake on a busy test machine must not count as an
/// outage.
async fn proxy_on(up: &Upstream, url: &str, sets: &[(&str, String)]) -> Proxy {
    let mut builder = Proxy::builder(Backend::PostgresRedis, up.addr)
        .redis_url(url)
        .set("redis.timeout", "2s")
        .admin();
    for (key, value) in sets {
        builder = builder.set(key, value.as_str());
    }
    builder.start().await
}

/// Stores `keys` new keys and replays each once; every answer is right
/// whatever Redis does.
async fn store_and_replay(proxy: &Proxy, tag: &str, keys: usize) {
    for i in 0..keys {
        let key = format!("{tag}-{i}");
        let first = proxy.post(ORDERS).key(&key).body(BODY).send().await;
        assert_eq!(first.status(), 201, "{}", first.text());
        assert!(!first.replayed());
        let replay = proxy.post(ORDERS).key(&key).body(BODY).send().await;
        assert_eq!(replay.status(), 201, "{}", replay.text());
        assert!(replay.replayed());
        assert_eq!(replay.body, first.body);
    }
}

async fn readyz(proxy: &Proxy) -> (u16, String) {
    let r = proxy.admin_get("/readyz").send().await;
    (r.status(), r.text())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn protected_traffic_through_tls_redis_gets_fast_path_hits() {
    let redis = TlsRedis::start(ClientAuth::No);
    let up = Upstream::start().await;
    let proxy = proxy_on(&up, &redis.url(), &[("redis.ca_file", redis.pki.ca())]).await;
    store_and_replay(&proxy, "tls", 10).await;
    assert_eq!(up.hits(ORDERS), 10);
    // Every replay is answered from Redis alone.
    assert!(proxy.fast_path_hits() >= 10, "{}", proxy.metrics.encode());
    assert_eq!(proxy.fast_path_errors(), 0, "{}", proxy.metrics.encode());
    assert_eq!(readyz(&proxy).await, (200, "ready\n".to_string()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn valkeys_urls_and_client_certificates_reach_a_server_that_requires_them() {
    let redis = TlsRedis::start(ClientAuth::Required);
    let up = Upstream::start().await;
    let url = format!("valkeys://{SERVER_NAME}:{}", redis.port);
    let with_cert = proxy_on(
        &up,
        &url,
        &[
            ("redis.ca_file", redis.pki.ca()),
            ("redis.cert_file", redis.pki.client_cert()),
            ("redis.key_file", redis.pki.client_key()),
        ],
    )
    .await;
    store_and_replay(&with_cert, "mtls", 5).await;
    assert!(
        with_cert.fast_path_hits() >= 5,
        "{}",
        with_cert.metrics.encode()
    );
    assert_eq!(with_cert.fast_path_errors(), 0);

    // Without a client certificate the server refuses the handshake: the
    // cause is named, and PostgreSQL answers alone.
    let without = proxy_on(&up, &url, &[("redis.ca_file", redis.pki.ca())]).await;
    fast_path_down_with_cause(&without, "requires a client certificate").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_certificate_from_an_untrusted_ca_is_named_and_postgres_answers_alone() {
    let redis = TlsRedis::start(ClientAuth::No);
    let up = Upstream::start().await;
    // The system roots do not know the test CA either.
    for sets in [vec![("redis.ca_file", redis.pki.other_ca())], vec![]] {
        let proxy = proxy_on(&up, &redis.url(), &sets).await;
        fast_path_down_with_cause(&proxy, "certificate not trusted").await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_name_the_certificate_does_not_carry_is_named_as_a_mismatch() {
    let redis = TlsRedis::start(ClientAuth::No);
    let up = Upstream::start().await;
    let url = format!("rediss://127.0.0.1:{}", redis.port);
    let proxy = proxy_on(&up, &url, &[("redis.ca_file", redis.pki.ca())]).await;
    fast_path_down_with_cause(&proxy, "host name mismatch").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rediss_to_a_plain_server_is_named_as_not_speaking_tls() {
    let plain = PrivateRedis::start();
    let up = Upstream::start().await;
    let url = plain.url().replace("redis://", "rediss://");
    let proxy = proxy_on(&up, &url, &[]).await;
    fast_path_down_with_cause(&proxy, "does not speak TLS").await;
}

/// Requests are answered right (PostgreSQL alone), no fast-path hit, and
/// `/readyz` stays 200 with the fast path's `cause`.
async fn fast_path_down_with_cause(proxy: &Proxy, cause: &str) {
    store_and_replay(proxy, "down", 2).await;
    assert_eq!(proxy.fast_path_hits(), 0, "{}", proxy.metrics.encode());
    assert!(proxy.fast_path_errors() > 0, "{}", proxy.metrics.encode());
    // The start-up probe may name the cause after the first timeouts did.
    let (status, body) = wait_for(&format!("/readyz to name {cause:?}"), || async {
        let (status, body) = readyz(proxy).await;
        body.contains(cause).then_some((status, body))
    })
    .await;
    assert_eq!(status, 200, "{body}");
    assert!(body.starts_with("ready\ndegraded: "), "{body}");
    // The store's own health report names it too; PostgreSQL is up.
    let store = proxy.admin_get("/healthz/store").send().await;
    assert_eq!(store.status(), 200, "{}", store.text());
    let degraded = store.json()["degraded"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    assert!(degraded.contains(cause), "{}", store.text());
}

/// Pins (issue 11): `serve` exited at start on a `rediss://` URL that
/// `check-config` had accepted. Now it starts, logs why the fast path is
/// down (here: an untrusted certificate) once, and serves on PostgreSQL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_starts_on_tls_redis_and_logs_an_untrusted_certificate_once() {
    require_postgres(&database_url()).await;
    let redis = TlsRedis::start(ClientAuth::No);
    let up = Upstream::start().await;
    let schema = TestSchema::new();
    let dir = tempfile::TempDir::new().expect("tempdir");
    let (listen, admin) = (crate::support::free_port(), crate::support::free_port());
    let config = dir.path().join("idemgate.toml");
    config_on_postgres(up.addr, listen, admin, &schema)
        .set("redis.url", redis.url())
        .set("redis.ca_file", redis.pki.other_ca())
        .write(&config);
    let serve = ServeProcess::start(&config, listen, admin, &[]).await;
    for i in 0..5 {
        let r = serve
            .post(ORDERS)
            .key(&format!("s-{i}"))
            .body(BODY)
            .send()
            .await;
        assert_eq!(r.status(), 201, "{}", r.text());
    }
    let log = wait_for("the start-up warning", || async {
        let log = serve.log();
        log.contains("unavailable at start-up").then_some(log)
    })
    .await;
    assert!(log.contains("certificate not trusted"), "{log}");
    // Logged per outage, not per request.
    let warnings = log.matches("certificate not trusted").count();
    assert!(warnings <= 3, "{warnings} warnings for 5 requests:\n{log}");
}

/// A certificate file that cannot be read is the operator's mistake, not
/// a Redis outage: `serve` refuses to start, naming the key and the file
/// (`check-config` accepts the config: it does not read files).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_refuses_to_start_on_a_missing_ca_file_naming_it() {
    let up = Upstream::start().await;
    let schema = TestSchema::new();
    let text = TestConfig::new(up.addr)
        .route(Route::post(ORDERS))
        .set("store.backend", "postgres")
        .set("store.url", database_url())
        .set("store.schema", schema.schema.as_str())
        .set("redis.url", "rediss://localhost:6380")
        .set("redis.ca_file", "/nonexistent/redis-ca.pem")
        .render();
    let (check, _) = run_on_config_text(&["check-config"], &text, &[]).await;
    assert_eq!(check.code, 0, "{check:?}");
    let (run, _) = run_on_config_text(&["serve"], &text, &[]).await;
    assert_ne!(run.code, 0, "{run:?}");
    assert!(
        run.stderr
            .contains("redis.ca_file /nonexistent/redis-ca.pem"),
        "{}",
        run.stderr
    );
}

/// `check_connection` (for `check-config --connect`) answers with the same
/// causes as the running proxy's log.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_connection_names_each_cause() {
    let redis = TlsRedis::start(ClientAuth::No);
    let plain = PrivateRedis::start();
    let cfg = |url: String, ca: Option<String>| idemgate::config::RedisConfig {
        url,
        timeout: std::time::Duration::from_secs(1),
        prefix: "unused".into(),
        cluster: false,
        ca_file: ca.map(Into::into),
        cert_file: None,
        key_file: None,
        sentinel: None,
    };
    let check = idemgate::store::redis::check_connection;
    let ok = check(&cfg(redis.url(), Some(redis.pki.ca()))).await;
    assert!(ok.as_ref().is_ok_and(|s| s.contains("answered")), "{ok:?}");
    for (config, cause) in [
        (
            cfg(redis.url(), Some(redis.pki.other_ca())),
            "certificate not trusted",
        ),
        (
            cfg(
                format!("rediss://127.0.0.1:{}", redis.port),
                Some(redis.pki.ca()),
            ),
            "host name mismatch",
        ),
        (
            cfg(plain.url().replace("redis://", "rediss://"), None),
            "does not speak TLS",
        ),
    ] {
        let e = check(&config).await.expect_err(cause);
        assert!(e.contains(cause), "want {cause:?}: {e}");
    }
}

/// `check-config --connect` tests the Redis fast path after PostgreSQL:
/// a trusted TLS Redis is reported as answering, one whose certificate is
/// not trusted fails the check with the cause (serve would run on
/// PostgreSQL alone, which the message says).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_config_connect_tests_the_redis_fast_path_too() {
    let redis = TlsRedis::start(ClientAuth::No);
    let schema = TestSchema::new();
    let config = |ca: String| {
        TestConfig::new("127.0.0.1:9".parse().unwrap())
            .set("store.backend", "postgres")
            .set("store.url", database_url())
            .set("store.schema", schema.schema.as_str())
            .set("redis.url", redis.url())
            .set("redis.ca_file", ca)
            .render()
    };
    let (ok, _) =
        run_on_config_text(&["check-config", "--connect"], &config(redis.pki.ca()), &[]).await;
    assert_eq!(ok.code, 0, "{ok:?}");
    assert!(ok.stdout.contains("answered"), "{ok:?}");
    let (bad, _) = run_on_config_text(
        &["check-config", "--connect"],
        &config(redis.pki.other_ca()),
        &[],
    )
    .await;
    assert_ne!(bad.code, 0, "{bad:?}");
    assert!(
        bad.stderr.contains("redis fast path") && bad.stderr.contains("certificate not trusted"),
        "{bad:?}"
    );
}
