//! Header rules: hop-by-hop stripping, forwarding headers, and which
//! response headers are stored for replay.

use crate::config::RouteConfig;
use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use std::net::SocketAddr;

/// RFC 9110 §7.6.1: these apply to one connection only and must not be
/// forwarded, plus the legacy `Keep-Alive`/`Proxy-Connection` (RFC 9112 §9.6
/// and common practice).
const HOP_BY_HOP: [HeaderName; 8] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
];

/// Removes hop-by-hop headers, including those the `Connection` header names.
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|t| HeaderName::from_bytes(t.trim().as_bytes()).ok())
        .collect();
    for name in named.iter().chain(HOP_BY_HOP.iter()) {
        headers.remove(name);
    }
    headers.remove(header::UPGRADE);
}

/// Adds `X-Forwarded-For/-Proto/-Host` for the upstream.
pub fn add_forwarded(headers: &mut HeaderMap, peer: SocketAddr, host: Option<HeaderValue>) {
    const XFF: HeaderName = HeaderName::from_static("x-forwarded-for");
    const XFP: HeaderName = HeaderName::from_static("x-forwarded-proto");
    const XFH: HeaderName = HeaderName::from_static("x-forwarded-host");
    let ip = peer.ip().to_string();
    let xff = match headers.get(&XFF).and_then(|v| v.to_str().ok()) {
        Some(prev) => format!("{prev}, {ip}"),
        None => ip,
    };
    if let Ok(v) = HeaderValue::from_str(&xff) {
        headers.insert(XFF, v);
    }
    headers.insert(XFP, HeaderValue::from_static("http"));
    if let Some(host) = host {
        if !headers.contains_key(&XFH) {
            headers.insert(XFH, host);
        }
    }
}

/// Never stored unless a route includes them: `Date` would be stale on
/// replay and `Set-Cookie` would hand one client's session to its retries
/// (granit-dotnet#1151). `Content-Length` is recomputed from the body.
const NOT_STORED_BY_DEFAULT: [HeaderName; 2] = [header::DATE, header::SET_COOKIE];

/// The response headers to keep for replay, in order, repeated names kept.
pub fn stored_headers(headers: &HeaderMap, route: &RouteConfig) -> Vec<(String, Bytes)> {
    let mut end_to_end = headers.clone();
    strip_hop_by_hop(&mut end_to_end);
    end_to_end
        .iter()
        .filter(|(name, _)| **name != header::CONTENT_LENGTH)
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
    use crate::config::Config;

    fn route(extra: &str) -> RouteConfig {
        let text = format!(
            "[server]\nupstream = \"http://127.0.0.1:1\"\n[[route]]\nmethods = [\"POST\"]\npath = \"/o\"\n{extra}"
        );
        let cfg = Config::parse(&text, "t.toml").unwrap();
        let r = cfg.routes.iter().next().unwrap().as_ref().clone();
        r
    }

    #[test]
    fn hop_by_hop_and_connection_named_headers_are_removed() {
        let mut h = HeaderMap::new();
        h.insert(header::CONNECTION, "close, x-secret-hop".parse().unwrap());
        h.insert("x-secret-hop", "1".parse().unwrap());
        h.insert("keep-alive", "timeout=5".parse().unwrap());
        h.insert(header::TRANSFER_ENCODING, "chunked".parse().unwrap());
        h.insert(header::UPGRADE, "websocket".parse().unwrap());
        h.insert("x-kept", "1".parse().unwrap());
        strip_hop_by_hop(&mut h);
        assert_eq!(h.len(), 1, "{h:?}");
        assert!(h.contains_key("x-kept"));
    }

    #[test]
    fn forwarded_headers_append_to_an_existing_chain() {
        let mut h = HeaderMap::new();
        h.insert("x-forwarded-for", "203.0.113.7".parse().unwrap());
        add_forwarded(
            &mut h,
            "127.0.0.1:5000".parse().unwrap(),
            Some(HeaderValue::from_static("api.example")),
        );
        assert_eq!(h["x-forwarded-for"], "203.0.113.7, 127.0.0.1");
        assert_eq!(h["x-forwarded-proto"], "http");
        assert_eq!(h["x-forwarded-host"], "api.example");
    }

    #[test]
    fn stored_headers_keep_order_and_repeats_but_not_date_or_cookies() {
        let mut h = HeaderMap::new();
        h.insert(header::LOCATION, "/o/1".parse().unwrap());
        h.append("x-multi", "a, b".parse().unwrap());
        h.append("x-multi", "c".parse().unwrap());
        h.insert(
            header::DATE,
            "Tue, 01 Dec 2026 08:00:00 GMT".parse().unwrap(),
        );
        h.insert(header::SET_COOKIE, "s=1".parse().unwrap());
        h.insert(header::CONTENT_LENGTH, "2".parse().unwrap());
        h.insert("x-internal", "1".parse().unwrap());
        let names = |v: Vec<(String, Bytes)>| {
            v.into_iter()
                .map(|(n, v)| format!("{n}={}", String::from_utf8_lossy(&v)))
                .collect::<Vec<_>>()
        };
        assert_eq!(
            names(stored_headers(&h, &route(""))),
            ["location=/o/1", "x-multi=a, b", "x-multi=c", "x-internal=1"]
        );
        let custom = route(
            "include_response_headers = [\"set-cookie\"]\nexclude_response_headers = [\"x-internal\"]",
        );
        assert_eq!(
            names(stored_headers(&h, &custom)),
            [
                "location=/o/1",
                "x-multi=a, b",
                "x-multi=c",
                "set-cookie=s=1"
            ]
        );
    }
}
