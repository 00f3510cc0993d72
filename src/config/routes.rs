//! `[defaults]` and `[[route]]`: each route's settings, resolved against the
//! defaults, and the route table in file order.

use super::raw::{
    HeaderNameValue, KeySpec, PointerValue, RawRouteSettings, ReplayCheckValue, ScopeSpec,
};
use super::units::{format_duration, format_size};
use super::{Invalid, OnStoreError, RouteConfig, DEFAULT_UPSTREAM_NAME};
use super::{
    DEFAULT_KEY_HEADER, DEFAULT_LEASE, DEFAULT_MAX_REQUEST_BODY, DEFAULT_MAX_RESPONSE_BODY,
    DEFAULT_SCOPE_HEADER, DEFAULT_TTL, MIN_LEASE,
};
use crate::idempotency::canonical_json::Pointer;
use crate::route::errors::ErrorShape;
use crate::route::overlap::{self, Shadowing, Shape};
use crate::route::{
    FingerprintMode, InFlight, PathPattern, Preset, PresetKey, PresetSettings, ReplayCheck,
    RouteTable, DELIVERY_REFUSALS,
};
use http::{HeaderName, Method};
use std::borrow::Borrow;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;
use toml::Spanned;

/// The longest a successful `replay_check` may be remembered.
const MAX_REPLAY_CHECK_CACHE: Duration = Duration::from_secs(3600);

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
        if d.preset.is_some() {
            return Err("defaults: `preset` belongs in a [[route]], not in [defaults]".into());
        }
        if d.strip_prefix.is_some() {
            return Err(Invalid::field(
                "defaults.strip_prefix",
                "defaults: `strip_prefix` belongs in a [[route]] (it must fit the route's path), not in [defaults]",
            ));
        }
        one_key_form(&d).map_err(|e| Invalid::from(format!("defaults: {e}")))?;
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

/// `key` and `key_header` say the same thing; `scope` and
/// `scope_header(s)` too: setting both is ambiguous.
fn one_key_form(r: &RawRouteSettings) -> Result<(), String> {
    if r.key.is_some() && r.key_header.is_some() {
        return Err("set `key` or `key_header`, not both".into());
    }
    if r.scope.is_some() && (r.scope_header.is_some() || r.scope_headers.is_some()) {
        return Err("set `scope` or `scope_header`/`scope_headers`, not both".into());
    }
    Ok(())
}

