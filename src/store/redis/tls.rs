//! TLS for the Redis fast path: the certificate files `[redis]` names, read
//! into the client's form, and connection errors named by their cause.
//!
//! The client (redis-rs with rustls) verifies the server's certificate
//! against `redis.ca_file` when set, else the system roots, and checks the
//! host name in `redis.url`; there is no switch to turn either off.

use crate::config::RedisConfig;
use crate::store::StoreError;
use redis::{ClientTlsConfig, TlsCertificates};
use std::path::Path;

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
    let root_cert = cfg
        .ca_file
        .as_deref()
        .map(|p| read_pem("redis.ca_file", p, "CERTIFICATE"))
        .transpose()?;
    let client_tls = match (&cfg.cert_file, &cfg.key_file) {
        (Some(cert), Some(key)) => Some(ClientTlsConfig {
            client_cert: read_pem("redis.cert_file", cert, "CERTIFICATE")?,
            client_key: read_pem("redis.key_file", key, "PRIVATE KEY")?,
        }),
        // The config refuses one without the other.
        _ => None,
    };
    Ok(Some(TlsCertificates {
        client_tls,
        root_cert,
    }))
}

/// Reads a PEM file, failing with the key and path when it is missing or
/// holds no `-----BEGIN ...{kind}-----` block (a DER file, say).
fn read_pem(key: &str, path: &Path, kind: &str) -> Result<Vec<u8>, StoreError> {
    let bytes = std::fs::read(path)
        .map_err(|e| StoreError::Unavailable(format!("{key} {}: {e}", path.display())))?;
    let text = String::from_utf8_lossy(&bytes);
    let has_block = text
        .lines()
        .any(|l| l.starts_with("-----BEGIN ") && l.trim_end().ends_with(&format!("{kind}-----")));
    if !has_block {
        return Err(StoreError::Unavailable(format!(
            "{key} {}: no PEM {kind} in it",
            path.display()
        )));
    }
    Ok(bytes)
}

/// The cause named when a `rediss://` URL points at a plain server.
pub(crate) const NOT_TLS: &str =
    "the server does not speak TLS: use redis:// for a plain port, or the server's TLS port";

/// `(host, port)` of a TLS URL, for [`answers_plain_ping`].
pub(super) fn plain_address(cfg: &RedisConfig) -> Option<(String, u16)> {
    use redis::IntoConnectionInfo;
    match cfg
        .client_url()
        .as_str()
        .into_connection_info()
        .ok()?
        .addr()
    {
        redis::ConnectionAddr::TcpTls { host, port, .. } => Some((host.clone(), *port)),
        _ => None,
    }
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

/// What went wrong, in the operator's words, for a TLS failure the error
/// text shows (rustls' messages, as redis-rs passes them on); `None` for
/// anything else.
pub(crate) fn tls_cause(error_text: &str) -> Option<&'static str> {
    const CAUSES: [(&[&str], &str); 5] = [
        (
            &["UnknownIssuer", "BadSignature", "UnknownRevocationStatus"],
            "certificate not trusted: the server's certificate is not signed by redis.ca_file (or, without it, by a system root)",
        ),
        (
            &["NotValidForName", "not valid for name"],
            "host name mismatch: the server's certificate does not name the host in redis.url",
        ),
        (
            &["Expired", "certificate expired", "NotValidYet"],
            "certificate expired or not yet valid: check the server's certificate dates and this machine's clock",
        ),
        (
            &["corrupt message", "InvalidContentType", "InappropriateMessage", "HandshakeNotComplete"],
            NOT_TLS,
        ),
        (
            &["CertificateRequired", "BadCertificate", "HandshakeFailure", "UnknownCA", "received fatal alert"],
            "the server refused the TLS handshake: it requires a client certificate (redis.cert_file, redis.key_file) or did not accept the one given",
        ),
    ];
    CAUSES
        .iter()
        .find(|(needles, _)| needles.iter().any(|n| error_text.contains(n)))
        .map(|(_, cause)| *cause)
}

/// `err` with its cause in front when it is a TLS failure, for logs and
/// `/readyz`.
pub(crate) fn describe(err: &dyn std::error::Error) -> String {
    let mut text = err.to_string();
    let mut source = err.source();
    while let Some(s) = source {
        let more = s.to_string();
        if !text.contains(&more) {
            text.push_str(": ");
            text.push_str(&more);
        }
        source = s.source();
    }
    match tls_cause(&text) {
        Some(cause) => format!("{cause} ({text})"),
        None => text,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The rustls messages each cause is recognised by (as redis-rs shows them).
    #[test]
    fn tls_failures_are_named_by_their_cause() {
        for (text, want) in [
            ("invalid peer certificate: UnknownIssuer", Some("certificate not trusted")),
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
            let got = tls_cause(text);
            match want {
                Some(w) => assert!(got.is_some_and(|g| g.contains(w)), "{text}: {got:?}"),
                None => assert_eq!(got, None, "{text}"),
            }
        }
    }

    #[test]
    fn certificate_files_must_exist_and_hold_pem() {
        let dir = tempfile::tempdir().unwrap();
        let der = dir.path().join("ca.der");
        std::fs::write(&der, [0x30, 0x82, 1, 2]).unwrap();
        let e = read_pem("redis.ca_file", &der, "CERTIFICATE")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("redis.ca_file") && e.contains("no PEM CERTIFICATE"),
            "{e}"
        );
        let missing = dir.path().join("nope.pem");
        let e = read_pem("redis.key_file", &missing, "PRIVATE KEY")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("redis.key_file") && e.contains("nope.pem"),
            "{e}"
        );
        let pem = dir.path().join("k.pem");
        std::fs::write(
            &pem,
            "-----BEGIN EC PRIVATE KEY-----\nAA==\n-----END EC PRIVATE KEY-----\n",
        )
        .unwrap();
        assert!(read_pem("redis.key_file", &pem, "PRIVATE KEY").is_ok());
    }
}
