//! TLS clients: what to trust and what to present, turned into a rustls
//! [`ClientConfig`]. Shared by every outgoing TLS connection (PostgreSQL
//! today; the same builder suits Redis or an upstream): the trust roots
//! (a CA file, or the system's), an optional client certificate, and how
//! much of the server's certificate is checked ([`ServerCheck`]: libpq's
//! `require` / `verify-ca` / `verify-full`).
//!
//! It also owns turning a rustls error into a sentence that names the
//! cause ([`describe`]): an operator reading "unknown issuer" in a log
//! should learn which setting to change.
//!
//! The crypto provider is ring, passed explicitly: no process-wide default
//! has to be installed, and nothing here depends on one.

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::WebPkiServerVerifier;
use rustls::crypto::{CryptoProvider, WebPkiSupportedAlgorithms};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::{
    CertificateError, ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme,
};
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
    /// A PEM file of CA certificates (libpq's `sslrootcert`).
    File(PathBuf),
}

/// A client certificate and its private key, both PEM files.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClientIdentity {
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// Everything a TLS client needs decided.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClientTls {
    pub check: ServerCheck,
    pub roots: Roots,
    pub identity: Option<ClientIdentity>,
}

/// A TLS setting that cannot be used; says which file and why.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("cannot read {what} {path}: {reason}")]
    Read {
        what: &'static str,
        path: PathBuf,
        reason: String,
    },
    #[error("{what} {path} holds no PEM certificate")]
    NoCertificate { what: &'static str, path: PathBuf },
    #[error("no usable root certificates in the system store ({0}); install ca-certificates or name a CA file")]
    NoSystemRoots(String),
    #[error("{what}: {reason}")]
    Invalid { what: &'static str, reason: String },
}

/// The crypto provider every config here uses.
fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// PEM certificates from `path` (`what` names the setting in errors).
pub fn load_certs(
    what: &'static str,
    path: &Path,
) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let read_err = |reason: String| TlsError::Read {
        what,
        path: path.to_path_buf(),
        reason,
    };
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|e| read_err(pem_reason(e)))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| read_err(pem_reason(e)))?;
    if certs.is_empty() {
        return Err(TlsError::NoCertificate {
            what,
            path: path.to_path_buf(),
        });
    }
    Ok(certs)
}

/// The PEM private key in `path` (PKCS#8, PKCS#1 or SEC1).
pub fn load_key(what: &'static str, path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    PrivateKeyDer::from_pem_file(path).map_err(|e| TlsError::Read {
        what,
        path: path.to_path_buf(),
        reason: pem_reason(e),
    })
}

fn pem_reason(e: rustls::pki_types::pem::Error) -> String {
    match e {
        rustls::pki_types::pem::Error::Io(io) => io.to_string(),
        rustls::pki_types::pem::Error::NoItemsFound => "no PEM item of the expected kind".into(),
        other => format!("not valid PEM ({other:?})"),
    }
}

/// The trust anchors `roots` names.
pub fn root_store(roots: &Roots) -> Result<RootCertStore, TlsError> {
    let mut store = RootCertStore::empty();
    match roots {
        Roots::File(path) => {
            for cert in load_certs("CA file", path)? {
                store.add(cert).map_err(|e| TlsError::Invalid {
                    what: "CA file",
                    reason: format!("{}: {e}", path.display()),
                })?;
            }
        }
        Roots::System => {
            let found = rustls_native_certs::load_native_certs();
            let (added, _ignored) = store.add_parsable_certificates(found.certs);
            if added == 0 {
                let why = found
                    .errors
                    .first()
                    .map(|e| e.to_string())
                    .unwrap_or_else(|| "none found".into());
                return Err(TlsError::NoSystemRoots(why));
            }
        }
    }
    Ok(store)
}

/// The rustls client configuration for `tls`. Reads the files now, so a
/// missing or unreadable one is reported at start-up, not per connection.
pub fn client_config(tls: &ClientTls) -> Result<ClientConfig, TlsError> {
    let provider = provider();
    let builder = ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError::Invalid {
            what: "TLS versions",
            reason: e.to_string(),
        })?;
    let verifier: Arc<dyn ServerCertVerifier> = match tls.check {
        ServerCheck::Nothing => Arc::new(AcceptAnyCertificate {
            algorithms: provider.signature_verification_algorithms,
        }),
        ServerCheck::Chain | ServerCheck::ChainAndName => {
            let roots = Arc::new(root_store(&tls.roots)?);
            let webpki = WebPkiServerVerifier::builder_with_provider(roots, provider.clone())
                .build()
                .map_err(|e| TlsError::Invalid {
                    what: "trust roots",
                    reason: e.to_string(),
                })?;
            if tls.check == ServerCheck::Chain {
                Arc::new(ChainOnly(webpki))
            } else {
                webpki
            }
        }
    };
    let builder = builder
        .dangerous()
        .with_custom_certificate_verifier(verifier);
    match &tls.identity {
        None => Ok(builder.with_no_client_auth()),
        Some(id) => {
            let certs = load_certs("client certificate", &id.cert)?;
            let key = load_key("client key", &id.key)?;
            builder
                .with_client_auth_cert(certs, key)
                .map_err(|e| TlsError::Invalid {
                    what: "client certificate and key",
                    reason: format!("{} / {}: {e}", id.cert.display(), id.key.display()),
                })
        }
    }
}

