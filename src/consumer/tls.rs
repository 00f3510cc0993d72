//! TLS to the brokers through `net::tls`, as the stores' (the same PEM
//! loader, trust roots, client certificates and verifier): each consumer's
//! rustls `ClientConfig` is built once at start-up, so a missing or bad
//! file stops the start, and handed to the broker's client (async-nats
//! takes it as is; lapin gets a stream this config already secured). A
//! failed handshake is named by its cause (`net::tls::diagnose`), with the
//! setting to change.

use crate::config::consumers::{ConsumerConfig, SourceConfig, TLS_FILES};
use crate::net::errors::Chain;
use crate::net::tls::{self, Cause, ClientTls, Roots, ServerCheck};
use std::sync::Arc;

/// The consumer's rustls configuration: for an `amqps://` or `tls://`
/// URL, from its settings; for `nats://`, the system roots (used only if
/// the server requires TLS; `None` when there are none); for `amqp://`,
/// `None`.
pub fn client_config(c: &ConsumerConfig) -> Result<Option<Arc<rustls::ClientConfig>>, String> {
    let settings = match &c.source {
        SourceConfig::Amqp(a) => a.tls.as_ref(),
        SourceConfig::JetStream(j) => j.tls.as_ref(),
    };
    let built = match settings {
        Some(settings) => {
            tls::client_config(settings).map_err(|e| format!("consumer {:?}: {e}", &*c.name))?
        }
        None if matches!(c.source, SourceConfig::JetStream(_)) => {
            match tls::client_config(&system_roots()) {
                Ok(config) => config,
                Err(_) => return Ok(None),
            }
        }
        None => return Ok(None),
    };
    Ok(Some(Arc::new(built)))
}

fn system_roots() -> ClientTls {
    ClientTls {
        check: ServerCheck::ChainAndName,
        roots: Roots::System,
        identity: None,
        names: TLS_FILES,
    }
}

/// `err` in one line: for a failed TLS handshake with `broker` ("NATS",
/// "RabbitMQ"), its cause and the setting to change first.
pub fn describe(broker: &str, err: &(dyn std::error::Error + 'static)) -> String {
    let text = Chain(err).to_string();
    let Some(failure) = tls::diagnose(err) else {
        return text;
    };
    let cause = match failure.cause {
        Cause::NotTrusted => format!(
            "the broker's certificate is not trusted ({}): it is not signed by the CA in source ca_file (or, without it, by a system root)",
            failure.name()
        ),
        Cause::NameMismatch => format!(
            "host name mismatch: the broker's certificate is not valid for the host in the url{}: connect by a name the certificate lists",
            failure
                .presented_names()
                .map(|names| format!(" (it names {names})"))
                .unwrap_or_default()
        ),
        Cause::Expired => "the broker's certificate has expired".into(),
        Cause::NotYetValid => "the broker's certificate is not valid yet (check the clocks)".into(),
        Cause::Revoked => "the broker's certificate is revoked".into(),
        Cause::BadCertificate => {
            format!("the broker's certificate was refused: {}", failure.name())
        }
        Cause::ClientCertificateRefused => format!(
            "the broker refused the client certificate ({}): set source cert_file and key_file, and check that the broker trusts their CA",
            failure.error
        ),
        Cause::NotTls => "the broker does not speak TLS on this port: use the broker's TLS port, or a plain URL".into(),
        Cause::Alert | Cause::Other => format!("{}", failure.error),
    };
    format!("TLS handshake with {broker} failed: {cause} ({text})")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_handshake_failure_names_the_broker_and_its_cause() {
        let unknown = rustls::Error::InvalidCertificate(rustls::CertificateError::UnknownIssuer);
        let io = std::io::Error::new(std::io::ErrorKind::InvalidData, unknown);
        let text = describe("NATS", &io);
        assert!(
            text.starts_with("TLS handshake with NATS failed: the broker's certificate is not trusted (unknown issuer): "),
            "{text}"
        );
        assert!(text.contains("source ca_file"), "{text}");
        let refused = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "refused");
        assert_eq!(describe("RabbitMQ", &refused), "refused");
    }
}
