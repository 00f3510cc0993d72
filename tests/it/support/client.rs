//! The HTTP client side: [`Req`] (one request on a fresh connection),
//! [`Resp`] (a response read whole), and connections kept open
//! ([`Http1Conn`], [`H2Conn`]).

use super::bounded;
use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Method, Request, Response, StatusCode, Version};
use http_body_util::{BodyExt, StreamBody};
use hyper::body::Frame;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo};
use idemgate::body::{boxed, full, BoxError, ProxyBody};
use std::net::SocketAddr;
use tokio::net::TcpStream;
use tokio::task::JoinHandle;

/// A request under construction.
pub struct Req {
    method: Method,
    url: String,
    headers: Vec<(HeaderName, HeaderValue)>,
    body: Option<ProxyBody>,
}

impl Req {
    pub fn new(method: Method, url: String) -> Self {
        Self {
            method,
            url,
            headers: Vec::new(),
            body: None,
        }
    }

    pub fn header(mut self, name: &str, value: &str) -> Self {
        self.headers.push((
            HeaderName::from_bytes(name.as_bytes()).expect("header name"),
            HeaderValue::from_str(value).expect("header value"),
        ));
        self
    }

    pub fn header_bytes(mut self, name: &str, value: &[u8]) -> Self {
        self.headers.push((
            HeaderName::from_bytes(name.as_bytes()).expect("header name"),
            HeaderValue::from_bytes(value).expect("header value"),
        ));
        self
    }

    /// Sets `Idempotency-Key`.
    pub fn key(self, key: &str) -> Self {
        self.header("idempotency-key", key)
    }

    /// A body with a `Content-Length`.
    pub fn body(mut self, body: impl Into<Bytes>) -> Self {
        self.body = Some(full(body));
        self
    }

    /// A body sent chunked, without a length.
    pub fn chunked(mut self, chunks: Vec<Bytes>) -> Self {
        let frames = chunks
            .into_iter()
            .map(|c| Ok::<_, BoxError>(Frame::data(c)));
        self.body = Some(boxed(StreamBody::new(futures_util::stream::iter(frames))));
        self
    }

    pub fn build(self) -> Request<ProxyBody> {
        let mut b = Request::builder().method(self.method).uri(self.url);
        for (n, v) in self.headers {
            b = b.header(n, v);
        }
        b.body(self.body.unwrap_or_else(|| full(Bytes::new())))
            .expect("request")
    }

    /// Sends on a fresh HTTP/1.1 connection and reads the whole response.
    pub async fn send(self) -> Resp {
        let what = format!("{} {}", self.method, self.url);
        bounded(&what, self.try_send())
            .await
            .unwrap_or_else(|e| panic!("{what} failed: {e}"))
    }

    /// Like [`Req::send`], but a transport error is returned, not a panic.
    pub async fn try_send(self) -> Result<Resp, BoxError> {
        let client: hyper_util::client::legacy::Client<HttpConnector, ProxyBody> =
            hyper_util::client::legacy::Client::builder(TokioExecutor::new())
                .build(HttpConnector::new());
        let resp = client.request(self.build()).await?;
        Resp::read(resp).await
    }
}

/// A response read whole.
#[derive(Clone, Debug)]
pub struct Resp {
    pub status: StatusCode,
    pub version: Version,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Resp {
    pub async fn read<B>(resp: Response<B>) -> Result<Self, BoxError>
    where
        B: hyper::body::Body,
        B::Error: Into<BoxError>,
    {
        let (parts, body) = resp.into_parts();
        let body = body.collect().await.map_err(Into::into)?.to_bytes();
        Ok(Self {
            status: parts.status,
            version: parts.version,
            headers: parts.headers,
            body,
        })
    }

    pub fn status(&self) -> u16 {
        self.status.as_u16()
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).map(|v| v.to_str().expect("ascii"))
    }

    pub fn header_all(&self, name: &str) -> Vec<String> {
        self.headers
            .get_all(name)
            .iter()
            .map(|v| v.to_str().expect("ascii").to_string())
            .collect()
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| {
            panic!(
                "body is not JSON ({e}): {}",
                String::from_utf8_lossy(&self.body)
            )
        })
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    pub fn replayed(&self) -> bool {
        self.header("idempotent-replayed") == Some("true")
    }

    /// Asserts an RFC 9457 problem with `status`; returns its JSON.
    pub fn assert_problem(&self, status: u16) -> serde_json::Value {
        assert_eq!(self.status(), status, "body: {}", self.text());
        assert_eq!(
            self.header("content-type"),
            Some("application/problem+json"),
            "{self:?}"
        );
        let json = self.json();
        assert_eq!(json["status"], status, "{json}");
        json
    }
}

/// An HTTP/1.1 connection kept open for several requests.
pub struct Http1Conn {
    sender: hyper::client::conn::http1::SendRequest<ProxyBody>,
    task: JoinHandle<()>,
}

impl Http1Conn {
    pub async fn open(addr: SocketAddr) -> Self {
        let stream = TcpStream::connect(addr).await.expect("connect");
        let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .expect("http1 handshake");
        let task = tokio::spawn(async move {
            let _ = conn.await;
        });
        Self { sender, task }
    }

    pub async fn send(&mut self, req: Req) -> Resp {
        bounded("a request on a kept-alive connection", async {
            self.sender.ready().await.expect("connection ready");
            let resp = self
                .sender
                .send_request(req.build())
                .await
                .expect("send request");
            Resp::read(resp).await.expect("read response")
        })
        .await
    }

    /// Hangs up: the connection is closed with any request still pending.
    pub fn close(self) {
        self.task.abort();
    }
}

/// An h2c (HTTP/2 with prior knowledge) connection.
pub struct H2Conn {
    sender: hyper::client::conn::http2::SendRequest<ProxyBody>,
    _task: JoinHandle<()>,
}

impl H2Conn {
    pub async fn open(addr: SocketAddr) -> Self {
        let stream = TcpStream::connect(addr).await.expect("connect");
        let (sender, conn) =
            hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(stream))
                .await
                .expect("h2 handshake");
        let task = tokio::spawn(async move {
            let _ = conn.await;
        });
        Self {
            sender,
            _task: task,
        }
    }

    pub async fn send(&mut self, req: Req) -> Resp {
        bounded("an h2 request", async {
            self.sender.ready().await.expect("h2 ready");
            let resp = self
                .sender
                .send_request(req.build())
                .await
                .expect("h2 send");
            Resp::read(resp).await.expect("read h2 response")
        })
        .await
    }
}
