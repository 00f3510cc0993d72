//! `[log]`: the log format and level.

use super::raw::RawLog;
use super::Invalid;
use serde::Deserialize;

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    #[default]
    Text,
    Json,
}

#[derive(Clone, Debug)]
pub struct LogConfig {
    pub format: LogFormat,
    /// An `EnvFilter` directive; `RUST_LOG` wins when set.
    pub level: String,
}

impl Default for LogConfig {
    fn default() -> Self {
        Self {
            format: LogFormat::Text,
            level: "info".to_string(),
        }
    }
}

impl TryFrom<RawLog> for LogConfig {
    type Error = Invalid;

    fn try_from(l: RawLog) -> Result<Self, Invalid> {
        let default = LogConfig::default();
        let log = LogConfig {
            format: l.format.unwrap_or(default.format),
            level: l.level.unwrap_or(default.level),
        };
        tracing_subscriber::EnvFilter::try_new(&log.level)
            .map_err(|e| format!("log.level {:?}: {e}", log.level))?;
        Ok(log)
    }
}
