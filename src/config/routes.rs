//! `[defaults]` and `[[route]]`: each route's settings, resolved against the
//! defaults, and the route table in file order.

use super::raw::{HeaderNameValue, RawRouteSettings};
use super::units::{format_duration, format_size};
use super::{Invalid, OnStoreError, RouteConfig};
use super::{
    DEFAULT_KEY_HEADER, DEFAULT_LEASE, DEFAULT_MAX_REQUEST_BODY, DEFAULT_MAX_RESPONSE_BODY,
    DEFAULT_SCOPE_HEADER, DEFAULT_TTL, MIN_LEASE,
};
use crate::route::RouteTable;
use http::{HeaderName, Method};
use std::fmt;
use std::sync::Arc;
use toml::Spanned;

/// `[defaults]`: what every route inherits unless it says otherwise.
pub(super) struct Defaults {
    raw: RawRouteSettings,
    /// Resolved once: `scope_header` or `scope_headers`, if either is set.
    scope_headers: Option<Vec<HeaderName>>,
}

impl TryFrom<RawRouteSettings> for Defaults {
    type Error = Invalid;

    fn try_from(d: RawRouteSettings) -> Result<Self, Invalid> {
        if d.methods.is_some() || d.path.is_some() {
            let key = if d.methods.is_some() {
                "defaults.methods"
            } else {
                "defaults.path"
            };
            return Err(Invalid::field(
                key,
                "defaults: `methods` and `path` belong in a [[route]], not in [defaults]",
            ));
        }
        let scope_headers = scope_headers(&d).map_err(|e| match &d.scope_headers {
            Some(list) => Invalid::at(list.span(), format!("defaults: {e}")),
            None => format!("defaults: {e}").into(),
        })?;
        Ok(Defaults {
            raw: d,
            scope_headers,
        })
    }
}

/// A table's scope headers: `scope_header` is the one-header form of
/// `scope_headers`; setting both is ambiguous.
fn scope_headers(r: &RawRouteSettings) -> Result<Option<Vec<HeaderName>>, String> {
    match (&r.scope_header, &r.scope_headers) {
        (Some(_), Some(_)) => Err(
            "set `scope_header` (one header) or `scope_headers` (several), not both".to_string(),
        ),
        (Some(one), None) => Ok(Some(vec![one.0.clone()])),
        (None, Some(list)) => Ok(Some(list.get_ref().0.clone())),
        (None, None) => Ok(None),
    }
}

impl Defaults {
    /// The `[[route]]`s in file order; two routes that could match the same
    /// request are an error.
    pub(super) fn routes(
        &self,
        raw: Vec<Spanned<RawRouteSettings>>,
    ) -> Result<RouteTable, Invalid> {
        let mut routes: Vec<RouteConfig> = Vec::with_capacity(raw.len());
        for (i, spanned) in raw.into_iter().enumerate() {
            let span = spanned.span();
            let index = i + 1;
            let at = |msg: String| Invalid::at(span.clone(), format!("route #{index}: {msg}"));
            let route = self.route(index, spanned.into_inner()).map_err(at)?;
            if let Some(prev) = routes.iter().find(|p| {
                p.path.same_shape(&route.path)
                    && p.methods.iter().any(|m| route.methods.contains(m))
            }) {
                return Err(at(format!(
                    "duplicate route: {} {} is already route #{}",
                    join_methods(&route.methods),
                    route.path,
                    prev.index
                )));
            }
            routes.push(route);
        }
        Ok(RouteTable::new(routes))
    }

