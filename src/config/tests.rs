use super::*;
use crate::idempotency::decision::ReleaseStatuses;
use std::path::PathBuf;

const MINIMAL: &str = "[server]\nupstream = \"http://127.0.0.1:3000\"\n";

fn parse(text: &str) -> Result<Config, ConfigError> {
    Config::parse(text, "test.toml")
}

fn err(text: &str) -> String {
    parse(text)
        .expect_err("config should be rejected")
        .to_string()
}

/// An environment of these variables.
pub(super) fn env(vars: &[(&str, &str)]) -> BTreeMap<String, String> {
    vars.iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn with_route(route: &str) -> String {
    format!("{MINIMAL}[[route]]\nmethods = [\"POST\"]\npath = \"/orders\"\n{route}")
}

/// Pins: uncommenting the shipped file's own `scope_headers` example was
/// a config error (`scope_header` was set beside it). Each of the two
/// scope lines, uncommented alone, loads.
#[test]
fn each_scope_line_of_the_shipped_file_uncommented_alone_loads() {
    let text = include_str!("../../config/idemgate.toml");
    for line in [
        "# scope_header = \"Authorization\"",
        "# scope_headers = [\"Authorization\", \"Stripe-Account\"]   # example",
    ] {
        assert!(text.contains(line), "{line}");
        let uncommented = text.replace(line, &line[2..]);
        let cfg = parse(&uncommented).unwrap_or_else(|e| panic!("{line}: {e}"));
        let route = cfg.routes.iter().next().expect("the example routes");
        assert_eq!(route.scope_headers[0], "authorization", "{line}");
    }
}

#[test]
fn shipped_example_parses_and_uses_every_default() {
    let text = include_str!("../../config/idemgate.toml");
    let cfg = parse(text).expect("config/idemgate.toml must parse");
    assert_eq!(cfg.restart.server.listen.to_string(), DEFAULT_LISTEN);
    assert_eq!(cfg.server.upstream_timeout, DEFAULT_UPSTREAM_TIMEOUT);
    assert_eq!(cfg.restart.server.max_connections, DEFAULT_MAX_CONNECTIONS);
    assert_eq!(cfg.restart.server.shutdown_grace, DEFAULT_SHUTDOWN_GRACE);
    assert_eq!(cfg.restart.server.idle_timeout, DEFAULT_IDLE_TIMEOUT);
    assert_eq!(
        cfg.restart.server.max_buffered_body_bytes,
        DEFAULT_MAX_BUFFERED_BODY_BYTES
    );
    assert_eq!(
        cfg.restart.server.h2_max_concurrent_streams,
        DEFAULT_H2_MAX_CONCURRENT_STREAMS
    );
    assert_eq!(cfg.restart.store.backend, Backend::Sqlite);
    assert_eq!(cfg.restart.store.path, PathBuf::from(DEFAULT_SQLITE_PATH));
    assert_eq!(cfg.restart.store.timeout, DEFAULT_STORE_TIMEOUT);
    assert_eq!(cfg.restart.store.sweep_batch, DEFAULT_SWEEP_BATCH);
    let routes: Vec<_> = cfg.routes.iter().collect();
    assert_eq!(routes.len(), 2);
    let r = &routes[0];
    assert_eq!(r.ttl, DEFAULT_TTL);
    assert_eq!(r.lease, DEFAULT_LEASE);
    assert_eq!(r.key_header.as_str(), "idempotency-key");
    assert_eq!(r.scope_headers, [http::header::AUTHORIZATION]);
    assert_eq!(r.max_request_body, DEFAULT_MAX_REQUEST_BODY);
    assert_eq!(r.max_response_body, DEFAULT_MAX_RESPONSE_BODY);
    assert!(r.require_key);
    assert_eq!(r.on_store_error, OnStoreError::Reject);
    assert_eq!(r.release_statuses, ReleaseStatuses::default());
    assert_eq!(r.on_ambiguous, OnAmbiguous::Release);
    assert_eq!(routes[1].ttl, Duration::from_secs(48 * 3600));
}

#[test]
fn the_file_without_its_examples_is_the_built_in_defaults() {
    let cfg = parse(MINIMAL).unwrap();
    assert!(cfg.restart.admin.is_none());
    assert!(cfg.restart.redis.is_none());
    assert_eq!(cfg.restart.log.format, LogFormat::Text);
    assert_eq!(cfg.routes.iter().count(), 0);
}

#[test]
fn defaults_apply_to_routes_and_routes_override_them() {
    let text = format!(
        "{MINIMAL}[defaults]\nttl = \"2h\"\nlease = \"5s\"\nrequire_key = false\n\
         [[route]]\nmethods = [\"POST\"]\npath = \"/a\"\n\
         [[route]]\nmethods = [\"POST\"]\npath = \"/b\"\nttl = \"3h\"\nrequire_key = true\n"
    );
    let cfg = parse(&text).unwrap();
    let r: Vec<_> = cfg.routes.iter().collect();
    assert_eq!(
        (r[0].ttl, r[0].lease, r[0].require_key),
        (Duration::from_secs(7200), Duration::from_secs(5), false)
    );
    assert_eq!(
        (r[1].ttl, r[1].require_key),
        (Duration::from_secs(3 * 3600), true)
    );
}

#[test]
fn release_statuses_come_from_defaults_and_a_route_replaces_them() {
    let text = format!(
        "{MINIMAL}[defaults]\nrelease_statuses = [\"429\", \"5xx\"]\n\
         [[route]]\nmethods = [\"POST\"]\npath = \"/a\"\n\
         [[route]]\nmethods = [\"POST\"]\npath = \"/b\"\nrelease_statuses = [\"5xx\"]\n\
         [[route]]\nmethods = [\"POST\"]\npath = \"/c\"\nrelease_statuses = []\n"
    );
    let cfg = parse(&text).unwrap();
    let shown: Vec<String> = cfg
        .routes
        .iter()
        .map(|r| r.release_statuses.to_string())
        .collect();
    assert_eq!(shown, ["429,5xx", "5xx", "none"]);
    let printed = cfg.to_string();
    assert!(printed.contains("release=429,5xx"), "{printed}");
    let default = parse(&with_route("")).unwrap();
    assert!(default.to_string().contains("release=408,425,429,5xx"));
}

#[test]
fn scope_headers_list_several_and_scope_header_is_the_one_header_form() {
    let text = format!(
        "{MINIMAL}[defaults]\nscope_headers = [\"Authorization\", \"Stripe-Account\"]\n\
         [[route]]\nmethods = [\"POST\"]\npath = \"/a\"\n\
         [[route]]\nmethods = [\"POST\"]\npath = \"/b\"\nscope_header = \"X-Api-Key\"\n\
         [[route]]\nmethods = [\"POST\"]\npath = \"/c\"\nscope_headers = [\"X-Tenant-Id\", \"Authorization\"]\n"
    );
    let cfg = parse(&text).unwrap();
    let lists: Vec<Vec<&str>> = cfg
        .routes
        .iter()
        .map(|r| r.scope_headers.iter().map(|h| h.as_str()).collect())
        .collect();
    assert_eq!(
        lists,
        [
            vec!["authorization", "stripe-account"],
            vec!["x-api-key"],
            vec!["x-tenant-id", "authorization"],
        ]
    );
    let printed = cfg.to_string();
    assert!(
        printed.contains("scope=authorization,stripe-account "),
        "{printed}"
    );
    let one = parse(&with_route("scope_headers = [\"Authorization\"]\n")).unwrap();
    let default = parse(&with_route("")).unwrap();
    let scopes = |c: &Config| c.routes.iter().next().unwrap().scope_headers.clone();
    assert_eq!(scopes(&one), scopes(&default));
}

#[test]
fn on_ambiguous_defaults_to_release_and_routes_may_keep() {
    let text = format!(
        "{MINIMAL}[defaults]\non_ambiguous = \"keep\"\n\
         [[route]]\nmethods = [\"POST\"]\npath = \"/payments\"\n\
         [[route]]\nmethods = [\"POST\"]\npath = \"/emails\"\non_ambiguous = \"release\"\n"
    );
    let cfg = parse(&text).unwrap();
    let set: Vec<OnAmbiguous> = cfg.routes.iter().map(|r| r.on_ambiguous).collect();
    assert_eq!(set, [OnAmbiguous::Keep, OnAmbiguous::Release]);
    let printed = cfg.to_string();
    assert!(printed.contains("on_ambiguous=keep"), "{printed}");
    assert!(printed.contains("on_ambiguous=release"), "{printed}");
    let default = parse(&with_route("")).unwrap();
    let route = default.routes.iter().next().unwrap();
    assert_eq!(route.on_ambiguous, OnAmbiguous::Release);
}

/// Each bad input names the file and the field or line: whole files, then
/// `MINIMAL` and more, then one route's settings.
#[test]
fn errors_name_file_line_and_field() {
    let whole: &[(&str, &[&str])] = &[
        (
            "[server]\nupstream = \"ftp://x\"\n",
            &["test.toml", "line 2", "ftp"],
        ),
        (
            "[server]\nupstream = \"not a url\"\n",
            &["line 2", "upstream URL"],
        ),
        (
            "[server]\nlisten = \"127.0.0.1:8080\"\n",
            &["server.upstream is required"],
        ),
        ("[server\n", &["test.toml", "line 1"]),
        // Whole-section and cross-section checks name a line too.
        (
            "[server]\nlisten = \"127.0.0.1:8080\"\n",
            &["test.toml", "line 1", "server.upstream is required"],
        ),
    ];
    let after_minimal: &[(&str, &[&str])] = &[
        ("colour = \"blue\"\n", &["test.toml", "line 3", "colour"]),
        (
            "[[route]]\nmethods = [\"post\"]\npath = \"/o\"\n",
            &["line 4", "invalid method"],
        ),
        (
            "[[route]]\nmethods = [\"POST\"]\npath = \"orders\"\n",
            &["line 5", "must start with '/'"],
        ),
        (
            "[[route]]\npath = \"/o\"\n",
            &["route #1", "`methods` is required"],
        ),
        (
            "[[route]]\nmethods = [\"POST\"]\npath = \"/o/{id}\"\n\
             [[route]]\nmethods = [\"PUT\", \"POST\"]\npath = \"/o/{x}\"\n",
            &["line 6", "route #2", "duplicate route", "route #1"],
        ),
        (
            "[[route]]\nmethods = [\"POST\"]\npath = \"/p/*\"\n\
             [[route]]\nmethods = [\"POST\"]\npath = \"/p\"\n",
            &[
                "line 8",
                "route #2 POST /p: never matches",
                "route #1 (POST /p/*, upstream default)",
            ],
        ),
        (
            "[defaults]\npath = \"/x\"\n",
            &["defaults", "belong in a [[route]]"],
        ),
        (
            "[store]\nbackend = \"postgres\"\n",
            &["store.url is required"],
        ),
        (
            "[store]\nbackend = \"sqlite\"\nurl = \"postgres://x\"\n",
            &["line 5", "store.url only applies"],
        ),
        ("[store]\nbackend = \"mysql\"\n", &["line 4", "mysql"]),
        (
            "[redis]\nurl = \"redis://127.0.0.1\"\n",
            &["needs store.backend = \"postgres\""],
        ),
        ("[log]\nformat = \"xml\"\n", &["line 4", "xml"]),
        (
            "idle_timeout = \"0\"\n",
            &["server.idle_timeout must be greater than 0"],
        ),
        (
            "h2_max_concurrent_streams = 0\n",
            &["server.h2_max_concurrent_streams must be at least 1"],
        ),
        (
            "max_buffered_body_bytes = \"1MiB\"\n[[route]]\nmethods = [\"POST\"]\n\
             path = \"/o\"\nmax_request_body = \"2MiB\"\n",
            &[
                "route #1 /o",
                "max_request_body (2MiB)",
                "server.max_buffered_body_bytes (1MiB)",
            ],
        ),
        (
            "[defaults]\nrelease_statuses = [\"3xx\"]\n",
            &["line 4", "release_statuses", "3xx"],
        ),
        (
            "[defaults]\nscope_header = \"Authorization\"\nscope_headers = [\"Authorization\"]\n",
            &["test.toml", "line 5", "defaults", "not both"],
        ),
        (
            "[defaults]\non_ambiguous = true\n",
            &["line 4", "on_ambiguous"],
        ),
        // Whole-section and cross-section checks name a line too.
        (
            "[store]\nbackend = \"sqlite\"\npool_size = 4\n",
            &[
                "test.toml",
                "line 5",
                "only applies to backend = \"postgres\"",
            ],
        ),
        (
            "[store]\nrequire_synchronous_replication = true\n",
            &[
                "line 4",
                "store.require_synchronous_replication only applies to backend = \"postgres\"",
            ],
        ),
        (
            "[store]\nbackend = \"memory\"\n\nsynchronous = \"full\"\n",
            &["line 6", "only apply to backend = \"sqlite\""],
        ),
        (
            "\n[redis]\nurl = \"redis://127.0.0.1\"\n",
            &["test.toml", "line 4", "needs store.backend = \"postgres\""],
        ),
        (
            "[store]\nbackend = \"postgres\"\n",
            &["line 3", "store.url is required"],
        ),
        ("[admin]\n", &["line 3", "admin.listen is required"]),
        (
            "idle_timeout = \"0\"\n",
            &["line 3", "server.idle_timeout must be greater than 0"],
        ),
        (
            "max_buffered_body_bytes = \"1MiB\"\n[[route]]\nmethods = [\"POST\"]\npath = \"/a\"\n\
             [[route]]\nmethods = [\"POST\"]\n\
             path = \"/o\"\nmax_request_body = \"2MiB\"\n",
            &["line 10", "route #2 /o", "max_request_body (2MiB)"],
        ),
        (
            "[log]\nlevel = \"verbose\"\n",
            &[
                "test.toml",
                "line 4",
                "log.level",
                "\"verbose\" is not a level",
            ],
        ),
        (
            "[[route]]\nmethods = [\"PSOT\"]\npath = \"/o\"\n",
            &[
                "test.toml",
                "line 3",
                "route #1",
                "\"PSOT\"",
                "allow_custom_methods",
            ],
        ),
    ];
    let in_route: &[(&str, &[&str])] = &[
        ("ttl = \"30\"\n", &["line 6", "unit is required"]),
        ("lease = \"5 parsecs\"\n", &["line 6", "parsecs"]),
        ("max_request_body = \"lots\"\n", &["line 6", "invalid size"]),
        ("require_key = \"yes\"\n", &["line 6", "require_key"]),
        ("on_store_error = \"panic\"\n", &["line 6", "panic"]),
        ("lease = \"100ms\"\n", &["route #1", "too short"]),
        (
            "ttl = \"10s\"\nlease = \"30s\"\n",
            &["ttl", "at least the lease"],
        ),
        ("scope_header = \"bad header\"\n", &["invalid header name"]),
        (
            "release_statuses = [\"429\", \"2xx\"]\n",
            &["test.toml", "line 6", "release_statuses", "2xx", "executed"],
        ),
        (
            "release_statuses = [\"201\"]\n",
            &["line 6", "release_statuses", "2xx answer", "run it again"],
        ),
        (
            "release_statuses = [\"5XX\"]\n",
            &["line 6", "release_statuses", "expected a status"],
        ),
        (
            "release_statuses = [429]\n",
            &["line 6", "release_statuses", "\"429\""],
        ),
        (
            "release_statuses = \"5xx\"\n",
            &["line 6", "release_statuses"],
        ),
        (
            "release_statuses = [\"5xx\", \"503\"]\n",
            &["line 6", "release_statuses", "overlap"],
        ),
        (
            "scope_header = \"Authorization\"\nscope_headers = [\"X-Tenant-Id\"]\n",
            &["test.toml", "line 3", "route #1", "not both"],
        ),
        ("scope_headers = []\n", &["line 6", "at least one header"]),
        (
            "scope_headers = [\"Authorization\", \"authorization\"]\n",
            &["line 6", "\"authorization\" is listed twice"],
        ),
        (
            "scope_headers = [\"Authorization\", \"bad header\"]\n",
            &["line 6", "invalid header name"],
        ),
        (
            "on_ambiguous = \"retry\"\n",
            &["test.toml", "line 6", "on_ambiguous", "release", "keep"],
        ),
    ];
    let cases = (whole
        .iter()
        .map(|(text, needles)| (text.to_string(), *needles)))
    .chain(
        after_minimal
            .iter()
            .map(|(extra, n)| (format!("{MINIMAL}{extra}"), *n)),
    )
    .chain(in_route.iter().map(|(route, n)| (with_route(route), *n)));
    for (text, needles) in cases {
        let msg = err(&text);
        for needle in needles {
            assert!(
                msg.contains(needle),
                "{needle:?} not in error for\n{text}\n--> {msg}"
            );
        }
    }
}

/// A method outside the registered set is refused (`"PSOT"` would leave
/// the route unprotected) unless the route allows it explicitly.
#[test]
fn custom_methods_need_allow_custom_methods() {
    let text = format!(
        "{MINIMAL}[[route]]\nmethods = [\"PURGE\"]\npath = \"/o\"\nallow_custom_methods = true\n"
    );
    let cfg = parse(&text).unwrap();
    assert_eq!(
        cfg.routes.iter().next().unwrap().methods[0].as_str(),
        "PURGE"
    );
    let text = format!(
        "{MINIMAL}[defaults]\nallow_custom_methods = true\n[[route]]\nmethods = [\"PURGE\"]\npath = \"/o\"\n"
    );
    assert!(parse(&text).is_ok());
}

#[test]
fn environment_overrides_urls_and_addresses() {
    let text = format!("{MINIMAL}[store]\nbackend = \"postgres\"\n");
    let env = env(&[
        ("IDEMGATE_STORE_URL", "postgres://u:hunter2@db:5432/app"),
        ("IDEMGATE_REDIS_URL", "redis://cache:6379"),
        ("IDEMGATE_UPSTREAM", "http://app:9000"),
        ("IDEMGATE_LISTEN", "0.0.0.0:8081"),
    ]);
    let cfg = Config::parse_with_env(&text, "t.toml", &env).unwrap();
    assert_eq!(
        cfg.restart.store.url.as_deref(),
        Some("postgres://u:hunter2@db:5432/app")
    );
    assert_eq!(
        cfg.restart.redis.as_ref().unwrap().url,
        "redis://cache:6379"
    );
    assert_eq!(cfg.server.upstream.to_string(), "http://app:9000/");
    assert_eq!(cfg.restart.server.listen.to_string(), "0.0.0.0:8081");
    let shown = cfg.to_string();
    assert!(shown.contains("postgres://u:****@db:5432/app"), "{shown}");
    assert!(!shown.contains("hunter2"));
}

/// Pins (found by the `config` fuzz target): `Config`'s derived `Debug`
/// printed the store and Redis URLs whole, password included, so a
/// `{config:?}` in a log or a panic message would have carried it. The
/// scope secret was masked there already.
#[test]
fn debug_output_masks_store_and_redis_passwords() {
    let text = format!("{MINIMAL}[store]\nbackend = \"postgres\"\n");
    let env = env(&[
        ("IDEMGATE_STORE_URL", "postgres://u:hunter2@db:5432/app"),
        ("IDEMGATE_REDIS_URL", "redis://:swordfish@cache:6379"),
    ]);
    let cfg = Config::parse_with_env(&text, "t.toml", &env).unwrap();
    let debug = format!("{cfg:?}");
    assert!(!debug.contains("hunter2"), "{debug}");
    assert!(!debug.contains("swordfish"), "{debug}");
    assert!(debug.contains("postgres://u:****@db:5432/app"), "{debug}");
    assert!(debug.contains("redis://:****@cache:6379"), "{debug}");
    assert!(
        debug.contains("pool_size: 16"),
        "the other fields stay: {debug}"
    );
}

/// Pins (found by the `config` fuzz target): a misspelled store or Redis
/// URL was echoed whole in the error that refused it, password included
/// (`redis.url: expected redis://host:port, got redis:/:pw@cache:6379`), as
/// was a password holding a `?`, where the query was cut off first.
#[test]
fn misspelled_urls_never_show_their_password() {
    for (url, want) in [
        ("redis:/:hunter2@cache:6379", "redis:****@cache:6379"),
        ("postgres:/u:hunter2@db/app", "postgres:****@db/app"),
        ("postgresql//u:hunter2@db", "postgresql//u:****@db"),
        ("u:hunter2@db", "u:****@db"),
        ("postgres://u:hun?ter2@db/app", "postgres://u:****@db/app"),
        (
            "postgres://u:hun&ter2@db/app?pass=x",
            "postgres://u:****@db/app?pass=****",
        ),
        ("postgres://u:hunter2@db/app?x=a@b", "postgres://u:****@b"),
    ] {
        assert_eq!(mask_url(url), want, "{url}");
    }
    let text = format!("{MINIMAL}[store]\nbackend = \"postgres\"\n");
    for (name, url) in [
        ("IDEMGATE_STORE_URL", "postgres:/u:hunter2@db/app"),
        ("IDEMGATE_REDIS_URL", "redis:/:hunter2@cache:6379"),
    ] {
        let mut env = env(&[("IDEMGATE_STORE_URL", "postgres://db/app")]);
        env.insert(name.to_string(), url.to_string());
        let e = Config::parse_with_env(&text, "t.toml", &env).unwrap_err();
        assert!(e.to_string().contains("expected"), "{name}: {e}");
        assert!(!e.to_string().contains("hunter2"), "{name}: {e}");
        assert!(!format!("{e:?}").contains("hunter2"), "{name}: {e:?}");
    }
}

#[test]
fn passwords_are_masked() {
    assert_eq!(mask_url("postgres://u:pw@h/db"), "postgres://u:****@h/db");
    assert_eq!(mask_url("redis://h:6379"), "redis://h:6379");
    assert_eq!(mask_url("redis://:pw@h:6379"), "redis://:****@h:6379");
    assert_eq!(
        mask_url("postgres://u@h/db?sslmode=disable&password=pw"),
        "postgres://u@h/db?sslmode=disable&password=****"
    );
    assert_eq!(mask_url("postgres://u:a@b@h/db"), "postgres://u:****@h/db");
}

/// The deployment examples must stay valid configs.
#[test]
fn deployment_configs_parse() {
    let env = env(&[
        (
            "IDEMGATE_STORE_URL",
            "postgres://idemgate:pw@postgres:5432/idemgate",
        ),
        ("IDEMGATE_REDIS_URL", "redis://redis:6379"),
    ]);
    let compose = include_str!("../../config/compose.toml");
    let cfg = Config::parse_with_env(compose, "config/compose.toml", &env).unwrap();
    assert_eq!(cfg.restart.store.backend, Backend::Postgres);
    assert!(cfg.restart.redis.is_some());
    Config::parse(
        include_str!("../../config/docker.toml"),
        "config/docker.toml",
    )
    .unwrap();

    let manifest = include_str!("../../deploy/kubernetes/sidecar.yaml");
    let start =
        manifest.find("idemgate.toml: |").expect("ConfigMap entry") + "idemgate.toml: |".len();
    let end = start + manifest[start..].find("\n---").expect("end of ConfigMap");
    let embedded: String = manifest[start..end]
        .lines()
        .map(|l| l.strip_prefix("    ").unwrap_or(l))
        .collect::<Vec<_>>()
        .join("\n");
    let cfg = Config::parse_with_env(&embedded, "deploy/kubernetes/sidecar.yaml", &env).unwrap();
    assert_eq!(cfg.routes.iter().count(), 2);
    assert!(cfg.restart.admin.is_some());
}

#[test]
fn scope_secret_comes_from_the_environment_and_is_never_shown() {
    let env = |v: &str| env(&[("IDEMGATE_SCOPE_SECRET", v)]);
    let short = Config::parse_with_env(MINIMAL, "t.toml", &env("short")).unwrap_err();
    assert!(short.to_string().contains("at least 16"), "{short}");
    let cfg = Config::parse_with_env(MINIMAL, "t.toml", &env("a-long-enough-secret")).unwrap();
    assert_eq!(
        cfg.scope_secret.as_ref().unwrap().expose(),
        b"a-long-enough-secret"
    );
    assert!(cfg.to_string().contains("HMAC-SHA256"));
    assert!(!format!("{cfg:?}").contains("a-long-enough-secret"));
    assert!(!cfg.to_string().contains("a-long-enough-secret"));
}

#[test]
fn any_section_key_can_come_from_the_environment() {
    let vars = env(&[
        ("IDEMGATE_SERVER_UPSTREAM_TIMEOUT", "5s"),
        ("IDEMGATE_SERVER_PRESERVE_HOST", "true"),
        ("IDEMGATE_STORE_SWEEP_BATCH", "50"),
        ("IDEMGATE_ADMIN_LISTEN", "127.0.0.1:9999"),
        ("IDEMGATE_LOG_FORMAT", "json"),
        (
            "IDEMGATE_TEST_DATABASE_URL",
            "ignored: not a config section",
        ),
    ]);
    let cfg = Config::parse_with_env(MINIMAL, "t.toml", &vars).unwrap();
    assert_eq!(cfg.server.upstream_timeout, Duration::from_secs(5));
    assert!(cfg.server.preserve_host);
    assert_eq!(cfg.restart.store.sweep_batch, 50);
    assert_eq!(
        cfg.restart.admin.unwrap().listen.to_string(),
        "127.0.0.1:9999"
    );
    assert_eq!(cfg.restart.log.format, LogFormat::Json);

    for (name, value, needle) in [
        ("IDEMGATE_SERVER_COLOUR", "blue", "unknown field `colour`"),
        ("IDEMGATE_SERVER_UPSTREAM_TIMEOUT", "30", "unit is required"),
        (
            "IDEMGATE_STORE_POOL_SIZE",
            "many",
            "IDEMGATE_STORE_POOL_SIZE",
        ),
    ] {
        let env = env(&[(name, value)]);
        let e = Config::parse_with_env(MINIMAL, "t.toml", &env)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(name) && e.contains(needle),
            "{needle:?} not in {e}"
        );
        if needle.starts_with("unknown field") {
            // A secret set under a wrong name is not printed.
            assert!(!e.contains(value), "the value is echoed: {e}");
        }
    }
    // A value that is not one TOML value is a plain string: a newline cannot
    // smuggle in other sections.
    let sneaky = "\"x\"\n[server]\nupstream = \"http://evil:1\"";
    let env = env(&[("IDEMGATE_LOG_LEVEL", sneaky)]);
    let e = Config::parse_with_env(MINIMAL, "t.toml", &env)
        .unwrap_err()
        .to_string();
    assert!(e.contains("log.level"), "{e}");
}

