//! `replay_check`: before a stored answer is replayed, the upstream is
//! asked whether the credential of the request asking for it is still
//! good, so a revoked or downgraded credential stops getting stored
//! responses (issue 21). The check carries the request's scope headers (its
//! credential, its tenant) and nothing else; its 2xx lets the replay
//! through, any other answer goes to the client as it came, and no answer
//! at all is a 503: never a replay, never an execution.
//!
//! [`Passed`] remembers a scope's successful check for the route's
//! `replay_check_cache` (bounded in entries), so a burst of retries costs
//! one check.

use crate::idempotency::Scope;
use crate::route::{ReplayCheck, RouteConfig};
use http::{HeaderMap, Method, Request};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use tokio::time::Instant;

/// The most scopes remembered at once; past it the expired are dropped,
/// then all (forgetting only costs checks).
const MAX_REMEMBERED: usize = 10_000;

/// What one replay's check needs of its request, taken before the request
/// is consumed.
pub(super) struct Pending {
    pub check: ReplayCheck,
    pub route: Arc<String>,
    /// The route's own upstream, where the check names none.
    pub route_upstream: Option<Arc<str>>,
    pub scope: Scope,
    pub headers: HeaderMap,
}

impl Pending {
    /// For `route`'s check, if it has one: the request's scope headers
    /// (every value, in order) and its request id, nothing else.
    pub fn of(route: &RouteConfig, scope: Scope, request: &HeaderMap) -> Option<Self> {
        let check = route.replay_check.clone()?;
        let mut headers = HeaderMap::new();
        let request_id = super::request_id::X_REQUEST_ID;
        let names = route.scope_headers.iter().chain([&request_id]);
        for name in names {
            for v in request.get_all(name) {
                headers.append(name.clone(), v.clone());
            }
        }
        Some(Self {
            check,
            route: route.label.clone(),
            route_upstream: route.upstream.clone(),
            scope,
            headers,
        })
    }

    /// The upstream the check goes to (`None`: the default).
    pub fn upstream(&self) -> Option<&str> {
        self.check
            .upstream
            .as_deref()
            .or(self.route_upstream.as_deref())
    }

    /// The check request's head (its body is empty).
    pub fn request(&self) -> http::request::Parts {
        let mut req = Request::builder()
            .method(self.check.method.clone())
            .uri(self.check.path.clone())
            .body(())
            .expect("a method and an origin-form path from the config");
        *req.headers_mut() = self.headers.clone();
        if self.check.method != Method::GET && self.check.method != Method::HEAD {
            req.headers_mut()
                .insert(http::header::CONTENT_LENGTH, http::HeaderValue::from(0));
        }
        req.into_parts().0
    }
}

/// A route's label and a scope digest.
type RouteScope = (Arc<String>, [u8; 32]);

/// Scopes whose check passed recently, per route, with when that lapses.
#[derive(Default)]
pub(super) struct Passed(Mutex<HashMap<RouteScope, Instant>>);

impl Passed {
    pub fn holds(&self, p: &Pending, now: Instant) -> bool {
        if p.check.cache.is_zero() {
            return false;
        }
        let map = self.0.lock().expect("replay check cache");
        map.get(&(p.route.clone(), p.scope.0))
            .is_some_and(|until| *until > now)
    }

    pub fn remember(&self, p: &Pending, now: Instant) {
        if p.check.cache.is_zero() {
            return;
        }
        let mut map = self.0.lock().expect("replay check cache");
        if map.len() >= MAX_REMEMBERED {
            map.retain(|_, until| *until > now);
            if map.len() >= MAX_REMEMBERED {
                map.clear();
            }
        }
        map.insert((p.route.clone(), p.scope.0), now + p.check.cache);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn pending(cache: Duration, scope: u8) -> Pending {
        Pending {
            check: ReplayCheck {
                method: Method::GET,
                path: "/v1/session".parse().unwrap(),
                upstream: None,
                cache,
            },
            route: Arc::new("/orders".into()),
            route_upstream: Some(Arc::from("api")),
            scope: Scope([scope; 32]),
            headers: HeaderMap::new(),
        }
    }

    #[test]
    fn a_passed_check_is_remembered_for_its_scope_until_the_cache_time() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        let passed = Passed::default();
        let (a, b, off) = (pending(s(30), 1), pending(s(30), 2), pending(s(0), 1));
        assert!(!passed.holds(&a, t0));
        passed.remember(&a, t0);
        passed.remember(&off, t0);
        // (pending, at) -> holds
        for (p, at, want) in [
            (&a, 29, true),
            (&a, 30, false),
            (&b, 1, false),
            (&off, 1, false),
        ] {
            assert_eq!(
                passed.holds(p, t0 + s(at)),
                want,
                "scope {} at {at}",
                p.scope.0[0]
            );
        }
        assert_eq!(a.upstream(), Some("api"), "the route's upstream by default");
    }

    #[test]
    fn the_cache_stays_bounded() {
        let t0 = Instant::now();
        let passed = Passed::default();
        for i in 0..(MAX_REMEMBERED + 5) {
            let mut p = pending(Duration::from_secs(30), 0);
            p.scope.0[..8].copy_from_slice(&(i as u64).to_be_bytes());
            passed.remember(&p, t0);
        }
        assert!(passed.0.lock().unwrap().len() <= MAX_REMEMBERED);
    }
}
