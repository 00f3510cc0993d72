//! The proxy's error type: every way a protected request can end without an
//! upstream response of its own, with the leaf errors it carries (a
//! malformed request, an upstream that gave no answer). Each variant knows
//! where it came from ([`Origin`], pingora's `ErrorSource` idea);
//! `problem.rs` is the one place that turns them into responses.

use crate::idempotency::{KeyError, KeyReuse, RepeatedScopeHeader, UnixMillis};
use crate::lease::KeyFate;
use crate::net::errors::{BoxError, Chain};
use crate::store::StoreError;
use crate::upstream::tls::TlsFailure;
use http::HeaderName;

#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    #[error("the {header} header is required on this route")]
    MissingKey { header: HeaderName },
    #[error("invalid {header} header: {reason}")]
    InvalidKey {
        header: HeaderName,
        reason: KeyError,
    },
    /// A route whose key is read from the body (`key = { json = .. }`).
    #[error("no usable key at {pointer} in the body: {reason}")]
    BodyKey {
        pointer: String,
        reason: BodyKeyError,
    },
    #[error(transparent)]
    RepeatedScopeHeader(#[from] RepeatedScopeHeader),
    /// Malformed in a way hyper does not catch (`proxy/admission.rs`).
    #[error("{0}")]
    InvalidRequest(RequestError),
    /// RFC 9112 §6.1: a transfer-coding other than `chunked`.
    #[error("the transfer-coding {coding:?} is not supported; only chunked is")]
    UnsupportedTransferCoding { coding: String },
    #[error("the request body is larger than {limit} bytes")]
    BodyTooLarge { limit: u64 },
    #[error("the request body could not be read: {0}")]
    BodyRead(#[source] BoxError),
    #[error("the request body did not arrive in time")]
    BodyTimeout,
    /// The body budget (`server.max_buffered_body_bytes`) is spent.
    #[error("too many request bodies are being received at once")]
    Overloaded,
    #[error("a request with this key is still being processed")]
    InFlight { retry_after_secs: u64 },
    /// `in_flight = { wait }`: too many duplicates wait already.
    #[error("too many requests are waiting for the answer to one already in flight")]
    TooManyWaiters { retry_after_secs: u64 },
    /// The key's record is another request's (in this scope).
    #[error("{}", reused(.0))]
    Mismatch(KeyReuse),
    #[error("{}", not_replayable(*status))]
    NotReplayable { status: u16 },
    #[error("the first request with this key was sent upstream but never answered, so whether it executed is unknown")]
    OutcomeUnknown,
    #[error("the idempotency store is unavailable: {0}")]
    Store(#[from] StoreError),
    /// The upstream gave no (complete) answer; `key` is what that did to
    /// the request's idempotency key.
    #[error("{error}")]
    Upstream {
        #[source]
        error: ForwardError,
        key: KeyFate,
    },
    /// An HTTP/1.1 `Upgrade` (e.g. WebSocket) on a protected route: a
    /// tunnel has no response that could be stored and replayed.
    #[error("this route is protected by an idempotency key, so its responses are stored and replayed; a connection upgrade (WebSocket) cannot pass through it")]
    UpgradeOnProtectedRoute,
    /// `replay_check` got no answer (refused, timed out): the stored
    /// response is not replayed, and nothing executes.
    #[error("the replay check got no answer: {0}")]
    ReplayCheckFailed(#[source] ForwardError),
    #[error("internal error: {0}")]
    Internal(String),
}

/// Why a body holds no usable key (each is a 400).
#[derive(Debug, thiserror::Error)]
pub enum BodyKeyError {
    #[error("{0}")]
    NotJson(#[from] crate::idempotency::canonical_json::JsonError),
    #[error("the body has no value there")]
    Missing,
    #[error("the value there is not a string or an integer")]
    WrongType,
    #[error("{0}")]
    Invalid(KeyError),
}

impl BodyKeyError {
    /// The key is not there at all (as opposed to there but unusable).
    pub fn is_missing(&self) -> bool {
        matches!(self, BodyKeyError::NotJson(_) | BodyKeyError::Missing)
    }
}

/// Who is at fault, which decides logging level and metrics.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Origin {
    Client,
    Upstream,
    Store,
    Internal,
}

impl ProxyError {
    pub fn upstream(error: ForwardError, key: KeyFate) -> Self {
        Self::Upstream { error, key }
    }

    pub fn origin(&self) -> Origin {
        match self {
            ProxyError::MissingKey { .. }
            | ProxyError::InvalidKey { .. }
            | ProxyError::BodyKey { .. }
            | ProxyError::TooManyWaiters { .. }
            | ProxyError::RepeatedScopeHeader(_)
            | ProxyError::InvalidRequest(_)
            | ProxyError::UnsupportedTransferCoding { .. }
            | ProxyError::BodyTooLarge { .. }
            | ProxyError::BodyRead(_)
            | ProxyError::BodyTimeout
            // Load from clients: counted in idemgate_body_budget_refusals_total,
            // not logged above debug one by one.
            | ProxyError::Overloaded
            | ProxyError::Upstream {
                error: ForwardError::TunnelsExhausted,
                ..
            }
            | ProxyError::InFlight { .. }
            | ProxyError::Mismatch(_)
            | ProxyError::NotReplayable { .. }
            | ProxyError::OutcomeUnknown
            | ProxyError::UpgradeOnProtectedRoute => Origin::Client,
            ProxyError::Store(_) => Origin::Store,
            ProxyError::Upstream { .. } | ProxyError::ReplayCheckFailed(_) => Origin::Upstream,
            ProxyError::Internal(_) => Origin::Internal,
        }
    }
}

/// Why a request is malformed in a way hyper does not catch (400; the
/// rules are `proxy/admission.rs`'s).
#[derive(Debug, thiserror::Error)]
pub enum RequestError {
    #[error("the chunked transfer-coding is applied more than once")]
    ChunkedTwice,
    #[error(
        "the request target must be a path such as /orders or an absolute URI \
         (origin-form or absolute-form), not {0}"
    )]
    TargetForm(&'static str),
    #[error("the Host header appears more than once")]
    RepeatedHost,
    #[error("the host header names another host than :authority")]
    HostMismatch,
}

/// Why the upstream gave no response head (`proxy/forward.rs`), or no
/// complete body; the client's own error is the source.
#[derive(Debug, thiserror::Error)]
pub enum ForwardError {
    /// Nothing was sent: connection refused, DNS, connect timeout.
    #[error("the upstream could not be reached: {}", Chain(&**.0))]
    Unreachable(#[source] BoxError),
    /// The TLS handshake failed (nothing was sent). The client's detail is
    /// [`TlsFailure::detail`]; this, the log's.
    #[error("upstream {upstream}: {} ({})", failure.detail(), failure.cause())]
    Tls {
        upstream: String,
        failure: TlsFailure,
    },
    /// No response head (or body) within the upstream timeout.
    #[error("the upstream did not answer in time")]
    Timeout,
    /// The upstream refused the request before processing any of it: an
    /// HTTP/2 `RST_STREAM` with `REFUSED_STREAM`, or a `GOAWAY` whose
    /// last-stream-id is below the request's stream (RFC 9113 §8.7, §6.8).
    /// Like a refused connection, nothing ran.
    #[error("the upstream could not be reached: {}", Chain(&**.0))]
    Refused(#[source] BoxError),
    /// Sent (maybe), then the connection failed: reset, closed, protocol error.
    #[error("the upstream connection failed: {}", Chain(&**.0))]
    Failed(#[source] BoxError),
    /// An upgrade request while `server.max_connections` tunnels are open;
    /// nothing was sent.
    #[error("too many upgraded connections (WebSocket) are open; nothing was forwarded")]
    TunnelsExhausted,
}

/// A reused key's sentence: "this key was first used for POST /payments at
/// 2026-12-04T13:55:01Z with a different request" (the time alone for a
/// record that did not keep its request).
fn reused(reuse: &KeyReuse) -> String {
    let at = rfc3339_seconds(reuse.first_used_at);
    match &reuse.first_use {
        Some(first) => format!(
            "this key was first used for {} {} at {at} with a different request",
            first.method, first.path
        ),
        None => format!("this key was first used at {at} with a different request"),
    }
}

/// RFC 3339 in UTC, to the second: `2026-12-04T13:55:01Z`.
pub fn rfc3339_seconds(ms: UnixMillis) -> String {
    let t = std::time::UNIX_EPOCH + std::time::Duration::from_millis(ms.max(0) as u64);
    humantime::format_rfc3339_seconds(t).to_string()
}

/// Why a completed record has no answer to replay.
fn not_replayable(status: u16) -> String {
    if status == crate::store::RESOLVED_STATUS {
        return "an operator settled this key as executed (idemgate keys resolve --applied); \
                its response was never received, so there is none to replay"
            .to_string();
    }
    format!("the original response (status {status}) could not be stored: it was larger than the route's max_response_body, or the upstream cut it off")
}