/// Guard for the environment rule: every key `config/idemgate.toml` lists,
/// set or commented out, can be set by `IDEMGATE_<SECTION>_<KEY>` exactly
/// as the file sets it. The keys come from the file, so a new key is
/// covered as soon as it is documented there.
#[test]
fn every_key_of_the_example_file_can_come_from_the_environment() {
    let shipped = include_str!("../../config/idemgate.toml");
    let full = with_commented_keys_in_force(shipped);
    let document = toml::de::DeTable::parse(&full).expect("the file with every key parses");
    let parsed: toml::Table = toml::from_str(&full).unwrap();
    let as_env = |value: &toml::Value| match value {
        toml::Value::String(s) => s.clone(),
        other => other.to_string(),
    };
    // (variable, value, where the key is in the file)
    let mut keys: Vec<(String, String, usize)> = Vec::new();
    for (section, table) in document.get_ref() {
        let section = section.get_ref().as_ref();
        // Routes, their defaults and consumers come from the file only
        // (a consumer's URL: IDEMGATE_CONSUMER_<NAME>_URL).
        if ["defaults", "route", "consumer"].contains(&section) {
            continue;
        }
        let toml::de::DeValue::Table(table) = table.get_ref() else {
            panic!("[{section}] is not a table");
        };
        for (key, value) in table {
            let key_name = key.get_ref().as_ref();
            // [upstreams.NAME]: IDEMGATE_UPSTREAMS_<NAME>_<KEY>.
            if section == "upstreams" {
                let toml::de::DeValue::Table(named) = value.get_ref() else {
                    panic!("[upstreams.{key_name}] is not a table");
                };
                for (inner, _) in named {
                    let inner_name = inner.get_ref().as_ref();
                    keys.push((
                        format!(
                            "IDEMGATE_UPSTREAMS_{}_{}",
                            key_name.to_ascii_uppercase(),
                            inner_name.to_ascii_uppercase()
                        ),
                        as_env(&parsed[section][key_name][inner_name]),
                        inner.span().start,
                    ));
                }
                continue;
            }
            keys.push((
                format!(
                    "IDEMGATE_{}_{}",
                    section.to_ascii_uppercase(),
                    key_name.to_ascii_uppercase()
                ),
                as_env(&parsed[section][key_name]),
                key.span().start,
            ));
        }
    }
    let mut walked = 0;
    for (name, value, at) in keys {
        let env: BTreeMap<String, String> = [(name.clone(), value)].into();
        let without = blank_line_of(&full, at);
        let raw = |text: &str, env: &BTreeMap<String, String>| {
            let raw = read_raw(text, env).unwrap_or_else(|e| panic!("{name}: {e}"));
            without_spans(&format!("{raw:?}"))
        };
        let from_file = raw(&full, &BTreeMap::new());
        assert_ne!(
            raw(&without, &BTreeMap::new()),
            from_file,
            "{name}: the key's line was not removed"
        );
        assert_eq!(
            raw(&without, &env),
            from_file,
            "{name} does not set the key"
        );

        // Where the key is in force in the shipped file, the whole
        // configuration comes out the same.
        let line = line_at(&full, at);
        if shipped[line.clone()] == full[line] {
            let shipped_without = blank_line_of(shipped, at);
            let want = parse(shipped).unwrap();
            let got = Config::parse_with_env(&shipped_without, "t.toml", &env)
                .unwrap_or_else(|e| panic!("{name}: {e}"));
            assert_eq!(format!("{got:?}"), format!("{want:?}"), "{name}");
            assert_eq!(got.to_string(), want.to_string(), "{name}");
        }
        walked += 1;
    }
    // server, admin, store, redis, log and the example upstream, with the
    // commented-out keys.
    assert!(walked >= 40, "only {walked} keys walked");
}

