//! The path normalizer, the route matcher and the forwarder's URI join on
//! any path: none panics; normalizing and resolving dot-segments are
//! idempotent; matching sees the path the upstream gets; a `;` parameter
//! never hides a route; a pattern matches its own instances; and no path
//! joined to the upstream's base path leaves it.
#![no_main]

use http::{Method, Uri};
use idemgate::config::Config;
use idemgate::fuzzing::{normalize_path, resolve_dot_segments, upstream_uri, PathPattern};
use libfuzzer_sys::fuzz_target;
use std::sync::OnceLock;

const CONFIG: &str = r#"
[server]
upstream = "http://127.0.0.1:9/base"
[[route]]
methods = ["POST"]
path = "/orders"
[[route]]
methods = ["POST"]
path = "/payments/{id}/capture"
[[route]]
methods = ["POST"]
path = "/api/v1/*"
[[route]]
methods = ["POST"]
path = "/a%2Fb/{x}"
"#;

fn config() -> &'static Config {
    static CONFIG_CELL: OnceLock<Config> = OnceLock::new();
    CONFIG_CELL.get_or_init(|| Config::parse(CONFIG, "fuzz").expect("the fuzz config is valid"))
}

fn route_of(path: &str) -> Option<usize> {
    config().routes.find(&Method::POST, path).map(|r| r.index)
}

fuzz_target!(|raw: &[u8]| {
    let path = String::from_utf8_lossy(raw);
    let path = path.as_ref();

    let normalized = normalize_path(path);
    assert!(normalized.starts_with('/'), "{path:?} -> {normalized:?}");
    assert_eq!(normalize_path(&normalized), normalized, "{path:?}");
    let route = route_of(&normalized);

    let resolved = resolve_dot_segments(path);
    assert_eq!(resolve_dot_segments(&resolved), resolved, "{path:?}");
    if path.starts_with('/') {
        // What is matched is what the upstream is sent.
        assert_eq!(normalize_path(&resolved), normalized, "{path:?}");
    }

    // A `;` parameter on the last segment selects the same route.
    let with_param = format!("{normalized};jsessionid=x");
    assert_eq!(route_of(&normalize_path(&with_param)), route, "{path:?}");

    // A pattern matches its own instances.
    if let Ok(pattern) = PathPattern::parse(path) {
        let instance = path
            .strip_suffix("/*")
            .unwrap_or(path)
            .split('/')
            .map(|seg| {
                if seg.len() > 2 && seg.starts_with('{') && seg.ends_with('}') {
                    "p_1"
                } else {
                    seg
                }
            })
            .collect::<Vec<_>>()
            .join("/");
        assert!(
            pattern.matches(&normalize_path(&instance)),
            "{path:?} vs {instance:?}"
        );
    }

    // Joined with the base path, an admitted target (one whose path starts
    // with `/`: `proxy/admission.rs`) never leaves it.
    let upstream = &config().server.upstream;
    let admitted = path
        .parse::<Uri>()
        .ok()
        .filter(|u| u.path().starts_with('/'));
    if let Some(original) = admitted {
        if let Ok(joined) = upstream_uri(upstream, &original) {
            let sent = joined.path();
            assert!(
                sent == "/base" || sent.starts_with("/base/"),
                "{path:?} -> {sent:?}"
            );
            let seen = normalize_path(sent);
            assert!(
                seen == "/base" || seen.starts_with("/base/"),
                "{path:?} -> {sent:?} -> {seen:?}"
            );
            assert_eq!(resolve_dot_segments(sent), sent, "{path:?}");
            assert_eq!(joined.query(), original.query(), "{path:?}");
        }
    }
});
