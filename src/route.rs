//! Route patterns and the route table: which requests are protected.
//!
//! A pattern is an exact path (`/orders`), a path with `{name}` segments that
//! match any single non-empty segment (`/payments/{id}/capture`), or a prefix
//! ending in `/*` that matches the prefix itself and everything below it
//! (`/api/*`). Routes are tried in config order; the first whose methods and
//! pattern match wins.

use crate::config::RouteConfig;
use http::Method;
use std::fmt;
use std::sync::Arc;

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

impl PathPattern {
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
        let (body, prefix) = match source.strip_suffix("/*") {
            Some(rest) => (rest, true),
            None => (source, false),
        };
        let mut segments = Vec::new();
        for seg in body.split('/').skip(1) {
            if seg.is_empty() && !(body.is_empty() || body == "/") {
                // "/orders/" keeps its trailing empty segment: it is a distinct path.
                segments.push(Segment::Literal(String::new()));
                continue;
            }
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

    /// Whether `path` (no query) matches.
    pub fn matches(&self, path: &str) -> bool {
        let rest = path.strip_prefix('/').unwrap_or(path);
        let mut parts = if rest.is_empty() {
            Vec::new()
        } else {
            rest.split('/').collect::<Vec<_>>()
        };
        if self.prefix {
            if parts.len() < self.segments.len() {
                return false;
            }
            parts.truncate(self.segments.len());
        } else if parts.len() != self.segments.len() {
            return false;
        }
        self.segments
            .iter()
            .zip(parts)
            .all(|(seg, part)| match seg {
                Segment::Literal(lit) => lit == part,
                Segment::Param => !part.is_empty(),
            })
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

/// The protected routes, in config order.
#[derive(Clone, Debug)]
pub struct RouteTable {
    routes: Vec<Arc<RouteConfig>>,
}

impl RouteTable {
    pub fn new(routes: Vec<RouteConfig>) -> Self {
        Self {
            routes: routes.into_iter().map(Arc::new).collect(),
        }
    }

    /// The first route whose method set and pattern match.
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
    fn patterns_match_as_documented() {
        let cases: &[(&str, &str, bool)] = &[
            ("/orders", "/orders", true),
            ("/orders", "/orders/", false),
            ("/orders", "/orders/1", false),
            ("/orders", "/order", false),
            ("/payments/{id}/capture", "/payments/p_1/capture", true),
            ("/payments/{id}/capture", "/payments//capture", false),
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
            assert_eq!(p.matches(path), *want, "{pattern} vs {path}");
        }
    }

    #[test]
    fn bad_patterns_are_explained() {
        for bad in ["orders", "/a/*/b", "/a*", "/x?y=1", "/a/{id", "/a/b{id}"] {
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
