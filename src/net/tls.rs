//! TLS clients, written once for every outgoing TLS connection (PostgreSQL,
//! Redis, `https://` upstreams): PEM files read and checked, the trust
//! roots (a CA file, or the system's), an optional client certificate, how
//! much of the server's certificate is checked ([`ServerCheck`]: libpq's
//! `require` / `verify-ca` / `verify-full`), and what a failed handshake
//! means ([`diagnose`]: the rustls error found by type in an error's chain,
//! named by its [`Cause`]). Each client words the cause with its own
//! settings. The OTLP exporter speaks plain HTTP only (its config refuses
//! `https://`), so it builds no TLS.
//!
//! Callers pass plain values: paths, and the names their users give the
//! files ([`FileNames`]), so errors name the setting to change.
//!
//! The crypto provider is ring, passed explicitly: another crate of the
//! build enabling a second rustls provider cannot make the process-wide
//! default ambiguous, and nothing here depends on one.

use super::errors;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::WebPkiServerVerifier;
use rustls::crypto::WebPkiSupportedAlgorithms;
use rustls::pki_types::pem::{self, PemObject};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::{
    CertificateError, ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme,
};
use std::borrow::Cow;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// How much of the server's certificate is verified.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ServerCheck {
    /// Encrypt only: any certificate is accepted (the handshake signature
    /// is still checked against it). libpq's `sslmode=require`.
    Nothing,
    /// The chain must lead to a trusted root; the name is not checked.
    /// libpq's `verify-ca`.
    Chain,
    /// The chain, and the certificate must name the host connected to.
    /// libpq's `verify-full`, and what every HTTPS client does.
    ChainAndName,
}

/// Where trusted roots come from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Roots {
    /// The operating system's store (`/etc/ssl/certs` on Debian;
    /// `SSL_CERT_FILE` / `SSL_CERT_DIR` override it).
    System,
    /// A PEM file of CA certificates.
    File(PathBuf),
}

/// A client certificate and its private key, both PEM files.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClientIdentity {
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// What the user calls the CA, certificate and key files (`ca_file`,
/// `sslrootcert`, ...), for errors.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FileNames {
    pub ca: &'static str,
    pub cert: &'static str,
    pub key: &'static str,
}

impl FileNames {
    pub const fn new(ca: &'static str, cert: &'static str, key: &'static str) -> Self {
        Self { ca, cert, key }
    }
}

/// Everything a TLS client needs decided.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClientTls {
    pub check: ServerCheck,
    pub roots: Roots,
    pub identity: Option<ClientIdentity>,
    pub names: FileNames,
}

