//! Claims and completions are durable whatever `synchronous_commit` the
//! server, database, role or `store.url` gives idemgate's sessions: `off`
//! acknowledges a commit before its WAL is flushed, so a PostgreSQL crash
//! loses rows the proxy already acted on (the upstream ran, the key is
//! forgotten, the retry runs it again). idemgate raises `off` and `local`
//! to `on` for its own sessions (behind PgBouncer per transaction), keeps
//! anything stronger, and says so at start-up and in `check-config
//! --connect`, which also says whether the connection is TLS or plaintext.
//!
//! The crash tests run a private cluster ([`PgCluster::private`]) with
//! `synchronous_commit = off` and `wal_writer_delay = 10s` (an unflushed
//! commit stays in the WAL buffers that long), crash it (SIGKILL to the
//! postmaster and every process of it, [`PgCluster::kill`]), start it
//! again and retry.

use crate::support::pg_cluster::PgCluster;
use crate::support::pgbouncer::PrivatePgBouncer;
use crate::support::services::{database_url, unique_schema};
use crate::support::{
    free_port, run_on_config_text, run_to_completion, Resp, Route, ServeProcess, TestConfig,
    Upstream, DEADLINE, ORDERS,
};
use std::time::{Duration, Instant};

/// A server whose default lets commits return before their WAL is flushed,
/// and whose WAL writer waits 10 s before writing them out.
const LAZY_COMMITS: &str = "synchronous_commit = off\nwal_writer_delay = 10s\n";

/// `url` with `query` added to its query string.
fn with_query(url: &str, query: &str) -> String {
    let sep = if url.contains('?') { '&' } else { '?' };
    format!("{url}{sep}{query}")
}

/// The store config for `url` and `schema`, as the crash tests run it.
fn store_config(upstream: std::net::SocketAddr, url: &str, schema: &str) -> TestConfig {
    TestConfig::new(upstream)
        .set("store.backend", "postgres")
        .set("store.url", url)
        .set("store.schema", schema)
        .set("store.connect_timeout", "1s")
        .set("store.timeout", "2s")
        .route(Route::post(ORDERS))
}