/// The longest `in_flight = { wait }`: a waiting duplicate holds a
/// connection and a task, and a sender gives up long before this.
const MAX_IN_FLIGHT_WAIT: std::time::Duration = std::time::Duration::from_secs(300);

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
        let found = shadowing(&routes);
        if let Some((later, by)) = routes
            .iter()
            .zip(&found)
            .find_map(|(r, s)| Some((r, s.never.as_ref()?)))
        {
            let takers: Vec<String> = by.iter().map(|&j| describe(&routes[j])).collect();
            return Err(Invalid::field(
                format!("route.{}.path", later.index - 1),
                format!(
                    "route #{later_index} {later_shape}: never matches: {takers} {verb} every request it would (routes are tried in file order), so its settings never apply; put the more specific route first, or remove it",
                    later_index = later.index,
                    later_shape = shape(later),
                    takers = takers.join(" and "),
                    verb = if by.len() == 1 { "takes" } else { "take" },
                ),
            ));
        }
        let errors = self.raw.errors.clone().map(|e| e.0).unwrap_or_default();
        Ok(RouteTable::new(routes, errors))
    }

    fn route(&self, index: usize, mut r: RawRouteSettings) -> Result<RouteConfig, String> {
        let defaults = &self.raw;
        one_key_form(&r)?;
        let own_scope_headers = scope_headers(&r)?;
        let preset = r.preset;
        let settings = preset.map(Preset::settings);
        let methods: Vec<Method> = match (r.methods.take(), preset) {
            (Some(m), _) => m.into_iter().map(|m| m.0).collect(),
            // Every preset's sender POSTs.
            (None, Some(_)) => vec![Method::POST],
            (None, None) => return Err("`methods` is required, e.g. methods = [\"POST\"]".into()),
        };
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
            .take()
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
        let ttl = r
            .ttl
            .map(|d| d.0)
            .or(settings.map(|p| p.ttl))
            .or(defaults.ttl.map(|d| d.0))
            .unwrap_or(DEFAULT_TTL);
        if ttl < lease {
            return Err(format!(
                "ttl ({}) must be at least the lease ({})",
                format_duration(ttl),
                format_duration(lease)
            ));
        }
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
        let d = self.deliveries(&r, own_scope_headers, &path, settings)?;
        let strip_prefix = r
            .strip_prefix
            .take()
            .map(|p| path.strip_prefix_of(&p).map(|()| Arc::from(p)))
            .transpose()?;
        let replay_check = self.replay_check(&r, &d)?;
        Ok(RouteConfig {
            replay_check,
            strip_prefix,
            index,
            label: Arc::new(path.as_str().to_string()),
            methods,
            path,
            key_header: d.key_header,
            key_json: d.key_json,
            scope_value: d.scope_value,
            scope_client_cert: d.scope_client_cert,
            fingerprint: d.fingerprint,
            fingerprint_ignore: d.fingerprint_ignore,
            in_flight: d.in_flight,
            preset,
            // A preset's sender always names its delivery: `[defaults]`
            // (written for the Idempotency-Key routes) never turns it off,
            // as it never changes a preset's ttl or scope.
            require_key: r
                .require_key
                .or(settings.map(|_| true))
                .or(defaults.require_key)
                .unwrap_or(true),
            ttl,
            lease,
            scope_headers: d.scope_headers,
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
            release_statuses: match r.release_statuses {
                Some(own) => own.0,
                None => {
                    let inherited = defaults
                        .release_statuses
                        .clone()
                        .map(|v| v.0)
                        .unwrap_or_default();
                    if d.delivery {
                        inherited.adding(&DELIVERY_REFUSALS)
                    } else {
                        inherited
                    }
                }
            },
            on_ambiguous: r.on_ambiguous.or(defaults.on_ambiguous).unwrap_or_default(),
            // Checked against [upstreams.NAME] by `Config::from_raw`.
            upstream: r
                .upstream
                .or_else(|| defaults.upstream.clone())
                .map(|u| Arc::from(u.into_inner())),
            errors: r
                .errors
                .or_else(|| defaults.errors.clone())
                .map(|e| e.0)
                .unwrap_or_default(),
        })
    }

    /// The route's `replay_check`, else `[defaults]`' (`"off"` turns that
    /// off), with its cache time.
    fn replay_check(
        &self,
        r: &RawRouteSettings,
        d: &Deliveries,
    ) -> Result<Option<ReplayCheck>, String> {
        let defaults = &self.raw;
        let cache = r
            .replay_check_cache
            .or(defaults.replay_check_cache)
            .map_or(Duration::ZERO, |c| c.0);
        let check = match r.replay_check.as_ref().or(defaults.replay_check.as_ref()) {
            None | Some(ReplayCheckValue::Off) => {
                if r.replay_check_cache.is_some() {
                    return Err("`replay_check_cache` needs a `replay_check`".into());
                }
                return Ok(None);
            }
            Some(ReplayCheckValue::Check {
                method,
                path,
                upstream,
            }) => ReplayCheck {
                method: method.clone(),
                path: path.clone(),
                upstream: upstream.as_ref().map(|u| Arc::from(u.get_ref().as_str())),
                cache,
            },
        };
        if d.scope_headers.is_empty() {
            return Err("`replay_check` sends the request's scope headers (its credential) to the upstream; this route is scoped by a fixed value or a client certificate, which a check request cannot carry".into());
        }
        if cache > MAX_REPLAY_CHECK_CACHE {
            return Err(format!(
                "replay_check_cache = {:?} is longer than {}: a revoked credential would keep its replays that long",
                format_duration(cache),
                format_duration(MAX_REPLAY_CHECK_CACHE)
            ));
        }
        Ok(Some(check))
    }

    /// Where the key comes from, whose it is, what the fingerprint covers
    /// and what a duplicate in flight gets (docs/book/src/webhooks.md, "Webhooks and message
    /// deliveries"): the route's own keys, then its preset's, then
    /// `[defaults]`.
    fn deliveries(
        &self,
        r: &RawRouteSettings,
        own_scope_headers: Option<Vec<HeaderName>>,
        path: &PathPattern,
        settings: Option<PresetSettings>,
    ) -> Result<Deliveries, String> {
        let defaults = &self.raw;
        let key = r
            .key
            .clone()
            .or_else(|| r.key_header.as_ref().map(|h| KeySpec::Header(h.0.clone())))
            .or_else(|| settings.map(|p| preset_key(p.key)))
            .or_else(|| defaults.key.clone());
        let (key_header, key_json) = match key {
            Some(KeySpec::Header(h)) => (h, None),
            Some(KeySpec::Json(p)) => (default_key_header(), Some(p)),
            None => (
                defaults
                    .key_header
                    .as_ref()
                    .map_or_else(default_key_header, |h| h.0.clone()),
                None,
            ),
        };
        let spec = |spec: &ScopeSpec| match spec {
            ScopeSpec::Header(h) => (vec![h.clone()], None, false),
            ScopeSpec::Value(v) => (Vec::new(), Some(v.clone()), false),
            ScopeSpec::ClientCert => (Vec::new(), None, true),
        };
        let (scope_headers, scope_value, scope_client_cert) = match (&r.scope, own_scope_headers) {
            (Some(s), _) => spec(s),
            (None, Some(own)) => (own, None, false),
            // A preset's consumer is the route: two routes for one sender
            // (two GitHub Apps get the same X-GitHub-Delivery) never share keys.
            (None, None) if r.preset.is_some() => (
                Vec::new(),
                r.preset
                    .map(|p| format!("{}:{}", p.as_str(), path.as_str())),
                false,
            ),
            (None, None) => match &defaults.scope {
                Some(s) => spec(s),
                None => (
                    self.scope_headers
                        .clone()
                        .unwrap_or_else(|| vec![DEFAULT_SCOPE_HEADER]),
                    None,
                    false,
                ),
            },
        };
        let fingerprint = r
            .fingerprint
            .or(settings.map(|p| p.fingerprint))
            .or(defaults.fingerprint)
            .unwrap_or_default();
        let preset_ignore = settings
            .filter(|_| fingerprint == FingerprintMode::Json)
            .map(|p| {
                p.fingerprint_ignore
                    .iter()
                    .map(|s| PointerValue(Pointer::parse(s).expect("a valid preset pointer")))
                    .collect()
            });
        let fingerprint_ignore: Vec<Pointer> = r
            .fingerprint_ignore
            .clone()
            .or(preset_ignore)
            .or_else(|| defaults.fingerprint_ignore.clone())
            .unwrap_or_default()
            .into_iter()
            .map(|p| p.0)
            .collect();
        if !fingerprint_ignore.is_empty() && fingerprint != FingerprintMode::Json {
            return Err("`fingerprint_ignore` needs fingerprint = \"json\"".into());
        }
        let in_flight = r
            .in_flight
            .map(|v| v.0)
            .or(settings.map(|p| InFlight::Wait(p.in_flight_wait)))
            .or(defaults.in_flight.map(|v| v.0))
            .unwrap_or_default();
        if let InFlight::Wait(wait) = in_flight {
            if wait.is_zero() || wait > MAX_IN_FLIGHT_WAIT {
                return Err(format!(
                    "in_flight = {{ wait = {:?} }} must be more than 0 and at most {}",
                    format_duration(wait),
                    format_duration(MAX_IN_FLIGHT_WAIT)
                ));
            }
        }
        // A sender's own id is a key anyone may name: the route's key is a
        // `key = { .. }` (its own, or `[defaults]`' where it sets none) or
        // its preset's.
        let delivery = settings.is_some()
            || r.key.is_some()
            || (r.key_header.is_none() && defaults.key.is_some());
        Ok(Deliveries {
            delivery,
            key_header,
            key_json,
            scope_headers,
            scope_value,
            scope_client_cert,
            fingerprint,
            fingerprint_ignore,
            in_flight,
        })
    }
}

