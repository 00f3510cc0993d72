//! Route patterns and the route table: which requests are protected.
//!
//! A pattern is an exact path (`/orders`), a path with `{name}` segments that
//! match any single non-empty segment (`/payments/{id}/capture`), or a prefix
//! ending in `/*` that matches the prefix itself and everything below it
//! (`/api/*`). Routes are tried in config order; the first whose methods and
//! pattern match wins. A route's settings ([`RouteConfig`]) are resolved by
//! `config`, which depends on this module and never the other way round.
//!
//! Matching sees through `;` path parameters (RFC 3986 §3.3): each segment
//! is compared by its name, the part before its first `;`, because servlet
//! containers, Spring and Python's `urlparse` route `/orders;jsessionid=1`
//! to `/orders`. The parameters are still forwarded as sent and are part of
//! the fingerprint, as the query is: one key on `/orders;v=1` and
//! `/orders;v=2` is a reuse (422), never a replay of the other's answer.

pub mod errors;
pub mod overlap;

use crate::idempotency::canonical_json::Pointer;
use crate::idempotency::decision::ReleaseStatuses;
use http::{HeaderName, Method};
use serde::Deserialize;
use std::borrow::Cow;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

/// A protected route with every setting resolved.
#[derive(Clone, Debug)]
pub struct RouteConfig {
    /// 1-based position in the file, for messages.
    pub index: usize,
    /// The route's label in metrics and logs: its path pattern.
    pub label: Arc<String>,
    pub methods: Vec<Method>,
    pub path: PathPattern,
    pub key_header: HeaderName,
    pub require_key: bool,
    pub ttl: Duration,
    pub lease: Duration,
    /// Keys are unique per combination of these headers' values, in this
    /// order (the credential, then any tenant header); empty only where
    /// `scope_value` replaces them.
    pub scope_headers: Vec<HeaderName>,
    pub fingerprint_headers: Vec<HeaderName>,
    pub max_request_body: u64,
    pub max_response_body: u64,
    pub include_response_headers: Vec<HeaderName>,
    pub exclude_response_headers: Vec<HeaderName>,
    pub on_store_error: OnStoreError,
    /// Upstream answers that release the key instead of being stored.
    pub release_statuses: ReleaseStatuses,
    /// What a request whose outcome is unknown does to its key.
    pub on_ambiguous: OnAmbiguous,
    /// The `[upstreams.NAME]` this route's requests go to; `None`: the
    /// default (`[server] upstream`).
    pub upstream: Option<Arc<str>>,
    /// `key = { json = "/id" }`: the key is read from the body at this
    /// pointer instead of from `key_header` (natural keys: a message id).
    pub key_json: Option<Pointer>,
    /// `scope = { value = "stripe" }`: one fixed consumer name instead of
    /// `scope_headers`, as in a processed-messages table's
    /// `(consumer, message_id)`.
    pub scope_value: Option<String>,
    /// `scope = { client_cert = true }`: the client's verified certificate
    /// (its SPKI digest, mTLS) instead of `scope_headers`; needs a
    /// `server.tls_client_ca_file`, so every client has one.
    pub scope_client_cert: bool,
    /// What of the body the fingerprint covers.
    pub fingerprint: FingerprintMode,
    /// With `fingerprint = "json"`: members removed before canonicalizing
    /// (fields a sender changes per attempt, e.g. `/deliveryAttempt`).
    pub fingerprint_ignore: Vec<Pointer>,
    /// What a duplicate gets while the first request is in flight.
    pub in_flight: InFlight,
    /// The preset the route's defaults came from, for `check-config`.
    pub preset: Option<Preset>,
    /// How idemgate's own error answers on this route are written.
    pub errors: errors::ErrorShape,
    /// `strip_prefix`: these leading segments leave the path before it is
    /// joined to the upstream's base path (`/api` turns `/api/orders` into
    /// `/orders`); checked at load to be a literal prefix of `path`.
    pub strip_prefix: Option<Arc<str>>,
    /// `replay_check`: asked of the upstream before every replay, with the
    /// request's scope headers; `None`: stored answers replay as they are.
    pub replay_check: Option<ReplayCheck>,
}

