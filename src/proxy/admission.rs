//! What every proxied request must satisfy before route lookup, protected
//! or not: rules hyper leaves to the application. A request that breaks one
//! is answered here and never forwarded.
//!
//! - The request target (RFC 9112 §3.2): origin-form (`/orders`) or
//!   absolute-form (`http://api.example/orders`), whose path is what gets
//!   forwarded. hyper also hands over `POST orders` (authority-form, which
//!   would reach the upstream as `POST /`) and `POST *` (asterisk-form);
//!   both are 400, `OPTIONS *` and `CONNECT` included: a reverse proxy has
//!   no use for them. (h2 resets an HTTP/2 `:path` not starting with `/`
//!   itself, except `*`.)
//! - The host (RFC 9112 §3.2, RFC 9113 §8.3.1): at most one `Host` field,
//!   and on HTTP/2 a `host` that names the same host as `:authority`
//!   (compared case-insensitively); 400 otherwise. Then the one host the
//!   request names becomes its `Host` field: the target's authority (an
//!   HTTP/1.1 absolute-form target wins over `Host`, RFC 9112 §3.2.2; an
//!   HTTP/2 `:authority`, which hyper puts in the URI, often comes without
//!   any `host`). Everything after admission (scope, fingerprint,
//!   forwarding with `preserve_host`) reads that one field, so a tenant
//!   named by the host is the tenant the request is forwarded to.
//! - Transfer-codings (RFC 9112 §6.1): hyper decodes a final `chunked` and
//!   passes any coding before it through, so `gzip, chunked` would reach
//!   the upstream as a plain chunked body of gzip bytes. Only `chunked` is
//!   understood; anything else is 501, `chunked` twice is 400. (hyper
//!   itself answers a bare 400 when `chunked` is not the final coding or
//!   the request is HTTP/1.0; HTTP/2 carries no transfer-codings, and h2
//!   resets a stream that sends one.)
//!
//! After route lookup, [`refuse_protected_upgrade`]: an HTTP/1.1 upgrade
//! (WebSocket) passes through as a tunnel on unprotected traffic only.

use super::headers::upgrade_protocol;
use crate::error::{ProxyError, RequestError};
use crate::route::RouteConfig;
use http::{header, HeaderMap, Request, Uri, Version};

/// The longest coding name a problem's detail repeats back.
const MAX_ECHOED_CODING: usize = 32;

/// Checks `req` against the rules above and makes its `Host` the host it
/// is forwarded for.
pub fn admit<B>(req: &mut Request<B>) -> Result<(), ProxyError> {
    target_form(req.uri())
        .and_then(|()| host(req))
        .map_err(ProxyError::InvalidRequest)?;
    transfer_codings(req.headers())?;
    authority_as_host(req);
    Ok(())
}

/// The target's authority, when it has one, replaces `Host` (see the
/// module docs). Regression: scope and fingerprint read `Host` while
/// forwarding used the authority, so `:authority: globex.example` without
/// a `host` shared acme's scope and was served its stored response.
fn authority_as_host<B>(req: &mut Request<B>) {
    let Some(authority) = req.uri().authority() else {
        return;
    };
    // Always a valid field value: hyper parsed it out of the target.
    if let Ok(value) = http::HeaderValue::from_str(authority.as_str()) {
        req.headers_mut().insert(header::HOST, value);
    }
}

/// An upgrade request on a route that protects it (it requires a key, or
/// the request carries one) is refused with 400: a tunnel has no response
/// to store or replay. Without a key on a `require_key = false` route the
/// request is unprotected, and the upgrade passes.
pub fn refuse_protected_upgrade<B>(
    route: &RouteConfig,
    req: &Request<B>,
) -> Result<(), ProxyError> {
    // A body key (`key = { json }`) is only known once the body is read:
    // such a route never tunnels.
    let protected = route.require_key
        || route.key_json.is_some()
        || req.headers().contains_key(&route.key_header);
    if protected && upgrade_protocol(req).is_some() {
        return Err(ProxyError::UpgradeOnProtectedRoute);
    }
    Ok(())
}

