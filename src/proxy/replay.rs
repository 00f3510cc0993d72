//! One round trip of a stored response: [`capture`] turns the upstream's
//! answer into what the store keeps, [`replay`] turns that back into the
//! response a retry gets, byte for byte plus the replay marker.

use super::headers::strip_hop_by_hop;
use crate::body::{full, ProxyBody};
use crate::route::RouteConfig;
use crate::store::StoredResponse;
use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{response, Method, Response, StatusCode};
use tracing::warn;

/// The replay marker Stripe uses (and IETF httpapi issue #46 asks for).
pub const REPLAYED_HEADER: HeaderName = HeaderName::from_static("idempotent-replayed");

/// Never stored unless a route includes them: `Date` would be stale on
/// replay and `Set-Cookie` would hand one client's session to its retries
/// (granit-dotnet#1151). `Content-Length` is recomputed from the body,
/// unless [`length_is_not_the_body`].
const NOT_STORED_BY_DEFAULT: [HeaderName; 2] = [header::DATE, header::SET_COOKIE];

/// What the store keeps of an upstream response to a `method` request,
/// its body read whole.
pub fn capture(
    method: &Method,
    parts: &response::Parts,
    body: Bytes,
    route: &RouteConfig,
) -> StoredResponse {
    let keep_length = body.is_empty() && length_is_not_the_body(method, parts.status);
    StoredResponse {
        status: parts.status.as_u16(),
        headers: stored_headers(&parts.headers, route, keep_length),
        body,
    }
}

/// A response to HEAD, and a 304, carries no body but may carry the
/// `Content-Length` of the representation it did not send (RFC 9110 §8.6):
/// that length is stored, so a replay carries it as the original did.
fn length_is_not_the_body(method: &Method, status: StatusCode) -> bool {
    *method == Method::HEAD || status == StatusCode::NOT_MODIFIED
}

/// The stored response, byte for byte, plus the replay marker.
pub fn replay(stored: StoredResponse) -> Response<ProxyBody> {
    let bodiless = stored.body.is_empty();
    let mut resp = Response::new(full(stored.body));
    *resp.status_mut() = StatusCode::from_u16(stored.status).unwrap_or(StatusCode::OK);
    let headers = resp.headers_mut();
    for (name, value) in stored.headers {
        // A stored length describes a body that was never sent (HEAD, 304);
        // beside a body it would contradict it.
        if name == header::CONTENT_LENGTH.as_str() && !bodiless {
            warn!("dropping a stored content-length beside a stored body");
            continue;
        }
        match (
            HeaderName::from_bytes(name.as_bytes()),
            HeaderValue::from_maybe_shared(value),
        ) {
            (Ok(n), Ok(v)) => {
                headers.append(n, v);
            }
            _ => warn!("dropping an invalid stored header"),
        }
    }
    headers.insert(REPLAYED_HEADER, HeaderValue::from_static("true"));
    resp
}

