//! `replay_check`: before a stored answer is replayed, the upstream is
//! asked whether the credential of the request asking for it is still
//! good, so a revoked or downgraded credential stops getting stored
//! responses (issue 21). The check carries the request's scope headers (its
//! credential, its tenant), its request id, and what the upstream is told
//! of every forwarded request (its `Host`, and HTTPS when it came over
//! TLS), nothing else; its 2xx lets the replay through, any other answer
//! goes to the client as it came, and no answer at all is a 503: never a
//! replay, never an execution.
//!
//! [`Passed`] remembers a successful check for the route's
//! `replay_check_cache` (bounded in entries), so a burst of retries costs
//! one check. What it remembers is the question asked (method, path,
//! upstream, credential headers), not the route: two routes may share a
//! path and label but ask different checks.

use crate::net::tls_server::TlsSession;
use crate::route::{ReplayCheck, RouteConfig};
use http::{header, HeaderMap, HeaderValue, Method, Request};
use sha2::{Digest, Sha256};
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
    pub headers: HeaderMap,
    /// The request's `Host` and TLS session: the check is forwarded as the
    /// request would be (`X-Forwarded-Host`, `X-Forwarded-Proto: https`,
    /// `preserve_host`), or an upstream that insists on HTTPS or routes by
    /// host would answer every check with a redirect.
    pub host: Option<HeaderValue>,
    pub tls: Option<TlsSession>,
    /// The question asked: the cache's key ([`Passed`]).
    pub question: [u8; 32],
}

