//! How idemgate reaches PostgreSQL: the TLS connector built from the
//! store URL (read the way libpq reads it: [`PgUrl`], config's), and
//! connection failures turned into sentences that name the cause. Every
//! connection idemgate opens to PostgreSQL (serve, migrate, keys,
//! check-config --connect) goes through [`PgTarget`], so they all speak
//! TLS alike.
//!
//! The rustls client config is `net::tls`'s; what is PostgreSQL's stays
//! here: the tokio-postgres connector and SCRAM's channel binding.

use crate::config::pg_url::{PgUrl, SslMode};
use crate::net::errors::Chain;
use crate::net::tls::{self, Cause};
use rustls::pki_types::ServerName;
use rustls::ClientConfig;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio_postgres::config::Host;
use tokio_postgres::tls::{ChannelBinding, MakeTlsConnect, TlsConnect};

/// Everything needed to open connections to one PostgreSQL: the parsed
/// URL, tokio-postgres's config and the TLS connector.
#[derive(Clone)]
pub struct PgTarget {
    pub url: PgUrl,
    pub config: tokio_postgres::Config,
    pub tls: MakeRustls,
    /// `host:port` (every host tried), for messages.
    pub endpoint: String,
}

impl PgTarget {
    /// Parses `url` and reads the TLS files it names: a bad URL or an
    /// unreadable certificate fails here, at start-up.
    pub fn new(url: &str) -> Result<Self, String> {
        let url = PgUrl::parse(url)?;
        let config = url.pg_config()?;
        let tls_config = tls::client_config(&url.client_tls()).map_err(|e| e.to_string())?;
        Ok(Self {
            url,
            endpoint: endpoint(&config),
            config,
            tls: MakeRustls {
                config: Arc::new(tls_config),
                seen: None,
            },
        })
    }

    /// The first host name, as the certificate must name it.
    fn host(&self) -> String {
        match self.config.get_hosts().first() {
            Some(Host::Tcp(h)) => h.clone(),
            #[cfg(unix)]
            Some(Host::Unix(p)) => p.display().to_string(),
            None => "localhost".into(),
        }
    }

    /// A failed call in one sentence: the host and port, what failed, and
    /// what to change where that is known.
    pub fn failure(&self, err: tokio_postgres::Error) -> PgFailure {
        let chain = Chain(&err).to_string();
        let cause = match (err.as_db_error(), tls::diagnose(&err)) {
            (Some(db), _) => describe_db(db.message(), db.code().code()),
            (None, Some(failure)) => describe_tls(failure, &self.host()),
            // tokio-postgres's own words for a server answering `N` to
            // SSLRequest; its cause is a private string type.
            (None, None) if chain.contains("server does not support TLS") => {
                "the server does not support TLS (it refused SSL): turn ssl on in the server, or use sslmode=prefer".into()
            }
            // tokio-postgres's words when no host accepted writes
            // (`target_session_attrs=read-write`, always set here).
            (None, None) if chain.contains("database does not allow writes") => {
                format!("{STANDBY}: no host in store.url accepts writes")
            }
            (None, None) => chain,
        };
        // A server that answered needs no address.
        let endpoint = err.as_db_error().is_none().then(|| self.endpoint.clone());
        PgFailure {
            endpoint,
            cause,
            source: Some(err),
        }
    }
}

/// A failed PostgreSQL call ([`PgTarget::failure`]); the driver's error,
/// when there is one, is the source.
#[derive(Debug, thiserror::Error)]
#[error("postgres{}: {cause}", .endpoint.as_ref().map(|at| format!(" at {at}")).unwrap_or_default())]
pub struct PgFailure {
    /// `host:port`; `None` when the server answered (with an error).
    pub endpoint: Option<String>,
    /// What failed, and what to change where that is known.
    pub cause: String,
    pub source: Option<tokio_postgres::Error>,
}

