//! The proxy's error type: every way a protected request can end without an
//! upstream response of its own. Each variant knows where it came from
//! ([`Origin`], pingora's `ErrorSource` idea); `problem.rs` is the one place
//! that turns them into responses.

use crate::idempotency::{KeyError, RepeatedScopeHeader};
use crate::proxy::admission::RequestError;
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
    BodyRead(String),
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
    #[error("this key was already used for a different request")]
    Mismatch,
    #[error("the original response (status {status}) could not be stored: it was larger than the route's max_response_body, or the upstream cut it off")]
    NotReplayable { status: u16 },
    #[error("the first request with this key was sent upstream but never answered, so whether it executed is unknown")]
    OutcomeUnknown,
    #[error("the idempotency store is unavailable: {0}")]
    Store(#[from] StoreError),
    /// Nothing reached the upstream (refused, connect timeout), or it
    /// refused the request unprocessed (HTTP/2 REFUSED_STREAM, GOAWAY).
    #[error("the upstream could not be reached: {reason}")]
    UpstreamUnreachable { reason: String, key: KeyFate },
    #[error("the upstream did not answer in time")]
    UpstreamTimeout { key: KeyFate },
    /// The connection failed after the request may have been sent.
    #[error("the upstream connection failed: {reason}")]
    UpstreamFailed { reason: String, key: KeyFate },
    /// The TLS handshake with an `https://` upstream failed: nothing was
    /// sent. The client's detail is [`TlsFailure::detail`]; this, the log's.
    #[error("upstream {upstream}: {} ({})", failure.detail(), failure.cause())]
    UpstreamTls {
        upstream: String,
        failure: TlsFailure,
        key: KeyFate,
    },
    /// An HTTP/1.1 `Upgrade` (e.g. WebSocket) on a protected route: a
    /// tunnel has no response that could be stored and replayed.
    #[error("this route is protected by an idempotency key, so its responses are stored and replayed; a connection upgrade (WebSocket) cannot pass through it")]
    UpgradeOnProtectedRoute,
    /// `server.max_connections` tunnels are open: nothing was forwarded.
    #[error("too many upgraded connections (WebSocket) are open; nothing was forwarded")]
    TooManyTunnels,
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
            | ProxyError::TooManyTunnels
            | ProxyError::InFlight { .. }
            | ProxyError::Mismatch
            | ProxyError::NotReplayable { .. }
            | ProxyError::OutcomeUnknown
            | ProxyError::UpgradeOnProtectedRoute => Origin::Client,
            ProxyError::Store(_) => Origin::Store,
            ProxyError::UpstreamUnreachable { .. }
            | ProxyError::UpstreamTimeout { .. }
            | ProxyError::UpstreamFailed { .. }
            | ProxyError::UpstreamTls { .. } => Origin::Upstream,
            ProxyError::Internal(_) => Origin::Internal,
        }
    }
}

/// What an upstream failure did to the request's idempotency key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeyFate {
    /// The request was not protected (no route, or no key where optional).
    Unprotected,
    /// Released: the retry runs again.
    Released,
    /// The store could not be told: retries get 409 until the lease runs out.
    Locked,
    /// The lease had run out and another request holds the key now.
    TakenOver,
    /// The upstream had already answered (status below 500) when the body
    /// failed: it executed, so the key stays completed and never runs again.
    Kept,
    /// Sent but unanswered on an `on_ambiguous = "keep"` route: recorded as
    /// outcome unknown; retries get 424 until an operator resolves it.
    Unknown,
}

impl ProxyError {
    /// What happened to the key, for upstream failures.
    pub fn key_fate(&self) -> Option<KeyFate> {
        match self {
            ProxyError::UpstreamUnreachable { key, .. }
            | ProxyError::UpstreamTimeout { key }
            | ProxyError::UpstreamFailed { key, .. }
            | ProxyError::UpstreamTls { key, .. } => Some(*key),
            _ => None,
        }
    }
}
