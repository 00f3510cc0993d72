//! PostgreSQL over TLS: libpq's `sslmode`, `sslrootcert`, `sslcert` and
//! `sslkey` in `store.url`, against real servers: the machine's PostgreSQL
//! (`ssl = on`, a self-signed certificate) and a private cluster with a CA
//! of the test's own ([`PgCluster`]). Failures must name their cause at
//! start-up, in `check-config --connect`, in `/healthz/store` and in
//! `/readyz` (with `server.readiness = "store"`).

use crate::support::pg_cluster::{exercise, PgCluster, CERT_USER, SCRAM_PASSWORD, SCRAM_USER};
use crate::support::services::{database_url, unique_schema};
use crate::support::{
    free_port, run_on_config_text, wait_for, Backend, Proxy, ServeProcess, TestConfig, Upstream,
};

/// `url` with `query` added to its query string.
fn with_query(url: &str, query: &str) -> String {
    let sep = if url.contains('?') { '&' } else { '?' };
    format!("{url}{sep}{query}")
}

/// A config text for `check-config --connect` against `url`.
fn config_text(url: &str) -> String {
    TestConfig::new("127.0.0.1:9".parse().unwrap())
        .set("store.backend", "postgres")
        .set("store.url", url)
        .set("store.connect_timeout", "2s")
        .render()
}

/// `check-config --connect` on `url`: (exit code, stdout + stderr).
async fn check_connect(url: &str) -> (i32, String) {
    let (run, _) = run_on_config_text(&["check-config", "--connect"], &config_text(url), &[]).await;
    (run.code, format!("{}{}", run.stdout, run.stderr))
}