/// A failed handshake with `host`, and which URL parameter to change.
fn describe_tls(failure: tls::Failure, host: &str) -> String {
    match failure.cause {
        Cause::NotTrusted => format!(
            "the server's certificate is not trusted ({}): \
             name the CA that signed it with sslrootcert, or encrypt without verifying (sslmode=require)",
            failure.name()
        ),
        Cause::NameMismatch => format!(
            "host name mismatch: the server's certificate is not valid for {host:?}{}: connect by a name the certificate lists, or use sslmode=verify-ca",
            failure
                .presented_names()
                .map(|names| format!(" (it names {names})"))
                .unwrap_or_default()
        ),
        Cause::Expired => "the server's certificate has expired".into(),
        Cause::NotYetValid => "the server's certificate is not valid yet (check the clocks)".into(),
        Cause::Revoked => "the server's certificate is revoked".into(),
        Cause::BadCertificate => format!("the server's certificate was refused: {}", failure.name()),
        Cause::ClientCertificateRefused => format!(
            "the server refused the client certificate ({}): check the client certificate and key, and that the server trusts their CA",
            failure.error
        ),
        Cause::Alert | Cause::NotTls | Cause::Other => {
            format!("TLS handshake with {host:?} failed: {}", failure.error)
        }
    }
}

/// `host:port[,host:port...]` of a config.
fn endpoint(config: &tokio_postgres::Config) -> String {
    let ports = config.get_ports();
    let port = |i: usize| ports.get(i).or(ports.first()).copied().unwrap_or(5432);
    let hosts: Vec<String> = config
        .get_hosts()
        .iter()
        .enumerate()
        .map(|(i, host)| {
            let port = port(i);
            match host {
                Host::Tcp(h) if h.contains(':') => format!("[{h}]:{port}"),
                Host::Tcp(h) => format!("{h}:{port}"),
                #[cfg(unix)]
                Host::Unix(p) => format!("{}/.s.PGSQL.{port}", p.display()),
            }
        })
        .collect();
    if hosts.is_empty() {
        format!("localhost:{}", port(0))
    } else {
        hosts.join(",")
    }
}

/// A server error, with a hint where a connection pooler is the likely
/// cause (their errors look like these).
/// What a server in recovery (or a read-only one) is called in every
/// message: at start-up, in `/healthz/store` and `check-config --connect`.
pub const STANDBY: &str = "store.url points at a standby (in recovery) or a read-only server";

pub fn describe_db(message: &str, code: &str) -> String {
    // 25006 read_only_sql_transaction: a connection opened before its
    // server went into recovery, or a `default_transaction_read_only` one.
    if code == "25006" {
        return format!("{STANDBY}: {message} ({code})");
    }
    let pooler = message.contains("unsupported startup parameter")
        || (message.starts_with("prepared statement") && (code == "26000" || code == "42P05"));
    if pooler {
        format!(
            "{message} ({code}): a connection pooler (PgBouncer in transaction mode?) is in front: add pgbouncer=true to store.url"
        )
    } else {
        format!("{message} ({code})")
    }
}

// === the connector ===

/// tokio-postgres's TLS hook over rustls; one [`ClientConfig`] for every
/// connection of a pool.
#[derive(Clone)]
pub struct MakeRustls {
    config: Arc<ClientConfig>,
    /// Where [`MakeRustls::recording`]'s copy writes the TLS version its
    /// handshake agreed on; nothing written means the connection is plain.
    seen: Option<Arc<OnceLock<&'static str>>>,
}

impl MakeRustls {
    /// A copy for one connection that records whether it got TLS (and
    /// which version): tokio-postgres falls back to plaintext on its own
    /// under `sslmode=prefer`, and nothing else tells which it was, even
    /// behind a pooler (the server's `pg_stat_ssl` would describe the
    /// pooler's own connection instead).
    pub fn recording(&self) -> (Self, Arc<OnceLock<&'static str>>) {
        let seen = Arc::new(OnceLock::new());
        let copy = Self {
            config: self.config.clone(),
            seen: Some(seen.clone()),
        };
        (copy, seen)
    }
}

/// How one connection is carried, for `check-config --connect`: the TLS
/// version, or plaintext and why (`sslmode=disable`, or a server that
/// offered no TLS under `prefer`/`allow`).
pub fn describe_transport(tls: Option<&str>, sslmode: SslMode) -> String {
    match (tls, sslmode) {
        (Some(version), _) => format!("over TLS ({version})"),
        (None, SslMode::Disable) => "in plaintext (sslmode=disable)".into(),
        (None, _) => "in plaintext (the server offered no TLS)".into(),
    }
}