// === verifiers ===

/// [`ServerCheck::Nothing`]: any certificate, but the handshake must still
/// be signed by its key (so the session is at least bound to it).
#[derive(Debug)]
struct AcceptAnyCertificate {
    algorithms: WebPkiSupportedAlgorithms,
}

impl ServerCertVerifier for AcceptAnyCertificate {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
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

/// [`ServerCheck::Chain`]: webpki's full check, with only a name mismatch
/// forgiven. webpki checks the chain before the name, so a
/// `NotValidForName` means the chain was already found trusted.
#[derive(Debug)]
struct ChainOnly(Arc<WebPkiServerVerifier>);

impl ServerCertVerifier for ChainOnly {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        match self
            .0
            .verify_server_cert(end_entity, intermediates, server_name, ocsp, now)
        {
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
        self.0.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_verify_schemes()
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

// === errors ===

/// The first rustls error in `err`'s source chain (tokio-rustls wraps it
/// in an `io::Error`).
pub fn find_rustls_error<'a>(
    err: &'a (dyn std::error::Error + 'static),
) -> Option<&'a rustls::Error> {
    let mut cur = Some(err);
    while let Some(e) = cur {
        if let Some(tls) = e.downcast_ref::<rustls::Error>() {
            return Some(tls);
        }
        if let Some(io) = e.downcast_ref::<std::io::Error>() {
            if let Some(tls) = io.get_ref().and_then(|i| i.downcast_ref::<rustls::Error>()) {
                return Some(tls);
            }
        }
        cur = e.source();
    }
    None
}

/// A sentence naming what went wrong in a handshake with `host`, and what
/// to change; `setting` is how the user names the CA (e.g. `sslrootcert`).
pub fn describe(err: &rustls::Error, host: &str, setting: &str) -> String {
    use rustls::AlertDescription as Alert;
    match err {
        rustls::Error::InvalidCertificate(cert) => match cert {
            CertificateError::UnknownIssuer => format!(
                "the server's certificate is not trusted (unknown issuer): \
                 name the CA that signed it with {setting}, or encrypt without verifying"
            ),
            CertificateError::NotValidForName => {
                format!("host name mismatch: the server's certificate is not valid for {host:?}")
            }
            CertificateError::NotValidForNameContext { presented, .. } => format!(
                "host name mismatch: the server's certificate is not valid for {host:?} (it names {})",
                presented
                    .iter()
                    .map(|name| name
                        .strip_prefix("DnsName(\"")
                        .and_then(|n| n.strip_suffix("\")"))
                        .unwrap_or(name))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
            CertificateError::Expired | CertificateError::ExpiredContext { .. } => {
                "the server's certificate has expired".into()
            }
            CertificateError::NotValidYet | CertificateError::NotValidYetContext { .. } => {
                "the server's certificate is not valid yet (check the clocks)".into()
            }
            CertificateError::Revoked => "the server's certificate is revoked".into(),
            other => format!("the server's certificate was refused: {other:?}"),
        },
        rustls::Error::AlertReceived(
            Alert::CertificateRequired
            | Alert::BadCertificate
            | Alert::UnknownCA
            | Alert::CertificateUnknown
            | Alert::AccessDenied,
        ) => format!(
            "the server refused the client certificate ({err}): check the client certificate and key, and that the server trusts their CA"
        ),
        other => format!("TLS handshake with {host:?} failed: {other}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_files_are_named() {
        let err = load_certs("CA file", Path::new("/nonexistent/ca.pem")).unwrap_err();
        assert!(
            err.to_string().contains("CA file /nonexistent/ca.pem"),
            "{err}"
        );
        let tls = ClientTls {
            check: ServerCheck::ChainAndName,
            roots: Roots::File("/nonexistent/root.crt".into()),
            identity: None,
        };
        let err = client_config(&tls).unwrap_err().to_string();
        assert!(err.contains("/nonexistent/root.crt"), "{err}");
    }

    #[test]
    fn a_file_without_certificates_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("empty.pem");
        std::fs::write(&path, "not a certificate\n").unwrap();
        let err = load_certs("CA file", &path).unwrap_err().to_string();
        assert!(err.contains("holds no PEM certificate"), "{err}");
    }

    #[test]
    fn encrypt_only_needs_no_roots() {
        let tls = ClientTls {
            check: ServerCheck::Nothing,
            roots: Roots::File("/nonexistent/never-read.pem".into()),
            identity: None,
        };
        assert!(client_config(&tls).is_ok());
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

    #[test]
    fn causes_are_named() {
        let unknown = rustls::Error::InvalidCertificate(CertificateError::UnknownIssuer);
        assert!(describe(&unknown, "db", "sslrootcert").contains("not trusted"));
        let name = rustls::Error::InvalidCertificate(CertificateError::NotValidForName);
        assert!(describe(&name, "db", "sslrootcert").contains("host name mismatch"));
        let io = std::io::Error::new(std::io::ErrorKind::InvalidData, unknown.clone());
        assert_eq!(find_rustls_error(&io), Some(&unknown));
    }
}
