//! RFC 9457 problem details (`application/problem+json`): the only place a
//! [`ProxyError`] becomes a response. The match is exhaustive on purpose.
//!
//! Status codes follow the IETF Idempotency-Key draft §2.7 (400 missing,
//! 409 in flight, 422 reused with another request) and RFC 9110 for the rest.

use crate::body::{full, ProxyBody};
use crate::error::{rfc3339_seconds, ForwardError, ProxyError};
use crate::idempotency::KeyReuse;
use crate::lease::KeyFate;
use crate::metrics::Outcome;
use crate::route::errors::{ErrorFields, ErrorShape};
use http::{header, HeaderValue, Response, StatusCode};

/// Base of the `type` URIs; each problem's page section in the README.
const TYPE_BASE: &str = "https://github.com/idemgate/idemgate#problem-";

/// How long a client should wait before retrying when the store is down.
const STORE_RETRY_AFTER_SECS: u64 = 2;
/// Buffered bodies are read in well under a second when clients send at
/// speed; a stalled one holds its share until `request_body_timeout`.
const OVERLOADED_RETRY_AFTER_SECS: u64 = 1;
/// A replay check that went unanswered: the upstream may be back soon.
const REPLAY_CHECK_RETRY_AFTER_SECS: u64 = 1;

pub struct Problem {
    pub status: StatusCode,
    pub slug: &'static str,
    pub title: &'static str,
    pub detail: String,
    pub retry_after_secs: Option<u64>,
    pub outcome: Outcome,
    /// RFC 9457 §3.1.5: this occurrence, `urn:idemgate:request:<request id>`.
    pub instance: Option<String>,
    /// Extension member: the request's key as the logs and `idemgate keys`
    /// name it ([`crate::idempotency::RecordKey::log_id`]), never the key.
    pub key_id: Option<String>,
    /// Extension member: whether the same operation may be sent again under
    /// a new key without risking a second execution ([`safe_new_key`]).
    pub safe_new_key: bool,
    /// Extension members of a 422: when and for what the key was first
    /// used (`first_used_at`, `first_method`, `first_path`).
    pub reuse: Option<KeyReuse>,
}