/// A TLS setting that cannot be used; says which file and why (never what
/// a key file holds).
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("{what} {}: {reason}", path.display())]
    File {
        what: &'static str,
        path: PathBuf,
        reason: String,
    },
    #[error("no usable root certificates in the system store ({reason}); install ca-certificates or set {ca}")]
    NoSystemRoots { reason: String, ca: &'static str },
    #[error("{what}: {reason}")]
    Invalid { what: &'static str, reason: String },
    #[error("TLS settings: {0}")]
    Rustls(#[from] rustls::Error),
}

pub(super) fn file_error(what: &'static str, path: &Path, reason: impl ToString) -> TlsError {
    TlsError::File {
        what,
        path: path.to_path_buf(),
        reason: reason.to_string(),
    }
}

// === PEM ===

/// The PEM certificates in `path` (at least one), and the file's bytes
/// for clients that take PEM themselves (redis-rs); `what` names the
/// setting in errors.
pub fn load_certs(what: &'static str, path: &Path) -> Result<(Certs, Vec<u8>), TlsError> {
    let pem = std::fs::read(path).map_err(|e| file_error(what, path, e))?;
    Ok((parse_certs(what, path, &pem)?, pem))
}

/// The PEM certificates in `pem`, read from `path` (at least one).
pub fn parse_certs(what: &'static str, path: &Path, pem: &[u8]) -> Result<Certs, TlsError> {
    match CertificateDer::pem_slice_iter(pem).collect::<Result<Vec<_>, _>>() {
        Ok(certs) if !certs.is_empty() => Ok(certs),
        Ok(_) => Err(file_error(what, path, "no PEM certificate in it")),
        Err(e) => Err(file_error(what, path, pem_reason(e, "certificate"))),
    }
}

/// The PEM private key in `path` (PKCS#8, PKCS#1 or SEC1), and the file's
/// bytes. Errors never quote the file.
pub fn load_key(what: &'static str, path: &Path) -> Result<(Key, Vec<u8>), TlsError> {
    let pem = std::fs::read(path).map_err(|e| file_error(what, path, e))?;
    Ok((parse_key(what, path, &pem)?, pem))
}

/// The PEM private key in `pem`, read from `path`. Errors never quote it.
pub fn parse_key(what: &'static str, path: &Path, pem: &[u8]) -> Result<Key, TlsError> {
    PrivateKeyDer::from_pem_slice(pem).map_err(|e| file_error(what, path, pem_reason(e, KEY_KINDS)))
}

pub type Certs = Vec<CertificateDer<'static>>;
pub type Key = PrivateKeyDer<'static>;
const KEY_KINDS: &str = "private key (PKCS#8, PKCS#1 or SEC1)";

fn pem_reason(e: pem::Error, kind: &str) -> String {
    match e {
        pem::Error::NoItemsFound => format!("no PEM {kind} in it"),
        other => format!("not valid PEM: {other}"),
    }
}

// === trust and the client config ===

/// The one crypto provider (ring; see the module docs), for clients and
/// the listeners ([`super::tls_server`]) alike.
pub fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The trust anchors `roots` names; `ca` is what the user calls the CA
/// file.
pub fn root_store(roots: &Roots, ca: &'static str) -> Result<RootCertStore, TlsError> {
    let mut store = RootCertStore::empty();
    match roots {
        Roots::File(path) => {
            for cert in load_certs(ca, path)?.0 {
                store.add(cert).map_err(|e| file_error(ca, path, e))?;
            }
        }
        Roots::System => {
            // Unreadable ones are skipped; none at all is an error.
            let found = rustls_native_certs::load_native_certs();
            let (added, _ignored) = store.add_parsable_certificates(found.certs);
            if added == 0 {
                let reason = found
                    .errors
                    .first()
                    .map_or("none found".to_string(), ToString::to_string);
                return Err(TlsError::NoSystemRoots { reason, ca });
            }
        }
    }
    Ok(store)
}

/// The rustls client configuration for `tls` (no ALPN: that is the
/// connector's). Reads the files now, so a missing or unreadable one is
/// reported at start-up (or reload), not per connection.
pub fn client_config(tls: &ClientTls) -> Result<ClientConfig, TlsError> {
    let provider = provider();
    let builder = ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()?;
    let chain = match tls.check {
        ServerCheck::Nothing => None,
        ServerCheck::Chain | ServerCheck::ChainAndName => {
            let roots = Arc::new(root_store(&tls.roots, tls.names.ca)?);
            let webpki = WebPkiServerVerifier::builder_with_provider(roots, provider.clone());
            Some(webpki.build().map_err(|e| TlsError::Invalid {
                what: "trust roots",
                reason: e.to_string(),
            })?)
        }
    };
    let verifier: Arc<dyn ServerCertVerifier> = match (tls.check, chain) {
        (ServerCheck::ChainAndName, Some(webpki)) => webpki,
        (_, chain) => Arc::new(Lenient {
            chain,
            algorithms: provider.signature_verification_algorithms,
        }),
    };
    let builder = builder
        .dangerous()
        .with_custom_certificate_verifier(verifier);
    match &tls.identity {
        None => Ok(builder.with_no_client_auth()),
        Some(id) => {
            let (certs, _) = load_certs(tls.names.cert, &id.cert)?;
            let (key, _) = load_key(tls.names.key, &id.key)?;
            builder
                .with_client_auth_cert(certs, key)
                .map_err(|e| TlsError::Invalid {
                    what: "client certificate and key",
                    reason: format!("{} / {}: {e}", id.cert.display(), id.key.display()),
                })
        }
    }
}

/// The version a handshake agreed on, in words ("TLS 1.3").
pub fn version_name(version: Option<rustls::ProtocolVersion>) -> &'static str {
    match version {
        Some(rustls::ProtocolVersion::TLSv1_3) => "TLS 1.3",
        Some(rustls::ProtocolVersion::TLSv1_2) => "TLS 1.2",
        _ => "TLS",
    }
}

// === verifiers ===

/// [`ServerCheck::Nothing`] (no `chain`: any certificate) and
/// [`ServerCheck::Chain`] (webpki's full check with only a name mismatch
/// forgiven: webpki checks the chain before the name, so `NotValidForName`
/// means the chain was already found trusted). Either way the handshake
/// must be signed by the certificate's key, so the session is bound to it.
#[derive(Debug)]
struct Lenient {
    chain: Option<Arc<WebPkiServerVerifier>>,
    algorithms: WebPkiSupportedAlgorithms,
}

impl ServerCertVerifier for Lenient {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let Some(webpki) = &self.chain else {
            return Ok(ServerCertVerified::assertion());
        };
        match webpki.verify_server_cert(end_entity, intermediates, server_name, ocsp, now) {
            Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.algorithms.supported_schemes()
    }
}

// === what a failed handshake means ===

/// Why a handshake failed, in the terms an operator acts on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cause {
    /// No trusted root signs the server's chain (unknown issuer, bad
    /// signature, unknown revocation status).
    NotTrusted,
    /// The certificate does not name the host connected to.
    NameMismatch,
    Expired,
    NotYetValid,
    Revoked,
    /// Another fault in the server's certificate (bad encoding, ...).
    BadCertificate,
    /// The server wanted a client certificate, or refused ours (an alert
    /// that says so).
    ClientCertificateRefused,
    /// Another alert from the server (e.g. `HandshakeFailure`, which
    /// TLS 1.2 servers also send for a missing client certificate).
    Alert,
    /// The peer does not speak TLS: its first bytes are no TLS record (a
    /// plain-text port).
    NotTls,
    Other,
}

