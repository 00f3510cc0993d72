//! Which routes take requests from which. The table is tried in file
//! order ([`RouteTable::find`](super::RouteTable::find)), so an earlier
//! route takes every request it matches from the routes after it:
//!
//! - a route whose requests earlier routes all take **never matches**:
//!   its settings (scope, `on_ambiguous`, upstream) never apply; `config`
//!   refuses it, naming the routes that take them;
//! - an earlier route that takes **some** of them (fewer methods, or paths
//!   that only partly overlap) is a warning saying which go where;
//! - an earlier route that is **more specific** (every path it matches the
//!   later one matches too: `/payments/{id}/capture` before `/payments/*`)
//!   is the intended order and says nothing.
//!
//! Pure: patterns and methods in, findings out. Routes have no host: a
//! route matches by method and path only, on every upstream and Host.

use super::{PathPattern, Segment};
use http::Method;

/// What of a route the overlap checks look at.
#[derive(Clone, Copy, Debug)]
pub struct Shape<'a> {
    pub methods: &'a [Method],
    pub path: &'a PathPattern,
}

/// An earlier route that takes some of a later one's requests.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Taken {
    /// The earlier route's position in the table (0-based).
    pub by: usize,
    /// The methods both list: the requests it takes have one of them.
    pub methods: Vec<Method>,
    /// `None`: it takes them on every path the later route matches;
    /// `Some(pattern)`: on the paths both match, written as a pattern
    /// (e.g. `/admin/orders`).
    pub paths: Option<String>,
}

/// What the earlier routes do to one route.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Shadowing {
    /// The earlier routes that take some of its requests, in table order,
    /// except the more specific ones (the intended order).
    pub taken: Vec<Taken>,
    /// `Some(routes)`: it never matches; these earlier routes (0-based,
    /// in table order) take all of its requests between them.
    pub never: Option<Vec<usize>>,
}