impl Problem {
    pub fn from_error(err: &ProxyError) -> Self {
        let detail = err.to_string();
        let safe_new_key = safe_new_key(err);
        let p = |status, slug, title, outcome| Problem {
            status,
            slug,
            title,
            detail: detail.clone(),
            retry_after_secs: None,
            outcome,
            instance: None,
            key_id: None,
            safe_new_key,
            reuse: None,
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
            ProxyError::Mismatch(reuse) => Problem {
                reuse: Some(reuse.clone()),
                ..p(
                    StatusCode::UNPROCESSABLE_ENTITY,
                    "key-reused",
                    "Idempotency-Key is already used",
                    Outcome::Mismatch,
                )
            },
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
                    "{detail}; it will not be sent again under this key. Ask the service whether \
                     the operation happened (e.g. look the resource up); an operator can settle \
                     the key with idemgate keys resolve, naming this key_id."
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
            ProxyError::ReplayCheckFailed(_) => Problem {
                retry_after_secs: Some(REPLAY_CHECK_RETRY_AFTER_SECS),
                detail: "the stored response is replayed only once the upstream confirms the \
                         request's credential, and it did not answer; nothing was replayed or \
                         executed. Retry with the same key."
                    .to_string(),
                ..p(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "replay-check-unavailable",
                    "Replay check unavailable",
                    Outcome::ReplayCheckFailed,
                )
            },
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

    /// The answer in the route's error shape. Every shape carries the same
    /// status, `Retry-After` and `Cache-Control: no-store`.
    pub fn into_response(self, shape: &ErrorShape) -> Response<ProxyBody> {
        let type_uri = format!("{TYPE_BASE}{}", self.slug);
        let (content_type, body) = match shape {
            ErrorShape::Problem => (PROBLEM_JSON, self.problem_json(&type_uri).to_string()),
            ErrorShape::Stripe => {
                let mut body = self.problem_json(&type_uri);
                let (kind, code) = stripe_error(self.slug);
                let mut error = serde_json::json!({ "type": kind, "message": self.detail });
                if let Some(code) = code {
                    error["code"] = code.into();
                }
                body["error"] = error;
                // stripe-node and the other Stripe SDKs read their error
                // from `error` only when the body is JSON they recognise.
                ("application/json", body.to_string())
            }
            ErrorShape::Template(t) => (
                t.content_type(),
                t.render(&ErrorFields {
                    status: self.status.as_u16(),
                    code: self.slug,
                    type_uri: &type_uri,
                    title: self.title,
                    detail: &self.detail,
                    key_id: self.key_id.as_deref(),
                    instance: self.instance.as_deref(),
                }),
            ),
        };
        let mut resp = Response::new(full(body));
        *resp.status_mut() = self.status;
        let h = resp.headers_mut();
        h.insert(
            header::CONTENT_TYPE,
            // Checked as a media type of visible ASCII when the config loaded.
            HeaderValue::from_str(content_type).unwrap_or(HeaderValue::from_static(PROBLEM_JSON)),
        );
        h.insert(header::CONTENT_LANGUAGE, HeaderValue::from_static("en"));
        h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
        if let Some(secs) = self.retry_after_secs {
            h.insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        if *shape == ErrorShape::Stripe {
            if let Some(retry) = self.stripe_should_retry() {
                h.insert(STRIPE_SHOULD_RETRY, HeaderValue::from_static(retry));
            }
        }
        resp
    }

    fn problem_json(&self, type_uri: &str) -> serde_json::Value {
        let mut body = serde_json::json!({
            "type": type_uri,
            "title": self.title,
            "status": self.status.as_u16(),
            "detail": self.detail,
        });
        if let Some(instance) = &self.instance {
            body["instance"] = instance.as_str().into();
        }
        if let Some(key_id) = &self.key_id {
            body["key_id"] = key_id.as_str().into();
        }
        body["safe_new_key"] = self.safe_new_key.into();
        if let Some(reuse) = &self.reuse {
            body["first_used_at"] = rfc3339_seconds(reuse.first_used_at).into();
            if let Some(first) = &reuse.first_use {
                body["first_method"] = first.method.as_str().into();
                body["first_path"] = first.path.as_str().into();
            }
        }
        body
    }

    /// `Stripe-Should-Retry`, which the Stripe SDKs obey over their own
    /// rules: `true` where the same request with the same key will be
    /// answered (in flight, overloaded, store down, key released), `false`
    /// where repeating it only repeats this answer.
    fn stripe_should_retry(&self) -> Option<&'static str> {
        match self.status {
            StatusCode::CONFLICT | StatusCode::SERVICE_UNAVAILABLE => Some("true"),
            StatusCode::BAD_GATEWAY | StatusCode::GATEWAY_TIMEOUT => {
                Some(if self.safe_new_key { "true" } else { "false" })
            }
            StatusCode::INTERNAL_SERVER_ERROR => None,
            _ => Some("false"),
        }
    }
}

const PROBLEM_JSON: &str = "application/problem+json";
const STRIPE_SHOULD_RETRY: header::HeaderName =
    header::HeaderName::from_static("stripe-should-retry");

/// `errors = "stripe"`: Stripe's `error.type` for a problem, and its
/// `error.code` where Stripe's error-code catalogue has one that means the
/// same (`parameter_missing`, `idempotency_key_in_use`); docs/book/src/error-shapes.md, "Error
/// shapes" lists them.
fn stripe_error(slug: &str) -> (&'static str, Option<&'static str>) {
    match slug {
        "key-missing" => ("invalid_request_error", Some("parameter_missing")),
        "in-flight" | "too-many-waiters" => ("idempotency_error", Some("idempotency_key_in_use")),
        "key-reused" | "response-not-stored" | "outcome-unknown" => ("idempotency_error", None),
        "key-invalid"
        | "scope-header-repeated"
        | "request-invalid"
        | "transfer-coding-unsupported"
        | "body-too-large"
        | "body-unreadable"
        | "body-timeout"
        | "upgrade-refused" => ("invalid_request_error", None),
        _ => ("api_error", None),
    }
}

/// Whether nothing of this request ran, so the operation may be sent again
/// under a new key (`true`), or the first execution may have happened and
/// a new key could run it twice (`false`). Where the key's fate is known
/// ([`KeyFate`]), it decides.
fn safe_new_key(err: &ProxyError) -> bool {
    match err {
        // Refused before a claim: nothing was forwarded.
        ProxyError::MissingKey { .. }
        | ProxyError::InvalidKey { .. }
        | ProxyError::BodyKey { .. }
        | ProxyError::RepeatedScopeHeader(_)
        | ProxyError::InvalidRequest(_)
        | ProxyError::UnsupportedTransferCoding { .. }
        | ProxyError::BodyTooLarge { .. }
        | ProxyError::BodyRead(_)
        | ProxyError::BodyTimeout
        | ProxyError::Overloaded
        | ProxyError::Store(_)
        | ProxyError::UpgradeOnProtectedRoute => true,
        // A record exists: its request is running, ran, or may have run.
        ProxyError::InFlight { .. }
        | ProxyError::TooManyWaiters { .. }
        | ProxyError::Mismatch(_)
        | ProxyError::NotReplayable { .. }
        | ProxyError::OutcomeUnknown
        | ProxyError::ReplayCheckFailed(_) => false,
        ProxyError::Upstream { error, key } => match key {
            // Released (or to be, once its lease runs out): the proxy judged
            // a second run safe, as a retry under the same key would be.
            KeyFate::Released | KeyFate::Locked => true,
            KeyFate::Kept | KeyFate::TakenOver | KeyFate::Unknown => false,
            // No key held: only what was sent says.
            KeyFate::Unprotected => matches!(
                error,
                ForwardError::Unreachable(_)
                    | ForwardError::Refused(_)
                    | ForwardError::Tls { .. }
                    | ForwardError::TunnelsExhausted
            ),
        },
        // It may have come after forwarding (a lost request task): assume so.
        ProxyError::Internal(_) => false,
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

    /// `errors = "stripe"`: every problem's Stripe type and code, so a new
    /// problem is placed on purpose (stripe-node raises StripeIdempotencyError
    /// for `idempotency_error` on a 400, and picks its class by status
    /// otherwise).
    #[test]
    fn every_problem_has_a_stripe_type() {
        let invalid = ("invalid_request_error", None);
        let idem = ("idempotency_error", None);
        let api = ("api_error", None);
        let rows = [
            (
                "key-missing",
                ("invalid_request_error", Some("parameter_missing")),
            ),
            ("key-invalid", invalid),
            ("scope-header-repeated", invalid),
            ("request-invalid", invalid),
            ("transfer-coding-unsupported", invalid),
            ("body-too-large", invalid),
            ("body-unreadable", invalid),
            ("body-timeout", invalid),
            ("upgrade-refused", invalid),
            (
                "in-flight",
                ("idempotency_error", Some("idempotency_key_in_use")),
            ),
            (
                "too-many-waiters",
                ("idempotency_error", Some("idempotency_key_in_use")),
            ),
            ("key-reused", idem),
            ("response-not-stored", idem),
            ("outcome-unknown", idem),
            ("overloaded", api),
            ("store-unavailable", api),
            ("upstream-failed", api),
            ("upstream-tls", api),
            ("upstream-timeout", api),
            ("tunnels-exhausted", api),
            ("replay-check-unavailable", api),
            ("internal", api),
        ];
        for (slug, want) in rows {
            assert_eq!(stripe_error(slug), want, "{slug}");
        }
        // Every slug `from_error` writes (a string alone on its line) has a row.
        let source = include_str!("problem.rs");
        for slug in source
            .split('"')
            .skip(1)
            .step_by(2)
            .filter(|s| s.len() > 3 && s.chars().all(|c| c.is_ascii_lowercase() || c == '-'))
        {
            if source.contains(&format!("                \"{slug}\",\n")) {
                assert!(rows.iter().any(|(s, _)| *s == slug), "{slug} has no row");
            }
        }
    }

    use super::*;
    use crate::error::RequestError;
    use crate::idempotency::{KeyError, RepeatedScopeHeader};
    use crate::store::StoreError;
    use http::HeaderName;

    /// Pins the IETF draft's status codes, the headers each problem carries
    /// and `safe_new_key`: one row per variant (and per key fate).
    #[tokio::test]
    async fn errors_map_to_documented_statuses() {
        use ForwardError::*;
        let h = HeaderName::from_static("idempotency-key");
        let tls = || Tls {
            upstream: "default".into(),
            failure: crate::upstream::tls::TlsFailure::Untrusted("expired".into()),
        };
        let up = ProxyError::upstream;
        let cases: Vec<(ProxyError, u16, Option<&str>, bool)> = vec![
            (
                ProxyError::MissingKey { header: h.clone() },
                400,
                None,
                true,
            ),
            (
                ProxyError::InvalidKey {
                    header: h,
                    reason: KeyError::TooLong,
                },
                400,
                None,
                true,
            ),
            (
                ProxyError::RepeatedScopeHeader(RepeatedScopeHeader(http::header::AUTHORIZATION)),
                400,
                None,
                true,
            ),
            (
                ProxyError::InvalidRequest(RequestError::ChunkedTwice),
                400,
                None,
                true,
            ),
            (
                ProxyError::UnsupportedTransferCoding {
                    coding: "gzip".into(),
                },
                501,
                None,
                true,
            ),
            (ProxyError::BodyTooLarge { limit: 10 }, 413, None, true),
            (ProxyError::BodyRead("cut".into()), 400, None, true),
            (ProxyError::BodyTimeout, 408, None, true),
            (ProxyError::Overloaded, 503, Some("1"), true),
            (
                ProxyError::InFlight {
                    retry_after_secs: 7,
                },
                409,
                Some("7"),
                false,
            ),
            (
                ProxyError::TooManyWaiters {
                    retry_after_secs: 3,
                },
                503,
                Some("3"),
                false,
            ),
            (
                ProxyError::BodyKey {
                    pointer: "/id".into(),
                    reason: crate::error::BodyKeyError::Missing,
                },
                400,
                None,
                true,
            ),
            (
                ProxyError::BodyKey {
                    pointer: "/id".into(),
                    reason: crate::error::BodyKeyError::WrongType,
                },
                400,
                None,
                true,
            ),
            (ProxyError::Mismatch(reuse(None)), 422, None, false),
            (ProxyError::NotReplayable { status: 200 }, 410, None, false),
            (ProxyError::OutcomeUnknown, 424, None, false),
            (
                ProxyError::ReplayCheckFailed(ForwardError::Timeout),
                503,
                Some("1"),
                false,
            ),
            (ProxyError::Store(StoreError::Timeout), 503, Some("2"), true),
            (
                up(Refused("refused".into()), KeyFate::Released),
                502,
                None,
                true,
            ),
            (
                up(Unreachable("x".into()), KeyFate::Locked),
                502,
                None,
                true,
            ),
            (up(Failed("reset".into()), KeyFate::Kept), 502, None, false),
            (
                up(Failed("reset".into()), KeyFate::TakenOver),
                502,
                None,
                false,
            ),
            (
                up(Failed("reset".into()), KeyFate::Unknown),
                502,
                None,
                false,
            ),
            (up(Timeout, KeyFate::Unknown), 504, None, false),
            (up(Timeout, KeyFate::Released), 504, None, true),
            (up(tls(), KeyFate::Released), 502, None, true),
            // Unprotected: what was sent decides.
            (
                up(Unreachable("x".into()), KeyFate::Unprotected),
                502,
                None,
                true,
            ),
            (
                up(Refused("x".into()), KeyFate::Unprotected),
                502,
                None,
                true,
            ),
            (up(tls(), KeyFate::Unprotected), 502, None, true),
            (
                up(Failed("reset".into()), KeyFate::Unprotected),
                502,
                None,
                false,
            ),
            (up(Timeout, KeyFate::Unprotected), 504, None, false),
            (ProxyError::UpgradeOnProtectedRoute, 400, None, true),
            (
                up(TunnelsExhausted, KeyFate::Released),
                503,
                Some("1"),
                true,
            ),
            (
                up(TunnelsExhausted, KeyFate::Unprotected),
                503,
                Some("1"),
                true,
            ),
            (ProxyError::Internal("x".into()), 500, None, false),
        ];
        for (err, status, retry_after, safe_new_key) in cases {
            let resp = Problem::from_error(&err).into_response(&ErrorShape::Problem);
            assert_eq!(resp.status().as_u16(), status, "{err}");
            let h = resp.headers();
            assert_eq!(h[header::CONTENT_TYPE], "application/problem+json");
            assert_eq!(h[header::CACHE_CONTROL], "no-store", "{err}");
            assert_eq!(
                h.get(header::RETRY_AFTER).map(|v| v.to_str().unwrap()),
                retry_after,
                "{err}"
            );
            let json = body_json(resp).await;
            assert_eq!(json["safe_new_key"], safe_new_key, "{err}");
            assert!(json.get("key_id").is_none(), "{err}: {json}");
        }
    }

    fn reuse(first_use: Option<crate::idempotency::FirstUse>) -> KeyReuse {
        KeyReuse {
            // 2026-12-04T13:55:01.250Z
            first_used_at: 1_796_392_501_250,
            first_use,
        }
    }

    /// A 422 says when and for what the key was first used, in its detail
    /// and as members; a record that kept no request gives the time alone.
    #[tokio::test]
    async fn a_reused_key_says_when_and_for_what_it_was_first_used() {
        let first = crate::idempotency::FirstUse::new("POST", "/payments");
        for shape in [ErrorShape::Problem, ErrorShape::Stripe] {
            let p = Problem::from_error(&ProxyError::Mismatch(reuse(Some(first.clone()))));
            let json = body_json(p.into_response(&shape)).await;
            assert_eq!(
                json["detail"],
                "this key was first used for POST /payments at 2026-12-04T13:55:01Z \
                 with a different request"
            );
            assert_eq!(json["first_used_at"], "2026-12-04T13:55:01Z");
            assert_eq!(json["first_method"], "POST");
            assert_eq!(json["first_path"], "/payments");
            assert_eq!(json["status"], 422);
        }
        let p = Problem::from_error(&ProxyError::Mismatch(reuse(None)));
        let json = body_json(p.into_response(&ErrorShape::Problem)).await;
        assert_eq!(
            json["detail"],
            "this key was first used at 2026-12-04T13:55:01Z with a different request"
        );
        assert_eq!(json["first_used_at"], "2026-12-04T13:55:01Z");
        assert!(json.get("first_method").is_none(), "{json}");
        assert!(json.get("first_path").is_none(), "{json}");
        // Only a 422 has them.
        let p = Problem::from_error(&ProxyError::OutcomeUnknown);
        let json = body_json(p.into_response(&ErrorShape::Problem)).await;
        assert!(json.get("first_used_at").is_none(), "{json}");
    }

    async fn body_json(resp: Response<ProxyBody>) -> serde_json::Value {
        use http_body_util::BodyExt;
        let bytes = resp.into_body().collect().await.unwrap().to_bytes();
        serde_json::from_slice(&bytes).unwrap()
    }

    /// The key id, when the request had a key, is a member beside the
    /// standard ones, which keep their names and values.
    #[tokio::test]
    async fn the_key_id_is_a_member_when_known() {
        let mut p = Problem::from_error(&ProxyError::OutcomeUnknown);
        p.key_id = Some("0123456789abcdef".into());
        p.instance = Some("urn:idemgate:request:r-1".into());
        let json = body_json(p.into_response(&ErrorShape::Problem)).await;
        assert_eq!(json["key_id"], "0123456789abcdef");
        assert_eq!(json["safe_new_key"], false);
        assert_eq!(json["status"], 424);
        assert_eq!(json["instance"], "urn:idemgate:request:r-1");
        let detail = json["detail"].as_str().unwrap();
        assert!(detail.contains("idemgate keys resolve"), "{detail}");
    }
}