impl Cause {
    /// Whether the server's certificate was refused.
    pub fn is_certificate(self) -> bool {
        use Cause::*;
        matches!(
            self,
            NotTrusted | NameMismatch | Expired | NotYetValid | Revoked | BadCertificate
        )
    }

    fn of(e: &rustls::Error) -> Self {
        use rustls::AlertDescription as A;
        use CertificateError as C;
        match e {
            rustls::Error::InvalidCertificate(cert) => match cert {
                C::UnknownIssuer | C::BadSignature | C::UnknownRevocationStatus => {
                    Cause::NotTrusted
                }
                C::NotValidForName | C::NotValidForNameContext { .. } => Cause::NameMismatch,
                C::Expired | C::ExpiredContext { .. } => Cause::Expired,
                C::NotValidYet | C::NotValidYetContext { .. } => Cause::NotYetValid,
                C::Revoked => Cause::Revoked,
                _ => Cause::BadCertificate,
            },
            rustls::Error::AlertReceived(
                A::CertificateRequired
                | A::BadCertificate
                | A::UnknownCA
                | A::CertificateUnknown
                | A::AccessDenied,
            ) => Cause::ClientCertificateRefused,
            rustls::Error::AlertReceived(_) => Cause::Alert,
            rustls::Error::InvalidMessage(_)
            | rustls::Error::InappropriateMessage { .. }
            | rustls::Error::HandshakeNotComplete => Cause::NotTls,
            _ => Cause::Other,
        }
    }
}

/// A failed handshake: its cause, and rustls' error for the details.
#[derive(Clone, Copy, Debug)]
pub struct Failure<'a> {
    pub cause: Cause,
    pub error: &'a rustls::Error,
}

impl Failure<'_> {
    /// The cause in a few words ("unknown issuer", "name mismatch",
    /// "expired", ...); rustls' own words past the certificate errors.
    pub fn name(&self) -> Cow<'static, str> {
        use CertificateError as C;
        let rustls::Error::InvalidCertificate(cert) = self.error else {
            return self.error.to_string().into();
        };
        match cert {
            C::UnknownIssuer => "unknown issuer",
            C::NotValidForName | C::NotValidForNameContext { .. } => "name mismatch",
            C::Expired | C::ExpiredContext { .. } => "expired",
            C::NotValidYet | C::NotValidYetContext { .. } => "not yet valid",
            C::Revoked => "revoked",
            C::BadSignature => "bad signature",
            C::BadEncoding => "bad encoding",
            other => return format!("invalid certificate: {other}").into(),
        }
        .into()
    }

    /// The names the server's certificate carries, when rustls says.
    pub fn presented_names(&self) -> Option<String> {
        let bare = |n: &String| {
            n.strip_prefix("DnsName(\"")?
                .strip_suffix("\")")
                .map(Into::into)
        };
        let rustls::Error::InvalidCertificate(CertificateError::NotValidForNameContext {
            presented,
            ..
        }) = self.error
        else {
            return None;
        };
        let names: Vec<String> = presented
            .iter()
            .map(|n| bare(n).unwrap_or(n.clone()))
            .collect();
        Some(names.join(", "))
    }
}

