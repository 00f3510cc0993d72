//! Header rules for forwarding: hop-by-hop stripping, `X-Forwarded-*`,
//! cookie joining, what makes an upgrade request, a declared body length.
//! Which response headers are stored is `replay.rs`'s.

use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Request, Version};
use std::net::SocketAddr;

/// RFC 9110 §7.6.1: these apply to one connection only and must not be
/// forwarded, plus the legacy `Keep-Alive`/`Proxy-Connection` (RFC 9112 §9.6
/// and common practice) and `Upgrade`, which the forwarder puts back on the
/// requests that may pass one. Compared as text: no hashing.
const HOP_BY_HOP: [&str; 9] = [
    "connection",
    "keep-alive",
    "proxy-connection",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

/// Whether `name` (any case) is one of [`HOP_BY_HOP`].
fn is_hop_by_hop(name: &str) -> bool {
    HOP_BY_HOP.iter().any(|h| h.eq_ignore_ascii_case(name))
}

/// [`is_hop_by_hop`] for a parsed name: the standard ones compare as
/// their tag, the two others as lowercase text (a `HeaderName` is always
/// lowercase), instead of nine case-insensitive comparisons per field.
fn is_hop_by_hop_name(name: &HeaderName) -> bool {
    name == header::CONNECTION
        || name == header::TE
        || name == header::TRAILER
        || name == header::TRANSFER_ENCODING
        || name == header::UPGRADE
        || name == header::PROXY_AUTHENTICATE
        || name == header::PROXY_AUTHORIZATION
        || matches!(name.as_str(), "keep-alive" | "proxy-connection")
}

/// Removes hop-by-hop headers, including those the `Connection` header names.
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    // Only the names present are removed, found in one pass over the
    // names: most messages carry none, or just `Connection: keep-alive`,
    // and a hashed removal (or lookup) of every hop-by-hop name cost more
    // than the rest of the rewrite. `Connection` is read only when present.
    let mut doomed: Vec<HeaderName> = Vec::new();
    let mut connection = false;
    for name in headers.keys() {
        if is_hop_by_hop_name(name) {
            connection |= name == header::CONNECTION;
            doomed.push(name.clone());
        }
    }
    if connection {
        doomed.extend(
            list_items(headers, header::CONNECTION)
                .filter(|t| !is_hop_by_hop(t))
                .filter_map(|t| HeaderName::from_bytes(t.as_bytes()).ok()),
        );
    }
    for name in doomed {
        headers.remove(name);
    }
}

/// The protocol an HTTP/1.1 upgrade request asks for (RFC 9110 §7.8): an
/// `Upgrade` field, named by `Connection` as it must be. Hop-by-hop, so
/// [`strip_hop_by_hop`] removes both; the forwarder puts them back on
/// requests that may pass an upgrade. HTTP/2 has no `Upgrade` (RFC 9113
/// §8.6), and HTTP/1.0 cannot be upgraded.
pub fn upgrade_protocol<B>(req: &Request<B>) -> Option<HeaderValue> {
    if req.version() != Version::HTTP_11 {
        return None;
    }
    let named =
        list_items(req.headers(), header::CONNECTION).any(|t| t.eq_ignore_ascii_case("upgrade"));
    named
        .then(|| req.headers().get(header::UPGRADE).cloned())
        .flatten()
}

/// The items of every `name` field, each a comma-separated list (RFC 9110
/// §5.6.1), trimmed; a field that is not text holds none.
pub fn list_items(headers: &HeaderMap, name: HeaderName) -> impl Iterator<Item = &str> {
    headers
        .get_all(name)
        .into_iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(str::trim)
}

