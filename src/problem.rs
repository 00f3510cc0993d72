//! RFC 9457 problem details (`application/problem+json`): the only place a
//! [`ProxyError`] becomes a response. The match is exhaustive on purpose.
//!
//! Status codes follow the IETF Idempotency-Key draft §2.7 (400 missing,
//! 409 in flight, 422 reused with another request) and RFC 9110 for the rest.

use crate::body::{full, ProxyBody};
use crate::error::{ForwardError, ProxyError};
use crate::lease::KeyFate;
use crate::metrics::Outcome;
use http::{header, HeaderValue, Response, StatusCode};

/// Base of the `type` URIs; each problem's page section in the README.
const TYPE_BASE: &str = "https://github.com/idemgate/idemgate#problem-";

/// How long a client should wait before retrying when the store is down.
const STORE_RETRY_AFTER_SECS: u64 = 2;
/// Buffered bodies are read in well under a second when clients send at
/// speed; a stalled one holds its share until `request_body_timeout`.
const OVERLOADED_RETRY_AFTER_SECS: u64 = 1;

pub struct Problem {
    pub status: StatusCode,
    pub slug: &'static str,
    pub title: &'static str,
    pub detail: String,
    pub retry_after_secs: Option<u64>,
    pub outcome: Outcome,
    /// RFC 9457 §3.1.5: this occurrence, `urn:idemgate:request:<request id>`.
    pub instance: Option<String>,
}

impl Problem {
    pub fn from_error(err: &ProxyError) -> Self {
        let detail = err.to_string();
        let p = |status, slug, title, outcome| Problem {
            status,
            slug,
            title,
            detail: detail.clone(),
            retry_after_secs: None,
            outcome,
            instance: None,
        };
        let key_missing = || {
            p(
                StatusCode::BAD_REQUEST,
                "key-missing",
                "Idempotency-Key is missing",
                Outcome::MissingKey,
            )
        };
        match err {
            ProxyError::MissingKey { .. } => key_missing(),
            ProxyError::BodyKey { reason, .. } if reason.is_missing() => key_missing(),
            ProxyError::InvalidKey { .. } | ProxyError::BodyKey { .. } => p(
                StatusCode::BAD_REQUEST,
                "key-invalid",
                "Idempotency-Key is invalid",
                Outcome::InvalidKey,
            ),
            ProxyError::TooManyWaiters { retry_after_secs } => Problem {
                retry_after_secs: Some(*retry_after_secs),
                ..p(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "too-many-waiters",
                    "Too many duplicates are waiting",
                    Outcome::Overloaded,
                )
            },
            ProxyError::RepeatedScopeHeader(_) => p(
                StatusCode::BAD_REQUEST,
                "scope-header-repeated",
                "A scope header is repeated",
                Outcome::InvalidRequest,
            ),
            ProxyError::InvalidRequest(_) => p(
                StatusCode::BAD_REQUEST,
                "request-invalid",
                "The request is malformed",
                Outcome::InvalidRequest,
            ),
            ProxyError::UnsupportedTransferCoding { .. } => p(
                StatusCode::NOT_IMPLEMENTED,
                "transfer-coding-unsupported",
                "Transfer-coding not supported",
                Outcome::InvalidRequest,
            ),
            ProxyError::BodyTooLarge { .. } => p(
                StatusCode::PAYLOAD_TOO_LARGE,
                "body-too-large",
                "Request body too large",
                Outcome::TooLarge,
            ),
            ProxyError::BodyRead(_) => p(
                StatusCode::BAD_REQUEST,
                "body-unreadable",
                "Request body could not be read",
                Outcome::InvalidRequest,
            ),
            ProxyError::BodyTimeout => p(
                StatusCode::REQUEST_TIMEOUT,
                "body-timeout",
                "Request body timed out",
                Outcome::InvalidRequest,
            ),
            ProxyError::Overloaded => Problem {
                retry_after_secs: Some(OVERLOADED_RETRY_AFTER_SECS),
                detail: format!(
                    "{detail}; this one was not read or forwarded: retry after Retry-After seconds"
                ),
                ..p(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "overloaded",
                    "Too many request bodies in progress",
                    Outcome::Overloaded,
                )
            },
            ProxyError::InFlight { retry_after_secs } => Problem {
                retry_after_secs: Some(*retry_after_secs),
                ..p(
                    StatusCode::CONFLICT,
                    "in-flight",
                    "A request is outstanding for this Idempotency-Key",
                    Outcome::Conflict,
                )
            },
            ProxyError::Mismatch => p(
                StatusCode::UNPROCESSABLE_ENTITY,
                "key-reused",
                "Idempotency-Key is already used",
                Outcome::Mismatch,
            ),
            ProxyError::NotReplayable { .. } => Problem {
                detail: format!(
                    "{detail}; the request was executed once and will not be executed again. \
                     Use a new key for a new request."
                ),
                ..p(
                    StatusCode::GONE,
                    "response-not-stored",
                    "The original response cannot be replayed",
                    Outcome::NotReplayable,
                )
            },
            ProxyError::OutcomeUnknown => Problem {
                detail: format!(
                    "{detail}; it will not be sent again under this key. Check with the service \
                     whether it took effect; an operator can then delete the key \
                     (idemgate keys delete) to allow it to run again."
                ),
                ..p(
                    StatusCode::FAILED_DEPENDENCY,
                    "outcome-unknown",
                    "The outcome of the original request is unknown",
                    Outcome::OutcomeUnknown,
                )
            },
            ProxyError::Store(_) => Problem {
                retry_after_secs: Some(STORE_RETRY_AFTER_SECS),
                detail: "the idempotency store is unavailable; the request was not forwarded"
                    .to_string(),
                ..p(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "store-unavailable",
                    "Idempotency store unavailable",
                    Outcome::StoreError,
                )
            },
            // The cause (`tcp connect error: Connection refused ...`) is
            // the operator's, in the log; clients get one stable sentence
            // per kind.
            ProxyError::Upstream { error, key } => {
                use {ForwardError::*, StatusCode as S};
                let (status, slug, title, sentence) = match error {
                    Unreachable(_) | Refused(_) => (
                        S::BAD_GATEWAY,
                        "upstream-failed",
                        "Upstream failed",
                        "the upstream could not be reached",
                    ),
                    Failed(_) => (
                        S::BAD_GATEWAY,
                        "upstream-failed",
                        "Upstream failed",
                        "the upstream connection failed before a complete answer",
                    ),
                    Tls { failure, .. } => (
                        S::BAD_GATEWAY,
                        "upstream-tls",
                        "Upstream TLS failed",
                        failure.detail(),
                    ),
                    Timeout => (
                        S::GATEWAY_TIMEOUT,
                        "upstream-timeout",
                        "Upstream timed out",
                        detail.as_str(),
                    ),
                    // Nothing was forwarded: the key is beside the point.
                    TunnelsExhausted => {
                        return Problem {
                            retry_after_secs: Some(OVERLOADED_RETRY_AFTER_SECS),
                            ..p(
                                S::SERVICE_UNAVAILABLE,
                                "tunnels-exhausted",
                                "Too many upgraded connections",
                                Outcome::Overloaded,
                            )
                        }
                    }
                };
                Problem {
                    detail: released_hint(*key, sentence.to_string()),
                    ..p(status, slug, title, Outcome::UpstreamError)
                }
            }
            ProxyError::UpgradeOnProtectedRoute => p(
                StatusCode::BAD_REQUEST,
                "upgrade-refused",
                "Upgrade not allowed on a protected route",
                Outcome::InvalidRequest,
            ),
            ProxyError::Internal(_) => Problem {
                detail: "internal error".to_string(),
                ..p(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "internal",
                    "Internal error",
                    Outcome::Internal,
                )
            },
        }
    }

