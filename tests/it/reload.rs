//! Reloading the config with SIGHUP, on the real binary: under continuous
//! loopback load (bounded) no request fails; a request in flight finishes
//! under the config it started with; routes change behaviour (a route
//! becomes protected); a bad file is refused with check-config's message
//! and the old config keeps serving; settings only a restart changes are
//! named; every reload is counted.

use crate::support::{
    metric_value, run_to_completion, wait_for, Http1Conn, Req, Route, ServeProcess, TestConfig,
    Upstream, ORDERS,
};
use http::Method;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

const BODY: &str = r#"{"item":"book","qty":1}"#;
/// Per worker: the load is bounded in count as well as in time.
const MAX_REQUESTS_PER_WORKER: usize = 3_000;

fn config(up: &Upstream, listen: std::net::SocketAddr, admin: std::net::SocketAddr) -> TestConfig {
    TestConfig::new(up.addr)
        .listen(listen, admin)
        .set("store.backend", "memory")
        .route(Route::post(ORDERS))
}

async fn reloads(gate: &ServeProcess, result: &str, n: u64) {
    let series = format!("idemgate_config_reloads_total{{result=\"{result}\"}}");
    wait_for(&format!("{series} to reach {n}"), || async {
        let text = gate.admin_get("/metrics").send().await.text();
        (metric_value(&text, &series) >= n).then_some(())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sighup_reloads_routes_under_load_without_failing_a_request() {
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("idemgate.toml");
    let (listen, admin) = (crate::support::free_port(), crate::support::free_port());
    config(&up, listen, admin).write(&path);
    let gate = ServeProcess::start(&path, listen, admin, &[]).await;
    let metrics = gate.admin_get("/metrics").send().await.text();
    assert!(
        metric_value(
            &metrics,
            "idemgate_config_last_reload_success_timestamp_seconds"
        ) > 0,
        "{metrics}"
    );

    // Load: every request carries a fresh key, so each one is a success
    // whether /payments is protected or not.
    let stop = Arc::new(AtomicBool::new(false));
    let sent = Arc::new(AtomicUsize::new(0));
    let failures = Arc::new(Mutex::new(Vec::<String>::new()));
    let workers: Vec<_> = (0..4)
        .map(|w| {
            let (stop, sent, failures) = (stop.clone(), sent.clone(), failures.clone());
            let base = format!("http://{listen}");
            tokio::spawn(async move {
                // Half the workers keep one connection across the reloads.
                let mut conn = if w % 2 == 0 {
                    Some(Http1Conn::open(listen).await)
                } else {
                    None
                };
                for i in 0..MAX_REQUESTS_PER_WORKER {
                    if stop.load(Ordering::Relaxed) {
                        break;
                    }
                    let path = if i % 2 == 0 { "/payments" } else { ORDERS };
                    let req = Req::new(Method::POST, format!("{base}{path}"))
                        .key(&format!("w{w}-{i}"))
                        .body(BODY);
                    let result = match conn.as_mut() {
                        Some(c) => Ok(c.send(req).await),
                        None => req.try_send().await,
                    };
                    sent.fetch_add(1, Ordering::Relaxed);
                    match result {
                        Ok(r) if r.status() < 300 => {}
                        Ok(r) => failures.lock().unwrap().push(format!(
                            "{path}: {} {}",
                            r.status(),
                            r.text()
                        )),
                        Err(e) => failures.lock().unwrap().push(format!("{path}: {e}")),
                    }
                }
            })
        })
        .collect();
    wait_for("the load to start", || async {
        (sent.load(Ordering::Relaxed) > 50).then_some(())
    })
    .await;

    // In flight across the reload: unprotected when it started.
    let slow = tokio::spawn(
        gate.post("/payments?delay_ms=1500")
            .key("k-slow")
            .body(BODY)
            .send(),
    );
    up.wait_hits("/payments", 1).await;
    tokio::time::sleep(Duration::from_millis(200)).await;

    // /payments becomes protected; max_connections can only change on a restart.
    config(&up, listen, admin)
        .route(Route::post("/payments"))
        .set("server.max_connections", 5000)
        .write(&path);
    gate.hangup();
    reloads(&gate, "ok", 1).await;
    let missing = gate.post("/payments").body(BODY).send().await;
    missing.assert_problem(400);
    let first = gate.post("/payments").key("k-new").body(BODY).send().await;
    assert_eq!(first.status(), 200, "{}", first.text());
    assert!(gate
        .post("/payments")
        .key("k-new")
        .body(BODY)
        .send()
        .await
        .replayed());
    let log = gate.log();
    assert!(
        log.contains("only change on a restart") && log.contains("server.max_connections"),
        "{log}"
    );

    let slow = slow.await.unwrap();
    assert_eq!(slow.status(), 200, "{}", slow.text());
    assert!(!slow.replayed());
    let again = gate
        .post("/payments?delay_ms=1500")
        .key("k-slow")
        .body(BODY)
        .send()
        .await;
    assert!(
        !again.replayed(),
        "the slow request ran under the config it started with (unprotected): nothing was stored for it"
    );

    // A bad file: refused with check-config's message, the old config serves.
    std::fs::write(
        &path,
        config(&up, listen, admin)
            .route(Route::post("/payments").set("methods", vec!["PSOT"]))
            .render(),
    )
    .unwrap();
    let checked =
        run_to_completion(&["check-config", "--config", path.to_str().unwrap()], &[]).await;
    assert_eq!(checked.code, 64, "{}", checked.stdout);
    gate.hangup();
    reloads(&gate, "error", 1).await;
    let refusal = checked.stderr.trim();
    assert!(refusal.starts_with("invalid configuration: "), "{refusal}");
    assert!(
        gate.log().contains(refusal),
        "{refusal}\nnot in\n{}",
        gate.log()
    );
    gate.post("/payments")
        .body(BODY)
        .send()
        .await
        .assert_problem(400);

    stop.store(true, Ordering::Relaxed);
    for w in workers {
        w.await.unwrap();
    }
    let failures = failures.lock().unwrap().clone();
    assert!(
        failures.is_empty(),
        "{} of {} requests failed across the reloads: {:?}",
        failures.len(),
        sent.load(Ordering::Relaxed),
        &failures[..failures.len().min(5)]
    );
    let text = gate.admin_get("/metrics").send().await.text();
    assert_eq!(
        metric_value(&text, "idemgate_config_reloads_total{result=\"ok\"}"),
        1
    );
    assert_eq!(
        metric_value(&text, "idemgate_config_reloads_total{result=\"error\"}"),
        1
    );
}

/// `server.watch_config = true`: a change of the file's content reloads it
/// without a signal; a bad one is refused the same way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watched_config_file_reloads_when_it_changes() {
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("idemgate.toml");
    let (listen, admin) = (crate::support::free_port(), crate::support::free_port());
    let watched = || config(&up, listen, admin).set("server.watch_config", true);
    watched().write(&path);
    let gate = ServeProcess::start(&path, listen, admin, &[]).await;
    let open = gate.post("/payments").body(BODY).send().await;
    assert_eq!(open.status(), 200, "not protected yet: {}", open.text());

    watched().route(Route::post("/payments")).write(&path);
    reloads(&gate, "ok", 1).await;
    gate.post("/payments")
        .body(BODY)
        .send()
        .await
        .assert_problem(400);

    std::fs::write(&path, "[server\n").unwrap();
    reloads(&gate, "error", 1).await;
    gate.post("/payments")
        .body(BODY)
        .send()
        .await
        .assert_problem(400);
    assert!(
        gate.log().contains("invalid configuration: "),
        "{}",
        gate.log()
    );
}

/// The protected route, last in the file: a writer's first write cut
/// before it leaves a valid config without it.
const PAYMENTS_ROUTE: &str = "\n[[route]]\nmethods = [\"POST\"]\npath = \"/payments\"\n";

/// Rewrites `path` in place (same inode) in two writes `gap` apart, as
/// an editor or `cat > file` on a slow volume can: first `first`, then
/// `rest`.
async fn rewrite_in_place(path: &std::path::Path, first: &str, rest: &str, gap: Duration) {
    use std::io::Write;
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .truncate(true)
        .open(path)
        .unwrap();
    file.write_all(first.as_bytes()).unwrap();
    file.flush().unwrap();
    tokio::time::sleep(gap).await;
    file.write_all(rest.as_bytes()).unwrap();
    file.flush().unwrap();
}

/// Regression (issue 17, item 3): with `watch_config`, a file rewritten in
/// place in two writes 1.9 s apart had its first half (a valid prefix
/// without the protected route) applied, and duplicates ran twice. Now
/// only content that stayed the same across a whole read interval is
/// applied: while three such rewrites run, `/payments` keeps refusing a
/// request without a key and replaying a repeated one, and each complete
/// file is applied once. An atomic rename (`mv tmp idemgate.toml`) is
/// applied at the next read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watched_file_rewritten_in_place_never_applies_its_first_half() {
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("idemgate.toml");
    let (listen, admin) = (crate::support::free_port(), crate::support::free_port());
    // Without /payments: the valid prefix of each version.
    let version = |timeout_s: u64| {
        config(&up, listen, admin)
            .set("server.watch_config", true)
            .set("server.upstream_timeout", format!("{timeout_s}s"))
            .render()
    };
    std::fs::write(&path, version(30) + PAYMENTS_ROUTE).unwrap();
    let gate = ServeProcess::start(&path, listen, admin, &[]).await;
    gate.post("/payments")
        .body(BODY)
        .send()
        .await
        .assert_problem(400);

    // Probes /payments until `stop`: a keyless request must be refused,
    // and each key run once (its repeat replayed).
    let stop = Arc::new(AtomicBool::new(false));
    let probe = {
        let (stop, base) = (stop.clone(), gate.url("/payments"));
        tokio::spawn(async move {
            let mut problems = Vec::new();
            let mut keys = 0;
            while !stop.load(Ordering::Relaxed) {
                let req = || Req::new(Method::POST, base.clone()).body(BODY);
                let keyless = req().send().await;
                if keyless.status() != 400 {
                    problems.push(format!("keyless: {}", keyless.status()));
                }
                let key = format!("probe-{keys}");
                keys += 1;
                let first = req().key(&key).send().await;
                let again = req().key(&key).send().await;
                if first.status() != 200 || !again.replayed() {
                    problems.push(format!(
                        "{key}: {} then {} (replayed: {})",
                        first.status(),
                        again.status(),
                        again.replayed()
                    ));
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            (keys, problems)
        })
    };
    for (round, timeout_s) in [(1, 7), (2, 8), (3, 9)] {
        // Not in step with the watcher's reads (every 2 s): the first
        // half is on disk when one comes.
        tokio::time::sleep(Duration::from_millis(700 * round)).await;
        let gap = Duration::from_millis(1900);
        rewrite_in_place(&path, &version(timeout_s), PAYMENTS_ROUTE, gap).await;
        reloads(&gate, "ok", round).await;
    }
    // Past any read that could still see a half.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    stop.store(true, Ordering::Relaxed);
    let (keys, problems) = probe.await.unwrap();
    assert!(problems.is_empty(), "the prefix was applied: {problems:?}");
    assert_eq!(
        up.hits("/payments"),
        keys,
        "every probe key ran exactly once"
    );
    let text = gate.admin_get("/metrics").send().await.text();
    assert_eq!(
        metric_value(&text, "idemgate_config_reloads_total{result=\"ok\"}"),
        3,
        "each complete file applied once, no half"
    );

    // An atomic rename: applied at the next read, not an interval later.
    let tmp = dir.path().join("idemgate.toml.tmp");
    let refunds = "\n[[route]]\nmethods = [\"POST\"]\npath = \"/refunds\"\n";
    std::fs::write(&tmp, version(10) + PAYMENTS_ROUTE + refunds).unwrap();
    let renamed = std::time::Instant::now();
    std::fs::rename(&tmp, &path).unwrap();
    reloads(&gate, "ok", 4).await;
    let took = renamed.elapsed();
    assert!(
        took < Duration::from_millis(3000),
        "a rename applies at the next read (every 2 s), took {took:?}"
    );
    gate.post("/refunds")
        .body(BODY)
        .send()
        .await
        .assert_problem(400);
}

/// A config on the memory store with the body budget `budget` and
/// `POST /orders` limited to `limit`.
fn sized(
    up: &Upstream,
    listen: std::net::SocketAddr,
    admin: std::net::SocketAddr,
    budget: &str,
    limit: &str,
) -> TestConfig {
    TestConfig::new(up.addr)
        .listen(listen, admin)
        .set("store.backend", "memory")
        .set("server.max_buffered_body_bytes", budget)
        .route(Route::post(ORDERS).set("max_request_body", limit))
}

/// `serve` on [`sized`]; the file's path and directory go with it.
async fn start_sized(
    up: &Upstream,
    budget: &str,
    limit: &str,
) -> (ServeProcess, std::path::PathBuf, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("idemgate.toml");
    let (listen, admin) = (crate::support::free_port(), crate::support::free_port());
    sized(up, listen, admin, budget, limit).write(&path);
    let gate = ServeProcess::start(&path, listen, admin, &[]).await;
    (gate, path, dir)
}

/// Regression (issue 17, item 9): started with an 8 MiB body budget and a
/// route limit of 1 MiB, a SIGHUP raising both (64 MiB / 16 MiB) was
/// accepted with a restart-only warning, and every chunked POST to the
/// route then got 503 (its 16 MiB reservation never fit the 8 MiB that
/// runs). The reload is refused now, naming the field and the running
/// value, and the route keeps serving chunked bodies.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_past_the_running_body_budget_is_refused_and_chunked_bodies_still_pass() {
    let up = Upstream::start().await;
    let (gate, path, _dir) = start_sized(&up, "8MiB", "1MiB").await;
    let chunked = |key: &str| {
        gate.post(ORDERS)
            .key(key)
            .chunked(vec![bytes::Bytes::from_static(b"{\"item\":\"a\"}\n")])
    };
    assert_eq!(chunked("before").send().await.status(), 201);

    sized(&up, gate.listen, gate.admin, "64MiB", "16MiB").write(&path);
    gate.hangup();
    reloads(&gate, "error", 1).await;
    let log = gate.log();
    for needle in [
        "config reload refused",
        "max_request_body (16MiB)",
        "server.max_buffered_body_bytes (8MiB)",
        "line ",
    ] {
        assert!(log.contains(needle), "{needle:?} not in\n{log}");
    }
    let after = chunked("after").send().await;
    assert_eq!(after.status(), 201, "{}", after.text());
    assert_eq!(up.hits(ORDERS), 2);
}

/// Regression (issue 17, item 9b): a body without a length reserved its
/// route's whole `max_request_body` from the body budget before a byte
/// was read. With the limit equal to the budget (8 MiB), one stalled
/// chunked upload made every other chunked POST a 503. It reserves what
/// it has sent now: a 13-byte chunked POST passes beside it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_chunked_upload_reserves_only_what_it_sent() {
    use tokio::io::AsyncWriteExt;
    let up = Upstream::start().await;
    let (gate, _path, _dir) = start_sized(&up, "8MiB", "8MiB").await;
    let listen = gate.listen;
    let mut stalled = tokio::net::TcpStream::connect(listen).await.unwrap();
    stalled
        .write_all(
            b"POST /orders HTTP/1.1\r\nhost: x\r\nidempotency-key: stalled\r\n\
              transfer-encoding: chunked\r\n\r\n5\r\nhello\r\n",
        )
        .await
        .unwrap();
    wait_for("the stalled body to be reserved", || async {
        let text = gate.admin_get("/metrics").send().await.text();
        (metric_value(&text, "idemgate_buffered_body_bytes") > 0).then_some(())
    })
    .await;
    let small = gate
        .post(ORDERS)
        .key("small")
        .chunked(vec![bytes::Bytes::from_static(b"{\"item\":\"a\"}\n")])
        .send()
        .await;
    assert_eq!(small.status(), 201, "{}", small.text());
    drop(stalled);
}

/// `idemgate reload` (and `POST /-/reload` on the admin listener, from
/// loopback) reloads without a signal, for images without `kill`, and
/// says how it went: a route added takes effect, a bad file is refused
/// with check-config's message and the running config stays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idemgate_reload_asks_the_running_proxy_over_its_admin_listener() {
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("idemgate.toml");
    let (listen, admin) = (crate::support::free_port(), crate::support::free_port());
    config(&up, listen, admin).write(&path);
    let gate = ServeProcess::start(&path, listen, admin, &[]).await;
    let file = path.to_str().unwrap();
    assert!(gate.post("/payments").body(BODY).send().await.status() < 300);

    config(&up, listen, admin)
        .route(Route::post("/payments"))
        .write(&path);
    let asked = run_to_completion(&["reload", "--config", file], &[]).await;
    assert_eq!(asked.code, 0, "{asked:?}");
    assert_eq!(asked.stdout.trim(), "config reloaded");
    gate.post("/payments")
        .body(BODY)
        .send()
        .await
        .assert_problem(400);
    reloads(&gate, "ok", 1).await;

    // A bad file: the command checks it first, as check-config does; the
    // endpoint itself refuses it with the same message.
    let bad = config(&up, listen, admin)
        .route(Route::post("/payments").set("methods", vec!["PSOT"]))
        .render();
    std::fs::write(&path, bad).unwrap();
    let asked = run_to_completion(&["reload", "--config", file], &[]).await;
    assert_eq!(asked.code, 64, "{asked:?}");
    assert!(asked.stderr.contains("PSOT"), "{asked:?}");
    let url = format!("http://{admin}/-/reload");
    let refused = Req::new(Method::POST, url.clone()).send().await;
    assert_eq!(refused.status(), 422, "{}", refused.text());
    assert!(
        refused.text().starts_with(
            "config reload refused, the running config stays: invalid configuration: "
        ) && refused.text().contains("PSOT"),
        "{}",
        refused.text()
    );
    reloads(&gate, "error", 1).await;
    gate.post("/payments")
        .body(BODY)
        .send()
        .await
        .assert_problem(400);
    assert_eq!(Req::new(Method::GET, url).send().await.status(), 405);

    // No admin listener to ask: a usage error that says what to do.
    let text = TestConfig::new(up.addr)
        .set("store.backend", "memory")
        .render();
    let (run, _) = crate::support::run_on_config_text(&["reload"], &text, &[]).await;
    assert_eq!(run.code, 64, "{run:?}");
    assert!(run.stderr.contains("no [admin] listen"), "{run:?}");
}