/// Adds `X-Forwarded-For/-Proto/-Host` for the upstream (`-Proto` is
/// `https` where the client connected over TLS, `tls`). Only with `trust`
/// (idemgate behind a proxy that sets them) are the client's own values
/// kept, the peer address appended to its `X-Forwarded-For` chain;
/// otherwise a client could claim any origin address, or make the upstream
/// build links to a host of its choosing.
pub fn add_forwarded(
    headers: &mut HeaderMap,
    peer: SocketAddr,
    host: Option<HeaderValue>,
    tls: bool,
    trust: bool,
) {
    const XFF: HeaderName = HeaderName::from_static("x-forwarded-for");
    const XFP: HeaderName = HeaderName::from_static("x-forwarded-proto");
    const XFH: HeaderName = HeaderName::from_static("x-forwarded-host");
    // Untrusted, a client's own chain could name any address as its origin.
    let peer_ip = ip_text(peer.ip());
    let xff = if trust && headers.contains_key(&XFF) {
        let mut chain: Vec<&str> = headers
            .get_all(&XFF)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .collect();
        chain.push(&peer_ip);
        HeaderValue::from_str(&chain.join(", ")).ok()
    } else {
        HeaderValue::from_str(&peer_ip).ok()
    };
    if let Some(v) = xff {
        headers.insert(XFF, v);
    }
    if !(trust && headers.contains_key(&XFP)) {
        let proto = if tls { "https" } else { "http" };
        headers.insert(XFP, HeaderValue::from_static(proto));
    }
    if !(trust && headers.contains_key(&XFH)) {
        match host {
            Some(host) => {
                headers.insert(XFH, host);
            }
            None => {
                headers.remove(&XFH);
            }
        }
    }
}

/// An address as text, IPv4 without the formatting machinery (on every
/// forwarded request, where `Display` cost more than the rest of
/// `X-Forwarded-For`).
fn ip_text(ip: std::net::IpAddr) -> String {
    let std::net::IpAddr::V4(v4) = ip else {
        return ip.to_string();
    };
    let mut out = String::with_capacity(15);
    for (i, octet) in v4.octets().into_iter().enumerate() {
        if i > 0 {
            out.push('.');
        }
        if octet >= 100 {
            out.push(char::from(b'0' + octet / 100));
        }
        if octet >= 10 {
            out.push(char::from(b'0' + octet / 10 % 10));
        }
        out.push(char::from(b'0' + octet % 10));
    }
    out
}

/// RFC 9113 §8.2.3: an HTTP/2 client may split `Cookie` into several
/// fields; they must be joined with "; " before going out as HTTP/1.1.
pub fn join_cookies(headers: &mut HeaderMap) {
    if headers.get_all(header::COOKIE).iter().count() < 2 {
        return;
    }
    let joined: Vec<&[u8]> = headers
        .get_all(header::COOKIE)
        .iter()
        .map(HeaderValue::as_bytes)
        .collect();
    if let Ok(v) = HeaderValue::from_bytes(&joined.join(&b"; "[..])) {
        headers.insert(header::COOKIE, v);
    }
}

/// The request's `Content-Length`, when it is a number.
pub fn content_length(headers: &HeaderMap) -> Option<u64> {
    headers
        .get(header::CONTENT_LENGTH)?
        .to_str()
        .ok()?
        .parse()
        .ok()
}