    pub fn into_response(self) -> Response<ProxyBody> {
        let mut body = serde_json::json!({
            "type": format!("{TYPE_BASE}{}", self.slug),
            "title": self.title,
            "status": self.status.as_u16(),
            "detail": self.detail,
        });
        if let Some(instance) = self.instance {
            body["instance"] = instance.into();
        }
        let mut resp = Response::new(full(body.to_string()));
        *resp.status_mut() = self.status;
        let h = resp.headers_mut();
        h.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        );
        h.insert(header::CONTENT_LANGUAGE, HeaderValue::from_static("en"));
        h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
        if let Some(secs) = self.retry_after_secs {
            h.insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        resp
    }
}

fn released_hint(key: KeyFate, detail: String) -> String {
    match key {
        KeyFate::Released => format!(
            "{detail}; the idempotency key was released, so a retry with the same key runs again"
        ),
        KeyFate::Kept => format!(
            "{detail}; the upstream had already answered, so the request was executed: \
             the key is kept and a retry will not run it again"
        ),
        KeyFate::Locked => format!(
            "{detail}; the idempotency key could not be released yet: retries get 409 until its lease runs out, then run again"
        ),
        KeyFate::TakenOver => format!(
            "{detail}; this request's lease had run out and another request holds the key now: a retry gets that request's answer"
        ),
        KeyFate::Unknown => format!(
            "{detail}; the request was sent and may have executed, so the key is kept as outcome \
             unknown: retries with it get 424 and are not sent again until an operator resolves it"
        ),
        KeyFate::Unprotected => detail,
    }
}