/// `text` with its commented-out keys and section headers (`# key = value`,
/// `# [redis]`) in force, each byte at the same offset.
fn with_commented_keys_in_force(text: &str) -> String {
    text.split_inclusive('\n')
        .map(|line| match line.strip_prefix("# ") {
            Some(rest) if toml::from_str::<toml::Table>(rest).is_ok_and(|t| !t.is_empty()) => {
                format!("  {rest}")
            }
            _ => line.to_string(),
        })
        .collect()
}

/// `text` with the line holding byte `offset` blanked, each byte at the same
/// offset, so the spans of everything else stay put.
fn blank_line_of(text: &str, offset: usize) -> String {
    let line = line_at(text, offset);
    let blank = " ".repeat(line.len());
    format!("{}{blank}{}", &text[..line.start], &text[line.end..])
}

/// The byte range of the line holding byte `offset`, without its newline.
fn line_at(text: &str, offset: usize) -> Range<usize> {
    let start = text[..offset].rfind('\n').map_or(0, |i| i + 1);
    let end = text[offset..].find('\n').map_or(text.len(), |i| offset + i);
    start..end
}

/// A `Debug` rendering without the `span: a..b, ` of `toml::Spanned`: a
/// value from the environment has no place in the file.
fn without_spans(debug: &str) -> String {
    let mut out = String::new();
    let mut rest = debug;
    while let Some(i) = rest.find("span: ") {
        out.push_str(&rest[..i]);
        rest = &rest[i..];
        rest = rest.find(", ").map_or("", |j| &rest[j + 2..]);
    }
    out.push_str(rest);
    out
}

