//! How idemgate reaches PostgreSQL: the store URL read the way libpq reads
//! it, the TLS connector built from it, and connection failures turned
//! into sentences that name the cause. Every connection idemgate opens to
//! PostgreSQL (serve, migrate, keys, check-config --connect) goes through
//! [`PgTarget`], so they all speak TLS alike.
//!
//! The URL takes libpq's TLS parameters, so the URL given to `psql` works:
//! `sslmode` (`disable`, `allow`, `prefer` (default), `require`,
//! `verify-ca`, `verify-full`), `sslrootcert` (a CA file, or `system`),
//! `sslcert` and `sslkey`. As in libpq, `require` with an `sslrootcert`
//! verifies the chain (like `verify-ca`), and `sslrootcert=system` implies
//! `verify-full`. Unlike libpq, `verify-ca`/`verify-full` without
//! `sslrootcert` trust the system's roots (libpq would need
//! `~/.postgresql/root.crt`), so a managed database whose CA is public
//! needs no file.
//!
//! `pgbouncer=true` (Prisma's convention) says a transaction-pooling
//! PgBouncer is in front: see [`super::postgres`] for what changes. It and
//! the TLS parameters are taken out before tokio-postgres parses the rest.
//!
//! The rustls client config is `net::tls`'s; what is PostgreSQL's stays
//! here: the tokio-postgres connector and SCRAM's channel binding.

use crate::net::errors::Chain;
use crate::net::tls::{self, Cause, ClientIdentity, ClientTls, FileNames, Roots, ServerCheck};
use rustls::pki_types::ServerName;
use rustls::ClientConfig;
use std::future::Future;
use std::io;
use std::path::PathBuf;
use std::pin::Pin;
use std::str::FromStr;
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio_postgres::config::Host;
use tokio_postgres::tls::{ChannelBinding, MakeTlsConnect, TlsConnect};

/// libpq's `sslmode`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SslMode {
    Disable,
    /// libpq tries plain first, then TLS; here it is `prefer` (TLS when the
    /// server offers it, unverified): the same servers are reachable.
    Allow,
    Prefer,
    Require,
    VerifyCa,
    VerifyFull,
}

impl SslMode {
    fn parse(value: &str) -> Result<Self, String> {
        Ok(match value {
            "disable" => SslMode::Disable,
            "allow" => SslMode::Allow,
            "prefer" => SslMode::Prefer,
            "require" => SslMode::Require,
            "verify-ca" => SslMode::VerifyCa,
            "verify-full" => SslMode::VerifyFull,
            other => {
                return Err(format!(
                    "sslmode={other:?}: expected disable, allow, prefer, require, verify-ca or verify-full"
                ))
            }
        })
    }

    pub fn as_str(self) -> &'static str {
        match self {
            SslMode::Disable => "disable",
            SslMode::Allow => "allow",
            SslMode::Prefer => "prefer",
            SslMode::Require => "require",
            SslMode::VerifyCa => "verify-ca",
            SslMode::VerifyFull => "verify-full",
        }
    }
}

/// `sslrootcert`: a CA file, or `system`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RootCert {
    System,
    File(PathBuf),
}

/// A store URL with the parameters idemgate handles itself taken out.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PgUrl {
    /// The URL without them: what tokio-postgres parses.
    rest: String,
    pub sslmode: SslMode,
    pub sslrootcert: Option<RootCert>,
    pub identity: Option<ClientIdentity>,
    /// `pgbouncer=true`: a transaction-pooling PgBouncer is in front.
    pub pgbouncer: bool,
}

