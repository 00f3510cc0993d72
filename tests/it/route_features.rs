//! Route settings that decide what is stored and who shares a key:
//! `release_statuses` (which answers mean "not executed") and, on every
//! backend, the regressions they pin.

use crate::support::{backend_tests, Backend, Proxy, ORDERS};
use http::{Request, Response};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use idemgate::body::full;
use idemgate::metrics::Outcome;
use std::collections::VecDeque;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

backend_tests!(
    rate_limited_answer_releases_the_key_so_the_retry_executes,
    a_route_that_releases_only_5xx_stores_and_replays_a_429,
);

const BODY: &str = r#"{"item":"book","qty":1}"#;

/// Pins: an upstream `429 Retry-After: 1` was stored and replayed for the
/// whole ttl, so the request could never run under its key (issue 8,
/// defect 4). By default 408, 425, 429 and every 5xx release the key.
async fn rate_limited_answer_releases_the_key_so_the_retry_executes(backend: Backend) {
    let up = Scripted::start(vec![Answer {
        status: 429,
        headers: vec![("retry-after", "1")],
    }])
    .await;
    let proxy = Proxy::start(backend, up.addr).await;
    let limited = proxy.post(ORDERS).key("k-429").body(BODY).send().await;
    assert_eq!(limited.status(), 429);
    assert_eq!(limited.header("retry-after"), Some("1"), "passed on as is");
    assert_eq!(limited.text(), r#"{"hit":1}"#, "the upstream's own body");
    assert!(!limited.replayed());

    let retry = proxy.post(ORDERS).key("k-429").body(BODY).send().await;
    assert_eq!(retry.status(), 201, "the retry runs: {}", retry.text());
    assert!(!retry.replayed());
    assert_eq!(up.hits(), 2);
    let third = proxy.post(ORDERS).key("k-429").body(BODY).send().await;
    assert!(third.replayed());
    assert_eq!(third.body, retry.body);
    assert_eq!(up.hits(), 2, "the executed retry is stored");
    assert_eq!(proxy.count(Outcome::UpstreamError), 1);
}

/// `release_statuses = ["5xx"]` keeps the behaviour before the default
/// grew: a 429 is the request's outcome, stored and replayed.
async fn a_route_that_releases_only_5xx_stores_and_replays_a_429(backend: Backend) {
    let up = Scripted::start(vec![Answer {
        status: 429,
        headers: vec![("retry-after", "1")],
    }])
    .await;
    let proxy = Proxy::builder(backend, up.addr)
        .each_route("release_statuses", vec!["5xx"])
        .start()
        .await;
    let limited = proxy.post(ORDERS).key("k-429").body(BODY).send().await;
    assert_eq!(limited.status(), 429);
    let again = proxy.post(ORDERS).key("k-429").body(BODY).send().await;
    assert_eq!(again.status(), 429);
    assert!(again.replayed());
    assert_eq!(again.header("retry-after"), Some("1"));
    assert_eq!(again.body, limited.body);
    assert_eq!(up.hits(), 1);
}

// ===== an upstream with scripted answers =====

/// One answer of a [`Scripted`] upstream.
struct Answer {
    status: u16,
    headers: Vec<(&'static str, &'static str)>,
}

/// An upstream that answers with its queued [`Answer`]s, then `201`, each
/// with the body `{"hit":N}`; it counts the requests it received. The
/// shared test upstream cannot send arbitrary response headers
/// (`Retry-After`).
struct Scripted {
    addr: SocketAddr,
    hits: Arc<AtomicUsize>,
    task: JoinHandle<()>,
}

impl Scripted {
    async fn start(answers: Vec<Answer>) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let queue = Arc::new(Mutex::new(VecDeque::from(answers)));
        let hits = Arc::new(AtomicUsize::new(0));
        let counted = hits.clone();
        let task = tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let (queue, hits) = (queue.clone(), counted.clone());
                let svc = service_fn(move |req: Request<Incoming>| {
                    let (queue, hits) = (queue.clone(), hits.clone());
                    async move {
                        // Read the request whole before answering, as an API would.
                        let _ = req.into_body().collect().await;
                        let n = hits.fetch_add(1, Ordering::SeqCst) + 1;
                        let answer = queue.lock().unwrap().pop_front();
                        let answer = answer.unwrap_or(Answer {
                            status: 201,
                            headers: Vec::new(),
                        });
                        let mut resp = Response::builder().status(answer.status);
                        for (name, value) in answer.headers {
                            resp = resp.header(name, value);
                        }
                        Ok::<_, Infallible>(resp.body(full(format!(r#"{{"hit":{n}}}"#))).unwrap())
                    }
                });
                tokio::spawn(async move {
                    let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                        .serve_connection(TokioIo::new(stream), svc)
                        .await;
                });
            }
        });
        Self { addr, hits, task }
    }

    fn hits(&self) -> usize {
        self.hits.load(Ordering::SeqCst)
    }
}

impl Drop for Scripted {
    fn drop(&mut self) {
        self.task.abort();
    }
}
