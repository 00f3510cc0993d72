//! A protected request made ready, pure but for reading its body: the key
//! (from a header, or from the body through a JSON pointer), its scope
//! (the client's headers, or the route's fixed consumer name) and the
//! fingerprint (the body raw or as canonical JSON), gathered into one
//! [`ProtectedRequest`] once the body is read (bounded in size and time).

use crate::body::budget::BodyBudget;
use crate::body::{drain, read_limited, ReadError};
use crate::config::Secret;
use crate::error::{BodyKeyError, ProxyError};
use crate::idempotency::canonical_json::{self, Json, JsonError};
use crate::idempotency::{Fingerprint, FirstUse, IdempotencyKey, RecordKey, Scope};
use crate::net::tls_server::ClientCert;
use crate::proxy::headers::{content_length, fields};
use crate::route::{normalize_path, FingerprintMode, RouteConfig};
use bytes::Bytes;
use http::{request, HeaderMap, HeaderValue, Method};
use hyper::body::Incoming;
use std::borrow::Cow;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

/// A refused (413, 503) body is read and discarded up to this much, so the client
/// sees the answer instead of a reset; past it the connection is just closed.
const DRAIN_MAX_BYTES: u64 = 16 << 20;
const DRAIN_MAX_TIME: Duration = Duration::from_secs(2);

/// Everything the protected path needs about one request, built once.
#[derive(Debug)]
pub struct ProtectedRequest {
    pub route: Arc<RouteConfig>,
    pub parts: request::Parts,
    pub body: Bytes,
    pub record_key: RecordKey,
    pub fingerprint: Fingerprint,
    pub peer: SocketAddr,
    /// Told whether the claim is still ours (a message consumer's
    /// progress follows it); `None` on the HTTP path.
    pub holding: Option<Arc<crate::lease::Holding>>,
}

impl ProtectedRequest {
    /// What the claim keeps of this request for a later 422: its method
    /// and its path as the client sent it (before dot-segments are
    /// resolved for the upstream), without the query.
    pub fn first_use(&self) -> FirstUse {
        FirstUse::new(self.parts.method.as_str(), self.parts.uri.path())
    }
}

/// Whose key it is: the client's verified certificate (`scope = {
/// client_cert = true }`), the route's fixed consumer name (`scope = {
/// value }`), or the route's scope headers, each sent at most once.
pub fn scope_of(
    route: &RouteConfig,
    headers: &HeaderMap,
    client: Option<&ClientCert>,
    scope_secret: Option<&Secret>,
) -> Result<Scope, ProxyError> {
    let secret = scope_secret.map(Secret::expose);
    if route.scope_client_cert {
        // The config refuses such a route on a listener that does not
        // require client certificates, so every request has one.
        let cert = client.ok_or_else(|| {
            ProxyError::Internal(
                "a client_cert scope on a connection without a client certificate".into(),
            )
        })?;
        return Ok(Scope::of_client_cert(&cert.spki_sha256, secret));
    }
    match &route.scope_value {
        Some(value) => Ok(Scope::of_value(value, secret)),
        None => Ok(Scope::of_fields(
            &fields(headers, &route.scope_headers),
            secret,
        )?),
    }
}

/// What is known of a request's key before its body is read.
#[derive(Debug)]
pub enum KeyPlan {
    /// From a header.
    Ready(RecordKey),
    /// In the body (`key = { json = .. }`), in this scope; `required`:
    /// whether its absence is refused ([`RouteConfig::key_required`]).
    InBody { scope: Scope, required: bool },
    /// No key, on a route that does not require one: passed through.
    Absent,
}

/// The key in the client's scope, or where to find it: checked before the
/// body is read (a bad header or scope is refused without reading it).
pub fn plan_key(
    route: &RouteConfig,
    method: &Method,
    headers: &HeaderMap,
    client: Option<&ClientCert>,
    scope_secret: Option<&Secret>,
) -> Result<KeyPlan, ProxyError> {
    let required = route.key_required(method);
    if route.key_json.is_some() {
        let scope = scope_of(route, headers, client, scope_secret)?;
        return Ok(KeyPlan::InBody { scope, required });
    }
    let sent: Vec<&[u8]> = headers
        .get_all(&route.key_header)
        .iter()
        .map(HeaderValue::as_bytes)
        .collect();
    let key = IdempotencyKey::from_fields(&sent).map_err(|reason| ProxyError::InvalidKey {
        header: route.key_header.clone(),
        reason,
    })?;
    match key {
        Some(key) => {
            let scope = scope_of(route, headers, client, scope_secret)?;
            Ok(KeyPlan::Ready(RecordKey::new(scope, &key)))
        }
        None if required => Err(ProxyError::MissingKey {
            header: route.key_header.clone(),
        }),
        None => Ok(KeyPlan::Absent),
    }
}

