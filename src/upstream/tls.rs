//! rustls client settings for `https://` upstreams, and what a failed
//! handshake means. Roots are the system's (rustls-native-certs) unless
//! the upstream names a `ca_file`; a `cert_file` + `key_file` pair is the
//! client certificate for upstreams that require mTLS. SNI and the name the
//! certificate must carry are the URL's host (hyper-rustls).
//!
//! The crypto provider is named explicitly (ring), so another crate of the
//! build enabling a second rustls provider cannot make the process-wide
//! default ambiguous.

use crate::config::UpstreamTls;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::{CertificateError, ClientConfig, RootCertStore};
use std::error::Error as StdError;
use std::path::Path;
use std::sync::Arc;

/// Why an upstream's TLS settings cannot be built (at start or reload).
#[derive(Debug, thiserror::Error)]
pub enum TlsSetupError {
    #[error("{what} {path}: {reason}")]
    File {
        what: &'static str,
        path: String,
        reason: String,
    },
    #[error("no system root certificates could be loaded ({0}); set a ca_file")]
    NoSystemRoots(String),
    #[error("TLS settings: {0}")]
    Rustls(#[from] rustls::Error),
}

/// A handshake that failed: the client sees a stable sentence
/// ([`TlsFailure::detail`]), the log the cause.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TlsFailure {
    /// The upstream's certificate did not verify; the cause in a few words
    /// (`unknown issuer`, `name mismatch`, `expired`, ...).
    Untrusted(String),
    /// Anything else in the handshake (an alert from the upstream, e.g. it
    /// wanted a client certificate, or no protocol in common).
    Handshake(String),
}

impl TlsFailure {
    /// What clients are told: no internals, the same for every cause.
    pub fn detail(&self) -> &'static str {
        match self {
            TlsFailure::Untrusted(_) => "the upstream's TLS certificate is not trusted",
            TlsFailure::Handshake(_) => "the TLS handshake with the upstream failed",
        }
    }

    /// What the log says.
    pub fn cause(&self) -> &str {
        match self {
            TlsFailure::Untrusted(cause) | TlsFailure::Handshake(cause) => cause,
        }
    }
}

/// The rustls client config for one upstream; ALPN is left to the
/// connector (it offers what the upstream's `protocol` allows).
pub fn client_config(tls: &UpstreamTls) -> Result<ClientConfig, TlsSetupError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let roots = match &tls.ca_file {
        Some(path) => roots_from(path)?,
        None => system_roots()?,
    };
    let builder = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots);
    Ok(match (&tls.cert_file, &tls.key_file) {
        (Some(cert), Some(key)) => builder.with_client_auth_cert(chain(cert)?, key_of(key)?)?,
        // The config refuses one without the other.
        _ => builder.with_no_client_auth(),
    })
}

fn file_error(what: &'static str, path: &Path, reason: impl ToString) -> TlsSetupError {
    TlsSetupError::File {
        what,
        path: path.display().to_string(),
        reason: reason.to_string(),
    }
}

fn certificates(
    what: &'static str,
    path: &Path,
) -> Result<Vec<CertificateDer<'static>>, TlsSetupError> {
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|e| file_error(what, path, e))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| file_error(what, path, e))?;
    if certs.is_empty() {
        return Err(file_error(what, path, "no PEM certificate in the file"));
    }
    Ok(certs)
}

fn roots_from(path: &Path) -> Result<RootCertStore, TlsSetupError> {
    const WHAT: &str = "ca_file";
    let mut roots = RootCertStore::empty();
    for cert in certificates(WHAT, path)? {
        roots.add(cert).map_err(|e| file_error(WHAT, path, e))?;
    }
    Ok(roots)
}

fn chain(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsSetupError> {
    certificates("cert_file", path)
}

fn key_of(path: &Path) -> Result<PrivateKeyDer<'static>, TlsSetupError> {
    // The error never quotes the file: it is a private key.
    PrivateKeyDer::from_pem_file(path).map_err(|e| {
        file_error(
            "key_file",
            path,
            format!("no PEM private key (PKCS#8, PKCS#1 or SEC1) could be read: {e}"),
        )
    })
}

