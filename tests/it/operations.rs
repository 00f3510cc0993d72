//! Operations: the real `idemgate` binary as an operator runs it. The admin
//! port (`/healthz`, `/readyz`, `/metrics`) after real traffic, readiness
//! following the store, the `keys` commands against a running proxy's
//! store, environment overrides, JSON access logs and SIGTERM.

use crate::support;
use crate::support::services::{
    database_url, drop_schema, require_postgres, unique_schema, TcpRelay,
};
use crate::support::{
    free_port, run_on_config_text, run_to_completion, wait_for, Action, Req, Route, Run,
    ServeProcess, TestConfig, Upstream, ORDERS,
};
use http::Method;
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;
use tokio::net::TcpStream;

const BODY: &str = r#"{"item":"lamp","qty":1}"#;
const CREDENTIAL: &str = "Bearer t-ops-credential-5d1c";

// ===== the binary as a child process =====

/// `POST /orders` with the test's credential, `key` and [`BODY`].
trait Orders {
    fn order(&self, key: &str) -> Req;
}

impl Orders for ServeProcess {
    fn order(&self, key: &str) -> Req {
        self.post(ORDERS)
            .header("authorization", CREDENTIAL)
            .key(key)
            .body(BODY)
    }
}

/// A config file in a temporary directory.
struct Setup {
    _dir: tempfile::TempDir,
    listen: SocketAddr,
    admin: SocketAddr,
    config: PathBuf,
}

impl Setup {
    /// Writes a config: the proxy and admin on free ports in front of
    /// `upstream`, `POST /orders` (small body limit) and `POST /payments`
    /// (keys expire after 1 s); `store` adds the `[store]` table and
    /// anything else, given the directory.
    fn new(upstream: SocketAddr, store: impl FnOnce(TestConfig, &Path) -> TestConfig) -> Setup {
        let dir = tempfile::TempDir::new().expect("tempdir");
        let (listen, admin) = (free_port(), free_port());
        let config = dir.path().join("idemgate.toml");
        let routes = TestConfig::new(upstream)
            .listen(listen, admin)
            .set("server.shutdown_grace", "10s")
            .route(Route::post(ORDERS).set("max_request_body", "1KiB"))
            .route(Route::post("/payments").set("ttl", "1s").set("lease", "1s"));
        store(routes, dir.path()).write(&config);
        Setup {
            _dir: dir,
            listen,
            admin,
            config,
        }
    }

    fn sqlite(upstream: SocketAddr) -> Setup {
        Self::new(upstream, sqlite_store)
    }

    /// `idemgate serve` on the config, with `env` added.
    async fn start_with_env(&self, env: &[(&str, &str)]) -> ServeProcess {
        ServeProcess::start(&self.config, self.listen, self.admin, env).await
    }

    async fn start(&self) -> ServeProcess {
        self.start_with_env(&[]).await
    }
}

fn sqlite_store(config: TestConfig, dir: &Path) -> TestConfig {
    config
        .set("store.backend", "sqlite")
        .set("store.path", dir.join("ops.db").display().to_string())
        .set("store.sweep_interval", "1h")
}

fn postgres_store(config: TestConfig, url: &str, schema: &str) -> TestConfig {
    config
        .set("store.backend", "postgres")
        .set("store.url", url)
        .set("store.schema", schema)
        .set("store.pool_size", 4)
        .set("store.connect_timeout", "1s")
        .set("store.statement_timeout", "1s")
        .set("store.timeout", "1s")
        .set("store.sweep_interval", "1h")
}

/// A config on the memory store, without routes.
fn memory_config() -> TestConfig {
    TestConfig::default()
        .set("server.upstream", "http://127.0.0.1:3000")
        .set("store.backend", "memory")
}

/// `idemgate keys <args> --config <config>`, expected to succeed (or, for
/// `show`, to find no record: exit 3); its stdout.
async fn keys(config: &Path, args: &[&str]) -> String {
    let mut all = vec!["keys", "--config", config.to_str().expect("utf-8 path")];
    all.extend_from_slice(args);
    let run = run_to_completion(&all, &[]).await;
    let absent = run.stdout.starts_with("no record");
    let expected = if absent && args[0] == "show" { 3 } else { 0 };
    assert_eq!(
        run.code, expected,
        "keys {args:?}: {}{}",
        run.stdout, run.stderr
    );
    run.stdout
}

/// `idemgate keys show --scope-header-value CREDENTIAL <key>`.
async fn show(config: &Path, key: &str) -> String {
    keys(config, &["show", "--scope-header-value", CREDENTIAL, key]).await
}

/// The value of the `field` line in `keys show` output.
fn show_field<'a>(out: &'a str, field: &str) -> &'a str {
    out.lines()
        .find_map(|l| l.strip_prefix(field).filter(|rest| rest.starts_with(' ')))
        .unwrap_or_else(|| panic!("no {field:?} line in:\n{out}"))
        .trim()
}

/// Every `idemgate_requests_total` sample: series → value.
fn request_counters(metrics: &str) -> BTreeMap<String, String> {
    metrics
        .lines()
        .filter(|l| l.starts_with("idemgate_requests_total{"))
        .map(|l| {
            let (series, value) = l.rsplit_once(' ').expect("sample line");
            (series.to_string(), value.to_string())
        })
        .collect()
}

fn requests_series(route: &str, outcome: &str) -> String {
    format!("idemgate_requests_total{{route=\"{route}\",outcome=\"{outcome}\"}}")
}

