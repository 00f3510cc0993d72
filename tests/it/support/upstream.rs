//! The test upstream: a counting HTTP server (HTTP/1.1 and h2c) whose
//! answers are shaped by query parameters or queued [`Action`]s.

use super::serve::{server, TestServer};
use super::{free_port, wait_for, wait_until, ORDERS};
use bytes::Bytes;
use http::{HeaderMap, Method, Request, Response, StatusCode, Version};
use http_body_util::{BodyExt, StreamBody};
use hyper::body::{Frame, Incoming};
use idemgate::body::{boxed, full, BoxError, ProxyBody};
use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::net::TcpListener;

/// One request as the upstream saw it.
#[derive(Clone, Debug)]
pub struct Seen {
    pub method: Method,
    pub path: String,
    pub query: Option<String>,
    pub version: Version,
    pub headers: HeaderMap,
    pub body: Bytes,
}

/// A one-shot behaviour for the next request the upstream receives,
/// whatever its path or query (so a retry can be the same request).
#[derive(Clone, Debug)]
pub enum Action {
    Status(u16),
    Delay(Duration),
    /// Close the connection without answering.
    ResetBeforeResponse,
    /// Send the head and part of the body, then abort the connection.
    ResetMidBody,
}

#[derive(Default)]
struct UpState {
    seen: Mutex<Vec<Seen>>,
    hits: Mutex<HashMap<String, usize>>,
    actions: Mutex<VecDeque<Action>>,
    completed: Mutex<HashMap<String, usize>>,
}

/// A counting HTTP upstream (HTTP/1.1 and h2c).
///
/// Every path answers; `POST /orders` answers 201 with `Location` and a JSON
/// body carrying the hit number. Query parameters shape any answer:
/// `status=N`, `delay_ms=N`, `size=N` (N bytes of `x`, chunked),
/// `headers=1` (repeated `x-multi`, `Set-Cookie`, a fixed `Date`),
/// `hop=1` (a hop-by-hop header named by `Connection`),
/// `reset=before|body`.
pub struct Upstream {
    pub addr: SocketAddr,
    state: Arc<UpState>,
    _server: TestServer,
}

/// The fixed `Date` the upstream sends with `headers=1`.
pub const UPSTREAM_DATE: &str = "Tue, 01 Dec 2026 08:00:00 GMT";

impl Upstream {
    pub async fn start() -> Self {
        Self::start_on(
            TcpListener::bind("127.0.0.1:0")
                .await
                .expect("bind upstream"),
        )
        .await
    }

    /// Starts on a given address (e.g. one the proxy was refused on before).
    pub async fn start_at(addr: SocketAddr) -> Self {
        let listener = wait_for("the upstream port to be free", || async {
            TcpListener::bind(addr).await.ok()
        })
        .await;
        Self::start_on(listener).await
    }

    pub async fn start_on(listener: TcpListener) -> Self {
        let state = Arc::new(UpState::default());
        let st = state.clone();
        let server = server()
            .on(listener)
            .serve(move |req, _| upstream_handle(st.clone(), req))
            .await;
        Self {
            addr: server.addr,
            state,
            _server: server,
        }
    }

    /// An address nothing listens on: connecting to it is refused.
    pub fn refusing_addr() -> SocketAddr {
        free_port()
    }

    /// Queues a behaviour for the next request.
    pub fn push(&self, action: Action) {
        self.state.actions.lock().unwrap().push_back(action);
    }

    /// How many requests for `path` arrived (counted before any delay).
    pub fn hits(&self, path: &str) -> usize {
        self.state
            .hits
            .lock()
            .unwrap()
            .get(path)
            .copied()
            .unwrap_or(0)
    }

    /// How many responses for `path` the upstream finished producing.
    pub fn completed(&self, path: &str) -> usize {
        self.state
            .completed
            .lock()
            .unwrap()
            .get(path)
            .copied()
            .unwrap_or(0)
    }

    pub fn total_hits(&self) -> usize {
        self.state.seen.lock().unwrap().len()
    }

    pub fn seen(&self) -> Vec<Seen> {
        self.state.seen.lock().unwrap().clone()
    }

    pub fn last(&self) -> Seen {
        self.seen().pop().expect("the upstream saw no request")
    }

    pub async fn wait_hits(&self, path: &str, n: usize) {
        wait_until(&format!("{n} upstream hit(s) on {path}"), || {
            self.hits(path) >= n
        })
        .await;
    }
}

