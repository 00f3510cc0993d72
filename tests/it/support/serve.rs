//! The one test server builder: a handler served over HTTP/1.1 and h2c
//! (or h2c only), optionally behind TLS, accepting through idemgate's own
//! accept loop (`idemgate::net::listen`). The plain hyper fakes (upstream,
//! recording upstream, h2 and TLS upstreams, OTLP receiver) are built on
//! it; fakes that must break the protocol keep their own socket code.

use http::{Request, Response};
use hyper::body::{Body, Incoming};
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use idemgate::body::BoxError;
use idemgate::net::listen;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio::task::JoinHandle;
use tokio_rustls::TlsAcceptor;
use tokio_util::task::TaskTracker;

/// What a handler knows of the connection its request came on.
#[derive(Clone, Debug, Default)]
pub struct Conn {
    /// The TLS session, on a [`ServerBuilder::tls`] server.
    pub tls: Option<TlsSession>,
}

#[derive(Clone, Debug)]
pub struct TlsSession {
    /// The SNI name the client sent ("" without).
    pub sni: String,
    /// The negotiated ALPN protocol ("" without).
    pub alpn: String,
    pub client_cert: bool,
}

/// How a [`TestServer`] listens and speaks.
#[derive(Default)]
pub struct ServerBuilder {
    listener: Option<TcpListener>,
    h2_only: bool,
    tls: Option<TlsAcceptor>,
}

/// A running test server; it stops accepting when dropped.
pub struct TestServer {
    pub addr: SocketAddr,
    task: JoinHandle<()>,
}

impl Drop for TestServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

pub fn server() -> ServerBuilder {
    ServerBuilder::default()
}

impl ServerBuilder {
    /// Listens on `listener` (default: 127.0.0.1:0).
    pub fn on(mut self, listener: TcpListener) -> Self {
        self.listener = Some(listener);
        self
    }

    /// HTTP/2 with prior knowledge only (no HTTP/1.1).
    pub fn h2_only(mut self) -> Self {
        self.h2_only = true;
        self
    }

    /// TLS first; a refused handshake ends the connection quietly (that is
    /// what some tests are about).
    pub fn tls(mut self, acceptor: TlsAcceptor) -> Self {
        self.tls = Some(acceptor);
        self
    }

    /// Serves every request with `handler` until the server is dropped.
    pub async fn serve<H, F, B, E>(self, handler: H) -> TestServer
    where
        H: Fn(Request<Incoming>, &Conn) -> F + Send + Sync + 'static,
        F: Future<Output = Result<Response<B>, E>> + Send + 'static,
        B: Body + Send + 'static,
        B::Data: Send,
        B::Error: Into<BoxError>,
        E: Into<BoxError>,
    {
        let listener = match self.listener {
            Some(l) => l,
            None => TcpListener::bind("127.0.0.1:0")
                .await
                .expect("bind a test server"),
        };
        let addr = listener.local_addr().expect("test server addr");
        let mut builder = auto::Builder::new(TokioExecutor::new());
        if self.h2_only {
            builder = builder.http2_only();
        }
        let (handler, tls) = (Arc::new(handler), self.tls);
        let task = tokio::spawn(async move {
            let open = TaskTracker::new();
            let never = std::future::pending();
            listen::serve(
                "test",
                listener,
                Semaphore::MAX_PERMITS,
                &open,
                never,
                |tcp, _| {
                    let (handler, tls, builder) = (handler.clone(), tls.clone(), builder.clone());
                    async move {
                        let (io, conn): (Box<dyn Io>, Conn) = match tls {
                            None => (Box::new(tcp), Conn::default()),
                            Some(acceptor) => {
                                let Ok(stream) = acceptor.accept(tcp).await else {
                                    return;
                                };
                                let session = stream.get_ref().1;
                                let tls = TlsSession {
                                    sni: session.server_name().unwrap_or("").to_string(),
                                    alpn: session
                                        .alpn_protocol()
                                        .map(|p| String::from_utf8_lossy(p).into_owned())
                                        .unwrap_or_default(),
                                    client_cert: session.peer_certificates().is_some(),
                                };
                                (Box::new(stream), Conn { tls: Some(tls) })
                            }
                        };
                        let svc = service_fn(move |req| handler(req, &conn));
                        let _ = builder.serve_connection(TokioIo::new(io), svc).await;
                    }
                },
            )
            .await;
        });
        TestServer { addr, task }
    }
}

/// A plain or TLS stream: one type for the connection's server.
trait Io: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Io for T {}