// ===== [tracing] =====

const TRACING: &str = "[tracing]\notlp_endpoint = \"http://127.0.0.1:4318\"\n";

#[cfg(feature = "otel")]
#[test]
fn tracing_section_sets_the_exporter_with_defaults() {
    let cfg = parse(&format!("{MINIMAL}{TRACING}")).unwrap();
    let t = cfg.restart.tracing.expect("tracing on");
    assert_eq!(t.traces_url.to_string(), "http://127.0.0.1:4318/v1/traces");
    assert_eq!(t.service_name, "idemgate");
    assert_eq!(t.sampling_ratio, 1.0);
    assert!(parse(MINIMAL).unwrap().restart.tracing.is_none());
    for (extra, part) in [
        ("sampling_ratio = 1.5\n", "between 0 and 1"),
        ("service_name = \"\"\n", "service_name"),
        ("sampling = 0.5\n", "unknown field"),
    ] {
        let e = err(&format!("{MINIMAL}{TRACING}{extra}"));
        assert!(e.contains(part), "{extra}: {e}");
    }
    let e = err(&format!(
        "{MINIMAL}[tracing]\nservice_name = \"x\"\notlp_endpoint = \"https://c:4318\"\n"
    ));
    assert!(e.contains("line") && e.contains("https"), "{e}");
    let e = err(&format!("{MINIMAL}[tracing]\nservice_name = \"x\"\n"));
    assert!(e.contains("needs otlp_endpoint"), "{e}");
}