/// The handshake failure in `err`'s chain, if any, found by type.
pub fn diagnose<'a>(err: &'a (dyn std::error::Error + 'static)) -> Option<Failure<'a>> {
    errors::find::<rustls::Error>(err).map(|error| Failure {
        cause: Cause::of(error),
        error,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const NAMES: FileNames = FileNames::new("ca_file", "cert_file", "key_file");

    fn tls(check: ServerCheck, ca: &str) -> ClientTls {
        ClientTls {
            check,
            roots: Roots::File(ca.into()),
            identity: None,
            names: NAMES,
        }
    }

    #[test]
    fn files_are_named_and_encrypt_only_reads_no_roots() {
        let err = client_config(&tls(ServerCheck::Chain, "/nonexistent/ca.pem")).unwrap_err();
        let err = err.to_string();
        assert!(err.starts_with("ca_file /nonexistent/ca.pem: "), "{err}");
        assert!(client_config(&tls(ServerCheck::Nothing, "/nonexistent/ca.pem")).is_ok());

        let dir = tempfile::tempdir().unwrap();
        let (der, key) = (dir.path().join("ca.der"), dir.path().join("k.pem"));
        std::fs::write(&der, [0x30, 0x82, 1, 2]).unwrap();
        let err = load_certs("redis.ca_file", &der).unwrap_err().to_string();
        assert!(err.ends_with("no PEM certificate in it"), "{err}");
        let err = load_key("redis.key_file", &der).unwrap_err().to_string();
        assert!(err.contains("no PEM private key"), "{err}");
        let pem = "-----BEGIN EC PRIVATE KEY-----\nAA==\n-----END EC PRIVATE KEY-----\n";
        std::fs::write(&key, pem).unwrap();
        assert!(load_key("redis.key_file", &key).is_ok());
    }

    #[test]
    fn handshake_failures_are_found_by_type_and_named() {
        use rustls::{AlertDescription as A, CertificateError as C, Error as E};
        use Cause::*;
        let cert = E::InvalidCertificate;
        for (err, cause, name) in [
            (cert(C::UnknownIssuer), NotTrusted, "unknown issuer"),
            (cert(C::BadSignature), NotTrusted, "bad signature"),
            (cert(C::NotValidForName), NameMismatch, "name mismatch"),
            (cert(C::Expired), Expired, "expired"),
            (cert(C::NotValidYet), NotYetValid, "not yet valid"),
            (cert(C::BadEncoding), BadCertificate, "bad encoding"),
            (
                E::AlertReceived(A::CertificateRequired),
                ClientCertificateRefused,
                "",
            ),
            (E::AlertReceived(A::HandshakeFailure), Alert, ""),
            (
                E::InvalidMessage(rustls::InvalidMessage::InvalidContentType),
                NotTls,
                "",
            ),
        ] {
            // As hyper-rustls hands it on: an io::Error in an io::Error.
            let inner = std::io::Error::new(std::io::ErrorKind::InvalidData, err.clone());
            let io = std::io::Error::other(inner);
            let failure = diagnose(&io).unwrap_or_else(|| panic!("{err:?} not found"));
            assert_eq!((failure.cause, failure.error), (cause, &err));
            let certificate = matches!(err, E::InvalidCertificate(_));
            assert_eq!(failure.cause.is_certificate(), certificate, "{err:?}");
            let name = if certificate {
                name.into()
            } else {
                err.to_string()
            };
            assert_eq!(failure.name(), name);
        }
        let plain = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "refused");
        assert!(diagnose(&plain).is_none());
    }
}