impl<S> MakeTlsConnect<S> for MakeRustls
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    type Stream = RustlsStream<S>;
    type TlsConnect = RustlsConnect;
    type Error = rustls::pki_types::InvalidDnsNameError;

    fn make_tls_connect(&mut self, host: &str) -> Result<RustlsConnect, Self::Error> {
        let name = ServerName::try_from(host.to_string())?;
        Ok(RustlsConnect(self.clone(), name))
    }
}

/// One connection's handshake, with the name its certificate must carry.
pub struct RustlsConnect(MakeRustls, ServerName<'static>);

impl<S> TlsConnect<S> for RustlsConnect
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    type Stream = RustlsStream<S>;
    type Error = io::Error;
    type Future = Pin<Box<dyn Future<Output = io::Result<RustlsStream<S>>> + Send>>;

    fn connect(self, stream: S) -> Self::Future {
        Box::pin(async move {
            let RustlsConnect(make, name) = self;
            let tls = tokio_rustls::TlsConnector::from(make.config)
                .connect(name, stream)
                .await?;
            if let Some(seen) = &make.seen {
                let _ = seen.set(tls::version_name(tls.get_ref().1.protocol_version()));
            }
            Ok(RustlsStream(Box::new(tls)))
        })
    }
}

/// An established TLS connection.
pub struct RustlsStream<S>(Box<tokio_rustls::client::TlsStream<S>>);

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncRead for RustlsStream<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut *self.0).poll_read(cx, buf)
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncWrite for RustlsStream<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut *self.0).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut *self.0).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut *self.0).poll_shutdown(cx)
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> tokio_postgres::tls::TlsStream for RustlsStream<S> {
    /// SCRAM's `tls-server-end-point` binding (RFC 5929), so
    /// `channel_binding=require` works as in libpq; none for certificates
    /// whose hash is not defined here (then `require` is refused).
    fn channel_binding(&self) -> ChannelBinding {
        let (_, session) = self.0.get_ref();
        session
            .peer_certificates()
            .and_then(|certs| certs.first())
            .and_then(|cert| tls_server_end_point(cert))
            .map(ChannelBinding::tls_server_end_point)
            .unwrap_or_else(ChannelBinding::none)
    }
}

// === channel binding ===

/// RFC 5929 `tls-server-end-point` channel binding data for a server's
/// end-entity certificate (DER): its hash with the hash function of its
/// signature algorithm, SHA-256 for MD5 and SHA-1. `None` where that is
/// not defined or not known here (Ed25519, RSA-PSS with its parameters):
/// then no binding is offered, rather than a wrong one that would fail
/// authentication.
pub fn tls_server_end_point(der: &[u8]) -> Option<Vec<u8>> {
    use sha2::Digest;
    // Certificate ::= SEQUENCE { tbsCertificate, signatureAlgorithm, ... }
    let tagged = |input, tag| der_tlv(input).filter(|&(found, ..)| found == tag);
    let (_, cert, _) = tagged(der, 0x30)?;
    let (_, _tbs, rest) = der_tlv(cert)?;
    let (_, algorithm, _) = tagged(rest, 0x30)?;
    let (_, oid, _) = tagged(algorithm, 0x06)?;
    const RSA: &[u8] = &[0x2a, 0x86, 0x48, 0x86, 0xf7, 0x0d, 0x01, 0x01];
    const ECDSA_SHA1: &[u8] = &[0x2a, 0x86, 0x48, 0xce, 0x3d, 0x04, 0x01];
    const ECDSA_SHA2: &[u8] = &[0x2a, 0x86, 0x48, 0xce, 0x3d, 0x04, 0x03];
    let bits = match oid {
        // md5WithRSA (4), sha1WithRSA (5), sha256WithRSA (11): SHA-256
        // (RFC 5929 §4.1: MD5 and SHA-1 become SHA-256; others keep theirs).
        [rsa @ .., 4 | 5 | 11] if rsa == RSA => 256,
        [rsa @ .., 14] if rsa == RSA => 224,
        [rsa @ .., 12] if rsa == RSA => 384,
        [rsa @ .., 13] if rsa == RSA => 512,
        oid if oid == ECDSA_SHA1 => 256,
        [ecdsa @ .., 1] if ecdsa == ECDSA_SHA2 => 224,
        [ecdsa @ .., 2] if ecdsa == ECDSA_SHA2 => 256,
        [ecdsa @ .., 3] if ecdsa == ECDSA_SHA2 => 384,
        [ecdsa @ .., 4] if ecdsa == ECDSA_SHA2 => 512,
        _ => return None,
    };
    // The hash covers the whole certificate as sent.
    Some(match bits {
        224 => sha2::Sha224::digest(der).to_vec(),
        256 => sha2::Sha256::digest(der).to_vec(),
        384 => sha2::Sha384::digest(der).to_vec(),
        _ => sha2::Sha512::digest(der).to_vec(),
    })
}