/// A request whose 2xx says the credential that made a stored answer is
/// still good (README "Replays only for valid credentials").
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReplayCheck {
    pub method: Method,
    pub path: http::uri::PathAndQuery,
    /// The `[upstreams.NAME]` asked; `None`: the route's own upstream.
    pub upstream: Option<Arc<str>>,
    /// How long a scope's successful check is remembered (`0`: never).
    pub cache: Duration,
}

impl RouteConfig {
    /// Whether a request by `method` without a key is refused (400).
    /// QUERY (RFC 10008) is safe and idempotent by definition: a route
    /// that lists it protects a QUERY that carries a key and passes one
    /// without, whatever `require_key` says.
    pub fn key_required(&self, method: &Method) -> bool {
        self.require_key && method.as_str() != "QUERY"
    }

    /// The scope headers as `check-config` prints them, for messages:
    /// `authorization,stripe-account`.
    pub fn scope_label(&self) -> String {
        if let Some(value) = &self.scope_value {
            return format!("value:{value}");
        }
        if self.scope_client_cert {
            return "client_cert".to_string();
        }
        self.scope_headers
            .iter()
            .map(HeaderName::as_str)
            .collect::<Vec<_>>()
            .join(",")
    }
}

/// `fingerprint`: how the body enters the fingerprint.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FingerprintMode {
    /// The bytes as sent.
    #[default]
    Raw,
    /// The RFC 8785 canonical form of a JSON body (key order and
    /// whitespace ignored); a body that is not I-JSON as raw bytes.
    Json,
}

impl FingerprintMode {
    pub fn as_str(self) -> &'static str {
        match self {
            FingerprintMode::Raw => "raw",
            FingerprintMode::Json => "json",
        }
    }
}

/// `in_flight`: what a duplicate gets while the first request runs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum InFlight {
    /// 409 with `Retry-After` at once.
    #[default]
    Reject,
    /// Wait up to this long for the first request's answer and replay it
    /// (or take the key over if it is released); 409 when it runs out.
    Wait(Duration),
}

/// `preset`: the settings a known sender's deliveries need (the book's
/// "Webhooks and message deliveries", docs/book/src/webhooks.md). A route's own keys override them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Preset {
    Github,
    StandardWebhooks,
    Stripe,
    Sns,
    PubSub,
    Shopify,
}

/// Where a preset reads its key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PresetKey {
    Header(&'static str),
    Json(&'static str),
}

/// What a preset sets; see [`Preset::settings`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PresetSettings {
    pub key: PresetKey,
    /// At least the sender's retry (or manual redelivery) horizon.
    pub ttl: Duration,
    pub fingerprint: FingerprintMode,
    pub fingerprint_ignore: &'static [&'static str],
    pub in_flight_wait: Duration,
}

/// A webhook sender waits about 10 s for an answer (GitHub, Pub/Sub's
/// default ack deadline): a duplicate waits half of that for the first
/// one's answer, so it can still be acknowledged with the replayed 2xx.
const PRESET_WAIT: Duration = Duration::from_secs(5);
const HOUR: u64 = 3600;
const DAY: u64 = 24 * HOUR;

