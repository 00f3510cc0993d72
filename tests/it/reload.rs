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
