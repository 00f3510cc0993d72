//! `[tracing]`: OpenTelemetry traces exported over OTLP/HTTP. The section
//! turns tracing on; it needs a build with the `otel` cargo feature, and is
//! a config error without it (never silently ignored).

use super::raw::RawTracing;
use super::{mask_url, Invalid};
pub use crate::telemetry::trace::TracingConfig;
use http::Uri;
use std::fmt;

/// The OTLP/HTTP path a collector takes traces on (OTLP spec, "OTLP/HTTP").
const TRACES_PATH: &str = "/v1/traces";
pub const DEFAULT_SERVICE_NAME: &str = "idemgate";
/// Every trace: sampling is the collector's or the client's choice (a
/// request's `traceparent` decides for its own trace) until an operator
/// lowers it.
pub const DEFAULT_SAMPLING_RATIO: f64 = 1.0;

impl TryFrom<RawTracing> for TracingConfig {
    type Error = Invalid;

    fn try_from(t: RawTracing) -> Result<Self, Invalid> {
        let Some(endpoint) = t.otlp_endpoint else {
            return Err(
                "[tracing] needs otlp_endpoint, the collector's OTLP/HTTP URL (e.g. \"http://127.0.0.1:4318\")"
                    .into(),
            );
        };
        let span = endpoint.span();
        let traces_url = traces_url(endpoint.get_ref()).map_err(|e| Invalid::at(span, e))?;
        let service_name = t
            .service_name
            .unwrap_or_else(|| DEFAULT_SERVICE_NAME.to_string());
        if service_name.trim().is_empty() {
            return Err("tracing.service_name must not be empty".into());
        }
        let sampling_ratio = t.sampling_ratio.unwrap_or(DEFAULT_SAMPLING_RATIO);
        if !(0.0..=1.0).contains(&sampling_ratio) {
            return Err(format!(
                "tracing.sampling_ratio must be between 0 and 1 (got {sampling_ratio})"
            )
            .into());
        }
        Ok(Self {
            traces_url,
            service_name,
            sampling_ratio,
        })
    }
}

/// `http://host:port` → `http://host:port/v1/traces`; a URL with a path is
/// taken as the traces URL itself. Plain HTTP only: the exporter speaks to
/// a collector beside the process (an agent or sidecar), which forwards.
fn traces_url(s: &str) -> Result<Uri, String> {
    let shown = mask_url(s);
    let uri: Uri = s
        .parse()
        .map_err(|e| format!("invalid tracing.otlp_endpoint {shown:?}: {e}"))?;
    match uri.scheme_str() {
        Some("http") => {}
        Some(other) => {
            return Err(format!(
                "invalid tracing.otlp_endpoint {shown:?}: scheme {other:?} is not supported (use http:// to a local collector)"
            ))
        }
        None => {
            return Err(format!(
                "invalid tracing.otlp_endpoint {shown:?}: expected http://host:port"
            ))
        }
    }
    if uri.host().is_none() {
        return Err(format!(
            "invalid tracing.otlp_endpoint {shown:?}: missing host"
        ));
    }
    if uri.authority().is_some_and(|a| a.as_str().contains('@')) {
        return Err(
            "invalid tracing.otlp_endpoint: credentials (user:password@) are not supported"
                .to_string(),
        );
    }
    if matches!(uri.path(), "" | "/") && uri.query().is_none() {
        let base = s.trim_end_matches('/');
        return format!("{base}{TRACES_PATH}")
            .parse()
            .map_err(|e| format!("invalid tracing.otlp_endpoint {shown:?}: {e}"));
    }
    Ok(uri)
}

impl fmt::Display for TracingConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "tracing    OTLP/HTTP {} (service {:?}, sampling ratio {})",
            mask_url(&self.traces_url.to_string()),
            self.service_name,
            self.sampling_ratio
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoint_table() {
        for (given, want) in [
            (
                "http://127.0.0.1:4318",
                Ok("http://127.0.0.1:4318/v1/traces"),
            ),
            (
                "http://collector:4318/",
                Ok("http://collector:4318/v1/traces"),
            ),
            (
                "http://c:4318/otlp/v1/traces",
                Ok("http://c:4318/otlp/v1/traces"),
            ),
            ("https://c:4318", Err("scheme \"https\" is not supported")),
            ("127.0.0.1:4318", Err("")),
            ("http://", Err("")),
            ("http://u:pw@c:4318", Err("credentials")),
        ] {
            let got = traces_url(given).map(|u| u.to_string());
            match (got, want) {
                (Ok(got), Ok(want)) => assert_eq!(got, want, "{given}"),
                (Err(e), Err(part)) => assert!(e.contains(part), "{given}: {e}"),
                (got, want) => panic!("{given}: got {got:?}, want {want:?}"),
            }
        }
    }
}