impl Preset {
    pub fn as_str(self) -> &'static str {
        match self {
            Preset::Github => "github",
            Preset::StandardWebhooks => "standard-webhooks",
            Preset::Stripe => "stripe",
            Preset::Sns => "sns",
            Preset::PubSub => "pub-sub",
            Preset::Shopify => "shopify",
        }
    }

    /// The sender's key, and a ttl covering its retries (the preset
    /// table in docs/book/src/webhooks.md gives the sources and what is uncertain).
    pub fn settings(self) -> PresetSettings {
        let s = |key, days: u64, fingerprint, fingerprint_ignore| PresetSettings {
            key,
            ttl: Duration::from_secs(days * DAY),
            fingerprint,
            fingerprint_ignore,
            in_flight_wait: PRESET_WAIT,
        };
        use FingerprintMode::{Json, Raw};
        match self {
            // No automatic retries; manual redelivery of recent deliveries
            // (about 3 days), same X-GitHub-Delivery.
            Preset::Github => s(PresetKey::Header("x-github-delivery"), 4, Raw, &[]),
            // The spec's schedule runs up to about 3 days.
            Preset::StandardWebhooks => s(PresetKey::Header("webhook-id"), 4, Raw, &[]),
            // Live mode retries for up to 3 days; `pending_webhooks` counts
            // the endpoints still owed the event and may change between
            // attempts.
            Preset::Stripe => s(PresetKey::Json("/id"), 4, Json, &["/pending_webhooks"]),
            // Delivery policies retry for at most an hour.
            Preset::Sns => s(PresetKey::Header("x-amz-sns-message-id"), 1, Json, &[]),
            // Redelivered until acknowledged or the subscription's message
            // retention runs out (7 days by default); `deliveryAttempt`
            // counts attempts (dead-letter policies only).
            Preset::PubSub => s(
                PresetKey::Json("/message/messageId"),
                7,
                Json,
                &["/deliveryAttempt"],
            ),
            // Retries for up to 48 hours (older documentation: 19 times;
            // newer: 8 times over 4 hours).
            Preset::Shopify => s(PresetKey::Header("x-shopify-webhook-id"), 2, Raw, &[]),
        }
    }
}

/// The upstream answers a delivery route (a preset, or `key = { .. }`)
/// releases besides its `release_statuses`, unless the route lists its
/// own: refusals that executed nothing. Such a route's key is the sender's
/// id, which anyone can name, and its scope is the route's, not the
/// caller's: an unsigned request naming a delivery id, or the genuine one
/// refused during a secret rotation, would otherwise have its refusal
/// replayed to every redelivery for the sender's whole retry horizon. 400
/// is what Stripe's and Standard Webhooks' example handlers answer to a
/// bad signature; 401 and 403 a refused credential; 404 a handler not
/// deployed yet. 410 stays stored: a receiver's deliberate "stop sending"
/// (Standard Webhooks disables the endpoint), the same on every attempt.
pub const DELIVERY_REFUSALS: [u16; 4] = [400, 401, 403, 404];

/// What a protected route does when the store cannot answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OnStoreError {
    /// 503 with `Retry-After`; nothing is forwarded unguarded.
    Reject,
    /// Forward without protection; for routes where availability wins.
    Forward,
}

/// What a route does with a key when the upstream's outcome is unknown: a
/// timeout or reset after the request was sent (docs/book/src/ambiguous.md, "Ambiguous
/// outcomes"). A refused connection sent nothing, so it always releases.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OnAmbiguous {
    /// Release the key: a retry runs again (at least once).
    #[default]
    Release,
    /// Keep the key as outcome-unknown until an operator resolves it: no
    /// retry runs (at most once; for payments and the like).
    Keep,
}

impl OnAmbiguous {
    /// As the config writes it.
    pub fn as_str(self) -> &'static str {
        match self {
            OnAmbiguous::Release => "release",
            OnAmbiguous::Keep => "keep",
        }
    }
}

/// A parsed path pattern.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PathPattern {
    source: String,
    segments: Vec<Segment>,
    prefix: bool,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Segment {
    Literal(String),
    Param,
}

/// `path` without the leading segments `prefix` (`"/api"`, never ending in
/// `/`), on a segment boundary: `/api/orders` gives `/orders`, `/api`
/// gives `/`; a path it does not start with is returned as it is.
pub fn strip_path_prefix<'a>(path: &'a str, prefix: &str) -> &'a str {
    match path.strip_prefix(prefix) {
        Some("") => "/",
        Some(rest) if rest.starts_with('/') => rest,
        _ => path,
    }
}