/// Origin-form or absolute-form: the target has a path starting with `/`.
fn target_form(uri: &Uri) -> Result<(), RequestError> {
    if uri.path().starts_with('/') {
        return Ok(());
    }
    Err(RequestError::TargetForm(match uri.path() {
        "*" => "the asterisk-form *",
        _ if uri.authority().is_some() => "the authority-form host:port",
        _ => "a relative path",
    }))
}

/// One `Host` at most; on HTTP/2 the same host as `:authority`.
fn host<B>(req: &Request<B>) -> Result<(), RequestError> {
    let mut hosts = req.headers().get_all(header::HOST).iter();
    let host = hosts.next();
    if hosts.next().is_some() {
        return Err(RequestError::RepeatedHost);
    }
    // hyper puts an HTTP/2 request's :authority in its URI.
    if let (Version::HTTP_2, Some(host), Some(authority)) =
        (req.version(), host, req.uri().authority())
    {
        if !host
            .as_bytes()
            .eq_ignore_ascii_case(authority.as_str().as_bytes())
        {
            return Err(RequestError::HostMismatch);
        }
    }
    Ok(())
}

/// Every coding in every `Transfer-Encoding` field must be `chunked`, once.
fn transfer_codings(headers: &HeaderMap) -> Result<(), ProxyError> {
    let mut chunked = 0;
    for value in headers.get_all(header::TRANSFER_ENCODING) {
        let text = String::from_utf8_lossy(value.as_bytes());
        // A list may hold empty elements (RFC 9110 §5.6.1).
        for coding in text.split(',').map(str::trim).filter(|c| !c.is_empty()) {
            if !coding.eq_ignore_ascii_case("chunked") {
                let coding = coding.chars().take(MAX_ECHOED_CODING).collect();
                return Err(ProxyError::UnsupportedTransferCoding { coding });
            }
            chunked += 1;
        }
    }
    if chunked > 1 {
        return Err(ProxyError::InvalidRequest(RequestError::ChunkedTwice));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn admitted(fields: &[(&str, &str)]) -> Result<(), ProxyError> {
        request(Version::HTTP_11, "/orders", fields)
    }

    fn request(version: Version, target: &str, fields: &[(&str, &str)]) -> Result<(), ProxyError> {
        let mut req = Request::post(target).version(version);
        for (name, value) in fields {
            req = req.header(*name, *value);
        }
        admit(&mut req.body(()).unwrap())
    }

    #[test]
    fn targets_are_origin_or_absolute_form() {
        for ok in [
            "/",
            "/orders?x=1",
            "http://api.example",
            "http://api.example/o",
        ] {
            assert!(request(Version::HTTP_11, ok, &[]).is_ok(), "{ok}");
        }
        for bad in ["*", "orders", "api.example:443"] {
            assert!(
                matches!(
                    request(Version::HTTP_11, bad, &[]),
                    Err(ProxyError::InvalidRequest(RequestError::TargetForm(_)))
                ),
                "{bad}"
            );
        }
    }

    #[test]
    fn hosts_must_agree() {
        let h2 = |target: &str, host: &[(&str, &str)]| request(Version::HTTP_2, target, host);
        let h1 = |target: &str, host: &[(&str, &str)]| request(Version::HTTP_11, target, host);
        let mismatch = |r: Result<(), ProxyError>| {
            matches!(
                r,
                Err(ProxyError::InvalidRequest(RequestError::HostMismatch))
            )
        };
        assert!(h2("http://a.example/o", &[("host", "A.Example")]).is_ok());
        assert!(h2("http://a.example/o", &[]).is_ok());
        assert!(h2("/o", &[("host", "a.example")]).is_ok());
        assert!(mismatch(h2("http://a.example/o", &[("host", "b.example")])));
        assert!(mismatch(h2(
            "http://a.example/o",
            &[("host", "a.example:80")]
        )));
        // HTTP/1.1 absolute-form: the target wins (forward.rs), no refusal.
        assert!(h1("http://a.example/o", &[("host", "b.example")]).is_ok());
        let two = [("host", "a.example"), ("host", "a.example")];
        for r in [h1("/o", &two), h2("http://a.example/o", &two)] {
            assert!(matches!(
                r,
                Err(ProxyError::InvalidRequest(RequestError::RepeatedHost))
            ));
        }
    }

    /// Pins: the host a request is forwarded for is its `Host` after
    /// admission, so the scope and fingerprint see it (an h2 `:authority`
    /// without `host`, an absolute-form target beside another `Host`).
    #[test]
    fn the_forwarded_authority_becomes_the_host() {
        let h2: &[(&str, &[&str], Option<&str>)] = &[
            ("http://acme.example/o", &[], Some("acme.example")),
            (
                "http://acme.example/o",
                &["ACME.example"],
                Some("acme.example"),
            ),
            ("/o", &["acme.example"], Some("acme.example")),
        ];
        let h1: &[(&str, &[&str], Option<&str>)] = &[
            (
                "http://acme.example/o",
                &["globex.example"],
                Some("acme.example"),
            ),
            ("http://acme.example:8080/o", &[], Some("acme.example:8080")),
            ("/o", &["globex.example"], Some("globex.example")),
            ("/o", &[], None),
        ];
        let cases = (h2.iter().map(|c| (Version::HTTP_2, c)))
            .chain(h1.iter().map(|c| (Version::HTTP_11, c)));
        for (version, (target, hosts, want)) in cases {
            let mut req = Request::post(*target).version(version);
            for host in *hosts {
                req = req.header("host", *host);
            }
            let mut req = req.body(()).unwrap();
            admit(&mut req).unwrap_or_else(|e| panic!("{target} {hosts:?}: {e}"));
            let got: Vec<_> = req.headers().get_all(header::HOST).iter().collect();
            let want: Vec<_> = want.iter().map(|h| h.as_bytes()).collect();
            assert_eq!(
                got.iter().map(|v| v.as_bytes()).collect::<Vec<_>>(),
                want,
                "{version:?} {target} {hosts:?}"
            );
        }
    }

    #[test]
    fn only_chunked_once_is_understood() {
        let te = "transfer-encoding";
        for ok in [&[][..], &[(te, "chunked")], &[(te, "Chunked , ")]] {
            assert!(admitted(ok).is_ok(), "{ok:?}");
        }
        for unsupported in [
            &[(te, "gzip, chunked")][..],
            &[(te, "gzip"), (te, "chunked")],
            &[(te, "chunked;x=1")],
            &[(te, "identity")],
        ] {
            assert!(
                matches!(
                    admitted(unsupported),
                    Err(ProxyError::UnsupportedTransferCoding { .. })
                ),
                "{unsupported:?}"
            );
        }
        for twice in [
            &[(te, "chunked, chunked")][..],
            &[(te, "chunked"), (te, "chunked")],
        ] {
            assert!(
                matches!(
                    admitted(twice),
                    Err(ProxyError::InvalidRequest(RequestError::ChunkedTwice))
                ),
                "{twice:?}"
            );
        }
        let long = format!("{}, chunked", "x".repeat(100));
        match admitted(&[(te, &long)]) {
            Err(ProxyError::UnsupportedTransferCoding { coding }) => {
                assert_eq!(coding.len(), MAX_ECHOED_CODING)
            }
            other => panic!("{other:?}"),
        }
    }

    /// Regression: a route keyed by its body (`key = { json }`) with
    /// `require_key = false` let an upgrade through, which became protected
    /// once the body key resolved (a stored 101, or a tunnel refusal taken
    /// for an ambiguous outcome).
    #[test]
    fn upgrades_are_refused_where_a_key_may_protect_the_request() {
        let upgrade = Request::get("/hook")
            .header("upgrade", "websocket")
            .header("connection", "upgrade")
            .body(())
            .unwrap();
        for (extra, refused) in [
            ("require_key = true\n", true),
            ("require_key = false\n", false),
            ("require_key = false\nkey = { json = \"/id\" }\n", true),
        ] {
            let route = crate::config::test_route(extra);
            let got = refuse_protected_upgrade(&route, &upgrade).is_err();
            assert_eq!(got, refused, "{extra}");
        }
    }
}