impl PgUrl {
    /// Reads `url` (a `postgres://` URL). Pure: no file is opened; the
    /// error says which parameter is wrong (never the password).
    pub fn parse(url: &str) -> Result<Self, String> {
        let (base, query) = match url.split_once('?') {
            Some((base, query)) => (base, query),
            None => (url, ""),
        };
        let mut kept = Vec::new();
        let mut sslmode = None;
        let mut rootcert = None;
        let mut cert = None;
        let mut key = None;
        let mut pgbouncer = false;
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            let (raw_key, raw_value) = pair.split_once('=').unwrap_or((pair, ""));
            let value = || percent_decode(raw_value);
            match percent_decode(raw_key)?.as_str() {
                "sslmode" => sslmode = Some(SslMode::parse(&value()?)?),
                "sslrootcert" => {
                    rootcert = Some(match value()?.as_str() {
                        "system" => RootCert::System,
                        path => RootCert::File(PathBuf::from(path)),
                    })
                }
                "sslcert" => cert = Some(PathBuf::from(value()?)),
                "sslkey" => key = Some(PathBuf::from(value()?)),
                "pgbouncer" => {
                    pgbouncer = match value()?.as_str() {
                        "true" => true,
                        "false" => false,
                        other => {
                            return Err(format!("pgbouncer={other:?}: expected true or false"))
                        }
                    }
                }
                unsupported @ ("sslpassword" | "sslcrl" | "sslcrldir") => {
                    return Err(format!(
                        "{unsupported} is not supported: use an unencrypted key file, and no CRL"
                    ))
                }
                // libpq's default; no other value means anything here.
                "sslsni" => {}
                _ => kept.push(pair),
            }
        }
        let sslmode = match (sslmode, &rootcert) {
            (None, Some(RootCert::System)) => SslMode::VerifyFull,
            (Some(mode), Some(RootCert::System)) if mode != SslMode::VerifyFull => {
                return Err(format!(
                    "sslmode={} may not be used with sslrootcert=system: use verify-full (as libpq)",
                    mode.as_str()
                ))
            }
            (mode, _) => mode.unwrap_or(SslMode::Prefer),
        };
        let identity = match (cert, key) {
            (Some(cert), Some(key)) => Some(ClientIdentity { cert, key }),
            (None, None) => None,
            _ => return Err("sslcert and sslkey must be given together".into()),
        };
        let rest = if kept.is_empty() {
            base.to_string()
        } else {
            format!("{base}?{}", kept.join("&"))
        };
        Ok(Self {
            rest,
            sslmode,
            sslrootcert: rootcert,
            identity,
            pgbouncer,
        })
    }

    /// What the connector checks, libpq's way.
    pub fn client_tls(&self) -> ClientTls {
        let check = match self.sslmode {
            SslMode::Disable | SslMode::Allow | SslMode::Prefer => ServerCheck::Nothing,
            // libpq: "if a root CA file exists, require behaves like verify-ca".
            SslMode::Require if matches!(self.sslrootcert, Some(RootCert::File(_))) => {
                ServerCheck::Chain
            }
            SslMode::Require => ServerCheck::Nothing,
            SslMode::VerifyCa => ServerCheck::Chain,
            SslMode::VerifyFull => ServerCheck::ChainAndName,
        };
        let roots = match &self.sslrootcert {
            Some(RootCert::File(path)) => Roots::File(path.clone()),
            Some(RootCert::System) | None => Roots::System,
        };
        ClientTls {
            check,
            roots,
            identity: self.identity.clone(),
            names: FileNames::new("sslrootcert", "sslcert", "sslkey"),
        }
    }

    /// tokio-postgres's config for the rest of the URL, with the TLS mode.
    pub fn pg_config(&self) -> Result<tokio_postgres::Config, String> {
        // The parser's own message names the bad part, never the password.
        let mut pg =
            tokio_postgres::Config::from_str(&self.rest).map_err(|err| Chain(&err).to_string())?;
        pg.ssl_mode(match self.sslmode {
            SslMode::Disable => tokio_postgres::config::SslMode::Disable,
            SslMode::Allow | SslMode::Prefer => tokio_postgres::config::SslMode::Prefer,
            SslMode::Require | SslMode::VerifyCa | SslMode::VerifyFull => {
                tokio_postgres::config::SslMode::Require
            }
        });
        Ok(pg)
    }
}

