//! `[log]`: the log format and level.

use super::raw::RawLog;
use super::Invalid;
pub use crate::telemetry::LogFormat;

#[derive(Clone, Debug, PartialEq)]
pub struct LogConfig {
    pub format: LogFormat,
    /// An `EnvFilter` directive; `RUST_LOG` wins when set.
    pub level: String,
}

impl TryFrom<RawLog> for LogConfig {
    type Error = Invalid;

    fn try_from(l: RawLog) -> Result<Self, Invalid> {
        let (span, level) = match l.level {
            Some(level) => (Some(level.span()), level.into_inner()),
            None => (None, "info".to_string()),
        };
        let invalid = |message: String| match &span {
            Some(span) => Invalid::at(span.clone(), message),
            None => Invalid::field("log.level", message),
        };
        check_level(&level).map_err(|e| invalid(format!("log.level {level:?}: {e}")))?;
        tracing_subscriber::EnvFilter::try_new(&level)
            .map_err(|e| invalid(format!("log.level {level:?}: {e}")))?;
        Ok(LogConfig {
            format: l.format.unwrap_or_default(),
            level,
        })
    }
}

const LEVELS: [&str; 6] = ["off", "error", "warn", "info", "debug", "trace"];

/// `EnvFilter` reads a bare word as a target to log at every level, so a
/// misspelled level (`"verbose"`) would pass and silence every other line:
/// each directive must be a level, or `target=level`.
fn check_level(level: &str) -> Result<(), String> {
    for directive in level.split(',').map(str::trim).filter(|d| !d.is_empty()) {
        let word = match directive.rsplit_once('=') {
            Some((_, level)) => level,
            None => directive,
        };
        if !LEVELS.iter().any(|l| l.eq_ignore_ascii_case(word)) {
            return Err(format!(
                "{word:?} is not a level: use one of {} or target=level (e.g. \"info,idemgate=debug\")",
                LEVELS.join(", ")
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::check_level;

    #[test]
    fn levels_are_checked_word_by_word() {
        for ok in [
            "info",
            "WARN",
            "info,idemgate=debug",
            "off",
            "idemgate::proxy=trace,",
        ] {
            assert!(check_level(ok).is_ok(), "{ok}");
        }
        for bad in ["verbose", "idemgate", "info,idemgate=loud"] {
            assert!(check_level(bad).is_err(), "{bad}");
        }
    }
}