/// For each route of the table (in order), what the routes before it take
/// from it.
pub fn shadowing(routes: &[Shape<'_>]) -> Vec<Shadowing> {
    routes
        .iter()
        .enumerate()
        .map(|(i, later)| shadowing_of(&routes[..i], later))
        .collect()
}

fn shadowing_of(earlier: &[Shape<'_>], later: &Shape<'_>) -> Shadowing {
    let mut taken = Vec::new();
    let mut involved: Vec<usize> = Vec::new();
    for (j, e) in earlier.iter().enumerate() {
        let methods: Vec<Method> = later
            .methods
            .iter()
            .filter(|m| e.methods.contains(m))
            .cloned()
            .collect();
        let Some(both) = intersection(e.path, later.path) else {
            continue;
        };
        if methods.is_empty() {
            continue;
        }
        involved.push(j);
        let all = covers(e.path, later.path);
        // More specific, first: the intended order.
        if !all && covers(later.path, e.path) {
            continue;
        }
        taken.push(Taken {
            by: j,
            methods,
            paths: (!all).then_some(both),
        });
    }
    // Dead when, for each of its methods, the earlier routes listing that
    // method match every path it does between them.
    let dead = later.methods.iter().all(|m| {
        let by: Vec<&PathPattern> = earlier
            .iter()
            .filter(|e| e.methods.contains(m))
            .map(|e| e.path)
            .collect();
        covered(later.path, &by)
    });
    Shadowing {
        taken,
        never: dead.then_some(involved),
    }
}

/// Whether `a` matches every path `b` does.
pub fn covers(a: &PathPattern, b: &PathPattern) -> bool {
    covered(b, &[a])
}

/// Whether the patterns `by` between them match every path `b` does.
pub fn covered(b: &PathPattern, by: &[&PathPattern]) -> bool {
    let candidates: Vec<(&[Segment], bool)> = by
        .iter()
        .map(|p| (p.segments.as_slice(), p.prefix))
        .collect();
    covered_rest(&b.segments, b.prefix, candidates)
}

/// One segment that can be any name: what a prefix's `/*` goes on with.
const ANY: &[Segment] = &[Segment::Param];

/// Whether every path matching `b` (its remaining segments, and whether it
/// is a prefix) matches one of `candidates` (theirs, after the segments
/// already compared). A `{param}` of `b` is every name: each literal a
/// candidate names there, and any other name.
fn covered_rest(b: &[Segment], b_prefix: bool, candidates: Vec<(&[Segment], bool)>) -> bool {
    if candidates.iter().any(|(s, prefix)| s.is_empty() && *prefix) {
        return true;
    }
    let Some((segment, rest)) = b.split_first() else {
        // The path may end here: a candidate must end here too.
        if !candidates.iter().any(|(s, _)| s.is_empty()) {
            return false;
        }
        // A prefix goes on with any segment, and may again end there.
        let longer: Vec<_> = candidates
            .into_iter()
            .filter(|(s, _)| !s.is_empty())
            .collect();
        return !b_prefix || covered_rest(ANY, true, longer);
    };
    let names: Vec<Option<&str>> = match segment {
        Segment::Literal(l) => vec![Some(l.as_str())],
        // Each literal named here, and any other name (`None`).
        Segment::Param => {
            let mut names: Vec<Option<&str>> = vec![None];
            for (s, _) in &candidates {
                if let Some(Segment::Literal(l)) = s.first() {
                    if !names.contains(&Some(l.as_str())) {
                        names.push(Some(l.as_str()));
                    }
                }
            }
            names
        }
    };
    names.into_iter().all(|name| {
        let next: Vec<(&[Segment], bool)> = candidates
            .iter()
            .filter_map(|&(s, prefix)| {
                let (first, rest) = s.split_first()?;
                let fits = match (first, name) {
                    (Segment::Param, _) => true,
                    (Segment::Literal(l), Some(name)) => l == name,
                    (Segment::Literal(_), None) => false,
                };
                fits.then_some((rest, prefix))
            })
            .collect();
        covered_rest(rest, b_prefix, next)
    })
}

/// The paths both patterns match, as a pattern (literals where either has
/// one, `b`'s parameter names elsewhere); `None` if they share none.
pub fn intersection(a: &PathPattern, b: &PathPattern) -> Option<String> {
    let (sa, sb) = (&a.segments, &b.segments);
    // A longer pattern than a non-prefix one can never match it.
    if (!a.prefix && sb.len() > sa.len()) || (!b.prefix && sa.len() > sb.len()) {
        return None;
    }
    if !a.prefix && !b.prefix && sa.len() != sb.len() {
        return None;
    }
    let names = b.param_names();
    let mut out = String::new();
    for i in 0..sa.len().max(sb.len()) {
        let part = match (sa.get(i), sb.get(i)) {
            (Some(Segment::Literal(x)), Some(Segment::Literal(y))) if x != y => return None,
            (Some(Segment::Literal(x)), _) | (_, Some(Segment::Literal(x))) => x.clone(),
            (_, Some(Segment::Param)) => names.get(i).cloned().unwrap_or_else(|| "{}".into()),
            (Some(Segment::Param), None) => a
                .param_names()
                .get(i)
                .cloned()
                .unwrap_or_else(|| "{}".into()),
            (None, None) => unreachable!("i is below the longer length"),
        };
        out.push('/');
        out.push_str(&part);
    }
    if a.prefix && b.prefix {
        out.push_str("/*");
    }
    if out.is_empty() {
        out.push('/');
    }
    Some(out)
}

// === impl PathPattern ===

impl PathPattern {
    /// Each segment as written (`{id}` for a parameter), by position.
    fn param_names(&self) -> Vec<String> {
        let body = self.source.strip_suffix("/*").unwrap_or(&self.source);
        super::normalize_path(body)
            .split('/')
            .filter(|s| !s.is_empty())
            .map(str::to_string)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(s: &str) -> PathPattern {
        PathPattern::parse(s).unwrap()
    }

    #[test]
    fn coverage_follows_what_the_patterns_match() {
        // (a, b, a matches every path b does)
        let cases: &[(&str, &str, bool)] = &[
            ("/p/*", "/p", true),
            ("/p/*", "/p/x", true),
            ("/p/*", "/p/{id}/capture", true),
            ("/p/*", "/p/*", true),
            ("/p/*", "/px", false),
            ("/p", "/p/*", false),
            ("/p", "/p", true),
            ("/p/{id}", "/p/x", true),
            ("/p/x", "/p/{id}", false),
            ("/p/{id}", "/p/{other}", true),
            ("/p/{id}", "/p/*", false),
            ("/p/{id}/*", "/p", false),
            ("/p/{id}/*", "/p/x/y", true),
            ("/*", "/anything/{id}", true),
            ("/*", "/", true),
            ("/", "/*", false),
            ("/", "/", true),
            ("/{a}/orders", "/admin/*", false),
        ];
        for (a, b, want) in cases {
            assert_eq!(covers(&p(a), &p(b)), *want, "{a} covers {b}");
        }
    }

    #[test]
    fn several_patterns_can_cover_one_between_them() {
        // (b, by, covered)
        let cases: &[(&str, &[&str], bool)] = &[
            ("/a/*", &["/a", "/a/{id}/*"], true),
            ("/a/*", &["/a"], false),
            ("/a/*", &["/a/{id}/*"], false),
            ("/a/{id}", &["/a/x", "/a/{other}"], true),
            ("/a/{id}", &["/a/x", "/a/y"], false),
            ("/a/{id}/b", &["/a/x/b", "/{t}/{u}/b"], true),
            ("/a/*", &["/a", "/a/{x}", "/a/{x}/{y}"], false),
            ("/a/*", &[], false),
        ];
        for (b, by, want) in cases {
            let by: Vec<PathPattern> = by.iter().map(|s| p(s)).collect();
            let by: Vec<&PathPattern> = by.iter().collect();
            assert_eq!(covered(&p(b), &by), *want, "{b} by {by:?}");
        }
    }

    #[test]
    fn an_intersection_is_written_as_a_pattern() {
        let cases: &[(&str, &str, Option<&str>)] = &[
            ("/{t}/orders", "/admin/*", Some("/admin/orders")),
            ("/admin/*", "/{t}/orders", Some("/admin/orders")),
            ("/p/*", "/p", Some("/p")),
            ("/p/*", "/p/{id}/*", Some("/p/{id}/*")),
            ("/a/{x}", "/a/{id}", Some("/a/{id}")),
            ("/a", "/b", None),
            ("/a", "/a/b", None),
            ("/a/*", "/b/*", None),
            ("/*", "/", Some("/")),
        ];
        for (a, b, want) in cases {
            assert_eq!(intersection(&p(a), &p(b)).as_deref(), *want, "{a} & {b}");
        }
    }

    /// (methods, path) per route → what each route is told.
    fn table(routes: &[(&[&str], &str)]) -> Vec<Shadowing> {
        let parsed: Vec<(Vec<Method>, PathPattern)> = routes
            .iter()
            .map(|(m, path)| {
                let methods = m.iter().map(|m| m.parse().unwrap()).collect();
                (methods, p(path))
            })
            .collect();
        let shapes: Vec<Shape<'_>> = parsed
            .iter()
            .map(|(methods, path)| Shape { methods, path })
            .collect();
        shadowing(&shapes)
    }

    fn taken(by: usize, methods: &[&str], paths: Option<&str>) -> Taken {
        Taken {
            by,
            methods: methods.iter().map(|m| m.parse().unwrap()).collect(),
            paths: paths.map(str::to_string),
        }
    }

    #[test]
    fn earlier_routes_shadow_later_ones_as_the_table_is_tried() {
        let quiet = Shadowing::default();
        let never = |by: Vec<usize>, taken: Vec<Taken>| Shadowing {
            taken,
            never: Some(by),
        };
        let warned = |taken: Vec<Taken>| Shadowing { taken, never: None };
        #[allow(clippy::type_complexity)]
        let cases: Vec<(&[(&[&str], &str)], Vec<Shadowing>)> = vec![
            // The trap: a prefix route before its own exact path.
            (
                &[(&["POST"], "/payments/*"), (&["POST"], "/payments")],
                vec![
                    quiet.clone(),
                    never(vec![0], vec![taken(0, &["POST"], None)]),
                ],
            ),
            // Wider methods take all of it too.
            (
                &[(&["POST", "PUT"], "/p/{id}"), (&["PUT"], "/p/x")],
                vec![
                    quiet.clone(),
                    never(vec![0], vec![taken(0, &["PUT"], None)]),
                ],
            ),
            // Fewer methods: only some of its requests go elsewhere.
            (
                &[(&["POST"], "/payments/*"), (&["POST", "PUT"], "/payments")],
                vec![quiet.clone(), warned(vec![taken(0, &["POST"], None)])],
            ),
            // Paths that only partly overlap.
            (
                &[(&["POST"], "/{tenant}/orders"), (&["POST"], "/admin/*")],
                vec![
                    quiet.clone(),
                    warned(vec![taken(0, &["POST"], Some("/admin/orders"))]),
                ],
            ),
            // Specific before general: the intended order, silent.
            (
                &[
                    (&["POST"], "/payments/{id}/capture"),
                    (&["POST"], "/payments/*"),
                ],
                vec![quiet.clone(), quiet.clone()],
            ),
            (
                &[(&["POST", "PUT"], "/p/x"), (&["POST"], "/p/{id}")],
                vec![quiet.clone(), quiet.clone()],
            ),
            // No method in common, or no path: nothing to say.
            (
                &[(&["POST"], "/p/*"), (&["PUT"], "/p")],
                vec![quiet.clone(), quiet.clone()],
            ),
            (
                &[(&["POST"], "/a/*"), (&["POST"], "/b")],
                vec![quiet.clone(), quiet.clone()],
            ),
            // Two specific routes that cover a general one between them.
            (
                &[
                    (&["POST"], "/a"),
                    (&["POST"], "/a/{id}/*"),
                    (&["POST"], "/a/*"),
                ],
                vec![quiet.clone(), quiet.clone(), never(vec![0, 1], vec![])],
            ),
            // Two routes that take a method each.
            (
                &[
                    (&["POST"], "/*"),
                    (&["PUT"], "/o/*"),
                    (&["POST", "PUT"], "/o/{id}"),
                ],
                vec![
                    quiet.clone(),
                    quiet.clone(),
                    never(
                        vec![0, 1],
                        vec![taken(0, &["POST"], None), taken(1, &["PUT"], None)],
                    ),
                ],
            ),
        ];
        for (routes, want) in cases {
            assert_eq!(table(routes), want, "{routes:?}");
        }
    }
}
