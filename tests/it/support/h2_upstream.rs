//! A gRPC-shaped HTTP/2 upstream (h2c, prior knowledge only): every
//! request is answered 200 `application/grpc` with a body that echoes the
//! request's, then trailers (`grpc-status: 0`, `grpc-message`). It records
//! each request's version and headers, so a test sees what arrived.

use super::serve::{server, TestServer};
use bytes::Bytes;
use http::{HeaderMap, Response, Version};
use http_body_util::{BodyExt, StreamBody};
use hyper::body::{Frame, Incoming};
use idemgate::body::{boxed, BoxError, ProxyBody};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

/// One request as the upstream saw it.
#[derive(Clone, Debug)]
pub struct H2Seen {
    pub version: Version,
    pub path: String,
    pub headers: HeaderMap,
    pub body: Bytes,
}

pub struct H2Upstream {
    pub addr: SocketAddr,
    seen: Arc<Mutex<Vec<H2Seen>>>,
    _server: TestServer,
}

impl H2Upstream {
    pub async fn start() -> Self {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let log = seen.clone();
        let server = server()
            .h2_only()
            .serve(move |req, _| {
                let log = log.clone();
                async move { Ok::<_, Infallible>(answer(req, &log).await) }
            })
            .await;
        Self {
            addr: server.addr,
            seen,
            _server: server,
        }
    }

    pub fn seen(&self) -> Vec<H2Seen> {
        self.seen.lock().unwrap().clone()
    }
}

async fn answer(req: http::Request<Incoming>, log: &Mutex<Vec<H2Seen>>) -> Response<ProxyBody> {
    let (parts, body) = req.into_parts();
    let body = body
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    log.lock().unwrap().push(H2Seen {
        version: parts.version,
        path: parts.uri.path().to_string(),
        headers: parts.headers,
        body: body.clone(),
    });
    let mut trailers = HeaderMap::new();
    trailers.insert("grpc-status", "0".parse().unwrap());
    trailers.insert("grpc-message", "ok".parse().unwrap());
    let frames: Vec<Result<Frame<Bytes>, BoxError>> = vec![
        Ok(Frame::data(Bytes::from_static(b"reply:"))),
        Ok(Frame::data(body)),
        Ok(Frame::trailers(trailers)),
    ];
    Response::builder()
        .status(200)
        .header("content-type", "application/grpc")
        .body(boxed(StreamBody::new(futures_util::stream::iter(frames))))
        .expect("response")
}