/// Without the feature the section is refused, never ignored: an operator
/// who asked for traces must not get a silent build without them.
#[cfg(not(feature = "otel"))]
#[test]
fn tracing_section_is_a_config_error_without_the_otel_feature() {
    let text = format!("{MINIMAL}{TRACING}");
    let e = err(&text);
    let line = text.lines().position(|l| l == "[tracing]").unwrap() + 1;
    assert!(
        e.contains("otel") && e.contains(&format!("line {line}")),
        "{e}"
    );
    let env = env(&[("IDEMGATE_TRACING_OTLP_ENDPOINT", "http://127.0.0.1:4318")]);
    let e = Config::parse_with_env(MINIMAL, "t.toml", &env).unwrap_err();
    assert!(e.to_string().contains("IDEMGATE_TRACING_"), "{e}");
}

// ===== natural keys, scopes, fingerprints, waiting duplicates, presets =====

#[test]
fn natural_keys_scopes_and_delivery_settings_resolve() {
    use crate::route::{FingerprintMode, InFlight, Preset};
    use http::{HeaderName, Method};
    let text = format!(
        "{MINIMAL}[[route]]\nmethods = [\"POST\"]\npath = \"/a\"\n\
         key = {{ header = \"X-GitHub-Delivery\" }}\nscope = {{ value = \"github\" }}\n\
         in_flight = {{ wait = \"10s\" }}\n\
         [[route]]\nmethods = [\"POST\"]\npath = \"/b\"\nkey = {{ json = \"/message/messageId\" }}\n\
         scope = {{ header = \"X-Tenant\" }}\nfingerprint = \"json\"\nfingerprint_ignore = [\"/deliveryAttempt\"]\n\
         in_flight = \"reject\"\n\
         [[route]]\npath = \"/c\"\npreset = \"stripe\"\n\
         [[route]]\npath = \"/d\"\npreset = \"stripe\"\nkey = {{ header = \"X-Id\" }}\nfingerprint = \"raw\"\n\
         ttl = \"1h\"\nin_flight = \"reject\"\nscope = {{ value = \"mine\" }}\n"
    );
    let cfg = parse(&text).unwrap();
    let r: Vec<_> = cfg.routes.iter().collect();
    assert_eq!(r[0].key_header.as_str(), "x-github-delivery");
    assert_eq!(r[0].key_json, None);
    assert_eq!(r[0].scope_value.as_deref(), Some("github"));
    assert_eq!(r[0].in_flight, InFlight::Wait(Duration::from_secs(10)));
    assert_eq!(r[0].fingerprint, FingerprintMode::Raw);
    assert_eq!(
        r[1].key_json.as_ref().map(|p| p.as_str()),
        Some("/message/messageId")
    );
    assert_eq!(r[1].scope_headers, [HeaderName::from_static("x-tenant")]);
    assert_eq!(r[1].scope_value, None);
    assert_eq!(r[1].fingerprint, FingerprintMode::Json);
    assert_eq!(r[1].fingerprint_ignore.len(), 1);
    assert_eq!(r[1].in_flight, InFlight::Reject);
    // A preset: its key, a scope of its own per route, its ttl and wait.
    assert_eq!(r[2].preset, Some(Preset::Stripe));
    assert_eq!(r[2].methods, [Method::POST]);
    assert_eq!(r[2].key_json.as_ref().map(|p| p.as_str()), Some("/id"));
    assert_eq!(r[2].scope_value.as_deref(), Some("stripe:/c"));
    assert_eq!(r[2].ttl, Duration::from_secs(4 * 24 * 3600));
    assert_eq!(r[2].fingerprint, FingerprintMode::Json);
    assert_eq!(r[2].fingerprint_ignore[0].as_str(), "/pending_webhooks");
    assert!(matches!(r[2].in_flight, InFlight::Wait(_)));
    // The route's own keys win over the preset's.
    assert_eq!(r[3].key_header.as_str(), "x-id");
    assert_eq!(r[3].key_json, None);
    assert_eq!(r[3].fingerprint, FingerprintMode::Raw);
    assert!(r[3].fingerprint_ignore.is_empty());
    assert_eq!(r[3].ttl, Duration::from_secs(3600));
    assert_eq!(r[3].in_flight, InFlight::Reject);
    assert_eq!(r[3].scope_value.as_deref(), Some("mine"));
    // Today's defaults are unchanged.
    let plain = parse(&with_route("")).unwrap();
    let p = plain.routes.iter().next().unwrap();
    assert_eq!(p.key_header.as_str(), "idempotency-key");
    assert_eq!((p.key_json.as_ref(), p.scope_value.as_ref()), (None, None));
    assert_eq!(p.fingerprint, FingerprintMode::Raw);
    assert_eq!(p.in_flight, InFlight::Reject);
    let shown = cfg.to_string();
    assert!(shown.contains("key_json=/id"), "{shown}");
    assert!(shown.contains("preset=stripe"), "{shown}");
    assert!(shown.contains("scope=value:stripe:/c"), "{shown}");
}

#[test]
fn every_preset_parses() {
    for preset in [
        "github",
        "standard-webhooks",
        "stripe",
        "sns",
        "pub-sub",
        "shopify",
    ] {
        let text = format!("{MINIMAL}[[route]]\npath = \"/hook\"\npreset = \"{preset}\"\n");
        let cfg = parse(&text).unwrap_or_else(|e| panic!("{preset}: {e}"));
        let r = cfg.routes.iter().next().unwrap();
        assert!(r.ttl >= Duration::from_secs(24 * 3600), "{preset}");
        assert!(r.require_key, "{preset}");
    }
}

#[test]
fn bad_delivery_settings_name_the_line_and_the_fix() {
    let cases: &[(&str, &[&str])] = &[
        (
            "key = { header = \"A\", json = \"/id\" }\n",
            &["line 6", "exactly one of `header`"],
        ),
        ("key = {}\n", &["line 6", "exactly one"]),
        (
            "key = { json = \"id\" }\n",
            &["line 6", "must start with '/'"],
        ),
        (
            "key = { json = \"/a~2\" }\n",
            &["line 6", "'~' must be followed"],
        ),
        ("key = { cookie = \"a\" }\n", &["line 6", "unknown field"]),
        (
            "key = { header = \"A\" }\nkey_header = \"B\"\n",
            &["route #1", "`key` or `key_header`"],
        ),
        (
            "scope = { value = \"s\" }\nscope_header = \"B\"\n",
            &["route #1", "`scope` or `scope_header`"],
        ),
        ("scope = { value = \"\" }\n", &["line 6", "1 to 255"]),
        (
            "scope = { header = \"a\", value = \"b\" }\n",
            &["line 6", "exactly one"],
        ),
        ("fingerprint = \"canonical\"\n", &["line 6", "raw", "json"]),
        (
            "fingerprint_ignore = [\"/a\"]\n",
            &["route #1", "needs fingerprint = \"json\""],
        ),
        ("in_flight = \"wait\"\n", &["line 6", "in_flight = { wait"]),
        (
            "in_flight = { wait = \"0s\" }\n",
            &["route #1", "more than 0"],
        ),
        (
            "in_flight = { wait = \"1h\" }\n",
            &["route #1", "at most 5m"],
        ),
        ("in_flight = { wait = 10 }\n", &["line 6"]),
        (
            "in_flight = { timeout = \"1s\" }\n",
            &["line 6", "unknown field"],
        ),
        ("preset = \"gitlab\"\n", &["line 6", "github"]),
        (
            "errors = \"json\"\n",
            &["line 6", "errors = \"problem\", \"stripe\""],
        ),
        (
            "errors = { template = \"{{nope}}\" }\n",
            &["line 6", "unknown placeholder {{nope}}", "{{detail}}"],
        ),
        (
            "errors = { template = '{\"m\": {{detail}}}' }\n",
            &["line 6", "not JSON once filled in"],
        ),
        (
            "errors = { template = \"x\", content_type = \"plain\" }\n",
            &["line 6", "not a media type"],
        ),
        (
            "errors = { template = \"x\", type = \"text/plain\" }\n",
            &["line 6", "unknown field `type`"],
        ),
        ("preset = \"github\"\nttl = \"1s\"\n", &["route #1", "ttl"]),
    ];
    for (route, needles) in cases {
        let msg = err(&with_route(route));
        for needle in *needles {
            assert!(msg.contains(needle), "{route:?}: {msg:?} lacks {needle:?}");
        }
    }
    let msg = err(&format!("{MINIMAL}[defaults]\npreset = \"github\"\n"));
    assert!(msg.contains("belongs in a [[route]]"), "{msg}");
    let msg = err(&format!(
        "{MINIMAL}[defaults]\nkey = {{ header = \"A\" }}\nkey_header = \"B\"\n"
    ));
    assert!(msg.contains("`key` or `key_header`"), "{msg}");
}