impl PathPattern {
    /// Whether `prefix` can be a route's `strip_prefix`: a path of literal
    /// segments this pattern starts with, so that every request the route
    /// matches loses exactly it.
    pub fn strip_prefix_of(&self, prefix: &str) -> Result<(), String> {
        let bad = |why: &str| Err(format!("strip_prefix {prefix:?}: {why}"));
        if !prefix.starts_with('/') || prefix.len() < 2 || prefix.ends_with('/') {
            return bad("expected a path such as \"/api\" (a leading '/', no trailing '/')");
        }
        let wanted: Vec<&str> = prefix[1..].split('/').collect();
        let fits = wanted.len() <= self.segments.len()
            && wanted
                .iter()
                .zip(&self.segments)
                .all(|(w, s)| matches!(s, Segment::Literal(l) if l == w));
        if fits {
            Ok(())
        } else {
            bad(&format!(
                "is not a literal prefix of the route's path {:?}: requests it matches would not all start with it",
                self.source
            ))
        }
    }

    /// Parses a pattern, explaining what is wrong with a bad one.
    pub fn parse(source: &str) -> Result<Self, String> {
        if !source.starts_with('/') {
            return Err(format!("path {source:?} must start with '/'"));
        }
        if source.contains(['?', '#']) {
            return Err(format!(
                "path {source:?} must not contain a query or fragment"
            ));
        }
        if source.contains(';') {
            return Err(format!(
                "path {source:?} must not contain ';': path parameters are ignored when matching"
            ));
        }
        let (body, prefix) = source
            .strip_suffix("/*")
            .map_or((source, false), |rest| (rest, true));
        let mut segments = Vec::new();
        let normalized = normalize_path(body);
        for seg in normalized.split('/').skip(1) {
            if seg.contains('*') {
                return Err(format!(
                    "path {source:?}: '*' is only allowed as a trailing \"/*\""
                ));
            }
            if seg.starts_with('{') && seg.ends_with('}') && seg.len() > 2 {
                segments.push(Segment::Param);
            } else if seg.contains(['{', '}']) {
                return Err(format!(
                    "path {source:?}: a parameter must be a whole segment such as \"{{id}}\""
                ));
            } else if !seg.is_empty() {
                segments.push(Segment::Literal(seg.to_string()));
            }
        }
        Ok(Self {
            source: source.to_string(),
            segments,
            prefix,
        })
    }

    /// Whether `path` (no query), as [`normalize_path`] returned it, matches.
    /// Not normalized again here: once per request is enough (normalizing
    /// is idempotent), and the fingerprint uses the same spelling.
    /// Each segment is compared by its name (see the module docs); a segment
    /// that is only parameters (`/;x/orders`) counts as empty, like `//`.
    pub fn matches(&self, path: &str) -> bool {
        // Walked, not collected: this runs for every route tried.
        let mut parts = path
            .split('/')
            .map(segment_name)
            .filter(|name| !name.is_empty());
        let fits = self.segments.iter().all(|seg| match (seg, parts.next()) {
            (Segment::Literal(lit), Some(part)) => lit == part,
            (Segment::Param, Some(part)) => !part.is_empty(),
            (_, None) => false,
        });
        fits && (self.prefix || parts.next().is_none())
    }

    /// Two patterns are the same route when they match the same paths.
    pub fn same_shape(&self, other: &Self) -> bool {
        self.prefix == other.prefix && self.segments == other.segments
    }

    pub fn as_str(&self) -> &str {
        &self.source
    }
}

impl fmt::Display for PathPattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.source)
    }
}

/// A segment's name: the part before its first `;` parameter.
fn segment_name(segment: &str) -> &str {
    segment.split(';').next().unwrap_or(segment)
}