/// The body as JSON, parsed once, if the route reads its key from it or
/// fingerprints it as JSON.
pub fn parse_body(route: &RouteConfig, body: &[u8]) -> Option<Result<Json, JsonError>> {
    (route.key_json.is_some() || route.fingerprint == FingerprintMode::Json)
        .then(|| canonical_json::parse(body))
}

/// The key once the body is read: `Ok(None)` where a body key is absent
/// and the route does not require one. The content type is not checked
/// (SNS sends JSON as `text/plain`). A string is the key as written; an
/// integer, its digits as written (never through a double, which would
/// merge ids above 2^53); anything else is refused.
pub fn resolve_key(
    route: &RouteConfig,
    plan: KeyPlan,
    doc: Option<&Result<Json, JsonError>>,
) -> Result<Option<RecordKey>, ProxyError> {
    let (scope, required) = match plan {
        KeyPlan::Ready(key) => return Ok(Some(key)),
        KeyPlan::Absent => return Ok(None),
        KeyPlan::InBody { scope, required } => (scope, required),
    };
    let Some(pointer) = &route.key_json else {
        return Err(ProxyError::Internal("a body key without a pointer".into()));
    };
    let refuse = |reason: BodyKeyError| {
        if reason.is_missing() && !required {
            return Ok(None);
        }
        Err(ProxyError::BodyKey {
            pointer: pointer.to_string(),
            reason,
        })
    };
    let doc = match doc {
        Some(Ok(doc)) => doc,
        Some(Err(e)) => return refuse(BodyKeyError::NotJson(e.clone())),
        None => {
            return Err(ProxyError::Internal(
                "a body key without a parsed body".into(),
            ))
        }
    };
    let text = match pointer.find(doc) {
        None => return refuse(BodyKeyError::Missing),
        Some(Json::String(s)) => s.as_str(),
        Some(Json::Number { text, .. }) if is_integer(text) => text,
        Some(_) => return refuse(BodyKeyError::WrongType),
    };
    match IdempotencyKey::from_value(text) {
        Ok(key) => Ok(Some(RecordKey::new(scope, &key))),
        Err(e) => refuse(BodyKeyError::Invalid(e)),
    }
}

/// `-?digits`: an integer as JSON writes it (no fraction, no exponent).
fn is_integer(text: &str) -> bool {
    let digits = text.strip_prefix('-').unwrap_or(text);
    !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit())
}

/// What of the body the fingerprint covers: the bytes as sent, or with
/// `fingerprint = "json"` the canonical form (RFC 8785) after removing
/// `fingerprint_ignore`; a body that is not I-JSON (not JSON, a duplicate
/// member name, nesting past the limit) counts as its bytes.
fn fingerprinted_body<'a>(
    route: &RouteConfig,
    body: &'a [u8],
    doc: Option<Result<Json, JsonError>>,
) -> Cow<'a, [u8]> {
    match (route.fingerprint, doc) {
        (FingerprintMode::Json, Some(Ok(mut doc))) => {
            for pointer in &route.fingerprint_ignore {
                pointer.remove(&mut doc);
            }
            let mut out = Vec::with_capacity(body.len());
            canonical_json::write(&doc, &mut out);
            Cow::Owned(out)
        }
        _ => Cow::Borrowed(body),
    }
}

/// Fingerprints the request (its path as route matching normalized it)
/// under its scoped key; `doc` is the body as [`parse_body`] parsed it.
pub fn prepare(
    route: Arc<RouteConfig>,
    parts: request::Parts,
    body: Bytes,
    record_key: RecordKey,
    doc: Option<Result<Json, JsonError>>,
    peer: SocketAddr,
) -> ProtectedRequest {
    let covered = fingerprinted_body(&route, &body, doc);
    let fingerprint = Fingerprint::compute(
        &parts.method,
        &normalize_path(parts.uri.path()),
        parts.uri.query(),
        &fields(&parts.headers, &route.fingerprint_headers),
        &covered,
    );
    ProtectedRequest {
        record_key,
        fingerprint,
        route,
        parts,
        body,
        peer,
        holding: None,
    }
}