/// Regression: `[defaults] require_key = false` turned a preset's required
/// key off, so deliveries without their id were forwarded unprotected.
/// Presets beat `[defaults]`; a route's own setting beats the preset.
#[test]
fn a_preset_requires_its_key_whatever_defaults_say() {
    let cases: &[(&str, &str, bool)] = &[
        ("", "preset = \"github\"\n", true),
        ("require_key = false\n", "preset = \"github\"\n", true),
        ("require_key = false\n", "preset = \"stripe\"\n", true),
        (
            "require_key = true\n",
            "preset = \"sns\"\nrequire_key = false\n",
            false,
        ),
        (
            "require_key = false\n",
            "preset = \"shopify\"\nrequire_key = true\n",
            true,
        ),
        // No preset: `[defaults]` still decides.
        ("require_key = false\n", "", false),
        ("", "", true),
    ];
    for (defaults, route, want) in cases {
        let (r, shown) = hook_route(defaults, route);
        assert_eq!(r.require_key, *want, "{defaults:?} {route:?}");
        assert!(shown.contains(&format!(" required={want} ")), "{shown}");
    }
}

/// The one route `/hook` under `[defaults]` `defaults`, and what
/// `check-config` shows.
fn hook_route(defaults: &str, route: &str) -> (std::sync::Arc<RouteConfig>, String) {
    let text = format!(
        "{MINIMAL}[defaults]\n{defaults}[[route]]\nmethods = [\"POST\"]\npath = \"/hook\"\n{route}"
    );
    let cfg = parse(&text).unwrap_or_else(|e| panic!("{text}: {e}"));
    let r = cfg.routes.iter().next().unwrap().clone();
    (r, cfg.to_string())
}

/// Regression: a webhook preset stored the upstream's 401 under the
/// delivery id, so the genuine delivery got 422 (or the 401 again) for
/// days. Delivery routes (a preset, or `key = { .. }`) release refusals
/// that executed nothing besides the inherited list; `key_header` routes
/// keep it as it is; a route's own `release_statuses` still wins.
#[test]
fn delivery_routes_release_refusals_that_executed_nothing() {
    const WITH_REFUSALS: &str = "400,401,403,404,408,425,429,5xx";
    let cases: &[(&str, &str, &str)] = &[
        ("", "preset = \"github\"\n", WITH_REFUSALS),
        ("", "preset = \"stripe\"\n", WITH_REFUSALS),
        ("", "preset = \"pub-sub\"\n", WITH_REFUSALS),
        ("", "key = { json = \"/id\" }\n", WITH_REFUSALS),
        ("", "key = { header = \"X-Delivery\" }\n", WITH_REFUSALS),
        ("key = { header = \"X-Delivery\" }\n", "", WITH_REFUSALS),
        // A preset whose key the route moved to a header is still one.
        (
            "",
            "preset = \"sns\"\nkey_header = \"X-Id\"\n",
            WITH_REFUSALS,
        ),
        // Idempotency-Key routes: unchanged.
        ("", "", "408,425,429,5xx"),
        ("", "key_header = \"X-Request-Key\"\n", "408,425,429,5xx"),
        (
            "key = { header = \"X-Delivery\" }\n",
            "key_header = \"X-Request-Key\"\n",
            "408,425,429,5xx",
        ),
        // `[defaults]`' list is the base the refusals join.
        (
            "release_statuses = [\"5xx\"]\n",
            "preset = \"github\"\n",
            "400,401,403,404,5xx",
        ),
        ("release_statuses = [\"5xx\"]\n", "", "5xx"),
        // The route's own list wins.
        (
            "",
            "preset = \"github\"\nrelease_statuses = [\"5xx\"]\n",
            "5xx",
        ),
        (
            "",
            "key = { json = \"/id\" }\nrelease_statuses = []\n",
            "none",
        ),
    ];
    for (defaults, route, want) in cases {
        let (r, shown) = hook_route(defaults, route);
        assert_eq!(
            r.release_statuses.to_string(),
            *want,
            "{defaults:?} {route:?}"
        );
        assert!(shown.contains(&format!(" release={want} ")), "{shown}");
    }
}

#[test]
fn a_relative_store_path_is_read_from_the_config_files_directory() {
    for (path, config_file, opened) in [
        (
            "data/idemgate.db",
            "config/idemgate.toml",
            "config/data/idemgate.db",
        ),
        (
            "data/idemgate.db",
            "/etc/idemgate/idemgate.toml",
            "/etc/idemgate/data/idemgate.db",
        ),
        // A file named without a directory: the working directory is its own.
        ("data/idemgate.db", "idemgate.toml", "data/idemgate.db"),
        (
            "../data/idemgate.db",
            "config/idemgate.toml",
            "config/../data/idemgate.db",
        ),
        (
            "/var/lib/idemgate/idemgate.db",
            "config/idemgate.toml",
            "/var/lib/idemgate/idemgate.db",
        ),
    ] {
        assert_eq!(
            crate::config::store_path_for(
                std::path::Path::new(path),
                std::path::Path::new(config_file)
            ),
            PathBuf::from(opened),
            "{path} in {config_file}"
        );
    }
    // Loading applies it (the default path and an env override alike);
    // parsing text that belongs to no file leaves it as written.
    let file = std::path::Path::new("/nonexistent/dir/idemgate.toml");
    let cfg = Config::parse_file(MINIMAL, file, &Default::default()).unwrap();
    assert_eq!(
        cfg.restart.store.path,
        PathBuf::from("/nonexistent/dir/data/idemgate.db")
    );
    let env = env(&[("IDEMGATE_STORE_PATH", "x.db")]);
    let cfg = Config::parse_file(MINIMAL, file, &env).unwrap();
    assert_eq!(
        cfg.restart.store.path,
        PathBuf::from("/nonexistent/dir/x.db")
    );
    assert_eq!(
        parse(MINIMAL).unwrap().restart.store.path,
        PathBuf::from(DEFAULT_SQLITE_PATH)
    );
}