// ===== admin endpoints =====

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_count_each_outcome_of_real_traffic_exactly_once() {
    let up = Upstream::start().await;
    let setup = Setup::sqlite(up.addr);
    let gate = setup.start().await;

    let health = gate.admin_get("/healthz").send().await;
    assert_eq!(health.status(), 200, "{}", health.text());
    let ready = gate.admin_get("/readyz").send().await;
    assert_eq!(ready.status(), 200, "{}", ready.text());

    // forwarded, then replayed
    let first = gate.order("k-new").send().await;
    assert_eq!(first.status(), 201, "{}", first.text());
    let retry = gate.order("k-new").send().await;
    assert!(retry.replayed(), "{retry:?}");
    // mismatch: the same key on another body
    gate.order("k-new")
        .body(r#"{"item":"pen"}"#)
        .send()
        .await
        .assert_problem(422);
    // conflict: a duplicate while the first is still upstream; that first
    // one then fails with a 5xx (upstream_error, key released)
    up.push(Action::Delay(Duration::from_secs(3)));
    let slow = tokio::spawn(
        gate.post("/orders?status=503")
            .header("authorization", CREDENTIAL)
            .key("k-slow")
            .body(BODY)
            .send(),
    );
    up.wait_hits(ORDERS, 2).await;
    gate.post("/orders?status=503")
        .header("authorization", CREDENTIAL)
        .key("k-slow")
        .body(BODY)
        .send()
        .await
        .assert_problem(409);
    assert_eq!(slow.await.unwrap().status(), 503);
    // missing_key, invalid_key, too_large
    gate.post(ORDERS)
        .body(BODY)
        .send()
        .await
        .assert_problem(400);
    gate.post(ORDERS)
        .key(&"k".repeat(300))
        .body(BODY)
        .send()
        .await
        .assert_problem(400);
    gate.post(ORDERS)
        .key("k-big")
        .body(vec![b'x'; 2048])
        .send()
        .await
        .assert_problem(413);
    // passthrough: the proxy port does not serve idemgate's /metrics, it
    // forwards the request to the upstream like any unprotected request
    let proxied = Req::new(Method::GET, gate.url("/metrics")).send().await;
    assert_eq!(proxied.status(), 200, "{}", proxied.text());
    assert_eq!(proxied.header("x-upstream"), Some("test"));
    assert_eq!(proxied.json()["path"], "/metrics");
    assert!(!proxied.text().contains("idemgate_"), "{}", proxied.text());
    assert_eq!(up.hits("/metrics"), 1);
    assert_eq!(up.hits(ORDERS), 2, "only the new key and the slow one ran");

    let metrics = wait_for("in_flight to drop to 0", || async {
        let m = gate.admin_get("/metrics").send().await;
        m.text()
            .lines()
            .any(|l| l == "idemgate_in_flight 0")
            .then_some(m)
    })
    .await;
    assert_eq!(metrics.status(), 200);
    let content_type = metrics.header("content-type").unwrap_or_default();
    assert!(
        content_type.starts_with("application/openmetrics-text")
            || content_type.starts_with("text/plain"),
        "{content_type}"
    );
    let text = metrics.text();
    for line in text.lines() {
        if line.starts_with('#') {
            // process_* keep their conventional names (metrics/process.rs).
            let named = line
                .split(' ')
                .nth(2)
                .is_some_and(|n| n.starts_with("idemgate_") || n.starts_with("process_"));
            assert!(
                (named
                    && (line.starts_with("# HELP ")
                        || line.starts_with("# TYPE ")
                        || line.starts_with("# UNIT ")))
                    || line == "# EOF",
                "unexpected comment line {line:?}"
            );
        } else {
            let (series, value) = line.rsplit_once(' ').expect("`series value`");
            assert!(
                series.starts_with("idemgate_") || series.starts_with("process_"),
                "{line}"
            );
            value
                .parse::<f64>()
                .unwrap_or_else(|e| panic!("{line}: value is not a number: {e}"));
        }
    }
    let expected: BTreeMap<String, String> = [
        (ORDERS, "forwarded"),
        (ORDERS, "replayed"),
        (ORDERS, "conflict"),
        (ORDERS, "mismatch"),
        (ORDERS, "missing_key"),
        (ORDERS, "invalid_key"),
        (ORDERS, "too_large"),
        (ORDERS, "upstream_error"),
        ("unrouted", "passthrough"),
    ]
    .into_iter()
    .map(|(route, outcome)| (requests_series(route, outcome), "1".to_string()))
    .collect();
    assert_eq!(request_counters(&text), expected, "{text}");
    for family in [
        "idemgate_store_duration_seconds",
        "idemgate_upstream_duration_seconds",
    ] {
        assert!(
            text.contains(&format!("# TYPE {family} histogram")),
            "{family} is not a histogram:\n{text}"
        );
        assert!(text.contains(&format!("{family}_bucket{{")), "{text}");
        assert!(text.contains(&format!("{family}_count{{")), "{text}");
    }
    assert!(
        text.contains("idemgate_upstream_duration_seconds_count{route=\"/orders\"} 2"),
        "the new key and the slow 5xx were timed:\n{text}"
    );
    // Families without labels are always exposed; per-route ones such as
    // lease_takeovers appear with their first event.
    assert!(
        text.contains("# TYPE idemgate_swept_records counter"),
        "{text}"
    );
    assert!(
        text.lines().any(|l| l == "idemgate_swept_records_total 0"),
        "{text}"
    );
    assert!(text.contains("# TYPE idemgate_in_flight gauge"), "{text}");
    assert!(
        !text.contains("redis_fast_path"),
        "no Redis, no fast-path counters:\n{text}"
    );

    // The admin port serves only its own paths; nothing reaches the upstream.
    let unknown = gate.admin_get("/nope").send().await;
    assert_eq!(unknown.status(), 404, "{}", unknown.text());
    assert_eq!(gate.admin_get(ORDERS).send().await.status(), 404);
    let post = Req::new(Method::POST, format!("http://{}/metrics", gate.admin))
        .send()
        .await;
    assert_eq!(post.status(), 405);
    assert_eq!(up.hits(ORDERS), 2);
    assert_eq!(up.total_hits(), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_turns_503_while_postgres_is_cut_off_and_200_when_it_returns() {
    require_postgres(&database_url()).await;
    let relay = TcpRelay::start(support::services::postgres_addr()).await;
    let schema = unique_schema("ops");
    let up = Upstream::start().await;
    let url = support::services::database_url_via(relay.addr());
    // readiness = "store": the default ("serving") is in readiness.rs.
    let setup = Setup::new(up.addr, |c, _| {
        postgres_store(c, &url, &schema).set("server.readiness", "store")
    });
    let gate = setup.start().await;

    let ready = |want: u16| {
        let gate = &gate;
        async move {
            wait_for(&format!("/readyz to answer {want}"), || async {
                let r = gate.admin_get("/readyz").send().await;
                (r.status() == want).then_some(r)
            })
            .await
        }
    };
    ready(200).await;
    assert_eq!(gate.order("k-before").send().await.status(), 201);

    relay.cut();
    let down = ready(503).await;
    assert!(down.text().starts_with("not ready"), "{}", down.text());
    assert_eq!(
        gate.admin_get("/healthz").send().await.status(),
        200,
        "still alive"
    );
    let refused = gate.order("k-during").send().await;
    refused.assert_problem(503);
    assert!(refused.header("retry-after").is_some(), "{refused:?}");
    assert_eq!(up.hits(ORDERS), 1, "nothing forwarded unguarded");

    relay.restore();
    ready(200).await;
    let after = wait_for("a protected request to succeed again", || async {
        let r = gate.order("k-after").send().await;
        (r.status() != 503).then_some(r)
    })
    .await;
    assert_eq!(after.status(), 201, "{}", after.text());
    assert!(gate.order("k-before").send().await.replayed());
    drop(gate);
    drop_schema(&database_url(), &schema).await;
}

// ===== keys commands =====

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_show_describes_a_stored_key_without_printing_the_key_or_credential() {
    let up = Upstream::start().await;
    let setup = Setup::sqlite(up.addr);
    let gate = setup.start().await;
    let key = "raw-key-0b5e7a";
    let stored = gate
        .post("/orders?headers=1")
        .header("authorization", CREDENTIAL)
        .key(key)
        .body(BODY)
        .send()
        .await;
    assert_eq!(stored.status(), 201, "{}", stored.text());

    let out = show(&setup.config, key).await;
    assert!(out.contains("state        completed\n"), "{out}");
    assert!(out.contains("status       201\n"), "{out}");
    assert!(
        out.contains(&format!("body         {} bytes\n", stored.body.len())),
        "{out}"
    );
    for header in [
        "  location: /orders/1\n",
        "  x-multi: a, b\n",
        "  x-multi: c\n",
        "  x-after: z\n",
        "  x-upstream: test\n",
        "  content-type: application/json\n",
    ] {
        assert!(out.contains(header), "missing {header:?} in:\n{out}");
    }
    assert!(!out.to_ascii_lowercase().contains("set-cookie"), "{out}");
    for field in ["key id", "scope", "fingerprint", "created", "expires"] {
        assert!(!show_field(&out, field).is_empty(), "{field}: {out}");
    }
    let created =
        humantime::parse_rfc3339(show_field(&out, "created")).expect("created is RFC 3339");
    let expires_field = show_field(&out, "expires");
    let expires = humantime::parse_rfc3339(expires_field.split(' ').next().unwrap())
        .expect("expires is RFC 3339");
    assert!(expires > created, "{out}");
    assert!(expires_field.contains("(in "), "{out}");
    assert!(!out.contains(key), "the raw key is printed:\n{out}");
    assert!(
        !out.contains(CREDENTIAL),
        "the credential is printed:\n{out}"
    );
    assert!(!out.contains("t-ops-credential"), "{out}");

    // The same record named by its scope hash; the anonymous scope has none.
    let scope = show_field(&out, "scope").to_string();
    let by_hash = keys(&setup.config, &["show", "--scope", &scope, key]).await;
    assert_eq!(by_hash, out);
    let anonymous = keys(&setup.config, &["show", "--anonymous", key]).await;
    assert!(anonymous.starts_with("no record for key id"), "{anonymous}");
    let unknown = show(&setup.config, "never-sent").await;
    assert!(unknown.starts_with("no record for key id"), "{unknown}");
    assert!(!unknown.contains("never-sent"), "{unknown}");
    assert_eq!(up.hits(ORDERS), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_delete_makes_the_next_request_with_that_key_execute_again() {
    let up = Upstream::start().await;
    let setup = Setup::sqlite(up.addr);
    let gate = setup.start().await;
    let first = gate.order("k-delete").send().await;
    assert_eq!(first.status(), 201);
    assert!(gate.order("k-delete").send().await.replayed());
    assert_eq!(up.hits(ORDERS), 1);

    let deleted = keys(
        &setup.config,
        &["delete", "--scope-header-value", CREDENTIAL, "k-delete"],
    )
    .await;
    assert!(deleted.starts_with("deleted key id "), "{deleted}");
    assert!(!deleted.contains("k-delete"), "{deleted}");
    assert!(show(&setup.config, "k-delete")
        .await
        .starts_with("no record"));
    let again = keys(
        &setup.config,
        &["delete", "--scope-header-value", CREDENTIAL, "k-delete"],
    )
    .await;
    assert!(again.starts_with("no record for key id "), "{again}");

    let rerun = gate.order("k-delete").send().await;
    assert_eq!(rerun.status(), 201, "{}", rerun.text());
    assert!(!rerun.replayed(), "the deleted key executes as new");
    assert_eq!(rerun.json()["hits"], 2);
    assert_eq!(up.hits(ORDERS), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_show_reports_a_key_stuck_in_flight_with_its_lease() {
    let up = Upstream::start().await;
    let setup = Setup::sqlite(up.addr);
    let gate = setup.start().await;
    up.push(Action::Delay(Duration::from_secs(30)));
    let stuck = tokio::spawn(gate.order("k-stuck").try_send());
    up.wait_hits(ORDERS, 1).await;

    let out = show(&setup.config, "k-stuck").await;
    assert!(out.contains("state        in_flight\n"), "{out}");
    let lease = show_field(&out, "lease until");
    humantime::parse_rfc3339(lease.split(' ').next().unwrap()).expect("lease is RFC 3339");
    assert!(
        lease.contains("(in "),
        "a live lease is in the future: {out}"
    );
    assert!(!out.contains("status "), "{out}");
    gate.order("k-stuck").send().await.assert_problem(409);
    stuck.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_purge_expired_reports_how_many_records_it_deleted() {
    let up = Upstream::start().await;
    let setup = Setup::sqlite(up.addr);
    let gate = setup.start().await;
    // /payments keys live 1 s; /orders keys a day.
    for key in ["p-1", "p-2"] {
        let r = gate
            .post("/payments")
            .header("authorization", CREDENTIAL)
            .key(key)
            .body(BODY)
            .send()
            .await;
        assert_eq!(r.status(), 200, "{}", r.text());
    }
    assert_eq!(gate.order("k-kept").send().await.status(), 201);
    assert_eq!(
        keys(&setup.config, &["purge-expired"]).await,
        "deleted 0 expired records\n"
    );
    for key in ["p-1", "p-2"] {
        wait_for("the payment key to expire", || async {
            show(&setup.config, key)
                .await
                .contains("(expired")
                .then_some(())
        })
        .await;
    }
    assert_eq!(
        keys(&setup.config, &["purge-expired"]).await,
        "deleted 2 expired records\n"
    );
    assert!(show(&setup.config, "p-1").await.starts_with("no record"));
    assert!(show(&setup.config, "k-kept")
        .await
        .contains("state        completed"));
    assert_eq!(
        keys(&setup.config, &["purge-expired"]).await,
        "deleted 0 expired records\n"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_show_and_delete_work_against_a_postgres_backed_proxy() {
    require_postgres(&database_url()).await;
    let schema = unique_schema("ops");
    let up = Upstream::start().await;
    let url = database_url();
    let setup = Setup::new(up.addr, |c, _| postgres_store(c, &url, &schema));
    let gate = setup.start().await;
    let stored = gate
        .post("/orders?headers=1")
        .header("authorization", CREDENTIAL)
        .key("pg-key-1")
        .body(BODY)
        .send()
        .await;
    assert_eq!(stored.status(), 201, "{}", stored.text());

    let out = show(&setup.config, "pg-key-1").await;
    assert!(out.contains("state        completed\n"), "{out}");
    assert!(out.contains("status       201\n"), "{out}");
    assert!(out.contains("  location: /orders/1\n"), "{out}");
    assert!(out.contains("  x-multi: a, b\n  x-multi: c\n"), "{out}");
    assert!(
        !out.contains("pg-key-1") && !out.contains(CREDENTIAL),
        "{out}"
    );
    assert!(show(&setup.config, "pg-unknown")
        .await
        .starts_with("no record"));

    let deleted = keys(
        &setup.config,
        &["delete", "--scope-header-value", CREDENTIAL, "pg-key-1"],
    )
    .await;
    assert!(deleted.starts_with("deleted key id "), "{deleted}");
    let rerun = gate
        .post("/orders?headers=1")
        .header("authorization", CREDENTIAL)
        .key("pg-key-1")
        .body(BODY)
        .send()
        .await;
    assert!(!rerun.replayed());
    assert_eq!(up.hits(ORDERS), 2);
    drop(gate);
    drop_schema(&database_url(), &schema).await;
}

// ===== keys resolve =====

/// A route that keeps unanswered keys as outcome unknown.
const KEEP: &str = "/keep";

/// `store`'s config plus [`KEEP`], with a 2 s upstream timeout.
fn with_keep_route(config: TestConfig) -> TestConfig {
    config
        .set("server.upstream_timeout", "2s")
        .route(Route::post(KEEP).set("on_ambiguous", "keep"))
}

/// `idemgate keys <args> --config <config>` logging at info, whatever
/// its exit code.
async fn keys_run(config: &Path, args: &[&str]) -> Run {
    let mut all = vec!["keys", "--config", config.to_str().expect("utf-8 path")];
    all.extend_from_slice(args);
    run_to_completion(&all, &[("RUST_LOG", "info")]).await
}

/// `keys resolve` of `key` in the test's scope, with `args` before it.
async fn resolve(config: &Path, args: &[&str], key: &str) -> Run {
    let all = [
        &["resolve", "--scope-header-value", CREDENTIAL][..],
        args,
        &[key],
    ]
    .concat();
    keys_run(config, &all).await
}

/// Two keys left outcome unknown, each way resolved; the refusals.
async fn resolve_settles_only_outcome_unknown_keys(setup: &Setup, up: &Upstream) {
    let gate = setup.start().await;
    let keep = |key: &str| {
        gate.post(KEEP)
            .header("authorization", CREDENTIAL)
            .key(key)
            .body(BODY)
    };
    up.push(Action::Delay(Duration::from_secs(4)));
    up.push(Action::Delay(Duration::from_secs(4)));
    let (a, b) = tokio::join!(keep("k-not-applied").send(), keep("k-applied").send());
    a.assert_problem(504);
    b.assert_problem(504);
    keep("k-applied").send().await.assert_problem(424);
    assert_eq!(up.hits(KEEP), 2);
    let unknown = show(&setup.config, "k-applied").await;
    assert!(unknown.contains("keys resolve"), "{unknown}");

    // The command line: exactly one verdict, and a reason.
    for bad in [
        &["--reason", "why"][..],
        &["--applied", "--not-applied", "--reason", "why"],
        &["--applied"],
        &["--applied", "--reason", " "],
    ] {
        let run = resolve(&setup.config, bad, "k-applied").await;
        assert_eq!(run.code, 2, "{bad:?}: {}{}", run.stdout, run.stderr);
    }
    let long = "x".repeat(501);
    let run = resolve(
        &setup.config,
        &["--applied", "--reason", &long],
        "k-applied",
    )
    .await;
    assert_eq!(run.code, 2, "{}", run.stderr);
    assert!(
        run.stderr.contains("at most 500 characters"),
        "{}",
        run.stderr
    );

    // Only an outcome-unknown record is settled.
    let absent = resolve(&setup.config, &["--applied", "--reason", "r"], "never-sent").await;
    assert_eq!(absent.code, 3, "{}{}", absent.stdout, absent.stderr);
    assert!(
        absent.stderr.contains("no record for key id"),
        "{}",
        absent.stderr
    );
    assert!(!absent.stderr.contains("never-sent"), "{}", absent.stderr);
    assert_eq!(gate.order("k-done").send().await.status(), 201);
    let done = resolve(&setup.config, &["--not-applied", "--reason", "r"], "k-done").await;
    assert_eq!(done.code, 1, "{}{}", done.stdout, done.stderr);
    assert!(
        done.stderr
            .contains("not outcome-unknown (state completed)")
            && done.stderr.contains("completed with status 201"),
        "{}",
        done.stderr
    );
    assert!(gate.order("k-done").send().await.replayed());
    up.push(Action::Delay(Duration::from_secs(30)));
    let busy = tokio::spawn(keep("k-busy").try_send());
    up.wait_hits(KEEP, 3).await;
    let in_flight = resolve(&setup.config, &["--not-applied", "--reason", "r"], "k-busy").await;
    assert_eq!(in_flight.code, 1, "{}", in_flight.stderr);
    assert!(
        in_flight.stderr.contains("(state in_flight)")
            && in_flight.stderr.contains("its lease is live until"),
        "{}",
        in_flight.stderr
    );
    busy.abort();

    // Not applied: released, the retry executes once.
    let released = resolve(
        &setup.config,
        &["--not-applied", "--reason", "no charge in the ledger"],
        "k-not-applied",
    )
    .await;
    assert_eq!(released.code, 0, "{}", released.stderr);
    assert!(
        released.stdout.starts_with("resolved key id "),
        "{}",
        released.stdout
    );
    assert!(
        !released.stdout.contains("k-not-applied"),
        "{}",
        released.stdout
    );
    assert!(
        released.stderr.contains("decision=\"not_applied\"")
            || released.stderr.contains("decision=not_applied"),
        "the resolve is logged: {}",
        released.stderr
    );
    assert!(
        !released.stderr.contains("k-not-applied"),
        "{}",
        released.stderr
    );
    let rerun = keep("k-not-applied").send().await;
    assert_eq!(rerun.status(), 200, "{}", rerun.text());
    assert!(!rerun.replayed());
    assert!(keep("k-not-applied").send().await.replayed());
    assert_eq!(up.hits(KEEP), 4, "the released key executed once more");

    // Applied: retries get 410 and never reach the upstream.
    let reason = "order 81 shipped, per the warehouse";
    let applied = resolve(
        &setup.config,
        &["--applied", "--reason", reason],
        "k-applied",
    )
    .await;
    assert_eq!(applied.code, 0, "{}", applied.stderr);
    for _ in 0..2 {
        let gone = keep("k-applied").send().await.assert_problem(410);
        // Not the too-large-to-store sentence: nothing was received.
        assert!(
            gone["detail"]
                .as_str()
                .unwrap()
                .contains("settled this key as executed"),
            "{gone}"
        );
    }
    assert_eq!(up.hits(KEEP), 4, "the applied key never executes again");
    let out = show(&setup.config, "k-applied").await;
    assert!(out.contains("state        unstored\n"), "{out}");
    assert!(out.contains("status       none (executed"), "{out}");
    assert!(
        show_field(&out, "resolved").starts_with("applied at ")
            && out.contains(&format!(": {reason}\n")),
        "{out}"
    );
    let again = resolve(&setup.config, &["--applied", "--reason", "r"], "k-applied").await;
    assert_eq!(again.code, 1, "{}", again.stderr);
    assert!(
        again.stderr.contains("already resolved as applied"),
        "{}",
        again.stderr
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_resolve_settles_an_unknown_outcome_on_sqlite() {
    let up = Upstream::start().await;
    let setup = Setup::new(up.addr, |c, dir| with_keep_route(sqlite_store(c, dir)));
    resolve_settles_only_outcome_unknown_keys(&setup, &up).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_resolve_settles_an_unknown_outcome_on_postgres() {
    require_postgres(&database_url()).await;
    let schema = unique_schema("resolve");
    let up = Upstream::start().await;
    let url = database_url();
    let setup = Setup::new(up.addr, |c, _| {
        with_keep_route(postgres_store(c, &url, &schema))
    });
    resolve_settles_only_outcome_unknown_keys(&setup, &up).await;
    drop_schema(&database_url(), &schema).await;
}

/// Through the Redis fast path: the 410s after an applied resolve are
/// answered alike from PostgreSQL and from the copy Redis caches.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_resolve_settles_an_unknown_outcome_behind_the_redis_fast_path() {
    require_postgres(&database_url()).await;
    support::services::require_redis(&support::services::redis_url());
    let schema = unique_schema("resolve_redis");
    let up = Upstream::start().await;
    let (url, redis) = (database_url(), support::services::redis_url());
    let setup = Setup::new(up.addr, |c, _| {
        with_keep_route(postgres_store(c, &url, &schema))
            .set("redis.url", redis.as_str())
            .set("redis.prefix", schema.as_str())
    });
    resolve_settles_only_outcome_unknown_keys(&setup, &up).await;
    drop_schema(&database_url(), &schema).await;
}

// ===== environment overrides =====

/// A postgres config without `store.url`.
fn pg_no_url() -> String {
    TestConfig::default()
        .set("server.listen", "127.0.0.1:18080")
        .set("server.upstream", "http://127.0.0.1:3000")
        .set("store.backend", "postgres")
        .route(Route::post(ORDERS))
        .render()
}

async fn check_config(text: &str, env: &[(&str, &str)]) -> Run {
    run_on_config_text(&["check-config"], text, env).await.0
}

#[tokio::test]
async fn check_config_takes_the_store_url_from_the_environment_and_masks_its_password() {
    let without = check_config(&pg_no_url(), &[]).await;
    assert_eq!(without.code, 64, "{}{}", without.stdout, without.stderr);
    assert!(
        without.stderr.contains("IDEMGATE_STORE_URL"),
        "{}",
        without.stderr
    );

    let run = check_config(
        &pg_no_url(),
        &[(
            "IDEMGATE_STORE_URL",
            "postgres://u:secret@127.0.0.1:5432/test",
        )],
    )
    .await;
    assert_eq!(run.code, 0, "{}{}", run.stdout, run.stderr);
    assert!(
        run.stdout.contains("postgres://u:****@127.0.0.1:5432/test"),
        "{}",
        run.stdout
    );
    assert!(!run.stdout.contains("secret"), "{}", run.stdout);
    assert!(!run.stderr.contains("secret"), "{}", run.stderr);
}

/// PostgreSQL (libpq and tokio-postgres alike) also takes the password as a
/// query parameter; `mask_url` only masks `user:password@`.
#[tokio::test]
async fn check_config_masks_a_password_given_as_a_query_parameter() {
    let run = check_config(
        &pg_no_url(),
        &[(
            "IDEMGATE_STORE_URL",
            "postgres://u@127.0.0.1:5432/test?password=secret",
        )],
    )
    .await;
    assert_eq!(run.code, 0, "{}{}", run.stdout, run.stderr);
    assert!(!run.stdout.contains("secret"), "{}", run.stdout);
}

#[tokio::test]
async fn check_config_prints_the_upstream_and_listen_address_from_the_environment() {
    let file_only =
        check_config(&pg_no_url(), &[("IDEMGATE_STORE_URL", "postgres://u@h/db")]).await;
    assert_eq!(file_only.code, 0, "{}", file_only.stderr);
    assert!(
        file_only.stdout.contains("listen     127.0.0.1:18080"),
        "{}",
        file_only.stdout
    );
    assert!(
        file_only.stdout.contains("http://127.0.0.1:3000"),
        "{}",
        file_only.stdout
    );

    let run = check_config(
        &pg_no_url(),
        &[
            ("IDEMGATE_STORE_URL", "postgres://u@h/db"),
            ("IDEMGATE_UPSTREAM", "http://127.0.0.1:4999"),
            ("IDEMGATE_LISTEN", "127.0.0.1:4998"),
        ],
    )
    .await;
    assert_eq!(run.code, 0, "{}", run.stderr);
    assert!(
        run.stdout.contains("listen     127.0.0.1:4998\n"),
        "{}",
        run.stdout
    );
    assert!(
        run.stdout.contains("upstream   http://127.0.0.1:4999"),
        "{}",
        run.stdout
    );
    assert!(
        !run.stdout.contains("18080") && !run.stdout.contains(":3000"),
        "{}",
        run.stdout
    );
}

#[tokio::test]
async fn a_bad_listen_address_in_the_environment_is_exit_64_naming_the_variable() {
    let run = check_config(
        &pg_no_url(),
        &[
            ("IDEMGATE_STORE_URL", "postgres://u@h/db"),
            ("IDEMGATE_LISTEN", "not-an-address"),
        ],
    )
    .await;
    assert_eq!(run.code, 64, "{}{}", run.stdout, run.stderr);
    assert!(run.stderr.contains("IDEMGATE_LISTEN"), "{}", run.stderr);
    assert!(run.stderr.contains("not-an-address"), "{}", run.stderr);

    let bad_upstream = check_config(
        &pg_no_url(),
        &[
            ("IDEMGATE_STORE_URL", "postgres://u@h/db"),
            ("IDEMGATE_UPSTREAM", "ftp://example"),
        ],
    )
    .await;
    assert_eq!(bad_upstream.code, 64, "{}", bad_upstream.stderr);
    assert!(
        bad_upstream.stderr.contains("IDEMGATE_UPSTREAM"),
        "{}",
        bad_upstream.stderr
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_sends_requests_to_the_upstream_and_listens_where_the_environment_says() {
    let up = Upstream::start().await;
    let nowhere = Upstream::refusing_addr();
    // The file names an upstream nothing listens on, and another port.
    let setup = Setup::sqlite(nowhere);
    let listen = free_port();
    let upstream = format!("http://{}", up.addr);
    let env_listen = listen.to_string();
    let gate = ServeProcess::start(
        &setup.config,
        listen,
        setup.admin,
        &[
            ("IDEMGATE_UPSTREAM", &upstream),
            ("IDEMGATE_LISTEN", &env_listen),
        ],
    )
    .await;
    let r = gate.order("k-env").send().await;
    assert_eq!(r.status(), 201, "{}\n{}", r.text(), gate.log());
    assert_eq!(up.hits(ORDERS), 1);
    assert!(
        TcpStream::connect(setup.listen).await.is_err(),
        "the file's listen address is not used"
    );
}

// ===== logs and signals =====

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_access_logs_carry_outcome_status_route_and_key_id_but_no_secrets() {
    let up = Upstream::start().await;
    let setup = Setup::new(up.addr, |c, dir| {
        sqlite_store(c, dir)
            .set("log.format", "json")
            .set("log.level", "idemgate=debug")
    });
    // The config's log level, not the harness's RUST_LOG.
    let gate = ServeProcess::start_with(&setup.config, setup.listen, setup.admin, &[], |cmd| {
        cmd.env_remove("RUST_LOG");
    })
    .await;
    let key = "raw-key-3c9d41";
    let body = r#"{"card":"body-marker-77aa"}"#;
    let send = |body: &'static str| {
        gate.post(ORDERS)
            .header("authorization", CREDENTIAL)
            .key(key)
            .body(body)
            .send()
    };
    assert_eq!(send(body).await.status(), 201);
    assert!(send(body).await.replayed());
    send(r#"{"card":"other-body-marker-88bb"}"#)
        .await
        .assert_problem(422);
    gate.post(ORDERS)
        .header("authorization", CREDENTIAL)
        .key("\"unterminated-quoting-key-5e")
        .body(body)
        .send()
        .await
        .assert_problem(400);

    let lines = wait_for("four access log lines", || async {
        let log = gate.log();
        let access: Vec<serde_json::Value> = log
            .lines()
            .filter(|l| l.contains("idemgate::access"))
            .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
            .collect();
        (access.len() >= 4).then_some(access)
    })
    .await;
    let log = gate.log();
    for line in log.lines() {
        let v: serde_json::Value =
            serde_json::from_str(line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}"));
        assert!(v.is_object(), "{line}");
    }
    let outcomes: Vec<_> = lines.iter().map(|l| l["outcome"].clone()).collect();
    assert_eq!(
        outcomes,
        ["forwarded", "replayed", "mismatch", "invalid_key"],
        "{log}"
    );
    let statuses: Vec<_> = lines.iter().map(|l| l["status"].clone()).collect();
    assert_eq!(statuses, [201, 201, 422, 400], "{log}");
    for l in &lines {
        assert_eq!(l["route"], ORDERS, "{l}");
        assert_eq!(l["method"], "POST", "{l}");
        assert!(l["key.id"].is_string(), "{l}");
    }
    let id = lines[0]["key.id"].as_str().unwrap();
    assert!(id != "-" && !id.is_empty(), "{log}");
    assert_eq!(lines[1]["key.id"], id, "the retry names the same key id");
    assert_eq!(lines[2]["key.id"], id);
    for secret in [
        key,
        CREDENTIAL,
        "t-ops-credential",
        "quoting-key-5e",
        "body-marker-77aa",
        "other-body-marker-88bb",
    ] {
        assert!(!log.contains(secret), "{secret:?} is in the log:\n{log}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_lets_an_in_flight_request_finish_and_exits_0() {
    let up = Upstream::start().await;
    let setup = Setup::sqlite(up.addr);
    let mut gate = setup.start().await;
    up.push(Action::Delay(Duration::from_millis(800)));
    let slow = tokio::spawn(gate.order("k-term").send());
    up.wait_hits(ORDERS, 1).await;
    gate.terminate();
    let r = slow.await.unwrap();
    assert_eq!(r.status(), 201, "{}", r.text());
    assert!(!r.replayed());
    assert_eq!(gate.exited().await, Some(0), "{}", gate.log());
    assert!(TcpStream::connect(gate.listen).await.is_err());

    // The drained request was recorded: a restart replays it.
    let again = setup.start().await;
    let retry = again.order("k-term").send().await;
    assert!(retry.replayed(), "{retry:?}");
    assert_eq!(retry.body, r.body);
    assert_eq!(up.hits(ORDERS), 1);
}

#[tokio::test]
async fn idemgate_config_in_the_environment_names_the_file_when_no_flag_is_given() {
    let dir = tempfile::TempDir::new().unwrap();
    let file = dir.path().join("from-env.toml");
    memory_config().write(&file);
    let path = file.to_str().unwrap();
    let run = run_to_completion(&["check-config"], &[("IDEMGATE_CONFIG", path)]).await;
    assert_eq!(run.code, 0, "{}", run.stderr);
    assert!(
        run.stdout.starts_with(&format!("{path}: ok")),
        "{}",
        run.stdout
    );
    assert!(run.stdout.contains("store      memory"), "{}", run.stdout);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_enables_the_redis_fast_path_from_the_environment_and_counts_its_hits() {
    require_postgres(&database_url()).await;
    support::services::require_redis(&support::services::redis_url());
    let schema = unique_schema("ops");
    let _keys = support::services::RedisPrefix(schema.clone());
    let up = Upstream::start().await;
    let url = database_url();
    let setup = Setup::new(up.addr, |c, _| {
        postgres_store(c, &url, &schema).set("redis.prefix", schema.as_str())
    });
    let redis = support::services::redis_url();
    let gate = setup
        .start_with_env(&[("IDEMGATE_REDIS_URL", &redis)])
        .await;
    assert_eq!(gate.order("k-fast").send().await.status(), 201);
    let replay = gate.order("k-fast").send().await;
    assert!(replay.replayed(), "{replay:?}");
    assert_eq!(up.hits(ORDERS), 1);

    let text = gate.admin_get("/metrics").send().await.text();
    for (series, value) in [
        ("idemgate_redis_fast_path_hits_total", "1"),
        ("idemgate_redis_fast_path_misses_total", "1"),
        ("idemgate_redis_fast_path_errors_total", "0"),
    ] {
        assert!(
            text.lines().any(|l| l == format!("{series} {value}")),
            "{series} {value}:\n{text}"
        );
    }
    drop(gate);
    drop_schema(&database_url(), &schema).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_applies_the_schema_once_and_then_reports_it_current() {
    require_postgres(&database_url()).await;
    let schema = unique_schema("ops");
    let url = database_url();
    let setup = Setup::new(Upstream::refusing_addr(), |c, _| {
        postgres_store(c, &url, &schema)
    });
    let config = setup.config.to_str().unwrap();
    let first = run_to_completion(&["migrate", "--config", config], &[]).await;
    assert_eq!(first.code, 0, "{}", first.stderr);
    assert!(
        first
            .stdout
            .contains(&format!("schema {schema:?} is current")),
        "{}",
        first.stdout
    );
    assert!(
        !first.stdout.contains("(0 migration(s)"),
        "{}",
        first.stdout
    );
    let second = run_to_completion(&["migrate", "--config", config], &[]).await;
    assert_eq!(second.code, 0, "{}", second.stderr);
    assert!(
        second.stdout.contains("(0 migration(s) applied now)"),
        "{}",
        second.stdout
    );
    // keys works on the migrated schema without a proxy running.
    assert!(show(&setup.config, "nothing-yet")
        .await
        .starts_with("no record"));
    drop_schema(&database_url(), &schema).await;

    let sqlite = Setup::sqlite(Upstream::refusing_addr());
    let run = run_to_completion(
        &["migrate", "--config", sqlite.config.to_str().unwrap()],
        &[],
    )
    .await;
    assert_eq!(run.code, 0, "{}", run.stderr);
    assert!(run.stdout.contains("nothing to migrate"), "{}", run.stdout);
}

#[tokio::test]
async fn keys_commands_refuse_the_memory_store_and_malformed_keys_with_a_reason() {
    let dir = tempfile::TempDir::new().unwrap();
    let memory = dir.path().join("memory.toml");
    memory_config().write(&memory);
    let run = run_to_completion(
        &[
            "keys",
            "--config",
            memory.to_str().unwrap(),
            "show",
            "--anonymous",
            "k",
        ],
        &[],
    )
    .await;
    assert_ne!(run.code, 0, "{}", run.stdout);
    assert!(run.stderr.contains("memory store"), "{}", run.stderr);

    let sqlite = Setup::sqlite(Upstream::refusing_addr());
    let config = sqlite.config.to_str().unwrap();
    let run = run_to_completion(
        &[
            "keys",
            "--config",
            config,
            "show",
            "--anonymous",
            "\"unterminated",
        ],
        &[],
    )
    .await;
    assert_ne!(run.code, 0, "{}", run.stdout);
    assert!(run.stderr.contains("invalid key"), "{}", run.stderr);
    let run = run_to_completion(
        &["keys", "--config", config, "show", "--scope", "zz", "k"],
        &[],
    )
    .await;
    assert_ne!(run.code, 0, "{}", run.stdout);
    assert!(run.stderr.contains("64 hex characters"), "{}", run.stderr);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_commands_find_keys_of_a_proxy_with_a_scope_secret_only_with_that_secret() {
    const SECRET: (&str, &str) = ("IDEMGATE_SCOPE_SECRET", "ops-scope-secret-0123456789");
    let up = Upstream::start().await;
    let setup = Setup::sqlite(up.addr);
    let gate = setup.start_with_env(&[SECRET]).await;
    let stored = gate
        .post(ORDERS)
        .header("authorization", CREDENTIAL)
        .key("k-keyed")
        .body(BODY)
        .send()
        .await;
    assert_eq!(stored.status(), 201, "{}", stored.text());
    let cfg = setup.config.to_str().unwrap();
    let args = [
        "keys",
        "--config",
        cfg,
        "show",
        "--scope-header-value",
        CREDENTIAL,
        "k-keyed",
    ];
    let with = run_to_completion(&args, &[SECRET]).await;
    assert!(
        with.stdout.contains("state        completed"),
        "{}",
        with.stdout
    );
    assert_eq!(with.code, 0, "{}", with.stderr);
    let without = run_to_completion(&args, &[]).await;
    assert_eq!(
        without.code, 3,
        "keys show exits 3 for a key with no record: {}",
        without.stderr
    );
    assert!(
        without.stdout.starts_with("no record"),
        "{}",
        without.stdout
    );
}

/// A delivery route's key (a preset's fixed consumer scope, a key from the
/// body) is found and deleted with `--scope-value`, and the next delivery
/// then runs again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_commands_name_a_delivery_routes_consumer_scope() {
    let up = Upstream::start().await;
    let setup = Setup::new(up.addr, |c, dir| {
        sqlite_store(c, dir).route(Route::post("/hooks/stripe").set("preset", "stripe"))
    });
    let gate = setup.start().await;
    let event = r#"{"id":"evt_1","type":"charge.succeeded","pending_webhooks":1}"#;
    let deliver = || gate.post("/hooks/stripe").body(event).send();
    assert_eq!(deliver().await.status(), 200);
    let scope = ["--scope-value", "stripe:/hooks/stripe"];
    let shown = keys(&setup.config, &[&["show"][..], &scope, &["evt_1"]].concat()).await;
    assert!(shown.contains("state        completed"), "{shown}");
    let deleted = keys(
        &setup.config,
        &[&["delete"][..], &scope, &["evt_1"]].concat(),
    )
    .await;
    assert!(deleted.starts_with("deleted key id "), "{deleted}");
    let again = deliver().await;
    assert_eq!(again.status(), 200, "{}", again.text());
    assert!(!again.replayed(), "the deleted delivery runs again");
    assert_eq!(up.hits("/hooks/stripe"), 2);
}