impl Pending {
    /// For `route`'s check, if it has one: the request's scope headers
    /// (every value, in order), its request id, `Host` and TLS session.
    pub fn of(route: &RouteConfig, request: &http::request::Parts) -> Option<Self> {
        let check = route.replay_check.clone()?;
        let mut headers = HeaderMap::new();
        let mut question = Sha256::new();
        let upstream = check.upstream.as_deref().or(route.upstream.as_deref());
        for part in [
            check.method.as_str(),
            check.path.as_str(),
            upstream.unwrap_or(""),
        ] {
            question.update((part.len() as u64).to_be_bytes());
            question.update(part);
        }
        for name in &route.scope_headers {
            for v in request.headers.get_all(name) {
                headers.append(name.clone(), v.clone());
                for part in [name.as_str().as_bytes(), v.as_bytes()] {
                    question.update((part.len() as u64).to_be_bytes());
                    question.update(part);
                }
            }
        }
        // Not part of the question: it differs on every request.
        let request_id = super::request_id::X_REQUEST_ID;
        for v in request.headers.get_all(&request_id) {
            headers.append(request_id.clone(), v.clone());
        }
        Some(Self {
            route: route.label.clone(),
            route_upstream: route.upstream.clone(),
            headers,
            host: request.headers.get(header::HOST).cloned(),
            tls: request.extensions.get::<TlsSession>().copied(),
            question: question.finalize().into(),
            check,
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
        if let Some(host) = &self.host {
            req.headers_mut().insert(header::HOST, host.clone());
        }
        if let Some(tls) = self.tls {
            req.extensions_mut().insert(tls);
        }
        if self.check.method != Method::GET && self.check.method != Method::HEAD {
            req.headers_mut()
                .insert(header::CONTENT_LENGTH, HeaderValue::from(0));
        }
        req.into_parts().0
    }
}

/// Questions whose check passed recently ([`Pending::question`]: the
/// check's method, path and upstream, and the credential headers sent),
/// with when that lapses.
#[derive(Default)]
pub(super) struct Passed(Mutex<HashMap<[u8; 32], Instant>>);

impl Passed {
    pub fn holds(&self, p: &Pending, now: Instant) -> bool {
        if p.check.cache.is_zero() {
            return false;
        }
        let map = self.0.lock().expect("replay check cache");
        map.get(&p.question).is_some_and(|until| *until > now)
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
        map.insert(p.question, now + p.check.cache);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::test_route;
    use std::time::Duration;

    const CHECK: &str = "replay_check = { method = \"GET\", path = \"/v1/session\" }\n";

    fn parts(auth: &str, extra: &[(&str, &str)]) -> http::request::Parts {
        let mut req = Request::post("/o").header("authorization", auth);
        for (name, value) in extra {
            req = req.header(*name, *value);
        }
        req.body(()).unwrap().into_parts().0
    }

    fn pending(route_extra: &str, auth: &str) -> Pending {
        Pending::of(&test_route(route_extra), &parts(auth, &[])).expect("a check")
    }

    #[test]
    fn a_passed_check_is_remembered_for_its_question_until_the_cache_time() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        let passed = Passed::default();
        let cached =
            format!("{CHECK}replay_check_cache = \"30s\"\nscope_header = \"Authorization\"\n");
        let a = pending(&cached, "Bearer a");
        let b = pending(&cached, "Bearer b");
        let off = pending(
            &format!("{CHECK}scope_header = \"Authorization\"\n"),
            "Bearer a",
        );
        assert!(!passed.holds(&a, t0));
        passed.remember(&a, t0);
        passed.remember(&off, t0);
        // (pending, at) -> holds
        for (name, p, at, want) in [
            ("a", &a, 29, true),
            ("a", &a, 30, false),
            ("another credential", &b, 1, false),
            ("no cache", &off, 1, false),
        ] {
            assert_eq!(passed.holds(p, t0 + s(at)), want, "{name} at {at}");
        }
    }

    /// Pins review finding F2 (2026-12-06): the cache was keyed by the
    /// route's label, which two routes share when they differ only in
    /// methods, so a credential that passed one route's check had its
    /// replays let through on another route with a stricter check.
    #[test]
    fn only_the_same_question_shares_a_remembered_check() {
        let route = |check: &str| {
            format!("replay_check = {check}\nreplay_check_cache = \"30s\"\nscope_header = \"Authorization\"\n")
        };
        let base = route("{ method = \"GET\", path = \"/v1/session\" }");
        let cases = [
            ("the same check and credential", base.clone(), true),
            (
                "another path",
                route("{ method = \"GET\", path = \"/v1/admin\" }"),
                false,
            ),
            (
                "another method",
                route("{ method = \"POST\", path = \"/v1/session\" }"),
                false,
            ),
            (
                "another upstream",
                route("{ method = \"GET\", path = \"/v1/session\", upstream = \"b\" }"),
                false,
            ),
        ];
        let t0 = Instant::now();
        for (name, other, shared) in cases {
            let passed = Passed::default();
            passed.remember(&pending(&base, "Bearer a"), t0);
            let other =
                Pending::of(&upstreams_route(&other), &parts("Bearer a", &[])).expect("a check");
            assert_eq!(passed.holds(&other, t0), shared, "{name}");
        }
    }

    /// A route whose config also names an upstream `b`.
    fn upstreams_route(extra: &str) -> Arc<RouteConfig> {
        let text = format!(
            "[server]\nupstream = \"http://127.0.0.1:1\"\n[upstreams.b]\nurl = \"http://127.0.0.1:2\"\n[[route]]\nmethods = [\"POST\"]\npath = \"/o\"\n{extra}"
        );
        let config = crate::config::Config::parse(&text, "t.toml").expect("a valid test config");
        let route = config.routes.iter().next().expect("one route").clone();
        route
    }

    #[test]
    fn the_check_carries_the_credential_request_id_host_and_tls_and_nothing_else() {
        let mut request = parts(
            "Bearer a",
            &[
                ("host", "api.example"),
                ("x-request-id", "r1"),
                ("cookie", "c=1"),
            ],
        );
        request.extensions.insert(TlsSession { client: None });
        let route = test_route(&format!("{CHECK}scope_header = \"Authorization\"\n"));
        let check = Pending::of(&route, &request).expect("a check").request();
        let mut names: Vec<_> = check.headers.keys().map(|n| n.as_str()).collect();
        names.sort_unstable();
        assert_eq!(names, ["authorization", "host", "x-request-id"]);
        assert_eq!(check.uri, "/v1/session");
        assert!(
            check.extensions.get::<TlsSession>().is_some(),
            "forwarded as https"
        );
        let plain = Pending::of(&route, &parts("Bearer a", &[])).expect("a check");
        assert!(plain.request().extensions.get::<TlsSession>().is_none());
        assert_eq!(plain.upstream(), None, "the route's upstream (the default)");
    }

    #[test]
    fn the_cache_stays_bounded() {
        let t0 = Instant::now();
        let passed = Passed::default();
        let mut p = pending(&format!("{CHECK}replay_check_cache = \"30s\"\n"), "a");
        for i in 0..(MAX_REMEMBERED + 5) {
            p.question[..8].copy_from_slice(&(i as u64).to_be_bytes());
            passed.remember(&p, t0);
        }
        assert!(passed.0.lock().unwrap().len() <= MAX_REMEMBERED);
    }
}