/// What `headers` holds of each of `names`, in that order: the protocol's
/// view of a route's scope and fingerprint headers.
pub fn fields<'a>(
    headers: &'a HeaderMap,
    names: &'a [HeaderName],
) -> Vec<(&'a HeaderName, Vec<&'a [u8]>)> {
    let values = |name| headers.get_all(name).iter().map(HeaderValue::as_bytes);
    names.iter().map(|n| (n, values(n).collect())).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ip_text_is_what_display_writes() {
        for octet in 0..=255u8 {
            for ip in [
                std::net::Ipv4Addr::new(octet, 0, 255, octet.wrapping_mul(7)),
                std::net::Ipv4Addr::new(10, octet, 100, 9),
            ] {
                assert_eq!(ip_text(ip.into()), ip.to_string());
            }
        }
        let v6: std::net::IpAddr = "2001:db8::1".parse().unwrap();
        assert_eq!(ip_text(v6), "2001:db8::1");
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
    fn a_parsed_name_is_hop_by_hop_exactly_when_its_text_is() {
        let names = HOP_BY_HOP.iter().copied().chain([
            "Keep-Alive",
            "PROXY-CONNECTION",
            "Transfer-Encoding",
            "x-kept",
            "content-length",
            "keep-alive-x",
            "proxy-connections",
            "tea",
        ]);
        for text in names {
            let name = HeaderName::from_bytes(text.as_bytes()).unwrap();
            assert_eq!(is_hop_by_hop_name(&name), is_hop_by_hop(text), "{text}");
        }
        // Every hop-by-hop field gone with no `Connection` at all.
        let mut h = HeaderMap::new();
        for text in HOP_BY_HOP.iter().filter(|t| **t != "connection") {
            h.insert(HeaderName::from_static(text), "1".parse().unwrap());
        }
        h.insert("x-kept", "1".parse().unwrap());
        strip_hop_by_hop(&mut h);
        assert_eq!(h.len(), 1, "{h:?}");
    }

    #[test]
    fn an_upgrade_is_an_http11_upgrade_field_named_by_connection() {
        let req = |version, fields: &[(&str, &str)]| {
            let mut r = Request::get("/ws").version(version);
            for (k, v) in fields {
                r = r.header(*k, *v);
            }
            upgrade_protocol(&r.body(()).unwrap())
        };
        let ws = [
            ("connection", "keep-alive, Upgrade"),
            ("upgrade", "websocket"),
        ];
        assert_eq!(req(Version::HTTP_11, &ws).unwrap(), "websocket");
        assert_eq!(req(Version::HTTP_10, &ws), None);
        assert_eq!(req(Version::HTTP_11, &[("upgrade", "websocket")]), None);
        assert_eq!(req(Version::HTTP_11, &[("connection", "upgrade")]), None);
    }

    #[test]
    fn forwarded_headers_are_kept_and_appended_only_when_trusted() {
        let mut h = HeaderMap::new();
        h.append("x-forwarded-for", "203.0.113.7".parse().unwrap());
        h.append("x-forwarded-for", "198.51.100.2".parse().unwrap());
        h.insert("x-forwarded-host", "evil.example".parse().unwrap());
        h.insert("x-forwarded-proto", "https".parse().unwrap());
        let peer = "127.0.0.1:5000".parse().unwrap();
        let host = Some(HeaderValue::from_static("api.example"));
        let mut untrusted = h.clone();
        let mut over_tls = h.clone();
        add_forwarded(&mut untrusted, peer, host.clone(), false, false);
        add_forwarded(&mut over_tls, peer, host.clone(), true, false);
        assert_eq!(untrusted["x-forwarded-for"], "127.0.0.1");
        assert_eq!(untrusted["x-forwarded-proto"], "http");
        assert_eq!(over_tls["x-forwarded-proto"], "https");
        assert_eq!(untrusted["x-forwarded-host"], "api.example");
        let mut trusted = h;
        add_forwarded(&mut trusted, peer, host, false, true);
        assert_eq!(
            trusted["x-forwarded-for"],
            "203.0.113.7, 198.51.100.2, 127.0.0.1"
        );
        assert_eq!(trusted["x-forwarded-proto"], "https");
        assert_eq!(trusted["x-forwarded-host"], "evil.example");
    }

    #[test]
    fn split_cookies_are_joined() {
        let mut h = HeaderMap::new();
        h.append(header::COOKIE, "a=1".parse().unwrap());
        h.append(header::COOKIE, "b=2".parse().unwrap());
        join_cookies(&mut h);
        assert_eq!(h.get_all(header::COOKIE).iter().count(), 1);
        assert_eq!(h[header::COOKIE], "a=1; b=2");
    }

    #[test]
    fn fields_are_the_named_headers_in_their_order_each_with_every_value() {
        let mut h = HeaderMap::new();
        h.append("x-tenant", HeaderValue::from_static("7"));
        h.append("x-other", HeaderValue::from_static("ignored"));
        h.append("x-tenant", HeaderValue::from_static("8"));
        let names = [
            HeaderName::from_static("x-absent"),
            HeaderName::from_static("x-tenant"),
        ];
        let want: Vec<(&HeaderName, Vec<&[u8]>)> =
            vec![(&names[0], vec![]), (&names[1], vec![b"7", b"8"])];
        assert_eq!(fields(&h, &names), want);
    }
}