    fn route(&self, index: usize, r: RawRouteSettings) -> Result<RouteConfig, String> {
        let defaults = &self.raw;
        let scope_headers = match scope_headers(&r)? {
            Some(own) => own,
            None => self
                .scope_headers
                .clone()
                .unwrap_or_else(|| vec![DEFAULT_SCOPE_HEADER]),
        };
        let methods: Vec<Method> = r
            .methods
            .ok_or("`methods` is required, e.g. methods = [\"POST\"]")?
            .into_iter()
            .map(|m| m.0)
            .collect();
        if methods.is_empty() {
            return Err("`methods` must list at least one method".into());
        }
        let allow_custom = r
            .allow_custom_methods
            .or(defaults.allow_custom_methods)
            .unwrap_or(false);
        check_methods(&methods, allow_custom)?;
        let path = r
            .path
            .ok_or("`path` is required, e.g. path = \"/orders\"")?
            .into_inner()
            .0;
        let headers = |v: Option<Vec<HeaderNameValue>>, d: &Option<Vec<HeaderNameValue>>| {
            v.or_else(|| d.clone())
                .unwrap_or_default()
                .into_iter()
                .map(|h| h.0)
                .collect::<Vec<_>>()
        };
        let lease = r
            .lease
            .or(defaults.lease)
            .map(|d| d.0)
            .unwrap_or(DEFAULT_LEASE);
        if lease < MIN_LEASE {
            return Err(format!(
                "lease = {:?} is too short (minimum {})",
                format_duration(lease),
                format_duration(MIN_LEASE)
            ));
        }
        let ttl = r.ttl.or(defaults.ttl).map(|d| d.0).unwrap_or(DEFAULT_TTL);
        if ttl < lease {
            return Err(format!(
                "ttl ({}) must be at least the lease ({})",
                format_duration(ttl),
                format_duration(lease)
            ));
        }
        let pick_header =
            |v: &Option<HeaderNameValue>, d: &Option<HeaderNameValue>, fallback: &str| {
                v.as_ref()
                    .or(d.as_ref())
                    .map(|h| h.0.clone())
                    .unwrap_or_else(|| {
                        HeaderName::from_bytes(fallback.as_bytes()).expect("valid default")
                    })
            };
        let max_request_body = r
            .max_request_body
            .or(defaults.max_request_body)
            .map(|s| s.0)
            .unwrap_or(DEFAULT_MAX_REQUEST_BODY);
        let max_response_body = r
            .max_response_body
            .or(defaults.max_response_body)
            .map(|s| s.0)
            .unwrap_or(DEFAULT_MAX_RESPONSE_BODY);
        Ok(RouteConfig {
            index,
            label: Arc::new(path.as_str().to_string()),
            methods,
            path,
            key_header: pick_header(&r.key_header, &defaults.key_header, DEFAULT_KEY_HEADER),
            require_key: r.require_key.or(defaults.require_key).unwrap_or(true),
            ttl,
            lease,
            scope_headers,
            fingerprint_headers: headers(r.fingerprint_headers, &defaults.fingerprint_headers),
            max_request_body,
            max_response_body,
            include_response_headers: headers(
                r.include_response_headers,
                &defaults.include_response_headers,
            ),
            exclude_response_headers: headers(
                r.exclude_response_headers,
                &defaults.exclude_response_headers,
            ),
            on_store_error: r
                .on_store_error
                .or(defaults.on_store_error)
                .unwrap_or(OnStoreError::Reject),
            release_statuses: r
                .release_statuses
                .or_else(|| defaults.release_statuses.clone())
                .map(|v| v.0)
                .unwrap_or_default(),
            on_ambiguous: r.on_ambiguous.or(defaults.on_ambiguous).unwrap_or_default(),
        })
    }
}

/// The methods of RFC 9110 §9 and PATCH (RFC 5789). Another name is much
/// more likely a typo (`"PSOT"`) than a method clients send, and a route
/// that never matches lets its traffic through unprotected: refused unless
/// the route sets `allow_custom_methods = true`.
fn check_methods(methods: &[Method], allow_custom: bool) -> Result<(), String> {
    const REGISTERED: [Method; 9] = [
        Method::GET,
        Method::HEAD,
        Method::POST,
        Method::PUT,
        Method::DELETE,
        Method::CONNECT,
        Method::OPTIONS,
        Method::TRACE,
        Method::PATCH,
    ];
    match methods.iter().find(|m| !REGISTERED.contains(m)) {
        Some(m) if !allow_custom => Err(format!(
            "method {:?} is not a standard HTTP method (GET, HEAD, POST, PUT, DELETE, CONNECT, OPTIONS, TRACE, PATCH): a typo would leave the route unprotected; set allow_custom_methods = true if clients really send it",
            m.as_str()
        )),
        _ => Ok(()),
    }
}

/// The `routes:` block of `check-config`: one line per route.
pub(super) struct RoutesDisplay<'a>(pub(super) &'a RouteTable);

impl fmt::Display for RoutesDisplay<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "routes:")?;
        if self.0.iter().next().is_none() {
            writeln!(f, "  (none: every request passes through unprotected)")?;
        }
        for r in self.0.iter() {
            writeln!(
                f,
                "  #{} {} {}  key={} required={} scope={} ttl={} lease={} max_request_body={} max_response_body={} on_store_error={} release={} on_ambiguous={}",
                r.index,
                join_methods(&r.methods),
                r.path,
                r.key_header,
                r.require_key,
                r.scope_label(),
                format_duration(r.ttl),
                format_duration(r.lease),
                format_size(r.max_request_body),
                format_size(r.max_response_body),
                match r.on_store_error {
                    OnStoreError::Reject => "reject",
                    OnStoreError::Forward => "forward",
                },
                r.release_statuses,
                r.on_ambiguous.as_str(),
            )?;
        }
        Ok(())
    }
}

fn join_methods(methods: &[Method]) -> String {
    methods
        .iter()
        .map(Method::as_str)
        .collect::<Vec<_>>()
        .join(",")
}