#[cfg(test)]
mod tests {
    /// The 502's detail is a stable sentence: the internal error chain
    /// (addresses, OS errors) stays in the log.
    #[test]
    fn upstream_failures_do_not_show_their_cause_to_clients() {
        for err in [
            ProxyError::upstream(
                ForwardError::Unreachable(
                    "client error (Connect): tcp connect error: Connection refused".into(),
                ),
                KeyFate::Released,
            ),
            ProxyError::upstream(
                ForwardError::Failed("connection reset by peer 10.0.0.7:3000".into()),
                KeyFate::Unprotected,
            ),
        ] {
            let p = Problem::from_error(&err);
            assert_eq!(p.status, StatusCode::BAD_GATEWAY);
            assert!(p.detail.starts_with("the upstream "), "{}", p.detail);
            for leak in ["tcp", "Connect", "reset", "10.0.0.7"] {
                assert!(!p.detail.contains(leak), "{leak} in {}", p.detail);
            }
        }
    }

    use super::*;
    use crate::error::RequestError;
    use crate::idempotency::{KeyError, RepeatedScopeHeader};
    use crate::store::StoreError;
    use http::HeaderName;

    /// Pins the IETF draft's status codes and the headers each problem carries.
    #[test]
    fn errors_map_to_documented_statuses() {
        let h = HeaderName::from_static("idempotency-key");
        let cases: Vec<(ProxyError, u16, Option<&str>)> = vec![
            (ProxyError::MissingKey { header: h.clone() }, 400, None),
            (
                ProxyError::InvalidKey {
                    header: h,
                    reason: KeyError::TooLong,
                },
                400,
                None,
            ),
            (
                ProxyError::RepeatedScopeHeader(RepeatedScopeHeader(http::header::AUTHORIZATION)),
                400,
                None,
            ),
            (
                ProxyError::InvalidRequest(RequestError::ChunkedTwice),
                400,
                None,
            ),
            (
                ProxyError::UnsupportedTransferCoding {
                    coding: "gzip".into(),
                },
                501,
                None,
            ),
            (ProxyError::BodyTooLarge { limit: 10 }, 413, None),
            (ProxyError::BodyTimeout, 408, None),
            (ProxyError::Overloaded, 503, Some("1")),
            (
                ProxyError::InFlight {
                    retry_after_secs: 7,
                },
                409,
                Some("7"),
            ),
            (
                ProxyError::TooManyWaiters {
                    retry_after_secs: 3,
                },
                503,
                Some("3"),
            ),
            (
                ProxyError::BodyKey {
                    pointer: "/id".into(),
                    reason: crate::error::BodyKeyError::Missing,
                },
                400,
                None,
            ),
            (
                ProxyError::BodyKey {
                    pointer: "/id".into(),
                    reason: crate::error::BodyKeyError::WrongType,
                },
                400,
                None,
            ),
            (ProxyError::Mismatch, 422, None),
            (ProxyError::NotReplayable { status: 200 }, 410, None),
            (ProxyError::OutcomeUnknown, 424, None),
            (
                ProxyError::upstream(ForwardError::Timeout, KeyFate::Unknown),
                504,
                None,
            ),
            (ProxyError::Store(StoreError::Timeout), 503, Some("2")),
            (
                ProxyError::upstream(ForwardError::Refused("refused".into()), KeyFate::Released),
                502,
                None,
            ),
            (
                ProxyError::upstream(ForwardError::Timeout, KeyFate::Released),
                504,
                None,
            ),
            (
                ProxyError::upstream(
                    ForwardError::Tls {
                        upstream: "default".into(),
                        failure: crate::upstream::tls::TlsFailure::Untrusted("expired".into()),
                    },
                    KeyFate::Released,
                ),
                502,
                None,
            ),
            (ProxyError::UpgradeOnProtectedRoute, 400, None),
            (
                ProxyError::upstream(ForwardError::TunnelsExhausted, KeyFate::Released),
                503,
                Some("1"),
            ),
            (ProxyError::Internal("x".into()), 500, None),
        ];
        for (err, status, retry_after) in cases {
            let resp = Problem::from_error(&err).into_response();
            assert_eq!(resp.status().as_u16(), status, "{err}");
            assert_eq!(
                resp.headers()[header::CONTENT_TYPE],
                "application/problem+json"
            );
            assert_eq!(
                resp.headers()
                    .get(header::RETRY_AFTER)
                    .map(|v| v.to_str().unwrap()),
                retry_after,
                "{err}"
            );
        }
    }
}
