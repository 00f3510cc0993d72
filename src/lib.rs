//! idemgate: an idempotency reverse proxy. It sits in front of an unmodified
//! HTTP API and makes the configured routes safe to retry: a repeated
//! request with the same `Idempotency-Key` gets the stored response instead
//! of a second execution.
//!
//! # Layout
//! Three layers; a module names only its own layer and those below (the
//! `layering` test below holds the table and fails on an upward import or
//! a cycle between modules at any level).
//!
//! **Plumbing**, each mechanism once:
//! - [`net`]: the accept loop, connection deadlines, the shutdown phases
//!   ([`net::drain::Drain`]), TLS clients and handshake diagnosis, error
//!   chains and causes found by type, backoff.
//! - [`body`]: body types, bounded reading, the buffered-body budget.
//! - [`clock`]: the wall clock, injected so tests can pause it.
//! - [`metrics`], [`telemetry`]: Prometheus counters every layer reports
//!   into; logs and (feature `otel`) OpenTelemetry spans.
//!
//! **Domain**, no HTTP messages (the edge reads requests into its values):
//! - [`idempotency`]: the protocol as pure functions: key parsing, scope,
//!   fingerprint, canonical JSON, the decision from a stored record.
//! - `route`: path patterns and the protected-route table.
//! - [`config`]: the TOML file, parsed strictly into typed settings, split
//!   into what reloads and what needs a restart.
//! - [`store`]: the storage trait, its backends (memory, SQLite,
//!   PostgreSQL, the Redis fast path) and the seam every call goes through.
//! - `lease`: holding a claimed key: renew, complete, release, and the
//!   one rule for writes whose answer was lost.
//!
//! **Edge**, HTTP and operations:
//! - `upstream`: the upstreams' pooled clients (named, HTTPS, HTTP/2) and
//!   the byte tunnel of upgraded connections.
//! - `proxy`: the request path; `proxy::protected` is the one hand-off
//!   (prepare, claim, execute, wait).
//! - `error`, `problem`: the proxy's error type with typed causes, and the
//!   one mapping to RFC 9457 responses.
//! - `admin`: health, readiness and `/metrics`.
//! - [`server`]: wiring: the listeners, sweeper, reload and shutdown.
//! - [`cmd`]: one file per subcommand (`serve`, `check-config`, `migrate`,
//!   `keys`, `demo`).
//! - `fuzzing`: not a stable API; the crate-private parsers and codecs,
//!   for fuzz targets and property tests.

pub(crate) mod admin;
pub mod body;
pub mod clock;
pub mod cmd;
pub mod config;
pub(crate) mod error;
#[doc(hidden)]
pub mod fuzzing;
pub mod idempotency;
pub(crate) mod lease;
pub mod metrics;
pub mod net;
pub(crate) mod problem;
pub(crate) mod proxy;
pub(crate) mod route;
pub mod server;
pub(crate) mod shutdown;
pub mod store;
pub mod telemetry;
pub(crate) mod upstream;

/// The layout above, enforced: a module names only its own layer and those
/// below, and no modules at any level name each other in a circle.
#[cfg(test)]
mod layering {
    use std::collections::{BTreeMap, BTreeSet};

    type Module = Vec<String>;

    /// Bottom to top. A new top-level module must be placed here.
    const LAYERS: [&[&str]; 3] = [
        &["net", "body", "clock", "metrics", "telemetry"],
        &["idempotency", "route", "config", "store", "lease"],
        &[
            "upstream", "error", "problem", "proxy", "admin", "server", "cmd", "shutdown",
            "fuzzing",
        ],
    ];

    /// Every module with a file, and its code without comments.
    fn sources() -> BTreeMap<Module, String> {
        let mut sources = BTreeMap::new();
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let mut dirs = vec![root.clone()];
        while let Some(dir) = dirs.pop() {
            for entry in std::fs::read_dir(dir).unwrap() {
                let path = entry.unwrap().path();
                if path.is_dir() {
                    dirs.push(path);
                } else if path.extension().is_some_and(|e| e == "rs") {
                    let rel = path.strip_prefix(&root).unwrap().with_extension("");
                    let module: Module = rel.iter().map(|s| s.to_string_lossy().into()).collect();
                    if !matches!(module[0].as_str(), "lib" | "main") {
                        let text = std::fs::read_to_string(&path).unwrap();
                        let code = text.lines().map(|l| l.split("//").next().unwrap());
                        sources.insert(module, code.collect::<Vec<_>>().join("\n"));
                    }
                }
            }
        }
        sources
    }

    /// The modules each module's code names.
    fn graph(sources: &BTreeMap<Module, String>) -> BTreeMap<Module, BTreeSet<Module>> {
        let known: BTreeSet<Module> = sources.keys().cloned().collect();
        let mut graph = BTreeMap::new();
        for (module, code) in sources {
            let tests_at = code.find("mod tests {").unwrap_or(usize::MAX);
            let mut named = BTreeSet::new();
            for (at, _) in code
                .match_indices("crate::")
                .chain(code.match_indices("super::"))
            {
                if code[..at]
                    .ends_with(|c: char| c.is_alphanumeric() || c == '_' || c == '$' || c == ':')
                {
                    continue; // `$crate::`, or the middle of `super::super::`
                }
                // `super` in the file's own `mod tests` is the file's module.
                let mut base = match code[at..].starts_with("crate::") {
                    true => Vec::new(),
                    false => module[..module.len() - usize::from(at < tests_at)].to_vec(),
                };
                let mut rest = &code[at + 7..];
                while let Some(r) = rest.strip_prefix("super::") {
                    base.pop();
                    rest = r;
                }
                for path in use_tree(rest) {
                    let mut target = base.clone();
                    for segment in path {
                        target.push(segment);
                        if !known.contains(&target) {
                            target.pop();
                            break;
                        }
                    }
                    named.insert(target);
                }
            }
            graph.insert(module.clone(), named);
        }
        graph
    }