/// `errors`: the route's own, else `[defaults]`'s, else problem details;
/// `[defaults]`'s also shapes answers outside every route.
#[test]
fn error_shapes_come_from_the_route_then_defaults() {
    use crate::route::errors::{ErrorFields, ErrorShape};
    let text = format!(
        "{MINIMAL}[defaults]\nerrors = \"stripe\"\n\
         [[route]]\nmethods = [\"POST\"]\npath = \"/a\"\n\
         [[route]]\nmethods = [\"POST\"]\npath = \"/b\"\nerrors = \"problem\"\n\
         [[route]]\nmethods = [\"POST\"]\npath = \"/c\"\n\
         errors = {{ template = '{{\"code\":\"{{{{code}}}}\",\"status\":{{{{status}}}}}}', content_type = \"application/vnd.api+json\" }}\n"
    );
    let cfg = parse(&text).unwrap();
    let r: Vec<_> = cfg.routes.iter().collect();
    assert_eq!(r[0].errors, ErrorShape::Stripe);
    assert_eq!(r[1].errors, ErrorShape::Problem);
    let ErrorShape::Template(t) = &r[2].errors else {
        panic!("{:?}", r[2].errors)
    };
    assert_eq!(t.content_type(), "application/vnd.api+json");
    let fields = ErrorFields {
        status: 409,
        code: "in-flight",
        type_uri: "",
        title: "",
        detail: "",
        key_id: None,
        instance: None,
    };
    assert_eq!(t.render(&fields), r#"{"code":"in-flight","status":409}"#);
    assert_eq!(cfg.routes.default_errors(), &ErrorShape::Stripe);
    assert!(cfg
        .to_string()
        .contains("errors=template (application/vnd.api+json)"));
    assert_eq!(
        parse(MINIMAL).unwrap().routes.default_errors(),
        &ErrorShape::Problem
    );
}

/// QUERY (RFC 10008) is a registered method; a route demanding keys for
/// safe methods only is a warning, a routing-only GET route is not.
#[test]
fn query_is_registered_and_safe_only_routes_warn() {
    let cfg = parse(&with_route("").replace("[\"POST\"]", "[\"QUERY\"]")).unwrap();
    let route = cfg.routes.iter().next().unwrap();
    assert_eq!(route.methods[0].as_str(), "QUERY");
    let query = http::Method::from_bytes(b"QUERY").unwrap();
    assert!(!route.key_required(&query), "QUERY never demands a key");
    assert!(route.key_required(&http::Method::POST));
    let warnings = cfg.warnings();
    assert!(
        warnings
            .iter()
            .any(|w| w.contains("route #1 /orders: protects only safe methods (QUERY)")),
        "{warnings:?}"
    );
    let routing =
        parse(&with_route("require_key = false\n").replace("[\"POST\"]", "[\"GET\"]")).unwrap();
    assert!(
        routing
            .warnings()
            .iter()
            .all(|w| !w.contains("safe methods")),
        "{:?}",
        routing.warnings()
    );
    let mixed = parse(&with_route("").replace("[\"POST\"]", "[\"GET\", \"POST\"]")).unwrap();
    assert!(mixed.warnings().iter().all(|w| !w.contains("safe methods")));
}

/// Sentinel from the environment alone: the list as a TOML array, and a
/// password taken as written (a numeric one stays a string, and never
/// meets the TOML parser).
#[test]
fn environment_sets_redis_sentinel_and_its_passwords_as_written() {
    let text = format!("{MINIMAL}[store]\nbackend = \"postgres\"\nurl = \"postgres://db/app\"\n");
    let env = env(&[
        (
            "IDEMGATE_REDIS_SENTINELS",
            "[\"10.0.0.1:26379\", \"10.0.0.2:26379\"]",
        ),
        ("IDEMGATE_REDIS_SENTINEL_MASTER", "mymaster"),
        ("IDEMGATE_REDIS_PASSWORD", "12345"),
        ("IDEMGATE_REDIS_SENTINEL_PASSWORD", "\"quoted"),
    ]);
    let cfg = Config::parse_with_env(&text, "t.toml", &env).unwrap();
    let s = cfg
        .restart
        .redis
        .as_ref()
        .unwrap()
        .sentinel
        .clone()
        .unwrap();
    assert_eq!(s.sentinels.len(), 2);
    assert_eq!(s.master, "mymaster");
    assert_eq!(s.password.as_deref(), Some("12345"));
    assert_eq!(s.sentinel_password.as_deref(), Some("\"quoted"));
    assert!(!cfg.to_string().contains("12345"));
}

#[test]
fn listener_tls_needs_the_certificate_and_its_key_together() {
    let server = |keys: &str| format!("{MINIMAL}{keys}\n");
    for (keys, needle) in [
        (
            "tls_cert_file = \"c.pem\"",
            "server.tls_cert_file needs server.tls_key_file",
        ),
        (
            "tls_key_file = \"k.pem\"",
            "server.tls_key_file needs server.tls_cert_file",
        ),
        (
            "tls_client_ca_file = \"ca.pem\"",
            "server.tls_client_ca_file needs server.tls_cert_file and server.tls_key_file",
        ),
    ] {
        let e = err(&server(keys));
        assert!(e.contains(needle), "{keys}: {e}");
        assert!(e.contains("line 3"), "{keys}: the line is named: {e}");
    }
    let admin = format!("{MINIMAL}[admin]\nlisten = \"127.0.0.1:9\"\ntls_cert_file = \"c.pem\"\n");
    assert!(err(&admin).contains("admin.tls_cert_file needs admin.tls_key_file"));

    // The files are not read at load (a reload must not fail mid-rotation):
    // check_files reads them, naming the setting and the file.
    let both = server("tls_cert_file = \"/nonexistent/c.pem\"\ntls_key_file = \"k.pem\"");
    let cfg = parse(&both).unwrap();
    let tls = cfg.restart.server.tls.as_ref().unwrap();
    assert_eq!(
        (tls.cert.to_str(), tls.client_ca.as_ref()),
        (Some("/nonexistent/c.pem"), None)
    );
    assert!(cfg.restart.admin.is_none());
    let e = cfg.check_files().unwrap_err().to_string();
    assert!(
        e.starts_with("server.tls_cert_file /nonexistent/c.pem: "),
        "{e}"
    );
    assert!(cfg
        .to_string()
        .contains("tls        cert /nonexistent/c.pem key k.pem, no client certificates"));
}

#[test]
fn a_client_cert_scope_needs_a_listener_that_requires_client_certificates() {
    let route =
        "[[route]]\nmethods = [\"POST\"]\npath = \"/orders\"\nscope = { client_cert = true }\n";
    let plain = format!("{MINIMAL}{route}");
    let e = err(&plain);
    assert!(
        e.contains(
            "route #1 /orders: scope = { client_cert = true } needs server.tls_client_ca_file"
        ),
        "{e}"
    );
    let tls = "tls_cert_file = \"c.pem\"\ntls_key_file = \"k.pem\"\n";
    let no_ca = format!("{MINIMAL}{tls}{route}");
    assert!(err(&no_ca).contains("needs server.tls_client_ca_file"));
    let mtls = format!("{MINIMAL}{tls}tls_client_ca_file = \"ca.pem\"\n{route}");
    let cfg = parse(&mtls).unwrap();
    let r = cfg.routes.iter().next().unwrap();
    assert!(r.scope_client_cert && r.scope_headers.is_empty() && r.scope_value.is_none());
    assert_eq!(r.scope_label(), "client_cert");
    // In [defaults] too; `false` and a mix are refused.
    let defaults = format!("{MINIMAL}{tls}tls_client_ca_file = \"ca.pem\"\n[defaults]\nscope = {{ client_cert = true }}\n[[route]]\nmethods = [\"POST\"]\npath = \"/a\"\n");
    assert!(
        parse(&defaults)
            .unwrap()
            .routes
            .iter()
            .next()
            .unwrap()
            .scope_client_cert
    );
    for bad in [
        "{ client_cert = false }",
        "{ client_cert = true, value = \"x\" }",
    ] {
        let text = with_route(&format!("scope = {bad}\n"));
        assert!(err(&text).contains("scope: "), "{bad}: {}", err(&text));
    }
}

/// The book's TLS example (docs/book/src/tls.md) is a working config (the
/// files are read by check-config and serve, not at load).
#[test]
fn the_book_tls_example_parses() {
    let doc = include_str!("../../docs/book/src/tls.md");
    let start = doc
        .find("<!-- tls-example")
        .and_then(|i| {
            doc[i..]
                .find("```toml\n")
                .map(|j| i + j + "```toml\n".len())
        })
        .expect("the TLS example in docs/book/src/tls.md");
    let end = start + doc[start..].find("```").expect("its end");
    let cfg = parse(&doc[start..end]).unwrap();
    let tls = cfg.restart.server.tls.as_ref().expect("server TLS");
    assert!(tls.client_ca.is_some());
    assert!(cfg.routes.iter().next().unwrap().scope_client_cert);
}

/// Every TOML example in the README and the book loads: a whole file as
/// written; a fragment (no `[server]`) on top of a minimal file, with a
/// PostgreSQL store under a `[redis]` that has none (the fast path needs
/// one), and the URLs the example says come from `IDEMGATE_*`. The files
/// are read from the book's directory, so a new chapter is covered as soon
/// as it is written.
#[test]
fn every_toml_example_in_the_docs_loads() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let book = root.join("docs/book/src");
    let mut files = vec![root.join("README.md")];
    for entry in std::fs::read_dir(&book).expect("docs/book/src") {
        let path = entry.expect("a directory entry").path();
        if path.extension().is_some_and(|e| e == "md") {
            files.push(path);
        }
    }
    files.sort();
    let mut loaded = 0;
    for file in &files {
        let name = file.strip_prefix(&root).unwrap().display().to_string();
        let text = std::fs::read_to_string(file).expect("a docs file");
        for (line, block) in toml_blocks(&text) {
            let mut config = String::new();
            if !block.contains("[server]") {
                config.push_str(MINIMAL);
            }
            if block.contains("[redis]") && !block.contains("[store]") {
                config.push_str(
                    "[store]\nbackend = \"postgres\"\nurl = \"postgres://docs@db/docs\"\n",
                );
            }
            config.push_str(&block);
            let mentioned: Vec<(&str, &str)> = [
                ("IDEMGATE_STORE_URL", "postgres://docs@db/docs"),
                ("IDEMGATE_REDIS_URL", "redis://cache:6379"),
            ]
            .into_iter()
            .filter(|(var, _)| block.contains(var))
            .collect();
            if let Err(e) = Config::parse_with_env(&config, &name, &env(&mentioned)) {
                panic!("{name}:{line}: the example does not load: {e}\n{config}");
            }
            loaded += 1;
        }
    }
    // The README and the book had 8 when this test was written.
    assert!(
        loaded >= 8,
        "only {loaded} TOML examples found in {files:?}"
    );
}