/// Reads a protected request's body whole, within the route's size limit,
/// the server's `request_body_timeout` and the global body budget (see
/// [`crate::body::budget`]): its length is reserved before a byte is read,
/// or, when it has none, its buffer as the chunks arrive; the bytes
/// returned hold that reservation until they are dropped.
pub async fn read_body(
    route: &RouteConfig,
    headers: &HeaderMap,
    body: &mut Incoming,
    timeout: Duration,
    budget: &Arc<BodyBudget>,
) -> Result<Bytes, ProxyError> {
    let too_large = ProxyError::BodyTooLarge {
        limit: route.max_request_body,
    };
    let declared = content_length(headers);
    if declared.is_some_and(|n| n > route.max_request_body) {
        drain_if_small(body, declared).await;
        return Err(too_large);
    }
    let expected = http_body::Body::size_hint(body).exact();
    let Some(mut reservation) = budget.try_reserve(expected.unwrap_or(0)) else {
        drain_if_small(body, expected).await;
        return Err(ProxyError::Overloaded);
    };
    let limit = route.max_request_body;
    let read = read_limited(body, limit, expected, |buf, more| {
        reservation.make_room(buf, more, limit)
    });
    let Ok(read) = tokio::time::timeout(timeout, read).await else {
        return Err(ProxyError::BodyTimeout);
    };
    match read {
        Ok(bytes) => Ok(reservation.hold(bytes)),
        Err(ReadError::TooLarge) => {
            drain(body, DRAIN_MAX_BYTES, DRAIN_MAX_TIME).await;
            Err(too_large)
        }
        Err(ReadError::NoRoom) => Err(ProxyError::Overloaded),
        Err(ReadError::Failed(e)) => Err(ProxyError::BodyRead(e)),
    }
}

