//! Lifecycles: client hang-ups, restarts, a killed process, graceful
//! shutdown, and the binary's config handling.

use crate::support::{
    free_port, run_on_config_text, wait_for, wait_until, Action, Backend, H2Conn, Http1Conn, Proxy,
    Req, Route, ServeProcess, TestConfig, Upstream, ORDERS,
};
use http::Method;
use hyper_util::rt::TokioIo;
use std::net::SocketAddr;
use std::time::Duration;
use tokio::net::TcpStream;

const BODY: &str = r#"{"item":"lamp"}"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_disconnect_mid_request_still_stores_the_response_for_the_retry() {
    let up = Upstream::start().await;
    let proxy = Proxy::start(Backend::Sqlite, up.addr).await;
    up.push(Action::Delay(Duration::from_millis(600)));

    let stream = TcpStream::connect(proxy.addr).await.unwrap();
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .unwrap();
    let conn = tokio::spawn(conn);
    let req = proxy.post(ORDERS).key("k-hangup").body(BODY).build();
    let pending = tokio::spawn(async move { sender.send_request(req).await });
    up.wait_hits(ORDERS, 1).await;
    // Hang up while the upstream is still working.
    pending.abort();
    conn.abort();
    let _ = pending.await;
    let _ = conn.await;

    wait_until("the upstream to finish", || up.completed(ORDERS) == 1).await;
    wait_until("the detached execution to record its result", || {
        proxy.metrics.in_flight().get() == 0
    })
    .await;
    // The request the client abandoned is still counted.
    wait_until("the abandoned request to be counted", || {
        proxy.count(idemgate::metrics::Outcome::Forwarded) == 1
    })
    .await;
    let retry = proxy.post(ORDERS).key("k-hangup").body(BODY).send().await;
    assert_eq!(retry.status(), 201, "{}", retry.text());
    assert!(retry.replayed());
    assert_eq!(retry.json()["hits"], 1);
    assert_eq!(up.hits(ORDERS), 1);
}

