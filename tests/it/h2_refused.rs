//! Issue 17 defect 7: an HTTP/2 upstream's `REFUSED_STREAM`, or a `GOAWAY`
//! whose last-stream-id is below the request's stream, means the request
//! was not processed (RFC 9113 §8.7, §6.8). Through the real binary on an
//! `on_ambiguous = "keep"` route: the proxy sends it once more on a new
//! stream, and when that is refused too it releases the key (502), never
//! "outcome unknown" (424).

use crate::support::h2_refusing::{Act, RefusingH2Upstream};
use crate::support::{free_port, Route, ServeProcess, TestConfig, ORDERS};

/// `idemgate serve` with the scripted h2c upstream as its default upstream
/// and `POST /orders` protected with `on_ambiguous = "keep"`.
async fn serve(up: &RefusingH2Upstream, dir: &std::path::Path) -> ServeProcess {
    let (listen, admin) = (free_port(), free_port());
    let path = dir.join("idemgate.toml");
    TestConfig::new(up.addr)
        .listen(listen, admin)
        .set("store.backend", "memory")
        .set("server.upstream_protocol", "h2")
        .route(Route::post(ORDERS).set("on_ambiguous", "keep"))
        .write(&path);
    ServeProcess::start(&path, listen, admin, &[]).await
}

/// Pins defect 7 (REFUSED_STREAM): the refused request is sent again on a
/// new stream and its answer stored; before, the client got 502 and every
/// retry 424 until an operator deleted the key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_h2_stream_is_retried_once_and_its_answer_stored() {
    let up = RefusingH2Upstream::start(&[Act::Refuse]).await;
    let dir = tempfile::TempDir::new().expect("tempdir");
    let gate = serve(&up, dir.path()).await;
    let first = gate.post(ORDERS).key("r-1").body("{}").send().await;
    assert_eq!(first.status(), 201, "{}", first.text());
    assert_eq!((up.refused(), up.answered()), (1, 1));
    let again = gate.post(ORDERS).key("r-1").body("{}").send().await;
    assert!(again.replayed(), "the stored answer is replayed");
    assert_eq!(up.answered(), 1, "executed once");
}

/// Pins defect 7 (refused twice): the key is released (502 saying so), and
/// the client's retry executes instead of getting 424.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_refused_twice_releases_the_key_for_the_retry() {
    let up = RefusingH2Upstream::start(&[Act::Refuse, Act::Refuse]).await;
    let dir = tempfile::TempDir::new().expect("tempdir");
    let gate = serve(&up, dir.path()).await;
    let first = gate.post(ORDERS).key("r-2").body("{}").send().await;
    first.assert_problem(502);
    assert!(first.text().contains("released"), "{}", first.text());
    assert_eq!((up.refused(), up.answered()), (2, 0));
    let retry = gate.post(ORDERS).key("r-2").body("{}").send().await;
    assert_eq!(retry.status(), 201, "{}", retry.text());
    assert_eq!(up.answered(), 1);
}

/// Pins defect 7 (GOAWAY below the stream): the request the upstream
/// excluded is sent again on a new connection and executes once; no 424.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_goaway_below_the_requests_stream_is_retried_and_never_kept_unknown() {
    let up = RefusingH2Upstream::start(&[Act::GoAwayBelow]).await;
    let dir = tempfile::TempDir::new().expect("tempdir");
    let gate = serve(&up, dir.path()).await;
    let first = gate.post(ORDERS).key("g-1").body("{}").send().await;
    assert_eq!(first.status(), 201, "{}", first.text());
    assert_eq!((up.goaways(), up.answered()), (1, 1));
    let again = gate.post(ORDERS).key("g-1").body("{}").send().await;
    assert!(again.replayed(), "the stored answer is replayed");

    // GOAWAY on both tries: released, and the client's retry runs.
    let up = RefusingH2Upstream::start(&[Act::GoAwayBelow, Act::GoAwayBelow]).await;
    let dir = tempfile::TempDir::new().expect("tempdir");
    let gate = serve(&up, dir.path()).await;
    let first = gate.post(ORDERS).key("g-2").body("{}").send().await;
    first.assert_problem(502);
    let retry = gate.post(ORDERS).key("g-2").body("{}").send().await;
    assert_eq!(retry.status(), 201, "{}", retry.text());
    assert_eq!((up.goaways(), up.answered()), (2, 1));
}