/// Sends `key` until the store answers again (a 503 while PostgreSQL
/// restarts is what the proxy promises); returns the first other answer.
async fn post_until_the_store_answers(serve: &ServeProcess, key: &str) -> Resp {
    let deadline = Instant::now() + DEADLINE;
    loop {
        let resp = serve
            .post(ORDERS)
            .key(key)
            .body("{\"amount\":1}")
            .send()
            .await;
        if resp.status() != 503 || Instant::now() > deadline {
            return resp;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A POST runs and is stored through `url` (the private `cluster`, maybe
/// through a pooler); PostgreSQL crashes and comes back; the retry must
/// be a replay, the upstream called once. Returns the proxy's log.
async fn a_stored_post_survives_a_crash(cluster: &mut PgCluster, url: &str) -> String {
    let up = Upstream::start().await;
    let schema = unique_schema("durable");
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("durable.toml");
    let (listen, admin) = (free_port(), free_port());
    store_config(up.addr, url, &schema)
        .listen(listen, admin)
        .write(&config);
    // The schema is made durable first (a checkpoint flushes everything),
    // so what the crash can lose is the proxy's own rows.
    let migrate = run_to_completion(&["migrate", "--config", config.to_str().unwrap()], &[]).await;
    assert_eq!(migrate.code, 0, "{migrate:?}");
    cluster.psql("CHECKPOINT");

    let serve = ServeProcess::start(&config, listen, admin, &[]).await;
    let first = serve
        .post(ORDERS)
        .key("pay-1")
        .body("{\"amount\":1}")
        .send()
        .await;
    assert_eq!(first.status(), 201, "{}", first.text());
    assert_eq!(up.hits(ORDERS), 1);

    cluster.kill();
    cluster.restart();

    let retry = post_until_the_store_answers(&serve, "pay-1").await;
    assert_eq!(retry.status(), 201, "{}\n{}", retry.text(), serve.log());
    assert!(
        retry.replayed(),
        "the retry after the crash must be a replay, not a second execution:\n{}",
        serve.log()
    );
    assert_eq!(retry.body, first.body);
    assert_eq!(up.hits(ORDERS), 1, "the upstream ran once");
    serve.log()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stored_key_survives_a_postgres_crash_on_a_synchronous_commit_off_server() {
    let mut cluster = PgCluster::private(LAZY_COMMITS);
    let url = cluster.url("postgres", "127.0.0.1", "sslmode=disable");
    let log = a_stored_post_survives_a_crash(&mut cluster, &url).await;
    // The operator is told, once, naming the server's value.
    let warnings: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("synchronous_commit"))
        .collect();
    assert_eq!(warnings.len(), 1, "one start-up warning:\n{log}");
    assert!(
        warnings[0].contains("off") && warnings[0].contains("raised"),
        "{log}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stored_key_survives_a_postgres_crash_on_a_synchronous_commit_off_server_behind_pgbouncer(
) {
    let mut cluster = PgCluster::private(LAZY_COMMITS);
    let direct = cluster.url("postgres", "127.0.0.1", "sslmode=disable");
    // Reconnects to the restarted server within a second.
    let bouncer = PrivatePgBouncer::in_front_of(&direct, "server_login_retry = 1\n");
    let url = bouncer.url("pgbouncer=true&sslmode=disable");
    a_stored_post_survives_a_crash(&mut cluster, &url).await;

    // check-config through the pooler names the server's value and what
    // idemgate's transactions run with.
    let (code, out) = check_connect(&url).await;
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains("synchronous_commit is off") && out.contains("raised to on"),
        "{out}"
    );
}

/// `check-config --connect` on `url`: (exit code, stdout + stderr).
async fn check_connect(url: &str) -> (i32, String) {
    let text = TestConfig::new("127.0.0.1:9".parse().unwrap())
        .set("store.backend", "postgres")
        .set("store.url", url)
        .set("store.schema", unique_schema("cc").as_str())
        .set("store.connect_timeout", "2s")
        .render();
    let (run, _) = run_on_config_text(&["check-config", "--connect"], &text, &[]).await;
    (run.code, format!("{}{}", run.stdout, run.stderr))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_config_connect_names_synchronous_commit_and_what_idemgate_runs_with() {
    // The URL's own options cannot weaken it: raised like a server default.
    for (options, says) in [
        ("off", "synchronous_commit is off (the server's, database's, role's or store.url's); raised to on"),
        ("local", "synchronous_commit is local (the server's, database's, role's or store.url's); raised to on"),
        ("remote_write", "synchronous_commit is remote_write (the server's, database's, role's or store.url's); raised to on"),
        ("remote_apply", "synchronous_commit is remote_apply: kept"),
    ] {
        let url = with_query(
            &database_url(),
            &format!("options=-c%20synchronous_commit%3D{options}"),
        );
        let (code, out) = check_connect(&url).await;
        assert_eq!(code, 0, "{out}");
        assert!(out.contains(says), "{options}: {out}");
    }
    let (code, out) = check_connect(&database_url()).await;
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("synchronous_commit is on: kept"), "{out}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_config_connect_says_whether_the_connection_is_tls_or_plaintext() {
    // The machine's PostgreSQL has ssl = on: prefer gets TLS.
    let (code, out) = check_connect(&with_query(&database_url(), "sslmode=prefer")).await;
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("(sslmode=prefer): ok, over TLS"), "{out}");
    let (code, out) = check_connect(&with_query(&database_url(), "sslmode=disable")).await;
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("(sslmode=disable): ok, in plaintext"), "{out}");

    // A server without TLS: prefer falls back to plaintext, and says so.
    let cluster = PgCluster::private("ssl = off\n");
    let url = cluster.url("postgres", "127.0.0.1", "sslmode=prefer");
    let (code, out) = check_connect(&url).await;
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains("(sslmode=prefer): ok, in plaintext (the server offered no TLS)"),
        "{out}"
    );
    assert!(!out.contains("over TLS"), "{out}");
}