/// Whether the server sees the connections named `app` encrypted.
async fn connections_use_tls(app: &str) -> bool {
    let (client, conn) = tokio_postgres::connect(&database_url(), tokio_postgres::NoTls)
        .await
        .expect("connect to the shared PostgreSQL");
    let task = tokio::spawn(conn);
    let row = client
        .query_one(
            "SELECT count(*), count(*) FILTER (WHERE s.ssl) FROM pg_stat_activity a \
             JOIN pg_stat_ssl s USING (pid) WHERE a.application_name = $1",
            &[&app],
        )
        .await
        .expect("pg_stat_ssl");
    drop(client);
    let _ = task.await;
    let (all, tls): (i64, i64) = (row.get(0), row.get(1));
    all > 0 && all == tls
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sslmode_require_serves_protected_routes_over_tls_on_the_machines_postgres() {
    let up = Upstream::start().await;
    let app = unique_schema("tls");
    let url = with_query(
        &database_url(),
        &format!("sslmode=require&application_name={app}"),
    );
    let proxy = Proxy::builder(Backend::Postgres, up.addr)
        .store_url(&url)
        .start()
        .await;
    exercise(&proxy, &up, "require").await;
    assert!(
        connections_use_tls(&app).await,
        "the proxy's connections are encrypted"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_full_with_a_ca_that_did_not_sign_the_certificate_says_not_trusted() {
    let cluster = PgCluster::shared();
    // The machine's certificate is self-signed: our test CA did not sign it.
    let url = with_query(
        &database_url(),
        &format!(
            "sslmode=verify-full&sslrootcert={}",
            cluster.other_ca.display()
        ),
    );
    let (code, out) = check_connect(&url).await;
    assert_ne!(code, 0, "{out}");
    assert!(out.contains("not trusted"), "{out}");
    assert!(out.contains("sslmode=verify-full"), "{out}");

    // The same at start-up (the log) and in /readyz, while serving.
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("serve.toml");
    let (listen, admin) = (free_port(), free_port());
    TestConfig::new("127.0.0.1:9".parse().unwrap())
        .set("store.backend", "postgres")
        .set("store.url", url.as_str())
        .set("store.schema", unique_schema("tls").as_str())
        .set("server.readiness", "store")
        .listen(listen, admin)
        .write(&config);
    let serve = ServeProcess::start(&config, listen, admin, &[]).await;
    let ready = serve.admin_get("/readyz").send().await;
    assert_eq!(ready.status(), 503);
    assert!(ready.text().contains("not trusted"), "{}", ready.text());
    let health = serve.admin_get("/healthz/store").send().await;
    assert_eq!(health.status(), 503);
    assert!(health.text().contains("not trusted"), "{}", health.text());
    let log = wait_for("the start-up warning", || {
        let log = serve.log();
        async move { log.contains("not trusted").then_some(log) }
    })
    .await;
    assert!(
        log.contains("127.0.0.1:5432") || log.contains("postgres at"),
        "{log}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_postgres_names_host_port_and_cause() {
    let port = free_port().port();
    let url = format!("postgres://postgres@127.0.0.1:{port}/test");
    let (code, out) = check_connect(&url).await;
    assert_ne!(code, 0, "{out}");
    assert!(out.contains(&format!("127.0.0.1:{port}")), "{out}");
    assert!(out.contains("refused"), "{out}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_full_with_the_clusters_ca_serves_protected_routes() {
    let cluster = PgCluster::shared();
    let query = format!("sslmode=verify-full&sslrootcert={}", cluster.ca.display());
    let (code, out) = check_connect(&cluster.url("postgres", "localhost", &query)).await;
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("sslmode=verify-full): ok"), "{out}");
    let up = Upstream::start().await;
    let proxy = Proxy::builder(Backend::Postgres, up.addr)
        .store_url(&cluster.url("postgres", "127.0.0.1", &query))
        .start()
        .await;
    exercise(&proxy, &up, "verify-full").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn host_name_mismatch_is_refused_by_verify_full_and_accepted_by_verify_ca() {
    let cluster = PgCluster::shared();
    // Connects to 127.0.0.1 but expects the certificate to name this host.
    let url = |mode: &str| {
        cluster.url(
            "postgres",
            "db.other.example",
            &format!(
                "hostaddr=127.0.0.1&sslmode={mode}&sslrootcert={}",
                cluster.ca.display()
            ),
        )
    };
    let (code, out) = check_connect(&url("verify-full")).await;
    assert_ne!(code, 0, "{out}");
    assert!(out.contains("host name mismatch"), "{out}");
    assert!(out.contains("db.other.example"), "{out}");
    let (code, out) = check_connect(&url("verify-ca")).await;
    assert_eq!(code, 0, "verify-ca checks the chain only: {out}");
    // libpq: require with a root certificate file behaves as verify-ca.
    let (code, out) = check_connect(&url("require")).await;
    assert_eq!(code, 0, "{out}");
    // ... and the chain is still checked: an unrelated CA is refused.
    let unrelated = cluster.url(
        "postgres",
        "localhost",
        &format!(
            "sslmode=verify-ca&sslrootcert={}",
            cluster.other_ca.display()
        ),
    );
    let (code, out) = check_connect(&unrelated).await;
    assert_ne!(code, 0, "{out}");
    assert!(out.contains("not trusted"), "{out}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_certificates_authenticate_a_role_that_requires_one() {
    let cluster = PgCluster::shared();
    let ca = format!("sslmode=verify-full&sslrootcert={}", cluster.ca.display());
    let without = cluster.url(CERT_USER, "localhost", &ca);
    let (code, out) = check_connect(&without).await;
    assert_ne!(code, 0, "{out}");
    assert!(out.contains("certificate"), "{out}");
    let with = format!(
        "{ca}&sslcert={}&sslkey={}",
        cluster.client_cert.display(),
        cluster.client_key.display()
    );
    let (code, out) = check_connect(&cluster.url(CERT_USER, "localhost", &with)).await;
    assert_eq!(code, 0, "{out}");
    let up = Upstream::start().await;
    let proxy = Proxy::builder(Backend::Postgres, up.addr)
        .store_url(&cluster.url(CERT_USER, "localhost", &with))
        .start()
        .await;
    exercise(&proxy, &up, "client-cert").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_certificate_file_fails_at_start_naming_the_file() {
    let url = with_query(
        &database_url(),
        "sslmode=verify-full&sslrootcert=/nonexistent/idemgate-root.crt",
    );
    let (code, out) = check_connect(&url).await;
    assert_ne!(code, 0, "{out}");
    assert!(out.contains("/nonexistent/idemgate-root.crt"), "{out}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scram_with_channel_binding_required_authenticates_over_tls() {
    let cluster = PgCluster::shared();
    // As hosted PostgreSQL services print their URLs.
    let query = format!(
        "sslmode=verify-full&sslrootcert={}&channel_binding=require",
        cluster.ca.display()
    );
    let url = cluster.url(SCRAM_USER, "localhost", &query).replacen(
        SCRAM_USER,
        &format!("{SCRAM_USER}:{SCRAM_PASSWORD}"),
        1,
    );
    let (code, out) = check_connect(&url).await;
    assert_eq!(code, 0, "{out}");
    let up = Upstream::start().await;
    let proxy = Proxy::builder(Backend::Postgres, up.addr)
        .store_url(&url)
        .start()
        .await;
    exercise(&proxy, &up, "scram").await;
    // A wrong password is an authentication error, not a TLS one.
    let wrong = url.replacen(SCRAM_PASSWORD, "wrong-password", 1);
    let (code, out) = check_connect(&wrong).await;
    assert_ne!(code, 0, "{out}");
    assert!(out.contains("password authentication failed"), "{out}");
    assert!(!out.contains("wrong-password"), "never the password: {out}");
}

/// The LISTEN/NOTIFY connection of waiting routes opens like the store's:
/// over verify-full TLS, with the URL's TLS parameters understood (it once
/// parsed the URL itself, refusing `sslrootcert` as an unknown option, and
/// connected without TLS).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn key_notifications_travel_over_verified_tls() {
    use idemgate::store::notify::KeyNotifier;
    use std::sync::{Arc, Mutex};
    let cluster = PgCluster::shared();
    let url = cluster.url(
        "postgres",
        "localhost",
        &format!("sslmode=verify-full&sslrootcert={}", cluster.ca.display()),
    );
    let store = TestConfig::new("127.0.0.1:9".parse().unwrap())
        .set("store.backend", "postgres")
        .set("store.url", url.as_str())
        .set("store.schema", unique_schema("tls").as_str())
        .parse()
        .restart
        .store;
    let seen: Arc<Mutex<Vec<String>>> = Arc::default();
    let log = seen.clone();
    let notifier = KeyNotifier::spawn(
        &store,
        Arc::new(move |id: &str| log.lock().unwrap().push(id.to_string())),
    )
    .expect("a notifier");
    wait_for("the notification back over TLS", || {
        notifier.publish("tls-id".into());
        let seen = seen.clone();
        async move {
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            seen.lock()
                .unwrap()
                .contains(&"tls-id".to_string())
                .then_some(())
        }
    })
    .await;
}