/// The system's roots; unreadable ones are skipped, none at all is an error.
fn system_roots() -> Result<RootCertStore, TlsSetupError> {
    let found = rustls_native_certs::load_native_certs();
    let mut roots = RootCertStore::empty();
    let (added, _ignored) = roots.add_parsable_certificates(found.certs);
    if added == 0 {
        let why = found
            .errors
            .first()
            .map_or("none found".to_string(), ToString::to_string);
        return Err(TlsSetupError::NoSystemRoots(why));
    }
    Ok(roots)
}

/// The TLS failure somewhere in a client error's source chain, if any.
/// rustls errors reach hyper wrapped in `io::Error`s (tokio-rustls wraps
/// once, hyper-rustls again), whose `source()` skips the wrapped error
/// itself, so each `io::Error` is opened by hand.
pub fn failure_in(err: &(dyn StdError + 'static)) -> Option<TlsFailure> {
    let mut cur: Option<&(dyn StdError + 'static)> = Some(err);
    while let Some(e) = cur {
        if let Some(tls) = rustls_error_in(e) {
            return Some(classify(tls));
        }
        cur = e.source();
    }
    None
}

/// `e` itself, or what its nested `io::Error`s wrap, as a rustls error.
fn rustls_error_in<'a>(mut e: &'a (dyn StdError + 'static)) -> Option<&'a rustls::Error> {
    loop {
        if let Some(tls) = e.downcast_ref::<rustls::Error>() {
            return Some(tls);
        }
        let inner = e.downcast_ref::<std::io::Error>()?.get_ref()?;
        e = inner as &(dyn StdError + 'static);
    }
}

fn classify(e: &rustls::Error) -> TlsFailure {
    match e {
        rustls::Error::InvalidCertificate(cert) => TlsFailure::Untrusted(
            match cert {
                CertificateError::UnknownIssuer => "unknown issuer",
                CertificateError::NotValidForName
                | CertificateError::NotValidForNameContext { .. } => "name mismatch",
                CertificateError::Expired | CertificateError::ExpiredContext { .. } => "expired",
                CertificateError::NotValidYet | CertificateError::NotValidYetContext { .. } => {
                    "not yet valid"
                }
                CertificateError::Revoked => "revoked",
                CertificateError::BadSignature => "bad signature",
                CertificateError::BadEncoding => "bad encoding",
                _ => return TlsFailure::Untrusted(format!("invalid certificate: {cert}")),
            }
            .to_string(),
        ),
        rustls::Error::AlertReceived(alert) => {
            TlsFailure::Handshake(format!("the upstream sent the alert {alert:?}"))
        }
        other => TlsFailure::Handshake(other.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn certificate_errors_name_their_cause_and_share_one_detail() {
        let cases = [
            (CertificateError::UnknownIssuer, "unknown issuer"),
            (CertificateError::NotValidForName, "name mismatch"),
            (CertificateError::Expired, "expired"),
        ];
        for (err, cause) in cases {
            let io = std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                rustls::Error::InvalidCertificate(err),
            );
            let failure = failure_in(&io).expect("found in the io::Error");
            assert_eq!(failure.cause(), cause);
            assert_eq!(
                failure.detail(),
                "the upstream's TLS certificate is not trusted"
            );
        }
        // hyper-rustls wraps tokio-rustls's io::Error in another one: the
        // first end-to-end run showed the raw chain to clients because of it.
        let twice = std::io::Error::other(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            rustls::Error::InvalidCertificate(CertificateError::UnknownIssuer),
        ));
        assert_eq!(
            failure_in(&twice).map(|f| f.cause().to_string()),
            Some("unknown issuer".to_string())
        );
        let plain = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "refused");
        assert_eq!(failure_in(&plain), None);
    }
}
