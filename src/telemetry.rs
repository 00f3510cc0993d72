//! Logging: `tracing` with an `EnvFilter` (`RUST_LOG` wins over
//! `log.level`), as text or JSON. Nothing logs raw keys, credentials or
//! bodies: requests are identified by `key.id`, a truncated hash.
//! OpenTelemetry traces (feature `otel`, `[tracing]`): [`trace`].

pub mod trace;

use std::io::IsTerminal;
use tracing_subscriber::EnvFilter;

/// `log.format`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    #[default]
    Text,
    Json,
}

/// Installs the global subscriber once (`level`: an `EnvFilter` directive); later calls are ignored.
pub fn init(format: LogFormat, level: &str) {
    // tokio_postgres logs every server NOTICE at info, and the redis crate
    // a warning per failed reconnect (several a second while a cluster node
    // is down); idemgate logs each outage once itself.
    let filter = EnvFilter::try_from_default_env()
        .or_else(|_| EnvFilter::try_new(format!("{level},tokio_postgres=warn,redis=error")))
        .unwrap_or_else(|_| EnvFilter::new("info"));
    // Colour codes only for a person at a terminal, never in a file or pipe.
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr);
    let _ = match format {
        LogFormat::Json => builder
            .json()
            .flatten_event(true)
            .with_current_span(false)
            .try_init(),
        LogFormat::Text => builder.try_init(),
    };
}