/// One DER TLV: (tag, contents, what follows). Definite lengths only.
fn der_tlv(input: &[u8]) -> Option<(u8, &[u8], &[u8])> {
    let (&tag, rest) = input.split_first()?;
    let (&first, rest) = rest.split_first()?;
    let (len, rest) = if first < 0x80 {
        (usize::from(first), rest)
    } else {
        let n = usize::from(first & 0x7f);
        if n == 0 || n > 4 || rest.len() < n {
            return None;
        }
        let len = rest[..n]
            .iter()
            .fold(0usize, |acc, b| (acc << 8) | usize::from(*b));
        (len, &rest[n..])
    };
    (rest.len() >= len).then(|| (tag, &rest[..len], &rest[len..]))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_transport_is_named_tls_or_plaintext_with_the_reason() {
        let offered_none = "in plaintext (the server offered no TLS)";
        for (tls, mode, says) in [
            (Some("TLS 1.3"), SslMode::Prefer, "over TLS (TLS 1.3)"),
            (Some("TLS 1.2"), SslMode::VerifyFull, "over TLS (TLS 1.2)"),
            (None, SslMode::Disable, "in plaintext (sslmode=disable)"),
            (None, SslMode::Prefer, offered_none),
            (None, SslMode::Allow, offered_none),
        ] {
            assert_eq!(describe_transport(tls, mode), says, "{tls:?} {mode:?}");
        }
    }

    #[test]
    fn pooler_errors_carry_the_hint() {
        let hinted = |message, code| describe_db(message, code).contains("add pgbouncer=true");
        assert!(hinted("unsupported startup parameter: options", "08P01"));
        assert!(hinted("prepared statement \"s3\" does not exist", "26000"));
        assert!(!describe_db("relation \"x\" does not exist", "42P01").contains("pgbouncer"));
    }

    #[test]
    fn channel_binding_hashes_the_certificate_with_its_signature_hash() {
        use sha2::Digest;
        // A certificate shaped as DER: SEQUENCE { tbs, AlgorithmIdentifier, sig }.
        let cert = |oid: &[u8]| {
            let mut alg = vec![0x06, oid.len() as u8];
            alg.extend_from_slice(oid);
            let mut body = vec![0x30, 0x03, 0x02, 0x01, 0x00];
            body.extend([0x30, alg.len() as u8]);
            body.extend(&alg);
            body.extend([0x03, 0x01, 0x00]);
            let mut der = vec![0x30, body.len() as u8];
            der.extend(body);
            der
        };
        let rsa = |last| [0x2a, 0x86, 0x48, 0x86, 0xf7, 0x0d, 0x01, 0x01, last];
        let ecdsa = |last| [0x2a, 0x86, 0x48, 0xce, 0x3d, 0x04, 0x03, last];
        for (oid, len) in [
            (&rsa(11)[..], 32),
            (&rsa(5)[..], 32),
            (&rsa(12)[..], 48),
            (&rsa(13)[..], 64),
            (&ecdsa(2)[..], 32),
            (&ecdsa(3)[..], 48),
            (&ecdsa(4)[..], 64),
            // Regression: SHA-224 signatures keep SHA-224 (were SHA-256).
            (&rsa(14)[..], 28),
            (&ecdsa(1)[..], 28),
        ] {
            let der = cert(oid);
            let bound = tls_server_end_point(&der).unwrap_or_else(|| panic!("{oid:x?}"));
            assert_eq!(bound.len(), len, "{oid:x?}");
            if len == 32 {
                assert_eq!(bound, sha2::Sha256::digest(&der).to_vec());
            }
        }
        // Ed25519 (1.3.101.112) and RSA-PSS: no binding rather than a wrong one.
        assert_eq!(tls_server_end_point(&cert(&[0x2b, 0x65, 0x70])), None);
        assert_eq!(tls_server_end_point(&cert(&rsa(10))), None);
        assert_eq!(tls_server_end_point(b"\x30\x05junk"), None);
    }
}
