//! TLS for the upstream tests: [`TestCa`], a throwaway certificate
//! authority (rcgen) whose certificates and keys are PEM files in a temp
//! dir, and [`TlsUpstream`], a real HTTPS server (tokio-rustls + hyper,
//! HTTP/1.1 and h2 by ALPN) that answers every request with what it saw of
//! the TLS session.

use super::serve::{server, TestServer};
use http::{Response, StatusCode};
use idemgate::body::{full, ProxyBody};
use rcgen::{
    date_time_ymd, BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair,
    KeyUsagePurpose,
};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::{RootCertStore, ServerConfig};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tokio_rustls::TlsAcceptor;

/// A certificate authority for one test; its files are deleted with it.
pub struct TestCa {
    issuer: CertifiedIssuer<'static, KeyPair>,
    dir: tempfile::TempDir,
    name: String,
}

/// A certificate and its key, as PEM files.
#[derive(Clone, Debug)]
pub struct CertFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
}

impl TestCa {
    pub fn new(name: &str) -> Self {
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(DnType::CommonName, format!("idemgate test CA {name}"));
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let key = KeyPair::generate().expect("CA key");
        let issuer = CertifiedIssuer::self_signed(params, key).expect("self-signed CA");
        let dir = tempfile::TempDir::new().expect("tempdir");
        std::fs::write(dir.path().join("ca.pem"), issuer.pem()).expect("write ca.pem");
        Self {
            issuer,
            dir,
            name: name.to_string(),
        }
    }

    /// The CA certificate (PEM): what `ca_file` points at.
    pub fn ca_file(&self) -> PathBuf {
        self.dir.path().join("ca.pem")
    }

    /// A leaf certificate for `names` (DNS names or IP addresses), valid
    /// now, or expired since 2001 when `expired`.
    pub fn leaf(&self, file: &str, names: &[&str], expired: bool) -> CertFiles {
        let names: Vec<String> = names.iter().map(|n| n.to_string()).collect();
        let mut params = CertificateParams::new(names).expect("leaf params");
        params
            .distinguished_name
            .push(DnType::CommonName, format!("{file} ({})", self.name));
        if expired {
            params.not_before = date_time_ymd(2000, 1, 1);
            params.not_after = date_time_ymd(2001, 1, 1);
        }
        let key = KeyPair::generate().expect("leaf key");
        let cert = params.signed_by(&key, &self.issuer).expect("sign leaf");
        let files = CertFiles {
            cert: self.dir.path().join(format!("{file}.pem")),
            key: self.dir.path().join(format!("{file}-key.pem")),
        };
        std::fs::write(&files.cert, cert.pem()).expect("write cert");
        std::fs::write(&files.key, key.serialize_pem()).expect("write key");
        files
    }
}

/// How a [`TlsUpstream`] is set up.
pub struct TlsUpstreamConfig<'a> {
    pub server: &'a CertFiles,
    /// Require a client certificate signed by this CA (mTLS).
    pub client_ca: Option<&'a Path>,
    /// ALPN protocols offered, e.g. `[b"h2", b"http/1.1"]`; empty: none.
    pub alpn: Vec<Vec<u8>>,
}

/// An HTTPS upstream on 127.0.0.1:0. Each answer is 200 with headers
/// telling what the TLS session was: `x-tls-sni`, `x-tls-alpn`,
/// `x-tls-client-cert` (`present`/`absent`), `x-http-version`.
pub struct TlsUpstream {
    pub addr: SocketAddr,
    _server: TestServer,
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

impl TlsUpstream {
    pub async fn start(cfg: TlsUpstreamConfig<'_>) -> Self {
        let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(&cfg.server.cert)
            .expect("read cert")
            .collect::<Result<_, _>>()
            .expect("parse cert");
        let key = PrivateKeyDer::from_pem_file(&cfg.server.key).expect("read key");
        let builder = ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .expect("protocol versions");
        let builder = match cfg.client_ca {
            Some(ca) => {
                let mut roots = RootCertStore::empty();
                for cert in CertificateDer::pem_file_iter(ca).expect("read client CA") {
                    roots.add(cert.expect("parse client CA")).expect("add root");
                }
                let verifier =
                    WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider())
                        .build()
                        .expect("client verifier");
                builder.with_client_cert_verifier(verifier)
            }
            None => builder.with_no_client_auth(),
        };
        let mut config = builder.with_single_cert(chain, key).expect("server cert");
        config.alpn_protocols = cfg.alpn;
        let acceptor = TlsAcceptor::from(Arc::new(config));
        let server = server()
            .tls(acceptor)
            .serve(|req: http::Request<hyper::body::Incoming>, conn| {
                let tls = conn.tls.as_ref().expect("a TLS session");
                let resp = Response::builder()
                    .status(StatusCode::OK)
                    .header("x-tls-sni", tls.sni.clone())
                    .header("x-tls-alpn", tls.alpn.clone())
                    .header(
                        "x-tls-client-cert",
                        if tls.client_cert { "present" } else { "absent" },
                    )
                    .header("x-http-version", format!("{:?}", req.version()))
                    .header("x-path", req.uri().path().to_string())
                    .body::<ProxyBody>(full("hello over tls"))
                    .expect("response");
                async move { Ok::<_, Infallible>(resp) }
            })
            .await;
        Self {
            addr: server.addr,
            _server: server,
        }
    }
}