/// The fenced ```` ```toml ```` blocks of a Markdown text: the line of each
/// opening fence, and the block with the fence's indentation (a list
/// item's) removed.
fn toml_blocks(text: &str) -> Vec<(usize, String)> {
    let mut blocks = Vec::new();
    let mut open: Option<(usize, usize, String)> = None;
    for (n, line) in text.lines().enumerate() {
        let trimmed = line.trim_start();
        let indent = line.len() - trimmed.len();
        match &mut open {
            None if trimmed == "```toml" => open = Some((n + 1, indent, String::new())),
            Some(_) if trimmed.starts_with("```") => {
                let (at, _, block) = open.take().unwrap();
                blocks.push((at, block));
            }
            Some((_, indent, block)) => {
                block.push_str(line.get(*indent..).unwrap_or("").trim_end());
                block.push('\n');
            }
            None => {}
        }
    }
    blocks
}

/// `replay_check` (issue 21): the route's, else `[defaults]`' (which
/// `"off"` turns off), and what it may not be.
#[test]
fn replay_check_is_resolved_and_its_mistakes_are_named() {
    let text = format!(
        "{MINIMAL}[upstreams.auth]\nurl = \"http://127.0.0.1:4000\"\n\
         [defaults]\nreplay_check = {{ path = \"/v1/session\" }}\nreplay_check_cache = \"30s\"\n\
         [[route]]\nmethods = [\"POST\"]\npath = \"/a\"\n\
         [[route]]\nmethods = [\"POST\"]\npath = \"/b\"\nreplay_check = {{ method = \"POST\", path = \"/check?x=1\", upstream = \"auth\" }}\n\
         [[route]]\nmethods = [\"POST\"]\npath = \"/c\"\nreplay_check = \"off\"\n"
    );
    let cfg = parse(&text).unwrap();
    let checks: Vec<_> = cfg.routes.iter().map(|r| r.replay_check.clone()).collect();
    let a = checks[0].as_ref().unwrap();
    assert_eq!((a.method.as_str(), a.path.as_str()), ("GET", "/v1/session"));
    assert_eq!(
        (a.upstream.as_deref(), a.cache),
        (None, Duration::from_secs(30))
    );
    let b = checks[1].as_ref().unwrap();
    assert_eq!((b.method.as_str(), b.path.as_str()), ("POST", "/check?x=1"));
    assert_eq!(b.upstream.as_deref(), Some("auth"));
    assert_eq!(checks[2], None);
    assert!(
        cfg.to_string().contains("replay_check=GET /v1/session"),
        "check-config shows it"
    );

    let route =
        |extra: &str| format!("{MINIMAL}[[route]]\nmethods = [\"POST\"]\npath = \"/o\"\n{extra}");
    for (extra, needles) in [
        (
            "replay_check = \"on\"\n",
            &["line 6", "replay_check = \"off\""][..],
        ),
        (
            "replay_check = { path = \"v1\" }\n",
            &["line 6", "origin-form"],
        ),
        (
            "replay_check = { path = \"/v1\", methd = \"GET\" }\n",
            &["line 6", "unknown field `methd`"],
        ),
        (
            "replay_check = { path = \"/v1\", upstream = \"nope\" }\n",
            &["line 6", "names no [upstreams.nope]"],
        ),
        (
            "replay_check_cache = \"30s\"\n",
            &["route #1", "needs a `replay_check`"],
        ),
        (
            "replay_check = { path = \"/v1\" }\nreplay_check_cache = \"2h\"\n",
            &["route #1", "longer than 1h"],
        ),
        (
            "replay_check = { path = \"/v1\" }\nscope = { value = \"c\" }\n",
            &["route #1", "cannot carry"],
        ),
    ] {
        let e = err(&route(extra));
        for n in needles {
            assert!(e.contains(n), "{extra}: {n:?} not in {e}");
        }
    }
}

/// `IDEMGATE_STORE_ENCRYPTION_KEYS` is read from the environment alone
/// (never as a `[store]` key), a malformed list is refused naming its
/// entry without the key, and check-config says whether responses are sealed.
#[test]
fn store_encryption_keys_come_from_the_environment_and_name_a_bad_entry() {
    use base64::Engine;
    let good = base64::engine::general_purpose::STANDARD.encode([7u8; 32]);
    let text = format!("{MINIMAL}[[route]]\nmethods = [\"POST\"]\npath = \"/o\"\n");
    let list = format!("k2:{good},k1:{good}x");
    let e = Config::parse_with_env(
        &text,
        "t.toml",
        &env(&[("IDEMGATE_STORE_ENCRYPTION_KEYS", &list)]),
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("entry 2") && e.contains("\"k1\""), "{e}");
    assert!(!e.contains(&good), "no key material: {e}");
    let list = format!("k2:{good}");
    let cfg = Config::parse_with_env(
        &text,
        "t.toml",
        &env(&[("IDEMGATE_STORE_ENCRYPTION_KEYS", &list)]),
    )
    .unwrap();
    assert_eq!(cfg.store_keys.as_ref().unwrap().current_id(), "k2");
    let shown = cfg.to_string();
    assert!(
        shown.contains("sealed at rest (AES-256-GCM) under key \"k2\""),
        "{shown}"
    );
    assert!(!shown.contains(&good));
    assert!(parse(&text)
        .unwrap()
        .to_string()
        .contains("stored in plaintext"));
    // Not a file setting.
    let e = err(&format!(
        "{MINIMAL}[store]\nencryption_keys = \"k:{good}\"\n"
    ));
    assert!(e.contains("unknown field `encryption_keys`"), "{e}");
}

/// `store.plaintext_responses = "refuse"` needs keys to refuse by (an error
/// naming the field and line without them), and check-config says which.
#[test]
fn refusing_plaintext_responses_needs_encryption_keys() {
    use base64::Engine;
    let good = base64::engine::general_purpose::STANDARD.encode([7u8; 32]);
    let text = format!(
        "{MINIMAL}[store]\nplaintext_responses = \"refuse\"\n[[route]]\nmethods = [\"POST\"]\npath = \"/o\"\n"
    );
    let e = err(&text);
    assert!(
        e.contains("store.plaintext_responses") && e.contains("IDEMGATE_STORE_ENCRYPTION_KEYS"),
        "{e}"
    );
    let list = format!("k2:{good}");
    let keys = env(&[("IDEMGATE_STORE_ENCRYPTION_KEYS", &list)]);
    let shown = Config::parse_with_env(&text, "t.toml", &keys)
        .unwrap()
        .to_string();
    assert!(shown.contains("plaintext records refused (410)"), "{shown}");
    let e = err(&format!(
        "{MINIMAL}[store]\nplaintext_responses = \"drop\"\n"
    ));
    assert!(e.contains("plaintext_responses"), "{e}");
}

/// Issue 20: with several PostgreSQL hosts in store.url (a store that
/// fails over), a protected route's lease shorter than FAILOVER_HORIZON is
/// warned about; one host, a lease of a minute or more, or a routing-only
/// route is not.
#[test]
fn a_lease_shorter_than_a_failover_warns_when_store_url_lists_several_hosts() {
    let config = |hosts: &str, lease: &str| {
        let mut text = format!(
            "{MINIMAL}[store]\nbackend = \"postgres\"\nurl = \"postgres://u@{hosts}/app\"\n"
        );
        text.push_str("[[route]]\nmethods = [\"POST\"]\npath = \"/orders\"\n");
        text.push_str(lease);
        text.push_str("[[route]]\nmethods = [\"GET\"]\npath = \"/ws\"\nrequire_key = false\n");
        parse(&text).unwrap().warnings()
    };
    let failover = |w: &Vec<String>| -> Vec<String> {
        w.iter()
            .filter(|w| w.contains("PostgreSQL hosts"))
            .cloned()
            .collect()
    };
    let two = failover(&config("db-a:5432,db-b:5432", ""));
    assert_eq!(two.len(), 1, "{two:?}");
    assert!(
        two[0].starts_with("route #1 /orders: lease (30s) is shorter than 1m")
            && two[0].contains("store.url lists 2 PostgreSQL hosts")
            && two[0].contains("set lease above your failover's duration"),
        "{two:?}"
    );
    assert!(failover(&config("db-a:5432", "")).is_empty());
    let long = "lease = \"90s\"\nttl = \"24h\"\n";
    assert!(failover(&config("db-a:5432,db-b:5432", long)).is_empty());
}