/// `%XX` decoded (URL query values: paths with spaces, `+` in names).
fn percent_decode(s: &str) -> Result<String, String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = s
                .get(i + 1..i + 3)
                .and_then(|h| u8::from_str_radix(h, 16).ok())
                .ok_or_else(|| format!("bad percent-encoding in {s:?}"))?;
            out.push(hex);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| format!("{s:?} is not UTF-8 once decoded"))
}

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
        let endpoint = endpoint(&config);
        Ok(Self {
            url,
            config,
            tls: MakeRustls {
                config: Arc::new(tls_config),
                seen: None,
            },
            endpoint,
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
    let hosts: Vec<String> = config
        .get_hosts()
        .iter()
        .enumerate()
        .map(|(i, host)| {
            let port = ports
                .get(i)
                .or_else(|| ports.first())
                .copied()
                .unwrap_or(5432);
            match host {
                Host::Tcp(h) if h.contains(':') => format!("[{h}]:{port}"),
                Host::Tcp(h) => format!("{h}:{port}"),
                #[cfg(unix)]
                Host::Unix(p) => format!("{}/.s.PGSQL.{port}", p.display()),
            }
        })
        .collect();
    if hosts.is_empty() {
        format!("localhost:{}", ports.first().copied().unwrap_or(5432))
    } else {
        hosts.join(",")
    }
}

/// A server error, with a hint where a connection pooler is the likely
/// cause (their errors look like these).
pub fn describe_db(message: &str, code: &str) -> String {
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
    let (0x30, cert, _) = der_tlv(der)? else {
        return None;
    };
    let (_, _tbs, rest) = der_tlv(cert)?;
    let (0x30, algorithm, _) = der_tlv(rest)? else {
        return None;
    };
    let (0x06, oid, _) = der_tlv(algorithm)? else {
        return None;
    };
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

    fn parse(url: &str) -> PgUrl {
        PgUrl::parse(url).unwrap_or_else(|e| panic!("{url}: {e}"))
    }

    #[test]
    fn sslmodes_map_to_libpq_checks() {
        let check = |url: &str| parse(url).client_tls().check;
        let base = "postgres://u@db.example/app";
        assert_eq!(check(base), ServerCheck::Nothing, "prefer by default");
        assert_eq!(
            check(&format!("{base}?sslmode=require")),
            ServerCheck::Nothing
        );
        assert_eq!(
            check(&format!("{base}?sslmode=require&sslrootcert=/ca.pem")),
            ServerCheck::Chain,
            "libpq: require with a root file verifies the chain"
        );
        assert_eq!(
            check(&format!("{base}?sslmode=verify-ca")),
            ServerCheck::Chain
        );
        assert_eq!(
            check(&format!("{base}?sslmode=verify-full")),
            ServerCheck::ChainAndName
        );
        assert_eq!(
            check(&format!("{base}?sslrootcert=system")),
            ServerCheck::ChainAndName,
            "sslrootcert=system implies verify-full"
        );
        assert_eq!(
            parse(&format!("{base}?sslmode=verify-full"))
                .client_tls()
                .roots,
            Roots::System
        );
    }

    #[test]
    fn handled_parameters_are_taken_out_and_the_rest_kept() {
        let url = parse(
            "postgres://u:p%40ss@h:6432/db?application_name=x&sslmode=verify-full&sslrootcert=%2Fetc%2Fca%20dir%2Froot.crt&pgbouncer=true&connect_timeout=3",
        );
        assert_eq!(
            url.rest,
            "postgres://u:p%40ss@h:6432/db?application_name=x&connect_timeout=3"
        );
        assert!(url.pgbouncer);
        assert_eq!(
            url.sslrootcert,
            Some(RootCert::File("/etc/ca dir/root.crt".into()))
        );
        let pg = url.pg_config().unwrap();
        assert_eq!(pg.get_ssl_mode(), tokio_postgres::config::SslMode::Require);
        assert_eq!(pg.get_application_name(), Some("x"));
        assert_eq!(endpoint(&pg), "h:6432");
        assert_eq!(parse("postgres://u@h/db").rest, "postgres://u@h/db");
        assert!(!parse("postgres://u@h/db?pgbouncer=false").pgbouncer);
    }

    #[test]
    fn bad_tls_parameters_are_refused_by_name() {
        for (url, says) in [
            ("postgres://h/db?sslmode=verify", "sslmode=\"verify\""),
            ("postgres://h/db?sslcert=/c.pem", "sslcert and sslkey"),
            (
                "postgres://h/db?sslmode=require&sslrootcert=system",
                "verify-full",
            ),
            ("postgres://h/db?pgbouncer=yes", "pgbouncer=\"yes\""),
            ("postgres://h/db?sslcrl=/crl.pem", "sslcrl is not supported"),
            ("postgres://h/db?sslrootcert=%zz", "percent-encoding"),
        ] {
            let err = PgUrl::parse(url).unwrap_err();
            assert!(err.contains(says), "{url}: {err}");
        }
    }

    #[test]
    fn check_config_names_a_bad_tls_parameter_without_the_password() {
        let text = "[server]\nupstream = \"http://127.0.0.1:9\"\n[store]\nbackend = \"postgres\"\n\
                    url = \"postgres://u:hunter2@h/db?sslmode=verify_full\"\n";
        let err = crate::config::Config::parse(text, "t.toml")
            .unwrap_err()
            .to_string();
        assert!(err.contains("store.url: sslmode=\"verify_full\""), "{err}");
        assert!(!err.contains("hunter2"), "{err}");
    }

    #[test]
    fn the_transport_is_named_tls_or_plaintext_with_the_reason() {
        for (tls, mode, says) in [
            (Some("TLS 1.3"), SslMode::Prefer, "over TLS (TLS 1.3)"),
            (Some("TLS 1.2"), SslMode::VerifyFull, "over TLS (TLS 1.2)"),
            (None, SslMode::Disable, "in plaintext (sslmode=disable)"),
            (
                None,
                SslMode::Prefer,
                "in plaintext (the server offered no TLS)",
            ),
            (
                None,
                SslMode::Allow,
                "in plaintext (the server offered no TLS)",
            ),
        ] {
            assert_eq!(describe_transport(tls, mode), says, "{tls:?} {mode:?}");
        }
    }

    #[test]
    fn pooler_errors_carry_the_hint() {
        assert!(
            describe_db("unsupported startup parameter: options", "08P01")
                .contains("add pgbouncer=true")
        );
        assert!(
            describe_db("prepared statement \"s3\" does not exist", "26000")
                .contains("add pgbouncer=true")
        );
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