fn query_param(query: Option<&str>, name: &str) -> Option<String> {
    query?
        .split('&')
        .filter_map(|kv| kv.split_once('='))
        .find(|(k, _)| *k == name)
        .map(|(_, v)| v.to_string())
}

async fn upstream_handle(
    st: Arc<UpState>,
    req: Request<Incoming>,
) -> Result<Response<ProxyBody>, std::io::Error> {
    let (parts, body) = req.into_parts();
    let body = body
        .collect()
        .await
        .map_err(std::io::Error::other)?
        .to_bytes();
    let path = parts.uri.path().to_string();
    let query = parts.uri.query().map(str::to_string);
    let n = {
        let mut hits = st.hits.lock().unwrap();
        let n = hits.entry(path.clone()).or_default();
        *n += 1;
        *n
    };
    st.seen.lock().unwrap().push(Seen {
        method: parts.method.clone(),
        path: path.clone(),
        query: query.clone(),
        version: parts.version,
        headers: parts.headers.clone(),
        body: body.clone(),
    });
    let action = st.actions.lock().unwrap().pop_front();
    let q = |name: &str| query_param(query.as_deref(), name);

    let mut delay = q("delay_ms")
        .and_then(|v| v.parse().ok())
        .map(Duration::from_millis);
    let mut status = q("status").and_then(|v| v.parse::<u16>().ok());
    let mut reset = q("reset");
    match action {
        Some(Action::Status(s)) => status = Some(s),
        Some(Action::Delay(d)) => delay = Some(d),
        Some(Action::ResetBeforeResponse) => reset = Some("before".into()),
        Some(Action::ResetMidBody) => reset = Some("body".into()),
        None => {}
    }
    if let Some(d) = delay {
        tokio::time::sleep(d).await;
    }
    if reset.as_deref() == Some("before") {
        return Err(std::io::Error::other(
            "reset before responding (on purpose)",
        ));
    }

    let is_order = parts.method == Method::POST && path == ORDERS;
    let default_status = if is_order { 201 } else { 200 };
    let status = StatusCode::from_u16(status.unwrap_or(default_status)).expect("status");
    let mut resp = Response::builder().status(status);
    if is_order {
        resp = resp.header("location", format!("/orders/{n}"));
    }
    if q("headers").is_some() {
        resp = resp
            .header("x-multi", "a, b")
            .header("x-multi", "c")
            .header("set-cookie", "session=one")
            .header("set-cookie", "theme=dark")
            .header("date", UPSTREAM_DATE)
            .header("x-after", "z");
    }
    if q("hop").is_some() {
        resp = resp
            .header("connection", "x-upstream-hop")
            .header("x-upstream-hop", "1");
    }
    resp = resp.header("x-upstream", "test");

    let done = {
        let st = st.clone();
        let path = path.clone();
        move || {
            *st.completed
                .lock()
                .unwrap()
                .entry(path.clone())
                .or_default() += 1
        }
    };

    if reset.as_deref() == Some("body") {
        // The head and a first chunk go out; the failure comes a moment
        // later, so the proxy has really seen the upstream's answer.
        let chunks = futures_util::stream::unfold(0u8, |step| async move {
            let item: Result<Frame<Bytes>, BoxError> = match step {
                0 => Ok(Frame::data(Bytes::from(vec![b'x'; 1000]))),
                1 => {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    Err("reset mid-body (on purpose)".into())
                }
                _ => return None,
            };
            Some((item, step + 1))
        });
        let body = StreamBody::new(chunks);
        return Ok(resp
            .header("content-length", "100000")
            .body(boxed(body))
            .expect("response"));
    }
    if let Some(size) = q("size").and_then(|v| v.parse::<usize>().ok()) {
        const CHUNK: usize = 16 * 1024;
        let mut chunks = Vec::new();
        let mut left = size;
        while left > 0 {
            let n = left.min(CHUNK);
            chunks.push(Ok::<_, BoxError>(Frame::data(Bytes::from(vec![b'x'; n]))));
            left -= n;
        }
        done();
        let body = StreamBody::new(futures_util::stream::iter(chunks));
        return Ok(resp.body(boxed(body)).expect("response"));
    }
    let json = serde_json::json!({
        "id": n,
        "hits": n,
        "method": parts.method.as_str(),
        "path": path,
        "query": query,
        "received": String::from_utf8_lossy(&body),
    });
    done();
    Ok(resp
        .header("content-type", "application/json")
        .body(full(json.to_string()))
        .expect("response"))
}
