//! TLS for `https://` upstreams: the upstream's settings as a
//! `net::tls` client (roots are the system's unless it names a `ca_file`; a
//! `cert_file` + `key_file` pair is the client certificate for upstreams
//! that require mTLS), and what a failed handshake tells the client. SNI
//! and the name the certificate must carry are the URL's host
//! (hyper-rustls).

use crate::config::UpstreamTls;
use crate::net::tls::{self, ClientIdentity, ClientTls, FileNames, Roots, ServerCheck, TlsError};
use rustls::ClientConfig;
use std::error::Error as StdError;

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
pub fn client_config(cfg: &UpstreamTls) -> Result<ClientConfig, TlsError> {
    tls::client_config(&ClientTls {
        check: ServerCheck::ChainAndName,
        roots: cfg.ca_file.clone().map_or(Roots::System, Roots::File),
        // The config refuses one without the other.
        identity: cfg
            .cert_file
            .clone()
            .zip(cfg.key_file.clone())
            .map(|(cert, key)| ClientIdentity { cert, key }),
        names: FileNames::new("ca_file", "cert_file", "key_file"),
    })
}

/// The TLS failure somewhere in a client error's source chain, if any.
pub fn failure_in(err: &(dyn StdError + 'static)) -> Option<TlsFailure> {
    let failure = tls::diagnose(err)?;
    Some(match failure.error {
        _ if failure.cause.is_certificate() => TlsFailure::Untrusted(failure.name().into()),
        rustls::Error::AlertReceived(alert) => {
            TlsFailure::Handshake(format!("the upstream sent the alert {alert:?}"))
        }
        other => TlsFailure::Handshake(other.to_string()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use rustls::{AlertDescription, CertificateError as C, Error as E};

    #[test]
    fn certificate_errors_name_their_cause_and_share_one_detail() {
        let untrusted = "the upstream's TLS certificate is not trusted";
        let cert = E::InvalidCertificate;
        for (err, cause, detail) in [
            (cert(C::UnknownIssuer), "unknown issuer", untrusted),
            (cert(C::NotValidForName), "name mismatch", untrusted),
            (cert(C::Expired), "expired", untrusted),
            (
                E::AlertReceived(AlertDescription::CertificateRequired),
                "the upstream sent the alert CertificateRequired",
                "the TLS handshake with the upstream failed",
            ),
        ] {
            // hyper-rustls wraps tokio-rustls's io::Error in another one: the
            // first end-to-end run showed the raw chain to clients because of it.
            let inner = std::io::Error::new(std::io::ErrorKind::InvalidData, err);
            let failure = failure_in(&std::io::Error::other(inner)).expect("found");
            assert_eq!((failure.cause(), failure.detail()), (cause, detail));
        }
        let plain = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "refused");
        assert_eq!(failure_in(&plain), None);
    }
}