#[tokio::test]
async fn replays_after_a_restart_on_the_same_sqlite_file() {
    let up = Upstream::start().await;
    let dir = tempfile::TempDir::new().unwrap();
    let db = dir.path().join("shared.db");
    let first_proxy = Proxy::builder(Backend::Sqlite, up.addr)
        .sqlite_file(&db)
        .start()
        .await;
    let first = first_proxy
        .post("/orders?headers=1")
        .key("k-restart")
        .body(BODY)
        .send()
        .await;
    assert_eq!(first.status(), 201);
    first_proxy.shutdown().await;

    let second_proxy = Proxy::builder(Backend::Sqlite, up.addr)
        .sqlite_file(&db)
        .start()
        .await;
    let again = second_proxy
        .post("/orders?headers=1")
        .key("k-restart")
        .body(BODY)
        .send()
        .await;
    assert!(again.replayed());
    assert_eq!(again.body, first.body);
    assert_eq!(again.header_all("x-multi"), ["a, b", "c"]);
    assert_eq!(up.hits(ORDERS), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn graceful_shutdown_lets_an_in_flight_request_finish_and_record() {
    let up = Upstream::start().await;
    let dir = tempfile::TempDir::new().unwrap();
    let db = dir.path().join("graceful.db");
    let mut proxy = Proxy::builder(Backend::Sqlite, up.addr)
        .sqlite_file(&db)
        .start()
        .await;
    up.push(Action::Delay(Duration::from_millis(600)));
    let slow = tokio::spawn(proxy.post(ORDERS).key("k-drain").body(BODY).send());
    up.wait_hits(ORDERS, 1).await;
    proxy.signal_shutdown();
    let r = slow.await.unwrap();
    assert_eq!(r.status(), 201);
    assert!(!r.replayed());
    proxy.stopped().await;
    assert!(
        TcpStream::connect(proxy.addr).await.is_err(),
        "a stopped proxy accepts no connections"
    );

    let next = Proxy::builder(Backend::Sqlite, up.addr)
        .sqlite_file(&db)
        .start()
        .await;
    let retry = next.post(ORDERS).key("k-drain").body(BODY).send().await;
    assert!(retry.replayed(), "the drained request was recorded");
    assert_eq!(retry.body, r.body);
    assert_eq!(up.hits(ORDERS), 1);
}

fn orders(listen: SocketAddr) -> Req {
    Req::new(Method::POST, format!("http://{listen}{ORDERS}"))
        .key("k-takeover")
        .body(BODY)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_process_claim_is_taken_over_after_its_lease() {
    let up = Upstream::start().await;
    let dir = tempfile::TempDir::new().unwrap();
    let (listen, admin) = (free_port(), free_port());
    let config = dir.path().join("idemgate.toml");
    TestConfig::new(up.addr)
        .listen(listen, admin)
        .set("store.backend", "sqlite")
        .set(
            "store.path",
            dir.path().join("takeover.db").display().to_string(),
        )
        .route(Route::post(ORDERS).set("lease", "2s"))
        .write(&config);

    let mut child = ServeProcess::start(&config, listen, admin, &[]).await;
    up.push(Action::Delay(Duration::from_secs(30)));
    let doomed = tokio::spawn(orders(listen).try_send());
    up.wait_hits(ORDERS, 1).await;
    child.kill();
    assert!(
        doomed.await.unwrap().is_err(),
        "the client sees the dead proxy"
    );

    let restarted = ServeProcess::start(&config, listen, admin, &[]).await;
    let early = orders(listen).send().await;
    early.assert_problem(409);
    assert!(early.header("retry-after").is_some());

    // Once the dead holder's lease runs out, the retry executes.
    let taken = wait_for("the lease to run out", || async {
        let r = orders(listen).send().await;
        (r.status() != 409).then_some(r)
    })
    .await;
    assert_eq!(taken.status(), 201, "{}", taken.text());
    assert!(!taken.replayed());
    assert_eq!(up.hits(ORDERS), 2);
    let replay = orders(listen).send().await;
    assert!(replay.replayed());
    assert_eq!(replay.body, taken.body);
    assert_eq!(up.hits(ORDERS), 2);

    let metrics = restarted.admin_get("/metrics").send().await.text();
    assert!(
        metrics.contains("idemgate_lease_takeovers_total{route=\"/orders\"} 1"),
        "{metrics}"
    );
}

/// A valid config, protecting `POST /orders`.
fn good() -> TestConfig {
    TestConfig::default()
        .set("server.upstream", "http://127.0.0.1:3000")
        .set("store.backend", "memory")
        .route(Route::post(ORDERS))
}

/// Line 4 is the mistake (a file as written by hand, to pin line numbers).
const BAD: &str = "[server]\nupstream = \"http://127.0.0.1:3000\"\n\n\
                   upstrem_timeout = \"5s\"\n";

#[tokio::test]
async fn check_config_accepts_a_good_file() {
    let (run, file) = run_on_config_text(&["check-config"], &good().render(), &[]).await;
    assert_eq!(run.code, 0, "{}", run.stderr);
    assert!(
        run.stdout.contains(&format!("{file}: ok")),
        "{}",
        run.stdout
    );
    assert!(run.stdout.contains("/orders"), "{}", run.stdout);
}

#[tokio::test]
async fn check_config_rejects_a_bad_file_naming_the_file_and_line() {
    let (run, file) = run_on_config_text(&["check-config"], BAD, &[]).await;
    let stderr = &run.stderr;
    assert_eq!(run.code, 64, "{stderr}");
    assert!(stderr.contains(&file), "{stderr}");
    assert!(stderr.contains("line 4"), "{stderr}");
    assert!(stderr.contains("upstrem_timeout"), "{stderr}");
}

#[tokio::test]
async fn check_config_names_the_line_of_a_bad_route() {
    let text = good().each_route("lease", "10ms").render();
    let (run, file) = run_on_config_text(&["check-config"], &text, &[]).await;
    let stderr = &run.stderr;
    assert_eq!(run.code, 64, "{stderr}");
    assert!(stderr.contains(&file), "{stderr}");
    assert!(stderr.contains("line "), "{stderr}");
    assert!(stderr.contains("lease"), "{stderr}");
}

#[tokio::test]
async fn serve_refuses_a_bad_config_with_the_same_message() {
    let (check, check_file) = run_on_config_text(&["check-config"], BAD, &[]).await;
    let (run, file) = run_on_config_text(&["serve"], BAD, &[]).await;
    let stderr = &run.stderr;
    assert_eq!(run.code, 64, "{stderr}");
    assert_eq!(run.code, check.code);
    assert!(
        stderr.contains(&file) && stderr.contains("line 4"),
        "{stderr}"
    );
    // The same text apart from the (different) temporary file name.
    assert_eq!(
        stderr.replace(&file, "<file>"),
        check.stderr.replace(&check_file, "<file>")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_keep_alive_connections_do_not_hold_up_shutdown() {
    let up = Upstream::start().await;
    // A grace period longer than the test's deadline: only closing idle
    // connections promptly lets `stopped` return in time.
    let mut proxy = Proxy::builder(Backend::Memory, up.addr)
        .set("server.shutdown_grace", "60s")
        .start()
        .await;
    let mut h1 = Http1Conn::open(proxy.addr).await;
    assert_eq!(h1.send(proxy.get("/idle")).await.status(), 200);
    let mut h2 = H2Conn::open(proxy.addr).await;
    assert_eq!(h2.send(proxy.get("/idle")).await.status(), 200);
    proxy.signal_shutdown();
    proxy.stopped().await;
    h1.close();
}