/// Reads and discards a refused body of known, small length, so the client
/// sees the refusal instead of a reset.
async fn drain_if_small(body: &mut Incoming, length: Option<u64>) {
    if length.is_some_and(|n| n <= DRAIN_MAX_BYTES) {
        drain(body, DRAIN_MAX_BYTES, DRAIN_MAX_TIME).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::{HeaderValue, Request};

    fn route(extra: &str) -> Arc<RouteConfig> {
        crate::config::test_route(extra)
    }

    fn parts(headers: &[(&str, &str)]) -> request::Parts {
        let mut b = Request::post("/o");
        for (n, v) in headers {
            b = b.header(*n, *v);
        }
        b.body(()).unwrap().into_parts().0
    }

    /// The key a header gives (`None`: absent, on a route without one).
    fn header_key(r: &RouteConfig, h: &HeaderMap) -> Result<Option<RecordKey>, ProxyError> {
        plan_key(r, &Method::POST, h, None, None).map(|plan| match plan {
            KeyPlan::Ready(key) => Some(key),
            _ => None,
        })
    }

    #[test]
    fn key_table() {
        let required = route("");
        let optional = route("require_key = false");
        let key = |h: &[(&str, &str)], r: &RouteConfig| header_key(r, &parts(h).headers);
        assert!(matches!(
            key(&[], &required),
            Err(ProxyError::MissingKey { .. })
        ));
        assert!(matches!(key(&[], &optional), Ok(None)));
        assert!(matches!(
            key(&[("idempotency-key", "")], &optional),
            Err(ProxyError::InvalidKey { .. })
        ));
        let quoted = key(&[("idempotency-key", "\"k1\"")], &required).unwrap();
        let bare = key(&[("idempotency-key", "k1")], &required).unwrap();
        assert_eq!(quoted.unwrap(), bare.unwrap());
        let twice = [
            ("idempotency-key", "k1"),
            ("authorization", "a"),
            ("authorization", "b"),
        ];
        assert!(matches!(
            key(&twice, &required),
            Err(ProxyError::RepeatedScopeHeader(_))
        ));
        // Without a key there is no scope to decide: passed through.
        assert!(matches!(key(&twice[1..], &optional), Ok(None)));
    }

    fn prepared(
        r: &Arc<RouteConfig>,
        headers: &[(&str, &str)],
        path: &str,
        body: &str,
    ) -> ProtectedRequest {
        let peer = "127.0.0.1:1".parse().unwrap();
        let mut parts = parts(headers);
        parts.uri = path.parse().unwrap();
        let mut keyed = parts.headers.clone();
        keyed.insert("idempotency-key", HeaderValue::from_static("k1"));
        let record_key = header_key(r, &keyed).unwrap().unwrap();
        let doc = parse_body(r, body.as_bytes());
        let body = Bytes::from(body.to_string());
        prepare(r.clone(), parts, body, record_key, doc, peer)
    }

    #[test]
    fn prepare_scopes_by_credential_and_fingerprints_the_request() {
        let r = route("fingerprint_headers = [\"x-tenant\"]");
        let base = prepared(&r, &[("authorization", "a")], "/o", "{}");
        let same = prepared(&r, &[("authorization", "a")], "/o", "{}");
        assert_eq!(base.record_key, same.record_key);
        assert_eq!(base.fingerprint, same.fingerprint);

        let other_client = prepared(&r, &[("authorization", "b")], "/o", "{}");
        assert_ne!(base.record_key, other_client.record_key);
        assert_eq!(base.fingerprint, other_client.fingerprint);

        for (i, other) in [
            prepared(&r, &[("authorization", "a")], "/o", "{ }"),
            prepared(&r, &[("authorization", "a")], "/p", "{}"),
            prepared(&r, &[("authorization", "a"), ("x-tenant", "1")], "/o", "{}"),
        ]
        .into_iter()
        .enumerate()
        {
            assert_eq!(base.record_key, other.record_key, "case {i}");
            assert_ne!(base.fingerprint, other.fingerprint, "case {i}");
        }
    }

    #[test]
    fn body_key_table() {
        let required = route("key = { json = \"/message/messageId\" }\nscope = { value = \"c\" }");
        let optional = route(
            "key = { json = \"/message/messageId\" }\nscope = { value = \"c\" }\nrequire_key = false",
        );
        let resolve = |r: &RouteConfig, body: &str| {
            let plan = plan_key(r, &Method::POST, &parts(&[]).headers, None, None).unwrap();
            assert!(matches!(plan, KeyPlan::InBody { .. }));
            let doc = parse_body(r, body.as_bytes());
            resolve_key(r, plan, doc.as_ref())
        };
        let key = |body: &str| resolve(&required, body).unwrap().unwrap();
        let slug = |r: &RouteConfig, body: &str| match resolve(r, body) {
            Err(e) => crate::problem::Problem::from_error(&e).slug,
            Ok(k) => panic!("{body}: a key {k:?}"),
        };
        let m = |id: &str| format!(r#"{{"message":{{"messageId":{id}}}}}"#);
        assert_eq!(key(&m("\"1\"")), key(&m("\"1\"")));
        assert_ne!(key(&m("\"1\"")), key(&m("\"2\"")));
        // An integer is its digits: 1 and "1" are one key, 1.0 is refused.
        assert_eq!(key(&m("1")), key(&m("\"1\"")));
        assert_eq!(key(&m("-7")), key(&m("\"-7\"")));
        for (body, want) in [
            ("not json".to_string(), "key-missing"),
            (r#"{"message":{}}"#.to_string(), "key-missing"),
            (r#"{"message":"x"}"#.to_string(), "key-missing"),
            (
                r#"{"message":{"messageId":1},"message":{}}"#.to_string(),
                "key-missing",
            ),
            (m("1.0"), "key-invalid"),
            (m("1e3"), "key-invalid"),
            (m("true"), "key-invalid"),
            (m("{}"), "key-invalid"),
            (m("\"\""), "key-invalid"),
            (m("\"tab\\there\""), "key-invalid"),
        ] {
            assert_eq!(slug(&required, &body), want, "{body}");
        }
        // Optional: no key there means unprotected; a bad one is still 400.
        assert!(matches!(resolve(&optional, "not json"), Ok(None)));
        assert!(matches!(resolve(&optional, r#"{"message":{}}"#), Ok(None)));
        assert_eq!(slug(&optional, &m("1.5")), "key-invalid");
        // The scope is the route's consumer, whatever the credential.
        let with_auth = |auth: &str| {
            let h = parts(&[("authorization", auth)]).headers;
            match plan_key(&required, &Method::POST, &h, None, None).unwrap() {
                KeyPlan::InBody { scope, .. } => scope,
                other => panic!("{other:?}"),
            }
        };
        assert_eq!(with_auth("a"), with_auth("b"));
        assert_eq!(with_auth("a"), Scope::of_value("c", None));
    }

    #[test]
    fn json_fingerprints_ignore_order_whitespace_and_the_ignored_members() {
        let r = route("fingerprint = \"json\"\nfingerprint_ignore = [\"/attempt\"]");
        let fp = |body: &str| prepared(&r, &[], "/o", body).fingerprint;
        let base = fp(r#"{"a":1,"b":[1,2],"attempt":1}"#);
        assert_eq!(base, fp(r#" { "b" : [1, 2.0], "a": 1, "attempt": 7 } "#));
        assert_eq!(base, fp(r#"{"a":1,"b":[1,2]}"#));
        assert_ne!(base, fp(r#"{"a":1,"b":[2,1]}"#));
        assert_ne!(base, fp(r#"{"a":"1","b":[1,2]}"#));
        // Not I-JSON: the bytes, exactly as a raw route would see them.
        let raw = route("");
        for body in ["plain", r#"{"a":1,"a":1}"#] {
            assert_eq!(fp(body), prepared(&raw, &[], "/o", body).fingerprint);
        }
    }
}
