//! Logging: `tracing` with an `EnvFilter` (`RUST_LOG` wins over
//! `log.level`), as text or JSON. Nothing logs raw keys, credentials or
//! bodies: requests are identified by `key.id`, a truncated hash.
//! OpenTelemetry traces (feature `otel`, `[tracing]`): [`trace`].

pub mod trace;

use crate::config::{LogConfig, LogFormat};
use std::io::IsTerminal;
use tracing_subscriber::EnvFilter;

/// Installs the global subscriber once; later calls are ignored.
pub fn init(cfg: &LogConfig) {
    // tokio_postgres logs every server NOTICE at info; keep those quiet.
    let filter = EnvFilter::try_from_default_env()
        .or_else(|_| EnvFilter::try_new(format!("{},tokio_postgres=warn", cfg.level)))
        .unwrap_or_else(|_| EnvFilter::new("info"));
    // Colour codes only for a person at a terminal, never in a file or pipe.
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr);
    let _ = match cfg.format {
        LogFormat::Json => builder
            .json()
            .flatten_event(true)
            .with_current_span(false)
            .try_init(),
        LogFormat::Text => builder.try_init(),
    };
}