/// What [`Defaults::deliveries`] resolves.
struct Deliveries {
    /// A delivery route (a preset, or a natural key): it releases
    /// [`DELIVERY_REFUSALS`] too.
    delivery: bool,
    key_header: HeaderName,
    key_json: Option<Pointer>,
    scope_headers: Vec<HeaderName>,
    scope_value: Option<String>,
    scope_client_cert: bool,
    fingerprint: FingerprintMode,
    fingerprint_ignore: Vec<Pointer>,
    in_flight: InFlight,
}

fn default_key_header() -> HeaderName {
    HeaderName::from_bytes(DEFAULT_KEY_HEADER.as_bytes()).expect("valid default")
}

fn preset_key(key: PresetKey) -> KeySpec {
    match key {
        PresetKey::Header(h) => KeySpec::Header(HeaderName::from_static(h)),
        PresetKey::Json(p) => KeySpec::Json(Pointer::parse(p).expect("a valid preset pointer")),
    }
}

/// The methods of RFC 9110 §9, PATCH (RFC 5789) and QUERY (RFC 10008). Another name is much
/// more likely a typo (`"PSOT"`) than a method clients send, and a route
/// that never matches lets its traffic through unprotected: refused unless
/// the route sets `allow_custom_methods = true`.
fn check_methods(methods: &[Method], allow_custom: bool) -> Result<(), String> {
    let query = Method::from_bytes(b"QUERY").expect("a valid method name");
    let registered: [Method; 10] = [
        Method::GET,
        Method::HEAD,
        Method::POST,
        Method::PUT,
        Method::DELETE,
        Method::CONNECT,
        Method::OPTIONS,
        Method::TRACE,
        Method::PATCH,
        query,
    ];
    match methods.iter().find(|m| !registered.contains(m)) {
        Some(m) if !allow_custom => Err(format!(
            "method {:?} is not a standard HTTP method (GET, HEAD, POST, PUT, DELETE, CONNECT, OPTIONS, TRACE, PATCH, QUERY): a typo would leave the route unprotected; set allow_custom_methods = true if clients really send it",
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
        let table: Vec<&RouteConfig> = self.0.iter().map(|r| r.as_ref()).collect();
        let found = shadowing(&table);
        for (r, s) in table.iter().zip(&found) {
            write!(
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
            // Only what differs from the defaults, so existing lines stay as they were.
            if let Some(p) = &r.key_json {
                write!(f, " key_json={p}")?;
            }
            if r.fingerprint != FingerprintMode::Raw {
                write!(f, " fingerprint={}", r.fingerprint.as_str())?;
            }
            if r.errors != ErrorShape::Problem {
                write!(f, " errors={}", r.errors)?;
            }
            for p in &r.fingerprint_ignore {
                write!(f, " fingerprint_ignore={p}")?;
            }
            if let InFlight::Wait(d) = r.in_flight {
                write!(f, " in_flight=wait:{}", format_duration(d))?;
            }
            if let Some(p) = r.preset {
                write!(f, " preset={}", p.as_str())?;
            }
            if let Some(c) = &r.replay_check {
                write!(f, " replay_check={} {}", c.method, c.path)?;
                if let Some(u) = &c.upstream {
                    write!(f, "@{u}")?;
                }
                if !c.cache.is_zero() {
                    write!(f, " replay_check_cache={}", format_duration(c.cache))?;
                }
            }
            write!(f, " upstream={}", upstream_name(r))?;
            if !s.taken.is_empty() {
                let by: Vec<String> = s
                    .taken
                    .iter()
                    .map(|t| format!("#{}", table[t.by].index))
                    .collect();
                write!(f, " shadowed_by={}", by.join(","))?;
            }
            writeln!(f)?;
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

/// What the routes before each route take from it ([`overlap::shadowing`]).
pub(super) fn shadowing<R: Borrow<RouteConfig>>(routes: &[R]) -> Vec<Shadowing> {
    let shapes: Vec<Shape<'_>> = routes
        .iter()
        .map(|r| Shape {
            methods: &r.borrow().methods,
            path: &r.borrow().path,
        })
        .collect();
    overlap::shadowing(&shapes)
}

/// The `check-config` warnings about routes that take some of a later
/// route's requests: which requests go where.
pub(super) fn shadowing_warnings(table: &RouteTable) -> Vec<String> {
    let routes: Vec<&RouteConfig> = table.iter().map(|r| r.as_ref()).collect();
    let mut out = Vec::new();
    for (later, s) in routes.iter().zip(shadowing(&routes)) {
        for t in &s.taken {
            let by = routes[t.by];
            let methods = join_methods(&t.methods);
            let rest: Vec<Method> = later
                .methods
                .iter()
                .filter(|m| !t.methods.contains(m))
                .cloned()
                .collect();
            out.push(match &t.paths {
                None => format!(
                    "route #{} {} (upstream {}): its {methods} requests go to route #{} {}, listed before it; {}: put the more specific route first if that is not what you want",
                    later.index,
                    shape(later),
                    upstream_name(later),
                    by.index,
                    describe_one(by),
                    if rest.is_empty() {
                        "only others reach it".to_string()
                    } else {
                        format!("only {} reach it", join_methods(&rest))
                    },
                ),
                Some(paths) => format!(
                    "route #{} {} (upstream {}): its {methods} requests to {paths} go to route #{} {}, listed before it; its other requests reach it: put the more specific route first if that is not what you want",
                    later.index,
                    shape(later),
                    upstream_name(later),
                    by.index,
                    describe_one(by),
                ),
            });
        }
    }
    out
}

/// `POST,PUT /payments`
fn shape(r: &RouteConfig) -> String {
    format!("{} {}", join_methods(&r.methods), r.path)
}

/// `route #1 (POST /payments/*, upstream default)`
fn describe(r: &RouteConfig) -> String {
    format!("route #{} {}", r.index, describe_one(r))
}

/// `(POST /payments/*, upstream default)`
fn describe_one(r: &RouteConfig) -> String {
    format!("({}, upstream {})", shape(r), upstream_name(r))
}

/// The route's upstream as logs and metrics name it.
fn upstream_name(r: &RouteConfig) -> &str {
    r.upstream.as_deref().unwrap_or(DEFAULT_UPSTREAM_NAME)
}