/// What a segment is to dot-segment removal (RFC 3986 §5.2.4).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Dot {
    /// `.`
    Current,
    /// `..`
    Parent,
    Other,
}

impl Dot {
    /// Judged by the segment's name, so `..;x` is `..`: servlet containers
    /// strip the parameters before resolving it (the `/..;/` bypass). The
    /// segment's unreserved escapes are already decoded.
    fn of(segment: &str) -> Self {
        match segment_name(segment) {
            "." => Dot::Current,
            ".." => Dot::Parent,
            _ => Dot::Other,
        }
    }

    /// As [`Dot::of`] for a segment as sent, where `%2E` (either case) is a
    /// `.` too: `of_raw(s)` is always `of(decode_unreserved(s))`, so what is
    /// matched and what is forwarded resolve alike.
    fn of_raw(segment: &str) -> Self {
        let name = segment_name(segment).as_bytes();
        let mut dots = 0;
        let mut i = 0;
        while i < name.len() {
            match name[i..] {
                [b'.', ..] => i += 1,
                [b'%', b'2', b'e' | b'E', ..] => i += 3,
                _ => return Dot::Other,
            }
            dots += 1;
        }
        match dots {
            1 => Dot::Current,
            2 => Dot::Parent,
            _ => Dot::Other,
        }
    }
}

/// RFC 3986 §5.2.4 on an absolute path, each segment judged by `dot`; the
/// other segments are kept byte for byte, and a `..` past the root stops
/// there. A path that does not start with `/` is returned as it is.
fn remove_dot_segments(path: &str, dot: fn(&str) -> Dot) -> Cow<'_, str> {
    let Some(rest) = path.strip_prefix('/') else {
        return Cow::Borrowed(path);
    };
    if rest.split('/').all(|seg| dot(seg) == Dot::Other) {
        return Cow::Borrowed(path);
    }
    let segments: Vec<&str> = rest.split('/').collect();
    let mut out: Vec<&str> = Vec::with_capacity(segments.len());
    for (i, seg) in segments.iter().enumerate() {
        let kind = dot(seg);
        match kind {
            Dot::Other => out.push(seg),
            Dot::Current => {}
            Dot::Parent => {
                out.pop();
            }
        }
        // A path ending in a dot-segment names a directory: "/a/b/.." is "/a/".
        if kind != Dot::Other && i + 1 == segments.len() {
            out.push("");
        }
    }
    Cow::Owned(format!("/{}", out.join("/")))
}

/// The path the upstream gets: dot-segments removed (RFC 3986 §5.2.4, with
/// `%2E` and `..;x` counted as [`Dot::of_raw`] says), so nothing joined to
/// the upstream's base path can leave it. Everything else stays as sent.
pub fn resolve_dot_segments(path: &str) -> Cow<'_, str> {
    remove_dot_segments(path, Dot::of_raw)
}

/// The form of a path that route matching and fingerprints use: percent-
/// encoded unreserved characters decoded (RFC 3986 §6.2.2.2), `.` and `..`
/// segments resolved (§5.2.4, including `..;x`) as [`resolve_dot_segments`]
/// resolves the forwarded path, then repeated slashes collapsed and a
/// trailing slash dropped. Other percent-encodings (such as `%2F`) and `;`
/// parameters are kept.
pub fn normalize_path(path: &str) -> Cow<'_, str> {
    let clean = !path.contains('%')
        && !path.contains("//")
        && !path.contains("/.")
        && (path.len() <= 1 || !path.ends_with('/'));
    if clean && path.starts_with('/') {
        return Cow::Borrowed(path);
    }
    let mut decoded = decode_unreserved(path);
    if !decoded.starts_with('/') {
        decoded.insert(0, '/');
    }
    let resolved = remove_dot_segments(&decoded, Dot::of);
    let mut normalized = String::with_capacity(resolved.len());
    for seg in resolved.split('/').filter(|seg| !seg.is_empty()) {
        normalized.push('/');
        normalized.push_str(seg);
    }
    if normalized.is_empty() {
        normalized.push('/');
    }
    Cow::Owned(normalized)
}

