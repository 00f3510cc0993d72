//! The request id: a sane client `X-Request-Id` is kept, anything else is
//! replaced by a generated one; it reaches the upstream, comes back on the
//! response (a replay carries the current request's id, its body byte for
//! byte the stored one), names every problem+json (`instance`) and is in
//! the access log line with the other per-request fields.

use crate::support::{Backend, Proxy, Route, ServeProcess, TestConfig, Upstream, ORDERS};

const BODY: &str = r#"{"item":"book","qty":1}"#;

fn is_generated(id: &str) -> bool {
    id.len() == 32 && id.bytes().all(|b| b.is_ascii_hexdigit())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_ids_are_kept_or_generated_forwarded_and_returned() {
    let up = Upstream::start().await;
    let proxy = Proxy::start(Backend::Memory, up.addr).await;

    let kept = proxy
        .get("/catalog")
        .header("x-request-id", "abc-1")
        .send()
        .await;
    assert_eq!(kept.header("x-request-id"), Some("abc-1"));
    let seen = up.last();
    assert_eq!(seen.headers["x-request-id"], "abc-1");

    let fresh = proxy.get("/catalog").send().await;
    let id = fresh.header("x-request-id").expect("an id").to_string();
    assert!(is_generated(&id), "{id}");
    assert_eq!(up.last().headers["x-request-id"], id.as_str());

    let insane = proxy
        .get("/catalog")
        .header("x-request-id", "bad;id")
        .send()
        .await;
    let replaced = insane.header("x-request-id").unwrap();
    assert!(is_generated(replaced), "{replaced}");
    assert_eq!(up.last().headers.get_all("x-request-id").iter().count(), 1);

    // A replay answers with the current request's id, the stored body as is.
    let first = proxy
        .post(ORDERS)
        .key("k-1")
        .header("x-request-id", "first")
        .body(BODY)
        .send()
        .await;
    assert_eq!(first.status(), 201);
    assert_eq!(first.header("x-request-id"), Some("first"));
    let replay = proxy
        .post(ORDERS)
        .key("k-1")
        .header("x-request-id", "second")
        .body(BODY)
        .send()
        .await;
    assert!(replay.replayed());
    assert_eq!(replay.header("x-request-id"), Some("second"));
    assert_eq!(replay.body, first.body);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_problem_names_its_request_as_instance() {
    // Missing key (400), and an unreachable upstream (502) on either path.
    let proxy = Proxy::builder(Backend::Memory, Upstream::refusing_addr())
        .start()
        .await;
    let missing = proxy
        .post(ORDERS)
        .header("x-request-id", "req-400")
        .body(BODY)
        .send()
        .await;
    let p = missing.assert_problem(400);
    assert_eq!(p["instance"], "urn:idemgate:request:req-400", "{p}");
    assert_eq!(missing.header("x-request-id"), Some("req-400"));
    for req in [proxy.post(ORDERS).key("k-502"), proxy.get("/catalog")] {
        let r = req.send().await;
        let p = r.assert_problem(502);
        let id = r.header("x-request-id").unwrap();
        assert_eq!(p["instance"], format!("urn:idemgate:request:{id}"), "{p}");
        let detail = p["detail"].as_str().unwrap();
        assert!(
            detail.starts_with("the upstream could not be reached"),
            "{detail}"
        );
        assert!(!detail.contains("tcp connect"), "{detail}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_access_log_line_has_the_request_fields() {
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("idemgate.toml");
    let (listen, admin) = (crate::support::free_port(), crate::support::free_port());
    TestConfig::new(up.addr)
        .listen(listen, admin)
        .set("store.backend", "memory")
        .route(Route::post(ORDERS))
        .write(&path);
    let gate = ServeProcess::start_with(&path, listen, admin, &[], |cmd| {
        cmd.env("RUST_LOG", "warn,idemgate::access=info");
    })
    .await;
    let r = gate
        .post(ORDERS)
        .key("k-log")
        .header("x-request-id", "log-me-1")
        .header("user-agent", "ops-test/1.0")
        .body(BODY)
        .send()
        .await;
    assert_eq!(r.status(), 201);
    let line = crate::support::wait_for("the access log line", || async {
        gate.log()
            .lines()
            .find(|l| l.contains("log-me-1"))
            .map(str::to_string)
    })
    .await;
    for field in [
        "request.id=\"log-me-1\"",
        "protocol=HTTP/1.1",
        "user_agent=\"ops-test/1.0\"",
        &format!("bytes_in={}", BODY.len()),
        "bytes_out=",
        "upstream_ms=",
        "latency_ms=",
        "outcome=\"forwarded\"",
    ] {
        assert!(line.contains(field), "{field} not in {line}");
    }
    assert!(
        !line.contains('\u{1b}'),
        "no colour codes in a file: {line:?}"
    );
}