    /// The paths of a `use` tree (`a::{b, c::d}`) or a plain path.
    fn use_tree(text: &str) -> Vec<Module> {
        if let Some(inner) = text.strip_prefix('{') {
            let (mut depth, mut start, mut out) = (0, 0, Vec::new());
            for (i, c) in inner.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' | ',' if depth == 0 => {
                        let item = inner[start..i].trim();
                        if !item.is_empty() {
                            out.extend(use_tree(item));
                        }
                        if c == '}' {
                            break;
                        }
                        start = i + 1;
                    }
                    '}' => depth -= 1,
                    _ => {}
                }
            }
            return out;
        }
        let n = text
            .find(|c: char| !(c.is_alphanumeric() || c == '_'))
            .unwrap_or(text.len());
        let head = text[..n].to_string();
        match text[n..].strip_prefix("::") {
            Some(rest) => use_tree(rest)
                .into_iter()
                .map(|p| [vec![head.clone()], p].concat())
                .collect(),
            None => vec![vec![head]],
        }
    }

    #[test]
    fn layering() {
        let graph = graph(&sources());
        let layer = |m: &Module| LAYERS.iter().position(|l| l.contains(&m[0].as_str()));
        let mut failures = Vec::new();
        for (from, named) in &graph {
            let Some(own) = layer(from) else {
                failures.push(format!("{} is in no layer of lib.rs's LAYERS", from[0]));
                continue;
            };
            for to in named.iter().filter(|to| !to.is_empty() && to[0] != from[0]) {
                if layer(to).is_some_and(|l| l > own) {
                    failures.push(format!(
                        "{} names {}, a higher layer",
                        from.join("::"),
                        to.join("::")
                    ));
                }
            }
        }
        // Between the children of every module (the crate's top level too).
        let mut siblings: BTreeMap<Module, BTreeMap<String, BTreeSet<String>>> = BTreeMap::new();
        for (from, named) in &graph {
            for to in named {
                let common = from.iter().zip(to).take_while(|(a, b)| a == b).count();
                if common < from.len() && common < to.len() {
                    let parent = from[..common].to_vec();
                    let edges = siblings.entry(parent).or_default();
                    edges
                        .entry(from[common].clone())
                        .or_default()
                        .insert(to[common].clone());
                }
            }
        }
        for (parent, edges) in &siblings {
            for start in edges.keys() {
                let mut path = vec![start.clone()];
                if let Some(cycle) = cycle_from(edges, &mut path, &mut BTreeSet::new()) {
                    failures.push(format!(
                        "a cycle in crate::{}: {}",
                        parent.join("::"),
                        cycle.join(" -> ")
                    ));
                }
            }
        }
        failures.sort();
        failures.dedup();
        assert!(failures.is_empty(), "{}", failures.join("\n"));
    }

    /// The domain speaks the protocol's values: the edge reads requests,
    /// responses and bodies into them. (`http`'s value types, such as
    /// `Method`, `HeaderName` and `StatusCode`, are the config's words.)
    #[test]
    fn the_domain_names_no_http_message() {
        const MESSAGES: [&str; 6] = [
            "hyper",
            "http_body",
            "HeaderMap",
            "Parts",
            "Request",
            "Response",
        ];
        let mut found = Vec::new();
        for (module, code) in sources()
            .iter()
            .filter(|(m, _)| LAYERS[1].contains(&m[0].as_str()))
        {
            let code = without_strings(code);
            for word in code.split(|c: char| !(c.is_alphanumeric() || c == '_')) {
                if MESSAGES.contains(&word) {
                    found.push(format!("{} names {word}", module.join("::")));
                }
            }
        }
        found.dedup();
        assert!(found.is_empty(), "{}", found.join("\n"));
    }

    /// `code` with its string literals' contents left out (`"…"`, `r#"…"#`).
    fn without_strings(code: &str) -> String {
        let (mut out, mut rest) = (String::new(), code);
        while let Some(at) = rest.find('"') {
            let raw = rest[..at].ends_with("r#");
            out.push_str(&rest[..at]);
            if rest[..at].ends_with(['\'', '\\']) && rest[at + 1..].starts_with('\'') {
                rest = &rest[at + 1..]; // the character '"'
                continue;
            }
            let body = &rest[at + 1..];
            let end = match raw {
                true => body.find("\"#").map(|e| e + 2),
                false => body
                    .char_indices()
                    .scan(false, |escaped, (i, c)| {
                        let close = c == '"' && !*escaped;
                        *escaped = c == '\\' && !*escaped;
                        Some((i, close))
                    })
                    .find(|&(_, close)| close)
                    .map(|(i, _)| i + 1),
            };
            rest = &body[end.unwrap_or(body.len())..];
        }
        out + rest
    }

    /// A path back to `path[0]` along `edges`, if there is one.
    fn cycle_from(
        edges: &BTreeMap<String, BTreeSet<String>>,
        path: &mut Vec<String>,
        seen: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        for next in edges.get(path.last().unwrap()).into_iter().flatten() {
            if *next == path[0] {
                return Some([path.clone(), vec![next.clone()]].concat());
            }
            if next > &path[0] && seen.insert(next.clone()) {
                path.push(next.clone());
                if let Some(c) = cycle_from(edges, path, seen) {
                    return Some(c);
                }
                path.pop();
            }
        }
        None
    }
}