/// Percent-encoding normalization (RFC 3986 §6.2.2.1-2): escapes of
/// unreserved characters decoded, the others kept with uppercase hex, and a
/// `%` that starts no escape encoded as `%25`. Every `%` in the result
/// starts a kept escape, so decoding it again changes nothing: this is what
/// makes [`normalize_path`] idempotent (`/%%36Frders` is `/%256Frders`,
/// never `/%6Frders`, which a second pass would turn into `/orders`).
fn decode_unreserved(path: &str) -> String {
    let bytes = path.as_bytes();
    // Work on bytes: paths may hold UTF-8, and what is decoded is ASCII.
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] != b'%' {
            out.push(bytes[i]);
            i += 1;
            continue;
        }
        match bytes.get(i + 1..i + 3) {
            Some(&[hi, lo]) if hi.is_ascii_hexdigit() && lo.is_ascii_hexdigit() => {
                let b = u8::from_str_radix(&path[i + 1..i + 3], 16).expect("two hex digits");
                if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
                    out.push(b);
                } else {
                    out.extend_from_slice(&[
                        b'%',
                        hi.to_ascii_uppercase(),
                        lo.to_ascii_uppercase(),
                    ]);
                }
                i += 3;
            }
            _ => {
                out.extend_from_slice(b"%25");
                i += 1;
            }
        }
    }
    String::from_utf8(out).unwrap_or_else(|_| path.to_string())
}

/// The protected routes, in config order.
#[derive(Clone, Debug)]
pub struct RouteTable {
    routes: Vec<Arc<RouteConfig>>,
    /// Every route's key header, and `Idempotency-Key`: an unrouted request
    /// carrying one is told its key was ignored.
    key_headers: Vec<HeaderName>,
    /// `[defaults] errors`: the shape of error answers to requests that
    /// match no route.
    errors: errors::ErrorShape,
}

impl RouteTable {
    pub fn new(routes: Vec<RouteConfig>, errors: errors::ErrorShape) -> Self {
        let mut key_headers = vec![HeaderName::from_static("idempotency-key")];
        for r in routes.iter().filter(|r| r.key_json.is_none()) {
            if !key_headers.contains(&r.key_header) {
                key_headers.push(r.key_header.clone());
            }
        }
        Self {
            routes: routes.into_iter().map(Arc::new).collect(),
            key_headers,
            errors,
        }
    }

    /// The key headers an unrouted request may carry in vain.
    pub fn key_headers(&self) -> &[HeaderName] {
        &self.key_headers
    }

    /// The shape of error answers outside any route (`[defaults] errors`).
    pub fn default_errors(&self) -> &errors::ErrorShape {
        &self.errors
    }

    /// The first route whose method set and pattern match `path`, as
    /// [`normalize_path`] returned it (normalized once per request).
    pub fn find(&self, method: &Method, path: &str) -> Option<&Arc<RouteConfig>> {
        self.routes
            .iter()
            .find(|r| r.methods.contains(method) && r.path.matches(path))
    }

