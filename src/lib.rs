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
//! - `consumer`: message consumers (`[[consumer]]`): broker messages
//!   (RabbitMQ, NATS JetStream) delivered through `proxy`'s protected
//!   path, acked once their answer is recorded.
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
pub(crate) mod consumer;
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
            "upstream", "error", "problem", "proxy", "consumer", "admin", "server", "cmd",
            "shutdown", "fuzzing",
        ],
    ];

    /// Every module with a file, and its code without comments or strings.
    fn sources() -> BTreeMap<Module, String> {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let (mut sources, mut dirs) = (BTreeMap::new(), vec![root.clone()]);
        while let Some(dir) = dirs.pop() {
            for path in std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().path()) {
                let rel = path.strip_prefix(&root).unwrap().with_extension("");
                let module: Module = rel.iter().map(|s| s.to_string_lossy().into()).collect();
                if path.is_dir() {
                    dirs.push(path);
                } else if path.extension().is_some_and(|e| e == "rs")
                    && !["lib", "main"].contains(&module[0].as_str())
                {
                    let text = std::fs::read_to_string(&path).unwrap();
                    sources.insert(module, code_only(&text));
                }
            }
        }
        sources
    }

    /// `text` without its comments and its literals' contents.
    fn code_only(text: &str) -> String {
        let (mut out, mut rest) = (String::new(), text);
        while let Some(at) = rest.find(['/', '"', '\'']) {
            out.push_str(&rest[..at]);
            let after = &rest[at + 1..];
            rest = match rest.as_bytes()[at] {
                b'/' if after.starts_with('/') => after.find('\n').map_or("", |e| &after[e..]),
                b'/' if after.starts_with('*') => after.find("*/").map_or("", |e| &after[e + 2..]),
                b'"' => {
                    let hashes = out.len() - out.trim_end_matches('#').len();
                    let end = match out[..out.len() - hashes].ends_with('r') {
                        true => after.find(&format!("\"{}", "#".repeat(hashes))),
                        false => {
                            let mut escaped = false;
                            after.find(|c| {
                                let close = c == '"' && !escaped;
                                escaped = c == '\\' && !escaped;
                                close
                            })
                        }
                    };
                    out.push_str("\"\"");
                    end.map_or("", |e| &after[e + 1 + hashes..])
                }
                b'\'' => {
                    let mut chars = after.char_indices();
                    match (chars.next(), chars.next()) {
                        (Some((_, '\\')), _) => {
                            after[2..].find('\'').map_or("", |e| &after[e + 3..])
                        }
                        (Some(_), Some((i, '\''))) => &after[i + 1..],
                        _ => {
                            out.push('\''); // a lifetime
                            after
                        }
                    }
                }
                _ => {
                    out.push('/');
                    after
                }
            };
        }
        out + rest
    }

    /// The modules each module's code names by `crate::` and `super::` paths.
    fn graph(sources: &BTreeMap<Module, String>) -> BTreeMap<Module, BTreeSet<Module>> {
        let resolve = |mut target: Module, path: Module| {
            for segment in path {
                target.push(segment);
                if !sources.contains_key(&target) {
                    target.pop();
                    break;
                }
            }
            target
        };
        let graph = sources.iter().map(|(module, code)| {
            let tests_at = code.find("mod tests {").unwrap_or(usize::MAX);
            let paths = code
                .match_indices("crate::")
                .chain(code.match_indices("super::"));
            // Not `$crate::`, nor the middle of `super::super::`.
            let paths = paths.filter(|(at, _)| {
                !code[..*at].ends_with(|c: char| c.is_alphanumeric() || "_$:".contains(c))
            });
            let named = paths.flat_map(|(at, _)| {
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
                use_tree(rest)
                    .into_iter()
                    .map(move |p| resolve(base.clone(), p))
            });
            (module.clone(), named.collect())
        });
        graph.collect()
    }

    /// The paths of a `use` tree (`a::{b, c::d}`) or a plain path.
    fn use_tree(text: &str) -> Vec<Module> {
        if let Some(inner) = text.strip_prefix('{') {
            let (mut depth, mut start, mut out) = (0, 0, Vec::new());
            for (i, c) in inner.char_indices() {
                match c {
                    '}' | ',' if depth == 0 => {
                        out.extend(Some(inner[start..i].trim()).filter(|t| !t.is_empty()));
                        if c == '}' {
                            break;
                        }
                        start = i + 1;
                    }
                    '{' => depth += 1,
                    '}' => depth -= 1,
                    _ => {}
                }
            }
            return out.into_iter().flat_map(use_tree).collect();
        }
        let n = text
            .find(|c: char| !(c.is_alphanumeric() || c == '_'))
            .unwrap_or(text.len());
        let head = vec![text[..n].to_string()];
        match text[n..].strip_prefix("::") {
            Some(rest) => use_tree(rest)
                .into_iter()
                .map(|p| [head.clone(), p].concat())
                .collect(),
            None => vec![head],
        }
    }

    #[test]
    fn layering() {
        let graph = graph(&sources());
        let layer = |m: &Module| LAYERS.iter().position(|l| l.contains(&m[0].as_str()));
        let mut failures = Vec::new();
        let mut siblings: BTreeMap<&[String], BTreeMap<&str, BTreeSet<&str>>> = BTreeMap::new();
        for (from, to) in graph
            .iter()
            .flat_map(|(f, n)| n.iter().map(move |t| (f, t)))
        {
            match (layer(from), layer(to)) {
                (None, _) => failures.push(format!("{} is in no layer of LAYERS", from[0])),
                (Some(own), Some(l)) if l > own => failures.push(format!(
                    "{} names {}, a higher layer",
                    from.join("::"),
                    to.join("::")
                )),
                _ => {}
            }
            // Edges between the children of every module (the crate's too).
            let common = from.iter().zip(to).take_while(|(a, b)| a == b).count();
            if common < from.len().min(to.len()) {
                let edges = siblings.entry(&from[..common]).or_default();
                edges.entry(&from[common]).or_default().insert(&to[common]);
            }
        }
        for (parent, edges) in &siblings {
            for &start in edges.keys() {
                if let Some(cycle) = cycle_from(edges, vec![start], &mut BTreeSet::new()) {
                    let (parent, cycle) = (parent.join("::"), cycle.join(" -> "));
                    failures.push(format!("a cycle in crate::{parent}: {cycle}"));
                }
            }
        }
        failures.sort();
        failures.dedup();
        assert!(failures.is_empty(), "{}", failures.join("\n"));
    }

    /// A path from `path[0]` back to itself along `edges`, if there is one.
    fn cycle_from<'a>(
        edges: &BTreeMap<&'a str, BTreeSet<&'a str>>,
        path: Vec<&'a str>,
        seen: &mut BTreeSet<&'a str>,
    ) -> Option<Vec<&'a str>> {
        for &next in edges.get(path.last().unwrap()).into_iter().flatten() {
            let longer = [&path[..], &[next]].concat();
            if next == path[0] {
                return Some(longer);
            }
            // Each cycle is reported once, from its least member.
            if next > path[0] && seen.insert(next) {
                if let Some(cycle) = cycle_from(edges, longer, seen) {
                    return Some(cycle);
                }
            }
        }
        None
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
        let sources = sources();
        let domain = sources
            .iter()
            .filter(|(m, _)| LAYERS[1].contains(&m[0].as_str()));
        let mut found: Vec<String> = domain
            .flat_map(|(module, code)| {
                let words = code.split(|c: char| !(c.is_alphanumeric() || c == '_'));
                let messages = words.filter(|w| MESSAGES.contains(w));
                messages.map(move |w| format!("{} names {w}", module.join("::")))
            })
            .collect();
        found.dedup();
        assert!(found.is_empty(), "{}", found.join("\n"));
    }
}
