//! TLS for the Redis fast path: the certificate files `[redis]` names,
//! checked by `net::tls` and handed to the client as the PEM it takes, and
//! connection errors named by their cause (`net::tls::diagnose`).
//!
//! The client (redis-rs with rustls) verifies the server's certificate
//! against `redis.ca_file` when set, else the system roots, and checks the
//! host name in `redis.url`; there is no switch to turn either off. It
//! builds its own rustls config from PEM bytes, so it takes no
//! `ClientConfig` from `net::tls`.

use crate::config::RedisConfig;
use crate::net::errors::Chain;
use crate::net::tls::{self, Cause};
use crate::store::StoreError;
use redis::{ClientTlsConfig, TlsCertificates};

/// Makes ring the process's rustls crypto provider unless one is installed
/// already: redis-rs builds its TLS config from the process default.
pub(super) fn install_crypto_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

/// The certificates the client is given beyond the system roots; `None`
/// when `[redis]` names no file (or the URL is not TLS).
pub(super) fn certificates(cfg: &RedisConfig) -> Result<Option<TlsCertificates>, StoreError> {
    if !cfg.is_tls() || (cfg.ca_file.is_none() && cfg.cert_file.is_none()) {
        return Ok(None);
    }
    let root_cert = match &cfg.ca_file {
        Some(ca) => Some(tls::load_certs("redis.ca_file", ca)?.1),
        None => None,
    };
    let client_tls = match (&cfg.cert_file, &cfg.key_file) {
        (Some(cert), Some(key)) => Some(ClientTlsConfig {
            client_cert: tls::load_certs("redis.cert_file", cert)?.1,
            client_key: tls::load_key("redis.key_file", key)?.1,
        }),
        // The config refuses one without the other.
        _ => None,
    };
    Ok(Some(TlsCertificates {
        client_tls,
        root_cert,
    }))
}

/// The cause named when a `rediss://` URL points at a plain server.
pub(crate) const NOT_TLS: &str =
    "the server does not speak TLS: use redis:// for a plain port, or the server's TLS port";

/// `(host, port)` of a TLS URL, for [`answers_plain_ping`].
pub(super) fn plain_address(cfg: &RedisConfig) -> Option<(String, u16)> {
    use redis::IntoConnectionInfo;
    let info = cfg.client_url().as_str().into_connection_info().ok()?;
    let redis::ConnectionAddr::TcpTls { host, port, .. } = info.addr() else {
        return None;
    };
    Some((host.clone(), *port))
}

/// Whether `host:port` answers a plain-text `PING` like Redis does
/// (`+PONG`, or an error such as `-NOAUTH`), within `timeout`.
pub(super) async fn answers_plain_ping(
    host: &str,
    port: u16,
    timeout: std::time::Duration,
) -> bool {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let attempt = async {
        let mut stream = tokio::net::TcpStream::connect((host, port)).await.ok()?;
        stream.write_all(b"PING\r\n").await.ok()?;
        let mut first = [0u8; 1];
        stream.read_exact(&mut first).await.ok()?;
        Some(matches!(first[0], b'+' | b'-'))
    };
    matches!(tokio::time::timeout(timeout, attempt).await, Ok(Some(true)))
}

/// `err` with its cause in front when it is a TLS failure, for logs and
/// `/readyz`.
pub(crate) fn describe(err: &redis::RedisError) -> String {
    let text = Chain(err).to_string();
    let cause = tls::diagnose(err)
        .map(|failure| failure.cause)
        .or_else(|| cause_in_text(&text));
    match cause.and_then(sentence) {
        Some(sentence) => format!("{sentence} ({text})"),
        None => text,
    }
}

/// A TLS failure in the operator's words; `None` for causes with none.
fn sentence(cause: Cause) -> Option<&'static str> {
    Some(match cause {
        Cause::NotTrusted => "certificate not trusted: the server's certificate is not signed by redis.ca_file (or, without it, by a system root)",
        Cause::NameMismatch => "host name mismatch: the server's certificate does not name the host in redis.url",
        Cause::Expired | Cause::NotYetValid => "certificate expired or not yet valid: check the server's certificate dates and this machine's clock",
        Cause::NotTls => NOT_TLS,
        Cause::ClientCertificateRefused | Cause::Alert => "the server refused the TLS handshake: it requires a client certificate (redis.cert_file, redis.key_file) or did not accept the one given",
        Cause::Revoked | Cause::BadCertificate | Cause::Other => return None,
    })
}

/// The cause from rustls' words, where redis-rs hands the error on as text
/// only: its cluster client flattens a node's connect error into
/// "Failed to create initial connections - Io: ...". Everywhere else the
/// typed error is found.
fn cause_in_text(text: &str) -> Option<Cause> {
    const WORDS: [(&str, Cause); 9] = [
        ("UnknownIssuer", Cause::NotTrusted),
        ("BadSignature", Cause::NotTrusted),
        ("UnknownRevocationStatus", Cause::NotTrusted),
        ("not valid for name", Cause::NameMismatch),
        ("certificate expired", Cause::Expired),
        ("Expired", Cause::Expired),
        ("NotValidYet", Cause::NotYetValid),
        ("received corrupt message", Cause::NotTls),
        ("received fatal alert", Cause::Alert),
    ];
    WORDS
        .iter()
        .find(|(words, _)| text.contains(words))
        .map(|(_, cause)| *cause)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The rustls words each cause is recognised by where redis-rs flattens
    /// the error to text (its cluster client).
    #[test]
    fn tls_failures_in_text_are_named_by_their_cause() {
        for (text, want) in [
            ("Failed to create initial connections - Io: invalid peer certificate: UnknownIssuer", Some("certificate not trusted")),
            (
                "I/O error - invalid peer certificate: certificate not valid for name \"localhost\"; certificate is only valid for redis.test",
                Some("host name mismatch"),
            ),
            ("invalid peer certificate: certificate expired: verification time 5", Some("certificate expired")),
            ("received corrupt message of type InvalidContentType", Some("does not speak TLS")),
            ("received fatal alert: CertificateRequired", Some("requires a client certificate")),
            ("received fatal alert: HandshakeFailure", Some("requires a client certificate")),
            ("Connection refused (os error 111)", None),
            ("key moved", None),
        ] {
            let got = cause_in_text(text).and_then(sentence);
            match want {
                Some(w) => assert!(got.is_some_and(|g| g.contains(w)), "{text}: {got:?}"),
                None => assert_eq!(got, None, "{text}"),
            }
        }
    }

    /// redis-rs keeps an io error behind an `Arc`: the rustls error in it
    /// is found by type, not by its text.
    #[test]
    fn a_typed_tls_failure_is_named_without_its_text() {
        let tls = rustls::Error::InvalidCertificate(rustls::CertificateError::NotValidForName);
        let io = std::io::Error::new(std::io::ErrorKind::InvalidData, tls);
        let text = describe(&redis::RedisError::from(io));
        assert!(text.starts_with("host name mismatch: "), "{text}");
    }
}