    pub fn iter(&self) -> impl Iterator<Item = &Arc<RouteConfig>> {
        self.routes.iter()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strip_prefix_removes_whole_leading_segments() {
        for (path, prefix, want) in [
            ("/api/orders", "/api", "/orders"),
            ("/api", "/api", "/"),
            ("/api/", "/api", "/"),
            ("/apix/orders", "/api", "/apix/orders"),
            ("/v1/api/orders", "/api", "/v1/api/orders"),
            ("/a/b/c", "/a/b", "/c"),
        ] {
            assert_eq!(strip_path_prefix(path, prefix), want, "{path} - {prefix}");
        }
        let pattern = |p: &str| PathPattern::parse(p).unwrap();
        for (route, prefix, ok) in [
            ("/api/orders", "/api", true),
            ("/api/*", "/api", true),
            ("/api/v1/{id}", "/api/v1", true),
            ("/api/orders", "/api/orders", true),
            ("/api/{id}", "/api/x", false),
            ("/api/orders", "/v2", false),
            ("/api", "/api/orders", false),
            ("/api/orders", "/api/", false),
            ("/api/orders", "api", false),
            ("/api/orders", "/", false),
        ] {
            assert_eq!(
                pattern(route).strip_prefix_of(prefix).is_ok(),
                ok,
                "{route} {prefix}"
            );
        }
    }

    #[test]
    fn patterns_match_as_documented() {
        let cases: &[(&str, &str, bool)] = &[
            ("/orders", "/orders", true),
            ("/orders", "/orders/", true),
            ("/orders", "//orders", true),
            ("/orders", "/./orders", true),
            ("/orders", "/x/../orders", true),
            ("/orders", "/%6Frders", true),
            ("/orders", "/%6frders", true),
            ("/orders", "/orders%2F", false),
            ("/a%2Fb", "/a%2fb", true),
            ("/orders", "/Orders", false),
            ("/orders", "/orders/1", false),
            ("/orders", "/orders;v=1", true),
            ("/orders", "/orders;jsessionid=abc", true),
            ("/orders", "/orders;", true),
            ("/orders", "/;x/orders", true),
            ("/orders", "/orders/;x", true),
            ("/orders", "/x/..;/orders", true),
            ("/orders", "/x/..;y=1/orders", true),
            ("/orders", "/orders%3Bv=1", false),
            ("/orders", "/orders.;x", false),
            ("/a/b", "/a;x/b", true),
            ("/a/b", "/a;x;y=2/b;z", true),
            ("/orders", "/order", false),
            ("/payments/{id}/capture", "/payments/p_1/capture", true),
            ("/payments/{id}/capture", "/payments//capture", false),
            ("/payments/{id}/capture", "/payments/;x/capture", false),
            ("/payments/{id}/capture", "/payments/p_1;v=2/capture", true),
            ("/api/*", "/api;v=1/orders", true),
            ("/payments/{id}/capture", "/payments/p_1", false),
            ("/payments/{id}/capture", "/payments/p_1/capture/x", false),
            ("/api/*", "/api", true),
            ("/api/*", "/api/", true),
            ("/api/*", "/api/v1/orders", true),
            ("/api/*", "/apix", false),
            ("/*", "/anything/at/all", true),
            ("/", "/", true),
            ("/", "/x", false),
        ];
        for (pattern, path, want) in cases {
            let p = PathPattern::parse(pattern).unwrap();
            assert_eq!(
                p.matches(&normalize_path(path)),
                *want,
                "{pattern} vs {path}"
            );
        }
    }

    #[test]
    fn normalization_table() {
        for (raw, want) in [
            ("/", "/"),
            ("", "/"),
            ("/a/b", "/a/b"),
            ("/a/b/", "/a/b"),
            ("/a//b", "/a/b"),
            ("/a/./b/../c", "/a/c"),
            ("/../a", "/a"),
            ("/%41%7e%2F", "/A~%2F"),
            ("/100%", "/100%25"),
            ("/100%2", "/100%252"),
            ("/a%2fb", "/a%2Fb"),
            ("/%c3%a9", "/%C3%A9"),
            ("/%+1", "/%25+1"),
            ("/größe/", "/größe"),
            ("//größe/%41", "/größe/A"),
            ("/%zz", "/%25zz"),
            ("/orders;v=1", "/orders;v=1"),
            ("/a;x/../b", "/b"),
            ("/a/..;x/b", "/b"),
            ("/a/%2e%2E/b", "/b"),
            ("/a/.%2e;x/b", "/b"),
            ("/a/...;x/b", "/a/...;x/b"),
            ("/a//../b", "/a/b"),
            ("/a/b/..", "/a"),
        ] {
            assert_eq!(normalize_path(raw), want, "{raw}");
        }
    }

    #[test]
    fn dot_segments_are_resolved_for_the_upstream() {
        for (raw, want) in [
            ("/", "/"),
            ("/orders;v=1", "/orders;v=1"),
            ("//a/b/", "//a/b/"),
            ("/../admin", "/admin"),
            ("/%2e%2E/admin", "/admin"),
            ("/x/../../admin", "/admin"),
            ("/x/..;/..;y/admin", "/admin"),
            ("/a/b/..", "/a/"),
            ("/a/b/.", "/a/b/"),
            ("/a//../b", "/a/b"),
            ("/a/%2e%2e%2e/b", "/a/%2e%2e%2e/b"),
            ("/a/%%32e/b", "/a/%%32e/b"),
            ("*", "*"),
        ] {
            assert_eq!(resolve_dot_segments(raw), want, "{raw}");
        }
    }

    /// Every path of up to four segments from an alphabet of the tricky
    /// ones: the forwarded path holds no dot-segment and stays below the
    /// base, resolving and normalizing are idempotent, and matching sees
    /// the path the upstream gets (normalizing before or after resolving
    /// is the same).
    #[test]
    fn resolving_agrees_with_matching_and_never_leaves_the_base() {
        const SEGMENTS: [&str; 16] = [
            "", ".", "..", "%2e", "%2E%2e", ".%2e", "..;x", ";x", "a", "b;v=1", "%2F", "...",
            "%%32e", "%", "%%36F", "%6f%2",
        ];
        let mut paths = vec![String::new()];
        for _ in 0..4 {
            let longer: Vec<String> = paths
                .iter()
                .flat_map(|p| SEGMENTS.iter().map(move |s| format!("{p}/{s}")))
                .collect();
            paths.extend(longer);
        }
        for seg in SEGMENTS {
            assert!(
                Dot::of_raw(seg) == Dot::of(&decode_unreserved(seg)),
                "{seg}"
            );
        }
        for path in paths.iter().filter(|p| !p.is_empty()) {
            let resolved = resolve_dot_segments(path);
            assert!(
                resolved.split('/').all(|s| Dot::of_raw(s) == Dot::Other),
                "{path} -> {resolved}"
            );
            assert_eq!(resolve_dot_segments(&resolved), resolved, "{path}");
            let normalized = normalize_path(path);
            assert_eq!(normalize_path(&resolved), normalized, "{path}");
            assert_eq!(normalize_path(&normalized), normalized, "{path}");
            let joined = format!("/base{resolved}");
            assert!(normalize_path(&joined).starts_with("/base"), "{path}");
        }
    }

    #[test]
    fn a_path_is_normalized_once_per_request() {
        // Pins: route lookup normalized the already normalized path again,
        // so "/%%36Frders" (then once: "/%6Frders") matched "/orders".
        // Normalizing is idempotent now, so twice is once.
        let p = PathPattern::parse("/orders").unwrap();
        for raw in ["/%%36Frders", "/x/%2%45%2%45/orders"] {
            let once = normalize_path(raw);
            assert!(!p.matches(&once), "{raw}");
            assert_eq!(normalize_path(&once), once, "{raw}");
        }
    }

    #[test]
    fn bad_patterns_are_explained() {
        for bad in [
            "orders",
            "/a/*/b",
            "/a*",
            "/x?y=1",
            "/a/{id",
            "/a/b{id}",
            "/orders;v=1",
        ] {
            assert!(PathPattern::parse(bad).is_err(), "{bad} should fail");
        }
    }

    #[test]
    fn parameter_names_do_not_make_routes_distinct() {
        let a = PathPattern::parse("/p/{id}/capture").unwrap();
        let b = PathPattern::parse("/p/{pid}/capture").unwrap();
        assert!(a.same_shape(&b));
        assert!(!a.same_shape(&PathPattern::parse("/p/*").unwrap()));
    }
}