/// The response headers to keep for replay, in order, repeated names kept;
/// `Content-Length` only with `keep_length`.
fn stored_headers(
    headers: &HeaderMap,
    route: &RouteConfig,
    keep_length: bool,
) -> Vec<(String, Bytes)> {
    let mut end_to_end = headers.clone();
    strip_hop_by_hop(&mut end_to_end);
    end_to_end
        .iter()
        .filter(|(name, _)| keep_length || **name != header::CONTENT_LENGTH)
        .filter(|(name, _)| {
            !NOT_STORED_BY_DEFAULT.contains(name) || route.include_response_headers.contains(name)
        })
        .filter(|(name, _)| !route.exclude_response_headers.contains(name))
        .map(|(name, value)| {
            (
                name.as_str().to_string(),
                Bytes::copy_from_slice(value.as_bytes()),
            )
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;

    fn route(extra: &str) -> RouteConfig {
        crate::config::test_route(extra).as_ref().clone()
    }

    fn upstream_answer() -> response::Parts {
        let (parts, ()) = Response::builder()
            .status(201)
            .header(header::LOCATION, "/o/1")
            .header("x-multi", "a, b")
            .header("x-multi", "c")
            .header(header::DATE, "Tue, 01 Dec 2026 08:00:00 GMT")
            .header(header::SET_COOKIE, "s=1")
            .header(header::CONTENT_LENGTH, "2")
            .header(header::CONNECTION, "close")
            .header("x-internal", "1")
            .body(())
            .unwrap()
            .into_parts();
        parts
    }

    fn names(v: &[(String, Bytes)]) -> Vec<String> {
        v.iter()
            .map(|(n, v)| format!("{n}={}", String::from_utf8_lossy(v)))
            .collect()
    }

    #[test]
    fn stored_headers_keep_order_and_repeats_but_not_date_or_cookies() {
        let parts = upstream_answer();
        let plain = capture(&Method::POST, &parts, Bytes::new(), &route(""));
        assert_eq!(
            names(&plain.headers),
            ["location=/o/1", "x-multi=a, b", "x-multi=c", "x-internal=1"]
        );
        let custom = route(
            "include_response_headers = [\"set-cookie\"]\nexclude_response_headers = [\"x-internal\"]",
        );
        assert_eq!(
            names(&capture(&Method::POST, &parts, Bytes::new(), &custom).headers),
            [
                "location=/o/1",
                "x-multi=a, b",
                "x-multi=c",
                "set-cookie=s=1"
            ]
        );
    }

    #[tokio::test]
    async fn a_captured_response_replays_byte_for_byte_with_the_marker() {
        let body = Bytes::from_static(b"\x00{\"id\":\"ord_1\"}\xff");
        let stored = capture(&Method::POST, &upstream_answer(), body.clone(), &route(""));
        assert_eq!(stored.status, 201);
        let resp = replay(stored);
        assert_eq!(resp.status(), 201);
        let h = resp.headers();
        assert_eq!(h[REPLAYED_HEADER], "true");
        assert_eq!(h[header::LOCATION], "/o/1");
        let multi: Vec<_> = h.get_all("x-multi").iter().collect();
        assert_eq!(multi, ["a, b", "c"]);
        assert!(!h.contains_key(header::DATE) && !h.contains_key(header::SET_COOKIE));
        assert!(!h.contains_key(header::CONNECTION));
        let got = resp.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(got, body);
    }

    #[test]
    fn only_bodiless_answers_keep_their_content_length() {
        let mut not_modified = upstream_answer();
        not_modified.status = StatusCode::NOT_MODIFIED;
        let length = |method: &Method, parts: &response::Parts, body: &'static [u8]| {
            let stored = capture(method, parts, Bytes::from_static(body), &route(""));
            let kept = stored.headers.iter().find(|(n, _)| n == "content-length");
            kept.map(|(_, v)| v.clone())
        };
        let two = Some(Bytes::from_static(b"2"));
        assert_eq!(length(&Method::HEAD, &upstream_answer(), b""), two);
        assert_eq!(length(&Method::POST, &not_modified, b""), two);
        assert_eq!(length(&Method::POST, &upstream_answer(), b""), None);
        assert_eq!(length(&Method::POST, &upstream_answer(), b"ok"), None);
        assert_eq!(length(&Method::HEAD, &upstream_answer(), b"ok"), None);

        let resp = replay(capture(
            &Method::HEAD,
            &upstream_answer(),
            Bytes::new(),
            &route(""),
        ));
        assert_eq!(resp.headers()[header::CONTENT_LENGTH], "2");
        let contradicting = replay(StoredResponse {
            status: 200,
            headers: vec![("content-length".into(), Bytes::from_static(b"9"))],
            body: Bytes::from_static(b"ok"),
        });
        assert!(!contradicting.headers().contains_key(header::CONTENT_LENGTH));
    }

    #[test]
    fn an_unusable_stored_header_is_dropped_not_fatal() {
        let resp = replay(StoredResponse {
            status: 200,
            headers: vec![
                ("bad name".into(), Bytes::from_static(b"x")),
                ("x-ok".into(), Bytes::from_static(b"1")),
            ],
            body: Bytes::new(),
        });
        assert_eq!(resp.headers()["x-ok"], "1");
        assert_eq!(resp.headers().len(), 2, "x-ok and the marker");
    }
}
